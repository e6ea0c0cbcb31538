"""SGLangClient against a fake SGLang 0.5.23 (tests/rolloutd/sglang_fake.py): transport and error bodies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from sglang_fake import FakeSGLang

from flexmarl.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolloutd.engines.http_client import EngineBusy, GenerationSlots
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient, sglang_error_message

PROMPT = (5, 6, 7)
# aiohttp's default connector: 100 connections per session, the old client's only bound.
OLD_POOL_CONNECTIONS = 100


@pytest.fixture
async def fake() -> AsyncIterator[FakeSGLang]:
    server = FakeSGLang()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _request(max_new_tokens: int = 4, **sampling: object) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_new_tokens=max_new_tokens, **sampling))  # type: ignore[arg-type]


async def test_more_concurrent_generations_than_the_old_pool_all_reach_the_server(fake: FakeSGLang) -> None:
    """150 long generations run at once: none waits for a pooled connection, none times out.

    The fake holds every /generate until 150 are in flight together; a client bounded by
    aiohttp's default 100-connection pool never gets there.
    """
    count = OLD_POOL_CONNECTIONS + 50
    fake.gate_in_flight = count
    async with SGLangClient(fake.url) as client:
        results = await asyncio.wait_for(asyncio.gather(*(client.generate(_request()) for _ in range(count))), 60)
        assert client.max_concurrent_generations == fake.max_running_requests  # read from /v1/loads
    assert len(results) == count and fake.max_in_flight == count


async def test_capacity_is_summed_over_ranks_and_bounds_generations_in_flight(fake: FakeSGLang) -> None:
    fake.max_running_requests, fake.dp_ranks = 2, 2
    fake.decode_s = 0.05
    async with SGLangClient(fake.url) as client:
        assert await client.running_capacity() == 4
        await asyncio.gather(*(client.generate(_request()) for _ in range(12)))
        assert client.max_concurrent_generations == 4 and client.generations_in_flight == 0
        load = await client.loads()
    assert fake.max_in_flight == 4
    # SGLang's num_total_tokens is used + queued tokens, summed here over the two ranks.
    assert (load.num_used_tokens, load.num_total_tokens) == (20, 30)


async def test_time_waiting_for_a_slot_is_not_counted_against_the_replica(fake: FakeSGLang) -> None:
    """Each request runs 0.4 s of its 1 s deadline; the last of 6 (2 at a time) ends after ~1.2 s."""
    fake.decode_s = 0.4
    async with SGLangClient(
        fake.url, max_concurrent_generations=2, generate_timeout_base_s=1.0, generate_timeout_per_token_s=0.0
    ) as client:
        start = time.monotonic()
        results = await asyncio.gather(*(client.generate(_request()) for _ in range(6)))
        elapsed_s = time.monotonic() - start
    assert len(results) == 6 and fake.max_in_flight == 2
    assert elapsed_s > client.generate_timeout_s(4)  # the queue was longer than one deadline


async def test_a_stuck_generation_hits_a_deadline_derived_from_max_new_tokens(fake: FakeSGLang) -> None:
    fake.hang = True
    async with SGLangClient(fake.url, generate_timeout_base_s=0.2, generate_timeout_per_token_s=0.01) as client:
        assert client.generate_timeout_s(1000) == pytest.approx(10.2)
        start = time.monotonic()
        with pytest.raises(Unavailable, match="deadline"):
            await client.generate(_request(max_new_tokens=20))
    assert 0.4 <= time.monotonic() - start < 5


async def test_control_calls_do_not_queue_behind_generations(fake: FakeSGLang) -> None:
    fake.hang = True
    async with SGLangClient(fake.url, max_concurrent_generations=300) as client:
        running = [asyncio.ensure_future(client.generate(_request())) for _ in range(OLD_POOL_CONNECTIONS + 20)]
        deadline = time.monotonic() + 30
        while fake.in_flight < len(running):
            assert time.monotonic() < deadline, f"only {fake.in_flight} generations reached the server"
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(client.health(), 5)
        await client.abort("rid-1")
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    assert fake.abort_bodies == [{"rid": "rid-1", "abort_all": False}]


@pytest.mark.parametrize(
    ("status", "body", "message", "error"),
    [
        # _create_error_response: a ValueError raised while serving /generate.
        (400, {"error": {"message": "The input (5 tokens) is longer than the model's context length (4 tokens)."}},
         "The input (5 tokens) is longer than the model's context length (4 tokens).", InvalidArgument),
        # The /generate contract gate: a bare string.
        (400, {"error": "unknown field `seed`, expected one of `max_new_tokens`"},
         "unknown field `seed`, expected one of `max_new_tokens`", InvalidArgument),
        # ErrorResponse of a validation error.
        (400, {"object": "error", "message": "1 validation error: input_ids", "type": "Bad Request", "param": None,
               "code": 400}, "1 validation error: input_ids", InvalidArgument),
        # An HTTPException (a 503 abort under memory pressure): alive, retry later.
        (503, {"object": "error", "message": "Retracted under decode memory pressure without a KV backup. Retry "
               "later.", "type": "503", "param": None, "code": 503},
         "Retracted under decode memory pressure without a KV backup. Retry later.", EngineBusy),
    ],
)
async def test_errors_carry_sglangs_message(
    fake: FakeSGLang, status: int, body: dict[str, object], message: str, error: type[Exception]
) -> None:
    fake.generate_answers.append((status, body))
    async with SGLangClient(fake.url) as client:
        with pytest.raises(error) as raised:
            await client.generate(_request())
    assert str(raised.value).endswith(f"HTTP {status}: {message}")
    assert sglang_error_message(body) == message


async def test_weight_update_failure_and_rejection_are_told_apart(fake: FakeSGLang) -> None:
    async with SGLangClient(fake.url) as client:
        fake.weights_answer = (400, {"success": False, "num_paused_requests": 0,
                                     "message": "Failed to get weights iterator: /ckpt/v2 (repository not found)."})
        with pytest.raises(FailedPrecondition, match=r"repository not found"):
            await client.update_weights_from_disk("/ckpt/v2")
        fake.weights_answer = (400, {"object": "error", "message": "model_path: Field required", "type": "Bad Request",
                                     "param": None, "code": 400})
        with pytest.raises(InvalidArgument, match="model_path: Field required"):
            await client.update_weights_from_disk("/ckpt/v2")
        fake.weights_answer = None
        result = await client.update_weights_from_disk("/ckpt/v2", weight_version="7")
    assert result.success and fake.weight_version == "7"


async def test_health_is_false_on_503_and_unavailable_when_down(fake: FakeSGLang) -> None:
    async with SGLangClient(fake.url, retries=0) as client:
        assert await client.health()
        fake.health_status = 503
        assert not await client.health()
        await fake.stop()
        with pytest.raises(Unavailable):
            await client.health()


async def test_generation_slots_are_fifo_weighted_and_survive_cancelled_waiters() -> None:
    slots = GenerationSlots(3)
    order: list[str] = []

    async def hold(name: str, samples: int, release: asyncio.Event) -> None:
        async with slots.hold(samples):
            order.append(name)
            await release.wait()

    first_done, never, rest_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    first = asyncio.ensure_future(hold("first", 2, first_done))
    await _until(lambda: slots.in_use == 2)
    cancelled = asyncio.ensure_future(hold("cancelled", 2, never))  # waits: 2 + 2 > 3
    big = asyncio.ensure_future(hold("big", 8, rest_done))  # n above the limit takes the whole limit
    small = asyncio.ensure_future(hold("small", 1, rest_done))  # fits now, but waits its turn (FIFO)
    await asyncio.sleep(0)
    assert order == ["first"]
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    first_done.set()
    await _until(lambda: order == ["first", "big"])
    assert slots.in_use == 3
    rest_done.set()
    await asyncio.wait_for(asyncio.gather(first, big, small), 10)
    assert order == ["first", "big", "small"] and slots.in_use == 0


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
