"""Data-parallel binding end to end: one agent with ``max_slots: 2`` on two one-slot traind processes.

Real etcd, stored, orchestratord, rolloutd (embedded engine) and two traind processes of one
slot each. In strict mode (async, max_staleness 0) the orchestrator binds both slots to the
agent in one data-parallel group (a real gloo process group across the two processes); the job
completes, every experience is consumed exactly once, and the final parameters equal those of
a single-slot run of the same job and seed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_support import (
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    metric_sum,
    running_cluster,
    weights_dir,
)
from test_equivalence import assert_equal_and_trained, run_pair, workflow_spec

from flexmarl.artifacts import checkpoint_tensors
from flexmarl.cli import materialize_models
from flexmarl.cluster import wait_until
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc, train_pb2, train_pb2_grpc

STEPS = 2
TRAINDS = ("traind-0", "traind-1")
# Both runs train the same groups from the same parameters. traind sums group gradients exactly
# (traind/accumulation.py) and the members all-reduce the exact sums, so neither which member got
# which micro-batch nor the order gloo adds them can change a bit: the parameters must be equal,
# with Adam's usual eps (1e-8), where an inexact sum would turn rounding noise on ~0 gradients into
# steps of about the learning rate.
ADAM_EPS = 1e-8


def _spec(e2e: E2ECluster, max_slots: int) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "dp-solo",
        "seed": 3,
        "environment": {"entrypoint": "dense_solo:DenseSolo", "config": {"num_objects": 4}},
        "agents": [{
            "name": "speaker", "model": "tiny://qwen2?seed=1",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1, "stop_token_ids": []},
            "optimizer": {"name": "adamw", "lr": 1.0e-2, "betas": [0.9, 0.999], "eps": ADAM_EPS,
                          "weight_decay": 0.0, "grad_clip": 1.0},
            "zero_stage": 0, "dtype": "fp32", "max_slots": max_slots,
        }],
        "algorithm": {"name": "grpo", "clip_eps": 0.2, "kl_coef": 0.0, "loss_agg": "token-mean",
                      "advantage_norm": "std"},
        # 4 tasks x 4 episodes, one group per micro-batch: 4 micro-batches per step (2 per member).
        "batch": {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 4},
        "total_steps": STEPS,
        "pipeline": {"mode": "async", "max_staleness": 0},
        "leases": {"rollout_timeout_s": 60, "train_timeout_s": 120},
    }
    return materialize_models(raw, e2e.models_dir)



def _bound_slots(e2e: E2ECluster, job_id: str) -> list[str]:
    """AgentProgress.slot_ids of the job's only agent, from orchestratord's GetJob."""

    async def get() -> list[str]:
        async with grpc.aio.insecure_channel(e2e.cluster.daemon("orchestratord").address) as channel:
            status = await orchestrator_pb2_grpc.OrchestratorStub(channel).GetJob(
                orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=10)
        return list(status.agents[0].slot_ids)

    return asyncio.run(get())


def _trainer_groups(e2e: E2ECluster) -> list[tuple[str, int, int]]:
    """(dp_group_id, dp_rank, dp_world_size) of each traind's slot, from GetTrainerStatus."""

    async def get() -> list[tuple[str, int, int]]:
        out = []
        for name in TRAINDS:
            async with grpc.aio.insecure_channel(e2e.cluster.daemon(name).address) as channel:
                status = await train_pb2_grpc.TrainerStub(channel).GetTrainerStatus(
                    train_pb2.GetTrainerStatusRequest(), timeout=10)
            out.extend((s.dp_group_id, s.dp_rank, s.dp_world_size) for s in status.slots)
        return out

    return asyncio.run(get())


@pytest.fixture(scope="module")
def dp_cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[E2ECluster]:
    """Two traind processes with one slot each (both can join a data-parallel group)."""
    with running_cluster(tmp_path_factory.mktemp("dp"), models_dir, trainer_workers=2, trainer_slots=1,
                         engine_replicas=1) as e2e:
        yield e2e


@pytest.mark.timeout(280)
def test_two_slots_train_one_agent_data_parallel_like_one_slot(dp_cluster: E2ECluster) -> None:
    e2e = dp_cluster
    spec = _spec(e2e, max_slots=2)
    e2e.client.submit(spec, job_id="dp-two-slots")
    # Both slots are bound to the agent, in one group, while the job runs.
    seen: dict[str, Any] = {}

    def grouped() -> bool:
        info = e2e.client.status("dp-two-slots")
        slots = _bound_slots(e2e, "dp-two-slots")
        if len(slots) == 2:
            seen["slots"] = slots
        groups = _trainer_groups(e2e)
        if sorted(rank for _, rank, world in groups if world == 2) == [0, 1] and len({g for g, _, _ in groups}) == 1:
            seen["groups"] = groups
        if info.state.finished:
            raise AssertionError(f"job finished ({info.state.name}: {info.error}) before both slots were "
                                 f"seen in one group: {seen}\n{e2e.log_tails()}")
        return "slots" in seen and "groups" in seen

    wait_until(grouped, 120, "both slots bound to the agent in one data-parallel group", interval_s=0.1)
    info = e2e.wait_job("dp-two-slots")
    assert_succeeded(e2e, info, STEPS)
    assert_exactly_once(e2e, "dp-two-slots", spec)
    assert_one_commit_per_step(e2e, "dp-two-slots", spec)
    # Both processes accumulated micro-batches of the job (each its share of the steps).
    for name in TRAINDS:
        trained = metric_sum(e2e.metrics_text(name), "flexmarl_traind_micro_batches_total",
                             lambda series: 'agent="speaker"' in series)
        assert trained >= 1, f"{name} accumulated no micro-batch of the data-parallel job"
    parallel = checkpoint_tensors(weights_dir(info.agents[0].weights_uri))

    # The same job and seed on one slot (max_slots 1); the group was dissolved when the job ended.
    single_spec = _spec(e2e, max_slots=1)
    e2e.client.submit(single_spec, job_id="dp-one-slot")
    single_info = e2e.wait_job("dp-one-slot")
    assert_succeeded(e2e, single_info, STEPS)
    assert_exactly_once(e2e, "dp-one-slot", single_spec)
    single = checkpoint_tensors(weights_dir(single_info.agents[0].weights_uri))

    assert_equal_and_trained("dp", {"speaker": single}, {"speaker": parallel}, spec)


@pytest.mark.timeout(420)
def test_three_agents_on_two_slots_train_in_async_what_sync_trains(dp_cluster: E2ECluster) -> None:
    """More agents than slots: the three workflow agents share the two slots (max_slots 1 each)."""
    spec = workflow_spec(dp_cluster.models_dir, seed=0)
    sync, async_ = run_pair(dp_cluster, "workflow-two-slots", spec)
    assert_equal_and_trained("workflow-two-slots", sync, async_, spec)
