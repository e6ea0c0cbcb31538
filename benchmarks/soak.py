"""Soak: a long synthetic job through real etcd, orchestratord and stored; what grows with each step.

Usage: python -m benchmarks.soak [--steps 10000] [--every 500] [--agents 4] [--out benchmarks/results/soak.json]
[--history-page-steps 500] [--defrag-check-s 60] [--defrag-min-free-mib 4]

Starts etcd (with the auto-compaction settings of deploy/config/etcd.env's soak comment, given as
ETCD_* variables: ``--etcd-compaction-retention 0`` turns it off), a real stored and a real
orchestratord, and drives one job of ``--agents`` agents for ``--steps`` committed steps with the
simulated rollout tasks and trainer slots of ``benchmarks/fake_workers.py`` (no model is loaded).
Every ``--every`` steps (the lowest agent's version) it records orchestratord's and stored's RSS,
etcd's database size (``etcd_mvcc_db_total_size_in_bytes`` and ``..._in_use_in_bytes`` from its
/metrics) and the job's etcd keys, the size of stored's files, and the median latency of a status call (GetJob) and a
history call (GetJobHistory's page of the latest 100 steps; the history is paged by step).

orchestratord runs with its history archive (``--history-page-steps``: pages of per-step history move
from etcd to stored) and its etcd defragmentation check (``--defrag-*``); at the end the whole history
is read page by page. Prints a table and the growth per committed step after warm-up (a least-squares slope over the
samples from ``--warmup-steps`` on), writes JSON (``--out``) and a PNG of the curves (``--png``).
The load average of the machine is printed with it: the daemons share the cores with the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* is found from the repo root
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from benchmarks.fake_workers import (  # noqa: E402
    Cluster,
    Recorder,
    RssSampler,
    control_plane,
    job_spec,
    rollout_worker,
    trainer_slot,
)
from benchmarks.report import Column, render_table  # noqa: E402
from flexmarl.cluster import EtcdServer  # noqa: E402
from flexmarl.registry import Registry  # noqa: E402
from flexmarl.v1 import orchestrator_pb2  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "soak.json"
PNG = REPO_ROOT / "docs" / "images" / "soak.png"
AGENT_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
#: Steps of the history page the soak reads at each sample (the latest ones).
HISTORY_WINDOW = 100
#: Targets of issue 36: after warm-up, each daemon's RSS grows less than this per committed step.
TARGET_GROWTH_KIB_PER_STEP = 1.0
_DB_SIZE = re.compile(r"^(etcd_mvcc_db_total_size_in_bytes|etcd_mvcc_db_total_size_in_use_in_bytes) (\S+)$", re.M)


def etcd_db_bytes(etcd: EtcdServer) -> dict[str, int]:
    """etcd's database file size and the part of it in use, from its /metrics."""
    with urllib.request.urlopen(f"http://{etcd.endpoint}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = {name: int(float(value)) for name, value in _DB_SIZE.findall(text)}
    return {"db_bytes": found.get("etcd_mvcc_db_total_size_in_bytes", 0),
            "db_in_use_bytes": found.get("etcd_mvcc_db_total_size_in_use_in_bytes", 0)}


def file_sizes(root: Path) -> dict[str, int]:
    """Bytes of every file under ``root`` (stored's database, its WAL and blobs), by relative path."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = path.stat().st_size
    return out


async def median_ms(call: Any, request: Any, repeats: int) -> float:
    """Median latency of ``repeats`` calls, in ms."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        await call(request, timeout=60)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


class Soak:
    """Drives the job and samples the daemons every ``every`` committed steps."""

    def __init__(self, cluster: Cluster, etcd: EtcdServer, data_dir: Path, pids: dict[str, int],
                 args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.etcd = etcd
        self.data_dir = data_dir
        self.sampler = RssSampler(pids)
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.start_s = time.monotonic()

    async def sample(self, job_id: str, step: int) -> dict[str, Any]:
        """One row: RSS, etcd db, stored files, status and history latency at ``step``."""
        orch = self.cluster.orch[0]
        rss = {name: self.sampler.rss(name) for name in ("orchestratord", "stored")}  # before this row's calls
        request = orchestrator_pb2.GetJobRequest(job_id=job_id)
        status_ms = await median_ms(orch.GetJob, request, 5)
        # The latest page of HISTORY_WINDOW steps, as a dashboard polls it (GetJobHistory is paged by step).
        page = orchestrator_pb2.GetJobHistoryRequest(job_id=job_id, from_step=max(0, step - HISTORY_WINDOW),
                                                     max_steps=HISTORY_WINDOW)
        history_ms = await median_ms(orch.GetJobHistory, page, 3)
        history = await orch.GetJobHistory(page, timeout=60)
        files = file_sizes(self.data_dir)
        keys = await self.etcd_job_keys(job_id)
        row = {"step": step, "wall_s": time.monotonic() - self.start_s,
               "orchestratord_rss_bytes": rss["orchestratord"], "stored_rss_bytes": rss["stored"],
               **etcd_db_bytes(self.etcd),
               "stored_files_bytes": sum(files.values()), "stored_files": files,
               "status_ms": status_ms, "history_ms": history_ms, "history_records": len(history.steps),
               "etcd_job_keys": keys,
               "load_avg_1m": os.getloadavg()[0]}
        self.rows.append(row)
        print(_row_line(row), flush=True)
        return row

    async def etcd_job_keys(self, job_id: str) -> int:
        """How many keys the job holds in etcd (keys only)."""
        registry = Registry(self.etcd.endpoint)
        await registry.connect()
        try:
            return len(await registry.list_keys(registry.key("jobs", job_id) + "/"))
        finally:
            await registry.close()

    async def whole_history(self, job_id: str) -> int:
        """Reads the job's whole history page by page (archived pages from stored): how many records."""
        orch, records, from_step = self.cluster.orch[0], 0, 0
        while True:
            page = await orch.GetJobHistory(orchestrator_pb2.GetJobHistoryRequest(
                job_id=job_id, from_step=from_step, max_steps=1000), timeout=60)
            records += len(page.steps)
            if not page.more:
                return records
            from_step = page.next_from_step

    async def run(self) -> dict[str, Any]:
        """Submits the job, drives it to the end (or the time limit) and samples along the way."""
        args = self.args
        orch = self.cluster.orch[0]
        agents = AGENT_NAMES[:args.agents]
        spec = job_spec("soak", args.prompts_per_step, args.group_size, args.steps, args.max_staleness,
                        agents=agents, lease_timeout_s=args.lease_timeout_s)
        job_id = (await orch.SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=spec, job_id="soak"),
                                       timeout=10)).job_id
        rec = Recorder()
        stop, done = asyncio.Event(), asyncio.Event()
        commits: list[float] = []
        print(_HEADER, flush=True)
        await self.sample(job_id, 0)
        workers = [asyncio.create_task(rollout_worker(i, self.cluster, rec, stop, done, args.response_tokens,
                                                      args.rollout_workers)) for i in range(args.rollout_workers)]
        workers += [asyncio.create_task(trainer_slot(i, self.cluster, rec, stop, done, commits))
                    for i in range(len(agents))]
        deadline = time.monotonic() + args.time_limit_s
        state = "TIMED_OUT"
        next_sample = args.every
        while time.monotonic() < deadline:
            status = await orch.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=30)
            step = min((a.version for a in status.agents), default=0)
            if step >= next_sample or (status.state != orchestrator_pb2.JOB_STATE_RUNNING and
                                       self.rows[-1]["step"] != step):
                await self.sample(job_id, step)
                next_sample = (step // args.every + 1) * args.every
            if status.state != orchestrator_pb2.JOB_STATE_RUNNING:
                state = str(orchestrator_pb2.JobState.Name(status.state))
                break
            await asyncio.sleep(0.2)
        done.set()
        stop.set()
        await asyncio.gather(*workers)
        wall_s = time.monotonic() - self.start_s
        errors = {rpc: dict(codes) for rpc, codes in rec.errors.items() if codes}
        history_records = await self.whole_history(job_id)
        print(f"whole history: {history_records} records for {len(commits)} agent commits", flush=True)
        return {"job_state": state, "wall_s": wall_s, "committed_steps": self.rows[-1]["step"],
                "whole_history_records": history_records,
                "agent_commits": len(commits), "steps_per_s": self.rows[-1]["step"] / max(wall_s, 1e-9),
                "rpc_errors": errors, "rows": self.rows}


def slope_per_step(rows: Sequence[dict[str, Any]], key: str, warmup_steps: int) -> float | None:
    """Least-squares growth of ``key`` per committed step over the rows from ``warmup_steps`` on."""
    points = [(r["step"], r[key]) for r in rows if r["step"] >= warmup_steps]
    if len(points) < 2 or points[-1][0] == points[0][0]:
        return None
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    return float(np.polyfit(x, y, 1)[0])


def growth(rows: Sequence[dict[str, Any]], warmup_steps: int) -> dict[str, float | None]:
    """Per-step growth after warm-up: bytes for sizes, ms for latencies."""
    keys = ("orchestratord_rss_bytes", "stored_rss_bytes", "db_bytes", "db_in_use_bytes", "stored_files_bytes",
            "status_ms", "history_ms")
    return {key: slope_per_step(rows, key, warmup_steps) for key in keys}


COLUMNS = [
    Column("step", 7),
    Column("wall s", 8, fmt=".0f"),
    Column("orch RSS MiB", 13, fmt=".1f"),
    Column("stored RSS MiB", 15, fmt=".1f"),
    Column("etcd db MiB", 12, fmt=".2f"),
    Column("etcd in use MiB", 16, fmt=".2f"),
    Column("etcd keys", 10),
    Column("stored files MiB", 17, fmt=".2f"),
    Column("status ms", 10, fmt=".2f"),
    Column("history ms", 11, fmt=".1f"),
    Column("load 1m", 8, fmt=".2f"),
]
_HEADER = render_table(COLUMNS, [])[0]


def _cells(row: dict[str, Any]) -> list[object]:
    mib = 2**20
    return [row["step"], row["wall_s"], row["orchestratord_rss_bytes"] / mib, row["stored_rss_bytes"] / mib,
            row["db_bytes"] / mib, row["db_in_use_bytes"] / mib, row.get("etcd_job_keys", 0),
            row["stored_files_bytes"] / mib,
            row["status_ms"], row["history_ms"], row["load_avg_1m"]]


def _row_line(row: dict[str, Any]) -> str:
    return render_table(COLUMNS, [_cells(row)])[-1]


def print_report(report: dict[str, Any]) -> None:
    """The table of every sample, then the growth per step after warm-up."""
    print("\n".join(render_table(COLUMNS, [_cells(r) for r in report["rows"]])))
    m = report["machine"]
    print(f"job {report['job_state']}: {report['committed_steps']} steps x {report['settings']['agents']} agents in "
          f"{report['wall_s']:.0f} s ({report['steps_per_s']:.2f} steps/s); {m['cpus']} CPUs, load average "
          f"{m['load_avg_at_start'][0]:.2f} at start, {m['load_avg_at_end'][0]:.2f} at end")
    g = report["growth_per_step"]
    print(f"growth per committed step after step {report['warmup_steps']} (least squares):")
    for key, value in g.items():
        if value is None:
            print(f"  {key}: n/a (too few samples after warm-up)")
        elif key.endswith("_ms"):
            print(f"  {key}: {value * 1000:+.3f} ms per 1,000 steps")
        else:
            print(f"  {key}: {value / 1024:+.3f} KiB")
    for name, met in report["targets"].items():
        print(f"  target {name}: {'met' if met else 'MISSED'}")
    if report["rpc_errors"]:
        print(f"RPC errors: {report['rpc_errors']}")


def plot(report: dict[str, Any], path: Path) -> None:
    """Three panels over committed steps: RSS, etcd and stored sizes, latencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    steps = [r["step"] for r in rows]
    mib = 2**20
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [
        ("RSS (MiB)", {"orchestratord": [r["orchestratord_rss_bytes"] / mib for r in rows],
                       "stored": [r["stored_rss_bytes"] / mib for r in rows]}),
        ("size (MiB)", {"etcd db": [r["db_bytes"] / mib for r in rows],
                        "etcd db in use": [r["db_in_use_bytes"] / mib for r in rows],
                        "stored files": [r["stored_files_bytes"] / mib for r in rows]}),
        ("median latency (ms)", {"status (GetJob)": [r["status_ms"] for r in rows],
                                 "history (GetJobHistory)": [r["history_ms"] for r in rows]}),
    ]
    for ax, (ylabel, series) in zip(axes, panels, strict=True):
        for label, values in series.items():
            ax.plot(steps, values, marker="o", label=label)
        ax.set_xlabel("committed steps")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(f"soak: {report['settings']['agents']} agents, {report['committed_steps']} steps "
                 f"({report['label']})" if report["label"] else
                 f"soak: {report['settings']['agents']} agents, {report['committed_steps']} steps")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000, help="committed steps of the job (every agent)")
    parser.add_argument("--every", type=int, default=500, help="sample every this many committed steps")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="growth is measured from this step on (default: a tenth of --steps, at least --every)")
    parser.add_argument("--agents", type=int, default=4, choices=range(1, len(AGENT_NAMES) + 1))
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--response-tokens", type=int, default=8)
    parser.add_argument("--rollout-workers", type=int, default=4, help="concurrent simulated rollout tasks")
    parser.add_argument("--lease-timeout-s", type=float, default=30.0,
                        help="the job's rollout and train lease timeouts")
    parser.add_argument("--etcd-compaction-retention", type=int, default=10_000,
                        help="etcd --auto-compaction-mode revision --auto-compaction-retention N (0: off)")
    parser.add_argument("--history-page-steps", type=int, default=500,
                        help="orchestratord --history-page-steps: history pages moved from etcd to stored")
    parser.add_argument("--defrag-check-s", type=float, default=60.0,
                        help="orchestratord --etcd-defrag-check-s (0: no defragmentation)")
    parser.add_argument("--defrag-min-free-mib", type=float, default=4.0,
                        help="orchestratord --etcd-defrag-min-free-mib")
    parser.add_argument("--defrag-min-interval-s", type=float, default=120.0,
                        help="orchestratord --etcd-defrag-min-interval-s")
    parser.add_argument("--time-limit-s", type=float, default=3600.0, help="stop driving after this long")
    parser.add_argument("--label", default="", help="a note in the JSON and the PNG's title (before/after)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--png", type=Path, default=None, help="the curves (default: beside --out, .png)")
    args = parser.parse_args(argv)
    if args.every < 1 or args.steps < 1:
        parser.error("--steps and --every must be >= 1")
    if args.warmup_steps is None:
        args.warmup_steps = max(args.every, args.steps // 10)
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    return args


def etcd_compaction_env(retention: int) -> dict[str, str]:
    """The ETCD_* variables of etcd's revision auto-compaction (etcd reads its flags from them too)."""
    if retention <= 0:
        return {"ETCD_AUTO_COMPACTION_RETENTION": "0"}  # off (EtcdServer turns it on by default)
    return {"ETCD_AUTO_COMPACTION_MODE": "revision", "ETCD_AUTO_COMPACTION_RETENTION": str(retention)}


def orchestratord_args(args: argparse.Namespace) -> list[str]:
    """orchestratord's history archive and etcd defragmentation settings for the run."""
    return ["--history-page-steps", str(args.history_page_steps), "--etcd-defrag-check-s", str(args.defrag_check_s),
            "--etcd-defrag-min-free-mib", str(args.defrag_min_free_mib),
            "--etcd-defrag-min-interval-s", str(args.defrag_min_interval_s)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the soak; returns the report it wrote."""
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    compaction = etcd_compaction_env(args.etcd_compaction_retention)
    with tempfile.TemporaryDirectory(prefix="soak-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with control_plane(tmp, compaction, orchestratord_args(args)) as (etcd, stored, orch):
            pids = {"orchestratord": orch.pid, "stored": stored.pid}
            result = asyncio.run(_drive(orch.address, stored.address, etcd, tmp / "data", pids, args))
    rows = result["rows"]
    per_step = growth(rows, args.warmup_steps)
    kib = TARGET_GROWTH_KIB_PER_STEP * 1024
    targets = {f"{name} growth < {TARGET_GROWTH_KIB_PER_STEP:g} KiB/step": value is not None and value < kib
               for name, value in (("orchestratord", per_step["orchestratord_rss_bytes"]),
                                   ("stored", per_step["stored_rss_bytes"]))}
    report = {
        "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "label": args.label,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "etcd_env": compaction,
        "orchestratord_args": orchestratord_args(args),
        "warmup_steps": args.warmup_steps,
        **result,
        "growth_per_step": per_step,
        "targets": targets,
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.png)
    print(f"wrote {args.out} and {args.png}")
    return report


async def _drive(orch_address: str, store_address: str, etcd: EtcdServer, data_dir: Path, pids: dict[str, int],
                 args: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster(orch_address, store_address, channels=2)
    try:
        return await Soak(cluster, etcd, data_dir, pids, args).run()
    finally:
        await cluster.close()


if __name__ == "__main__":
    main()
