"""The synthetic engine: many modelled replicas in one process, lengths only, no neural net.

It serves SGLang's native HTTP API through the same server as the embedded engine
(:mod:`rolloutd.engines.embedded.server`: routes, parsing, validation, rids, abort and error
shapes as SGLang 0.5.23) plus ``/get_load`` (polled by sglang-router's ``power_of_two``
policy), one aiohttp application per port, so rolloutd and sglang-router drive it through
their ordinary clients. It exists for the scale-out benchmarks and the engine contract suite
(tests/rolloutd): 64 or more modelled replicas do not fit a small CPU machine as embedded
engines. It lives in benchmarks/ because the daemon never runs it; it imports rolloutd's
server, never the other way round.

The replicas themselves (what they return, their modelled time, pauses and aborts) are
:mod:`benchmarks.synthetic_replica`; this module serves them (one :class:`SyntheticServer` per
replica), runs many in one process (:class:`SyntheticEngine`), launches that process
(:class:`SyntheticFleet`) and is its command line (``python -m benchmarks.synthetic_engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.synthetic_replica import ReplicaRequest, SyntheticEngineConfig, SyntheticReplica
from flexmarl import devicemodel
from flexmarl.errors import InvalidArgument, Unavailable
from rolloutd.engines import lora, weight_messages
from rolloutd.engines.embedded.interface import DistributedUpdate, EngineBackend, LoadSnapshot, SampleRequest
from rolloutd.engines.embedded.outputs import FLUSH_AFTER_UPDATE_FAILED, first_sample
from rolloutd.engines.embedded.server import SGLangServer
from rolloutd.engines.launcher import stop_process
from rolloutd.engines.lora import LoraRef, LoraSettings, LoraUpdate

logger = logging.getLogger(__name__)

ENGINE_VERSION = "flexmarl-synthetic-0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]


class SyntheticBackend(EngineBackend):
    """One :class:`SyntheticReplica` under the shared SGLang-protocol server."""

    name = "synthetic"
    version = ENGINE_VERSION

    def __init__(self, replica: SyntheticReplica) -> None:
        self.replica = replica
        self._weight_groups: dict[str, int] = {}  # group name -> world size (no real group: modelled)
        self._weight_session = False

    async def start(self, port: int) -> None:
        """Start the replica's scheduler."""
        self.replica.start(port)

    async def stop(self) -> None:
        """Stop the replica's scheduler."""
        await self.replica.stop()

    def check(self, request: SampleRequest) -> None:
        """Stop strings need a tokenizer, which the synthetic engine has not."""
        if request.params.stop:
            raise InvalidArgument("sampling_params.stop is not supported by the synthetic engine (no tokenizer)")

    def submit(self, request: SampleRequest) -> asyncio.Future[dict[str, Any]]:
        """Queue the sample; its seed is ``sampling_seed``, else a fresh one."""
        replica = self.replica
        loop = asyncio.get_running_loop()
        inner: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
        seed = request.params.seed if request.params.seed is not None else replica.new_seed()
        job = ReplicaRequest(request.rid, list(request.input_ids), request.params, request.return_logprob, seed, inner)
        job.created_s = request.created_s
        job.lora_id = request.lora_id
        replica.submit(job)
        return first_sample(inner)

    def abort(self, rid: str, abort_all: bool) -> None:
        """The scheduler's abort (prefix match)."""
        self.replica.abort(rid, abort_all)

    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        weight_version: str | None,
        *,
        paused: bool,
        flush_cache: bool,
    ) -> bool:
        """Record the new path and version after the modelled reload (no weights are read)."""
        if not model_path:
            raise InvalidArgument("model_path is required")
        if self.replica.config.check_model_path and not Path(model_path).is_dir():
            raise InvalidArgument(f"{model_path} is not a directory")
        return await self.replica.update_weights(model_path, weight_version, paused=paused, flush_cache=flush_cache)

    async def set_weight_version(self, weight_version: str) -> None:
        """Rename the modelled weights at the next iteration boundary (live sequences record the change)."""
        await self.replica.rename(weight_version)

    # ----- weight-update groups, modelled (answers as rolloutd/engines/weight_messages.py) --------------
    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """Record the membership (the synthetic engine has no weights: nothing connects)."""
        if not group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        if group_name in self._weight_groups or not 0 < rank_offset < world_size:
            reason = "The specified group name has already been created" if group_name in self._weight_groups else (
                f"rank {rank_offset} is not a replica rank of a world of {world_size}"
            )
            return False, f"Failed to initialize custom process group: {reason}."
        self._weight_groups[group_name] = world_size
        return True, weight_messages.INIT_OK

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Forget the membership."""
        if self._weight_groups.pop(group_name, None) is None:
            return False, weight_messages.DESTROY_MISSING
        return True, weight_messages.DESTROY_OK

    async def begin_weight_update(self, selector: str, *, paused: bool) -> tuple[bool, str]:
        """Open the session."""
        if self._weight_session:
            return False, weight_messages.SESSION_OPEN
        self._weight_session = True
        return True, "Success"

    async def end_weight_update(self, *, paused: bool) -> tuple[bool, str]:
        """Close the session."""
        if not self._weight_session:
            return False, weight_messages.SESSION_MISSING
        self._weight_session = False
        return True, "Success"

    async def update_weights_from_distributed(
        self, update: DistributedUpdate, weight_version: str | None, *, paused: bool, flush_cache: bool
    ) -> tuple[bool, str]:
        """Spend the bucket's modelled broadcast time (its bytes over the profile's link), placed as a reload."""
        if not self._weight_session:
            return False, weight_messages.NO_SESSION
        if update.group_name not in self._weight_groups:
            return False, (
                f"Failed to receive weights: Group {update.group_name} not in {list(self._weight_groups)}. "
                "Please call `init_weights_update_group` first."
            )
        nbytes = 0
        for dtype, shape in zip(update.dtypes, update.shapes, strict=False):
            if dtype not in weight_messages.DTYPE_BYTES:
                return False, f"Failed to receive weights: module 'torch' has no attribute '{dtype}'"
            nbytes += math.prod(shape) * weight_messages.DTYPE_BYTES[dtype]
        replica = self.replica
        flushed = await replica.update_weights(
            replica.model_path, weight_version, paused=paused, flush_cache=flush_cache,
            modelled_s=nbytes / replica.profile.link_bytes_per_s,
        )
        if not flushed:
            return False, FLUSH_AFTER_UPDATE_FAILED
        return True, weight_messages.UPDATE_OK

    async def pause(self, mode: str) -> None:
        """Pause the replica's scheduler at its next iteration boundary."""
        await self.replica.pause(mode)

    @property
    def lora_settings(self) -> LoraSettings:
        """The replica's LoRA flags."""
        return self.replica.config.lora

    async def load_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Validate and load (modelled transfer time) the adapter."""
        return await self.replica.load_adapter(ref)

    async def unload_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Forget the adapter."""
        return self.replica.unload_adapter(ref)

    async def resume(self) -> None:
        """Let the replica's scheduler run again."""
        await self.replica.resume()

    @property
    def weight_version(self) -> str:
        """The modelled weight version."""
        return self.replica.weight_version

    @property
    def last_output_s(self) -> float:
        """When the scheduler last advanced."""
        return self.replica.last_output_s

    def load_snapshot(self) -> LoadSnapshot:
        """The replica's load."""
        return self.replica.load()

    def flush_cache(self) -> bool:
        """Refused while anything waits or runs, as SGLang."""
        return self.replica.idle()

    def model_info(self) -> dict[str, Any]:
        """Fields of SGLang's ``/model_info``."""
        return {
            "model_path": self.replica.model_path,
            "served_model_name": self.replica.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.replica.weight_version,
            "load_format": "auto",
        }

    def server_info(self) -> dict[str, Any]:
        """Server arguments and state (``dp_size`` for sglang-router)."""
        replica = self.replica
        info: dict[str, Any] = {k: v for k, v in dataclasses.asdict(replica.config).items() if k != "ports"}
        info.update(info.pop("lora"))
        info.update(
            {
                "model_path": replica.model_path,
                "weight_version": replica.weight_version,
                "port": replica.port,
                "tp_size": 1,
                "dp_size": 1,
                "max_running_requests": replica.config.max_running_requests,
                "max_total_num_tokens": replica.load().max_total_num_tokens,  # SGLang's scheduler init info
                "device_profile": replica.profile.name,
                "backend": "synthetic",
                "internal_states": [
                    {
                        "iterations": replica.iterations,
                        "generated_tokens": replica.generated_tokens,
                        "max_batch_sequences": replica.max_batch_sequences,
                        "modelled_busy_s": replica.modelled_busy_s,
                        "overrun_s": replica.overrun_s,
                    }
                ],
            }
        )
        return info


class SyntheticServer(SGLangServer):
    """The HTTP face of one replica (the shared SGLang-protocol server, plus ``/get_load``)."""

    def __init__(self, replica: SyntheticReplica) -> None:
        super().__init__(SyntheticBackend(replica), serve_get_load=True)
        self.replica = replica

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> int:
        """Listen (a deep backlog: benchmarks open many connections at once); returns the bound port."""
        return await super().start(host, port, backlog=backlog)


class SyntheticEngine:
    """Every replica of one process."""

    def __init__(self, config: SyntheticEngineConfig) -> None:
        config.validate()
        self.config = config
        profile = config.profile()
        self.servers = [SyntheticServer(SyntheticReplica(i, config, profile)) for i in range(config.replicas)]
        self.ports: list[int] = []

    async def start(self) -> list[int]:
        """Listen on every port; returns the bound ports in replica order."""
        wanted = self.config.ports or (0,) * self.config.replicas
        self.ports = [
            await server.start(self.config.host, port) for server, port in zip(self.servers, wanted, strict=True)
        ]
        return self.ports

    @property
    def urls(self) -> list[str]:
        """``http://host:port`` of every replica."""
        return [f"http://{self.config.host}:{port}" for port in self.ports]

    async def stop(self) -> None:
        """Stop every replica (idempotent)."""
        for server in self.servers:
            await server.stop()


# ---- launching a fleet as a child process ----------------------------------------------------------------


class SyntheticFleet:
    """A synthetic engine process started by a benchmark: its replicas' URLs, and stop()."""

    def __init__(self, process: subprocess.Popen[bytes], urls: list[str], log_path: Path) -> None:
        self.process = process
        self.urls = urls
        self.log_path = log_path

    @classmethod
    def start(
        cls, config: SyntheticEngineConfig, run_dir: Path, *, env: dict[str, str] | None = None, timeout_s: float = 60.0
    ) -> SyntheticFleet:
        """Start ``python -m benchmarks.synthetic_engine`` and wait for its ready file."""
        run_dir.mkdir(parents=True, exist_ok=True)
        ready = run_dir / "synthetic.ready.json"
        ready.unlink(missing_ok=True)
        log_path = run_dir / "synthetic.log"
        command = [sys.executable, "-m", "benchmarks.synthetic_engine", *to_args(config), "--ready-file", str(ready)]
        child_env = {**os.environ, **(env or {})}
        # benchmarks/ is not an installed package: the child finds it through the repository root.
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                tail = log_path.read_bytes()[-4000:].decode(errors="replace")
                raise Unavailable(f"synthetic engine did not start (exit {process.poll()}):\n{tail}")
            time.sleep(0.05)
        ports = json.loads(ready.read_text())["ports"]
        return cls(process, [f"http://{config.host}:{port}" for port in ports], log_path)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        stop_process(self.process, grace_s)


def to_args(config: SyntheticEngineConfig) -> list[str]:
    """Command-line flags that rebuild ``config`` (without the ready file)."""
    args = [
        "--replicas",
        str(config.replicas),
        "--host",
        config.host,
        "--model-path",
        config.model_path,
        "--weight-version",
        config.weight_version,
        "--vocab-size",
        str(config.vocab_size),
        "--eos-token-id",
        str(config.eos_token_id),
        "--eos-median-tokens",
        str(config.eos_median_tokens),
        "--eos-sigma",
        str(config.eos_sigma),
        "--max-running-requests",
        str(config.max_running_requests),
        "--seed",
        str(config.seed),
    ]
    if config.ports:
        args += ["--ports", ",".join(map(str, config.ports))]
    if config.modelled_device:
        args += ["--modelled-device", config.modelled_device]
    if not config.check_model_path:
        args.append("--no-check-model-path")
    return args + config.lora.cli_args()


def _parse_args(argv: Sequence[str] | None) -> tuple[SyntheticEngineConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.synthetic_engine",
        description="FlexMARL synthetic engine: modelled replicas, lengths only",
    )
    parser.add_argument("--replicas", type=int, default=1, help="replicas served by this process (one port each)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ports", default="", help="comma-separated ports, one per replica (default: OS picks)")
    parser.add_argument("--model-path", default="synthetic", help="model path reported until the first update")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn from [0, vocab-size)")
    parser.add_argument("--eos-token-id", type=int, default=257)
    parser.add_argument(
        "--eos-median-tokens",
        type=float,
        default=0.0,
        help="median of lognormal response lengths without ignore_eos (0: max_new_tokens)",
    )
    parser.add_argument("--eos-sigma", type=float, default=1.0)
    parser.add_argument("--max-running-requests", type=int, default=256, help="sequences per continuous batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modelled-device", default="", help="device profile (default: $FLEXMARL_MODELLED_DEVICE)")
    parser.add_argument("--no-check-model-path", action="store_true", help="accept weight updates of any path")
    parser.add_argument("--ready-file", default="", help='write {"ports", "pid"} JSON here once listening')
    lora.add_lora_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ports = tuple(int(p) for p in args.ports.split(",") if p.strip())
    config = SyntheticEngineConfig(
        replicas=args.replicas,
        host=args.host,
        ports=ports,
        model_path=args.model_path,
        weight_version=args.weight_version,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        eos_median_tokens=args.eos_median_tokens,
        eos_sigma=args.eos_sigma,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        # The environment is read here, once: the engine itself only sees its config.
        modelled_device=args.modelled_device or os.environ.get(devicemodel.PROFILE_ENV, ""),
        check_model_path=not args.no_check_model_path,
        lora=lora.settings_from_args(args),
    )
    return config, args.ready_file


async def serve(config: SyntheticEngineConfig, ready_file: str = "") -> None:
    """Serve every replica until SIGTERM or SIGINT."""
    engine = SyntheticEngine(config)
    ports = await engine.start()
    logger.info("synthetic engine: %d replicas on %s ports %s..%s", len(ports), config.host, ports[0], ports[-1])
    if ready_file:
        target = Path(ready_file)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({"ports": ports, "pid": os.getpid()}))
        tmp.replace(target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping")
    await engine.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.synthetic_engine``."""
    config, ready_file = _parse_args(argv)
    try:
        config.validate()
    except InvalidArgument as exc:
        raise SystemExit(str(exc)) from exc
    asyncio.run(serve(config, ready_file))


if __name__ == "__main__":
    main()
