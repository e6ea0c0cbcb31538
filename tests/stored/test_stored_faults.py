"""stored as a real subprocess: SIGKILL mid-append, and a 200 MB blob at constant memory."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc.aio
import numpy as np
import psutil
import pytest

from flexmarl import errors
from flexmarl.cluster import DaemonProcess, free_port
from flexmarl.experience import ExperienceRecord
from flexmarl.store_client import StoreClient

log = logging.getLogger(__name__)

RecordFactory = Callable[..., ExperienceRecord]
StartDaemon = Callable[..., DaemonProcess]
pytestmark = pytest.mark.timeout(120)


def proto_bytes(record: ExperienceRecord) -> bytes:
    return dataclasses.replace(record, created_unix_ms=0).to_proto().SerializeToString(deterministic=True)


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the process's peak resident set size."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


async def test_sigkill_mid_append_loses_no_acknowledged_experience(
    start_daemon: StartDaemon, tmp_path: Path, record_factory: RecordFactory
) -> None:
    data_dir = tmp_path / "stored-data"
    port = free_port()
    proc = start_daemon("stored", "--data-dir", str(data_dir), "--port", str(port), "--gc-interval-s", "0")
    acked: dict[str, ExperienceRecord] = {}
    in_flight: dict[int, list[ExperienceRecord]] = {}
    enough = asyncio.Event()
    client = StoreClient(proc.address)

    async def appender(worker: int) -> None:
        batch_no = 0
        while True:
            batch = [
                record_factory(f"w{worker}-b{batch_no}", s, group_size=8, response_tokens=1024, seed=batch_no)
                for s in range(8)
            ]
            in_flight[worker] = batch
            try:
                await client.append(batch)
            except (errors.Unavailable, grpc.aio.AioRpcError):
                return
            acked.update({r.experience_id: r for r in batch})
            batch_no += 1
            if len(acked) >= 400:
                enough.set()

    # the blob upload in flight at the kill must not leave anything served
    blob = os.urandom(64 << 20)

    async def uploader() -> None:
        try:
            await client.put_blob_bytes("ckpt/half", blob)
        except (errors.FlexmarlError, grpc.aio.AioRpcError):
            pass

    tasks = [asyncio.create_task(appender(w)) for w in range(3)] + [asyncio.create_task(uploader())]
    await asyncio.wait_for(enough.wait(), timeout=60)
    proc.kill()  # SIGKILL while the appenders keep sending
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    await client.close()
    log.info("killed stored with %d acknowledged experiences", len(acked))

    proc.start()  # same data dir, same port
    client = StoreClient(proc.address)
    try:
        ids = list(acked)
        got = await client.read("job1", ids)
        assert len(got) == len(ids)
        for record in got:
            assert proto_bytes(record) == proto_bytes(acked[record.experience_id])
        # a batch in flight at the kill is all there (identical) or not there at all
        for batch in in_flight.values():
            if batch[0].experience_id in acked:
                continue
            present = await client.query("job1", "alice", limit=0)
            present_ids = {r.experience_id for r in present}
            found = [r for r in batch if r.experience_id in present_ids]
            assert len(found) in (0, len(batch))
            if found:
                stored_batch = await client.read("job1", [r.experience_id for r in batch])
                assert [proto_bytes(r) for r in stored_batch] == [proto_bytes(r) for r in batch]
        info = await client.stat_blob("ckpt/half")
        if info is not None:
            assert await client.get_blob_bytes("ckpt/half") == blob
        assert list((data_dir / "blobs" / "tmp").iterdir()) == []
        # retrying every acknowledged batch is a no-op
        appended, duplicates = await client.append([acked[i] for i in ids[:64]])
        assert (appended, duplicates) == (0, 64)
    finally:
        await client.close()


async def test_200mb_blob_round_trip_at_constant_memory(start_daemon: StartDaemon, tmp_path: Path) -> None:
    proc = start_daemon("stored", "--data-dir", str(tmp_path / "stored-data"), "--gc-interval-s", "0")
    size = 200 << 20
    src = tmp_path / "src.bin"
    rng = np.random.default_rng(0)
    with src.open("wb") as f:
        for _ in range(size // (8 << 20)):
            f.write(rng.bytes(8 << 20))
    expected = hashlib.sha256(src.read_bytes()).hexdigest()
    baseline = peak_rss_bytes(proc.pid)
    rss_now = psutil.Process(proc.pid).memory_info().rss
    client = StoreClient(proc.address)
    try:
        start = time.perf_counter()
        info = await client.put_blob_file("weights/job1/alice/1/model.safetensors", src, job_id="job1")
        put_s = time.perf_counter() - start
        assert info.sha256 == expected and info.size_bytes == size
        after_put = peak_rss_bytes(proc.pid)
        dst = tmp_path / "dst.bin"
        start = time.perf_counter()
        got = await client.get_blob_file("weights/job1/alice/1/model.safetensors", dst)
        get_s = time.perf_counter() - start
        after_get = peak_rss_bytes(proc.pid)
    finally:
        await client.close()
    assert got.sha256 == expected and dst.stat().st_size == size
    message = (
        f"stored peak RSS: {baseline / 2**20:.1f} MiB before (RSS {rss_now / 2**20:.1f} MiB), "
        f"{after_put / 2**20:.1f} MiB after a 200 MiB put ({size / 2**20 / put_s:.0f} MiB/s), "
        f"{after_get / 2**20:.1f} MiB after the get ({size / 2**20 / get_s:.0f} MiB/s)"
    )
    log.warning(message)
    print(message)
    # bounded, not proportional: ~+20-60 MiB for 100, 200 or 400 MiB blobs (allocator arenas, gRPC buffers)
    assert after_get - baseline < 100 << 20, message
