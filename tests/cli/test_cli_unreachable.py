"""Without a reachable cluster every client subcommand exits 3 with one line on stderr."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from cli_support import run_cli


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(autouse=True)
def no_cluster_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXMARL_ORCHESTRATOR", raising=False)
    monkeypatch.delenv("FLEXMARL_ETCD_ENDPOINTS", raising=False)


@pytest.mark.parametrize("command", [["jobs"], ["status", "j"], ["watch", "j"], ["cancel", "j"], ["plot", "j"],
                                     ["time-to-reward", "j"]])
def test_no_cluster_file_is_exit_3(command: list[str], tmp_path: Path) -> None:
    result = run_cli(*command, "--run-dir", str(tmp_path))
    assert result.returncode == 3, result.explain()
    assert result.stderr.strip() == (f"flexmarl {command[0]}: no cluster: pass --address or --etcd, or start one "
                                     f"with `flexmarl up` (looked in {tmp_path})"), result.explain()


@pytest.mark.parametrize("flag", ["--etcd", "--address"])
def test_unreachable_endpoint_is_exit_3(flag: str) -> None:
    result = run_cli("jobs", flag, f"127.0.0.1:{_closed_port()}", timeout_s=60)
    assert result.returncode == 3, result.explain()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexmarl jobs: cannot reach the cluster: "), result.explain()
    assert result.stdout == ""


def test_down_without_cluster_is_exit_3(tmp_path: Path) -> None:
    result = run_cli("down", "--run-dir", str(tmp_path))
    assert result.returncode == 3, result.explain()
    assert result.stderr.strip() == (f"flexmarl down: no local cluster running in {tmp_path} "
                                      "(no readable cluster.json)")


@pytest.mark.timeout(120)
def test_up_that_fails_prints_the_failing_daemons_last_log_lines(tmp_path: Path) -> None:
    """A daemon that exits at start: `flexmarl up` names it and shows why (its log's last lines), exit 1."""
    result = run_cli("up", "--detach", "--run-dir", str(tmp_path), env={"FLEXMARL_LEASE_POLL_MAX_MS": "-1"})
    assert result.returncode == 1, result.explain()
    lines = result.stderr.strip().splitlines()
    assert lines[0] == ("flexmarl up: cluster did not start: orchestratord exited with code 2; "
                        "the last lines of its log:"), result.explain()
    assert "  | orchestratord: error: lease_poll_max_ms: must be in 1..60000, got -1" in lines, result.explain()
    assert lines[-1] == f"(logs in {tmp_path})", result.explain()
