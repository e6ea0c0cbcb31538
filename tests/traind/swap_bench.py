"""Swap seconds vs bytes moved, per ZeRO stage and location (run: python tests/traind/swap_bench.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from flexmarl.tiny import build_tiny_checkpoint
    from tests.traind.conftest import make_groups
    from tests.traind.test_trainer import step_sizes, trainer_config
    from traind.locations import MemoryStateStore, open_location
    from traind.model import AgentTrainer
    from traind.swap import swap_in, swap_out

    root = Path(tempfile.mkdtemp(prefix="flexmarl-swap-bench-"))
    models = {
        "1.3M": build_tiny_checkpoint(root / "small", seed=0),
        "9.6M": build_tiny_checkpoint(
            root / "medium",
            seed=0,
            num_layers=4,
            hidden_size=512,
            intermediate_size=1024,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
        ),
    }
    memory = MemoryStateStore()
    print("| model params | ZeRO | location | MB moved | swap out s | swap in s |")
    print("|---|---|---|---|---|---|")
    for label, path in models.items():
        for stage in (0, 2, 3):
            for scheme in ("mem", "file"):
                config = trainer_config(path, zero_stage=stage)
                trainer = AgentTrainer(config)
                groups = make_groups(seed=1, tasks=2, group_size=4)
                for group in groups:
                    trainer.accumulate(group)
                trainer.optimizer_step(*step_sizes(groups))
                uri = f"mem://{label}-{stage}" if scheme == "mem" else (root / f"state-{label}-{stage}").as_uri()
                location = open_location(uri, memory=memory)
                out = swap_out(trainer, location)
                trainer, back = swap_in(config, location)
                trainer.release()
                print(
                    f"| {label} | {stage} | {scheme} | {out.bytes_moved / 1e6:.1f} | {out.seconds:.2f} | "
                    f"{back.seconds:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
