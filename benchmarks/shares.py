"""What a replica assignment costs a rollout-bound step, from the device model alone (no run).

The step of a pipelined job whose tasks stream through the replicas is set by its slowest agent: the
replica-seconds that agent's share of a step needs over the replicas serving it. Those replica-seconds
depend on how full the agent keeps its replicas. A replica decodes at most as many sequences together as
its KV cache holds, each reserving prompt + ``max_new_tokens`` tokens (``devicemodel.kv_capacity_tokens``,
what the embedded engine and SGLang admit), and at most ``max_running_requests``; a decode iteration reads
the weights once however many sequences share it, so a full replica makes each token cheap and a nearly
empty one does not (``devicemodel.decode_iteration_s``).

An agent's replicas stay full only while enough of its sequences are in flight: rolloutd runs
``max_tasks`` tasks of ``group_size`` episodes at once, and the slowest agent holds nearly all of them
(the others' turns pass quickly). :func:`agent_step_s` charges each agent's sequences at the batch its
replicas run at: as full as the KV cache allows for the slowest agent when rolloutd keeps enough in
flight, one step's sequences spread over its replicas for the others. :func:`assignment_estimate` compares
fixed equal shares with the best whole-replica assignment (what hierarchical balancing can reach at
best, every agent keeping one replica) and the device-work bound (every replica-second shared perfectly).

It is a steady state without moves: a job whose heavy role moves pays each move's drain and load, and
fixed shares get back part of the loss while the previous heavy agent's backlog drains on its own
replicas beside the new one's (docs/benchmarks.md, "The saturating shape").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

from benchmarks.workloads import LengthDistribution, Workload
from flexmarl import devicemodel


@dataclasses.dataclass(frozen=True)
class AgentLoad:
    """One agent's steady state on its replicas (modelled seconds and tokens)."""

    agent: str
    replicas: int
    batch: float  # sequences a replica of the agent decodes together
    full_batch: float  # the most its KV cache (or max_running_requests) admits
    replica_s: float  # replica-seconds of one step's sequences at ``batch``
    latency_s: float  # one sequence of the mean length at ``batch`` (its decode iterations)

    @property
    def step_s(self) -> float:
        """The agent's share of a step over its replicas."""
        return self.replica_s / self.replicas


@dataclasses.dataclass(frozen=True)
class AssignmentEstimate:
    """Fixed equal shares against the best whole-replica assignment and the perfect spread."""

    fixed: tuple[AgentLoad, ...]
    best: tuple[AgentLoad, ...]
    spread_s: float  # every agent's replica-seconds at full batches over all replicas

    @property
    def fixed_step_s(self) -> float:
        """The step under fixed equal shares: its slowest agent's."""
        return max(load.step_s for load in self.fixed)

    @property
    def best_step_s(self) -> float:
        """The step under the best whole-replica assignment."""
        return max(load.step_s for load in self.best)

    @property
    def ratio(self) -> float:
        """How much longer fixed shares' step is than the best assignment's."""
        return self.fixed_step_s / self.best_step_s


def lengths(dist: LengthDistribution, episodes: int, token_scale: float, rng: random.Random) -> list[int]:
    """One step's response lengths of an agent, in modelled tokens rounded up to whole real tokens."""
    return [math.ceil(dist.sample(rng) / token_scale) * int(token_scale) for _ in range(episodes)]


def full_batch(profile: devicemodel.DeviceProfile, prompt_tokens: int, lengths_: list[int]) -> float:
    """Sequences of these lengths one replica admits together (KV reservation, max_running_requests)."""
    reserved = prompt_tokens + sum(lengths_) / len(lengths_)
    return max(1.0, min(float(profile.max_running_requests), devicemodel.kv_capacity_tokens(profile) / reserved))


def agent_step_s(
    profile: devicemodel.DeviceProfile,
    agent: str,
    prompt_tokens: int,
    lengths_: list[int],
    replicas: int,
    in_flight: int,
) -> AgentLoad:
    """One agent's step on ``replicas`` replicas with ``in_flight`` of its sequences kept in flight.

    A replica decodes ``min(full batch, in_flight / replicas)`` sequences together; a token of a
    sequence costs one iteration of that batch over the batch (the mean context of a sequence is its
    prompt plus half its response), and every prompt is prefilled once.
    """
    full = full_batch(profile, prompt_tokens, lengths_)
    batch = max(1.0, min(full, in_flight / replicas))
    mean = sum(lengths_) / len(lengths_)
    iteration_s = devicemodel.decode_iteration_s(profile, max(1, round(batch)), batch * (prompt_tokens + mean / 2))
    decode_s = sum(lengths_) * iteration_s / batch
    replica_s = devicemodel.prefill_s(profile, prompt_tokens * len(lengths_)) + decode_s
    return AgentLoad(agent, replicas, batch, full, replica_s, mean * iteration_s)


def assignment_estimate(
    workload: Workload,
    profile: devicemodel.DeviceProfile,
    replicas: int,
    episodes: int,
    in_flight_episodes: int,
    seed: int = 0,
) -> AssignmentEstimate:
    """Fixed equal shares, the best whole-replica assignment and the perfect spread of one step's work.

    ``workload``'s agents as listed (a rotating workload: one phase of it, the others are the same
    rotated); ``in_flight_episodes``: what rolloutd keeps running (``max_tasks`` x ``group_size``), all
    of them at the slowest agent's turn, one step's (``episodes``) at each other agent's.
    """
    rng = random.Random(seed)
    agents = [(name, lengths(dist, episodes, profile.token_scale, rng)) for name, dist in workload.agents]
    if replicas < len(agents):
        raise ValueError(f"{replicas} replicas cannot give each of {len(agents)} agents one")

    def loads(shares: tuple[int, ...]) -> tuple[AgentLoad, ...]:
        first = [agent_step_s(profile, name, workload.prompt_tokens, lens, share, episodes)
                 for (name, lens), share in zip(agents, shares, strict=True)]
        slowest = max(range(len(first)), key=lambda i: first[i].step_s)
        name, lens = agents[slowest]
        out = list(first)
        out[slowest] = agent_step_s(profile, name, workload.prompt_tokens, lens, shares[slowest],
                                    max(episodes, in_flight_episodes))
        return tuple(out)

    base, extra = divmod(replicas, len(agents))
    fixed = loads(tuple(base + (1 if i < extra else 0) for i in range(len(agents))))
    candidates = (c for c in itertools.product(range(1, replicas + 1), repeat=len(agents)) if sum(c) == replicas)
    best = min((loads(c) for c in candidates), key=lambda ls: max(load.step_s for load in ls))
    spread = sum(agent_step_s(profile, name, workload.prompt_tokens, lens, 1, 10**9).replica_s for name, lens in agents)
    return AssignmentEstimate(fixed, best, spread / replicas)


def describe(estimate: AssignmentEstimate, in_flight_episodes: int) -> str:
    """The estimate as printed by ``benchmarks.run --estimate-only``."""

    def shares(loads: tuple[AgentLoad, ...]) -> str:
        return ", ".join(f"{load.agent} {load.replicas} ({load.step_s:.1f} s, batch {load.batch:.0f}"
                         f"/{load.full_batch:.0f})" for load in loads)

    slowest = max(estimate.best, key=lambda load: load.step_s)
    return (
        f"replica shares at steady state, {in_flight_episodes} episodes in flight (device model only, not run): "
        f"fixed equal shares {estimate.fixed_step_s:.1f} s [{shares(estimate.fixed)}]; best whole-replica "
        f"assignment {estimate.best_step_s:.1f} s [{shares(estimate.best)}] = fixed / best {estimate.ratio:.2f}x; "
        f"perfect spread {estimate.spread_s:.1f} s (fixed / spread {estimate.fixed_step_s / estimate.spread_s:.2f}x); "
        f"the slowest agent's sequence takes {slowest.latency_s:.1f} s at its batch "
        f"({slowest.latency_s / estimate.best_step_s:.1f} best steps)"
    )
