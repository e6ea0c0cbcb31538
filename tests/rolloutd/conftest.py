"""Fixtures of the engine tests (prefixed ``engine_``; other rolloutd tests share this dir)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("engine-ckpt") / "seed0", seed=0)


@pytest.fixture(scope="session")
def engine_checkpoint_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights (seed 1), for reload tests."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("engine-ckpt") / "seed1", seed=1)


@pytest.fixture(scope="module")
def engine_replica(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReplica]:
    """An embedded engine subprocess shared by a test module; stopped at module teardown."""
    run_dir = tmp_path_factory.mktemp("engine-run")
    replica = asyncio.run(launch(ReplicaSpec("embedded", str(engine_checkpoint), seed=0), run_dir, timeout_s=120))
    try:
        yield replica
    finally:
        replica.stop(grace_s=10)


@pytest.fixture(scope="session")
def engine_reference_model(engine_checkpoint: Path) -> object:
    """The checkpoint loaded in this process, for forward-pass comparisons."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model
