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

The same rule answers a slot's poll again without asking the binder (:class:`QuietPolls`): a poll that
found no work leaves its slot *quiet*; until a change's wake names the slot (or every slot), while no
change is pending and the slot polls with what it held then, its next poll would get the same answer,
so the planner returns it without recomputing (most trainer polls are a traind's re-poll after its
long poll ended, or a poll woken for another slot's sake). A quiet answer is at most
:data:`QUIET_POLL_MAX_AGE_S` old: past that the poll is answered in full again, so a change the wake rule
missed costs a delay, as it does the long polls, never a hang.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from orchestratord.binding import AgentDemand, AgentKey, SlotBinder
from orchestratord.planner.job import JobPlanner

#: The oldest empty answer a quiet slot's poll is given again without recomputing it (seconds).
QUIET_POLL_MAX_AGE_S = 30.0

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

    def pending(self, running: Sequence[JobPlanner]) -> bool:
        """Whether a change not yet consumed by :meth:`wakes` may have changed some waiting poll's answer."""
        if self._wake_all or self._changed or self._binder.slot_set_changes != self._slot_set_changes:
            return True
        seen = self._jobs_seen
        if len(running) != len(seen):
            return True
        for job, job_id in zip(running, seen, strict=True):
            if job.job_id != job_id or job.has_touched():
                return True
        return self._binder.starving() != self._starving

    def wakes(self, running: Sequence[JobPlanner], waiting: Collection[str]) -> set[str]:
        """The waiting slots whose poll may now be answered differently (consumes the changes seen so far)."""
        targets = self.targets(running)
        if targets is None:
            return set(waiting)
        return {slot_id for slot_id in targets if slot_id in waiting}

    def targets(self, running: Sequence[JobPlanner]) -> set[str] | None:
        """Every slot (waiting or not) whose poll the changes since the last call may answer differently.

        None: every slot's. Consumes the changes; an empty set at once when none is pending.
        """
        if not self.pending(running):
            return set()
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
            return None
        return targets

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


#: What a slot polled with: (worker id, its resident agents' (job, agent, version), its rendezvous address, its
#: capacity).
PollInputs = tuple[str, tuple[tuple[str, str, int], ...], str, float]


class QuietPolls:
    """The slots whose last poll found no work and whose answer no change since can have altered (see above).

    The planner files a slot after an empty answer (:meth:`quiet`), drops the slots each change's
    wake names (:meth:`woken`; all of them when the change concerns every slot) and answers a quiet
    slot's next poll at once when :meth:`still_quiet` says it would be the same.
    """

    def __init__(self) -> None:
        self._since_s: dict[str, tuple[PollInputs, float]] = {}
        #: Polls answered from here (for tests and profiles).
        self.answered = 0

    def __contains__(self, slot_id: object) -> bool:
        return slot_id in self._since_s

    def quiet(self, slot_id: str, inputs: PollInputs, now_s: float) -> None:
        """``slot_id``'s poll with ``inputs`` found no work now."""
        self._since_s[slot_id] = (inputs, now_s)

    def forget(self, slot_id: str) -> None:
        """``slot_id``'s next poll is answered in full."""
        self._since_s.pop(slot_id, None)

    def woken(self, targets: Iterable[str] | None) -> None:
        """A change may have given these slots (None: every slot) work."""
        if targets is None:
            self._since_s.clear()
            return
        since_s = self._since_s
        for slot_id in targets:
            since_s.pop(slot_id, None)

    def still_quiet(self, slot_id: str, inputs: PollInputs, now_s: float) -> bool:
        """Whether ``slot_id`` polling with ``inputs`` now may be given its last (empty) answer again."""
        entry = self._since_s.get(slot_id)
        if entry is None or entry[0] != inputs or now_s - entry[1] > QUIET_POLL_MAX_AGE_S:
            return False
        self.answered += 1
        return True
