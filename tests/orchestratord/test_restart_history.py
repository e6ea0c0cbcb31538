"""orchestratord restarts over a cluster with history: 50 jobs and more than 20 MB of job state in etcd.

Seen by a user (2026-12-05): after ~580 committed steps over seven jobs, orchestratord read the whole
jobs prefix in one etcd response at start, met gRPC's 4 MiB receive limit, logged it as "etcd
unavailable" for a minute and exited; the cluster stayed down until `flexmarl down --wipe`. Every read
of state that grows with history is now paged (flexmarl.registry.Registry.get_prefix, list_keys).

The state is written through orchestratord's own EtcdStateStore (the records a real job leaves:
spec, meta, manifests of 256 experiences, commits, per-step history), then the daemons start on it.
It is old state (no history archive index): orchestratord, run with pages of 4 steps, moves the old
pages of every job's history to stored and deletes their etcd keys while it serves; history reads the
same records before, during and after, and across a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import aetcd.exceptions
import grpc
import grpc.aio
import pytest

from flexmarl.client import AsyncClient
from flexmarl.client import JobState as ApiJobState
from flexmarl.cluster import DaemonProcess, EtcdServer
from flexmarl.ids import ExperienceKey, TaskRef
from flexmarl.jobspec import parse_job_spec
from flexmarl.registry import Registry
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from orchestratord.etcd_state import EtcdStateStore
from orchestratord.state import HistoryArchiveIndex, JobState, StepCommit, StepManifest

from .helpers import spec_dict

StartDaemon = Callable[..., DaemonProcess]

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

JOBS = 50
STEPS = 22
PROMPTS, GROUP = 16, 16  # 256 episodes per step: each manifest lists 256 experience ids
MIN_STATE_BYTES = 20 * 1024 * 1024
GRPC_DEFAULT_RECEIVE_BYTES = 4 * 1024 * 1024
PAGE_STEPS = 4
#: A finished job keeps the page after the last archived one live: steps 0..15 of 22 are archived.
ARCHIVED_STEPS = 16


def _spec_json(index: int) -> str:
    spec = parse_job_spec(spec_dict(name=f"history{index:02d}", total_steps=STEPS,
                                    batch={"prompts_per_step": PROMPTS, "group_size": GROUP,
                                           "micro_batch_size": 64}))
    return spec.to_json()


async def _write_job(store: EtcdStateStore, index: int, running: bool) -> None:
    """One job as orchestratord leaves it: every step's manifest, commit and history record."""
    job_id = f"history{index:02d}-{index:04x}"
    agents = ("sender", "receiver")
    await store.create_job(job_id, _spec_json(index), agents, created_s=1_000.0 + index)
    steps = STEPS // 2 if running else STEPS
    for step in range(steps):
        for agent in agents:
            ids = tuple(sorted(
                str(ExperienceKey(str(TaskRef(job_id, step, position)), sample, agent, 0))
                for position in range(PROMPTS) for sample in range(GROUP)))
            await store.put_manifest(StepManifest(job_id, agent, step, ids, PROMPTS * GROUP, 8 * PROMPTS * GROUP))
            commit = StepCommit(job_id, agent, step, f"file:///w/{job_id}/{agent}/v{step + 1}",
                                f"file:///s/{job_id}/{agent}/v{step + 1}", "traind-0/slot0",
                                committed_s=2_000.0 + step, loss=0.01, grad_norm=0.5, step_seconds=1.5)
            history = {"agent": agent, "step": step, "version": step + 1, "reward_mean": step / STEPS,
                       "loss": 0.01, "grad_norm": 0.5, "step_seconds": 1.5, "tokens_per_s": 100.0,
                       "staleness_mean": 0.0, "episodes": PROMPTS * GROUP, "response_tokens": 8 * PROMPTS * GROUP,
                       "committed_unix_ms": int(commit.committed_s * 1000), "weights_uri": commit.weights_uri}
            await store.commit_step(commit, history)
            await store.clear_pending_mark(job_id, agent, step)
    if not running:
        await store.set_job_state(job_id, JobState.SUCCEEDED, "", updated_s=3_000.0)


async def _write_history(etcd: EtcdServer) -> int:
    """Writes the jobs (a few at a time) and returns the bytes of job state in etcd."""
    registry = Registry(etcd.endpoint, "/flexmarl")
    await registry.connect()
    try:
        store = EtcdStateStore(registry)
        gate = asyncio.Semaphore(10)

        async def one(index: int) -> None:
            async with gate:
                await _write_job(store, index, running=index >= JOBS - 2)

        await asyncio.gather(*(one(index) for index in range(JOBS)))
        values, _ = await registry.get_prefix(registry.key("jobs") + "/")
        # The control: one unpaged read of the same state is refused by the client's receive limit,
        # which is what stopped orchestratord from starting before the reads were paged.
        with pytest.raises(aetcd.exceptions.ClientError, match="larger than max"):
            await registry.client.get_prefix(registry.key("jobs").encode() + b"/")
        return sum(len(key) + len(value) for key, value in values.items())
    finally:
        await registry.close()


@pytest.mark.asyncio
async def test_orchestratord_starts_over_20_mb_of_history(etcd: EtcdServer, start_daemon: StartDaemon,
                                                           tmp_path: Path) -> None:
    state_bytes = await _write_history(etcd)
    assert state_bytes >= MIN_STATE_BYTES > GRPC_DEFAULT_RECEIVE_BYTES

    stored = start_daemon("stored", "--data-dir", str(tmp_path / "stored-data"))
    orchestratord = start_daemon("orchestratord", "--store-address", stored.address,
                                 "--history-page-steps", str(PAGE_STEPS), timeout_s=120)
    client = AsyncClient(orchestratord.address)
    try:
        jobs = await client.list_jobs()
        assert len(jobs) == JOBS
        by_state = {job.job_id: job.state for job in jobs}
        assert sum(state == ApiJobState.SUCCEEDED for state in by_state.values()) == JOBS - 2
        assert sum(state == ApiJobState.RUNNING for state in by_state.values()) == 2
        running = await client.status(f"history{JOBS - 1:02d}-{JOBS - 1:04x}")
        assert sorted((a.agent, a.version) for a in running.agents) == [("receiver", STEPS // 2),
                                                                         ("sender", STEPS // 2)]
        history = await client.history("history00-0000")
        assert sorted((r.agent, r.step) for r in history) == sorted(
            (agent, step) for agent in ("receiver", "sender") for step in range(STEPS))
        # Paged by step: a page holds every agent's records of its steps and says whether more follow.
        channel = grpc.aio.insecure_channel(orchestratord.address)
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        page = await stub.GetJobHistory(orchestrator_pb2.GetJobHistoryRequest(
            job_id="history00-0000", from_step=10, max_steps=5), timeout=30)
        assert sorted((r.agent, r.step) for r in page.steps) == sorted(
            (agent, step) for agent in ("receiver", "sender") for step in range(10, 15))
        assert page.more and page.next_from_step == 15 and not page.evals
        last = await stub.GetJobHistory(orchestrator_pb2.GetJobHistoryRequest(
            job_id="history00-0000", from_step=STEPS - 2, max_steps=5), timeout=30)
        assert {r.step for r in last.steps} == {STEPS - 2, STEPS - 1} and not last.more and last.next_from_step == 0
        assert await client.history("history00-0000", page_steps=3) == history  # many pages, the same records
        for bad in (orchestrator_pb2.GetJobHistoryRequest(job_id="history00-0000", from_step=-1),
                    orchestrator_pb2.GetJobHistoryRequest(job_id="history00-0000", max_steps=100_001)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetJobHistory(bad, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await channel.close()

        # The old pages went to stored, their manifests, commits and records left etcd; reads are unchanged.
        await _wait_archived(etcd, "history00-0000", ARCHIVED_STEPS)
        assert await client.history("history00-0000") == history
        assert await client.history("history00-0000", page_steps=3) == history
        assert sorted(await _step_keys(etcd, "history00-0000")) == sorted(
            (agent, step, kind) for agent in ("receiver", "sender") for step in range(ARCHIVED_STEPS, STEPS)
            for kind in ("manifest", "commit"))
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    # A second restart reads the same state again (nothing was rewritten into a shape it cannot read).
    orchestratord.restart(120)
    client = AsyncClient(orchestratord.address)
    try:
        assert len(await client.list_jobs()) == JOBS
        assert await client.history("history00-0000") == history
        running = await client.status(f"history{JOBS - 1:02d}-{JOBS - 1:04x}")
        assert sorted((a.agent, a.version) for a in running.agents) == [("receiver", STEPS // 2),
                                                                         ("sender", STEPS // 2)]
    finally:
        await client.close()


async def _step_keys(etcd: EtcdServer, job_id: str) -> list[tuple[str, int, str]]:
    """(agent, step, manifest|commit) of every step key of a job in etcd."""
    registry = Registry(etcd.endpoint, "/flexmarl")
    await registry.connect()
    try:
        keys = await registry.list_keys(registry.key("jobs", job_id, "agents") + "/")
    finally:
        await registry.close()
    out = []
    for key in keys:
        parts = key.split("/")
        if parts[-3] == "steps" and parts[-1] in ("manifest", "commit"):
            out.append((parts[-4], int(parts[-2]), parts[-1]))
    return out


async def _wait_archived(etcd: EtcdServer, job_id: str, steps: int, timeout_s: float = 90.0) -> None:
    """Waits until the job's history archive index says ``steps`` steps are archived and cleaned."""
    registry = Registry(etcd.endpoint, "/flexmarl")
    await registry.connect()
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            raw = await registry.get(registry.key("jobs", job_id, "history_archive"))
            index = HistoryArchiveIndex.from_json(raw) if raw is not None else None
            if index is not None and index.archived_steps == steps and index.cleaned == index.pages:
                return
            assert asyncio.get_running_loop().time() < deadline, f"{job_id}: history not archived: {index}"
            await asyncio.sleep(0.2)
    finally:
        await registry.close()
