"""Why hierarchical balancing moves no replica in ``benchmarks.run``'s modelled runs: the balancer's units.

    python -m benchmarks.balancer_units [--heavy-tickets 400] [--token-scale 128] [--time-scale 0.5]

rolloutd's balancer (``rolloutd/balancer.py``) estimates each agent group's drain time as its
outstanding *real* tokens over its replicas' ``tokens_per_s`` (a fixed 1,000 per replica, set by
``rolloutd/router.py``), and moves a replica only if that beats ``reassignment_cost_s`` (10 wall s)
plus the donor's own drain. Under the device model a real token stands for ``token_scale`` modelled
ones and a wall second for ``1 / time_scale`` modelled seconds, so a replica really delivers
``modelled tokens/s / time_scale / token_scale`` real tokens per wall second (~40 on the shifting
shape, not 1,000) and reloads in ``weight_transfer_s x time_scale`` wall s (0.3, not 10). This feeds
the real ``HierarchicalBalancer`` the demand of the shifting shape (one heavy agent with
``--heavy-tickets`` requests in flight or queued, two light ones, 6 replicas at 2 each) under both
calibrations and prints the moves it decides.
"""

from __future__ import annotations

import argparse
import sys

from flexmarl import devicemodel
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, ReplicaAssignment

AGENTS = ("planner", "coder", "reviewer")


def moves(tokens_per_s: float, reassignment_cost_s: float, heavy_tickets: int, heavy_tokens: int,
          light_tickets: int, light_tokens: int, replicas: int = 6) -> dict[str, int]:
    """Replicas per agent after one rebalance of the given demand (the balancer starts at equal shares)."""
    specs = [ReplicaAssignment(f"replica-{i}", AGENTS[i * len(AGENTS) // replicas], tokens_per_s)
             for i in range(replicas)]
    balancer = HierarchicalBalancer(specs, [AgentSpec(a, a) for a in AGENTS],
                                    BalancerConfig(reassignment_cost_s=reassignment_cost_s))
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


def main(argv: list[str] | None = None) -> int:
    """Prints the balancer's decision under rolloutd's calibration and under the modelled device's."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.balancer_units", description=__doc__.split("\n")[0])
    parser.add_argument("--heavy-tickets", type=int, default=400)
    parser.add_argument("--token-scale", type=float, default=128.0)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--modelled-tokens-per-s", type=float, default=2500.0,
                        help="one replica's modelled decode rate at the batch the shape reaches")
    args = parser.parse_args(argv)
    heavy, light = round(3072 / args.token_scale), round(128 / args.token_scale) or 1
    real_rate = args.modelled_tokens_per_s / args.time_scale / args.token_scale  # a wall s is 1 / time_scale modelled s
    reload_s = devicemodel.weight_transfer_s(devicemodel.PRESETS["h100"]) * args.time_scale
    default = BalancerConfig()
    out = [
        ("rolloutd as configured", 1000.0, default.reassignment_cost_s),
        ("rates and reload of the modelled device", real_rate, reload_s),
    ]
    for name, rate, cost in out:
        counts = moves(rate, cost, args.heavy_tickets, heavy, 4, light)
        drain = args.heavy_tickets * heavy / (2 * rate)
        print(f"{name}: {rate:.0f} real tokens/s per replica, reload {cost:.2f} s; heavy agent's estimated "  # noqa: T201
              f"drain on its 2 replicas {drain:.1f} s -> replicas after a rebalance {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
