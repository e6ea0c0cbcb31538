"""Fixtures of the stored tests: a database in a temp dir and a record factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from flexmarl.experience import ExperienceRecord, experience_id, group_id
from stored.database import Database

RecordFactory = Callable[..., ExperienceRecord]


def make_record(
    task: str = "t0",
    sample: int = 0,
    agent: str = "alice",
    turn: int = 0,
    *,
    job_id: str = "job1",
    version: int = 0,
    group_size: int = 4,
    response_tokens: int = 16,
    prompt_tokens: int = 8,
    reward: float = 1.0,
    seed: int | None = None,
) -> ExperienceRecord:
    """A valid record with deterministic pseudo-random arrays."""
    rng = np.random.default_rng(seed if seed is not None else hash((task, sample, agent, turn)) & 0xFFFF)
    return ExperienceRecord(
        experience_id=experience_id(task, sample, agent, turn),
        job_id=job_id,
        agent=agent,
        task_id=task,
        group_id=group_id(task, agent),
        sample_index=sample,
        episode_id=f"{task}-{sample}",
        turn=turn,
        behavior_version=version,
        reward=reward,
        prompt_token_ids=rng.integers(0, 50_000, prompt_tokens, dtype=np.int32),
        response_token_ids=rng.integers(0, 50_000, response_tokens, dtype=np.int32),
        response_logprobs=-rng.random(response_tokens, dtype=np.float32),
        group_size=group_size,
    )


@pytest.fixture
def record_factory() -> RecordFactory:
    return make_record


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(tmp_path / "stored.db")
    yield database
    database.close()
