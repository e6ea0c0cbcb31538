"""orchestratord's CPU per lease operation on asyncio and on uvloop, beside a bare grpc.aio server, in one run.

Usage: python benchmarks/event_loop.py [--rounds 4] [--rpcs 3000] [--callers 64]

Starts etcd, one stored, two orchestratords (separate etcd prefixes, the same code), each as
``python -m orchestratord``: one with ``FLEXMARL_EVENT_LOOP=asyncio``, one with ``FLEXMARL_EVENT_LOOP=uvloop``
(flexmarl.daemon's switch); and a bare grpc.aio server (asyncio's loop) whose RenewLeases,
LeaseRolloutTasks and ReportRolloutTask only build an empty reply: the floor of Python gRPC itself.
Each orchestratord gets a 2-agent job and ``--callers`` workers holding 8 task leases. Two round
kinds, each against every server in turn (ABC CBA ..., so load from other work on the machine hits
all alike), each ``--rpcs`` RPCs from ``--callers`` closed-loop callers of one client process:

* ``renew``: RenewLeases of the caller's 8 leases (8 lease operations per RPC, as rolloutd renews
  every task it holds in one call);
* ``turnover``: ReportRolloutTask of the oldest held task (one experience per sample and agent),
  then LeaseRolloutTasks (non-blocking, one task) for its replacement (1 lease operation each).

The server's CPU (user + system) over the round is divided by its RPCs and its lease operations.
CPU per RPC is far less sensitive to a shared machine than latency or throughput.

Needs uvloop (a dependency). Prints a table and writes benchmarks/results/event_loop.json.
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

from benchmarks.fake_workers import AGENTS, job_spec  # noqa: E402
from benchmarks.report import Column, render_table  # noqa: E402
from flexmarl.cluster import DaemonProcess, EtcdServer  # noqa: E402
from flexmarl.daemon import EVENT_LOOP_ENV  # noqa: E402
from flexmarl.experience import experience_id, group_id  # noqa: E402
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "event_loop.json"
# Per worker: its id and the (lease id, task id) of each task it holds.
Holders = list[tuple[str, list[tuple[str, str]]]]
KINDS = ("renew", "turnover")
#: Lease operations per RPC of each round kind (a turnover is a report and a lease: one operation each).
OPS_PER_RPC = {"renew": 8.0, "turnover": 1.0}
GROUP_SIZE = 2


async def _take_leases(address: str, workers: int) -> Holders:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await stub.SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=job_spec("loop", 8192, 2, 1000, 9),
                                                               job_id="loop"), timeout=30)
        holders = []
        for k in range(workers):
            reply = await stub.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
                worker_id=f"holder-{k}", max_tasks=8, wait_ms=0), timeout=30)
            holders.append((f"holder-{k}", [(t.lease_id, t.task_id) for t in reply.tasks]))
        return holders


def _bare_holders(workers: int) -> Holders:
    """Made-up leases for the bare server (it answers every request alike)."""
    return [(f"holder-{k}", [(f"loop/bare-task-{k}-{i}", f"loop/b0/t{k * 8 + i}") for i in range(8)])
            for k in range(workers)]


def _summaries(task_id: str) -> list[orchestrator_pb2.ExperienceSummary]:
    """A successful task's report: one experience per (sample, agent) at behaviour version 0."""
    return [orchestrator_pb2.ExperienceSummary(
        experience_id=experience_id(task_id, sample, agent, 0), agent=agent, group_id=group_id(task_id, agent),
        sample_index=sample, behavior_version=0, response_tokens=8, reward=0.5)
        for sample in range(GROUP_SIZE) for agent in AGENTS]


def _bare_server_main(conn: multiprocessing.connection.Connection) -> None:
    """A grpc.aio server whose lease RPCs only build an empty reply (no interceptor, no planner)."""

    def handler(request_cls: Any, reply_cls: Any) -> grpc.RpcMethodHandler:
        async def answer(request: Any, context: Any) -> Any:
            return reply_cls()
        return grpc.unary_unary_rpc_method_handler(answer, request_cls.FromString, reply_cls.SerializeToString)

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flexmarl.v1.Orchestrator", {
            "RenewLeases": handler(orchestrator_pb2.RenewLeasesRequest, orchestrator_pb2.RenewLeasesResponse),
            "LeaseRolloutTasks": handler(orchestrator_pb2.LeaseRolloutTasksRequest,
                                         orchestrator_pb2.LeaseRolloutTasksResponse),
            "ReportRolloutTask": handler(orchestrator_pb2.ReportRolloutTaskRequest,
                                         orchestrator_pb2.ReportRolloutTaskResponse),
        }),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _client_main(address: str, holders: Holders, kind: str, rpcs: int, callers: int,
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
            worker_id, held = holders[index % len(holders)]
            if kind == "renew":
                renew = orchestrator_pb2.RenewLeasesRequest(worker_id=worker_id, lease_ids=[lease for lease, _ in held])
                while left[0] > 0:
                    left[0] -= 1
                    await stub.RenewLeases(renew, timeout=60)
                return
            while left[0] > 0:  # turnover: report the oldest task, lease its replacement
                left[0] -= 2
                lease_id, task_id = held.pop(0)
                await stub.ReportRolloutTask(orchestrator_pb2.ReportRolloutTaskRequest(
                    lease_id=lease_id, worker_id=worker_id, task_id=task_id, succeeded=True,
                    experiences=_summaries(task_id)), timeout=60)
                reply = await stub.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
                    worker_id=worker_id, max_tasks=1, wait_ms=0), timeout=60)
                held.extend((t.lease_id, t.task_id) for t in reply.tasks)
                if not reply.tasks:  # the bare server leases nothing: report the same made-up task again
                    held.append((lease_id, task_id))

        start = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        wall_s = time.perf_counter() - start
        for channel in channels:
            await channel.close()
        return wall_s

    conn.send((asyncio.run(main()), holders))


def one_round(address: str, server_pid: int, holders: Holders, kind: str,
              args: argparse.Namespace) -> dict[str, float]:
    """Server and client CPU per RPC and per lease operation, and RPC/s, of one round against one server.

    The client process takes the holders' tasks of this round with it; a turnover round's leases
    replace the reported ones in the server, so ``holders`` is updated from what the client sends back.
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    client = ctx.Process(target=_client_main, args=(address, holders, kind, args.rpcs, args.callers, child),
                         daemon=True)
    client.start()
    if not parent.poll(120) or parent.recv() != "ready":
        raise SystemExit("the client process did not start within 120 s")
    server, caller = psutil.Process(server_pid), psutil.Process(client.pid)
    server_before, client_before = sum(server.cpu_times()[:2]), sum(caller.cpu_times()[:2])
    parent.send("go")
    wall_s, held = parent.recv()
    server_s, client_s = sum(server.cpu_times()[:2]) - server_before, sum(caller.cpu_times()[:2]) - client_before
    client.join(timeout=30)
    holders[:] = held
    return {"server_cpu_us_per_rpc": server_s / args.rpcs * 1e6, "client_cpu_us_per_rpc": client_s / args.rpcs * 1e6,
            "server_cpu_us_per_lease_op": server_s / (args.rpcs * OPS_PER_RPC[kind]) * 1e6,
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
    servers = ("bare grpc.aio", "asyncio", "uvloop")
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {kind: {name: [] for name in servers} for kind in KINDS}
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="loop-bench-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = EtcdServer(tmp / "etcd")
        etcd.start()
        stored = DaemonProcess("stored", ["--data-dir", str(tmp / "data"), "--log-level", "WARNING"],
                               etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
        daemon_args = ["--store-address", "", "--log-level", "WARNING"]
        daemons: dict[str, DaemonProcess] = {}
        parent, child = ctx.Pipe(duplex=False)
        bare = ctx.Process(target=_bare_server_main, args=(child,), daemon=True)
        try:
            stored.start()
            daemon_args[1] = stored.address
            daemons = {
                loop: DaemonProcess("orchestratord", daemon_args, etcd_endpoint=etcd.endpoint, run_dir=tmp / "run",
                                    name=f"orch-{loop}", etcd_prefix=f"/loop-{loop}", env={EVENT_LOOP_ENV: loop})
                for loop in ("asyncio", "uvloop")
            }
            bare.start()
            addresses = {"bare grpc.aio": (f"127.0.0.1:{parent.recv()}", int(bare.pid or 0))}
            holders = {"bare grpc.aio": _bare_holders(args.callers)}
            for name, daemon in daemons.items():
                daemon.start()
                addresses[name] = (daemon.address, daemon.pid)
                holders[name] = asyncio.run(_take_leases(daemon.address, args.callers))
            for index in range(args.rounds):
                for kind in KINDS:
                    for name in servers if index % 2 == 0 else servers[::-1]:
                        address, pid = addresses[name]
                        rounds[kind][name].append(one_round(address, pid, holders[name], kind, args))
        finally:
            bare.terminate()
            for daemon in daemons.values():
                daemon.terminate()
            stored.terminate()
            etcd.stop()
    medians = {kind: {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
                      for name, rs in by_server.items()} for kind, by_server in rounds.items()}
    ratio = {kind: medians[kind]["uvloop"]["server_cpu_us_per_rpc"] / medians[kind]["asyncio"]["server_cpu_us_per_rpc"]
             for kind in KINDS}
    report: dict[str, Any] = {
        "command": "python benchmarks/event_loop.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ops_per_rpc": OPS_PER_RPC, "rounds": rounds, "medians": medians, "uvloop_server_cpu_ratio": ratio,
    }
    columns = [Column("round", 9, "<"), Column("server", 14, "<"), Column("us CPU/RPC", 11, fmt=".0f"),
               Column("us CPU/lease op", 15, fmt=".1f"), Column("client us/RPC", 13, fmt=".0f"),
               Column("RPC/s", 7, fmt=".0f"), Column("server us/RPC per round", 0, "<", gap="  ")]
    rows = [[kind, name, m["server_cpu_us_per_rpc"], m["server_cpu_us_per_lease_op"] if name != "bare grpc.aio"
             else float("nan"), m["client_cpu_us_per_rpc"], m["rpcs_per_s"],
             " ".join(f"{r['server_cpu_us_per_rpc']:.0f}" for r in rounds[kind][name])]
            for kind in KINDS for name, m in medians[kind].items()]
    print(f"{args.rounds} alternating rounds per kind and server of {args.rpcs} RPCs from {args.callers} callers "
          f"(medians); load average {load_at_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("\n".join(render_table(columns, rows, sep=" ")))
    for kind in KINDS:
        cpu = {name: m["server_cpu_us_per_rpc"] for name, m in medians[kind].items()}
        print(f"{kind}: uvloop / asyncio orchestratord CPU per RPC {ratio[kind]:.2f}; orchestratord (uvloop) / "
              f"bare grpc.aio {cpu['uvloop'] / cpu['bare grpc.aio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
