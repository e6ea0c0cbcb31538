"""gRPC adapter of flexmarl.v1.Store: decode, call the stores in worker threads, encode.

Domain errors (flexmarl.errors) propagate to the server's error-mapping interceptor,
which turns them into status codes. Every SQLite or file operation runs in the
daemon's I/O executor, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc.aio

from flexmarl.errors import InvalidArgument, Unavailable
from flexmarl.v1 import store_pb2, store_pb2_grpc
from stored import serde
from stored.blobs import BlobStore, BlobUpload
from stored.experiences import ExperienceStore
from stored.metrics import StoredMetrics

_T = TypeVar("_T")
log = logging.getLogger(__name__)


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
        self, request_iterator: AsyncIterator[store_pb2.PutBlobRequest], context: grpc.aio.ServicerContext
    ) -> store_pb2.BlobInfo:
        """Receives a header then chunks; verifies and stores the content."""
        upload: BlobUpload | None = None
        committed = False
        try:
            async for request in request_iterator:
                part = request.WhichOneof("part")
                if upload is None:
                    if part != "header":
                        raise InvalidArgument("PutBlob: the first message must carry the header")
                    h = request.header
                    upload = await self._run(self._blobs.begin_upload, h.name, h.size_bytes, h.sha256, h.job_id)
                elif part == "chunk":
                    await self._run(upload.write, request.chunk)
                    self._metrics.blob_bytes_in.inc(len(request.chunk))
                else:
                    raise InvalidArgument("PutBlob: only the first message may carry a header")
            if upload is None:
                raise InvalidArgument("PutBlob: empty stream (no header)")
            info = await self._run(upload.commit)
            committed = True
            return serde.blob_info_to_proto(info)
        finally:
            if upload is not None and not committed:
                await self._run(upload.abort)

    async def GetBlob(  # noqa: N802
        self, request: store_pb2.GetBlobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[store_pb2.GetBlobResponse]:
        """Streams a verified byte range; the first message carries the blob's info."""
        reader = await self._run(self._blobs.open_reader, request.name, request.offset, request.length)
        try:
            info = serde.blob_info_to_proto(reader.info)
            first = True
            while (item := await self._run(reader.next_chunk)) is not None:
                offset, chunk = item
                self._metrics.blob_bytes_out.inc(len(chunk))
                message = store_pb2.GetBlobResponse(offset=offset, chunk=chunk)
                if first:
                    message.info.CopyFrom(info)
                    first = False
                yield message
            if first:
                yield store_pb2.GetBlobResponse(info=info, offset=request.offset)
        finally:
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
