"""Property tests: the binder's incremental index of waiting agents and the lease table's expiry heap.

Both keep, per call, only what changed; each is checked against a recount after every step of a random
interleaving: the binder's decisions over its tracked demands against a walk of every demand (an untracked
copy), and the lease table's expiries against the rule "an active lease is due once its deadline passed".
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from orchestratord.binding import AgentDemand, AgentKey, DecisionKind, SlotBinder
from orchestratord.leases import Lease, LeaseKind, LeaseStatus, LeaseTable

from .helpers import FakeClock

AGENTS: tuple[AgentKey, ...] = tuple((job, name) for job in ("j1", "j2") for name in ("a", "b", "c"))
SLOTS = ("s0", "s1", "s2", "s3")

demand_fields = st.fixed_dictionaries({
    "ready_micro_batches": st.integers(0, 3),
    "optimizer_pending": st.booleans(),
    "mid_step": st.booleans(),
    "max_slots": st.integers(1, 3),
    "upcoming_micro_batches": st.integers(0, 6),
    "portable": st.booleans(),
    "warm_start_pending": st.booleans(),
    "step_tokens": st.sampled_from([0, 100, 110, 1000]),
    "version": st.integers(0, 3),
})
#: Slot capacities: mixed (the capacity rules apply) or all equal (they must change nothing).
MIXED = {"s0": 2.0, "s1": 1.0, "s2": 1.0, "s3": 4.0}


class BinderMachine(RuleBasedStateMachine):
    """The planner's use of the binder: tracked demands changed one key at a time, polls applied as it applies them."""

    @initialize(static=st.booleans(), mixed=st.booleans())
    def setup(self, static: bool, mixed: bool) -> None:
        self.capacities = MIXED if mixed else dict.fromkeys(SLOTS, 2.0)
        self.clock = FakeClock()
        self.binder = SlotBinder(self.clock, max_wait_s=20.0, dp_min_micro_batches_per_member=1, incarnation="t")
        if static:
            self.binder.set_static("j2", ["a", "b", "c"])
        self.demands: dict[AgentKey, AgentDemand] = {}
        self.binder.track_demands(self.demands)

    @rule(agent=st.sampled_from(AGENTS), fields=demand_fields)
    def set_demand(self, agent: AgentKey, fields: dict[str, object]) -> None:
        max_slots = fields["max_slots"]
        assert isinstance(max_slots, int)
        self.demands[agent] = AgentDemand(agent, data_parallel=max_slots > 1, **fields)  # type: ignore[arg-type]
        self.binder.demand_changed(agent)

    @rule(agent=st.sampled_from(AGENTS))
    def drop_demand(self, agent: AgentKey) -> None:
        self.demands.pop(agent, None)
        self.binder.demand_changed(agent)

    @rule()
    def rebuild(self) -> None:
        """The job set changed: the planner rebuilds its demands into a new mapping."""
        self.demands = dict(self.demands)
        self.binder.track_demands(self.demands)

    @rule(slot=st.sampled_from(SLOTS), resident=st.sets(st.sampled_from(AGENTS), max_size=2), dp=st.booleans())
    def poll(self, slot: str, resident: set[AgentKey], dp: bool) -> None:
        self.binder.observe_poll(slot, f"w-{slot}", {agent: 1 for agent in resident}, f"host:{slot}" if dp else "",
                                 self.capacities[slot])
        self.binder.note_waiting()
        decision = self.binder.decide(slot, self.demands)
        if decision.kind is DecisionKind.RELEASE and decision.agent is not None:
            self.binder.release(slot)
            if decision.successor is not None:
                self.binder.bind(slot, decision.successor)
                self.binder.grow(decision.successor, self.demands)
        elif decision.kind is DecisionKind.BIND and decision.agent is not None:
            self.binder.bind(slot, decision.agent)
            self.binder.grow(decision.agent, self.demands)
        elif decision.kind is DecisionKind.JOIN and decision.agent is not None:
            self.binder.join(slot, decision.agent)

    @rule(slot=st.sampled_from(SLOTS))
    def remove_slot(self, slot: str) -> None:
        self.binder.remove_slot(slot)

    @rule(job=st.sampled_from(("j1", "j2")))
    def forget_job(self, job: str) -> None:
        self.binder.forget_agents(job)

    @rule(seconds=st.sampled_from([1.0, 7.0, 25.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def index_matches_a_recount(self) -> None:
        if not hasattr(self, "binder"):
            return
        bound = {agent for agent in AGENTS if self.binder.members(agent)}
        assert self.binder.waiting() == {key for key, demand in self.demands.items()
                                         if demand.has_work and key not in bound}
        assert self.binder.recruiting() == {
            key for key, demand in self.demands.items()
            if key in bound and demand.data_parallel and not demand.mid_step and demand.portable
            and len(self.binder.members(key)) < self.binder.wanted_members(demand)}

    @invariant()
    def decisions_match_a_walk_of_every_demand(self) -> None:
        """Every slot's decision from the index equals the one from walking every demand (an untracked copy)."""
        if not hasattr(self, "binder"):
            return
        for slot in SLOTS:
            assert self.binder.decide(slot, self.demands) == self.binder.decide(slot, dict(self.demands)), slot

    @invariant()
    def equal_capacities_decide_as_a_binder_blind_to_them(self) -> None:
        if not hasattr(self, "binder") or len(set(self.capacities.values())) > 1:
            return
        blind = copy.deepcopy(self.binder)
        blind._capacity_aware = False
        for slot in SLOTS:
            assert self.binder.decide(slot, self.demands) == blind.decide(slot, self.demands), slot

    @invariant()
    def waits_match_a_recount(self) -> None:
        """note_waiting (O(changes)) leaves the same waits as note_demand's walk of every demand."""
        if not hasattr(self, "binder"):
            return
        recount = copy.deepcopy(self.binder)
        recount.note_demand(self.demands.values())
        self.binder.note_waiting()
        assert {a: self.binder.waited_s(a) for a in AGENTS} == {a: recount.waited_s(a) for a in AGENTS}


BinderMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestBinderIndex = BinderMachine.TestCase


class LeaseTableMachine(RuleBasedStateMachine):
    """Leases issued, renewed (deadlines later or, with the clock set back, earlier), ended, expired by due()."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = LeaseTable(self.clock, "job/e-")
        self.returned: dict[str, float] = {}  # lease -> the deadline due() returned it at (until renewed)

    @rule(timeout_s=st.sampled_from([1.0, 5.0, 30.0]))
    def issue(self, timeout_s: float) -> None:
        self.table.issue(LeaseKind.ROLLOUT_TASK, "w", "t", timeout_s)

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        active = self.table.active(LeaseKind.ROLLOUT_TASK)
        if active:
            lease = data.draw(st.sampled_from(active))
            self.table.renew(lease)
            self.returned.pop(lease.lease_id, None)  # due again once its new deadline passes

    @rule(data=st.data(), status=st.sampled_from([LeaseStatus.RELEASED, LeaseStatus.REVOKED]))
    def end(self, data: st.DataObject, status: LeaseStatus) -> None:
        active = self.table.active(LeaseKind.ROLLOUT_TASK)
        if active:
            self.table.end(data.draw(st.sampled_from(active)), status, "test")

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0, -3.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(expire=st.booleans())
    def due(self, expire: bool) -> None:
        """due() returns exactly the active leases past their deadline not returned at that deadline before."""
        now_s = self.clock()
        expected = sorted((lease.deadline_s, lease.lease_id) for lease in self.table.active(LeaseKind.ROLLOUT_TASK)
                           if lease.deadline_s < now_s and lease.lease_id not in self.returned)
        found: list[Lease] = self.table.due()
        assert [(lease.deadline_s, lease.lease_id) for lease in found] == expected
        self.returned.update((lease.lease_id, lease.deadline_s) for lease in found)
        if expire:
            for lease in found:
                self.table.end(lease, LeaseStatus.EXPIRED, "deadline passed")

    @invariant()
    def heap_holds_about_one_entry_per_active_lease(self) -> None:
        queued = self.table.queued_deadlines()
        active = {lease.lease_id: lease for lease in self.table.active(LeaseKind.ROLLOUT_TASK)}
        assert set(queued) <= set(active)
        for lease_id, lease in active.items():  # queued at or before its deadline, unless due() returned it
            assert queued[lease_id] <= lease.deadline_s if lease_id in queued \
                else self.returned.get(lease_id) == lease.deadline_s
        assert len(self.table._deadlines) <= 2 * len(queued) + 65


LeaseTableMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestLeaseExpiry = LeaseTableMachine.TestCase
