"""Fixtures for traind tests: CPU DeepSpeed, a tiny checkpoint, synthetic experiences."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

# Tests only: DeepSpeed's CPU accelerator (traind itself never sets it); tests/conftest.py, loaded
# first, sets it too and picks DeepSpeed's JIT cache (TORCH_EXTENSIONS_DIR).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from flexmarl.experience import ExperienceRecord, experience_id, group_id  # noqa: E402


def make_group(
    rng: np.random.Generator, task: str, agent: str, group_size: int, vocab: int = 200, behavior_version: int = 0
) -> list[ExperienceRecord]:
    """One complete group: group_size single-turn episodes with random lengths and rewards."""
    out = []
    for sample in range(group_size):
        prompt = rng.integers(1, vocab, size=int(rng.integers(2, 7))).astype(np.int32)
        response = rng.integers(1, vocab, size=int(rng.integers(1, 6))).astype(np.int32)
        logprobs = (-rng.uniform(3.0, 7.0, size=response.shape[0])).astype(np.float32)
        out.append(
            ExperienceRecord(
                experience_id=experience_id(task, sample, agent, 0),
                job_id="job",
                agent=agent,
                task_id=task,
                group_id=group_id(task, agent),
                sample_index=sample,
                episode_id=f"{task}/{sample}",
                turn=0,
                behavior_version=behavior_version,
                reward=float(rng.integers(0, 3)),
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=logprobs,
                group_size=group_size,
            )
        )
    return out


def make_groups(seed: int, tasks: int, group_size: int, agent: str = "a") -> list[list[ExperienceRecord]]:
    rng = np.random.default_rng(seed)
    return [make_group(rng, f"t{seed}-{i}", agent, group_size) for i in range(tasks)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flexmarl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flexmarl.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tinyb") / "model", seed=1)


GroupsFactory = Callable[[int, int, int], list[list[ExperienceRecord]]]
