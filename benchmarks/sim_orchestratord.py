"""orchestratord's own loop in :mod:`benchmarks.sim`: the coordinator's tick, with the planner calls it makes.

``JobCoordinator._tick_loop`` (orchestratord/coordinator.py) every ``TICK_INTERVAL_S``: the planner's
``tick`` under the lock (expiries, silent slots), then ``trainer_wakes`` as after every mutation,
``_observe_slots`` (the slot gauges and the pipeline-bubble counter: every known slot against every
running job), and every ``DEMAND_INTERVAL_S`` ``_push_demand`` (``rollout_demand()``: to each rolloutd its share,
``rolloutd_share``). The simulation times :meth:`CoordinatorTick.observe_slots` as planner CPU.
"""

from __future__ import annotations

from orchestratord.planner import Planner

#: orchestratord/coordinator.py's TICK_INTERVAL_S and DEMAND_INTERVAL_S (a test checks they agree).
TICK_INTERVAL_S = 0.2
DEMAND_INTERVAL_S = 1.0


class CoordinatorTick:
    """The planner reads of the coordinator's tick that are not Planner methods themselves."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.bubble_slots = 0  # idle slots summed over ticks (what the bubble counter adds up)

    def observe_slots(self) -> int:
        """``_observe_slots``' planner reads: the known slots, and those no running job keeps busy; returns those."""
        slots = self.planner.binder.slots()
        running = [job for job in self.planner.jobs() if not job.state.terminal]
        if not running:
            return 0
        busy: set[str] = set()  # one pass per job, not one per slot and job
        for job in running:
            busy |= job.busy_slots()
        idle = sum(1 for s in slots if s.slot_id not in busy)
        self.bubble_slots += idle
        return idle
