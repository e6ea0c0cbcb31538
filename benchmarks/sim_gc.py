"""The garbage-collector policy a :mod:`benchmarks.sim` run is measured under, applied as the daemons apply it.

Every daemon calls :func:`flexmarl.gc_policy.apply_after_startup` once its start-up is done
(``flexmarl/daemon.py``; ``--gc-freeze``, ``--gc-gen0-threshold``). The simulation calls the same
function once its cluster is built (the planner, every rolloutd's balancer, the replicas and
slots: its start-up), so the planner's and the balancers' CPU, which includes the collections
their allocations trigger, is measured under the daemons' setting ("daemon") or CPython's
own ("cpython": nothing frozen, generation 0 every 700 allocations). The collector stays on
either way: a collection that a measured call triggers is counted in that call's CPU.

The simulation holds the whole cluster in one process, so its heap is far larger than any one
daemon's: every rolloutd's and orchestratord's state, the episodes, the event queue. What it
builds while running stays in the collector's generations under either policy, as a daemon's
run-time objects do. After the run the frozen objects go back to the collector
(:func:`flexmarl.gc_policy.release_frozen`) and CPython's thresholds return, so that a sweep
of several runs in one process measures each alike and frees each run's objects.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flexmarl.gc_policy import GcPolicy, apply_after_startup, release_frozen

if TYPE_CHECKING:
    from benchmarks.control_cpu import CpuMeter
    from benchmarks.sim import Simulation
    from benchmarks.sim_model import SimOutcome

#: The policies a run can be measured under (``--gc``).
GC_POLICIES: dict[str, GcPolicy] = {"daemon": GcPolicy(), "cpython": GcPolicy.cpython_default()}


class CollectionMeter:
    """Collections per generation and the thread CPU they took, through ``gc.callbacks`` (one call per collection).

    ``measured_seconds`` is the part of ``seconds`` spent in collections that started inside a call
    one of ``meters`` times: collector work counted in the planner's or a balancer's CPU.
    """

    def __init__(self, meters: Sequence[CpuMeter] = ()) -> None:
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self.measured_seconds = 0.0
        self._meters = list(meters)
        self._started = 0.0
        self._inside = False

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """The collector's callback: ``phase`` "start" or "stop", ``info["generation"]`` the generation collected."""
        if phase == "start":
            self._inside = any(meter.inside for meter in self._meters)
            self._started = time.thread_time()
        else:
            elapsed_s = time.thread_time() - self._started
            self.seconds += elapsed_s
            if self._inside:
                self.measured_seconds += elapsed_s
            self.collections[info["generation"]] += 1


def run_under(simulation: Simulation, policy: str, max_events: int) -> SimOutcome:
    """Runs ``simulation`` (built, not yet run) under the named GC policy; the outcome records it and its GC."""
    thresholds = gc.get_threshold()
    applied = apply_after_startup(GC_POLICIES[policy])
    meter = CollectionMeter([simulation.cpu, *(process.cpu for process in simulation.rolloutds)])
    gc.callbacks.append(meter)
    try:
        outcome = simulation.run(max_events=max_events)
    finally:
        gc.callbacks.remove(meter)
        release_frozen()
        gc.set_threshold(*thresholds)
    return dataclasses.replace(
        outcome,
        gc_policy=policy,
        gc_frozen_objects=applied.frozen_objects,
        gc_collections=tuple(meter.collections),
        gc_cpu_s=meter.seconds,
        gc_measured_cpu_s=meter.measured_seconds,
    )


def same_model(a: SimOutcome, b: SimOutcome) -> bool:
    """Whether two runs of one size and configuration modelled the same run (events, steps, moves, lease operations)."""
    return (a.events, a.step_s, a.reassignments, a.lease_ops, a.state) == (b.events, b.step_s, b.reassignments,
                                                                          b.lease_ops, b.state)
