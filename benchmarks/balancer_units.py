"""Why hierarchical balancing moved no replica in ``benchmarks.run``'s modelled runs, and that it moves them now.

    python -m benchmarks.balancer_units [--heavy-tickets 400] [--token-scale 128] [--time-scale 0.5]

rolloutd's balancer (``rolloutd/balancer.py``) estimates each agent group's drain time as its
outstanding *real* tokens over its replicas' tokens/s, and moves a replica only if that beats the
cost of a weight load plus the donor's own drain. Until measured rates, both were constants: 1,000
tokens/s per replica (set by ``rolloutd/router.py``) and ``reassignment_cost_s`` = 10 wall s (what
``--no-balancer-measured-rates`` still pins). Under the device model a real token stands for
``token_scale`` modelled ones and a wall second for ``1 / time_scale`` modelled seconds, so a
saturated replica really delivers ``modelled tokens/s / time_scale / token_scale`` real tokens per
wall second (~40 on the shifting shape, not 1,000), one serving a request at a time far less, and
it reloads in ``weight_transfer_s x time_scale`` wall s (0.3, not 10).

This feeds the real ``HierarchicalBalancer`` the demand of the shifting shape (one heavy agent with
``--heavy-tickets`` requests in flight or queued, two light ones, 6 replicas at 2 each) three ways
and prints the moves it decides: with the fixed constants; with what rolloutd measures now (the
real :class:`rolloutd.replica_rates.ReplicaRate` and :class:`~rolloutd.replica_rates.ReloadCost`
fed the generations and loads the device model makes: the heavy agent's replicas saturated, the
light agents' serving one request at a time; every replica counted at the best measured, as rolloutd
does); and with each replica at the rate it delivered, why rolloutd does not: a light agent's
replica, given one short request at a time, delivers a thirtieth of what it can.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from flexmarl import devicemodel
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, ReplicaAssignment
from rolloutd.replica_rates import ReloadCost, ReplicaRate

AGENTS = ("planner", "coder", "reviewer")
REPLICAS = 6
MEASURED_BUSY_S = 30.0  # busy seconds each replica is measured over before the rebalance


def measured_rate(tokens_per_s: float, concurrency: int, tokens_each: float) -> float:
    """What rolloutd's estimator measures of a replica running ``concurrency`` generations at a time.

    Each generation delivers ``tokens_each`` tokens, the replica ``tokens_per_s`` in all; replays
    ``MEASURED_BUSY_S`` of such generations through :class:`ReplicaRate` (prior 1,000).
    """
    rate = ReplicaRate(1000.0, "agent")
    latency_s = tokens_each * concurrency / tokens_per_s
    now = 0.0
    while now < MEASURED_BUSY_S:
        marks = [rate.begin(now) for _ in range(concurrency)]
        now += latency_s
        for mark in marks:
            rate.end(mark, now, round(tokens_each))
    return rate.tokens_per_s


def replicas_after(rates: list[float], reload_s: float, heavy_tickets: int, heavy_tokens: int, light_tickets: int,
                   light_tokens: int, measured_rates: bool = True) -> dict[str, int]:
    """Replicas per agent after one rebalance of the given demand (the balancer starts at equal shares).

    ``rates``: each replica's tokens/s (replica i serves agent ``i * 3 // 6``), fed as rolloutd feeds
    measurements; ``reload_s`` the load cost.
    """
    specs = [ReplicaAssignment(f"replica-{i}", AGENTS[i * len(AGENTS) // REPLICAS]) for i in range(REPLICAS)]
    balancer = HierarchicalBalancer(specs, [AgentSpec(a, a) for a in AGENTS],
                                    BalancerConfig(measured_rates=measured_rates))
    for spec, rate in zip(specs, rates, strict=True):
        balancer.set_replica_rate(spec.replica_id, rate)
    balancer.set_reassignment_cost_s(reload_s)
    for _ in range(heavy_tickets):
        balancer.submit(AGENTS[0], heavy_tokens)
    for agent in AGENTS[1:]:
        for _ in range(light_tickets):
            balancer.submit(agent, light_tokens)
    balancer.rebalance(now_s=100.0)
    counts: dict[str, int] = dict.fromkeys(AGENTS, 0)
    for replica in balancer.replicas():
        counts[replica.target_model_key] += 1
    return counts


@dataclasses.dataclass(frozen=True)
class Decision:
    """One calibration of the balancer and the replicas per agent it leaves after a rebalance."""

    name: str
    rates: tuple[float, ...]  # per replica, tokens/s (replicas 0-1 serve the heavy agent)
    reload_s: float
    replicas: dict[str, int]


def decisions(heavy_tickets: int = 400, token_scale: float = 128.0, time_scale: float = 0.5,
              modelled_tokens_per_s: float = 2500.0) -> list[Decision]:
    """The balancer's decision with the fixed constants, with what rolloutd measures, and per replica's delivery."""
    heavy, light = round(3072 / token_scale), round(128 / token_scale) or 1
    profile = devicemodel.PRESETS["h100"]
    heavy_rate = modelled_tokens_per_s / (time_scale * token_scale)  # a modelled second takes time_scale wall s
    # A light replica runs one short request at a time: a prefill and one decode step per modelled token.
    light_latency_s = (devicemodel.prefill_s(profile, 512) + 128 * devicemodel.decode_iteration_s(profile, 1, 576)
                       ) * time_scale
    reload = ReloadCost(BalancerConfig().reassignment_cost_s)
    for _ in range(4):  # the measured loads of the first versions
        reload.observe(devicemodel.weight_transfer_s(profile) * time_scale)
    delivered = (measured_rate(heavy_rate, heavy_tickets // 2, heavy),) * 2
    delivered += (measured_rate(light / light_latency_s, 1, light),) * 4
    default = BalancerConfig()
    rows = [
        ("fixed constants (--no-balancer-measured-rates)", (default.prior_tokens_per_s,) * REPLICAS,
         default.reassignment_cost_s, False),
        ("measured by rolloutd (every replica at the best measured)", (max(delivered),) * REPLICAS, reload.seconds,
         True),
        ("measured, each replica at what it delivered", delivered, reload.seconds, False),
    ]
    return [Decision(name, rates, cost, replicas_after(list(rates), cost, heavy_tickets, heavy, 4, light, by_group))
            for name, rates, cost, by_group in rows]


def main(argv: list[str] | None = None) -> int:
    """Prints the balancer's decisions (see :func:`decisions`)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.balancer_units", description=__doc__.split("\n")[0])
    parser.add_argument("--heavy-tickets", type=int, default=400)
    parser.add_argument("--token-scale", type=float, default=128.0)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--modelled-tokens-per-s", type=float, default=2500.0,
                        help="one replica's modelled decode rate at the batch the heavy agent gives it")
    args = parser.parse_args(argv)
    heavy = round(3072 / args.token_scale)
    for row in decisions(args.heavy_tickets, args.token_scale, args.time_scale, args.modelled_tokens_per_s):
        drain = args.heavy_tickets * heavy / (row.rates[0] + row.rates[1])
        print(f"{row.name}: heavy agent's replicas {row.rates[0]:.1f} real tokens/s, the light agents' "  # noqa: T201
              f"{row.rates[2]:.1f}, reload {row.reload_s:.2f} s; heavy agent's estimated drain on its 2 replicas "
              f"{drain:.1f} s -> replicas after a rebalance {row.replicas}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
