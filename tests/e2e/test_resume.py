"""Resume on a new cluster: a job continued from its checkpoint manifests alone trains what it would have.

Strict mode (``sync``, i.e. max_staleness 0) on the session cluster: job A runs 2 steps; job B,
the same spec with 1 step, runs 1. B's etcd data is then deleted, so what is left of B are its
files (weights, training state, the manifest beside it) in traind's work dir, as after a lost
cluster with a surviving shared path. ``resume`` continues B from that path as a new job, with
A's spec; its one step (step 1, the original's next) must give A's parameters after step 2 bit
for bit. A spec with other agents or other model shapes is refused before anything is created.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from e2e_support import E2ECluster, assert_succeeded, weights_dir

from flexmarl.artifacts import checkpoint_tensors, file_uri, local_path
from flexmarl.cli import materialize_models
from flexmarl.errors import InvalidArgument
from flexmarl.registry import Registry

WAIT_S = 400.0  # a 2-step job takes ~20 s on an idle 2-core machine; generous for a shared one


def _spec(e2e: E2ECluster, total_steps: int) -> dict[str, Any]:
    spec = e2e.spec(seed=3, total_steps=total_steps, pipeline={"mode": "sync"})
    spec["batch"] = {"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8}
    return spec


def _final(e2e: E2ECluster, job_id: str, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    info = e2e.wait_job(job_id, timeout_s=WAIT_S)
    assert_succeeded(e2e, info, steps)
    return {a.agent: checkpoint_tensors(weights_dir(a.weights_uri)) for a in info.agents}


def _wipe_etcd(e2e: E2ECluster, job_id: str) -> None:
    async def wipe() -> None:
        registry = Registry(e2e.cluster.etcd_endpoint, e2e.prefix)
        await registry.connect()
        try:
            await registry.delete_prefix(registry.key(f"jobs/{job_id}/"))
        finally:
            await registry.close()

    asyncio.run(wipe())
    assert not e2e.etcd_prefix_values(f"jobs/{job_id}/")


@pytest.mark.timeout(900)
def test_a_job_resumed_from_its_checkpoints_trains_its_next_step_bit_for_bit(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    e2e.client.submit(_spec(e2e, 2), job_id="resume-a")
    e2e.client.submit(_spec(e2e, 1), job_id="resume-b")
    expected = _final(e2e, "resume-a", 2)
    info_b = e2e.wait_job("resume-b", timeout_s=WAIT_S)
    assert_succeeded(e2e, info_b, 1)
    after_b = {a.agent: checkpoint_tensors(weights_dir(a.weights_uri)) for a in info_b.agents}
    # <work dir>/weights/<job>/<agent>/v1: the checkpoints of B are under <work dir>/checkpoints/<job>.
    work_dir = local_path(info_b.agents[0].weights_uri).parents[3]
    source = file_uri(work_dir / "checkpoints" / "resume-b")
    _wipe_etcd(e2e, "resume-b")

    jobs_before = {j.job_id for j in e2e.client.list_jobs()}
    other_agents = _spec(e2e, 2)
    other_agents["agents"] = other_agents["agents"][:1]
    other_shapes = _spec(e2e, 2)
    other_shapes["agents"][0]["model"] = "tiny://llama?seed=1"
    other_shapes = materialize_models(other_shapes, e2e.models_dir)
    for bad, words in ((other_agents, "agents differ"), (other_shapes, "model shapes differ")):
        with pytest.raises(InvalidArgument, match=words) as refused:  # orchestratord's check, not the preflight
            e2e.client.submit(bad, job_id="resume-bad", preflight=False, resume_from=source)
        assert "\n" not in str(refused.value)
    with pytest.raises(InvalidArgument, match="nothing left to train"):
        e2e.client.resume(source, job_id="resume-bad")  # B's own spec: its 1 step is done
    assert {j.job_id for j in e2e.client.list_jobs()} == jobs_before

    job_id = e2e.client.resume(source, _spec(e2e, 2), job_id="resume-b2")
    resumed = _final(e2e, job_id, 2)
    for agent in ("sender", "receiver"):
        assert set(e2e.commits(job_id, agent)) == {1}, f"{agent}: the resumed job's steps are not [1]"
        unequal = [t for t in expected[agent] if not torch.equal(resumed[agent][t], expected[agent][t])]
        assert not unequal, f"{agent}: resumed job differs from the uninterrupted one in {unequal}"
        assert any(not torch.equal(resumed[agent][t], after_b[agent][t]) for t in after_b[agent]), \
            f"{agent}: the resumed step left every parameter at B's"
    # The resumed job's own checkpoints are resumable in turn.
    assert all((work_dir / "checkpoints" / job_id / agent / "v2.json").is_file() for agent in ("sender", "receiver"))
