"""rolloutd end to end: a 2-agent environment through the daemon, two embedded replicas, stored.

No traind runs, so the job stays at version 0 and the first batch's experiences are exactly
what rolloutd produced; their logprobs are checked against a forward pass of the same model.
rolloutd runs with its default ``--max-tasks auto``: the job's staleness rule admits 12 tasks
((3 + 1) x 3 prompts), so it leases up to 12 at once, not 8 (one step of 3 is all there is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from flexmarl.cli import materialize_models
from flexmarl.client import AsyncClient
from flexmarl.store_client import StoreClient
from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.timeout(240)

# The engine runs the same fp32 weights but batches and pads differently from this single
# forward pass; reductions in another order differ by ~1e-6 per logit, far below this bound.
LOGPROB_TOLERANCE = 1e-4


def _spec(models_dir: Path) -> dict[str, object]:
    raw = {
        "name": "rollout-it",
        "seed": 7,
        "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [
            {"name": "sender", "model": "tiny://qwen2?seed=1", "sampling": {"max_new_tokens": 1}},
            {"name": "receiver", "model": "tiny://qwen2?seed=2", "sampling": {"max_new_tokens": 1}},
        ],
        "batch": {"prompts_per_step": 3, "group_size": 4, "micro_batch_size": 4},
        "total_steps": 1,
        "pipeline": {"max_staleness": 3},
    }
    return materialize_models(raw, models_dir)


def _metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def _forward_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(logprobs[start + i, token]) for i, token in enumerate(response)]


def test_two_agent_episodes_reach_stored_with_true_logprobs(etcd, start_daemon, tmp_path: Path) -> None:
    # Started together (their imports overlap) while the models are built.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        starting = [
            pool.submit(start_daemon, "stored", "--data-dir", str(tmp_path / "stored"), name="stored"),
            pool.submit(start_daemon, "orchestratord", name="orchestratord"),
            pool.submit(start_daemon, "rolloutd", "--engine-replicas", "2", "--work-dir", str(tmp_path / "rolloutd"),
                        name="rolloutd"),
        ]
        built = pool.submit(_spec, tmp_path / "models")
        stored, _, rolloutd = (started.result() for started in starting)
        spec = built.result()
    expected = 3 * 4  # prompts x group size, one turn per agent per episode

    async def scenario() -> None:
        async with AsyncClient(etcd_endpoints=etcd.endpoint) as client:
            job_id = await client.submit(spec)
        store = StoreClient(stored.address)
        try:
            deadline = asyncio.get_running_loop().time() + 180
            refs = {}
            while True:
                refs = {agent: await store.query(job_id, agent) for agent in ("sender", "receiver")}
                if all(len(r) == expected for r in refs.values()):
                    break
                assert asyncio.get_running_loop().time() < deadline, f"rollouts incomplete: {refs}"
                await asyncio.sleep(0.5)
            # Each agent's checkpoint, loaded once for all of its records.
            models = {a["name"]: AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32)
                      for a in spec["agents"]}  # type: ignore[index,union-attr]
            worst = 0.0
            for agent, agent_refs in refs.items():
                records = await store.read(job_id, [r.experience_id for r in agent_refs])
                assert {r.sample_index for r in records} == set(range(4))
                for record in records:
                    assert record.behavior_version == 0
                    assert record.response_tokens == 1
                    want = _forward_logprobs(models[agent], record.prompt_token_ids.tolist(),
                                             record.response_token_ids.tolist())
                    got = record.response_logprobs.tolist()
                    worst = max(worst, *(abs(a - b) for a, b in zip(got, want, strict=True)))
            print(f"max |engine logprob - forward logprob| = {worst:.2e}")
            assert worst < LOGPROB_TOLERANCE
            # Both agents are served, one replica each (the inter-agent level split them).
            async with grpc.aio.insecure_channel(rolloutd.address) as channel:
                status = await rollout_pb2_grpc.RolloutStub(channel).GetRolloutStatus(
                    rollout_pb2.GetRolloutStatusRequest())
            assert len(status.replicas) == 2 and all(r.healthy for r in status.replicas)
            assert {a.rsplit("/", 1)[-1] for r in status.replicas for a in r.agents} == {"sender", "receiver"}
            assert status.episodes_done >= expected
            assert (status.max_tasks, status.max_tasks_auto, status.live_rolloutds) == (12, True, 1)
            assert "flexmarl_rolloutd_max_tasks 12.0" in await asyncio.to_thread(_metrics_text, rolloutd.metrics_port)
        finally:
            await store.close()

    asyncio.run(scenario())
