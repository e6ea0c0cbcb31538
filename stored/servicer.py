"""gRPC adapter of flexmarl.v1.Store: decode, call the stores in worker threads, encode.

Domain errors (flexmarl.errors) propagate to the server's error-mapping interceptor,
which turns them into status codes. Every SQLite or file operation runs in the
daemon's I/O executor, never on the event loop.

Blob streams keep one chunk of file work in flight beside the network: PutBlob
receives the next message while the previous chunk is written and hashed, and GetBlob
reads and verifies the next segment while the current one is sent. Order is kept (one
operation at a time per stream) and memory stays bounded by two chunks. Their chunk
messages go through :mod:`flexmarl.blob_wire` (same wire format, without protobuf's
copies of the bytes under the GIL): see :func:`add_to_server`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
import grpc.aio

from flexmarl import blob_wire
from flexmarl.errors import InvalidArgument, Unavailable
from flexmarl.v1 import store_pb2, store_pb2_grpc
from stored import serde
from stored.blobs import BlobReader, BlobStore, BlobUpload
from stored.experiences import ExperienceStore
from stored.metrics import StoredMetrics

_T = TypeVar("_T")
log = logging.getLogger(__name__)
SERVICE_NAME = "flexmarl.v1.Store"


class _HandlerTable:
    """Stands for a server to the generated add function: keeps the method handlers it registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """The generated function registers the same table here too; one copy is kept."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """Keeps the table."""
        self.handlers.update(handlers)


def add_to_server(servicer: StoreServicer, server: grpc.aio.Server) -> None:
    """Registers the Store service as the generated function does, blob chunks with flexmarl.blob_wire codecs."""
    table = _HandlerTable()
    store_pb2_grpc.add_StoreServicer_to_server(servicer, table)
    handlers = dict(table.handlers)
    handlers["PutBlob"] = grpc.stream_unary_rpc_method_handler(
        servicer.PutBlob, request_deserializer=blob_wire.decode_put_request,
        response_serializer=store_pb2.BlobInfo.SerializeToString,
    )
    handlers["GetBlob"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetBlob, request_deserializer=store_pb2.GetBlobRequest.FromString,
        response_serializer=blob_wire.encode_get_response,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


#: GetBlob reads, verifies and encodes this much per hand-off to the I/O executor: fewer thread
#: switches per byte (each can wait a scheduler time slice on a busy machine); messages stay one
#: segment each.
_GET_BATCH_BYTES = 4 << 20


def _next_messages(reader: BlobReader, info: store_pb2.BlobInfo | None) -> tuple[list[bytes], int]:
    """The next verified chunks of reader (up to _GET_BATCH_BYTES) as GetBlobResponse wire bytes.

    Returns the messages (none at the end) and their payload bytes; info rides on the first.
    """
    messages: list[bytes] = []
    size = 0
    while size < _GET_BATCH_BYTES and (item := reader.next_chunk()) is not None:
        offset, chunk = item
        messages.append(blob_wire.encode_get_chunk(offset, chunk, info))
        info = None
        size += len(chunk)
    return messages, size


class StoreServicer(store_pb2_grpc.StoreServicer):
    """Serves every RPC of the Store service."""

    def __init__(self, metrics: StoredMetrics, executor: Executor) -> None:
        self._stores: tuple[ExperienceStore, BlobStore] | None = None
        self._metrics = metrics
        self._executor = executor

    def attach(self, experiences: ExperienceStore, blobs: BlobStore) -> None:
        """Starts serving from these stores (the daemon opens them after building the server)."""
        self._stores = (experiences, blobs)

    @property
    def _experiences(self) -> ExperienceStore:
        if self._stores is None:
            raise Unavailable("stored is starting")
        return self._stores[0]

    @property
    def _blobs(self) -> BlobStore:
        if self._stores is None:
            raise Unavailable("stored is starting")
        return self._stores[1]

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _start(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """Starts fn in the I/O executor without waiting for it."""
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # ---- experiences --------------------------------------------------------------

    async def AppendExperiences(  # noqa: N802 - gRPC method name
        self, request: store_pb2.AppendExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.AppendExperiencesResponse:
        """Appends a batch, durable before the reply."""
        records = serde.records_from_proto(request.experiences)
        start = time.perf_counter()
        result = await self._run(self._experiences.append, records)
        self._metrics.append_seconds.observe(time.perf_counter() - start)
        self._metrics.appended.inc(result.appended)
        self._metrics.duplicates.inc(result.duplicates)
        self._metrics.appended_bytes.inc(result.appended_bytes)
        return store_pb2.AppendExperiencesResponse(appended=result.appended, duplicates=result.duplicates)

    def _read_message(self, job_id: str, ids: list[str]) -> tuple[store_pb2.ReadExperiencesResponse, int]:
        records = self._experiences.read_batch(job_id, ids)
        payload = sum(r.prompt_token_ids.nbytes + r.response_token_ids.nbytes + r.response_logprobs.nbytes
                      for r in records)
        return serde.read_response(records), payload

    async def ReadExperiences(  # noqa: N802
        self, request: store_pb2.ReadExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.ReadExperiencesResponse]:
        """Streams the requested experiences in order, one bounded batch per message."""
        batches = await self._run(self._experiences.plan_read, request.job_id, list(request.experience_ids))
        for batch in batches:
            start = time.perf_counter()
            message, payload = await self._run(self._read_message, request.job_id, batch)
            self._metrics.read_seconds.observe(time.perf_counter() - start)
            self._metrics.read.inc(len(batch))
            self._metrics.read_bytes.inc(payload)
            yield message

    async def QueryExperiences(  # noqa: N802
        self, request: store_pb2.QueryExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.QueryExperiencesResponse:
        """Lists refs matching a filter."""
        refs = await self._run(self._experiences.query, serde.query_from_proto(request))
        return serde.query_response(refs)

    async def MarkExperiences(  # noqa: N802
        self, request: store_pb2.MarkExperiencesRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.MarkExperiencesResponse:
        """Moves experiences between states for a step, in one transaction."""
        state = serde.state_from_proto(request.state, required=True)
        if state is None:
            raise InvalidArgument("state is required")
        changed = await self._run(
            self._experiences.mark, request.job_id, request.agent, request.step_id,
            list(request.experience_ids), state,
        )
        return store_pb2.MarkExperiencesResponse(changed=changed)

    async def GetStats(  # noqa: N802
        self, request: store_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.GetStatsResponse:
        """Rows and bytes per partition and state, plus blob totals."""
        stats = await self._run(self._experiences.stats, request.job_id)
        count, total = await self._run(self._blobs.totals)
        return serde.stats_response(stats, count, total)

    async def CollectGarbage(  # noqa: N802
        self, request: store_pb2.CollectGarbageRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.CollectGarbageResponse:
        """Deletes consumed experiences of finished jobs older than the retention; no destructive default.

        The scope must be explicit (a job id, or ``all_jobs`` with an empty job id) and so must the
        retention; jobs orchestratord has not finished are never touched. Every call is logged with
        the peer that made it.
        """
        if not request.HasField("retention_s"):
            raise InvalidArgument("retention_s: required (seconds since consumption; 0 = every consumed experience)")
        if request.all_jobs == bool(request.job_id):
            raise InvalidArgument("scope: name one job_id, or set all_jobs with an empty job_id")
        log.info("CollectGarbage of %s, retention %.0f s, asked by %s",
                 "every finished job" if request.all_jobs else f"job {request.job_id!r}", request.retention_s,
                 context.peer())
        result = await self._run(self._experiences.collect_garbage, request.job_id, request.retention_s)
        self.record_gc(result.deleted_rows, result.deleted_bytes)
        return store_pb2.CollectGarbageResponse(deleted_rows=result.deleted_rows, deleted_bytes=result.deleted_bytes,
                                                skipped_running_jobs=list(result.skipped_running_jobs))

    async def FinishJob(  # noqa: N802
        self, request: store_pb2.FinishJobRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.FinishJobResponse:
        """Records that a job ended, so CollectGarbage may touch it."""
        newly = await self._run(self._experiences.finish_job, request.job_id, request.state)
        if newly:
            log.info("job %r finished (%s), reported by %s", request.job_id, request.state, context.peer())
        return store_pb2.FinishJobResponse(newly_finished=newly)

    def record_gc(self, rows: int, size: int) -> None:
        """Counts one garbage collection."""
        self._metrics.gc_runs.inc()
        self._metrics.gc_rows.inc(rows)
        self._metrics.gc_bytes.inc(size)

    # ---- blobs --------------------------------------------------------------------

    async def PutBlob(  # noqa: N802
        self,
        request_iterator: AsyncIterator[store_pb2.PutBlobRequest | memoryview],
        context: grpc.aio.ServicerContext,
    ) -> store_pb2.BlobInfo:
        """Receives a header then chunks; verifies and stores the content (durable before the reply).

        The expected sha256 rides on the opening header, or, when that has none, on a closing header
        after the last chunk that repeats the opening one's name, size and job with the hash set: a
        client that hashes while it streams (``StoreClient.put_blob_file``) then needs no pass over
        the file before the first byte leaves. Either way nothing is acknowledged unverified when a
        hash was given, and no chunk may follow a closing header.
        """
        upload: BlobUpload | None = None
        closed = False  # a closing header arrived: the stream must end here
        writing: asyncio.Future[None] | None = None  # the previous chunk's write, beside the next receive
        committed = False
        try:
            async for request in request_iterator:
                # A chunk arrives as a view of its message (blob_wire), anything else as a message.
                part: str | None = "chunk" if isinstance(request, memoryview) else request.WhichOneof("part")
                chunk: bytes | memoryview = request if isinstance(request, memoryview) else request.chunk
                if upload is None:
                    if part != "header" or isinstance(request, memoryview):
                        raise InvalidArgument("PutBlob: the first message must carry the header")
                    h = request.header
                    upload = await self._run(self._blobs.begin_upload, h.name, h.size_bytes, h.sha256, h.job_id)
                elif closed:
                    raise InvalidArgument("PutBlob: nothing may follow the closing header")
                elif isinstance(request, memoryview) or part == "chunk":
                    if writing is not None:
                        await writing
                    writing = self._start(upload.write, chunk)
                    self._metrics.blob_bytes_in.inc(len(chunk))
                elif part == "header":
                    h = request.header
                    upload.expect(h.name, h.size_bytes, h.sha256, h.job_id)
                    closed = True
                else:
                    raise InvalidArgument("PutBlob: a message with neither a header nor a chunk")
            if upload is None:
                raise InvalidArgument("PutBlob: empty stream (no header)")
            if writing is not None:
                await writing
            info = await self._run(upload.commit)
            committed = True
            return serde.blob_info_to_proto(info)
        finally:
            if writing is not None and not writing.done():
                await asyncio.wait([writing])  # the file must not close under a running write
            if writing is not None and writing.done() and not writing.cancelled():
                writing.exception()  # retrieved: the error that matters is already propagating
            if upload is not None and not committed:
                await self._run(upload.abort)

    async def GetBlob(  # type: ignore[override]  # noqa: N802 - chunks leave as blob_wire-encoded bytes
        self, request: store_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.GetBlobResponse | bytes]:
        """Streams a verified byte range; the first message carries the blob's info."""
        reader = await self._run(self._blobs.open_reader, request.name, request.offset, request.length)
        info = serde.blob_info_to_proto(reader.info)
        # The next segments are read, verified and encoded beside the send of the current ones.
        reading = self._start(_next_messages, reader, info)
        try:
            first = True
            while (batch := await reading)[0]:
                reading = self._start(_next_messages, reader, None)
                messages, size = batch
                self._metrics.blob_bytes_out.inc(size)
                first = False
                for message in messages:
                    yield message
            if first:
                yield store_pb2.GetBlobResponse(info=info, offset=request.offset)
        finally:
            if not reading.done():
                await asyncio.wait([reading])  # the file must not close under a running read
            if not reading.cancelled():
                reading.exception()  # retrieved: a client that went away never sees it
            reader.close()

    async def StatBlob(  # noqa: N802
        self, request: store_pb2.StatBlobRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.BlobInfo:
        """Describes a named (or hash-addressed) blob."""
        return serde.blob_info_to_proto(await self._run(self._blobs.stat, request.name))

    async def ListBlobs(  # noqa: N802
        self, request: store_pb2.ListBlobsRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.ListBlobsResponse:
        """Lists named blobs by prefix."""
        infos = await self._run(self._blobs.list, request.prefix, request.limit)
        return store_pb2.ListBlobsResponse(blobs=[serde.blob_info_to_proto(i) for i in infos])

    async def DeleteBlob(  # noqa: N802
        self, request: store_pb2.DeleteBlobRequest, context: grpc.aio.ServicerContext
    ) -> store_pb2.DeleteBlobResponse:
        """Removes one exactly named blob (and its content when no name is left on it); logged."""
        deleted = await self._run(self._blobs.delete, request.name)
        log.info("DeleteBlob %r (content deleted: %s), asked by %s", request.name, deleted, context.peer())
        return store_pb2.DeleteBlobResponse(content_deleted=deleted)
