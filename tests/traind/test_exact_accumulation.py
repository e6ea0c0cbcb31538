"""Exact accumulation (issue 22): a step's result does not depend on the order or cut of its micro-batches."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.experience import ExperienceRecord
from traind.accumulation import GRID_BITS, MAX_EXPONENT, ExactGradientSum, GradientOutOfRange
from traind.model import AgentTrainer, AgentTrainerConfig, StepStats

from .conftest import make_groups
from .test_trainer import step_sizes, trainer_config

Group = list[ExperienceRecord]


def _exact_value(contributions: Sequence[torch.Tensor], index: int) -> float:
    """The fp32 rounding of the exact sum of the contributions truncated to the grid (what the sum promises)."""
    grid = Fraction(1, 2**GRID_BITS)
    total = Fraction(0)
    for c in contributions:
        value = Fraction(float(c[index]))
        units = abs(value) / grid
        truncated = (units.numerator // units.denominator) * grid
        total += truncated if value >= 0 else -truncated
    return float(torch.tensor(float(total), dtype=torch.float32))


def test_sum_is_exact_and_independent_of_order() -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (64, 3)
    # Magnitudes from 1e-14 to 1e8 with cancellation: an fp32 sum of these depends on the order.
    contributions = [torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-14, 9, shape, generator=gen).float()
                     for _ in range(6)]
    contributions.append(-contributions[0])  # exact cancellation of one contribution
    results = []
    for seed in range(4):
        order = list(range(len(contributions)))
        random.Random(seed).shuffle(order)
        acc = ExactGradientSum([torch.zeros(shape)])
        for k in order:
            acc.add([contributions[k]])
        result = acc.result()[0]
        assert result is not None
        results.append(result)
    for other in results[1:]:
        assert torch.equal(results[0].view(torch.int32), other.view(torch.int32))
    flat = [c.reshape(-1) for c in contributions]
    got = results[0].reshape(-1)
    for index in range(0, got.numel(), 7):
        assert float(got[index]) == _exact_value(flat, index)


def test_sum_keeps_untouched_parameters_none_and_non_finite_values() -> None:
    params = [torch.zeros(4), torch.zeros(2)]
    acc = ExactGradientSum(params)
    acc.add([torch.tensor([1.0, float("inf"), 2.0, 0.0]), None])
    acc.add([torch.tensor([1.0, 1.0, float("nan"), float("-inf")]), None])
    summed, untouched = acc.result()
    assert untouched is None
    assert summed is not None
    assert summed[0] == 2.0 and summed[1] == float("inf") and torch.isnan(summed[2]) and summed[3] == float("-inf")


def test_sum_rejects_out_of_range_contributions_without_adding_them() -> None:
    acc = ExactGradientSum([torch.zeros(2)])
    acc.add([torch.tensor([1.5, -2.0])])
    with pytest.raises(GradientOutOfRange, match="cannot be summed exactly"):
        acc.add([torch.tensor([1.0, 2.0**MAX_EXPONENT])])
    result = acc.result()[0]
    assert result is not None and result.tolist() == [1.5, -2.0]


def _cuts(groups: Sequence[Group]) -> list[list[Group]]:
    """Several arrival orders and cuts of one step's groups into micro-batches, records shuffled too."""
    rng = random.Random(7)
    shuffled = []
    for group in reversed(groups):
        records = list(group)
        rng.shuffle(records)
        shuffled.append(records)
    return [
        [list(g) for g in groups],  # in order, one group per micro-batch
        shuffled,  # reversed, records shuffled
        [groups[2] + groups[0], list(groups[1])],  # another cut: two groups in one micro-batch
    ]


def _train(config: AgentTrainerConfig, steps: Sequence[Sequence[Group]]) -> tuple[list[StepStats], list[torch.Tensor]]:
    trainer = AgentTrainer(config)
    try:
        stats = []
        for index, micro_batches in enumerate(steps):
            for mb_index, micro_batch in enumerate(micro_batches):
                trainer.accumulate(micro_batch, micro_batch_index=mb_index)
            records = [r for mb in micro_batches for r in mb]
            stats.append(trainer.optimizer_step(*step_sizes([records]), num_micro_batches=len(micro_batches)))
            assert stats[-1].version == index + 1
        return stats, [p.detach().clone() for p in trainer.engine.module.parameters()]
    finally:
        trainer.release()


def test_shuffled_micro_batches_train_identical_bytes_with_adamw(tiny_model_dir: Path) -> None:
    """The same groups in other orders, other record orders and other cuts: every parameter byte-equal.

    Adam eps 1e-8 (the default): arrival-order summation moves near-zero gradients by rounding
    noise, which Adam turns into updates of ~lr, so this fails with ``exact_accumulation=False``
    (the arrival-order path of DeepSpeed's gradient buffers).
    """
    config = dataclasses.replace(trainer_config(tiny_model_dir), lr=1e-2)
    step_groups = [make_groups(seed=40 + step, tasks=3, group_size=4) for step in range(2)]
    runs = []
    for cut in range(len(_cuts(step_groups[0]))):
        runs.append(_train(config, [_cuts(groups)[cut] for groups in step_groups]))
    want_stats, want_params = runs[0]
    for stats, params in runs[1:]:
        for want, got in zip(want_params, params, strict=True):
            assert torch.equal(want.view(torch.int32), got.view(torch.int32))
        assert [(s.loss, s.grad_norm, s.kl, s.ratio_mean, s.clip_fraction) for s in stats] == \
            [(s.loss, s.grad_norm, s.kl, s.ratio_mean, s.clip_fraction) for s in want_stats]
    initial = _train(config, [])[1]
    assert any(not torch.equal(a, b) for a, b in zip(initial, want_params, strict=True))  # it trained


def test_a_replayed_step_gives_the_same_bytes(tiny_model_dir: Path) -> None:
    groups = make_groups(seed=50, tasks=3, group_size=4)
    trainer = AgentTrainer(trainer_config(tiny_model_dir))
    try:
        trainer.accumulate(groups[2], micro_batch_index=2)
        first = trainer.accumulated_gradients()
        trainer.discard_gradients()  # the slot died: the step replays from zero
        for index in (1, 0, 2):
            trainer.accumulate(groups[index], micro_batch_index=index)
        replayed = trainer.accumulated_gradients()
        trainer.discard_gradients()
        for index in (0, 1, 2):
            trainer.accumulate(groups[index], micro_batch_index=index)
        fresh = trainer.accumulated_gradients()
        assert all(g is not None for g in first)
        for a, b in zip(replayed, fresh, strict=True):
            assert a is not None and b is not None and torch.equal(a, b)
    finally:
        trainer.release()


def test_micro_batch_delivered_again_is_not_added_twice(tiny_model_dir: Path) -> None:
    groups = make_groups(seed=60, tasks=2, group_size=4)
    trainer = AgentTrainer(trainer_config(tiny_model_dir))
    try:
        first = trainer.accumulate(groups[0], micro_batch_index=0)
        once = trainer.accumulated_gradients()
        again = trainer.accumulate(list(reversed(groups[0])), micro_batch_index=0)  # same experiences
        assert again == first
        for a, b in zip(once, trainer.accumulated_gradients(), strict=True):
            assert a is not None and b is not None and torch.equal(a, b)
        with pytest.raises(InvalidArgument, match="micro-batch 0 was accumulated already"):
            trainer.accumulate(groups[1], micro_batch_index=0)
        with pytest.raises(InvalidArgument, match="accumulated already in this step"):
            trainer.accumulate(groups[0], micro_batch_index=1)  # one group in two micro-batches
        trainer.accumulate(groups[1], micro_batch_index=1)
        stats = trainer.optimizer_step(*step_sizes(groups), num_micro_batches=2)
        assert stats.version == 1 and stats.micro_batches == 2
    finally:
        trainer.release()


def test_optimizer_step_with_a_missing_micro_batch_is_refused(tiny_model_dir: Path) -> None:
    groups = make_groups(seed=70, tasks=3, group_size=4)
    trainer = AgentTrainer(trainer_config(tiny_model_dir))
    try:
        trainer.accumulate(groups[0], micro_batch_index=0)
        trainer.accumulate(groups[2], micro_batch_index=2)
        with pytest.raises(FailedPrecondition, match=r"missing \[1\]"):
            trainer.optimizer_step(*step_sizes(groups), num_micro_batches=3)
        assert trainer.version == 0  # nothing was stepped
        trainer.accumulate(groups[1], micro_batch_index=1)
        assert trainer.optimizer_step(*step_sizes(groups), num_micro_batches=3).version == 1
    finally:
        trainer.release()


def test_a_micro_batch_with_an_incomplete_group_adds_nothing(tiny_model_dir: Path) -> None:
    groups = make_groups(seed=80, tasks=2, group_size=4)
    trainer = AgentTrainer(trainer_config(tiny_model_dir))
    try:
        with pytest.raises(InvalidArgument, match="incomplete"):
            trainer.accumulate(groups[0] + groups[1][:1], micro_batch_index=0)
        assert all(g is None for g in trainer.accumulated_gradients())
        trainer.accumulate(groups[0] + groups[1], micro_batch_index=0)  # the group was not recorded as done
        assert trainer.optimizer_step(*step_sizes(groups), num_micro_batches=1).version == 1
    finally:
        trainer.release()
