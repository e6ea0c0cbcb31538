"""The binder's slot-capacity rules (orchestratord.binding, "Slot capacity"): heavy agents on large slots.

Slots: ``big`` (capacity 2) and ``s1``, ``s2`` (capacity 1). Agents: ``H`` trains ~10x the tokens of the
light ``L``, ``M`` (its step 1.1x ``L``'s: inside the margin) and ``N``.
"""

from __future__ import annotations

from orchestratord.binding import AgentDemand, AgentKey, BindingDecision, DecisionKind, SlotBinder
from orchestratord.planner import Planner, PlannerOptions

from .helpers import FakeClock, experiences_for, make_spec

H = ("job", "h")
L = ("job", "l")
M = ("job", "m")
N = ("job", "n")


def heavy(**fields: object) -> AgentDemand:
    return AgentDemand(H, step_tokens=1000, ready_micro_batches=4, **fields)  # type: ignore[arg-type]


def light(key: AgentKey = L, tokens: int = 100, **fields: object) -> AgentDemand:
    return AgentDemand(key, step_tokens=tokens, ready_micro_batches=5, **fields)  # type: ignore[arg-type]


def sized(clock: FakeClock, *, aware: bool = True, capacities: tuple[float, float, float] = (2.0, 1.0, 1.0),
          max_wait_s: float = 60.0) -> SlotBinder:
    binder = SlotBinder(clock, capacity_aware=aware, max_wait_s=max_wait_s)
    for slot_id, capacity in zip(("big", "s1", "s2"), capacities, strict=True):
        binder.observe_poll(slot_id, f"w-{slot_id}", {}, capacity=capacity)
    return binder


def decide(binder: SlotBinder, slot_id: str, *items: AgentDemand) -> BindingDecision:
    ds = {d.key: d for d in items}
    binder.note_demand(ds.values())
    return binder.decide(slot_id, ds)


def test_a_small_slot_leaves_the_heavy_agent_to_a_free_large_one_which_takes_it_first() -> None:
    binder = sized(FakeClock())
    # s1 would take H by work (5 ready micro-batches against L's 4), but a larger slot is free for H.
    h = AgentDemand(H, step_tokens=1000, ready_micro_batches=5)
    l4 = AgentDemand(L, step_tokens=100, ready_micro_batches=4)
    assert decide(binder, "s1", h, l4) == BindingDecision(DecisionKind.BIND, L)
    # The large slot takes the heaviest waiting agent, whatever their ready micro-batches.
    assert decide(binder, "big", heavy(), light()) == BindingDecision(DecisionKind.BIND, H)
    # Blind to capacity, the same poll of s1 takes H (today's rule: most work).
    assert decide(sized(FakeClock(), aware=False), "s1", h, l4) == BindingDecision(DecisionKind.BIND, H)


def test_a_large_slot_weighs_agents_within_the_margin_by_the_usual_score() -> None:
    binder = sized(FakeClock())
    binder.observe_poll("big", "w-big", {L: 1}, capacity=2.0)  # L's state is resident there: affinity
    # M's step is 1.1x L's: no reason to load M's state instead of keeping L's.
    assert decide(binder, "big", light(), light(M, 110)) == BindingDecision(DecisionKind.BIND, L)
    assert decide(binder, "big", light(), light(M, 110), heavy()) == BindingDecision(DecisionKind.BIND, H)


def test_equal_capacities_change_no_decision() -> None:
    """Every slot of capacity 2: the capacity-aware binder decides as the blind one, poll after poll."""
    for capacities in ((2.0, 2.0, 2.0), (2.0, 1.0, 1.0)):
        clocks = FakeClock(), FakeClock()
        aware = sized(clocks[0], capacities=(2.0, 2.0, 2.0))
        blind = sized(clocks[1], aware=False, capacities=capacities)
        script = [("s1", (heavy(), light())), ("big", (heavy(mid_step=True), light(), light(M, 110))),
                  ("s2", (heavy(mid_step=True), light(mid_step=True), light(M, 110))),
                  ("s1", (heavy(), light(mid_step=True), light(M, 110, mid_step=True), light(N)))]
        for slot_id, items in script:
            found = [decide(binder, slot_id, *items) for binder in (aware, blind)]
            assert found[0] == found[1], (capacities, slot_id)
            for binder in (aware, blind):
                if found[0].kind is DecisionKind.BIND and found[0].agent is not None:
                    binder.bind(slot_id, found[0].agent)
            for clock in clocks:
                clock.advance(1.0)
        assert not aware.capacities_differ


def test_a_heavy_agent_moves_to_a_freed_large_slot_at_its_step_boundary() -> None:
    binder = sized(FakeClock())
    binder.bind("s1", H)
    binder.bind("big", L)
    # Mid-step nothing moves.
    assert decide(binder, "s1", heavy(mid_step=True), light(mid_step=True)).kind is DecisionKind.KEEP
    binder.release("big")  # the large slot is freed (L's job ended, or L gave it up)
    assert decide(binder, "s1", heavy(), light()) == BindingDecision(DecisionKind.RELEASE, H, L)
    binder.release("s1")
    binder.bind("s1", L)
    # H waits: the small s2 leaves it to the large slot, which takes it on its next poll.
    assert decide(binder, "s2", heavy(), light(mid_step=True)).kind is DecisionKind.IDLE
    assert decide(binder, "big", heavy(), light(mid_step=True)) == BindingDecision(DecisionKind.BIND, H)


def test_a_lighter_agent_gives_a_large_slot_up_to_a_heavier_waiting_one_but_not_for_noise() -> None:
    binder = sized(FakeClock())
    binder.bind("big", L)
    binder.bind("s1", N)
    binder.bind("s2", M)
    assert decide(binder, "big", light(), heavy(), light(N, mid_step=True),
                  light(M, 110, mid_step=True)) == BindingDecision(DecisionKind.RELEASE, L, H)
    assert decide(binder, "big", light(mid_step=True), heavy()).kind is DecisionKind.KEEP  # never mid-step
    # M trains 1.1x L's tokens: within the margin, so L keeps the large slot and M waits for a small one.
    binder.release("s2")
    assert decide(binder, "big", light(), light(M, 110), light(N, mid_step=True)).kind is DecisionKind.KEEP
    assert decide(binder, "s2", light(mid_step=True), light(M, 110),
                  light(N, mid_step=True)) == BindingDecision(DecisionKind.BIND, M)


def test_a_heavy_agent_on_a_small_slot_leaves_for_a_large_one_a_lighter_agent_holds() -> None:
    binder = sized(FakeClock())
    binder.bind("s1", H)
    binder.bind("big", L)
    # At H's step boundary the large slot is L's, mid-step: H waits for it (s1 takes the waiting N) ...
    assert decide(binder, "s1", heavy(), light(mid_step=True), light(N)) == BindingDecision(
        DecisionKind.RELEASE, H, N)
    binder.release("s1")
    binder.bind("s1", N)
    assert decide(binder, "s2", heavy(), light(mid_step=True), light(N, mid_step=True)).kind is DecisionKind.IDLE
    # ... and L gives it up at its own boundary.
    assert decide(binder, "big", heavy(), light(), light(N, mid_step=True)) == BindingDecision(
        DecisionKind.RELEASE, L, H)


def test_a_lost_large_slot_lets_small_slots_take_the_heavy_agent() -> None:
    binder = sized(FakeClock())
    assert decide(binder, "s1", heavy()).kind is DecisionKind.IDLE  # left to the free large slot
    changes = binder.slot_set_changes
    binder.remove_slot("big")
    assert binder.slot_set_changes > changes  # every waiting poll is asked again
    assert not binder.capacities_differ
    assert decide(binder, "s1", heavy()) == BindingDecision(DecisionKind.BIND, H)


def test_a_silent_or_saving_large_slot_is_not_waited_for_nor_is_a_starving_agent_held_back() -> None:
    clock = FakeClock()
    binder = sized(clock, max_wait_s=30)
    clock.advance(11)  # past recruit_fresh_s since the large slot last polled
    binder.observe_poll("s1", "w-s1", {}, capacity=1.0)
    assert decide(binder, "s1", heavy()) == BindingDecision(DecisionKind.BIND, H)
    binder.release("s1")
    binder.observe_poll("big", "w-big", {}, capacity=2.0)
    big = binder.slot("big")
    assert big is not None
    big.swapping_out = L
    assert decide(binder, "s1", heavy()) == BindingDecision(DecisionKind.BIND, H)
    big.swapping_out = None
    assert decide(binder, "s1", heavy()).kind is DecisionKind.IDLE
    clock.advance(31)  # H starves: any slot takes it
    binder.observe_poll("big", "w-big", {}, capacity=2.0)
    assert decide(binder, "s1", heavy()) == BindingDecision(DecisionKind.BIND, H)


def test_a_slot_reporting_a_new_capacity_counts_as_a_slot_set_change() -> None:
    binder = sized(FakeClock(), capacities=(1.0, 1.0, 1.0))
    changes = binder.slot_set_changes
    binder.observe_poll("big", "w-big", {}, capacity=1.0)
    assert binder.slot_set_changes == changes and not binder.capacities_differ
    binder.observe_poll("big", "w-big", {}, capacity=2.0)
    assert binder.slot_set_changes == changes + 1 and binder.capacities_differ
    binder.observe_poll("s3", "w-s3", {}, capacity=1.0)  # a new slot among differing capacities
    assert binder.slot_set_changes == changes + 2


def test_the_planner_gives_the_binder_each_polling_slots_capacity_unless_told_to_ignore_them() -> None:
    for aware in (True, False):
        planner = Planner(FakeClock(), PlannerOptions(capacity_aware_binding=aware))
        assert planner.poll_trainer_work("w", "w/slot0", (), "", 2.0) is None
        assert planner.poll_trainer_work("w", "w/slot1") is None
        capacities = [(slot.slot_id, slot.capacity) for slot in planner.binder.slots()]
        assert sorted(capacities) == [("w/slot0", 2.0), ("w/slot1", 1.0)]
        assert planner.binder.capacities_differ is aware


def test_an_agents_weight_projects_its_formed_micro_batches_onto_the_whole_step() -> None:
    planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e0"))
    planner.submit_job("job1", make_spec())  # 4 groups of 2 per step, 2 groups per micro-batch: 2 micro-batches
    leases = planner.lease_rollout_tasks("roll-0", 4)
    job = planner.job("job1")
    assert job.demand("sender").step_tokens == 0
    for lease in leases[:2]:
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                    experiences_for(lease, ("sender", "receiver")))
    plan = job.current_plan("sender")
    assert plan is not None and len(plan.micro_batches) == 1
    assert job.demand("sender").step_tokens == 2 * plan.formed_tokens  # one of two formed: weighs as two
    for lease in leases[2:]:
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                    experiences_for(lease, ("sender", "receiver")))
    assert len(plan.micro_batches) == 2 and job.demand("sender").step_tokens == plan.formed_tokens
