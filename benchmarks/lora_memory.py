"""Trainer memory per agent: LoRA adapters over one shared base vs full-model agents (issue 17).

Usage: python benchmarks/lora_memory.py [--layers 4] [--hidden 512] [--rank 8]
       [--targets q_proj,k_proj,v_proj,o_proj] [--agents 8]

Builds a tiny random-init checkpoint of the given size (``flexmarl.tiny``), then one full-model
agent and one LoRA agent over it (fp32, ZeRO 0, exact accumulation, on CUDA when available, else
CPU), trains each one step, and reports per agent: the parameters that train and their bytes,
the optimizer (Adam) state bytes, the exact-accumulation sums' bytes, and the bytes one swap moves
(``swap_out`` to ``mem://``). From these, the trainer memory of ``--agents`` agents (resident or
swapped to ``mem://``): N full models (each its weights + optimizer + sums) vs one base + N
adapters (each its adapter + optimizer + sums), and what a switch between two agents moves. Measured by
counting tensor bytes (not the process's RSS, which a shared machine makes noisy). Prints a table
and writes benchmarks/results/lora_memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flexmarl.experience import ExperienceRecord, experience_id, group_id  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402
from traind.locations import MemoryStateStore, open_location  # noqa: E402
from traind.lora import LoraBaseCache, LoraSettings, optimizer_state_bytes, trainable_bytes  # noqa: E402
from traind.model import AgentTrainer, AgentTrainerConfig  # noqa: E402
from traind.swap import swap_out  # noqa: E402


def _group(agent: str, group_size: int = 4, tokens: int = 16, vocab: int = 200) -> list[ExperienceRecord]:
    rng = np.random.default_rng(0)
    task = "bench/0/0"
    return [ExperienceRecord(
        experience_id=experience_id(task, sample, agent, 0), job_id="bench", agent=agent, task_id=task,
        group_id=group_id(task, agent), sample_index=sample, episode_id=f"{task}/{sample}", turn=0,
        behavior_version=0, reward=float(sample % 2), prompt_token_ids=rng.integers(1, vocab, 16).astype(np.int32),
        response_token_ids=rng.integers(1, vocab, tokens).astype(np.int32),
        response_logprobs=(-rng.uniform(3.0, 7.0, tokens)).astype(np.float32), group_size=group_size)
        for sample in range(group_size)]


def _measure(config: AgentTrainerConfig, bases: LoraBaseCache) -> dict[str, int]:
    trainer = AgentTrainer(config, lora_bases=bases)
    group = _group(config.agent)
    trainer.accumulate(group)
    exact = trainer._exact_sum  # noqa: SLF001 - the benchmark reads what the step allocated
    exact_bytes = exact.bytes_allocated if exact is not None else 0
    trainer.optimizer_step(sum(r.response_tokens for r in group), len(group))
    module = trainer.engine.module
    row = {
        "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "trainable_bytes": trainable_bytes(module),
        "optimizer_bytes": optimizer_state_bytes(trainer.engine.basic_optimizer),
        "exact_sum_bytes": exact_bytes,
        "module_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
    }
    row["swap_bytes"] = swap_out(trainer, open_location(f"mem://bench/{config.agent}", memory=MemoryStateStore())
                                 ).bytes_moved
    row["resident_bytes"] = row["trainable_bytes"] + row["optimizer_bytes"] + row["exact_sum_bytes"]
    return row


def main() -> None:
    """Measures both kinds of agent and writes the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--agents", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    model_dir = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model", num_layers=args.layers,
                                      hidden_size=args.hidden, num_heads=max(1, args.hidden // 64),
                                      num_kv_heads=max(1, args.hidden // 128), intermediate_size=2 * args.hidden)
    full = AgentTrainerConfig(agent="full", model_path=str(model_dir), lr=1e-3)
    adapter = dataclasses.replace(full, agent="adapter", lora=LoraSettings(
        rank=args.rank, alpha=2 * args.rank, dropout=0.0, target_modules=tuple(args.targets.split(","))))
    bases = LoraBaseCache()
    rows = {"full": _measure(full, bases), "lora": _measure(adapter, bases)}
    base_bytes = rows["lora"]["module_bytes"] - rows["lora"]["trainable_bytes"]
    n = args.agents
    slot = {
        "full_models_bytes": n * (rows["full"]["module_bytes"] + rows["full"]["optimizer_bytes"]
                                  + rows["full"]["exact_sum_bytes"]),
        "shared_base_bytes": base_bytes + n * rows["lora"]["resident_bytes"],
    }
    slot["ratio"] = slot["full_models_bytes"] / slot["shared_base_bytes"]
    full_row, lora_row = rows["full"], rows["lora"]
    result: dict[str, Any] = {"args": vars(args), "device": "cuda" if torch.cuda.is_available() else "cpu",
                              "base_bytes": base_bytes, "agents": rows, "slot_of_n_agents": slot,
                              "per_agent_resident_ratio": full_row["resident_bytes"] / lora_row["resident_bytes"],
                              "swap_ratio": full_row["swap_bytes"] / lora_row["swap_bytes"]}
    mib = 1 << 20
    print(f"{'agent':8} {'trainable':>12} {'train MiB':>10} {'optim MiB':>10} {'exact MiB':>10} {'swap MiB':>10}")
    for name, row in rows.items():
        print(f"{name:8} {row['trainable_parameters']:>12,} {row['trainable_bytes'] / mib:>10.3f} "
              f"{row['optimizer_bytes'] / mib:>10.3f} {row['exact_sum_bytes'] / mib:>10.3f} "
              f"{row['swap_bytes'] / mib:>10.3f}")
    print(f"trainer memory of {n} agents: {slot['full_models_bytes'] / mib:.1f} MiB as full models, "
          f"{slot['shared_base_bytes'] / mib:.1f} MiB as LoRA over one base ({slot['ratio']:.1f}x less); "
          f"a switch moves {result['swap_ratio']:.0f}x fewer bytes")
    out = REPO_ROOT / "benchmarks" / "results" / "lora_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
