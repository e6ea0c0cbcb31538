"""Swap transparency: an agent swapped out and back trains exactly as one never swapped."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flexmarl.errors import InvalidArgument, NotFound
from traind.locations import (
    FileLocation,
    MemoryLocation,
    MemoryStateStore,
    StateLocation,
    StoredLocation,
    open_location,
)
from traind.model import AgentTrainer, AgentTrainerConfig
from traind.swap import swap_in, swap_out

from .conftest import make_groups
from .test_trainer import flat_params, step_sizes, trainer_config


def train_steps(trainer: AgentTrainer, first_seed: int, steps: int) -> None:
    for step in range(steps):
        groups = make_groups(seed=first_seed + step, tasks=2, group_size=4, agent=trainer.config.agent)
        for group in groups:
            trainer.accumulate(group)
        trainer.optimizer_step(*step_sizes(groups))


def optimizer_state(trainer: AgentTrainer) -> list[torch.Tensor]:
    state = trainer.engine.basic_optimizer.state
    return [t.clone() for s in state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]


def check_swap_is_transparent(
    config_a: AgentTrainerConfig, config_b: AgentTrainerConfig, location: StateLocation
) -> None:
    """A: 2 steps, out; B in, 1 step, out; A back in, 2 steps == A trained 4 steps unswapped."""
    unswapped = AgentTrainer(config_a)
    train_steps(unswapped, first_seed=100, steps=4)
    want_params = flat_params(unswapped.engine.module)
    want_opt = optimizer_state(unswapped)
    unswapped.release()

    agent_a = AgentTrainer(config_a)
    train_steps(agent_a, first_seed=100, steps=2)
    out_stats = swap_out(agent_a, location)
    assert not agent_a.resident and out_stats.bytes_moved > 0
    agent_b = AgentTrainer(config_b)
    train_steps(agent_b, first_seed=500, steps=1)
    agent_b.release()
    agent_a, in_stats = swap_in(config_a, location)
    assert in_stats.bytes_moved == out_stats.bytes_moved
    assert agent_a.version == 2
    train_steps(agent_a, first_seed=102, steps=2)
    assert agent_a.version == 4
    assert torch.equal(flat_params(agent_a.engine.module), want_params)
    for got, want in zip(optimizer_state(agent_a), want_opt, strict=True):
        assert torch.equal(got, want)
    agent_a.release()


@pytest.mark.parametrize(("scheme", "zero_stage"), [("mem", 0), ("file", 0), ("file", 2), ("mem", 3)])
def test_swap_transparency(
    tiny_model_dir: Path, tiny_model_dir_b: Path, tmp_path: Path, scheme: str, zero_stage: int
) -> None:
    memory = MemoryStateStore()
    uri = "mem://job/a" if scheme == "mem" else (tmp_path / "state-a").as_uri()
    location = open_location(uri, memory=memory)
    config_a = trainer_config(tiny_model_dir, zero_stage=zero_stage, agent="a")
    config_b = trainer_config(tiny_model_dir_b, zero_stage=zero_stage, agent="b")
    check_swap_is_transparent(config_a, config_b, location)
    if scheme == "mem":
        assert memory.nbytes() > 0


def test_open_location_resolves_and_validates(tmp_path: Path) -> None:
    memory = MemoryStateStore()
    assert isinstance(open_location("mem://job/agent", memory=memory), MemoryLocation)
    assert isinstance(open_location(tmp_path.as_uri()), FileLocation)
    stored = open_location("stored://job/agent", store=object(), rank=1, world_size=2)  # type: ignore[arg-type]
    assert isinstance(stored, StoredLocation)
    assert stored.blob_name == "job/agent/rank-00001-of-00002.tar"
    for bad in ("s3://bucket/x", "file://relative/x", "mem://", "mem://a/../b"):
        with pytest.raises(InvalidArgument):
            open_location(bad, memory=memory, store=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        open_location("mem://x")
    with pytest.raises(InvalidArgument):
        open_location("stored://x")
    with pytest.raises(NotFound):
        with open_location("mem://never", memory=memory).readable_dir():
            pass
    with pytest.raises(NotFound):
        with open_location((tmp_path / "absent").as_uri()).readable_dir():
            pass


@pytest.fixture
def stored_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a thread, as traind's main loop while torch works in another thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_swap_transparency_through_stored(
    tiny_model_dir: Path, tiny_model_dir_b: Path, tmp_path: Path, stored_loop: asyncio.AbstractEventLoop
) -> None:
    if shutil.which("etcd") is None:
        pytest.skip("stored:// needs an etcd binary for the stored daemon's registry (Debian etcd-server)")
    from flexmarl.cluster import DaemonProcess, EtcdServer
    from flexmarl.store_client import StoreClient

    etcd = EtcdServer(tmp_path / "etcd")
    etcd.start()
    stored = DaemonProcess(
        "stored", ["--data-dir", str(tmp_path / "stored")], etcd_endpoint=etcd.endpoint, run_dir=tmp_path / "run"
    )
    try:
        stored.start()

        async def connect() -> StoreClient:
            return StoreClient(stored.address)

        client = asyncio.run_coroutine_threadsafe(connect(), stored_loop).result(10)
        location = open_location("stored://job/a/state", store=client, loop=stored_loop, job_id="job")
        check_swap_is_transparent(
            trainer_config(tiny_model_dir, agent="a"), trainer_config(tiny_model_dir_b, agent="b"), location
        )
        asyncio.run_coroutine_threadsafe(client.close(), stored_loop).result(10)
    finally:
        stored.terminate()
        etcd.stop()
