"""RolloutRouter.set_agents: agents join and leave without draining the others, under every balancing policy.

A job starting or ending on a shared rolloutd, and every on-demand evaluation round (``flexmarl eval
--version``: keys ``<job>@<round>/<agent>``), changes the agent keys its router serves. The router used to
rebuild its balancer for each change after every request in flight had drained, so a long generation of
one job held up the others' changes and every request queued behind them. Fake SGLang replicas whose
requests decode for seconds show the order: the change completes while another agent's request runs.
"""

from __future__ import annotations

import asyncio

import pytest
from sglang_fake import FakeSGLang

from flexmarl.errors import Unavailable
from rolloutd.balancer import BalancerConfig, RoutingPolicy
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.router import Replica, RolloutRouter, agent_key

pytestmark = pytest.mark.timeout(90)

TRAIN = agent_key("job-1", "solver")
ROUND = agent_key("job-1@d1", "solver")


async def generate(router: RolloutRouter, key: str, affinity: str = "") -> None:
    await asyncio.wait_for(router.generate(key, [1, 2, 3], {"max_new_tokens": 4}, 1, affinity or f"{key}#0"), 60)


async def in_flight(router: RolloutRouter, key: str) -> None:
    """Returns once a request of key is in the router's balancer (queued or placed)."""
    while (balancer := router.balancer()) is None or key not in balancer.model_demand_tokens() \
            or balancer.demand_tokens(key) == 0:
        await asyncio.sleep(0.005)


async def resolve(uri: str) -> str:
    return uri


@pytest.fixture
async def servers() -> list[FakeSGLang]:
    started = [FakeSGLang() for _ in range(3)]
    for server in started:
        await server.start()
    yield started  # type: ignore[misc]
    for server in started:
        await server.stop()


async def test_a_round_joins_and_leaves_while_the_jobs_long_request_runs(servers: list[FakeSGLang]) -> None:
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1)) for i, s in enumerate(servers)]
    router = RolloutRouter(replicas, resolve, BalancerConfig(reassignment_cost_s=0.0, rebalance_interval_s=0.0))
    for key in (TRAIN, ROUND):
        router.require(key, 1, f"/weights/{key}/v1")
    try:
        await router.set_agents([TRAIN])
        await generate(router, TRAIN)
        for server in servers:
            server.decode_s = 3.0  # the job's long generation, and the round's below
        long = asyncio.ensure_future(generate(router, TRAIN, "long#0"))
        await asyncio.wait_for(in_flight(router, TRAIN), 20)

        # the round joins: no wait for the job's request (a rebuild would wait its 3 s)
        await asyncio.wait_for(router.set_agents([TRAIN, ROUND]), 20)
        assert not long.done()
        for server in servers:
            server.decode_s = 0.0
        await generate(router, ROUND)  # served by a replica the balancer moved to the round
        assert router.reassignments >= 1
        balancer = router.balancer()
        assert balancer is not None and set(balancer.replica_counts()) == {TRAIN, ROUND}

        # the round leaves while one of its requests runs: only that request is waited for
        for server in servers:
            server.decode_s = 3.0
        last = asyncio.ensure_future(generate(router, ROUND, "last#0"))
        await asyncio.wait_for(in_flight(router, ROUND), 20)
        leave = asyncio.ensure_future(router.set_agents([TRAIN]))
        await asyncio.sleep(0)
        with pytest.raises(Unavailable, match="not served"):  # a leaving agent takes no new request
            await generate(router, ROUND, "late#0")
        for server in servers:
            server.decode_s = 0.0
        await generate(router, TRAIN, "meanwhile#0")  # the job is served meanwhile
        assert not leave.done() and not last.done()
        await asyncio.wait_for(last, 20)
        await asyncio.wait_for(leave, 20)
        await asyncio.wait_for(long, 20)
        balancer = router.balancer()
        assert balancer is not None and set(balancer.replica_counts()) == {TRAIN}
        assert sum(balancer.replica_counts().values()) == 3  # the round's replicas went back to the job
        await generate(router, TRAIN, "after#0")
        with pytest.raises(Unavailable, match="not served"):
            await generate(router, ROUND, "gone#0")
    finally:
        await router.close()
        for replica in router.replicas():
            await replica.client.close()


@pytest.mark.parametrize("routing", [RoutingPolicy.LEAST_TOKENS, RoutingPolicy.ROUND_ROBIN])
async def test_static_shares_are_dealt_again_by_moves_without_the_drain(
    servers: list[FakeSGLang], routing: RoutingPolicy
) -> None:
    """Static and round-robin shares are equal shares of the whole set of agents: a change deals them again by
    moving replicas (the idle ones), while the job's long request runs on."""
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1)) for i, s in enumerate(servers)]
    config = BalancerConfig(rebalance_enabled=False, routing=routing, reassignment_cost_s=0.0)
    router = RolloutRouter(replicas, resolve, config)
    for key in (TRAIN, ROUND):
        router.require(key, 1, f"/weights/{key}/v1")
    try:
        await router.set_agents([TRAIN])
        for server in servers:
            server.decode_s = 3.0
        long = asyncio.ensure_future(generate(router, TRAIN, "long#0"))
        await asyncio.wait_for(in_flight(router, TRAIN), 20)
        balancer = router.balancer()
        assert balancer is not None
        busy = {v.replica_id for v in balancer.replicas() if v.in_flight_requests}
        await asyncio.wait_for(router.set_agents([TRAIN, ROUND]), 20)
        assert not long.done()  # no rebuild waited for it
        assert sorted(balancer.replica_counts().values()) == [1, 2]
        assert {v.replica_id for v in balancer.replicas() if v.target_model_key == TRAIN} >= busy
        for server in servers:
            server.decode_s = 0.0
        await generate(router, ROUND)  # on the replica dealt to the round
        assert not long.done()

        await asyncio.wait_for(router.set_agents([TRAIN]), 20)  # the round leaves: its replica goes back
        assert router.balancer() is balancer and balancer.replica_counts() == {TRAIN: 3}
        await asyncio.wait_for(long, 20)
        await generate(router, TRAIN, "after#0")
    finally:
        await router.close()
        for replica in router.replicas():
            await replica.client.close()
