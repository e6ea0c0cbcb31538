"""AgentTrainer in one process: step-exact accumulation, reference equivalence, publish."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord
from traind import losses
from traind.batches import micro_batch_advantages, pack_micro_batch, token_logprobs
from traind.losses import LossAggregation, PolicyLossConfig
from traind.model import AgentTrainer, AgentTrainerConfig

from .conftest import make_groups


def trainer_config(
    model_dir: Path,
    *,
    zero_stage: int = 0,
    agg: LossAggregation = LossAggregation.TOKEN_MEAN,
    kl_coef: float = 0.0,
    agent: str = "a",
    adam_eps: float = 1e-8,
) -> AgentTrainerConfig:
    return AgentTrainerConfig(
        agent=agent,
        model_path=str(model_dir),
        zero_stage=zero_stage,
        lr=1e-3,
        grad_clip=1.0,
        eps=adam_eps,
        loss=PolicyLossConfig(loss_agg=agg, kl_coef=kl_coef),
    )


def flat_grads(trainer: AgentTrainer) -> torch.Tensor:
    grads = trainer.accumulated_gradients()
    assert all(g is not None for g in grads)
    return torch.cat([g.detach().flatten() for g in grads if g is not None])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def step_sizes(groups: Sequence[Sequence[ExperienceRecord]]) -> tuple[int, int]:
    records = [r for g in groups for r in g]
    return sum(r.response_tokens for r in records), len(records)


@pytest.mark.parametrize("agg", list(LossAggregation))
def test_accumulated_gradient_equals_full_batch_gradient(tiny_model_dir: Path, agg: LossAggregation) -> None:
    """Four micro-batches of one group each vs one micro-batch of all four groups, ZeRO 0.

    The raw gradient sums must agree to 1e-6 relative: the only difference is the batch
    shape (padding width, batched-matmul blocking), which changes fp32 summation order.
    """
    trainer = trainer_config(tiny_model_dir, agg=agg)
    trainer_obj = AgentTrainer(trainer)
    try:
        groups = make_groups(seed=1, tasks=4, group_size=4)
        for group in groups:
            trainer_obj.accumulate(group)
        micro = flat_grads(trainer_obj)
        trainer_obj.discard_gradients()
        trainer_obj.accumulate([r for g in groups for r in g])
        full = flat_grads(trainer_obj)
        rel = float((micro - full).norm() / full.norm())
        assert rel < 1e-6, rel
        assert float(full.norm()) > 0.0
    finally:
        trainer_obj.release()


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: Sequence[Sequence[ExperienceRecord]],
    cfg: AgentTrainerConfig,
) -> float:
    """The textbook full-batch step: mean loss, backward, clip, AdamW, without DeepSpeed."""
    records = [r for g in groups for r in g]
    advs = micro_batch_advantages(records, cfg.advantage_norm, cfg.advantage_eps)
    packed = pack_micro_batch(records, advs)
    logp = token_logprobs(model, packed.input_ids, packed.attention_mask)
    terms = losses.policy_loss_per_token(
        logp, packed.behavior_logprobs, packed.advantages, packed.response_mask, cfg.loss
    )
    mask = packed.response_mask
    if cfg.loss.loss_agg is LossAggregation.TOKEN_MEAN:
        loss = (terms.loss * mask).sum() / mask.sum()
    else:
        loss = ((terms.loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    optimizer.zero_grad()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
    optimizer.step()
    return norm


@pytest.mark.parametrize(
    ("zero_stage", "agg"),
    [(0, LossAggregation.TOKEN_MEAN), (0, LossAggregation.SEQ_MEAN), (2, LossAggregation.TOKEN_MEAN)],
)
def test_two_steps_match_plain_torch_full_batch(tiny_model_dir: Path, zero_stage: int, agg: LossAggregation) -> None:
    """Micro-batched DeepSpeed steps == full-batch torch steps (normaliser and clip applied once).

    Adam's eps is 1e-4 here: with eps=1e-8 the first Adam update is ~lr*sign(g), so an
    entry whose gradient is at the fp32 noise floor (~1e-7 of the largest) may flip sign
    between two summation orders and differ by 2*lr. A larger eps keeps the update a
    continuous function of g, so the comparison tests the gradient, not sign noise.
    """
    cfg = trainer_config(tiny_model_dir, zero_stage=zero_stage, agg=agg, adam_eps=1e-4)
    trainer = AgentTrainer(cfg)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    try:
        for step in range(2):
            groups = make_groups(seed=10 + step, tasks=3, group_size=4)
            for group in groups:
                trainer.accumulate(group)
            tokens, sequences = step_sizes(groups)
            stats = trainer.optimizer_step(tokens, sequences)
            ref_norm = reference_step(model, optimizer, groups, cfg)
            assert stats.version == step + 1
            assert stats.grad_norm == pytest.approx(ref_norm, rel=1e-5)
            assert stats.grad_norm > cfg.grad_clip  # the clip is exercised
            assert stats.response_tokens == tokens and stats.sequences == sequences
            assert math.isfinite(stats.loss) and 0.0 <= stats.clip_fraction <= 1.0
        torch.testing.assert_close(flat_params(trainer.engine.module), flat_params(model), rtol=1e-5, atol=1e-6)
    finally:
        trainer.release()


def test_kl_to_reference_is_zero_before_the_first_update(tiny_model_dir: Path) -> None:
    trainer = AgentTrainer(trainer_config(tiny_model_dir, kl_coef=0.1))
    try:
        groups = make_groups(seed=3, tasks=1, group_size=4)
        trainer.accumulate(groups[0])
        tokens, sequences = step_sizes(groups)
        first = trainer.optimizer_step(tokens, sequences)
        assert first.kl == pytest.approx(0.0, abs=1e-10)
        trainer.accumulate(groups[0])
        second = trainer.optimizer_step(tokens, sequences)
        assert second.kl > 0.0
    finally:
        trainer.release()


def test_incomplete_group_is_rejected(tiny_model_dir: Path) -> None:
    group = make_groups(seed=4, tasks=1, group_size=4)[0]
    with pytest.raises(InvalidArgument, match="incomplete"):
        micro_batch_advantages(group[:1], losses.AdvantageNorm.STD, 1e-6)


def test_publish_reloads_with_identical_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = AgentTrainer(trainer_config(tiny_model_dir))
    try:
        groups = make_groups(seed=5, tasks=2, group_size=4)
        for group in groups:
            trainer.accumulate(group)
        trainer.optimizer_step(*step_sizes(groups))
        out = trainer.publish(tmp_path / "v1")
        assert (out / "model.safetensors").is_file()
        assert (out / "config.json").is_file()
        assert (out / "tokenizer.json").is_file()
        reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        ids = torch.tensor([[5, 17, 33, 2, 9, 100]])
        with torch.no_grad():
            want = trainer.engine.module(input_ids=ids).logits
            got = reloaded(input_ids=ids).logits
            base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)(input_ids=ids).logits
        assert torch.equal(want, got)
        assert not torch.equal(base, got)  # the trained weights were published, not the initial ones
    finally:
        trainer.release()


def test_decoupled_loss_reaches_the_trainer_and_stays_micro_batch_invariant(tiny_model_dir: Path) -> None:
    """``algorithm.proximal_policy: trainer`` from the job spec to the gradient.

    The groups' recorded behaviour logprobs are not the tiny model's, so they stand for a stale
    policy: PPO-clip around them clips tokens that the decoupled loss weights instead, and the two
    gradients differ. The decoupled loss is per token too, so micro-batches still sum to the batch.
    """
    from flexmarl.jobspec import parse_job_spec
    from tests.orchestratord.helpers import spec_dict
    from traind.worker import trainer_config as spec_trainer_config

    data = spec_dict()
    data["algorithm"] = {**data.get("algorithm", {}), "proximal_policy": "trainer", "behaviour_weight_cap": 3.0}
    spec = parse_job_spec(data)
    loss = spec_trainer_config(spec, spec.agents[0].name).loss
    assert loss.proximal is losses.ProximalPolicy.TRAINER and loss.behaviour_weight_cap == 3.0

    groups = make_groups(seed=1, tasks=2, group_size=4)
    grads = {}
    for proximal in losses.ProximalPolicy:
        cfg = trainer_config(tiny_model_dir)
        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, proximal=proximal))
        trainer = AgentTrainer(cfg)
        try:
            trainer.accumulate([r for g in groups for r in g])
            grads[proximal] = flat_grads(trainer)
            if proximal is losses.ProximalPolicy.TRAINER:  # the behaviour loss's invariance has its own test above
                trainer.discard_gradients()
                for group in groups:
                    trainer.accumulate(group)
                micro = flat_grads(trainer)
                assert float((micro - grads[proximal]).norm() / grads[proximal].norm()) < 1e-6
        finally:
            trainer.release()
    behaviour, decoupled = grads[losses.ProximalPolicy.BEHAVIOUR], grads[losses.ProximalPolicy.TRAINER]
    assert float((behaviour - decoupled).norm() / behaviour.norm()) > 1e-3
