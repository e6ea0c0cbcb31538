"""The analytic time-shared sequential baseline of benchmarks.run against hand computations."""

from __future__ import annotations

import pytest

from benchmarks.run import timeshared_sequential_estimate, turn_phase_s
from benchmarks.workloads import LengthDistribution, Workload
from flexmarl import devicemodel as dm

ITERATION_S = 29.4e9 / 2.345e12  # one H100 decode iteration of Qwen2.5-14B below the compute bound: 12.537 ms
KV_S = 196_608 / 2.345e12  # reading one context token's KV cache


def test_a_turn_phase_is_the_slowest_replica_of_a_continuous_batch() -> None:
    # One replica, lengths 2, 1, 3 after prompts of 10 tokens: prefill 30 tokens, then 3 iterations
    # with 3, 2, 1 live sequences holding 3*11, 2*12, 1*13 = 70 context tokens in total.
    prefill_30 = 2 * 14.7e9 * 30 / 593.4e12
    assert turn_phase_s(dm.H100_SXM, 10, [2, 1, 3], 1) == pytest.approx(prefill_30 + 3 * ITERATION_S + 70 * KV_S)
    # Two replicas: [2, 3] and [1]; the first is slower: prefill 20, then 2*11 + 2*12 + 1*13 = 59 tokens.
    prefill_20 = 2 * 14.7e9 * 20 / 593.4e12
    assert turn_phase_s(dm.H100_SXM, 10, [2, 1, 3], 2) == pytest.approx(prefill_20 + 3 * ITERATION_S + 59 * KV_S)
    assert turn_phase_s(dm.H100_SXM, 10, [], 2) == 0.0


def test_the_estimate_adds_phases_reloads_and_training_on_all_devices() -> None:
    constant = LengthDistribution("uniform", low=200, high=200)  # 200 tokens -> 2 real tokens -> 256 modelled
    workload = Workload("one", (("solo", constant),), prompt_tokens=512)
    profile = dm.H100_SXM.with_changes(token_scale=128.0)
    estimate = timeshared_sequential_estimate(workload, profile, devices=2, episodes=4, samples=2)
    # Each of the 2 devices serves 2 sequences of 256 tokens after 512-token prompts.
    decode_s = sum(dm.decode_iteration_s(profile, 2, 2 * (512 + step)) for step in range(1, 257))
    assert estimate.rollout_s == pytest.approx(dm.prefill_s(profile, 1024) + decode_s)
    assert decode_s == pytest.approx(256 * ITERATION_S + KV_S * 2 * sum(512 + s for s in range(1, 257)))
    assert estimate.reload_s == pytest.approx(0.588)  # one agent's weights, 29.4 GB over 50 GB/s
    # 4 * (512 + 256) = 3072 tokens on 2 devices, optimizer step on 2 devices, and the 264.6 GB
    # training state out and in over 2 links: 2 * 5.292 s / 2.
    train_s = 6 * 14.7e9 * 3072 / (395.6e12 * 2) + 14.7e9 * 16 / (2.345e12 * 2) + 0.588 + 5.292
    assert estimate.train_s == pytest.approx(train_s)
    assert estimate.step_s == pytest.approx(estimate.rollout_s + 0.588 + train_s)
