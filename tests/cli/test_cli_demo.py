"""`flexmarl demo`, shortened: its own local cluster, a 2-step signaling job, summary table and PNG."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_support import ensure_stopped, run_cli

from flexmarl.localcluster import CLUSTER_FILE

pytestmark = pytest.mark.timeout(300)


def test_demo_trains_plots_and_summarises(small_job_file: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    try:
        demo = run_cli("demo", "--steps", "2", "--job-file", str(small_job_file), "--run-dir", str(run_dir),
                       "--engine-replicas", "1", timeout_s=280)
    finally:
        ensure_stopped(run_dir)
    assert demo.returncode == 0, demo.explain()
    out = demo.stdout
    assert "FlexMARL demo" in out and "agents sender, receiver" in out, demo.explain()
    header = next((line for line in out.splitlines() if "first reward" in line), "")
    for column in ("agent", "steps", "first reward", "last reward", "best reward", "tokens/s", "step s"):
        assert column in header, demo.explain()
    for agent in ("sender", "receiver"):
        row = next((line for line in out.splitlines() if re.search(rf"\b{agent}\b\s*\S\s*2\s*\S", line)), "")
        assert row, f"no summary row with 2 steps for {agent}\n{demo.explain()}"
        rewards = re.findall(r"\d+\.\d{3}", row)
        assert len(rewards) >= 3 and all(0.0 <= float(r) <= 1.0 for r in rewards[:3]), row
    match = re.search(r"job succeeded in \d+s; reward curve: (\S+\.png)", out)
    assert match, demo.explain()
    png = Path(match.group(1))
    assert png.parent == run_dir.resolve()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert not (run_dir / CLUSTER_FILE).exists()  # the demo stopped its cluster
