"""FlexMARL against its baselines on the real daemons, with modelled device time.

    python -m benchmarks.run                      # default matrix (3-agent long-tail), ~15-20 min
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

Writes ``<out>/modelled.json`` and ``<out>/modelled.png`` (other workloads:
``modelled-<agents>-agent-<variant>.*``) and prints the table, plus the analytic estimate of a
colocated, time-shared sequential baseline (:func:`timeshared_sequential_estimate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks.report import Column, bar_chart, render_table  # noqa: E402
from benchmarks.workloads import Workload, make_workload  # noqa: E402
from flexmarl import devicemodel  # noqa: E402
from flexmarl.client import Client  # noqa: E402
from flexmarl.localcluster import LocalCluster, LocalClusterConfig  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402

log = logging.getLogger("benchmarks.run")

# name -> (pipeline section, rollout section, what it is)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "sequential": (
        {"mode": "sequential"},
        {"balancing": "static"},
        "MAS-RL-like: barrier, agents train one after another, fixed replica shares",
    ),
    "static": ({"mode": "static"}, {}, "MARTI-like: barrier, fixed slots and replica shares per agent"),
    "flexmarl": (
        {"mode": "async", "max_staleness": 1},
        {"balancing": "hierarchical"},
        "async micro-batches, hierarchical LB, dynamic binding",
    ),
    "no-async": ({"mode": "sync"}, {"balancing": "hierarchical"}, "FlexMARL with the rollout->train barrier"),
    "no-lb": ({"mode": "async", "max_staleness": 1}, {"balancing": "static"}, "FlexMARL with fixed replica shares"),
    "no-binding": (
        {"mode": "async", "max_staleness": 1, "binding": "static"},
        {"balancing": "hierarchical"},
        "FlexMARL with each agent on a fixed slot set",
    ),
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


@dataclasses.dataclass(frozen=True)
class TimeSharedEstimate:
    """Modelled seconds of one step of a colocated, time-shared sequential baseline (not measured)."""

    devices: int
    rollout_s: float
    reload_s: float
    train_s: float

    @property
    def step_s(self) -> float:
        """Rollout phases + weight reloads between them + training of every agent in turn."""
        return self.rollout_s + self.reload_s + self.train_s


def turn_phase_s(profile: devicemodel.DeviceProfile, prompt_tokens: int, lengths: list[int], replicas: int) -> float:
    """Modelled seconds for ``replicas`` replicas to answer one turn of every episode, all sent at once.

    Sequences are dealt round-robin to the replicas; each replica prefills its prompts, then
    decodes its sequences as one continuous batch (a sequence leaves when done; at step s each
    live sequence holds ``prompt_tokens + s`` context tokens). The phase ends with the slowest
    replica.
    """
    slowest = 0.0
    for replica in range(replicas):
        mine = sorted(lengths[replica::replicas])
        if not mine:
            continue
        elapsed = devicemodel.prefill_s(profile, prompt_tokens * len(mine))
        live, done = len(mine), 0
        for step in range(1, mine[-1] + 1):
            elapsed += devicemodel.decode_iteration_s(profile, live, live * (prompt_tokens + step))
            while done < len(mine) and mine[done] == step:
                done += 1
                live -= 1
        slowest = max(slowest, elapsed)
    return slowest


def timeshared_sequential_estimate(
    workload: Workload, profile: devicemodel.DeviceProfile, devices: int, episodes: int, samples: int = 8, seed: int = 0
) -> TimeSharedEstimate:
    """The paper's kind of sequential baseline on the same devices, from the device model alone.

    All ``devices`` serve one agent at a time: per step, every agent's turn of every episode
    runs as one phase on all devices (one replica per device; a phase starts when the previous
    agent's phase ended, because turn k needs turn k - 1's answer, and its replicas first load
    that agent's weights), then each agent trains in turn on all devices (data parallel), its
    full training state swapped in and the previous one's out (sharded over the devices' links).
    Response lengths are drawn from the workload as the environment draws them (rounded up to
    whole real tokens); the result is the mean over ``samples`` draws of a step's lengths.
    """
    rng = random.Random(seed)
    scale = profile.token_scale
    trainer = profile.with_changes(train_devices_per_slot=devices)
    rollout = train = 0.0
    for _ in range(samples):
        for _, dist in workload.agents:
            lengths = [math.ceil(dist.sample(rng) / scale) * int(scale) for _ in range(episodes)]
            rollout += turn_phase_s(profile, workload.prompt_tokens, lengths, devices)
            tokens = sum(workload.prompt_tokens + length for length in lengths)
            train += (
                devicemodel.train_tokens_s(trainer, tokens)
                + devicemodel.optimizer_step_s(trainer)
                + 2.0 * devicemodel.swap_s(profile) / devices
            )
    reload = len(workload.agents) * devicemodel.weight_transfer_s(profile)
    return TimeSharedEstimate(devices, rollout / samples, reload, train / samples)


def _daemon_pythonpath() -> str:
    """The repository (benchmarks.workloads) and its client package, ahead of the caller's path."""
    root = Path(__file__).resolve().parents[1]
    parts = [str(root), str(root / "clients" / "python"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(part for part in parts if part)


def job_spec(workload: Workload, config: str, model_dir: Path, steps: int, token_scale: float) -> dict[str, Any]:
    """The job of one configuration."""
    pipeline, rollout, _ = CONFIGS[config]
    max_new = workload.max_real_tokens(token_scale)
    return {
        "name": f"bench-{config}",
        "seed": 0,
        "environment": {
            "entrypoint": "benchmarks.workloads:SkewedAgentsEnv",
            "config": workload.environment_config(token_scale),
        },
        "agents": [
            {
                "name": name,
                "model": str(model_dir),
                "sampling": {"temperature": 1.0, "max_new_tokens": max_new},
                "optimizer": {"name": "adamw", "lr": 1.0e-4},
            }
            for name, _ in workload.agents
        ],
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
        token_scale=args.token_scale,
        time_scale=args.time_scale,
        trace_dir=str(trace_dir),
        train_devices_per_slot=args.train_devices_per_slot,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    profile_path = run_dir / "device.json"
    profile_path.write_text(profile.to_json())
    cluster_config = LocalClusterConfig(
        run_dir=run_dir,
        engine_replicas=args.replicas,
        trainer_slots=args.slots,
        env={devicemodel.PROFILE_ENV: str(profile_path), "PYTHONPATH": _daemon_pythonpath()},
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


def measure(
    config: str,
    workload: Workload,
    state: str,
    history: list[Any],
    profile: devicemodel.DeviceProfile,
    trace_dir: Path,
    args: argparse.Namespace,
    wall_s: float,
) -> RunResult:
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
        args.replicas * window_s
    )
    train_busy = sum(devicemodel.busy_seconds(r, done_at[first], done_at[last]) for r in trainers) / (
        args.slots * window_s
    )
    overrun = sum(float(rec.get("overrun_s", 0.0)) for r in [*engines, *trainers] for rec in r)
    return RunResult(
        config,
        workload.name,
        state,
        step_s,
        response_tokens / (window_s / profile.time_scale),
        rollout_busy,
        train_busy,
        wall_s,
        measured,
        overrun,
    )


def table(results: list[RunResult]) -> str:
    """The printed table: figures and speedups of FlexMARL over each baseline."""
    by_name = {r.config: r for r in results}
    flex = by_name.get("flexmarl")
    columns = [
        Column("config", 12, "<"),
        Column("state", 10, "<"),
        Column("step s", 8, fmt=".1f"),
        Column("tok/s", 9, fmt=".0f"),
        Column("roll busy", 9, fmt=".2f"),
        Column("train busy", 10, fmt=".2f"),
        Column("flexmarl speedup", 16, fmt=".2f", suffix="x"),
        Column("target", 0, "<", gap="  "),
    ]
    rows = []
    for r in results:
        over = r.step_s / flex.step_s if flex and flex.step_s > 0 else float("nan")
        target = TARGETS.get(r.config)
        verdict = ""
        if target is not None:
            verdict = f">= {target}x: {'met' if over >= target else 'MISSED'}"
        elif r.config != "flexmarl":
            verdict = f"ablation costs {over:.2f}x"
        rows.append([r.config, r.state, r.step_s, r.tokens_per_s, r.rollout_busy, r.train_busy, over, verdict])
    return "\n".join(render_table(columns, rows))


def estimate_line(estimate: TimeSharedEstimate, results: list[RunResult]) -> str:
    """The analytic time-shared sequential baseline, against FlexMARL's measured step."""
    flex = next((r for r in results if r.config == "flexmarl"), None)
    over = estimate.step_s / flex.step_s if flex is not None and flex.step_s > 0 else float("nan")
    return (
        f"time-shared sequential on all {estimate.devices} devices (device model only, not run): "
        f"{estimate.step_s:.1f} s/step (rollout phases {estimate.rollout_s:.1f}, reloads {estimate.reload_s:.1f}, "
        f"training {estimate.train_s:.1f}) = {over:.2f}x FlexMARL's step"
    )


def chart(results: list[RunResult], path: Path) -> None:
    """A bar chart of modelled step seconds."""
    bar_chart(
        path,
        [r.config for r in results],
        [r.step_s for r in results],
        ylabel="modelled step seconds",
        title=f"{results[0].workload}: step time (lower is better)",
        size=(7, 3.5),
    )


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
    # 0.1: a modelled second lasts 0.1 wall s, so the real per-step overheads (polls, gRPC,
    # DeepSpeed on CPU, checkpoint writes and reloads: ~1-3 wall s) stay small next to device time.
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
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
    profile = devicemodel.PRESETS[args.device].with_changes(token_scale=args.token_scale)
    estimate = timeshared_sequential_estimate(workload, profile, args.replicas + args.slots, episodes=64)
    report = table(results) + "\n" + estimate_line(estimate, results)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "workload": workload.name,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": [dataclasses.asdict(r) for r in results],
        "timeshared_sequential_estimate": {**dataclasses.asdict(estimate), "step_s": estimate.step_s},
        "table": report,
    }
    default_workload = args.agents == 3 and args.variant == "long-tail"
    stem = "modelled" if default_workload else f"modelled-{args.agents}-agent-{args.variant}"
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    chart(results, args.out / f"{stem}.png")
    return 0 if all(r.state == "SUCCEEDED" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
