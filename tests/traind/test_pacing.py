"""Modelled device time in traind: read once from config, injected into the trainer, settled by its owner."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flexmarl import devicemodel
from flexmarl.config import ConfigError, load_config
from traind.config import TrainerConfig
from traind.model import AgentTrainer
from traind.pacing import ModelledDeviceClock

from .conftest import make_groups
from .test_trainer import step_sizes, trainer_config


def _profile(trace_dir: Path) -> devicemodel.DeviceProfile:
    return devicemodel.H100_SXM.with_changes(token_scale=4.0, time_scale=1e-4, trace_dir=str(trace_dir))


def test_clock_waits_out_its_charges_in_order_and_traces_them(tmp_path: Path) -> None:
    profile = _profile(tmp_path)
    clock = ModelledDeviceClock(profile, "traind-test-a")
    started = time.perf_counter()
    clock.train(started, real_tokens=1000.0)
    clock.optimizer_step(started)
    assert devicemodel.read_traces(tmp_path) == {}  # charged, not yet waited
    clock.settle()
    train_s = devicemodel.train_tokens_s(profile, 1000.0 * profile.token_scale)
    # one device: the step starts when the micro-batch ends, though both were charged from the same instant
    assert time.perf_counter() - started >= (train_s + devicemodel.optimizer_step_s(profile)) * profile.time_scale
    records = devicemodel.read_traces(tmp_path)["traind-test-a"]
    assert [r["kind"] for r in records] == ["train", "optimizer"]
    assert records[0]["modelled_s"] == pytest.approx(train_s)
    assert records[1]["modelled_s"] == pytest.approx(devicemodel.optimizer_step_s(profile))
    assert records[1]["start_s"] == pytest.approx(records[0]["start_s"] + train_s * profile.time_scale, abs=1e-3)
    clock.settle()  # nothing left
    assert len(devicemodel.read_traces(tmp_path)["traind-test-a"]) == 2


def test_the_profile_comes_from_traind_config_once(tmp_path: Path) -> None:
    path = tmp_path / "device.json"
    path.write_text(_profile(tmp_path).to_json())
    config = load_config(TrainerConfig, [], "traind", env={devicemodel.PROFILE_ENV: str(path)})
    assert config.modelled_device == str(path)
    assert config.device_profile() == devicemodel.load_profile(path)
    assert load_config(TrainerConfig, [], "traind", env={}).device_profile() is None
    with pytest.raises(ConfigError, match="modelled_device"):
        load_config(TrainerConfig, ["--modelled-device", str(tmp_path / "absent.json")], "traind", env={})


def test_trainer_charges_micro_batches_and_steps_to_its_clock(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AgentTrainer(trainer_config(tiny_model_dir), ModelledDeviceClock(_profile(tmp_path), "traind-t-a"))
    try:
        groups = make_groups(seed=3, tasks=2, group_size=2)
        for group in groups:
            trainer.accumulate(group)
        trainer.optimizer_step(*step_sizes(groups))
        assert trainer.device_clock is not None
        trainer.device_clock.settle()
    finally:
        trainer.release()
    kinds = [r["kind"] for r in devicemodel.read_traces(tmp_path)["traind-t-a"]]
    assert kinds == ["train", "train", "optimizer"]


def test_a_swap_in_charges_the_state_over_the_link_full_model_or_adapter(tmp_path: Path) -> None:
    profile = _profile(tmp_path)
    clock = ModelledDeviceClock(profile, "traind-t-swap")
    started = time.perf_counter()
    clock.swap_in(started)
    clock.swap_in(started, lora_rank=8, lora_modules=("q_proj", "v_proj"))
    clock.swap_in(started, lora_rank=8, lora_modules=("c_attn",))  # a name the modelled model lacks
    clock.settle()
    records = devicemodel.read_traces(tmp_path)["traind-t-swap"]
    assert [r["kind"] for r in records] == ["swap"] * 3
    assert records[0]["modelled_s"] == pytest.approx(devicemodel.swap_s(profile))
    assert records[1]["modelled_s"] == pytest.approx(
        devicemodel.lora_swap_s(profile, devicemodel.qwen25_14b_lora(8, ("q_proj", "v_proj"))))
    assert records[2]["modelled_s"] == pytest.approx(devicemodel.lora_swap_s(profile, devicemodel.qwen25_14b_lora(8)))
    assert records[1]["modelled_s"] < records[2]["modelled_s"] < records[0]["modelled_s"]


def test_a_swap_in_charges_the_share_one_device_of_the_slot_holds_under_the_agents_zero_stage(tmp_path: Path) -> None:
    profile = _profile(tmp_path).with_changes(train_devices_per_slot=2)
    clock = ModelledDeviceClock(profile, "traind-t-zero")
    started = time.perf_counter()
    for stage in (0, 1, 3):
        clock.swap_in(started, zero_stage=stage)
    clock.settle()
    charged = [r["modelled_s"] for r in devicemodel.read_traces(tmp_path)["traind-t-zero"]]
    assert charged == [pytest.approx(devicemodel.swap_s(profile, stage)) for stage in (0, 1, 3)]
    assert charged[0] > charged[1] > charged[2] == pytest.approx(charged[0] / 2)


def test_traind_swap_in_charges_the_agents_own_zero_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from traind import swap
    from traind.locations import FileLocation
    from traind.model import AgentTrainerConfig

    class Loaded:  # the engine build and the state read are not what this test is about
        def __init__(self, config: AgentTrainerConfig, device_clock: object, lora_bases: object = None) -> None:
            self.config = config

        def load_state(self, location: object) -> int:
            return 0

    monkeypatch.setattr(swap, "AgentTrainer", Loaded)
    profile = _profile(tmp_path).with_changes(train_devices_per_slot=4)
    clock = ModelledDeviceClock(profile, "traind-t-stage")
    location = FileLocation("file://" + str(tmp_path / "state"), tmp_path / "state")  # the stub never reads it
    for stage in (0, 3):
        swap.swap_in(AgentTrainerConfig(agent="a", model_path="/nowhere", zero_stage=stage), location, clock)
    clock.settle()
    charged = [r["modelled_s"] for r in devicemodel.read_traces(tmp_path)["traind-t-stage"]]
    assert charged == [pytest.approx(devicemodel.swap_s(profile, 0)), pytest.approx(devicemodel.swap_s(profile, 3))]


def test_a_swap_in_and_the_micro_batch_after_it_take_the_sum_of_their_modelled_times(tmp_path: Path) -> None:
    # The micro-batch's real work ran while the modelled swap was still in progress (a real swap takes less
    # than the modelled one): it starts on the device when the swap ends, and its real compute counts as
    # overrun only past its own modelled end. Before, both windows started at their real starts and the swap hid
    # the micro-batch (or the micro-batch the swap).
    # The micro-batch is ~0.1 wall s (0.4 M modelled tokens), so a late wake from the swap's sleep on a loaded
    # machine does not leave its own wait starting past its modelled end (an overrun); the schedule is checked
    # on the modelled starts the traces record, not on when the sleeps woke.
    profile = devicemodel.H100_SXM.with_changes(token_scale=4.0, time_scale=0.01, trace_dir=str(tmp_path))
    scale = profile.time_scale
    clock = ModelledDeviceClock(profile, "traind-t-serial")
    started = time.perf_counter()
    clock.swap_in(started)
    clock.train(started + 0.001, real_tokens=100_000.0)  # real work right after the real (fast) swap
    clock.settle()
    elapsed = time.perf_counter() - started
    swap_s, train_s = devicemodel.swap_s(profile), devicemodel.train_tokens_s(profile, 400_000.0)
    assert elapsed >= (swap_s + train_s) * scale
    # once the device is idle again, a charge starts at its real start
    later = time.perf_counter()
    later_wall_s = time.time() - (time.perf_counter() - later)
    clock.train(later, real_tokens=100_000.0)
    clock.settle()
    swap, train, again = devicemodel.read_traces(tmp_path)["traind-t-serial"]
    assert (swap["kind"], train["kind"], again["kind"]) == ("swap", "train", "train")
    assert train["start_s"] == pytest.approx(swap["start_s"] + swap_s * scale, abs=1e-3)  # when the swap ends
    assert train["overrun_s"] == 0.0
    assert again["start_s"] == pytest.approx(later_wall_s, abs=1e-3)  # not at the end of the earlier charges
