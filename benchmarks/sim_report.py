"""The tables and the chart `python -m benchmarks.sim` prints and draws from its outcomes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.report import Column, line_chart, render_table

if TYPE_CHECKING:
    from benchmarks.sim import SimOutcome


def table(outcomes: Sequence[SimOutcome]) -> str:
    """Step seconds, throughput, busy fractions and FlexMARL's speedup per size (once per size and configuration).

    A run measured under several GC policies models the same events; its first policy's is shown.
    """
    outcomes = modelled_once(outcomes)
    flex = {o.devices: o for o in outcomes if o.config == "flexmarl"}
    columns = [
        Column("devices", 7),
        Column("repl", 5),
        Column("slots", 5),
        Column("eps/step", 8),
        Column("config", 11, "<"),
        Column("state", 10, "<"),
        Column("step s", 8, fmt=".1f"),
        Column("bound s", 7, fmt=".1f"),
        Column("step/bound", 10, fmt=".2f", suffix="x"),
        Column("tok/s", 9, fmt=".0f"),
        Column("roll busy", 9, fmt=".2f"),
        Column("train busy", 10, fmt=".2f"),
        Column("dp max", 6),
        Column("moves", 6),
        Column("speedup", 8, fmt=".2f", suffix="x"),
    ]
    rows = []
    for o in outcomes:
        ref = flex.get(o.devices)
        over = o.step_s / ref.step_s if ref is not None and ref.step_s > 0 else math.nan
        rows.append(
            [o.devices, o.replicas, o.slots, o.episodes_per_step, o.config, o.state, o.step_s, o.bound_s,
             o.step_s / o.bound_s if o.bound_s > 0 else math.nan, o.tokens_per_s, o.rollout_busy, o.train_busy,
             o.max_group_size, o.reassignments, over]
        )
    lines = render_table(columns, rows)
    lines.append(
        "modelled seconds (H100/Qwen2.5-14B roofline); bound = device-work bound of a step (benchmarks/bound.py); "
        "dp max = largest data-parallel group (slots); speedup = config step s / flexmarl step s"
    )
    return "\n".join(lines)


def modelled_once(outcomes: Sequence[SimOutcome]) -> list[SimOutcome]:
    """One outcome per size and configuration: the first GC policy's (the others model the same events)."""
    first = {}
    for o in outcomes:
        first.setdefault((o.devices, o.config), o)
    return list(first.values())


#: Issue 35's target: planner + balancer CPU per modelled step below this share of the step.
CONTROL_CPU_TARGET = 0.01


def run_label(outcome: SimOutcome) -> str:
    """The configuration, with the GC policy it was measured under where it has one (``flexmarl/daemon``)."""
    return f"{outcome.config}/{outcome.gc_policy}" if outcome.gc_policy else outcome.config


def growth_exponents(outcomes: Sequence[SimOutcome]) -> dict[tuple[str, int], float]:
    """Per configuration (and GC policy, :func:`run_label`) and size: d log(CPU per step) / d log(devices).

    Each from the run of the next smaller size with the same label.
    """
    exponents: dict[tuple[str, int], float] = {}
    for label in dict.fromkeys(run_label(o) for o in outcomes):
        runs = sorted((o for o in outcomes if run_label(o) == label), key=lambda o: o.devices)
        for smaller, larger in zip(runs, runs[1:], strict=False):
            a, b = smaller.control_cpu_per_step_s, larger.control_cpu_per_step_s
            if a > 0 and b > 0 and larger.devices > smaller.devices:
                exponents[(label, larger.devices)] = math.log(b / a) / math.log(larger.devices / smaller.devices)
    return exponents


def cpu_table(outcomes: Sequence[SimOutcome]) -> str:
    """The control plane's real CPU per modelled step beside the step, its bound and the lease rate."""
    exponents = growth_exponents(outcomes)
    columns = [
        Column("devices", 7),
        Column("agents", 6),
        Column("config/gc", 24, "<"),
        Column("step s", 8, fmt=".1f"),
        Column("bound s", 7, fmt=".1f"),
        Column("planner cpu/step s", 18, fmt=".3f"),
        Column("balancer cpu/step s", 19, fmt=".3f"),
        Column("cpu/step", 8, fmt=".2%"),
        Column("growth exp", 10, fmt=".2f"),
        Column("rolloutds", 9),
        Column("orch core", 9, fmt=".2%"),
        Column("rolloutd core", 13, fmt=".2%"),
        Column("lease op/s", 10, fmt=".0f"),
        Column("empty polls/s", 13, fmt=".0f"),
        Column("planner us/call", 15, fmt=".1f"),
        Column("balancer us/call", 16, fmt=".2f"),
        Column("gc s/step", 9, fmt=".3f"),
        Column("gc in cpu s/step", 16, fmt=".3f"),
        Column("target", 6, "<"),
    ]
    rows = []
    for o in outcomes:
        share = o.control_cpu_share
        per_modelled_s = o.step_s / o.modelled_s if o.modelled_s > 0 else math.nan
        rows.append(
            [o.devices, o.agents, run_label(o), o.step_s, o.bound_s, o.planner_cpu_s * per_modelled_s,
             o.balancer_cpu_s * per_modelled_s, share, exponents.get((run_label(o), o.devices), math.nan),
             o.rolloutds, o.planner_cpu_s / o.modelled_s if o.modelled_s > 0 else math.nan, o.rolloutd_share,
             o.lease_ops_per_s, o.lease_ops.get("empty poll", 0) / o.modelled_s if o.modelled_s > 0 else math.nan,
             1e6 * o.planner_cpu_s / o.planner_calls if o.planner_calls else math.nan,
             1e6 * o.balancer_cpu_s / o.balancer_calls if o.balancer_calls else math.nan,
             o.gc_cpu_s * per_modelled_s, o.gc_measured_cpu_s * per_modelled_s,
             "met" if share < CONTROL_CPU_TARGET else "MISSED"]
        )
    lines = render_table(columns, rows)
    lines.append(
        "cpu = real thread CPU seconds inside the real Planner and HierarchicalBalancer (+ TokenEstimator) calls, per "
        "modelled step; cpu/step = that / the modelled step (target < 1%); growth exp = d log(cpu/step s) / d log "
        "(devices) from the next smaller size (target <= 1); orch core = the planner's CPU per modelled second (one "
        "orchestratord's core), rolloutd core = the busiest rolloutd's balancer's; lease op/s per modelled second "
        "(lease, report, renew, "
        "trainer lease, ack, commit, slot event), empty polls apart; gc = the GC policy the run was measured under "
        "(daemon: start-up frozen, generation 0 every 50,000 allocations; cpython: its defaults), gc s/step = thread "
        "CPU of every collection in the process per modelled step (the simulation's and the measured code's), gc in "
        "cpu = of that, the collections that ran inside a measured call (counted in planner/balancer cpu)"
    )
    return "\n".join(lines)


def chart(outcomes: Sequence[SimOutcome], path: Path) -> None:
    """Tokens/s against devices, one line per configuration."""
    outcomes = modelled_once(outcomes)
    series = {
        config: [(o.devices, o.tokens_per_s) for o in outcomes if o.config == config]
        for config in dict.fromkeys(o.config for o in outcomes)
    }
    line_chart(
        path,
        series,
        xlabel="devices",
        ylabel="modelled response tokens / s",
        title="simulated throughput (weak scaling)",
        size=(6.5, 4),
        log_x_base=2,
        log_y=True,
    )


