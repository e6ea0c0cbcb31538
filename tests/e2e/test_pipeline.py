"""The whole pipeline on a local cluster: a 2-agent job on one trainer slot, end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from e2e_support import (
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    metric_sum,
    weights_dir,
)

from flexmarl.artifacts import checkpoint_tensors
from flexmarl.client import JobState
from rolloutd.engines.launcher import ReplicaSpec, launch
from rolloutd.engines.protocol import GenerationRequest, SamplingParams

PROMPT_IDS = (111, 98, 106, 58, 48, 49, 50, 51, 32, 116, 103, 116, 58, 48, 62)



async def _greedy_logprobs_before_and_after(model: str, published: Path, run_dir: Path) -> tuple[
        list[float], list[float], str]:
    """Greedy logprobs of one prompt on an engine serving model, then after loading the published weights."""
    replica = await launch(ReplicaSpec(backend="embedded", model_path=model), run_dir, name="check-engine")
    try:
        async with replica.client() as client:
            request = GenerationRequest(PROMPT_IDS, SamplingParams(temperature=0.0, max_new_tokens=4))
            before = (await client.generate(request))[0]
            await client.update_weights_from_disk(str(published), weight_version="final")
            after = (await client.generate(request))[0]
            info = await client.model_info()
    finally:
        await asyncio.to_thread(replica.stop, 10.0)
    return list(before.output_token_logprobs), list(after.output_token_logprobs), info.weight_version


@pytest.mark.timeout(240)
def test_two_agents_on_one_slot_train_exactly_once(shared_cluster: E2ECluster, tmp_path: Path) -> None:
    e2e = shared_cluster
    swaps_before = metric_sum(e2e.metrics_text("traind-0"), "flexmarl_traind_swap_seconds_count",
                              lambda series: 'direction="in"' in series)
    spec = e2e.spec()
    job_id = e2e.client.submit(spec)

    info = e2e.wait_job(job_id)

    total_steps = spec["total_steps"]
    assert_succeeded(e2e, info, total_steps)
    assert {a.agent for a in info.agents} == {"sender", "receiver"}
    history = e2e.client.history(job_id)
    assert sorted((r.agent, r.step) for r in history) == sorted(
        (agent, step) for agent in ("sender", "receiver") for step in range(total_steps))
    assert all(r.episodes == spec["batch"]["prompts_per_step"] * spec["batch"]["group_size"] for r in history)
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)

    # Two agents alternating through one slot: the slot swapped committed states in.
    traind_metrics = e2e.metrics_text("traind-0")
    swaps = metric_sum(traind_metrics, "flexmarl_traind_swap_seconds_count", lambda series: 'direction="in"' in series)
    assert swaps - swaps_before > 0, traind_metrics
    assert metric_sum(traind_metrics, "flexmarl_traind_swap_bytes_total") > 0

    # The last published weights are a loadable checkpoint that differs from the initial model.
    models = {a["name"]: a["model"] for a in spec["agents"]}
    for agent in info.agents:
        published = weights_dir(agent.weights_uri)
        initial, trained = checkpoint_tensors(Path(models[agent.agent])), checkpoint_tensors(published)
        shared = set(initial) & set(trained)
        assert shared, f"{agent.agent}: no common tensor names"
        assert any(not torch.equal(initial[k], trained[k]) for k in shared), f"{agent.agent}: weights unchanged"
    sender = next(a for a in info.agents if a.agent == "sender")
    before, after, version = asyncio.run(
        _greedy_logprobs_before_and_after(models["sender"], weights_dir(sender.weights_uri), tmp_path / "engine"))
    assert version == "final"
    assert before and after
    assert before != after, "the engine generates the same logprobs after loading trained weights"
    assert e2e.client.status(job_id).state is JobState.SUCCEEDED
