"""Interruptible rollouts end to end: a partial-rollout job on the session's local cluster.

The sender writes a long message (tests/e2e/long_signaling.py), so its generations are still
running when the previous step commits: the commit interrupts them (``in_place``: the engine
keeps them and continues on the new weights). The job still trains every step exactly once, and
what stored holds is consistent: per-token version spans inside the staleness window, the
behaviour version the oldest token's. No learning assertion here: benchmarks/partial_learning.py.
"""

from __future__ import annotations

import pytest
from e2e_support import E2ECluster, assert_exactly_once, assert_one_commit_per_step, assert_succeeded
from partial_support import interruptions, partial_spec, span_summaries

LONG_ENV = "long_signaling:LongSignaling"


@pytest.mark.timeout(240)
def test_interrupted_job_trains_exactly_once_with_consistent_spans(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    spec = partial_spec(e2e.spec(
        total_steps=3,  # batch 2 needs v1 and rolls out while step 1 trains; step 1's commit interrupts it
        batch={"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8},
        environment={"entrypoint": LONG_ENV, "config": {"num_objects": 4, "long_message_tokens": 96}},
    ))
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
