"""Scale-out through the real daemons: 64 modelled rollout replicas, 16 modelled trainer slots.

    python -m benchmarks.scaleout                         # flexmarl vs static, 16 agents, ~17 min on 2 busy cores
    python -m benchmarks.scaleout --configs flexmarl --steps 2 --replicas 64 --slots 16

One local cluster per configuration: etcd, stored, orchestratord, one rolloutd pointed (via
``--engine-urls``) at ``--replicas`` replicas of the synthetic engine
(:mod:`benchmarks.synthetic_engine`, all in one process, continuous batching, lengths only),
and ``--slots`` traind processes of one slot each. One process per slot because traind
serialises the compute of the slots of one process (one DeepSpeed process group), modelled
waits included; separate processes let the slots' modelled device time overlap as separate
devices would. The tiny model is still trained for real in every slot.

Everything carries ``FLEXMARL_MODELLED_DEVICE``; figures come from the same measurement as
``benchmarks.run`` (step seconds, tokens/s, busy fractions from the traces), plus the CPU
seconds each daemon used during the job (orchestratord's is the question at scale: it serves
every slot's long polls, every task lease and every etcd write).

Writes ``<out>/scaleout.json`` and ``<out>/scaleout.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import psutil  # noqa: E402

from benchmarks.report import Column, bar_chart, render_table  # noqa: E402
from benchmarks.run import CONFIGS, RunResult, job_spec, measure  # noqa: E402
from benchmarks.synthetic_engine import SyntheticFleet  # noqa: E402
from benchmarks.synthetic_replica import SyntheticEngineConfig  # noqa: E402
from benchmarks.workloads import Workload, make_workload  # noqa: E402
from flexmarl import devicemodel  # noqa: E402
from flexmarl.client import Client  # noqa: E402
from flexmarl.localcluster import LocalCluster, LocalClusterConfig  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402

log = logging.getLogger("benchmarks.scaleout")


@dataclasses.dataclass
class ScaleResult:
    """One configuration at scale: the figures of benchmarks.run plus CPU use per daemon kind."""

    run: RunResult
    replicas: int
    slots: int
    agents: int
    cpu_s: dict[str, float]
    job_wall_s: float

    def cpu_fraction(self, kind: str) -> float:
        """CPU seconds of ``kind`` per wall second of the job (1.0 = one core busy)."""
        return self.cpu_s.get(kind, 0.0) / self.job_wall_s if self.job_wall_s > 0 else math.nan


def _cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds per kind, summed over the kind's processes and their children."""
    totals: dict[str, float] = {}
    for kind, kind_pids in pids.items():
        total = 0.0
        for pid in kind_pids:
            try:
                process = psutil.Process(pid)
                for proc in [process, *process.children(recursive=True)]:
                    times = proc.cpu_times()
                    total += times.user + times.system
            except psutil.Error:
                continue
        totals[kind] = total
    return totals


def run_one(config: str, workload: Workload, args: argparse.Namespace, model_dir: Path, root: Path) -> ScaleResult:
    """One configuration on a fresh cluster with a fresh synthetic fleet."""
    run_dir = root / config
    trace_dir = run_dir / "traces"
    profile = devicemodel.PRESETS[args.device].with_changes(
        token_scale=args.token_scale,
        time_scale=args.time_scale,
        trace_dir=str(trace_dir),
        train_devices_per_slot=args.train_devices_per_slot,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    profile_path = run_dir / "device.json"
    profile_path.write_text(profile.to_json())
    env = {
        devicemodel.PROFILE_ENV: str(profile_path),
        "PYTHONPATH": os.pathsep.join(
            [
                str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "clients" / "python"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    fleet = SyntheticFleet.start(
        SyntheticEngineConfig(
            replicas=args.replicas,
            model_path=str(model_dir),
            modelled_device=str(profile_path),
            max_running_requests=args.max_running_requests,
            seed=0,
        ),
        run_dir / "synthetic",
        env=env,
    )
    try:
        cluster_config = LocalClusterConfig(
            run_dir=run_dir,
            engine_replicas=1,
            trainer_workers=args.slots,
            trainer_slots=1,
            env=env,
            rolloutd_args=["--engine-urls", ",".join(fleet.urls), "--max-tasks", str(args.max_tasks)],
        )
        started = time.monotonic()
        with LocalCluster(cluster_config) as cluster:
            pids: dict[str, list[int]] = {"orchestratord": [], "rolloutd": [], "traind": [], "stored": []}
            for proc in cluster.daemons.values():
                pids.setdefault(proc.kind, []).append(proc.pid)
            pids["synthetic"] = [fleet.process.pid]
            pids["etcd"] = [cluster.etcd.pid]
            with Client(etcd_endpoints=cluster.etcd_endpoint, timeout_s=60) as client:
                spec = job_spec(workload, config, model_dir, args.steps, args.token_scale)
                spec["batch"] = {
                    "prompts_per_step": args.prompts,
                    "group_size": args.group_size,
                    "micro_batch_size": args.micro_batch,
                }
                cpu_before = _cpu_seconds(pids)
                job_started = time.monotonic()
                job_id = client.submit(spec)
                deadline = time.monotonic() + args.run_timeout_s
                info = client.status(job_id)
                while not info.state.finished and time.monotonic() < deadline:
                    time.sleep(1.0)
                    info = client.status(job_id)
                job_wall_s = time.monotonic() - job_started
                cpu_after = _cpu_seconds(pids)
                if not info.state.finished:
                    client.cancel(job_id)
                history = client.history(job_id)
        wall_s = time.monotonic() - started
    finally:
        fleet.stop()
    measure_args = argparse.Namespace(replicas=args.replicas, slots=args.slots)
    result = measure(config, workload, info.state.name, history, profile, trace_dir, measure_args, wall_s)
    cpu_s = {kind: cpu_after.get(kind, 0.0) - cpu_before.get(kind, 0.0) for kind in cpu_after}
    return ScaleResult(result, args.replicas, args.slots, len(workload.agents), cpu_s, job_wall_s)


def table(results: list[ScaleResult]) -> str:
    """Figures, FlexMARL's speedup over each baseline, and CPU (cores busy) per daemon kind."""
    flex = next((r for r in results if r.run.config == "flexmarl"), None)
    columns = [
        Column("config", 12, "<"),
        Column("state", 10, "<"),
        Column("repl", 4),
        Column("slots", 5),
        Column("step s", 8, fmt=".1f"),
        Column("tok/s", 9, fmt=".0f"),
        Column("roll busy", 9, fmt=".2f"),
        Column("train busy", 10, fmt=".2f"),
        Column("speedup", 8, fmt=".2f", suffix="x"),
        *(Column(header, 8, fmt=".2f") for header in ("orch cpu", "roll cpu", "eng cpu", "trn cpu")),
    ]
    rows = []
    for r in results:
        run = r.run
        over = run.step_s / flex.run.step_s if flex and flex.run.step_s > 0 else math.nan
        rows.append(
            [run.config, run.state, r.replicas, r.slots, run.step_s, run.tokens_per_s, run.rollout_busy,
             run.train_busy, over, *(r.cpu_fraction(k) for k in ("orchestratord", "rolloutd", "synthetic", "traind"))]
        )
    lines = render_table(columns, rows)
    lines.append(
        "step s and tok/s are modelled; speedup = config step s / flexmarl step s; "
        "cpu = CPU seconds per wall second of the job (cores busy)"
    )
    return "\n".join(lines)


def chart(results: list[ScaleResult], path: Path) -> None:
    """Bars of modelled step seconds per configuration."""
    first = results[0]
    bar_chart(
        path,
        [r.run.config for r in results],
        [r.run.step_s for r in results],
        ylabel="modelled step seconds",
        title=f"{first.agents} agents, {first.replicas} replicas, {first.slots} slots (lower is better)",
        size=(6, 3.5),
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the configurations; returns 0 when every job succeeded."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["flexmarl", "static"], choices=list(CONFIGS))
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--variant", choices=["long-tail", "uniform"], default="long-tail")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="traind processes of one slot each")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--max-tasks", type=int, default=64, help="rolloutd's concurrent tasks")
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--device", choices=sorted(devicemodel.PRESETS), default="h100")
    parser.add_argument("--train-devices-per-slot", type=int, default=1)
    parser.add_argument("--token-scale", type=float, default=128.0)
    parser.add_argument("--time-scale", type=float, default=0.05)
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workload = make_workload(args.agents, args.variant)
    results: list[ScaleResult] = []
    with tempfile.TemporaryDirectory(prefix="flexmarl-scaleout-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_checkpoint(root / "tiny", seed=1)
        for config in args.configs:
            log.info("running %s: %d agents, %d replicas, %d slots", config, args.agents, args.replicas, args.slots)
            result = run_one(config, workload, args, model_dir, root)
            log.info("%s", result)
            results.append(result)
    report = table(results)
    print(report)  # noqa: T201 (a CLI report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {
        "workload": workload.name,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": [
            {
                **dataclasses.asdict(r.run),
                "replicas": r.replicas,
                "slots": r.slots,
                "agents": r.agents,
                "job_wall_s": r.job_wall_s,
                "cpu_s": r.cpu_s,
                "cpu_cores_busy": {k: r.cpu_fraction(k) for k in r.cpu_s},
            }
            for r in results
        ],
        "table": report,
    }
    (args.out / "scaleout.json").write_text(json.dumps(payload, indent=2))
    chart(results, args.out / "scaleout.png")
    return 0 if all(r.run.state == "SUCCEEDED" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
