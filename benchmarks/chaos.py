"""Seeded chaos on a local cluster: many SIGKILLs of every kind of process during one strict job.

Usage: python -m benchmarks.chaos [--seed 0] [--faults 20] [--trainer-workers 2] [--steps-per-fault 10]

Runs tests/chaos/chaos_driver.py: a fault-free reference job, then the same job (same spec and
seed) while a schedule drawn from ``--seed`` SIGKILLs and restarts etcd, stored, orchestratord,
traind, rolloutd and engine replicas (every kind once first, then random kinds), each fault
waiting for two new steps of every agent. Checks completion, exactly-once consumption, that
nothing acknowledged by stored was lost and that every published version's weights load; prints
a table (faults per kind, recovery seconds, re-issued leases, wall time against the fault-free
job) and writes benchmarks/results/chaos.json. Exits 1 when a check failed (figures still written).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "chaos"))

from chaos_driver import FAULT_KINDS, ChaosConfig, ChaosDriver, ChaosFailure, ChaosResult  # noqa: E402

from benchmarks.report import Column, percentile, render_table  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "chaos.json"


def _table(result: ChaosResult, failure: str) -> str:
    faults = [
        Column("fault", 5),
        Column("kind", 14, "<"),
        Column("target", 14, "<"),
        Column("at version", 10),
        Column("restart s", 10, fmt=".1f"),
        Column("recovery s", 11, fmt=".1f"),
    ]
    lines = render_table(
        faults, ([f.index, f.kind, f.target, f.version_at_kill, f.restart_s, f.recovery_s] for f in result.faults)
    )
    lines.append("")
    kinds = [Column("kind", 14, "<"), Column("faults", 6), Column("recovery p50 s", 15), Column("max s", 7)]
    rows = []
    for kind in FAULT_KINDS:
        times = [f.recovery_s for f in result.faults if f.kind == kind]
        p50 = f"{percentile(times, 50):.1f}" if times else "-"
        top = f"{max(times):.1f}" if times else "-"
        rows.append([kind, len(times), p50, top])
    lines += render_table(kinds, rows)
    ratio = result.job_wall_s / result.baseline_wall_s if result.baseline_wall_s else float("nan")
    lines += [
        "",
        f"job: {result.job_state} after {len(result.faults)}/{result.faults_planned} faults, "
        f"{result.total_steps} steps",
        f"wall: chaos job {result.job_wall_s:.1f}s, fault-free job {result.baseline_wall_s:.1f}s (x{ratio:.2f})",
        f"task leases: {result.tasks_leased} for {result.tasks} tasks = {result.reissued_leases} re-issued "
        f"({result.reissued_log_lines} 're-issuing task' log lines)",
        f"exactly once: {result.experiences_consumed} experiences, each in one committed manifest and consumed once",
        f"stored probe: {result.probe_experiences_acked} experiences and {result.probe_blobs_acked} blobs "
        f"acknowledged, all read back ({result.probe_errors} failed writes during outages)",
        f"weights: {result.versions_loaded} published versions loaded",
        f"parameters vs fault-free: max relative difference {result.max_relative_difference:.3g}; rollouts first "
        f"differ at batch {result.first_differing_batch} (max |dlogprob| {result.first_difference_logprob:.3g})",
        f"checks: {result.checks}" + (f"\nFAILED: {failure.splitlines()[0]}" if failure else ""),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--steps", type=int, default=0, help="total_steps (default: steps-per-fault x faults + 4)")
    parser.add_argument(
        "--steps-per-fault",
        type=int,
        default=10,
        help="a second traind keeps the job going through a traind restart (~15 steps)",
    )
    parser.add_argument("--trainer-workers", type=int, default=2)
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free reference job")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aetcd", "grpc", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="flexmarl-chaos-"))
    config = ChaosConfig(
        run_dir=run_dir,
        seed=args.seed,
        faults=args.faults,
        total_steps=args.steps,
        steps_per_fault=args.steps_per_fault,
        trainer_workers=args.trainer_workers,
        rollout_workers=args.rollout_workers,
        baseline=not args.no_baseline,
    )
    driver = ChaosDriver(config)
    failure = ""
    started = time.monotonic()
    try:
        with driver.running():
            driver.run()
            driver.check_outcome()
    except ChaosFailure as exc:
        failure = str(exc)
    except Exception as exc:  # a timeout or a daemon that did not come back is a failed run, still reported
        failure = f"{type(exc).__name__}: {exc}"
    result = driver.result
    print(_table(result, failure))
    data: dict[str, Any] = {
        "settings": {
            "seed": args.seed,
            "faults": args.faults,
            "total_steps": config.steps,
            "trainer_workers": args.trainer_workers,
            "rollout_workers": args.rollout_workers,
            "engine_replicas": config.engine_replicas,
            "baseline": config.baseline,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
        "benchmark_wall_s": time.monotonic() - started,
        "passed": not failure,
        "failure": failure[:4000],
        "run_dir": str(run_dir),
        **result.to_json(),
        "wall_ratio_vs_fault_free": result.job_wall_s / result.baseline_wall_s if result.baseline_wall_s else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
