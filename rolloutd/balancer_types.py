"""The hierarchical balancer's value types, its configuration and its token estimator (:mod:`rolloutd.balancer`).

Pure data and arithmetic, no balancer state: :class:`BalancerConfig` (both levels' tunables), the
:class:`AgentSpec` / :class:`Ticket` / :class:`ReplicaMove` values the balancer takes and returns,
:class:`TokenEstimator` (a request's expected token cost) and :func:`equal_split` (the initial and
static assignment). :mod:`rolloutd.balancer` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence

from flexmarl.errors import InvalidArgument
from rolloutd.balancer_state import ReplicaAssignment


class RoutingPolicy(enum.Enum):
    """Intra-agent routing policy."""

    LEAST_TOKENS = "least-tokens"  # least outstanding estimated tokens + episode affinity
    ROUND_ROBIN = "round-robin"  # load-oblivious baseline



@dataclasses.dataclass(frozen=True)
class BalancerConfig:
    """Tunables of both balancing levels.

    Attributes:
        balance_abs_threshold_tokens: intra-agent imbalance needs max - min load above this.
        balance_rel_threshold: intra-agent imbalance also needs max > this × min load.
        routing: intra-agent policy.
        rebalance_enabled: False keeps the initial replica assignment (static), except that a group with
            queued requests and no replica takes one from a group without demand: a static share that gave
            a group nothing (more groups than replicas, e.g. a pinned evaluation round's keys beside the
            jobs') would otherwise leave its requests waiting forever.
        rebalance_interval_s: minimum time between inter-agent re-evaluations.
        reassignment_cost_s: estimated time of one weight load on a replica (while ``measured_rates``,
            the prior: the caller's measured loads replace it, :meth:`HierarchicalBalancer.set_reassignment_cost_s`).
        hysteresis: a rebalance's moves, together, must cut the largest group's estimated
            drain time by at least this fraction (after counting the moves' cost).
        min_residency_s: a replica that was moved stays put at least this long.
        move_patience: a planned move into a group is made once every rebalance has wanted it for this
            multiple of the move's estimated cost, drain and load (ski rental, :mod:`rolloutd.move_patience`);
            0: at once.
        move_evicts: a replica moved away from a group whose generations can go on elsewhere (rolloutd:
            a partial-rollout agent's, :meth:`HierarchicalBalancer.set_evicting_groups`) has them aborted
            and resumed on the group's other replicas with their tokens, and loads at once: the planner
            counts such a donor's move at its weight load, not its drain. False (the default: measured no
            faster on `shifting` and `saturating`, docs/benchmarks.md): every donor drains.
        max_affinity_keys: bound on remembered affinity keys (least recently used dropped).
        measured_rates: replica rates are measured deliveries (rolloutd's :mod:`rolloutd.replica_rates`,
            through :meth:`HierarchicalBalancer.set_replica_rate`), which depend on the load a group
            gives its replicas: a moved replica is predicted to deliver its new group's mean rate per
            replica. False: the rates are the configured ``ReplicaAssignment.tokens_per_s``, each a
            property of its replica, which a move carries along, and rolloutd measures nothing (the
            behaviour before measured rates).
        prior_tokens_per_s: a replica's tokens/s before one is measured (rolloutd's assignments).
        dispatch_kv_factor: > 0: a replica with a known KV capacity takes a request only while its
            requests' reserved KV tokens, the new one's included, stay within this factor of that
            capacity (one request always runs on an idle replica); the rest wait in the balancer's
            queue (see the module doc). 0: every request goes to a replica at once, which queues
            what it cannot batch.
    """

    balance_abs_threshold_tokens: int = 64
    balance_rel_threshold: float = 1.5
    routing: RoutingPolicy = RoutingPolicy.LEAST_TOKENS
    rebalance_enabled: bool = True
    rebalance_interval_s: float = 5.0
    reassignment_cost_s: float = 10.0
    hysteresis: float = 0.1
    min_residency_s: float = 0.0
    move_patience: float = 1.0
    move_evicts: bool = False
    max_affinity_keys: int = 100_000
    measured_rates: bool = True
    prior_tokens_per_s: float = 1000.0
    dispatch_kv_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.balance_abs_threshold_tokens < 0:
            raise InvalidArgument("balance_abs_threshold_tokens must be >= 0")
        if self.balance_rel_threshold < 1.0:
            raise InvalidArgument("balance_rel_threshold must be >= 1")
        if (self.rebalance_interval_s < 0 or self.reassignment_cost_s < 0 or self.min_residency_s < 0
                or not 0 <= self.move_patience < math.inf):
            raise InvalidArgument("intervals and costs must be >= 0")
        if not 0.0 <= self.hysteresis < 1.0:
            raise InvalidArgument("hysteresis must be in [0, 1)")
        if self.max_affinity_keys < 1:
            raise InvalidArgument("max_affinity_keys must be >= 1")
        if not self.prior_tokens_per_s > 0:
            raise InvalidArgument("prior_tokens_per_s must be > 0")
        if not 0.0 <= self.dispatch_kv_factor < math.inf:
            raise InvalidArgument("dispatch_kv_factor must be finite and >= 0")



@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """An agent (rolloutd uses "job/agent") and its model group.

    ``adapter``: the agent is a LoRA adapter over its group's base (the group is the base's
    replica pool; each request takes one of its replica's adapter slots).
    """

    agent: str
    model_key: str
    adapter: bool = False


@dataclasses.dataclass(frozen=True)
class Ticket:
    """One generation request; ``replica_id`` is None while it waits for a replica.

    ``adapter``: the adapter name a LoRA agent's request holds a slot of its replica for (None: a
    full-model agent's request). ``kv_tokens``: the KV-cache tokens its samples reserve on a replica.
    """

    request_id: int
    agent: str
    estimated_tokens: int
    affinity_key: str
    replica_id: str | None
    adapter: str | None = None
    kv_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class ReplicaMove:
    """A reassignment decided by the inter-agent level."""

    replica_id: str
    from_model_key: str
    to_model_key: str


class TokenEstimator:
    """Estimates a request's token cost from the agent's observed response lengths.

    Estimate = prefill_token_weight × prompt tokens + n × expected response tokens, where the
    expected response is an exponential moving average of observed lengths (capped by
    max_new_tokens) that starts at the first request's max_new_tokens. Starting pessimistic
    matters: the first responses to finish are the short ones, and an average seeded by them
    would make long-tailed agents look cheap and pile requests onto one replica.
    """

    def __init__(self, prefill_token_weight: float = 0.1, ema_alpha: float = 0.05) -> None:
        if prefill_token_weight < 0 or not 0.0 < ema_alpha <= 1.0:
            raise InvalidArgument("prefill_token_weight must be >= 0 and ema_alpha in (0, 1]")
        self._prefill_token_weight = prefill_token_weight
        self._ema_alpha = ema_alpha
        self._mean_response_tokens: dict[str, float] = {}

    def expected_response_tokens(self, agent: str, max_new_tokens: int) -> float:
        """Expected generated tokens of one sample."""
        mean = self._mean_response_tokens.setdefault(agent, float(max_new_tokens))
        return min(mean, float(max_new_tokens))

    def estimate(self, agent: str, prompt_tokens: int, max_new_tokens: int, n: int = 1) -> int:
        """Estimated tokens of one request producing n samples from one prompt."""
        cap = float(max_new_tokens)  # expected_response_tokens, inlined (asked for every request)
        response = min(self._mean_response_tokens.setdefault(agent, cap), cap)
        return max(1, math.ceil(self._prefill_token_weight * prompt_tokens + n * response))

    def observe(self, agent: str, response_tokens: int) -> None:
        """Records the actual length of one generated sample."""
        mean = self._mean_response_tokens.get(agent, float(response_tokens))
        self._mean_response_tokens[agent] = (1 - self._ema_alpha) * mean + self._ema_alpha * response_tokens


def equal_split(
    replica_ids: Sequence[str], model_keys: Iterable[str], tokens_per_s: float = 1000.0
) -> list[ReplicaAssignment]:
    """Initial (and static baseline) assignment: replicas dealt to model groups in turn."""
    keys = sorted(set(model_keys))
    if not keys:
        raise InvalidArgument("no model groups to assign replicas to")
    return [ReplicaAssignment(r, keys[i % len(keys)], tokens_per_s) for i, r in enumerate(replica_ids)]


def split_keeping_loaded(loaded: Mapping[str, str], model_keys: Sequence[str]) -> dict[str, str]:
    """:func:`equal_split`'s shares, each replica kept on the group it holds (``loaded``) where the shares allow.

    ``loaded`` maps every replica to the model it holds now ("" or a group not in ``model_keys``:
    none of them); a replica kept needs no weight load. Returns each replica's group.
    """
    split = equal_split(list(loaded), model_keys)
    counts = {key: sum(1 for s in split if s.model_key == key) for key in model_keys}
    assigned: dict[str, str] = {}
    for replica_id, key in loaded.items():
        if counts.get(key, 0) > 0:
            assigned[replica_id] = key
            counts[key] -= 1
    free = [key for key in model_keys for _ in range(counts[key])]
    for replica_id in loaded:
        if replica_id not in assigned:
            assigned[replica_id] = free.pop(0) if free else model_keys[0]
    return assigned
