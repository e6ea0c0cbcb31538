"""Daemon lifecycle shared by orchestratord, rolloutd, traind and stored.

``main()`` parses the config, connects to etcd, serves gRPC (with health, reflection
and error mapping) and metrics, registers the daemon, and on SIGTERM/SIGINT shuts
down in order: health NOT_SERVING -> deregister -> stop accepting and drain ->
app.stop() (flush) -> exit 0. Start-up problems (bad config, port in use, etcd
unreachable) end the process with one clear line and a non-zero exit code.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.gc_collector import GCCollector

from flexmarl import __version__
from flexmarl.config import ConfigError, DaemonConfig, load_config
from flexmarl.errors import Unavailable
from flexmarl.gc_policy import GcPolicy, apply_after_startup
from flexmarl.metrics import MetricsServer, RpcMetrics
from flexmarl.registry import Registry, ServiceRecord
from flexmarl.security import INSECURE, TransportSecurity
from flexmarl.server import GrpcServer

log = logging.getLogger(__name__)

C = TypeVar("C", bound=DaemonConfig)

#: Environment variable choosing the daemons' event loop: ``uvloop`` (the default where uvloop is
#: installed; it cut orchestratord's CPU per RPC, docs/benchmarks-scale.md) or ``asyncio``.
EVENT_LOOP_ENV = "FLEXMARL_EVENT_LOOP"

#: Exit codes of every daemon (documented in docs/architecture.md).
EXIT_OK = 0
EXIT_STARTUP = 1
EXIT_CONFIG = 2


class StartupError(Exception):
    """A daemon could not start; the message is the one line shown to the user."""


class DaemonApp(abc.ABC):
    """What a daemon plugs into the shared lifecycle."""

    #: Full gRPC service names, for health and reflection (e.g. "flexmarl.v1.Store").
    service_names: tuple[str, ...] = ()

    @abc.abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the daemon's servicers to the server."""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called before the server accepts requests (open stores, start background tasks)."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Called after the server drained (flush and close)."""

    def registration_info(self) -> dict[str, Any]:
        """Extra fields published in the daemon's etcd record."""
        return {}


@dataclasses.dataclass
class DaemonContext:
    """What a daemon's app gets from the runtime."""

    kind: str
    service_id: str
    config: DaemonConfig
    metrics: CollectorRegistry
    registry: Registry
    advertise_address: str = ""
    #: TLS material and token for the daemon's server and every channel it opens.
    security: TransportSecurity = INSECURE


def setup_logging(kind: str, level: str) -> None:
    """One log format for every daemon, on stderr."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {kind}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("aetcd").setLevel(logging.WARNING)


def default_service_id(kind: str) -> str:
    """kind-host-pid: unique per process on a cluster."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


def main(
    kind: str,
    config_cls: type[C],
    build: Callable[[C, DaemonContext], DaemonApp],
    argv: Sequence[str] | None = None,
    description: str = "",
) -> int:
    """Runs a daemon until SIGTERM/SIGINT; returns the process exit code."""
    try:
        config = load_config(config_cls, argv, prog=kind, description=description)
    except ConfigError as exc:
        print(f"{kind}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(kind, config.log_level)
    log.info("%s %s starting with %s", kind, __version__, json.dumps(config.masked(), sort_keys=True))
    runner = DaemonRunner(kind, config, build)
    try:
        loop_factory = event_loop_factory(os.environ.get(EVENT_LOOP_ENV, ""))
    except ValueError as exc:
        print(f"{kind}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    log.info("%s event loop: %s", kind, "asyncio" if loop_factory is None else "uvloop")
    try:
        with asyncio.Runner(loop_factory=loop_factory) as loop_runner:
            return loop_runner.run(runner.run())
    except StartupError as exc:
        print(f"{kind}: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a daemon runs on, from ``FLEXMARL_EVENT_LOOP`` (None: asyncio's own).

    "" (unset) is uvloop where it is installed, else asyncio; "uvloop" requires it.

    Raises:
        ValueError: an unknown choice, or "uvloop" without uvloop installed.
    """
    choice = choice.strip().lower()
    if choice not in ("", "uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV}={choice!r}: expected uvloop or asyncio")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed (pip install uvloop)") from None
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def exit_process(code: int) -> None:
    """Ends a daemon's process with ``code`` once :func:`main` has returned, skipping interpreter teardown.

    By then the daemon has stopped: its server, registry lease, engines and files are closed and
    everything durable was written before it was acknowledged. What is left is the interpreter's
    own teardown (garbage collection of torch's and DeepSpeed's module graphs), which took ~4 s of
    CPU per traind exit on the 2-core CI machine and held up every cluster stop that waits on it.
    Log handlers and the standard streams are flushed first. Only the console entry points call
    this; :func:`main` itself returns, so in-process callers (tests) keep their interpreter.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class DaemonRunner:
    """Starts, serves and stops one daemon inside an event loop."""

    def __init__(self, kind: str, config: C, build: Callable[[C, DaemonContext], DaemonApp]) -> None:
        self.kind = kind
        self.config = config
        self._build: Callable[[Any, DaemonContext], DaemonApp] = build
        self.service_id = config.service_id or default_service_id(kind)
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.grpc_port = 0
        self.metrics_port = -1

    def request_stop(self) -> None:
        """Asks the serving loop to shut down (signal-safe)."""
        self._stop_requested.set()

    async def run(self) -> int:
        """Serves until asked to stop; raises StartupError when it cannot start."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        cfg = self.config
        try:
            security = TransportSecurity.from_config(cfg)
            registry = Registry.from_config(cfg)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        metrics_registry = CollectorRegistry()
        rpc_metrics = RpcMetrics(self.kind, metrics_registry)
        up = Gauge(f"flexmarl_{self.kind}_up", "1 while the daemon serves.", registry=metrics_registry)
        GCCollector(registry=metrics_registry)  # python_gc_collections_total{generation} and the objects collected
        Gauge(f"flexmarl_{self.kind}_gc_frozen_objects",
              "Objects in the collector's permanent generation (frozen after start-up, --gc-freeze).",
              registry=metrics_registry).set_function(gc.get_freeze_count)
        try:
            await registry.connect()
        except Unavailable as exc:
            raise StartupError(f"{exc} at {cfg.etcd_endpoints}") from None
        advertise = f"{cfg.advertise_host or cfg.host}"
        ctx = DaemonContext(self.kind, self.service_id, cfg, metrics_registry, registry, security=security)
        app = self._build(cfg, ctx)
        server = GrpcServer(app.service_names, cfg.max_message_bytes, rpc_metrics, security)
        app.add_to_server(server.server)
        metrics_server: MetricsServer | None = None
        try:
            try:
                self.grpc_port = server.bind(cfg.host, cfg.port)
            except OSError as exc:
                raise StartupError(f"gRPC: {exc}") from None
            ctx.advertise_address = f"{advertise}:{self.grpc_port}"
            if cfg.metrics_port >= 0:
                metrics_server = MetricsServer(metrics_registry, cfg.metrics_host, cfg.metrics_port)
                try:
                    self.metrics_port = metrics_server.start()
                except OSError as exc:
                    metrics_server = None
                    raise StartupError(
                        f"metrics: cannot bind {cfg.metrics_host}:{cfg.metrics_port}: {exc.strerror or exc}"
                    ) from None
            await app.start()
            # Start-up is done: what it built lives as long as the daemon (flexmarl/gc_policy.py). Before the
            # server accepts calls, so that no RPC waits for the one full collection this runs.
            apply_after_startup(GcPolicy(freeze=cfg.gc_freeze, gen0_threshold=cfg.gc_gen0_threshold))
            await server.server.start()
            await server.set_serving(True)
            up.set(1)
            record = ServiceRecord(
                kind=self.kind,
                service_id=self.service_id,
                address=ctx.advertise_address,
                metrics_port=self.metrics_port,
                pid=os.getpid(),
                started_unix_ms=int(time.time() * 1000),
                info=app.registration_info(),
            )
            try:
                await registry.register(record, cfg.registry_ttl_s)
            except Exception as exc:  # etcd vanished between connect and register
                raise StartupError(f"etcd: cannot register: {type(exc).__name__} {exc}") from None
            self._write_ready_file()
            log.info("%s %s serving gRPC on %s, metrics on %s", self.kind, self.service_id,
                     ctx.advertise_address, self.metrics_port)
            await self._stop_requested.wait()
            log.info("%s shutting down", self.kind)
            up.set(0)
            await server.set_serving(False)
            await registry.deregister(self.kind, self.service_id)
            await server.server.stop(cfg.grace_s)
            await app.stop()
            return EXIT_OK
        finally:
            await server.server.stop(0)
            if metrics_server is not None:
                metrics_server.stop()
            await registry.close()
            log.info("%s stopped", self.kind)

    def _write_ready_file(self) -> None:
        if not self.config.ready_file:
            return
        path = Path(self.config.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({
            "grpc_port": self.grpc_port,
            "metrics_port": self.metrics_port,
            "pid": os.getpid(),
            "service_id": self.service_id,
        }))
        tmp.replace(path)
