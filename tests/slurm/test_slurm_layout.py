"""How `flexmarl slurm` lays roles over an allocation, and what it refuses before starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl.cli import main
from flexmarl.placement import Host, HostRunner
from flexmarl.slurm import Allocation, LayoutRequest, SlurmError, SrunSteps, layout

pytestmark = pytest.mark.timeout(60)

NODES = tuple(Host(f"n{i}", f"10.0.0.{i + 1}") for i in range(4))
RUNNER = HostRunner()


def _alloc(nodes: int, gpus: int = 0) -> Allocation:
    return Allocation("42", NODES[:nodes], gpus)


def test_one_node_shares_every_role() -> None:
    placement = layout(_alloc(1), LayoutRequest(), RUNNER)
    assert placement.control == NODES[0]
    assert placement.trainer == placement.rollout == NODES[:1]


def test_several_nodes_split_trainers_and_rollouts_disjointly() -> None:
    placement = layout(_alloc(4), LayoutRequest(), RUNNER)
    assert placement.control == NODES[0]
    assert placement.trainer == NODES[:2] and placement.rollout == NODES[2:]
    placement = layout(_alloc(3, gpus=8), LayoutRequest(trainer_nodes=1, control_node="n2", gpus_per_node=8), RUNNER)
    assert placement.control == NODES[2]
    assert placement.trainer == NODES[:1] and placement.rollout == NODES[1:3]
    assert placement.gpus_per_worker == 8


@pytest.mark.parametrize(("nodes", "gpus", "request_", "message"), [
    (2, 0, LayoutRequest(trainer_nodes=2, rollout_nodes=1),
     "the allocation has 2 nodes; 2 trainer + 1 rollout nodes need 3 (sbatch --nodes)"),
    (1, 0, LayoutRequest(trainer_nodes=2),
     "the allocation has 1 node; 2 trainer + 1 rollout nodes need 3 (sbatch --nodes)"),
    (2, 4, LayoutRequest(gpus_per_node=8),
     "--gpus-per-node 8: the allocation has 4 GPUs per node (SLURM_GPUS_ON_NODE; ask sbatch for --gres=gpu:N)"),
    (1, 8, LayoutRequest(gpus_per_node=8), "--gpus-per-node 8: rolloutd and traind would share the one node's GPUs; "
                                          "allocate at least 2 nodes (sbatch --nodes 2)"),
    (2, 0, LayoutRequest(control_node="login1"), "--control-node login1: not a node of the allocation (n0, n1)"),
])
def test_a_layout_the_allocation_cannot_hold_is_refused_in_one_line(nodes: int, gpus: int, request_: LayoutRequest,
                                                                    message: str) -> None:
    with pytest.raises(SlurmError) as caught:
        layout(_alloc(nodes, gpus), request_, RUNNER)
    assert str(caught.value) == message


def test_each_process_is_a_foreground_srun_step_on_its_node() -> None:
    argv = SrunSteps().wrap(NODES[1], ["python", "-m", "traind"], name="traind-0", gpus=2)
    assert argv == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--job-name=flexmarl-traind-0",
                    "--kill-on-bad-exit=0", "--quiet", "--export=ALL", "--gres=gpu:2", "python", "-m", "traind"]
    assert "--gres" not in " ".join(SrunSteps().wrap(NODES[0], ["etcd"], name="etcd"))


def test_outside_an_allocation_the_launcher_says_so_and_starts_nothing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "run"
    assert main(["slurm", "examples/signaling/job.yaml", "--run-dir", str(run_dir)]) == 2
    assert capsys.readouterr().err.strip() == (
        "flexmarl slurm: not inside a Slurm allocation (no SLURM_JOB_ID / SLURM_JOB_NODELIST): run it from an "
        "sbatch script (deploy/slurm/flexmarl.sbatch) or an salloc shell")
    assert not run_dir.exists()
