"""Pause, continue, partial aborts and per-token weight versions on the embedded engine (in-process).

What SGLang 0.5.23 does (sglang/srt/managers/tokenizer_manager.py ``pause_generation``,
scheduler.py ``pause_generation``/``continue_generation``/``abort_request``,
sglang/srt/utils/weight_versions.py), checked with deterministic inference and a fixed seed, so
a sequence interrupted by a weight update can be compared token for token with uninterrupted
runs: its tokens before the update are the old weights' run, and (retract) its tokens after it
are the new weights' run from the prompt plus those tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from flexmarl.errors import FailedPrecondition
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.embedded.interface import VersionChange
from rolloutd.engines.embedded.outputs import FORCE_STREAM_INTERVAL, weight_version_spans
from rolloutd.engines.embedded.sampling import gumbel_max_token
from rolloutd.engines.protocol import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    SamplingParams,
    WeightVersionSpan,
)
from rolloutd.engines.sglang.client import SGLangClient

PROMPT = (104, 101, 108, 108, 111)
TOKENS = 200  # long enough for a pause to land inside it
LOGPROB_TOLERANCE = 1e-4


def _request(prompt: tuple[int, ...] = PROMPT, tokens: int = TOKENS, rid: str | None = None) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_new_tokens=tokens, seed=7, ignore_eos=True), rid=rid)


@contextlib.asynccontextmanager
async def _served(checkpoint: Path) -> AsyncIterator[tuple[EmbeddedServer, SGLangClient]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EmbeddedEngineConfig(model_path=str(checkpoint), seed=0, enable_deterministic_inference=True)
    server = EmbeddedServer(EmbeddedEngine(config))
    port = await server.start("127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()
        torch.set_num_threads(threads)


@pytest.fixture
async def served(engine_checkpoint: Path) -> AsyncIterator[tuple[EmbeddedServer, SGLangClient]]:
    async with _served(engine_checkpoint) as pair:
        yield pair


async def _wait_tokens(server: EmbeddedServer, at_least: int) -> None:
    deadline = time.monotonic() + 30
    while server.engine.generated_tokens < at_least:
        assert time.monotonic() < deadline, "generation never started"
        await asyncio.sleep(0.002)


async def _tokens_so_far(client: SGLangClient, running: bool) -> int:
    """Output tokens of the one paused sequence: its KV tokens (running) or queued tokens, less the prompt."""
    load = await client.loads()
    assert (load.num_running_reqs, load.num_waiting_reqs) == ((1, 0) if running else (0, 1))
    return (load.num_used_tokens if running else load.num_total_tokens) - len(PROMPT)


def _close(actual: tuple[float, ...], expected: tuple[float, ...]) -> bool:
    if len(actual) != len(expected):
        return False
    return all(abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(actual, expected, strict=True))


def _assert_spans(result: GenerationResult, spans: list[tuple[str, int, int]]) -> None:
    assert result.weight_versions == tuple(WeightVersionSpan(*span) for span in spans)
    assert result.weight_version == spans[-1][0]


async def test_retract_then_update_continues_from_the_tokens_so_far(
    served: tuple[EmbeddedServer, SGLangClient], engine_checkpoint_other: Path
) -> None:
    server, client = served
    [old] = await client.generate(_request())
    interrupted = asyncio.create_task(client.generate(_request()))
    await _wait_tokens(server, TOKENS + 2)
    await client.pause_generation(PauseMode.RETRACT)
    k = await _tokens_so_far(client, running=False)  # back in the waiting queue, its KV cache freed
    assert await client.flush_cache()  # is_fully_idle(ignore_waiting=True) while paused
    update = await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v1")
    assert update.success
    await client.continue_generation()
    [result] = await asyncio.wait_for(interrupted, 60)
    assert 0 < k < TOKENS, "the pause did not land inside the sequence"
    _assert_spans(result, [("default", 0, k), ("v1", k, TOKENS)])
    assert result.finish_reason is FinishReason.LENGTH and len(result.output_ids) == TOKENS
    # Before the update: the old weights' uninterrupted run.
    assert result.output_ids[:k] == old.output_ids[:k]
    assert _close(result.output_token_logprobs[:k], old.output_token_logprobs[:k])
    # After it: the new weights' run from the prompt plus those tokens (re-prefilled on resume).
    [new] = await client.generate(_request(PROMPT + result.output_ids[:k], TOKENS - k))
    assert result.output_ids[k:] == new.output_ids
    assert _close(result.output_token_logprobs[k:], new.output_token_logprobs)
    assert result.version_of_token(k - 1) == "default" and result.version_of_token(k) == "v1"


async def test_in_place_update_keeps_the_old_kv_cache_and_needs_flush_cache_false(
    served: tuple[EmbeddedServer, SGLangClient], engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    server, client = served
    [old] = await client.generate(_request())
    interrupted = asyncio.create_task(client.generate(_request()))
    await _wait_tokens(server, TOKENS + 2)
    await client.pause_generation(PauseMode.IN_PLACE)
    k = await _tokens_so_far(client, running=True)
    assert not await client.flush_cache()  # in place: the request still runs
    # weight_updater.py: the weights change, then the flush is refused, so SGLang answers 400...
    with pytest.raises(FailedPrecondition, match="the cache was not flushed"):
        await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v1")
    # ...and /model_info keeps the last successful update's version, though tokens now get v1.
    assert (await client.model_info()).weight_version == "default"
    await client.continue_generation()
    [result] = await asyncio.wait_for(interrupted, 60)
    assert 0 < k < TOKENS, "the pause did not land inside the sequence"
    _assert_spans(result, [("default", 0, k), ("v1", k, TOKENS)])
    assert result.output_ids[:k] == old.output_ids[:k]
    assert _close(result.output_token_logprobs[:k], old.output_token_logprobs[:k])
    # After the update: the new weights over the old weights' KV of the prefix; the last token
    # before the pause is run again by the new weights (SGLang's next decode step runs it).
    old_model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32).eval()
    new_model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint_other), dtype=torch.float32).eval()
    cache_kwarg = "cache" if "cache" in inspect.signature(old_model.forward).parameters else "past_key_values"
    tokens = list(PROMPT + result.output_ids)
    cut = len(PROMPT) - 1 + k
    with torch.no_grad():
        cache = DynamicCache(config=old_model.config)
        old_model(input_ids=torch.tensor([tokens[:cut]]), use_cache=True, **{cache_kwarg: cache})
        logits = new_model(
            input_ids=torch.tensor([tokens[cut : len(tokens) - 1]]),
            position_ids=torch.arange(cut, len(tokens) - 1).unsqueeze(0),
            use_cache=True,
            **{cache_kwarg: cache},
        ).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    expected = logprobs.gather(1, torch.tensor(result.output_ids[k:]).unsqueeze(1)).squeeze(1)
    assert _close(result.output_token_logprobs[k:], tuple(float(v) for v in expected))
    # The tokens were sampled from that distribution too (deterministic sampling: seed 7, position).
    sampled = [gumbel_max_token(row.exp(), 7, len(PROMPT) + k + i) for i, row in enumerate(logprobs)]
    assert tuple(sampled) == result.output_ids[k:]


async def test_abort_pause_answers_partial_outputs_and_holds_new_requests(
    served: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = served
    [full] = await client.generate(_request())
    running = asyncio.create_task(client.generate(_request()))
    await _wait_tokens(server, TOKENS + 2)
    await client.pause_generation(PauseMode.ABORT)  # returns once nothing is in flight
    [partial] = await asyncio.wait_for(running, 5)
    count = len(partial.output_ids)
    assert partial.finish_reason is FinishReason.ABORT and 0 < count < TOKENS
    assert partial.completion_tokens == count == len(partial.output_token_logprobs)
    assert partial.output_ids == full.output_ids[:count]
    assert _close(partial.output_token_logprobs, full.output_token_logprobs[:count])
    _assert_spans(partial, [("default", 0, count)])
    # A new request waits at the pause gate: its rid is registered, the scheduler never sees it.
    held = asyncio.create_task(client.generate(_request(tokens=3, rid="held")))
    deadline = time.monotonic() + 10
    while "held" not in server._inflight:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.002)
    load = await client.loads()
    assert (load.num_running_reqs, load.num_waiting_reqs) == (0, 0) and not held.done()
    await client.continue_generation()
    [after] = await asyncio.wait_for(held, 30)
    assert after.finish_reason is FinishReason.LENGTH and len(after.output_ids) == 3


async def test_an_abort_during_an_in_place_pause_answers_after_continue(
    served: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = served
    running = asyncio.create_task(client.generate(_request(rid="r1")))
    await _wait_tokens(server, 2)
    await client.pause_generation(PauseMode.IN_PLACE)
    k = await _tokens_so_far(client, running=True)
    await client.abort("r1")
    assert (await client.loads()).num_running_reqs == 1 and not running.done()  # paused: no decode step
    await client.continue_generation()
    [result] = await asyncio.wait_for(running, 30)
    # scheduler.py: a running request aborted runs one more decode step, then finishes with FINISH_ABORT.
    assert result.finish_reason is FinishReason.ABORT and len(result.output_ids) == k + 1
    assert len(result.output_token_logprobs) == k + 1


async def test_a_retracted_request_aborted_in_the_queue_answers_what_the_tokenizer_had(
    served: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = served
    running = asyncio.create_task(client.generate(_request(tokens=600)))
    await _wait_tokens(server, FORCE_STREAM_INTERVAL + 10)
    await client.pause_generation(PauseMode.RETRACT)
    k = await _tokens_so_far(client, running=False)
    await client.abort(abort_all=True)
    [result] = await asyncio.wait_for(running, 10)  # answered while still paused
    shown = k - k % FORCE_STREAM_INTERVAL  # output_streamer.py sends a non-streaming request's tokens every 50
    assert k >= FORCE_STREAM_INTERVAL and shown > 0
    assert result.finish_reason is FinishReason.ABORT
    assert len(result.output_ids) == len(result.output_token_logprobs) == result.completion_tokens == shown
    _assert_spans(result, [("default", 0, shown)])
    await client.continue_generation()
    assert (await client.loads()).num_waiting_reqs == 0


def test_weight_version_spans_are_sglangs() -> None:
    # weight_versions.py compute_weight_version_spans, on the cases a pause produces.
    assert weight_version_spans([], "v0", 5) == [{"version": "v0", "start": 0, "end": 5}]
    assert weight_version_spans([], "v0", 0) == [{"version": "v0", "start": 0, "end": 0}]
    twice = [VersionChange("v0", 3), VersionChange("v1", 7)]
    assert weight_version_spans(twice, "v2", 9) == [
        {"version": "v0", "start": 0, "end": 3},
        {"version": "v1", "start": 3, "end": 7},
        {"version": "v2", "start": 7, "end": 9},
    ]
    # A change with no token since the previous one leaves no span; a rename back merges.
    assert weight_version_spans([VersionChange("v0", 4)], "v1", 4) == [{"version": "v0", "start": 0, "end": 4}]
    assert weight_version_spans([VersionChange("v0", 2), VersionChange("v1", 2)], "v0", 6) == [
        {"version": "v0", "start": 0, "end": 6}
    ]
