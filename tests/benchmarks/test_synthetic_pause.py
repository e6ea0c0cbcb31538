"""The synthetic engine's pause, continue, rename and abort follow embedded/engine.py's (in process, no HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from benchmarks.synthetic_engine import SyntheticBackend
from benchmarks.synthetic_replica import SyntheticEngineConfig, SyntheticReplica
from flexmarl import devicemodel
from rolloutd.engines.embedded.interface import SampleRequest
from rolloutd.engines.protocol import SamplingParams

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)
# One modelled H100 decode iteration of one sequence is ~12.5 ms; at this time scale it lasts ~1 wall ms.
PROFILE = devicemodel.H100_SXM.with_changes(token_scale=1.0, time_scale=0.08)


@pytest.fixture
async def backend() -> AsyncIterator[SyntheticBackend]:
    replica = SyntheticReplica(0, SyntheticEngineConfig(seed=5), PROFILE)
    engine = SyntheticBackend(replica)
    await engine.start(0)
    try:
        yield engine
    finally:
        await engine.stop()


def _submit(backend: SyntheticBackend, rid: str, tokens: int) -> asyncio.Future[dict[str, Any]]:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    return backend.submit(SampleRequest(rid, PROMPT, params, return_logprob=True))


async def _running(backend: SyntheticBackend, count: int) -> None:
    async with asyncio.timeout(10):
        while backend.load_snapshot().num_running_reqs < count:
            await asyncio.sleep(0.005)


def _generated(backend: SyntheticBackend) -> int:
    """Output tokens of the one running sequence (its KV tokens less the prompt)."""
    return backend.load_snapshot().num_used_tokens - len(PROMPT)


async def test_a_continue_sent_right_behind_a_pause_leaves_the_engine_running(backend: SyntheticBackend) -> None:
    out = _submit(backend, "a", 200)
    await _running(backend, 1)
    pause = asyncio.create_task(backend.pause("in_place"))
    resume = asyncio.create_task(backend.resume())  # before the pause reached an iteration boundary
    await asyncio.wait_for(asyncio.gather(pause, resume), 10)
    meta = (await asyncio.wait_for(out, 10))["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 200


async def test_a_rename_splits_the_spans_where_the_batch_stands(backend: SyntheticBackend) -> None:
    out = _submit(backend, "r", 2000)  # ~2 wall s
    await _running(backend, 1)
    await asyncio.sleep(0.3)
    await asyncio.wait_for(backend.set_weight_version("v2"), 10)
    meta = (await asyncio.wait_for(out, 30))["meta_info"]
    spans = meta["weight_versions"]
    assert [span["version"] for span in spans] == ["default", "v2"]
    assert 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 2000


async def test_an_abort_while_paused_in_place_answers_after_one_more_step_at_continue(
    backend: SyntheticBackend,
) -> None:
    out = _submit(backend, "x", 2000)
    await _running(backend, 1)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(backend.pause("in_place"), 10)
    generated = _generated(backend)
    backend.abort("x", abort_all=False)
    await asyncio.sleep(0.05)
    assert not out.done()  # a running sequence answers only once it runs again
    await asyncio.wait_for(backend.resume(), 10)
    meta = (await asyncio.wait_for(out, 10))["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] == generated + 1 == len(meta["output_token_logprobs"])


async def test_a_retracted_sequence_re_prefills_and_keeps_its_budget(backend: SyntheticBackend) -> None:
    tokens = 400
    out = _submit(backend, "t", tokens)
    await _running(backend, 1)
    await asyncio.sleep(0.1)
    await asyncio.wait_for(backend.pause("retract"), 10)
    load = backend.load_snapshot()
    generated = load.num_waiting_tokens - len(PROMPT)
    assert (load.num_running_reqs, load.num_waiting_reqs) == (0, 1) and 0 < generated < tokens
    await asyncio.wait_for(backend.resume(), 10)
    meta = (await asyncio.wait_for(out, 10))["meta_info"]
    assert meta["completion_tokens"] == tokens and meta["finish_reason"]["type"] == "length"
    # Modelled time: the prompt's prefill, the re-prefill of prompt plus output, one iteration per token.
    decode_s = sum(devicemodel.real_decode_iteration_s(PROFILE, 1, float(len(PROMPT) + k)) for k in range(tokens))
    prefill_s = devicemodel.prefill_s(PROFILE, len(PROMPT)) + devicemodel.prefill_s(PROFILE, len(PROMPT) + generated)
    assert backend.replica.modelled_busy_s == pytest.approx(decode_s + prefill_s, rel=1e-9)
