"""`flexmarl up` restarts a crashed daemon (systemd's Restart=on-failure): back-off, a restart limit, and says so.

A real stored daemon (the cheapest to start) under :class:`DaemonSupervisor` with a clock the test moves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl.cluster import DaemonProcess
from flexmarl.localcluster import DaemonSupervisor, GaveUp, RestartPolicy

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _crash(proc: DaemonProcess) -> None:
    assert proc.proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=10)


def test_a_crashed_daemon_is_restarted_after_its_back_off_until_the_limit(start_daemon: object,
                                                                         tmp_path: Path) -> None:
    stored = start_daemon("stored", "--data-dir", str(tmp_path / "data"))  # type: ignore[operator]
    clock = Clock()
    restarted: list[str] = []
    supervisor = DaemonSupervisor({"stored": stored}, RestartPolicy(initial_delay_s=1.0, max_restarts=1),
                                  on_restart=restarted.append, now_s=clock)
    assert supervisor.check() == []  # alive: nothing to do

    first_pid = stored.pid
    _crash(stored)
    assert supervisor.check() == [
        f"stored killed by signal 9; restarting it in 1.0s (restart 1 of at most 1); log {stored.log_path}"]
    assert supervisor.check() == [] and not stored.alive()  # within its back-off
    clock.now_s += 1.0
    (line,) = supervisor.check()
    assert stored.alive() and stored.pid != first_pid
    assert line == f"stored restarted (pid {stored.pid}, {stored.address})"
    assert restarted == ["stored"]  # the cluster file is rewritten: a new pid and new ports

    _crash(stored)  # a second crash within the window is one more than max_restarts allows
    with pytest.raises(GaveUp, match=r"^stored killed by signal 9; restarted 1 times in 300s, giving up"):
        supervisor.check()

    clock.now_s += 301.0  # a crash after the window counts from zero again, backing off from the start
    assert supervisor.check()[0].startswith("stored killed by signal 9; restarting it in 1.0s (restart 1 of")


def test_a_daemon_that_exits_with_code_0_is_not_restarted(tmp_path: Path) -> None:
    """Exit 0 is a stop on purpose (a drained SIGTERM), not a failure: `up` reports it and does not restart."""
    daemon = DaemonProcess("stored", etcd_endpoint="127.0.0.1:1", run_dir=tmp_path)
    daemon.proc = subprocess.Popen([sys.executable, "-c", "pass"])
    daemon.proc.wait(timeout=30)
    with pytest.raises(GaveUp, match=r"^stored exited \(code 0\) and is not restarted"):
        DaemonSupervisor({"stored": daemon}, RestartPolicy(initial_delay_s=0.0)).check()


def test_back_off_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(initial_delay_s=1.0, max_delay_s=5.0)
    assert [policy.delay_s(n) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
