"""Cost of exact gradient accumulation (issue 22) vs DeepSpeed's arrival-order accumulation.

Usage: python benchmarks/exact_accumulation.py [--layers 2] [--hidden 256] [--groups 4] [--group-size 8]
       [--response-tokens 64] [--repeats 3]

Builds a tiny random-init checkpoint of the given size (``flexmarl.tiny``), then trains one step of
``--groups`` complete groups, one group per micro-batch, with ``exact_accumulation`` on and off
(fp32, ZeRO 0, on CUDA when available, else CPU), the two trainers' steps interleaved. Reports per
step: seconds of the accumulate calls and of the optimizer step (median over repeats), the extra
resident bytes of the exact sums and the time of one fold (``ExactGradientSum.add`` of one full
gradient) alone. Prints JSON and writes benchmarks/results/exact_accumulation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flexmarl.experience import ExperienceRecord, experience_id, group_id  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402
from traind.accumulation import ExactGradientSum  # noqa: E402
from traind.model import AgentTrainer, AgentTrainerConfig  # noqa: E402


def _groups(groups: int, group_size: int, response_tokens: int, vocab: int) -> list[list[ExperienceRecord]]:
    rng = np.random.default_rng(0)
    out = []
    for task_index in range(groups):
        task = f"bench/0/{task_index}"
        records = []
        for sample in range(group_size):
            records.append(ExperienceRecord(
                experience_id=experience_id(task, sample, "a", 0), job_id="bench", agent="a", task_id=task,
                group_id=group_id(task, "a"), sample_index=sample, episode_id=f"{task}/{sample}", turn=0,
                behavior_version=0, reward=float(rng.integers(0, 2)),
                prompt_token_ids=rng.integers(1, vocab, size=32).astype(np.int32),
                response_token_ids=rng.integers(1, vocab, size=response_tokens).astype(np.int32),
                response_logprobs=(-rng.uniform(3.0, 7.0, size=response_tokens)).astype(np.float32),
                group_size=group_size))
        out.append(records)
    return out


def _step(trainer: AgentTrainer, groups: list[list[ExperienceRecord]]) -> tuple[float, float]:
    started = time.perf_counter()
    for index, group in enumerate(groups):
        trainer.accumulate(group, micro_batch_index=index)
    accumulated = time.perf_counter()
    tokens = sum(r.response_tokens for g in groups for r in g)
    trainer.optimizer_step(tokens, sum(len(g) for g in groups), num_micro_batches=len(groups))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return accumulated - started, time.perf_counter() - accumulated


def main() -> None:
    """Runs the comparison and writes the result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    model_dir = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "model", num_layers=args.layers,
                                      hidden_size=args.hidden, intermediate_size=2 * args.hidden)
    base = AgentTrainerConfig(agent="a", model_path=str(model_dir), lr=1e-3)
    groups = _groups(args.groups, args.group_size, args.response_tokens, vocab=200)
    result: dict[str, Any] = {"args": vars(args), "device": "cuda" if torch.cuda.is_available() else "cpu",
                              "threads": torch.get_num_threads()}
    trainers = {name: AgentTrainer(dataclasses.replace(base, exact_accumulation=name == "exact"))
                for name in ("arrival_order", "exact")}
    try:
        timings: dict[str, list[tuple[float, float]]] = {name: [] for name in trainers}
        for trainer in trainers.values():
            _step(trainer, groups)  # warm-up
        for _ in range(args.repeats):  # interleaved: a machine shared with other work drifts
            for name, trainer in trainers.items():
                timings[name].append(_step(trainer, groups))
        for name, runs in timings.items():
            result[name] = {"accumulate_s": statistics.median(t[0] for t in runs),
                            "optimizer_step_s": statistics.median(t[1] for t in runs)}
        params = [p for p in trainers["exact"].engine.module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        probe = ExactGradientSum(params)
        grads = [torch.randn_like(p) for p in params]
        probe.add(grads)  # allocation
        fold_s = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            probe.add(grads)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            fold_s.append(time.perf_counter() - started)
        result["parameters"] = numel
        result["exact"]["fold_s"] = statistics.median(fold_s)
        result["exact"]["extra_bytes"] = probe.bytes_allocated
        result["exact"]["extra_bytes_per_parameter"] = probe.bytes_allocated / numel
        probe.free()
    finally:
        for trainer in trainers.values():
            trainer.release()
    result["accumulate_slowdown"] = result["exact"]["accumulate_s"] / result["arrival_order"]["accumulate_s"]
    print(json.dumps(result, indent=2))
    out = REPO_ROOT / "benchmarks" / "results" / "exact_accumulation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
