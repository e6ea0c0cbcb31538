"""HierarchicalBalancer.add_agents / remove_agents: agents join and leave while the others' requests run.

rolloutd used to rebuild its balancer for every job or evaluation round that joined or left, after every
request in flight on it had drained: with long generations a stall of every other job. These pin the
incremental change: nothing of the agents that stay is touched, a new group is served through the usual
starvation rule, and a group left without agents hands its replicas on as ordinary moves.
"""

from __future__ import annotations

import pytest

from flexmarl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, ReplicaAssignment, ReplicaPhase

pytestmark = pytest.mark.timeout(30)


def make(replicas: dict[str, str], agents: dict[str, str], **config: object) -> HierarchicalBalancer:
    return HierarchicalBalancer(
        [ReplicaAssignment(r, m, 100.0) for r, m in replicas.items()],
        [AgentSpec(a, m) for a, m in agents.items()],
        BalancerConfig(**config),  # type: ignore[arg-type]
    )


def serve_moves(b: HierarchicalBalancer) -> list[str]:
    """Does what the router does for each awaited load: begin, complete. Returns the replicas loaded."""
    loaded = []
    while moves := b.replicas_awaiting_load():
        for move in moves:
            b.begin_load(move.replica_id)
            b.complete_load(move.replica_id)
            loaded.append(move.replica_id)
    return loaded


def test_a_joining_agent_is_served_by_a_replica_moved_to_it_and_the_running_requests_stay_put() -> None:
    b = make({"r0": "a", "r1": "a", "r2": "a"}, {"a": "a"}, rebalance_interval_s=0.0, reassignment_cost_s=0.0)
    running = b.submit("a", 500)
    b.add_agents([AgentSpec("e", "e")])
    assert b.replica_counts() == {"a": 3, "e": 0}
    waiting = b.submit("e", 50)
    assert waiting.replica_id is None and b.starved_agents() == {"e"}
    moves = b.rebalance(1.0)
    assert [(m.from_model_key, m.to_model_key) for m in moves][:1] == [("a", "e")]
    assert running.replica_id not in {m.replica_id for m in moves}  # a busy replica is not the one taken
    serve_moves(b)
    placed = b.place_queued()
    assert [t.request_id for t in placed] == [waiting.request_id] and placed[0].replica_id is not None
    assert b.finish(running.request_id).replica_id == running.replica_id  # counted where it ran, untouched


def test_a_group_left_without_agents_hands_its_replicas_to_the_fewest_first() -> None:
    b = make({"r0": "a", "r1": "b", "r2": "e", "r3": "e", "r4": "e"}, {"a": "a", "b": "b", "e": "e"},
             rebalance_enabled=True)
    busy = b.submit("a", 100)
    moves = b.remove_agents(["e"], 5.0)
    # one each then (a and b), the tie to a for its demand, then b; a fresh count after each move
    assert [m.to_model_key for m in moves] == ["a", "b", "a"]
    assert {m.from_model_key for m in moves} == {"e"}
    assert all(b.replica(m.replica_id).phase is ReplicaPhase.AWAITING_LOAD for m in moves)  # type: ignore[union-attr]
    assert sorted(serve_moves(b)) == ["r2", "r3", "r4"]
    assert sum(b.replica_counts().values()) == 5 and set(b.replica_counts()) == {"a", "b"}
    with pytest.raises(NotFound):
        b.submit("e", 1)
    assert b.finish(busy.request_id).replica_id == "r0"


def test_a_replica_loading_for_a_group_that_leaves_is_handed_on_when_its_load_completes() -> None:
    b = make({"r0": "a", "r1": "a"}, {"a": "a"}, rebalance_interval_s=0.0, reassignment_cost_s=0.0)
    b.add_agents([AgentSpec("e", "e")])
    asked = b.submit("e", 10)
    moves = b.rebalance(1.0)
    assert moves and {m.to_model_key for m in moves} == {"e"}
    for move in moves:
        b.begin_load(move.replica_id)  # the router is loading e's weights onto it
    b.finish(asked.request_id)  # the round was cancelled: its request ends unserved
    assert b.remove_agents(["e"], 2.0) == []  # a loading replica is left to its load
    for move in moves:
        b.complete_load(move.replica_id)
        view = b.replica(move.replica_id)
        assert view is not None and view.target_model_key == "a" and view.phase is ReplicaPhase.AWAITING_LOAD
    assert sorted(serve_moves(b)) == sorted(m.replica_id for m in moves)
    assert b.replica_counts() == {"a": 2}


def test_only_agents_without_requests_leave_and_bad_changes_change_nothing() -> None:
    b = make({"r0": "a", "r1": "b"}, {"a": "a", "b": "b"})
    ticket = b.submit("b", 10)
    with pytest.raises(FailedPrecondition, match="'b'"):
        b.remove_agents(["b"], 1.0)
    with pytest.raises(NotFound, match="'x'"):
        b.remove_agents(["a", "x"], 1.0)
    with pytest.raises(FailedPrecondition, match="no agent would be left"):
        b.finish(ticket.request_id)
        b.remove_agents(["a", "b"], 1.0)
    with pytest.raises(AlreadyExists, match="'a'"):
        b.add_agents([AgentSpec("c", "c"), AgentSpec("a", "a")])
    with pytest.raises(InvalidArgument, match="both LoRA"):
        b.add_agents([AgentSpec("c", "b", adapter=True)])
    with pytest.raises(InvalidArgument, match=">= 1"):
        b.add_agents([AgentSpec("c", "pool", adapter=True)], {"pool": 0})
    assert b.replica_counts() == {"a": 1, "b": 1}
    assert b.submit("a", 1).replica_id == "r0" and b.submit("b", 1).replica_id == "r1"
    with pytest.raises(NotFound):
        b.submit("c", 1)


def test_one_lora_agent_of_a_pool_leaves_and_the_pool_stays_with_its_bound() -> None:
    b = HierarchicalBalancer([ReplicaAssignment("r0", "pool", 100.0)], [AgentSpec("x", "pool", adapter=True)],
                             BalancerConfig(), adapter_slots={"pool": 1})
    b.add_agents([AgentSpec("y", "pool", adapter=True)])
    assert b.remove_agents(["x"], 1.0) == []
    first = b.submit("y", 10, adapter="y@v1")
    second = b.submit("y", 10, adapter="y@v2")  # one adapter slot: the second name waits
    assert first.replica_id == "r0" and second.replica_id is None
    assert b.adapter_slots_free("r0") == 0


def test_a_hint_of_an_agent_that_left_is_forgotten() -> None:
    b = make({"r0": "a", "r1": "b"}, {"a": "a", "b": "b"})
    b.set_demand_hints({"a": 100, "b": 500})
    b.remove_agents(["b"], 1.0)
    assert b.model_demand_tokens() == {"a": 100}
    b.add_agents([AgentSpec("b", "b")])
    assert b.demand_tokens("b") == 0


def test_static_shares_are_evened_out_by_the_fewest_moves_least_loaded_first() -> None:
    b = make({f"r{i}": "a" if i < 4 else "b" for i in range(6)}, {"a": "a", "b": "b"}, rebalance_enabled=False)
    running = [b.submit("a", 100) for _ in range(3)]  # r0-r2 busy, r3 idle
    b.add_agents([AgentSpec("e", "e"), AgentSpec("f", "f")])
    moves = b.even_out(1.0)
    # 4/2/0/0 -> 2/2/1/1: two moves, both from a (the most replicas), each to the group with the fewest
    assert [(m.replica_id, m.from_model_key, m.to_model_key) for m in moves] == [("r3", "a", "e"), ("r0", "a", "f")]
    assert sorted(b.replica_counts().values()) == [1, 1, 2, 2]
    assert b.replica("r0").phase is ReplicaPhase.DRAINING  # its request runs on, then it loads
    assert b.even_out(2.0) == []  # already even: nothing moves
    assert serve_moves(b) == ["r3"]
    assert b.finish(running[0].request_id).replica_id == "r0"
    assert serve_moves(b) == ["r0"]

    b.remove_agents(["e", "f"], 3.0)  # their replicas go home, one to each of a and b
    serve_moves(b)
    assert b.replica_counts() == {"a": 3, "b": 3} and b.even_out(4.0) == []


def test_even_out_moves_no_loading_replica_and_leaves_shares_one_apart() -> None:
    b = make({"r0": "a", "r1": "a", "r2": "a", "r3": "b"}, {"a": "a", "b": "b"}, rebalance_enabled=False)
    assert [(m.replica_id, m.to_model_key) for m in b.even_out(0.0)] == [("r0", "b")]  # 3/1 -> 2/2
    b = make({"r0": "a", "r1": "a", "r2": "b"}, {"a": "a", "b": "b"}, rebalance_enabled=False)
    assert b.even_out(0.0) == []  # 2/1: as an equal split of 3 over 2 deals it
    b = make({"r0": "a", "r1": "a", "r2": "a"}, {"a": "a"}, rebalance_enabled=False)
    b.add_agents([AgentSpec("e", "e")])
    assert [m.replica_id for m in b.even_out(1.0)] == ["r0"]
    b.begin_load("r0")  # loading for e: counted there, not movable
    b.remove_agents(["a"], 2.0)  # r1 and r2 go to e as well: e holds three, one of them loading
    b.add_agents([AgentSpec("f", "f")])
    assert [(m.replica_id, m.to_model_key) for m in b.even_out(3.0)] == [("r1", "f")]
    assert b.replica_counts() == {"e": 2, "f": 1}
