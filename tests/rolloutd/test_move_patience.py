"""The balancer's patience: a move waits until the demand it answers has lasted as long as the move costs.

Unit tests of :mod:`rolloutd.move_patience` and of the balancer's moves under demand that turns
(the ``shifting`` benchmark shape in small: each group heavy in turn) and demand that stays.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.config import ConfigError, load_config
from flexmarl.errors import InvalidArgument
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, ReplicaAssignment
from rolloutd.config import RolloutConfig
from rolloutd.metrics import RolloutMetrics
from rolloutd.move_patience import DrainTimes, EvictionAborts, MovePatience

GROUPS = ("p", "c", "r")


def make(patience: float, reassignment_cost_s: float = 10.0) -> HierarchicalBalancer:
    """Six replicas, two per group, 100 tokens/s each; a rebalance every 5 s."""
    return HierarchicalBalancer(
        [ReplicaAssignment(f"r{i}", GROUPS[i // 2], 100.0) for i in range(6)],
        [AgentSpec(g, g) for g in GROUPS],
        BalancerConfig(reassignment_cost_s=reassignment_cost_s, move_patience=patience, rebalance_interval_s=5.0,
                       measured_rates=False),
    )


def heavy(b: HierarchicalBalancer, group: str) -> None:
    b.set_demand_hints({g: 20_000 if g == group else 100 for g in GROUPS})


def run_loads(b: HierarchicalBalancer, now_s: float) -> None:
    """The router's part: load every drained replica at once."""
    for move in b.replicas_awaiting_load():
        b.begin_load(move.replica_id, now_s)
        b.complete_load(move.replica_id)


def test_demand_that_turns_faster_than_a_move_is_not_chased() -> None:
    """Each group is heavy for 10 s in turn, a move costs 10 s: after the first deal, patience moves nothing."""
    moves_by_patience = {}
    for patience in (0.0, 1.0):
        b = make(patience)
        moves = 0
        for step in range(24):  # 120 s, a rebalance every 5 s
            now_s = 5.0 * step
            heavy(b, GROUPS[(step // 2) % 3])
            moves += len(b.maybe_rebalance(now_s))
            run_loads(b, now_s)
        moves_by_patience[patience] = moves
    first_deal = make(1.0)
    heavy(first_deal, "p")
    dealt = len(first_deal.maybe_rebalance(0.0))
    assert dealt >= 1
    assert moves_by_patience[1.0] == dealt  # the first deal, at once, and nothing after
    assert moves_by_patience[0.0] >= 5 * dealt  # at once: every turn of the demand moved replicas


def turned_after_the_first_deal(patience: float) -> tuple[HierarchicalBalancer, int]:
    """A balancer that dealt replicas to a heavy p at 0 s (at once: no group was touched), now with c heavy."""
    b = make(patience)
    heavy(b, "p")
    first = b.maybe_rebalance(0.0)
    assert first and {m.to_model_key for m in first} == {"p"}
    run_loads(b, 0.0)
    heavy(b, "c")
    return b, len(first)


def test_demand_that_stays_is_followed_once_it_lasted_the_move_cost() -> None:
    b, dealt = turned_after_the_first_deal(1.0)
    assert b.maybe_rebalance(5.0) == []  # wanted since 5 s; a move costs 10 s
    assert b.maybe_rebalance(10.0) == []
    later = b.maybe_rebalance(15.0)  # wanted for 10 s without a break
    assert later and {m.to_model_key for m in later} == {"c"}
    assert b.reassignments == dealt + len(later)  # what was planned and not made is not counted


def test_a_break_in_the_want_starts_the_wait_again() -> None:
    b, _ = turned_after_the_first_deal(1.0)
    assert b.maybe_rebalance(5.0) == []
    b.set_demand_hints(dict.fromkeys(GROUPS, 0))  # nothing to do: the want ends
    assert b.maybe_rebalance(10.0) == []
    heavy(b, "c")
    assert b.maybe_rebalance(15.0) == []  # wanted again since 15 s
    assert b.maybe_rebalance(20.0) == []
    assert b.maybe_rebalance(25.0)


def test_a_planned_move_not_made_leaves_every_replica_as_it_was() -> None:
    b, _ = turned_after_the_first_deal(1.0)
    before = b.replicas()
    assert b.maybe_rebalance(5.0) == []
    assert b.replicas() == before
    assert b.replicas_awaiting_load() == []


def test_zero_patience_moves_at_once() -> None:
    b, _ = turned_after_the_first_deal(0.0)
    assert {m.to_model_key for m in b.maybe_rebalance(5.0)} == {"c"}


def test_a_drain_costs_what_the_drains_of_its_group_took() -> None:
    """A donor with requests in flight is counted at its group's measured drain (and at one under way)."""
    b = HierarchicalBalancer(
        [ReplicaAssignment(f"r{i}", "a" if i < 3 else "b", 100.0) for i in range(6)],
        [AgentSpec("a", "a"), AgentSpec("b", "b")],
        BalancerConfig(reassignment_cost_s=10.0, move_patience=1.0, rebalance_interval_s=5.0, measured_rates=False))
    running = [b.submit(g, 10) for g in "ab" for _ in range(3)]  # every replica runs one short request
    b.set_demand_hints({"a": 20_000, "b": 100})
    first = b.maybe_rebalance(0.0)  # the first deal: at once; its donors drain
    assert first and {m.from_model_key for m in first} == {"b"}
    donors = {m.replica_id for m in first}
    for ticket in running:
        if ticket.replica_id in donors:
            b.finish(ticket.request_id)
    run_loads(b, 30.0)  # their drains ended: 30 s measured for a replica leaving b
    assert b.drain_estimate_s("b") == 30.0
    registry = CollectorRegistry()  # what Prometheus scrapes from rolloutd's router
    RolloutMetrics(registry).watch_router(lambda: SimpleNamespace(balancer=lambda: b,
                                                                  delivered_tokens_per_s=lambda _replica: 0.0))
    assert registry.get_sample_value("flexmarl_rolloutd_balancer_drain_seconds", {"agent": "b"}) == 30.0
    assert registry.get_sample_value("flexmarl_rolloutd_balancer_drain_seconds", {"agent": "a"}) == 0.0
    for ticket in running:
        if ticket.replica_id not in donors:
            b.finish(ticket.request_id)
    b.set_demand_hints({"a": 100, "b": 20_000})
    assert b.maybe_rebalance(35.0) == []  # a donor of a runs nothing: a 10 s load is its cost
    back = b.maybe_rebalance(45.0)
    assert back and {m.from_model_key for m in back} == {"a"}
    assert b.drain_estimate_s("a") == 0.0  # the donors of a had nothing in flight: no drain under way
    run_loads(b, 45.0)
    for _ in range(12):
        b.submit("b", 10)  # every replica of b runs a request again
    b.set_demand_hints({"a": 20_000, "b": 100})
    assert b.maybe_rebalance(50.0) == []  # wanted since 50 s, a donor of b costs 10 s + its 30 s drain
    assert b.maybe_rebalance(85.0) == []
    assert b.maybe_rebalance(90.0)


def test_a_donor_that_hands_its_generations_on_costs_its_load_alone() -> None:
    """A group whose moved replicas hand their generations on (partial rollouts) is counted at no drain."""
    b = HierarchicalBalancer(
        [ReplicaAssignment(f"r{i}", "a" if i < 3 else "b", 100.0) for i in range(6)],
        [AgentSpec("a", "a"), AgentSpec("b", "b")],
        BalancerConfig(reassignment_cost_s=10.0, move_patience=1.0, rebalance_interval_s=5.0, measured_rates=False))
    assert not b.evicts("b")
    running = [b.submit(g, 10) for g in "ab" for _ in range(3)]  # every replica runs one short request
    b.set_demand_hints({"a": 20_000, "b": 100})
    first = b.maybe_rebalance(0.0)  # the first deal, at once
    assert first and {m.from_model_key for m in first} == {"b"}
    for ticket in running:
        b.finish(ticket.request_id)
    run_loads(b, 30.0)  # a drain of 30 s measured from b
    assert b.drain_estimate_s("b") == 30.0
    b.set_demand_hints({"a": 100, "b": 20_000})
    assert b.maybe_rebalance(35.0) == []
    assert b.maybe_rebalance(45.0)  # back to b
    run_loads(b, 45.0)
    for _ in range(12):
        b.submit("b", 10)  # every replica of b runs a request again
    b.set_demand_hints({"a": 20_000, "b": 100})
    b.set_evicting_groups({"b"})
    assert b.evicts("b") and not b.evicts("a")
    assert b.maybe_rebalance(50.0) == []  # wanted since 50 s: without a drain, the 10 s load is the cost
    moved = b.maybe_rebalance(60.0)
    assert moved and {m.from_model_key for m in moved} == {"b"}  # not 90 s, as a drained donor of b would be
    b.set_evicting_groups(())
    assert not b.evicts("b")


def test_drain_times_average_and_the_ones_under_way() -> None:
    drains = DrainTimes(weight=0.5)
    assert drains.estimate_s("g") == 0.0
    drains.observe("g", 10.0)
    drains.observe("g", 20.0)
    assert drains.estimate_s("g") == 15.0
    drains.note_ongoing(100.0, [("g", 70.0), ("g", 90.0), ("h", 99.0)])
    assert drains.estimate_s("g") == 30.0  # one under way for 30 s already
    assert drains.estimate_s("h") == 1.0
    drains.note_ongoing(101.0, [])
    assert drains.estimate_s("g") == 15.0
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidArgument):
            drains.observe("g", bad)
    with pytest.raises(InvalidArgument):
        DrainTimes(weight=0.0)


def test_move_patience_waits_per_group_without_a_break() -> None:
    patience = MovePatience(2.0)
    assert patience.ripe({"a": 5.0}, 0.0, {"a", "b"})  # no group touched before: at once
    assert not patience.ripe({"a": 5.0}, 1.0, {"a", "c"})  # a was touched: wait 2 x 5 s
    assert not patience.ripe({"a": 5.0, "c": 0.5}, 10.0, {"a", "c"})  # a's 9 s, c's 0 s
    assert patience.ripe({"a": 5.0, "c": 0.5}, 11.0, {"a", "c"})  # a's 10 s, c's 1 s: each 2 x its own cost
    patience.forget()
    assert not patience.ripe({"a": 0.5}, 20.0, {"a"})
    assert patience.ripe({"a": 0.5}, 21.0, {"a"})
    for bad in (-1.0, float("inf")):
        with pytest.raises(InvalidArgument):
            MovePatience(bad)
    with pytest.raises(InvalidArgument):
        BalancerConfig(move_patience=-1.0)


def test_a_handing_on_replica_aborts_again_at_once_for_a_new_generation_else_ever_later() -> None:
    aborts = EvictionAborts(0.0625, 0.5)  # binary fractions: the sums below are exact
    polls = [0.0625 * i for i in range(33)]  # 2 s polled every 62.5 ms, nothing new started
    made = [t for t in polls if aborts.due(t, entries=7)]
    assert made == [0.0, 0.0625, 0.1875, 0.4375, 0.9375, 1.4375, 1.9375]  # waits doubling to the 0.5 s cap
    assert aborts.due(1.96875, entries=8)  # a generation started since: at once, and the waits start again
    assert not aborts.due(2.0, entries=8) and aborts.due(2.03125, entries=8) and not aborts.due(2.125, entries=8)
    assert aborts.count == 9
    for first, most in ((0.0, 1.0), (0.5, 0.1), (0.1, float("inf"))):
        with pytest.raises(InvalidArgument):
            EvictionAborts(first, most)


def test_handing_generations_on_is_a_rolloutd_flag() -> None:
    assert load_config(RolloutConfig, [], prog="rolloutd", env={}).balancer_move_evicts is False
    config = load_config(RolloutConfig, ["--balancer-move-evicts"], prog="rolloutd", env={})
    assert config.balancer_move_evicts is True


def test_the_patience_is_a_rolloutd_flag() -> None:
    assert load_config(RolloutConfig, [], prog="rolloutd", env={}).balancer_move_patience == 1.0
    config = load_config(RolloutConfig, ["--balancer-move-patience", "0"], prog="rolloutd", env={})
    assert config.balancer_move_patience == 0.0
    with pytest.raises(ConfigError, match="balancer_move_patience"):
        load_config(RolloutConfig, ["--balancer-move-patience", "-1"], prog="rolloutd", env={})
