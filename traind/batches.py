"""Batch preparation for one micro-batch: GRPO advantages, packed tensors, next-token logprobs.

Pure functions of experiences and tensors (torch and numpy, no DeepSpeed), shared by
:class:`traind.model.AgentTrainer` and anything that trains or checks with the trainer's
own pieces (tests, ``benchmarks/signaling_learning.py``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord, min_episodes_to_train
from traind import losses


@dataclasses.dataclass(frozen=True)
class PackedMicroBatch:
    """Right-padded token tensors of a micro-batch, aligned to next-token logits."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1], 1 where logits[:, t] predicts a response token that trains
    behavior_logprobs: torch.Tensor  # [B, L-1], each token's own behaviour logprob (resumed samples included)
    advantages: torch.Tensor  # [B]
    #: Response tokens left out of ``response_mask`` as too stale (``min_token_version``).
    stale_tokens: int = 0


def micro_batch_advantages(
    records: Sequence[ExperienceRecord], norm: losses.AdvantageNorm, eps: float, *,
    baseline: losses.TurnBaseline = losses.TurnBaseline.EPISODE, step_stats: losses.ReturnStats | None = None,
) -> list[float]:
    """The advantage of every record (:func:`traind.losses.turn_advantages`); the micro-batch must hold whole groups.

    rolloutd writes each turn's return (the agent's rewards from that turn on, discounted by the
    agent's ``gamma``; for episode-level rewards the episode return on every turn) as the
    record's ``reward``. A group's episodes are its ``group_size`` but those dropped as their
    reward failed (orchestratord's manifest names which): at least
    :func:`flexmarl.experience.min_episodes_to_train`.

    Raises:
        InvalidArgument: a group has fewer distinct samples than a task trains with, a turn
            is there twice, or ``agent`` normalisation without ``step_stats``.
    """
    samples: dict[str, set[int]] = defaultdict(set)
    sizes: dict[str, int] = {}
    for rec in records:
        samples[rec.group_id].add(rec.sample_index)
        sizes[rec.group_id] = rec.group_size
    for gid, by_sample in samples.items():
        if len(by_sample) < min_episodes_to_train(sizes[gid]):
            raise InvalidArgument(
                f"group {gid!r} is incomplete in the micro-batch: {len(by_sample)} of {sizes[gid]} episodes"
            )
    returns = [losses.TurnReturn(rec.group_id, rec.sample_index, rec.turn, float(rec.reward)) for rec in records]
    return losses.turn_advantages(returns, norm, eps, baseline=baseline, step_stats=step_stats)


def pack_micro_batch(
    records: Sequence[ExperienceRecord], advantages: Sequence[float], *, min_token_version: int | None = None,
) -> PackedMicroBatch:
    """Concatenates prompt + response per record and right-pads to one tensor.

    ``behavior_logprobs`` holds each response token's own behaviour logprob, whatever version
    sampled it (a sample resumed after an interruption mixes versions; decoupled PPO takes the
    ratio per token). ``min_token_version`` (``rollout.mask_stale_tokens``: the trained version
    minus ``pipeline.max_staleness``) leaves every token sampled with an older version out of
    ``response_mask``, so it adds nothing to the loss, the gradient or the token count
    (:func:`traind.losses.stale_token_mask`).
    """
    if not records:
        raise InvalidArgument("empty micro-batch")
    lengths = [len(r.prompt_token_ids) + len(r.response_token_ids) for r in records]
    width = max(lengths)
    if width < 2:
        raise InvalidArgument("every sequence needs a prompt token and a response token")
    batch = len(records)
    input_ids = torch.zeros((batch, width), dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    behavior = torch.zeros((batch, width - 1), dtype=torch.float32)
    stale = 0
    for i, rec in enumerate(records):
        prompt_len = len(rec.prompt_token_ids)
        resp_len = len(rec.response_token_ids)
        if prompt_len == 0:
            raise InvalidArgument(f"experience {rec.experience_id!r} has an empty prompt")
        input_ids[i, :prompt_len] = torch.from_numpy(rec.prompt_token_ids.astype(np.int64))
        input_ids[i, prompt_len : prompt_len + resp_len] = torch.from_numpy(rec.response_token_ids.astype(np.int64))
        attention[i, : lengths[i]] = 1
        keep = torch.ones(resp_len, dtype=torch.float32)
        if min_token_version is not None:
            keep = losses.stale_token_mask(torch.from_numpy(rec.token_versions()), min_token_version)
            stale += resp_len - int(keep.sum().item())
        response_mask[i, prompt_len - 1 : prompt_len - 1 + resp_len] = keep
        behavior[i, prompt_len - 1 : prompt_len - 1 + resp_len] = torch.from_numpy(
            rec.response_logprobs.astype(np.float32)
        )
    return PackedMicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response_mask,
        behavior_logprobs=behavior,
        advantages=torch.tensor(list(advantages), dtype=torch.float32),
        stale_tokens=stale,
    )


def token_logprobs(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each next token, ``[B, L-1]``, computed in fp32."""
    return token_logprobs_and_entropy(model, input_ids, attention_mask, temperature, entropy=False)[0]


def token_logprobs_and_entropy(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token logprobs ``[B, L-1]`` and (when asked) the entropy of each next-token distribution."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        # The engines report logprobs of the temperature-scaled distribution the tokens were
        # sampled from (SGLang's default); the policy ratio must compare like with like.
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    log_norm = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets).squeeze(-1) - log_norm
    if not entropy:
        return picked, None
    log_probs = logits - log_norm.unsqueeze(-1)
    return picked, -(log_probs.exp() * log_probs).sum(dim=-1)
