"""Shared fixtures: a throwaway etcd and daemons as subprocesses on OS-chosen ports."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flexmarl.cluster import DaemonProcess, EtcdServer

# DeepSpeed must pick its CPU accelerator on machines without a GPU; harmless with one
# for the tests, which train on CPU.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's JIT cache for its CPU ops: the per-interpreter folder dev.sh builds it in (the build
# names the interpreter's paths, so interpreters sharing one folder rebuild it in turn, for minutes).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser(
    f"~/.cache/flexmarl/torch_extensions/{hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]}"))


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A started etcd on free loopback ports; its data dir is removed after the test."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


StartDaemon = Callable[..., DaemonProcess]


@pytest.fixture
def start_daemon(etcd: EtcdServer, tmp_path: Path) -> Iterator[StartDaemon]:
    """start_daemon(kind, *args, name=None, env=None) -> a ready DaemonProcess; all stopped after."""
    started: list[DaemonProcess] = []

    def start(kind: str, *args: str, name: str | None = None, env: dict[str, str] | None = None,
              timeout_s: float = 60.0) -> DaemonProcess:
        proc = DaemonProcess(kind, args, etcd_endpoint=etcd.endpoint, run_dir=tmp_path / "run", env=env,
                             name=name or f"{kind}-{len(started)}")
        started.append(proc)
        proc.start(timeout_s)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.terminate(timeout_s=10)
