"""``rollout.weight_sync: distributed`` on the session's local cluster: every daemon's part, end to end.

rolloutd watches the job's versions under its worker id, so orchestratord names it a peer of
each announced version; traind's rank 0 waits for its post, plans the group and broadcasts
while the checkpoint is committed; the replica receives every version it serves. Over the
broadcast, async with ``max_staleness: 0`` still trains bit for bit what sync trains (the pair
of tests/e2e/test_equivalence.py). More pairs, and two rolloutds sharing one agent's group on
real daemons, are ``python -m benchmarks.weight_sync_equivalence [--rolloutds 2]`` (over CI's
budget); the protocol with two rolloutds is in tests/rolloutd/test_weight_sync.py.
"""

from __future__ import annotations

import pytest
from e2e_support import E2ECluster, assert_exactly_once, assert_one_commit_per_step, broadcast_counts, rolloutd_log
from test_equivalence import STEPS, assert_equal_and_trained, cases, run_pair


@pytest.mark.timeout(480)
def test_over_the_broadcast_async_trains_bit_for_bit_what_sync_trains(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    spec = cases(e2e.models_dir)["signaling-s0"]
    spec = dict(spec, rollout={**spec.get("rollout", {}), "weight_sync": "distributed"})

    sync, async_ = run_pair(e2e, "signaling-distributed", spec)

    assert_equal_and_trained("signaling-distributed", sync, async_, spec)
    log = rolloutd_log(e2e)
    for mode in ("sync", "async"):
        job_id = f"eq-signaling-distributed-{mode}"
        assert_one_commit_per_step(e2e, job_id, spec)
        assert_exactly_once(e2e, job_id, spec)
        counts = broadcast_counts(log, job_id)
        # One replica serves both agents in turn: a version of the agent it does not serve then is
        # skipped (loaded from the checkpoint when the replica turns to that agent).
        assert counts["received"] >= 1 and counts["failed"] == 0, (mode, counts, e2e.log_tails())
        assert counts["received"] + counts["skipped"] == STEPS * len(spec["agents"]), (mode, counts)
