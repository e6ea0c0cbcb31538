"""Which replica served an affinity key last, with the reverse indexes that make forgetting O(keys forgotten).

The balancer (:mod:`rolloutd.balancer`) remembers, per episode or group key, the replica that served
it (KV prefix reuse), up to a bound, least recently used dropped first. It forgets a replica's keys
when its weights change or it dies, and a task's keys when the task is done: per weight load and
per finished task. A scan of every key for those (up to 100,000) was the cost; the two reverse
indexes here (replica -> its keys, task -> its keys) make each O(the keys it drops).
"""

from __future__ import annotations

import collections

from flexmarl.errors import InvalidArgument

SEPARATOR = "#"


def group_affinity_key(task_id: str) -> str:
    """Affinity key of a rollout task's group (used by its coalesced first-turn request)."""
    return task_id


def episode_affinity_key(task_id: str, sample_index: int) -> str:
    """Affinity key of one episode; falls back to its group's key when not seen yet."""
    return f"{task_id}{SEPARATOR}{sample_index}"


def affinity_parent(key: str) -> str:
    """The key an affinity lookup falls back to ("" when there is none)."""
    head, sep, _ = key.rpartition(SEPARATOR)
    return head if sep else ""


def _task_of(key: str) -> str:
    """The task a key belongs to: its part before the first separator (episode keys are ``task#sample``)."""
    return key.partition(SEPARATOR)[0]


class AffinityMap:
    """Affinity key -> replica id, least recently remembered first, bounded."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise InvalidArgument("max_keys must be >= 1")
        self._max_keys = max_keys
        self._replica_of: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._keys_of_replica: dict[str, set[str]] = {}
        self._keys_of_task: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._replica_of)

    def get(self, key: str) -> str | None:
        """The replica that served ``key`` last (None: not remembered)."""
        return self._replica_of.get(key)

    def items(self) -> list[tuple[str, str]]:
        """(key, replica id) pairs, least recently remembered first."""
        return list(self._replica_of.items())

    def remember(self, key: str, replica_id: str) -> None:
        """``replica_id`` served ``key`` now; the least recently remembered key goes past the bound."""
        replica_of = self._replica_of
        old = replica_of.get(key)
        if old is not None:  # a kept key (an episode's next turn): its task holds it, the count stays
            if old != replica_id:
                self._discard(self._keys_of_replica, old, key)
                replica_of[key] = replica_id
                self._keys_of_replica.setdefault(replica_id, set()).add(key)
            replica_of.move_to_end(key)
            return
        replica_of[key] = replica_id
        self._keys_of_replica.setdefault(replica_id, set()).add(key)
        self._keys_of_task.setdefault(_task_of(key), set()).add(key)
        while len(replica_of) > self._max_keys:
            self._drop(next(iter(replica_of)))

    def forget_replica(self, replica_id: str) -> None:
        """Drops every key ``replica_id`` served (its KV cache is gone)."""
        for key in list(self._keys_of_replica.get(replica_id, ())):
            self._drop(key)

    def forget_tree(self, key: str) -> None:
        """Drops ``key`` and its descendants (``key#...``)."""
        prefix = key + SEPARATOR
        for stale in [k for k in self._keys_of_task.get(_task_of(key), ()) if k == key or k.startswith(prefix)]:
            self._drop(stale)

    def _drop(self, key: str) -> None:
        replica_id = self._replica_of.pop(key)
        self._discard(self._keys_of_replica, replica_id, key)
        self._discard(self._keys_of_task, _task_of(key), key)

    @staticmethod
    def _discard(index: dict[str, set[str]], owner: str, key: str) -> None:
        keys = index.get(owner)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del index[owner]

    def check(self) -> None:
        """Raises AssertionError unless both reverse indexes equal a recount (tests)."""
        by_replica: dict[str, set[str]] = {}
        by_task: dict[str, set[str]] = {}
        for key, replica_id in self._replica_of.items():
            by_replica.setdefault(replica_id, set()).add(key)
            by_task.setdefault(_task_of(key), set()).add(key)
        if by_replica != self._keys_of_replica or by_task != self._keys_of_task:
            raise AssertionError("affinity reverse indexes disagree with the keys")
