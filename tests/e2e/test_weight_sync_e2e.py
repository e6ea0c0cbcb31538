"""``rollout.weight_sync: distributed`` on the session's local cluster: every daemon's part, end to end.

rolloutd watches the job's versions under its worker id, so orchestratord names it a peer of
each announced version; traind's rank 0 waits for its post, plans the group and broadcasts
while the checkpoint is committed; the replica receives every version it serves. The job
still trains every step exactly once. Bit-equality of sync and async runs over the broadcast,
and two rolloutds sharing one agent's group on real daemons, are ``python -m
benchmarks.weight_sync_equivalence [--rolloutds 2]`` (two jobs per pair: over CI's budget); the
protocol with two rolloutds is in tests/rolloutd/test_weight_sync.py.
"""

from __future__ import annotations

import pytest
from e2e_support import (
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    broadcast_counts,
    rolloutd_log,
)


@pytest.mark.timeout(240)
def test_a_distributed_sync_job_reaches_the_replica_by_broadcast(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    spec = e2e.spec(total_steps=2, rollout={"weight_sync": "distributed"})
    job_id = e2e.client.submit(spec)

    info = e2e.wait_job(job_id)

    assert_succeeded(e2e, info, spec["total_steps"])
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    counts = broadcast_counts(rolloutd_log(e2e), job_id)
    # One replica serves both agents in turn: a version of the agent it does not serve then is
    # skipped (loaded from the checkpoint when the replica turns to that agent).
    assert counts["received"] >= 1 and counts["failed"] == 0, (counts, e2e.log_tails())
    assert counts["received"] + counts["skipped"] == spec["total_steps"] * len(spec["agents"]), counts
