"""Fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_support import small_job, write_job


@pytest.fixture(scope="module")
def small_job_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/signaling/job.yaml with total_steps 2, prompts_per_step 4, group_size 4, micro_batch_size 8."""
    path: Path = write_job(tmp_path_factory.mktemp("jobs") / "job.yaml", small_job())
    return path
