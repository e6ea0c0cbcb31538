"""The soak benchmark's short mode: real etcd, orchestratord and stored; the table, JSON and PNG it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_writes_a_sane_table_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--steps", "60", "--every", "20", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "orch RSS MiB" in proc.stdout and "etcd db MiB" in proc.stdout and "history ms" in proc.stdout
    report = json.loads(out.read_text())
    assert report["job_state"] == "JOB_STATE_SUCCEEDED"
    assert report["committed_steps"] == 60 and report["agent_commits"] == 60 * 4
    rows = report["rows"]
    steps = [row["step"] for row in rows]
    assert steps[0] == 0 and steps[-1] == 60 and steps == sorted(steps) and len(rows) >= 4
    for row in rows:
        assert row["orchestratord_rss_bytes"] > 10 * 2**20 and row["stored_rss_bytes"] > 10 * 2**20
        assert 0 < row["db_in_use_bytes"] <= row["db_bytes"]
        assert row["stored_files_bytes"] == sum(row["stored_files"].values()) > 0
        assert row["status_ms"] > 0 and row["history_ms"] > 0
    # Every agent's every step has its history record by the end.
    assert rows[-1]["history_records"] == 60 * 4
    assert rows[-1]["db_bytes"] > rows[0]["db_bytes"]
    assert set(report["growth_per_step"]) >= {"orchestratord_rss_bytes", "stored_rss_bytes", "db_bytes"}
    assert report["etcd_env"] == {"ETCD_AUTO_COMPACTION_MODE": "revision", "ETCD_AUTO_COMPACTION_RETENTION": "10000"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
