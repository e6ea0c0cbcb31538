"""Backpressure: a full stored slows rollouts down instead of losing experiences.

stored starts with a 1-byte job quota, so every append of the job fails with RESOURCE_EXHAUSTED,
reason QUOTA_EXCEEDED (a status detail, not the message text). rolloutd must hold the finished
tasks' experiences and retry while renewing their leases, lease nothing new, and never report a
task failed. Then stored restarts without a quota (an operator raising it): the held experiences
land, the remaining tasks run, a simulated trainer commits the step, and stored holds every
experience of the job exactly once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from flexmarl.cli import materialize_models
from flexmarl.client import AsyncClient
from flexmarl.cluster import DaemonProcess, EtcdServer
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.timeout(240)

PROMPTS = 4
GROUP_SIZE = 2
MAX_TASKS = 2
LEASE_TIMEOUT_S = 6.0
AGENTS = ("sender", "receiver")


def _spec(models_dir: Path) -> dict[str, object]:
    raw = {
        "name": "backpressure",
        "seed": 3,
        "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [
            {"name": "sender", "model": "tiny://qwen2?seed=1", "sampling": {"max_new_tokens": 1}},
            {"name": "receiver", "model": "tiny://qwen2?seed=2", "sampling": {"max_new_tokens": 1}},
        ],
        "batch": {"prompts_per_step": PROMPTS, "group_size": GROUP_SIZE, "micro_batch_size": 4},
        "total_steps": 1,
        "leases": {"rollout_timeout_s": LEASE_TIMEOUT_S},
    }
    return materialize_models(raw, models_dir)


def _metric(proc: DaemonProcess, name: str, label: str = "") -> float:
    """Sum of a metric's samples (optionally only those whose labels contain ``label``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] == name and label in series:
            total += float(value)
    return total


def _wait(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


async def _train(orch_address: str, job_id: str, timeout_s: float) -> None:
    """Two simulated trainer slots (one per agent): ack micro-batches, commit the step (no model involved)."""
    async with grpc.aio.insecure_channel(orch_address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        deadline = time.monotonic() + timeout_s

        async def slot(worker_id: str) -> None:
            slot_id = f"{worker_id}/0"
            while time.monotonic() < deadline:
                status = await stub.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id))
                if status.state == orchestrator_pb2.JOB_STATE_SUCCEEDED:
                    return
                assert status.state == orchestrator_pb2.JOB_STATE_RUNNING, status
                work = await stub.PollTrainerWork(orchestrator_pb2.PollTrainerWorkRequest(
                    worker_id=worker_id, slot_id=slot_id, wait_ms=500))
                kind = work.WhichOneof("work")
                if kind == "micro_batch":
                    await stub.AckMicroBatch(orchestrator_pb2.AckMicroBatchRequest(
                        lease_id=work.micro_batch.lease_id, worker_id=worker_id, slot_id=slot_id))
                elif kind == "optimizer_step":
                    step = work.optimizer_step
                    await stub.CommitStep(orchestrator_pb2.CommitStepRequest(
                        worker_id=worker_id, slot_id=slot_id, job_id=step.job_id, agent=step.agent,
                        step=step.step, new_version=step.new_version, weights_uri="file:///nonexistent/weights",
                        state_uri="file:///nonexistent/state"))
                elif kind == "swap_out":
                    await stub.ReportSlotEvent(orchestrator_pb2.ReportSlotEventRequest(
                        worker_id=worker_id, slot_id=slot_id, job_id=work.swap_out.job_id, agent=work.swap_out.agent,
                        kind=orchestrator_pb2.ReportSlotEventRequest.KIND_SWAPPED_OUT,
                        state_uri="file:///nonexistent/state"))
            raise AssertionError(f"job {job_id} did not succeed within {timeout_s} s")

        await asyncio.gather(slot("fake-trainer-a"), slot("fake-trainer-b"))


def test_full_store_slows_rollouts_and_loses_nothing(etcd: EtcdServer, start_daemon: Callable[..., DaemonProcess],
                                                     tmp_path: Path) -> None:
    data_dir = str(tmp_path / "stored")
    # Started together (their imports overlap) while the models are built.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        starting = [
            pool.submit(start_daemon, "stored", "--data-dir", data_dir, "--job-quota-bytes", "1", name="stored"),
            pool.submit(start_daemon, "orchestratord", name="orchestratord"),
            pool.submit(start_daemon, "rolloutd", "--engine-replicas", "1", "--max-tasks", str(MAX_TASKS),
                        "--work-dir", str(tmp_path / "rolloutd"), name="rolloutd"),
        ]
        built = pool.submit(_spec, tmp_path / "models")
        stored, orch, rolloutd = (started.result() for started in starting)
        spec = built.result()

    async def submit() -> str:
        async with AsyncClient(etcd_endpoints=etcd.endpoint) as client:
            return str(await client.submit(spec))

    job_id = asyncio.run(submit())

    # stored is full: rolloutd holds back, keeps its leases alive and fails nothing.
    _wait("rolloutd to hold back", lambda: _metric(rolloutd, "flexmarl_rolloutd_backpressure") == 1.0, 180)
    _wait("both tasks to wait on their append",
          lambda: _metric(rolloutd, "flexmarl_rolloutd_pending_appends") == MAX_TASKS, 60)
    held_since = time.monotonic()
    backpressure_s = _metric(rolloutd, "flexmarl_rolloutd_backpressure_seconds_total")
    while time.monotonic() - held_since < 2 * LEASE_TIMEOUT_S:  # longer than a lease lives unrenewed
        assert _metric(orch, "flexmarl_orchestratord_rollout_tasks_leased_total") == MAX_TASKS
        assert _metric(orch, "flexmarl_orchestratord_rollout_tasks_reported_total") == 0
        assert _metric(rolloutd, "flexmarl_rolloutd_backpressure") == 1.0
        time.sleep(0.5)
    assert _metric(rolloutd, "flexmarl_rolloutd_backpressure_seconds_total") >= backpressure_s + LEASE_TIMEOUT_S
    assert _metric(rolloutd, "flexmarl_rolloutd_append_retries_total", 'code="RESOURCE_EXHAUSTED"') >= 2

    # The operator lifts the quota: the held experiences land and the job completes.
    stored.terminate()
    stored.args = ["--data-dir", data_dir]
    stored.restart()
    try:
        asyncio.run(_train(orch.address, job_id, timeout_s=120))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; rolloutd pending appends "
                             f"{_metric(rolloutd, 'flexmarl_rolloutd_pending_appends')}, tasks reported "
                             f"{_metric(orch, 'flexmarl_orchestratord_rollout_tasks_reported_total')}; rolloutd log:\n"
                             f"{rolloutd.stderr_tail()}") from None
    assert _metric(orch, "flexmarl_orchestratord_rollout_tasks_reported_total", 'outcome="failed"') == 0
    # A lease may still expire under a loaded machine and be re-issued; that costs time, never data.
    assert _metric(orch, "flexmarl_orchestratord_rollout_tasks_leased_total") >= PROMPTS
    # Released once the lease loop sees no append waiting (it looks every BACKPRESSURE_POLL_S).
    _wait("rolloutd to release backpressure", lambda: _metric(rolloutd, "flexmarl_rolloutd_backpressure") == 0.0, 30)

    async def stored_ids() -> dict[str, list[str]]:
        async with StoreClient(stored.address) as store:
            return {agent: [r.experience_id for r in await store.query(job_id, agent)] for agent in AGENTS}

    ids = asyncio.run(stored_ids())
    for agent in AGENTS:
        assert len(ids[agent]) == len(set(ids[agent])) == PROMPTS * GROUP_SIZE, (agent, ids[agent])
        assert {i.rsplit("/", 3)[0] for i in ids[agent]} == {f"{job_id}/b0/t{t}" for t in range(PROMPTS)}
