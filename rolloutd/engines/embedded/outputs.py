"""The ``/generate`` answer objects every SGLang-protocol backend builds, as SGLang 0.5.23 shapes them.

A finished (or running-aborted) sample's object follows sglang/srt/managers/tokenizer_manager.py
(``_handle_batch_output``: ``text``, ``output_ids``, ``meta_info`` with ``finish_reason``
from sglang/srt/managers/schedule_batch.py and ``output_token_logprobs`` triples); a sample
aborted in the waiting queue follows ``_handle_abort_req``; ``meta_info.weight_versions`` the
spans of sglang/srt/utils/weight_versions.py (``compute_weight_version_spans``,
``add_weight_versions_to_meta_info``). What a non-streaming request's tokenizer manager holds of a
running request is what output_streamer.py has sent it (:func:`received_tokens`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutd.engines.embedded.interface import SampleRequest, VersionChange

#: output_streamer.py: a non-streaming request's tokens reach the tokenizer manager every
#: SGLANG_FORCE_STREAM_INTERVAL (50) tokens and when it finishes.
FORCE_STREAM_INTERVAL = 50
FLUSH_AFTER_UPDATE_FAILED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)



def weight_version_spans(
    changes: Sequence[VersionChange], current_version: str, output_tokens: int
) -> list[dict[str, Any]]:
    """The ``{"version", "start", "end"}`` spans of a request's tokens (``compute_weight_version_spans``)."""
    spans: list[dict[str, Any]] = []
    for version, end in [*((c.old_version, c.output_tokens) for c in changes), (current_version, output_tokens)]:
        end = min(end, output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def _add_weight_versions(meta_info: dict[str, Any], spans: list[dict[str, Any]], visible_tokens: int) -> None:
    """``add_weight_versions_to_meta_info``: the spans of the tokens the answer carries, and the last version."""
    visible = [span for span in spans if span["start"] < visible_tokens or span["start"] == 0]
    meta_info["weight_versions"] = [{**span, "end": min(span["end"], visible_tokens)} for span in visible]
    meta_info["weight_version"] = visible[-1]["version"]



def first_sample(job: asyncio.Future[list[dict[str, Any]]]) -> asyncio.Future[dict[str, Any]]:
    """A future of the one output of a one-sample job's future (cancellation and errors carried over)."""
    sample: asyncio.Future[dict[str, Any]] = job.get_loop().create_future()

    def relay(done: asyncio.Future[list[dict[str, Any]]]) -> None:
        if sample.done():
            return
        if done.cancelled():
            sample.cancel()
        elif (exc := done.exception()) is not None:
            sample.set_exception(exc)
        else:
            sample.set_result(done.result()[0])

    job.add_done_callback(relay)
    return sample


def running_abort_reason() -> dict[str, Any]:
    """``finish_reason`` of a sample aborted while running (schedule_batch.py ``FINISH_ABORT()``)."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def sample_output(
    request: SampleRequest,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    reason: Mapping[str, Any],
    *,
    text: str,
    weight_version: str,
    model_path: str,
    version_changes: Sequence[VersionChange] = (),
    top_logprobs: Sequence[Sequence[tuple[float, int]]] = (),
) -> dict[str, Any]:
    """The ``/generate`` object of a finished (or running-aborted) sample.

    ``weight_version`` is the version served now; ``version_changes`` the changes recorded
    while the sample ran; ``meta_info`` carries their spans. ``model_path`` in ``meta_info`` is
    a FlexMARL extension: the checkpoint serving when it finished.
    """
    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": dict(reason),
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "model_path": model_path,
        "e2e_latency": time.monotonic() - request.created_s,
    }
    spans = weight_version_spans(version_changes, weight_version, len(output_ids))
    _add_weight_versions(meta_info, spans, len(output_ids))
    if request.return_logprob:
        # SGLang's shape: one [logprob, token_id, text-or-null] triple per output token.
        meta_info["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, output_ids, strict=True)]
        if request.top_logprobs_num:  # tokenizer_manager.py detokenize_top_logprobs_tokens: per token, k triples
            meta_info["output_top_logprobs"] = [[[lp, tid, None] for lp, tid in top] for top in top_logprobs]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info}


def received_tokens(generated: int) -> int:
    """How many of a running non-streaming request's tokens the tokenizer manager has (output_streamer.py)."""
    return generated - generated % FORCE_STREAM_INTERVAL


def queued_abort_output(
    request: SampleRequest,
    weight_version: str,
    *,
    output_ids: Sequence[int] = (),
    logprobs: Sequence[float] = (),
    text: str = "",
    version_changes: Sequence[VersionChange] = (),
    top_logprobs: Sequence[Sequence[tuple[float, int]]] = (),
) -> dict[str, Any]:
    """The object of a sample aborted in the waiting queue (tokenizer_manager.py ``_handle_abort_req``).

    SGLang answers it with fewer ``meta_info`` fields than a finished sample: no
    ``prompt_tokens`` and no ``cached_tokens``. A sample retracted there by a pause has
    ``output_ids``; the answer carries the :func:`received_tokens` of them (the tokenizer
    manager's copy), the spans clipped to those.
    """
    shown = received_tokens(len(output_ids))
    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": weight_version,
        "e2e_latency": time.monotonic() - request.created_s,
    }
    _add_weight_versions(meta_info, weight_version_spans(version_changes, weight_version, len(output_ids)), shown)
    if request.return_logprob:
        meta_info["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(logprobs[:shown], output_ids[:shown], strict=True)
        ]
        if request.top_logprobs_num:
            meta_info["output_top_logprobs"] = [[[lp, tid, None] for lp, tid in top] for top in top_logprobs[:shown]]
    meta_info["completion_tokens"] = shown
    return {"text": text, "output_ids": list(output_ids[:shown]), "meta_info": meta_info}
