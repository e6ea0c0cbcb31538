"""A launched daemon does not inherit the launcher's torch.distributed rendezvous (MASTER_PORT, RANK, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flexmarl.cluster import RENDEZVOUS_VARIABLES, _Child, daemon_environment

pytestmark = pytest.mark.timeout(60)


def test_rendezvous_variables_are_dropped_unless_the_daemon_is_given_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.setenv(name, "7")
    monkeypatch.setenv("FLEXMARL_KEEP_ME", "yes")
    env = daemon_environment()
    assert not set(RENDEZVOUS_VARIABLES) & set(env)
    assert env["FLEXMARL_KEEP_ME"] == "yes"
    assert daemon_environment({"MASTER_PORT": "29555"})["MASTER_PORT"] == "29555"  # given on purpose: kept


def test_a_child_started_after_this_process_joined_a_group_gets_a_clean_rendezvous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """traind.distributed.ensure_distributed in a test process sets MASTER_PORT; every traind inherited it."""
    monkeypatch.setenv("MASTER_PORT", "29513")
    monkeypatch.setenv("RANK", "0")
    child = _Child("probe", tmp_path)
    child._spawn([sys.executable, "-c", "import os; print(os.environ.get('MASTER_PORT'), os.environ.get('RANK'))"])
    assert child.proc is not None
    child.proc.wait(timeout=30)  # the child wrote its line to the log file before it exited
    assert child.log_path.read_text().split() == ["None", "None"]
