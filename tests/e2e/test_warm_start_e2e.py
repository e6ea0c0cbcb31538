"""A warm-started agent through the daemons: version 0 is its warm start, and batch 0 is sampled by it.

The sender's warm start teaches it one token for every prompt of the game. orchestratord holds
the job's rollouts until traind has published that warm start as version 0, so the sender's
step-0 experiences carry the taught token, and step 0 trains the very policy that sampled them:
its importance ratio is 1 and nothing is clipped. Sampled by the base checkpoint (a random-init
byte-level model), the token would be about 1 in 256 of the messages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dense_signaling import WARM_TOKEN
from e2e_support import E2ECluster, assert_exactly_once, assert_succeeded, weights_dir

from flexmarl.artifacts import checkpoint_tensors


@pytest.mark.timeout(300)
def test_batch_zero_is_sampled_by_the_published_warm_start(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    spec = e2e.spec(total_steps=1)
    sender = next(a for a in spec["agents"] if a["name"] == "sender")
    sender["warm_start"] = {"dataset": "dense_signaling:sender_warm_start", "steps": 30, "lr": 1e-2,
                            "batch_size": 8}
    job_id = e2e.client.submit(spec)
    info = e2e.wait_job(job_id)
    assert_succeeded(e2e, info, 1)
    assert_exactly_once(e2e, job_id, spec)

    records = e2e.stored_experiences(job_id, "sender")
    episodes = spec["batch"]["prompts_per_step"] * spec["batch"]["group_size"]
    assert len(records) == episodes and {r.behavior_version for r in records} == {0}
    taught = sum(int(r.response_token_ids[0]) == WARM_TOKEN for r in records)
    assert taught >= 0.9 * episodes, f"only {taught} of {episodes} step-0 messages carry the warm start's token"

    # Step 0 trained the policy that sampled it: every token's ratio is 1 (engine and trainer agree).
    (row,) = [r for r in e2e.client.history(job_id) if r.agent == "sender"]
    assert row.figures["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert row.figures["clip_fraction"] == 0.0

    # Version 0 is published beside v1 and differs from the base checkpoint.
    commit = e2e.commits(job_id, "sender")[0]
    v0 = weights_dir(commit["weights_uri"]).parent / "v0"
    base, warm = checkpoint_tensors(Path(sender["model"])), checkpoint_tensors(v0)
    shared = set(base) & set(warm)  # the published copy also names the tied lm_head
    assert shared and any(not torch.equal(base[k], warm[k]) for k in shared)
