"""rolloutd's worker loop: lease rollout tasks, run their episodes, store experiences, report.

A task's experiences are durable in stored before the task is reported done; a task
whose lease is lost (renewal says so, or the orchestrator rejects the report) is
abandoned, and the experiences it may already have written are kept by stored and
deduplicated by id when the re-issued task writes them again.

Backpressure: when stored is full (its per-job quota or its disk: RESOURCE_EXHAUSTED, reason
QUOTA_EXCEEDED or DISK_FULL), down or slow, a finished task keeps its experiences and retries the append with
exponential backoff for as long as its lease lives (the renew loop keeps renewing it, and cancels the task
only when the orchestrator says the lease is lost). Meanwhile the lease loop leases nothing new:
while appends are failing, or while half of the task limit or more tasks wait on their append.
Rollouts slow down to what stored absorbs instead of dropping data.

The worker speaks dataclasses (:mod:`rolloutd.types`): to orchestratord through an
:class:`~rolloutd.link.OrchestratorLink` (gRPC in :mod:`rolloutd.link`, protos in
:mod:`rolloutd.serde`), to stored through :class:`flexmarl.store_client.StoreClient`; every retry
is :mod:`flexmarl.retry`'s.

A job's engines are made ready when the worker learns of the job, not inside its first task: the
job loop lists the pending and running jobs every :data:`JOB_DISCOVERY_INTERVAL_S`
(:meth:`~rolloutd.link.OrchestratorLink.active_jobs`) and prepares each new one in a background task
(:meth:`RolloutWorker._prepare`: launch or attach the engines, LoRA flags, router, weight groups,
environment, runner). A leased task finds its job ready or waits on that same preparation (a job first
seen in a lease starts it then), logged and counted (``flexmarl_rolloutd_engines_preparing``); while
it waits its lease renewals count as progress (:attr:`TaskProgress.setting_up`), so orchestratord's
progress bound does not take it for hung: the wait is bounded by ``engine_launch_timeout_s`` per
launched replica. A preparation that fails is the error of the tasks waiting on it (a job that cannot
run: ``JOB_UNRUNNABLE``, as before), then forgotten, so the next task of the job tries again.

How many tasks it leases at once (``--max-tasks``: a number, or ``auto``, sized from the served jobs'
staleness rules and the live rolloutds in etcd's service directory) is :mod:`rolloutd.task_limit`'s; the
worker hands it the served jobs as they come and go and the directory's rolloutds as they change.

Partial rollouts (``rollout.partial_rollout``) and distributed weight sync (``rollout.weight_sync:
distributed``, :mod:`rolloutd.weight_sync`): for each such job the worker keeps one
WatchAgentVersions stream open (:meth:`~rolloutd.link.OrchestratorLink.watch_versions`) and
hands every committed version to the router at once (:meth:`RolloutRouter.publish`), which
interrupts a partial-rollout agent's running generations and reloads its replicas, and every
version its trainer announces before broadcasting it to :meth:`RolloutRouter.announce`. Other jobs
learn versions only from their leased tasks' minimum versions, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from flexmarl.artifacts import resolve_dir
from flexmarl.connections import PeerConnections, describe_error
from flexmarl.datasets import TaskDataset, open_dataset, read_rows
from flexmarl.devices import DeviceSet
from flexmarl.entrypoints import loaded_digest
from flexmarl.episode import Environment, load_environment
from flexmarl.errors import (
    ErrorReason,
    FailedPrecondition,
    FlexmarlError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from flexmarl.experience import ExperienceSummary, FailedEpisode, group_id, min_episodes_to_train
from flexmarl.ids import EvalTaskRef, TaskRef
from flexmarl.jobspec import MAX_TASKS_PER_LEASE, JobSpec, JobSpecCache
from flexmarl.registry import Registry, ServiceDirectory, ServiceRecord
from flexmarl.retry import RetryPolicy, retry
from flexmarl.security import INSECURE, TransportSecurity
from flexmarl.store_client import StoreClient
from rolloutd.balancer import BalancerConfig, RoutingPolicy
from rolloutd.config import EnginePathMap
from rolloutd.engines.launcher import Backend, EngineReplica, ReplicaSpec, attach, launch
from rolloutd.engines.lora import DEFAULT_MAX_LORAS_PER_BATCH, LoraSettings
from rolloutd.engines.supervisor import EngineSupervisor
from rolloutd.engines.vllm.jobs import refuse_unservable
from rolloutd.external_env import ExternalAgents
from rolloutd.link import GrpcOrchestratorLink, OrchestratorLink
from rolloutd.lora_launch import engine_lora_settings, launch_model, lora_bases
from rolloutd.metrics import RolloutMetrics
from rolloutd.router import Replica, RolloutRouter, agent_key
from rolloutd.runner import AgentRuntime, RolloutResult, RolloutRunner, RolloutTaskInput, TaskProgress
from rolloutd.task_limit import DEFAULT_CAP, TaskLimit
from rolloutd.tokenizers import HFTokenizer
from rolloutd.types import AgentDemand, JobPreparation, ReplicaStatus, RolloutStatus, RolloutTask, TaskReport

log = logging.getLogger(__name__)

RENEW_INTERVAL_S = 2.0
JOB_SWEEP_INTERVAL_S = 10.0
#: Between listings of the pending and running jobs whose engines the worker prepares ahead of their tasks.
JOB_DISCOVERY_INTERVAL_S = 5.0
LEASE_WAIT_MS = 2000
#: Between failed lease polls: 0.2 s doubling to 5 s, back to 0.2 s after a poll that answers.
LEASE_POLL_RETRY = RetryPolicy(initial_s=0.2, max_s=5.0)
#: Long enough to outlast an orchestratord restart (~3-10 s): 12 attempts, 0.2 s doubling to 2 s
#: (about 20 s in all). A report given up costs a lease timeout before the task is re-issued.
REPORT_RETRY = RetryPolicy(initial_s=0.2, max_s=2.0, attempts=12)
#: Appends retry without a deadline: the task's lease bounds the wait (see the module doc).
APPEND_RETRY = RetryPolicy(initial_s=0.2, max_s=5.0)
#: Between WatchAgentVersions streams that failed or ended: 0.2 s doubling to 5 s.
VERSION_WATCH_RETRY = RetryPolicy(initial_s=0.2, max_s=5.0)
BACKPRESSURE_POLL_S = 0.1
_RETRIED_APPEND_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclasses.dataclass
class _ServedJob:
    """A training job whose agents this worker serves (its spec, environment, runner and the engines' router)."""

    job_id: str
    spec: JobSpec
    env: Environment
    runner: RolloutRunner
    router: RolloutRouter
    #: The WatchAgentVersions loop of a partial-rollout job (None: the job does not interrupt).
    version_watch: asyncio.Task[None] | None = None
    #: Each agent's runtime (tokenizer, sampling), shared with the job's pinned evaluation rounds.
    runtimes: dict[str, AgentRuntime] = dataclasses.field(default_factory=dict)
    #: A pinned evaluation round served under agent keys of its own (:meth:`RolloutWorker._pinned`):
    #: the job it evaluates.
    pinned_of: str = ""
    #: Whether ``env`` is another served entry's (a pinned round's without a task file): closed with that one.
    shares_env: bool = False


@dataclasses.dataclass(frozen=True)
class _InFlightTask:
    """A leased rollout task being run (keyed by its lease id, which renewals speak)."""

    ref: TaskRef | EvalTaskRef
    runner: asyncio.Task[None]
    #: What its lease renewals report as the task's progress.
    progress: TaskProgress
    #: The served job it runs under (its job id, or a pinned evaluation round's key: :func:`served_key`).
    key: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What the worker needs from rolloutd's config."""

    worker_id: str
    work_dir: Path
    #: Tasks leased at once (``--max-tasks N``); None: ``auto``, sized from the served jobs within ``max_tasks_cap``.
    max_tasks: int | None
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
    #: LoRA agents' replicas: --max-loras-per-batch and --max-loaded-loras (None: no bound).
    engine_max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    engine_max_loaded_loras: int | None = None
    #: engine_backend vllm: the python of vLLM's virtual environment (launched replicas).
    vllm_python: str = ""
    #: The balancer decides on measured replica rates and load seconds; the priors until measured.
    balancer_measured_rates: bool = True
    balancer_tokens_per_s: float = 1000.0
    balancer_reassignment_cost_s: float = 10.0
    #: > 0: requests wait in rolloutd once a replica's reserved KV tokens reach this share of its capacity.
    balancer_dispatch_kv_factor: float = 0.0
    balancer_move_patience: float = 1.0  #: BalancerConfig.move_patience
    balancer_move_evicts: bool = False  #: BalancerConfig.move_evicts
    #: ``--max-tasks auto`` leases at most this many tasks at once.
    max_tasks_cap: int = DEFAULT_CAP

    @property
    def weights_cache(self) -> Path:
        """The directory stored:// checkpoints are unpacked into."""
        return self.weights_cache_dir or self.work_dir / "weights"


def replica_specs(settings: WorkerSettings, model_path: str, lora: LoraSettings | None = None,
                  dtype: str = "auto") -> list[ReplicaSpec]:
    """What each replica rolloutd launches runs: its backend, model, dtype, devices and flags (``lora``: LoRA flags)."""
    devices = settings.engine_device_sets
    if devices is not None and len(devices) != settings.engine_replicas:
        raise InvalidArgument(f"{len(devices)} device sets for {settings.engine_replicas} replicas")
    return [
        ReplicaSpec(backend=settings.engine_backend, model_path=model_path,  # type: ignore[arg-type]
                    num_threads=settings.engine_threads, tp_size=settings.engine_tp_size,
                    deterministic_inference=settings.deterministic_inference,
                    devices=None if devices is None else devices[index], extra_args=settings.engine_extra_args,
                    lora=lora or LoraSettings(), vllm_python=settings.vllm_python, dtype=dtype)
        for index in range(settings.engine_replicas)
    ]


def launch_dtype(spec: JobSpec, backend: str) -> str:
    """A launched replica's ``--dtype`` for the job: a vLLM replica's follows the agents' (``auto`` otherwise).

    vLLM's ``auto`` serves a float32 checkpoint in bfloat16 (``vllm/config/model.py``: "Downcast for
    float32 models"), so an fp32 job would sample from, and record logprobs of, another policy than
    the one traind trains. float32 when any agent trains in fp32 (a bf16 checkpoint upcasts exactly).
    """
    if backend != "vllm":
        return "auto"
    return "float32" if any(agent.dtype == "fp32" for agent in spec.agents) else "bfloat16"


def attached_engines(settings: WorkerSettings) -> list[EngineReplica]:
    """The replicas of ``engine_urls``, each spoken to in its backend's API (an embedded engine speaks SGLang's)."""
    backend: Backend = "vllm" if settings.engine_backend == "vllm" else "sglang"
    return [attach(url, backend) for url in settings.engine_urls]


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

    def __init__(
        self, settings: WorkerSettings, registry: Registry, metrics: RolloutMetrics,
        link: OrchestratorLink | None = None,
    ) -> None:
        """Builds the worker; ``link`` replaces the gRPC link to orchestratord (tests drive the loops with a fake)."""
        self.settings = settings
        self._registry = registry
        self._metrics = metrics
        self._engines: list[EngineReplica] = []
        self.router: RolloutRouter | None = None
        self._jobs: dict[str, _ServedJob] = {}
        #: Each job's preparation in progress, or failed and not yet handed to a task (:meth:`_prepare`).
        self._preparing: dict[str, asyncio.Task[_ServedJob]] = {}
        #: Each job's last preparation: when it started and, once it ended, when (GetRolloutStatus).
        self._prep_times: dict[str, tuple[float, float | None]] = {}
        #: Jobs the job loop has started preparing (listed and still active).
        self._discovered: set[str] = set()
        self._in_flight: dict[str, _InFlightTask] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._peers = PeerConnections(registry, orchestrator_address=settings.orchestrator_address,
                                      store_address=settings.store_address,
                                      max_message_bytes=settings.max_message_bytes, security=settings.security)
        self._link: OrchestratorLink = link if link is not None else GrpcOrchestratorLink(self._peers)
        self._engine_lock = asyncio.Lock()
        self._job_lock = asyncio.Lock()
        self._supervisor: EngineSupervisor | None = None
        self._specs = JobSpecCache(self._link.job_spec)
        self.episodes_done = 0
        self._stopping = False
        #: Tasks whose experiences wait to be durable in stored, and since when appends fail (None: they succeed).
        self._pending_appends = 0
        self._max_pending_appends = 1
        self._appends_failing_since: float | None = None
        #: The lease limit (``--max-tasks``), and in ``auto`` the live rolloutds it is shared among.
        self.task_limit = TaskLimit(settings.max_tasks, settings.max_tasks_cap, self._task_limit_changed)
        self._rolloutds: ServiceDirectory | None = None
        metrics.watch_router(lambda: self.router)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the job, lease and renewal loops (engines start with the first job the worker learns of)."""
        loop = asyncio.get_running_loop()
        if self.task_limit.auto:
            self._rolloutds = self._registry.directory("rolloutd")
            self._rolloutds.on_change(self._rolloutds_changed)
            self._rolloutds.start()
        self._loops = [loop.create_task(self._job_loop(), name="job loop"),
                       loop.create_task(self._lease_loop(), name="lease loop"),
                       loop.create_task(self._renew_loop(), name="renew loop")]

    async def stop(self) -> None:
        """Stops leasing, cancels running tasks (their leases expire and are re-issued), stops engines."""
        self._stopping = True
        running = [*self._loops, *(entry.runner for entry in self._in_flight.values()), *self._preparing.values(),
                   *(job.version_watch for job in self._jobs.values() if job.version_watch is not None)]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._rolloutds is not None:
            await self._rolloutds.stop()
        if self._supervisor is not None:
            await self._supervisor.stop()  # before the engines stop: a stop is no crash to relaunch
        if self.router is not None:
            await self.router.close()
            for replica in self.router.replicas():
                with contextlib.suppress(Exception):
                    await replica.client.close()
        for job in self._jobs.values():
            with contextlib.suppress(Exception):
                await job.env.aclose()
        for engine in self._engines:
            await asyncio.to_thread(engine.stop, 10.0)
        await self._link.close()
        await self._peers.close()

    # ---- leasing -----------------------------------------------------------------------------------

    def _task_limit_changed(self, limit: int) -> None:
        """Keeps the append backpressure and the metric with the lease limit."""
        self._max_pending_appends = max(1, limit // 2)
        self._metrics.max_tasks.set(limit)

    def _rolloutds_changed(self, services: dict[str, ServiceRecord]) -> None:
        """The live rolloutds (this one counted before it registers and after it leaves) share the jobs' tasks."""
        self.task_limit.set_rolloutds(len(set(services) | {self.settings.worker_id}))

    def _served_jobs_changed(self) -> None:
        """Sizes the lease limit from the jobs served now (a pinned evaluation round is its job's)."""
        self.task_limit.set_jobs({key: job.spec for key, job in self._jobs.items() if not job.pinned_of})

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
        backoff = LEASE_POLL_RETRY.backoff()
        while not self._stopping:
            await self._wait_out_backpressure()
            free = self.task_limit.current - len(self._in_flight)
            if free <= 0 or self._stopping:
                await asyncio.sleep(0.05)
                continue
            try:
                tasks = await self._link.lease_tasks(self.settings.worker_id, min(free, MAX_TASKS_PER_LEASE),
                                                      LEASE_WAIT_MS)
            except FlexmarlError as exc:
                log.warning("leasing tasks failed (%s); retrying", describe_error(exc))
                await backoff.sleep()
                continue
            backoff.reset()
            for task in tasks:
                progress = TaskProgress()
                self._in_flight[task.lease_id] = _InFlightTask(task.ref, asyncio.get_running_loop().create_task(
                    self._run(task, progress), name=f"task {task.task_id}"), progress, served_key(task))

    async def _renew_loop(self) -> None:
        last_sweep_s = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(RENEW_INTERVAL_S)
            if time.monotonic() - last_sweep_s > JOB_SWEEP_INTERVAL_S:
                last_sweep_s = time.monotonic()
                await self._forget_finished_jobs()
            self._drop_hung_replicas()
            if not self._in_flight:
                continue
            lease_ids = list(self._in_flight)
            progress = [self._in_flight[lease_id].progress.tick_if_setting_up() for lease_id in lease_ids]
            try:
                renewed = await self._link.renew(self.settings.worker_id, lease_ids, progress)
            except FlexmarlError as exc:
                log.warning("renewing leases failed (%s)", describe_error(exc))
                continue
            for lease_id in renewed.lost_lease_ids:
                entry = self._in_flight.get(lease_id)
                if entry is not None:
                    log.warning("lease %s lost; abandoning its task", lease_id)
                    entry.runner.cancel()

    def _drop_hung_replicas(self) -> None:
        """Drops engine replicas that answered nothing for half the served jobs' progress bound.

        Half, so a hung replica is out of the router before orchestratord refuses the leases of the
        tasks stuck on it: their re-issued attempts then go to a replica that answers.
        """
        bounds = [job.spec.leases.progress_timeout_s for job in self._jobs.values()]
        bounds = [bound for bound in bounds if bound > 0]
        if self.router is None or not bounds:
            return
        for replica_id in self.router.drop_hung(min(bounds) / 2):
            self._metrics.engine_hung.inc()
            log.warning("engine replica %s hung: dropped until its /health answers", replica_id)

    async def _forget_finished_jobs(self) -> None:
        """Stops serving the agents of jobs that ended (their replicas go to the live jobs)."""
        busy = {key for entry in self._in_flight.values() for key in (entry.key, entry.ref.job_id)}
        ended = []
        for job_id in list(self._jobs):
            if job_id in busy:
                continue
            try:
                state = await self._link.job_state(job_id)
            except NotFound:  # the job ended and was deleted
                ended.append(job_id)
                continue
            except FlexmarlError:  # orchestratord unreachable right now: ask again later
                continue
            if state.finished:
                ended.append(job_id)
        if not ended or self.router is None:
            return
        async with self._job_lock:
            for job_id in ended:
                job = self._jobs.pop(job_id, None)
                self._prep_times.pop(job_id, None)
                self._specs.forget(job_id)
                if job is not None and job.version_watch is not None:
                    job.version_watch.cancel()
                    for name in job.spec.agent_names:
                        self.router.set_partial_rollout(agent_key(job_id, name), False)
                        self.router.set_distributed_sync(agent_key(job_id, name), False)
                if job is not None and not job.shares_env:
                    with contextlib.suppress(Exception):
                        await job.env.aclose()  # an ExternalAgents job's gateway stops listening
            self._set_lora_agents(self.router)
            await self.router.set_agents([agent_key(j.job_id, a) for j in self._jobs.values()
                                          for a in j.spec.agent_names])
            self._served_jobs_changed()
        log.info("stopped serving finished jobs %s", ended)

    # ---- one task ----------------------------------------------------------------------------------

    async def _run(self, task: RolloutTask, progress: TaskProgress) -> None:
        started = time.perf_counter()
        try:
            progress.setting_up = True  # engines launching: bounded by the launch timeout, not the progress bound
            try:
                job = await self._job(task)
            except InvalidArgument as exc:  # the spec or environment: no other attempt can succeed
                log.error("job %s cannot run: %s", task.job_id, exc)
                await self._report(TaskReport(task.lease_id, task.task_id, error=str(exc),
                                              reason=ErrorReason.JOB_UNRUNNABLE))
                return
            finally:
                progress.setting_up = False
            if task.pinned:
                try:
                    job = await self._pinned(job, task)
                except InvalidArgument as exc:  # its task file: this round cannot run, the job can
                    log.error("evaluation task %s cannot run: %s", task.task_id, exc)
                    await self._report(TaskReport(task.lease_id, task.task_id, error=str(exc)))
                    return
            for version in task.agent_versions:
                base = job.spec.agent(version.agent).model
                job.router.require(agent_key(job.job_id, version.agent), version.version,
                                   version.weights_uri or base)
            if task.evaluation:
                await self._evaluate(job, task, progress)
                return
            stored = await self._durable_experiences(job, task) if task.attempt > 1 else None
            if stored is not None:
                # An earlier attempt's experiences are durable: they are the task's result (exactly once).
                log.info("task %s: reusing %d stored experiences of an earlier attempt", task.task_id, len(stored))
                await self._report(TaskReport(task.lease_id, task.task_id, experiences=tuple(stored),
                                              failed_episodes=_earlier_failures(stored, task.group_size)))
                return
            result = await job.runner.run(RolloutTaskInput(task.job_id, task.task_id, task.task_index,
                                                           job.spec.seed, task.group_size, progress))
            self._metrics.episodes_failed.inc(len(result.failed_episodes))
            if result.ok:
                await self._store_experiences(result)
                await self._report(TaskReport(task.lease_id, task.task_id, experiences=tuple(
                    ExperienceSummary.of_record(e) for e in result.experiences),
                    failed_episodes=result.failed_episodes))
                self.episodes_done += task.group_size - len(result.failed_episodes)
                self._metrics.observe_task(result, time.perf_counter() - started)
            elif result.given_up:  # too few episodes left: orchestratord gives the task up (no re-issue)
                dropped = result.failed_episodes[0]
                message = (f"{len(result.failed_episodes)} of {task.group_size} episodes failed in their reward "
                           f"(episode {dropped.sample_index}: {dropped.reason})")
                log.warning("task %s given up: %s", task.task_id, message)
                await self._report(TaskReport(task.lease_id, task.task_id, error=message,
                                              reason=ErrorReason.EPISODES_FAILED,
                                              failed_episodes=result.failed_episodes))
            else:
                first = result.errors[0]
                message = f"episode {first.sample_index}: {first.error_type}: {first.message}"
                log.warning("task %s failed: %s", task.task_id, message)
                await self._report(TaskReport(task.lease_id, task.task_id, error=message))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything else fails the task, never the daemon
            log.exception("task %s failed", task.task_id)
            with contextlib.suppress(Exception):
                await self._report(TaskReport(task.lease_id, task.task_id, error=f"{type(exc).__name__}: {exc}"))
        finally:
            self._in_flight.pop(task.lease_id, None)

    async def _evaluate(self, job: _ServedJob, task: RolloutTask, progress: TaskProgress) -> None:
        """A held-out evaluation task: its episodes are reported, nothing is stored (never trained on)."""
        result = await job.runner.evaluate(RolloutTaskInput(task.job_id, task.task_id, task.task_index, job.spec.seed,
                                                            task.group_size, progress), greedy=task.greedy)
        if result.ok:
            await self._report(TaskReport(task.lease_id, task.task_id, eval_episodes=result.episodes))
            return
        first = result.errors[0]
        message = f"episode {first.sample_index}: {first.error_type}: {first.message}"
        log.warning("eval task %s failed: %s", task.task_id, message)
        # Only rewards failed: playing the task again would fail again (orchestratord gives it up at once).
        reason = ErrorReason.EPISODES_FAILED if all(e.reward for e in result.errors) else ErrorReason.UNSPECIFIED
        await self._report(TaskReport(task.lease_id, task.task_id, error=message, reason=reason))

    async def _store_experiences(self, result: RolloutResult) -> None:
        """Appends a task's experiences, retrying while stored is full, down or slow (see the module doc).

        There is no deadline: the task's lease bounds the wait (the renew loop cancels this task
        when the lease is lost, and the re-issued task produces the experiences again). Any other
        error (a malformed or oversized record) fails the task at once.
        """

        async def append() -> None:
            store = await self._peers.store()
            await store.append(result.experiences)

        async def on_retry(exc: BaseException, _attempt: int, _delay_s: float) -> None:
            code = _append_retry_code(exc)
            if code is None:  # retry() retries only what _append_retry_code names
                return
            if self._appends_failing_since is None:
                self._appends_failing_since = time.monotonic()
                log.warning("appending to stored failed (%s); holding the experiences and retrying",
                            describe_error(exc))
            self._metrics.append_retries.labels(code.name).inc()
            if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                await self._peers.reset_store()

        self._pending_appends += 1
        self._metrics.pending_appends.set(self._pending_appends)
        try:
            await retry(append, retryable=lambda exc: _append_retry_code(exc) is not None, policy=APPEND_RETRY,
                        on_retry=on_retry)
            self._appends_failing_since = None
        finally:
            self._pending_appends -= 1
            self._metrics.pending_appends.set(self._pending_appends)
            if self._pending_appends == 0:
                # "Failing" describes appends still waiting. A task cancelled mid-retry (its lease
                # lost) must not leave it set: a re-issued task that reuses durable experiences
                # appends nothing, so no success would ever clear it and leasing would stop for good.
                self._appends_failing_since = None

    async def _durable_experiences(self, job: _ServedJob, task: RolloutTask) -> list[ExperienceSummary] | None:
        """The experiences an earlier attempt of the task stored (all or nothing), or None.

        rolloutd appends a task's experiences in one request, which stored applies
        atomically, so a task is either wholly stored or not at all: every agent has the same
        episodes, all of the group's but those dropped as their reward failed.
        """
        store = await self._peers.store()
        found: list[ExperienceSummary] = []
        for agent in job.spec.agent_names:
            refs = await store.query(task.job_id, agent, group_id=group_id(task.task_id, agent))
            found.extend(ExperienceSummary.of_ref(ref, agent) for ref in refs)
        if not found:
            return None
        episodes = {e.sample_index for e in found}
        for agent in job.spec.agent_names:
            samples = {e.sample_index for e in found if e.agent == agent}
            if samples != episodes or len(samples) < min_episodes_to_train(task.group_size):
                raise Unavailable(f"task {task.task_id}: stored holds a partial group of {agent} "
                                  f"(samples {sorted(samples)} of the task's {sorted(episodes)})")
        return found

    async def _report(self, report: TaskReport) -> None:
        """Reports a task, retrying while orchestratord is unreachable (:data:`REPORT_RETRY`)."""
        try:
            await retry(lambda: self._link.report(self.settings.worker_id, report),
                        retryable=_report_retryable, policy=REPORT_RETRY)
        except (FailedPrecondition, NotFound) as exc:
            log.warning("report of task %s rejected: %s", report.task_id, describe_error(exc))
        except FlexmarlError:
            log.error("could not report task %s; its lease will expire", report.task_id)

    # ---- jobs and engines --------------------------------------------------------------------------

    async def _job_loop(self) -> None:
        """Prepares the engines of every pending or running job as soon as it is listed, before its first task."""
        while not self._stopping:
            try:
                active = await self._link.active_jobs()
            except FailedPrecondition as exc:
                log.info("jobs are prepared when their first task is leased: %s", describe_error(exc))
                return
            except FlexmarlError as exc:  # orchestratord unreachable right now: list again later
                log.debug("listing jobs failed (%s)", describe_error(exc))
            else:
                listed = {job.job_id for job in active}
                for job in active:
                    if job.job_id not in self._discovered and job.job_id not in self._jobs:
                        self._discovered.add(job.job_id)
                        self._prepare(job.job_id, job.spec_digest)
                self._discovered &= listed
                for job_id in [j for j, prep in self._preparing.items() if prep.done() and j not in listed]:
                    del self._preparing[job_id]  # a failed preparation of a job that ended before any task
                    self._prep_times.pop(job_id, None)
            await asyncio.sleep(JOB_DISCOVERY_INTERVAL_S)

    def _prepare(self, job_id: str, spec_digest: str) -> asyncio.Task[_ServedJob]:
        """The job's preparation (:meth:`_prepared`), started in the background unless under way already."""
        prep = self._preparing.get(job_id)
        if prep is None:
            prep = asyncio.get_running_loop().create_task(self._prepared(job_id, spec_digest),
                                                          name=f"prepare job {job_id}")
            prep.add_done_callback(lambda done: done.cancelled() or done.exception())  # raised to its tasks
            self._preparing[job_id] = prep
        return prep

    async def _prepared(self, job_id: str, spec_digest: str) -> _ServedJob:
        """Makes the job ready to run tasks (:meth:`_new_job`), once, whoever asked first; logged and counted."""
        started = time.monotonic()
        self._prep_times[job_id] = (started, None)
        self._metrics.engines_preparing.inc()
        log.info("preparing job %s: its engines, environment and runner", job_id)
        try:
            async with self._job_lock:  # one set-up at a time: they share this worker's engines
                job = self._jobs.get(job_id) or await self._new_job(job_id, spec_digest)
        except Exception as exc:
            log.error("preparing job %s failed: %s", job_id, describe_error(exc))
            raise
        finally:
            self._metrics.engines_preparing.dec()
            self._prep_times[job_id] = (started, time.monotonic())
        self._preparing.pop(job_id, None)
        log.info("job %s ready in %.1f s", job_id, time.monotonic() - started)
        return job

    async def _job(self, task: RolloutTask) -> _ServedJob:
        """The task's job, ready: at once, or when its preparation ends (started now if nobody started it)."""
        job = self._jobs.get(task.job_id)
        if job is not None:
            return job
        failed = self._preparing.get(task.job_id)
        if failed is not None and failed.done() and (failed.cancelled()
                                                     or not isinstance(failed.exception(), InvalidArgument)):
            del self._preparing[task.job_id]  # failed for a passing reason before this task: it tries again
        prep = self._prepare(task.job_id, task.spec_digest)
        if not prep.done():
            log.info("task %s waits for job %s to be prepared", task.task_id, task.job_id)
        try:
            return await asyncio.shield(prep)  # a lost lease cancels the task, not the job's preparation
        except asyncio.CancelledError:
            raise
        except Exception:
            if self._preparing.get(task.job_id) is prep:
                del self._preparing[task.job_id]  # handed to this task: the job's next task tries again
            raise

    async def _new_job(self, job_id: str, spec_digest: str) -> _ServedJob:
        spec = await self._specs.get(job_id, spec_digest)
        if self.settings.engine_backend == "vllm":
            launched_on_cpu = not self.settings.engine_urls and self.settings.engine_device_sets is None
            refuse_unservable(spec, on_cpu=launched_on_cpu)
        dataset = None
        if spec.environment.dataset is not None:
            # A changed or unreadable file is InvalidArgument (the job cannot run), found before engines launch.
            dataset = await asyncio.to_thread(open_dataset, spec.environment.dataset)
            for split, skipped in dataset.skipped.items():
                self._metrics.dataset_rows_skipped.labels(split).inc(len(skipped))
        router = await self._ensure_engines(spec)
        env = await asyncio.to_thread(load_environment, spec.environment.entrypoint, spec.environment.config,
                                      dataset)
        _check_environment_code(spec)
        if isinstance(env, ExternalAgents) and not env.gateway_config.cluster_token and self.settings.security.token:
            # The agent program's calls carry the cluster's bearer token too (docs/gateway.md).
            env.gateway_config = dataclasses.replace(env.gateway_config, cluster_token=self.settings.security.token)
        missing = [a for a in env.agents if a not in spec.agent_names]
        if missing:
            raise InvalidArgument(f"environment needs agents {missing} that the job spec lacks")
        runtimes = {}
        for agent in spec.agents:
            tokenizer = await asyncio.to_thread(HFTokenizer, agent.model)
            runtimes[agent.name] = AgentRuntime(tokenizer, _sampling_of(agent.sampling.model_dump()),
                                                gamma=spec.algorithm_of(agent.name).gamma)
        runner = RolloutRunner(env, runtimes, router.backend(job_id, spec.seed))
        job = _ServedJob(job_id, spec, env, runner, router, runtimes=runtimes)
        self._jobs[job_id] = job
        self._set_lora_agents(router)
        await router.set_agents([agent_key(j.job_id, a) for j in self._jobs.values() for a in j.spec.agent_names])
        distributed = spec.rollout.weight_sync == "distributed"
        if spec.rollout.partial_rollout or distributed:
            for name in spec.agent_names:
                router.set_partial_rollout(agent_key(job_id, name), spec.rollout.partial_rollout)
                router.set_distributed_sync(agent_key(job_id, name), distributed)
            job.version_watch = asyncio.get_running_loop().create_task(
                self._watch_versions(job), name=f"versions of {job_id}")
        log.info("serving job %s (%s)", job_id, spec.name)
        self._served_jobs_changed()
        return job

    async def _pinned(self, job: _ServedJob, task: RolloutTask) -> _ServedJob:
        """The served entry of an on-demand evaluation round: the job's agents under keys ``<job>@<round>/<agent>``.

        The router only ever moves an agent key to a newer version; the round's exact (older) versions
        get keys of their own, so training tasks keep theirs. Forgotten with the round (the job sweep
        finds no job of that id). With a task file (``flexmarl eval --dataset``) the round gets an
        environment of its own whose held-out tasks are the file's rows.

        Raises:
            InvalidArgument: the task file is unreadable, changed since it was named, or has no usable row.
        """
        key = served_key(task)
        served = self._jobs.get(key)
        if served is not None:
            return served
        async with self._job_lock:
            served = self._jobs.get(key)
            if served is not None:
                return served
            env = job.env if not task.eval_file else await self._eval_file_environment(job.spec, task)
            runner = RolloutRunner(env, job.runtimes, job.router.backend(key, job.spec.seed, seed_scope=job.job_id))
            served = _ServedJob(key, job.spec, env, runner, job.router, runtimes=job.runtimes, pinned_of=job.job_id,
                                shares_env=env is job.env)
            self._jobs[key] = served
            self._set_lora_agents(job.router)
            await job.router.set_agents([agent_key(j.job_id, a) for j in self._jobs.values()
                                         for a in j.spec.agent_names])
        log.info("serving on-demand evaluation %s of job %s", key, job.job_id)
        return served

    @staticmethod
    async def _eval_file_environment(spec: JobSpec, task: RolloutTask) -> Environment:
        """The job's environment over a task file's rows as its held-out tasks (a pinned round's ``eval_file``)."""
        fields = spec.environment.dataset.fields if spec.environment.dataset is not None else ()
        rows = await asyncio.to_thread(read_rows, task.eval_file, fields)
        if rows.sha256 != task.eval_sha256:
            raise InvalidArgument(f"eval_file: {task.eval_file} changed since it was named (sha256 "
                                  f"{task.eval_sha256[:12]}... then, {rows.sha256[:12]}... now)")
        if not rows.rows:
            raise InvalidArgument(f"eval_file: {task.eval_file}: no usable rows")
        # Only eval_task is played here: the train split is a placeholder the dataset requires.
        dataset = TaskDataset(rows.rows, rows.rows, skipped={"eval": rows.problems})
        return await asyncio.to_thread(load_environment, spec.environment.entrypoint, spec.environment.config, dataset)

    async def _watch_versions(self, job: _ServedJob) -> None:
        """Hands each version of a partial-rollout or distributed-sync job's agents to the router as it comes.

        A version announced with its weight-update group goes to :meth:`RolloutRouter.announce`
        (the replicas receive the broadcast), a committed one to :meth:`RolloutRouter.publish`.
        """
        backoff = VERSION_WATCH_RETRY.backoff()
        while not self._stopping:
            try:
                async for published in self._link.watch_versions(job.job_id, self.settings.worker_id):
                    backoff.reset()
                    if published.agent not in job.spec.agent_names:
                        continue
                    key = agent_key(job.job_id, published.agent)
                    if published.weight_group is not None:  # being broadcast (weight_sync: distributed)
                        job.router.announce(key, published.version, published.weight_group)
                        continue
                    uri = published.weights_uri or job.spec.agent(published.agent).model
                    job.router.publish(key, published.version, uri)
            except (NotFound, FailedPrecondition) as exc:  # the job is gone, or the link cannot watch
                log.info("not watching the versions of job %s: %s", job.job_id, describe_error(exc))
                return
            except FlexmarlError as exc:
                log.warning("watching the versions of job %s failed (%s); watching again", job.job_id,
                            describe_error(exc))
            await backoff.sleep()

    def _set_lora_agents(self, router: RolloutRouter) -> None:
        """Tells the router which agents of the served jobs are LoRA adapters (:mod:`rolloutd.lora_launch`)."""
        router.set_lora_agents({agent_key(j.job_id, a): base for j in self._jobs.values()
                                for a, base in lora_bases(j.spec).items()}, self.settings.engine_max_loras_per_batch)

    async def _ensure_engines(self, spec: JobSpec) -> RolloutRouter:
        """The router over this worker's engines, launching or attaching them for the first job."""
        async with self._engine_lock:
            if self.router is not None:
                return self.router
            s = self.settings
            if s.engine_urls:
                engines = attached_engines(s)
                path_map = s.engine_path_map
            else:
                engines = []
                launched = []
                lora = engine_lora_settings(spec, s.engine_max_loras_per_batch, s.engine_max_loaded_loras)
                specs = replica_specs(s, launch_model(spec), lora, launch_dtype(spec, s.engine_backend))
                for index, replica_spec in enumerate(specs):
                    engine = await launch(replica_spec, s.work_dir / "engines", name=f"engine-{index}",
                                          timeout_s=s.engine_launch_timeout_s)
                    engines.append(engine)
                    launched.append((engine, replica_spec, f"engine-{index}"))
                    self._engines = engines  # stop() stops the ones started, even if a later one fails
                path_map = EnginePathMap()  # launched replicas see rolloutd's filesystem
                self._supervisor = EngineSupervisor(
                    launched, s.work_dir / "engines", launch_timeout_s=s.engine_launch_timeout_s,
                    on_restart=self._engine_restarted,
                    on_give_up=lambda _: self._metrics.engine_gave_up.inc())
                self._supervisor.start()
            replicas = [Replica(f"replica-{i}", e.client()) for i, e in enumerate(engines)]
            cache = s.weights_cache
            cache.mkdir(parents=True, exist_ok=True)
            resolve = weights_resolver(cache, path_map, self._peers.store)

            # The first job's rollout.balancing sets the policy of this worker's router (benchmarks, ablations).
            balancing = spec.balancing
            config = BalancerConfig(rebalance_enabled=balancing == "hierarchical", routing=RoutingPolicy.ROUND_ROBIN
                                    if balancing == "round-robin" else RoutingPolicy.LEAST_TOKENS,
                                    measured_rates=s.balancer_measured_rates,
                                    prior_tokens_per_s=s.balancer_tokens_per_s,
                                    reassignment_cost_s=s.balancer_reassignment_cost_s,
                                    dispatch_kv_factor=s.balancer_dispatch_kv_factor,
                                    move_patience=s.balancer_move_patience, move_evicts=s.balancer_move_evicts)
            self.router = RolloutRouter(replicas, resolve, config=config, on_reload=self._metrics.observe_reload,
                                        owner=s.worker_id, on_broadcast=self._metrics.observe_broadcast)
            return self.router

    def _engine_restarted(self, name: str) -> None:
        """The supervisor relaunched launched replica ``engine-<i>``: counted; the router forgets its weights."""
        self._metrics.engine_restarts.inc()
        router, replica_id = self.router, f"replica-{name.removeprefix('engine-')}"
        for replica in router.replicas() if router is not None else ():
            if replica.replica_id == replica_id and router is not None:
                router.readmit(replica, relaunched=True)

    # ---- rolloutd's own API --------------------------------------------------------------------------

    def status(self) -> RolloutStatus:
        """What GetRolloutStatus reports: replicas (with the balancer's view of their load), tasks, episodes."""
        router = self.router
        replicas: list[ReplicaStatus] = []
        if router is not None:
            balancer = router.balancer()
            views = {v.replica_id: v for v in balancer.replicas()} if balancer is not None else {}
            for replica in router.replicas():
                view = views.get(replica.replica_id)
                replicas.append(ReplicaStatus(
                    replica_id=replica.replica_id, url=replica.client.url,
                    agents=(view.model_key,) if view is not None else (), healthy=replica.healthy,
                    outstanding_tokens=view.outstanding_tokens if view is not None else 0,
                    in_flight_requests=view.in_flight_requests if view is not None else 0,
                    backend=self.settings.engine_backend,
                ))
        return RolloutStatus(
            worker_id=self.settings.worker_id, tasks_in_flight=len(self._in_flight), episodes_done=self.episodes_done,
            reassignments=router.reassignments if router is not None else 0, replicas=tuple(replicas),
            jobs=self._preparations(), max_tasks=self.task_limit.current,
            max_tasks_auto=self.task_limit.auto, live_rolloutds=self.task_limit.rolloutds,
        )

    def _preparations(self) -> tuple[JobPreparation, ...]:
        """Every job served here (ready) or whose preparation is under way or failed, by job id."""
        now = time.monotonic()

        def seconds(job_id: str) -> float:  # so far while it runs, else how long it took
            started, ended = self._prep_times.get(job_id, (now, None))
            return (now if ended is None else ended) - started

        out: dict[str, JobPreparation] = {}
        for job_id, prep in self._preparing.items():
            if not prep.done():
                out[job_id] = JobPreparation(job_id, "preparing", seconds(job_id))
            elif prep.cancelled() or prep.exception() is not None:
                exc = prep.exception() if not prep.cancelled() else None
                out[job_id] = JobPreparation(job_id, "failed", seconds(job_id),
                                             describe_error(exc) if exc is not None else "cancelled")
        for job_id in self._jobs:
            out[job_id] = JobPreparation(job_id, "ready", seconds(job_id))
        return tuple(out[job_id] for job_id in sorted(out))

    def set_demand(self, demand: list[AgentDemand]) -> None:
        """Passes orchestratord's demand hints to the inter-agent balancer (none before the first job)."""
        if self.router is None:
            return
        self.router.set_demand_hints({agent_key(hint.job_id, hint.agent): hint.tokens for hint in demand})


def served_key(task: RolloutTask) -> str:
    """The served job a task runs under: its job, or ``<job>@<round>`` for a pinned evaluation round."""
    if task.pinned and isinstance(task.ref, EvalTaskRef):
        return f"{task.job_id}@{task.ref.round_id}"
    return task.job_id


def _earlier_failures(stored: Sequence[ExperienceSummary], group_size: int) -> tuple[FailedEpisode, ...]:
    """The episodes an earlier attempt dropped: those of the group without a stored experience."""
    kept = {e.sample_index for e in stored}
    return tuple(FailedEpisode(i, "its reward failed in an earlier attempt of the task")
                 for i in range(group_size) if i not in kept)


def _report_retryable(exc: BaseException) -> bool:
    """Whether a failed report is worth another attempt: yes, unless orchestratord rejected it."""
    return isinstance(exc, FlexmarlError) and not isinstance(exc, (FailedPrecondition, NotFound))


def _append_retry_code(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of an append failure worth retrying, or None.

    stored answers RESOURCE_EXHAUSTED both for a full job quota or a full disk (reasons
    QUOTA_EXCEEDED, DISK_FULL; retried: GC or an operator frees room) and for a record or
    request over its size limits (never fits: not retried); the error's reason (sent in the
    status's trailing metadata) tells them apart. A call that ended with a status
    :mod:`flexmarl.errors` has no error for (DEADLINE_EXCEEDED: stored is slow) reaches here as
    the ``grpc.aio.AioRpcError`` itself, which is no ``grpc.Call``.
    """
    if isinstance(exc, ResourceExhausted):
        retried = (ErrorReason.QUOTA_EXCEEDED, ErrorReason.DISK_FULL)
        return grpc.StatusCode.RESOURCE_EXHAUSTED if exc.reason in retried else None
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) and exc.code() in _RETRIED_APPEND_CODES:
        code: grpc.StatusCode = exc.code()
        return code
    return None


def _check_environment_code(spec: JobSpec) -> None:
    """Refuses a job checked against other environment code than this process runs (InvalidArgument).

    Python keeps running a module as it was first imported: a rolloutd that imported the
    environment's module for an earlier job runs that code, whatever the file says now. The
    preflight recorded the digest of the file it checked (``environment.code_digest``); when the
    module running here is another, the job is refused rather than run on code nobody checked.
    """
    expected = spec.environment.code_digest
    module = spec.environment.entrypoint.partition(":")[0]
    running = loaded_digest(module)
    if expected and running and running != expected:
        raise InvalidArgument(
            f"environment.code_digest: the job was checked against {module} at {expected[:19]}..., but this "
            f"rolloutd runs {module} as it imported it earlier ({running[:19]}...): restart rolloutd "
            "(`flexmarl down` then `flexmarl up` on a local cluster) to load the edited code")


def _sampling_of(sampling: dict[str, Any]) -> dict[str, Any]:
    """Spec sampling settings in SGLang's sampling_params names."""
    return {k: v for k, v in json.loads(json.dumps(sampling)).items() if v is not None}
