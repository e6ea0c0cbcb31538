"""Seeded chaos on a local cluster: many SIGKILLs of every kind of process during one strict job.

Usage: python -m benchmarks.chaos [--seed 0 1 2] [--faults 12] [--trainer-workers 2] [--steps-per-fault 10]
                                  [--kinds all|sigkill|KIND,...] [--etcd-members 3] [--require-equal]
       python -m benchmarks.chaos --partial [--seed 0] [--faults 3]

Runs tests/chaos/chaos_driver.py: a fault-free reference job, then the same job (same spec and
seed) while a schedule drawn from ``--seed`` SIGKILLs and restarts etcd, stored, orchestratord,
traind, rolloutd and engine replicas, SIGSTOPs a worker or an engine for 15 s (then SIGCONT) and
SIGKILLs one member of a three-member etcd (``--kinds``; every kind once first, then random kinds),
each fault waiting for two new steps of every agent. Several seeds run one after another and end
with a table of one row per seed. Checks completion, exactly-once consumption, that
nothing acknowledged by stored was lost and that every published version's weights load; prints
a table (faults per kind, recovery seconds, re-issued leases, wall time against the fault-free
job) and writes benchmarks/results/chaos.json. Exits 1 when a check failed (figures still written).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from chaos_driver import (  # noqa: E402
    ALL_FAULT_KINDS,
    FAULT_KINDS,
    ChaosConfig,
    ChaosDriver,
    ChaosFailure,
    ChaosResult,
)

from benchmarks.report import Column, percentile, render_table  # noqa: E402

PARTIAL_ENV = "long_signaling:LongSignaling"  # tests/e2e (on sys.path through chaos_driver)
REGISTRY_TTL_ARGS = ["--registry-ttl-s", "3"]

RESULTS = REPO_ROOT / "benchmarks" / "results" / "chaos.json"
PARTIAL_RESULTS = REPO_ROOT / "benchmarks" / "results" / "chaos_partial.json"


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
    for kind in result.kinds:
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


@dataclasses.dataclass
class PartialFault:
    """One SIGKILL of rolloutd at the start of an interruption."""

    index: int
    interruption: str  # the rolloutd log line that triggered it
    mid_pause: bool  # rolloutd had not logged the end of that interruption when it died
    restart_s: float = 0.0
    recovery_s: float = 0.0  # kill -> the job's next commit


def _log_from(path: Path, offset: int) -> str:
    with path.open("rb") as log_file:
        log_file.seek(offset)
        return log_file.read().decode(errors="replace")


def _committed(e2e: Any, job_id: str) -> tuple[int, bool]:
    info = e2e.client.status(job_id)
    return sum(a.version for a in info.agents), info.state.finished


def _partial_fault(e2e: Any, job_id: str, index: int, timeout_s: float) -> PartialFault | None:
    """Waits for rolloutd to start interrupting a replica for the job, SIGKILLs and restarts it."""
    from partial_support import INTERRUPTED, PAUSING

    proc = e2e.cluster.daemon("rolloutd-0")
    offset = proc.log_path.stat().st_size
    deadline = time.monotonic() + timeout_s
    while True:
        text = _log_from(proc.log_path, offset)
        started = [m for m in PAUSING.finditer(text) if m.group(3).startswith(f"{job_id}/")]
        if started:
            break
        if _committed(e2e, job_id)[1]:
            return None  # the job ended before another interruption
        if time.monotonic() > deadline:
            raise TimeoutError(f"no interruption of {job_id} within {timeout_s}s")
        time.sleep(0.005)
    e2e.orphaned_engines.extend(e2e.engine_pids("rolloutd-0"))
    proc.kill()
    killed_at = time.monotonic()
    first = started[0]
    ended = [m for m in INTERRUPTED.finditer(_log_from(proc.log_path, offset))
             if m.group(1, 3, 4) == first.group(1, 3, 4)]
    fault = PartialFault(index, first.group(0), mid_pause=not ended)
    committed_at_kill, _ = _committed(e2e, job_id)
    proc.restart()
    fault.restart_s = round(time.monotonic() - killed_at, 3)
    while True:
        committed, finished = _committed(e2e, job_id)
        if committed > committed_at_kill or finished:
            break
        if time.monotonic() > deadline + 300:
            raise TimeoutError(f"{job_id} committed nothing after fault {index}")
        time.sleep(0.1)
    fault.recovery_s = round(time.monotonic() - killed_at, 3)
    logging.getLogger("benchmarks.chaos").info("partial fault %d: %s (mid pause %s), recovered in %.1fs", index,
                                               fault.interruption, fault.mid_pause, fault.recovery_s)
    return fault


def _partial_checks(e2e: Any, job_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The usual chaos checks of a finished partial-rollout job; raises AssertionError naming what broke."""
    from e2e_support import assert_exactly_once, assert_one_commit_per_step, assert_succeeded, weights_dir
    from partial_support import interruptions, read_records, span_summaries

    from flexmarl.artifacts import checkpoint_tensors

    info = e2e.client.wait(job_id, 900)
    assert_succeeded(e2e, info, spec["total_steps"])
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    agents = [a["name"] for a in spec["agents"]]
    listed = 0
    for agent in agents:
        ids = [r.experience_id for r in e2e.stored_refs(job_id, agent)]
        records = read_records(e2e.cluster.daemon("stored").address, job_id, ids)
        assert [r.experience_id for r in records] == ids, f"{agent}: experiences stored lists do not read back"
        listed += len(ids)
    versions = 0
    for agent in agents:  # traind keeps the latest versions' weights only: the final one of each agent loads
        commits = e2e.commits(job_id, agent)
        assert checkpoint_tensors(weights_dir(commits[max(commits)]["weights_uri"])), f"{agent}: final weights"
        versions += 1
    manifests = {agent: e2e.manifests(job_id, agent) for agent in agents}
    spans = span_summaries(manifests, e2e.cluster.daemon("stored").address, job_id, max_staleness=1)
    logs = [p.log_path for p in e2e.cluster.daemons.values() if p.kind == "rolloutd"]
    return {"experiences_listed": listed, "versions_loaded": versions, "interruptions": interruptions(logs, job_id),
            "spans": {agent: dataclasses.asdict(summary) for agent, summary in spans.items()}}


def partial_main(args: argparse.Namespace) -> int:
    """``--partial``: SIGKILLs rolloutd at the start of interruptions of a partial-rollout job."""
    from e2e_support import running_cluster
    from partial_support import partial_spec

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="flexmarl-chaos-partial-"))
    steps = args.steps or 3 * args.faults + 3
    faults: list[PartialFault] = []
    failure = ""
    checks: dict[str, Any] = {}
    started = time.monotonic()
    job_wall_s = 0.0
    with running_cluster(run_dir / "cluster", run_dir / "models", engine_replicas=1, trainer_workers=1,
                         trainer_slots=1, rolloutd_args=REGISTRY_TTL_ARGS, traind_args=REGISTRY_TTL_ARGS,
                         orchestratord_args=REGISTRY_TTL_ARGS, stored_args=REGISTRY_TTL_ARGS) as e2e:
        spec = partial_spec(e2e.spec(
            seed=args.seed, total_steps=steps, batch={"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8},
            environment={"entrypoint": PARTIAL_ENV, "config": {"num_objects": 4, "long_message_tokens": 96}},
            leases={"rollout_timeout_s": 10, "train_timeout_s": 60},
        ))
        job_id = e2e.client.submit(spec)
        job_started = time.monotonic()
        try:
            for index in range(args.faults):
                fault = _partial_fault(e2e, job_id, index, timeout_s=300)
                if fault is None:
                    break
                faults.append(fault)
            checks = _partial_checks(e2e, job_id, spec)
            if len(faults) < args.faults:
                raise AssertionError(f"only {len(faults)} of {args.faults} faults: the job ended first")
        except Exception as exc:  # a failed check or a timeout is a failed run, still reported
            failure = f"{type(exc).__name__}: {exc}"
        job_wall_s = time.monotonic() - job_started
    mid = sum(f.mid_pause for f in faults)
    rows = ([f.index, "yes" if f.mid_pause else "no", f.restart_s, f.recovery_s, f.interruption[:60]] for f in faults)
    lines = render_table([Column("fault", 5), Column("mid pause", 9), Column("restart s", 10, fmt=".1f"),
                          Column("recovery s", 11, fmt=".1f"), Column("interruption killed", 60, "<")], rows)
    lines += ["", f"job: {steps} steps, {len(faults)} rolloutd SIGKILLs at an interruption's start ({mid} before "
              f"its end was logged), wall {job_wall_s:.1f}s"]
    if checks:
        lines += [f"checks: SUCCEEDED, one commit per step, exactly once, {checks['experiences_listed']} listed "
                  f"experiences read back, {checks['versions_loaded']} agents' final weights load, spans consistent",
                  f"interruptions logged: {checks['interruptions']}; sender spans: {checks['spans'].get('sender')}"]
    if failure:
        lines.append(f"FAILED: {failure.splitlines()[0][:400]}")
    print("\n".join(lines))
    data = {"settings": {"seed": args.seed, "faults": args.faults, "total_steps": steps, "spec": spec},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()},
            "benchmark_wall_s": time.monotonic() - started, "job_wall_s": job_wall_s, "passed": not failure,
            "failure": failure[:4000], "run_dir": str(run_dir), "faults": [dataclasses.asdict(f) for f in faults],
            **checks}
    out: Path = args.out or PARTIAL_RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 1 if failure else 0


def _kinds(text: str) -> tuple[str, ...]:
    """--kinds: ``all``, ``sigkill`` (the SIGKILL kinds only) or a comma list of kinds."""
    if text == "all":
        return ALL_FAULT_KINDS
    if text == "sigkill":
        return FAULT_KINDS
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(ALL_FAULT_KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown fault kinds {unknown}; known: {', '.join(ALL_FAULT_KINDS)}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one or more seeds, run one after another")
    parser.add_argument("--faults", type=int, default=None, help="default 20 (3 with --partial)")
    parser.add_argument("--steps", type=int, default=0, help="total_steps (default: steps-per-fault x faults + 4)")
    parser.add_argument(
        "--steps-per-fault",
        type=int,
        default=10,
        help="a second traind keeps the job going through a traind restart (~15 steps)",
    )
    parser.add_argument("--trainer-workers", type=int, default=2)
    parser.add_argument("--rollout-workers", type=int, default=1)
    parser.add_argument("--kinds", type=_kinds, default=ALL_FAULT_KINDS,
                        help=f"fault kinds: all (default), sigkill, or a comma list of {', '.join(ALL_FAULT_KINDS)}")
    parser.add_argument("--etcd-members", type=int, default=3, choices=(1, 3, 5),
                        help="etcd members (etcd-member faults need 3 or 5)")
    parser.add_argument("--stop-s", type=float, default=15.0, help="how long a sigstop fault freezes its process")
    parser.add_argument("--require-equal", action="store_true",
                        help="fail unless the final parameters equal the fault-free job's (strict runs are bit-equal)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the fault-free reference job")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} ({PARTIAL_RESULTS} with --partial)")
    parser.add_argument("--partial", action="store_true",
                        help="a partial-rollout job; SIGKILL rolloutd when it starts interrupting (default 3 faults)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("aetcd", "grpc", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.partial:
        args.faults = 3 if args.faults is None else args.faults
        args.seed = args.seed[0]
        return partial_main(args)
    args.faults = 20 if args.faults is None else args.faults
    if "etcd-member" in args.kinds and args.etcd_members < 3:
        parser.error("--kinds with etcd-member needs --etcd-members 3 or 5")

    root = args.run_dir or Path(tempfile.mkdtemp(prefix="flexmarl-chaos-"))
    runs: list[dict[str, Any]] = []
    for seed in args.seed:
        runs.append(_run_seed(args, seed, root / f"seed{seed}" if len(args.seed) > 1 else root))
    if len(runs) > 1:
        print(_seed_table(runs))
    out: Path = args.out or RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0 if all(run["passed"] for run in runs) else 1


def _run_seed(args: argparse.Namespace, seed: int, run_dir: Path) -> dict[str, Any]:
    """One chaos run (reference job, chaos job, checks); its figures as JSON-able data."""
    config = ChaosConfig(
        run_dir=run_dir,
        seed=seed,
        faults=args.faults,
        total_steps=args.steps,
        steps_per_fault=args.steps_per_fault,
        trainer_workers=args.trainer_workers,
        rollout_workers=args.rollout_workers,
        baseline=not args.no_baseline,
        require_equal_parameters=args.require_equal,
        kinds=args.kinds,
        etcd_members=args.etcd_members,
        stop_s=args.stop_s,
    )
    driver = ChaosDriver(config)
    failure = ""
    started = time.monotonic()
    load_before = os.getloadavg()
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
    return {
        "settings": {
            "seed": seed,
            "faults": args.faults,
            "kinds": list(args.kinds),
            "etcd_members": args.etcd_members,
            "stop_s": args.stop_s,
            "total_steps": config.steps,
            "trainer_workers": args.trainer_workers,
            "rollout_workers": args.rollout_workers,
            "engine_replicas": config.engine_replicas,
            "baseline": config.baseline,
            "require_equal": args.require_equal,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg()},
        "benchmark_wall_s": time.monotonic() - started,
        "passed": not failure,
        "failure": failure[:4000],
        "run_dir": str(run_dir),
        **result.to_json(),
        "wall_ratio_vs_fault_free": result.job_wall_s / result.baseline_wall_s if result.baseline_wall_s else None,
    }


def _seed_table(runs: list[dict[str, Any]]) -> str:
    """One row per seed: outcome, faults by kind, wall time against the fault-free job, parameter difference."""
    columns = [Column("seed", 4), Column("state", 10, "<"), Column("faults", 6), Column("by kind", 48, "<"),
               Column("chaos s", 8, fmt=".1f"), Column("ratio", 6, fmt=".2f"), Column("re-issued", 9),
               Column("max rel diff", 12, "<"), Column("checks", 7, "<")]
    rows = []
    for run in runs:
        kinds = " ".join(f"{k}:{n}" for k, n in run["faults_by_kind"].items() if n)
        rows.append([run["seed"], run["job_state"] or "-", len(run["faults"]), kinds, run["job_wall_s"],
                     run["wall_ratio_vs_fault_free"] or float("nan"), run["reissued_leases"],
                     f"{run['max_relative_difference']:.3g}", "passed" if run["passed"] else "FAILED"])
    return "\n".join(["", *render_table(columns, rows)])


if __name__ == "__main__":
    sys.exit(main())
