"""Policy-gradient losses for traind: GRPO advantages, PPO-clip, k3 KL, aggregation.

Every loss here is returned as a *sum* (over tokens for ``token-mean``, over
sequences for ``seq-mean``). The step normaliser (total response tokens or
total sequences of the step) is applied once, to the accumulated gradient,
right before the optimizer step. That is what makes the gradient of a step
independent of how its groups were cut into micro-batches (DESIGN §3):
``g = (1/N) * sum_m grad(L_m)`` where every ``L_m`` is a plain sum and ``N`` is
fixed for the whole step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import torch

from flexmarl.errors import InvalidArgument

# Overflow guard only: exp(20) ~ 4.9e8 is far beyond any ratio the clip lets through.
LOG_RATIO_LIMIT = 20.0


class LossAggregation(enum.StrEnum):
    """How per-token losses become the step loss."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN = "seq-mean"


class ProximalPolicy(enum.StrEnum):
    """Which policy the PPO clip keeps the update close to (docs/training.md, "Off-policy correction").

    ``behaviour``: the policy that sampled each token (its recorded logprob): plain PPO-clip, so a
    token whose probability has already moved past the clip range since it was sampled (by the
    versions trained while it waited) gets no gradient. ``trainer``: decoupled PPO (Hilton et al.,
    "Batch size-invariance for policy optimization", 2022; AReaL's ``use_decoupled_loss``): the clip
    is around the trainer's policy at the start of the step, and each token's loss is weighted by the
    behaviour importance weight ``pi_prox / pi_behaviour``; tokens whose weight exceeds
    ``behaviour_weight_cap`` are dropped. traind takes one optimizer step per version, so the
    proximal policy is the weights of the very forward pass being trained: its logprobs are that
    pass's, detached, and no extra forward pass is needed (AReaL recomputes them because it takes
    several minibatch steps per version).
    """

    BEHAVIOUR = "behaviour"
    TRAINER = "trainer"


class AdvantageNorm(enum.StrEnum):
    """How returns become advantages (docs/training.md, "Credit assignment").

    ``std`` / ``mean``: GRPO within the task's group (against the group's baseline set, see
    :class:`TurnBaseline`); ``agent``: Dr. MAS, ``(G - mean) / std`` over every experience of the
    agent's step (the statistics come with the work, :class:`ReturnStats`); ``none``: the raw
    return, no baseline and no scaling.
    """

    STD = "std"
    MEAN = "mean"
    AGENT = "agent"
    NONE = "none"


class TurnBaseline(enum.StrEnum):
    """Which returns of a group a turn's ``std`` / ``mean`` advantage is measured against.

    ``episode``: each episode of the group once, with its return from the agent's first turn
    (its whole, discounted return); for episode-level rewards every turn of an episode has that
    return, so this is plain GRPO. ``turn``: the returns of the group's turns with the same
    turn index (the agent's k-th turn against the other episodes' k-th turns).
    """

    EPISODE = "episode"
    TURN = "turn"


@dataclasses.dataclass(frozen=True)
class ReturnStats:
    """Mean and unbiased standard deviation of the returns of every experience of an agent's step.

    Computed once by orchestratord's planner when the step's manifest is fixed (exactly rounded
    sums, so they do not depend on the order rewards were reported in) and sent with every
    micro-batch of the step: ``agent`` normalisation is then a fixed affine map of each
    return, the same for every cut of the step into micro-batches.
    """

    count: int
    mean: float
    std: float

    @classmethod
    def of(cls, returns: Sequence[float]) -> ReturnStats:
        """The statistics of a step's returns (``std`` 0 for fewer than two)."""
        count = len(returns)
        if count == 0:
            return cls(0, 0.0, 0.0)
        mean = math.fsum(returns) / count
        std = math.sqrt(math.fsum((r - mean) * (r - mean) for r in returns) / (count - 1)) if count > 1 else 0.0
        return cls(count, mean, std)


@dataclasses.dataclass(frozen=True)
class EntropySchedule:
    """Entropy-bonus coefficient per trained version: linear from ``start`` to ``end`` over ``steps`` steps.

    ``steps`` 0 (or ``end`` None) keeps ``start`` for the whole job. Step ``t`` (the version being
    trained) uses ``start + (end - start) * min(t, steps) / steps``.
    """

    start: float = 0.0
    end: float | None = None
    steps: int = 0

    def __post_init__(self) -> None:
        if self.start < 0.0 or (self.end is not None and self.end < 0.0) or self.steps < 0:
            raise InvalidArgument(f"entropy schedule must be non-negative, got {self}")

    def at(self, step: int) -> float:
        """The coefficient of the step that trains version ``step``."""
        if self.end is None or self.steps == 0:
            return self.start
        frac = min(max(step, 0), self.steps) / self.steps
        return self.start + (self.end - self.start) * frac


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of the clipped policy loss.

    Attributes:
        clip_eps_low: lower PPO clip, the ratio is clipped to ``1 - clip_eps_low``.
        clip_eps_high: upper PPO clip, ``1 + clip_eps_high``.
        dual_clip: hard cap ``c`` for negative advantages (dual-clip PPO): the loss of a
            token with ``A < 0`` is at most ``-c * A``, so a very stale sample whose ratio
            exploded cannot dominate the step. ``0`` disables it; must be ``> 1`` otherwise.
        kl_coef: weight of the k3 KL estimate to the frozen reference policy.
        loss_agg: token-level or sequence-level aggregation.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        proximal: the policy the clip is measured against (:class:`ProximalPolicy`).
        behaviour_weight_cap: with ``proximal`` ``trainer``, a token whose behaviour importance
            weight ``pi_prox / pi_behaviour`` exceeds it adds nothing to the loss (AReaL's
            ``behav_imp_weight_cap``); must be > 1.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 3.0
    kl_coef: float = 0.0
    loss_agg: LossAggregation = LossAggregation.TOKEN_MEAN
    entropy_coef: float = 0.0
    proximal: ProximalPolicy = ProximalPolicy.BEHAVIOUR
    behaviour_weight_cap: float = 5.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_eps_low < 1.0) or self.clip_eps_high < 0.0:
            raise InvalidArgument(f"clip eps must be in [0, 1): {self.clip_eps_low}, {self.clip_eps_high}")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise InvalidArgument(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if self.kl_coef < 0.0:
            raise InvalidArgument(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0.0:
            raise InvalidArgument(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if not self.behaviour_weight_cap > 1.0:
            raise InvalidArgument(f"behaviour_weight_cap must be > 1, got {self.behaviour_weight_cap}")


def group_advantages(
    returns: Sequence[float], norm: AdvantageNorm = AdvantageNorm.STD, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages of one group of episode returns.

    ``std``: ``(R_i - mean) / (std + eps)`` with the unbiased (n - 1) standard
    deviation, as in DeepSeekMath's GRPO; ``mean``: ``R_i - mean``. A group of one
    has zero advantage (nothing to compare against).

    Args:
        returns: the episode returns of one group (one task, one agent).
        norm: ``std`` or ``mean``.
        eps: added to the standard deviation; a group with equal returns gets zeros.

    Returns:
        One advantage per return, in the same order.
    """
    count = len(returns)
    if count == 0:
        return []
    mean = math.fsum(returns) / count
    centred = [r - mean for r in returns]
    if norm is AdvantageNorm.MEAN or count == 1:
        return centred if count > 1 else [0.0]
    std = math.sqrt(math.fsum(c * c for c in centred) / (count - 1))
    return [c / (std + eps) for c in centred]


def grouped_advantages(
    returns_by_group: Mapping[str, Mapping[int, float]],
    norm: AdvantageNorm = AdvantageNorm.STD,
    eps: float = 1e-6,
) -> dict[tuple[str, int], float]:
    """Advantages for several complete groups at once.

    Args:
        returns_by_group: group id -> (sample index -> episode return).
        norm: ``std`` or ``mean``.
        eps: see :func:`group_advantages`.

    Returns:
        (group id, sample index) -> advantage.
    """
    out: dict[tuple[str, int], float] = {}
    for gid, by_sample in returns_by_group.items():
        samples = sorted(by_sample)
        advs = group_advantages([by_sample[s] for s in samples], norm, eps)
        out.update({(gid, s): a for s, a in zip(samples, advs, strict=True)})
    return out


@dataclasses.dataclass(frozen=True)
class TurnReturn:
    """The return of one experience: one turn ``turn`` of episode ``sample_index`` in group ``group_id``."""

    group_id: str
    sample_index: int
    turn: int
    value: float


def turn_advantages(
    returns: Sequence[TurnReturn],
    norm: AdvantageNorm = AdvantageNorm.STD,
    eps: float = 1e-6,
    *,
    baseline: TurnBaseline = TurnBaseline.EPISODE,
    step_stats: ReturnStats | None = None,
) -> list[float]:
    """Advantage of every experience of complete groups (see :class:`AdvantageNorm`).

    ``std`` / ``mean`` with the ``episode`` baseline: ``G_{e,k} - mean`` (over ``std``) where
    mean and std are over the group's episodes' first-turn returns ``G_{e,0}``; for one turn per
    episode (or every turn sharing the episode's return) this is :func:`group_advantages`
    exactly. With the ``turn`` baseline the statistics are over the group's returns of turn
    index ``k``. ``agent`` uses ``step_stats`` (the whole step's), ``none`` the return itself.

    Raises:
        InvalidArgument: ``agent`` without ``step_stats``; an experience twice.
    """
    if norm is AdvantageNorm.NONE:
        return [r.value for r in returns]
    if norm is AdvantageNorm.AGENT:
        if step_stats is None:
            raise InvalidArgument("advantage_norm agent needs the step's return statistics")
        if step_stats.count < 2:
            return [0.0 for _ in returns]
        return [(r.value - step_stats.mean) / (step_stats.std + eps) for r in returns]
    seen: set[tuple[str, int, int]] = set()
    first: dict[str, dict[int, TurnReturn]] = {}
    by_turn: dict[tuple[str, int], dict[int, float]] = {}
    for r in returns:
        key = (r.group_id, r.sample_index, r.turn)
        if key in seen:
            raise InvalidArgument(f"group {r.group_id!r} episode {r.sample_index} turn {r.turn} given twice")
        seen.add(key)
        episodes = first.setdefault(r.group_id, {})
        if r.sample_index not in episodes or r.turn < episodes[r.sample_index].turn:
            episodes[r.sample_index] = r
        by_turn.setdefault((r.group_id, r.turn), {})[r.sample_index] = r.value
    stats: dict[tuple[str, int], tuple[float, float]] = {}

    def baseline_of(r: TurnReturn) -> tuple[float, float]:
        key = (r.group_id, r.turn if baseline is TurnBaseline.TURN else -1)
        if key not in stats:
            if baseline is TurnBaseline.TURN:
                values = [by_turn[key][s] for s in sorted(by_turn[key])]
            else:
                values = [first[r.group_id][s].value for s in sorted(first[r.group_id])]
            mean = math.fsum(values) / len(values)
            std = math.sqrt(math.fsum((v - mean) * (v - mean) for v in values) / (len(values) - 1)) if len(values) > 1 \
                else math.inf
            stats[key] = (mean, std)
        return stats[key]

    out: list[float] = []
    for r in returns:
        mean, std = baseline_of(r)
        if math.isinf(std):  # nothing to compare against
            out.append(0.0)
        elif norm is AdvantageNorm.MEAN:
            out.append(r.value - mean)
        else:
            out.append((r.value - mean) / (std + eps))
    return out


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Unbiased for samples from pi_theta, always >= 0 (Schulman, "Approximating KL divergence").
    """
    delta = (ref_logprobs - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1.0


@dataclasses.dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token terms of the policy loss (``[batch, tokens]``, zero where masked)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor


def policy_loss_per_token(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """PPO-clip per-token loss around the proximal policy ``config.proximal`` names.

    ``r = exp(clamp(logp - logp_prox, ±20))``;
    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``;
    for ``A < 0`` additionally ``l = min(l, -c A)`` (dual clip); plus ``kl_coef * k3``.

    ``behaviour``: ``logp_prox`` is the behaviour logprob. ``trainer`` (decoupled PPO): ``logp_prox``
    is ``logp`` detached (the weights before this step's update, see :class:`ProximalPolicy`), and
    the clipped term is multiplied by ``w = exp(clamp(logp_prox - logp_behaviour, ±20))``, detached,
    and by 0 where ``w > behaviour_weight_cap``. The returned ratio is ``pi_theta / pi_behaviour``
    either way (how far the policy moved since sampling); ``clipped`` marks every token the clip,
    the dual clip or the weight cap left without gradient.

    Args:
        logprobs: ``[B, T]`` logprobs of the response tokens under the current policy.
        behavior_logprobs: ``[B, T]`` logprobs recorded by the policy that sampled them.
        advantages: ``[B]`` (per sequence) or ``[B, T]``.
        mask: ``[B, T]``, 1 for real response tokens.
        config: clip and KL settings.
        ref_logprobs: ``[B, T]`` logprobs under the frozen reference, needed when ``kl_coef > 0``.
        entropy: ``[B, T]`` entropy of the current policy's next-token distribution at each
            response position, needed when ``entropy_coef > 0`` (the loss gets
            ``- entropy_coef * entropy``: a bonus that keeps the policy from collapsing early).

    Returns:
        The per-token loss, ratio, clipped indicator and KL, each masked.
    """
    if config.kl_coef > 0.0 and ref_logprobs is None:
        raise InvalidArgument("kl_coef > 0 needs reference logprobs")
    if config.entropy_coef > 0.0 and entropy is None:
        raise InvalidArgument("entropy_coef > 0 needs the policy's entropy")
    mask_f = mask.to(logprobs.dtype)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    adv = adv.to(logprobs.dtype)
    behaviour = behavior_logprobs.to(logprobs.dtype)
    decoupled = config.proximal is ProximalPolicy.TRAINER
    proximal = logprobs.detach() if decoupled else behaviour
    log_ratio = (logprobs - proximal).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clipped_ratio
    loss = torch.maximum(unclipped_loss, clipped_loss)
    clipped = (clipped_loss > unclipped_loss).to(logprobs.dtype)
    if config.dual_clip > 0.0:
        cap = -adv * config.dual_clip
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
        clipped = torch.where(capped, torch.ones_like(clipped), clipped)
    moved = ratio.detach()
    if decoupled:
        weight = torch.exp((proximal - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        dropped = weight > config.behaviour_weight_cap
        loss = torch.where(dropped, torch.zeros_like(loss), loss * weight)
        clipped = torch.where(dropped, torch.ones_like(clipped), clipped)
        moved = moved * weight
    if ref_logprobs is not None and config.kl_coef > 0.0:
        kl = k3_kl(logprobs, ref_logprobs.to(logprobs.dtype))
        loss = loss + config.kl_coef * kl
    else:
        kl = torch.zeros_like(loss)
    if entropy is not None and config.entropy_coef > 0.0:
        loss = loss - config.entropy_coef * entropy.to(loss.dtype)
    entropy_terms = entropy.detach().to(loss.dtype) if entropy is not None else torch.zeros_like(loss)
    return PolicyLossTerms(
        loss=loss * mask_f,
        ratio=moved * mask_f,
        clipped=clipped.detach() * mask_f,
        kl=kl.detach() * mask_f,
        entropy=entropy_terms * mask_f,
    )


def stale_token_mask(token_versions: torch.Tensor, min_token_version: int) -> torch.Tensor:
    """1.0 for each token sampled with ``min_token_version`` or newer, 0.0 for the older (too stale) ones.

    ``rollout.mask_stale_tokens`` (slime's ``--mask-offpolicy-in-partial-rollout``): with
    ``min_token_version`` = trained version - ``pipeline.max_staleness``, a sample resumed across
    interruptions trains only on its tokens within the staleness bound. A masked token adds
    nothing to the loss and is not counted by the token-mean normaliser (docs/training.md).
    """
    return (token_versions >= min_token_version).to(torch.float32)


def aggregate_sum(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: LossAggregation) -> torch.Tensor:
    """Sums a masked per-token loss for a micro-batch, before the step normaliser.

    ``token-mean``: the sum over all response tokens (step normaliser: step tokens).
    ``seq-mean``: the sum over sequences of each sequence's token mean (step
    normaliser: step sequences). A sequence with no tokens contributes 0.
    """
    mask_f = mask.to(per_token.dtype)
    masked = per_token * mask_f
    if loss_agg is LossAggregation.TOKEN_MEAN:
        return masked.sum()
    lengths = mask_f.sum(dim=-1).clamp(min=1.0)
    return (masked.sum(dim=-1) / lengths).sum()


def step_normaliser(loss_agg: LossAggregation, step_response_tokens: int, step_sequences: int) -> int:
    """The fixed denominator of a whole step for an aggregation mode."""
    value = step_response_tokens if loss_agg is LossAggregation.TOKEN_MEAN else step_sequences
    if value <= 0:
        raise InvalidArgument(f"step normaliser for {loss_agg.value} must be > 0, got {value}")
    return value
