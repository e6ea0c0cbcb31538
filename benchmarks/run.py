"""FlexMARL against its baselines on the real daemons, with modelled device time.

    python -m benchmarks.run                      # default matrix (3-agent long-tail), ~5-10 min
    python -m benchmarks.run --configs flexmarl sequential --steps 3

Every configuration starts a fresh local cluster (etcd, stored, orchestratord, one traind with
``--slots`` slots, one rolloutd with ``--replicas`` embedded engines), all with
``FLEXMARL_MODELLED_DEVICE`` pointing at one device profile (``flexmarl.devicemodel``), submits
one job of the workload (``benchmarks/workloads.py``) and measures from the committed steps:

* step seconds (modelled): mean interval between the moments every agent had committed step
  t - 1 and step t, over steps 1..N-1 (step 0 includes engine start-up and is left out);
* tokens/s (modelled): response tokens of those steps x token_scale / their modelled seconds;
* busy fractions: union of the engines' (trainers') modelled-time intervals in that window,
  over replicas (slots) x window.

Writes ``<out>/modelled.json`` and ``<out>/modelled.png`` and prints the table.
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

from benchmarks.workloads import Workload, make_workload  # noqa: E402
from flexmarl import devicemodel  # noqa: E402
from flexmarl.client import Client  # noqa: E402
from flexmarl.localcluster import LocalCluster, LocalClusterConfig  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402

log = logging.getLogger("benchmarks.run")

# name -> (pipeline section, rollout section, what it is)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "sequential": ({"mode": "sequential"}, {"balancing": "static"},
                   "MAS-RL-like: barrier, agents train one after another, fixed replica shares"),
    "static": ({"mode": "static"}, {}, "MARTI-like: barrier, fixed slots and replica shares per agent"),
    "flexmarl": ({"mode": "async", "max_staleness": 1}, {"balancing": "hierarchical"},
                 "async micro-batches, hierarchical LB, dynamic binding"),
    "no-async": ({"mode": "sync"}, {"balancing": "hierarchical"}, "FlexMARL with the rollout->train barrier"),
    "no-lb": ({"mode": "async", "max_staleness": 1}, {"balancing": "static"}, "FlexMARL with fixed replica shares"),
    "no-binding": ({"mode": "async", "max_staleness": 1, "binding": "static"}, {"balancing": "hierarchical"},
                   "FlexMARL with each agent on a fixed slot set"),
}
TARGETS = {"sequential": 8.0, "static": 1.6}


@dataclasses.dataclass
class RunResult:
    """Measured figures of one configuration."""

    config: str
    workload: str
    state: str
    step_s: float
    tokens_per_s: float
    rollout_busy: float
    train_busy: float
    wall_s: float
    steps_measured: int
    model_overrun_s: float


def job_spec(workload: Workload, config: str, model_dir: Path, steps: int, token_scale: float) -> dict[str, Any]:
    """The job of one configuration."""
    pipeline, rollout, _ = CONFIGS[config]
    max_new = workload.max_real_tokens(token_scale)
    return {
        "name": f"bench-{config}",
        "seed": 0,
        "environment": {"entrypoint": "benchmarks.workloads:SkewedAgentsEnv",
                        "config": workload.environment_config(token_scale)},
        "agents": [{"name": name, "model": str(model_dir),
                    "sampling": {"temperature": 1.0, "max_new_tokens": max_new},
                    "optimizer": {"name": "adamw", "lr": 1.0e-4}} for name, _ in workload.agents],
        "algorithm": {"name": "grpo"},
        "batch": {"prompts_per_step": 4, "group_size": 16, "micro_batch_size": 16},
        "total_steps": steps,
        "pipeline": {"max_staleness": 0, **pipeline},
        "rollout": rollout,
        "leases": {"rollout_timeout_s": 900, "train_timeout_s": 900},
    }


def run_one(config: str, workload: Workload, args: argparse.Namespace, model_dir: Path, root: Path) -> RunResult:
    """One configuration on a fresh local cluster."""
    run_dir = root / config.replace(" ", "_")
    trace_dir = run_dir / "traces"
    profile = devicemodel.PRESETS[args.device].with_changes(
        token_scale=args.token_scale, time_scale=args.time_scale, trace_dir=str(trace_dir),
        train_devices_per_slot=args.train_devices_per_slot)
    run_dir.mkdir(parents=True, exist_ok=True)
    profile_path = run_dir / "device.json"
    profile_path.write_text(profile.to_json())
    cluster_config = LocalClusterConfig(
        run_dir=run_dir, engine_replicas=args.replicas, trainer_slots=args.slots,
        env={devicemodel.PROFILE_ENV: str(profile_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    started = time.monotonic()
    with LocalCluster(cluster_config) as cluster:
        with Client(etcd_endpoints=cluster.etcd_endpoint, timeout_s=60) as client:
            job_id = client.submit(job_spec(workload, config, model_dir, args.steps, args.token_scale))
            deadline = time.monotonic() + args.run_timeout_s
            info = client.status(job_id)
            while not info.state.finished and time.monotonic() < deadline:
                time.sleep(0.5)
                info = client.status(job_id)
            if not info.state.finished:
                client.cancel(job_id)
            history = client.history(job_id)
    wall_s = time.monotonic() - started
    return measure(config, workload, info.state.name, history, profile, trace_dir, args, wall_s)


def measure(config: str, workload: Workload, state: str, history: list[Any], profile: devicemodel.DeviceProfile,
            trace_dir: Path, args: argparse.Namespace, wall_s: float) -> RunResult:
    """Turns a job's step records and traces into the table's figures."""
    agents = len(workload.agents)
    done_at: dict[int, float] = {}
    tokens: dict[int, int] = {}
    per_step: dict[int, int] = {}
    for record in history:
        done_at[record.step] = max(done_at.get(record.step, 0.0), record.committed_unix_ms / 1000.0)
        tokens[record.step] = tokens.get(record.step, 0) + record.response_tokens
        per_step[record.step] = per_step.get(record.step, 0) + 1
    complete = sorted(step for step, count in per_step.items() if count == agents)
    nan = float("nan")
    if len(complete) < 2:
        return RunResult(config, workload.name, state, nan, nan, nan, nan, wall_s, 0, 0.0)
    first, last = complete[0], complete[-1]
    window_s = done_at[last] - done_at[first]
    measured = last - first
    step_s = window_s / measured / profile.time_scale
    response_tokens = sum(tokens[s] for s in complete[1:]) * profile.token_scale
    traces = devicemodel.read_traces(trace_dir)
    engines = [r for name, r in traces.items() if name.startswith("engine-")]
    trainers = [r for name, r in traces.items() if name.startswith("traind-")]
    rollout_busy = sum(devicemodel.busy_seconds(r, done_at[first], done_at[last]) for r in engines) / (
        args.replicas * window_s)
    train_busy = sum(devicemodel.busy_seconds(r, done_at[first], done_at[last]) for r in trainers) / (
        args.slots * window_s)
    overrun = sum(float(rec.get("overrun_s", 0.0)) for r in [*engines, *trainers] for rec in r)
    return RunResult(config, workload.name, state, step_s, response_tokens / (window_s / profile.time_scale),
                     rollout_busy, train_busy, wall_s, measured, overrun)


def table(results: list[RunResult]) -> str:
    """The printed table: figures and speedups of FlexMARL over each baseline."""
    by_name = {r.config: r for r in results}
    flex = by_name.get("flexmarl")
    lines = [f"{'config':<12} {'state':<10} {'step s':>8} {'tok/s':>9} {'roll busy':>9} {'train busy':>10} "
             f"{'flexmarl speedup':>16}  target"]
    for r in results:
        over = r.step_s / flex.step_s if flex and flex.step_s > 0 else float("nan")
        target = TARGETS.get(r.config)
        verdict = ""
        if target is not None:
            verdict = f">= {target}x: {'met' if over >= target else 'MISSED'}"
        elif r.config != "flexmarl":
            verdict = f"ablation costs {over:.2f}x"
        lines.append(f"{r.config:<12} {r.state:<10} {r.step_s:>8.1f} {r.tokens_per_s:>9.0f} {r.rollout_busy:>9.2f} "
                     f"{r.train_busy:>10.2f} {over:>15.2f}x  {verdict}")
    return "\n".join(lines)


def chart(results: list[RunResult], path: Path) -> None:
    """A bar chart of modelled step seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r.config for r in results]
    ax.bar(names, [r.step_s if math.isfinite(r.step_s) else 0.0 for r in results], color="#4477aa")
    ax.set_ylabel("modelled step seconds")
    ax.set_title(f"{results[0].workload}: step time (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Runs the matrix; returns 0 when every job finished."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--variant", choices=["long-tail", "uniform"], default="long-tail")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--device", choices=sorted(devicemodel.PRESETS), default="h100")
    parser.add_argument("--train-devices-per-slot", type=int, default=1)
    parser.add_argument("--token-scale", type=float, default=128.0)
    parser.add_argument("--time-scale", type=float, default=0.01)
    parser.add_argument("--run-timeout-s", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workload = make_workload(args.agents, args.variant)
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="flexmarl-bench-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_checkpoint(root / "tiny", seed=1)
        for config in args.configs:
            log.info("running %s on %s", config, workload.name)
            result = run_one(config, workload, args, model_dir, root)
            log.info("%s", result)
            results.append(result)
    report = table(results)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"workload": workload.name, "settings": {k: str(v) for k, v in vars(args).items()},
               "results": [dataclasses.asdict(r) for r in results], "table": report}
    (args.out / "modelled.json").write_text(json.dumps(payload, indent=2))
    chart(results, args.out / "modelled.png")
    return 0 if all(r.state == "SUCCEEDED" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
