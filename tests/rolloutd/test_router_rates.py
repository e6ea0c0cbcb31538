"""RolloutRouter feeds its balancer measured replica rates and load seconds (rolloutd/replica_rates.py).

Fake SGLang replicas (tests/rolloutd/sglang_fake.py) that decode each request in a fixed time, so a
replica running a batch delivers the batch's tokens over that time.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from sglang_fake import FakeSGLang

from flexmarl.config import ConfigError, load_config
from rolloutd.balancer import BalancerConfig
from rolloutd.config import RolloutConfig
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.metrics import RolloutMetrics
from rolloutd.replica_rates import RateSettings
from rolloutd.router import Replica, RolloutRouter, agent_key

KEY = agent_key("job-1", "solver")
DECODE_S = 0.4
BATCH = 8  # requests per replica, each TOKENS long, decoded together in DECODE_S
TOKENS = 8
LOAD_S = 0.05


async def _resolve(uri: str) -> str:
    await asyncio.sleep(LOAD_S)  # a weight load's measurable part
    return uri


async def _serve_batches(servers: list[FakeSGLang], config: BalancerConfig) -> RolloutRouter:
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1)) for i, s in enumerate(servers)]
    router = RolloutRouter(replicas, _resolve, config, rate_settings=RateSettings(window_s=0.2, half_life_s=1.0))
    router.require(KEY, 1, "/weights/v1")
    await router.set_agents([KEY])
    balancer = router.balancer()
    assert balancer is not None and balancer.reassignment_cost_s == config.reassignment_cost_s
    await asyncio.gather(*(router.generate(KEY, [1, 2, 3], {"max_new_tokens": TOKENS}, 1, f"task#{i}")
                           for i in range(BATCH * len(servers))))
    return router


async def _close(router: RolloutRouter) -> None:
    await router.close()
    for replica in router.replicas():
        await replica.client.close()


async def test_measured_rates_and_loads_reach_the_balancer_and_the_knob_pins_the_configured_ones() -> None:
    servers = [FakeSGLang(), FakeSGLang()]
    for server in servers:
        server.decode_s = DECODE_S
        await server.start()
    try:
        router = await _serve_batches(servers, BalancerConfig(rebalance_interval_s=3600.0))
        balancer = router.balancer()
        assert balancer is not None
        # Each replica loaded v1 once (LOAD_S of it measurable): the move cost is measured, not 10 s.
        assert LOAD_S <= balancer.reassignment_cost_s < 2.0
        assert len({v.tokens_per_s for v in balancer.replicas()}) == 1  # alike: all at the best measured
        for view in balancer.replicas():
            # A batch of BATCH requests delivers BATCH x TOKENS in ~DECODE_S: ~160 tokens/s, not each
            # request's TOKENS / DECODE_S (20) and not the 1,000 prior.
            assert BATCH * TOKENS / DECODE_S / 3 < view.tokens_per_s <= BATCH * TOKENS / DECODE_S * 1.05, view
        registry = CollectorRegistry()
        RolloutMetrics(registry).watch_router(lambda: router)  # what Prometheus scrapes
        assert registry.get_sample_value("flexmarl_rolloutd_balancer_reload_seconds") == balancer.reassignment_cost_s
        group = router.model_key(KEY)
        assert registry.get_sample_value("flexmarl_rolloutd_balancer_drain_seconds", {"agent": group}) == (
            balancer.drain_estimate_s(group)) == 0.0  # no replica moved: no drain measured
        assert registry.get_sample_value("flexmarl_rolloutd_replica_tokens_per_s", {"replica": "replica-1"}) == (
            balancer.replicas()[1].tokens_per_s)
        delivered = [registry.get_sample_value("flexmarl_rolloutd_replica_delivered_tokens_per_s", {"replica": r})
                     for r in ("replica-0", "replica-1")]
        # the capacity is the best of them (fed again when it moves by more than 2 %)
        assert max(delivered) == pytest.approx(balancer.replicas()[0].tokens_per_s, rel=0.03)
        await _close(router)

        router = await _serve_batches(servers, BalancerConfig(rebalance_interval_s=3600.0, measured_rates=False))
        balancer = router.balancer()
        assert balancer is not None and balancer.reassignment_cost_s == 10.0
        assert {v.tokens_per_s for v in balancer.replicas()} == {1000.0}
        await _close(router)
    finally:
        for server in servers:
            await server.stop()


async def test_one_demand_message_rebalances_once_so_agents_hinted_together_swap_no_replicas() -> None:
    """SetAgentDemand's hints apply together: equal hints for two agents on equal shares move nothing.

    Applied one by one, the first agent's rebalance took the second's replicas (no demand yet) and
    the second's hint took two back: four loads at every job start of the ablation's first run.
    """
    servers = [FakeSGLang() for _ in range(4)]
    for server in servers:
        await server.start()
    replicas = [Replica(f"replica-{i}", SGLangClient(s.url, retries=1)) for i, s in enumerate(servers)]
    router = RolloutRouter(replicas, _resolve, BalancerConfig(reassignment_cost_s=0.0))
    keys = [agent_key("job-1", "planner"), agent_key("job-1", "coder")]
    for key in keys:
        router.require(key, 1, f"/weights/{key}")
    try:
        await router.set_agents(keys)
        router.set_demand_hints(dict.fromkeys([*keys, agent_key("job-2", "unknown")], 1_000_000))
        balancer = router.balancer()
        assert balancer is not None and router.reassignments == 0
        assert balancer.replica_counts() == dict.fromkeys(keys, 2)
        assert all(balancer.demand_tokens(key) == 1_000_000 for key in keys)
    finally:
        await _close(router)
        for server in servers:
            await server.stop()


async def test_requests_wait_in_rolloutd_once_a_replica_reserves_its_kv_capacity() -> None:
    """dispatch_kv_factor: the router reads each engine's max_total_num_tokens and sends what fits.

    Each request reserves its prompt (3) + max_new_tokens (8) = 11 tokens; a replica holding 33 runs
    three at once and the other five wait in rolloutd. Without the factor all eight go to the engine.
    """
    async def most_in_flight(factor: float) -> int:
        server = FakeSGLang()
        server.decode_s = 0.05
        server.max_total_num_tokens = 33
        await server.start()
        router = RolloutRouter([Replica("replica-0", SGLangClient(server.url, retries=1))], _resolve,
                               BalancerConfig(dispatch_kv_factor=factor))
        router.require(KEY, 1, "/weights/v1")
        try:
            await router.set_agents([KEY])
            await asyncio.gather(*(router.generate(KEY, [1, 2, 3], {"max_new_tokens": TOKENS}, 1, f"task#{i}")
                                   for i in range(8)))
            return server.max_in_flight
        finally:
            await _close(router)
            await server.stop()

    assert await most_in_flight(1.0) == 3
    assert await most_in_flight(0.0) == 8


def test_the_dispatch_bound_is_a_rolloutd_flag_off_by_default() -> None:
    assert load_config(RolloutConfig, [], prog="rolloutd", env={}).balancer_dispatch_kv_factor == 0.0
    config = load_config(RolloutConfig, ["--balancer-dispatch-kv-factor", "1.5"], prog="rolloutd", env={})
    assert config.balancer_dispatch_kv_factor == 1.5
    with pytest.raises(ConfigError, match="balancer_dispatch_kv_factor"):
        load_config(RolloutConfig, ["--balancer-dispatch-kv-factor", "-1"], prog="rolloutd", env={})
