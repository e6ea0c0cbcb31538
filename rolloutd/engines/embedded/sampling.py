"""Sampling, log-probabilities, seeds and stop conditions of the embedded engine, as SGLang 0.5.23's.

Log-probabilities: like SGLang by default, the logprob of a sampled token is taken from the
temperature-scaled distribution ``log_softmax(logits / temperature)`` before top-k/top-p/min-p
truncation; greedy decoding (temperature below 1e-6) gives ``log_softmax(logits)``. The flag
``--return-original-logprob`` (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) returns
``log_softmax(logits)`` at every temperature.

Sampling and seeds (sglang/srt/sampling/sampling_batch_info.py ``from_schedule_batch``,
sglang/srt/layers/sampler.py): without ``--enable-deterministic-inference`` a request's
``sampling_seed`` is ignored; tokens are drawn from the engine's own generator (seeded at start
by ``--seed``, SGLang's ``--random-seed``) in batch order, and logprobs are the batched
decode's (they depend on what shared the batch). With the flag, every sample draws its token at
position ``p`` by Gumbel-max over uniforms that are a function of (its seed, ``p``) alone (seed
42 when the request brought none), so the ``n`` samples of one ``n > 1`` request with one seed
are identical, and the samples do not depend on what else shares the batch; the logprobs are
then recomputed per finished sequence in an unpadded forward pass
(:func:`rolloutd.engines.embedded.runner.rescore_logits`, :func:`rescored_logprobs`), so they
are batch-invariant too. SGLang's seeded sampler asserts when a batch needs min-p sampling, and
a failed assertion in its scheduler takes the server down: with the flag, a request with
``min_p > 0`` stops this engine the same way (the scheduler raises ``SchedulerCrash``).

Stop conditions (sglang/srt/managers/schedule_batch.py ``update_finish_state``): stop strings
first (the decoded output contains one: ``{"type": "stop", "matched": "<str>"}``), then stop
token ids and EOS (both off under ``ignore_eos``), then ``max_new_tokens``. ``output_ids``
keep every token through the one that completed the match; ``text`` drops the stop string
and what follows it (the matched stop token) unless ``no_stop_trim``
(detokenizer_manager.py ``trim_matched_stop``).
"""

from __future__ import annotations

from typing import Any

import torch

from rolloutd.engines.embedded.model import LoadedModel
from rolloutd.engines.embedded.work import SequenceState
from rolloutd.engines.protocol import SamplingParams

LOGPROB_FLOOR = torch.finfo(torch.float32).min
# sampling_batch_info.py: the seed of a request without sampling_seed under deterministic inference.
DEFAULT_SAMPLING_SEED = 42
_UINT64_MASK = (1 << 64) - 1


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    position: int,
    deterministic: bool,
    original_logprob: bool,
    rng: torch.Generator,
) -> tuple[int, float]:
    """One token and its logprob (sampler.py's order: temperature, top-k, top-p, min-p).

    Args:
        logits: The next-token logits of one sequence.
        params: Its sampling parameters.
        position: The token's position in the sequence (prompt plus output so far).
        deterministic: ``--enable-deterministic-inference``: Gumbel-max seeded by (seed, position).
        original_logprob: ``--return-original-logprob``: the logprob of the raw distribution.
        rng: The engine's generator (used without ``deterministic``).
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:  # SGLang: temperature 1 and top_k 1, whatever the seed
        token_id = int(torch.argmax(logits))
        return token_id, max(float(raw_logprobs[token_id]), LOGPROB_FLOOR)
    scaled_logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = scaled_logprobs.exp()
    if params.top_k > 0 and params.top_k < probs.numel():
        threshold = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = (cumulative - sorted_probs) > params.top_p * cumulative[-1]
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
    if deterministic:
        seed = params.seed if params.seed is not None else DEFAULT_SAMPLING_SEED
        token_id = gumbel_max_token(probs, seed, position)
    else:
        token_id = int(torch.multinomial(probs / probs.sum(), 1, generator=rng))
    source = raw_logprobs if original_logprob else scaled_logprobs
    return token_id, max(float(source[token_id]), LOGPROB_FLOOR)


def top_logprobs(
    logits: torch.Tensor, params: SamplingParams, k: int, *, original_logprob: bool
) -> list[tuple[float, int]]:
    """The ``k`` most likely tokens of the distribution :func:`sample_token` takes the logprob from.

    SGLang's sampler.py hands that same ``logprobs`` tensor to ``compute_logprobs`` with
    ``top_logprobs_nums``, and logprob_processor.py ``get_top_logprobs`` takes its ``topk``.
    """
    if params.greedy or params.temperature == 0 or original_logprob:
        source = torch.log_softmax(logits, dim=-1)
    else:
        source = torch.log_softmax(logits / params.temperature, dim=-1)
    return topk(source, k)


def rescored_logprobs(
    logits: torch.Tensor, output_ids: list[int], params: SamplingParams, top_logprobs_num: int, *,
    original_logprob: bool,
) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """The logprobs of ``output_ids`` (and, when asked, each token's top alternatives) from rescoring logits.

    Same convention as :func:`sample_token`: the temperature-scaled distribution, the raw one at
    temperature 0 or with ``original_logprob``. The alternatives come from the same passes, so
    they agree with the sampled logprobs.
    """
    temperature = params.temperature
    if temperature != 0 and not original_logprob:
        logits = logits / temperature
    scores = torch.log_softmax(logits, dim=-1)
    chosen = scores.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)
    top = [topk(row, top_logprobs_num) for row in scores] if top_logprobs_num else None
    return [max(float(value), LOGPROB_FLOOR) for value in chosen], top


def stop_reason(seq: SequenceState, token_id: int, loaded: LoadedModel) -> dict[str, Any] | None:
    """schedule_batch.py ``update_finish_state``: stop strings, then stop tokens/EOS, then length."""
    params = seq.job.params
    if params.stop and loaded.tokenizer is not None:
        decoded = loaded.tokenizer.decode(seq.output_ids)
        for stop in params.stop:
            if stop in decoded:
                return {"type": "stop", "matched": stop}
    # _check_token_based_finish: ignore_eos turns off stop_token_ids as well as EOS.
    if not params.ignore_eos and (token_id in params.stop_token_ids or token_id in loaded.eos_token_ids):
        return {"type": "stop", "matched": token_id}
    if len(seq.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    return None


def topk(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """(logprob, token id) of the ``k`` largest entries, largest first (floored as sampled logprobs are)."""
    values, indices = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(max(float(v), LOGPROB_FLOOR), int(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]


def output_text(loaded: LoadedModel, output_ids: list[int], reason: dict[str, Any], params: SamplingParams) -> str:
    """The detokenized output, trimmed at the matched stop as detokenizer_manager.py ``trim_matched_stop``."""
    if loaded.tokenizer is None or not output_ids:
        return ""
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    ids = output_ids
    if isinstance(matched, int) and not params.no_stop_trim:
        ids = output_ids[:-1]  # the matched stop token is the last one
    text = str(loaded.tokenizer.decode(ids, skip_special_tokens=True))
    if isinstance(matched, str) and (position := text.find(matched)) != -1:
        text = text[: position + len(matched)] if params.no_stop_trim else text[:position]
    return text


def gumbel_max_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token Gumbel-max picks from ``probs`` with uniforms that depend on (seed, position) only.

    What SGLang's deterministic sampler does (sampler.py ``multinomial_with_seed``: argmax of
    ``log p + Gumbel`` noise hashed from the seed and the position), with FlexMARL's own
    uniform stream: a generator seeded by a 64-bit mix of the seed and the position. Two
    samples with one seed at one position draw the same noise, whatever shares the batch.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    mixed ^= mixed >> 31
    generator = torch.Generator()
    generator.manual_seed(mixed)
    uniforms = torch.rand(probs.shape[-1], generator=generator, dtype=torch.float64).clamp_(1e-300, 1.0 - 2.0**-53)
    gumbel = -torch.log(-torch.log(uniforms))
    scores = torch.log(probs.to(torch.float64)) + gumbel  # log 0 = -inf: filtered tokens never win
    return int(torch.argmax(scores))
