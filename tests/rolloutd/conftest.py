"""Fixtures of the engine tests (prefixed ``engine_``; other rolloutd tests share this dir)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.synthetic_engine import SyntheticFleet
from benchmarks.synthetic_replica import SyntheticEngineConfig
from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch

# Both shipped servers run with room for 4 sequences, so tests can fill a batch and queue behind it.
ENGINE_MAX_RUNNING = 4


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (seed 0)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("engine-ckpt") / "seed0", seed=0)


@pytest.fixture(scope="session")
def engine_checkpoint_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights (seed 1), for reload tests."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("engine-ckpt") / "seed1", seed=1)


def _launch_embedded(checkpoint: Path, run_dir: Path, *extra_args: str) -> EngineReplica:
    spec = ReplicaSpec("embedded", str(checkpoint), seed=0, extra_args=extra_args)
    return asyncio.run(launch(spec, run_dir, timeout_s=120))


@pytest.fixture(scope="module")
def engine_replica(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReplica]:
    """An embedded engine subprocess in SGLang's default mode (seeds ignored), shared by a module."""
    replica = _launch_embedded(
        engine_checkpoint, tmp_path_factory.mktemp("engine-run"), "--max-batch-size", str(ENGINE_MAX_RUNNING)
    )
    try:
        yield replica
    finally:
        replica.stop(grace_s=10)


@pytest.fixture(scope="module")
def engine_deterministic_replica(
    engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineReplica]:
    """An embedded engine subprocess launched with ``--enable-deterministic-inference``."""
    replica = _launch_embedded(
        engine_checkpoint, tmp_path_factory.mktemp("engine-run-det"), "--enable-deterministic-inference"
    )
    try:
        yield replica
    finally:
        replica.stop(grace_s=10)


@pytest.fixture(scope="module")
def engine_synthetic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyntheticFleet]:
    """A one-replica synthetic engine subprocess (H100 timing, real time), shared by a module."""
    config = SyntheticEngineConfig(replicas=1, max_running_requests=ENGINE_MAX_RUNNING, seed=0)
    fleet = SyntheticFleet.start(config, tmp_path_factory.mktemp("engine-synth"), timeout_s=60)
    try:
        yield fleet
    finally:
        fleet.stop()


@dataclass(frozen=True)
class ServedEngine:
    """One of the servers FlexMARL ships, running: which one, and its URL."""

    kind: str  # "embedded" or "synthetic"
    url: str

    @property
    def real_logits(self) -> bool:
        """Whether a neural network (and a tokenizer) produces its tokens."""
        return self.kind == "embedded"


@pytest.fixture(scope="module", params=["embedded", "synthetic"])
def engine_served(request: pytest.FixtureRequest) -> ServedEngine:
    """Every server implementation FlexMARL ships, in turn (the contract suite runs against each)."""
    if request.param == "embedded":
        replica: EngineReplica = request.getfixturevalue("engine_replica")
        return ServedEngine("embedded", replica.url)
    fleet: SyntheticFleet = request.getfixturevalue("engine_synthetic")
    return ServedEngine("synthetic", fleet.urls[0])


@pytest.fixture(scope="session")
def engine_reference_model(engine_checkpoint: Path) -> object:
    """The checkpoint loaded in this process, for forward-pass comparisons."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model
