"""RolloutRouter under rollout.balancing static with more agent keys than replicas (fake SGLang replicas).

A finished job's on-demand evaluation rounds (flexmarl eval, `--versions`) add keys ``<job>@<round>/<agent>`` beside
the job's: on two replicas serving a two-agent job, the round's keys were dealt no replica at the rebuild, static
shares never moved one, and the requests waited forever; the rebuild that drops the previous round's keys waits
for those very requests to drain. Found by ``benchmarks.time_to_reward --eval-after`` on the sequential
configuration (static balancing), whose second pinned round never finished.
"""

from __future__ import annotations

import asyncio

import pytest
from sglang_fake import FakeSGLang

from rolloutd.balancer import BalancerConfig
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.router import Replica, RolloutRouter, agent_key

pytestmark = pytest.mark.timeout(60)

JOB = [agent_key("job-1", "sender"), agent_key("job-1", "receiver")]


def round_keys(round_id: str) -> list[str]:
    return [agent_key(f"job-1@{round_id}", name) for name in ("sender", "receiver")]


async def generate(router: RolloutRouter, key: str) -> None:
    await asyncio.wait_for(router.generate(key, [1, 2, 3], {"max_new_tokens": 4}, 1, f"{key}#0"), 20)


async def in_flight(router: RolloutRouter, key: str) -> None:
    """Returns once a request of key is in the router's balancer (queued or placed)."""
    while (balancer := router.balancer()) is None or balancer.demand_tokens(key) == 0:
        await asyncio.sleep(0.005)


async def resolve(uri: str) -> str:
    return uri


async def test_static_shares_serve_a_pinned_rounds_keys_beside_the_jobs_and_the_next_round() -> None:
    servers = [FakeSGLang() for _ in range(2)]
    for server in servers:
        server.decode_s = 0.3  # a request stays in flight long enough for the sweep's rebuild to start beside it
        await server.start()
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1)) for i, s in enumerate(servers)]
    router = RolloutRouter(replicas, resolve, BalancerConfig(rebalance_enabled=False, reassignment_cost_s=0.0))
    for key in JOB + round_keys("d1") + round_keys("d2"):
        router.require(key, 1, f"/weights/{key}/v1")
    try:
        await router.set_agents(JOB)
        for key in JOB:
            await generate(router, key)
        # round d1 joins: four keys on two replicas; each of its agents' turns gets a replica in turn
        await router.set_agents(JOB + round_keys("d1"))
        for key in round_keys("d1"):
            await generate(router, key)
        # round d2 opens before d1's keys are swept; the sweep's rebuild then runs while d2's requests are queued
        await router.set_agents(JOB + round_keys("d1") + round_keys("d2"))
        first = asyncio.ensure_future(generate(router, round_keys("d2")[0]))
        await asyncio.wait_for(in_flight(router, round_keys("d2")[0]), 20)
        assert not first.done()  # the sweep's rebuild below starts with the request in the balancer
        await asyncio.wait_for(router.set_agents(JOB + round_keys("d2")), 20)
        await first
        await generate(router, round_keys("d2")[1])
        balancer = router.balancer()
        assert balancer is not None and sum(balancer.replica_counts().values()) == 2
        # the round's keys were served by replicas moved to them, which a static share alone never does
        assert router.reassignments >= 1 and set(balancer.replica_counts()) == set(JOB + round_keys("d2"))
    finally:
        await router.close()
        for replica in router.replicas():
            await replica.client.close()
        for server in servers:
            await server.stop()
