"""rolloutd's link to orchestratord: typed calls that take and return :mod:`rolloutd.types` dataclasses.

:class:`OrchestratorLink` is what the worker depends on; :class:`GrpcOrchestratorLink` is the
real one, over :class:`flexmarl.connections.PeerConnections`. Every call makes one attempt
(the worker retries with :mod:`flexmarl.retry`) and raises :mod:`flexmarl.errors` errors only:

- a definite answer of orchestratord keeps its domain error (``NotFound``, ``FailedPrecondition``,
  ...; the reason from the ``flexmarl-reason`` metadata, through :func:`flexmarl.errors.error_for_rpc`);
- anything else (no orchestratord registered, the channel down, no answer in time, a status that
  speaks of the transport or the peer's process rather than the request (UNAVAILABLE,
  DEADLINE_EXCEEDED, INTERNAL, UNKNOWN, CANCELLED) or that has no domain error, a call cancelled
  under us by a dropped channel) is ``Unavailable``, and the channel is dropped, so that the next
  call discovers orchestratord again: a restarted one may listen elsewhere.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from flexmarl.client import JobState
from flexmarl.connections import PeerConnections, cancelled_from_outside, describe_error
from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument, Unavailable, error_for_rpc
from flexmarl.v1 import orchestrator_pb2_grpc
from rolloutd import serde
from rolloutd.types import ActiveJob, PublishedVersion, RenewResult, RolloutTask, TaskReport

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Statuses that say nothing about the request: the channel, the peer or its process failed.
_TRANSPORT_CODES = frozenset({
    None, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
})

#: Bound on one call to orchestratord, discovery in etcd included (the RPCs have their own deadlines).
CALL_DEADLINE_S = 40.0
#: RPC deadlines: a lease long-poll and a report; a renewal and a job-state check; a spec fetch.
LEASE_TIMEOUT_S = 30.0
REPORT_TIMEOUT_S = 30.0
RENEW_TIMEOUT_S = 10.0
JOB_STATE_TIMEOUT_S = 10.0
JOB_SPEC_TIMEOUT_S = 30.0
ACTIVE_JOBS_TIMEOUT_S = 10.0


class OrchestratorLink(abc.ABC):
    """The calls rolloutd's worker makes to orchestratord (see the module doc for the errors)."""

    @abc.abstractmethod
    async def lease_tasks(self, worker_id: str, max_tasks: int, wait_ms: int) -> list[RolloutTask]:
        """Leases up to ``max_tasks`` rollout tasks, waiting up to ``wait_ms`` for the first one."""

    @abc.abstractmethod
    async def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        """Renews the leases of the tasks in flight with each task's progress; the result names those lost."""

    @abc.abstractmethod
    async def report(self, worker_id: str, report: TaskReport) -> None:
        """Reports a finished task.

        Raises:
            FailedPrecondition, NotFound: orchestratord rejects the report (the lease is lost,
                the task unknown): reporting again cannot succeed.
        """

    @abc.abstractmethod
    async def job_spec(self, job_id: str) -> str:
        """A job's spec JSON."""

    @abc.abstractmethod
    async def job_state(self, job_id: str) -> JobState:
        """A job's state.

        Raises:
            NotFound: orchestratord does not know the job (it ended and was deleted).
        """

    async def active_jobs(self) -> list[ActiveJob]:
        """The pending and running jobs, whose engines the worker prepares before their first task.

        Raises:
            FailedPrecondition: this link cannot list jobs (the worker then learns of a job from its
                first leased task, and prepares its engines then).
        """
        raise FailedPrecondition(f"{type(self).__name__} does not list jobs")

    def watch_versions(self, job_id: str, worker_id: str = "") -> AsyncIterator[PublishedVersion]:
        """Every committed version of a job's agents: the current ones, then each new one as it is committed.

        With ``worker_id`` this worker is a peer of the job's weight-update groups while it
        watches (:mod:`flexmarl.weight_group`): rank 0 waits for its answer.

        The stream ends or raises ``Unavailable`` when orchestratord goes away (watch again);
        ``NotFound`` when it does not know the job.

        Raises:
            FailedPrecondition: this link cannot watch versions (the worker then learns them from
                leased tasks only).
        """
        raise FailedPrecondition(f"{type(self).__name__} does not stream agent versions")

    async def close(self) -> None:  # noqa: B027 (a link may hold nothing to close)
        """Closes what the link holds."""


class GrpcOrchestratorLink(OrchestratorLink):
    """The link over gRPC, to the orchestratord configured or registered in etcd."""

    def __init__(self, peers: PeerConnections) -> None:
        self._peers = peers

    async def lease_tasks(self, worker_id: str, max_tasks: int, wait_ms: int) -> list[RolloutTask]:
        """See :meth:`OrchestratorLink.lease_tasks`; a malformed task is logged and left to expire."""
        request = serde.lease_request(worker_id, max_tasks, wait_ms)
        reply = await self._call("leasing tasks", lambda stub: stub.LeaseRolloutTasks(request,
                                                                                       timeout=LEASE_TIMEOUT_S))
        tasks = []
        for msg in reply.tasks:
            try:
                tasks.append(serde.rollout_task(msg))
            except InvalidArgument as exc:  # an orchestratord bug: let the lease expire
                log.error("leased task %s not run: %s", msg.lease_id, exc)
        return tasks

    async def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        """See :meth:`OrchestratorLink.renew`."""
        request = serde.renew_request(worker_id, lease_ids, progress)
        reply = await self._call("renewing leases", lambda stub: stub.RenewLeases(request, timeout=RENEW_TIMEOUT_S))
        return serde.renew_result(reply)

    async def report(self, worker_id: str, report: TaskReport) -> None:
        """See :meth:`OrchestratorLink.report`."""
        request = serde.report_request(worker_id, report)
        await self._call(f"reporting task {report.task_id}",
                         lambda stub: stub.ReportRolloutTask(request, timeout=REPORT_TIMEOUT_S))

    async def job_spec(self, job_id: str) -> str:
        """See :meth:`OrchestratorLink.job_spec`."""
        request = serde.job_request(job_id)
        status = await self._call(f"fetching the spec of job {job_id}",
                                  lambda stub: stub.GetJob(request, timeout=JOB_SPEC_TIMEOUT_S))
        return serde.job_spec_json(status)

    async def job_state(self, job_id: str) -> JobState:
        """See :meth:`OrchestratorLink.job_state`."""
        request = serde.job_request(job_id)
        status = await self._call(f"asking for job {job_id}",
                                  lambda stub: stub.GetJob(request, timeout=JOB_STATE_TIMEOUT_S))
        return serde.job_state(status)

    async def active_jobs(self) -> list[ActiveJob]:
        """See :meth:`OrchestratorLink.active_jobs` (ListJobs, pending and running)."""
        request = serde.active_jobs_request()
        reply = await self._call("listing jobs", lambda stub: stub.ListJobs(request, timeout=ACTIVE_JOBS_TIMEOUT_S))
        return serde.active_jobs(reply)

    async def watch_versions(self, job_id: str, worker_id: str = "") -> AsyncIterator[PublishedVersion]:
        """See :meth:`OrchestratorLink.watch_versions` (one WatchAgentVersions stream, no deadline)."""
        what = f"watching the versions of job {job_id}"
        try:
            async with asyncio.timeout(CALL_DEADLINE_S):
                stub = await self._peers.orchestrator()
            async for msg in stub.WatchAgentVersions(serde.watch_versions_request(job_id, worker_id)):
                yield serde.published_version(msg)
            return
        except (grpc.RpcError, FlexmarlError, TimeoutError, asyncio.CancelledError) as exc:
            # FlexmarlError: discovery, or a malformed version (an orchestratord bug)
            error = _failure(what, exc, timed_out=f"no orchestratord within {CALL_DEADLINE_S:g} s",
                             cancelled="the stream was cancelled with its channel")
        await self._peers.reset_orchestrator()
        raise error

    async def _call(self, what: str, call: Callable[[orchestrator_pb2_grpc.OrchestratorStub], Awaitable[_T]]) -> _T:
        """One call, discovery included, bounded by :data:`CALL_DEADLINE_S`; errors as the module doc says."""
        try:
            async with asyncio.timeout(CALL_DEADLINE_S):
                stub = await self._peers.orchestrator()
                return await call(stub)
        except (grpc.RpcError, FlexmarlError, TimeoutError, asyncio.CancelledError) as exc:
            # FlexmarlError: discovery (none registered, etcd unreachable)
            error = _failure(what, exc, timed_out=f"no answer within {CALL_DEADLINE_S:g} s",
                             cancelled="the call was cancelled with its channel")
        await self._peers.reset_orchestrator()
        raise error


def _status_code(exc: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)  # grpc.aio.AioRpcError has one, but is no grpc.Call
    return code() if callable(code) else None


def _failure(what: str, exc: BaseException, *, timed_out: str, cancelled: str) -> Unavailable:
    """How a failed call or stream is reported: the Unavailable to raise after rediscovery.

    Raises instead the definite error a non-transport status maps to (the orchestrator answered),
    and re-raises a cancellation that came from outside. grpc.aio cancels the calls of a channel
    closed under them: that is a failed call, not ours to end.
    """
    if isinstance(exc, grpc.RpcError):
        mapped = error_for_rpc(exc) if _status_code(exc) not in _TRANSPORT_CODES else None
        if mapped is not None:
            raise mapped from exc
        return _unavailable(what, exc)
    if isinstance(exc, TimeoutError):
        return _unavailable(what, exc, timed_out)
    if isinstance(exc, asyncio.CancelledError):
        if cancelled_from_outside():
            raise exc
        return _unavailable(what, exc, cancelled)
    return _unavailable(what, exc)


def _unavailable(what: str, cause: BaseException, description: str = "") -> Unavailable:
    error = Unavailable(f"{what}: {description or describe_error(cause)}")
    error.__cause__ = cause
    return error
