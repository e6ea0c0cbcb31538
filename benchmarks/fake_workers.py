"""Simulated rollout and trainer workers that drive a real job through orchestratord and stored.

Shared by the load benchmark (``benchmarks/load.py``) and the soak benchmark (``benchmarks/soak.py``):
rollout tasks lease, append tiny synthetic experiences to stored and report; trainer slots poll,
ack micro-batches and commit steps with a fake weights URI. No model is ever loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np
import psutil

from benchmarks.report import latency_ms
from flexmarl.cluster import DaemonProcess, EtcdServer
from flexmarl.experience import ExperienceRecord, experience_id, group_id
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc, store_pb2, store_pb2_grpc

AGENTS = ("alice", "bob")

T = TypeVar("T")


@contextlib.contextmanager
def control_plane(tmp: Path, etcd_env: Mapping[str, str] | None = None, orch_args: Sequence[str] = (),
                  ) -> Iterator[tuple[EtcdServer, DaemonProcess, DaemonProcess]]:
    """A real etcd (with ``etcd_env``'s ETCD_* settings), stored and orchestratord under ``tmp``; stopped after.

    ``orch_args``: further orchestratord flags.

    Yields (etcd, stored, orchestratord): what the simulated workers drive.
    """
    etcd = EtcdServer(tmp / "etcd", env=etcd_env)
    etcd.start()
    stored = DaemonProcess("stored", ["--data-dir", str(tmp / "data"), "--log-level", "WARNING"],
                           etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
    orch: DaemonProcess | None = None
    try:
        stored.start()
        orch = DaemonProcess("orchestratord", ["--store-address", stored.address, "--log-level", "WARNING",
                                               *orch_args],
                             etcd_endpoint=etcd.endpoint, run_dir=tmp / "run")
        orch.start()
        yield etcd, stored, orch
    finally:
        if orch is not None:
            orch.terminate()
        stored.terminate()
        etcd.stop()


def job_spec(name: str, prompts_per_step: int, group_size: int, total_steps: int, max_staleness: int,
             agents: Sequence[str] = AGENTS, lease_timeout_s: float = 600.0) -> str:
    """A job spec of ``agents`` (models are never loaded: the workers are simulated)."""
    agent = {"model": "/nonexistent/tiny", "sampling": {"max_new_tokens": 4}}
    return json.dumps({
        "name": name, "seed": 0,
        "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [{"name": a, **agent} for a in agents],
        "algorithm": {"name": "grpo"},
        "batch": {"prompts_per_step": prompts_per_step, "group_size": group_size,
                  "micro_batch_size": group_size * max(1, prompts_per_step // 4)},
        "total_steps": total_steps, "pipeline": {"mode": "async", "max_staleness": max_staleness},
        "leases": {"rollout_timeout_s": lease_timeout_s, "train_timeout_s": lease_timeout_s},
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
            out[rpc] = {"count": len(samples), "ops_per_s": len(samples) / wall_s, **latency_ms(samples),
                        "errors": dict(self.errors.get(rpc, {}))}
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
    """Tiny synthetic experiences of one task: every sample x every agent of ``versions``, one turn each."""
    rng = np.random.default_rng(task.task_index)
    out = []
    for sample in range(task.group_size):
        for agent in versions:
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
                lease_id=mb.lease_id, worker_id=worker_id, slot_id=slot_id, episodes=0))
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
