"""Loss functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from flexmarl.errors import InvalidArgument
from traind import losses
from traind.losses import AdvantageNorm, LossAggregation, PolicyLossConfig


def test_group_advantages_std_uses_unbiased_std() -> None:
    # mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    advs = losses.group_advantages([1.0, 2.0, 3.0], AdvantageNorm.STD, eps=1e-6)
    assert advs == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6)], abs=1e-12)


def test_group_advantages_mean_only() -> None:
    assert losses.group_advantages([1.0, 2.0, 6.0], AdvantageNorm.MEAN) == pytest.approx([-2.0, -1.0, 3.0])


def test_group_advantages_equal_returns_and_singletons_are_zero() -> None:
    assert losses.group_advantages([5.0, 5.0]) == [0.0, 0.0]
    assert losses.group_advantages([3.0]) == [0.0]
    assert losses.group_advantages([]) == []


def test_grouped_advantages_keys_by_group_and_sample() -> None:
    advs = losses.grouped_advantages({"t/a": {1: 0.0, 0: 2.0}, "u/a": {0: 1.0}}, AdvantageNorm.MEAN)
    assert advs == {("t/a", 0): 1.0, ("t/a", 1): -1.0, ("u/a", 0): 0.0}


def _terms(ratio: float, adv: float, cfg: PolicyLossConfig) -> losses.PolicyLossTerms:
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64)
    behavior = torch.zeros((1, 1), dtype=torch.float64)
    return losses.policy_loss_per_token(logp, behavior, torch.tensor([adv]), torch.ones((1, 1)), cfg)


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "clipped"),
    [
        (1.5, 1.0, -1.2, 1.0),  # positive advantage, ratio above 1+eps: clipped to 1.2
        (1.5, -1.0, 1.5, 0.0),  # negative advantage, ratio above: pessimistic unclipped term
        (0.5, 1.0, -0.5, 0.0),  # positive advantage, ratio below 1-eps: unclipped
        (0.5, -1.0, 0.8, 1.0),  # negative advantage, ratio below: clipped to 0.8
        (5.0, -1.0, 3.0, 1.0),  # stale sample: dual clip caps -A*r at -A*c = 3
        (1.0, 2.0, -2.0, 0.0),  # on-policy: -A
    ],
)
def test_ppo_clip_by_hand(ratio: float, adv: float, loss: float, clipped: float) -> None:
    terms = _terms(ratio, adv, PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0))
    assert terms.loss.item() == pytest.approx(loss, abs=1e-9)
    assert terms.clipped.item() == clipped
    assert terms.ratio.item() == pytest.approx(ratio)


def test_dual_clip_off_keeps_unbounded_loss() -> None:
    terms = _terms(5.0, -1.0, PolicyLossConfig(dual_clip=0.0))
    assert terms.loss.item() == pytest.approx(5.0)


def test_k3_kl_by_hand() -> None:
    # pi = 1, pi_ref = 0.5 on the sampled token: exp(d) - d - 1 with d = ln 0.5
    kl = losses.k3_kl(torch.tensor([0.0], dtype=torch.float64), torch.tensor([math.log(0.5)], dtype=torch.float64))
    assert kl.item() == pytest.approx(0.5 + math.log(2.0) - 1.0, abs=1e-12)
    same = losses.k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3]))
    assert same.item() == 0.0


def test_kl_term_is_added_with_its_coefficient() -> None:
    cfg = PolicyLossConfig(kl_coef=0.1)
    logp = torch.tensor([[0.0]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    terms = losses.policy_loss_per_token(logp, logp, torch.tensor([1.0]), torch.ones((1, 1)), cfg, ref)
    assert terms.loss.item() == pytest.approx(-1.0 + 0.1 * (0.5 + math.log(2.0) - 1.0), abs=1e-12)
    with pytest.raises(InvalidArgument):
        losses.policy_loss_per_token(logp, logp, torch.tensor([1.0]), torch.ones((1, 1)), cfg)


def test_masked_tokens_contribute_nothing() -> None:
    logp = torch.tensor([[0.3, 10.0]])
    terms = losses.policy_loss_per_token(
        logp, torch.zeros_like(logp), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), PolicyLossConfig()
    )
    assert terms.loss[0, 1].item() == 0.0
    assert terms.clipped[0, 1].item() == 0.0


def test_aggregate_sums_by_hand() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert losses.aggregate_sum(per_token, mask, LossAggregation.TOKEN_MEAN).item() == 15.0
    # sequence means 2 and 4.5
    assert losses.aggregate_sum(per_token, mask, LossAggregation.SEQ_MEAN).item() == 6.5


def test_step_normaliser_and_validation() -> None:
    assert losses.step_normaliser(LossAggregation.TOKEN_MEAN, 41, 16) == 41
    assert losses.step_normaliser(LossAggregation.SEQ_MEAN, 41, 16) == 16
    with pytest.raises(InvalidArgument):
        losses.step_normaliser(LossAggregation.TOKEN_MEAN, 0, 16)
    with pytest.raises(InvalidArgument):
        PolicyLossConfig(dual_clip=0.5)


def test_micro_batch_sums_add_up_to_the_full_batch_loss() -> None:
    """The per-micro-batch sums divided once by the step total give the full-batch mean."""
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn((6, 5), generator=gen, dtype=torch.float64)
    mask = (torch.rand((6, 5), generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1.0
    for agg in LossAggregation:
        full = losses.aggregate_sum(per_token, mask, agg)
        parts = sum(losses.aggregate_sum(per_token[i : i + 2], mask[i : i + 2], agg) for i in (0, 2, 4))
        assert float(parts) == pytest.approx(float(full), rel=1e-12)


def test_entropy_bonus_is_subtracted_with_its_coefficient() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    mask = torch.tensor([[1.0, 0.0]])
    entropy = torch.tensor([[0.7, 0.9]])
    base = losses.policy_loss_per_token(logp, logp, torch.tensor([1.0]), mask, PolicyLossConfig())
    bonus = losses.policy_loss_per_token(logp, logp, torch.tensor([1.0]), mask,
                                         PolicyLossConfig(entropy_coef=0.1), None, entropy)
    # ratio 1, A = 1: loss -1 per token; with the bonus -1 - 0.1 * 0.7 on the one real token.
    assert base.loss.tolist() == [[-1.0, 0.0]]
    assert bonus.loss[0, 0].item() == pytest.approx(-1.07)
    assert bonus.loss[0, 1].item() == 0.0
    assert bonus.entropy[0].tolist() == pytest.approx([0.7, 0.0])
    with pytest.raises(InvalidArgument, match="entropy"):
        losses.policy_loss_per_token(logp, logp, torch.tensor([1.0]), mask, PolicyLossConfig(entropy_coef=0.1))
    with pytest.raises(InvalidArgument, match="entropy_coef"):
        PolicyLossConfig(entropy_coef=-1.0)


def test_token_entropy_matches_the_distribution() -> None:
    from traind.batches import token_logprobs_and_entropy

    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # p = (1/4, 3/4), then (1/2, 1/2)

    class _Model:
        def __call__(self, **_: object) -> object:
            return type("Out", (), {"logits": logits})()

    ids = torch.tensor([[0, 1]])
    logp, entropy = token_logprobs_and_entropy(_Model(), ids, torch.ones_like(ids))
    assert logp[0].tolist() == pytest.approx([math.log(0.75)])
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy is not None and entropy[0].tolist() == pytest.approx([expected])


def _grad(ratio: float, adv: float, cfg: PolicyLossConfig) -> tuple[float, losses.PolicyLossTerms]:
    """d loss / d logp of one token whose policy moved to ``ratio`` x its behaviour probability."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    behavior = torch.zeros((1, 1), dtype=torch.float64)
    terms = losses.policy_loss_per_token(logp, behavior, torch.tensor([adv]), torch.ones((1, 1)), cfg)
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    return grad.item(), terms


@pytest.mark.parametrize(
    ("ratio", "adv", "behaviour_grad", "trainer_grad"),
    [
        (1.5, 1.0, 0.0, -1.5),  # moved up past 1 + eps while it waited: clipped by PPO, weighted 1.5 decoupled
        (0.5, -1.0, 0.0, 0.5),  # moved down past 1 - eps: same, the other side
        (0.5, 1.0, -0.5, -0.5),  # inside the pessimistic branch: both give -A r
        (1.0, 2.0, -2.0, -2.0),  # on-policy: identical
        (6.0, 1.0, 0.0, 0.0),  # weight 6 > cap 5: dropped (and clipped by PPO)
    ],
)
def test_decoupled_loss_weights_stale_tokens_instead_of_clipping_them(
        ratio: float, adv: float, behaviour_grad: float, trainer_grad: float) -> None:
    behaviour = PolicyLossConfig(dual_clip=0.0)
    trainer = PolicyLossConfig(dual_clip=0.0, proximal=losses.ProximalPolicy.TRAINER, behaviour_weight_cap=5.0)
    grad_b, terms_b = _grad(ratio, adv, behaviour)
    grad_t, terms_t = _grad(ratio, adv, trainer)
    assert grad_b == pytest.approx(behaviour_grad, abs=1e-12)
    assert grad_t == pytest.approx(trainer_grad, abs=1e-12)
    # the ratio reported is pi_theta / pi_behaviour under both; "clipped" marks the tokens left without gradient
    assert terms_t.ratio.item() == pytest.approx(ratio) == terms_b.ratio.item()
    assert terms_t.clipped.item() == (1.0 if trainer_grad == 0.0 else 0.0)


def test_decoupled_loss_value_is_the_weighted_policy_term() -> None:
    cfg = PolicyLossConfig(proximal=losses.ProximalPolicy.TRAINER)
    terms = _terms(1.5, -2.0, cfg)  # weight 1.5, ratio to the trainer's policy 1: loss = -A * 1 * 1.5
    assert terms.loss.item() == pytest.approx(3.0, abs=1e-12)
    with pytest.raises(InvalidArgument, match="behaviour_weight_cap"):
        PolicyLossConfig(proximal=losses.ProximalPolicy.TRAINER, behaviour_weight_cap=1.0)
