"""Credit assignment: advantage normalisations, turn baselines, step statistics, entropy schedules."""

from __future__ import annotations

import random

import numpy as np
import pytest

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord
from traind import losses
from traind.batches import micro_batch_advantages
from traind.losses import AdvantageNorm, EntropySchedule, ReturnStats, TurnBaseline, TurnReturn


def record(group: str, sample: int, turn: int, reward: float, group_size: int = 3) -> ExperienceRecord:
    return ExperienceRecord(
        experience_id=f"{group}/{sample}/{turn}", job_id="j", agent="a", task_id=group, group_id=f"{group}/a",
        sample_index=sample, episode_id=f"{group}/{sample}", turn=turn, behavior_version=0, reward=reward,
        prompt_token_ids=np.array([1], dtype=np.int32), response_token_ids=np.array([2], dtype=np.int32),
        response_logprobs=np.array([-0.5], dtype=np.float32), group_size=group_size,
    )


def test_single_turn_std_and_mean_are_grpo_bit_for_bit() -> None:
    rewards = [0.3, 1.7, -0.2]
    records = [record("t", i, 0, r) for i, r in enumerate(rewards)]
    for norm in (AdvantageNorm.STD, AdvantageNorm.MEAN):
        assert micro_batch_advantages(records, norm, 1e-6) == losses.group_advantages(rewards, norm, 1e-6)


def test_episode_baseline_counts_each_episode_once() -> None:
    # Episode 0 has three turns, the others one: the baseline is still over the three episodes.
    records = [record("t", 0, k, 2.0) for k in range(3)] + [record("t", 1, 0, 0.0), record("t", 2, 0, 1.0)]
    advantages = micro_batch_advantages(records, AdvantageNorm.STD, 1e-6)
    expected = losses.group_advantages([2.0, 0.0, 1.0], AdvantageNorm.STD, 1e-6)
    assert advantages == [expected[0]] * 3 + expected[1:]


def test_episode_baseline_measures_later_turns_against_whole_episode_returns() -> None:
    # Discounted returns: G_{e,k} differ by turn; the statistics are over the first turns' returns.
    records = [record("t", 0, 0, 1.0, 2), record("t", 0, 1, 2.0, 2), record("t", 1, 0, 3.0, 2)]
    got = micro_batch_advantages(records, AdvantageNorm.MEAN, 1e-6)
    assert got == [1.0 - 2.0, 2.0 - 2.0, 3.0 - 2.0]


def test_turn_baseline_compares_turns_of_the_same_index() -> None:
    records = [record("t", 0, 0, 1.0), record("t", 0, 1, 5.0), record("t", 1, 0, 3.0), record("t", 1, 1, 7.0),
               record("t", 2, 0, 2.0)]
    got = micro_batch_advantages(records, AdvantageNorm.MEAN, 1e-6, baseline=TurnBaseline.TURN)
    assert got == [1.0 - 2.0, 5.0 - 6.0, 3.0 - 2.0, 7.0 - 6.0, 2.0 - 2.0]
    # A turn index only one episode reached has nothing to compare against.
    lonely = [record("t", 0, 0, 1.0, 2), record("t", 0, 1, 9.0, 2), record("t", 1, 0, 3.0, 2)]
    got = micro_batch_advantages(lonely, AdvantageNorm.STD, 1e-6, baseline=TurnBaseline.TURN)
    assert got[1] == 0.0 and got[0] == -got[2] != 0.0


def test_agent_norm_uses_the_step_statistics_whatever_the_cut() -> None:
    rng = random.Random(7)
    rewards = [rng.uniform(-1, 2) for _ in range(12)]
    records = [record(f"t{i // 3}", i % 3, 0, r) for i, r in enumerate(rewards)]
    stats = ReturnStats.of(rewards)
    whole = micro_batch_advantages(records, AdvantageNorm.AGENT, 1e-6, step_stats=stats)
    parts = [a for g in range(4) for a in micro_batch_advantages(records[3 * g: 3 * g + 3], AdvantageNorm.AGENT,
                                                                 1e-6, step_stats=stats)]
    assert whole == parts == [(r - stats.mean) / (stats.std + 1e-6) for r in rewards]
    # the step's advantages have mean 0 and (unbiased) std ~1, unlike per-group ones
    assert abs(sum(whole)) < 1e-9 and np.std(whole, ddof=1) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(InvalidArgument, match="statistics"):
        micro_batch_advantages(records, AdvantageNorm.AGENT, 1e-6)
    alone = [record("t", 0, 0, 1.0, 1)]
    assert micro_batch_advantages(alone, AdvantageNorm.AGENT, 1e-6, step_stats=ReturnStats.of([1.0])) == [0.0]


def test_return_stats_are_order_independent_bit_for_bit() -> None:
    rng = random.Random(3)
    rewards = [rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8) for _ in range(200)]
    reference = ReturnStats.of(rewards)
    for _ in range(5):
        rng.shuffle(rewards)
        assert ReturnStats.of(rewards) == reference
    assert ReturnStats.of([]) == ReturnStats(0, 0.0, 0.0) and ReturnStats.of([2.0]) == ReturnStats(1, 2.0, 0.0)


def test_none_is_the_raw_return() -> None:
    records = [record("t", i, 0, r) for i, r in enumerate([0.0, 1.0, 4.0])]
    assert micro_batch_advantages(records, AdvantageNorm.NONE, 1e-6) == [0.0, 1.0, 4.0]


def test_incomplete_groups_and_repeated_turns_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="incomplete"):
        micro_batch_advantages([record("t", 0, 0, 1.0)], AdvantageNorm.STD, 1e-6)
    # A group without the episodes whose reward failed (2 of 3 left, samples 0 and 2): GRPO over those two.
    survivors = [record("t", 0, 0, 1.0), record("t", 2, 0, 3.0)]
    assert micro_batch_advantages(survivors, AdvantageNorm.STD, 1e-6) == losses.group_advantages([1.0, 3.0],
                                                                                               AdvantageNorm.STD, 1e-6)
    twice = [record("t", i, 0, 1.0) for i in range(3)] + [record("t", 0, 0, 1.0)]
    with pytest.raises(InvalidArgument, match="twice"):
        losses.turn_advantages([TurnReturn(r.group_id, r.sample_index, r.turn, r.reward) for r in twice])


def test_entropy_schedule_is_linear_then_constant() -> None:
    schedule = EntropySchedule(0.2, 0.0, 10)
    assert [schedule.at(t) for t in (0, 5, 10, 30)] == pytest.approx([0.2, 0.1, 0.0, 0.0])
    assert EntropySchedule(0.05).at(100) == 0.05 and EntropySchedule(0.1, 0.3, 0).at(5) == 0.1
    with pytest.raises(InvalidArgument):
        EntropySchedule(-1.0)
