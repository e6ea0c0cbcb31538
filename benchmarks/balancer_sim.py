"""Discrete-event simulation of rollout load balancing on a skewed multi-agent workload.

It drives the real :class:`rolloutd.balancer.HierarchicalBalancer` (it does not re-implement
it) under three configurations and reports makespan and utilisation:

* ``round-robin``: replicas dealt equally to agents once, requests round-robin within an agent;
* ``static``: the same fixed equal assignment, least-outstanding-tokens routing;
* ``hierarchical``: the same start, then demand-proportional reassignment (paying a weight
  load per move) plus least-tokens routing with episode affinity.

Utilisation = work done / (replicas × replica_tokens_per_s × makespan).

Replica model: processor sharing. A replica decodes ``replica_tokens_per_s`` in total, split
evenly over its running requests, and one request never goes faster than
``request_tokens_per_s`` (a decode step per token). A request's work is its response tokens
plus ``prefill_token_weight`` × its prompt tokens not already cached on that replica (the
prompt of an episode's earlier turn on the same replica and model is cached until a reload).

Run ``python -m benchmarks.balancer_sim`` for the comparison table.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Sequence

from benchmarks.report import Column, render_table
from rolloutd.balancer import (
    AgentSpec,
    BalancerConfig,
    HierarchicalBalancer,
    RoutingPolicy,
    Ticket,
    TokenEstimator,
    equal_split,
)

POLICIES = ("round-robin", "static", "hierarchical")


@dataclasses.dataclass(frozen=True)
class SimTurn:
    """One generation request of an episode."""

    agent: str
    prompt_tokens: int
    response_tokens: int


@dataclasses.dataclass(frozen=True)
class SimEpisode:
    """Turns run one after another; all episodes are released at time 0."""

    episode_key: str
    turns: tuple[SimTurn, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """Agents, their max_new_tokens, and the episodes of one rollout batch."""

    agents: tuple[str, ...]
    max_new_tokens: dict[str, int]
    episodes: tuple[SimEpisode, ...]

    def tokens_per_agent(self) -> dict[str, int]:
        """Total response tokens each agent generates."""
        totals = dict.fromkeys(self.agents, 0)
        for episode in self.episodes:
            for turn in episode.turns:
                totals[turn.agent] += turn.response_tokens
        return totals


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Cluster model of the simulation."""

    replicas: int = 8
    replica_tokens_per_s: float = 200.0
    request_tokens_per_s: float = 60.0
    prefill_token_weight: float = 0.05
    reload_s: float = 4.0
    rebalance_interval_s: float = 1.0
    hysteresis: float = 0.15


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one policy on one workload."""

    policy: str
    makespan_s: float
    utilisation: float
    reassignments: int
    requests: int


def _long_tail(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def skewed_workload(
    seed: int = 0, tasks: int = 48, group_size: int = 4, heavy_ratio: float = 10.0, light_mean_tokens: float = 24.0
) -> Workload:
    """Planner → solver (heavy_ratio × the tokens, long tail) → verifier, solver revises on reject.

    Response lengths are lognormal (sigma 1: a long tail) capped at max_new_tokens.
    """
    rng = random.Random(seed)
    heavy_mean = light_mean_tokens * heavy_ratio
    max_new = {"planner": 128, "solver": int(heavy_mean * 8), "verifier": 128}  # tails up to 8x the mean
    episodes: list[SimEpisode] = []
    for task in range(tasks):
        for sample in range(group_size):
            plan = _long_tail(rng, light_mean_tokens, 1.0, max_new["planner"])
            solve = _long_tail(rng, heavy_mean, 1.0, max_new["solver"])
            verdict = _long_tail(rng, light_mean_tokens, 1.0, max_new["verifier"])
            turns = [
                SimTurn("planner", 64, plan),
                SimTurn("solver", 64 + plan, solve),
                SimTurn("verifier", 64 + plan + solve, verdict),
            ]
            if rng.random() < 0.5:  # rejected: the solver revises on top of its cached prompt
                revise = _long_tail(rng, heavy_mean / 2, 1.0, max_new["solver"])
                turns.append(SimTurn("solver", 64 + plan + solve + verdict, revise))
            episodes.append(SimEpisode(f"t{task}#{sample}", tuple(turns)))
    return Workload(("planner", "solver", "verifier"), max_new, tuple(episodes))


@dataclasses.dataclass
class _Running:
    request_id: int
    episode: int
    remaining_work: float


class _Simulation:
    def __init__(self, workload: Workload, policy: str, config: SimConfig) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.workload = workload
        self.config = config
        balancer_config = BalancerConfig(
            routing=RoutingPolicy.ROUND_ROBIN if policy == "round-robin" else RoutingPolicy.LEAST_TOKENS,
            rebalance_enabled=policy == "hierarchical",
            rebalance_interval_s=config.rebalance_interval_s,
            reassignment_cost_s=config.reload_s,
            hysteresis=config.hysteresis,
            min_residency_s=config.reload_s,
        )
        replica_ids = [f"r{i:02d}" for i in range(config.replicas)]
        self.balancer = HierarchicalBalancer(
            equal_split(replica_ids, workload.agents, config.replica_tokens_per_s),
            [AgentSpec(agent, agent) for agent in workload.agents],
            balancer_config,
        )
        self.estimator = TokenEstimator(prefill_token_weight=config.prefill_token_weight)
        self.policy = policy
        self.now_s = 0.0
        self.running: dict[str, list[_Running]] = {r: [] for r in replica_ids}
        self.cached: dict[str, set[tuple[str, int]]] = {r: set() for r in replica_ids}
        self.work_done: dict[str, float] = dict.fromkeys(replica_ids, 0.0)
        self.next_turn = [0] * len(workload.episodes)
        self.loads_done: list[tuple[float, str]] = []  # heap of (time, replica)
        self.ticket_episode: dict[int, int] = {}
        self.finished_episodes = 0
        self.requests = 0

    # -- request lifecycle
    def submit_next_turn(self, episode: int) -> None:
        turn = self.workload.episodes[episode].turns[self.next_turn[episode]]
        estimate = self.estimator.estimate(turn.agent, turn.prompt_tokens, self.workload.max_new_tokens[turn.agent])
        ticket = self.balancer.submit(turn.agent, estimate, self.workload.episodes[episode].episode_key)
        self.ticket_episode[ticket.request_id] = episode
        self.requests += 1
        if ticket.replica_id is not None:
            self.start(ticket)

    def start(self, ticket: Ticket) -> None:
        if ticket.replica_id is None:
            raise RuntimeError("start() needs a placed ticket")
        episode = self.ticket_episode[ticket.request_id]
        turn = self.workload.episodes[episode].turns[self.next_turn[episode]]
        cache = self.cached[ticket.replica_id]
        uncached = turn.prompt_tokens if (turn.agent, episode) not in cache else 0
        cache.add((turn.agent, episode))
        work = turn.response_tokens + self.config.prefill_token_weight * uncached
        self.running[ticket.replica_id].append(_Running(ticket.request_id, episode, work))

    def complete(self, replica_id: str, running: _Running) -> None:
        self.running[replica_id].remove(running)
        self.balancer.finish(running.request_id)
        episode = running.episode
        turn = self.workload.episodes[episode].turns[self.next_turn[episode]]
        self.estimator.observe(turn.agent, turn.response_tokens)
        self.next_turn[episode] += 1
        if self.next_turn[episode] < len(self.workload.episodes[episode].turns):
            self.submit_next_turn(episode)
        else:
            self.finished_episodes += 1

    # -- balancer housekeeping
    def update_hints(self) -> None:
        hints = dict.fromkeys(self.workload.agents, 0.0)
        for index, episode in enumerate(self.workload.episodes):
            for turn in episode.turns[self.next_turn[index] + 1 :]:
                hints[turn.agent] += self.estimator.expected_response_tokens(
                    turn.agent, self.workload.max_new_tokens[turn.agent]
                )
        for agent, tokens in hints.items():
            self.balancer.set_demand_hint(agent, round(tokens))

    def start_loads(self) -> None:
        for move in self.balancer.replicas_awaiting_load():
            self.balancer.begin_load(move.replica_id, self.now_s)  # its drain, measured as the router does
            self.cached[move.replica_id].clear()
            heapq.heappush(self.loads_done, (self.now_s + self.config.reload_s, move.replica_id))

    def place_queued(self) -> None:
        for ticket in self.balancer.place_queued():
            self.start(ticket)

    # -- time
    def rate(self, replica_id: str) -> float:
        active = len(self.running[replica_id])
        return min(self.config.request_tokens_per_s, self.config.replica_tokens_per_s / active)

    def advance(self, until_s: float) -> None:
        dt = until_s - self.now_s
        for replica_id, active in self.running.items():
            if active:
                step = self.rate(replica_id) * dt
                self.work_done[replica_id] += step * len(active)
                for running in active:
                    running.remaining_work -= step
        self.now_s = until_s

    def next_completion(self) -> tuple[float, str, _Running] | None:
        best: tuple[float, str, _Running] | None = None
        for replica_id in sorted(self.running):
            active = self.running[replica_id]
            if not active:
                continue
            soonest = min(active, key=lambda r: (r.remaining_work, r.request_id))
            at_s = self.now_s + max(0.0, soonest.remaining_work) / self.rate(replica_id)
            if best is None or at_s < best[0]:
                best = (at_s, replica_id, soonest)
        return best

    def run(self) -> SimResult:
        total = len(self.workload.episodes)
        for episode in range(total):
            self.submit_next_turn(episode)
        next_tick_s = 0.0
        while self.finished_episodes < total:
            completion = self.next_completion()
            load_s = self.loads_done[0][0] if self.loads_done else math.inf
            completion_s = completion[0] if completion else math.inf
            tick_s = next_tick_s if self.policy == "hierarchical" else math.inf
            at_s = min(completion_s, load_s, tick_s)
            if math.isinf(at_s):
                raise RuntimeError(f"{self.policy}: simulation stalled with queued requests")
            self.advance(at_s)
            if completion is not None and at_s == completion_s:
                self.complete(completion[1], completion[2])
            elif at_s == load_s:
                _, replica_id = heapq.heappop(self.loads_done)
                self.balancer.complete_load(replica_id)
            else:
                self.update_hints()
                self.balancer.maybe_rebalance(self.now_s)
                next_tick_s = self.now_s + self.config.rebalance_interval_s
            self.start_loads()
            self.place_queued()
        makespan_s = self.now_s
        capacity = self.config.replica_tokens_per_s * self.config.replicas * makespan_s
        utilisation = sum(self.work_done.values()) / capacity if capacity > 0 else 0.0
        return SimResult(self.policy, makespan_s, utilisation, self.balancer.reassignments, self.requests)


def simulate(workload: Workload, policy: str, config: SimConfig | None = None) -> SimResult:
    """Runs one policy on a workload (deterministic)."""
    return _Simulation(workload, policy, config or SimConfig()).run()


def compare(workload: Workload, config: SimConfig | None = None) -> dict[str, SimResult]:
    """Runs every policy on the same workload."""
    return {policy: simulate(workload, policy, config) for policy in POLICIES}


def format_table(results: Sequence[SimResult]) -> str:
    """A plain-text table of results."""
    columns = [
        Column("policy", 14, "<"),
        Column("makespan_s", 12, fmt=".1f"),
        Column("utilisation", 13, fmt=".2f"),
        Column("moves", 7),
        Column("requests", 10),
    ]
    rows = [[r.policy, r.makespan_s, r.utilisation, r.reassignments, r.requests] for r in results]
    return "\n".join(render_table(columns, rows, sep=""))


def main() -> None:
    """Prints the comparison on the default skewed workload."""
    workload = skewed_workload()
    print("response tokens per agent:", workload.tokens_per_agent())  # noqa: T201 (a CLI report)
    print(format_table(list(compare(workload).values())))  # noqa: T201


if __name__ == "__main__":
    main()
