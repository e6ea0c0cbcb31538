"""rolloutd's worker loop: lease rollout tasks, run their episodes, store experiences, report.

A task's experiences are durable in stored before the task is reported done; a task
whose lease is lost (renewal says so, or the orchestrator rejects the report) is
abandoned, and the experiences it may already have written are kept by stored and
deduplicated by id when the re-issued task writes them again.

Backpressure: when stored is full (its per-job quota: RESOURCE_EXHAUSTED, reason
QUOTA_EXCEEDED), down or slow, a finished task keeps its experiences and retries the append with
exponential backoff for as long as its lease lives (the renew loop keeps renewing it, and cancels the task
only when the orchestrator says the lease is lost). Meanwhile the lease loop leases nothing new:
while appends are failing, or while half of ``max_tasks`` or more tasks wait on their append.
Rollouts slow down to what stored absorbs instead of dropping data.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from flexmarl.artifacts import resolve_dir
from flexmarl.connections import PeerConnections, cancelled_from_outside, describe_error
from flexmarl.devices import DeviceSet
from flexmarl.errors import ErrorReason, FlexmarlError, InvalidArgument, ResourceExhausted, Unavailable
from flexmarl.experience import group_id
from flexmarl.ids import TaskRef
from flexmarl.jobspec import JobSpec, JobSpecCache
from flexmarl.registry import Registry
from flexmarl.security import INSECURE, TransportSecurity
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2
from rolloutd.balancer import BalancerConfig, RoutingPolicy
from rolloutd.config import EnginePathMap
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, attach, launch
from rolloutd.episode import Environment, HFTokenizer, load_environment
from rolloutd.metrics import RolloutMetrics
from rolloutd.router import Replica, RolloutRouter, agent_key
from rolloutd.runner import AgentRuntime, RolloutResult, RolloutRunner, RolloutTaskInput

log = logging.getLogger(__name__)

RENEW_INTERVAL_S = 2.0
JOB_SWEEP_INTERVAL_S = 10.0
_FINISHED_JOB_STATES = (orchestrator_pb2.JOB_STATE_SUCCEEDED, orchestrator_pb2.JOB_STATE_FAILED,
                        orchestrator_pb2.JOB_STATE_CANCELLED)
LEASE_WAIT_MS = 2000
#: Bound on one call to orchestratord, discovery in etcd included (the RPCs have their own deadlines).
POLL_DEADLINE_S = 40.0
#: Report attempts (backoff 0.2 s doubling to 2 s: about 20 s in all).
REPORT_ATTEMPTS = 12
APPEND_BACKOFF_MIN_S = 0.2
APPEND_BACKOFF_MAX_S = 5.0
BACKPRESSURE_POLL_S = 0.1
_RETRIED_APPEND_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclasses.dataclass
class _ServedJob:
    """A training job whose agents this worker serves (its spec, environment and runner)."""

    job_id: str
    spec: JobSpec
    env: Environment
    runner: RolloutRunner


@dataclasses.dataclass(frozen=True)
class _InFlightTask:
    """A leased rollout task being run (keyed by its lease id, which renewals speak)."""

    ref: TaskRef
    runner: asyncio.Task[None]


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What the worker needs from rolloutd's config."""

    worker_id: str
    work_dir: Path
    max_tasks: int
    engine_backend: str
    engine_replicas: int
    engine_urls: tuple[str, ...]
    engine_threads: int
    orchestrator_address: str
    store_address: str
    max_message_bytes: int
    security: TransportSecurity = INSECURE
    engine_tp_size: int = 1
    #: One device set per launched replica; None: the replicas inherit rolloutd's devices.
    engine_device_sets: tuple[DeviceSet, ...] | None = None
    deterministic_inference: bool = True
    engine_launch_timeout_s: float = 600.0
    engine_extra_args: tuple[str, ...] = ()
    #: How attached engines (engine_urls) name rolloutd's checkpoint paths.
    engine_path_map: EnginePathMap = dataclasses.field(default_factory=EnginePathMap)
    #: Where stored:// checkpoints are unpacked (None: <work_dir>/weights).
    weights_cache_dir: Path | None = None

    @property
    def weights_cache(self) -> Path:
        """The directory stored:// checkpoints are unpacked into."""
        return self.weights_cache_dir or self.work_dir / "weights"


def replica_specs(settings: WorkerSettings, model_path: str) -> list[ReplicaSpec]:
    """What each replica rolloutd launches runs: its backend, model, devices and flags."""
    devices = settings.engine_device_sets
    if devices is not None and len(devices) != settings.engine_replicas:
        raise InvalidArgument(f"{len(devices)} device sets for {settings.engine_replicas} replicas")
    return [
        ReplicaSpec(backend=settings.engine_backend, model_path=model_path,  # type: ignore[arg-type]
                    num_threads=settings.engine_threads, tp_size=settings.engine_tp_size,
                    deterministic_inference=settings.deterministic_inference,
                    devices=None if devices is None else devices[index], extra_args=settings.engine_extra_args)
        for index in range(settings.engine_replicas)
    ]


def weights_resolver(
    cache_dir: Path, path_map: EnginePathMap, store: Callable[[], Awaitable[StoreClient]],
) -> Callable[[str], Awaitable[str]]:
    """The router's resolver: a weights URI to the path the engines load it from.

    A ``stored://`` checkpoint is unpacked into ``cache_dir`` once; the local directory is
    then named as the engines see it (``path_map``; identity for launched replicas).

    Raises (from the resolver):
        InvalidArgument: the URI is malformed, or its directory is outside every mapped prefix.
    """
    async def resolve(uri: str) -> str:
        client = await store() if uri.startswith("stored://") else None
        return path_map.to_engine(str(await resolve_dir(uri, cache_dir, client)))

    return resolve


class RolloutWorker:
    """Pulls tasks from orchestratord and turns them into experiences in stored."""

    def __init__(self, settings: WorkerSettings, registry: Registry, metrics: RolloutMetrics) -> None:
        self.settings = settings
        self._registry = registry
        self._metrics = metrics
        self._engines: list[EngineReplica] = []
        self.router: RolloutRouter | None = None
        self._jobs: dict[str, _ServedJob] = {}
        self._in_flight: dict[str, _InFlightTask] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._peers = PeerConnections(registry, orchestrator_address=settings.orchestrator_address,
                                      store_address=settings.store_address,
                                      max_message_bytes=settings.max_message_bytes, security=settings.security)
        self._engine_lock = asyncio.Lock()
        self._job_lock = asyncio.Lock()
        self._specs = JobSpecCache(self._fetch_spec)
        self.episodes_done = 0
        self._stopping = False
        #: Tasks whose experiences wait to be durable in stored, and since when appends fail (None: they succeed).
        self._pending_appends = 0
        self._max_pending_appends = max(1, settings.max_tasks // 2)
        self._appends_failing_since: float | None = None
        metrics.watch_router(lambda: self.router)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the lease and renewal loops (engines start with the first job)."""
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._lease_loop(), name="lease loop"),
                       loop.create_task(self._renew_loop(), name="renew loop")]

    async def stop(self) -> None:
        """Stops leasing, cancels running tasks (their leases expire and are re-issued), stops engines."""
        self._stopping = True
        running = [*self._loops, *(entry.runner for entry in self._in_flight.values())]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.router is not None:
            await self.router.close()
            for replica in self.router.replicas():
                with contextlib.suppress(Exception):
                    await replica.client.close()
        for engine in self._engines:
            await asyncio.to_thread(engine.stop, 10.0)
        await self._peers.close()

    # ---- leasing -----------------------------------------------------------------------------------

    def store_backpressure(self) -> str:
        """Why no new task should be leased now because of stored ("" when leasing may go on)."""
        if self._appends_failing_since is not None:
            return f"appends to stored failing for {time.monotonic() - self._appends_failing_since:.1f} s"
        if self._pending_appends >= self._max_pending_appends:
            return f"{self._pending_appends} tasks waiting on their append to stored"
        return ""

    async def _wait_out_backpressure(self) -> None:
        """Blocks while stored pushes back, counting the time in the backpressure metrics."""
        reason = self.store_backpressure()
        if not reason:
            return
        log.warning("not leasing new tasks: %s", reason)
        self._metrics.backpressure.set(1)
        last_s = time.monotonic()
        try:
            while not self._stopping and self.store_backpressure():
                await asyncio.sleep(BACKPRESSURE_POLL_S)
                now_s = time.monotonic()
                self._metrics.backpressure_seconds.inc(now_s - last_s)
                last_s = now_s
        finally:
            self._metrics.backpressure.set(0)
        log.info("stored keeps up again; leasing tasks")

    async def _lease_loop(self) -> None:
        backoff_s = 0.2
        while not self._stopping:
            await self._wait_out_backpressure()
            free = self.settings.max_tasks - len(self._in_flight)
            if free <= 0 or self._stopping:
                await asyncio.sleep(0.05)
                continue
            try:
                # Discovery included: nothing in one poll may wait longer than the poll itself.
                async with asyncio.timeout(POLL_DEADLINE_S):
                    stub = await self._peers.orchestrator()
                    reply = await stub.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
                        worker_id=self.settings.worker_id, max_tasks=free, wait_ms=LEASE_WAIT_MS), timeout=30)
                backoff_s = 0.2
            except (grpc.RpcError, FlexmarlError, TimeoutError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise
                log.warning("leasing tasks failed (%s); retrying", describe_error(exc))
                await self._peers.reset_orchestrator()
                await asyncio.sleep(backoff_s)
                backoff_s = min(5.0, backoff_s * 2)
                continue
            for task in reply.tasks:
                try:
                    ref = TaskRef.parse(task.task_id)
                except InvalidArgument as exc:  # an orchestratord bug: let the lease expire
                    log.error("leased task %s not run: %s", task.lease_id, exc)
                    continue
                self._in_flight[task.lease_id] = _InFlightTask(ref, asyncio.get_running_loop().create_task(
                    self._run(task), name=f"task {task.task_id}"))

    async def _renew_loop(self) -> None:
        last_sweep_s = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(RENEW_INTERVAL_S)
            if time.monotonic() - last_sweep_s > JOB_SWEEP_INTERVAL_S:
                last_sweep_s = time.monotonic()
                await self._forget_finished_jobs()
            if not self._in_flight:
                continue
            try:
                async with asyncio.timeout(POLL_DEADLINE_S):
                    stub = await self._peers.orchestrator()
                    reply = await stub.RenewLeases(orchestrator_pb2.RenewLeasesRequest(
                        worker_id=self.settings.worker_id, lease_ids=list(self._in_flight)), timeout=10)
            except (grpc.RpcError, FlexmarlError, TimeoutError, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and cancelled_from_outside():
                    raise
                log.warning("renewing leases failed (%s)", describe_error(exc))
                continue
            for lease_id in reply.lost_lease_ids:
                entry = self._in_flight.get(lease_id)
                if entry is not None:
                    log.warning("lease %s lost; abandoning its task", lease_id)
                    entry.runner.cancel()

    async def _forget_finished_jobs(self) -> None:
        """Stops serving the agents of jobs that ended (their replicas go to the live jobs)."""
        busy = {entry.ref.job_id for entry in self._in_flight.values()}
        ended = []
        for job_id in list(self._jobs):
            if job_id in busy:
                continue
            try:
                async with asyncio.timeout(POLL_DEADLINE_S):
                    stub = await self._peers.orchestrator()
                    status = await stub.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=10)
            except grpc.RpcError as exc:
                if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND:
                    ended.append(job_id)
                continue
            except (FlexmarlError, TimeoutError):  # no orchestratord registered right now: ask again later
                continue
            if status.state in _FINISHED_JOB_STATES:
                ended.append(job_id)
        if not ended or self.router is None:
            return
        async with self._job_lock:
            for job_id in ended:
                self._jobs.pop(job_id, None)
                self._specs.forget(job_id)
            await self.router.set_agents([agent_key(j.job_id, a) for j in self._jobs.values()
                                          for a in j.spec.agent_names])
        log.info("stopped serving finished jobs %s", ended)

    # ---- one task ----------------------------------------------------------------------------------

    async def _run(self, task: orchestrator_pb2.RolloutTask) -> None:
        started = time.perf_counter()
        try:
            job = await self._job(task)
            assert self.router is not None
            for version in task.agent_versions:
                base = job.spec.agent(version.agent).model
                self.router.require(agent_key(task.job_id, version.agent), version.version,
                                    version.weights_uri or base)
            stored = await self._durable_experiences(job, task) if task.attempt > 1 else None
            if stored is not None:
                # An earlier attempt's experiences are durable: they are the task's result (exactly once).
                log.info("task %s: reusing %d stored experiences of an earlier attempt", task.task_id, len(stored))
                await self._report_summaries(task, stored, "")
                return
            result = await job.runner.run(RolloutTaskInput(task.job_id, task.task_id, task.task_index,
                                                           job.spec.seed, task.group_size))
            if result.ok:
                await self._store_experiences(result)
                await self._report(task, result, "")
                self.episodes_done += task.group_size
                self._metrics.observe_task(result, time.perf_counter() - started)
            else:
                first = result.errors[0]
                message = f"episode {first.sample_index}: {first.error_type}: {first.message}"
                log.warning("task %s failed: %s", task.task_id, message)
                await self._report(task, result, message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything else fails the task, never the daemon
            log.exception("task %s failed", task.task_id)
            with contextlib.suppress(Exception):
                await self._report(task, None, f"{type(exc).__name__}: {exc}")
        finally:
            self._in_flight.pop(task.lease_id, None)

    async def _store_experiences(self, result: RolloutResult) -> None:
        """Appends a task's experiences, retrying while stored is full, down or slow (see the module doc).

        There is no deadline: the task's lease bounds the wait (the renew loop cancels this task
        when the lease is lost, and the re-issued task produces the experiences again). Any other
        error (a malformed or oversized record) fails the task at once.
        """
        self._pending_appends += 1
        self._metrics.pending_appends.set(self._pending_appends)
        backoff_s = APPEND_BACKOFF_MIN_S
        try:
            while True:
                try:
                    store = await self._peers.store()
                    await store.append(result.experiences)
                    self._appends_failing_since = None
                    return
                except (ResourceExhausted, Unavailable, grpc.RpcError) as exc:
                    code = _append_retry_code(exc)
                    if code is None:
                        raise
                    if self._appends_failing_since is None:
                        self._appends_failing_since = time.monotonic()
                        log.warning("appending to stored failed (%s); holding the experiences and retrying",
                                    describe_error(exc))
                    self._metrics.append_retries.labels(code.name).inc()
                    if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await self._peers.reset_store()
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(APPEND_BACKOFF_MAX_S, backoff_s * 2)
        finally:
            self._pending_appends -= 1
            self._metrics.pending_appends.set(self._pending_appends)
            if self._pending_appends == 0:
                # "Failing" describes appends still waiting. A task cancelled mid-retry (its lease
                # lost) must not leave it set: a re-issued task that reuses durable experiences
                # appends nothing, so no success would ever clear it and leasing would stop for good.
                self._appends_failing_since = None

    async def _durable_experiences(
        self, job: _ServedJob, task: orchestrator_pb2.RolloutTask
    ) -> list[orchestrator_pb2.ExperienceSummary] | None:
        """The experiences an earlier attempt of the task stored (all or nothing), or None.

        rolloutd appends a task's experiences in one request, which stored applies
        atomically, so a task is either wholly stored or not at all.
        """
        store = await self._peers.store()
        found: list[orchestrator_pb2.ExperienceSummary] = []
        for agent in job.spec.agent_names:
            refs = await store.query(task.job_id, agent, group_id=group_id(task.task_id, agent))
            found.extend(
                orchestrator_pb2.ExperienceSummary(
                    experience_id=r.experience_id, agent=agent, group_id=r.group_id, sample_index=r.sample_index,
                    behavior_version=r.behavior_version, response_tokens=r.response_tokens, reward=r.reward)
                for r in refs
            )
        if not found:
            return None
        for agent in job.spec.agent_names:
            samples = {e.sample_index for e in found if e.agent == agent}
            if samples != set(range(task.group_size)):
                raise Unavailable(f"task {task.task_id}: stored holds a partial group of {agent} "
                                  f"(samples {sorted(samples)})")
        return found

    async def _report(self, task: orchestrator_pb2.RolloutTask, result: RolloutResult | None, error: str) -> None:
        experiences = [] if result is None or error else [
            orchestrator_pb2.ExperienceSummary(
                experience_id=e.experience_id, agent=e.agent, group_id=e.group_id, sample_index=e.sample_index,
                behavior_version=e.behavior_version, response_tokens=e.response_tokens, reward=e.reward,
            )
            for e in result.experiences
        ]
        await self._report_summaries(task, experiences, error)

    async def _report_summaries(
        self, task: orchestrator_pb2.RolloutTask, experiences: list[orchestrator_pb2.ExperienceSummary], error: str
    ) -> None:
        request = orchestrator_pb2.ReportRolloutTaskRequest(
            lease_id=task.lease_id, worker_id=self.settings.worker_id, task_id=task.task_id,
            succeeded=not error, error=error[:4096], experiences=experiences)
        # Long enough to outlast an orchestratord restart (~3-10 s): a report given up costs a
        # lease timeout before the task is re-issued.
        backoff_s = 0.2
        for _attempt in range(REPORT_ATTEMPTS):
            try:
                async with asyncio.timeout(POLL_DEADLINE_S):
                    stub = await self._peers.orchestrator()
                    await stub.ReportRolloutTask(request, timeout=30)
                return
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    log.warning("report of task %s rejected: %s", task.task_id, describe_error(exc))
                    return
            except (FlexmarlError, TimeoutError):  # no orchestratord registered right now
                pass
            await self._peers.reset_orchestrator()
            await asyncio.sleep(backoff_s)
            backoff_s = min(2.0, backoff_s * 2)
        log.error("could not report task %s; its lease will expire", task.task_id)

    # ---- jobs and engines --------------------------------------------------------------------------

    async def _job(self, task: orchestrator_pb2.RolloutTask) -> _ServedJob:
        job = self._jobs.get(task.job_id)
        if job is not None:
            return job
        async with self._job_lock:  # one set-up per job, however many of its tasks arrive at once
            job = self._jobs.get(task.job_id)
            if job is not None:
                return job
            return await self._new_job(task)

    async def _fetch_spec(self, job_id: str) -> str:
        """A job's spec JSON from orchestratord (once per job: :class:`~flexmarl.jobspec.JobSpecCache`)."""
        stub = await self._peers.orchestrator()
        status = await stub.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=30)
        return str(status.spec_json)

    async def _new_job(self, task: orchestrator_pb2.RolloutTask) -> _ServedJob:
        spec = await self._specs.get(task.job_id, task.spec_digest)
        await self._ensure_engines(spec)
        assert self.router is not None
        env = await asyncio.to_thread(load_environment, spec.environment.entrypoint, spec.environment.config)
        missing = [a for a in env.agents if a not in spec.agent_names]
        if missing:
            raise InvalidArgument(f"environment needs agents {missing} that the job spec lacks")
        runtimes = {}
        for agent in spec.agents:
            tokenizer = await asyncio.to_thread(HFTokenizer, agent.model)
            runtimes[agent.name] = AgentRuntime(tokenizer, _sampling_of(agent.sampling.model_dump()))
        runner = RolloutRunner(env, runtimes, self.router.backend(task.job_id, spec.seed))
        job = _ServedJob(task.job_id, spec, env, runner)
        self._jobs[task.job_id] = job
        await self.router.set_agents([agent_key(j.job_id, a) for j in self._jobs.values()
                                      for a in j.spec.agent_names])
        log.info("serving job %s (%s)", task.job_id, spec.name)
        return job

    async def _ensure_engines(self, spec: JobSpec) -> None:
        async with self._engine_lock:
            if self.router is not None:
                return
            s = self.settings
            if s.engine_urls:
                engines = [attach(url) for url in s.engine_urls]
                path_map = s.engine_path_map
            else:
                engines = []
                for index, replica_spec in enumerate(replica_specs(s, spec.agents[0].model)):
                    engines.append(await launch(replica_spec, s.work_dir / "engines", name=f"engine-{index}",
                                                timeout_s=s.engine_launch_timeout_s))
                    self._engines = engines  # stop() stops the ones started, even if a later one fails
                path_map = EnginePathMap()  # launched replicas see rolloutd's filesystem
            replicas = [Replica(f"replica-{i}", e.client()) for i, e in enumerate(engines)]
            cache = s.weights_cache
            cache.mkdir(parents=True, exist_ok=True)
            resolve = weights_resolver(cache, path_map, self._peers.store)

            # The first job's rollout.balancing sets the policy of this worker's router (benchmarks, ablations).
            balancing = spec.balancing
            config = BalancerConfig(rebalance_enabled=balancing == "hierarchical", routing=RoutingPolicy.ROUND_ROBIN
                                    if balancing == "round-robin" else RoutingPolicy.LEAST_TOKENS)
            self.router = RolloutRouter(replicas, resolve, config=config, on_reload=self._metrics.observe_reload)

    def status(self) -> dict[str, Any]:
        """What GetRolloutStatus reports."""
        return {"tasks_in_flight": len(self._in_flight), "episodes_done": self.episodes_done}


def _append_retry_code(exc: Exception) -> grpc.StatusCode | None:
    """The status code of an append failure worth retrying, or None.

    stored answers RESOURCE_EXHAUSTED both for a full job quota (retried: GC or an operator
    frees room) and for a record or request over its size limits (never fits: not retried);
    the error's reason (sent in the status's trailing metadata) tells them apart.
    """
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED if exc.reason is ErrorReason.QUOTA_EXCEEDED else None
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, grpc.Call) and exc.code() in _RETRIED_APPEND_CODES:
        code: grpc.StatusCode = exc.code()
        return code
    return None


def _sampling_of(sampling: dict[str, Any]) -> dict[str, Any]:
    """Spec sampling settings in SGLang's sampling_params names."""
    return {k: v for k, v in json.loads(json.dumps(sampling)).items() if v is not None}
