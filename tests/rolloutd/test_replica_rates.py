"""Measured replica rates and load costs (rolloutd/replica_rates.py): concurrency, prior, decay."""

from __future__ import annotations

import pytest

from flexmarl.errors import InvalidArgument
from rolloutd.replica_rates import RateSettings, ReloadCost, ReplicaRate, ReplicaRates

SETTINGS = RateSettings(window_s=1.0, half_life_s=10.0)


def test_the_prior_is_the_rate_until_a_window_of_busy_time_is_measured() -> None:
    rate = ReplicaRate(1000.0, "a", SETTINGS)
    mark = rate.begin(0.0)
    assert not rate.end(mark, 0.5, 20)  # half a busy second: not yet a measurement
    assert rate.tokens_per_s == 1000.0 and not rate.measured
    mark = rate.begin(10.0)
    assert rate.end(mark, 10.5, 20)  # a second in all: 40 tokens over it
    assert rate.measured and rate.tokens_per_s == pytest.approx(40.0)


def test_concurrent_generations_are_summed_over_the_busy_time_not_each_over_its_own_latency() -> None:
    rate = ReplicaRate(1000.0, "a", SETTINGS)
    marks = [rate.begin(0.0) for _ in range(4)]  # a batch of 4, each 10 tokens in 2 s
    changed = [rate.end(mark, 2.0, 10) for mark in marks]
    assert changed == [False, True, False, True]  # every second end completes a busy second of shares
    assert rate.tokens_per_s == pytest.approx(20.0)  # 10 / 0.5 s each (4 share 2 s), not 10 / 2 s = 5


def test_overlapping_generations_share_the_time_they_overlap_and_idle_time_counts_for_nothing() -> None:
    rate = ReplicaRate(1000.0, "a", RateSettings(window_s=1.4, half_life_s=10.0))
    first = rate.begin(0.0)
    second = rate.begin(1.0)
    assert rate.end(first, 2.0, 10)  # alone for 1 s, half of the next: charged 1.5 s
    assert rate.tokens_per_s == pytest.approx(10 / 1.5)
    rate = ReplicaRate(1000.0, "a", SETTINGS)
    rate.end(rate.begin(0.0), 1.0, 10)
    rate.end(rate.begin(100.0), 101.0, 10)  # 99 idle seconds between
    assert rate.tokens_per_s == pytest.approx(10.0)
    assert second.model_key == "a"


def test_a_changed_speed_weighs_half_after_one_half_life_of_busy_time() -> None:
    rate = ReplicaRate(1000.0, "a", SETTINGS)
    now = 0.0
    for _ in range(50):  # 50 busy seconds at 100 tokens/s
        rate.end(rate.begin(now), now + 1.0, 100)
        now += 1.0
    assert rate.tokens_per_s == pytest.approx(100.0)
    for _ in range(10):  # one half-life at 10 tokens/s
        rate.end(rate.begin(now), now + 1.0, 10)
        now += 1.0
    assert rate.tokens_per_s == pytest.approx(55.0)


def test_a_failed_generation_is_charged_nothing_and_a_restart_measures_afresh_from_its_prior() -> None:
    rate = ReplicaRate(1000.0, "a", SETTINGS)
    assert not rate.end(rate.begin(0.0), 5.0, None)
    assert not rate.measured and rate.measured_busy_s == 0.0
    rate.end(rate.begin(5.0), 7.0, 40)
    assert rate.tokens_per_s == pytest.approx(20.0)
    old = rate.begin(7.0)
    rate.restart("b", 55.0)
    assert rate.tokens_per_s == 55.0 and not rate.measured
    assert not rate.end(old, 9.0, 1000)  # the old model's generation measures nothing of "b"
    assert rate.measured_busy_s == 0.0
    with pytest.raises(InvalidArgument):
        rate.restart("b", 0.0)
    with pytest.raises(InvalidArgument):
        rate.end(rate.begin(9.0), 10.0, -1)


def test_the_reload_cost_is_the_prior_until_a_load_is_measured_then_their_moving_average() -> None:
    cost = ReloadCost(10.0, RateSettings(reload_weight=0.5))
    assert cost.seconds == 10.0 and not cost.measured
    cost.observe(0.3)
    assert cost.seconds == pytest.approx(0.3)
    cost.observe(0.5)
    assert cost.seconds == pytest.approx(0.4) and cost.loads == 2
    with pytest.raises(InvalidArgument):
        cost.observe(float("nan"))
    with pytest.raises(InvalidArgument):
        RateSettings(window_s=0.0)


def test_the_capacity_is_the_best_measured_replica_a_peak_that_halves_per_half_life() -> None:
    rates = ReplicaRates(1000.0, RateSettings(window_s=1.0, capacity_half_life_s=60.0))
    assert rates.capacity(0.0) == 1000.0  # nothing measured: the prior
    for replica_id, tokens in (("busy", 40), ("light", 1)):  # one saturated, one given one request at a time
        rate = rates.of(replica_id)
        rate.end(rate.begin(0.0), 1.0, tokens)
    assert rates.capacity(1.0) == pytest.approx(40.0)
    rates.of("busy").restart("other-model", 1000.0)  # its measurement starts again; the peak holds, decaying
    assert rates.capacity(61.0) == pytest.approx(20.0)
    assert rates.capacity(121.0) == pytest.approx(10.0)
    assert rates.capacity(1000.0) == pytest.approx(1.0)  # the light one's measurement is the floor
