"""GPU smoke check: does a first GPU run of FlexMARL work on this machine? (run by gpu_smoke.sh)

Checks, each with its own deadline, every result written to the JSON as soon as it is known
(a run cut short still leaves what it learnt):

1. ``environment``: torch/CUDA, devices, whether deepspeed, sglang and etcd are there.
2. ``embedded_engine``: one embedded engine launched by rolloutd's launcher on device set 0
   with ``--enable-deterministic-inference`` (on CUDA when the engine has a ``--device``
   option; otherwise it runs on CPU and says so): generate with logprobs, ``n>1`` with a
   seed twice (reproducible?), per-sample seeds, ``update_weights_from_disk``.
3. ``replicas_on_distinct_devices``: two replicas from rolloutd's own device plan; each
   child's ``CUDA_VISIBLE_DEVICES`` (and, on CUDA, the GPU nvidia-smi shows it on) differ.
4. ``traind_deepspeed``: in a child process, traind's AgentTrainer on the slot's device
   (``TrainerConfig.slot_local_ranks`` + ``on_device``), one micro-batch and one optimizer
   step; records the process-group backend (NCCL on CUDA) and the engine's device.
5. ``strict_job``: a LocalCluster (etcd + the four daemons) runs the signaling example with
   tiny models, ``pipeline: {mode: async, max_staleness: 0}``, seeded sampling, 2 steps.
6. ``sglang_server``: when ``import sglang`` works, a real SGLang server launched by our
   launcher (deterministic inference, device set 0) driven by our client: generate with
   logprobs, ``n>1`` with seeds, per-sample seeds, ``update_weights_from_disk``.

``--cpu`` is a dry mode for machines without a GPU: DeepSpeed on its CPU accelerator, fake
device ids for the replicas (a CPU engine never opens them), SGLang skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_smoke.json"
PROMPT = (1, 5, 9, 13, 17, 21)


class Skipped(Exception):
    """A check that cannot run here (the reason is recorded)."""


@dataclasses.dataclass
class CheckResult:
    """One check's outcome."""

    name: str
    status: str  # passed | failed | skipped
    seconds: float
    detail: dict[str, Any]


@dataclasses.dataclass
class Machine:
    """What this machine offers, learnt once by the environment check."""

    cpu_mode: bool
    cuda_devices: int = 0
    deepspeed: bool = False
    sglang: bool = False
    etcd: str = ""
    embedded_device_flag: bool = False

    @property
    def on_cuda(self) -> bool:
        """Whether the checks use CUDA."""
        return not self.cpu_mode and self.cuda_devices > 0


class Smoke:
    """Runs the checks and keeps the JSON report current."""

    def __init__(self, out: Path, machine: Machine, work_dir: Path) -> None:
        self.out = out
        self.machine = machine
        self.work_dir = work_dir
        self.results: list[CheckResult] = []
        self.environment: dict[str, Any] = {}
        self.started_unix_s = time.time()

    def write(self) -> None:
        """Writes the report (atomically)."""
        summary = {s: sum(1 for r in self.results if r.status == s) for s in ("passed", "failed", "skipped")}
        report = {"started_unix_s": self.started_unix_s, "seconds": time.time() - self.started_unix_s,
                  "mode": "cuda" if self.machine.on_cuda else "cpu", "environment": self.environment,
                  "checks": [dataclasses.asdict(r) for r in self.results], "summary": summary}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        staging = self.out.with_suffix(".tmp")
        staging.write_text(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(staging, self.out)

    async def check(self, name: str, budget_s: float, body: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Runs one check under its deadline and records it."""
        started = time.monotonic()
        try:
            detail = await asyncio.wait_for(body(), budget_s)
            status = "failed" if detail.pop("_failed", False) else "passed"
        except Skipped as exc:
            status, detail = "skipped", {"reason": str(exc)}
        except TimeoutError:
            status, detail = "failed", {"error": f"over its {budget_s:.0f} s budget"}
        except Exception as exc:  # a smoke check reports, it does not stop the others
            status, detail = "failed", {"error": f"{type(exc).__name__}: {exc}"[:4000],
                                        "traceback": traceback.format_exc()[-4000:]}
        result = CheckResult(name, status, round(time.monotonic() - started, 2), detail)
        self.results.append(result)
        self.write()
        print(f"[gpu_smoke] {name}: {status} ({result.seconds:.1f} s) {json.dumps(detail, default=str)[:400]}",
              flush=True)


# ---- helpers ---------------------------------------------------------------------------------


def _python_ok(code: str, timeout_s: float = 180.0) -> tuple[bool, str]:
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout_s:.0f} s"
    return done.returncode == 0, (done.stdout + done.stderr).strip()[-600:]


def _child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def _gpu_of_pids() -> dict[int, str]:
    """pid -> GPU uuid of every CUDA process nvidia-smi sees."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {}
    done = subprocess.run([tool, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=30, check=False)
    out = {}
    for line in done.stdout.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            out[int(pid)] = uuid.strip()
    return out


def _tiny(name: str, seed: int) -> Path:
    from flexmarl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(Path(tempfile.gettempdir()) / "flexmarl-gpu-smoke" / name, seed=seed)


async def _drive_engine(url: str, other_checkpoint: Path) -> dict[str, Any]:
    """Our client against one engine: logprobs, n>1 with seeds, per-sample seeds, a weight update."""
    from rolloutd.engines.launcher import attach
    from rolloutd.engines.protocol import GenerationRequest, SamplingParams

    detail: dict[str, Any] = {}
    async with attach(url).client() as client:
        [greedy] = await client.generate(GenerationRequest(PROMPT, SamplingParams(
            temperature=0.0, max_new_tokens=8, ignore_eos=True), return_logprob=True))
        detail["logprobs_match_tokens"] = len(greedy.output_token_logprobs) == len(greedy.output_ids) > 0
        group = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, n=4, seed=7)
        first = await client.generate(GenerationRequest(PROMPT, group, return_logprob=True))
        again = await client.generate(GenerationRequest(PROMPT, group, return_logprob=True))
        detail["n4_seeded_reproducible"] = [r.output_ids for r in first] == [r.output_ids for r in again]
        # SGLang hashes (seed, position): the n samples of one seeded request coincide.
        detail["n4_seeded_distinct_samples"] = len({r.output_ids for r in first})
        per_sample = [await client.generate(GenerationRequest(PROMPT, dataclasses.replace(group, n=1, seed=7 + i)))
                      for i in range(4)]
        detail["per_sample_seeds_distinct_samples"] = len({r[0].output_ids for r in per_sample})
        await client.update_weights_from_disk(str(other_checkpoint), weight_version="1")
        info = await client.model_info()
        detail["weights_updated"] = info.model_path == str(other_checkpoint) and info.weight_version == "1"
    detail["_failed"] = not (detail["logprobs_match_tokens"] and detail["n4_seeded_reproducible"]
                             and detail["weights_updated"])
    return detail


# ---- the checks -------------------------------------------------------------------------------


async def environment(smoke: Smoke) -> dict[str, Any]:
    """Versions and what is installed; fills smoke.machine."""
    import torch

    m = smoke.machine
    m.cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    m.deepspeed = importlib.util.find_spec("deepspeed") is not None
    m.sglang = importlib.util.find_spec("sglang") is not None and _python_ok("import sglang")[0]
    m.etcd = os.environ.get("FLEXMARL_ETCD_BINARY") or shutil.which("etcd") or ""
    engine_help = subprocess.run([sys.executable, "-m", "rolloutd.engines.embedded", "--help"], capture_output=True,
                                 text=True, timeout=120, check=False).stdout
    m.embedded_device_flag = "--device " in engine_help or "--device\n" in engine_help
    detail = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cuda_devices": m.cuda_devices,
              "device_names": [torch.cuda.get_device_name(i) for i in range(m.cuda_devices)],
              "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "deepspeed": m.deepspeed,
              "sglang": m.sglang, "etcd": m.etcd or None, "embedded_engine_device_flag": m.embedded_device_flag,
              "cpu_mode": m.cpu_mode}
    if m.deepspeed:
        # From the installed metadata: importing DeepSpeed in a child costs ~7 s of CPU for a version string.
        detail["deepspeed_version"] = importlib.metadata.version("deepspeed")
    smoke.environment = detail
    return dict(detail)


def _embedded_extra_args(m: Machine) -> tuple[str, ...]:
    return ("--device", "cuda") if m.on_cuda and m.embedded_device_flag else ()


def _device_sets(m: Machine, replicas: int) -> tuple[Any, ...] | None:
    from flexmarl.devices import DeviceSet
    from rolloutd.config import RolloutConfig

    if m.cpu_mode:  # fake ids: a CPU engine never opens them, its environment shows the plan
        return tuple(DeviceSet((str(i),)) for i in range(replicas))
    return RolloutConfig(engine_replicas=replicas).engine_device_sets()


async def embedded_engine(smoke: Smoke) -> dict[str, Any]:
    """One embedded replica on device set 0, driven by our client."""
    from rolloutd.engines.launcher import ReplicaSpec, launch

    m = smoke.machine
    sets = _device_sets(m, 1)
    spec = ReplicaSpec("embedded", str(_tiny("base", 0)), deterministic_inference=True,
                       devices=None if sets is None else sets[0], extra_args=_embedded_extra_args(m))
    replica = await launch(spec, smoke.work_dir / "embedded", timeout_s=120, name="embedded")
    try:
        detail = await _drive_engine(replica.url, _tiny("other", 1))
        pid = replica.pid or 0
        detail["CUDA_VISIBLE_DEVICES"] = _child_env(pid).get("CUDA_VISIBLE_DEVICES")
        detail["on_gpu"] = _gpu_of_pids().get(pid)
        if m.on_cuda and not m.embedded_device_flag:
            detail["note"] = "the embedded engine has no --device option: it ran on CPU"
        elif m.on_cuda and detail["on_gpu"] is None:
            detail["_failed"] = True
            detail["note"] = "launched with --device cuda but nvidia-smi shows no CUDA context for it"
        return detail
    finally:
        replica.stop()


async def replicas_on_distinct_devices(smoke: Smoke) -> dict[str, Any]:
    """Two replicas from rolloutd's own plan (replica_specs) land on different devices."""
    from rolloutd.engines.launcher import launch_many
    from rolloutd.worker import WorkerSettings, replica_specs

    m = smoke.machine
    if not m.cpu_mode and m.cuda_devices < 2:
        raise Skipped(f"{m.cuda_devices} CUDA device(s): distinct devices need 2")
    settings = WorkerSettings(worker_id="smoke", work_dir=smoke.work_dir, max_tasks=1, engine_backend="embedded",
                              engine_replicas=2, engine_urls=(), engine_threads=1, orchestrator_address="",
                              store_address="", max_message_bytes=1 << 26, engine_device_sets=_device_sets(m, 2),
                              engine_extra_args=_embedded_extra_args(m))
    replicas = await launch_many(replica_specs(settings, str(_tiny("base", 0))), smoke.work_dir / "replicas",
                                 timeout_s=180)
    try:
        pids = [r.pid or 0 for r in replicas]
        visible = [_child_env(pid).get("CUDA_VISIBLE_DEVICES") for pid in pids]
        gpus = _gpu_of_pids()
        on_gpu = [gpus.get(pid) for pid in pids]
        detail: dict[str, Any] = {"CUDA_VISIBLE_DEVICES": visible, "gpu_uuids": on_gpu}
        distinct_gpus = None not in on_gpu and len(set(on_gpu)) == 2
        detail["_failed"] = None in visible or len(set(visible)) != 2 or (
            m.on_cuda and m.embedded_device_flag and not distinct_gpus)
        return detail
    finally:
        for replica in replicas:
            replica.stop()


async def traind_deepspeed(smoke: Smoke) -> dict[str, Any]:
    """traind's trainer on its slot's device, in a child process (a clean CUDA/process-group state)."""
    if not smoke.machine.deepspeed:
        raise Skipped("deepspeed not installed")
    done = await asyncio.to_thread(subprocess.run, [sys.executable, __file__, "--traind-child"],
                                   capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"_failed": True, "returncode": done.returncode, "log": (done.stdout + done.stderr)[-3000:]}
    detail: dict[str, Any] = json.loads(lines[-1])
    wanted_backend = "nccl" if smoke.machine.on_cuda else "gloo"
    detail["_failed"] = detail.get("backend") != wanted_backend or not detail.get("stepped")
    return detail


def traind_child() -> None:
    """The traind check's child: one micro-batch and one step of AgentTrainer on the slot's device."""
    import numpy as np
    import torch.distributed

    from flexmarl.experience import ExperienceRecord, experience_id, group_id
    from traind.config import TrainerConfig
    from traind.distributed import on_device
    from traind.model import AgentTrainer, AgentTrainerConfig

    ranks = TrainerConfig(slots=1).slot_local_ranks()
    local_rank = None if ranks is None else ranks[0]
    rng = np.random.default_rng(0)
    records = [ExperienceRecord(
        experience_id=experience_id("t0", i, "a", 0), job_id="smoke", agent="a", task_id="t0",
        group_id=group_id("t0", "a"), sample_index=i, episode_id=f"t0/{i}", turn=0, behavior_version=0,
        reward=float(i % 2), prompt_token_ids=rng.integers(1, 200, size=5).astype(np.int32),
        response_token_ids=rng.integers(1, 200, size=4).astype(np.int32),
        response_logprobs=(-rng.uniform(3, 6, size=4)).astype(np.float32), group_size=4) for i in range(4)]
    config = AgentTrainerConfig(agent="a", model_path=str(_tiny("base", 0)), lr=1e-3)
    started = time.perf_counter()
    trainer = on_device(local_rank, AgentTrainer, config)
    micro = on_device(local_rank, trainer.accumulate, records)
    step = on_device(local_rank, trainer.optimizer_step, micro.response_tokens, micro.sequences)
    print(json.dumps({"local_rank": local_rank, "engine_device": str(trainer.device),
                      "engine_local_rank": int(trainer.engine.local_rank),
                      "backend": str(torch.distributed.get_backend()), "loss": step.loss,
                      "grad_norm": step.grad_norm, "stepped": trainer.version == 1,
                      "seconds": time.perf_counter() - started}), flush=True)


def _strict_spec(models_dir: Path) -> dict[str, Any]:
    import yaml

    from flexmarl.cli import materialize_models

    raw: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "signaling" / "job.yaml").read_text())
    raw.update(total_steps=2, batch={"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8},
               pipeline={"mode": "async", "max_staleness": 0})
    return materialize_models(raw, models_dir)


async def strict_job(smoke: Smoke) -> dict[str, Any]:
    """One strict job end to end on a LocalCluster."""
    from flexmarl.client import Client, JobState
    from flexmarl.localcluster import LocalCluster, LocalClusterConfig

    m = smoke.machine
    if not m.deepspeed:
        raise Skipped("deepspeed not installed (traind needs it)")
    if not m.etcd:
        raise Skipped("no etcd binary (PATH or FLEXMARL_ETCD_BINARY)")
    rolloutd_args = ["--engine-launch-timeout-s", "300"]
    traind_args: list[str] = []
    if m.on_cuda and m.embedded_device_flag:
        rolloutd_args += ["--engine-extra-args", "--device cuda"]
    if m.on_cuda and m.cuda_devices >= 2:  # trainer and engine on different devices
        traind_args += ["--gpus", "0"]
        rolloutd_args += ["--gpus", "1"]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients" / "python")]),
           "DS_ACCELERATOR": "cuda" if m.on_cuda else "cpu", "FLEXMARL_ETCD_BINARY": m.etcd}
    run_dir = smoke.work_dir / "cluster"
    config = LocalClusterConfig(run_dir=run_dir, engine_replicas=1, trainer_slots=1, env=env,
                                rolloutd_args=rolloutd_args, traind_args=traind_args,
                                etcd_prefix="/flexmarl-gpu-smoke")
    cluster = LocalCluster(config)
    await asyncio.to_thread(cluster.start, 180.0)
    def submit_and_wait() -> Any:  # the SDK client runs its own event loop: keep it off this one
        client = Client(etcd_endpoints=cluster.etcd_endpoint, etcd_prefix=config.etcd_prefix)
        try:
            client.submit(_strict_spec(smoke.work_dir / "models"), job_id="gpu-smoke-strict")
            return client.wait("gpu-smoke-strict", 240.0)
        finally:
            client.close()

    try:
        info = await asyncio.to_thread(submit_and_wait)
        detail: dict[str, Any] = {"state": info.state.name, "error": info.error,
                                  "agents": {a.agent: {"step": a.step, "version": a.version} for a in info.agents},
                                  "rolloutd_args": rolloutd_args, "traind_args": traind_args}
        detail["_failed"] = info.state is not JobState.SUCCEEDED or any(a.step != 2 for a in info.agents)
        if detail["_failed"]:
            detail["logs"] = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(run_dir.glob("*.log"))}
        return detail
    finally:
        await asyncio.to_thread(cluster.stop)


async def sglang_server(smoke: Smoke) -> dict[str, Any]:
    """A real SGLang server launched by our launcher and driven by our client."""
    from rolloutd.engines.launcher import ReplicaSpec, launch

    m = smoke.machine
    if not m.on_cuda:
        raise Skipped("no CUDA device" if not m.cpu_mode else "--cpu dry mode")
    if not m.sglang:
        raise Skipped("import sglang fails (not installed)")
    sets = _device_sets(m, 1)
    spec = ReplicaSpec("sglang", str(_tiny("base", 0)), deterministic_inference=True, mem_fraction_static=0.3,
                       devices=None if sets is None else sets[0], extra_args=("--disable-cuda-graph",))
    replica = await launch(spec, smoke.work_dir / "sglang", timeout_s=300, name="sglang")
    try:
        detail = await _drive_engine(replica.url, _tiny("other", 1))
        detail["CUDA_VISIBLE_DEVICES"] = _child_env(replica.pid or 0).get("CUDA_VISIBLE_DEVICES")
        if detail["_failed"]:
            detail["log_tail"] = replica.log_tail(3000)
        return detail
    finally:
        replica.stop(grace_s=30)


async def main_async(args: argparse.Namespace) -> int:
    """Runs every check in order; returns 1 when one failed."""
    machine = Machine(cpu_mode=args.cpu)
    with tempfile.TemporaryDirectory(prefix="flexmarl-gpu-smoke-") as tmp:
        smoke = Smoke(args.out, machine, Path(tmp))
        await smoke.check("environment", 300, lambda: environment(smoke))
        checks: list[tuple[str, float, Callable[[Smoke], Awaitable[dict[str, Any]]]]] = [
            ("embedded_engine", 150, embedded_engine),
            ("replicas_on_distinct_devices", 180, replicas_on_distinct_devices),
            ("traind_deepspeed", 250, traind_deepspeed),
            ("strict_job", 420, strict_job),
            ("sglang_server", 400, sglang_server),
        ]
        for name, budget_s, body in checks:
            if args.only and name not in args.only:
                continue
            await smoke.check(name, budget_s, lambda body=body: body(smoke))  # type: ignore[misc]
        smoke.write()
        print(f"[gpu_smoke] report: {args.out}", flush=True)
        return 1 if any(r.status == "failed" for r in smoke.results) else 0


def main() -> None:
    """Command line of the smoke check."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument("--cpu", action="store_true", help="dry mode without a GPU (CPU DeepSpeed, fake device ids)")
    parser.add_argument("--only", nargs="*", default=[], help="run only these checks (after environment)")
    parser.add_argument("--traind-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.traind_child:
        traind_child()
        return
    if args.cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    # Every process this script starts is a world of one (or rendezvouses as traind decides):
    # rendezvous settings inherited from whatever started the script would point them elsewhere.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
