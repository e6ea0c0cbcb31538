from __future__ import annotations

import pytest

from flexmarl.config import ConfigError, load_config
from orchestratord.binding import AgentDemand, DecisionKind, SlotBinder
from orchestratord.config import OrchestratorConfig
from orchestratord.planner import OptimizerStepWork, Planner, PlannerOptions, RolloutDemandEstimator

from .helpers import FakeClock, make_spec, run_job

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


# ---- data parallelism (agents[].max_slots > 1) ----------------------------------------------------------


def dp_demand(key: tuple[str, str], **fields: object) -> AgentDemand:
    base: dict[str, object] = {"max_slots": 2, "data_parallel": True, "upcoming_micro_batches": 4}
    base.update(fields)
    return AgentDemand(key, **base)  # type: ignore[arg-type]


def dp_binder(clock: FakeClock, slots: int = 2, **knobs: float) -> SlotBinder:
    binder = SlotBinder(clock, incarnation="t", **knobs)  # type: ignore[arg-type]
    for i in range(slots):
        binder.observe_poll(f"s{i}", f"w{i}", {}, dp_address=f"127.0.0.1:{7000 + i}")
    return binder


def test_group_forms_at_a_step_boundary_when_worth_it() -> None:
    clock = FakeClock()
    binder = dp_binder(clock)
    binder.bind("s0", A)
    ds = demands(dp_demand(A, ready_micro_batches=1))
    assert binder.grow(A, ds) == ["s1"]
    group = binder.group(A)
    assert group is not None and group.members == ("s0", "s1") and group.world_size == 2
    assert group.master_address == "127.0.0.1:7000" and group.rank_of("s1") == 1
    assert binder.slot_of(A) == "s0" and binder.slot("s1").agent == A  # type: ignore[union-attr]


def test_a_free_slot_polling_joins_the_group() -> None:
    binder = dp_binder(FakeClock())
    binder.bind("s0", A)
    decision = binder.decide("s1", demands(dp_demand(A)))
    assert decision.kind is DecisionKind.JOIN and decision.agent == A


def test_group_not_formed_when_not_worth_it_or_not_allowed() -> None:
    clock = FakeClock()
    cases = [
        dp_demand(A, upcoming_micro_batches=1),  # fewer than 2 micro-batches for the extra member
        dp_demand(A, max_slots=1),  # max_slots respected
        dp_demand(A, data_parallel=False),  # e.g. ZeRO >= 1
        dp_demand(A, portable=False),  # a new member could not load the state
        dp_demand(A, mid_step=True),  # never mid-step
    ]
    for demand in cases:
        binder = dp_binder(clock)
        binder.bind("s0", A)
        assert binder.grow(A, demands(demand)) == [], demand
        assert binder.decide("s1", demands(demand)).kind is DecisionKind.IDLE, demand


def test_group_respects_max_slots_and_work_size() -> None:
    binder = dp_binder(FakeClock(), slots=4)
    binder.bind("s0", A)
    assert binder.grow(A, demands(dp_demand(A, max_slots=3, upcoming_micro_batches=100))) == ["s1", "s2"]
    binder2 = dp_binder(FakeClock(), slots=4)
    binder2.bind("s0", A)
    # 1 + 5 // 2 = 3 members at most for 5 upcoming micro-batches, though max_slots is 4.
    assert binder2.grow(A, demands(dp_demand(A, max_slots=4, upcoming_micro_batches=5))) == ["s1", "s2"]


def test_only_capable_and_recently_seen_slots_are_recruited() -> None:
    clock = FakeClock()
    binder = SlotBinder(clock, incarnation="t", recruit_fresh_s=5)
    binder.observe_poll("s0", "w0", {}, dp_address="h:1")
    binder.observe_poll("s1", "w1", {})  # a process with several slots: no rendezvous address
    binder.observe_poll("s2", "w2", {}, dp_address="h:3")
    clock.advance(6)
    binder.observe_poll("s0", "w0", {}, dp_address="h:1")
    binder.bind("s0", A)
    assert binder.grow(A, demands(dp_demand(A))) == []  # s1 incapable, s2 silent for 6 s
    binder.observe_poll("s2", "w2", {}, dp_address="h:3")
    assert binder.grow(A, demands(dp_demand(A))) == ["s2"]
    # a primary without a rendezvous address cannot lead a group
    binder3 = SlotBinder(clock, incarnation="t")
    binder3.observe_poll("s0", "w0", {})
    binder3.observe_poll("s1", "w1", {}, dp_address="h:2")
    binder3.bind("s0", A)
    assert binder3.grow(A, demands(dp_demand(A))) == []


def test_group_never_takes_a_slot_another_agent_waits_for() -> None:
    binder = dp_binder(FakeClock())
    binder.bind("s0", A)
    ds = demands(dp_demand(A), AgentDemand(B, ready_micro_batches=1))
    binder.note_demand(ds.values())
    assert binder.grow(A, ds) == []
    decision = binder.decide("s1", ds)
    assert decision.kind is DecisionKind.BIND and decision.agent == B


def test_member_leaves_at_step_boundary_for_a_waiting_agent_but_not_mid_step() -> None:
    binder = dp_binder(FakeClock())
    binder.bind("s0", A)
    binder.grow(A, demands(dp_demand(A)))
    epoch_before = binder.group(A).group_id  # type: ignore[union-attr]
    ds = demands(dp_demand(A, mid_step=True), AgentDemand(B, ready_micro_batches=3))
    binder.note_demand(ds.values())
    assert binder.decide("s1", ds).kind is DecisionKind.KEEP  # never mid-step
    ds = demands(dp_demand(A), AgentDemand(B, ready_micro_batches=3))
    decision = binder.decide("s1", ds)
    assert decision.kind is DecisionKind.RELEASE and decision.agent == A and decision.successor == B
    binder.release("s1")
    binder.bind("s1", B)
    group = binder.group(A)
    assert group is not None and group.members == ("s0",) and group.group_id != epoch_before
    assert binder.slot_of(B) == "s1"


def test_group_dissolves_when_idle() -> None:
    binder = dp_binder(FakeClock())
    binder.bind("s0", A)
    binder.grow(A, demands(dp_demand(A)))
    # between steps with the next step's work still expected: the group stays
    assert binder.decide("s1", demands(dp_demand(A))).kind is DecisionKind.KEEP
    # nothing more to train (the last step committed): the extra member leaves
    idle = demands(dp_demand(A, upcoming_micro_batches=0))
    decision = binder.decide("s1", idle)
    assert decision.kind is DecisionKind.RELEASE and decision.successor is None
    binder.release("s1")
    assert binder.members(A) == ("s0",) and binder.slot("s1").agent is None  # type: ignore[union-attr]
    # the job ends: every binding goes
    binder.bind("s1", B)
    binder.forget_agents("job")
    assert binder.members(A) == () and binder.members(B) == ()


def test_releasing_the_primary_frees_every_member_and_a_dead_member_leaves() -> None:
    binder = dp_binder(FakeClock(), slots=3)
    binder.bind("s0", A)
    binder.grow(A, demands(dp_demand(A, max_slots=3)))
    assert binder.members(A) == ("s0", "s1", "s2")
    binder.remove_slot("s1")  # a member died
    group = binder.group(A)
    assert group is not None and group.members == ("s0", "s2")
    assert binder.release("s0") == A
    assert binder.members(A) == () and all(s.agent is None for s in binder.slots())


def test_static_binding_limits_group_members() -> None:
    binder = dp_binder(FakeClock(), slots=4)
    binder.set_static("job", ["a", "b"])  # a: s0, s2; b: s1, s3
    binder.bind("s0", A)
    assert binder.grow(A, demands(dp_demand(A, max_slots=4, upcoming_micro_batches=100))) == ["s2"]


# ---- version lead: no agent of a job runs ahead of one waiting for its slot ---------------------------------


def _bound(binder: SlotBinder, agent: tuple[str, str]) -> SlotBinder:
    binder.observe_poll("s0", "w0", {agent: 1})
    binder.bind("s0", agent)
    return binder


def test_a_bound_agent_gives_way_at_its_step_boundary_to_an_agent_of_its_job_a_version_behind() -> None:
    binder = _bound(SlotBinder(FakeClock()), A)
    even = demands(AgentDemand(A, ready_micro_batches=9, version=3), AgentDemand(B, ready_micro_batches=1, version=3))
    binder.note_demand(even.values())
    assert binder.decide("s0", even).kind is DecisionKind.KEEP  # level: A keeps its slot while it has work
    ahead = demands(AgentDemand(A, ready_micro_batches=9, version=4), AgentDemand(B, ready_micro_batches=1, version=3))
    binder.note_demand(ahead.values())
    decision = binder.decide("s0", ahead)
    assert (decision.kind, decision.agent, decision.successor) == (DecisionKind.RELEASE, A, B)
    # never mid-step, however far ahead
    mid = demands(AgentDemand(A, mid_step=True, version=9), AgentDemand(B, ready_micro_batches=1, version=3))
    assert binder.decide("s0", mid).kind is DecisionKind.KEEP


def test_the_version_lead_is_a_setting_and_zero_turns_the_rule_off() -> None:
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=5), AgentDemand(B, ready_micro_batches=1, version=4))
    for lead, expected in ((0, DecisionKind.KEEP), (2, DecisionKind.KEEP), (1, DecisionKind.RELEASE)):
        binder = _bound(SlotBinder(FakeClock(), version_lead=lead), A)
        binder.note_demand(ds.values())
        assert binder.decide("s0", ds).kind is expected, lead
    binder = _bound(SlotBinder(FakeClock(), version_lead=2), A)
    further = demands(AgentDemand(A, ready_micro_batches=9, version=6),
                      AgentDemand(B, ready_micro_batches=1, version=4))
    binder.note_demand(further.values())
    assert binder.decide("s0", further).successor == B


def test_the_lead_compares_agents_of_one_job_only_and_gives_way_to_the_most_behind() -> None:
    other = ("other-job", "a")
    c = ("job", "c")
    binder = _bound(SlotBinder(FakeClock()), A)
    # another job's versions say nothing about this one's: A keeps its slot (it has work, nobody starves)
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=7), AgentDemand(other, ready_micro_batches=9, version=0))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP
    # of two agents behind, the one furthest behind takes the slot, whatever its work
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=7), AgentDemand(B, ready_micro_batches=1, version=3),
                 AgentDemand(c, ready_micro_batches=8, version=6))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).successor == B
    # an agent behind but without work, or bound to another slot, is not waiting for this one
    binder.observe_poll("s1", "w1", {})
    binder.bind("s1", B)
    assert binder.decide("s0", ds).successor == c
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=7), AgentDemand(c, version=2))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP


def test_the_lead_respects_static_slot_sets() -> None:
    binder = SlotBinder(FakeClock())
    binder.set_static("job", ["a", "b"])
    binder.observe_poll("s0", "w0", {})
    binder.observe_poll("s1", "w1", {})
    binder.bind("s0", A)  # A's set is s0, B's is s1
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=5), AgentDemand(B, ready_micro_batches=1, version=1))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP


def test_when_the_most_behind_may_not_take_the_slot_the_next_most_behind_does() -> None:
    c = ("job", "c")
    binder = SlotBinder(FakeClock())
    binder.set_static("job", ["a", "b", "c"])  # two slots: a and c may use s0, b only s1
    binder.observe_poll("s0", "w0", {})
    binder.observe_poll("s1", "w1", {})
    binder.bind("s0", A)
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=5), AgentDemand(B, ready_micro_batches=1, version=1),
                 AgentDemand(c, ready_micro_batches=1, version=3))
    binder.note_demand(ds.values())
    decision = binder.decide("s0", ds)
    assert (decision.kind, decision.agent, decision.successor) == (DecisionKind.RELEASE, A, c)
    # c within the lead: nobody that lags may take s0, and A keeps it while it has work
    ds = demands(AgentDemand(A, ready_micro_batches=9, version=5), AgentDemand(B, ready_micro_batches=1, version=1),
                 AgentDemand(c, ready_micro_batches=1, version=5))
    binder.note_demand(ds.values())
    assert binder.decide("s0", ds).kind is DecisionKind.KEEP


def _commit_runs(lead: int) -> tuple[list[int], int]:
    """Two agents of an eta-4 job on one slot: lengths of each agent's runs of commits, and the largest version gap."""
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0", binding_version_lead=lead, swap_location="file"))
    planner.submit_job("job1", make_spec(total_steps=12, pipeline={"mode": "async", "max_staleness": 4}))
    runs: list[int] = []
    last = ""
    versions = {"sender": 0, "receiver": 0}
    gap = 0
    for _, work in run_job(planner, clock, "job1", slots=("slot-0",)):
        if isinstance(work, OptimizerStepWork):
            runs = runs + [1] if work.agent != last else runs[:-1] + [runs[-1] + 1]
            last = work.agent
            versions[work.agent] = work.new_version
            gap = max(gap, abs(versions["sender"] - versions["receiver"]))
    return runs, gap


def test_two_agents_sharing_a_slot_alternate_in_short_runs_and_never_drift_apart() -> None:
    runs, gap = _commit_runs(lead=1)
    assert sum(runs) == 24 and max(runs) <= 2 and gap <= 1, runs  # one swap-in serves about two steps
    blind_runs, blind_gap = _commit_runs(lead=0)
    assert sum(blind_runs) == 24 and max(blind_runs) > 2 and blind_gap > 1, blind_runs  # the ablation drifts


def test_orchestratord_takes_the_version_lead_as_a_flag_and_refuses_a_negative_one() -> None:
    assert load_config(OrchestratorConfig, [], "orchestratord", env={}).binding_version_lead == 1
    assert load_config(OrchestratorConfig, ["--binding-version-lead", "0"], "orchestratord",
                       env={}).binding_version_lead == 0
    with pytest.raises(ConfigError, match="binding_version_lead"):
        load_config(OrchestratorConfig, ["--binding-version-lead", "-1"], "orchestratord", env={})


def test_orchestratord_sets_the_binders_wait_clocks_from_its_flags() -> None:
    from orchestratord.app import planner_options

    default = planner_options(load_config(OrchestratorConfig, [], "orchestratord", env={}))
    assert default == PlannerOptions()  # every option orchestratord sets defaults to the planner's own
    config = load_config(OrchestratorConfig, ["--binding-max-wait-s", "15", "--binding-aging-per-s", "0.2",
                                              "--binding-version-lead", "2"], "orchestratord", env={})
    options = planner_options(config)
    assert (options.max_wait_s, options.aging_per_s, options.binding_version_lead) == (15.0, 0.2, 2)
    # and the binder runs on them: an agent waiting 15 s starves, and its score aged 0.2 a second
    clock = FakeClock()
    binder = Planner(clock, options).binder
    binder.observe_poll("s0", "w0", {})
    binder.bind("s0", A)
    ds = demands(AgentDemand(A, ready_micro_batches=9), AgentDemand(B, ready_micro_batches=1))
    binder.note_demand(ds.values())
    clock.advance(14.0)
    assert binder.starving() == frozenset() and binder.score(B, "s0", ds[B])[1] == pytest.approx(1 + 0.2 * 14)
    clock.advance(1.0)
    assert binder.starving() == {B}
    for bad in (["--binding-max-wait-s", "0"], ["--binding-aging-per-s", "-1"]):
        with pytest.raises(ConfigError, match=bad[0][2:].replace("-", "_")):
            load_config(OrchestratorConfig, bad, "orchestratord", env={})
