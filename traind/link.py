"""traind's link to orchestratord and stored: typed calls in, dataclasses out, transport kept here.

The worker (:mod:`traind.worker`) depends on the two small protocols below and on nothing of
gRPC: :class:`OrchestratorLink` (poll for work, ack, commit, report slot events, fetch a job's
spec) and :class:`StoreLink` (read a micro-batch's experiences; the stored client for weights and
states). :class:`GrpcOrchestratorLink` and :class:`GrpcStoreLink` are the real ones over
:class:`flexmarl.connections.PeerConnections`: they convert through :mod:`traind.serde`, bound
every call by a deadline, and drop a channel after a failed call so that the next one rediscovers
the peer (a restarted orchestratord or stored may come back at another address). A test drives
the worker with in-memory fakes of both protocols.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import grpc

from flexmarl.connections import PeerConnections, cancelled_from_outside, describe_error
from flexmarl.errors import Unavailable, error_for_rpc
from flexmarl.experience import ExperienceRecord
from flexmarl.retry import RetryPolicy, retry
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from flexmarl.weight_group import WeightGroupRecord
from traind import serde
from traind.work import ResidentAgent, SlotEvent, SlotEventKind, StepCommit, TrainerWork

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Bound on one poll, discovery in etcd included (the RPC itself has a 30 s deadline).
POLL_DEADLINE_S = 40.0
#: Bound on one lease renewal (a renewal every third of the lease's time: two may fail before it expires).
RENEW_TIMEOUT_S = 5.0
#: How long a read of experiences waits for stored to come back before it fails.
STORE_RETRY = RetryPolicy(initial_s=0.2, max_s=2.0, deadline_s=60.0)


class OrchestratorCallError(Exception):
    """A call to orchestratord failed (transport, deadline or refusal); the link has dropped its channel.

    Attributes:
        call: The RPC's name.
        error: The domain error of the call's status (reason included), None for a status without one.
    """

    def __init__(self, call: str, cause: BaseException | str) -> None:
        self.call = call
        self.error = error_for_rpc(cause) if isinstance(cause, grpc.RpcError) else None
        super().__init__(f"{call}: {cause if isinstance(cause, str) else describe_error(cause)}")


class OrchestratorLink(Protocol):
    """What a traind worker asks of orchestratord (and the only way it reaches it)."""

    async def poll_work(self, slot_id: str, resident: Sequence[ResidentAgent], wait_ms: int,
                        dp_address: str, *, capacity: float = 1.0) -> TrainerWork | None:
        """The slot's next work, None when there was none within ``wait_ms`` (``capacity``: the slot's, reported).

        Raises:
            OrchestratorCallError: The poll failed.
            flexmarl.errors.FlexmarlError: orchestratord could not be discovered.
        """

    async def ack_micro_batch(self, slot_id: str, lease_id: str, episodes: int) -> None:
        """Acks a micro-batch whose gradient is accumulated (raises OrchestratorCallError)."""

    async def renew_leases(self, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> frozenset[str]:
        """Renews the leases of work in progress with its progress figures; returns the lost ones.

        Raises OrchestratorCallError.
        """

    async def commit_step(self, commit: StepCommit) -> None:
        """Commits an optimizer step (raises OrchestratorCallError)."""

    async def announce_weights(self, slot_id: str, job_id: str, agent: str, version: int,
                               record: WeightGroupRecord) -> tuple[str, ...]:
        """Announces the version rank 0 is about to broadcast over ``record``; the group's peers.

        The peers are the rolloutd workers orchestratord counts on to answer (raises OrchestratorCallError).
        """

    async def report_slot_event(self, event: SlotEvent) -> None:
        """Reports a swap-out or a failure of a slot (raises OrchestratorCallError)."""

    async def job_spec(self, job_id: str) -> str:
        """A job's spec JSON (raises OrchestratorCallError)."""


class StoreLink(Protocol):
    """What a traind worker asks of stored."""

    async def read_experiences(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """A micro-batch's experiences, waiting a while for a restarting stored."""

    async def client(self) -> StoreClient:
        """The stored client (connecting on first use) for weights and state blobs."""

    def client_if_open(self) -> StoreClient | None:
        """The stored client when one is open (for code that runs off the event loop)."""


class GrpcOrchestratorLink:
    """:class:`OrchestratorLink` over gRPC, for the worker ``worker_id``."""

    def __init__(self, peers: PeerConnections, worker_id: str) -> None:
        self._peers = peers
        self._worker_id = worker_id

    async def _call(self, name: str, call: Callable[[orchestrator_pb2_grpc.OrchestratorStub], Awaitable[T]]) -> T:
        """``call(stub)``; a failed call drops the channel and raises :class:`OrchestratorCallError`.

        A ``CancelledError`` that is not this task's own cancellation is a call cancelled under it
        (grpc.aio raises it when the channel closes): a failed call, not a reason to end a loop.
        Discovery errors (:class:`~flexmarl.errors.FlexmarlError`) propagate as they are.
        """
        try:
            return await call(await self._peers.orchestrator())
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            await self._peers.reset_orchestrator()
            raise OrchestratorCallError(name, "cancelled (its channel closed)") from None
        except (grpc.RpcError, TimeoutError) as exc:
            await self._peers.reset_orchestrator()
            raise OrchestratorCallError(name, exc) from exc

    async def poll_work(self, slot_id: str, resident: Sequence[ResidentAgent], wait_ms: int,
                        dp_address: str, *, capacity: float = 1.0) -> TrainerWork | None:
        """PollTrainerWork, discovery included within :data:`POLL_DEADLINE_S`."""
        request = serde.poll_request(self._worker_id, slot_id, resident, wait_ms, dp_address, capacity)

        async def poll(stub: orchestrator_pb2_grpc.OrchestratorStub) -> orchestrator_pb2.PollTrainerWorkResponse:
            reply: orchestrator_pb2.PollTrainerWorkResponse = await stub.PollTrainerWork(request, timeout=30)
            return reply

        async def bounded() -> orchestrator_pb2.PollTrainerWorkResponse:
            # Discovery included: nothing in one poll may wait longer than the poll itself.
            async with asyncio.timeout(POLL_DEADLINE_S):
                return await self._call("PollTrainerWork", poll)

        try:
            reply = await bounded()
        except TimeoutError as exc:
            await self._peers.reset_orchestrator()
            raise OrchestratorCallError("PollTrainerWork", exc) from exc
        return serde.trainer_work(reply)

    async def ack_micro_batch(self, slot_id: str, lease_id: str, episodes: int) -> None:
        """AckMicroBatch."""
        request = serde.ack_request(self._worker_id, slot_id, lease_id, episodes)
        await self._call("AckMicroBatch", lambda stub: stub.AckMicroBatch(request, timeout=30))

    async def renew_leases(self, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> frozenset[str]:
        """RenewLeases."""
        request = serde.renew_request(self._worker_id, lease_ids, progress)
        reply = await self._call("RenewLeases", lambda stub: stub.RenewLeases(request, timeout=RENEW_TIMEOUT_S))
        return frozenset(reply.lost_lease_ids)

    async def commit_step(self, commit: StepCommit) -> None:
        """CommitStep."""
        request = serde.commit_request(self._worker_id, commit)
        await self._call("CommitStep", lambda stub: stub.CommitStep(request, timeout=60))

    async def announce_weights(self, slot_id: str, job_id: str, agent: str, version: int,
                               record: WeightGroupRecord) -> tuple[str, ...]:
        """AnnounceWeights."""
        request = serde.announce_request(self._worker_id, slot_id, job_id, agent, version, record)
        response = await self._call("AnnounceWeights", lambda stub: stub.AnnounceWeights(request, timeout=30))
        return tuple(response.peers)

    async def report_slot_event(self, event: SlotEvent) -> None:
        """ReportSlotEvent (a failure report waits less: the slot is already giving up)."""
        request = serde.slot_event_request(self._worker_id, event)
        timeout_s = 10 if event.kind is SlotEventKind.FAILED else 30
        await self._call("ReportSlotEvent", lambda stub: stub.ReportSlotEvent(request, timeout=timeout_s))

    async def job_spec(self, job_id: str) -> str:
        """GetJob's spec JSON."""
        request = orchestrator_pb2.GetJobRequest(job_id=job_id)
        status = await self._call("GetJob", lambda stub: stub.GetJob(request, timeout=30))
        return str(status.spec_json)


class GrpcStoreLink:
    """:class:`StoreLink` over :class:`flexmarl.store_client.StoreClient`."""

    def __init__(self, peers: PeerConnections) -> None:
        self._peers = peers

    async def read_experiences(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Reads from stored; after UNAVAILABLE (stored restarting, maybe elsewhere) rediscovers and retries."""

        async def read() -> list[ExperienceRecord]:
            return await (await self._peers.store()).read(job_id, ids)

        async def rediscover(exc: BaseException, attempt: int, delay_s: float) -> None:
            log.info("reading experiences of %s failed (%s); retrying in %.1fs", job_id, describe_error(exc), delay_s)
            await self._peers.reset_store()

        return await retry(read, retryable=lambda exc: isinstance(exc, Unavailable), policy=STORE_RETRY,
                           on_retry=rediscover)

    async def client(self) -> StoreClient:
        """The stored client (connecting on first use)."""
        return await self._peers.store()

    def client_if_open(self) -> StoreClient | None:
        """The stored client when one is open."""
        return self._peers.store_if_open()
