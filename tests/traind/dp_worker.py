"""One data-parallel rank of test_data_parallel (run as a script; env carries the rendezvous)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.traind.conftest import make_groups
    from tests.traind.test_trainer import flat_params, step_sizes, trainer_config
    from traind.distributed import ensure_distributed
    from traind.model import AgentTrainer

    ensure_distributed()
    # One fresh trainer per ZeRO stage, one after the other on the same process group (the
    # processes' start-up, torch and DeepSpeed imports and the rendezvous are paid once).
    for zero_stage in spec["zero_stages"]:
        trainer = AgentTrainer(trainer_config(Path(spec["model"]), zero_stage=zero_stage, adam_eps=spec["adam_eps"]))
        rank, world = trainer.rank, trainer.world_size
        norms = []
        for step in range(spec["steps"]):
            groups = make_groups(seed=200 + step, tasks=4, group_size=4)
            for group in groups[rank::world]:  # this rank's share of the step
                trainer.accumulate(group)
            stats = trainer.optimizer_step(*step_sizes(groups))  # normalisers of the whole step
            norms.append(stats.grad_norm)
        torch.save(
            {"params": flat_params(trainer.engine.module), "norms": norms, "world": world},
            Path(spec["out"]) / f"zero{zero_stage}-rank{rank}.pt",
        )
        trainer.release()


if __name__ == "__main__":
    main()
    # The results are saved and every trainer released: skip the interpreter's teardown of the
    # torch/DeepSpeed module graph (~4 s of CPU per rank, paid while the test waits for both).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
