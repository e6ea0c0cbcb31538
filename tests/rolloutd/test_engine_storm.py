"""The embedded engine under every control at once: generations, aborts, weight updates, pauses, flushes.

Each operation has its own test elsewhere; this one runs them side by side, from two controllers
so that weight updates overlap, for a fixed number of rounds. It checks what must hold whatever
the interleaving: the engine never dies, every generation is answered once everything is
continued, each answer is well formed (tokens, logprobs and weight-version spans agree, within
its budget) and the last update sent is the weights served. Two overlapping updates once left
transformers' load stubs in place and the engine died sampling from NaN logits
(docs/engines.md, "Embedded engine").
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from flexmarl.errors import FlexmarlError
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.protocol import GenerationRequest, GenerationResult, PauseMode, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient

ROUNDS = 40  # per controller
GENERATIONS = 160


def _check(result: GenerationResult, max_new_tokens: int) -> None:
    ids, logprobs, spans = result.output_ids, result.output_token_logprobs, result.weight_versions
    assert result.completion_tokens == len(ids) <= max_new_tokens
    assert len(logprobs) == len(ids) and all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
    if ids:  # the spans cover the output, in order, without a gap
        assert spans[0].start == 0 and spans[-1].end == len(ids)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("deterministic", [False, True])
async def test_the_engine_survives_every_control_at_once(
    engine_checkpoint: Path, engine_checkpoint_other: Path, deterministic: bool
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EmbeddedEngineConfig(model_path=str(engine_checkpoint), seed=0, max_batch_size=6,
                                  enable_deterministic_inference=deterministic)
    server = EmbeddedServer(EmbeddedEngine(config))
    url = f"http://127.0.0.1:{await server.start('127.0.0.1', 0)}"
    clients = [SGLangClient(url) for _ in range(3)]
    finishes: Counter[str] = Counter()
    refused: list[str] = []
    checkpoints = (engine_checkpoint, engine_checkpoint_other)
    last_update: list[tuple[str, str]] = []

    async def generate(rng: random.Random) -> None:
        budget = rng.randrange(0, 60)
        sampling = SamplingParams(max_new_tokens=budget, temperature=rng.choice([0.0, 0.7, 1.0]),
                                  top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(5), n=rng.choice([1, 1, 2]),
                                  ignore_eos=rng.random() < 0.5)
        for result in await clients[0].generate(GenerationRequest((104, 105, rng.randrange(200)), sampling)):
            _check(result, budget)
            finishes[str(result.finish_reason)] += 1

    async def update(client: SGLangClient, rng: random.Random, version: str, flush: bool) -> None:
        path = str(rng.choice(checkpoints))
        try:
            await client.update_weights_from_disk(path, weight_version=version, flush_cache=flush)
        except FlexmarlError as exc:  # SGLang's 400: updated, but the cache not flushed (requests running)
            assert "not flushed" in str(exc), exc
            refused.append(version)
        last_update.append((path, version))

    async def controller(index: int) -> None:
        client, rng = clients[1 + index], random.Random(100 + index)
        for round_ in range(ROUNDS):
            choice = rng.random()
            if choice < 0.25:
                await client.abort(abort_all=True)
            elif choice < 0.55:
                await update(client, rng, f"c{index}-r{round_}", rng.random() < 0.5)
            elif choice < 0.85 and index == 0:  # one controller pauses: continue is global
                await client.pause_generation(rng.choice(list(PauseMode)))
                if rng.random() < 0.5:
                    await update(client, rng, f"c{index}-r{round_}-paused", False)
                await client.continue_generation()
            else:
                await client.flush_cache()
            await asyncio.sleep(rng.random() * 0.1)

    async def generations() -> list[asyncio.Task[None]]:
        rng = random.Random(7)
        tasks = []
        for _ in range(GENERATIONS):
            tasks.append(asyncio.create_task(generate(random.Random(rng.random()))))
            await asyncio.sleep(rng.random() * 0.03)
        return tasks

    try:
        _, _, tasks = await asyncio.gather(controller(0), controller(1), generations())
        await clients[1].continue_generation()
        deadline = time.monotonic() + 180
        pending = set(tasks)
        while pending:  # every generation is answered, each one's errors raised here
            assert server.engine.fatal is None, server.engine.fatal
            assert time.monotonic() < deadline, f"{len(pending)} generations never answered"
            done, pending = await asyncio.wait(pending, timeout=1)
            for task in done:
                task.result()
        assert server.engine.fatal is None
        path, version = last_update[-1]
        assert server.engine.loaded.weight_version == version and server.engine.loaded.model_path == path
        four = SamplingParams(max_new_tokens=4, ignore_eos=True)
        [after] = await clients[0].generate(GenerationRequest((104, 105), four))
        assert after.weight_version == version and after.completion_tokens == 4
        assert finishes["abort"] and finishes["length"] and len(last_update) > len(refused)
    finally:
        for client in clients:
            await client.close()
        await server.stop()
        torch.set_num_threads(threads)
