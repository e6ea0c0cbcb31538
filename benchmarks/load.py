"""Load on orchestratord and stored: many simulated rollout and trainer workers on loopback.

Usage: python benchmarks/load.py [--rollout-workers 200] [--steps 60] [--drive-s 90] [--storm-s 10]
                                [--open-rates 5000] [--open-workers 1000] [--client-procs 3]

Starts etcd, a real stored (fsync on every commit) and a real orchestratord as subprocesses. Phases
1-2 run from one asyncio process over a few shared gRPC channels; phases 3-5 run their callers in
--client-procs separate processes (multiprocessing), so the client's CPU does not starve the server:

1. drive: a real 2-agent job through the planner. Hundreds of simulated rolloutd tasks long-poll
   LeaseRolloutTasks, append tiny synthetic experiences to stored (one AppendExperiences per task),
   renew, and report; simulated traind slots (one per agent) poll, ack micro-batches and commit
   steps with a fake weights_uri (file:///tmp/x). Ends when the job succeeds or --drive-s passes.
   RSS of both daemons is sampled throughout (growth per committed step).
2. hold: a second job admits many tasks at once; the benchmark leases them all without reporting and
   reads orchestratord's RSS before and after (state bytes per lease in flight).
3. baseline: the closed loop of phase 4 against a bare grpc.aio server (same proto, handlers that
   only build an empty reply; no interceptor, no planner): the ceiling of Python gRPC itself here.
4. storm (closed loop): --rollout-workers callers each call RenewLeases (one held lease) and a
   non-blocking LeaseRolloutTasks back to back for --storm-s: the ceiling. Its latency is queueing
   of that many concurrent callers, not latency at a rate.
5. open (open loop): for each rate in --open-rates, --open-workers simulated rolloutds each hold
   --open-leases task leases and, like rolloutd, renew all of them in one RenewLeases every
   --renew-s; the rest of the rate is task turnover: ReportRolloutTask of a held task, then a
   LeaseRolloutTasks for its replacement, at Poisson times. Sends are scheduled ahead and never wait
   for earlier replies; latency counts from the scheduled send time (no coordinated omission).
   Each client process sends from one dispatcher with a done callback per call (no coroutine per
   simulated worker or per send), so the clients cost little CPU per RPC.

Lease operations are counted per lease: a RenewLeases of k leases is k operations, a task leased is
one, a task reported is one. RPCs per second are reported next to them.

Prints a table and writes benchmarks/results/load.json. The client shares the machine's cores with
the daemons, so the numbers are a lower bound of what orchestratord alone can serve: each phase
prints the CPU each side spent per RPC (inside the measured window only), the load average, and
whether server + client cores exceeded the cores available (then latency measures the box).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.report is found from the repo root
    sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
import psutil  # noqa: E402

from benchmarks.fake_workers import (  # noqa: E402
    AGENTS,
    Cluster,
    Recorder,
    RssSampler,
    control_plane,
    job_spec,
    rollout_worker,
    trainer_slot,
    watch_job,
)
from benchmarks.report import Column, latency_ms, render_table  # noqa: E402
from flexmarl.experience import experience_id, group_id  # noqa: E402
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
TARGET_LEASE_OPS_PER_S = 5000.0
TARGET_P99_MS = 10.0
LEASE_RPCS = ("LeaseRolloutTasks", "RenewLeases", "ReportRolloutTask", "PollTrainerWork", "AckMicroBatch",
              "CommitStep")

T = TypeVar("T")


async def drive(cluster: Cluster, sampler: RssSampler, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 1: a real job through the planner, to completion or the time limit."""
    orch = cluster.orch[0]
    spec = job_spec("load", args.prompts_per_step, args.group_size, args.steps, args.max_staleness)
    job_id = (await orch.SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=spec, job_id="load-drive"),
                                   timeout=10)).job_id
    rec = Recorder()
    stop, done = asyncio.Event(), asyncio.Event()
    commits: list[float] = []
    start = time.monotonic()
    sampler.sample()
    tasks = [asyncio.create_task(rollout_worker(i, cluster, rec, stop, done, args.response_tokens,
                                                args.rollout_worker_ids)) for i in range(args.rollout_workers)]
    tasks += [asyncio.create_task(trainer_slot(i, cluster, rec, stop, done, commits)) for i in range(len(AGENTS))]
    watcher = asyncio.create_task(watch_job(orch, job_id, done, stop))
    try:
        await asyncio.wait_for(done.wait(), timeout=args.drive_s)
    except TimeoutError:
        pass
    stop.set()
    wall_s = time.monotonic() - start
    await asyncio.gather(*tasks)
    state = await watcher if watcher.done() else "TIMED_OUT"
    if not watcher.done():
        watcher.cancel()
    status = await orch.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=10)
    sampler.sample()
    steps_done = sum(a.version for a in status.agents)
    # RSS growth over the run, after the first tenth of it (imports, pools and caches warmed up).
    growth: dict[str, Any] = {}
    for name, samples in sampler.samples.items():
        run = [(t, v) for t, v in samples if t >= start]
        warm = run[max(0, len(run) // 10)]
        growth[name] = {"rss_start_mb": run[0][1] / 2**20, "rss_after_warmup_mb": warm[1] / 2**20,
                        "rss_end_mb": run[-1][1] / 2**20, "rss_peak_mb": max(v for _, v in run) / 2**20,
                        "growth_after_warmup_kb_per_committed_step":
                            (run[-1][1] - warm[1]) / 1024 / max(1, steps_done * 0.9)}
    return {"job_state": state, "wall_s": wall_s, "committed_steps_all_agents": steps_done,
            "tasks_done": status.tasks_done, "tasks_total": status.tasks_total,
            "steps_per_s": steps_done / wall_s, "rpcs": rec.summary(wall_s), "memory": growth}


async def hold(cluster: Cluster, sampler: RssSampler, args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """Phase 2: lease many tasks at once, without reporting: orchestratord bytes per lease in flight."""
    orch = cluster.orch[0]
    spec = job_spec("hold", args.hold_prompts, 2, 1000, 9)
    await orch.SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=spec, job_id="load-hold"), timeout=10)
    await asyncio.sleep(0.5)
    before = sampler.rss("orchestratord")
    leased: list[Any] = []
    while True:
        reply = await orch.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
            worker_id="holder", max_tasks=256, wait_ms=0), timeout=30)
        if not reply.tasks:
            break
        leased.extend(reply.tasks)
    after = sampler.rss("orchestratord")
    return {"leases_in_flight": len(leased), "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20,
            "bytes_per_lease": (after - before) / max(1, len(leased))}, leased


# ---- multi-process callers (phases 3-5) ---------------------------------------------------------------


def _summary(seconds: dict[str, list[float]], errors: dict[str, dict[str, int]], lease_ops: dict[str, int],
             wall_s: float) -> dict[str, dict[str, Any]]:
    """count, RPC/s, lease ops/s, p50/p99/max ms per RPC (samples merged over client processes)."""
    out: dict[str, dict[str, Any]] = {}
    for rpc in sorted(set(seconds) | set(errors)):
        samples = seconds.get(rpc, [])
        out[rpc] = {"count": len(samples), "ops_per_s": len(samples) / wall_s,
                    "lease_ops_per_s": lease_ops.get(rpc, 0) / wall_s, **latency_ms(samples),
                    "errors": dict(errors.get(rpc, {}))}
    return out


class _ProcRecorder:
    """Latencies, errors and lease operations of one client process."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.lease_ops: dict[str, int] = defaultdict(int)
        self.lag_s: list[float] = []

    async def call(self, rpc: str, method: Callable[..., Awaitable[T]], request: Any, since: float,
                   ops: int = 1) -> T | None:
        """Calls method(request); latency counts from ``since`` (the scheduled send time)."""
        try:
            reply = await method(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            self.errors[rpc][exc.code().name] += 1
            return None
        self.seconds[rpc].append(time.perf_counter() - since)
        self.lease_ops[rpc] += ops
        return reply

    def result(self) -> dict[str, Any]:
        """Plain data for the parent process."""
        return {"seconds": dict(self.seconds), "errors": {k: dict(v) for k, v in self.errors.items()},
                "lease_ops": dict(self.lease_ops), "lag_s": self.lag_s}


def _summaries(task_id: str, group_size: int) -> list[orchestrator_pb2.ExperienceSummary]:
    """A successful task's report: one experience per (sample, agent) at behaviour version 0."""
    return [orchestrator_pb2.ExperienceSummary(
        experience_id=experience_id(task_id, sample, agent, 0), agent=agent, group_id=group_id(task_id, agent),
        sample_index=sample, behavior_version=0, response_tokens=8, reward=0.5)
        for sample in range(group_size) for agent in AGENTS]


async def _closed_callers(cfg: dict[str, Any], rec: _ProcRecorder, stubs: list[Any],
                          started: Callable[[], Awaitable[None]]) -> None:
    """Closed loop: each caller renews one held lease, then polls for a task without waiting, back to back."""
    leases: list[str] = cfg["lease_ids"]

    async def one(index: int) -> None:
        orch = stubs[index % len(stubs)]
        lease = leases[(cfg["proc"] * 7919 + index) % len(leases)] if leases else ""
        renew = orchestrator_pb2.RenewLeasesRequest(worker_id=cfg["holder"], lease_ids=[lease] if lease else [])
        poll = orchestrator_pb2.LeaseRolloutTasksRequest(worker_id=f"storm-{cfg['proc']}-{index}", max_tasks=1,
                                                         wait_ms=0)
        while time.time() < cfg["end_at"]:
            await rec.call("RenewLeases", orch.RenewLeases, renew, time.perf_counter(), len(renew.lease_ids))
            got = await rec.call("LeaseRolloutTasks", orch.LeaseRolloutTasks, poll, time.perf_counter(), 0)
            if got is not None:
                rec.lease_ops["LeaseRolloutTasks"] += len(got.tasks)

    await started()
    await asyncio.sleep(max(0.0, cfg["start_at"] - time.time()))
    await asyncio.gather(*(one(i) for i in range(cfg["callers"])))


def _schedule(cfg: dict[str, Any]) -> list[tuple[float, int, int]]:
    """Every send of one client process, in time order: (due, 0 = renew / 1 = turnover, worker).

    Each worker renews every --renew-s from a random phase and turns tasks over at Poisson times.
    Drawn before the clock starts, so the sends depend on no reply (open loop).
    """
    rng = random.Random(cfg["proc"])
    rate, events = cfg["task_rate_per_worker"], []
    for index in range(cfg["workers"]):
        due = cfg["start_at"] + rng.uniform(0, cfg["renew_s"])
        while due < cfg["end_at"]:
            events.append((due, 0, index))
            due += cfg["renew_s"]
        due = cfg["start_at"] + rng.expovariate(rate) if rate > 0 else float("inf")
        while due < cfg["end_at"]:
            events.append((due, 1, index))
            due += rng.expovariate(rate)
    events.sort()
    return events


async def _open_workers(cfg: dict[str, Any], rec: _ProcRecorder, stubs: list[Any],
                        started: Callable[[], Awaitable[None]]) -> None:
    """Open loop: simulated rolloutds renewing their leases in batches and turning tasks over at Poisson times.

    One dispatcher sends every call of the process at its scheduled time and never waits for a reply:
    a reply is recorded by a done callback of its call (a turnover's lease is sent from its report's).
    One timer for the process and no coroutine per send (not one sleeping coroutine per simulated
    worker) keeps the client's CPU per RPC low, so the box measures the server more than the client.
    """
    held: list[deque[Any]] = []
    for index in range(cfg["workers"]):  # each worker leases its tasks before the clock starts
        reply = await stubs[index % len(stubs)].LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(
            worker_id=f"open-{cfg['proc']}-{index}", max_tasks=cfg["leases"], wait_ms=0), timeout=30)
        held.append(deque(reply.tasks))
    await started()
    events = _schedule(cfg)
    in_flight: set[Any] = set()
    finished = asyncio.get_running_loop().create_future()

    def send(rpc: str, method: Any, request: Any, since: float, ops: int,
             then: Callable[[Any], None] | None = None) -> None:
        call = asyncio.ensure_future(method(request, timeout=30))
        in_flight.add(call)

        def done(call: asyncio.Future[Any]) -> None:
            in_flight.discard(call)
            try:
                reply = call.result() if not call.cancelled() else None
            except grpc.aio.AioRpcError as exc:
                rec.errors[rpc][exc.code().name] += 1
            else:
                if reply is None:
                    rec.errors[rpc]["CANCELLED"] += 1
                else:
                    rec.seconds[rpc].append(time.perf_counter() - since)
                    rec.lease_ops[rpc] += ops
                    if then is not None:
                        then(reply)
            if not in_flight and not events and not finished.done():
                finished.set_result(None)

        call.add_done_callback(done)

    def turn_over(index: int, since: float) -> None:
        if not held[index]:
            return
        task, worker_id, orch = held[index].popleft(), f"open-{cfg['proc']}-{index}", stubs[index % len(stubs)]

        def leased(got: Any) -> None:
            rec.lease_ops["LeaseRolloutTasks"] += len(got.tasks)
            held[index].extend(got.tasks)

        def reported(_: Any) -> None:
            send("LeaseRolloutTasks", orch.LeaseRolloutTasks, orchestrator_pb2.LeaseRolloutTasksRequest(
                worker_id=worker_id, max_tasks=1, wait_ms=0), time.perf_counter(), 0, leased)

        send("ReportRolloutTask", orch.ReportRolloutTask, orchestrator_pb2.ReportRolloutTaskRequest(
            lease_id=task.lease_id, worker_id=worker_id, task_id=task.task_id, succeeded=True,
            experiences=_summaries(task.task_id, task.group_size)), since, 1, reported)

    events.reverse()  # popped from the end: earliest first
    while events:
        due, kind, index = events[-1]
        wait_s = due - time.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        events.pop()
        now = time.time()
        rec.lag_s.append(now - due)
        since = time.perf_counter() - (now - due)  # latency counts from the scheduled time
        if kind == 0:
            ids = [t.lease_id for t in held[index]]
            send("RenewLeases", stubs[index % len(stubs)].RenewLeases,
                 orchestrator_pb2.RenewLeasesRequest(worker_id=f"open-{cfg['proc']}-{index}", lease_ids=ids),
                 since, len(ids))
        else:
            turn_over(index, since)
    if in_flight:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(finished), timeout=35)


async def _window_cpu(cfg: dict[str, Any], out: dict[str, float]) -> None:
    """CPU seconds this process spends inside the measured window (set-up and drain excluded)."""
    await asyncio.sleep(max(0.0, cfg["start_at"] - time.time()))
    before = sum(os.times()[:2])
    await asyncio.sleep(max(0.0, cfg["end_at"] - time.time()))
    out["cpu_s"] = sum(os.times()[:2]) - before


def _client_main(cfg: dict[str, Any], conn: multiprocessing.connection.Connection) -> None:
    """Entry point of one client process: sets up, waits for the common start, runs its callers, reports."""

    async def main() -> dict[str, Any]:
        channels = [grpc.aio.insecure_channel(cfg["address"]) for _ in range(cfg["channels"])]
        stubs = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in channels]
        for channel in channels:
            await channel.channel_ready()
        rec = _ProcRecorder()
        window: dict[str, float] = {}
        meters: list[asyncio.Task[None]] = []

        async def started() -> None:
            """Tells the parent this process is set up; the parent answers the window once all are."""
            conn.send("ready")
            cfg["start_at"], cfg["end_at"] = await asyncio.to_thread(conn.recv)
            meters.append(asyncio.create_task(_window_cpu(cfg, window)))

        if cfg["mode"] == "open":
            await _open_workers(cfg, rec, stubs, started)
        else:
            await _closed_callers(cfg, rec, stubs, started)
        await asyncio.gather(*meters)
        for channel in channels:
            await channel.close()
        return {**rec.result(), **window}

    conn.send(asyncio.run(main()))
    conn.close()


def run_clients(address: str, configs: list[dict[str, Any]], pids: dict[str, int], wall_s: float,
                setup_s: float) -> dict[str, Any]:
    """Runs one client process per config; merges their samples; measures server CPU and peak RSS.

    The clock starts once every client process is set up (connected, its leases taken), so a slow
    start on a loaded machine shortens no window; ``setup_s`` bounds how long that may take.
    """
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for index, cfg in enumerate(configs):
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_client_main, daemon=True, args=({**cfg, "proc": index, "address": address}, child))
        proc.start()
        procs.append(proc)
        conns.append(parent)
    for conn in conns:
        if not conn.poll(setup_s) or conn.recv() != "ready":
            raise SystemExit(f"a client process was not set up within {setup_s:.0f} s")
    start_at = time.time() + 0.2
    for conn in conns:
        conn.send((start_at, start_at + wall_s))
    watched = {name: psutil.Process(pid) for name, pid in pids.items()}
    while time.time() < start_at:
        time.sleep(0.01)
    cpu_before = {name: sum(p.cpu_times()[:2]) for name, p in watched.items()}
    load_at_start = os.getloadavg()
    peak = dict.fromkeys(watched, 0)
    while time.time() < start_at + wall_s:
        for name, p in watched.items():
            peak[name] = max(peak[name], p.memory_info().rss)
        time.sleep(0.25)
    cpu_cores = {name: (sum(p.cpu_times()[:2]) - cpu_before[name]) / wall_s for name, p in watched.items()}
    load_at_end = os.getloadavg()
    results = [conn.recv() for conn in conns]
    for proc in procs:
        proc.join(timeout=30)
    seconds: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    lease_ops: dict[str, int] = defaultdict(int)
    lag: list[float] = []
    for result in results:
        for rpc, values in result["seconds"].items():
            seconds[rpc].extend(values)
        for rpc, codes in result["errors"].items():
            for code, n in codes.items():
                errors[rpc][code] += n
        for rpc, n in result["lease_ops"].items():
            lease_ops[rpc] += n
        lag.extend(result["lag_s"])
    server = next(iter(watched))
    cpu_cores["clients"] = sum(r["cpu_s"] for r in results) / wall_s
    rpcs_per_s = sum(len(v) for v in seconds.values()) / wall_s
    ops_per_s = sum(lease_ops.values()) / wall_s
    available = len(os.sched_getaffinity(0))
    busy = cpu_cores[server] + cpu_cores["clients"]
    return {"wall_s": wall_s, "client_procs": len(configs), "rpcs": _summary(seconds, errors, lease_ops, wall_s),
            "rpcs_per_s": rpcs_per_s, "lease_ops_per_s": ops_per_s, "cpu_cores_used": cpu_cores,
            "load_avg_at_start": load_at_start, "load_avg_at_end": load_at_end,
            "box": {"available_cores": available, "server_plus_client_cores": busy,
                    "oversubscribed": busy > available},
            "client_cpu_us_per_rpc": cpu_cores["clients"] * 1e6 / max(1.0, rpcs_per_s),
            "server_cpu_us_per_rpc": cpu_cores[server] * 1e6 / max(1.0, rpcs_per_s),
            "server_cpu_us_per_lease_op": cpu_cores[server] * 1e6 / max(1.0, ops_per_s),
            **latency_ms([v for values in seconds.values() for v in values]),
            "peak_rss_mb": {k: v / 2**20 for k, v in peak.items()},
            "client_lag_p99_ms": latency_ms(lag)["p99_ms"] if lag else 0.0}


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def storm(address: str, leased: list[str], pids: dict[str, int], args: argparse.Namespace,
          holder: str = "holder") -> dict[str, Any]:
    """Closed loop from --client-procs processes: the ceiling (and queueing latency) of RenewLeases + polls."""
    configs = [{"mode": "closed", "callers": n, "lease_ids": leased, "holder": holder, "channels": args.channels}
               for n in _split(args.rollout_workers, args.client_procs)]
    return run_clients(address, configs, pids, args.storm_s, setup_s=120.0)


def open_loop(address: str, rate: float, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """Open loop at ``rate`` lease ops/s: batched renewals of held leases plus task turnover."""
    renew_ops = args.open_workers * args.open_leases / args.renew_s
    task_rate = (rate - renew_ops) / 2  # a turnover is one report and one lease
    if task_rate < 0:
        raise SystemExit(f"--open-workers x --open-leases / --renew-s = {renew_ops:.0f} lease ops/s of renewals "
                         f"alone exceeds the rate {rate:.0f}")
    configs = [{"mode": "open", "workers": n, "leases": args.open_leases, "renew_s": args.renew_s,
                "task_rate_per_worker": task_rate / args.open_workers, "channels": args.channels}
               for n in _split(args.open_workers, args.client_procs)]
    result = run_clients(address, configs, pids, args.open_s, setup_s=120.0 + args.open_workers / 30)
    result["offered"] = {"lease_ops_per_s": rate, "renewal_lease_ops_per_s": renew_ops,
                         "renew_rpcs_per_s": args.open_workers / args.renew_s, "task_turnovers_per_s": task_rate,
                         "rpcs_per_s": args.open_workers / args.renew_s + 2 * task_rate,
                         "leases_held": args.open_workers * args.open_leases,
                         "mean_task_s": args.open_workers * args.open_leases / task_rate if task_rate else None}
    return result


async def _empty_renew(request: Any, context: Any) -> orchestrator_pb2.RenewLeasesResponse:
    return orchestrator_pb2.RenewLeasesResponse()


async def _empty_lease(request: Any, context: Any) -> orchestrator_pb2.LeaseRolloutTasksResponse:
    return orchestrator_pb2.LeaseRolloutTasksResponse()


def _bare_server_main(conn: multiprocessing.connection.Connection) -> None:
    """A grpc.aio server whose RenewLeases and LeaseRolloutTasks only build an empty reply."""

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flexmarl.v1.Orchestrator", {
            "RenewLeases": grpc.unary_unary_rpc_method_handler(
                _empty_renew, orchestrator_pb2.RenewLeasesRequest.FromString,
                orchestrator_pb2.RenewLeasesResponse.SerializeToString),
            "LeaseRolloutTasks": grpc.unary_unary_rpc_method_handler(
                _empty_lease, orchestrator_pb2.LeaseRolloutTasksRequest.FromString,
                orchestrator_pb2.LeaseRolloutTasksResponse.SerializeToString),
        }),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


def baseline(args: argparse.Namespace) -> dict[str, Any]:
    """Phase 3: the closed loop against a bare grpc.aio server."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_bare_server_main, args=(child,), daemon=True)
    server.start()
    try:
        port = parent.recv()
        return storm(f"127.0.0.1:{port}", [f"bare-{i}" for i in range(args.rollout_workers)],
                     {"bare_grpc": int(server.pid or 0)}, args)
    finally:
        server.terminate()
        server.join(timeout=10)


async def run(orch_address: str, store_address: str, pids: dict[str, int],
              args: argparse.Namespace) -> dict[str, Any]:
    """Phases 1 and 2 (one asyncio process), and the job the open loop turns over."""
    cluster = Cluster(orch_address, store_address, args.channels)
    sampler = RssSampler(pids)
    sampler.start()
    try:
        driven = await drive(cluster, sampler, args)
        held, leased = await hold(cluster, sampler, args)
        spec = job_spec("open", args.open_prompts, 2, 1000, 9)
        await cluster.orch[0].SubmitJob(orchestrator_pb2.SubmitJobRequest(spec_json=spec, job_id="load-open"),
                                        timeout=10)
    finally:
        await sampler.stop()
        await cluster.close()
    peaks = {name: sampler.peak(name) / 2**20 for name in pids}
    return {"drive": driven, "hold": held, "peak_rss_mb": peaks, "held_lease_ids": [t.lease_id for t in leased]}


def _lease_ops(rpcs: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """Total ops/s and the worst p99 over the orchestrator's lease RPCs."""
    rows = [rpcs[r] for r in LEASE_RPCS if r in rpcs]
    return sum(r["ops_per_s"] for r in rows), max((r["p99_ms"] for r in rows), default=float("nan"))


RPC_COLUMNS = [
    Column("phase/rpc", 36, "<"),
    Column("count", 9),
    Column("RPC/s", 9, fmt=".0f"),
    Column("lease op/s", 10, fmt=".0f"),
    Column("p50 ms", 9, fmt=".2f"),
    Column("p99 ms", 9, fmt=".2f"),
    Column("max ms", 9, fmt=".1f"),
    Column("errors", 0, "<", gap="  "),
]


def _rows(phase: str, rpcs: dict[str, dict[str, Any]]) -> list[list[object]]:
    return [
        [phase + "/" + rpc, row["count"], row["ops_per_s"], row.get("lease_ops_per_s"), row["p50_ms"],
         row["p99_ms"], row["max_ms"], ",".join(f"{k}={v}" for k, v in row["errors"].items()) or "-"]
        for rpc, row in rpcs.items()
    ]


def print_report(report: dict[str, Any]) -> None:
    """A human-readable table of the report."""
    d, h, s, b = report["drive"], report["hold"], report["storm"], report["baseline"]
    print(f"drive: job {d['job_state']} in {d['wall_s']:.1f} s, {d['committed_steps_all_agents']} agent-steps "
          f"committed ({d['steps_per_s']:.2f}/s), tasks {d['tasks_done']}/{d['tasks_total']}")
    rows = _rows("drive", d["rpcs"]) + _rows("baseline(bare grpc.aio)", b["rpcs"]) + _rows("storm(closed)", s["rpcs"])
    for run in report["open"]:
        rows += _rows(f"open@{run['offered']['lease_ops_per_s']:.0f}", run["rpcs"])
    print("\n".join(render_table(RPC_COLUMNS, rows, sep="")))
    for name, m in d["memory"].items():
        print(f"{name}: RSS start {m['rss_start_mb']:.1f} MiB, after warm-up {m['rss_after_warmup_mb']:.1f}, "
              f"end {m['rss_end_mb']:.1f}, peak {m['rss_peak_mb']:.1f}; growth after warm-up "
              f"{m['growth_after_warmup_kb_per_committed_step']:.1f} KiB per committed step")
    print(f"hold: {h['leases_in_flight']} leases in flight: orchestratord RSS {h['rss_before_mb']:.1f} -> "
          f"{h['rss_after_mb']:.1f} MiB = {h['bytes_per_lease']:.0f} bytes per lease")
    print("peak RSS (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in report["peak_rss_mb"].items()))
    for name, phase in (("baseline", b), ("storm", s), *((f"open@{r['offered']['lease_ops_per_s']:.0f}", r)
                                                         for r in report["open"])):
        cores = ", ".join(f"{k} {v:.2f}" for k, v in phase["cpu_cores_used"].items())
        print(f"{name:<12} {phase['rpcs_per_s']:>7,.0f} RPC/s {phase['lease_ops_per_s']:>7,.0f} lease ops/s  "
              f"p50 {phase['p50_ms']:6.2f} p99 {phase['p99_ms']:7.2f} max {phase['max_ms']:7.1f} ms  "
              f"server {phase['server_cpu_us_per_rpc']:.0f} us CPU/RPC, clients {phase['client_cpu_us_per_rpc']:.0f}; "
              f"cores busy: {cores}; client lag p99 {phase['client_lag_p99_ms']:.1f} ms")
        box = phase["box"]
        verdict = ("OVERSUBSCRIBED (latency measures the box, not the server)" if box["oversubscribed"]
                   else "not oversubscribed")
        print(f"{'':<12} box: server + clients = {box['server_plus_client_cores']:.2f} of "
              f"{box['available_cores']} cores: {verdict}; "
              f"load average {phase['load_avg_at_start'][0]:.2f} -> {phase['load_avg_at_end'][0]:.2f} "
              f"(other work on the machine counts there too)")
    print(f"storm / bare grpc.aio RPC/s: {s['rpcs_per_s'] / b['rpcs_per_s']:.2f}")
    for run, met in zip(report["open"], report["targets"]["open"], strict=True):
        o = run["offered"]
        print(f"open loop offered {o['lease_ops_per_s']:,.0f} lease ops/s ({o['rpcs_per_s']:,.0f} RPC/s: "
              f"{o['renew_rpcs_per_s']:.0f} RenewLeases of {report['settings']['open_leases']} leases, "
              f"{o['task_turnovers_per_s']:.0f} report+lease turnovers; {o['leases_held']} leases held) -> achieved "
              f"{run['lease_ops_per_s']:,.0f} lease ops/s, {run['rpcs_per_s']:,.0f} RPC/s, worst RPC p99 "
              f"{met['worst_p99_ms']:.2f} ms: rate {'met' if met['rate_met'] else 'MISSED'}, "
              f"p99 < {TARGET_P99_MS} ms {'met' if met['p99_met'] else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-workers", type=int, default=200,
                        help="concurrent simulated rollout tasks (drive) and closed-loop callers (storm)")
    parser.add_argument("--rollout-worker-ids", type=int, default=8, help="distinct rolloutd ids they act as")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels per client process")
    parser.add_argument("--client-procs", type=int, default=3, help="client processes of phases 3-5")
    parser.add_argument("--steps", type=int, default=60, help="total_steps of the driven job")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--response-tokens", type=int, default=8)
    parser.add_argument("--drive-s", type=float, default=90.0, help="time limit of the driven job")
    parser.add_argument("--hold-prompts", type=int, default=1000, help="prompts per step of the held job (x10)")
    parser.add_argument("--storm-s", type=float, default=10.0)
    parser.add_argument("--open-rates", default="5000", help="comma-separated offered lease ops/s of the open loop")
    parser.add_argument("--open-workers", type=int, default=1000, help="simulated rolloutds of the open loop")
    parser.add_argument("--open-leases", type=int, default=8, help="task leases each holds (rolloutd max_tasks)")
    parser.add_argument("--renew-s", type=float, default=2.0, help="renewal period (rolloutd's RENEW_INTERVAL_S)")
    parser.add_argument("--open-s", type=float, default=10.0, help="duration of each open-loop rate")
    parser.add_argument("--open-prompts", type=int, default=8192, help="prompts per step of the turned-over job")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rates = [float(r) for r in args.open_rates.split(",") if r.strip()]
    load_at_start = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp_name, \
            control_plane(Path(tmp_name)) as (_, stored, orch):
        pids = {"orchestratord": orch.pid, "stored": stored.pid}
        result = asyncio.run(run(orch.address, stored.address, pids, args))
        leased = result.pop("held_lease_ids")
        result["baseline"] = baseline(args)
        result["storm"] = storm(orch.address, leased, {"orchestratord": orch.pid}, args)
        result["open"] = [open_loop(orch.address, rate, {"orchestratord": orch.pid}, args) for rate in rates]
        for phase in (result["storm"], *result["open"]):
            result["peak_rss_mb"]["orchestratord"] = max(result["peak_rss_mb"]["orchestratord"],
                                                         phase["peak_rss_mb"]["orchestratord"])

    ops, p99 = result["storm"]["lease_ops_per_s"], result["storm"]["p99_ms"]
    drive_ops, drive_p99 = _lease_ops(result["drive"]["rpcs"])
    open_targets = []
    for run_ in result["open"]:
        worst = max(row["p99_ms"] for row in run_["rpcs"].values())
        open_targets.append({"offered": run_["offered"]["lease_ops_per_s"], "worst_p99_ms": worst,
                             "rate_met": run_["lease_ops_per_s"] >= 0.97 * run_["offered"]["lease_ops_per_s"]
                             and run_["offered"]["lease_ops_per_s"] >= TARGET_LEASE_OPS_PER_S,
                             "p99_met": worst < TARGET_P99_MS})
    report = {
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "lease_op_counting": "RenewLeases of k leases = k lease ops; each task leased = 1; each task reported = 1",
        **result,
        "targets": {"lease_ops_per_s": TARGET_LEASE_OPS_PER_S, "p99_ms": TARGET_P99_MS,
                    "storm_ops_met": ops >= TARGET_LEASE_OPS_PER_S, "storm_p99_met": p99 < TARGET_P99_MS,
                    "storm_vs_bare_grpc_rpcs": result["storm"]["rpcs_per_s"] / result["baseline"]["rpcs_per_s"],
                    "drive_lease_ops_per_s": drive_ops, "drive_worst_p99_ms": drive_p99,
                    "drive_p99_met": drive_p99 < TARGET_P99_MS, "open": open_targets},
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
