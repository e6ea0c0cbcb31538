"""Which device each traind slot trains on, and that DeepSpeed is given it (LOCAL_RANK).

On this CPU machine DeepSpeed's CPU accelerator ignores the device index, but the engine
still records the LOCAL_RANK it was built under (``engine.local_rank``), which is what
picks ``cuda:N`` on a GPU host (DeepSpeedEngine._set_distributed_vars).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any, cast

import deepspeed
import pytest
import yaml
from prometheus_client import CollectorRegistry

from flexmarl.cli import materialize_models
from flexmarl.config import ConfigError, load_config
from flexmarl.connections import PeerConnections
from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpecCache, spec_digest
from flexmarl.registry import Registry
from traind import distributed
from traind.config import TrainerConfig
from traind.link import GrpcOrchestratorLink, GrpcStoreLink
from traind.metrics import TrainerMetrics
from traind.work import DataParallelGroup, MicroBatchWork
from traind.worker import TrainerSettings, TrainerWorker

REPO_ROOT = Path(__file__).resolve().parents[2]


def _settings(tmp_path: Path, slots: int, ranks: tuple[int, ...] | None) -> TrainerSettings:
    return TrainerSettings(worker_id="traind-test", slots=slots, work_dir=tmp_path, state_location="file",
                           publish_location="file", slot_local_ranks=ranks)


def _worker(settings: TrainerSettings) -> TrainerWorker:
    # Nothing here calls a peer: the connections stay unopened.
    peers = PeerConnections(cast(Registry, object()), orchestrator_address="127.0.0.1:9",
                            store_address="127.0.0.1:9", max_message_bytes=1 << 26)
    return TrainerWorker(settings, TrainerMetrics(CollectorRegistry()),
                         GrpcOrchestratorLink(peers, settings.worker_id), GrpcStoreLink(peers))


def test_each_slot_gets_one_device_as_its_local_index() -> None:
    four = TrainerConfig(slots=2)
    # CUDA_VISIBLE_DEVICES fixes this process's numbering: device 6 is cuda:2 here.
    assert TrainerConfig(slots=2, gpus="6,7").slot_local_ranks(
        env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, cuda_device_count=lambda: 4) == (2, 3)
    assert four.slot_local_ranks(env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, cuda_device_count=lambda: 4) == (0, 1)
    assert four.slot_local_ranks(env={}, cuda_device_count=lambda: 4) == (0, 1)
    assert TrainerConfig(slots=1, gpus="3").slot_local_ranks(env={}, cuda_device_count=lambda: 4) == (3,)
    assert TrainerConfig(slots=1, gpus="GPU-b").slot_local_ranks(
        env={"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, cuda_device_count=lambda: 2) == (1,)


def test_cpu_training_assigns_nothing() -> None:
    assert TrainerConfig(slots=4).slot_local_ranks(env={"CUDA_VISIBLE_DEVICES": "0"}, cuda_device_count=lambda: 0) \
        is None
    assert TrainerConfig(slots=4, gpus="none").slot_local_ranks(env={}, cuda_device_count=lambda: 8) is None
    # DS_ACCELERATOR=cpu here: the real count is 0 and load_config assigns nothing.
    assert distributed.cuda_device_count() == 0
    assert load_config(TrainerConfig, ["--slots", "3"], prog="traind", env={}).slot_local_ranks() is None


def test_device_misconfigurations_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"3 x 1 device\(s\) needed, but only 2"):
        TrainerConfig(slots=3).slot_local_ranks(env={}, cuda_device_count=lambda: 2)
    with pytest.raises(ConfigError, match="not in this daemon's CUDA_VISIBLE_DEVICES"):
        TrainerConfig(slots=1, gpus="2").slot_local_ranks(env={"CUDA_VISIBLE_DEVICES": "0,1"},
                                                          cuda_device_count=lambda: 2)
    with pytest.raises(ConfigError, match="must be an index"):
        TrainerConfig(slots=1, gpus="GPU-a").slot_local_ranks(env={}, cuda_device_count=lambda: 2)
    with pytest.raises(ConfigError, match="beyond the 2 CUDA devices"):
        TrainerConfig(slots=1, gpus="5").slot_local_ranks(env={}, cuda_device_count=lambda: 2)
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        load_config(TrainerConfig, ["--gpus", "0"], prog="traind", env={})


def test_worker_slots_carry_their_devices(tmp_path: Path) -> None:
    worker = _worker(_settings(tmp_path, 2, (2, 3)))
    assert [slot.local_rank for slot in worker.slots] == [2, 3]
    assert [slot.local_rank for slot in _worker(_settings(tmp_path, 2, None)).slots] == [None, None]
    with pytest.raises(InvalidArgument, match="1 devices for 2 slots"):
        _worker(_settings(tmp_path, 2, (0,)))


async def test_slot_calls_run_with_the_slots_local_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # restored after the test
    worker = _worker(_settings(tmp_path, 2, (0, 5)))
    seen: list[tuple[str, int]] = []

    def record() -> None:
        seen.append((os.environ["LOCAL_RANK"], threading.get_ident()))

    await worker._on_device(worker.slots[1], record)
    await worker._on_device(worker.slots[0], record)
    assert [rank for rank, _ in seen] == ["5", "0"]
    assert all(ident != threading.get_ident() for _, ident in seen)  # on pool threads, set there


def _signaling_spec_json(models_dir: Path) -> str:
    raw: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "signaling" / "job.yaml").read_text())
    return json.dumps(materialize_models(raw, models_dir))


@pytest.mark.timeout(240)
async def test_a_slots_engine_is_built_on_the_slots_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    worker = _worker(_settings(tmp_path, 2, (0, 1)))
    spec_json = _signaling_spec_json(tmp_path / "models")

    async def fetch(job_id: str) -> str:  # orchestratord's GetJob
        return spec_json

    worker._specs = JobSpecCache(fetch)
    work = MicroBatchWork(lease_id="", job_id="job", agent="sender", step=0, step_id="s1", micro_batch_index=0,
                          experience_ids=(), base_version=0, state_uri="", step_episodes=0,
                          spec_digest=spec_digest(spec_json))
    slot = worker.slots[1]
    async with worker._compute:
        trainer = await worker._bind(slot, work)
    try:
        # Before slots had devices every engine was built under LOCAL_RANK 0 (ensure_distributed's default).
        assert trainer.engine.local_rank == 1
    finally:
        await worker.stop()


async def test_data_parallel_group_binds_to_the_slots_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, os.environ.get(name, "0"))
    joined: list[dict[str, str]] = []

    def fake_init(**_: object) -> None:  # DeepSpeed binds the NCCL group to cuda:LOCAL_RANK here
        joined.append({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})

    # Keep this process's real group (other tests use it); only the rendezvous is recorded.
    monkeypatch.setattr(distributed, "shutdown_distributed", lambda: None)
    monkeypatch.setattr(deepspeed, "init_distributed", fake_init)
    worker = _worker(_settings(tmp_path, 1, (3,)))
    group = DataParallelGroup(group_id="job/a/g1", rank=1, world_size=2, master_address="127.0.0.1:29999",
                              timeout_s=5)
    async with worker._compute:
        await worker._join(group)
    assert joined == [{"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "3"}]


def test_local_rank_is_set_again_after_the_group_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI failed when a test's monkeypatch removed LOCAL_RANK after the process group was made: every
    # later engine in that process hit DeepSpeed's LOCAL_RANK assertion (ensure_distributed returned early).
    distributed.ensure_distributed()
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # restored after the test
    distributed.ensure_distributed()
    assert os.environ["LOCAL_RANK"] == os.environ.get("RANK", "0")


def test_slot_capacities_default_to_the_modelled_devices_else_one_and_bad_values_are_named(tmp_path: Path) -> None:
    from flexmarl import devicemodel

    assert TrainerConfig(slots=3).slot_capacities() == (1.0, 1.0, 1.0)
    assert TrainerConfig(slots=3, slot_capacity="2").slot_capacities() == (2.0, 2.0, 2.0)
    assert TrainerConfig(slots=3, slot_capacity="2, 1,1.5").slot_capacities() == (2.0, 1.0, 1.5)
    profile = tmp_path / "device.json"
    profile.write_text(devicemodel.PRESETS["h100"].with_changes(train_devices_per_slot=4).to_json())
    modelled = TrainerConfig(slots=2, modelled_device=str(profile))
    assert modelled.slot_capacities() == (4.0, 4.0)
    sized = load_config(TrainerConfig, ["--slots", "2", "--slot-capacity", "2,1", "--modelled-device", str(profile)],
                        prog="traind", env={})
    assert sized.slot_capacities() == (2.0, 1.0)
    # A modelled slot's training takes the time of its capacity in devices.
    assert [p.train_devices_per_slot for p in sized.slot_profiles() or ()] == [2, 1]
    assert TrainerConfig(slots=2).slot_profiles() is None
    for value, message in (("2,1", "2 values for 3 slots"), ("0", "must be > 0"), ("-1,1,1", "must be > 0"),
                           ("nan", "must be > 0"), ("2000", "<= 1024"), ("two", "expected numbers")):
        with pytest.raises(ConfigError, match=f"slot_capacity: .*{message}"):
            load_config(TrainerConfig, ["--slots", "3", f"--slot-capacity={value}"], prog="traind", env={})
    with pytest.raises(ConfigError, match="slot_capacity: a modelled slot trains on whole devices"):
        load_config(TrainerConfig, ["--slot-capacity", "1.5", "--modelled-device", str(profile)], prog="traind",
                    env={})


def test_worker_slots_carry_their_capacities_and_modelled_devices(tmp_path: Path) -> None:
    from flexmarl import devicemodel

    profile = devicemodel.PRESETS["h100"]
    profiles = (profile.with_changes(train_devices_per_slot=2), profile)
    worker = _worker(dataclasses.replace(_settings(tmp_path, 2, None), slot_capacities=(2.0, 1.0),
                                         slot_profiles=profiles))
    assert [(slot.capacity, slot.profile) for slot in worker.slots] == list(zip((2.0, 1.0), profiles, strict=True))
    assert [slot.capacity for slot in _worker(_settings(tmp_path, 2, None)).slots] == [1.0, 1.0]
    with pytest.raises(InvalidArgument, match="1 capacities and 2 profiles for 2 slots"):
        _worker(dataclasses.replace(_settings(tmp_path, 2, None), slot_capacities=(2.0,)))
