"""Trainer long polls: the demands kept between polls, and which waiting polls a change can have answered.

A slot's poll (:meth:`Planner.poll_trainer_work`) is answered from the binder's decision over every
agent's demand and, for a bound slot, its agent's next work. Rather than wake every waiting poll on
every state change (O(slots x changes) polls per step, i.e. O(devices²)), the daemon asks
:meth:`TrainerPollWakes.wakes` after each change which waiting slots to poll again:

* the slots bound to (or working on) an agent whose plan changed: their agent's next work is all
  that can change for them, unless
* some agent starts or stops waiting for a slot, or could take another member (what a free or an
  idle bound slot decides on), a starving agent appears, the slot set changed under static binding
  or a slot was forgotten, or a rare job-wide change happened: then every waiting poll.

Time alone changes a decision only through starvation, which :meth:`wakes` checks; the daemon also
re-checks every poll within its long-poll bound (``lease_poll_max_ms``), so a wake this misses
costs a delay, not a hang. The demands are recomputed only for the agents their job marked touched
(``JobPlan.touched``: the writers of ``StepPlan``'s tallies and the job's rarer changes).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from orchestratord.binding import AgentDemand, AgentKey, SlotBinder
from orchestratord.planner.job import JobPlanner

#: What free slots decide on, per agent: (waiting for a slot, could take another member).
_Signature = tuple[bool, bool]


class TrainerPollWakes:
    """The binder's input kept between polls, and the wake rule above."""

    def __init__(self, binder: SlotBinder) -> None:
        self._binder = binder
        self._demands: dict[AgentKey, AgentDemand] = {}
        self._jobs_seen: tuple[str, ...] = ()
        self._signatures: dict[AgentKey, _Signature] = {}
        self._members: dict[AgentKey, tuple[str, ...]] = {}
        self._changed: set[AgentKey] = set()
        self._wake_all = True
        self._slot_set_changes = 0
        self._starving: frozenset[AgentKey] = frozenset()
        #: Demands recomputed so far (for tests and profiles); also the demands' version.
        self.recomputed = 0

    def mark(self, agents: Iterable[AgentKey | None]) -> None:
        """The agents' bindings changed (their slots' answers may have)."""
        self._changed.update(agent for agent in agents if agent is not None)

    def mark_all(self) -> None:
        """A rare change any waiting poll's answer may depend on."""
        self._wake_all = True

    def demands(self, running: Sequence[JobPlanner]) -> dict[AgentKey, AgentDemand]:
        """Every running job's agents' demands, recomputing only the touched ones (a kept dict: read only)."""
        seen = tuple(job.job_id for job in running)
        if seen != self._jobs_seen:
            self._jobs_seen = seen
            self._demands = {}
            self._binder.track_demands(self._demands)
            self._wake_all = True
            for job in running:
                job.touch_all()
        for job in running:
            for name in job.take_touched():
                key = (job.job_id, name)
                self._demands[key] = job.data_parallel_demand(name)
                self._binder.demand_changed(key)
                self._changed.add(key)
                self.recomputed += 1
        return self._demands

    def wakes(self, running: Sequence[JobPlanner], waiting: Collection[str]) -> set[str]:
        """The waiting slots whose poll may now be answered differently (consumes the changes seen so far)."""
        jobs = {job.job_id: job for job in running}
        self.demands(running)
        if self._binder.slot_set_changes != self._slot_set_changes:
            self._slot_set_changes = self._binder.slot_set_changes
            self._wake_all = True
        starving = self._binder.starving()
        if starving != self._starving:
            self._starving = starving
            self._wake_all = True
        targets: set[str] = set()
        for key in self._changed:
            members = self._binder.members(key)
            signature = self._signature(key, members)
            if self._signatures.get(key) != signature:
                self._signatures[key] = signature
                self._wake_all = True
            targets.update(self._members.get(key, ()))
            targets.update(members)
            self._members[key] = members
            job = jobs.get(key[0])
            plan = job.current_plan(key[1]) if job is not None else None
            if plan is not None:
                targets.update(plan.members)
                targets.update(plan.leased_by_slot)
        self._changed.clear()
        if self._wake_all:
            self._wake_all = False
            return set(waiting)
        return {slot_id for slot_id in targets if slot_id in waiting}

    def _signature(self, key: AgentKey, members: tuple[str, ...]) -> _Signature:
        demand = self._demands.get(key)
        if demand is None:
            return (False, False)
        recruitable = (bool(members) and demand.data_parallel and not demand.mid_step and demand.portable
                       and len(members) < self._binder.wanted_members(demand))
        return (demand.has_work and not members, recruitable)

    def cached(self) -> Mapping[AgentKey, AgentDemand]:
        """The demands as kept (tests compare them with a recount)."""
        return self._demands
