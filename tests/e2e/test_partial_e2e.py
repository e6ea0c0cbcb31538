"""Interruptible rollouts end to end: a partial-rollout job on the session's local cluster.

One agent writes a long message (tests/e2e/long_solo.py) on the cluster's one replica and one
slot. At ``max_staleness`` 1 the pipeline's own order puts a commit inside a running batch:
batches 0 and 1 roll out on v0 together (G seconds); step 0 trains (T) and commits v1, which
starts batch 2; step 1 trains batch 1, already there, and commits v2 at T into batch 2's G. So
as long as a generation outlasts a training step (384 tokens against a one-micro-batch step,
several times over on any machine) v2 interrupts batch 2's running generations (``in_place``:
the engine keeps them and continues on the new weights), whatever the scheduling noise. The job
still trains every step exactly once, and what stored holds is consistent: per-token version
spans inside the staleness window, the behaviour version the oldest token's. No learning
assertion here: benchmarks/partial_learning.py. (A two-agent job shares the replica and the slot
between its agents, and whether a commit finds a generation running is then up to scheduling.)
"""

from __future__ import annotations

import pytest
from e2e_support import E2ECluster, assert_exactly_once, assert_one_commit_per_step, assert_succeeded
from partial_support import interruptions, partial_spec, span_summaries

LONG_ENV = "long_solo:LongSolo"


@pytest.mark.timeout(240)
def test_interrupted_job_trains_exactly_once_with_consistent_spans(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    raw = e2e.spec(
        total_steps=3,  # batch 2 needs v1 and rolls out while step 1 trains; step 1's commit interrupts it
        batch={"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8},
        environment={"entrypoint": LONG_ENV, "config": {"num_objects": 4, "long_message_tokens": 384}},
    )
    raw["agents"] = [a for a in raw["agents"] if a["name"] == "sender"]
    spec = partial_spec(raw)
    job_id = e2e.client.submit(spec)

    info = e2e.wait_job(job_id)

    assert_succeeded(e2e, info, spec["total_steps"])
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    interrupted = interruptions([p.log_path for p in e2e.cluster.daemons.values() if p.kind == "rolloutd"], job_id)
    assert interrupted.get("sender", 0) >= 1, f"no interruption of the sender: {interrupted}\n{e2e.log_tails()}"
    manifests = {a["name"]: e2e.manifests(job_id, a["name"]) for a in spec["agents"]}
    summaries = span_summaries(manifests, e2e.cluster.daemon("stored").address, job_id, max_staleness=1)
    sender = summaries["sender"]
    assert sender.experiences == spec["total_steps"] * 8
    # An in-place interruption lands on running generations: some sender samples carry two versions.
    assert sender.multi_span >= 1 and sender.tokens_newer_than_behaviour >= 1, (sender, interrupted)
