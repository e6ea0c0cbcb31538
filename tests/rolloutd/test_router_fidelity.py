"""RolloutRouter against fake SGLang 0.5.23 replicas (tests/rolloutd/sglang_fake.py).

Seeded groups stay diverse and reproducible although SGLang gives the samples of one seeded
request one seed; a replica dropped after a failure serves again once its /health answers; a
503 (busy, alive) does not drop a replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from sglang_fake import FakeSGLang, seeded_tokens

from flexmarl.episode import GenerationOutput
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.router import Replica, RolloutRouter, agent_key

JOB = "job-1"
AGENT = "solver"
KEY = agent_key(JOB, AGENT)
PROMPT = [11, 12, 13, 14]
SAMPLING = {"temperature": 1.0, "max_new_tokens": 6}
GROUP = 4


async def _resolve(uri: str) -> str:
    return uri


async def _start(count: int) -> list[FakeSGLang]:
    servers = [FakeSGLang() for _ in range(count)]
    for server in servers:
        await server.start()
    return servers


async def _router(
    servers: Sequence[FakeSGLang], health_probe_interval_s: float = 5.0, busy_backoff_s: float = 1.0
) -> RolloutRouter:
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1, retry_backoff_s=0.01))
                for i, s in enumerate(servers)]
    router = RolloutRouter(replicas, _resolve, health_probe_interval_s=health_probe_interval_s,
                           busy_backoff_s=busy_backoff_s)
    router.require(KEY, 3, "/weights/v3")
    await router.set_agents([KEY])
    return router


async def _close(router: RolloutRouter, servers: Sequence[FakeSGLang]) -> None:
    await router.close()
    for replica in router.replicas():
        await replica.client.close()
    for server in servers:
        await server.stop()


@pytest.fixture
async def two_replicas() -> AsyncIterator[tuple[RolloutRouter, list[FakeSGLang]]]:
    servers = await _start(2)
    router = await _router(servers, health_probe_interval_s=0.05, busy_backoff_s=0.01)
    try:
        yield router, servers
    finally:
        await _close(router, servers)


async def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _seeded_group(seed: int) -> tuple[list[GenerationOutput], list[FakeSGLang]]:
    servers = await _start(2)
    for server in servers:
        server.gate_in_flight = GROUP  # each sample's request is held until all of them are in flight
    router = await _router(servers)
    try:
        backend = router.backend(JOB, seed=seed)
        outputs = await asyncio.wait_for(backend.generate(AGENT, PROMPT, dict(SAMPLING), GROUP, f"{JOB}/task-0"), 60)
    finally:
        await _close(router, servers)
    return outputs, servers


async def test_fake_like_sglang_gives_one_seeded_request_identical_samples() -> None:
    [server] = await _start(1)
    try:
        async with SGLangClient(server.url) as client:
            samples = await client.generate(GenerationRequest(tuple(PROMPT), SamplingParams(n=GROUP, seed=5)))
    finally:
        await server.stop()
    assert len({s.output_ids for s in samples}) == 1
    assert len({s.rid for s in samples}) == GROUP  # n > 1: fresh rids per sample


async def test_a_seeded_group_gets_distinct_reproducible_samples_from_one_replica() -> None:
    outputs, servers = await _seeded_group(seed=7)
    assert len(outputs) == GROUP and len({o.token_ids for o in outputs}) == GROUP
    assert all(o.version == 3 for o in outputs)
    # One request per sample, n = 1, seeds base + i, all on one replica (the radix cache keeps the prompt).
    [busy] = [s for s in servers if s.generate_bodies]
    seeds = [body["sampling_params"]["sampling_seed"] for body in busy.generate_bodies]
    assert all(body["sampling_params"]["n"] == 1 for body in busy.generate_bodies)
    base = min(seeds)
    assert sorted(seeds) == list(range(base, base + GROUP))
    assert [o.token_ids for o in outputs] == [seeded_tokens(base + i, PROMPT, 6) for i in range(GROUP)]  # in order
    assert busy.max_in_flight == GROUP  # sent together
    again, _ = await _seeded_group(seed=7)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # sample i gets the same seed
    other, _ = await _seeded_group(seed=8)
    assert [o.token_ids for o in other] != [o.token_ids for o in outputs]


async def test_an_unseeded_group_stays_one_request(two_replicas: tuple[RolloutRouter, list[FakeSGLang]]) -> None:
    router, servers = two_replicas
    outputs = await router.generate(KEY, PROMPT, SAMPLING, GROUP, "task-1")
    bodies = [body for server in servers for body in server.generate_bodies]
    assert len(outputs) == GROUP and len(bodies) == 1 and bodies[0]["sampling_params"]["n"] == GROUP
    assert "sampling_seed" not in bodies[0]["sampling_params"]


async def test_samples_lost_with_a_replica_are_retried_on_another(
    two_replicas: tuple[RolloutRouter, list[FakeSGLang]],
) -> None:
    router, servers = two_replicas
    first = await router.generate(KEY, PROMPT, {**SAMPLING, "sampling_seed": 100}, GROUP, "task-2")
    [busy] = [s for s in servers if s.generate_bodies]
    [idle] = [s for s in servers if s is not busy]
    busy.generate_answers.extend([(502, "Bad Gateway")] * 2)  # two samples fail behind a proxy
    busy.health_status = 503  # and it stays out until it answers /health again
    outputs = await router.generate(KEY, PROMPT, {**SAMPLING, "sampling_seed": 100}, GROUP, "task-2")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in first]  # same seeds, same samples
    assert len(idle.generate_bodies) == 2  # only the lost samples went to the other replica
    assert [r.healthy for r in router.replicas()].count(False) == 1


async def test_a_busy_replica_is_not_dropped(two_replicas: tuple[RolloutRouter, list[FakeSGLang]]) -> None:
    router, servers = two_replicas
    retracted = {"object": "error", "message": "Retracted under decode memory pressure without a KV backup. "
                 "Retry later.", "type": "503", "param": None, "code": 503}
    for server in servers:
        server.generate_answers.append((503, retracted))
    outputs = await router.generate(KEY, PROMPT, SAMPLING, 1, "task-3")
    assert len(outputs) == 1
    assert all(r.healthy for r in router.replicas())
    balancer = router.balancer()
    assert balancer is not None and len(balancer.replicas()) == 2


async def test_a_restarted_replica_is_readmitted_and_serves_again() -> None:
    [server] = await _start(1)
    router = await _router([server], health_probe_interval_s=0.05)
    try:
        await router.generate(KEY, PROMPT, SAMPLING, 1, "task-4")
        [replica] = router.replicas()
        assert replica.reloads == 1 and len(server.weight_bodies) == 1
        await server.stop()
        pending = asyncio.ensure_future(router.generate(KEY, PROMPT, SAMPLING, 1, "task-4"))
        await _wait_for(lambda: not replica.healthy, "the replica to be dropped")
        assert not pending.done()  # queued for a replica, not failed
        restarted = FakeSGLang()
        restarted.port = server.port
        await restarted.start()
        try:
            [output] = await asyncio.wait_for(pending, 30)
            assert replica.healthy and output.version == 3
            # It may have restarted with other weights: the router loaded them again first.
            assert replica.reloads == 2 and [b["model_path"] for b in restarted.weight_bodies] == ["/weights/v3"]
            balancer = router.balancer()
            assert balancer is not None and [v.replica_id for v in balancer.replicas()] == [replica.replica_id]
            assert balancer.replicas()[0].model_key == KEY
            await router.generate(KEY, PROMPT, SAMPLING, 1, "task-5")
            assert len(restarted.generate_bodies) == 2
        finally:
            await restarted.stop()
    finally:
        await _close(router, [])


async def test_a_replica_relaunched_unseen_loads_its_weights_again() -> None:
    # The supervisor relaunched the engine between two requests: no request failed, so only its word tells
    # the router that the replica serves its launch weights again (seen on vLLM: v0 served as v1).
    [server] = await _start(1)
    router = await _router([server])
    try:
        await router.generate(KEY, PROMPT, SAMPLING, 1, "task-7")
        [replica] = router.replicas()
        await server.stop()
        restarted = FakeSGLang()
        restarted.port = server.port
        await restarted.start()
        try:
            router.readmit(replica, relaunched=True)
            assert replica.healthy and (replica.loaded_agent, replica.loaded_version) == ("", -1)
            [output] = await router.generate(KEY, PROMPT, SAMPLING, 1, "task-8")
            assert output.version == 3 and [b["model_path"] for b in restarted.weight_bodies] == ["/weights/v3"]
        finally:
            await restarted.stop()
    finally:
        await _close(router, [])


async def test_queued_requests_wait_for_the_first_replica_back() -> None:
    servers = await _start(2)
    router = await _router(servers, health_probe_interval_s=0.05)
    try:
        for server in servers:
            server.health_status = 503  # up, but not ready: not re-admitted
            server.generate_answers.append((502, "Bad Gateway"))
        pending = asyncio.ensure_future(router.generate(KEY, PROMPT, SAMPLING, 1, "task-6"))
        await _wait_for(lambda: not any(r.healthy for r in router.replicas()), "both replicas to be dropped")
        assert not pending.done()
        servers[1].health_status = 200
        [output] = await asyncio.wait_for(pending, 30)
        assert output.version == 3 and [r.healthy for r in router.replicas()] == [False, True]
    finally:
        await _close(router, servers)


@pytest.mark.timeout(60)
async def test_a_hung_replica_is_dropped_and_the_work_it_held_goes_to_another() -> None:
    """A replica that holds requests and answers none (SIGSTOPped, a stuck device call) is dropped (issue 36).

    Its connections stay open, so nothing fails over by itself before the /generate deadline; the
    requests it holds end with their tasks (orchestratord stops renewing their leases), and the
    work, asked again, goes to a replica that answers.
    """
    servers = await _start(2)
    router = await _router(servers, health_probe_interval_s=0.05)
    try:
        hung, alive = servers
        hung.hang, hung.health_status = True, 503  # a stopped process answers neither
        held = [asyncio.ensure_future(router.generate(KEY, PROMPT, SAMPLING, 1, f"task-h{i}")) for i in range(8)]
        await _wait_for(lambda: hung.in_flight > 0, "a request to reach the hung replica")
        replica = next(r for r in router.replicas() if r.replica_id == "replica-0")  # servers[0]'s
        assert router.drop_hung(stall_s=30) == [] and replica.healthy  # not hung for long yet
        dropped: list[str] = []
        await _wait_for(lambda: bool(dropped.extend(router.drop_hung(stall_s=0.3)) or dropped),
                        "the hung replica to be dropped")
        assert dropped == [replica.replica_id] and not replica.healthy
        # The replica that answered is not hung, even with nothing in flight now.
        assert all(r.healthy for r in router.replicas() if r is not replica)
        for pending in held:  # their leases are refused: the tasks are cancelled
            pending.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        outputs = await asyncio.wait_for(router.generate(KEY, PROMPT, SAMPLING, 1, "task-h0"), 30)
        assert len(outputs) == 1 and alive.generate_bodies
        assert not replica.healthy  # /health does not answer: it stays out
    finally:
        await _close(router, servers)


async def test_close_stops_the_health_probe() -> None:
    [server] = await _start(1)
    router = await _router([server], health_probe_interval_s=0.05)
    server.generate_answers.append((502, "Bad Gateway"))
    server.health_status = 503
    pending = asyncio.ensure_future(router.generate(KEY, PROMPT, SAMPLING, 1, "task-7"))
    [replica] = router.replicas()
    await _wait_for(lambda: not replica.healthy, "the replica to be dropped")
    probe = router._probe
    assert probe is not None and not probe.done()
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await _close(router, [server])
    assert probe.done() and router._probe is None
