"""orchestratord's CPU per RPC on asyncio's own event loop vs uvloop, side by side in one run.

Usage: python benchmarks/event_loop.py [--rounds 4] [--rpcs 3000] [--callers 64]

Starts etcd, one stored and two orchestratords (separate etcd prefixes, the same code): one as
``python -m orchestratord``, one with ``uvloop.install()`` before the same module runs. Each gets a
2-agent job and 64 workers holding 8 task leases. Then rounds alternate between the two (ABBA...,
so load from other work on the machine hits both alike): one client process sends ``--rpcs`` RPCs
from ``--callers`` closed-loop callers, each a ``RenewLeases`` of its worker's 8 leases followed by
a non-blocking ``LeaseRolloutTasks``, and the server's CPU (user + system) over the round is divided
by the RPCs. CPU per RPC is far less sensitive to a shared machine than latency or throughput.

Needs uvloop (``pip install uvloop``). Prints a table and writes benchmarks/results/event_loop.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* is found from the repo root
    sys.path.insert(0, str(REPO_ROOT))

import grpc.aio  # noqa: E402
import psutil  # noqa: E402

from benchmarks.fake_workers import job_spec  # noqa: E402
from benchmarks.report import Column, render_table  # noqa: E402
from flexmarl.cluster import DaemonProcess, EtcdServer  # noqa: E402
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "event_loop.json"
Holders = list[tuple[str, list[str]]]


class UvloopDaemon(DaemonProcess):
    """The same daemon command line, run after ``uvloop.install()``."""

    def command(self) -> list[str]:
        """``python -c <install uvloop, run the module> <the daemon's arguments>``."""
        cmd = super().command()
        launcher = ("import runpy, sys, uvloop; uvloop.install(); sys.argv[0] = sys.argv[1]; del sys.argv[1]; "
                    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
        return [sys.executable, "-c", launcher, self.kind, *cmd[3:]]


async def _take_leases(address: str, workers: int) -> Holders:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await stub.SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=job_spec("loop", 8192, 2, 1000, 9),
                                                               job_id="loop"), timeout=30)
        holders = []
        for k in range(workers):
            reply = await stub.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
                worker_id=f"holder-{k}", max_tasks=8, wait_ms=0), timeout=30)
            holders.append((f"holder-{k}", [t.lease_id for t in reply.tasks]))
        return holders


def _client_main(address: str, holders: Holders, rpcs: int, callers: int,
                 conn: multiprocessing.connection.Connection) -> None:
    """One round's client: connects, waits for "go", sends ``rpcs`` RPCs, sends back the wall time."""

    async def main() -> float:
        channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
        stubs = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in channels]
        for channel in channels:
            await channel.channel_ready()
        conn.send("ready")
        await asyncio.to_thread(conn.recv)
        left = [rpcs]

        async def caller(index: int) -> None:
            stub = stubs[index % len(stubs)]
            worker_id, lease_ids = holders[index % len(holders)]
            renew = orchestrator_pb2.RenewLeasesRequest(worker_id=worker_id, lease_ids=lease_ids)
            poll = orchestrator_pb2.LeaseRolloutTasksRequest(worker_id=f"poll-{index}", max_tasks=1, wait_ms=0)
            while left[0] > 0:
                left[0] -= 2
                await stub.RenewLeases(renew, timeout=60)
                await stub.LeaseRolloutTasks(poll, timeout=60)

        start = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall_s = time.perf_counter() - start
        for channel in channels:
            await channel.close()
        return wall_s

    conn.send(asyncio.run(main()))


def one_round(address: str, server_pid: int, holders: Holders, args: argparse.Namespace) -> dict[str, float]:
    """Server and client CPU per RPC, and RPC/s, of one round against one daemon."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    client = ctx.Process(target=_client_main, args=(address, holders, args.rpcs, args.callers, child), daemon=True)
    client.start()
    if not parent.poll(120) or parent.recv() != "ready":
        raise SystemExit("the client process did not start within 120 s")
    server, caller = psutil.Process(server_pid), psutil.Process(client.pid)
    server_before, client_before = sum(server.cpu_times()[:2]), sum(caller.cpu_times()[:2])
    parent.send("go")
    wall_s = float(parent.recv())
    server_s, client_s = sum(server.cpu_times()[:2]) - server_before, sum(caller.cpu_times()[:2]) - client_before
    client.join(timeout=30)
    return {"server_cpu_us_per_rpc": server_s / args.rpcs * 1e6, "client_cpu_us_per_rpc": client_s / args.rpcs * 1e6,
            "rpcs_per_s": args.rpcs / wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per event loop (alternating)")
    parser.add_argument("--rpcs", type=int, default=3000, help="RPCs per round")
    parser.add_argument("--callers", type=int, default=64, help="closed-loop callers per round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    try:
        import uvloop  # noqa: F401
    except ImportError:
        raise SystemExit("needs uvloop: pip install uvloop") from None
    load_at_start = os.getloadavg()
    rounds: dict[str, list[dict[str, float]]] = {"asyncio": [], "uvloop": []}
    with tempfile.TemporaryDirectory(prefix="loop-bench-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = EtcdServer(tmp / "etcd")
        etcd.start()
        stored = DaemonProcess("stored", ["--data-dir", str(tmp / "data"), "--log-level", "WARNING"],
                               etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
        daemon_args = ["--store-address", "", "--log-level", "WARNING"]
        daemons: dict[str, DaemonProcess] = {}
        try:
            stored.start()
            daemon_args[1] = stored.address
            daemons = {
                "asyncio": DaemonProcess("orchestratord", daemon_args, etcd_endpoint=etcd.endpoint,
                                         run_dir=tmp / "run", name="orch-asyncio", etcd_prefix="/loop-asyncio"),
                "uvloop": UvloopDaemon("orchestratord", daemon_args, etcd_endpoint=etcd.endpoint,
                                       run_dir=tmp / "run", name="orch-uvloop", etcd_prefix="/loop-uvloop"),
            }
            holders = {}
            for name, daemon in daemons.items():
                daemon.start()
                holders[name] = asyncio.run(_take_leases(daemon.address, args.callers))
            order = list(daemons)
            for index in range(args.rounds):
                for name in order if index % 2 == 0 else order[::-1]:
                    rounds[name].append(one_round(daemons[name].address, daemons[name].pid, holders[name], args))
        finally:
            for daemon in daemons.values():
                daemon.terminate()
            stored.terminate()
            etcd.stop()
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in rounds.items()}
    report: dict[str, Any] = {
        "command": "python benchmarks/event_loop.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": rounds, "medians": medians,
        "uvloop_server_cpu_ratio": medians["uvloop"]["server_cpu_us_per_rpc"]
        / medians["asyncio"]["server_cpu_us_per_rpc"],
    }
    columns = [Column("event loop", 10, "<"), Column("server us CPU/RPC", 18, fmt=".0f"),
               Column("client us CPU/RPC", 18, fmt=".0f"), Column("RPC/s", 8, fmt=".0f"),
               Column("server us/RPC per round", 0, "<", gap="  ")]
    rows = [[name, m["server_cpu_us_per_rpc"], m["client_cpu_us_per_rpc"], m["rpcs_per_s"],
             " ".join(f"{r['server_cpu_us_per_rpc']:.0f}" for r in rounds[name])] for name, m in medians.items()]
    print(f"orchestratord, {args.rounds} alternating rounds of {args.rpcs} RPCs from {args.callers} callers "
          f"(medians); load average {load_at_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("\n".join(render_table(columns, rows, sep="")))
    print(f"uvloop / asyncio server CPU per RPC: {report['uvloop_server_cpu_ratio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
