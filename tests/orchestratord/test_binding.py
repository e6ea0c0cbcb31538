from __future__ import annotations

from orchestratord.binding import AgentDemand, DecisionKind, RolloutDemandEstimator, SlotBinder

from .helpers import FakeClock

A = ("job", "a")
B = ("job", "b")


def demands(*items: AgentDemand) -> dict[tuple[str, str], AgentDemand]:
    return {d.key: d for d in items}


def test_free_slot_binds_agent_with_most_work() -> None:
    clock = FakeClock()
    binder = SlotBinder(clock)
    binder.observe_poll("s0", "w0", {})
    ds = demands(AgentDemand(A, ready_micro_batches=1), AgentDemand(B, ready_micro_batches=3))
    binder.note_demand(ds.values())
    decision = binder.decide("s0", ds)
    assert decision.kind is DecisionKind.BIND and decision.agent == B


def test_no_work_means_idle() -> None:
    binder = SlotBinder(FakeClock())
    binder.observe_poll("s0", "w0", {})
    assert binder.decide("s0", demands(AgentDemand(A))).kind is DecisionKind.IDLE


def test_affinity_prefers_resident_agent() -> None:
    binder = SlotBinder(FakeClock(), affinity_bonus=1.5)
    binder.observe_poll("s0", "w0", {A: 3})
    ds = demands(AgentDemand(A, ready_micro_batches=1), AgentDemand(B, ready_micro_batches=2))
    assert binder.decide("s0", ds).agent == A


def test_mid_step_binding_never_moves() -> None:
    clock = FakeClock()
    binder = SlotBinder(clock, max_wait_s=5)
    binder.observe_poll("s0", "w0", {})
    binder.bind("s0", A)
    ds = demands(AgentDemand(A, mid_step=True), AgentDemand(B, ready_micro_batches=5))
    binder.note_demand(ds.values())
    clock.advance(100)
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP


def test_idle_agent_gives_slot_to_waiting_agent_but_keeps_it_otherwise() -> None:
    binder = SlotBinder(FakeClock())
    binder.observe_poll("s0", "w0", {})
    binder.bind("s0", A)
    assert binder.decide("s0", demands(AgentDemand(A), AgentDemand(B))).kind is DecisionKind.KEEP
    ds = demands(AgentDemand(A), AgentDemand(B, ready_micro_batches=1))
    binder.note_demand(ds.values())
    decision = binder.decide("s0", ds)
    assert decision.kind is DecisionKind.RELEASE and decision.agent == A and decision.successor == B


def test_aging_prevents_starvation_at_step_boundary() -> None:
    clock = FakeClock()
    binder = SlotBinder(clock, max_wait_s=30)
    binder.observe_poll("s0", "w0", {})
    binder.bind("s0", A)
    ds = demands(AgentDemand(A, ready_micro_batches=10), AgentDemand(B, ready_micro_batches=1))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP  # A has more work
    clock.advance(31)
    decision = binder.decide("s0", ds)
    assert decision.kind is DecisionKind.RELEASE and decision.successor == B
    # and a starving agent outranks any amount of work on a free slot
    binder.observe_poll("s1", "w1", {})
    assert binder.score(B, "s1", ds[B]) > binder.score(("job", "c"), "s1", AgentDemand(("job", "c"), 50))


def test_removing_a_slot_ends_its_binding() -> None:
    binder = SlotBinder(FakeClock())
    binder.observe_poll("s0", "w0", {})
    binder.bind("s0", A)
    assert binder.slot_of(A) == "s0" and binder.slots_of_worker("w0") == ["s0"]
    binder.remove_slot("s0")
    assert binder.slot_of(A) is None and binder.slot("s0") is None
    # a slot re-registering under another worker is a fresh slot
    binder.observe_poll("s1", "w1", {})
    binder.bind("s1", B)
    binder.observe_poll("s1", "w2", {})
    assert binder.slot_of(B) is None


def test_one_slot_per_agent() -> None:
    binder = SlotBinder(FakeClock())
    binder.observe_poll("s0", "w0", {})
    binder.observe_poll("s1", "w0", {})
    binder.bind("s0", A)
    ds = demands(AgentDemand(A, ready_micro_batches=4))
    assert binder.decide("s1", ds).kind is DecisionKind.IDLE


def test_rollout_demand_estimator() -> None:
    est = RolloutDemandEstimator(smoothing=0.5)
    est.set_prior(A, 100)
    assert est.estimate(A, 4) == 400
    est.observe(A, episodes=2, response_tokens=20)  # 10 per episode
    assert est.tokens_per_episode(A) == 55
    est.forget_job("job")
    assert est.estimate(A, 4) == 0
