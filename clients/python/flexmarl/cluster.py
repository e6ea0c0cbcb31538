"""A cluster's processes: etcd and daemons as subprocesses on OS-chosen ports.

Used by the test harness, ``flexmarl up`` and ``flexmarl slurm``. Each runs on a host of a
:mod:`flexmarl.placement` (this machine's loopback unless told otherwise), started through the
placement's runner. Launchers fail fast: when a child dies before it is ready, the error carries
the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from flexmarl.placement import LOCALHOST, Host, HostRunner

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


def descendant_pids(pid: int, cmdline_contains: str) -> list[int]:
    """Pids of ``pid``'s live descendants whose command line contains ``cmdline_contains``.

    [] when ``pid`` is gone. Used to find the engine replicas a rolloutd launched.
    """
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if cmdline_contains in " ".join(child.cmdline()):
                pids.append(child.pid)
    return sorted(pids)


def _tail(path: Path, max_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


#: torch.distributed's rendezvous variables. A daemon forms its own process groups (traind's world of
#: one, its data-parallel groups); inherited from the launching process (a torchrun or Slurm shell, a
#: test process that initialised a group) they would make every traind bind the same MASTER_PORT.
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                        "MASTER_PORT")


def daemon_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child, without :data:`RENDEZVOUS_VARIABLES` unless ``env`` sets them."""
    full_env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    full_env.update(env or {})
    return full_env


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
        full_env = daemon_environment(env)
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
        if self.proc is not None and self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._close_log()

    def terminate(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        self.signal_stop()
        return self.wait_stopped(timeout_s)

    def signal_stop(self) -> None:
        """Sends SIGTERM if the process runs; :meth:`wait_stopped` waits for it (several stop together)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float = 10.0) -> int:
        """Waits for an exit after :meth:`signal_stop`, SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc is None:
            return 0
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


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """PEM files etcd serves clients with; ``client_cert_auth`` requires a client certificate signed by ``ca``."""

    cert: Path
    key: Path
    ca: Path
    client_cert_auth: bool = False


def etcd_client_args(tls: EtcdTls | None, username: str, password_file: Path | None) -> list[str]:
    """The daemon flags that reach an etcd serving ``tls`` with ``username`` (its password in the file)."""
    args: list[str] = []
    if tls is not None:
        args += ["--etcd-ca", str(tls.ca)]
        if tls.client_cert_auth:
            args += ["--etcd-cert", str(tls.cert), "--etcd-key", str(tls.key)]
    if password_file is not None:
        args += ["--etcd-username", username, "--etcd-password-file", str(password_file)]
    return args


#: etcd's history auto-compaction for every etcd started here (``flexmarl up``, tests, benchmarks): keep
#: the last 10,000 revisions (etcd 3.4 compacts every 5 minutes in revision mode). Without it etcd keeps
#: every revision of every key and its db grows with every step. Production: deploy/config/etcd.env.
#: Defragmentation (returning the freed pages to the file system) is orchestratord's
#: (``orchestratord/etcd_maintenance.py``).
AUTO_COMPACTION_ENV = {"ETCD_AUTO_COMPACTION_MODE": "revision", "ETCD_AUTO_COMPACTION_RETENTION": "10000"}


class EtcdServer(_Child):
    """A real etcd on free loopback ports; its data dir is ``<run_dir>/etcd-data`` (or a temp dir), removed on stop.

    ``tls`` serves clients over HTTPS/TLS; ``auth`` creates the ``root`` user with a random
    password (in ``password_file``, mode 0600) and enables etcd's authentication.
    ``extra_hosts`` are further addresses (already configured) it listens on for clients.
    """

    def __init__(
        self,
        run_dir: Path | None = None,
        binary: str | None = None,
        *,
        tls: EtcdTls | None = None,
        auth: bool = False,
        extra_hosts: Sequence[str] = (),
        host: Host = LOCALHOST,
        runner: HostRunner | None = None,
        member: str = "flexmarl-test",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._own_dir = run_dir is None
        super().__init__("etcd", Path(tempfile.mkdtemp(prefix="flexmarl-etcd-")) if run_dir is None else run_dir)
        self.binary = binary or os.environ.get(ETCD_BINARY_ENV) or shutil.which("etcd") or "/usr/bin/etcd"
        self.data_dir = self.run_dir / "etcd-data"
        self.client_port = 0
        self.peer_port = 0
        self.tls = tls
        self.auth = auth
        #: Its member name, and (a member of a cluster of several) every member's name=peer URL.
        self.member = member
        #: Further ETCD_* settings for the process (etcd reads every flag from its environment too);
        #: :data:`AUTO_COMPACTION_ENV` unless ``env`` sets them.
        self.env = {**AUTO_COMPACTION_ENV, **(env or {})}
        self.initial_cluster = ""
        self.cluster_token = "flexmarl"
        #: Whether it talks mutual TLS to its peers (``tls`` needed): set for the members of an
        #: :class:`EtcdCluster` with TLS; a lone member has no peers.
        self.peer_tls = False
        #: The host it runs on (clients reach it at the host's address) and how it is started there.
        self.host = host
        self.runner = runner or HostRunner()
        self.extra_hosts = tuple(extra_hosts) if host.loopback else tuple(dict.fromkeys((host.address, *extra_hosts)))
        self.username = "root" if auth else ""
        self.password_file = self.run_dir / "etcd-root-password" if auth else None

    @property
    def endpoint(self) -> str:
        """host:port for clients (the host's address; loopback on one machine)."""
        return f"{self.host.address}:{self.client_port}"

    def _spawn(self, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        super()._spawn(self.runner.wrap(self.host, cmd, name=self.name), env)

    def endpoint_on(self, host: str) -> str:
        """host:port for clients that reach etcd on one of its ``extra_hosts``."""
        return f"{host}:{self.client_port}"

    def client_args(self) -> list[str]:
        """The daemon flags that reach this etcd: its CA, a client certificate, the root user."""
        return etcd_client_args(self.tls, self.username, self.password_file)

    def start(self, timeout_s: float = 20.0) -> None:
        """Starts etcd (reusing its ports on a restart) and waits for /health; enables auth on a fresh data dir."""
        fresh = not (self.data_dir / "member").exists()
        for attempt in range(3):
            if not self.client_port or (attempt and not self.initial_cluster):
                self.client_port, self.peer_port = free_port(), free_port()
            self.spawn()
            try:
                self.wait_healthy(timeout_s)
                break
            except LaunchError:
                # A member of a cluster keeps the ports its peers were told (no retry on other ports).
                if (self.data_dir.exists() and attempt < 2 and not self.initial_cluster
                        and "address already in use" in self.stderr_tail()):
                    continue
                raise
        if self.password_file is not None and fresh:
            self._enable_auth(self.password_file)

    @property
    def peer_url(self) -> str:
        """Where the other members of its cluster reach it."""
        return f"{'https' if self.peer_tls else 'http'}://{self.host.address}:{self.peer_port}"

    def spawn(self) -> None:
        """Starts the process on its ports without waiting (the members of a cluster start together)."""
        if not Path(self.binary).exists():
            raise LaunchError(f"etcd binary not found at {self.binary} (apt install etcd-server)")
        self.peer_port = self.peer_port or free_port()
        scheme = "https" if self.tls is not None else "http"
        tls_args: list[str] = []
        if self.tls is not None:
            tls_args = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                        "--trusted-ca-file", str(self.tls.ca)]
            if self.tls.client_cert_auth:
                tls_args.append("--client-cert-auth")
        if self.peer_tls:
            assert self.tls is not None  # keep: peer_tls implies it
            # The members authenticate each other with certificates of the same CA (the server
            # certificate serves both ends: it carries the client-auth usage too).
            tls_args += ["--peer-cert-file", str(self.tls.cert), "--peer-key-file", str(self.tls.key),
                         "--peer-trusted-ca-file", str(self.tls.ca), "--peer-client-cert-auth"]
        client_urls = ",".join(f"{scheme}://{host}:{self.client_port}" for host in ("127.0.0.1", *self.extra_hosts))
        # One member: fast elections (tests restart it often). Several: timeouts that a loaded 2-core
        # machine keeps (etcd's own defaults are 100 ms / 1 s), or the leader flaps under load.
        timing = ["10", "100"] if not self.initial_cluster else ["100", "1000"]
        cluster = ["--initial-cluster", self.initial_cluster or f"{self.member}={self.peer_url}"]
        if self.initial_cluster:
            cluster += ["--initial-cluster-token", self.cluster_token]
        self._spawn([
            self.binary, "--name", self.member, "--data-dir", str(self.data_dir),
            "--listen-client-urls", client_urls, "--advertise-client-urls", client_urls,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url, *cluster,
            "--heartbeat-interval", timing[0], "--election-timeout", timing[1],
            "--quota-backend-bytes", str(256 * 1024 * 1024), "--log-level", "warn", *tls_args,
        ], env={"ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", ""), **self.env})

    def wait_healthy(self, timeout_s: float) -> None:
        """Waits for /health (a member of a cluster: once the cluster has a leader); kills it on failure."""
        try:
            wait_until(self._healthy, timeout_s, f"{self.member} /health")
        except (TimeoutError, LaunchError):
            self.kill()
            raise LaunchError(f"etcd did not become healthy; last output:\n{self.stderr_tail()}") from None

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        if self.tls.client_cert_auth:
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        return context

    def _enable_auth(self, password_file: Path) -> None:
        """Creates the root user (random password, written 0600) and turns etcd's auth on.

        A member of a cluster does it for the whole cluster (users and the auth switch are replicated).
        """
        import grpc
        from aetcd import rpc

        password = secrets.token_urlsafe(24)
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
        if self.tls is None:
            channel = grpc.insecure_channel(self.endpoint)
        else:
            key = self.tls.key.read_bytes() if self.tls.client_cert_auth else None
            cert = self.tls.cert.read_bytes() if self.tls.client_cert_auth else None
            channel = grpc.secure_channel(self.endpoint, grpc.ssl_channel_credentials(
                self.tls.ca.read_bytes(), private_key=key, certificate_chain=cert))
        with channel:
            auth = rpc.AuthStub(channel)
            auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=10)
            auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=10)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
            auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)

    def _healthy(self) -> bool:
        self._check_alive()
        scheme = "https" if self.tls is not None else "http"
        try:
            with urllib.request.urlopen(f"{scheme}://{self.endpoint}/health", timeout=1,
                                        context=self._ssl_context()) as resp:
                return bool(json.loads(resp.read()).get("health") in ("true", True))
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def restart(self, timeout_s: float = 20.0) -> None:
        """Stops and starts etcd on the same ports and data (state survives)."""
        self.terminate()
        self.start(timeout_s)

    def stop(self, *, keep_data: bool = False) -> None:
        """Stops etcd and deletes its data (it preallocates ~120 MB) unless ``keep_data``.

        A kept data dir is reused by the next :meth:`start` of an ``EtcdServer`` on the same
        ``run_dir`` (new ports, same keys): how ``flexmarl up`` brings a local cluster's jobs back.
        An etcd in a temp dir of its own (no ``run_dir``) never keeps its data.
        """
        self.terminate()
        if keep_data and not self._own_dir:
            return
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class EtcdCluster:
    """Several etcd members (three or five for a quorum that survives one or two deaths), started together.

    Member ``i`` keeps its data in ``<run_dir>/member-<i>/etcd-data``; clients get every member's
    endpoint (:attr:`endpoint`, comma-separated), and FlexMARL's registry follows the cluster when the
    member it uses dies. It offers what :class:`flexmarl.localcluster.LocalCluster` uses of an
    :class:`EtcdServer`. With ``tls`` every member serves clients over TLS with the same certificate
    and the members talk mutual TLS to each other; ``auth`` creates the ``root`` user (password in
    ``<run_dir>/etcd-root-password``) and enables auth on the cluster, once, on fresh data.
    """

    def __init__(self, run_dir: Path, members: int, binary: str | None = None, *, host: Host = LOCALHOST,
                 runner: HostRunner | None = None, tls: EtcdTls | None = None, auth: bool = False) -> None:
        if members < 1:
            raise ValueError("an etcd cluster needs at least one member")
        self.run_dir = run_dir
        self.members = [EtcdServer(run_dir / f"member-{i}", binary, host=host, runner=runner, member=f"etcd-{i}",
                                   tls=tls) for i in range(members)]
        token = "flexmarl-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
        for member in self.members:
            member.cluster_token = token
            member.peer_tls = tls is not None
        self.tls = tls
        self.username = "root" if auth else ""
        self.password_file: Path | None = run_dir / "etcd-root-password" if auth else None

    @property
    def binary(self) -> str:
        """The etcd executable."""
        return self.members[0].binary

    @property
    def host(self) -> Host:
        """The host the members run on."""
        return self.members[0].host

    @property
    def runner(self) -> HostRunner:
        """How the members are started on it."""
        return self.members[0].runner

    @property
    def extra_hosts(self) -> tuple[str, ...]:
        """Further addresses the members listen on."""
        return self.members[0].extra_hosts

    @property
    def endpoint(self) -> str:
        """Every member's host:port, comma-separated (the daemons' --etcd-endpoints)."""
        return ",".join(member.endpoint for member in self.members)

    @property
    def data_dir(self) -> Path:
        """The first member's data dir (its ``member`` subdirectory shows that the cluster has state)."""
        return self.members[0].data_dir

    @property
    def pid(self) -> int:
        """The first member's pid (the cluster file's; :attr:`pids` are all of them)."""
        return self.members[0].pid

    @property
    def pids(self) -> list[int]:
        """Every member's pid."""
        return [member.pid for member in self.members]

    def client_args(self) -> list[str]:
        """The daemon flags that reach it: its CA, a client certificate, the root user (none when plain)."""
        return etcd_client_args(self.tls, self.username, self.password_file)

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts every member on ports agreed up front and waits until each is healthy (a leader is elected).

        On fresh data with ``auth``, enables auth on the cluster through the first member.
        """
        fresh = not any((member.data_dir / "member").exists() for member in self.members)
        for member in self.members:
            if not member.client_port:
                member.client_port, member.peer_port = free_port(), free_port()
        initial = ",".join(f"{m.member}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial
        try:
            for member in self.members:
                member.spawn()
            for member in self.members:
                member.wait_healthy(timeout_s)
            if self.password_file is not None and fresh:
                self.members[0]._enable_auth(self.password_file)
        except BaseException:
            self.stop(keep_data=True)
            raise

    def kill(self) -> None:
        """SIGKILLs every member (fault tests); :meth:`start` brings them back on their data and ports."""
        for member in self.members:
            member.kill()

    def stop(self, *, keep_data: bool = False) -> None:
        """Stops every member; deletes their data unless ``keep_data``."""
        for member in self.members:
            member.signal_stop()
        for member in self.members:
            member.wait_stopped()
        if not keep_data:
            for member in self.members:
                shutil.rmtree(member.data_dir, ignore_errors=True)


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
        host: Host = LOCALHOST,
        runner: HostRunner | None = None,
        gpus: int = 0,
    ) -> None:
        super().__init__(name or kind, run_dir)
        self.kind = kind
        #: The host it runs on, binds and advertises (its gRPC and metrics servers), and how it is started there.
        self.host = host
        self.runner = runner or HostRunner()
        self.gpus = gpus
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
        return f"{self.host.address}:{self.grpc_port}"

    def command(self) -> list[str]:
        """The command line that starts it (through its host's runner)."""
        hosted = [] if self.host.loopback else ["--host", self.host.address, "--metrics-host", self.host.address]
        return self.runner.wrap(self.host, [
            sys.executable, "-m", self.kind,
            "--etcd-endpoints", self.etcd_endpoint, "--etcd-prefix", self.etcd_prefix,
            "--ready-file", str(self.ready_file), *hosted, *self.args,
        ], name=self.name, gpus=self.gpus)

    def start(self, timeout_s: float = 60.0) -> None:
        """Starts it and waits for its ready file; raises LaunchError with its output if it dies."""
        self.spawn()
        self.wait_ready(timeout_s)

    def spawn(self) -> None:
        """Starts the process without waiting (several daemons then import in parallel); see wait_ready."""
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        self._spawn(self.command(), env=self.env)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Waits for the ready file of a spawned daemon; raises LaunchError with its output if it dies."""
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
