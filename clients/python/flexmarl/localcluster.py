"""A whole FlexMARL cluster: etcd + the four daemons as child processes.

Used by ``flexmarl up`` / ``flexmarl demo``, ``flexmarl slurm`` and by end-to-end tests. By
default every process runs on this machine and listens on loopback; a :class:`Placement` lays
the roles over several hosts instead (a Slurm allocation, the multi-host test's namespaces), each
process on its host's address, started through the placement's runner. Every process takes a
port the OS chose (etcd: a free one); logs go to ``<run_dir>/<name>.log`` and the cluster's
addresses to ``<run_dir>/cluster.json``. Across hosts the run dir must be on a file system every
host shares (the daemons write their ready files there).

The cluster's state lives in the run dir: etcd's data (``etcd/etcd-data``: jobs, steps,
registrations), stored's experiences (``stored-data``) and the workers' directories
(``traind-N``: published weights; ``rolloutd-N``: weight cache). A cluster started again on
the same run dir reuses all of it, so orchestratord restores its jobs. A persistent cluster
(``flexmarl up``) keeps that state when it stops; ``flexmarl down --wipe`` (:func:`wipe_state`)
deletes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from flexmarl.cluster import DaemonProcess, EtcdCluster, EtcdServer, EtcdTls, LaunchError
from flexmarl.devcerts import DevCerts
from flexmarl.placement import LOCAL_PLACEMENT, Host, Placement

if TYPE_CHECKING:
    from flexmarl.registry import EtcdSecurity

log = logging.getLogger(__name__)

CLUSTER_FILE = "cluster.json"
ETCD_DIR = "etcd"
STORED_DATA_DIR = "stored-data"
_WORKER_DIR = re.compile(r"^(traind|rolloutd)-\d+$")
DEFAULT_TORCH_EXTENSIONS_DIR = Path.home() / ".cache" / "flexmarl" / "torch_extensions"


@dataclasses.dataclass(frozen=True)
class LocalClusterConfig:
    """Shape of a local cluster."""

    run_dir: Path
    rollout_workers: int = 1
    engine_replicas: int = 2
    trainer_workers: int = 1
    trainer_slots: int = 1
    etcd_prefix: str = "/flexmarl"
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rolloutd_args: Sequence[str] = ()
    traind_args: Sequence[str] = ()
    orchestratord_args: Sequence[str] = ()
    stored_args: Sequence[str] = ()
    #: Generate dev TLS material and a token into ``<run_dir>/tls`` and start every daemon with them;
    #: etcd then serves mutual TLS (server cert; clients need a certificate of the dev CA) with auth
    #: on (user ``root``, a random password in ``etcd/etcd-root-password``, mode 0600).
    secure: bool = False
    #: Keep etcd's data when the cluster stops (``flexmarl up``), so that the next start restores the jobs.
    #: A throwaway cluster (tests, the demo) deletes the etcd data it created; data it found is always kept.
    persistent: bool = False
    #: Where each role runs and how its processes are started there (default: all here, on loopback).
    placement: Placement = LOCAL_PLACEMENT
    #: etcd's client port (0: a free one); a launcher across hosts may pin it.
    etcd_port: int = 0
    #: etcd members (3 or 5: a quorum that survives one or two deaths), each its own process and data.
    etcd_members: int = 1


class LocalCluster:
    """Starts and stops a local cluster; usable as a context manager."""

    def __init__(self, config: LocalClusterConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir.resolve()
        self.etcd: EtcdServer | EtcdCluster
        if config.etcd_members > 1:
            self.etcd = EtcdCluster(self.run_dir / ETCD_DIR, config.etcd_members, host=config.placement.control,
                                    runner=config.placement.runner)
        else:
            self.etcd = EtcdServer(self.run_dir / ETCD_DIR, host=config.placement.control,
                                   runner=config.placement.runner)
            self.etcd.client_port = config.etcd_port
        self.daemons: dict[str, DaemonProcess] = {}
        #: The generated TLS material and token when the cluster is secure (None otherwise).
        self.certs: DevCerts | None = None
        #: Whether start() found etcd data of an earlier run (whose jobs orchestratord then restores).
        self.restored = False

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def etcd_endpoint(self) -> str:
        """host:port of etcd."""
        return self.etcd.endpoint

    def daemon(self, name: str) -> DaemonProcess:
        """A started daemon by name (e.g. "stored", "rolloutd-0")."""
        return self.daemons[name]

    def _add(self, kind: str, name: str, args: Sequence[str], env: Mapping[str, str] | None = None,
             host: Host | None = None) -> DaemonProcess:
        full_env = {
            "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
            # DeepSpeed JIT-builds its CPU ops once per machine; share one cache with dev.sh and the tests.
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(DEFAULT_TORCH_EXTENSIONS_DIR)),
            **self.config.env, **(env or {}),
        }
        if self.certs is not None:
            args = [*self.certs.daemon_args(), *self.etcd.client_args(), *args]
        placement = self.config.placement
        worker = kind in ("rolloutd", "traind")
        proc = DaemonProcess(kind, args, etcd_endpoint=self.etcd.endpoint, run_dir=self.run_dir, env=full_env,
                             name=name, etcd_prefix=self.config.etcd_prefix, host=host or placement.control,
                             runner=placement.runner, gpus=placement.gpus_per_worker if worker else 0)
        self.daemons[name] = proc
        return proc

    def start(self, timeout_s: float = 120.0) -> None:
        """Starts etcd, then stored, orchestratord, traind and rolloutd workers together; waits until all serve."""
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        running = running_etcd_pid(self.run_dir)
        if running is not None:
            raise LaunchError(f"a local cluster is already running in {self.run_dir} (etcd pid {running}); "
                              "stop it with `flexmarl down`")
        self._check_etcd_layout()
        self.restored = (self.etcd.data_dir / "member").exists()
        if cfg.secure and self.certs is None:
            self._secure_etcd()
        try:
            self.etcd.start()
            # Fixed registry ids (as the workers have): a restarted daemon overwrites its own record
            # instead of sitting next to its dead predecessor's until that lease expires.
            self._add("stored", "stored", ["--data-dir", str(self.run_dir / STORED_DATA_DIR), "--service-id", "stored",
                                           *cfg.stored_args], host=cfg.placement.store_host)
            self._add("orchestratord", "orchestratord", ["--service-id", "orchestratord", *cfg.orchestratord_args])
            for i in range(cfg.trainer_workers):
                host = cfg.placement.trainer_host(i)
                # Data-parallel peers reach each other at the host's address (the default is loopback).
                dp_host = [] if host.loopback else ["--dp-host", host.address]
                self._add("traind", f"traind-{i}", [
                    "--slots", str(cfg.trainer_slots), "--work-dir", str(self.run_dir / f"traind-{i}"),
                    "--service-id", f"traind-{i}", *dp_host, *cfg.traind_args,
                ], host=host)
            for i in range(cfg.rollout_workers):
                self._add("rolloutd", f"rolloutd-{i}", [
                    "--engine-replicas", str(cfg.engine_replicas), "--work-dir", str(self.run_dir / f"rolloutd-{i}"),
                    "--service-id", f"rolloutd-{i}", *cfg.rolloutd_args,
                ], host=cfg.placement.rollout_host(i))
            # All at once: each waits for its peers through etcd, and their imports (torch in the
            # workers) overlap instead of adding up.
            for proc in self.daemons.values():
                proc.spawn()
            for proc in self.daemons.values():
                proc.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.write_cluster_file()

    def _check_etcd_layout(self) -> None:
        """Refuses settings the run dir's etcd cannot take: a member count other than its data's."""
        members = self.config.etcd_members
        etcd_dir = self.run_dir / ETCD_DIR
        single = (etcd_dir / "etcd-data" / "member").exists()
        found = len(list(etcd_dir.glob("member-*/etcd-data/member"))) or int(single)
        if found and found != members:
            raise LaunchError(f"the run dir holds the data of a {found}-member etcd; start it with --etcd-members "
                              f"{found} (or delete its jobs with `flexmarl down --wipe`)")

    def _secure_etcd(self) -> None:
        """Generates the dev TLS material and makes etcd serve mutual TLS with auth (see ``secure``).

        The daemons present the server certificate (it is also a client certificate) and log in
        as ``root``; a restarted cluster keeps its etcd data, whose root password is the one
        already in the password file (auth is enabled only on a fresh data dir).
        """
        from flexmarl.devcerts import generate

        self.certs = generate(self.run_dir / "tls")
        tls = EtcdTls(cert=self.certs.server_cert, key=self.certs.server_key, ca=self.certs.ca, client_cert_auth=True)
        if isinstance(self.etcd, EtcdCluster):
            self.etcd = EtcdCluster(self.run_dir / ETCD_DIR, len(self.etcd.members), self.etcd.binary,
                                    host=self.etcd.host, runner=self.etcd.runner, tls=tls, auth=True)
            return
        self.etcd = EtcdServer(self.run_dir / ETCD_DIR, self.etcd.binary, tls=tls, auth=True,
                               extra_hosts=self.etcd.extra_hosts, host=self.etcd.host, runner=self.etcd.runner)
        self.etcd.client_port = self.config.etcd_port

    def etcd_security(self) -> EtcdSecurity:
        """How a client reaches this cluster's etcd: plaintext, or (secure) the dev CA, client cert and root user."""
        from flexmarl.registry import EtcdSecurity

        if self.certs is None or self.etcd.password_file is None:
            return EtcdSecurity()
        return EtcdSecurity.from_files(ca=str(self.certs.ca), cert=str(self.certs.client_cert),
                                       key=str(self.certs.client_key), username=self.etcd.username,
                                       password_file=str(self.etcd.password_file))

    def write_cluster_file(self) -> None:
        """Records addresses and pids so `flexmarl down` and clients can find the cluster."""
        data: dict[str, Any] = {
            "etcd_endpoint": self.etcd.endpoint,
            "etcd_prefix": self.config.etcd_prefix,
            "etcd_pid": self.etcd.pid,
            "etcd_pids": self.etcd.pids if isinstance(self.etcd, EtcdCluster) else [self.etcd.pid],
            "etcd_data_dir": str(self.etcd.data_dir),
            "started_unix_s": time.time(),
            "tls": {f.name: str(getattr(self.certs, f.name)) for f in dataclasses.fields(self.certs)}
            if self.certs is not None else {},
            # The CLI's --etcd-* settings that reach a secure cluster's etcd (paths, never the password).
            "etcd_tls": {"etcd_ca": str(self.certs.ca), "etcd_cert": str(self.certs.client_cert),
                         "etcd_key": str(self.certs.client_key), "etcd_username": self.etcd.username,
                         "etcd_password_file": str(self.etcd.password_file)}
            if self.certs is not None else {},
            "daemons": {
                name: {"kind": p.kind, "pid": p.pid, "address": p.address, "metrics_port": p.metrics_port,
                       "log": str(p.log_path)}
                for name, p in self.daemons.items()
            },
        }
        (self.run_dir / CLUSTER_FILE).write_text(json.dumps(data, indent=2))

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to every daemon (workers first), then etcd.

        Removes etcd's data only when the cluster is not ``persistent`` and created that data
        (found none at start): stopping never deletes the jobs of an earlier run.
        """
        # Tiers in order (workers, then orchestratord, then stored: what they flush into); the
        # daemons of one tier stop together.
        for tier in ([p for p in self.daemons.values() if p.kind not in ("orchestratord", "stored")],
                     [p for p in self.daemons.values() if p.kind == "orchestratord"],
                     [p for p in self.daemons.values() if p.kind == "stored"]):
            for proc in tier:
                with contextlib.suppress(Exception):
                    proc.signal_stop()
            for proc in tier:
                with contextlib.suppress(Exception):
                    proc.wait_stopped(timeout_s)
        with contextlib.suppress(Exception):
            self.etcd.stop(keep_data=self.config.persistent or self.restored)
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / CLUSTER_FILE).unlink()


def read_cluster_file(run_dir: Path) -> dict[str, Any]:
    """The cluster.json of a running local cluster; raises LaunchError when there is none."""
    path = run_dir / CLUSTER_FILE
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        raise LaunchError(f"no local cluster running in {run_dir} (no readable {CLUSTER_FILE})") from None
    return data


def running_etcd_pid(run_dir: Path) -> int | None:
    """The pid of the etcd that run_dir's cluster.json names when it is still running, else None."""
    with contextlib.suppress(LaunchError, KeyError, TypeError, ValueError):
        data = read_cluster_file(run_dir)
        pid, data_dir = int(data["etcd_pid"]), str(data["etcd_data_dir"])
        # The pid of a crashed cluster may have been reused: it counts only while it is that etcd.
        with contextlib.suppress(psutil.Error):
            if pid > 0 and _alive(pid) and data_dir in " ".join(psutil.Process(pid).cmdline()):
                return pid
    return None


def state_paths(run_dir: Path) -> list[Path]:
    """The directories of run_dir that hold a local cluster's state (those that exist).

    etcd's data, stored's data and the workers' directories; not the logs, the TLS material or
    the tiny models the CLI built (``models/``).
    """
    paths = [run_dir / ETCD_DIR / "etcd-data", *sorted((run_dir / ETCD_DIR).glob("member-*/etcd-data")),
             run_dir / STORED_DATA_DIR]
    if run_dir.is_dir():
        paths += sorted(p for p in run_dir.iterdir() if _WORKER_DIR.match(p.name))
    return [p for p in paths if p.is_dir()]


def wipe_state(run_dir: Path) -> list[Path]:
    """Deletes a stopped local cluster's state (:func:`state_paths`); returns what it deleted.

    Raises:
        LaunchError: the cluster recorded in run_dir is still running.
    """
    running = running_etcd_pid(run_dir)
    if running is not None:
        raise LaunchError(f"the local cluster in {run_dir} is still running (etcd pid {running}); "
                          "stop it first")
    paths = state_paths(run_dir)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    return paths


def stop_from_file(run_dir: Path, timeout_s: float = 20.0) -> int:
    """Stops a detached local cluster recorded in run_dir; returns how many processes were signalled.

    Its state (etcd's data, stored's data, the workers' directories) stays for the next start on
    run_dir; :func:`wipe_state` deletes it.
    """
    data = read_cluster_file(run_dir)
    # Workers first, then orchestratord, then stored (what they flush into), then etcd.
    order = {"rolloutd": 0, "traind": 0, "orchestratord": 1, "stored": 2}
    tiers: list[list[int]] = [[], [], [], [int(pid) for pid in data.get("etcd_pids", [data.get("etcd_pid", -1)])]]
    for d in data.get("daemons", {}).values():
        tiers[order.get(str(d.get("kind")), 0)].append(int(d["pid"]))
    signalled = 0
    for tier in tiers:  # the processes of one tier stop together
        sent = []
        for pid in tier:
            if pid <= 0:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                signalled += 1
                sent.append(pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in sent):
            time.sleep(0.05)
        for pid in sent:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (run_dir / CLUSTER_FILE).unlink()
    return signalled


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a crashed daemon of a local cluster is started again: systemd's ``Restart=on-failure``.

    A daemon that exits with a non-zero code or a signal is restarted after a back-off that doubles
    from ``initial_delay_s`` up to ``max_delay_s`` (``RestartSec``, with steps); more than
    ``max_restarts`` restarts within ``window_s`` (``StartLimitBurst`` in ``StartLimitIntervalSec``)
    give up. A daemon that exits with code 0 stopped on purpose and is not restarted.
    """

    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0

    def delay_s(self, recent_restarts: int) -> float:
        """The back-off before the next restart, after ``recent_restarts`` within the window."""
        return float(min(self.max_delay_s, self.initial_delay_s * 2 ** recent_restarts))


class GaveUp(LaunchError):
    """A daemon exited and is not restarted (exit code 0, or its restart limit was reached)."""


class DaemonSupervisor:
    """Restarts the crashed daemons of a local cluster by a :class:`RestartPolicy`; ``flexmarl up`` polls it.

    :meth:`check` never sleeps: it notes a death, and restarts the daemon on the first check
    after its back-off. ``on_restart`` runs after each successful restart (the local cluster
    rewrites its cluster file: a restarted daemon has a new pid and new ports).
    """

    def __init__(self, daemons: Mapping[str, DaemonProcess], policy: RestartPolicy = RestartPolicy(), *,
                 on_restart: Callable[[str], None] = lambda name: None,
                 now_s: Callable[[], float] = time.monotonic, start_timeout_s: float = 120.0) -> None:
        self._daemons = daemons
        self._policy = policy
        self._on_restart = on_restart
        self._now_s = now_s
        self._start_timeout_s = start_timeout_s
        self._restarts: dict[str, list[float]] = {}
        self._due_s: dict[str, float] = {}

    def check(self) -> list[str]:
        """Restarts what is due; returns one line per death noticed or restart done.

        Raises:
            GaveUp: a daemon exited with code 0, or crashed once more than its restart limit allows.
        """
        lines: list[str] = []
        now = self._now_s()
        for name, proc in self._daemons.items():
            if proc.alive():
                continue
            if name not in self._due_s:
                lines.append(self._noticed(name, proc, now))
            elif now >= self._due_s[name]:
                lines.append(self._restart(name, proc))
        return lines

    def _noticed(self, name: str, proc: DaemonProcess, now: float) -> str:
        code = proc.proc.returncode if proc.proc is not None else None
        if code == 0:
            raise GaveUp(f"{name} exited (code 0) and is not restarted; see {proc.log_path}")
        recent = [t for t in self._restarts.get(name, []) if now - t < self._policy.window_s]
        self._restarts[name] = recent
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if len(recent) >= self._policy.max_restarts:
            raise GaveUp(f"{name} {how}; restarted {len(recent)} times in {self._policy.window_s:.0f}s, "
                         f"giving up; see {proc.log_path}")
        delay = self._policy.delay_s(len(recent))
        self._due_s[name] = now + delay
        return (f"{name} {how}; restarting it in {delay:.1f}s "
                f"(restart {len(recent) + 1} of at most {self._policy.max_restarts}); log {proc.log_path}")

    def _restart(self, name: str, proc: DaemonProcess) -> str:
        del self._due_s[name]
        self._restarts[name].append(self._now_s())
        try:
            proc.restart(self._start_timeout_s)
        except LaunchError as exc:  # counted; the next check notices it dead again and backs off further
            return f"{name} did not start again: {str(exc).splitlines()[0]}"
        self._on_restart(name)
        return f"{name} restarted (pid {proc.pid}, {proc.address})"
