"""The same balancer work, interleaved over K balancers in one process: what the CPU per call does.

    python -m benchmarks.balancer_interleave 8 106 8 106

``benchmarks.sim`` runs every rolloutd's balancer in one process: 8 at 768 devices, 106 at
10,240, each over 64 replicas and 64 agents. Each balancer's work per request is the same at
every size, yet its CPU per call grows with the size (docs/benchmarks-scale.md, "Sixth round").
This drives K identical balancers (``rolloutd.balancer.HierarchicalBalancer``, least-tokens
routing, 64 replicas dealt to 64 agents) round-robin with one seeded request stream: each
balancer gets the same requests whatever K is (submit, and finish once more than 64 are in
flight), so only how many balancers' state the process touches in turn changes. It prints the
thread CPU per request for each K. The collector is frozen after start-up and its young
generation collected every 50,000 allocations, as the daemons do (``flexmarl.gc_policy``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections import deque

from flexmarl.gc_policy import GcPolicy, apply_after_startup
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, RoutingPolicy, Ticket, equal_split

REPLICAS = 64
AGENTS = 64
IN_FLIGHT = 64  # requests each balancer holds before it finishes its oldest


@dataclasses.dataclass(frozen=True)
class InterleavedRun:
    """One run: the CPU per request, and each balancer's replica loads at its end (equal: the same requests)."""

    cpu_per_request_us: float
    loads: list[tuple[int, ...]]


def run(balancers: int, requests_each: int, seed: int = 0) -> InterleavedRun:
    """Thread CPU µs per request (its submit, and the finish of the oldest one once 64 are in flight)."""
    agents = [f"agent-{i:02d}" for i in range(AGENTS)]
    replicas = [f"replica-{j:02d}" for j in range(REPLICAS)]
    config = BalancerConfig(rebalance_enabled=False, routing=RoutingPolicy.LEAST_TOKENS)
    pool = [
        HierarchicalBalancer(equal_split(replicas, agents), [AgentSpec(a, a) for a in agents], config)
        for _ in range(balancers)
    ]
    streams = [random.Random(seed) for _ in pool]  # every balancer gets the same requests
    in_flight: list[deque[Ticket]] = [deque() for _ in pool]
    clock = time.thread_time
    spent_s = 0.0
    for request in range(requests_each):
        for balancer, rng, held in zip(pool, streams, in_flight, strict=True):
            agent, tokens = agents[rng.randrange(AGENTS)], rng.randrange(100, 4000)
            started = clock()
            held.append(balancer.submit(agent, tokens, f"task-{request}#0"))
            if len(held) > IN_FLIGHT:
                balancer.finish(held.popleft().request_id)
            spent_s += clock() - started
    loads = [tuple(r.outstanding_tokens for r in balancer.replicas()) for balancer in pool]
    return InterleavedRun(1e6 * spent_s / (balancers * requests_each), loads)


def main(argv: list[str] | None = None) -> int:
    """Prints the CPU per request for each K given."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.balancer_interleave", description=__doc__.split("\n")[0]
    )
    parser.add_argument("balancers", type=int, nargs="+", help="K: balancers interleaved (one run each, in order)")
    parser.add_argument("--requests", type=int, default=300_000, help="requests per run, over all its balancers")
    args = parser.parse_args(argv)
    apply_after_startup(GcPolicy())
    for k in args.balancers:
        result = run(k, max(1, args.requests // k))
        print(f"{k} balancers: {result.cpu_per_request_us:.2f} us per request", flush=True)  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
