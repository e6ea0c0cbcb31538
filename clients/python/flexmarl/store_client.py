"""Asyncio client of stored (service flexmarl.v1.Store) and the types it returns.

Every FlexMARL component talks to stored through :class:`StoreClient`. Errors come
back as :mod:`flexmarl.errors` exceptions (NotFound, InvalidArgument, DataLoss, ...)
mapped from the gRPC status; statuses without a domain error (DEADLINE_EXCEEDED,
CANCELLED, INTERNAL, ...) are re-raised as ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio

from flexmarl import errors
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.retry import RetryPolicy, retry
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.v1 import common_pb2, store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)

BLOB_CHUNK_BYTES = 1 << 20
_APPEND_MAX_RECORDS = 4096
_READ_MAX_IDS = 16384
_MESSAGE_MARGIN_BYTES = 64 << 10
#: A broken GetBlob stream resumes at once from the byte it broke at, five streams in all.
_GET_RESUME = RetryPolicy(initial_s=0.0, max_s=0.0, attempts=5)

_T = TypeVar("_T")
_RESUMABLE_CODES = (
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)

@dataclass(frozen=True)
class ExperienceRef:
    """An experience's ids and group metadata, without its arrays (a query result)."""

    experience_id: str
    group_id: str
    task_id: str
    sample_index: int
    behavior_version: int
    response_tokens: int
    prompt_tokens: int
    reward: float
    state: ExperienceState
    step_id: str = ""


@dataclass(frozen=True)
class BlobInfo:
    """A named blob: its content hash (lower-case hex sha256) and size."""

    name: str
    sha256: str
    size_bytes: int
    created_unix_ms: int


@dataclass(frozen=True)
class ExperienceStats:
    """Rows and payload bytes of one (job, agent, state)."""

    job_id: str
    agent: str
    state: ExperienceState
    rows: int
    bytes: int


@dataclass(frozen=True)
class StoreStats:
    """What stored holds: experiences per (job, agent, state) and blob totals."""

    experiences: list[ExperienceStats]
    blob_count: int
    blob_bytes: int


def _resumable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _RESUMABLE_CODES


def _mapped(exc: grpc.aio.AioRpcError) -> BaseException:
    return errors.error_for_rpc(exc) or exc


async def _call(awaitable: Awaitable[_T]) -> _T:
    try:
        return await awaitable
    except grpc.aio.AioRpcError as exc:
        raise _mapped(exc) from exc


def ref_from_proto(msg: store_pb2.ExperienceRef) -> ExperienceRef:
    """Decodes a query result."""
    return ExperienceRef(
        experience_id=msg.experience_id,
        group_id=msg.group_id,
        task_id=msg.task_id,
        sample_index=msg.sample_index,
        behavior_version=msg.behavior_version,
        response_tokens=msg.response_tokens,
        prompt_tokens=msg.prompt_tokens,
        reward=msg.reward,
        state=ExperienceState(msg.state),
        step_id=msg.step_id,
    )


def blob_info_from_proto(msg: store_pb2.BlobInfo) -> BlobInfo:
    """Decodes a blob description."""
    return BlobInfo(name=msg.name, sha256=msg.sha256, size_bytes=msg.size_bytes, created_unix_ms=msg.created_unix_ms)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(BLOB_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


class StoreClient:
    """Asyncio client of one stored daemon."""

    def __init__(
        self, address: str, *, max_message_bytes: int = 64 << 20, security: TransportSecurity | None = None
    ) -> None:
        self.address = address
        self._max_message_bytes = max_message_bytes
        self._channel = open_channel(
            address,
            security,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self._stub = store_pb2_grpc.StoreStub(self._channel)

    async def close(self, grace_s: float | None = None) -> None:
        """Closes the channel; with ``grace_s``, calls in flight get that long to finish first."""
        await self._channel.close(grace_s)

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- experiences --------------------------------------------------------------

    def _append_requests(self, records: Sequence[ExperienceRecord]) -> list[store_pb2.AppendExperiencesRequest]:
        budget = self._max_message_bytes - _MESSAGE_MARGIN_BYTES
        requests: list[store_pb2.AppendExperiencesRequest] = []
        batch: list[common_pb2.Experience] = []
        batch_bytes = 0
        for record in records:
            msg = record.to_proto()
            size = msg.ByteSize() + 8
            if batch and (batch_bytes + size > budget or len(batch) >= _APPEND_MAX_RECORDS):
                requests.append(store_pb2.AppendExperiencesRequest(experiences=batch))
                batch, batch_bytes = [], 0
            batch.append(msg)
            batch_bytes += size
        if batch:
            requests.append(store_pb2.AppendExperiencesRequest(experiences=batch))
        return requests

    async def append(self, records: Sequence[ExperienceRecord]) -> tuple[int, int]:
        """Appends records, durable on return; returns (appended, duplicates).

        Splits into requests under the message limit; each request is atomic and
        idempotent, so retrying the whole call after an error is safe.
        """
        appended = duplicates = 0
        for request in self._append_requests(records):
            reply = await _call(self._stub.AppendExperiences(request))
            appended += reply.appended
            duplicates += reply.duplicates
        return appended, duplicates

    async def read(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Reads experiences in the order of ids (each verified by stored)."""
        out: list[ExperienceRecord] = []
        for start in range(0, len(ids), _READ_MAX_IDS):
            request = store_pb2.ReadExperiencesRequest(job_id=job_id, experience_ids=ids[start : start + _READ_MAX_IDS])
            try:
                async for reply in self._stub.ReadExperiences(request):
                    out.extend(ExperienceRecord.from_proto(msg) for msg in reply.experiences)
            except grpc.aio.AioRpcError as exc:
                raise _mapped(exc) from exc
        return out

    async def query(
        self,
        job_id: str,
        agent: str,
        *,
        state: ExperienceState | None = None,
        min_version: int = 0,
        max_version: int = -1,
        complete_groups_only: bool = False,
        step_id: str = "",
        limit: int = 0,
        group_id: str = "",
    ) -> list[ExperienceRef]:
        """Lists refs of one (job, agent) in arrival order; see QueryExperiences."""
        request = store_pb2.QueryExperiencesRequest(
            job_id=job_id,
            agent=agent,
            state=common_pb2.ExperienceState.ValueType(int(state) if state is not None else 0),
            min_behavior_version=min_version,
            max_behavior_version=max_version,
            complete_groups_only=complete_groups_only,
            step_id=step_id,
            limit=limit,
            group_id=group_id,
        )
        reply = await _call(self._stub.QueryExperiences(request))
        return [ref_from_proto(msg) for msg in reply.experiences]

    async def mark(self, job_id: str, agent: str, step_id: str, ids: Sequence[str], state: ExperienceState) -> int:
        """Moves experiences to state for step_id in one transaction; returns how many changed."""
        request = store_pb2.MarkExperiencesRequest(
            job_id=job_id, agent=agent, step_id=step_id, experience_ids=ids,
            state=common_pb2.ExperienceState.ValueType(int(state)),
        )
        reply = await _call(self._stub.MarkExperiences(request))
        return int(reply.changed)

    async def stats(self, job_id: str = "") -> StoreStats:
        """Rows and bytes per (job, agent, state) plus blob totals."""
        reply = await _call(self._stub.GetStats(store_pb2.GetStatsRequest(job_id=job_id)))
        return StoreStats(
            experiences=[
                ExperienceStats(
                    job_id=s.job_id, agent=s.agent, state=ExperienceState(s.state), rows=s.rows, bytes=s.bytes
                )
                for s in reply.experiences
            ],
            blob_count=reply.blob_count,
            blob_bytes=reply.blob_bytes,
        )

    async def collect_garbage(self, job_id: str, retention_s: float) -> tuple[int, int]:
        """Deletes the finished job's experiences consumed >= retention_s ago; returns (rows, bytes).

        ``job_id="*"`` means every finished job (the RPC's explicit ``all_jobs``); a job that has not
        finished (:meth:`finish_job`) is refused (FailedPrecondition) or, with "*", skipped.
        """
        request = (store_pb2.CollectGarbageRequest(all_jobs=True, retention_s=retention_s) if job_id == "*"
                   else store_pb2.CollectGarbageRequest(job_id=job_id, retention_s=retention_s))
        reply = await _call(self._stub.CollectGarbage(request))
        return int(reply.deleted_rows), int(reply.deleted_bytes)

    async def finish_job(self, job_id: str, state: str) -> bool:
        """Records that a job ended (orchestratord's call); False when it already was."""
        reply = await _call(self._stub.FinishJob(store_pb2.FinishJobRequest(job_id=job_id, state=state)))
        return bool(reply.newly_finished)

    # ---- blobs --------------------------------------------------------------------

    async def _put(
        self, header: store_pb2.PutBlobHeader, chunks: Callable[[], AsyncIterator[bytes]]
    ) -> BlobInfo:
        async def requests() -> AsyncIterator[store_pb2.PutBlobRequest]:
            yield store_pb2.PutBlobRequest(header=header)
            async for chunk in chunks():
                yield store_pb2.PutBlobRequest(chunk=chunk)

        return blob_info_from_proto(await _call(self._stub.PutBlob(requests())))

    async def put_blob_bytes(self, name: str, data: bytes, *, job_id: str = "") -> BlobInfo:
        """Stores data under name (replacing what the name pointed to)."""
        header = store_pb2.PutBlobHeader(
            name=name, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), job_id=job_id
        )
        view = memoryview(data)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(data), BLOB_CHUNK_BYTES):
                yield bytes(view[start : start + BLOB_CHUNK_BYTES])

        return await self._put(header, chunks)

    async def put_blob_file(self, name: str, path: Path, *, job_id: str = "") -> BlobInfo:
        """Streams a file into stored under name; stored checks the sha256 computed here."""
        path = Path(path)
        size = path.stat().st_size
        header = store_pb2.PutBlobHeader(name=name, size_bytes=size, sha256=_file_sha256(path), job_id=job_id)

        async def chunks() -> AsyncIterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(BLOB_CHUNK_BYTES):
                    yield chunk

        return await self._put(header, chunks)

    async def get_blob_bytes(self, name: str) -> bytes:
        """Reads a whole blob ("name" or "sha256:<hex>") and verifies its sha256."""
        parts: list[bytes] = []
        info: BlobInfo | None = None
        try:
            async for reply in self._stub.GetBlob(store_pb2.GetBlobRequest(name=name)):
                if reply.HasField("info"):
                    info = blob_info_from_proto(reply.info)
                parts.append(reply.chunk)
        except grpc.aio.AioRpcError as exc:
            raise _mapped(exc) from exc
        data = b"".join(parts)
        if info is None:
            raise errors.DataLoss(f"blob {name!r}: stream carried no header")
        if len(data) != info.size_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
            raise errors.DataLoss(f"blob {name!r}: received content does not match sha256 {info.sha256}")
        return data

    async def get_blob_file(self, name: str, path: Path) -> BlobInfo:
        """Downloads a blob to path, resuming after a broken stream; verifies the sha256.

        Bytes land in ``<path>.part`` first (a partial file left by an earlier call is
        resumed) and the file is renamed to path once its sha256 matches. The content is
        pinned by hash after the first lookup, so a name re-pointed mid-download cannot
        mix two contents.

        Raises:
            NotFound: no blob has this name.
            DataLoss: the downloaded content does not match the blob's sha256.
        """
        path = Path(path)
        part = path.with_name(path.name + ".part")
        info = await self.stat_blob(name)
        if info is None:
            raise errors.NotFound(f"blob {name!r} not found")
        resumed = part.exists() and part.stat().st_size > 0
        for attempt in range(2):
            await self._download(info, part)
            if _file_sha256(part) == info.sha256:
                os.replace(part, path)
                return info
            part.unlink()
            if attempt == 0 and resumed:
                log.warning("blob %r: partial file %s was stale; downloading from the start", name, part)
                continue
            break
        raise errors.DataLoss(f"blob {name!r}: downloaded content does not match sha256 {info.sha256}")

    async def _download(self, info: BlobInfo, part: Path) -> None:
        """Appends the blob's missing bytes to ``part``; a broken stream resumes at once from where it broke."""
        part.parent.mkdir(parents=True, exist_ok=True)
        with part.open("ab") as f:
            if f.tell() > info.size_bytes:
                f.truncate(0)
                f.seek(0)

            async def fetch_rest() -> None:
                while f.tell() < info.size_bytes:
                    request = store_pb2.GetBlobRequest(name=f"sha256:{info.sha256}", offset=f.tell())
                    try:
                        async for reply in self._stub.GetBlob(request):
                            if reply.offset != f.tell():
                                raise errors.DataLoss(
                                    f"blob {info.name!r}: chunk at byte {reply.offset}, expected {f.tell()}"
                                )
                            f.write(reply.chunk)
                    finally:
                        f.flush()

            def log_resume(exc: BaseException, attempt: int, delay_s: float) -> None:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                log.warning("blob %r: stream broke at byte %d (%s); resuming", info.name, f.tell(), code)

            try:
                await retry(fetch_rest, retryable=_resumable, policy=_GET_RESUME, on_retry=log_resume)
            except grpc.aio.AioRpcError as exc:
                raise _mapped(exc) from exc

    async def stat_blob(self, name: str) -> BlobInfo | None:
        """The blob a name (or "sha256:<hex>") refers to, or None when there is none."""
        try:
            reply = await _call(self._stub.StatBlob(store_pb2.StatBlobRequest(name=name)))
        except errors.NotFound:
            return None
        return blob_info_from_proto(reply)

    async def list_blobs(self, prefix: str = "", *, limit: int = 0) -> list[BlobInfo]:
        """Named blobs whose name starts with prefix, in name order."""
        reply = await _call(self._stub.ListBlobs(store_pb2.ListBlobsRequest(prefix=prefix, limit=limit)))
        return [blob_info_from_proto(b) for b in reply.blobs]

    async def delete_blob(self, name: str) -> bool:
        """Removes a name; True when its content went too (no other name referenced it).

        Raises:
            NotFound: no blob has this name.
        """
        reply = await _call(self._stub.DeleteBlob(store_pb2.DeleteBlobRequest(name=name)))
        return bool(reply.content_deleted)


__all__ = ["BlobInfo", "ExperienceRef", "ExperienceStats", "StoreClient", "StoreStats"]
