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
  over replicas (slots) x window;
* the device-work bound of a step (``benchmarks/bound.py``): the larger of the rollout
  replica-seconds of the tokens those steps generated (at the best batching the engine allows)
  over the replicas and the training slot-seconds of the tokens they trained over the slots,
  from the device model and the step records; printed beside the step with the ratio;
* orchestration overhead: server-side handler seconds of orchestratord's lease, report, ack,
  commit and slot-event RPCs and of every stored RPC (the daemons' ``flexmarl_<daemon>_rpc_seconds``
  histograms, scraped before the job is submitted and after it finished), per step, as a share
  of the step's wall seconds (``step s x time_scale``);
* overrun (``benchmarks/machine.py``): wall seconds of the measured window in which the engines' and
  trainers' real compute ran past its modelled time, plus the seconds the control plane's threads
  (orchestratord, stored, etcd) waited for a CPU, beside every daemon's CPU share and the share of the
  window with no device busy; a configuration above ``OVERRUN_LIMIT`` of its window is "not measured
  (machine-set)" and left out of the speedups.

Ablations on top of ``flexmarl-partial``: ``partial-no-lb``, ``partial-no-binding``, ``partial-no-interrupt``
(async off: ``no-async``), ``partial-size-blind`` (orchestratord's binder blind to slot capacities),
``partial-impatient`` (the balancer's moves made at once, no patience), ``partial-evict-moves`` (a moved
replica hands its generations on instead of draining them); the shapes
built for them: ``--variant shifting``, ``--variant saturating`` (which also sets rolloutd's ``--max-tasks``,
``--rollout-max-tasks``), ``--variant two-heavy`` and ``--variant sized`` (slots of 2, 1 and 1 devices, traind's
``--slot-capacity``; ``--slot-capacity`` sets others; busy fractions and the bound then count devices, not slots).

``--eta 1 2 4`` runs every async configuration at each ``max_staleness`` (barrier ones once).

Writes ``<out>/modelled.json`` and ``<out>/modelled.png`` (other workloads:
``modelled-<agents>-agent-<variant>.*``) and prints the table, plus the analytic estimate of a
colocated, time-shared sequential baseline (:func:`timeshared_sequential_estimate`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from benchmarks.bound import (  # noqa: E402
    AgentStepWork,
    DeviceWorkBound,
    RpcTime,
    device_work_bound,
    mean_bound,
    rpc_overhead,
    rpc_times,
    scrape,
)
from benchmarks.machine import OVERRUN_LIMIT, CpuSampler, WindowAccount, account  # noqa: E402
from benchmarks.report import Column, bar_chart, render_table  # noqa: E402
from benchmarks.shares import assignment_estimate, describe  # noqa: E402
from benchmarks.workloads import VARIANTS, Workload, make_workload  # noqa: E402
from flexmarl import devicemodel  # noqa: E402
from flexmarl.client import Client  # noqa: E402
from flexmarl.jobspec import parse_job_spec  # noqa: E402
from flexmarl.localcluster import LocalCluster, LocalClusterConfig  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402
from orchestratord.planner import PlannerOptions  # noqa: E402
from rolloutd.task_limit import AUTO_FLOOR  # noqa: E402

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
    "flexmarl-interrupt": (
        {"mode": "async", "max_staleness": 1},
        {"balancing": "hierarchical", "partial_rollout": True},
        "FlexMARL with interruptible generation only: a new version interrupts the agent's generations, which "
        "continue on it; step t still trains batch t",
    ),
    # eta 8: a task (the slowest of its 16 episodes, each a three-agent chain) takes ~100 modelled s, ~3 steps,
    # and the replicas, weight-bound at the small batches a few tasks make, deliver a step's tasks every ~45 s
    # at eta 4; eta 8 doubles what is in flight (docs/benchmarks.md, "Interruptible rollouts").
    "flexmarl-partial": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "partial rollout (slime --partial-rollout --mask-offpolicy-in-partial-rollout, AReaL): interruptible "
        "generation, a step is the first tasks to finish, tokens older than eta get zero weight",
    ),
    "flexmarl-partial-held": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True},
        "flexmarl-partial without masking: a step waits for a task no later step may take (every token within eta)",
    ),
    # issue 35's ablations on top of flexmarl-partial, one mechanism off each (async off: no-async)
    "partial-no-lb": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "static", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with fixed replica shares",
    ),
    "partial-no-binding": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion", "binding": "static"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with each agent on a fixed slot set",
    ),
    "partial-no-interrupt": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical"},
        "flexmarl-partial without interruptible generation (a running generation finishes on its weights)",
    ),
    "partial-size-blind": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with the binder blind to slot capacities (orchestratord --no-capacity-aware-binding)",
    ),
    "partial-impatient": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with every planned replica move made at once (rolloutd --balancer-move-patience 0, "
        "the balancer before its patience)",
    ),
    "partial-evict-moves": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with a moved replica handing its generations on (aborted, resumed on their agent's "
        "other replicas) instead of draining them (rolloutd --balancer-move-evicts)",
    ),
    "partial-no-lead": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        {"balancing": "hierarchical", "partial_rollout": True, "mask_stale_tokens": True},
        "flexmarl-partial with a bound agent keeping its slot while it has work, however far a waiting agent of "
        "its job falls behind (orchestratord --binding-version-lead 0)",
    ),
}
# orchestratord flags of a configuration (the ablations of a daemon setting rather than a job setting).
ORCHESTRATORD_ARGS: dict[str, tuple[str, ...]] = {
    "partial-size-blind": ("--no-capacity-aware-binding",),
    "partial-no-lead": ("--binding-version-lead", "0"),
}
# rolloutd flags of a configuration, after the workload's.
ROLLOUTD_ARGS: dict[str, tuple[str, ...]] = {"partial-impatient": ("--balancer-move-patience", "0"),
                                             "partial-evict-moves": ("--balancer-move-evicts",)}


def orchestratord_args(config: str, time_scale: float) -> tuple[str, ...]:
    """orchestratord's flags for a configuration at ``time_scale`` wall s per modelled s.

    The binder's clocks are wall seconds (an agent starves after ``max_wait_s``, its priority ages
    ``aging_per_s``); they are set so that they run in modelled seconds, as on the modelled device, not
    ``1 / time_scale`` times looser. Then the configuration's own flags (its ablation).
    """
    options = PlannerOptions()
    return ("--binding-max-wait-s", repr(options.max_wait_s * time_scale),
            "--binding-aging-per-s", repr(options.aging_per_s / time_scale), *ORCHESTRATORD_ARGS.get(config, ()))


# Speedup targets of the reference configuration over a baseline: the paper's (flexmarl) and issue 15's
# (flexmarl-partial), with issue 15's bound, busy and overhead targets.
TARGETS = {"flexmarl": {"sequential": 8.0, "static": 1.6}, "flexmarl-partial": {"sequential": 5.0, "static": 3.0}}
GROUP_SIZE = 16  # episodes of a task (the job's batch.group_size)
BOUND_TARGET = 1.3  # step within 1.3x of the device-work bound
BUSY_TARGET = 0.8  # the busier of rollout/train busy
OVERHEAD_TARGET = 0.01  # orchestration overhead, share of the step


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
    eta: int | None = None  # max_staleness of an async configuration run by --eta (None: the config's)
    bound_s: float = float("nan")
    bound_rollout_s: float = float("nan")
    bound_train_s: float = float("nan")
    bound_by: str = ""
    overhead_s_per_step: float = float("nan")  # wall handler seconds of the counted RPCs per step
    overhead_share: float = float("nan")  # of the step's wall seconds (step s x time_scale)
    # of the step at real speed (step s): the handler seconds are real, the modelled step is what a cluster takes
    overhead_share_real: float = float("nan")
    agent_bound_s: float = float("nan")  # max(bound_s, the busiest agent's own training per step on its one slot)
    staleness_mean: float = float("nan")  # versions between the trained step and its oldest tokens, over the steps
    stale_token_fraction: float = 0.0  # response tokens masked as older than eta (rollout.mask_stale_tokens)
    overhead_rpcs: dict[str, float] = dataclasses.field(default_factory=dict)  # "daemon/method" -> seconds
    long_polls_left_out: int = 0
    # the measured window's real work past its modelled time (benchmarks/machine.py): wall seconds
    window_wall_s: float = float("nan")
    overrun_s: float = float("nan")  # engines' and trainers' overrun + the control plane's CPU wait, in the window
    device_overrun_s: float = float("nan")  # engines' and trainers' (traces), in the window
    control_wait_s: float = float("nan")  # orchestratord's, stored's and etcd's threads waiting for a CPU
    overrun_share: float = float("nan")  # overrun_s / window_wall_s
    daemon_cpu_share: float = float("nan")  # every daemon's CPU s / window wall s (cores)
    daemon_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)
    machine_busy_share: float = float("nan")  # the machine's CPUs, everyone's processes
    all_idle_share: float = float("nan")  # share of the window with no engine and no trainer busy
    machine_set: bool = False  # overrun_share above OVERRUN_LIMIT: not measured

    def add_account(self, window: WindowAccount) -> None:
        """Fills the window's overrun figures and the verdict."""
        self.window_wall_s = window.wall_s
        self.overrun_s = window.overrun_s
        self.device_overrun_s = window.device_overrun_s
        self.control_wait_s = window.control_wait_s
        self.overrun_share = window.overrun_share
        self.daemon_cpu_share = window.daemon_cpu_share
        self.daemon_cpu_s = window.daemon_cpu_s
        self.machine_busy_share = window.machine_busy_share
        self.all_idle_share = window.all_idle_share
        self.machine_set = window.machine_set

    @property
    def measured(self) -> bool:
        """Whether the step is a measurement of the model (steps measured and not machine-set)."""
        return self.steps_measured > 0 and not self.machine_set

    @property
    def label(self) -> str:
        """The configuration's name in tables (with its eta when swept)."""
        return self.config if self.eta is None else f"{self.config} eta={self.eta}"

    @property
    def over_bound(self) -> float:
        """The step's ratio to its device-work bound."""
        return self.step_s / self.bound_s if self.bound_s > 0 else float("nan")


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
    full training state swapped in and the previous one's out (sharded over the devices' links, as
    under ZeRO 3).
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
                + 2.0 * devicemodel.swap_s(trainer, zero_stage=3)  # one trainer over every device: sharded
            )
    reload = len(workload.agents) * devicemodel.weight_transfer_s(profile)
    return TimeSharedEstimate(devices, rollout / samples, reload, train / samples)


def workload_bound(
    workload: Workload,
    profile: devicemodel.DeviceProfile,
    replicas: int,
    slots: int,
    episodes: int,
    samples: int = 8,
    seed: int = 0,
) -> DeviceWorkBound:
    """The device-work bound of a step of ``workload`` from the device model alone (no run).

    The same bound as a run's (:func:`benchmarks.bound.device_work_bound`), over response
    lengths drawn from the workload as the environment draws them (rounded up to whole real
    tokens), averaged over ``samples`` draws of a step: what to expect before measuring.
    """
    rng = random.Random(seed)
    scale = profile.token_scale
    bounds = []
    for _ in range(samples):
        work = []
        for name, dist in workload.agents:
            tokens = sum(math.ceil(dist.sample(rng) / scale) * scale for _ in range(episodes))
            work.append(AgentStepWork(name, episodes, tokens))
        bounds.append(
            device_work_bound(profile, work, prompt_tokens=workload.prompt_tokens, replicas=replicas, slots=slots)
        )
    return mean_bound(bounds)


def _daemon_pythonpath() -> str:
    """The repository (benchmarks.workloads) and its client package, ahead of the caller's path."""
    root = Path(__file__).resolve().parents[1]
    parts = [str(root), str(root / "clients" / "python"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(part for part in parts if part)


def job_spec(
    workload: Workload, config: str, model_dir: Path, steps: int, token_scale: float, eta: int | None = None
) -> dict[str, Any]:
    """The job of one configuration (``eta``: its ``max_staleness`` instead of the config's, async only)."""
    pipeline, rollout, _ = CONFIGS[config]
    if eta is not None:
        pipeline = {**pipeline, "max_staleness": eta}
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
        "batch": {"prompts_per_step": 4, "group_size": GROUP_SIZE, "micro_batch_size": GROUP_SIZE},
        "total_steps": steps,
        "pipeline": {"max_staleness": 0, **pipeline},
        "rollout": rollout,
        "leases": {"rollout_timeout_s": 900, "train_timeout_s": 900},
    }


def rolloutd_args(spec: Mapping[str, Any], max_tasks: int | None = None, kv_factor: float = 0.0) -> list[str]:
    """rolloutd's flags for a cluster that runs ``spec``: ``--max-tasks`` as many tasks as its staleness rule
    keeps in flight (:attr:`~flexmarl.jobspec.JobSpec.rollout_tasks_ahead`), never below 8, unless ``max_tasks``
    says how many; ``--balancer-dispatch-kv-factor`` when ``kv_factor`` > 0.

    With a fixed 8 tasks (rolloutd's default before ``--max-tasks auto``; two steps of 4 prompts) an eta 4 or 8
    job ran as if eta were 1: rolloutd leased no more, its replicas decoded a few sequences at a time and the
    trainer waited on them (docs/benchmarks.md, "Where partial rollouts' step went"). rolloutd's default
    ``auto`` now sizes the same figure for one job and one rolloutd; the harness still passes it, so that a
    run's task limit is in its command line whatever rolloutd's default becomes.
    """
    tasks = max_tasks or rollout_tasks_ahead(spec)
    flags = ["--max-tasks", str(tasks)]
    if kv_factor > 0:
        flags += ["--balancer-dispatch-kv-factor", str(kv_factor)]
    return flags


def rollout_tasks_ahead(spec: Mapping[str, Any]) -> int:
    """The tasks ``spec``'s staleness rule keeps in flight, never below ``--max-tasks auto``'s floor (8)."""
    return max(AUTO_FLOOR, parse_job_spec(dict(spec)).rollout_tasks_ahead)


def is_async(config: str) -> bool:
    """Whether the configuration pipelines rollout and training (the ones ``--eta`` sweeps)."""
    return CONFIGS[config][0].get("mode") == "async"


def scrape_rpc_times(cluster: LocalCluster) -> list[RpcTime]:
    """The overhead-counted RPC seconds of the cluster's orchestratord and stored, now."""
    times: list[RpcTime] = []
    for name in ("orchestratord", "stored"):
        daemon = cluster.daemon(name)
        times += rpc_times(name, daemon.kind, scrape(daemon.metrics_port))
    return times


def run_one(
    config: str, workload: Workload, args: argparse.Namespace, model_dir: Path, root: Path, eta: int | None = None
) -> RunResult:
    """One configuration on a fresh local cluster."""
    run_dir = root / (config if eta is None else f"{config}-eta{eta}")
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
    spec = job_spec(workload, config, model_dir, args.steps, args.token_scale, eta)
    capacities = slot_capacities(workload, args)
    cluster_config = LocalClusterConfig(
        run_dir=run_dir,
        engine_replicas=args.replicas,
        trainer_slots=len(capacities),
        env={devicemodel.PROFILE_ENV: str(profile_path), "PYTHONPATH": _daemon_pythonpath()},
        rolloutd_args=(*rolloutd_args(spec, rollout_max_tasks(workload, args), dispatch_kv_factor(workload, args)),
                       *ROLLOUTD_ARGS.get(config, ())),
        traind_args=("--slot-capacity", ",".join(map(str, capacities))),
        orchestratord_args=orchestratord_args(config, profile.time_scale),
    )
    started = time.monotonic()
    with LocalCluster(cluster_config) as cluster:
        sampler = CpuSampler({"etcd": cluster.etcd.pid, **{name: d.pid for name, d in cluster.daemons.items()}})
        with Client(etcd_endpoints=cluster.etcd_endpoint, timeout_s=60) as client:
            before = scrape_rpc_times(cluster)
            sampler.sample()
            job_id = client.submit(spec)
            deadline = time.monotonic() + args.run_timeout_s
            info = client.status(job_id)
            while not info.state.finished and time.monotonic() < deadline:
                time.sleep(0.5)
                sampler.sample()
                info = client.status(job_id)
            sampler.sample()
            if not info.state.finished:
                client.cancel(job_id)
            overhead = rpc_overhead(before, scrape_rpc_times(cluster))
            history = client.history(job_id)
    wall_s = time.monotonic() - started
    result = measure(config, workload, info.state.name, history, profile, trace_dir, args, wall_s, sampler)
    result.eta = eta
    add_overhead(result, overhead, args.steps, profile.time_scale)
    return result


def rollout_max_tasks(workload: Workload, args: argparse.Namespace) -> int | None:
    """Tasks rolloutd runs at once: ``--rollout-max-tasks``, else the workload's; None: the job's staleness rule's."""
    if args.rollout_max_tasks is not None:
        return int(args.rollout_max_tasks)
    return workload.rollout_tasks or None


def dispatch_kv_factor(workload: Workload, args: argparse.Namespace) -> float:
    """rolloutd's ``--balancer-dispatch-kv-factor``: ``--dispatch-kv-factor``, else the workload's (0: off)."""
    return float(args.dispatch_kv_factor if args.dispatch_kv_factor is not None else workload.dispatch_kv_factor)


def add_overhead(result: RunResult, overhead: list[RpcTime], steps: int, time_scale: float) -> None:
    """Fills the result's overhead figures from the RPC seconds the whole job took (``steps`` steps)."""
    total_s = sum(t.seconds for t in overhead)
    result.overhead_rpcs = {f"{t.daemon}/{t.method}": round(t.seconds, 4) for t in overhead if t.calls > 0}
    result.long_polls_left_out = sum(t.left_out_calls for t in overhead)
    result.overhead_s_per_step = total_s / max(1, steps)
    step_wall_s = result.step_s * time_scale
    result.overhead_share = result.overhead_s_per_step / step_wall_s if step_wall_s > 0 else float("nan")
    result.overhead_share_real = result.overhead_s_per_step / result.step_s if result.step_s > 0 else float("nan")


def measure(
    config: str,
    workload: Workload,
    state: str,
    history: list[Any],
    profile: devicemodel.DeviceProfile,
    trace_dir: Path,
    args: argparse.Namespace,
    wall_s: float,
    sampler: CpuSampler | None = None,
) -> RunResult:
    """Turns a job's step records and traces (and the daemons' CPU samples) into the table's figures."""
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
    capacities = slot_capacities(workload, args)
    if len(set(capacities)) == 1:  # equal slots: slot-seconds busy over slot-seconds
        train_busy = sum(devicemodel.busy_seconds(r, done_at[first], done_at[last]) for r in trainers) / (
            len(capacities) * window_s)
    else:
        train_busy = device_busy_seconds(trainers, done_at[first], done_at[last]) / (sum(capacities) * window_s)
    overrun = sum(float(rec.get("overrun_s", 0.0)) for r in [*engines, *trainers] for rec in r)
    bound = step_bound(history, complete[1:], profile, workload.prompt_tokens, args.replicas, capacities)
    start, end = done_at[first], done_at[last]
    window = account([rec for r in [*engines, *trainers] for rec in r], start, end,
                     sampler.window(start, end) if sampler is not None else None)
    result = RunResult(
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
        bound_s=bound.step_s,
        bound_rollout_s=bound.rollout_s,
        bound_train_s=bound.train_s,
        bound_by=bound.bound_by,
        agent_bound_s=bound.agent_step_s,
        staleness_mean=statistics.fmean(r.staleness_mean for r in history) if history else nan,
        stale_token_fraction=(
            sum(r.figures.get("stale_token_fraction", 0.0) * r.response_tokens for r in history)
            / max(1, sum(r.response_tokens for r in history))),
    )
    result.add_account(window)
    return result


def step_bound(
    history: list[Any],
    steps: list[int],
    profile: devicemodel.DeviceProfile,
    prompt_tokens: int,
    replicas: int,
    capacities: tuple[int, ...],
) -> DeviceWorkBound:
    """The mean device-work bound of ``steps``, from what their step records say was generated and trained.

    ``capacities``: each slot's devices (:func:`bound_shape`).
    """
    work: dict[int, list[AgentStepWork]] = {step: [] for step in steps}
    for record in history:
        if record.step in work:
            tokens = record.response_tokens * profile.token_scale
            work[record.step].append(AgentStepWork(record.agent, record.episodes, tokens))
    trainer, slots = bound_shape(profile, capacities)
    return sized_bound(mean_bound(
        [
            device_work_bound(trainer, work[step], prompt_tokens=prompt_tokens, replicas=replicas, slots=slots)
            for step in steps
        ]
    ), capacities)


def bound_shape(profile: devicemodel.DeviceProfile, capacities: tuple[int, ...]) -> tuple[devicemodel.DeviceProfile,
                                                                                           int]:
    """The profile and slot count the device-work bound of slots of ``capacities`` devices is computed with.

    Equal slots: as they are. Slots of different sizes: as many one-device slots as they have devices (the
    training bound is device-seconds over every device; publishing weights, which does not shrink with
    devices, is then counted per device: a looser bound), with :func:`sized_bound`.
    """
    if len(set(capacities)) == 1:
        return profile.with_changes(train_devices_per_slot=capacities[0]), len(capacities)
    return profile.with_changes(train_devices_per_slot=1), sum(capacities)


def sized_bound(bound: DeviceWorkBound, capacities: tuple[int, ...]) -> DeviceWorkBound:
    """``bound`` with the busiest agent's own training on the largest slot (unchanged for equal slots)."""
    if len(set(capacities)) == 1:
        return bound
    return dataclasses.replace(bound, busiest_agent_train_s=bound.busiest_agent_train_s / max(capacities))


def slot_capacities(workload: Workload, args: argparse.Namespace) -> tuple[int, ...]:
    """Each trainer slot's devices: ``--slot-capacity``, else the workload's, else ``--slots`` x
    ``--train-devices-per-slot``."""
    # Callers that measure without this parser (benchmarks.scaleout) pass only replicas and slots.
    text = getattr(args, "slot_capacity", None)
    text = workload.slot_capacity if text is None else text
    if not text:
        return (int(getattr(args, "train_devices_per_slot", 1)),) * int(args.slots)
    return tuple(int(part) for part in text.split(","))


def device_busy_seconds(trainers: list[list[dict[str, Any]]], start_s: float, end_s: float) -> float:
    """Device-seconds the trainers were busy in [start, end]: each interval times its slot's devices.

    A trainer trace is one agent's (it trains on one slot at a time, so its intervals never overlap); each
    record names the devices of the slot it ran on (``devices``, from the slot's modelled profile).
    """
    total = 0.0
    for records in trainers:
        by_devices: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_devices.setdefault(int(record.get("devices", 1)), []).append(record)
        total += sum(devices * devicemodel.busy_seconds(rs, start_s, end_s) for devices, rs in by_devices.items())
    return total


def reference(results: list[RunResult]) -> RunResult | None:
    """The FlexMARL run speedups are taken against: interruptible rollouts when run, else ``flexmarl`` (default eta)."""
    for name in ("flexmarl-partial", "flexmarl"):
        runs = [r for r in results if r.config == name]
        if runs:
            return next((r for r in runs if r.eta is None or r.eta == 1), runs[0])
    return None


NOT_MEASURED = "not measured (machine-set)"


def speedup(run: RunResult, ref: RunResult | None) -> float:
    """``run``'s step over the reference's; NaN unless both are measurements of the model."""
    if ref is None or not (run.measured and ref.measured) or not ref.step_s > 0:
        return float("nan")
    return run.step_s / ref.step_s


def row_verdict(run: RunResult, ref: RunResult | None, targets: dict[str, float]) -> str:
    """The table's last column: machine-set, the target's verdict or the reference's speedup."""
    if run.machine_set:
        return NOT_MEASURED
    if ref is not None and ref.machine_set and run is not ref:
        return f"{ref.label} {NOT_MEASURED}"
    over = speedup(run, ref)
    if math.isnan(over):
        return "not measured" if run is not ref else ""
    target = targets.get(run.config)
    if target is not None:
        return f">= {target}x: {'met' if over >= target else 'MISSED'}"
    return f"{ref.label if ref else '-'} is {over:.2f}x faster" if run is not ref else ""


def table(results: list[RunResult]) -> str:
    """The printed table: figures, the bound beside the step, overrun, and the reference's speedup over each run."""
    ref = reference(results)
    targets = TARGETS.get(ref.config, {}) if ref is not None else {}
    columns = [
        Column("config", 22, "<"),
        Column("state", 10, "<"),
        Column("step s", 7, fmt=".1f"),
        Column("bound s", 7, fmt=".1f"),
        Column("bound by", 8, "<"),
        Column("step/bound", 10, fmt=".2f", suffix="x"),
        Column("tok/s", 6, fmt=".0f"),
        Column("roll busy", 9, fmt=".2f"),
        Column("train busy", 10, fmt=".2f"),
        Column("overhead", 8, fmt=".2%"),
        Column("overrun s", 9, fmt=".2f"),
        Column("overrun", 7, fmt=".1%"),
        Column("daemon cpu", 10, fmt=".2f"),
        Column("all idle", 8, fmt=".1%"),
        Column("ref speedup", 11, fmt=".2f", suffix="x"),
        Column("target", 0, "<", gap="  "),
    ]
    rows = []
    for r in results:
        over = speedup(r, ref)
        rows.append(
            [r.label, r.state, r.step_s, r.bound_s, r.bound_by, r.over_bound, r.tokens_per_s, r.rollout_busy,
             r.train_busy, r.overhead_share, r.overrun_s, r.overrun_share, r.daemon_cpu_share, r.all_idle_share,
             "–" if math.isnan(over) else over, row_verdict(r, ref, targets)]
        )
    lines = render_table(columns, rows)
    lines.append(
        "modelled seconds; bound = max(rollout replica-s / replicas, train slot-s / slots) of the tokens generated "
        "and trained (benchmarks/bound.py); overhead = orchestratord + stored RPC handler s per step / step wall s "
        "(step s x time_scale); overrun = wall s in the measured window that the engines' and trainers' real "
        "compute ran past its modelled time + the s orchestratord's, stored's and etcd's threads waited for a CPU, "
        f"and its share of the window (above {OVERRUN_LIMIT:.0%}: {NOT_MEASURED}, left out of the speedups); "
        "daemon cpu = every daemon's CPU s / window wall s (cores); all idle = share of the window with no engine "
        "and no trainer busy (benchmarks/machine.py)"
    )
    if ref is not None:
        lines.append(target_line(ref))
    return "\n".join(lines)


def target_line(ref: RunResult) -> str:
    """Issue 15's bound, busy and overhead targets for the reference run."""
    busier = max(ref.rollout_busy, ref.train_busy)

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return (
        (f"{NOT_MEASURED}: " if ref.machine_set else "")
        + f"{ref.label}: step {ref.over_bound:.2f}x its bound (target <= {BOUND_TARGET}x: "
        f"{verdict(ref.over_bound <= BOUND_TARGET)}; with the busiest agent's own training on its one slot the "
        f"bound is {ref.agent_bound_s:.1f} s, step {ref.step_s / ref.agent_bound_s:.2f}x that); busier busy "
        f"{busier:.2f} (target >= {BUSY_TARGET}: {verdict(busier >= BUSY_TARGET)}); overhead "
        f"{ref.overhead_s_per_step:.3f} wall s per step = {ref.overhead_share_real:.2%} of the step at real speed "
        f"(target < {OVERHEAD_TARGET:.0%}: {verdict(ref.overhead_share_real < OVERHEAD_TARGET)}), "
        f"{ref.overhead_share:.2%} of its compressed wall time; staleness {ref.staleness_mean:.2f} versions, "
        f"{ref.stale_token_fraction:.1%} of the tokens masked as older than eta"
    )


def estimate_line(estimate: TimeSharedEstimate, results: list[RunResult]) -> str:
    """The analytic time-shared sequential baseline, against the reference's measured step."""
    ref = reference(results)
    over = estimate.step_s / ref.step_s if ref is not None and ref.measured and ref.step_s > 0 else float("nan")
    return (
        f"time-shared sequential on all {estimate.devices} devices (device model only, not run): "
        f"{estimate.step_s:.1f} s/step (rollout phases {estimate.rollout_s:.1f}, reloads {estimate.reload_s:.1f}, "
        f"training {estimate.train_s:.1f}) = {over:.2f}x {ref.label if ref else 'FlexMARL'}'s step"
    )


def analytic_lines(workload: Workload, args: argparse.Namespace, results: list[RunResult]) -> str:
    """The device-model-only figures of the run's shape: the expected bound and the time-shared baseline."""
    profile = devicemodel.PRESETS[args.device].with_changes(token_scale=args.token_scale)
    capacities = slot_capacities(workload, args)
    trainer, slots = bound_shape(profile, capacities)
    bound = sized_bound(workload_bound(workload, trainer, args.replicas, slots, episodes=64), capacities)
    estimate = timeshared_sequential_estimate(workload, profile, args.replicas + len(capacities), episodes=64)
    lines = [
        f"device-work bound of a step from the workload's draws (device model only, not run): {bound.step_s:.1f} s "
        f"(rollout {bound.rollout_s:.1f} s on {bound.replicas} replicas, training {bound.train_s:.1f} s on "
        f"{len(capacities)} slots of {'/'.join(map(str, capacities))} devices; {BOUND_TARGET}x of it: "
        f"{BOUND_TARGET * bound.step_s:.1f} s; the busiest agent's own training on the largest slot: "
        f"{bound.busiest_agent_train_s:.1f} s)",
        estimate_line(estimate, results),
    ]
    if args.replicas >= len(workload.agents):
        partial = job_spec(workload, "flexmarl-partial", Path("model"), args.steps, args.token_scale)
        in_flight = (rollout_max_tasks(workload, args) or rollout_tasks_ahead(partial)) * GROUP_SIZE
        lines.append(describe(assignment_estimate(workload, profile, args.replicas, 64, in_flight), in_flight))
    return "\n".join(lines)


def chart(results: list[RunResult], path: Path) -> None:
    """A bar chart of modelled step seconds."""
    bar_chart(
        path,
        [r.label for r in results],
        [r.step_s for r in results],
        ylabel="modelled step seconds",
        title=f"{results[0].workload}: step time (lower is better)",
        size=(7, 3.5),
    )


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.run``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, default="long-tail")
    parser.add_argument("--rotate-every", type=int, default=None,
                        help="shifting and saturating variants: steps between moves of the heavy role to another "
                             "agent (default 3 and 8)")
    parser.add_argument("--rollout-max-tasks", type=int, default=None,
                        help="rolloutd's --max-tasks (default: the variant's, saturating 20; else as many as the "
                             "job's staleness rule admits, at least 8)")
    parser.add_argument("--dispatch-kv-factor", type=float, default=None,
                        help="rolloutd's --balancer-dispatch-kv-factor (default: the variant's, saturating 1; else "
                             "0, every request sent to an engine at once)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--device", choices=sorted(devicemodel.PRESETS), default="h100")
    parser.add_argument("--train-devices-per-slot", type=int, default=1)
    parser.add_argument("--slot-capacity", default=None,
                        help="devices of each trainer slot, comma-separated (traind's --slot-capacity; replaces "
                             "--slots and --train-devices-per-slot; default: the variant's, sized 2,1,1)")
    parser.add_argument("--token-scale", type=float, default=128.0)
    # 0.1: a modelled second lasts 0.1 wall s, so the real per-step overheads (polls, gRPC,
    # DeepSpeed on CPU, checkpoint writes and reloads: ~1-3 wall s) stay small next to device time.
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--eta", type=int, nargs="+", default=None, help="run every async configuration at each max_staleness"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--keep", type=Path, default=None,
                        help="run the clusters in this new directory and keep it (logs, traces); default: a temp dir")
    parser.add_argument("--stem", default="", help="output file stem (default: modelled[-<agents>-agent-<variant>])")
    parser.add_argument(
        "--estimate-only", action="store_true",
        help="print the device-model bound, the time-shared estimate and the replica-share estimate only",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the matrix; returns 0 when every job finished."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workload = make_workload(args.agents, args.variant, rotate_every_steps=args.rotate_every)
    if args.estimate_only:
        print(analytic_lines(workload, args, []))  # noqa: T201 (a CLI report)
        return 0
    results: list[RunResult] = []
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=False)
    with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(
            prefix="flexmarl-bench-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_checkpoint(root / "tiny", seed=1)
        for config in args.configs:
            for eta in args.eta if args.eta and is_async(config) else [None]:
                log.info("running %s (eta %s) on %s", config, eta, workload.name)
                result = run_one(config, workload, args, model_dir, root, eta)
                log.info("%s", result)
                results.append(result)
    profile = devicemodel.PRESETS[args.device].with_changes(token_scale=args.token_scale)
    estimate = timeshared_sequential_estimate(workload, profile, args.replicas + len(slot_capacities(workload, args)),
                                              episodes=64)
    report = table(results) + "\n" + analytic_lines(workload, args, results)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "workload": workload.name,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": [
            {**dataclasses.asdict(r), "label": r.label, "step_over_bound": r.over_bound,
             "measurement": NOT_MEASURED if r.machine_set else "measured"}
            for r in results
        ],
        "timeshared_sequential_estimate": {**dataclasses.asdict(estimate), "step_s": estimate.step_s},
        "table": report,
    }
    default_workload = args.agents == 3 and args.variant == "long-tail"
    stem = args.stem or ("modelled" if default_workload else f"modelled-{args.agents}-agent-{args.variant}")
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    chart(results, args.out / f"{stem}.png")
    return 0 if all(r.state == "SUCCEEDED" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
