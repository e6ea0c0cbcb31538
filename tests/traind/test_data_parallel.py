"""One agent on two slots: two gloo ranks as real subprocesses with a TCP rendezvous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from traind.distributed import free_loopback_port
from traind.model import AgentTrainer

from .conftest import make_groups
from .test_trainer import flat_params, step_sizes, trainer_config

STEPS = 2
# Adam eps 1e-4: see test_two_steps_match_plain_torch_full_batch (sign noise at eps 1e-8).
ADAM_EPS = 1e-4
WORKER = Path(__file__).with_name("dp_worker.py")


ZERO_STAGES = (0, 2)


def run_ranks(model_dir: Path, out: Path, zero_stages: tuple[int, ...], timeout_s: float = 240.0) -> None:
    """Two ranks train ``STEPS`` steps at each ZeRO stage in turn; writes ``zero<stage>-rank<r>.pt`` to out."""
    spec = json.dumps(
        {"model": str(model_dir), "zero_stages": list(zero_stages), "steps": STEPS, "out": str(out),
         "adam_eps": ADAM_EPS}
    )
    port = free_loopback_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), spec],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(output)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            pytest.fail(f"rank exited with {proc.returncode}:\n{output[-4000:]}")


@pytest.fixture(scope="module")
def ranks_out(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both ranks' results at every ZeRO stage, from one pair of rank processes."""
    out = tmp_path_factory.mktemp("dp-ranks")
    run_ranks(tiny_model_dir, out, ZERO_STAGES)
    return out


@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_two_ranks_equal_one_process_on_the_union_batch(tiny_model_dir: Path, ranks_out: Path, zero_stage: int) -> None:
    rank0 = torch.load(ranks_out / f"zero{zero_stage}-rank0.pt")
    rank1 = torch.load(ranks_out / f"zero{zero_stage}-rank1.pt")
    assert rank0["world"] == 2
    assert torch.equal(rank0["params"], rank1["params"])  # replicas never diverge

    single = AgentTrainer(trainer_config(tiny_model_dir, zero_stage=zero_stage, adam_eps=ADAM_EPS))
    try:
        norms = []
        for step in range(STEPS):
            groups = make_groups(seed=200 + step, tasks=4, group_size=4)
            for group in groups:
                single.accumulate(group)
            norms.append(single.optimizer_step(*step_sizes(groups)).grad_norm)
        want = flat_params(single.engine.module)
    finally:
        single.release()
    # Gradients were averaged over ranks and rescaled by W/N: the same step as one process.
    assert rank0["norms"] == pytest.approx(norms, rel=1e-5)
    torch.testing.assert_close(rank0["params"], want, rtol=1e-5, atol=1e-6)
