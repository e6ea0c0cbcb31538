"""The roofline device model against hand-computed values from the cited datasheet numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexmarl import devicemodel as dm
from flexmarl.errors import InvalidArgument

# Hand computation, H100 SXM (989e12 FLOP/s, 3.35e12 B/s), Qwen2.5-14B (14.7e9 params, BF16):
#   W = 14.7e9 * 2 B = 29.4e9 B; usable HBM = 3.35e12 * 0.7 = 2.345e12 B/s
#   usable prefill FLOP/s = 989e12 * 0.6 = 593.4e12; usable training FLOP/s = 989e12 * 0.4 = 395.6e12
W = 29.4e9
HBM = 2.345e12


def test_presets_carry_the_datasheet_numbers() -> None:
    assert dm.H100_SXM.peak_flops == 989e12 and dm.H100_SXM.hbm_bytes_per_s == 3.35e12
    assert dm.H200_SXM.peak_flops == 989e12 and dm.H200_SXM.hbm_bytes_per_s == 4.8e12
    assert dm.QWEN25_14B_KV_BYTES_PER_TOKEN == 196_608
    assert dm.H100_SXM.weight_bytes == pytest.approx(W)


def test_decode_of_one_sequence_reads_the_weights_once() -> None:
    assert dm.decode_iteration_s(dm.H100_SXM, 1, 0) == pytest.approx(29.4e9 / 2.345e12)  # 12.537 ms
    assert dm.decode_iteration_s(dm.H100_SXM, 1, 0) == pytest.approx(0.0125373, rel=1e-5)
    assert dm.decode_iteration_s(dm.H200_SXM, 1, 0) == pytest.approx(29.4e9 / 3.36e12)  # 8.75 ms


def test_batched_decode_adds_the_kv_cache_and_becomes_compute_bound() -> None:
    # 64 sequences x 4096 context tokens: KV = 196608 * 262144 = 5.1539e10 B -> (29.4e9 + 5.1539e10) / 2.345e12
    assert dm.decode_iteration_s(dm.H100_SXM, 64, 64 * 4096) == pytest.approx(0.0345155, rel=1e-5)
    # Without KV, compute (2 * 14.7e9 * b / 593.4e12) overtakes the 12.54 ms weight read above b = 253.
    no_kv = dm.H100_SXM.with_changes(kv_bytes_per_token=0.0)
    assert dm.decode_iteration_s(no_kv, 253, 0) == pytest.approx(W / HBM)
    assert dm.decode_iteration_s(no_kv, 512, 0) == pytest.approx(2 * 14.7e9 * 512 / 593.4e12)  # 25.37 ms
    assert dm.decode_iteration_s(dm.H100_SXM, 0, 0) == 0.0


def test_prefill_training_optimizer_and_transfers() -> None:
    assert dm.prefill_s(dm.H100_SXM, 1000) == pytest.approx(0.0495450, rel=1e-5)  # 2.94e13 / 593.4e12
    # 6 * 14.7e9 * 1e6 / (395.6e12 * 8 devices) = 8.82e16 / 3.1648e15
    assert dm.train_tokens_s(dm.H100_SXM, 1e6) == pytest.approx(27.8690, rel=1e-5)
    # update: 14.7e9 * 16 B / (2.345e12 * 8) = 12.54 ms; publish: 29.4e9 / 50e9 = 0.588 s
    assert dm.optimizer_step_s(dm.H100_SXM) == pytest.approx(0.0125373 + 0.588, rel=1e-5)
    assert dm.weight_transfer_s(dm.H100_SXM) == pytest.approx(0.588)
    assert dm.swap_s(dm.H100_SXM) == pytest.approx(14.7e9 * 18 / 50e9)  # 5.292 s


def test_a_swap_moves_one_devices_share_of_the_state_by_zero_stage() -> None:
    # H100_SXM's slot has 8 devices, each with its own link: ZeRO 0 replicates the whole state on each,
    # ZeRO 1 and 2 shard the optimizer state (16 B per parameter), ZeRO 3 the weights (2 B) too.
    assert dm.H100_SXM.train_devices_per_slot == 8
    assert dm.swap_s(dm.H100_SXM, 0) == pytest.approx(14.7e9 * 18 / 50e9)
    assert dm.swap_s(dm.H100_SXM, 1) == pytest.approx(14.7e9 * (2 + 16 / 8) / 50e9)
    assert dm.swap_s(dm.H100_SXM, 2) == dm.swap_s(dm.H100_SXM, 1)
    assert dm.swap_s(dm.H100_SXM, 3) == pytest.approx(14.7e9 * 18 / 8 / 50e9)
    one = dm.H100_SXM.with_changes(train_devices_per_slot=1)
    assert [dm.swap_s(one, stage) for stage in range(4)] == [pytest.approx(dm.swap_s(dm.H100_SXM))] * 4
    with pytest.raises(ValueError, match="zero_stage"):
        dm.swap_s(dm.H100_SXM, 4)


def test_token_scale_turns_one_real_iteration_into_many_modelled_ones() -> None:
    scaled = dm.H100_SXM.with_changes(token_scale=128.0)
    # One real iteration of 4 sequences with 10 real context tokens = 128 iterations at 1280 context tokens.
    expected = 128 * dm.decode_iteration_s(dm.H100_SXM, 4, 1280)
    assert dm.real_decode_iteration_s(scaled, 4, 10) == pytest.approx(expected)


def test_kv_capacity_is_the_memory_left_after_the_weights() -> None:
    # H100: 80e9 B * 0.88 - 29.4e9 B of weights = 41.0e9 B / 196,608 B per token = 208,536.8 tokens.
    assert dm.H100_SXM.hbm_capacity_bytes == 80e9 and dm.H200_SXM.hbm_capacity_bytes == 141e9
    assert dm.kv_capacity_tokens(dm.H100_SXM) == pytest.approx(208_536.78, rel=1e-6)
    # H200: 141e9 * 0.88 - 29.4e9 = 94.68e9 B -> 481,567.4 tokens; TP2 doubles the memory, not the weights.
    assert dm.kv_capacity_tokens(dm.H200_SXM) == pytest.approx(481_567.38, rel=1e-6)
    tp2 = dm.H100_SXM.with_changes(rollout_devices_per_replica=2)
    assert dm.kv_capacity_tokens(tp2) == pytest.approx((160e9 * 0.88 - 29.4e9) / 196_608)
    assert dm.kv_capacity_tokens(dm.H100_SXM.with_changes(hbm_capacity_bytes=20e9)) == 0.0  # weights do not fit
    assert dm.kv_capacity_tokens(dm.H100_SXM.with_changes(kv_bytes_per_token=0.0)) == float("inf")


def test_tensor_and_data_parallel_devices_divide_the_time() -> None:
    tp2 = dm.H100_SXM.with_changes(rollout_devices_per_replica=2)
    assert dm.decode_iteration_s(tp2, 1, 0) == pytest.approx(dm.decode_iteration_s(dm.H100_SXM, 1, 0) / 2)
    one = dm.H100_SXM.with_changes(train_devices_per_slot=1)
    assert dm.train_tokens_s(one, 1e6) == pytest.approx(8 * dm.train_tokens_s(dm.H100_SXM, 1e6))


def test_profiles_load_from_files_with_presets_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"preset": "h200", "time_scale": 0.01, "token_scale": 64, "trace_dir": "/t"}))
    profile = dm.load_profile(path)
    assert profile.hbm_bytes_per_s == 4.8e12 and profile.time_scale == 0.01 and profile.token_scale == 64
    assert dm.profile_from_env({dm.PROFILE_ENV: str(path)}) == profile
    assert dm.profile_from_env({}) is None
    assert dm.parse_profile(json.loads(profile.to_json())) == profile
    yaml_path = tmp_path / "p.yaml"
    yaml_path.write_text("preset: h100\ntrain_devices_per_slot: 4\n")
    assert dm.load_profile(yaml_path).train_devices_per_slot == 4


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"preset": "tpu"}, "preset must be one of"),
        ({"flops": 1}, "unknown field"),
        ({"time_scale": 0}, "time_scale must be a positive number"),
        ({"train_mfu": 1.5}, "train_mfu must be in"),
        ({"train_devices_per_slot": 0}, "devices per replica and per slot"),
        ({"kv_memory_fraction": 0}, "kv_memory_fraction must be in"),
        ({"hbm_capacity_bytes": -1}, "hbm_capacity_bytes must be a positive number"),
        ({"max_running_requests": 0}, "max_running_requests must be >= 1"),
    ],
)
def test_bad_profiles_are_rejected(data: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        dm.parse_profile(data)


def test_pacer_waits_for_the_scaled_modelled_time_and_records_overruns() -> None:
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = dm.Pacer(dm.H100_SXM.with_changes(time_scale=0.5), clock=lambda: now[0], sleep=sleep)
    pacer.add(4.0)  # 4 modelled s -> 2 wall s
    now[0] += 0.5  # real compute took 0.5 s
    assert pacer.wait() == pytest.approx(1.5) and now[0] == pytest.approx(102.0)
    pacer.add(1.0)  # target 102.5, but real compute ran to 103
    now[0] = 103.0
    assert pacer.wait() == 0.0 and pacer.overrun_s == pytest.approx(0.5)


def test_traces_and_busy_time(tmp_path: Path) -> None:
    writer = dm.TraceWriter(dm.H100_SXM.with_changes(trace_dir=str(tmp_path)), "engine-1")
    writer.record("decode", 1.0, 3.0, 100.0)
    writer.record("decode", 2.0, 4.0, 100.0, tokens=5)
    writer.record("train", 6.0, 7.0, 50.0)
    records = dm.read_traces(tmp_path)["engine-1"]
    assert len(records) == 3 and records[1]["tokens"] == 5
    assert dm.busy_seconds(records, 0.0, 10.0) == pytest.approx(4.0)  # [1,4] + [6,7]
    assert dm.busy_seconds(records, 2.5, 6.5) == pytest.approx(2.0)  # [2.5,4] + [6,6.5]
    dm.TraceWriter(dm.H100_SXM, "nowhere").record("decode", 0.0, 1.0, 1.0)  # no trace_dir: no-op


def test_a_json_profile_with_a_tiny_time_scale_loads(tmp_path: Path) -> None:
    """json.dumps writes 1e-05; YAML 1.1 would read it as a string."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"preset": "h100", "time_scale": 0.00001}))
    assert "1e-05" in path.read_text()
    assert dm.load_profile(path).time_scale == pytest.approx(1e-5)
