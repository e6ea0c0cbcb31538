"""A real one-host Slurm for tests: munged, slurmctld and slurmd from Debian's packages in a temp dir.

Settings as seen working on these machines (shared/SLURM_TEST.md): root daemons without systemd, our own
ports and munge socket, ``proctrack/linuxproc``, no accounting, no batch delay, ``KillWait=2``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

#: Debian's packages the harness needs (dev.sh installs them).
SLURM_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")


def require_slurm() -> None:
    """Skips outside CI when Slurm is missing; in CI (CI=true) a missing Slurm fails the test."""
    missing = [name for name in SLURM_BINARIES if shutil.which(name) is None]
    if not missing:
        return
    message = f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node_line() -> str:
    """This host as a Slurm node: `slurmd -C`'s first line without RealMemory, reached on loopback."""
    shown = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    first = shown.splitlines()[0]
    fields = [f for f in first.split() if not f.startswith("RealMemory=")]
    return " ".join(fields) + " NodeAddr=127.0.0.1 State=UNKNOWN"


class SlurmCluster:
    """munged + slurmctld + slurmd for this host only; :meth:`stop` kills all three and their jobs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node = _node_line().split()[0].removeprefix("NodeName=")

    @property
    def env(self) -> dict[str, str]:
        """The environment every Slurm command of this cluster needs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        """Writes the configuration, starts the three daemons and waits until the node is idle."""
        root = self.root
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a socket under a directory others cannot traverse.
        for path in (root, *root.parents):
            if path == Path("/"):
                break
            path.chmod(path.stat().st_mode | 0o755)
        key = root / "munge" / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
        socket_path = root / "munge" / "munge.sock"
        self._spawn(["munged", "-F", "-S", str(socket_path), f"--key-file={key}",
                     f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
                     f"--seed-file={root / 'munge' / 'munged.seed'}"], root / "log" / "munged.out")
        _wait(lambda: socket_path.exists(), timeout_s, "munged's socket", self)
        self.conf.write_text("\n".join([
            "ClusterName=flexmarltest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=2",
            "SchedulerParameters=batch_sched_delay=0",
            "MailProg=/bin/true",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            _node_line(),
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], root / "log" / "slurmctld.out")
        self._spawn(["slurmd", "-D", "-f", str(self.conf)], root / "log" / "slurmd.out")
        _wait(lambda: self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle", timeout_s,
              "the Slurm node to be idle", self)

    def _spawn(self, argv: Sequence[str], log: Path) -> None:
        with log.open("ab") as out:
            self.procs.append(subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=self.env, start_new_session=True))

    def run(self, *argv: str, check: bool = True, env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=check,
                              env={**self.env, **(env or {})}, cwd=cwd)

    def job_state(self, job_id: str) -> str:
        """JobState of a job (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...), "" once Slurm forgot it."""
        shown = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        for field in shown.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def logs(self) -> str:
        """The daemons' logs' tails (for a failing test's message)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-3000:]
            parts.append(f"--- {path.name}\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, then stops slurmd, slurmctld and munged."""
        self.run("scancel", "--full", "-u", "root", check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}\n{cluster.logs()}")
