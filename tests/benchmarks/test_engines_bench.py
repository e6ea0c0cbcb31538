"""benchmarks/engines.py's quick mode: one real vLLM server and one embedded engine; the table and JSON it writes.

No timing is asserted (the figures of a quick run on a shared machine mean nothing). In CI a
missing vLLM fails the test, elsewhere it skips (tests/rolloutd/vllm_support.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PATHS = ("(a) vllm-openai", "(b) rolloutd-vllm", "(c) rolloutd-embedded")


def _vllm_support() -> ModuleType:
    """tests/rolloutd/vllm_support.py (the test directories are not packages)."""
    path = REPO_ROOT / "tests" / "rolloutd" / "vllm_support.py"
    spec = importlib.util.spec_from_file_location("vllm_support", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_engines_benchmark_writes_its_table_and_json(tmp_path: Path) -> None:
    python = _vllm_support().require_vllm_python()
    out = tmp_path / "engines.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engines", "--quick", "--vllm-python", python, "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=220, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for header in ("path", "tokens/s", "p50 ms", "p99 ms"):
        assert header in proc.stdout
    assert "(b)/(a) at concurrency 4:" in proc.stdout and "load average" in proc.stdout
    report = json.loads(out.read_text())
    rows = {(row["path"], row["concurrency"]): row for row in report["rows"]}
    assert set(rows) == {(path, c) for path in PATHS for c in report["concurrency"]}
    for row in rows.values():
        assert row["requests"] == report["prompts"] * report["repeats"]
        assert row["tokens"] == row["requests"] * report["new_tokens"]
        assert row["tokens_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
    assert set(report["ratio_b_over_a"]) == {str(c) for c in report["concurrency"]}
    assert report["target_ratio"] == 0.9 and len(report["load_avg_at_start"]) == 3
