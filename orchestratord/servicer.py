"""gRPC adapter of orchestratord: validate fields, call the coordinator, encode replies (via serde)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any, get_args

import grpc.aio

from flexmarl.devices import slot_capacity_problem
from flexmarl.errors import ErrorReason, InvalidArgument
from flexmarl.jobspec import MAX_EVAL_SAMPLES_PER_TASK, MAX_TASKS_PER_LEASE, EvalSampling
from flexmarl.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestratord import serde
from orchestratord.coordinator import (
    HISTORY_PAGE_STEPS,
    MAX_HISTORY_PAGE_STEPS,
    JobCoordinator,
    require_id,
    step_figures,
)

MAX_SPEC_BYTES = 1 << 20
MAX_REPORTED_EXPERIENCES = 1 << 16
MAX_DP_ADDRESS_LENGTH = 256
MAX_RESUME_SOURCE_LENGTH = 4096
MAX_EVAL_TASKS = 100_000  # as JobSpec evaluation.tasks
_SHA256 = re.compile(r"[0-9a-f]{64}")


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Every RPC of flexmarl.v1.Orchestrator."""

    def __init__(self, coordinator: JobCoordinator) -> None:
        self._coordinator = coordinator

    # ---- jobs ----

    async def SubmitJob(  # noqa: N802
        self, request: orchestrator_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.SubmitJobResponse:
        """Validates and creates a job (resumed from checkpoints when ``resume_from`` is set)."""
        if len(request.spec_json.encode()) > MAX_SPEC_BYTES:
            raise InvalidArgument(f"spec_json: larger than {MAX_SPEC_BYTES} bytes")
        if request.job_id:
            require_id("job_id", request.job_id)
        if len(request.resume_from) > MAX_RESUME_SOURCE_LENGTH:
            raise InvalidArgument(f"resume_from: longer than {MAX_RESUME_SOURCE_LENGTH} characters")
        job_id = await self._coordinator.submit_job(request.spec_json, request.job_id, request.resume_from)
        return orchestrator_pb2.SubmitJobResponse(job_id=job_id)

    async def GetJob(  # noqa: N802
        self, request: orchestrator_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.JobStatus:
        """A job's status."""
        return serde.job_status(self._coordinator.snapshot(require_id("job_id", request.job_id)),
                                self._coordinator.rates(request.job_id))

    async def ListJobs(  # noqa: N802
        self, request: orchestrator_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListJobsResponse:
        """Every job, filtered by state."""
        snaps = self._coordinator.snapshots(serde.job_states(request.states))
        jobs = [serde.job_status(s, self._coordinator.rates(s.job_id)) for s in snaps]
        return orchestrator_pb2.ListJobsResponse(jobs=jobs)

    async def CancelJob(  # noqa: N802
        self, request: orchestrator_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.JobStatus:
        """Cancels a job."""
        snap = await self._coordinator.cancel_job(require_id("job_id", request.job_id))
        return serde.job_status(snap, self._coordinator.rates(snap.job_id))

    async def WatchJob(  # noqa: N802
        self, request: orchestrator_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.JobStatus]:
        """Streams a snapshot on every change until the job ends."""
        job_id = require_id("job_id", request.job_id)
        last = None
        snap = self._coordinator.snapshot(job_id)
        async for _ in _prepend(self._coordinator.changes()):
            snap = self._coordinator.snapshot(job_id)
            if snap != last:
                last = snap
                yield serde.job_status(snap, self._coordinator.rates(job_id))
            if snap.state.terminal:
                return

    async def GetJobHistory(  # noqa: N802
        self, request: orchestrator_pb2.GetJobHistoryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.JobHistory:
        """A page of a job's per-step records (and, on the first page, its evaluation rounds)."""
        job_id = require_id("job_id", request.job_id)
        if request.from_step < 0:
            raise InvalidArgument(f"from_step: must be >= 0, got {request.from_step}")
        if request.max_steps > MAX_HISTORY_PAGE_STEPS:
            raise InvalidArgument(f"max_steps: at most {MAX_HISTORY_PAGE_STEPS}, got {request.max_steps}")
        max_steps = request.max_steps or HISTORY_PAGE_STEPS
        rows, evals, more = await self._coordinator.history(job_id, request.from_step, max_steps)
        return orchestrator_pb2.JobHistory(job_id=job_id, steps=[serde.step_record(r) for r in rows],
                                           evals=[serde.eval_record(r) for r in evals], more=more,
                                           next_from_step=request.from_step + max_steps if more else 0)

    async def EvaluateJob(  # noqa: N802
        self, request: orchestrator_pb2.EvaluateJobRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.EvaluateJobResponse:
        """Opens an on-demand evaluation round on kept versions."""
        job_id = require_id("job_id", request.job_id)
        for agent in request.agent_versions:
            require_id("agent_versions", agent)
        if request.tasks > MAX_EVAL_TASKS:
            raise InvalidArgument(f"tasks: at most {MAX_EVAL_TASKS}, got {request.tasks}")
        if request.eval_file and (not request.eval_file.startswith("/") or len(request.eval_file) > 4096
                                  or not request.eval_file.isprintable()):
            raise InvalidArgument(f"eval_file: an absolute path every rolloutd host sees, got {request.eval_file!r}")
        if request.eval_file and not _SHA256.fullmatch(request.eval_sha256):
            raise InvalidArgument("eval_sha256: the file's content sha256 (64 hex digits) goes with eval_file")
        if request.eval_sha256 and not request.eval_file:
            raise InvalidArgument("eval_sha256: given without eval_file")
        if request.sampling not in ("", *get_args(EvalSampling)):
            raise InvalidArgument(f"sampling: one of {list(get_args(EvalSampling))} (or empty: the job's), got "
                                  f"{request.sampling[:64]!r}")
        if request.samples_per_task > MAX_EVAL_SAMPLES_PER_TASK:
            raise InvalidArgument(f"samples_per_task: at most {MAX_EVAL_SAMPLES_PER_TASK} (0: the job's), "
                                  f"got {request.samples_per_task}")
        round_id = await self._coordinator.evaluate_job(job_id, dict(request.agent_versions), request.tasks,
                                                        request.eval_file, request.eval_sha256, request.sampling,
                                                        request.samples_per_task)
        return orchestrator_pb2.EvaluateJobResponse(round_id=round_id)

    async def WatchAgentVersions(  # noqa: N802
        self, request: orchestrator_pb2.WatchAgentVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.AgentVersion]:
        """Streams every agent version (current ones first, then each new one)."""
        job_id = request.job_id
        if job_id:
            require_id("job_id", job_id)
            self._coordinator.snapshot(job_id)  # NotFound for an unknown job
        watching: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if request.worker_id:  # a rolloutd: a peer of the job's weight-update groups while it watches
            watching = self._coordinator.watching_versions(job_id, require_id("worker_id", request.worker_id))
        with watching:
            async for msg in self._versions(job_id):
                yield msg

    async def _versions(self, job_id: str) -> AsyncIterator[common_pb2.AgentVersion]:
        """WatchAgentVersions' stream (job_id checked)."""
        # (job, agent, version, the group that announced it (a replayed step announces anew), or once committed
        # its weights: version 0 of a warm-start agent is the spec's model until the warm start commits it)
        sent: set[tuple[str, str, int, str]] = set()
        async for _ in _prepend(self._coordinator.changes()):
            # A version being broadcast (weight_sync: distributed) first, with its group, then once committed.
            for version, record in self._coordinator.announced_weights(job_id):
                group = f"{record.master_address}:{record.master_port}/{record.epoch}"
                key = (version.job_id, version.agent, version.version, group)
                if key not in sent:
                    sent.add(key)
                    yield serde.announced_version(version, record)
            for version in self._coordinator.versions(job_id):
                key = (version.job_id, version.agent, version.version, "committed " + version.weights_uri)
                if key not in sent:
                    sent.add(key)
                    yield serde.agent_version(version)

    # ---- rollout workers ----

    async def LeaseRolloutTasks(  # noqa: N802
        self, request: orchestrator_pb2.LeaseRolloutTasksRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.LeaseRolloutTasksResponse:
        """Long-poll for rollout tasks."""
        worker_id = require_id("worker_id", request.worker_id)
        if not 1 <= request.max_tasks <= MAX_TASKS_PER_LEASE:
            raise InvalidArgument(f"max_tasks: must be in 1..{MAX_TASKS_PER_LEASE}, got {request.max_tasks}")
        tasks = await self._coordinator.lease_rollout_tasks(worker_id, request.max_tasks, request.wait_ms)
        return orchestrator_pb2.LeaseRolloutTasksResponse(
            tasks=[serde.rollout_task(t, self._coordinator.spec_digest(t.job_id)) for t in tasks]
        )

    async def RenewLeases(  # noqa: N802
        self, request: orchestrator_pb2.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.RenewLeasesResponse:
        """Extends leases still held."""
        worker_id = require_id("worker_id", request.worker_id)
        for lease_id in request.lease_ids:
            require_id("lease_ids", lease_id)
        if request.progress and len(request.progress) != len(request.lease_ids):
            raise InvalidArgument(f"progress: {len(request.progress)} figures for {len(request.lease_ids)} "
                                  "lease ids (send none, or one per lease id)")
        result = await self._coordinator.renew(worker_id, list(request.lease_ids), list(request.progress))
        return serde.renew_response(result)

    async def ReportRolloutTask(  # noqa: N802
        self, request: orchestrator_pb2.ReportRolloutTaskRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReportRolloutTaskResponse:
        """A task finished (experiences durable in stored) or failed."""
        if len(request.experiences) > MAX_REPORTED_EXPERIENCES:
            raise InvalidArgument(f"experiences: more than {MAX_REPORTED_EXPERIENCES}")
        if len(request.eval_episodes) > MAX_REPORTED_EXPERIENCES:
            raise InvalidArgument(f"eval_episodes: more than {MAX_REPORTED_EXPERIENCES}")
        if len(request.failed_episodes) > MAX_REPORTED_EXPERIENCES:
            raise InvalidArgument(f"failed_episodes: more than {MAX_REPORTED_EXPERIENCES}")
        await self._coordinator.report_task(
            require_id("lease_id", request.lease_id), require_id("worker_id", request.worker_id),
            require_id("task_id", request.task_id), request.succeeded, request.error[:4096],
            serde.experience_summaries(request.experiences), ErrorReason.parse(request.reason),
            serde.eval_episodes(request.eval_episodes), serde.failed_episodes(request.failed_episodes),
        )
        return orchestrator_pb2.ReportRolloutTaskResponse()

    # ---- trainer workers ----

    async def PollTrainerWork(  # noqa: N802
        self, request: orchestrator_pb2.PollTrainerWorkRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.PollTrainerWorkResponse:
        """Long-poll for the next work of a trainer slot."""
        worker_id = require_id("worker_id", request.worker_id)
        slot_id = require_id("slot_id", request.slot_id)
        if len(request.dp_address) > MAX_DP_ADDRESS_LENGTH:
            raise InvalidArgument(f"dp_address: longer than {MAX_DP_ADDRESS_LENGTH} characters")
        capacity = request.capacity or 1.0  # unset: a one-device slot
        problem = slot_capacity_problem(capacity)
        if problem is not None:
            raise InvalidArgument(f"capacity: {problem}")
        work = await self._coordinator.poll_trainer_work(worker_id, slot_id, serde.resident_agents(request.resident),
                                                     request.wait_ms, request.dp_address, capacity)
        digest = self._coordinator.spec_digest(work.job_id) if work is not None else ""
        return serde.trainer_work(work, digest)

    async def AckMicroBatch(  # noqa: N802
        self, request: orchestrator_pb2.AckMicroBatchRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.AckMicroBatchResponse:
        """A micro-batch's gradients are accumulated."""
        await self._coordinator.ack_micro_batch(require_id("lease_id", request.lease_id),
                                            require_id("worker_id", request.worker_id),
                                            require_id("slot_id", request.slot_id), request.episodes)
        return orchestrator_pb2.AckMicroBatchResponse()

    async def CommitStep(  # noqa: N802
        self, request: orchestrator_pb2.CommitStepRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.CommitStepResponse:
        """The optimizer step ran and the weights are published."""
        if not request.weights_uri:
            raise InvalidArgument("weights_uri: must not be empty")
        await self._coordinator.commit_step(
            require_id("worker_id", request.worker_id), require_id("slot_id", request.slot_id),
            require_id("job_id", request.job_id), require_id("agent", request.agent), request.step,
            request.new_version, request.weights_uri, request.state_uri, request.loss, request.grad_norm,
            request.step_seconds, step_figures(request.figures),
        )
        return orchestrator_pb2.CommitStepResponse()

    async def AnnounceWeights(  # noqa: N802
        self, request: orchestrator_pb2.AnnounceWeightsRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.AnnounceWeightsResponse:
        """Rank 0 of an agent is about to broadcast a version to the replicas (CommitStep follows)."""
        require_id("worker_id", request.worker_id)
        require_id("slot_id", request.slot_id)
        peers = await self._coordinator.announce_weights(require_id("job_id", request.job_id),
                                                         require_id("agent", request.agent), request.version,
                                                         serde.weight_group_record(request))
        return orchestrator_pb2.AnnounceWeightsResponse(peers=list(peers))

    async def ReportSlotEvent(  # noqa: N802
        self, request: orchestrator_pb2.ReportSlotEventRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReportSlotEventResponse:
        """A slot swapped an agent out or failed."""
        kind = serde.slot_event_kind(request.kind)
        await self._coordinator.slot_event(
            require_id("worker_id", request.worker_id), require_id("slot_id", request.slot_id),
            require_id("job_id", request.job_id), require_id("agent", request.agent), kind,
            request.state_uri, request.error[:4096],
        )
        return orchestrator_pb2.ReportSlotEventResponse()


async def _prepend(changes: AsyncIterator[None]) -> AsyncIterator[None]:
    """Yields once at once, then after every change."""
    yield None
    async for _ in changes:
        yield None
