"""Integration tests of stored through gRPC (in-process server on port 0, no etcd)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flexmarl import errors
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.server import GrpcServer
from flexmarl.store_client import StoreClient
from flexmarl.v1 import common_pb2, store_pb2, store_pb2_grpc
from stored.app import StoredApp
from stored.config import StoredConfig

RecordFactory = Callable[..., ExperienceRecord]
READY, LEASED, CONSUMED = ExperienceState.READY, ExperienceState.LEASED, ExperienceState.CONSUMED


@dataclasses.dataclass
class Served:
    address: str
    app: StoredApp
    registry: CollectorRegistry
    client: StoreClient


async def serve(tmp_path: Path, **overrides: Any) -> tuple[GrpcServer, Served]:
    config = StoredConfig(data_dir=str(tmp_path / "data"), gc_interval_s=0, **overrides)
    config.validate()
    registry = CollectorRegistry()
    app = StoredApp(config, registry)
    server = GrpcServer(app.service_names, config.max_message_bytes)
    app.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await app.start()
    await server.server.start()
    address = f"127.0.0.1:{port}"
    return server, Served(address, app, registry, StoreClient(address))


@pytest.fixture
async def stored(tmp_path: Path) -> AsyncIterator[Served]:
    server, served = await serve(tmp_path, read_batch_bytes=4096, job_quota_overrides="tiny=2000")
    try:
        yield served
    finally:
        await served.client.close()
        await server.server.stop(0)
        await served.app.stop()


def group(make: RecordFactory, task: str, size: int = 4, **kw: Any) -> list[ExperienceRecord]:
    return [make(task, s, group_size=size, **kw) for s in range(size)]


def same(a: ExperienceRecord, b: ExperienceRecord) -> bool:
    return dataclasses.replace(a, state=READY, step_id="", created_unix_ms=0).to_proto() == dataclasses.replace(
        b, state=READY, step_id="", created_unix_ms=0
    ).to_proto()


async def test_experience_lifecycle(stored: Served, record_factory: RecordFactory) -> None:
    client = stored.client
    records = group(record_factory, "t0") + group(record_factory, "t1")[:3] + group(record_factory, "t2", agent="bob")
    assert await client.append(records) == (11, 0)
    assert await client.append(records[:2]) == (0, 2)
    got = await client.read("job1", [r.experience_id for r in records[::-1]])
    assert all(same(g, r) for g, r in zip(got, records[::-1], strict=True))
    refs = await client.query("job1", "alice", state=READY, complete_groups_only=True)
    assert [r.task_id for r in refs] == ["t0"] * 4
    ids = [r.experience_id for r in refs]
    assert await client.mark("job1", "alice", "step-0", ids, LEASED) == 4
    assert [r.state for r in await client.query("job1", "alice", step_id="step-0")] == [LEASED] * 4
    assert await client.mark("job1", "alice", "step-0", ids, CONSUMED) == 4
    stats = await client.stats("job1")
    by_key = {(s.agent, s.state): s.rows for s in stats.experiences}
    assert by_key == {("alice", READY): 3, ("alice", CONSUMED): 4, ("bob", READY): 4}
    with pytest.raises(errors.FailedPrecondition, match="has not finished"):
        await client.collect_garbage("job1", 0)  # a running job is never garbage-collected on request
    assert await client.finish_job("job1", "SUCCEEDED") is True
    assert await client.finish_job("job1", "SUCCEEDED") is False
    assert await client.collect_garbage("job1", 0) == (4, 4 * (8 * 4 + 16 * 8))
    with pytest.raises(errors.NotFound):
        await client.read("job1", ids)


async def test_read_streams_bounded_messages(stored: Served, record_factory: RecordFactory) -> None:
    records = [record_factory(f"t{i}", 0, group_size=1, response_tokens=200) for i in range(20)]  # 1632 B each
    await stored.client.append(records)
    async with grpc.aio.insecure_channel(stored.address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        request = store_pb2.ReadExperiencesRequest(job_id="job1", experience_ids=[r.experience_id for r in records])
        sizes = [len(m.experiences) async for m in stub.ReadExperiences(request)]
    assert sizes == [2] * 10


async def test_client_splits_appends_under_the_message_limit(
    stored: Served, record_factory: RecordFactory
) -> None:
    client = StoreClient(stored.address, max_message_bytes=1 << 20)
    try:
        records = [record_factory(f"t{i}", 0, group_size=1, response_tokens=20_000) for i in range(20)]  # 160 kB each
        assert await client.append(records) == (20, 0)
        assert len(await client.read("job1", [r.experience_id for r in records])) == 20
    finally:
        await client.close()


async def expect_code(code: grpc.StatusCode, call: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()


async def test_bad_inputs_get_clear_statuses(stored: Served, record_factory: RecordFactory) -> None:
    code = grpc.StatusCode
    async with grpc.aio.insecure_channel(stored.address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        good = record_factory().to_proto()
        await stub.AppendExperiences(store_pb2.AppendExperiencesRequest(experiences=[good]))
        ragged = common_pb2.Experience()
        ragged.CopyFrom(good)
        ragged.response_logprobs = ragged.response_logprobs[:-4]
        await expect_code(code.INVALID_ARGUMENT, stub.AppendExperiences(
            store_pb2.AppendExperiencesRequest(experiences=[ragged])))
        odd = common_pb2.Experience()
        odd.CopyFrom(good)
        odd.prompt_token_ids = b"abc"
        await expect_code(code.INVALID_ARGUMENT, stub.AppendExperiences(
            store_pb2.AppendExperiencesRequest(experiences=[odd])))
        bad_id = common_pb2.Experience()
        bad_id.CopyFrom(good)
        bad_id.experience_id = "whatever"
        await expect_code(code.INVALID_ARGUMENT, stub.AppendExperiences(
            store_pb2.AppendExperiencesRequest(experiences=[bad_id])))
        conflict = common_pb2.Experience()
        conflict.CopyFrom(good)
        conflict.reward = 42.0
        await expect_code(code.ALREADY_EXISTS, stub.AppendExperiences(
            store_pb2.AppendExperiencesRequest(experiences=[conflict])))
        await expect_code(code.RESOURCE_EXHAUSTED, stub.AppendExperiences(
            store_pb2.AppendExperiencesRequest(
                experiences=[record_factory(job_id="tiny", response_tokens=500).to_proto()])))
        await expect_code(code.NOT_FOUND, stub.ReadExperiences(
            store_pb2.ReadExperiencesRequest(job_id="nojob", experience_ids=["a"])).read())
        await expect_code(code.NOT_FOUND, stub.ReadExperiences(
            store_pb2.ReadExperiencesRequest(job_id="job1", experience_ids=["t9/0/alice/0"])).read())
        await expect_code(code.INVALID_ARGUMENT, stub.ReadExperiences(
            store_pb2.ReadExperiencesRequest(job_id="bad job!", experience_ids=["a"])).read())
        await expect_code(code.INVALID_ARGUMENT, stub.MarkExperiences(store_pb2.MarkExperiencesRequest(
            job_id="job1", agent="alice", step_id="s", experience_ids=[good.experience_id])))
        await expect_code(code.INVALID_ARGUMENT, stub.QueryExperiences(
            store_pb2.QueryExperiencesRequest(job_id="job1", agent="alice", state=7)))  # type: ignore[arg-type]
        await expect_code(code.NOT_FOUND, stub.GetStats(store_pb2.GetStatsRequest(job_id="nojob")))
        await expect_code(code.INVALID_ARGUMENT, stub.CollectGarbage(
            store_pb2.CollectGarbageRequest(job_id="job1", retention_s=-1)))
        # No destructive default: every field must be explicit.
        for request in (store_pb2.CollectGarbageRequest(), store_pb2.CollectGarbageRequest(job_id="job1"),
                        store_pb2.CollectGarbageRequest(retention_s=0),
                        store_pb2.CollectGarbageRequest(job_id="job1", all_jobs=True, retention_s=0)):
            await expect_code(code.INVALID_ARGUMENT, stub.CollectGarbage(request))
        await expect_code(code.INVALID_ARGUMENT, stub.FinishJob(store_pb2.FinishJobRequest(job_id="job1")))
        await expect_code(code.INVALID_ARGUMENT, stub.FinishJob(store_pb2.FinishJobRequest(state="SUCCEEDED")))
        # blobs
        data = os.urandom(3000)

        async def put(*messages: store_pb2.PutBlobRequest) -> store_pb2.BlobInfo:
            async def gen() -> AsyncIterator[store_pb2.PutBlobRequest]:
                for m in messages:
                    yield m
            return await stub.PutBlob(gen())

        header = store_pb2.PutBlobHeader(name="b", size_bytes=len(data), sha256="ab" * 32)
        chunk = store_pb2.PutBlobRequest(chunk=data)
        await expect_code(code.DATA_LOSS, put(store_pb2.PutBlobRequest(header=header), chunk))
        await expect_code(code.INVALID_ARGUMENT, put(store_pb2.PutBlobRequest(chunk=data)))
        await expect_code(code.INVALID_ARGUMENT, put())
        header = store_pb2.PutBlobHeader(name="b", size_bytes=10)
        await expect_code(code.INVALID_ARGUMENT, put(store_pb2.PutBlobRequest(header=header), chunk))
        header = store_pb2.PutBlobHeader(name="b", size_bytes=5 << 20)
        await expect_code(code.RESOURCE_EXHAUSTED, put(
            store_pb2.PutBlobRequest(header=header), store_pb2.PutBlobRequest(chunk=b"x" * (5 << 20))))
        bad_name = store_pb2.PutBlobHeader(name="../x")
        await expect_code(code.INVALID_ARGUMENT, put(store_pb2.PutBlobRequest(header=bad_name)))
        await expect_code(code.RESOURCE_EXHAUSTED, put(store_pb2.PutBlobRequest(
            header=store_pb2.PutBlobHeader(name="t/x", size_bytes=5000, job_id="tiny"))))
        await expect_code(code.NOT_FOUND, stub.StatBlob(store_pb2.StatBlobRequest(name="nope")))
        await expect_code(code.NOT_FOUND, stub.GetBlob(store_pb2.GetBlobRequest(name="nope")).read())
        await expect_code(code.NOT_FOUND, stub.DeleteBlob(store_pb2.DeleteBlobRequest(name="nope")))
    assert list((stored.app.data_dir / "blobs" / "tmp").iterdir()) == []


async def test_put_blob_hash_on_a_closing_header(stored: Served) -> None:
    """An upload opened without a hash takes it from a closing header; nothing unverified is acknowledged."""
    code = grpc.StatusCode
    data = os.urandom((1 << 20) + 5)
    sha = hashlib.sha256(data).hexdigest()
    opening = store_pb2.PutBlobRequest(header=store_pb2.PutBlobHeader(name="c/x", size_bytes=len(data), job_id="job1"))
    chunk = store_pb2.PutBlobRequest(chunk=data)

    def closing(sha256: str, name: str = "c/x", size: int = len(data)) -> store_pb2.PutBlobRequest:
        return store_pb2.PutBlobRequest(header=store_pb2.PutBlobHeader(name=name, size_bytes=size, sha256=sha256,
                                                                       job_id="job1"))

    async with grpc.aio.insecure_channel(stored.address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)

        async def put(*messages: store_pb2.PutBlobRequest) -> store_pb2.BlobInfo:
            async def gen() -> AsyncIterator[store_pb2.PutBlobRequest]:
                for m in messages:
                    yield m
            return await stub.PutBlob(gen())

        await expect_code(code.DATA_LOSS, put(opening, chunk, closing("ab" * 32)))
        await expect_code(code.INVALID_ARGUMENT, put(opening, chunk, closing("xyz")))
        await expect_code(code.INVALID_ARGUMENT, put(opening, chunk, closing(sha, name="c/y")))
        await expect_code(code.INVALID_ARGUMENT, put(opening, chunk, closing(sha, size=len(data) + 1)))
        await expect_code(code.INVALID_ARGUMENT, put(opening, chunk, closing(sha), chunk))
        await expect_code(code.INVALID_ARGUMENT, put(opening, chunk, closing(sha), closing(sha)))
        with_hash = store_pb2.PutBlobRequest(header=store_pb2.PutBlobHeader(
            name="c/x", size_bytes=len(data), sha256=sha, job_id="job1"))
        await expect_code(code.INVALID_ARGUMENT, put(with_hash, chunk, closing(sha)))
        await expect_code(code.NOT_FOUND, stub.StatBlob(store_pb2.StatBlobRequest(name="c/x")))
        info = await put(opening, chunk, closing(sha.upper()))
        assert info.sha256 == sha and info.size_bytes == len(data)
    assert await stored.client.get_blob_bytes("c/x") == data
    assert list((stored.app.data_dir / "blobs" / "tmp").iterdir()) == []


async def test_blob_round_trips(stored: Served, tmp_path: Path) -> None:
    client = stored.client
    data = os.urandom(3 * (1 << 20) + 17)
    info = await client.put_blob_bytes("weights/job1/alice/1", data, job_id="job1")
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert await client.get_blob_bytes("weights/job1/alice/1") == data
    assert await client.get_blob_bytes(f"sha256:{info.sha256}") == data
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    assert (await client.put_blob_file("copy", src)).sha256 == info.sha256
    dst = tmp_path / "out" / "dst.bin"
    assert (await client.get_blob_file("copy", dst)).sha256 == info.sha256
    assert dst.read_bytes() == data
    # resume from a partial file; a stale partial is detected and fetched again
    part = dst.with_name("dst2.bin.part")
    part.write_bytes(data[: 1_500_000])
    await client.get_blob_file("copy", dst.with_name("dst2.bin"))
    assert dst.with_name("dst2.bin").read_bytes() == data and not part.exists()
    part.write_bytes(b"\x00" * 100)
    await client.get_blob_file("copy", dst.with_name("dst2.bin"))
    assert dst.with_name("dst2.bin").read_bytes() == data
    async with grpc.aio.insecure_channel(stored.address) as channel:
        stub = store_pb2_grpc.StoreStub(channel)
        msgs = [m async for m in stub.GetBlob(store_pb2.GetBlobRequest(name="copy", offset=1_000_000, length=200_000))]
        assert msgs[0].info.sha256 == info.sha256 and msgs[0].offset == 1_000_000
        assert b"".join(m.chunk for m in msgs) == data[1_000_000:1_200_000]
    assert await client.stat_blob("copy") == dataclasses.replace(info, name="copy", created_unix_ms=(
        await client.stat_blob("copy")).created_unix_ms)  # type: ignore[union-attr]
    assert [b.name for b in await client.list_blobs("weights/")] == ["weights/job1/alice/1"]
    assert (await client.stats()).blob_count == 1
    assert await client.delete_blob("copy") is False
    assert await client.delete_blob("weights/job1/alice/1") is True
    assert await client.stat_blob("copy") is None
    assert (await client.stats()).blob_bytes == 0
    assert await client.put_blob_bytes("empty", b"") is not None
    assert await client.get_blob_bytes("empty") == b""
    await client.get_blob_file("empty", tmp_path / "empty.bin")
    assert (tmp_path / "empty.bin").read_bytes() == b""


async def test_get_blob_file_resumes_a_broken_stream(stored: Served, tmp_path: Path) -> None:
    client = stored.client
    data = os.urandom(5 << 20)
    await client.put_blob_bytes("big", data)
    real = client._get_blob
    calls: list[int] = []

    def flaky(request: store_pb2.GetBlobRequest) -> Any:
        calls.append(request.offset)
        stream = real(request)
        if len(calls) > 1:
            return stream

        async def broken() -> AsyncIterator[store_pb2.GetBlobResponse]:
            n = 0
            async for message in stream:
                yield message
                n += 1
                if n == 2:
                    stream.cancel()
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               "connection reset")
        return broken()

    client._get_blob = flaky  # type: ignore[assignment]
    await client.get_blob_file("big", tmp_path / "big.bin")
    assert calls == [0, 2 << 20]
    assert (tmp_path / "big.bin").read_bytes() == data


async def test_corrupt_blob_is_never_served(stored: Served) -> None:
    data = os.urandom(3 << 20)
    info = await stored.client.put_blob_bytes("c", data)
    path = stored.app.blobs.content_path(info.sha256)
    with path.open("r+b") as f:
        f.seek((2 << 20) + 7)
        f.write(bytes([data[(2 << 20) + 7] ^ 1]))
    with pytest.raises(errors.DataLoss):
        await stored.client.get_blob_bytes("c")
    with pytest.raises(errors.DataLoss):
        await stored.client.get_blob_file("c", stored.app.data_dir.parent / "c.bin")


async def test_metrics_exported(stored: Served, record_factory: RecordFactory) -> None:
    await stored.client.append(group(record_factory, "t0"))
    await stored.client.read("job1", [record_factory("t0", 0).experience_id])
    await stored.client.put_blob_bytes("m", b"12345")
    await stored.client.get_blob_bytes("m")
    text = generate_latest(stored.registry).decode()
    assert 'flexmarl_stored_experience_rows{agent="alice",job="job1",state="ready"} 4.0' in text
    assert 'flexmarl_stored_experience_bytes{agent="alice",job="job1",state="ready"} 640.0' in text
    for name in ("flexmarl_stored_append_seconds_count 1.0", "flexmarl_stored_read_seconds_count 1.0",
                 "flexmarl_stored_blob_in_bytes_total 5.0", "flexmarl_stored_blob_out_bytes_total 5.0",
                 "flexmarl_stored_blobs 1.0", "flexmarl_stored_gc_runs_total 0.0"):
        assert name in text


def test_every_rpc_is_served_and_covered_by_the_client() -> None:
    methods = store_pb2.DESCRIPTOR.services_by_name["Store"].methods_by_name
    covered = {
        "AppendExperiences": "append", "ReadExperiences": "read", "QueryExperiences": "query",
        "MarkExperiences": "mark", "GetStats": "stats", "CollectGarbage": "collect_garbage",
        "FinishJob": "finish_job",
        "PutBlob": "put_blob_file", "GetBlob": "get_blob_file", "StatBlob": "stat_blob",
        "ListBlobs": "list_blobs", "DeleteBlob": "delete_blob",
    }
    assert set(methods) == set(covered)
    from stored.servicer import StoreServicer

    for rpc, method in covered.items():
        assert rpc in StoreServicer.__dict__, rpc
        assert hasattr(StoreClient, method), method


async def test_append_survives_restart_in_process(tmp_path: Path, record_factory: RecordFactory) -> None:
    server, served = await serve(tmp_path)
    records = group(record_factory, "t0", response_tokens=1000)
    await served.client.append(records)
    await served.client.close()
    await server.server.stop(0)
    await served.app.stop()
    server, served = await serve(tmp_path)
    try:
        got = await served.client.read("job1", [r.experience_id for r in records])
        assert all(same(g, r) for g, r in zip(got, records, strict=True))
        assert np.array_equal(got[0].response_logprobs, records[0].response_logprobs)
    finally:
        await served.client.close()
        await server.server.stop(0)
        await served.app.stop()
