"""rolloutd's worker loops over a fake link to orchestratord: lease -> run -> store -> report, and lost leases.

The orchestrator is an in-memory :class:`~rolloutd.link.OrchestratorLink` (no gRPC, no etcd);
everything else is real: two embedded engines in this process, a real stored on port 0 and the
signaling example. The gRPC link's error mapping and the append retry rule are checked on
their own, without a network.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from flexmarl.client import JobState
from flexmarl.cluster import EtcdServer
from flexmarl.connections import PeerConnections
from flexmarl.entrypoints import loaded_digest, source_digest
from flexmarl.errors import ErrorReason, FailedPrecondition, FlexmarlError, NotFound, ResourceExhausted, Unavailable
from flexmarl.experience import ExperienceRecord, ExperienceSummary
from flexmarl.ids import TaskRef
from flexmarl.jobspec import JobSpec, parse_job_spec
from flexmarl.registry import Registry, ServiceRecord
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2
from rolloutd import serde
from rolloutd import worker as worker_module
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.link import GrpcOrchestratorLink, OrchestratorLink
from rolloutd.metrics import RolloutMetrics
from rolloutd.runner import RolloutResult, RolloutRunner, RolloutTaskInput
from rolloutd.types import ActiveJob, AgentVersion, RenewResult, RolloutTask, TaskReport
from rolloutd.worker import RolloutWorker, WorkerSettings, _append_retry_code
from tests.stored_support import inprocess_stored

pytestmark = pytest.mark.timeout(120)

JOB = "link-job"
GROUP_SIZE = 3


class FakeOrchestrator(OrchestratorLink):
    """orchestratord as the worker sees it, in memory: tasks to hand out, what was reported and renewed."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec_json = spec.to_json()
        self.to_lease: asyncio.Queue[RolloutTask] = asyncio.Queue()
        self.reports: asyncio.Queue[TaskReport] = asyncio.Queue()
        self.report_calls = 0
        self.report_errors: list[FlexmarlError] = []  # raised by the next report calls, in turn
        self.lease_errors: list[FlexmarlError] = []
        self.lease_calls = 0
        self.lease_max_tasks: list[int] = []  # what each lease call asked for
        self.lost: set[str] = set()
        self.renewed: set[str] = set()
        self.spec_fetches = 0
        self.active: list[ActiveJob] = []  # what the worker's job loop lists

    async def lease_tasks(self, worker_id: str, max_tasks: int, wait_ms: int) -> list[RolloutTask]:
        self.lease_calls += 1
        self.lease_max_tasks.append(max_tasks)
        if self.lease_errors:
            raise self.lease_errors.pop(0)
        try:
            tasks = [await asyncio.wait_for(self.to_lease.get(), wait_ms / 1000)]
        except TimeoutError:
            return []
        while len(tasks) < max_tasks and not self.to_lease.empty():
            tasks.append(self.to_lease.get_nowait())
        return tasks

    async def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        self.renewed.update(lease_ids)
        return RenewResult(frozenset(self.lost.intersection(lease_ids)))

    async def report(self, worker_id: str, report: TaskReport) -> None:
        self.report_calls += 1
        if self.report_errors:
            raise self.report_errors.pop(0)
        self.reports.put_nowait(report)

    async def job_spec(self, job_id: str) -> str:
        self.spec_fetches += 1
        if job_id != JOB:
            raise NotFound(f"job {job_id} not found")
        return self.spec_json

    async def job_state(self, job_id: str) -> JobState:
        return JobState.RUNNING

    async def active_jobs(self) -> list[ActiveJob]:
        return list(self.active)


def _spec(model: Path, prompts_per_step: int = 2, **fields: Any) -> JobSpec:
    return parse_job_spec({
        "name": "link-test", "seed": 3,
        "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [{"name": agent, "model": str(model), "sampling": {"max_new_tokens": 1}}
                   for agent in ("sender", "receiver")],
        "batch": {"prompts_per_step": prompts_per_step, "group_size": GROUP_SIZE, "micro_batch_size": GROUP_SIZE},
        "total_steps": 1, **fields,
    })


def _task(spec: JobSpec, position: int, *, attempt: int = 1) -> RolloutTask:
    """Task ``position`` of batch 0, at version 0 of both agents (their base models), as the planner leases it."""
    return RolloutTask(lease_id=f"{JOB}/e1-task-{position}-{attempt}", ref=TaskRef(JOB, 0, position),
                       task_index=position, group_size=GROUP_SIZE, attempt=attempt, spec_digest=spec.digest(),
                       agent_versions=tuple(AgentVersion(agent, 0) for agent in spec.agent_names))


@pytest.fixture
async def stored_address(tmp_path: Path) -> AsyncIterator[str]:
    async with inprocess_stored(tmp_path / "stored") as (_, _, address):
        yield address


@pytest.fixture
async def engine_urls(engine_checkpoint: Path) -> AsyncIterator[tuple[str, ...]]:
    """Two embedded engines served from this process (one per agent)."""
    servers = []
    try:
        for _ in range(2):
            engine = await asyncio.to_thread(EmbeddedEngine, EmbeddedEngineConfig(model_path=str(engine_checkpoint)))
            server = EmbeddedServer(engine)
            await server.start("127.0.0.1", 0)
            servers.append(server)
        yield tuple(f"http://127.0.0.1:{server.port}" for server in servers)
    finally:
        for server in servers:
            await server.stop()


@dataclasses.dataclass(frozen=True)
class Served:
    """A started worker over the fake orchestrator, the job's spec, stored's client and the worker's metrics."""

    worker: RolloutWorker
    link: FakeOrchestrator
    spec: JobSpec
    store: StoreClient
    metrics: CollectorRegistry


@pytest.fixture
async def served(
    engine_checkpoint: Path, engine_urls: tuple[str, ...], stored_address: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Served]:
    """The worker, over two in-process engines and a real stored; renewals every 50 ms."""
    monkeypatch.setattr(worker_module, "RENEW_INTERVAL_S", 0.05)
    monkeypatch.setattr(worker_module, "JOB_DISCOVERY_INTERVAL_S", 0.05)
    spec = _spec(engine_checkpoint)
    link = FakeOrchestrator(spec)
    settings = WorkerSettings(
        worker_id="rolloutd-link", work_dir=tmp_path / "rolloutd", max_tasks=2, engine_backend="embedded",
        engine_replicas=2, engine_urls=engine_urls, engine_threads=1, orchestrator_address="",
        store_address=stored_address, max_message_bytes=16 << 20,
    )
    metrics = CollectorRegistry()
    # No etcd: both peers are configured, and the orchestrator is the fake.
    worker = RolloutWorker(settings, cast(Registry, object()), RolloutMetrics(metrics), link=link)
    store = StoreClient(stored_address)
    await worker.start()
    try:
        yield Served(worker, link, spec, store, metrics)
    finally:
        await worker.stop()
        await store.close()


async def _stored_summaries(store: StoreClient, task: RolloutTask) -> set[ExperienceSummary]:
    found = set()
    for agent in ("sender", "receiver"):
        refs = await store.query(JOB, agent, group_id=f"{task.task_id}/{agent}")
        found.update(ExperienceSummary.of_ref(ref, agent) for ref in refs)
    return found


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"waited {timeout_s} s for {what}")


def _metric(metrics: CollectorRegistry, name: str, **labels: str) -> float:
    return metrics.get_sample_value(name, labels) or 0.0


async def test_a_leased_task_is_run_stored_and_reported_and_a_reissued_attempt_reuses_it(
    served: Served, monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, link, spec, store, metrics = served.worker, served.link, served.spec, served.store, served.metrics
    # stored is slow once: the append's DEADLINE_EXCEEDED is held and retried, not a failed task.
    appends = _flaky_appends(monkeypatch, [grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                                                grpc.aio.Metadata(), grpc.aio.Metadata(), "slow")])
    link.report_errors.append(Unavailable("orchestratord restarting"))  # the first report is retried
    first = _task(spec, 0)
    link.to_lease.put_nowait(first)

    report = await asyncio.wait_for(link.reports.get(), 60)
    assert report.lease_id == first.lease_id and report.task_id == first.task_id and report.succeeded
    assert link.report_calls == 2 and appends == [1, 1]
    assert len(report.experiences) == 2 * GROUP_SIZE
    assert {(e.agent, e.sample_index) for e in report.experiences} == {
        (agent, i) for agent in ("sender", "receiver") for i in range(GROUP_SIZE)}
    assert set(report.experiences) == await _stored_summaries(store, first)  # durable before reported
    assert _metric(metrics, "flexmarl_rolloutd_append_retries_total", code="DEADLINE_EXCEEDED") == 1
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")
    status = worker.status()
    assert status.worker_id == "rolloutd-link" and status.episodes_done == GROUP_SIZE
    assert len(status.replicas) == 2 and all(r.healthy and r.backend == "embedded" for r in status.replicas)

    # orchestratord lost the report's effect and re-issues the task: the stored experiences are its result.
    again = _task(spec, 0, attempt=2)
    link.to_lease.put_nowait(again)
    reused = await asyncio.wait_for(link.reports.get(), 30)
    assert reused.lease_id == again.lease_id and reused.succeeded
    assert set(reused.experiences) == set(report.experiences)
    assert appends == [1, 1] and worker.status().episodes_done == GROUP_SIZE  # nothing run or appended again
    assert link.spec_fetches == 1  # the spec is fetched once per job

    # An earlier attempt of task 2 stored the group without episode 1 (its reward failed): reused as it is,
    # the missing episode reported failed.
    partial = _task(spec, 2, attempt=2)
    await store.append([_record(partial, sample, agent) for sample in (0, 2) for agent in ("sender", "receiver")])
    link.to_lease.put_nowait(partial)
    reused = await asyncio.wait_for(link.reports.get(), 30)
    assert reused.succeeded and {(e.agent, e.sample_index) for e in reused.experiences} == {
        (agent, i) for agent in ("sender", "receiver") for i in (0, 2)}
    assert [f.sample_index for f in reused.failed_episodes] == [1]


def _record(task: RolloutTask, sample: int, agent: str) -> ExperienceRecord:
    """A one-turn experience of episode ``sample`` of ``task``, as rolloutd writes it."""
    return ExperienceRecord(
        experience_id=f"{task.task_id}/{sample}/{agent}/0", job_id=JOB, agent=agent, task_id=task.task_id,
        group_id=f"{task.task_id}/{agent}", sample_index=sample, episode_id=f"{task.task_id}/{sample}", turn=0,
        behavior_version=0, reward=1.0, prompt_token_ids=np.array([1, 2], dtype=np.int32),
        response_token_ids=np.array([3], dtype=np.int32), response_logprobs=np.array([-0.5], dtype=np.float32),
        group_size=GROUP_SIZE)


async def test_a_task_held_by_a_full_stored_is_abandoned_when_its_lease_is_lost(
    served: Served, monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, link, spec, store, metrics = served.worker, served.link, served.spec, served.store, served.metrics
    full = ResourceExhausted("job quota full", reason=ErrorReason.QUOTA_EXCEEDED)
    appends = _flaky_appends(monkeypatch, [full] * 1000)
    link.lease_errors.append(Unavailable("no orchestratord registered"))  # the first poll fails: backoff, retry
    held = _task(spec, 1)
    link.to_lease.put_nowait(held)

    await _until(lambda: bool(worker.store_backpressure()), "appends to fail")
    await _until(lambda: held.lease_id in link.renewed, "the held task's lease to be renewed")
    assert link.lease_calls >= 2  # the failed poll and the one that leased the task
    assert _metric(metrics, "flexmarl_rolloutd_append_retries_total", code="RESOURCE_EXHAUSTED") >= 1
    leases_while_failing = link.lease_calls
    await asyncio.sleep(0.3)
    assert link.lease_calls == leases_while_failing  # backpressure: nothing new is leased

    link.lost.add(held.lease_id)
    await _until(lambda: worker.status().tasks_in_flight == 0, "the lost task to be cancelled")
    assert link.report_calls == 0 and link.reports.empty()  # an abandoned task is never reported
    assert await _stored_summaries(store, held) == set()
    assert worker.store_backpressure() == ""
    await _until(lambda: link.lease_calls > leases_while_failing, "leasing to resume")
    assert len(appends) >= 2


async def test_a_rejected_report_is_not_retried(
    served: Served,
) -> None:
    worker, link, spec = served.worker, served.link, served.spec
    link.report_errors.append(FailedPrecondition("lease expired"))
    link.to_lease.put_nowait(_task(spec, 2))
    await _until(lambda: link.report_calls == 1 and worker.status().tasks_in_flight == 0, "the report")
    await asyncio.sleep(0.5)  # past the first retry delay (0.2 s)
    assert link.report_calls == 1 and link.reports.empty()


async def test_a_job_whose_environment_does_not_load_is_reported_unrunnable(served: Served) -> None:
    worker, link = served.worker, served.link
    broken = served.spec.model_copy(update={"environment": served.spec.environment.model_copy(
        update={"entrypoint": "examples.signalling.env:SignalingGame"})})  # a typo in the module
    link.spec_json = broken.to_json()
    link.to_lease.put_nowait(_task(broken, 3))
    report = await asyncio.wait_for(link.reports.get(), 30)
    assert not report.succeeded and report.reason is ErrorReason.JOB_UNRUNNABLE
    assert "examples.signalling.env" in report.error
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")


async def test_a_listed_job_is_prepared_before_its_first_task_is_leased(
        served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    worker, link, spec, metrics = served.worker, served.link, served.spec, served.metrics
    caplog.set_level("INFO", logger="rolloutd.worker")
    assert worker.router is None and worker.status().replicas == () and worker.status().jobs == ()  # no job yet
    gate = asyncio.Event()  # holds the preparation until its "preparing" state has been seen
    new_job = worker._new_job

    async def held_new_job(job_id: str, spec_digest: str) -> Any:
        await gate.wait()
        return await new_job(job_id, spec_digest)

    monkeypatch.setattr(worker, "_new_job", held_new_job)
    link.active = [ActiveJob(JOB, spec.digest())]  # submitted: listed, none of its tasks leasable yet
    await _until(lambda: bool(worker.status().jobs), "the listed job's preparation to start")
    [preparing] = worker.status().jobs
    assert (preparing.job_id, preparing.state, preparing.error) == (JOB, "preparing", "")
    gate.set()
    await _until(lambda: f"job {JOB} ready in" in caplog.text, "the listed job to be prepared")
    status = worker.status()
    assert len(status.replicas) == 2 and status.tasks_in_flight == 0 and link.spec_fetches == 1
    [ready] = status.jobs
    assert (ready.job_id, ready.state) == (JOB, "ready") and ready.seconds > 0
    assert serde.rollout_status(status).jobs[0].state == "ready"  # what GetRolloutStatus sends
    assert link.to_lease.empty() and link.reports.empty()  # prepared with no task leased
    assert _metric(metrics, "flexmarl_rolloutd_engines_preparing") == 0

    task = _task(spec, 0)
    link.to_lease.put_nowait(task)  # the first task finds the job ready: nothing is prepared inside it
    report = await asyncio.wait_for(link.reports.get(), 60)
    assert report.succeeded, report.error
    assert "waits for job" not in caplog.text and caplog.text.count(f"preparing job {JOB}") == 1
    assert link.spec_fetches == 1
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")


async def test_a_listed_job_that_cannot_run_fails_its_first_task_as_unrunnable(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    worker, link = served.worker, served.link
    caplog.set_level("INFO", logger="rolloutd.worker")
    broken = served.spec.model_copy(update={"environment": served.spec.environment.model_copy(
        update={"entrypoint": "examples.signalling.env:SignalingGame"})})  # a typo in the module
    link.spec_json = broken.to_json()
    link.active = [ActiveJob(JOB, broken.digest())]
    await _until(lambda: f"preparing job {JOB} failed" in caplog.text, "the listed job's preparation to fail")
    [failed] = worker.status().jobs  # visible before any task takes it
    assert (failed.job_id, failed.state) == (JOB, "failed") and "examples.signalling.env" in failed.error
    link.to_lease.put_nowait(_task(broken, 3))
    report = await asyncio.wait_for(link.reports.get(), 30)  # the failure the preparation met, not a hang
    assert not report.succeeded and report.reason is ErrorReason.JOB_UNRUNNABLE
    assert "examples.signalling.env" in report.error
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")
    assert caplog.text.count(f"preparing job {JOB}:") == 1  # the failure was handed over, not prepared again


async def test_a_job_checked_against_other_environment_code_than_the_worker_runs_is_refused(served: Served) -> None:
    """The preflight's code_digest against the module this worker imported: another one is never run."""
    worker, link = served.worker, served.link
    checked_elsewhere = served.spec.model_copy(update={"environment": served.spec.environment.model_copy(
        update={"code_digest": "sha256:" + "0" * 64})})
    link.spec_json = checked_elsewhere.to_json()
    link.to_lease.put_nowait(_task(checked_elsewhere, 3))
    report = await asyncio.wait_for(link.reports.get(), 30)
    assert not report.succeeded and report.reason is ErrorReason.JOB_UNRUNNABLE
    assert report.error.startswith("environment.code_digest: the job was checked against examples.signaling.env "
                                   "at sha256:000000000000..., but this rolloutd runs examples.signaling.env as it "
                                   "imported it earlier (sha256:")
    assert "restart rolloutd" in report.error
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")


async def test_a_job_checked_against_the_code_the_worker_runs_is_served(served: Served) -> None:
    worker, link = served.worker, served.link
    digest = source_digest("examples.signaling.env")
    checked = served.spec.model_copy(update={"environment": served.spec.environment.model_copy(
        update={"code_digest": digest})})
    link.spec_json = checked.to_json()
    link.to_lease.put_nowait(_task(checked, 1))
    report = await asyncio.wait_for(link.reports.get(), 60)
    assert report.succeeded, report.error
    assert loaded_digest("examples.signaling.env") == digest
    await _until(lambda: worker.status().tasks_in_flight == 0, "the task to leave the worker")


async def test_auto_leases_as_many_tasks_as_the_served_job_admits_shared_among_the_live_rolloutds(
    engine_checkpoint: Path, etcd: EtcdServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--max-tasks auto``: a job admitting (5 + 1) x 4 = 24 tasks gets 24 in flight, 12 while another rolloutd runs.

    The tasks are held before their episodes, so no engine or stored is ever called (the addresses are dead).
    """
    monkeypatch.setattr(worker_module, "JOB_DISCOVERY_INTERVAL_S", 0.05)
    monkeypatch.setattr(worker_module, "LEASE_WAIT_MS", 50)
    held = asyncio.Event()  # never set: a task holds its slot until the worker stops (the lease loop is the subject)

    async def hold(self: RolloutRunner, task: RolloutTaskInput) -> RolloutResult:
        await held.wait()
        raise AssertionError("held tasks never finish")

    monkeypatch.setattr(RolloutRunner, "run", hold)
    spec = _spec(engine_checkpoint, prompts_per_step=4, pipeline={"max_staleness": 5})
    link = FakeOrchestrator(spec)
    settings = WorkerSettings(
        worker_id="rolloutd-auto", work_dir=tmp_path / "rolloutd", max_tasks=None, engine_backend="embedded",
        engine_replicas=2, engine_urls=("http://127.0.0.1:9", "http://127.0.0.1:9"), engine_threads=1,
        orchestrator_address="", store_address="127.0.0.1:9", max_message_bytes=16 << 20,
    )
    metrics = CollectorRegistry()
    registry = Registry(etcd.endpoint, "/auto")
    await registry.connect()
    worker = RolloutWorker(settings, registry, RolloutMetrics(metrics), link=link)
    await worker.start()
    try:
        assert (worker.status().max_tasks, _metric(metrics, "flexmarl_rolloutd_max_tasks")) == (8, 8)  # no job yet
        link.active = [ActiveJob(JOB, spec.digest())]
        await _until(lambda: worker.status().max_tasks == 24, "the served job to size the limit")
        status = serde.rollout_status(worker.status())  # what GetRolloutStatus sends
        assert (status.max_tasks, status.max_tasks_auto, status.live_rolloutds) == (24, True, 1)
        assert _metric(metrics, "flexmarl_rolloutd_max_tasks") == 24 and worker._max_pending_appends == 12

        peer = ServiceRecord(kind="rolloutd", service_id="rolloutd-peer", address="127.0.0.1:1", metrics_port=-1,
                             pid=1, started_unix_ms=0)
        await registry.register(peer, ttl_s=10)
        await _until(lambda: worker.status().max_tasks == 12, "another live rolloutd to halve the limit")
        assert worker.status().live_rolloutds == 2 and worker._max_pending_appends == 6
        for position in range(14):
            link.to_lease.put_nowait(_task(spec, position))
        await _until(lambda: worker.status().tasks_in_flight == 12, "12 tasks in flight")
        assert link.to_lease.qsize() == 2  # 12 in flight: more than the fixed 8 of old

        await registry.deregister("rolloutd", "rolloutd-peer")
        await _until(lambda: worker.status().tasks_in_flight == 14, "the rest leased once the peer left")
        assert worker.status().max_tasks == 24 and link.to_lease.empty() and 12 in link.lease_max_tasks
    finally:
        await worker.stop()
        await registry.close()


def _flaky_appends(monkeypatch: pytest.MonkeyPatch, errors: list[BaseException]) -> list[int]:
    """Makes stored's appends raise ``errors`` in turn, then succeed; returns the batch size of every call."""
    calls: list[int] = []
    real_append = StoreClient.append

    async def append(self: StoreClient, records: Sequence[ExperienceRecord]) -> tuple[int, int]:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return await real_append(self, records)

    monkeypatch.setattr(StoreClient, "append", append)
    return calls


# ---- the pieces, without a network ---------------------------------------------------------------


def _rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_an_append_that_timed_out_or_found_stored_down_is_retried() -> None:
    # grpc.aio's errors are no grpc.Call: the code must be read from AioRpcError itself.
    assert _append_retry_code(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert _append_retry_code(_rpc_error(grpc.StatusCode.UNAVAILABLE)) is grpc.StatusCode.UNAVAILABLE
    assert _append_retry_code(Unavailable("stored not registered")) is grpc.StatusCode.UNAVAILABLE
    assert _append_retry_code(_rpc_error(grpc.StatusCode.INTERNAL)) is None
    assert _append_retry_code(ResourceExhausted("record too large")) is None


class _Peers:
    """The part of PeerConnections the gRPC link uses, around a stub whose calls fail as told."""

    def __init__(self, error: BaseException | None, reply: Any = None) -> None:
        self.resets = 0
        self.error = error
        self.reply = reply
        self.requests: list[Any] = []

    async def orchestrator(self) -> Any:
        peers = self

        class Stub:
            def __getattr__(self, name: str) -> Callable[..., Any]:
                async def call(request: Any, timeout: float) -> Any:
                    peers.requests.append(request)
                    if peers.error is not None:
                        raise peers.error
                    return peers.reply

                return call

        return Stub()

    async def reset_orchestrator(self) -> None:
        self.resets += 1


def _link(peers: _Peers) -> GrpcOrchestratorLink:
    return GrpcOrchestratorLink(cast(PeerConnections, peers))


async def test_the_grpc_link_keeps_definite_answers_and_turns_the_rest_into_unavailable() -> None:
    report = TaskReport("lease-1", f"{JOB}/b0/t0", error="x" * 5000)
    rejected = _Peers(_rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "lease lost"))
    with pytest.raises(FailedPrecondition, match="lease lost"):
        await _link(rejected).report("w", report)
    assert rejected.resets == 0  # a definite answer: the channel is fine
    assert len(rejected.requests[0].error) == 4096 and not rejected.requests[0].succeeded

    gone = _Peers(_rpc_error(grpc.StatusCode.NOT_FOUND, "no such job"))
    with pytest.raises(NotFound):
        await _link(gone).job_state(JOB)

    for error in (_rpc_error(grpc.StatusCode.UNAVAILABLE), _rpc_error(grpc.StatusCode.INTERNAL),
                  _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED), Unavailable("no orchestratord registered")):
        down = _Peers(error)
        with pytest.raises(Unavailable, match="leasing tasks"):
            await _link(down).lease_tasks("w", 2, 0)
        assert down.resets == 1  # rediscovered on the next call


async def test_the_grpc_link_decodes_tasks_and_leaves_a_malformed_one_to_expire() -> None:
    good = orchestrator_pb2.RolloutTask(lease_id="l1", job_id=JOB, task_id=f"{JOB}/b2/t5", task_index=5,
                                        group_size=4, attempt=2, spec_digest="d",
                                        agent_versions=[{"agent": "sender", "version": 3, "weights_uri": "u"}])
    bad = orchestrator_pb2.RolloutTask(lease_id="l2", job_id=JOB, task_id="not-a-task-id")
    other_job = orchestrator_pb2.RolloutTask(lease_id="l3", job_id="other", task_id=f"{JOB}/b2/t6")
    peers = _Peers(None, orchestrator_pb2.LeaseRolloutTasksResponse(tasks=[good, bad, other_job]))
    tasks = await _link(peers).lease_tasks("w", 3, 0)
    assert [t.lease_id for t in tasks] == ["l1"]
    task = tasks[0]
    assert (task.job_id, task.task_id, task.task_index, task.group_size, task.attempt) == (JOB, f"{JOB}/b2/t5", 5, 4, 2)
    assert [(v.agent, v.version, v.weights_uri) for v in task.agent_versions] == [("sender", 3, "u")]
    assert peers.requests[0].worker_id == "w" and peers.requests[0].max_tasks == 3
