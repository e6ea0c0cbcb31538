"""The balancer's affinity keys and their reverse indexes (rolloutd/affinity_map.py)."""

from __future__ import annotations

from rolloutd.affinity_map import AffinityMap


def test_forgetting_a_replica_or_a_task_drops_exactly_its_keys_and_the_bound_drops_the_oldest() -> None:
    keys = AffinityMap(max_keys=5)
    for key, replica_id in [("t1", "r0"), ("t1#0", "r0"), ("t1#1", "r1"), ("t10#0", "r0"), ("t2#0#1", "r1")]:
        keys.remember(key, replica_id)
    keys.remember("t1#1", "r0")  # served elsewhere now: r1 no longer holds it
    keys.check()
    keys.forget_replica("r1")
    assert dict(keys.items()) == {"t1": "r0", "t1#0": "r0", "t10#0": "r0", "t1#1": "r0"}
    keys.forget_tree("t1")  # t1 and t1#..., not t10#0
    assert dict(keys.items()) == {"t10#0": "r0"}
    for index in range(6):
        keys.remember(f"t3#{index}", "r2")
    assert [key for key, _ in keys.items()] == [f"t3#{i}" for i in range(1, 6)]  # t10#0 and t3#0 dropped
    keys.check()
    keys.forget_tree("t3#4")
    keys.forget_replica("r9")  # none: nothing happens
    assert len(keys) == 4 and keys.get("t3#4") is None and keys.get("t3#5") == "r2"
    keys.check()


def test_a_kept_key_remembered_again_is_the_most_recent_on_the_replica_that_served_it_last() -> None:
    """An episode's next turn remembers its key again: on the same replica or another, no index drifts."""
    keys = AffinityMap(max_keys=3)
    for key in ("t1#0", "t1#1", "t2#0"):
        keys.remember(key, "r0")
    keys.remember("t1#0", "r0")  # the same replica again: only its recency changes
    keys.remember("t1#1", "r1")  # another replica: r0 no longer holds it
    keys.check()
    assert keys.items() == [("t2#0", "r0"), ("t1#0", "r0"), ("t1#1", "r1")]
    keys.remember("t3#0", "r1")  # past the bound: the least recent, t2#0, goes
    keys.check()
    assert keys.items() == [("t1#0", "r0"), ("t1#1", "r1"), ("t3#0", "r1")]
    keys.forget_replica("r1")
    keys.forget_tree("t1")
    assert len(keys) == 0
    keys.check()
