"""``python -m rolloutd.engines.embedded``: one embedded engine replica on one port.

The command line follows SGLang's ``python -m sglang.launch_server`` (sglang/srt/server_args.py)
where SGLang has the flag (``--model-path``, ``--host``, ``--port``, ``--enable-deterministic-inference``,
the LoRA flags); the ready file and SIGTERM handling are how rolloutd's launcher
(:mod:`rolloutd.engines.launcher`) starts and stops a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import torch

from flexmarl import devicemodel
from flexmarl.errors import InvalidArgument
from rolloutd.engines import lora
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine

logger = logging.getLogger(__name__)


def parse_args(argv: Sequence[str] | None) -> EmbeddedEngineConfig:
    """The engine's settings from its command line (SGLang's flag names where SGLang has the flag)."""
    parser = argparse.ArgumentParser(
        prog="python -m rolloutd.engines.embedded", description="FlexMARL embedded CPU inference engine"
    )
    parser.add_argument("--model-path", required=True, help="Hugging Face causal-LM checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (loopback by default)")
    parser.add_argument("--port", type=int, default=0, help="listen port (0: the OS picks)")
    parser.add_argument("--ready-file", default="", help='write {"port", "pid"} JSON here once listening')
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most sequences decoded together")
    parser.add_argument("--batch-window-s", type=float, default=0.002, help="wait for co-arriving requests")
    parser.add_argument("--weight-version", default="default", help="initial weight_version reported")
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the engine's sampling generator (SGLang's --random-seed)"
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="as SGLang: honour sampling_seed (42 when absent) with position-hashed sampling, and return "
        "batch-invariant logprobs",
    )
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        help="logprobs of the raw distribution instead of the temperature-scaled one",
    )
    parser.add_argument(
        "--modelled-device",
        default="",
        help="device profile (JSON/YAML, flexmarl.devicemodel): take that accelerator's time; "
        "default: $FLEXMARL_MODELLED_DEVICE",
    )
    lora.add_lora_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads < 1 or args.max_batch_size < 1 or args.batch_window_s < 0:
        parser.error("--num-threads and --max-batch-size must be >= 1, --batch-window-s >= 0")
    lora_settings = lora.settings_from_args(args)
    try:
        lora_settings.check()
    except InvalidArgument as exc:
        parser.error(str(exc))
    return EmbeddedEngineConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        batch_window_s=args.batch_window_s,
        return_original_logprob=args.return_original_logprob,
        enable_deterministic_inference=args.enable_deterministic_inference,
        weight_version=args.weight_version,
        seed=args.seed,
        ready_file=args.ready_file,
        modelled_device=args.modelled_device or os.environ.get(devicemodel.PROFILE_ENV, ""),
        lora=lora_settings,
    )


def _write_ready_file(path: str, port: int) -> None:
    """Atomically write the ready file, so a reader never sees half of it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(target)


async def serve(config: EmbeddedEngineConfig) -> int:
    """Run one replica until SIGTERM or SIGINT (exit status 0), or until the engine dies (1)."""
    torch.set_num_threads(config.num_threads)
    engine = await asyncio.to_thread(EmbeddedEngine, config)
    server = EmbeddedServer(engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_fatal() -> None:
        loop.call_soon_threadsafe(stop.set)

    engine.on_fatal = on_fatal
    port = await server.start(config.host, config.port)
    logger.info("embedded engine serving %s on %s:%d", config.model_path, config.host, port)
    if config.ready_file:
        _write_ready_file(config.ready_file, port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping")
    await server.stop()
    return 0 if engine.fatal is None else 1


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rolloutd.engines.embedded``."""
    raise SystemExit(asyncio.run(serve(parse_args(argv))))
