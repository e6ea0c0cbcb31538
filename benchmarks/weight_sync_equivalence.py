"""Sync == async equivalence with ``rollout.weight_sync: distributed`` (issue 16), on a real local cluster.

Usage: python -m benchmarks.weight_sync_equivalence [--cases signaling-s0 dialogue-s0] [--replicas 2] [--rolloutds 1]

The pairs of tests/e2e/test_equivalence.py (the job in ``sync``, then in ``async`` with
``max_staleness: 0``; their final parameters must be bit-equal) with every version sent to the
engine replicas by the trainer's broadcast (traind's rank 0 announces it, orchestratord streams
the group, rolloutd's replicas join and receive it; the durable copy is still committed). Too
long for CI's budget (two jobs per pair on real daemons), hence a command: it prints, per pair,
the largest |difference| over every tensor (0 = bit-equal) and, from rolloutd's log, how many
versions its replicas received by broadcast, how many it skipped (no replica served the agent
then: the version is loaded from disk when needed) and how many failed; it writes
benchmarks/results/weight_sync_equivalence.json and exits 1 when a pair differs, a version
failed, or no version at all went by broadcast (the test would be vacuous).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

from e2e_support import broadcast_counts, rolloutd_log, running_cluster  # noqa: E402
from test_equivalence import cases, run_pair  # noqa: E402

from benchmarks.equivalence import _compare  # noqa: E402
from benchmarks.report import Column, render_table  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "weight_sync_equivalence.json"
def main(argv: list[str] | None = None) -> int:
    """Runs the pairs; prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cases", nargs="+", default=["signaling-s0", "dialogue-s0"])
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas of each rolloutd")
    parser.add_argument("--rolloutds", type=int, default=1,
                        help="rolloutd workers (2: their replicas of an agent share its group)")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flexmarl-weight-sync-eq-") as tmp:
        models = Path(tmp) / "models"
        with running_cluster(Path(tmp) / "cluster", models, trainer_workers=1, trainer_slots=1,
                             engine_replicas=args.replicas, rollout_workers=args.rolloutds) as e2e:
            matrix = cases(models)
            for name in args.cases:
                spec = matrix[name]
                spec = dict(spec, rollout={**spec.get("rollout", {}), "weight_sync": "distributed"})
                started = time.monotonic()
                sync, async_ = run_pair(e2e, f"{name}-distributed", spec)
                row = _compare(name, spec, sync, async_, time.monotonic() - started)
                log = rolloutd_log(e2e)
                for mode in ("sync", "async"):
                    row[mode] = broadcast_counts(log, f"eq-{name}-distributed-{mode}")
                rows.append(row)
                print(row, flush=True)
    columns = [Column("case", 14, "<"), Column("max |diff|", 11, fmt=".3g"), Column("equal", 6, "<"),
               Column("sync: received/skipped/failed", 30, "<"), Column("async: received/skipped/failed", 31, "<"),
               Column("pair s", 7, fmt=".1f")]

    def counts(c: dict[str, int]) -> str:
        return f"{c['received']} / {c['skipped']} / {c['failed']}"

    print("\n".join(render_table(columns, ([r["case"], r["max_abs_diff"], "yes" if r["equal"] else "NO",
                                            counts(r["sync"]), counts(r["async"]), r["seconds"]] for r in rows))))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    summary = {"replicas": args.replicas, "rolloutds": args.rolloutds, "pairs": rows}
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO_ROOT)}")
    ok = all(r["equal"] and r[m]["failed"] == 0 and r[m]["received"] > 0 for r in rows for m in ("sync", "async"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
