"""Local processes: a throwaway etcd and daemons as subprocesses on OS-chosen ports.

Used by the test harness and by ``flexmarl up``. Launchers fail fast: when a child
dies before it is ready, the error carries the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ETCD_BINARY_ENV = "FLEXMARL_ETCD_BINARY"


class LaunchError(RuntimeError):
    """A child process failed to start or died; the message holds its stderr tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for programs that cannot take port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Polls predicate until it holds; raises TimeoutError naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(interval_s)


def _tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


class _Child:
    """A subprocess whose stdout/stderr go to log files in a run dir."""

    def __init__(self, name: str, run_dir: Path) -> None:
        self.name = name
        self.run_dir = run_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = run_dir / f"{name}.log"
        self._log: IO[bytes] | None = None

    def _spawn(self, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            list(cmd), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr_tail(self) -> str:
        """The last lines the child wrote."""
        return _tail(self.log_path)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise LaunchError(
                f"{self.name} exited with code {self.proc.returncode}; last output:\n{self.stderr_tail()}"
            )

    def kill(self) -> None:
        """SIGKILL, no cleanup (fault tests)."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close_log()

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_log()
        return int(self.proc.returncode)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class EtcdServer(_Child):
    """A real etcd on free loopback ports with a temp data dir (removed on stop)."""

    def __init__(self, run_dir: Path | None = None, binary: str | None = None) -> None:
        self._own_dir = run_dir is None
        super().__init__("etcd", Path(tempfile.mkdtemp(prefix="flexmarl-etcd-")) if run_dir is None else run_dir)
        self.binary = binary or os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd") or "/usr/bin/etcd"
        self.data_dir = self.run_dir / "etcd-data"
        self.client_port = 0
        self.peer_port = 0

    @property
    def endpoint(self) -> str:
        """host:port for clients."""
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Starts etcd (reusing its ports on a restart) and waits for /health."""
        if not Path(self.binary).exists():
            raise LaunchError(f"etcd binary not found at {self.binary} (apt install etcd-server)")
        for attempt in range(3):
            if not self.client_port or attempt:
                self.client_port, self.peer_port = free_port(), free_port()
            client_url = f"http://127.0.0.1:{self.client_port}"
            peer_url = f"http://127.0.0.1:{self.peer_port}"
            self._spawn([
                self.binary, "--name", "flexmarl-test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"flexmarl-test={peer_url}",
                "--heartbeat-interval", "10", "--election-timeout", "100",
                "--quota-backend-bytes", str(256 * 1024 * 1024), "--log-level", "warn",
            ], env={"ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")})
            try:
                wait_until(self._healthy, timeout_s, "etcd /health")
                return
            except (TimeoutError, LaunchError):
                self.kill()
                if self.data_dir.exists() and attempt < 2 and "address already in use" in self.stderr_tail():
                    continue
                raise LaunchError(f"etcd did not become healthy; last output:\n{self.stderr_tail()}") from None

    def _healthy(self) -> bool:
        self._check_alive()
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return bool(json.loads(resp.read()).get("health") in ("true", True))
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def restart(self, timeout_s: float = 20.0) -> None:
        """Stops and starts etcd on the same ports and data (state survives)."""
        self.terminate()
        self.start(timeout_s)

    def stop(self) -> None:
        """Stops etcd and deletes its data (it preallocates ~120 MB)."""
        self.terminate()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class DaemonProcess(_Child):
    """`python -m <kind>` on OS-chosen ports, registered in the given etcd."""

    def __init__(
        self,
        kind: str,
        args: Sequence[str] = (),
        *,
        etcd_endpoint: str,
        run_dir: Path,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        etcd_prefix: str = "/flexmarl",
    ) -> None:
        super().__init__(name or kind, run_dir)
        self.kind = kind
        self.args = list(args)
        self.etcd_endpoint = etcd_endpoint
        self.etcd_prefix = etcd_prefix
        self.env = dict(env or {})
        self.ready_file = run_dir / f"{self.name}.ready.json"
        self.grpc_port = 0
        self.metrics_port = -1
        self.service_id = ""

    @property
    def address(self) -> str:
        """host:port of its gRPC server."""
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        """The command line that starts it."""
        return [
            sys.executable, "-m", self.kind,
            "--etcd-endpoints", self.etcd_endpoint, "--etcd-prefix", self.etcd_prefix,
            "--ready-file", str(self.ready_file), *self.args,
        ]

    def start(self, timeout_s: float = 60.0) -> None:
        """Starts it and waits for its ready file; raises LaunchError with its output if it dies."""
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        self._spawn(self.command(), env=self.env)
        try:
            wait_until(self._ready, timeout_s, f"{self.name} to become ready")
        except TimeoutError as exc:
            self.kill()
            raise LaunchError(f"{exc}; last output:\n{self.stderr_tail()}") from None
        info: dict[str, Any] = json.loads(self.ready_file.read_text())
        self.grpc_port = int(info["grpc_port"])
        self.metrics_port = int(info["metrics_port"])
        self.service_id = str(info["service_id"])

    def _ready(self) -> bool:
        self._check_alive()
        return self.ready_file.exists()

    def restart(self, timeout_s: float = 60.0) -> None:
        """Starts the same daemon again (after kill or terminate)."""
        if self.alive():
            self.terminate()
        self.start(timeout_s)
