"""The embedded engine in-process: batching, sampling options, weight swaps, abort, launcher."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from flexmarl.errors import Unavailable
from rolloutd.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedServer
from rolloutd.engines.launcher import ReplicaSpec, attach, launch, sglang_command
from rolloutd.engines.protocol import FinishReason, GenerationRequest, SamplingParams
from rolloutd.engines.sglang_client import SGLangClient

PROMPT = (104, 105)


@pytest.fixture
async def engine_server(engine_checkpoint: Path) -> AsyncIterator[tuple[EmbeddedServer, SGLangClient]]:
    # One intra-op thread, as the engine subprocess uses: on a shared 2-core machine two torch
    # threads per tiny matmul are ~30x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=str(engine_checkpoint), batch_window_s=0.05, seed=0))
    server = EmbeddedServer(engine)
    port = await server.start("127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()
        torch.set_num_threads(threads)


async def _wait_running(client: SGLangClient, count: int = 1) -> None:
    deadline = time.monotonic() + 20
    while (await client.loads()).num_running_reqs < count:
        assert time.monotonic() < deadline, "request never started"
        await asyncio.sleep(0.01)


async def test_concurrent_requests_share_a_batch_and_match_solo_runs(
    engine_server: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = engine_server
    prompts = [tuple(range(1, 2 + i * 3)) for i in range(5)]  # lengths differ: left padding matters
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=6, seed=i)) for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(client.generate(r) for r in requests))
    assert server.engine.max_batch_sequences == 5 and server.engine.batches_run == 1
    for request, [batched] in zip(requests, together, strict=True):
        [solo] = await client.generate(request)
        assert solo.output_ids == batched.output_ids
        assert (
            max(abs(a - b) for a, b in zip(solo.output_token_logprobs, batched.output_token_logprobs, strict=True))
            < 1e-4
        )


async def test_top_k_one_and_tiny_top_p_are_greedy(engine_server: tuple[EmbeddedServer, SGLangClient]) -> None:
    _, client = engine_server
    [greedy] = await client.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6)))
    [top_k] = await client.generate(GenerationRequest(PROMPT, SamplingParams(top_k=1, max_new_tokens=6, seed=1)))
    [top_p] = await client.generate(GenerationRequest(PROMPT, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=2)))
    assert greedy.output_ids == top_k.output_ids == top_p.output_ids
    [no_lp] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=3), return_logprob=False))
    assert no_lp.output_token_logprobs == () and len(no_lp.output_ids) == 3


async def test_zero_new_tokens_and_eos(engine_server: tuple[EmbeddedServer, SGLangClient]) -> None:
    server, client = engine_server
    [empty] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=0)))
    assert empty.output_ids == () and empty.finish_reason is FinishReason.LENGTH
    # Make every token an EOS: the first sample token ends the sequence unless ignore_eos.
    loaded = server.engine.loaded
    server.engine._loaded = type(loaded)(**{**loaded.__dict__, "eos_token_ids": frozenset(range(320))})
    [stopped] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, seed=1)))
    [ignored] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert stopped.finish_reason is FinishReason.STOP and len(stopped.output_ids) == 1
    assert ignored.finish_reason is FinishReason.LENGTH and len(ignored.output_ids) == 4


async def test_weight_swap_waits_for_the_running_batch(
    engine_server: tuple[EmbeddedServer, SGLangClient], engine_checkpoint_other: Path
) -> None:
    server, client = engine_server
    long_request = asyncio.create_task(
        client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=300, seed=1)))
    )
    await _wait_running(client)
    await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v7")
    [old] = await long_request
    [new] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2)))
    # Every token of the running request came from the old weights; the next from the new ones.
    assert old.weight_version == "default" and old.completion_tokens == 300
    assert new.weight_version == "v7" and new.model_path == str(engine_checkpoint_other)


async def test_abort_all_and_queued(engine_server: tuple[EmbeddedServer, SGLangClient]) -> None:
    server, client = engine_server
    running = asyncio.create_task(client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=1500))))
    await _wait_running(client)
    queued = asyncio.create_task(
        client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=1500, n=2), rid="queued"))
    )
    deadline = time.monotonic() + 20
    while (await client.loads()).num_waiting_reqs < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await client.abort(abort_all=True)
    [first] = await asyncio.wait_for(running, 20)
    second = await asyncio.wait_for(queued, 20)
    assert first.finish_reason is FinishReason.ABORT and first.completion_tokens < 1500
    assert [s.finish_reason for s in second] == [FinishReason.ABORT] * 2
    assert all(s.completion_tokens == 0 for s in second)
    assert await client.health_generate()  # still serving after aborts


def test_sglang_command_uses_server_args_flags() -> None:
    spec = ReplicaSpec(
        "sglang",
        "/ckpt",
        host="0.0.0.0",
        tp_size=2,
        mem_fraction_static=0.8,
        seed=3,
        weight_version="5",
        extra_args=("--skip-tokenizer-init",),
    )
    command = sglang_command(spec, 30000)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--model-path"] == "/ckpt" and flags["--port"] == "30000" and flags["--host"] == "0.0.0.0"
    assert flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.8"
    assert flags["--random-seed"] == "3" and flags["--weight-version"] == "5"
    assert command[-1] == "--skip-tokenizer-init"


async def test_attach_and_launch_failures(tmp_path: Path) -> None:
    replica = attach("http://127.0.0.1:9/")
    assert replica.url == "http://127.0.0.1:9" and replica.pid is None and replica.stop() is None
    with pytest.raises(Unavailable):
        await replica.wait_healthy(timeout_s=0.3)
    with pytest.raises(Unavailable, match="exited"):
        await launch(ReplicaSpec("embedded", str(tmp_path / "no-such-checkpoint")), tmp_path, timeout_s=60)
