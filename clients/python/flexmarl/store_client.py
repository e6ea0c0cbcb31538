"""Asyncio client of stored (service flexmarl.v1.Store) and the types it returns.

Every FlexMARL component talks to stored through :class:`StoreClient`. Errors come
back as :mod:`flexmarl.errors` exceptions (NotFound, InvalidArgument, DataLoss, ...)
mapped from the gRPC status; statuses without a domain error (DEADLINE_EXCEEDED,
CANCELLED, INTERNAL, ...) are re-raised as ``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import grpc
import grpc.aio

from flexmarl import blob_wire, errors
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.retry import RetryPolicy, retry
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.v1 import common_pb2, store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)

BLOB_CHUNK_BYTES = 1 << 20
_APPEND_MAX_RECORDS = 4096
_READ_MAX_IDS = 16384
_MESSAGE_MARGIN_BYTES = 64 << 10
#: A download hands its received chunks to the writer thread this many bytes at a time.
_PART_BATCH_BYTES = 4 << 20
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
    #: The agent's unshaped episode return (None: stored before the field existed).
    episode_return: float | None = None


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


#: The details grpcio's asyncio client gives a call whose request write failed in Core.
_WRITE_FAILED_IN_CORE = "Internal error from Core"


def _completed(coroutine: Coroutine[object, None, _T]) -> _T | None:
    """The result of a coroutine that finishes without suspending; None (and closed) if it would wait."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coroutine.close()
    return None


async def await_client_stream(call: grpc.aio.StreamUnaryCall[object, _T]) -> _T:
    """The reply of a client-streaming call, or the domain error of the status the server ended it with.

    grpcio's asyncio client (seen on 1.85; grpc/grpc#36066, open) loses that status when the server
    ends the call while requests are still being written: a refused token, a bad header, a full
    store. The write that then fails sets the call's status to INTERNAL "Internal error from Core",
    before or after the server's status arrives, and the caller sees INTERNAL when it came last
    (1 to 6 calls in 100, of 64 small messages each, against a server that ends them early, on
    our 2-core machines). A done callback runs on every status the call is given, with the status already set:
    it keeps each one, and the server's own is reported in place of Core's write failure.
    """
    # the statuses other than Core's write failure, in the order the call was given them
    sent: list[tuple[grpc.StatusCode, str, grpc.aio.Metadata]] = []

    def keep(done: grpc.aio.Call) -> None:
        code, details = _completed(done.code()), _completed(done.details()) or ""
        if code is not None and (code, details) != (grpc.StatusCode.INTERNAL, _WRITE_FAILED_IN_CORE):
            sent.append((code, details, _completed(done.trailing_metadata()) or grpc.aio.Metadata()))

    call.add_done_callback(keep)
    try:
        reply: _T = await call
        return reply
    except grpc.aio.AioRpcError as exc:
        if sent and exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _WRITE_FAILED_IN_CORE:
            code, details, trailing = sent[-1]
            server_status = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details, exc.debug_error_string())
            raise _mapped(server_status) from exc
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
        episode_return=msg.episode_return if msg.HasField("episode_return") else None,
    )


def blob_info_from_proto(msg: store_pb2.BlobInfo) -> BlobInfo:
    """Decodes a blob description."""
    return BlobInfo(name=msg.name, sha256=msg.sha256, size_bytes=msg.size_bytes, created_unix_ms=msg.created_unix_ms)


def _read_encoded(f: BinaryIO, hasher: hashlib._Hash) -> bytes:
    """The file's next chunk as a PutBlobRequest message, fed to hasher on the way; b"" at the end."""
    chunk = f.read(BLOB_CHUNK_BYTES)
    if not chunk:
        return b""
    hasher.update(chunk)
    return blob_wire.encode_put_chunk(chunk)


class _PartFile:
    """A download's ``.part`` file, hashed as it grows: no second pass over the file at the end.

    Appends are gathered into batches of ``_PART_BATCH_BYTES`` written in a worker thread, one
    batch at a time and in order, beside the receipt of the next chunks (hashlib and file writes
    release the GIL); ``size`` counts the bytes handed to :meth:`append`, ``written`` waits until
    they are on the file.
    """

    def __init__(self, path: Path, size_limit: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = path.open("ab")
        self._hash = hashlib.sha256()
        if self._file.tell() > size_limit:
            self._file.truncate(0)
            self._file.seek(0)
        with path.open("rb") as existing:  # a resumed download: the bytes already there
            while chunk := existing.read(BLOB_CHUNK_BYTES):
                self._hash.update(chunk)
        self.size = self._file.tell()
        self._batch: list[bytes | memoryview] = []
        self._batch_bytes = 0
        self._pending: asyncio.Future[None] | None = None

    def _write(self, chunks: list[bytes | memoryview]) -> None:
        for chunk in chunks:
            self._file.write(chunk)
            self._hash.update(chunk)

    async def append(self, chunk: bytes | memoryview) -> None:
        """Adds chunk to the file (written with its batch, after the previous batch)."""
        self._batch.append(chunk)
        self._batch_bytes += len(chunk)
        self.size += len(chunk)
        if self._batch_bytes >= _PART_BATCH_BYTES:
            await self._flush_batch()

    async def _flush_batch(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending
        if self._batch:
            batch, self._batch, self._batch_bytes = self._batch, [], 0
            self._pending = asyncio.ensure_future(asyncio.to_thread(self._write, batch))

    async def written(self) -> None:
        """Writes what is gathered and waits for it; raises what a write raised."""
        await self._flush_batch()
        pending, self._pending = self._pending, None
        if pending is not None:
            await pending

    def hexdigest(self) -> str:
        """The sha256 of the whole file (after :meth:`written`)."""
        return self._hash.hexdigest()

    async def close(self) -> None:
        """Waits for the write in flight (its error is the caller's only if it awaited it), then closes.

        Chunks gathered but not yet written are dropped: the caller that wants them calls :meth:`written`.
        """
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                await asyncio.wait([pending])  # the file must not close under a running write
                if not pending.cancelled():
                    pending.exception()
        finally:
            self._file.close()


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
        # PutBlob and GetBlob through flexmarl.blob_wire codecs: the same wire format, with chunks
        # encoded in a worker thread and decoded as views of the received message, so the event
        # loop makes no copy of them beyond gRPC's own.
        self._put_blob: grpc.aio.StreamUnaryMultiCallable[store_pb2.PutBlobRequest | bytes, store_pb2.BlobInfo] = (
            self._channel.stream_unary(
                "/flexmarl.v1.Store/PutBlob", request_serializer=blob_wire.encode_put_request,
                response_deserializer=store_pb2.BlobInfo.FromString,
            )
        )
        self._get_blob: grpc.aio.UnaryStreamMultiCallable[store_pb2.GetBlobRequest, blob_wire.BlobChunk] = (
            self._channel.unary_stream(
                "/flexmarl.v1.Store/GetBlob", request_serializer=store_pb2.GetBlobRequest.SerializeToString,
                response_deserializer=blob_wire.decode_get_response,
            )
        )

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
        """Streams the header, then chunks (each already encoded by blob_wire.encode_put_chunk)."""
        async def requests() -> AsyncIterator[store_pb2.PutBlobRequest | bytes]:
            yield store_pb2.PutBlobRequest(header=header)
            async for chunk in chunks():
                yield chunk

        return blob_info_from_proto(await await_client_stream(self._put_blob(requests())))

    async def put_blob_bytes(self, name: str, data: bytes, *, job_id: str = "") -> BlobInfo:
        """Stores data under name (replacing what the name pointed to)."""
        sha256 = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        header = store_pb2.PutBlobHeader(name=name, size_bytes=len(data), sha256=sha256, job_id=job_id)
        view = memoryview(data)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(data), BLOB_CHUNK_BYTES):
                yield blob_wire.encode_put_chunk(view[start : start + BLOB_CHUNK_BYTES])

        return await self._put(header, chunks)

    async def put_blob_file(self, name: str, path: Path, *, job_id: str = "") -> BlobInfo:
        """Streams a file into stored under name; stored checks the sha256 computed here.

        The file is hashed as it is read for sending, in one pass, and the hash closes the stream
        (a closing header, see ``StoreServicer.PutBlob``): no pass over the file before the first
        byte leaves. Stored acknowledges only content that matches it.
        """
        path = Path(path)
        size = path.stat().st_size
        header = store_pb2.PutBlobHeader(name=name, size_bytes=size, job_id=job_id)
        hasher = hashlib.sha256()

        async def chunks() -> AsyncIterator[bytes]:
            with path.open("rb") as f:
                # Read, hashed and encoded in a worker thread, one chunk at a time and in order: the
                # event loop keeps feeding gRPC meanwhile.
                next_chunk = asyncio.ensure_future(asyncio.to_thread(_read_encoded, f, hasher))
                try:
                    while chunk := await next_chunk:
                        next_chunk = asyncio.ensure_future(asyncio.to_thread(_read_encoded, f, hasher))
                        yield chunk
                finally:
                    if not next_chunk.done():
                        await asyncio.wait([next_chunk])  # the file must not close under a running read
            closing = store_pb2.PutBlobHeader(name=name, size_bytes=size, sha256=hasher.hexdigest(), job_id=job_id)
            yield store_pb2.PutBlobRequest(header=closing).SerializeToString()

        return await self._put(header, chunks)

    async def get_blob_bytes(self, name: str) -> bytes:
        """Reads a whole blob ("name" or "sha256:<hex>") and verifies its sha256."""
        parts: list[bytes | memoryview] = []
        info: BlobInfo | None = None
        try:
            async for reply in self._get_blob(store_pb2.GetBlobRequest(name=name)):
                if reply.info is not None:
                    info = blob_info_from_proto(reply.info)
                parts.append(reply.data)
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
            if await self._download(info, part) == info.sha256:
                os.replace(part, path)
                return info
            part.unlink()
            if attempt == 0 and resumed:
                log.warning("blob %r: partial file %s was stale; downloading from the start", name, part)
                continue
            break
        raise errors.DataLoss(f"blob {name!r}: downloaded content does not match sha256 {info.sha256}")

    async def _download(self, info: BlobInfo, part: Path) -> str:
        """Appends the blob's missing bytes to ``part``; returns the sha256 of the whole file.

        A broken stream resumes at once from where it broke.
        """
        f = await asyncio.to_thread(_PartFile, part, info.size_bytes)
        try:

            async def fetch_rest() -> None:
                while f.size < info.size_bytes:
                    request = store_pb2.GetBlobRequest(name=f"sha256:{info.sha256}", offset=f.size)
                    async for reply in self._get_blob(request):
                        if reply.offset != f.size:
                            raise errors.DataLoss(
                                f"blob {info.name!r}: chunk at byte {reply.offset}, expected {f.size}"
                            )
                        await f.append(reply.data)

            def log_resume(exc: BaseException, attempt: int, delay_s: float) -> None:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
                log.warning("blob %r: stream broke at byte %d (%s); resuming", info.name, f.size, code)

            try:
                await retry(fetch_rest, retryable=_resumable, policy=_GET_RESUME, on_retry=log_resume)
            except grpc.aio.AioRpcError as exc:
                raise _mapped(exc) from exc
            await f.written()
            return f.hexdigest()
        finally:
            await f.close()

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
