from __future__ import annotations

import pytest

import rolloutd.balancer as balancer_module
from benchmarks.balancer_sim import compare, format_table, simulate, skewed_workload
from flexmarl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from rolloutd.balancer import (
    AgentSpec,
    BalancerConfig,
    HierarchicalBalancer,
    ReplicaAssignment,
    ReplicaPhase,
    RoutingPolicy,
    TokenEstimator,
    affinity_parent,
    episode_affinity_key,
    equal_split,
    group_affinity_key,
)


def make(replicas: dict[str, str], agents: dict[str, str], **config: object) -> HierarchicalBalancer:
    return HierarchicalBalancer(
        [ReplicaAssignment(r, m, 100.0) for r, m in replicas.items()],
        [AgentSpec(a, m) for a, m in agents.items()],
        BalancerConfig(**config),  # type: ignore[arg-type]
    )


def test_least_tokens_routing_spreads_load() -> None:
    b = make({"r0": "m", "r1": "m"}, {"a": "m"})
    first = b.submit("a", 100)
    second = b.submit("a", 10)
    third = b.submit("a", 10)
    assert first.replica_id == "r0"
    assert second.replica_id == "r1"
    assert third.replica_id == "r1"  # r1 has 10 outstanding, r0 has 100
    assert [r.outstanding_tokens for r in b.replicas()] == [100, 20]


def test_a_placed_ticket_is_the_request_with_its_replica() -> None:
    """_assign builds the placed Ticket field by field (not dataclasses.replace): every field is carried."""
    import dataclasses

    from rolloutd.balancer import Ticket

    assert [f.name for f in dataclasses.fields(Ticket)] == [
        "request_id", "agent", "estimated_tokens", "affinity_key", "replica_id", "adapter", "kv_tokens"]
    b = make({"r0": "m"}, {"a": "m"})
    placed = b.submit("a", 42, "t1#0", kv_tokens=7)
    assert placed == Ticket(placed.request_id, "a", 42, "t1#0", "r0", None, 7)
    assert b.finish(placed.request_id) == placed


def test_affinity_wins_while_balanced_and_loses_when_imbalanced() -> None:
    b = make({"r0": "m", "r1": "m"}, {"a": "m"})
    key = episode_affinity_key("t1", 0)
    t0 = b.submit("a", 10, key)
    assert t0.replica_id == "r0"
    b.submit("a", 10, "other")  # -> r1, loads 10/10
    b.finish(t0.request_id)  # loads 0/10: diff 10 <= 64, balanced
    assert b.submit("a", 10, key).replica_id == "r0"
    # Now make r0 heavily loaded: 10 + 200 vs 10 -> diff > 64 and > 1.5x: imbalanced.
    b.submit("a", 200, key)
    assert b.submit("a", 10, key).replica_id == "r1"


def test_sglang_imbalance_rule_needs_both_thresholds() -> None:
    b = make({"r0": "m"}, {"a": "m"})
    assert b.config.balance_abs_threshold_tokens == 64 and b.config.balance_rel_threshold == 1.5
    assert not b.is_imbalanced([100, 60])  # diff 40 <= 64
    assert not b.is_imbalanced([1000, 900])  # 1000 <= 1.5 * 900
    assert b.is_imbalanced([200, 100])  # diff 100 > 64 and 200 > 150


def test_group_affinity_key_is_fallback_for_episode_keys() -> None:
    assert affinity_parent(episode_affinity_key("job/3/7", 2)) == group_affinity_key("job/3/7")
    b = make({"r0": "m", "r1": "m"}, {"a": "m"})
    b.submit("a", 5, "x")  # r0
    grouped = b.submit("a", 5, group_affinity_key("task"))  # r1 (least loaded)
    assert grouped.replica_id == "r1"
    assert b.submit("a", 5, episode_affinity_key("task", 3)).replica_id == "r1"


def test_round_robin_ignores_load() -> None:
    b = make({"r0": "m", "r1": "m"}, {"a": "m"}, routing=RoutingPolicy.ROUND_ROBIN)
    ids = [b.submit("a", tokens).replica_id for tokens in (1000, 1, 1, 1)]
    assert ids == ["r0", "r1", "r0", "r1"]


def test_demand_is_hint_plus_queued_plus_in_flight() -> None:
    b = make({"r0": "m"}, {"a": "m", "b": "n"})
    b.set_demand_hint("a", 50)
    t = b.submit("a", 30)
    queued = b.submit("b", 7)  # no replica serves model n
    assert queued.replica_id is None
    assert b.demand_tokens("a") == 80
    assert b.demand_tokens("b") == 7
    b.finish(t.request_id)
    assert b.demand_tokens("a") == 50
    with pytest.raises(NotFound):
        b.submit("nobody", 1)
    with pytest.raises(InvalidArgument):
        b.set_demand_hint("a", -1)


def test_a_push_of_hints_is_each_hint_set_in_turn_and_a_bad_one_sets_none() -> None:
    """set_demand_hints (one SetAgentDemand) is set_demand_hint per agent: demand, and urgency of a starved group."""
    one_by_one = make({"r0": "m"}, {"a": "m", "b": "n", "c": "m"}, rebalance_interval_s=1e9)
    pushed = make({"r0": "m"}, {"a": "m", "b": "n", "c": "m"}, rebalance_interval_s=1e9)
    for b in (one_by_one, pushed):
        b.maybe_rebalance(0.0)  # the interval starts; only an urgent rebalance runs before it passes
    hints = {"a": 50, "b": 7, "c": 0}
    for agent, tokens in hints.items():
        one_by_one.set_demand_hint(agent, tokens)
    pushed.set_demand_hints(hints)
    for b in (one_by_one, pushed):
        assert {a: b.demand_tokens(a) for a in "abc"} == hints
        assert b._rebalance_urgent  # b's group n has no replica: the next maybe_rebalance runs
    assert one_by_one.maybe_rebalance(1.0) == pushed.maybe_rebalance(1.0)
    with pytest.raises(InvalidArgument):
        pushed.set_demand_hints({"a": 1, "c": -1})
    with pytest.raises(NotFound):
        pushed.set_demand_hints({"a": 1, "nobody": 2})
    assert {a: pushed.demand_tokens(a) for a in "abc"} == hints  # nothing of a refused push was set


def test_rebalance_moves_replicas_toward_demand_proportionally() -> None:
    replicas = {f"r{i}": ("heavy" if i < 2 else "light") for i in range(4)}
    b = make(replicas, {"heavy": "heavy", "light": "light"}, reassignment_cost_s=1.0, hysteresis=0.1)
    b.set_demand_hint("heavy", 100_000)
    b.set_demand_hint("light", 10_000)
    moves = b.rebalance(now_s=0.0)
    assert [(m.from_model_key, m.to_model_key) for m in moves] == [("light", "heavy")]
    assert b.replica_counts() == {"heavy": 3, "light": 1}  # light keeps its last replica
    assert b.reassignments == 1


def test_hysteresis_and_cost_prevent_small_moves() -> None:
    b = make({"r0": "a", "r1": "b"}, {"a": "a", "b": "b"}, reassignment_cost_s=100.0)
    b.set_demand_hint("a", 1000)  # 10 s of work: not worth a 100 s weight load
    assert b.rebalance(now_s=0.0) == []
    b2 = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b"}, hysteresis=0.1, reassignment_cost_s=0.0)
    b2.set_demand_hint("a", 1050)
    b2.set_demand_hint("b", 1000)  # a: 5.25 s on 2 replicas, b: 10 s on 1
    assert b2.rebalance(now_s=0.0) == []  # moving one a->b would make a the 10.5 s bottleneck


def test_rebalance_interval_is_respected() -> None:
    b = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b"}, rebalance_interval_s=5.0, reassignment_cost_s=0.0)
    b.set_demand_hint("a", 100)
    b.set_demand_hint("b", 10_000)
    assert len(b.maybe_rebalance(0.0)) == 1  # a keeps its last replica: it has demand
    b.set_demand_hint("a", 0)
    assert b.maybe_rebalance(1.0) == []  # within the interval
    assert len(b.maybe_rebalance(5.0)) == 1  # a has no demand now: its last replica moves
    assert b.replica_counts() == {"a": 0, "b": 3}


def test_move_drains_then_loads_then_serves_queued() -> None:
    b = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b"}, reassignment_cost_s=0.0)
    running = b.submit("a", 10)
    assert running.replica_id == "r0"
    b.set_demand_hint("b", 100_000)
    (move,) = b.rebalance(now_s=0.0)
    assert move.replica_id in {"r0", "r1"}
    views = {v.replica_id: v for v in b.replicas()}
    moved = views[move.replica_id]
    if move.replica_id == "r0":
        assert moved.phase is ReplicaPhase.DRAINING
        b.finish(running.request_id)
    assert [m.replica_id for m in b.replicas_awaiting_load()] == [move.replica_id]
    b.begin_load(move.replica_id)
    with pytest.raises(FailedPrecondition):
        b.begin_load(move.replica_id)
    b.complete_load(move.replica_id)
    assert {v.replica_id: v.model_key for v in b.replicas()}[move.replica_id] == "b"


def test_starved_group_gets_a_replica_regardless_of_hysteresis() -> None:
    b = make({"r0": "a", "r1": "a"}, {"a": "a", "b": "b"}, hysteresis=0.9, reassignment_cost_s=1e9)
    b.set_demand_hint("a", 1_000_000)
    waiting = b.submit("b", 5)
    assert waiting.replica_id is None
    moves = b.maybe_rebalance(now_s=0.0)
    assert [(m.to_model_key) for m in moves] == ["b"]
    (pending,) = b.replicas_awaiting_load()
    b.complete_load(pending.replica_id)
    placed = b.place_queued()
    assert [t.request_id for t in placed] == [waiting.request_id]
    assert placed[0].replica_id == pending.replica_id


def test_static_keeps_its_shares_but_never_leaves_a_group_with_queued_requests_and_no_replica() -> None:
    """rollout.balancing static (rebalance off): more groups than replicas, as when a pinned evaluation round's keys
    join the job's, left the groups dealt nothing waiting forever (rolloutd's next rebuild, which would free a
    replica, waits for those very requests to drain). The starved group takes a replica from a group without demand;
    nothing else moves, and a group with demand keeps its last replica."""
    b = make({"r0": "a", "r1": "b"}, {"a": "a", "b": "b", "c": "c"}, rebalance_enabled=False,
             reassignment_cost_s=0.0)
    b.set_demand_hint("a", 1_000_000)  # demand alone moves nothing under static shares
    b.set_demand_hint("b", 0)
    assert b.maybe_rebalance(0.0) == [] and b.rebalance(0.0) == []
    busy = b.submit("a", 50)
    waiting = b.submit("c", 5)
    assert waiting.replica_id is None and b.starved_agents() == {"c"} and not b.settled(1.0)
    (move,) = b.maybe_rebalance(1.0)
    assert (move.replica_id, move.from_model_key, move.to_model_key) == ("r1", "b", "c")  # a has demand: it keeps r0
    (pending,) = b.replicas_awaiting_load()
    b.begin_load(pending.replica_id)
    b.complete_load(pending.replica_id)
    assert [(t.request_id, t.replica_id) for t in b.place_queued()] == [(waiting.request_id, "r1")]
    # b now has queued requests and no replica, and every group has demand: no donor, nothing moves
    stuck = b.submit("b", 5)
    assert stuck.replica_id is None and b.maybe_rebalance(2.0) == [] and b.replica_counts() == {"a": 1, "b": 0, "c": 1}
    b.finish(waiting.request_id)
    b.set_demand_hint("c", 0)
    (back,) = b.rebalance(3.0)  # c's demand is gone: b takes its replica
    assert (back.replica_id, back.to_model_key) == ("r1", "b") and busy.replica_id == "r0"


def test_shared_base_model_agents_share_replicas() -> None:
    b = make({"r0": "base", "r1": "other"}, {"a": "base", "b": "base", "c": "other"})
    assert b.submit("a", 5).replica_id == "r0"
    assert b.submit("b", 5).replica_id == "r0"
    assert b.replica_counts() == {"base": 1, "other": 1}


def test_token_estimator_starts_pessimistic_and_learns() -> None:
    est = TokenEstimator(prefill_token_weight=0.0, ema_alpha=0.5)
    assert est.estimate("a", 100, max_new_tokens=64) == 64
    est.observe("a", 16)
    assert est.estimate("a", 100, max_new_tokens=64) == 40
    assert est.estimate("a", 100, max_new_tokens=64, n=4) == 160


def test_equal_split_deals_replicas() -> None:
    specs = equal_split(["r0", "r1", "r2"], ["y", "x"])
    assert [(s.replica_id, s.model_key) for s in specs] == [("r0", "x"), ("r1", "y"), ("r2", "x")]


def test_simulation_is_deterministic() -> None:
    workload = skewed_workload(seed=3, tasks=8)
    assert simulate(workload, "hierarchical") == simulate(workload, "hierarchical")


def test_hierarchical_beats_round_robin_and_static_on_skewed_workload() -> None:
    workload = skewed_workload(seed=0)
    tokens = workload.tokens_per_agent()
    assert tokens["solver"] >= 10 * tokens["planner"]  # clearly skewed
    results = compare(workload)
    print("\n" + format_table(list(results.values())))
    hierarchical = results["hierarchical"]
    assert hierarchical.makespan_s < 0.9 * results["round-robin"].makespan_s
    assert hierarchical.makespan_s < 0.9 * results["static"].makespan_s
    assert hierarchical.utilisation > results["static"].utilisation
    assert hierarchical.reassignments > 0


def test_removed_replica_can_be_added_back_and_serves_queued_requests() -> None:
    b = make({"r0": "m"}, {"a": "m"})
    running = b.submit("a", 50)  # in flight on r0 when it is removed
    b.remove_replica("r0")
    waiting = b.submit("a", 10)
    assert waiting.replica_id is None  # no replica left: queued
    b.add_replica(ReplicaAssignment("r0", "m", 100.0))
    [placed] = b.place_queued()
    assert placed.request_id == waiting.request_id and placed.replica_id == "r0"
    # The request that ran on r0's previous membership does not count against the new one.
    b.finish(running.request_id)
    [view] = b.replicas()
    assert (view.outstanding_tokens, view.in_flight_requests, view.phase) == (10, 1, ReplicaPhase.SERVING)
    b.finish(placed.request_id)
    assert (b.replicas()[0].outstanding_tokens, b.replicas()[0].in_flight_requests) == (0, 0)


def test_add_replica_rejects_a_served_replica() -> None:
    b = make({"r0": "m"}, {"a": "m"})
    with pytest.raises(AlreadyExists):
        b.add_replica(ReplicaAssignment("r0", "m"))


@pytest.mark.parametrize("scan_group_max", [0, balancer_module.SCAN_GROUP_MAX])
def test_the_group_index_agrees_with_the_replicas_through_moves_loads_and_membership_changes(
        scan_group_max: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing, counts and awaiting loads come from an index rebuilt on change (O(group) per request at scale).

    Run with routing from the load heaps (``SCAN_GROUP_MAX`` 0) and from a pass over each group (the default,
    for groups this small): both pick what a scan of the group picks.

    A random run of submits, finishes, rebalances, loads, rate updates and replica removals: after every operation
    the balancer's answers equal a recount over its replicas' views, and a request is only ever
    placed on a replica serving its group.
    """
    import random

    monkeypatch.setattr(balancer_module, "SCAN_GROUP_MAX", scan_group_max)
    rng = random.Random(7)
    b = make({f"r{i}": "abc"[i % 3] for i in range(9)}, {"a": "a", "b": "b", "c": "c"}, reassignment_cost_s=0.0,
             rebalance_interval_s=0.0, min_residency_s=0.0)
    running: list[int] = []
    removed: list[str] = []
    heaps_used = False
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            task = f"t{rng.randrange(8)}"
            key = rng.choice(["", group_affinity_key(task), episode_affinity_key(task, rng.randrange(4))])
            ticket = b.submit(rng.choice("abc"), rng.randint(1, 5000), key)
            if ticket.replica_id is not None:
                running.append(ticket.request_id)
        elif op < 0.65 and running:
            b.finish(running.pop(rng.randrange(len(running))))
        elif op < 0.75:
            b.set_demand_hint(rng.choice("abc"), rng.choice([0, 10_000, 1_000_000]))
            if rng.random() < 0.3:  # static shares dealt again (no replica is ever left loading here)
                b.even_out(now_s=float(step))
                assert max(b.replica_counts().values()) - min(b.replica_counts().values()) <= 1
            else:
                b.rebalance(now_s=float(step))
        elif op < 0.9:
            for move in b.replicas_awaiting_load():
                b.begin_load(move.replica_id)
                b.complete_load(move.replica_id)
        elif op < 0.91:
            b.forget_affinity(rng.choice([group_affinity_key(f"t{rng.randrange(8)}"), episode_affinity_key("t1", 2)]))
        elif op < 0.92:  # a measured rate (rolloutd feeds them as they change)
            b.set_replica_rate(rng.choice([v.replica_id for v in b.replicas()]), rng.choice([20.0, 100.0, 333.3]))
        elif op < 0.93:  # a measured capacity, counted for every replica
            b.set_every_replica_rate(rng.choice([20.0, 100.0, 333.3]))
        elif op < 0.96 and len(removed) < 3:
            victim = rng.choice([v.replica_id for v in b.replicas()])
            b.remove_replica(victim)
            removed.append(victim)
        elif removed:
            b.add_replica(ReplicaAssignment(removed.pop(), rng.choice("abc"), 100.0))
        for ticket in b.place_queued():
            running.append(ticket.request_id)
        views = b.replicas()
        assert b.replica_counts() == {key: sum(1 for v in views if v.target_model_key == key) for key in "abc"}
        awaiting = [v.replica_id for v in views if v.phase is ReplicaPhase.AWAITING_LOAD]
        assert [m.replica_id for m in b.replicas_awaiting_load()] == awaiting
        ticket = b.submit("a", 1)
        serving_a = {v.replica_id for v in views if v.phase is ReplicaPhase.SERVING and v.model_key == "a"}
        assert (ticket.replica_id in serving_a) if serving_a else ticket.replica_id is None
        b.finish(ticket.request_id)
        _assert_index_is_a_rebuild(b)
        _assert_demand_queues_and_affinity_are_a_recount(b)
        for key in "abc":  # routing from the load heaps picks what a scan of the group picks
            serving = [b._replicas[v.replica_id] for v in views
                       if v.phase is ReplicaPhase.SERVING and v.model_key == key]
            if serving:
                assert b._least_tokens_in_group(key, "") is b._least_tokens_with_affinity(serving, "")
        heaps_used = heaps_used or bool(b._groups().loads)
    assert heaps_used is (scan_group_max == 0)  # the path under test was the one taken


def test_every_replica_rate_at_once_is_each_replica_rate_in_turn() -> None:
    """set_every_replica_rate (the router's measured capacity) leaves what set_replica_rate per replica leaves."""
    one_by_one = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b", "c": "c"})
    at_once = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b", "c": "c"})
    for b in (one_by_one, at_once):
        b.set_demand_hint("c", 1000)
        b.rebalance(0.0)  # a replica moves to c: the index is built and a target differs from its group
    for view in one_by_one.replicas():
        one_by_one.set_replica_rate(view.replica_id, 333.3)
    at_once.set_every_replica_rate(333.3)
    assert at_once.replicas() == one_by_one.replicas()
    assert at_once._groups().rates == one_by_one._groups().rates and at_once._groups().rates["a"] > 0
    assert at_once._groups().incoming == one_by_one._groups().incoming
    _assert_index_is_a_rebuild(at_once)
    with pytest.raises(InvalidArgument):
        at_once.set_every_replica_rate(0.0)


def test_settled_means_the_asks_after_an_event_answer_nothing() -> None:
    """settled(now) (the router's skip) only when starved_agents, maybe_rebalance, replicas_awaiting_load and
    place_queued would all answer nothing; a random run where it is both true and false."""
    import random

    rng = random.Random(11)
    b = make({f"r{i}": "abc"[i % 3] for i in range(6)}, {"a": "a", "b": "b", "c": "c"}, reassignment_cost_s=0.0,
             rebalance_interval_s=5.0, min_residency_s=0.0)
    running: list[int] = []
    outcomes = set()
    for step in range(600):
        now_s = step * 0.5
        op = rng.random()
        if op < 0.45:
            ticket = b.submit(rng.choice("abc"), rng.randint(1, 5000), episode_affinity_key("t", rng.randrange(4)))
            if ticket.replica_id is not None:
                running.append(ticket.request_id)
        elif op < 0.85 and running:
            b.finish(running.pop(rng.randrange(len(running))))
        else:
            b.set_demand_hint(rng.choice("abc"), rng.choice([0, 10_000, 1_000_000]))
        settled = b.settled(now_s)
        outcomes.add(settled)
        if settled:
            assert not b.starved_agents() and b.maybe_rebalance(now_s) == []
            assert b.replicas_awaiting_load() == [] and b.place_queued() == []
            assert b.settled(now_s)  # asking changed nothing
        else:  # what the router does then
            b.maybe_rebalance(now_s)
            for move in b.replicas_awaiting_load():
                b.begin_load(move.replica_id)
                b.complete_load(move.replica_id)
            running.extend(t.request_id for t in b.place_queued())
    assert outcomes == {True, False}


def _assert_demand_queues_and_affinity_are_a_recount(b: HierarchicalBalancer) -> None:
    """What the balancer keeps per event (O(what changed)) equals a recount over its tickets and keys."""
    tickets = list(b._tickets.values())
    hints = b._demand_hint_tokens
    assert b.model_demand_tokens() == {key: sum(t.estimated_tokens for t in tickets if t.agent == key)
                                       + hints.get(key, 0) for key in "abc"}
    assert all(b.demand_tokens(a) == sum(t.estimated_tokens for t in tickets if t.agent == a) + hints.get(a, 0)
               for a in "abc")
    assert b._waiting_groups == {key for key, queue in b._queued.items() if queue}
    b._affinity.check()
    live = {v.replica_id for v in b.replicas()}
    assert all(replica_id in live for _, replica_id in b._affinity.items())  # a removed replica's keys went


def _assert_index_is_a_rebuild(b: HierarchicalBalancer) -> None:
    """The group index, as moves patched it, equals one rebuilt from the replicas (the same floats too)."""
    def shape(index: object) -> tuple[object, ...]:
        return (index.counts, index.rates,  # type: ignore[attr-defined]
                {k: v for k, v in index.incoming.items() if v},  # type: ignore[attr-defined]
                {k: [r.spec.replica_id for r in v] for k, v in index.serving.items() if v},  # type: ignore[attr-defined]
                {k: [r.spec.replica_id for r in v] for k, v in index.targets.items() if v})  # type: ignore[attr-defined]

    kept = shape(b._groups())
    b._groups_cache = None
    assert kept == shape(b._groups())


def test_a_group_measured_slow_gets_replicas_the_configured_rate_and_cost_would_not_give_it() -> None:
    """The balancer decides on measured rates and load seconds (rolloutd/replica_rates.py feeds them).

    4,000 tokens of demand on two replicas: at the configured 1,000 tokens/s each they drain in
    2 s and no move pays a 10 s load; measured at 20 tokens/s each they drain in 100 s and
    replicas move. The donors, measured at 1 token/s under their light load, are counted at the
    receiving group's mean (20), and the measured 0.3 s load alone is enough at the configured rate.
    """
    def balancer(**config: object) -> HierarchicalBalancer:
        b = HierarchicalBalancer([ReplicaAssignment(f"r{i}", "abc"[i // 2], 1000.0) for i in range(6)],
                                 [AgentSpec(a, a) for a in "abc"], BalancerConfig(**config))  # type: ignore[arg-type]
        for _ in range(40):
            b.submit("a", 100)
        return b

    fixed = balancer()
    assert fixed.rebalance(now_s=10.0) == [] and fixed.replica_counts()["a"] == 2
    measured = balancer()
    for replica_id, rate in {"r0": 20.0, "r1": 20.0, "r2": 1.0, "r3": 1.0, "r4": 1.0, "r5": 1.0}.items():
        measured.set_replica_rate(replica_id, rate)
    moves = measured.rebalance(now_s=10.0)
    assert moves and all(m.to_model_key == "a" for m in moves) and measured.replica_counts()["a"] > 2
    assert {v.tokens_per_s for v in measured.replicas() if v.target_model_key == "a"} == {20.0}
    pinned = balancer(measured_rates=False)  # the donors carry their own 1 token/s: too little to pay
    for replica_id, rate in {"r0": 20.0, "r1": 20.0, "r2": 1.0, "r3": 1.0, "r4": 1.0, "r5": 1.0}.items():
        pinned.set_replica_rate(replica_id, rate)
    assert pinned.rebalance(now_s=10.0) == []
    cheap_load = balancer()
    cheap_load.set_reassignment_cost_s(0.3)
    assert cheap_load.reassignment_cost_s == 0.3 and cheap_load.rebalance(now_s=10.0)
    with pytest.raises(InvalidArgument):
        cheap_load.set_replica_rate("r0", 0.0)
    with pytest.raises(InvalidArgument):
        cheap_load.set_reassignment_cost_s(-1.0)


def test_a_full_replica_takes_no_more_requests_and_the_rest_wait_in_the_balancer() -> None:
    b = make({"r0": "m", "r1": "m"}, {"a": "m"}, dispatch_kv_factor=1.0)
    for replica in ("r0", "r1"):
        b.set_replica_kv_capacity(replica, 300)
    placed = [b.submit("a", 10, kv_tokens=100) for _ in range(6)]  # three fit on each replica
    assert sorted(t.replica_id or "" for t in placed) == ["r0"] * 3 + ["r1"] * 3
    waiting = [b.submit("a", 10, kv_tokens=100) for _ in range(2)]
    assert [t.replica_id for t in waiting] == [None, None] and b.queued("a") == waiting
    assert b.demand_tokens("a") == 80  # the waiting requests are demand
    b.finish(placed[0].request_id)  # a place frees on r0: the oldest waiting request takes it
    (moved,) = b.place_queued()
    assert moved.request_id == waiting[0].request_id and moved.replica_id == placed[0].replica_id
    assert b.queued("a") == [waiting[1]]
    # a request larger than a replica's capacity still runs on an idle one; factor 0 sends everything at once
    lone = make({"r0": "m"}, {"a": "m"}, dispatch_kv_factor=1.0)
    lone.set_replica_kv_capacity("r0", 300)
    assert lone.submit("a", 10, kv_tokens=1000).replica_id == "r0"
    assert lone.submit("a", 10, kv_tokens=1).replica_id is None
    unbounded = make({"r0": "m"}, {"a": "m"})
    unbounded.set_replica_kv_capacity("r0", 300)
    assert all(unbounded.submit("a", 10, kv_tokens=1000).replica_id == "r0" for _ in range(3))
    with pytest.raises(InvalidArgument, match="KV capacity"):
        b.set_replica_kv_capacity("r0", 0)
    with pytest.raises(InvalidArgument, match="kv_tokens"):
        b.submit("a", 10, kv_tokens=-1)
    with pytest.raises(InvalidArgument, match="dispatch_kv_factor"):
        BalancerConfig(dispatch_kv_factor=-1.0)


def test_a_replica_moved_to_a_saturated_agent_takes_its_backlog_and_the_donor_drains_one_batch() -> None:
    b = make({"r0": "heavy", "r1": "light"}, {"h": "heavy", "l": "light"}, dispatch_kv_factor=1.0,
             reassignment_cost_s=0.0, hysteresis=0.0)
    for replica in ("r0", "r1"):
        b.set_replica_kv_capacity(replica, 200)
    running = [b.submit("h", 100, kv_tokens=100) for _ in range(2)]
    backlog = [b.submit("h", 100, kv_tokens=100) for _ in range(6)]
    assert {t.replica_id for t in running} == {"r0"} and all(t.replica_id is None for t in backlog)
    light = b.submit("l", 1, kv_tokens=100)
    b.finish(light.request_id)  # the light agent has no demand left: its replica may go
    (move,) = b.rebalance(now_s=0.0)
    assert (move.replica_id, move.to_model_key) == ("r1", "heavy")
    (load,) = b.replicas_awaiting_load()  # r1 ran nothing: it loads at once
    b.begin_load(load.replica_id)
    b.complete_load(load.replica_id)
    taken = b.place_queued()  # the backlog waited in the balancer, so the new replica takes two of it now
    assert [t.replica_id for t in taken] == ["r1", "r1"]
    assert [t.request_id for t in taken] == [t.request_id for t in backlog[:2]]
    # moving r0 back: it drains its two running requests only, not the four still waiting
    b.submit("l", 100, kv_tokens=100)  # r1 serves heavy now: the light agent's request waits for a replica
    (back,) = b.rebalance(now_s=10.0)
    assert back.to_model_key == "light" and b.replica(back.replica_id).phase is ReplicaPhase.DRAINING
    donor = running if back.replica_id == "r0" else taken
    for ticket in donor:
        b.finish(ticket.request_id)
    assert [m.replica_id for m in b.replicas_awaiting_load()] == [back.replica_id]


def test_the_interleaving_benchmark_gives_every_balancer_the_same_requests() -> None:
    """benchmarks.balancer_interleave: whatever K, each balancer routes the same requests to the same replicas."""
    from benchmarks.balancer_interleave import run

    alone, three = run(1, 200), run(3, 200)
    assert three.loads == alone.loads * 3 and sum(alone.loads[0]) > 0
    assert alone.cpu_per_request_us > 0 and three.cpu_per_request_us > 0


def test_route_and_release_are_the_calls_they_replace() -> None:
    """route = the estimator's estimate then submit; release = finish, the estimator's observations, then settled.

    Two twins through one random run (queued requests, KV-bounded replicas, moves): the same tickets, loads,
    estimates and answers. An unknown request's release raises NotFound and observes nothing.
    """
    import random

    rng = random.Random(5)
    config = dict(reassignment_cost_s=0.0, rebalance_interval_s=5.0, min_residency_s=0.0, dispatch_kv_factor=1.0)
    fused = make({f"r{i}": "ab"[i % 2] for i in range(4)}, {"a": "a", "b": "b", "c": "c"}, **config)
    apart = make({f"r{i}": "ab"[i % 2] for i in range(4)}, {"a": "a", "b": "b", "c": "c"}, **config)
    estimator = TokenEstimator()
    for b in (fused, apart):
        for replica in ("r0", "r1", "r2", "r3"):
            b.set_replica_kv_capacity(replica, 20_000.0)
    running: list[tuple[int, str]] = []
    for step in range(500):
        now_s = step * 0.5
        if rng.random() < 0.55:
            agent, prompt, new, n = rng.choice("abc"), rng.randint(1, 400), rng.randint(1, 3000), rng.randint(1, 2)
            key = episode_affinity_key(f"t{rng.randrange(3)}", rng.randrange(4))
            ticket = fused.route(agent, prompt, new, n, key, kv_tokens=n * (prompt + new))
            assert ticket == apart.submit(agent, estimator.estimate(agent, prompt, new, n), key,
                                          kv_tokens=n * (prompt + new))
            running.append((ticket.request_id, agent))
        elif running:
            request_id, agent = running.pop(rng.randrange(len(running)))
            lengths = [rng.randint(1, 3000) for _ in range(rng.randint(0, 2))]
            settled = fused.release(request_id, now_s, lengths)
            apart.finish(request_id)
            for tokens in lengths:
                estimator.observe(agent, tokens)
            assert settled == apart.settled(now_s)
        if not fused.settled(now_s):
            for b in (fused, apart):
                b.maybe_rebalance(now_s)
                for move in b.replicas_awaiting_load():
                    b.begin_load(move.replica_id)
                    b.complete_load(move.replica_id)
            assert fused.place_queued() == apart.place_queued()
        assert fused.replicas() == apart.replicas()
        assert [fused.estimator.estimate(a, 10, 3000) for a in "abc"] == [
            estimator.estimate(a, 10, 3000) for a in "abc"]
    means = dict(fused.estimator._mean_response_tokens)
    with pytest.raises(NotFound):
        fused.release(10**9, 0.0, [5])
    assert fused.estimator._mean_response_tokens == means
