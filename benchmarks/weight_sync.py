"""Version-change-to-serving latency: disk sync vs distributed sync (the integration of issue 16).

Usage: python benchmarks/weight_sync.py [--rounds 3] [--layers 12] [--hidden 768] [--intermediate 3072]

On CPU, with a config-only Qwen2 model of about 100 M parameters (random init, no download) served
by 2 embedded engine replicas (subprocesses, the real HTTP server), each round times, from "the
optimizer step is done" (the trainer holds the new parameters) to "every replica serves the new
version" (``/model_info`` reports it):

* disk: publish a safetensors checkpoint as traind does (``save_pretrained`` beside the target,
  tokenizer copied, renamed into place; a ``file://`` location), then ``/update_weights_from_disk``
  on both replicas at once;
* disk via stored (``publish_location: stored``, the path of a cluster without shared storage):
  the same publish, then traind's upload of the directory as one tar blob
  (:func:`flexmarl.artifacts.publish_dir`) into a real stored daemon, then rolloutd's download and
  unpack (:func:`flexmarl.artifacts.resolve_dir`, once for the node's 2 replicas) and
  ``/update_weights_from_disk`` on both;
* distributed (fp32 and bf16 on the wire): the production path of ``rollout.weight_sync:
  distributed`` minus the two RPC hops (AnnounceWeights, the WatchAgentVersions event): traind's
  :class:`traind.weight_sync.AgentBroadcast` announces the version (bucket plan, 256 MiB
  buckets) and pushes it on a thread while the durable copy is written on another (as
  ``traind/worker.py`` does: the commit waits for both), and rolloutd's router
  (:meth:`rolloutd.router.RolloutRouter.receive_broadcast`: drain the replicas, answer rank 0 on
  its store, replay the plan with ``/begin_weight_update``, ``/update_weights_from_distributed``
  per bucket, ``/end_weight_update``, verify ``/model_info``) brings both replicas to the version.
  The group is formed by a first version before the timed rounds (membership changes only at
  version boundaries; the formation time is reported). The time until the durable copy is
  written too (the commit could go out) is reported beside.

Two bounds are printed beside the distributed rows, each measured bare (:class:`BareBroadcast`: 3
processes kept for the run, nothing of the path running while they time a round, 2 rounds of
each right after every distributed round so that they see the load the rounds saw): the gloo
broadcast of the same tensors to 2 ranks (issue 35's bound), and that broadcast plus each
receiver's copy of the received tensors into its parameters (the copy SGLang's loader makes).

After the last distributed round, a greedy generation's logprobs on each replica are checked
against the trainer's forward pass (the broadcast delivered the right weights).

The same comparison at 14.7 B parameters comes from :mod:`flexmarl.devicemodel` (H100 profile:
bf16 weights, 50 GB/s link): distributed = weights over the link once (a pipelined broadcast
reaches every replica in about the time of one copy); disk = written once at the storage's write
bandwidth, then read by every replica at its read bandwidth (concurrently) and moved over the link
into device memory. Storage figures are assumptions, given in the table: stored's measured blob
path (benchmarks/stored.py: 286 MiB/s put, 316 MiB/s get) and a local NVMe (2 GB/s write, 3 GB/s
read).

Prints a table and writes benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.report import Column, render_table  # noqa: E402
from flexmarl import devicemodel  # noqa: E402
from flexmarl.artifacts import publish_dir, resolve_dir  # noqa: E402
from flexmarl.cluster import DaemonProcess, EtcdServer  # noqa: E402
from flexmarl.store_client import StoreClient  # noqa: E402
from flexmarl.tiny import build_tiny_checkpoint  # noqa: E402
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch  # noqa: E402
from rolloutd.engines.protocol import GenerationRequest, SamplingParams  # noqa: E402
from rolloutd.engines.sglang.client import SGLangClient  # noqa: E402
from rolloutd.router import Replica, RolloutRouter  # noqa: E402
from rolloutd.weight_sync import SYNC_PHASES  # noqa: E402
from traind.weight_sync import AgentBroadcast, distinct_tensors  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "weight_sync.json"
REPLICAS = 2
AGENT = "bench/agent"
BUCKET_BYTES = 256 * 1024 * 1024
#: The wires of the distributed rows (torch dtype names).
WIRES = {"fp32": "float32", "bf16": "bfloat16"}
#: Rounds of each bound timed right after each distributed round.
BOUND_SAMPLES = 2
MIB = 1024 * 1024
# Storage assumptions of the modelled rows (bytes/s): (label, write, read).
STORAGE = (
    ("stored blobs (measured)", 286 * MIB, 316 * MIB),
    ("local NVMe (assumed)", 2.0e9, 3.0e9),
)


def _publish(model: Any, checkpoint: Path, target: Path) -> None:
    """traind's publish (model.py ``AgentTrainer.publish``): save beside the target, copy the tokenizer, rename."""
    staging = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, staging / name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)


def _next_version(model: Any, seed: int) -> None:
    """Stand in for an optimizer step: move every parameter a little (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)


async def _serving(clients: list[SGLangClient], version: str) -> None:
    infos = await asyncio.gather(*(client.model_info() for client in clients))
    wrong = [info.weight_version for info in infos if info.weight_version != version]
    if wrong:
        raise RuntimeError(f"replicas serve {wrong}, expected {version}")


async def _disk_round(model: Any, checkpoint: Path, clients: list[SGLangClient], out: Path, version: str,
                      via: tuple[StoreClient, Path] | None = None) -> float:
    """traind publishes, both replicas load the checkpoint from disk; seconds until they serve it.

    ``via`` (a stored client, an unpack directory): the checkpoint travels through stored, as with
    ``publish_location: stored``: a tar blob put by traind, got and unpacked once by the node's rolloutd.
    """
    started_s = time.perf_counter()
    target = out / version
    await asyncio.to_thread(_publish, model, checkpoint, target)
    local, blob = target, ""
    if via is not None:
        store, cache = via
        uri = await publish_dir(target, f"weights/bench/agent/{version}.tar", store)
        local, blob = await resolve_dir(uri, cache, store), uri.removeprefix("stored://")
    await asyncio.gather(*(client.update_weights_from_disk(str(local), weight_version=version) for client in clients))
    await _serving(clients, version)
    seconds = time.perf_counter() - started_s
    shutil.rmtree(target, ignore_errors=True)
    if via is not None:
        shutil.rmtree(local, ignore_errors=True)
        await via[0].delete_blob(blob)
    return seconds


@dataclasses.dataclass(frozen=True)
class DistributedRound:
    """One distributed version: to serving, to commit-ready (durable copy written too), rank 0's broadcast."""

    serving_s: float
    commit_s: float
    broadcast_s: float
    #: The trainer's part before the push (the distinct tensors, the bucket plan) and rolloutd's
    #: phases (:data:`rolloutd.weight_sync.SYNC_PHASES`), seconds each: where serving_s goes.
    prepare_s: float = float("nan")
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    #: CPU seconds the replicas' processes spent from the announcement to serving (all of them).
    replicas_cpu_s: float = float("nan")


async def _distributed_round(
    model: Any, checkpoint: Path, router: RolloutRouter, broadcast: AgentBroadcast, clients: list[SGLangClient],
    out: Path, version: int, send_dtype: torch.dtype | None, durable_write: bool = True,
    replica_pids: tuple[int, ...] = (),
) -> DistributedRound:
    """traind's side (announce, push beside the durable write) and rolloutd's (receive_broadcast), concurrently."""
    started_s = time.perf_counter()
    cpu_started_s = _processes_cpu_s(replica_pids)
    params = distinct_tensors({name: t.detach() for name, t in model.state_dict().items()})
    broadcast.send_dtype = send_dtype
    record = await asyncio.to_thread(broadcast.announce, params)
    record = dataclasses.replace(record, peers=("rolloutd",))  # orchestratord's part: the router's owner
    prepare_s = time.perf_counter() - started_s
    push = asyncio.ensure_future(asyncio.to_thread(broadcast.push, params, version, record))
    target = out / f"v{version}"
    durable = asyncio.ensure_future(asyncio.to_thread(_publish, model, checkpoint, target) if durable_write
                                    else asyncio.sleep(0))
    outcome = await router.receive_broadcast(AGENT, version, record)
    # The router answers once every replica's /model_info named the version: serving.
    serving_s = time.perf_counter() - started_s
    replicas_cpu_s = _processes_cpu_s(replica_pids) - cpu_started_s
    if outcome is None or outcome.failed or len(outcome.served) != len(clients):
        raise RuntimeError(f"v{version} did not reach every replica: {outcome}")
    await _serving(clients, str(version))  # checked again, outside the timing
    report = await push
    await durable
    commit_s = time.perf_counter() - started_s
    shutil.rmtree(target, ignore_errors=True)
    return DistributedRound(serving_s, commit_s, report.seconds if report is not None else float("nan"),
                            prepare_s, dict(outcome.phases), replicas_cpu_s)


def _processes_cpu_s(pids: tuple[int, ...]) -> float:
    """CPU seconds (user + system, every thread) the processes have spent so far (Linux /proc)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def _check_logprobs(model: Any, clients: list[SGLangClient]) -> float:
    """Largest |served - trainer| logprob over a greedy generation on each replica."""
    prompt = (104, 101, 108, 108, 111)
    worst = 0.0
    for client in clients:
        [result] = await client.generate(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=4)))
        ids = torch.tensor([[*prompt, *result.output_ids]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        for i, (token, served) in enumerate(zip(result.output_ids, result.output_token_logprobs, strict=True)):
            worst = max(worst, abs(float(logprobs[len(prompt) - 1 + i, token]) - served))
    return worst


def _modelled_rows(profile: devicemodel.DeviceProfile) -> list[dict[str, Any]]:
    weight_bytes = profile.weight_bytes
    link_s = devicemodel.weight_transfer_s(profile)
    rows = [{"path": "distributed (broadcast over the link)", "seconds": link_s, "assumed": "link 50 GB/s"}]
    for label, write_bps, read_bps in STORAGE:
        seconds = weight_bytes / write_bps + weight_bytes / read_bps + link_s
        rows.append({"path": f"disk via {label}", "seconds": seconds,
                     "assumed": f"write {write_bps / 1e9:.2f} GB/s, read {read_bps / 1e9:.2f} GB/s"})
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="flexmarl-weight-sync-"))
    replicas: list[EngineReplica] = []
    etcd = EtcdServer(work / "etcd")
    stored: DaemonProcess | None = None
    bare: BareBroadcast | None = None
    bounds: dict[tuple[str, bool], list[float]] = {(wire, copy): [] for wire in WIRES for copy in (False, True)}
    bounds_cpu: dict[tuple[str, bool], list[float]] = {key: [] for key in bounds}
    try:
        etcd.start()  # before the daemon is described: its endpoint names etcd's chosen port
        stored = DaemonProcess("stored", ["--data-dir", str(work / "stored"), "--gc-interval-s", "0",
                                          "--log-level", "WARNING"], etcd_endpoint=etcd.endpoint, run_dir=work / "run")
        stored.start()
        checkpoint = build_tiny_checkpoint(
            work / "v0", seed=0, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.hidden // 64,
            num_kv_heads=max(1, args.hidden // 256), head_dim=64, intermediate_size=args.intermediate,
        )
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        model.eval()  # type: ignore[no-untyped-call]
        params = sum(p.numel() for p in model.parameters())
        print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB fp32); "
              f"launching {REPLICAS} embedded replicas", flush=True)
        bare = BareBroadcast([tuple(p.shape) for p in model.parameters()], REPLICAS)
        replicas = list(await asyncio.gather(*(
            launch(ReplicaSpec("embedded", str(checkpoint), seed=0), work / f"run{i}", timeout_s=600)
            for i in range(REPLICAS)
        )))
        clients = [SGLangClient(replica.url, request_timeout_s=900) for replica in replicas]
        replica_pids = tuple(replica.process.pid for replica in replicas if replica.process is not None)
        out = work / "published"
        out.mkdir()

        async def resolve(uri: str) -> str:
            return uri

        router = RolloutRouter([Replica(f"r{i}", client, AGENT, 0) for i, client in enumerate(clients)], resolve)
        await router.set_agents([AGENT])
        router.require(AGENT, 0, str(checkpoint))
        router.set_distributed_sync(AGENT, True)
        broadcast = AgentBroadcast("bench", "agent", timeout_s=600, bucket_bytes=BUCKET_BYTES)
        version = 1  # the first version forms the group (a new epoch); the timed ones keep it
        formed = await _distributed_round(model, checkpoint, router, broadcast, clients, out, version, None)
        store = StoreClient(stored.address)
        cache = work / "unpacked"
        cache.mkdir()
        disk: list[float] = []
        via_stored: list[float] = []
        fp32: list[DistributedRound] = []
        bf16: list[DistributedRound] = []
        for round_index in range(args.rounds):  # interleaved, so load from other work hits all alike
            for kind in ("disk", "stored", "fp32", "bf16"):
                version += 1
                _next_version(model, version)
                if kind in ("disk", "stored"):
                    seconds = await _disk_round(model, checkpoint, clients, out, str(version),
                                                (store, cache) if kind == "stored" else None)
                    (disk if kind == "disk" else via_stored).append(seconds)
                    router.require(AGENT, version, str(out / str(version)))
                    for routed in router.replicas():  # what the router's own disk reload records
                        routed.loaded_version = version
                else:
                    dtype = torch.bfloat16 if kind == "bf16" else None
                    done = await _distributed_round(model, checkpoint, router, broadcast, clients, out, version,
                                                    dtype, not args.without_durable_write, replica_pids)
                    (bf16 if kind == "bf16" else fp32).append(done)
                    for _ in range(BOUND_SAMPLES):  # the bounds, right after the round they bound
                        for copy in (False, True):
                            seconds, receivers_cpu_s = await asyncio.to_thread(bare.time, WIRES[kind], copy)
                            bounds[(kind, copy)].append(seconds)
                            bounds_cpu[(kind, copy)].append(receivers_cpu_s)
            print(f"round {round_index + 1}: disk {disk[-1]:.2f}s, via stored {via_stored[-1]:.2f}s, "
                  f"distributed fp32 {fp32[-1].serving_s:.2f}s, "
                  f"bf16 {bf16[-1].serving_s:.2f}s", flush=True)
        # The last round was bf16: push fp32 once more so the engines hold exactly the trainer's weights.
        version += 1
        await _distributed_round(model, checkpoint, router, broadcast, clients, out, version, None)
        max_logprob_error = await _check_logprobs(model, clients)
        broadcast.close()
        await store.close()
        await router.close()
        for client in clients:
            await client.close()
    finally:
        if bare is not None:
            bare.close()
        for replica in replicas:
            replica.stop(grace_s=10)
        if stored is not None:
            stored.terminate()
        etcd.stop()
        shutil.rmtree(work, ignore_errors=True)
    raw = {wire: statistics.median(bounds[(wire, False)]) for wire in WIRES}
    raw_copy = {wire: statistics.median(bounds[(wire, True)]) for wire in WIRES}
    rounds_by_wire = {"fp32": fp32, "bf16": bf16}

    def paired(wire: str, copy: bool) -> float:
        """Median over the rounds of (the bound timed right after a round) / (that round's serving time)."""
        samples = bounds[(wire, copy)]
        return statistics.median(statistics.median(samples[i * BOUND_SAMPLES:(i + 1) * BOUND_SAMPLES]) / r.serving_s
                                 for i, r in enumerate(rounds_by_wire[wire]))
    profile = devicemodel.DeviceProfile()
    return {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model_params": params,
        "replicas": REPLICAS,
        "rounds": args.rounds,
        "durable_write_beside": not args.without_durable_write,
        "bucket_bytes": BUCKET_BYTES,
        "first_version_with_group_formation_s": formed.serving_s,
        "cpu_seconds": {
            "disk": disk, "disk_via_stored": via_stored,
            "distributed_fp32": [r.serving_s for r in fp32], "distributed_bf16": [r.serving_s for r in bf16],
            "commit_ready_fp32": [r.commit_s for r in fp32], "commit_ready_bf16": [r.commit_s for r in bf16],
            "broadcast_fp32": [r.broadcast_s for r in fp32], "broadcast_bf16": [r.broadcast_s for r in bf16],
        },
        "cpu_median_s": {
            "disk": statistics.median(disk),
            "disk_via_stored": statistics.median(via_stored),
            "distributed_fp32": statistics.median(r.serving_s for r in fp32),
            "distributed_bf16": statistics.median(r.serving_s for r in bf16),
            "commit_ready_fp32": statistics.median(r.commit_s for r in fp32),
            "commit_ready_bf16": statistics.median(r.commit_s for r in bf16),
            "broadcast_fp32": statistics.median(r.broadcast_s for r in fp32),
            "broadcast_bf16": statistics.median(r.broadcast_s for r in bf16),
        },
        # Where the serving time goes (medians per part): the trainer's preparation, then rolloutd's phases.
        "phases_median_s": {wire: {"prepare": statistics.median(r.prepare_s for r in rounds),
                                   **{phase: statistics.median(r.phases.get(phase, math.nan) for r in rounds)
                                      for phase in SYNC_PHASES}}
                            for wire, rounds in (("fp32", fp32), ("bf16", bf16))},
        "raw_broadcast_s": raw,
        # Every bound round, in the order timed (BOUND_SAMPLES right after each distributed round).
        "raw_broadcast_rounds_s": {wire: bounds[(wire, False)] for wire in WIRES},
        "raw_broadcast_copy_rounds_s": {wire: bounds[(wire, True)] for wire in WIRES},
        # Each round against the bound rounds timed right after it (load drifts less within a pair).
        "share_of_bound_by_round": {wire: paired(wire, False) for wire in WIRES},
        "share_of_bound2_by_round": {wire: paired(wire, True) for wire in WIRES},
        # CPU seconds per version, a figure load disturbs less than wall time: the replicas (every
        # process, from the announcement to serving) against the bare receivers (bound 1, bound 2).
        "replicas_cpu_s": {wire: [r.replicas_cpu_s for r in rounds] for wire, rounds in rounds_by_wire.items()},
        "bare_receivers_cpu_s": {wire: statistics.median(bounds_cpu[(wire, False)]) for wire in WIRES},
        "bare_receivers_copy_cpu_s": {wire: statistics.median(bounds_cpu[(wire, True)]) for wire in WIRES},
        # The second bound: the bare broadcast plus each receiver's one copy into its parameters.
        "raw_broadcast_copy_s": raw_copy,
        "speedup_bound": {name: statistics.median(disk) / seconds for name, seconds in raw.items()},
        "speedup_fp32": statistics.median(disk) / statistics.median(r.serving_s for r in fp32),
        "speedup_bf16": statistics.median(disk) / statistics.median(r.serving_s for r in bf16),
        "speedup_vs_stored_fp32": statistics.median(via_stored) / statistics.median(r.serving_s for r in fp32),
        "speedup_vs_stored_bf16": statistics.median(via_stored) / statistics.median(r.serving_s for r in bf16),
        "max_logprob_error": max_logprob_error,
        "modelled": {"profile": profile.name, "model_params": profile.model_params,
                     "weight_bytes": profile.weight_bytes, "rows": _modelled_rows(profile)},
    }


def _bare_rank(rank: int, world: int, port: int, shapes: list[tuple[int, ...]], commands: Any, out: Any) -> None:
    """One rank of the bare collective, kept for the run: per command, rank 0 broadcasts tensors of ``shapes``.

    A command is ``(dtype name, copy)``: one timed round of the per-tensor asynchronous broadcasts
    (``copy``: then each receiver copies what it received into fp32 parameters of the same
    shapes, cast as the engine's load casts, one thread, as an embedded replica runs); None ends.
    """
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tensors: dict[str, list[torch.Tensor]] = {}
    params = [torch.zeros(shape) for shape in shapes] if rank > 0 else []
    while (command := commands.get()) is not None:
        dtype_name, copy = command
        received = tensors.setdefault(dtype_name, [torch.zeros(shape, dtype=getattr(torch, dtype_name))
                                                   for shape in shapes])
        tdist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        works = [tdist.broadcast(t, src=0, async_op=True) for t in received]
        for work in works:
            work.wait()
        if copy:
            for param, tensor in zip(params, received, strict=False):  # params: [] on rank 0
                param.copy_(tensor)
        cpu_s = time.process_time() - cpu_started
        tdist.barrier()  # every receiver holds every tensor (copied into its parameters)
        out.put((rank, time.perf_counter() - started, cpu_s))
    tdist.destroy_process_group()


class BareBroadcast:
    """The bounds of the distributed rows, measured beside them: a bare gloo broadcast from one process to others.

    The same per-tensor, asynchronous broadcasts :class:`traind.weight_sync.AgentBroadcast` queues,
    with no engine, no HTTP, no copy into parameters and nothing else of the path running: what no
    broadcast-based sync on this machine can beat (bound 1, issue 35's bound). With ``copy``: plus
    each receiver's copy of the received tensors into its parameters, the copy SGLang's loader makes
    (bound 2). The processes live for the whole run and time a round right after each round of the
    path, so a bound and the rounds it is compared with see the same load on the machine.
    """

    def __init__(self, shapes: list[tuple[int, ...]], receivers: int) -> None:
        import multiprocessing as mp
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        world = receivers + 1
        self._commands = [ctx.Queue() for _ in range(world)]
        self._procs = [ctx.Process(target=_bare_rank, args=(r, world, port, shapes, self._commands[r], self._out),
                                   daemon=True) for r in range(world)]
        for proc in self._procs:
            proc.start()
        for dtype in ("float32", "bfloat16"):  # the first round of each faults its tensors in: not timed
            for copy in (False, True):
                self.time(dtype, copy)

    def time(self, dtype_name: str, copy: bool) -> tuple[float, float]:
        """Seconds of one bare round, and the CPU seconds its receivers spent in it (blocking)."""
        for commands in self._commands:
            commands.put((dtype_name, copy))
        answers = [self._out.get(timeout=600) for _ in self._commands]
        wall = next(seconds for rank, seconds, _ in answers if rank == 0)
        return float(wall), float(sum(cpu for rank, _, cpu in answers if rank > 0))

    def close(self) -> None:
        """End the processes."""
        for commands in self._commands:
            commands.put(None)
        for proc in self._procs:
            proc.join(timeout=60)


#: Issue 35: the distributed sync takes at most 1 / 0.9 of the bare broadcast of the same tensors.
BOUND_TARGET = 0.9


#: What each part of a distributed sync is (rows of the table, in order).
_PHASE_LABELS = {
    "prepare": "trainer: distinct tensors, bucket plan",
    "plan": "rank 0's plan (members posted, plan read)",
    "begin": "/begin_weight_update",
    "transfer": "buckets: broadcast received + loaded",
    "end": "/end_weight_update",
    "verify": "/model_info names the version",
}


def _phase_rows(result: dict[str, Any], wire: str) -> list[tuple[str, float, None, None]]:
    """The serving time's parts (medians), when the result has them (older JSON does not)."""
    phases = result.get("phases_median_s", {}).get(wire, {})
    return [(f"    {name}: {_PHASE_LABELS[name]}", seconds, None, None) for name, seconds in phases.items()]


def render(result: dict[str, Any]) -> str:
    med = result["cpu_median_s"]
    disk_s = med["disk"]
    lines = [f"CPU, {result['model_params'] / 1e6:.0f} M parameters, {result['replicas']} embedded replicas, "
             f"median of {result['rounds']} rounds (optimizer step done -> every replica serves the version)"]
    if not result.get("durable_write_beside", True):
        lines.append("DIAGNOSIS RUN (--without-durable-write): the distributed rounds wrote no durable copy beside")
    stored_s = med["disk_via_stored"]
    columns = [Column("path", 56, "<"), Column("seconds", 8, fmt=".2f"), Column("vs disk", 8, fmt=".1f", suffix="x"),
               Column("vs stored", 10, fmt=".1f", suffix="x")]
    rows = [
        ("disk (publish safetensors + /update_weights_from_disk)", disk_s, 1.0, None),
        ("disk via stored (+ tar blob put, get, unpack)", stored_s, disk_s / stored_s, 1.0),
        ("distributed, fp32 on the wire", med["distributed_fp32"], disk_s / med["distributed_fp32"],
         stored_s / med["distributed_fp32"]),
        ("  rank 0's broadcast (answer to last bucket)", med["broadcast_fp32"], None, None),
        *_phase_rows(result, "fp32"),
        ("  commit ready (durable copy written beside)", med["commit_ready_fp32"], None, None),
        ("distributed, bf16 on the wire", med["distributed_bf16"], disk_s / med["distributed_bf16"],
         stored_s / med["distributed_bf16"]),
        ("  rank 0's broadcast (answer to last bucket)", med["broadcast_bf16"], None, None),
        *_phase_rows(result, "bf16"),
        ("  commit ready (durable copy written beside)", med["commit_ready_bf16"], None, None),
        (f"bound: bare gloo broadcast to {result['replicas']} ranks, fp32", result["raw_broadcast_s"]["fp32"],
         result["speedup_bound"]["fp32"], stored_s / result["raw_broadcast_s"]["fp32"]),
        (f"bound: bare gloo broadcast to {result['replicas']} ranks, bf16", result["raw_broadcast_s"]["bf16"],
         result["speedup_bound"]["bf16"], stored_s / result["raw_broadcast_s"]["bf16"]),
    ]
    copy_bound = result.get("raw_broadcast_copy_s", {})  # older JSON has only the bare bound
    rows += [(f"bound 2: bare broadcast + one copy into parameters, {wire}", seconds, disk_s / seconds,
              stored_s / seconds) for wire, seconds in copy_bound.items()]
    lines += render_table(columns, rows, sep="  ")
    by_round, by_round2 = result.get("share_of_bound_by_round", {}), result.get("share_of_bound2_by_round", {})
    for wire in by_round:
        cpu = statistics.median(result["replicas_cpu_s"][wire])
        lines.append(f"distributed {wire}, each round against the bounds timed right after it (medians): "
                     f"{by_round[wire]:.0%} of bound 1, {by_round2[wire]:.0%} of bound 2; replicas' CPU per version "
                     f"{cpu:.3f}s against the bare receivers' {result['bare_receivers_cpu_s'][wire]:.3f}s (bound 1) / "
                     f"{result['bare_receivers_copy_cpu_s'][wire]:.3f}s (bound 2)")
    for wire in ("fp32", "bf16"):
        share = result["raw_broadcast_s"][wire] / med[f"distributed_{wire}"]
        lines.append(f"distributed {wire}: {share:.0%} of its bound (bare broadcast s / distributed s; target >= "
                     f"{BOUND_TARGET:.0%}, issue 35): {'met' if share >= BOUND_TARGET else 'MISSED'}")
        if wire in copy_bound:
            share = copy_bound[wire] / med[f"distributed_{wire}"]
            lines.append(f"distributed {wire}: {share:.0%} of bound 2 (bare broadcast + each receiver's copy into "
                         f"fp32 parameters, as SGLang's loader copies, s / distributed s; target >= "
                         f"{BOUND_TARGET:.0%}): "
                         f"{'met' if share >= BOUND_TARGET else 'MISSED'}")
    lines.append(f"first version (forms the group) {result['first_version_with_group_formation_s']:.2f}s; served "
                 f"logprobs vs the trainer's forward pass: max |diff| {result['max_logprob_error']:.1e}")
    modelled = result["modelled"]
    lines.append("")
    lines.append(f"modelled ({modelled['profile']}, {modelled['model_params'] / 1e9:.1f} B parameters, "
                 f"{modelled['weight_bytes'] / 1e9:.1f} GB bf16)")
    mcols = [Column("path", 56, "<"), Column("seconds", 8, fmt=".1f"), Column("assumed", 34, "<")]
    lines += render_table(mcols, [(row["path"], row["seconds"], row["assumed"]) for row in modelled["rows"]],
                          sep="  ")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--without-durable-write", action="store_true",
                        help="a diagnosis, not traind's path: the timed distributed rounds write no durable copy "
                             "beside the broadcast (what that write costs the broadcast on shared cores)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(render(result))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
