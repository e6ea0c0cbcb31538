"""gRPC adapter of orchestratord: validate fields, call the service, encode replies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from flexmarl.errors import InvalidArgument
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from orchestratord import serde
from orchestratord.coordinator import JobCoordinator, require_id
from orchestratord.planner import SlotEventKind
from orchestratord.state import JobState

MAX_SPEC_BYTES = 1 << 20
MAX_TASKS_PER_LEASE = 256
MAX_REPORTED_EXPERIENCES = 1 << 16
MAX_DP_ADDRESS_LENGTH = 256


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Every RPC of flexmarl.v1.Orchestrator."""

    def __init__(self, service: JobCoordinator) -> None:
        self._service = service

    # ---- jobs ----

    async def SubmitJob(self, request: orchestrator_pb2.SubmitJobRequest, context: Any) -> Any:  # noqa: N802
        """Validates and creates a job."""
        if len(request.spec_json.encode()) > MAX_SPEC_BYTES:
            raise InvalidArgument(f"spec_json: larger than {MAX_SPEC_BYTES} bytes")
        if request.job_id:
            require_id("job_id", request.job_id)
        job_id = await self._service.submit_job(request.spec_json, request.job_id)
        return orchestrator_pb2.SubmitJobResponse(job_id=job_id)

    async def GetJob(self, request: orchestrator_pb2.GetJobRequest, context: Any) -> Any:  # noqa: N802
        """A job's status."""
        return serde.job_status(self._service.snapshot(require_id("job_id", request.job_id)),
                                self._service.rates(request.job_id))

    async def ListJobs(self, request: orchestrator_pb2.ListJobsRequest, context: Any) -> Any:  # noqa: N802
        """Every job, filtered by state."""
        states = []
        for value in request.states:
            try:
                states.append(JobState(value))
            except ValueError:
                raise InvalidArgument(f"states: unknown job state {value}") from None
        snaps = self._service.snapshots(states)
        jobs = [serde.job_status(s, self._service.rates(s.job_id)) for s in snaps]
        return orchestrator_pb2.ListJobsResponse(jobs=jobs)

    async def CancelJob(self, request: orchestrator_pb2.CancelJobRequest, context: Any) -> Any:  # noqa: N802
        """Cancels a job."""
        snap = await self._service.cancel_job(require_id("job_id", request.job_id))
        return serde.job_status(snap, self._service.rates(snap.job_id))

    async def WatchJob(  # noqa: N802
        self, request: orchestrator_pb2.WatchJobRequest, context: Any
    ) -> AsyncIterator[orchestrator_pb2.JobStatus]:
        """Streams a snapshot on every change until the job ends."""
        job_id = require_id("job_id", request.job_id)
        last = None
        snap = self._service.snapshot(job_id)
        async for _ in _prepend(self._service.changes()):
            snap = self._service.snapshot(job_id)
            if snap != last:
                last = snap
                yield serde.job_status(snap, self._service.rates(job_id))
            if snap.state.terminal:
                return

    async def GetJobHistory(self, request: orchestrator_pb2.GetJobRequest, context: Any) -> Any:  # noqa: N802
        """Per-step records of a job."""
        job_id = require_id("job_id", request.job_id)
        rows = await self._service.history(job_id)
        return orchestrator_pb2.JobHistory(job_id=job_id, steps=[serde.step_record(r) for r in rows])

    async def WatchAgentVersions(  # noqa: N802
        self, request: orchestrator_pb2.WatchAgentVersionsRequest, context: Any
    ) -> AsyncIterator[Any]:
        """Streams every agent version (current ones first, then each new one)."""
        job_id = request.job_id
        if job_id:
            require_id("job_id", job_id)
            self._service.snapshot(job_id)  # NotFound for an unknown job
        sent: set[tuple[str, str, int]] = set()
        async for _ in _prepend(self._service.changes()):
            for version in self._service.versions(job_id):
                key = (version.job_id, version.agent, version.version)
                if key not in sent:
                    sent.add(key)
                    yield serde.agent_version(version)

    # ---- rollout workers ----

    async def LeaseRolloutTasks(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Long-poll for rollout tasks."""
        worker_id = require_id("worker_id", request.worker_id)
        if not 1 <= request.max_tasks <= MAX_TASKS_PER_LEASE:
            raise InvalidArgument(f"max_tasks: must be in 1..{MAX_TASKS_PER_LEASE}, got {request.max_tasks}")
        tasks = await self._service.lease_rollout_tasks(worker_id, request.max_tasks, request.wait_ms)
        return orchestrator_pb2.LeaseRolloutTasksResponse(
            tasks=[serde.rollout_task(t, self._service.planner.job(t.job_id).spec_digest) for t in tasks]
        )

    async def RenewLeases(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Extends leases still held."""
        worker_id = require_id("worker_id", request.worker_id)
        for lease_id in request.lease_ids:
            require_id("lease_ids", lease_id)
        result = await self._service.renew(worker_id, list(request.lease_ids))
        return orchestrator_pb2.RenewLeasesResponse(lost_lease_ids=list(result.lost_lease_ids),
                                                    deadline_unix_ms=int(result.deadline_s * 1000))

    async def ReportRolloutTask(self, request: Any, context: Any) -> Any:  # noqa: N802
        """A task finished (experiences durable in stored) or failed."""
        if len(request.experiences) > MAX_REPORTED_EXPERIENCES:
            raise InvalidArgument(f"experiences: more than {MAX_REPORTED_EXPERIENCES}")
        await self._service.report_task(
            require_id("lease_id", request.lease_id), require_id("worker_id", request.worker_id),
            require_id("task_id", request.task_id), request.succeeded, request.error[:4096],
            serde.experience_summaries(request.experiences),
        )
        return orchestrator_pb2.ReportRolloutTaskResponse()

    # ---- trainer workers ----

    async def PollTrainerWork(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Long-poll for the next work of a trainer slot."""
        worker_id = require_id("worker_id", request.worker_id)
        slot_id = require_id("slot_id", request.slot_id)
        if len(request.dp_address) > MAX_DP_ADDRESS_LENGTH:
            raise InvalidArgument(f"dp_address: longer than {MAX_DP_ADDRESS_LENGTH} characters")
        work = await self._service.poll_trainer_work(worker_id, slot_id, serde.resident_agents(request.resident),
                                                     request.wait_ms, request.dp_address)
        digest = self._service.planner.job(work.job_id).spec_digest if work is not None else ""
        return serde.trainer_work(work, digest)

    async def AckMicroBatch(self, request: Any, context: Any) -> Any:  # noqa: N802
        """A micro-batch's gradients are accumulated."""
        await self._service.ack_micro_batch(require_id("lease_id", request.lease_id),
                                            require_id("worker_id", request.worker_id),
                                            require_id("slot_id", request.slot_id), request.episodes)
        return orchestrator_pb2.AckMicroBatchResponse()

    async def CommitStep(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The optimizer step ran and the weights are published."""
        if not request.weights_uri:
            raise InvalidArgument("weights_uri: must not be empty")
        await self._service.commit_step(
            require_id("worker_id", request.worker_id), require_id("slot_id", request.slot_id),
            require_id("job_id", request.job_id), require_id("agent", request.agent), request.step,
            request.new_version, request.weights_uri, request.state_uri, request.loss, request.grad_norm,
            request.step_seconds,
        )
        return orchestrator_pb2.CommitStepResponse()

    async def ReportSlotEvent(self, request: Any, context: Any) -> Any:  # noqa: N802
        """A slot swapped an agent out or failed."""
        kinds = {
            orchestrator_pb2.ReportSlotEventRequest.KIND_SWAPPED_OUT: SlotEventKind.SWAPPED_OUT,
            orchestrator_pb2.ReportSlotEventRequest.KIND_FAILED: SlotEventKind.FAILED,
        }
        kind = kinds.get(request.kind)
        if kind is None:
            raise InvalidArgument(f"kind: unknown slot event {request.kind}")
        await self._service.slot_event(
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
