"""Launch engine replicas as subprocesses (embedded engine, SGLang or vLLM) or attach to URLs.

A vLLM replica runs ``python -m vllm.entrypoints.openai.api_server`` with the interpreter of
vLLM's own virtual environment (``ReplicaSpec.vllm_python``); its flags and environment are in
:mod:`rolloutd.engines.vllm.launch`, and :meth:`EngineReplica.client` gives a
:class:`~rolloutd.engines.vllm.VLLMClient` for it.

SGLang 0.5.23 builds its CLI from the fields of ``sglang/srt/arg_groups/fields/*.py``
(``sglang/srt/arg_groups/arg_utils.py``: field ``a_b`` is flag ``--a-b``; a bool is
``store_true``), collected by ``ServerArgs.add_cli_args`` in ``sglang/srt/server_args.py``.
The flags used here and the file of each:

* ``--model-path``, ``--dtype``: ``fields/model.py``
* ``--host``, ``--port``, ``--weight-version``: ``fields/serving.py``
* ``--tp-size``: ``fields/parallel.py``
* ``--mem-fraction-static``: ``fields/schedule.py``
* ``--random-seed``, ``--base-gpu-id``: ``fields/device.py``
* ``--enable-deterministic-inference``: ``fields/exec_.py`` (without it SGLang ignores
  ``sampling_seed``; with it, the sampling backend is forced to pytorch and batch-invariant
  kernels are used, see ``arg_groups/attention_hook.py`` and ``arg_groups/overrides.py``)
* ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``, ``--lora-paths``,
  ``--max-loras-per-batch``, ``--max-loaded-loras``: ``fields/lora.py`` (checked at start by
  ``arg_groups/lora_hook.py``; the embedded engine takes the same flags,
  :class:`~rolloutd.engines.lora.LoraSettings`)

Devices: a replica with a :class:`~flexmarl.devices.DeviceSet` gets
``CUDA_VISIBLE_DEVICES`` = that set, and SGLang ``--base-gpu-id 0``: SGLang's scheduler
puts TP rank ``r`` on visible device ``base_gpu_id + r * gpu_id_step``
(``sglang/srt/entrypoints/engine.py``), an index into the visible devices, so 0 is the
set's first device. ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless set) makes indices mean what
``nvidia-smi`` shows (SGLang warns without it: ``sglang/srt/platforms/cuda.py``). The
embedded engine takes the same ``--enable-deterministic-inference`` flag.

SGLang and vLLM cannot bind port 0 and report it, so a free port is chosen here.

A vLLM replica binds its ZeroMQ IPC sockets under ``VLLM_RPC_BASE_PATH`` (the temp directory by
default, ``vllm/utils/network_utils.py`` ``get_open_zmq_ipc_path``: a fresh uuid per socket) and never
removes them, not even on a clean exit: each launch left its sockets in ``/tmp``. The launcher gives
each one a scratch directory of its own there (unless the environment names one), removed when the
replica stops or is relaunched (:meth:`EngineReplica.clear_scratch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from flexmarl.devices import CUDA_VISIBLE_DEVICES, DeviceSet
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.lora import LoraSettings
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.engines.vllm import VLLMClient, vllm_command, vllm_env

logger = logging.getLogger(__name__)

Backend = Literal["embedded", "sglang", "vllm"]


@dataclass(frozen=True)
class ReplicaSpec:
    """How to start one replica."""

    backend: Backend
    model_path: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks (embedded) / a free port is chosen (sglang, vllm)
    num_threads: int = 1  # embedded only
    tp_size: int = 1  # sglang and vllm
    mem_fraction_static: float | None = None  # sglang only
    dtype: str = "auto"  # sglang and vllm
    seed: int | None = None
    weight_version: str = "default"
    # --enable-deterministic-inference: honour sampling_seed (SGLang ignores it otherwise) and
    # batch-invariant kernels; slower on SGLang (pytorch sampling backend, no custom all-reduce).
    deterministic_inference: bool = False
    # The replica's devices (CUDA_VISIBLE_DEVICES of the child); None: it inherits rolloutd's view.
    devices: DeviceSet | None = None
    # LoRA adapters over the base (both backends take SGLang's flags); off by default.
    lora: LoraSettings = field(default_factory=LoraSettings)
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # The python of vLLM's virtual environment (vllm only; rolloutd's --vllm-python).
    vllm_python: str = ""


def _die_with_parent(command: list[str]) -> list[str]:
    """Prefixes util-linux's ``setpriv --pdeathsig TERM``: the engine gets SIGTERM when rolloutd dies.

    Engines run in their own session (so a terminal's Ctrl-C reaches rolloutd, which stops
    them in order), which also means nothing would stop an orphan after a SIGKILL of rolloutd.
    Without setpriv (not Linux), rolloutd's own shutdown is the only stop.
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *command] if setpriv else command


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def embedded_command(spec: ReplicaSpec, ready_file: Path) -> list[str]:
    """Command line of ``python -m rolloutd.engines.embedded``."""
    command = [
        sys.executable,
        "-m",
        "rolloutd.engines.embedded",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--ready-file",
        str(ready_file),
        "--num-threads",
        str(spec.num_threads),
        "--weight-version",
        spec.weight_version,
    ]
    if spec.seed is not None:
        command += ["--seed", str(spec.seed)]
    if spec.deterministic_inference:
        command.append("--enable-deterministic-inference")
    return command + spec.lora.cli_args() + list(spec.extra_args)


def sglang_command(spec: ReplicaSpec, port: int) -> list[str]:
    """Command line of ``python -m sglang.launch_server`` (flags from sglang server_args.py)."""
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--tp-size",
        str(spec.tp_size),
        "--dtype",
        spec.dtype,
        "--weight-version",
        spec.weight_version,
    ]
    if spec.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.seed is not None:
        command += ["--random-seed", str(spec.seed)]
    if spec.devices is not None:
        command += ["--base-gpu-id", "0"]  # an index into CUDA_VISIBLE_DEVICES, which is the set
    if spec.deterministic_inference:
        command.append("--enable-deterministic-inference")
    return command + spec.lora.cli_args() + list(spec.extra_args)


def replica_env(spec: ReplicaSpec, base_env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: ``base_env``, the spec's ``env``, and its devices (see the module doc).

    Raises:
        InvalidArgument: an SGLang replica's set holds fewer devices than ``tp_size``.
    """
    env = {**base_env, **spec.env}
    if spec.devices is not None:
        if spec.backend in ("sglang", "vllm") and len(spec.devices.ids) < spec.tp_size:
            raise InvalidArgument(f"--tp-size {spec.tp_size} needs {spec.tp_size} devices, "
                                  f"the replica has {spec.devices}")
        env[CUDA_VISIBLE_DEVICES] = spec.devices.cuda_visible_devices
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return vllm_env(spec, env) if spec.backend == "vllm" else env


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> int:
    """SIGTERM a child, then SIGKILL it after ``grace_s``; returns its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=grace_s)
    return process.returncode


def kill_leftovers(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of an exited replica's process group.

    Each replica runs in a session of its own (``start_new_session``), so its group holds only
    its processes. vLLM's API server runs its engine core as a child process, which outlives a
    SIGKILL of the server (seen with 0.32 on CPU: the orphan kept 750 MB and a third of a core
    for minutes; on a GPU it would keep its device memory). While any member lives, the group
    id cannot be reused, so the signal reaches nothing else.
    """
    if process.poll() is None:
        return  # the leader still runs: not leftovers
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class EngineReplica:
    """A running (or attached) replica: its URL, its API (``backend``), and its process when this launcher owns it."""

    def __init__(self, url: str, process: subprocess.Popen[bytes] | None = None, log_path: Path | None = None,
                 backend: Backend = "sglang", scratch_dir: Path | None = None):
        self.url = url
        self.process = process
        self.log_path = log_path
        self.backend = backend
        #: The child's own temp directory (a vLLM replica's IPC sockets), removed once it exited.
        self.scratch_dir = scratch_dir

    def clear_scratch(self) -> None:
        """Removes the scratch directory of an exited child (nothing while it runs)."""
        if self.scratch_dir is not None and (self.process is None or self.process.poll() is not None):
            shutil.rmtree(self.scratch_dir, ignore_errors=True)
            self.scratch_dir = None

    @property
    def pid(self) -> int | None:
        """The child's pid, or None for an attached replica."""
        return None if self.process is None else self.process.pid

    def client(self, **kwargs: float | int) -> SGLangClient | VLLMClient:
        """A new client for this replica (the caller closes it): vLLM's API for a vLLM replica, else SGLang's."""
        if self.backend == "vllm":
            return VLLMClient(self.url, **kwargs)  # type: ignore[arg-type]
        return SGLangClient(self.url, **kwargs)  # type: ignore[arg-type]

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of the child's combined stdout/stderr."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()
        return data[-max_bytes:].decode(errors="replace")

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; fail fast (with the log tail) when the child dies."""
        deadline = time.monotonic() + timeout_s
        # SGLang's /health generates a token and answers only after its once-a-second poll saw it
        # (>= 1 s); a probe that times out is just asked again, so the child's exit is still seen soon.
        async with SGLangClient(self.url, retries=0, control_timeout_s=5.0) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise Unavailable(f"engine at {self.url} exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(Unavailable):
                    if await client.health():
                        return
                if time.monotonic() > deadline:
                    raise Unavailable(f"engine at {self.url} not healthy after {timeout_s}s:\n{self.log_tail()}")
                await asyncio.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code (None if attached)."""
        if self.process is None:
            return None
        code = stop_process(self.process, grace_s)
        kill_leftovers(self.process)
        self.clear_scratch()
        return code

    def kill(self) -> None:
        """SIGKILL the child, as a crash would (fault tests): its own children are left (:func:`kill_leftovers`)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def attach(url: str, backend: Backend = "sglang") -> EngineReplica:
    """A replica someone else runs (an SGLang or vLLM server on a GPU host; ``backend``: which API it speaks)."""
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"engine URL must be http(s)://host:port, got {url!r}")
    return EngineReplica(url.rstrip("/"), backend="vllm" if backend == "vllm" else "sglang")


async def _wait_ready_file(path: Path, process: subprocess.Popen[bytes], deadline: float, log_path: Path) -> int:
    while True:
        if path.exists():
            return int(json.loads(path.read_text())["port"])
        if process.poll() is not None:
            tail = log_path.read_bytes()[-4000:].decode(errors="replace")
            raise Unavailable(f"embedded engine exited with {process.returncode} before listening:\n{tail}")
        if time.monotonic() > deadline:
            raise Unavailable(f"embedded engine wrote no ready file within the deadline: {path}")
        await asyncio.sleep(0.05)


async def launch(spec: ReplicaSpec, run_dir: Path, *, timeout_s: float = 120.0, name: str = "engine",
                 append_log: bool = False) -> EngineReplica:
    """Start a replica as a subprocess and wait until ``/health`` answers 200.

    Args:
        spec: What to run.
        run_dir: Directory for the ready file and the child's log (created).
        timeout_s: Deadline for the replica to become healthy (SGLang loads the model and
            captures CUDA graphs first: minutes for a large model).
        name: File name stem for the ready file and the log.
        append_log: Append to the log instead of starting it afresh (a relaunch keeps the crash's output).

    Raises:
        InvalidArgument: The spec cannot be run (unknown backend, too few devices for tp_size).
        Unavailable: The child died or did not become healthy in time (message has its log tail).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / f"{name}.log"
    ready_file = run_dir / f"{name}.ready.json"
    ready_file.unlink(missing_ok=True)
    if spec.backend == "embedded":
        command = embedded_command(spec, ready_file)
        port = spec.port
    elif spec.backend == "sglang":
        port = spec.port or free_port(spec.host)
        command = sglang_command(spec, port)
    elif spec.backend == "vllm":
        port = spec.port or free_port(spec.host)
        command = vllm_command(spec, port)
    else:
        raise InvalidArgument(f"unknown engine backend {spec.backend!r}")
    env = replica_env(spec, os.environ)
    scratch = None
    if spec.backend == "vllm" and "VLLM_RPC_BASE_PATH" not in env:
        scratch = Path(tempfile.mkdtemp(prefix=f"flexmarl-{name}-"))  # short: a socket path has 107 bytes
        env["VLLM_RPC_BASE_PATH"] = str(scratch)
    deadline = time.monotonic() + timeout_s
    try:
        with open(log_path, "ab" if append_log else "wb") as log_file:
            process = subprocess.Popen(_die_with_parent(command), stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
    except OSError:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    logger.info("started %s engine pid %d on devices %s: %s", spec.backend, process.pid,
                spec.devices or "(inherited)", " ".join(command))
    replica = EngineReplica("", process, log_path, backend="vllm" if spec.backend == "vllm" else "sglang",
                            scratch_dir=scratch)
    try:
        if spec.backend == "embedded":
            port = await _wait_ready_file(ready_file, process, deadline, log_path)
        replica.url = f"http://{spec.host}:{port}"
        await replica.wait_healthy(max(deadline - time.monotonic(), 0.1))
        if spec.backend == "vllm" and spec.weight_version != "default":
            await _set_vllm_weight_version(replica.url, spec.weight_version)
    except (FlexmarlError, asyncio.CancelledError):
        replica.kill()
        if replica.process is not None:
            kill_leftovers(replica.process)
        replica.clear_scratch()
        raise
    return replica


async def _set_vllm_weight_version(url: str, weight_version: str) -> None:
    """Set a fresh vLLM replica's weight version (it starts at "default"; no flag sets another)."""
    async with VLLMClient(url, retries=0) as client:
        await client.set_weight_version(weight_version)


async def launch_many(specs: Sequence[ReplicaSpec], run_dir: Path, *, timeout_s: float = 120.0) -> list[EngineReplica]:
    """Start several replicas concurrently; if one fails, stop the others and raise."""
    results = await asyncio.gather(
        *(launch(spec, run_dir, timeout_s=timeout_s, name=f"engine-{index}") for index, spec in enumerate(specs)),
        return_exceptions=True,
    )
    replicas = [result for result in results if isinstance(result, EngineReplica)]
    errors = [result for result in results if isinstance(result, BaseException)]
    if errors:
        for replica in replicas:
            replica.stop()
        raise errors[0]
    return replicas
