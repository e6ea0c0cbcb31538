"""Throughput of stored: experience append/read and blob put/get vs raw loopback gRPC.

Usage: python benchmarks/stored.py [--records 4096] [--batch 64] [--response-tokens 1024] [--blob-rounds 3]

Starts etcd and a real stored subprocess (fsync on every commit, synchronous=FULL),
plus a bare gRPC server subprocess that streams/accepts raw 1 MiB messages with no
work: the ceiling any gRPC service can reach on this machine. Blob put/get (through
StoreClient's put_blob_file/get_blob_file: file read, sha256, verified, fsynced) and
the raw bound alternate for ``--blob-rounds`` rounds, so load from other work on the
machine hits both alike; the table gives the medians and each blob figure's median
ratio to the raw bound of its round, plus the CPU time client and server spent per MiB
(a figure other work on a shared machine disturbs less than throughput). Prints a
table and writes benchmarks/results/stored.json.

A put is durable before it is acknowledged (fsynced), so it is also bounded by the disk:
each round times a bare durable write of the same bytes to stored's file system (1 MiB
writes, an ``fdatasync`` every 8 MiB behind and an fsync at the end, as stored writes a
blob) and the put's "of bound" is against the slower of that and the raw client-stream.
Nothing bounds a get but gRPC: stored reads the page cache, the client writes its file
there.

Both are also bounded by CPU: a verified transfer cannot skip two sha256 passes (put: the
client's and stored's; get: the client's), stored's CRC-32 segment digests and the file
write and read. Those passes are timed alone in this process, added to the raw stream's
CPU per MiB, and "CPU bound" is what ``cpus`` cores could move if all of it ran in
parallel: a bound no implementation on this machine beats, printed beside the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.report is found from the repo root
    sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from benchmarks.report import Column, percentile, render_table  # noqa: E402
from flexmarl.cluster import DaemonProcess, EtcdServer, free_port, wait_until  # noqa: E402
from flexmarl.experience import ExperienceRecord, experience_id, group_id  # noqa: E402
from flexmarl.store_client import StoreClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "stored.json"
RAW_MESSAGE_BYTES = 1 << 20

RAW_SERVER = r"""
import asyncio, sys
import grpc, grpc.aio
PAYLOAD = b"x" * (1 << 20)
async def down(request, context):
    for _ in range(int(request)):
        yield PAYLOAD
async def up(request_iterator, context):
    n = 0
    async for chunk in request_iterator:
        n += len(chunk)
    return str(n).encode()
async def main():
    ident = lambda b: b
    handler = grpc.method_handlers_generic_handler("raw.Raw", {
        "Down": grpc.unary_stream_rpc_method_handler(down, request_deserializer=ident, response_serializer=ident),
        "Up": grpc.stream_unary_rpc_method_handler(up, request_deserializer=ident, response_serializer=ident),
    })
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.aio.server(options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


def make_records(n: int, response_tokens: int, prompt_tokens: int, group_size: int = 8) -> list[ExperienceRecord]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        task, sample = f"bench-{i // group_size}", i % group_size
        out.append(ExperienceRecord(
            experience_id=experience_id(task, sample, "policy", 0), job_id="bench", agent="policy", task_id=task,
            group_id=group_id(task, "policy"), sample_index=sample, episode_id=f"{task}-{sample}", turn=0,
            behavior_version=0, reward=float(rng.random()),
            prompt_token_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
            response_token_ids=rng.integers(0, 150_000, response_tokens, dtype=np.int32),
            response_logprobs=-rng.random(response_tokens, dtype=np.float32),
            group_size=group_size,
        ))
    return out


def payload_bytes(r: ExperienceRecord) -> int:
    return int(r.prompt_token_ids.nbytes + r.response_token_ids.nbytes + r.response_logprobs.nbytes)


class CpuMeter:
    """CPU seconds (user + system, every thread) of this process and a server process."""

    def __init__(self, server_pid: int) -> None:
        self._server = psutil.Process(server_pid)

    def now(self) -> float:
        server = self._server.cpu_times()
        return time.process_time() + server.user + server.system


async def bench_raw(address: str, total_mb: int, cpu: CpuMeter) -> dict[str, float]:
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=opts) as channel:
        await channel.channel_ready()
        down = channel.unary_stream("/raw.Raw/Down", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        up = channel.stream_unary("/raw.Raw/Up", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        start, cpu_start = time.perf_counter(), cpu.now()
        received = 0
        async for chunk in down(str(total_mb).encode()):
            received += len(chunk)
        down_s, down_cpu_s = time.perf_counter() - start, cpu.now() - cpu_start
        payload = b"y" * RAW_MESSAGE_BYTES

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(total_mb):
                yield payload

        start, cpu_start = time.perf_counter(), cpu.now()
        sent = int(await up(chunks()))
        up_s, up_cpu_s = time.perf_counter() - start, cpu.now() - cpu_start
    return {"down_mb_per_s": received / 2**20 / down_s, "up_mb_per_s": sent / 2**20 / up_s,
            "down_cpu_ms_per_mb": 1000 * down_cpu_s / total_mb, "up_cpu_ms_per_mb": 1000 * up_cpu_s / total_mb}


async def bench_stored(address: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    records = make_records(args.records, args.response_tokens, args.prompt_tokens)
    total_mb = sum(payload_bytes(r) for r in records) / 2**20
    async with StoreClient(address) as client:
        start = time.perf_counter()
        latencies = []
        for i in range(0, len(records), args.batch):
            t0 = time.perf_counter()
            await client.append(records[i : i + args.batch])
            latencies.append(time.perf_counter() - t0)
        append_s = time.perf_counter() - start
        ids = [r.experience_id for r in records]
        start = time.perf_counter()
        got = 0
        for i in range(0, len(ids), args.read_batch):
            got += len(await client.read("bench", ids[i : i + args.read_batch]))
        read_s = time.perf_counter() - start
        assert got == len(records)
    return {
        "records": len(records),
        "payload_mb": total_mb,
        "append_batch": args.batch,
        "append_experiences_per_s": len(records) / append_s,
        "append_mb_per_s": total_mb / append_s,
        "append_p50_ms": 1000 * percentile(latencies, 50),
        "append_p99_ms": 1000 * percentile(latencies, 99),
        "read_batch": args.read_batch,
        "read_experiences_per_s": len(records) / read_s,
        "read_mb_per_s": total_mb / read_s,
    }


async def bench_blob(address: str, mb: int, tmp: Path, round_index: int, cpu: CpuMeter) -> dict[str, float]:
    """One put and one get of a fresh random blob of mb MiB (no dedup with an earlier round)."""
    blob = tmp / "blob.bin"
    blob.write_bytes(os.urandom(mb << 20))
    name = f"bench/blob-{round_index}"
    async with StoreClient(address) as client:
        start, cpu_start = time.perf_counter(), cpu.now()
        await client.put_blob_file(name, blob)
        put_s, put_cpu_s = time.perf_counter() - start, cpu.now() - cpu_start
        start, cpu_start = time.perf_counter(), cpu.now()
        await client.get_blob_file(name, tmp / "blob.out")
        get_s, get_cpu_s = time.perf_counter() - start, cpu.now() - cpu_start
        await client.delete_blob(name)
    (tmp / "blob.out").unlink()
    return {"put_mb_per_s": mb / put_s, "get_mb_per_s": mb / get_s,
            "put_cpu_ms_per_mb": 1000 * put_cpu_s / mb, "get_cpu_ms_per_mb": 1000 * get_cpu_s / mb}


def bench_disk(directory: Path, mb: int, sync_every_mb: int = 8) -> float:
    """MiB/s of a bare durable write of mb random MiB into directory (stored's pattern, no hashing)."""
    payload = os.urandom(RAW_MESSAGE_BYTES)
    path = directory / "durable-write.bin"
    start = time.perf_counter()
    with path.open("wb") as f:
        for index in range(mb):
            f.write(payload)
            if (index + 1) % sync_every_mb == 0:
                f.flush()
                os.fdatasync(f.fileno())
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return mb / seconds


def essential_work_ms_per_mb(directory: Path, mb: int) -> dict[str, float]:
    """CPU ms per MiB of the passes a verified transfer cannot skip, each timed alone in this process.

    sha256 (the client's and stored's whole-content hash), CRC-32 (stored's segment digests), a
    file write into the page cache and a read back (stored's upload and read, the client's file).
    """
    data = os.urandom(mb << 20)
    path = directory / "essential-work.bin"

    def timed(fn: Any) -> float:
        start = time.process_time()
        fn()
        return 1000 * (time.process_time() - start) / mb

    def write() -> None:
        with path.open("wb") as f:
            for start in range(0, len(data), RAW_MESSAGE_BYTES):
                f.write(data[start : start + RAW_MESSAGE_BYTES])

    def read() -> None:
        with path.open("rb") as f:
            while f.read(RAW_MESSAGE_BYTES):
                pass

    figures: dict[str, list[float]] = {"sha256": [], "crc32": [], "write": [], "read": []}
    for _ in range(3):  # the first write takes fresh page-cache pages; the median is the steady state
        figures["sha256"].append(timed(lambda: hashlib.sha256(data).digest()))
        figures["crc32"].append(timed(lambda: zlib.crc32(data)))
        figures["write"].append(timed(write))
        figures["read"].append(timed(read))
        path.unlink()
    return {name: statistics.median(values) for name, values in figures.items()}


#: Issue 35: a blob put or get moves at least this share of the lowest bound of its path.
BOUND_TARGET = 0.9


def cpu_bounds(work: dict[str, float], raw_up_cpu: float, raw_down_cpu: float, cpus: int) -> dict[str, float]:
    """MiB/s no put / get can beat on ``cpus`` cores: the raw stream's CPU plus the essential passes, all parallel.

    put: the client reads and hashes its file, stored writes, hashes and checksums it; get: stored
    reads and checks its segments, the client writes and hashes the file.
    """
    put = raw_up_cpu + work["read"] + 2 * work["sha256"] + work["crc32"] + work["write"]
    get = raw_down_cpu + work["read"] + work["crc32"] + work["sha256"] + work["write"]
    return {"put_cpu_ms_per_mb_floor": put, "get_cpu_ms_per_mb_floor": get,
            "put_cpu_bound_mb_per_s": 1000 * cpus / put, "get_cpu_bound_mb_per_s": 1000 * cpus / get}


def blob_rounds(
    raw: tuple[str, int], stored: tuple[str, int], args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Raw bound and stored blob put/get ((address, server pid) each), alternating; medians and ratios."""
    rounds = []
    for index in range(args.blob_rounds):
        raw_result = asyncio.run(bench_raw(raw[0], args.blob_mb, CpuMeter(raw[1])))
        disk = bench_disk(tmp / "data", args.blob_mb)
        blob = asyncio.run(bench_blob(stored[0], args.blob_mb, tmp, index, CpuMeter(stored[1])))
        rounds.append({**{f"raw_{k}": v for k, v in raw_result.items()}, **blob, "disk_mb_per_s": disk,
                       "put_vs_raw": blob["put_mb_per_s"] / raw_result["up_mb_per_s"],
                       "get_vs_raw": blob["get_mb_per_s"] / raw_result["down_mb_per_s"]})
    return {"blob_mb": args.blob_mb, "rounds": rounds,
            **{f"median_{key}": statistics.median(r[key] for r in rounds) for key in rounds[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="experiences per append call")
    parser.add_argument("--read-batch", type=int, default=512, help="ids per read call")
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--blob-mb", type=int, default=128)
    parser.add_argument("--blob-rounds", type=int, default=3, help="alternating raw / stored blob rounds")
    parser.add_argument("--synchronous", default="FULL")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help=f"the JSON file to write (a directory: {RESULTS.name} in it)")
    args = parser.parse_args()
    if args.out.is_dir():  # decided before the run, so a finished run is never lost to its output path
        args.out = args.out / RESULTS.name
    load_at_start = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="stored-bench-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = EtcdServer(tmp / "etcd")
        etcd.start()
        stored = DaemonProcess(
            "stored", ["--data-dir", str(tmp / "data"), "--gc-interval-s", "0", "--log-level", "WARNING",
                       "--sqlite-synchronous", args.synchronous],
            etcd_endpoint=etcd.endpoint, run_dir=tmp / "run",
        )
        raw_port = free_port()
        raw = subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(raw_port)])
        try:
            stored.start()
            wait_until(lambda: raw.poll() is None, 5, "raw server")
            result = asyncio.run(bench_stored(stored.address, args, tmp))
            blobs = blob_rounds((f"127.0.0.1:{raw_port}", raw.pid), (stored.address, stored.pid), args, tmp)
            work = essential_work_ms_per_mb(tmp, args.blob_mb)
        finally:
            raw.terminate()
            raw.wait(10)
            stored.terminate()
            etcd.stop()

    report = {
        "command": "python benchmarks/stored.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "sqlite_synchronous": args.synchronous,
        "response_tokens": args.response_tokens,
        "prompt_tokens": args.prompt_tokens,
        "stored": result,
        "blobs": blobs,
        "essential_work_cpu_ms_per_mb": work,
        "cpu_bounds": (bounds := cpu_bounds(work, blobs["median_raw_up_cpu_ms_per_mb"],
                                            blobs["median_raw_down_cpu_ms_per_mb"], os.cpu_count() or 1)),
        # The lowest of the bounds on each path: "of bound" in the table.
        "put_bound_mb_per_s": min(blobs["median_raw_up_mb_per_s"], blobs["median_disk_mb_per_s"],
                                  bounds["put_cpu_bound_mb_per_s"]),
        "get_bound_mb_per_s": min(blobs["median_raw_down_mb_per_s"], bounds["get_cpu_bound_mb_per_s"]),
    }
    nan = float("nan")
    b = blobs
    rows = [
        (f"append (batches of {args.batch})", result["append_experiences_per_s"], result["append_mb_per_s"], nan, nan,
         nan),
        (f"read (batches of {args.read_batch})", result["read_experiences_per_s"], result["read_mb_per_s"], nan, nan,
         nan),
        (f"blob put {args.blob_mb} MiB", nan, b["median_put_mb_per_s"], b["median_put_vs_raw"],
         b["median_put_mb_per_s"] / report["put_bound_mb_per_s"], b["median_put_cpu_ms_per_mb"]),
        (f"blob get {args.blob_mb} MiB", nan, b["median_get_mb_per_s"], b["median_get_vs_raw"],
         b["median_get_mb_per_s"] / report["get_bound_mb_per_s"], b["median_get_cpu_ms_per_mb"]),
        ("raw gRPC client-stream 1 MiB msgs", nan, b["median_raw_up_mb_per_s"], nan, nan,
         b["median_raw_up_cpu_ms_per_mb"]),
        ("raw gRPC server-stream 1 MiB msgs", nan, b["median_raw_down_mb_per_s"], nan, nan,
         b["median_raw_down_cpu_ms_per_mb"]),
        ("durable write (put's disk bound)", nan, b["median_disk_mb_per_s"], nan, nan, nan),
        ("put CPU bound (raw + essential work)", nan, bounds["put_cpu_bound_mb_per_s"],
         bounds["put_cpu_bound_mb_per_s"] / b["median_raw_up_mb_per_s"], nan, bounds["put_cpu_ms_per_mb_floor"]),
        ("get CPU bound (raw + essential work)", nan, bounds["get_cpu_bound_mb_per_s"],
         bounds["get_cpu_bound_mb_per_s"] / b["median_raw_down_mb_per_s"], nan, bounds["get_cpu_ms_per_mb_floor"]),
    ]
    print(f"stored benchmark: {args.records} experiences, {args.response_tokens}-token responses + logprobs, "
          f"{args.prompt_tokens}-token prompts, synchronous={args.synchronous}; blob figures: medians of "
          f"{args.blob_rounds} alternating rounds (put vs client-stream, get vs server-stream); \"of bound\": of "
          "the lowest bound of the path (raw stream, durable write for a put, CPU)")
    columns = [Column("operation", 36, "<"), Column("experiences/s", 15, fmt=",.0f"), Column("MiB/s", 10, fmt=".1f"),
               Column("of raw", 8, fmt=".0%"), Column("of bound", 9, fmt=".0%"), Column("CPU ms/MiB", 11, fmt=".2f")]
    table_rows = [tuple("-" if v != v else v for v in row) for row in rows]
    print("\n".join(render_table(columns, table_rows, sep="")))
    print("essential passes alone, CPU ms/MiB: " + ", ".join(f"{k} {v:.2f}" for k, v in work.items()))
    for path in ("put", "get"):
        share = b[f"median_{path}_mb_per_s"] / report[f"{path}_bound_mb_per_s"]
        report.setdefault("targets", {})[path] = {"of_bound": share, "target": BOUND_TARGET,
                                                  "met": share >= BOUND_TARGET}
        print(f"blob {path}: {share:.0%} of its bound ({report[f'{path}_bound_mb_per_s']:.0f} MiB/s; target >= "
              f"{BOUND_TARGET:.0%}, issue 35): {'met' if share >= BOUND_TARGET else 'MISSED'}")
        # What a loaded machine disturbs least: the CPU the transfer took per MiB against the floor of its work.
        floor = bounds[f"{path}_cpu_ms_per_mb_floor"] / b[f"median_{path}_cpu_ms_per_mb"]
        report["targets"][path]["cpu_floor_over_cpu"] = floor
        print(f"blob {path}: CPU floor / CPU spent per MiB {floor:.0%} ({bounds[f'{path}_cpu_ms_per_mb_floor']:.2f} / "
              f"{b[f'median_{path}_cpu_ms_per_mb']:.2f} ms; target >= {BOUND_TARGET:.0%}): "
              f"{'met' if floor >= BOUND_TARGET else 'MISSED'}")
    print(f"append latency p50 {result['append_p50_ms']:.1f} ms, p99 {result['append_p99_ms']:.1f} ms; load average "
          f"{report['machine']['load_avg_at_start'][0]:.1f} at start, {report['machine']['load_avg_at_end'][0]:.1f} "
          f"at end on {os.cpu_count()} CPUs (a loaded machine makes blob throughput follow CPU ms/MiB)")
    for index, r in enumerate(blobs["rounds"]):
        print(f"blob round {index}: put {r['put_mb_per_s']:.0f} / raw up {r['raw_up_mb_per_s']:.0f} MiB/s "
              f"({r['put_vs_raw']:.0%}; durable write {r['disk_mb_per_s']:.0f}), get {r['get_mb_per_s']:.0f} / raw "
              f"down {r['raw_down_mb_per_s']:.0f} MiB/s "
              f"({r['get_vs_raw']:.0%})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
