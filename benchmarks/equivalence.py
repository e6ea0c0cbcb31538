"""The whole sync == async matrix: every shape at three seeds, on one slot and on two.

Usage: python -m benchmarks.equivalence [--seeds 0 1 2]

CI (tests/e2e/test_equivalence.py, test_data_parallel_binding.py) runs each shape at one seed;
this runs the matrix: the signaling game (one-token turns), the dialogue (two multi-token turns
per agent, seq-mean with KL and entropy) and the workflow example (three agents, multi-token,
a micro-batch remainder) on a cluster of one traind slot, and the workflow's three agents on a
cluster of two one-slot traind processes, each at every seed, in ``sync`` and then in ``async``
with ``max_staleness: 0``. Prints, per pair, the largest |difference| over every tensor of every
agent (0 means bit-equal) and whether training moved each agent, and writes
benchmarks/results/equivalence.json. Exits 1 when a pair differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

from e2e_support import running_cluster  # noqa: E402
from test_equivalence import cases, run_pair, workflow_spec  # noqa: E402

from benchmarks.report import Column, render_table  # noqa: E402
from flexmarl.artifacts import checkpoint_tensors  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "equivalence.json"


def _compare(name: str, spec: dict[str, Any], sync: dict[str, dict[str, torch.Tensor]],
             async_: dict[str, dict[str, torch.Tensor]], seconds: float) -> dict[str, Any]:
    worst = 0.0
    moved = {}
    for agent, expected in sync.items():
        initial = checkpoint_tensors(Path(next(a["model"] for a in spec["agents"] if a["name"] == agent)))
        for tensor, value in expected.items():
            worst = max(worst, float((async_[agent][tensor] - value).abs().max()))
        moved[agent] = any(not torch.equal(value, initial[t]) for t, value in expected.items() if t in initial)
    return {"case": name, "max_abs_diff": worst, "equal": worst == 0.0, "moved": moved, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flexmarl-equivalence-") as tmp:
        models = Path(tmp) / "models"
        with running_cluster(Path(tmp) / "one-slot", models, trainer_workers=1, trainer_slots=1) as e2e:
            for name, spec in cases(models, tuple(args.seeds)).items():
                started = time.monotonic()
                sync, async_ = run_pair(e2e, name, spec)
                rows.append(_compare(f"1 slot: {name}", spec, sync, async_, time.monotonic() - started))
                print(rows[-1], flush=True)
        with running_cluster(Path(tmp) / "two-slots", models, trainer_workers=2, trainer_slots=1) as e2e:
            for seed in args.seeds:
                spec = workflow_spec(models, seed)
                started = time.monotonic()
                sync, async_ = run_pair(e2e, f"workflow-two-slots-s{seed}", spec)
                rows.append(_compare(f"2 slots: workflow-s{seed}", spec, sync, async_, time.monotonic() - started))
                print(rows[-1], flush=True)
    columns = [Column("case", 28, "<"), Column("max |diff|", 11, fmt=".3g"), Column("equal", 6, "<"),
               Column("agents moved", 30, "<"), Column("pair s", 7, fmt=".1f")]
    table = render_table(columns, ([r["case"], r["max_abs_diff"], "yes" if r["equal"] else "NO",
                                    ", ".join(a for a, m in r["moved"].items() if m), r["seconds"]] for r in rows))
    print("\n".join(table))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"seeds": args.seeds, "pairs": rows}, indent=2))
    print(f"wrote {RESULTS}")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
