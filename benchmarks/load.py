"""Load on orchestratord and stored: many simulated rollout and trainer workers on loopback.

Usage: python benchmarks/load.py [--rollout-workers 200] [--steps 60] [--drive-s 90] [--storm-s 10]

Starts etcd, a real stored (fsync on every commit) and a real orchestratord as subprocesses, then
runs three phases from one asyncio process over a few shared gRPC channels:

1. drive: a real 2-agent job through the planner. Hundreds of simulated rolloutd tasks long-poll
   LeaseRolloutTasks, append tiny synthetic experiences to stored (one AppendExperiences per task),
   renew, and report; simulated traind slots (one per agent) poll, ack micro-batches and commit
   steps with a fake weights_uri (file:///tmp/x). Ends when the job succeeds or --drive-s passes.
   RSS of both daemons is sampled throughout (growth per committed step).
2. hold: a second job admits many tasks at once; the benchmark leases them all without reporting and
   reads orchestratord's RSS before and after (state bytes per lease in flight).
3. storm: the same hundreds of tasks call RenewLeases (one held lease each) and non-blocking
   LeaseRolloutTasks as fast as they can for --storm-s: the lease-operation ceiling.

Prints a table and writes benchmarks/results/load.json. The client shares the machine's cores with
the daemons, so the numbers are a lower bound of what orchestratord alone can serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np
import psutil

from flexmarl.cluster import DaemonProcess, EtcdServer
from flexmarl.experience import ExperienceRecord, experience_id, group_id
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc, store_pb2, store_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
AGENTS = ("alice", "bob")
TARGET_LEASE_OPS_PER_S = 5000.0
TARGET_P99_MS = 10.0
LEASE_RPCS = ("LeaseRolloutTasks", "RenewLeases", "ReportRolloutTask", "PollTrainerWork", "AckMicroBatch",
              "CommitStep")

T = TypeVar("T")


def job_spec(name: str, prompts_per_step: int, group_size: int, total_steps: int, max_staleness: int) -> str:
    """A 2-agent job spec (models are never loaded: the workers are simulated)."""
    agent = {"model": "/nonexistent/tiny", "sampling": {"max_new_tokens": 4}}
    return json.dumps({
        "name": name, "seed": 0,
        "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [{"name": a, **agent} for a in AGENTS],
        "algorithm": {"name": "grpo"},
        "batch": {"prompts_per_step": prompts_per_step, "group_size": group_size,
                  "micro_batch_size": group_size * max(1, prompts_per_step // 4)},
        "total_steps": total_steps, "pipeline": {"mode": "async", "max_staleness": max_staleness},
        "leases": {"rollout_timeout_s": 600, "train_timeout_s": 600},
    })


class Recorder:
    """Latency samples and error counts per RPC."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    async def timed(self, rpc: str, method: Callable[..., Awaitable[T]], request: Any) -> T | None:
        """Calls method(request), recording its latency; None (and an error count) when it failed."""
        start = time.perf_counter()
        try:
            result = await method(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            self.errors[rpc][exc.code().name] += 1
            return None
        self.seconds[rpc].append(time.perf_counter() - start)
        return result

    def summary(self, wall_s: float) -> dict[str, dict[str, Any]]:
        """count, ops/s, p50/p99/max ms per RPC."""
        out: dict[str, dict[str, Any]] = {}
        for rpc, samples in sorted(self.seconds.items()):
            ms = np.array(samples) * 1000
            out[rpc] = {"count": len(samples), "ops_per_s": len(samples) / wall_s,
                        "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                        "max_ms": float(ms.max()), "errors": dict(self.errors.get(rpc, {}))}
        return out


class RssSampler:
    """Samples the RSS of some processes every interval_s."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def rss(self, name: str) -> int:
        """RSS of one process now (bytes)."""
        return int(self._procs[name].memory_info().rss)

    def sample(self) -> None:
        """One sample of every process."""
        now = time.monotonic()
        for name in self._procs:
            self.samples[name].append((now, self.rss(name)))

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        """Starts sampling in the background."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops sampling."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def peak(self, name: str) -> int:
        """Largest RSS sampled."""
        return max(v for _, v in self.samples[name])


def experiences_of(task: Any, versions: dict[str, int], tokens: int) -> list[ExperienceRecord]:
    """Tiny synthetic experiences of one task: every sample x every agent, one turn each."""
    rng = np.random.default_rng(task.task_index)
    out = []
    for sample in range(task.group_size):
        for agent in AGENTS:
            out.append(ExperienceRecord(
                experience_id=experience_id(task.task_id, sample, agent, 0), job_id=task.job_id, agent=agent,
                task_id=task.task_id, group_id=group_id(task.task_id, agent), sample_index=sample,
                episode_id=f"{task.task_id}-{sample}", turn=0, behavior_version=versions.get(agent, 0),
                reward=float(rng.random()), prompt_token_ids=np.arange(4, dtype=np.int32),
                response_token_ids=rng.integers(0, 256, tokens, dtype=np.int32),
                response_logprobs=-rng.random(tokens, dtype=np.float32), group_size=task.group_size,
            ))
    return out


class Cluster:
    """Stubs over a few shared channels, round-robin."""

    def __init__(self, orch_address: str, store_address: str, channels: int) -> None:
        self.channels = [grpc.aio.insecure_channel(orch_address) for _ in range(channels)]
        self.store_channels = [grpc.aio.insecure_channel(store_address) for _ in range(channels)]
        self.orch = [orchestrator_pb2_grpc.OrchestratorStub(c) for c in self.channels]
        self.store = [store_pb2_grpc.StoreStub(c) for c in self.store_channels]

    async def close(self) -> None:
        """Closes every channel."""
        for channel in (*self.channels, *self.store_channels):
            await channel.close()


async def rollout_worker(index: int, cluster: Cluster, rec: Recorder, stop: asyncio.Event, job_done: asyncio.Event,
                         tokens: int, worker_ids: int) -> None:
    """Simulated rolloutd task: lease -> append to stored -> renew -> report, until the job ends."""
    orch = cluster.orch[index % len(cluster.orch)]
    store = cluster.store[index % len(cluster.store)]
    worker_id = f"rw-{index % worker_ids}"
    while not stop.is_set() and not job_done.is_set():
        reply = await rec.timed("LeaseRolloutTasks", orch.LeaseRolloutTasks,
            orchestrator_pb2.LeaseRolloutTasksRequest(worker_id=worker_id, max_tasks=1, wait_ms=500))
        if reply is None or not reply.tasks:
            continue
        for task in reply.tasks:
            versions = {v.agent: v.version for v in task.agent_versions}
            records = experiences_of(task, versions, tokens)
            appended = await rec.timed("AppendExperiences", store.AppendExperiences,
                store_pb2.AppendExperiencesRequest(experiences=[r.to_proto() for r in records]))
            await rec.timed("RenewLeases", orch.RenewLeases,
                orchestrator_pb2.RenewLeasesRequest(worker_id=worker_id, lease_ids=[task.lease_id]))
            summaries = [orchestrator_pb2.ExperienceSummary(
                experience_id=r.experience_id, agent=r.agent, group_id=r.group_id, sample_index=r.sample_index,
                behavior_version=r.behavior_version, response_tokens=len(r.response_token_ids), reward=r.reward)
                for r in records]
            await rec.timed("ReportRolloutTask", orch.ReportRolloutTask, orchestrator_pb2.ReportRolloutTaskRequest(
                lease_id=task.lease_id, worker_id=worker_id, task_id=task.task_id, succeeded=appended is not None,
                error="" if appended is not None else "append failed", experiences=summaries))


async def trainer_slot(index: int, cluster: Cluster, rec: Recorder, stop: asyncio.Event, job_done: asyncio.Event,
                       commits: list[float]) -> None:
    """Simulated traind slot: poll -> ack micro-batches -> commit optimizer steps with fake weights."""
    orch = cluster.orch[index % len(cluster.orch)]
    worker_id, slot_id = f"tw-{index}", f"tw-{index}/0"
    resident: dict[tuple[str, str], int] = {}
    while not stop.is_set() and not job_done.is_set():
        request = orchestrator_pb2.PollTrainerWorkRequest(worker_id=worker_id, slot_id=slot_id, wait_ms=500, resident=[
            orchestrator_pb2.ResidentAgent(job_id=j, agent=a, version=v) for (j, a), v in resident.items()])
        work = await rec.timed("PollTrainerWork", orch.PollTrainerWork, request)
        if work is None:
            continue
        kind = work.WhichOneof("work")
        if kind == "micro_batch":
            mb = work.micro_batch
            resident[(mb.job_id, mb.agent)] = mb.base_version
            await rec.timed("AckMicroBatch", orch.AckMicroBatch, orchestrator_pb2.AckMicroBatchRequest(
                lease_id=mb.lease_id, worker_id=worker_id, slot_id=slot_id, loss_sum=0.0,
                tokens=len(mb.experience_ids), episodes=0))
        elif kind == "optimizer_step":
            step = work.optimizer_step
            ok = await rec.timed("CommitStep", orch.CommitStep, orchestrator_pb2.CommitStepRequest(
                worker_id=worker_id, slot_id=slot_id, job_id=step.job_id, agent=step.agent, step=step.step,
                new_version=step.new_version, weights_uri="file:///tmp/x", state_uri="file:///tmp/x"))
            if ok is not None:
                resident[(step.job_id, step.agent)] = step.new_version
                commits.append(time.monotonic())
        elif kind == "swap_out":
            swap = work.swap_out
            resident.pop((swap.job_id, swap.agent), None)
            await rec.timed("ReportSlotEvent", orch.ReportSlotEvent, orchestrator_pb2.ReportSlotEventRequest(
                worker_id=worker_id, slot_id=slot_id, job_id=swap.job_id, agent=swap.agent,
                kind=orchestrator_pb2.ReportSlotEventRequest.KIND_SWAPPED_OUT, state_uri="file:///tmp/x"))


async def watch_job(orch: Any, job_id: str, done: asyncio.Event, stop: asyncio.Event) -> str:
    """Sets done when the job reaches a terminal state; returns that state's name."""
    terminal = {orchestrator_pb2.JOB_STATE_SUCCEEDED, orchestrator_pb2.JOB_STATE_FAILED,
                orchestrator_pb2.JOB_STATE_CANCELLED}
    while not stop.is_set():
        status = await orch.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=10)
        if status.state in terminal:
            done.set()
            return str(orchestrator_pb2.JobState.Name(status.state))
        await asyncio.sleep(0.25)
    return "TIMED_OUT"


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


async def storm(cluster: Cluster, leased: list[Any], pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """Phase 3: RenewLeases and non-blocking LeaseRolloutTasks as fast as the client can send them."""
    rec = Recorder()
    stop = asyncio.Event()

    async def one(index: int) -> None:
        orch = cluster.orch[index % len(cluster.orch)]
        lease = leased[index % len(leased)] if leased else None
        renew = orchestrator_pb2.RenewLeasesRequest(worker_id="holder", lease_ids=[lease.lease_id] if lease else [])
        poll = orchestrator_pb2.LeaseRolloutTasksRequest(worker_id=f"storm-{index}", max_tasks=1, wait_ms=0)
        while not stop.is_set():
            await rec.timed("RenewLeases", orch.RenewLeases, renew)
            await rec.timed("LeaseRolloutTasks", orch.LeaseRolloutTasks, poll)

    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    procs["client"] = psutil.Process()
    cpu_before = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    start = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(args.rollout_workers)]
    await asyncio.sleep(args.storm_s)
    stop.set()
    await asyncio.gather(*tasks)
    wall_s = time.monotonic() - start
    cpu_cores = {name: (sum(p.cpu_times()[:2]) - cpu_before[name]) / wall_s for name, p in procs.items()}
    rpcs = rec.summary(wall_s)
    all_ms = np.array([s for v in rec.seconds.values() for s in v]) * 1000
    return {"wall_s": wall_s, "rpcs": rpcs, "lease_ops_per_s": len(all_ms) / wall_s, "cpu_cores_used": cpu_cores,
            "orchestratord_cpu_us_per_op": cpu_cores["orchestratord"] * 1e6 / max(1.0, len(all_ms) / wall_s),
            "p50_ms": float(np.percentile(all_ms, 50)), "p99_ms": float(np.percentile(all_ms, 99))}


async def run(orch_address: str, store_address: str, pids: dict[str, int],
              args: argparse.Namespace) -> dict[str, Any]:
    """All three phases."""
    cluster = Cluster(orch_address, store_address, args.channels)
    sampler = RssSampler(pids)
    sampler.start()
    try:
        driven = await drive(cluster, sampler, args)
        held, leased = await hold(cluster, sampler, args)
        stormed = await storm(cluster, leased, pids, args)
    finally:
        await sampler.stop()
        await cluster.close()
    peaks = {name: sampler.peak(name) / 2**20 for name in pids}
    return {"drive": driven, "hold": held, "storm": stormed, "peak_rss_mb": peaks}


def _lease_ops(rpcs: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """Total ops/s and the worst p99 over the orchestrator's lease RPCs."""
    rows = [rpcs[r] for r in LEASE_RPCS if r in rpcs]
    return sum(r["ops_per_s"] for r in rows), max((r["p99_ms"] for r in rows), default=float("nan"))


def print_report(report: dict[str, Any]) -> None:
    """A human-readable table of the report."""
    d, h, s = report["drive"], report["hold"], report["storm"]
    print(f"drive: job {d['job_state']} in {d['wall_s']:.1f} s, {d['committed_steps_all_agents']} agent-steps "
          f"committed ({d['steps_per_s']:.2f}/s), tasks {d['tasks_done']}/{d['tasks_total']}")
    print(f"{'phase/rpc':<32}{'count':>9}{'ops/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}  errors")
    for phase, rpcs in (("drive", d["rpcs"]), ("storm", s["rpcs"])):
        for rpc, row in rpcs.items():
            errors = ",".join(f"{k}={v}" for k, v in row["errors"].items()) or "-"
            print(f"{phase + '/' + rpc:<32}{row['count']:>9}{row['ops_per_s']:>10.0f}{row['p50_ms']:>9.2f}"
                  f"{row['p99_ms']:>9.2f}{row['max_ms']:>9.1f}  {errors}")
    for name, m in d["memory"].items():
        print(f"{name}: RSS start {m['rss_start_mb']:.1f} MiB, after warm-up {m['rss_after_warmup_mb']:.1f}, "
              f"end {m['rss_end_mb']:.1f}, peak {m['rss_peak_mb']:.1f}; growth after warm-up "
              f"{m['growth_after_warmup_kb_per_committed_step']:.1f} KiB per committed step")
    print(f"hold: {h['leases_in_flight']} leases in flight: orchestratord RSS {h['rss_before_mb']:.1f} -> "
          f"{h['rss_after_mb']:.1f} MiB = {h['bytes_per_lease']:.0f} bytes per lease")
    cores = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_cores_used"].items())
    print(f"storm CPU (cores busy): {cores}; orchestratord {s['orchestratord_cpu_us_per_op']:.0f} us CPU per op")
    t = report["targets"]
    print(f"storm: {s['lease_ops_per_s']:,.0f} lease ops/s, p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms "
          f"-> target >= {TARGET_LEASE_OPS_PER_S:,.0f}/s: {'met' if t['storm_ops_met'] else 'MISSED'}; "
          f"p99 < {TARGET_P99_MS} ms: {'met' if t['storm_p99_met'] else 'MISSED'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-workers", type=int, default=200, help="concurrent simulated rollout tasks")
    parser.add_argument("--rollout-worker-ids", type=int, default=8, help="distinct rolloutd ids they act as")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels shared by the tasks")
    parser.add_argument("--steps", type=int, default=60, help="total_steps of the driven job")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--response-tokens", type=int, default=8)
    parser.add_argument("--drive-s", type=float, default=90.0, help="time limit of the driven job")
    parser.add_argument("--hold-prompts", type=int, default=1000, help="prompts per step of the held job (x10)")
    parser.add_argument("--storm-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_at_start = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = EtcdServer(tmp / "etcd")
        etcd.start()
        stored = DaemonProcess("stored", ["--data-dir", str(tmp / "data"), "--log-level", "WARNING"],
                               etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
        orch: DaemonProcess | None = None
        try:
            stored.start()
            orch = DaemonProcess("orchestratord", ["--store-address", stored.address, "--log-level", "WARNING"],
                                 etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
            orch.start()
            result = asyncio.run(run(orch.address, stored.address,
                                     {"orchestratord": orch.pid, "stored": stored.pid}, args))
        finally:
            if orch is not None:
                orch.terminate()
            stored.terminate()
            etcd.stop()

    ops, p99 = result["storm"]["lease_ops_per_s"], result["storm"]["p99_ms"]
    drive_ops, drive_p99 = _lease_ops(result["drive"]["rpcs"])
    report = {
        "command": "python benchmarks/load.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **result,
        "targets": {"lease_ops_per_s": TARGET_LEASE_OPS_PER_S, "p99_ms": TARGET_P99_MS,
                    "storm_ops_met": ops >= TARGET_LEASE_OPS_PER_S, "storm_p99_met": p99 < TARGET_P99_MS,
                    "drive_lease_ops_per_s": drive_ops, "drive_worst_p99_ms": drive_p99,
                    "drive_p99_met": drive_p99 < TARGET_P99_MS},
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
