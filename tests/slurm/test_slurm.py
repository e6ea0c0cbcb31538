"""FlexMARL on a real (one-host) Slurm through the shipped sbatch script: a job to SUCCEEDED, a daemon
step SIGKILLed and restarted, and an `scancel` that leaves no process behind.

The launcher (`flexmarl slurm`, flexmarl/slurm.py) lays the cluster over the allocation with each
daemon an `srun --overlap` step; the Slurm is munged + slurmctld + slurmd from Debian's packages
(tests/slurm/slurm_support.py). In CI a missing Slurm fails these tests; elsewhere they skip.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from slurm_support import SlurmCluster, require_slurm

from flexmarl.cluster import free_port

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
SBATCH = REPO_ROOT / "deploy" / "slurm" / "flexmarl.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_slurm()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _job_file(path: Path, name: str, steps: int) -> Path:
    spec = yaml.safe_load((REPO_ROOT / "examples" / "signaling" / "job.yaml").read_text())
    spec.update(name=name, total_steps=steps)
    spec["batch"] = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}
    path.write_text(yaml.safe_dump(spec))
    return path


def _sbatch(slurm: SlurmCluster, job: Path, run_dir: Path) -> tuple[str, Path]:
    out = run_dir.parent / f"{run_dir.name}.out"
    done = slurm.run("sbatch", "--parsable", f"--output={out}", f"--export=ALL,FLEXMARL_PYTHON={sys.executable}",
                     str(SBATCH), str(job), "--run-dir", str(run_dir), "--etcd-port", str(free_port()),
                     "--engine-replicas", "1", cwd=REPO_ROOT)
    return done.stdout.strip().split(";")[0], out


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str, explain: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{explain()}")


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _processes_of(run_dir: Path) -> set[psutil.Process]:
    """Every process whose command line names the run dir, with all their descendants (engines too)."""
    found: set[psutil.Process] = set()
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(proc.info["cmdline"] or ()):
                found.add(proc)
                found.update(proc.children(recursive=True))
        except psutil.Error:
            continue
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_sbatch_runs_the_signaling_job_to_succeeded(slurm: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job_id, out = _sbatch(slurm, _job_file(tmp_path / "job.yaml", "slurm-signaling", 2), run_dir)

    def explain() -> str:
        logs = "\n".join(f"--- {p.name}\n{_text(p)[-2000:]}" for p in sorted(run_dir.glob("*.log")))
        return f"job {job_id}: {slurm.job_state(job_id)}\n--- output\n{_text(out)}\n{logs}"

    _wait(lambda: slurm.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", ""), 300,
          "the Slurm job to end", explain)
    assert slurm.job_state(job_id) in ("COMPLETED", ""), explain()
    output = _text(out)
    assert f"flexmarl slurm: allocation {job_id}, 1 node(s)" in output, explain()
    assert f"control (etcd, orchestratord, stored): {slurm.node} (127.0.0.1)" in output, explain()
    flexmarl_job = output.split("submitted job ", 1)[1].split()[0]
    for agent in ("sender", "receiver"):
        assert f"{flexmarl_job} {agent} step 2/2" in output, explain()
    assert f"{flexmarl_job} succeeded" in output, explain()
    _wait(lambda: not _processes_of(run_dir), 30, "every process of the run dir to end", explain)


def test_a_killed_daemon_step_is_restarted_and_scancel_leaves_no_process(slurm: SlurmCluster,
                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job_id, out = _sbatch(slurm, _job_file(tmp_path / "job.yaml", "slurm-cancel", 200), run_dir)

    def explain() -> str:
        return f"job {job_id}: {slurm.job_state(job_id)}\n--- output\n{_text(out)}"

    _wait(lambda: "step 1/200" in _text(out), 240, "the job's first step", explain)
    (stored,) = [p for p in _processes_of(run_dir)
                 if p.name().startswith("python") and "stored" in p.cmdline()[1:3]]
    os.kill(stored.pid, signal.SIGKILL)
    _wait(lambda: "stored restarted" in _text(out), 60, "the launcher to restart stored's step", explain)
    steps_before = _text(out).count(" step ")
    _wait(lambda: _text(out).count(" step ") > steps_before, 120, "a step after the restart", explain)

    processes = _processes_of(run_dir)
    kinds = {arg for p in processes for arg in p.cmdline()[1:3]}
    assert {"orchestratord", "stored", "rolloutd", "traind"} <= kinds, kinds
    slurm.run("scancel", job_id)
    _wait(lambda: slurm.job_state(job_id) in ("CANCELLED", ""), 60, "the Slurm job to be cancelled", explain)
    def left() -> list[int]:
        return sorted(p.pid for p in processes if _alive(p))

    _wait(lambda: not left(), 30, "every FlexMARL process of the job to end", lambda: f"{explain()}\nleft: {left()}")
    assert not _processes_of(run_dir)
