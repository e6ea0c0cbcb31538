"""The asyncio coordinator around the planner: persistence, long-polls, liveness, recovery.

Every mutation of the planner runs under one lock, and the durable changes it emits
are written to etcd before the RPC that caused them is answered (a committed step is
durable before traind hears "ok"). Long-polls and watch streams wait on one condition
that is notified after each mutation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from flexmarl.connections import PeerConnections
from flexmarl.engine_limits import EngineLimits, unservable
from flexmarl.errors import ErrorReason, FailedPrecondition, FlexmarlError, InvalidArgument, NotFound, Unavailable
from flexmarl.evaluation import EvalEpisode, EvalRecord
from flexmarl.experience import ExperienceRecord, ExperienceState, ExperienceSummary, FailedEpisode
from flexmarl.ids import EvalTaskRef, StepRef
from flexmarl.jobspec import EvaluationSpec, JobSpec, parse_job_spec
from flexmarl.registry import Registry, ServiceDirectory, ServiceRecord
from flexmarl.retry import RetryPolicy, retry
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.tracking import StepTracking
from flexmarl.v1 import rollout_pb2_grpc
from flexmarl.weight_group import WeightGroupRecord
from orchestratord import serde
from orchestratord.etcd_state import EtcdStateStore
from orchestratord.failures import RECORD_KEYS as FAILURE_RECORD_KEYS
from orchestratord.history_archive import DEFAULT_PAGE_STEPS, HistoryArchive, HistoryBlobs, consumed_steps
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.planner import (
    AgentVersion,
    JobSnapshot,
    Planner,
    PlannerOptions,
    RenewResult,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    TrainerWork,
)
from orchestratord.planner.demand import rolloutd_share
from orchestratord.resume import ResumePlan, plan_resume
from orchestratord.state import (
    EvalRecorded,
    JobState,
    JobStateChanged,
    StateChange,
    StateStore,
    StepCommitted,
    WarmStartPublished,
    apply_changes,
)
from orchestratord.trainer_polls import TrainerPollWaiters

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ID_LENGTH = 256
MAX_PROMPTS_PER_STEP = 1 << 20
MAX_GROUP_SIZE = 1 << 16
TICK_INTERVAL_S = 0.2
DEMAND_INTERVAL_S = 1.0
#: Reading what rollouts already stored, at a restart: stored may still be starting after a whole-cluster restart.
RECOVERY_READ_RETRY = RetryPolicy(initial_s=0.5, max_s=0.5, deadline_s=30.0)
#: Marking a committed step's experiences consumed: stored may be restarting (maybe on a new address).
#: Marking a committed step consumed in stored: no deadline (the pending mark in etcd is the record).
MARK_CONSUMED_RETRY = RetryPolicy(initial_s=0.5, max_s=5.0)
#: Telling stored a job ended.
FINISH_JOB_RETRY = RetryPolicy(initial_s=0.5, max_s=5.0, deadline_s=300.0)


def require_id(name: str, value: str) -> str:
    """Validates a caller-supplied id (non-empty, bounded, printable, no whitespace)."""
    if not value:
        raise InvalidArgument(f"{name}: must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(f"{name}: longer than {MAX_ID_LENGTH} characters")
    if not value.isprintable() or value.split() != [value]:  # split() splits on exactly str.isspace
        raise InvalidArgument(f"{name}: must be printable without whitespace, got {value!r}")
    return value


#: Steps of a history page when GetJobHistory asks for none (``max_steps`` 0), and the most it may ask for.
HISTORY_PAGE_STEPS = 1000
MAX_HISTORY_PAGE_STEPS = 100_000
#: The history record's own fields (:meth:`JobCoordinator._history_record`); a trainer figure may not reuse one.
HISTORY_FIELDS = frozenset({
    "agent", "step", "version", "reward_mean", "return_mean", "loss", "grad_norm", "step_seconds", "tokens_per_s",
    "staleness_mean", "episodes", "response_tokens", "committed_unix_ms", "weights_uri", *FAILURE_RECORD_KEYS,
})
MAX_STEP_FIGURES = 16
_FIGURE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _is_eval_task(task_id: str) -> bool:
    """Whether a reported task is a held-out evaluation task (``flexmarl.ids.EvalTaskRef``)."""
    try:
        EvalTaskRef.parse(task_id)
    except InvalidArgument:
        return False
    return True


def step_figures(figures: Mapping[str, float]) -> dict[str, float]:
    """Validates a commit's extra per-step figures (``CommitStepRequest.figures``)."""
    if len(figures) > MAX_STEP_FIGURES:
        raise InvalidArgument(f"figures: at most {MAX_STEP_FIGURES}, got {len(figures)}")
    out: dict[str, float] = {}
    for name, value in figures.items():
        if not _FIGURE_NAME.fullmatch(name) or name in HISTORY_FIELDS:
            raise InvalidArgument(f"figures: bad name {name!r} (expected [a-z][a-z0-9_]{{0,31}}, not one of the "
                                  f"history record's own fields)")
        if not math.isfinite(value):
            raise InvalidArgument(f"figures: {name} must be finite, got {value}")
        out[name] = float(value)
    return out


class JobCoordinator:
    """Planner + etcd state + waiting, for the servicer."""

    def __init__(
        self,
        registry: Registry,
        metrics: OrchestratorMetrics,
        *,
        store_address: str = "",
        lease_poll_max_ms: int = 5000,
        options: PlannerOptions | None = None,
        now_s: Callable[[], float] = time.time,
        security: TransportSecurity | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        history_page_steps: int = DEFAULT_PAGE_STEPS,
    ) -> None:
        self._registry = registry
        self._security = security
        self._metrics = metrics
        self._now_s = now_s
        self.planner = Planner(now_s, options)
        self._history_page_steps = history_page_steps
        self.state = EtcdStateStore(registry)
        self._lock = asyncio.Lock()
        #: Watch streams wait here (every mutation wakes them); trainer polls wait in _trainer_polls.
        self._changed = asyncio.Condition()
        #: PollTrainerWork long polls that found no work, woken only when the planner says their answer may change.
        self._trainer_polls = TrainerPollWaiters()
        #: Long-polls for rollout tasks wait here; woken only when some job has a task to hand out.
        self._lease_waiters: set[asyncio.Future[None]] = set()
        #: Planner changes whose write failed (etcd unreachable); written before the next ones.
        self._unpersisted: list[StateChange] = []
        # Only the stored side is used: orchestratord is the orchestrator.
        self._peers = PeerConnections(registry, orchestrator_address="", store_address=store_address,
                                      max_message_bytes=max_message_bytes, security=security)
        self.lease_poll_max_ms = lease_poll_max_ms
        self._tasks: list[asyncio.Task[None]] = []
        self._directories: list[ServiceDirectory] = []
        self._known_workers: dict[str, set[str]] = {"rolloutd": set(), "traind": set()}
        self._last_commit_s: dict[tuple[str, str], float] = {}
        #: (job, agent) -> the version being broadcast and its weight-update group (announce_weights).
        self._weight_groups: dict[tuple[str, str], tuple[int, WeightGroupRecord]] = {}
        #: (job or "" for every job, rolloutd worker id) -> its open WatchAgentVersions streams.
        self._version_watchers: collections.Counter[tuple[str, str]] = collections.Counter()
        self._background: set[asyncio.Task[Any]] = set()
        self._rollout_channels: dict[str, grpc.aio.Channel] = {}
        #: Generated tokens per second of each agent's last step (JobStatus, progress bars).
        self.tokens_per_s: dict[tuple[str, str], float] = {}
        #: The job's experiment trackers (``tracking:``), written once a commit is durable.
        self._tracking = StepTracking(self._read_experiences)
        self._step_records: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._archiving: set[str] = set()

    @property
    def state(self) -> StateStore:
        """Durable job state (etcd)."""
        return self._state

    @state.setter
    def state(self, store: StateStore) -> None:
        self._state = store
        #: Old pages of per-step history move to stored and their etcd keys go (etcd stays bounded).
        self.history_archive = HistoryArchive(store, self._peers_store, self._history_page_steps)

    async def _peers_store(self) -> HistoryBlobs:
        return await self._peers.store()

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Restores every unfinished job from etcd and starts the tick and liveness loops."""
        for job_id in await self.state.list_job_ids():
            persisted = await self.state.load_job(job_id)
            if persisted is None:
                continue
            reported: list[ExperienceSummary] = []
            consumed_by: dict[str, int] = {}
            if not persisted.state.terminal:
                reported, consumed_by = await self._reported_experiences(job_id, list(persisted.agents))
            job = self.planner.restore_job(persisted, reported, consumed_by)
            for agent in job.spec.agent_names:
                self._last_commit_s[(job_id, agent)] = self._now_s()
            # Marking a committed step's experiences consumed runs after the commit; the commit left a
            # durable pending mark, so a restart drains exactly the marks stored has not confirmed.
            for agent, step in sorted(persisted.pending_marks):
                manifest = persisted.manifests.get((agent, step))
                if manifest is not None:
                    self.history_archive.mark_pending(job_id, agent, step)
                    self._spawn(self._mark_consumed(job_id, agent, step, manifest.experience_ids))
            self._archive_history(job_id)
            if persisted.state.terminal:  # idempotent: a restart may have cut the first call short
                self._spawn(self._finish_in_store(job_id, persisted.state))
            log.info("restored job %s (%s) with %d reported experiences", job_id, persisted.state.name, len(reported))
        await self._persist(self.planner.take_changes())
        for kind in ("rolloutd", "traind"):
            directory = self._registry.directory(kind)
            directory.on_change(functools.partial(self._on_workers, kind))
            directory.start()
            self._directories.append(directory)
        self._tasks.append(asyncio.get_running_loop().create_task(self._tick_loop(), name="planner tick"))

    async def stop(self) -> None:
        """Stops the loops and closes the stored client."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for directory in self._directories:
            await directory.stop()
        for task in list(self._background):
            task.cancel()
        for channel in self._rollout_channels.values():
            await channel.close()
        await self._tracking.close()
        await self._peers.reset_store()

    async def _reported_experiences(self, job_id: str,
                                    agents: Sequence[str]) -> tuple[list[ExperienceSummary], dict[str, int]]:
        """What rollouts already wrote to stored for a job (so a restart does not redo them).

        Also the step that consumed each consumed one (:func:`consumed_steps`).
        """

        async def query() -> tuple[list[ExperienceSummary], dict[str, int]]:
            store = await self._peers.store()
            summaries: list[ExperienceSummary] = []
            consumed: dict[str, int] = {}
            for agent in agents:
                refs = await store.query(job_id, agent)
                summaries += [ExperienceSummary.of_ref(ref, agent) for ref in refs]
                consumed.update(consumed_steps(refs))
            return summaries, consumed

        async def rediscover(exc: BaseException, attempt: int, delay_s: float) -> None:
            log.warning("waiting for stored to recover job %s: %s", job_id, exc)
            await self._peers.reset_store()

        try:
            return await retry(query, retryable=_any_error, policy=RECOVERY_READ_RETRY, on_retry=rediscover)
        except Exception as exc:
            raise Unavailable(f"cannot read job {job_id} from stored: {exc}") from None

    def _on_workers(self, kind: str, services: dict[str, ServiceRecord]) -> None:
        alive = set(services)
        gone = self._known_workers[kind] - alive
        self._known_workers[kind] = alive
        for worker_id in gone:
            log.warning("%s %s is gone; re-issuing its work", kind, worker_id)
            self._spawn(self.mutate(functools.partial(self.planner.worker_gone, worker_id)))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _tick_loop(self) -> None:
        last_demand_s = 0.0
        last_tick_s = time.monotonic()
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            try:
                await self.mutate(self.planner.tick)
                now = time.monotonic()
                self._observe_slots(now - last_tick_s)
                last_tick_s = now
                if time.monotonic() - last_demand_s >= DEMAND_INTERVAL_S:
                    last_demand_s = time.monotonic()
                    await self._push_demand()
            except Exception:
                log.exception("planner tick failed")

    def _observe_slots(self, elapsed_s: float) -> None:
        """Slot gauges, and pipeline bubbles: time slots sat without work while a job was running."""
        slots = self.planner.binder.slots()
        self._metrics.known_slots.set(len(slots))
        self._metrics.bound_slots.set(sum(1 for s in slots if s.agent is not None))
        running = [job for job in self.planner.jobs() if not job.state.terminal]
        if not running:
            return
        busy: set[str] = set()  # one pass per job, not one per slot and job
        for job in running:
            busy |= job.busy_slots()
        idle = sum(1 for s in slots if s.slot_id not in busy)
        self._metrics.bubble_seconds.inc(idle * elapsed_s)

    async def _push_demand(self) -> None:
        """Tells every rolloutd its share of each agent's outstanding generation demand (its balancer's hint)."""
        demand = self.planner.rollout_demand()
        for (job_id, agent), tokens in demand.items():
            self._metrics.rollout_demand_tokens.labels(job_id, agent).set(tokens)
        if not demand or not self._directories:
            return
        records = list(self._directories[0].services.values())
        request = serde.agent_demand_request(rolloutd_share(demand, len(records)))
        for record in records:
            channel = self._rollout_channels.get(record.address)
            if channel is None:
                channel = self._rollout_channels[record.address] = open_channel(record.address, self._security)
            try:
                await rollout_pb2_grpc.RolloutStub(channel).SetAgentDemand(request, timeout=2)
            except grpc.RpcError as exc:
                log.debug("demand hint to %s failed: %s", record.service_id, exc)

    # ---- mutation, persistence, waiting -----------------------------------------------------------------

    async def mutate(self, fn: Callable[[], T], notify: bool = True) -> T:
        """Runs fn on the planner, persists its changes and wakes waiters; returns fn's result.

        A long-poll's empty attempt passes notify=False: waking the other waiters for it would
        make idle long-polls wake each other in a loop.
        """
        async with self._lock:
            try:
                result = fn()
            finally:
                await self._persist(self.planner.take_changes())
            # Under the lock and before any await: a poll that found no work registers before the next mutation.
            self._trainer_polls.wake(self.planner.trainer_wakes(self._trainer_polls.slots()))
        self._wake_lease_waiters()
        if notify:
            await self._notify()
        return result

    def _wake_lease_waiters(self) -> None:
        """Wakes the rollout-task long-polls when some job has a task to hand out (else they sleep on)."""
        if self._lease_waiters and self.planner.has_leasable_tasks():
            for waiter in self._lease_waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._lease_waiters.clear()

    async def _notify(self) -> None:
        """Wakes long-polls and watch streams: the planner may have changed."""
        async with self._changed:
            self._changed.notify_all()

    async def _persist(self, changes: list[StateChange]) -> None:
        """Writes the planner's changes, after any earlier ones a failed write left behind.

        The planner has already applied them in memory. When etcd stays unreachable past the
        state store's retries, the RPC fails and the changes are kept: the next mutation writes
        them first, so no reply is ever sent on top of an unwritten change (a restart before that
        drops only changes no caller was told about). Rewriting a change is idempotent.
        """
        pending = self._unpersisted + changes
        if not pending:
            return
        self._unpersisted = []
        try:
            await apply_changes(self.state, pending, self._history_record)
        except BaseException:
            self._unpersisted = pending
            raise
        for change in pending:
            if isinstance(change, StepCommitted):
                self._observe_commit(change)
            elif isinstance(change, WarmStartPublished):
                log.info("job %s: agent %s warm-started, version 0 is %s", change.job_id, change.agent,
                         change.weights_uri)
            elif isinstance(change, EvalRecorded):
                self._observe_eval(change)
            elif isinstance(change, JobStateChanged) and change.state.terminal:
                self._spawn(self._finish_in_store(change.job_id, change.state))
                self._spawn(self._tracking.job_ended(change.job_id))

    def _history_record(self, change: StepCommitted) -> dict[str, Any]:
        """The step's figures for `flexmarl plot`, stored atomically with its commit."""
        commit, manifest = change.commit, change.manifest
        job = self.planner.job(commit.job_id)
        progress = next((a for a in job.snapshot().agents if a.agent == commit.agent), None)
        key = (commit.job_id, commit.agent)
        now_s = self._now_s()
        since_s = max(1e-6, now_s - self._last_commit_s.get(key, now_s))
        self._last_commit_s[key] = now_s
        tokens = manifest.step_response_tokens if manifest is not None else 0
        record: dict[str, Any] = {
            "agent": commit.agent, "step": commit.step, "version": commit.new_version,
            "reward_mean": progress.reward_mean if progress else 0.0,
            "return_mean": progress.return_mean if progress else 0.0, "loss": commit.loss,
            "grad_norm": commit.grad_norm, "step_seconds": commit.step_seconds or since_s,
            "tokens_per_s": tokens / since_s, "staleness_mean": progress.staleness_mean if progress else 0.0,
            "episodes": manifest.step_episodes if manifest is not None else 0, "response_tokens": tokens,
            "committed_unix_ms": int(commit.committed_s * 1000), "weights_uri": commit.weights_uri,
            **dict(commit.figures),
            # The step's failed episodes and given-up tasks (orchestratord/failures.py).
            **(manifest.failures.as_record() if manifest is not None and manifest.failures is not None else {}),
        }
        self.tokens_per_s[key] = record["tokens_per_s"]
        self._step_records[(commit.job_id, commit.agent, commit.step)] = record
        self._metrics.step_seconds.labels(commit.agent).observe(record["step_seconds"])
        self._metrics.staleness.observe(record["staleness_mean"])
        return record

    def _observe_commit(self, change: StepCommitted) -> None:
        """After a commit is durable: count it, mark its experiences consumed in stored, write its trackers."""
        commit, manifest = change.commit, change.manifest
        self._metrics.steps_committed.labels(commit.job_id, commit.agent).inc()
        job = self.planner.job(commit.job_id)
        if manifest is not None:
            self.history_archive.mark_pending(commit.job_id, commit.agent, commit.step)
            self._spawn(self._mark_consumed(commit.job_id, commit.agent, commit.step, manifest.experience_ids))
        record = self._step_records.pop((commit.job_id, commit.agent, commit.step), None)
        if record is not None and job.spec.tracking.trackers:
            self._spawn(self._tracking.step_committed(commit.job_id, job.spec, record,
                                                      manifest.experience_ids if manifest is not None else ()))

    def _observe_eval(self, change: EvalRecorded) -> None:
        """After an evaluation round's record is durable: write it to the job's trackers."""
        job = self.planner.job(change.job_id)
        # An on-demand round's versions are the asker's: the trackers' curves are the periodic rounds'.
        if job.spec.tracking.trackers and not EvalRecord.from_dict(change.record).on_demand:
            self._spawn(self._tracking.eval_recorded(change.job_id, job.spec, change.record))

    async def _read_experiences(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Whole experiences from stored (the trackers' sample dumps)."""
        store = await self._peers.store()
        return await store.read(job_id, ids)

    async def _mark_consumed(self, job_id: str, agent: str, step: int, ids: Sequence[str]) -> None:
        """Marks a committed step's experiences consumed in stored, then drops its pending mark.

        The commit wrote the pending mark in its own etcd transaction (``StateStore.commit_step``).
        While stored is unavailable the mark is retried with no deadline (back-off up to 5 s); only
        after stored confirmed is the pending mark cleared, so neither a long stored outage nor an
        orchestratord restart loses it (a restart drains every pending mark again; marking is
        idempotent). A definite refusal from stored (an unknown job, an illegal move) is logged
        and the mark dropped: retrying cannot change it.
        """

        async def mark() -> None:
            store = await self._peers.store()
            await store.mark(job_id, agent, str(StepRef(job_id, agent, step)), ids, ExperienceState.CONSUMED)

        async def rediscover(exc: BaseException, attempt: int, delay_s: float) -> None:
            if attempt == 1 or attempt % 20 == 0:
                log.warning("marking step %d of %s/%s consumed: stored unavailable (%s); retrying",
                            step, job_id, agent, exc)
            await self._peers.reset_store()  # stored restarting, maybe on a new address

        try:
            await retry(mark, retryable=_unavailable, policy=MARK_CONSUMED_RETRY, on_retry=rediscover)
        except Exception as exc:
            log.warning("stored refused marking step %d of %s/%s consumed: %s", step, job_id, agent, exc)
        try:
            await self.state.clear_pending_mark(job_id, agent, step)
        except Exception as exc:  # etcd away: the mark stays pending and the next start drains it again
            log.warning("could not clear the pending mark of step %d of %s/%s: %s", step, job_id, agent, exc)
            return
        self.history_archive.mark_cleared(job_id, agent, step)
        self._archive_history(job_id)

    def _archive_history(self, job_id: str) -> None:
        """Starts an archive pass of the job's old history pages when one may be due (one at a time a job)."""
        try:
            job = self.planner.job(job_id)
        except NotFound:
            return
        min_version = min(v.version for v in job.versions())
        if job_id in self._archiving or not self.history_archive.due(job_id, min_version):
            return
        self._archiving.add(job_id)

        async def archive() -> None:
            try:
                await self.history_archive.archive(job_id, job.spec.agent_names, min_version)
            except Exception as exc:  # stored or etcd away: the next commit or restart tries again
                log.warning("job %s: archiving old history failed (%s); will retry", job_id, exc)
            finally:
                self._archiving.discard(job_id)

        self._spawn(archive())

    async def _finish_in_store(self, job_id: str, state: JobState) -> None:
        """Tells stored a job ended, so an explicit CollectGarbage of it may reclaim its rows.

        Until stored has heard it, garbage collection on request leaves the job alone (the safe
        side); a restart sends it again for every ended job, so a failure is logged, not raised.
        """

        async def finish() -> None:
            store = await self._peers.store()
            await store.finish_job(job_id, state.name)

        async def rediscover(exc: BaseException, attempt: int, delay_s: float) -> None:
            await self._peers.reset_store()

        try:
            await retry(finish, retryable=_unavailable, policy=FINISH_JOB_RETRY, on_retry=rediscover)
        except Exception as exc:
            log.warning("could not tell stored that job %s ended: %s", job_id, exc)

    async def _wait_for_trainer_work(self, slot_id: str, fn: Callable[[], T | None], wait_ms: int) -> T | None:
        """Calls fn (as a mutation) until it returns work or wait_ms passes (at most ``lease_poll_max_ms``).

        Between calls the poll sleeps until the planner says a change may have given the slot work
        (:meth:`Planner.trainer_wakes`, asked by every mutation); the bound on the wait is the safety
        re-check (the trainer polls again).
        """
        wait_s = min(max(wait_ms, 0), self.lease_poll_max_ms) / 1000.0
        deadline = time.monotonic() + wait_s
        while True:
            # Registered before the call: a change this call (or any later one) makes that may give the
            # slot work wakes it, so no wake falls between the call and the wait.
            waiter = self._trainer_polls.register(slot_id)
            try:
                result = await self.mutate(fn, notify=False)
                if result:
                    await self._notify()
                    return result
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return result
                async with asyncio.timeout(remaining_s):
                    await waiter
            except TimeoutError:
                return None
            finally:
                self._trainer_polls.discard(slot_id, waiter)

    async def changes(self) -> AsyncIterator[None]:
        """Yields after every mutation (for watch streams); also every few seconds."""
        while True:
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=5.0)
            yield None

    # ---- jobs --------------------------------------------------------------------------------------------

    async def submit_job(self, spec_json: str, job_id: str, resume_from: str = "") -> str:
        """Validates and creates a job (idempotent for the same id and spec).

        With ``resume_from`` (:mod:`orchestratord.resume`) the job continues the checkpoints of an
        earlier job under a new id, each agent from its checkpoint's version; an empty spec then
        means the earlier job's.
        """
        plan: ResumePlan | None = None
        if resume_from:
            given = _spec_from_json(spec_json) if spec_json.strip() else None
            plan = await plan_resume(resume_from, given, self._peers.store)
            spec = plan.spec
        else:
            spec = _spec_from_json(spec_json) if spec_json.strip() else _empty_spec()
        if not job_id:
            job_id = f"{spec.name}-{int(self._now_s() * 1000):x}"
        if plan is not None and job_id == plan.source.job_id:
            raise InvalidArgument(f"job_id: a resumed job needs a new id, not its source's ({job_id!r})")
        # What a registered rolloutd's replicas would serve wrongly is refused now (a later one checks it itself).
        await asyncio.to_thread(_refuse_unservable, spec, self._engine_limits())  # reads the agents' config.json
        initial = plan.initial_versions() if plan is not None else None
        job = await self.mutate(lambda: self.planner.submit_job(job_id, spec, initial))
        if plan is not None:
            log.info("job %s resumes %s from %s", job_id, plan.source, plan.describe())
        for agent in job.spec.agent_names:
            self._last_commit_s.setdefault((job_id, agent), self._now_s())
        self._metrics.jobs_submitted.inc()
        log.info("job %s submitted (%s, %d agents, mode %s, max_staleness %d)", job_id, spec.name,
                 len(spec.agents), spec.pipeline.mode, spec.pipeline.max_staleness)
        return job_id

    def _engine_limits(self) -> list[tuple[str, EngineLimits]]:
        """Each registered rolloutd's published engine limits (:mod:`flexmarl.engine_limits`), by service id."""
        if not self._directories:  # before start()
            return []
        rolloutds = sorted(self._directories[0].services.values(), key=lambda r: r.service_id)
        published = ((r.service_id, EngineLimits.from_info(r.info)) for r in rolloutds)
        return [(service_id, limits) for service_id, limits in published if limits is not None]


    def snapshot(self, job_id: str) -> JobSnapshot:
        """A job's status."""
        return self.planner.snapshot(job_id)

    def spec_digest(self, job_id: str) -> str:
        """The digest that names a job's spec in its work (workers fetch the spec once by GetJob)."""
        return self.planner.job(job_id).spec_digest

    def rates(self, job_id: str) -> dict[str, float]:
        """Last step's generated tokens/s of each agent of a job."""
        return {agent: rate for (job, agent), rate in self.tokens_per_s.items() if job == job_id}

    def snapshots(self, states: Sequence[JobState]) -> list[JobSnapshot]:
        """Every job's status, filtered by state."""
        out = [self.planner.snapshot(job.job_id) for job in self.planner.jobs()]
        return [s for s in out if not states or s.state in states]

    async def cancel_job(self, job_id: str) -> JobSnapshot:
        """Cancels a job."""
        return await self.mutate(lambda: self.planner.cancel_job(job_id))

    def versions(self, job_id: str) -> list[AgentVersion]:
        """Committed versions of a job's agents ([] for all jobs when job_id is empty)."""
        jobs = [self.planner.job(job_id)] if job_id else self.planner.jobs()
        return [v for job in jobs for v in job.versions()]

    def announced_weights(self, job_id: str) -> list[tuple[AgentVersion, WeightGroupRecord]]:
        """Versions being broadcast and not committed yet, with their groups ([] for all jobs when job_id is empty)."""
        out = []
        for (job, agent), (version, record) in list(self._weight_groups.items()):
            if job_id and job != job_id:
                continue
            try:
                committed = self.planner.job(job).version(agent)
            except FlexmarlError:  # the job ended and was deleted
                self._weight_groups.pop((job, agent), None)
                continue
            if version > committed:
                out.append((AgentVersion(job, agent, version, ""), record))
        return out

    @contextlib.contextmanager
    def watching_versions(self, job_id: str, worker_id: str) -> Any:
        """While the block runs, rolloutd ``worker_id`` watches ``job_id``'s versions ("": every job's).

        A watcher is a peer of the weight-update groups announced meanwhile (:meth:`announce_weights`).
        """
        key = (job_id, worker_id)
        self._version_watchers[key] += 1
        try:
            yield
        finally:
            self._version_watchers[key] -= 1
            if self._version_watchers[key] == 0:
                del self._version_watchers[key]  # only open streams are counted

    def version_peers(self, job_id: str) -> tuple[str, ...]:
        """The rolloutd workers watching ``job_id``'s versions now (sorted worker ids)."""
        return tuple(sorted({worker for job, worker in self._version_watchers if job in (job_id, "")}))

    async def announce_weights(self, job_id: str, agent: str, version: int,
                               record: WeightGroupRecord) -> tuple[str, ...]:
        """Rank 0 of an agent is about to broadcast ``version`` over ``record``'s group (weight_sync: distributed).

        The record streamed is ``record`` with its peers: the rolloutd workers watching the job's
        versions now (:meth:`version_peers`), whom rank 0 waits for; returns them. Kept in memory
        only, never in etcd: the record names a socket of a live trainer process, worthless after
        either restarts; the next version announces again (and a replica that missed one loads
        the committed checkpoint).

        Raises:
            NotFound: No such job or agent.
            FailedPrecondition: ``version`` is not newer than the agent's committed version.
        """
        committed = self.planner.job(job_id).version(agent)
        if version <= committed:
            raise FailedPrecondition(f"{job_id}/{agent}: v{version} is not newer than the committed v{committed}")
        peers = self.version_peers(job_id)
        self._weight_groups[(job_id, agent)] = (version, dataclasses.replace(record, peers=peers))
        await self._notify()
        return peers

    async def history(self, job_id: str, from_step: int = 0, max_steps: int = HISTORY_PAGE_STEPS,
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        """A page of a job's step records, whether more follow, and (from step 0) its evaluation rounds.

        The page holds every agent's records of steps ``from_step .. from_step + max_steps - 1``, at
        least as new as the job's status read before.
        Status is served from the planner, which holds a change before :meth:`mutate` has written
        it; waiting for the lock lets a write in progress land first, so a caller who saw the job
        SUCCEEDED finds its last commit's record (it was missing now and then under CI load).
        """
        job = self.planner.job(job_id)
        async with self._lock:
            pass
        rows, more = await self.history_archive.page(job_id, job.spec.agent_names, from_step, max_steps)
        evals = await self.state.load_evals(job_id) if from_step == 0 else []
        return rows, evals, more

    async def evaluate_job(self, job_id: str, versions: Mapping[str, int], tasks: int, eval_file: str = "",
                           eval_sha256: str = "", sampling: str = "", samples_per_task: int = 0) -> str:
        """Opens an on-demand evaluation round (``flexmarl eval``) on kept versions; returns its round id.

        ``versions``: agent -> version (an agent not named: its committed version); ``tasks`` 0: the
        job's ``evaluation.tasks``; ``eval_file``: the held-out rows come from that task file (checked by
        rolloutd against ``eval_sha256``); ``sampling`` / ``samples_per_task``: the round's own ("" / 0: the
        job's ``evaluation``). An older version's weights come from its step's history record.

        Raises:
            NotFound: no such job.
            InvalidArgument: an unknown agent, or a version the agent has not reached.
            FailedPrecondition: the job failed or was cancelled, or a version's weights are not kept.
        """
        job = self.planner.job(job_id)
        current = {v.agent: v for v in job.versions()}
        unknown = sorted(set(versions) - set(current))
        if unknown:
            raise InvalidArgument(f"agent_versions: job {job_id!r} has no agents {unknown} (it has {sorted(current)})")
        pinned: list[AgentVersion] = []
        for agent, now in current.items():
            version = versions.get(agent, now.version)
            uri = now.weights_uri
            if version != now.version:
                if not 0 <= version < now.version:
                    raise InvalidArgument(f"agent_versions: {agent} has versions 0..{now.version}, not {version}")
                if not job.spec.checkpoint.keeps_weights(version, now.version) or (
                        version == 0 and job.spec.agent(agent).warm_start is not None
                        and not job.initial_weights_uri(agent)):
                    # (a warm start committed before its URI was kept past later versions is not findable)
                    raise FailedPrecondition(f"agent_versions: version {version} of {agent} is not kept "
                                             f"({job.spec.checkpoint.describe()})")
                if version == 0:
                    uri = job.initial_weights_uri(agent)  # its published warm start; "" is the spec's own model
                else:
                    # Version v is the commit of step v - 1: one record, not the job's whole history.
                    rows, _ = await self.history_archive.page(job_id, [agent], version - 1, 1)
                    uri = next((str(row.get("weights_uri", "")) for row in rows if row.get("version") == version), "")
                    if not uri:
                        raise FailedPrecondition(f"agent_versions: no weights recorded for version {version} "
                                                 f"of {agent}")
            pinned.append(AgentVersion(job_id, agent, version, uri))
        count = tasks or (job.spec.evaluation or EvaluationSpec()).tasks
        round_id = await self.mutate(lambda: job.open_evaluation(pinned, count, eval_file, eval_sha256, sampling,
                                                                 samples_per_task))
        log.info("job %s: on-demand evaluation %s of %s", job_id, round_id, {v.agent: v.version for v in pinned})
        return round_id

    # ---- workers -------------------------------------------------------------------------------------

    async def lease_rollout_tasks(self, worker_id: str, max_tasks: int, wait_ms: int) -> list[RolloutTaskLease]:
        """Long-poll for rollout tasks.

        The planner is entered (under the lock) only while some job has a task to hand out, so an
        empty poll is one predicate check, and waiting polls sleep until a mutation leaves a task
        to hand out (an expired lease is re-queued by the tick loop, at most TICK_INTERVAL_S late).
        Leasing changes nothing other waiters wait for, so it wakes nobody.
        """
        wait_s = min(max(wait_ms, 0), self.lease_poll_max_ms) / 1000.0
        deadline = time.monotonic() + wait_s
        lease = functools.partial(self.planner.lease_rollout_tasks, worker_id, max_tasks)
        while True:
            if self.planner.has_leasable_tasks():
                tasks = await self.mutate(lease, notify=False)
                if tasks:
                    self._metrics.tasks_leased.inc(len(tasks))
                    if log.isEnabledFor(logging.DEBUG):
                        for task in tasks:
                            log.debug("leased %s (attempt %d) to %s with versions %s", task.task_id, task.attempt,
                                      worker_id, {v.agent: v.version for v in task.agent_versions})
                    return tasks
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return []
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._lease_waiters.add(waiter)
            try:
                async with asyncio.timeout(remaining_s):
                    await waiter
            except TimeoutError:
                return []
            finally:
                self._lease_waiters.discard(waiter)

    async def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        """Renews leases whose work progresses: soft state, never persisted (leases are re-issued after a restart).

        A renewal changes nothing a long-poll or watch waits for, so it wakes nobody; one that ended
        stalled trainer work (replayed on another slot) wakes the trainer polls.
        """
        result = await self.mutate(functools.partial(self.planner.renew_leases, worker_id, lease_ids, progress),
                                   notify=False)
        if result.stalled_slots:
            await self._notify()
        return result

    async def report_task(self, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                          experiences: Sequence[ExperienceSummary],
                          reason: ErrorReason = ErrorReason.UNSPECIFIED,
                          eval_episodes: Sequence[EvalEpisode] = (),
                          failed_episodes: Sequence[FailedEpisode] = ()) -> None:
        """A task (or an eval task: ``eval_episodes``) finished or failed (``failed_episodes``: those dropped)."""
        await self.mutate(lambda: self.planner.report_rollout_task(lease_id, worker_id, task_id, succeeded, error,
                                                                   experiences, reason, eval_episodes,
                                                                   failed_episodes))
        given_up = not succeeded and reason is ErrorReason.EPISODES_FAILED
        kind = "eval" if _is_eval_task(task_id) else "train"
        self._metrics.tasks_reported.labels("ok" if succeeded else "given_up" if given_up else "failed", kind).inc()
        self._metrics.episodes_failed.inc(len(failed_episodes))

    async def poll_trainer_work(self, worker_id: str, slot_id: str, resident: Sequence[ResidentAgent],
                                wait_ms: int, dp_address: str = "", capacity: float = 1.0) -> TrainerWork | None:
        """Long-poll for trainer work (``dp_address``: the slot's data-parallel rendezvous, "" = none)."""
        return await self._wait_for_trainer_work(
            slot_id, lambda: self.planner.poll_trainer_work(worker_id, slot_id, resident, dp_address, capacity),
            wait_ms)

    async def ack_micro_batch(self, lease_id: str, worker_id: str, slot_id: str, episodes: int) -> None:
        """A micro-batch was accumulated."""
        await self.mutate(lambda: self.planner.ack_micro_batch(lease_id, worker_id, slot_id, episodes))
        self._metrics.micro_batches_acked.inc()

    async def commit_step(self, worker_id: str, slot_id: str, job_id: str, agent: str, step: int, new_version: int,
                          weights_uri: str, state_uri: str, loss: float, grad_norm: float, step_seconds: float,
                          figures: Mapping[str, float] | None = None) -> None:
        """An optimizer step ran and its weights are published: durable before returning."""
        await self.mutate(lambda: self.planner.commit_step(worker_id, slot_id, job_id, agent, step, new_version,
                                                           weights_uri, state_uri, loss, grad_norm, step_seconds,
                                                           figures))

    async def slot_event(self, worker_id: str, slot_id: str, job_id: str, agent: str, kind: SlotEventKind,
                         state_uri: str, error: str) -> None:
        """A slot swapped an agent out or failed."""
        await self.mutate(lambda: self.planner.report_slot_event(worker_id, slot_id, job_id, agent, kind,
                                                                 state_uri, error))


def _any_error(exc: BaseException) -> bool:
    return True


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, Unavailable)


def _empty_spec() -> JobSpec:
    raise InvalidArgument("spec_json: must not be empty")


def _refuse_unservable(spec: JobSpec, rolloutds: list[tuple[str, EngineLimits]]) -> None:
    """Raises InvalidArgument (one line naming the setting) if some rolloutd's replicas cannot serve ``spec``."""
    for service_id, limits in rolloutds:
        problem = unservable(spec, limits)
        if problem is not None:
            raise InvalidArgument(f"{problem} ({service_id} runs {limits.backend} replicas)")


def _spec_from_json(spec_json: str) -> JobSpec:
    """Parses SubmitJob's spec_json as JSON text only (never a file path on this host, never YAML aliases)."""
    try:
        data = json.loads(spec_json)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"job spec: spec_json is not valid JSON: {str(exc)[:200]}") from None
    spec = parse_job_spec(data)
    # Sizes that travel in uint32/uint64 fields of tasks and job statuses.
    for name, value, limit in (("batch.prompts_per_step", spec.batch.prompts_per_step, MAX_PROMPTS_PER_STEP),
                               ("batch.group_size", spec.batch.group_size, MAX_GROUP_SIZE)):
        if value > limit:
            raise InvalidArgument(f"{name}: must be <= {limit}, got {value}")
    return spec
