"""Where the tests find vLLM: a test that needs it fails in CI when it is missing, elsewhere it skips.

Shared by tests/rolloutd/test_vllm_engine.py and tests/e2e/test_vllm_e2e.py (which loads this file
by path: the two test directories are not packages).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: A fast, small vLLM replica on CPU (docs/engines.md): no torch.compile, a short context, 64 MiB of KV cache.
VLLM_TEST_ARGS = ("--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", "67108864",
                  "--max-num-seqs", "8")


def vllm_python() -> str:
    """The vLLM environment's python: $FLEXMARL_VLLM_PYTHON, else the repo's .venv-vllm (./dev.sh test)."""
    return os.environ.get("FLEXMARL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def require_vllm_python() -> str:
    """:func:`vllm_python`; fails the test in CI (``CI=true``) when it is not installed, skips it elsewhere."""
    python = vllm_python()
    if not os.access(python, os.X_OK):
        reason = f"vLLM is not installed at {python} (./dev.sh test installs it into .venv-vllm)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return python
