"""Contract of the SGLang client against a real embedded engine subprocess.

Every response field the client reads is checked here, on the wire and parsed. The same tests
would run against a GPU SGLang server by pointing a client at it (docs/engines.md).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from flexmarl.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch
from rolloutd.engines.protocol import FinishReason, GenerationRequest, SamplingParams
from rolloutd.engines.sglang_client import SGLangClient

PROMPT = (104, 101, 108, 108, 111)  # "hello"
# Logprobs served by a batched, KV-cached decode vs one full forward pass of the same fp32 model.
LOGPROB_TOLERANCE = 1e-4


async def _post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def _forward_logprobs(model: Any, prompt: tuple[int, ...], output: tuple[int, ...], temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    scaled = logits[positions] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


async def test_wire_format_of_generate(engine_replica: EngineReplica) -> None:
    body: dict[str, Any] = {
        "input_ids": list(PROMPT),
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 3},
        "return_logprob": True,
        "rid": "wire-1",
    }
    one = await _post(engine_replica.url, "/generate", body)
    assert isinstance(one, dict) and set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["id"] == "wire-1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 4
    assert isinstance(meta["cached_tokens"], int) and isinstance(meta["weight_version"], str)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == one["output_ids"] and all(len(t) == 3 and t[0] < 0 for t in triples)

    body["sampling_params"] = {**body["sampling_params"], "n": 3}
    many = await _post(engine_replica.url, "/generate", body)
    assert isinstance(many, list) and len(many) == 3  # n > 1 answers a list, one object per sample
    assert all(len(sample["output_ids"]) == 4 for sample in many)


async def test_generate_parses_every_field(engine_replica: EngineReplica, engine_checkpoint: Path) -> None:
    async with SGLangClient(engine_replica.url) as client:
        info = await client.model_info()
        [result] = await client.generate(
            GenerationRequest(PROMPT, SamplingParams(max_new_tokens=6, seed=1), rid="parse-1")
        )
    assert result.rid == "parse-1"
    assert len(result.output_ids) == len(result.output_token_logprobs) == result.completion_tokens == 6
    assert result.finish_reason is FinishReason.LENGTH and result.matched_stop is None
    assert result.prompt_tokens == len(PROMPT)
    assert result.weight_version == info.weight_version
    assert result.model_path == str(engine_checkpoint) == info.model_path
    assert isinstance(result.text, str) and result.e2e_latency_s > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_equal_a_forward_pass(
    engine_replica: EngineReplica, engine_reference_model: Any, temperature: float
) -> None:
    # SGLang's default: logprobs of the temperature-scaled distribution (raw when greedy).
    async with SGLangClient(engine_replica.url) as client:
        [result] = await client.generate(
            GenerationRequest(PROMPT, SamplingParams(temperature=temperature, max_new_tokens=8, seed=5))
        )
    expected = _forward_logprobs(engine_reference_model, PROMPT, result.output_ids, temperature)
    served = torch.tensor(result.output_token_logprobs)
    assert float((served - expected).abs().max()) < LOGPROB_TOLERANCE


async def test_greedy_is_argmax_and_repeatable(engine_replica: EngineReplica, engine_reference_model: Any) -> None:
    request = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=5))
    async with SGLangClient(engine_replica.url) as client:
        first, second = await client.generate(request), await client.generate(request)
    assert first[0].output_ids == second[0].output_ids
    reference = engine_reference_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False, eos_token_id=None
    )
    assert tuple(reference[0, len(PROMPT) :].tolist()) == first[0].output_ids


async def test_n_samples_and_seeds(engine_replica: EngineReplica) -> None:
    async with SGLangClient(engine_replica.url) as client:
        samples = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, n=4, seed=11)))
        again = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, n=4, seed=11)))
        other = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, n=4, seed=12)))
    assert len(samples) == 4
    assert len({s.output_ids for s in samples}) == 4  # the samples differ from one another
    assert [s.output_ids for s in samples] == [s.output_ids for s in again]  # same seed, same samples
    assert [s.output_ids for s in samples] != [s.output_ids for s in other]
    assert all(s.prompt_tokens == len(PROMPT) for s in samples)


async def test_stop_token_ids_end_the_sample(engine_replica: EngineReplica) -> None:
    every_token = tuple(range(320))
    async with SGLangClient(engine_replica.url) as client:
        [result] = await client.generate(
            GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, stop_token_ids=every_token, seed=2))
        )
        [greedy] = await client.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=3)))
        stop_at = greedy.output_ids[1]
        [stopped] = await client.generate(
            GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=3, stop_token_ids=(stop_at,)))
        )
    assert result.finish_reason is FinishReason.STOP and len(result.output_ids) == 1
    assert result.matched_stop == result.output_ids[-1]
    expected_len = greedy.output_ids.index(stop_at) + 1
    assert stopped.finish_reason is FinishReason.STOP and stopped.output_ids == greedy.output_ids[:expected_len]


async def test_abort_running_request(engine_replica: EngineReplica) -> None:
    async with SGLangClient(engine_replica.url) as client:
        task = asyncio.create_task(
            client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2000), rid="to-abort"))
        )
        deadline = time.monotonic() + 20
        while (await client.loads()).num_running_reqs == 0:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        await client.abort("to-abort")
        [result] = await asyncio.wait_for(task, timeout=20)
    assert result.finish_reason is FinishReason.ABORT
    assert result.completion_tokens < 2000 and len(result.output_token_logprobs) == result.completion_tokens


async def test_health_info_loads_flush(engine_replica: EngineReplica, engine_checkpoint: Path) -> None:
    async with SGLangClient(engine_replica.url) as client:
        assert await client.health() and await client.health_generate()
        info = await client.model_info()
        assert info.model_path == str(engine_checkpoint) and info.is_generation
        server = await client.server_info()
        assert server["model_path"] == str(engine_checkpoint) and "version" in server
        load = await client.loads()
        assert load.num_waiting_reqs >= 0 and load.num_total_tokens >= load.num_used_tokens
        assert await client.flush_cache()


async def test_bad_requests_raise_invalid_argument(engine_replica: EngineReplica) -> None:
    async with SGLangClient(engine_replica.url) as client:
        with pytest.raises(InvalidArgument):
            await client.generate(GenerationRequest((100_000,), SamplingParams(max_new_tokens=1)))  # server 400
        with pytest.raises(InvalidArgument):
            await client.generate(GenerationRequest(PROMPT, SamplingParams(top_p=0.0)))  # client-side check
        with pytest.raises(InvalidArgument):
            await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=10_000)))  # > context


async def test_weight_reload_changes_outputs_and_version(
    engine_replica: EngineReplica, engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    greedy = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6))
    async with SGLangClient(engine_replica.url) as client:
        [before] = await client.generate(greedy)
        update = await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v1")
        assert update.success
        [after] = await client.generate(greedy)
        assert (await client.model_info()).weight_version == "v1"
        with pytest.raises(FailedPrecondition):
            await client.update_weights_from_disk(str(engine_checkpoint_other / "missing"), weight_version="v9")
        assert (await client.model_info()).weight_version == "v1"  # a failed load changes nothing
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="v2", load_format="safetensors")
        [restored] = await client.generate(greedy)
    assert after.weight_version == "v1" and after.model_path == str(engine_checkpoint_other)
    assert after.output_token_logprobs != before.output_token_logprobs
    assert restored.weight_version == "v2" and restored.output_ids == before.output_ids


async def test_killed_replica_raises_unavailable(engine_checkpoint: Path, tmp_path: Path) -> None:
    replica = await launch(ReplicaSpec("embedded", str(engine_checkpoint)), tmp_path, timeout_s=120)
    try:
        async with SGLangClient(replica.url, retries=2, retry_backoff_s=0.05) as client:
            assert await client.health()
            replica.kill()
            with pytest.raises(Unavailable):
                await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2)))
            with pytest.raises(Unavailable):
                await client.health()
    finally:
        replica.stop()
