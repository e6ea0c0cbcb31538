"""The embedded engine's forward passes: the running batch's KV cache, prefill, decode, reruns, rescoring.

The part of SGLang's model runner (sglang/srt/model_executor/model_runner.py ``forward``, with
the batch layout of sglang/srt/managers/schedule_batch.py) the embedded engine needs, over a
Hugging Face model and its ``DynamicCache`` on CPU: rows of different lengths decode together,
left-padded to one length with an attention mask, each row's next position tracked apart. Each
distinct prompt is prefilled once and its cache rows repeated for its samples (SGLang's radix
cache shares their prefix). Every pass runs under the rows' LoRA adapters
(:class:`rolloutd.engines.embedded.adapters.EngineAdapters`). The scheduler
(:mod:`rolloutd.engines.embedded.engine`) decides what runs; these functions only run it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rolloutd.engines.embedded.model import LoadedModel
from rolloutd.engines.embedded.work import Segment, SequenceState

#: ``rows(model, lora_ids)``: a context in which the model's forward passes add each row's adapter delta.
AdapterRows = Callable[[Any, Sequence[str | None]], contextlib.AbstractContextManager[None]]


def left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def cache_mergeable(cache: Any) -> bool:
    """Whether the cache is plain per-layer key/value tensors, which rows of other batches may join."""
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = list(getattr(cache, "layers", None) or [])
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


@dataclass
class Batch:
    """The running batch: one KV cache row, mask row and next-token logits per sequence.

    Rows are left-padded to a common length (mask 0 on the padding); the position of each row's
    next token is tracked separately, so rows of different lengths decode together.
    """

    loaded: LoadedModel
    cache: Any
    mask: torch.Tensor
    last_position: torch.Tensor
    logits: torch.Tensor
    rows: list[SequenceState]
    mergeable: bool

    def select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (in order) and drop padding columns no row needs any more."""
        kept = torch.tensor(keep)
        self.cache.batch_select_indices(kept)
        self.mask, self.last_position, self.logits = self.mask[kept], self.last_position[kept], self.logits[kept]
        self.rows = [self.rows[row] for row in keep]
        if not self.mergeable:
            return
        used = torch.nonzero(self.mask.sum(dim=0)).flatten()
        first = int(used[0]) if used.numel() else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]


def merge_batches(running: Batch, new: Batch) -> Batch:
    """``running`` with the rows of ``new`` (just prefilled, same model) appended, left-padded to one length."""
    width = max(running.mask.shape[1], new.mask.shape[1])
    for old_layer, new_layer in zip(running.cache.layers, new.cache.layers, strict=True):
        old_layer.keys = torch.cat([left_pad(old_layer.keys, width, 2), left_pad(new_layer.keys, width, 2)])
        old_layer.values = torch.cat([left_pad(old_layer.values, width, 2), left_pad(new_layer.values, width, 2)])
    running.mask = torch.cat([left_pad(running.mask, width, 1), left_pad(new.mask, width, 1)])
    running.last_position = torch.cat([running.last_position, new.last_position])
    running.logits = torch.cat([running.logits, new.logits])
    running.rows = running.rows + new.rows
    return running


def prefill(rows: list[SequenceState], loaded: LoadedModel, adapter_rows: AdapterRows) -> Batch:
    """A batch of the rows, their tokens (prompt, plus output for a retracted row) prefilled by ``loaded``.

    Each distinct token sequence (of one adapter) is prefilled once (the samples of an n > 1
    request arrive as rows of one prompt, like SGLang's radix cache sharing their prefix; the
    radix cache keys prefixes by adapter too), left-padded, then its cache rows are repeated
    for every row.
    """
    prompt_rows: dict[tuple[tuple[int, ...], str | None], int] = {}
    for seq in rows:
        prompt_rows.setdefault((tuple(seq.tokens()), seq.job.lora_id), len(prompt_rows))
    width = max(len(prompt) for prompt, _ in prompt_rows)
    pad_id = int(loaded.model.config.pad_token_id or 0)
    input_ids = torch.full((len(prompt_rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_rows), width), dtype=torch.long)
    for (prompt, _), row in prompt_rows.items():
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    from transformers import DynamicCache

    cache = DynamicCache(config=loaded.model.config)
    with adapter_rows(loaded.model, [adapter for _, adapter in prompt_rows]):
        out = loaded.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{loaded.cache_kwarg: cache},
        )
    logits = out.logits[:, -1, :].float()
    expand = torch.tensor([prompt_rows[(tuple(seq.tokens()), seq.job.lora_id)] for seq in rows])
    cache.batch_select_indices(expand)
    return Batch(
        loaded, cache, mask[expand], positions[expand, -1], logits[expand], rows, mergeable=cache_mergeable(cache)
    )


def decode(batch: Batch, next_ids: list[int], adapter_rows: AdapterRows) -> None:
    """Run every row's newly sampled token through the batch's model: its KV joins the cache, next logits result."""
    loaded = batch.loaded
    batch.mask = torch.cat([batch.mask, torch.ones((len(next_ids), 1), dtype=torch.long)], dim=1)
    batch.last_position = batch.last_position + 1
    with adapter_rows(loaded.model, [seq.job.lora_id for seq in batch.rows]):
        out = loaded.model(
            input_ids=torch.tensor(next_ids).unsqueeze(1),
            attention_mask=batch.mask,
            position_ids=batch.last_position.unsqueeze(1),
            use_cache=True,
            **{loaded.cache_kwarg: batch.cache},
        )
    batch.logits = out.logits[:, -1, :].float()


def rerun_last_tokens(batch: Batch, adapter_rows: AdapterRows) -> None:
    """Recompute every row's last-token KV and next-token logits with ``batch.loaded`` (a mergeable cache).

    SGLang's decode step runs a sequence's last sampled token through the model; here that
    token was already run (by the old weights), so its cache column is dropped and run again.
    """
    loaded = batch.loaded
    last_ids = torch.tensor([seq.tokens()[-1] for seq in batch.rows]).unsqueeze(1)
    for layer in batch.cache.layers:
        layer.keys = layer.keys[:, :, :-1, :]
        layer.values = layer.values[:, :, :-1, :]
    with adapter_rows(loaded.model, [seq.job.lora_id for seq in batch.rows]):
        out = loaded.model(
            input_ids=last_ids,
            attention_mask=batch.mask,
            position_ids=batch.last_position.unsqueeze(1),
            use_cache=True,
            **{loaded.cache_kwarg: batch.cache},
        )
    batch.logits = out.logits[:, -1, :].float()


def rescore_logits(seq: SequenceState, served: LoadedModel, adapter_rows: AdapterRows) -> torch.Tensor:
    """The logits that predicted each of ``seq.output_ids``, from unpadded forward passes of the sequence alone.

    One pass of the weights that produced them, when one set did (``served`` when the sequence
    recorded no :class:`Segment`); after a weight change, one pass per segment, each over the KV
    cache the sequence then had (an in-place change keeps the old weights' cache of the prefix;
    a re-prefill recomputes it whole), so each token's logits are those of the weights and cache
    that sampled it.
    """
    job, output_ids = seq.job, seq.output_ids
    prompt_length, count = len(job.input_ids), len(output_ids)
    tokens = seq.tokens()
    segments = seq.segments or [Segment(served, 0, fresh=True)]
    pieces: list[torch.Tensor] = []
    adapter = [job.lora_id]
    with torch.inference_mode():
        if len(segments) == 1:
            model = segments[0].loaded.model
            with adapter_rows(model, adapter):
                logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
            pieces.append(logits[prompt_length - 1 : prompt_length - 1 + count])
        else:
            from transformers import DynamicCache

            cache: Any = None
            for index, segment in enumerate(segments):
                end = segments[index + 1].start if index + 1 < len(segments) else count
                first = prompt_length - 1 + segment.start  # the fed token whose logits give token `start`
                if segment.fresh:
                    cache = DynamicCache(config=segment.loaded.model.config)
                    feed_from = 0
                elif end <= segment.start:
                    continue
                else:
                    feed_from = first
                feed = tokens[feed_from : prompt_length - 1 + end]
                if not feed:
                    continue
                with adapter_rows(segment.loaded.model, adapter):
                    out = segment.loaded.model(
                        input_ids=torch.tensor([feed]),
                        position_ids=torch.arange(feed_from, feed_from + len(feed)).unsqueeze(0),
                        use_cache=True,
                        **{segment.loaded.cache_kwarg: cache},
                    )
                pieces.append(out.logits[0, first - feed_from :].float())
    return torch.cat(pieces)
