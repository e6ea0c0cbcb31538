"""The hierarchical balancer's inter-agent level: which replicas move to which model group.

Replicas are assigned to *model groups* (the agents that share one ``model_key`` can be served by
the same replica without a weight load) so that the estimated time to drain each group's
outstanding token demand is balanced, i.e. replicas follow demand in proportion. A move costs a
weight load (the balancer's ``reassignment_cost_s``) plus the time to drain the donor replica; a
donor whose group hands its generations on (:meth:`Assignments.evicts`: partial-rollout agents in
rolloutd, whose generations are aborted and resumed elsewhere with their tokens) costs the load alone. A
rebalance plans greedy moves, each shortening the current bottleneck, and makes them only if
together they cut the largest estimated drain time by more than the hysteresis margin (a per-move
margin would never grow a group of nine or more: one replica more shortens a group of n by at most
1/(n+1)); and only once every rebalance has wanted them for as long as they cost, drain and load
(``BalancerConfig.move_patience``, ski rental: :mod:`rolloutd.move_patience`). A group with
demand never loses its last replica, and a group that has demand but no replica gets one at the
next rebalance regardless of hysteresis.

:class:`ReplicaPlanner` decides; the replicas, their group index and what a move does to them stay
the balancer's (:class:`rolloutd.balancer.HierarchicalBalancer`, through :class:`Assignments`). A
plan is made by moving replicas one by one, each move seeing the group rates the ones before it
left, and is undone replica by replica when it is not worth its cost or not yet ripe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from rolloutd.balancer_state import GroupIndex, ReplicaState, SavedAssignment
from rolloutd.balancer_types import BalancerConfig, ReplicaMove
from rolloutd.move_patience import DrainTimes, MovePatience

#: A donor's rank (lower is better): its group's drain time without it, minus the group's now, its
#: outstanding tokens, its id.
DonorScore = tuple[float, float, int, str]


class Assignments(Protocol):
    """What the planner reads and changes of the balancer's replicas (HierarchicalBalancer implements it)."""

    @property
    def model_keys(self) -> tuple[str, ...]:
        """The model groups balanced, sorted."""

    @property
    def reassignment_cost_s(self) -> float:
        """The estimated seconds of one weight load."""

    def groups(self) -> GroupIndex:
        """The group index, up to date."""

    def replica_states(self) -> Collection[ReplicaState]:
        """Every replica."""

    def has_replica(self, model_key: str) -> bool:
        """Whether a replica serves or moves to ``model_key``."""

    def evicts(self, model_key: str) -> bool:
        """Whether a replica moved away from ``model_key`` hands its generations on instead of draining them."""

    def rate_in(self, replica: ReplicaState, model_key: str) -> float:
        """The rate ``replica`` is expected to deliver serving ``model_key``."""

    def move(self, replica: ReplicaState, to_model_key: str, now_s: float) -> ReplicaMove:
        """Moves ``replica`` to ``to_model_key`` now (it drains, then awaits its load)."""

    def undo_move(self, replica: ReplicaState, saved: SavedAssignment) -> None:
        """Undoes a :meth:`move` not made: ``replica`` is as ``saved`` again."""


@dataclasses.dataclass(frozen=True)
class PlannedMove:
    """A move of a plan, what undoing it restores, and its estimated cost (drain and load, seconds)."""

    move: ReplicaMove
    replica: ReplicaState
    saved: SavedAssignment
    cost_s: float


def drain_time_s(demand_tokens: float, rate_tokens_per_s: float) -> float:
    """Seconds to serve ``demand_tokens`` at ``rate_tokens_per_s`` (inf: demand and no rate)."""
    if demand_tokens <= 0:
        return 0.0
    return math.inf if rate_tokens_per_s <= 0 else demand_tokens / rate_tokens_per_s


class ReplicaPlanner:
    """Plans and makes the inter-agent moves of one balancer (see module doc)."""

    def __init__(self, config: BalancerConfig, replicas: Assignments) -> None:
        self._config = config
        self._replicas = replicas
        #: Measured drains per group left, and their priors (:class:`~rolloutd.move_patience.DrainTimes`).
        self.drains = DrainTimes()
        self._patience = MovePatience(config.move_patience)
        #: Within one plan: the best donor of each (group, require_spare) not touched by a move since.
        self._donor_memo: dict[tuple[str, bool], tuple[DonorScore, ReplicaState | None]] | None = None

    def plan(self, demand: Mapping[str, int], now_s: float) -> list[ReplicaMove]:
        """Decides replica moves now; moved replicas start draining (see ReplicaPhase).

        First every group with demand and no replica takes one from the group that loses least (never a group's
        last replica while that group has demand); then, unless ``rebalance_enabled`` is False (static), the moves
        that cut the largest drain time.
        """
        moves: list[ReplicaMove] = []
        self._donor_memo = {}
        try:
            for model_key in self._replicas.model_keys:
                if demand[model_key] > 0 and not self._replicas.has_replica(model_key):
                    donor = self._pick_donor(demand, exclude=model_key, now_s=now_s, require_spare=True)
                    if donor is not None:
                        moves.append(self._move(donor, model_key, now_s))
            if not self._config.rebalance_enabled:
                return moves
            return moves + self._improving_plan(demand, now_s)
        finally:
            self._donor_memo = None

    def _improving_plan(self, demand: Mapping[str, int], now_s: float) -> list[ReplicaMove]:
        """Greedy moves, each shortening the bottleneck; kept only if together they beat the hysteresis.

        The margin applies to the whole plan, not to each move: one more replica shortens a
        group of n by at most 1/(n+1), so a per-move margin of 10 % would never let a group of
        nine or more grow, however skewed the demand.
        """
        model_keys = self._replicas.model_keys
        rates = dict(self._replicas.groups().rates)
        before_s = max((drain_time_s(demand[key], rates[key]) for key in model_keys if demand[key] > 0), default=0.0)
        if before_s <= 0 or math.isinf(before_s):
            self._patience.forget()
            return []
        self.drains.note_ongoing(now_s, ((r.model_key, r.draining_since_s) for r in self._replicas.replica_states()
                                         if r.draining_since_s is not None))
        after_s: dict[str, float] = {}
        planned: list[PlannedMove] = []
        for _ in range(len(self._replicas.replica_states())):
            found = self._best_improving_move(demand, now_s, after_s)
            if found is None:
                break
            planned.append(found)
        rates = dict(self._replicas.groups().rates)
        final_s = max(after_s.get(key, drain_time_s(demand[key], rates[key])) for key in model_keys)
        if not planned or final_s > before_s * (1.0 - self._config.hysteresis):
            self._patience.forget()  # not worth it
        else:
            wanted_cost_s: dict[str, float] = {}
            for step in planned:
                key = step.move.to_model_key
                wanted_cost_s[key] = max(step.cost_s, wanted_cost_s.get(key, 0.0))
            touched = {key for step in planned for key in (step.move.from_model_key, step.move.to_model_key)}
            if self._patience.ripe(wanted_cost_s, now_s, touched):
                return [step.move for step in planned]
        for step in reversed(planned):
            self._replicas.undo_move(step.replica, step.saved)
        return []

    def _best_improving_move(self, demand: Mapping[str, int], now_s: float,
                             after_s: dict[str, float]) -> PlannedMove | None:
        """The next move that shortens the current bottleneck, with what undoing it needs and its cost (s).

        ``after_s`` collects each touched group's estimated drain time after the moves so far
        (a receiving group's includes the weight load and the donor's drain).
        """
        index = self._replicas.groups()
        rates = index.rates  # read before this move changes them
        # The group with demand that drains last (the larger key on a tie), in one pass (a rebalance asks per move).
        bottleneck: str | None = None
        before_s = -math.inf
        model_keys = self._replicas.model_keys
        for key in model_keys:
            key_demand = demand[key]
            if key_demand <= 0:
                continue
            key_s = after_s.get(key)
            if key_s is None:
                key_s = drain_time_s(key_demand, rates[key])
            if key_s >= before_s:  # keys ascend: on a tie the later (larger) key wins, as max over (s, key)
                bottleneck, before_s = key, key_s
        if bottleneck is None or math.isinf(before_s):
            return None  # nothing to do, or a starved group the first pass could not serve
        donor = self._pick_donor(demand, exclude=bottleneck, now_s=now_s, require_spare=True)
        if donor is None:
            return None
        donor_rate = donor.tokens_per_s
        donor_key = donor.target_model_key
        if self._replicas.evicts(donor.model_key):
            drain_s = 0.0  # its generations go on elsewhere in its group, with their tokens so far
        else:
            drain_s = donor.outstanding_tokens / donor_rate
            if donor.in_flight_requests:  # its last request takes its whole latency, however few tokens are left
                drain_s = max(drain_s, self.drains.estimate_s(donor.model_key))
        cost_s = self._replicas.reassignment_cost_s + drain_s
        bottleneck_rate = rates[bottleneck]
        # Replicas this plan already moved in are loading, not serving, during the cost.
        serving_rate = bottleneck_rate - index.incoming.get(bottleneck, 0.0)
        remaining_after_cost = max(0.0, demand[bottleneck] - max(0.0, serving_rate) * cost_s)
        gained_rate = self._replicas.rate_in(donor, bottleneck)
        bottleneck_after_s = cost_s + remaining_after_cost / (bottleneck_rate + gained_rate)
        donor_after_s = drain_time_s(demand.get(donor_key, 0), rates.get(donor_key, 0.0) - donor_rate)
        if not (bottleneck_after_s < before_s and donor_after_s < before_s):
            return None
        saved = donor.saved()
        move = self._move(donor, bottleneck, now_s)
        after_s[bottleneck] = bottleneck_after_s
        if donor_key in model_keys:
            after_s[donor_key] = max(after_s.get(donor_key, 0.0), donor_after_s)
        return PlannedMove(move, donor, saved, cost_s)

    def _pick_donor(
        self, demand: Mapping[str, int], exclude: str, now_s: float, require_spare: bool
    ) -> ReplicaState | None:
        """The movable replica whose group suffers least from losing it.

        The best of each group (by the group it serves now) is kept for the rest of a plan
        (``_donor_memo``) until a move touches that group: a plan of many moves is not O(replicas) each.
        """
        best: DonorScore | None = None
        best_replica: ReplicaState | None = None
        index = self._replicas.groups()
        for key, serving in index.serving.items():
            if key == exclude or not serving:
                continue
            memo = self._donor_memo
            found = memo.get((key, require_spare)) if memo is not None else None
            if found is None:
                found = self._group_donor(index, key, serving, demand, now_s, require_spare)
                if memo is not None:
                    memo[(key, require_spare)] = found
            score, replica = found
            if replica is not None and (best is None or score < best):
                best, best_replica = score, replica
        return best_replica

    def _group_donor(self, index: GroupIndex, key: str, serving: Sequence[ReplicaState], demand: Mapping[str, int],
                     now_s: float, require_spare: bool) -> tuple[DonorScore, ReplicaState | None]:
        """The best donor among the replicas serving ``key`` (see :meth:`_pick_donor`), with its score."""
        best: DonorScore = (math.inf, math.inf, 0, "")
        best_replica: ReplicaState | None = None
        for replica in serving:
            replica_id = replica.spec.replica_id
            if key not in index.counts:  # serving a model no agent uses: always free to take
                score: DonorScore = (-1.0, 0.0, replica.outstanding_tokens, replica_id)
            else:
                if now_s - replica.last_move_s < self._config.min_residency_s:
                    continue
                if require_spare and demand[key] > 0 and index.counts[key] <= 1:
                    continue  # a group with demand keeps its last replica
                rate = index.rates[key]
                after_s = drain_time_s(demand[key], rate - replica.tokens_per_s)
                score = (after_s, -drain_time_s(demand[key], rate), replica.outstanding_tokens, replica_id)
            if best_replica is None or score < best:
                best, best_replica = score, replica
        return best, best_replica

    def _move(self, replica: ReplicaState, to_model_key: str, now_s: float) -> ReplicaMove:
        """The balancer's move, and the donors it may have changed forgotten for the rest of the plan."""
        touched = (replica.model_key, replica.target_model_key, to_model_key)
        move = self._replicas.move(replica, to_model_key, now_s)
        if self._donor_memo is not None:
            for key in touched:
                self._donor_memo.pop((key, True), None)
                self._donor_memo.pop((key, False), None)
        return move


__all__ = ["Assignments", "DonorScore", "PlannedMove", "ReplicaPlanner", "drain_time_s"]
