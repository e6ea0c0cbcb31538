"""The hierarchical balancer's replicas and the group index it derives from them (:mod:`rolloutd.balancer`).

Pure state, no policy: each replica's phase, groups, load and rate (:class:`ReplicaState`), and
the per-group sums and lists the balancer would otherwise recount on every request
(:class:`GroupIndex`), patched by each change instead of rebuilt.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import heapq
import math
from collections.abc import Iterable, Mapping


class ReplicaPhase(enum.Enum):
    """Where a replica is in its serve → drain → load cycle."""

    SERVING = "serving"
    DRAINING = "draining"  # reassigned; finishing in-flight requests of its old group
    AWAITING_LOAD = "awaiting-load"  # drained; the caller must load the new group's weights
    LOADING = "loading"  # the caller is loading weights


@dataclasses.dataclass(frozen=True)
class ReplicaAssignment:
    """An engine replica and the model group it serves at start."""

    replica_id: str
    model_key: str
    tokens_per_s: float = 1000.0


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """Read-only state of one replica (status RPC, metrics, tests)."""

    replica_id: str
    model_key: str
    phase: ReplicaPhase
    target_model_key: str
    outstanding_tokens: int
    in_flight_requests: int
    #: Adapter names with requests running on the replica (each holds one adapter slot), sorted.
    adapters: tuple[str, ...] = ()
    #: The rate the balancer counts for it (configured, measured, or predicted for its target group).
    tokens_per_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SavedAssignment:
    """What a planned move changes of a replica (:meth:`ReplicaState.saved`), kept to undo it."""

    target_model_key: str
    last_move_s: float
    phase: ReplicaPhase
    tokens_per_s: float
    draining_since_s: float | None


@dataclasses.dataclass
class ReplicaState:
    """One replica as the balancer keeps it."""

    spec: ReplicaAssignment
    model_key: str
    target_model_key: str
    tokens_per_s: float
    phase: ReplicaPhase = ReplicaPhase.SERVING
    outstanding_tokens: int = 0
    in_flight_requests: int = 0
    #: KV-cache tokens its requests in flight reserve, and how many it holds (inf: not known).
    kv_tokens: int = 0
    kv_capacity_tokens: float = math.inf
    last_move_s: float = -math.inf
    #: When a move left it draining requests (its drain is measured at its load), else None.
    draining_since_s: float | None = None
    #: Adapter name (Ticket.adapter) -> its requests in flight here.
    adapter_requests: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def saved(self) -> SavedAssignment:
        """What a move changes of it, to put back if the move is not made (:meth:`restore`)."""
        return SavedAssignment(self.target_model_key, self.last_move_s, self.phase, self.tokens_per_s,
                               self.draining_since_s)

    def restore(self, saved: SavedAssignment) -> None:
        """Puts back what :meth:`saved` kept (the caller re-derives its group index)."""
        self.target_model_key, self.last_move_s, self.phase = saved.target_model_key, saved.last_move_s, saved.phase
        self.tokens_per_s, self.draining_since_s = saved.tokens_per_s, saved.draining_since_s

    def view(self) -> ReplicaView:
        """Its read-only state."""
        return ReplicaView(
            replica_id=self.spec.replica_id,
            model_key=self.model_key,
            phase=self.phase,
            target_model_key=self.target_model_key,
            outstanding_tokens=self.outstanding_tokens,
            in_flight_requests=self.in_flight_requests,
            adapters=tuple(sorted(self.adapter_requests)),
            tokens_per_s=self.tokens_per_s,
        )


def _remove(replicas: list[ReplicaState], replica: ReplicaState) -> None:
    """Removes ``replica`` itself from the list (by identity: dataclass equality compares every field)."""
    del replicas[next(i for i, r in enumerate(replicas) if r is replica)]


@dataclasses.dataclass
class GroupIndex:
    """What HierarchicalBalancer derives from its replicas' groups and phases, valid for one epoch.

    A move (``_move``) patches the groups it touches instead of a rebuild (rebalancing plans many).
    """

    epoch: int
    counts: dict[str, int]  # replicas serving or moving to each model group (target)
    rates: dict[str, float]  # their tokens_per_s (summed in replica id order)
    serving: dict[str, list[ReplicaState]]  # SERVING replicas by the group they serve now, in replica id order
    targets: dict[str, list[ReplicaState]]  # replicas by target group, in replica id order
    incoming: dict[str, float]  # tokens_per_s of the replicas moving to each group (target, not yet serving it)
    # Per group, built on first use: (min-heap of (outstanding tokens, replica id), max-heap of (-tokens, id)) of
    # its SERVING replicas; an entry whose replica no longer serves the group with those tokens is stale (skipped).
    loads: dict[str, tuple[list[tuple[int, str]], list[tuple[int, str]]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(cls, epoch: int, model_keys: Iterable[str], replicas: Iterable[ReplicaState]) -> GroupIndex:
        """The index of ``replicas`` (in replica id order) over the groups ``model_keys``."""
        counts = dict.fromkeys(model_keys, 0)
        rates = dict.fromkeys(counts, 0.0)
        serving: dict[str, list[ReplicaState]] = {}
        targets: dict[str, list[ReplicaState]] = {}
        incoming: dict[str, float] = {}
        for replica in replicas:
            target = replica.target_model_key
            targets.setdefault(target, []).append(replica)
            if target in counts:
                counts[target] += 1
                rates[target] += replica.tokens_per_s
            if target != replica.model_key:
                incoming[target] = incoming.get(target, 0) + replica.tokens_per_s
            if replica.phase is ReplicaPhase.SERVING:
                serving.setdefault(replica.model_key, []).append(replica)
        return cls(epoch, counts, rates, serving, targets, incoming)

    def extremes(self, model_key: str, replicas: Mapping[str, ReplicaState],
                 scan_max: int) -> tuple[ReplicaState, int, int] | None:
        """The group's least loaded serving replica (first in id order on ties), its load and the most loaded's.

        A group of up to ``scan_max`` replicas is read in one pass; a larger one from its load heaps
        (O(log group)), which every load change of its replicas then keeps (:meth:`push_load`). None:
        no replica serves the group.
        """
        serving = self.serving.get(model_key)
        if not serving:
            return None
        if len(serving) <= scan_max:
            # Cheaper than two heap entries per load change: a rolloutd's 64 replicas over its agents make
            # groups of a few replicas. The same answer as the heaps'.
            self.loads.pop(model_key, None)  # no heaps to keep while the group is read by a scan
            least = serving[0]
            low = high = least.outstanding_tokens
            for replica in serving:
                tokens = replica.outstanding_tokens
                if tokens < low:
                    least, low = replica, tokens
                elif tokens > high:
                    high = tokens
            return least, low, high
        heaps = self.loads.get(model_key)
        if heaps is None:
            low_heap = [(r.outstanding_tokens, r.spec.replica_id) for r in serving]
            high_heap = [(-r.outstanding_tokens, r.spec.replica_id) for r in serving]
            heapq.heapify(low_heap)
            heapq.heapify(high_heap)
            heaps = self.loads[model_key] = (low_heap, high_heap)
        low_heap, high_heap = heaps

        def current(tokens: int, replica_id: str) -> bool:
            replica = replicas.get(replica_id)
            return (replica is not None and replica.phase is ReplicaPhase.SERVING and replica.model_key == model_key
                    and replica.outstanding_tokens == tokens)

        while not current(*low_heap[0]):
            heapq.heappop(low_heap)
        while not current(-high_heap[0][0], high_heap[0][1]):
            heapq.heappop(high_heap)
        return replicas[low_heap[0][1]], low_heap[0][0], -high_heap[0][0]

    def push_load(self, replica: ReplicaState) -> None:
        """A SERVING replica's outstanding tokens changed (or it began serving): a fresh entry in its group's heaps."""
        heaps = self.loads.get(replica.model_key)
        if heaps is None:
            return
        low, high = heaps
        if len(low) > 2 * len(self.serving.get(replica.model_key, ())) + 64:  # mostly stale: rebuild
            del self.loads[replica.model_key]
            return
        heapq.heappush(low, (replica.outstanding_tokens, replica.spec.replica_id))
        heapq.heappush(high, (-replica.outstanding_tokens, replica.spec.replica_id))

    def serve(self, replica: ReplicaState) -> None:
        """``replica`` (now SERVING its target group) joins its group's serving list."""
        bisect.insort(self.serving.setdefault(replica.model_key, []), replica, key=lambda r: r.spec.replica_id)
        key = replica.model_key
        self.incoming[key] = sum(r.tokens_per_s for r in self.targets.get(key, ()) if r.model_key != key)
        self.push_load(replica)

    def retarget(self, replica: ReplicaState, old_target: str, was_serving: bool) -> None:
        """``replica`` moved from ``old_target`` to its ``target_model_key`` (and left SERVING if it was)."""
        if was_serving:
            _remove(self.serving[replica.model_key], replica)
        _remove(self.targets[old_target], replica)
        bisect.insort(self.targets.setdefault(replica.target_model_key, []), replica,
                      key=lambda r: r.spec.replica_id)
        for key in (old_target, replica.target_model_key):
            self.recount(key)

    def spare_of_fullest(self, low: str) -> ReplicaState | None:
        """The least loaded replica not loading of the fullest group holding two more than ``low`` (None: none).

        Groups by most replicas, then key; a group whose every replica is loading is passed over.
        """
        for key in sorted(self.counts, key=lambda k: (-self.counts[k], k)):
            if self.counts[key] - self.counts[low] <= 1:
                return None
            movable = [r for r in self.targets.get(key, ()) if r.phase is not ReplicaPhase.LOADING]
            if movable:
                return min(movable, key=lambda r: (r.outstanding_tokens, r.spec.replica_id))
        return None

    def recount(self, key: str) -> None:
        """Group ``key``'s count and rate sums from its members (one joined or left, or a member's rate changed)."""
        members = self.targets.get(key, [])
        if key in self.counts:
            self.counts[key] = len(members)
            self.rates[key] = sum(r.tokens_per_s for r in members)
        self.incoming[key] = sum(r.tokens_per_s for r in members if r.model_key != key)
