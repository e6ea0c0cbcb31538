"""Leases: time-bounded grants of a piece of work (a rollout task, a micro-batch) to one worker.

A lease is active until it is released (its work was reported), expired (its
deadline passed) or revoked (its holder died). Only an active lease held by the
caller may be renewed, reported or acked; a lease that ended is remembered so
that a late report gets FAILED_PRECONDITION ("expired") rather than NOT_FOUND
("never existed"), until the planner forgets it (:meth:`LeaseTable.forget`).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Callable, Hashable, Iterable

from flexmarl.errors import FailedPrecondition, NotFound


class LeaseKind(enum.Enum):
    """What a lease grants."""

    ROLLOUT_TASK = "task"
    MICRO_BATCH = "mb"
    WARM_START = "warm"
    EVAL_TASK = "eval"


class LeaseStatus(enum.Enum):
    """Lifecycle of one lease."""

    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"
    REVOKED = "revoked"


@dataclasses.dataclass
class Lease:
    """One grant. ``subject`` names the work (task id, step id + micro-batch index, or a warm start's agent)."""

    lease_id: str
    kind: LeaseKind
    holder: str
    subject: str
    timeout_s: float
    deadline_s: float
    status: LeaseStatus = LeaseStatus.ACTIVE
    end_reason: str = ""
    #: The holder's last reported progress (a count that only grows) and when it last grew (issue time at first).
    progress: int = 0
    progress_at_s: float = 0.0

    def stalled_s(self, now_s: float) -> float:
        """Seconds since this lease's work last showed progress."""
        return now_s - self.progress_at_s


class LeaseTable:
    """Every lease of one job, with expiry by deadline."""

    def __init__(self, now_s: Callable[[], float], id_prefix: str,
                 group_of: Callable[[Lease], Hashable | None] | None = None) -> None:
        """A table issuing ids ``<id_prefix><kind>-<n>``.

        ``group_of``: the group a lease is filed under at issue (None: none), which
        :meth:`forget_group` forgets at once, reading only that group's leases.
        """
        self._now_s = now_s
        self._id_prefix = id_prefix
        self._group_of = group_of
        self._groups: dict[Hashable, list[str]] = {}
        self._next_number = 0
        self._leases: dict[str, Lease] = {}
        # The active leases by kind, in issue order (what active(kind) reads: O(active), not O(every lease kept)).
        self._active: dict[LeaseKind, dict[str, Lease]] = {kind: {} for kind in LeaseKind}
        # Expiry: a min-heap of (deadline, lease id) with one live entry per active lease, the one whose deadline
        # ``_queued`` records. A renewal only moves the lease's deadline later (O(1), no heap entry): due() finds
        # the entry early and queues it again at the lease's deadline then. An ended lease's entry is stale and
        # dropped when it comes up, or when stale entries outnumber live ones (the heap is rebuilt).
        self._deadlines: list[tuple[float, str]] = []
        self._queued: dict[str, float] = {}

    def issue(self, kind: LeaseKind, holder: str, subject: str, timeout_s: float) -> Lease:
        """Grants a new lease that ends ``timeout_s`` from now."""
        self._next_number += 1
        lease_id = f"{self._id_prefix}{kind.value}-{self._next_number}"
        now_s = self._now_s()
        lease = Lease(lease_id, kind, holder, subject, timeout_s, now_s + timeout_s, progress_at_s=now_s)
        self._leases[lease_id] = lease
        self._active[kind][lease_id] = lease
        self._queue(lease)
        if self._group_of is not None:
            group = self._group_of(lease)
            if group is not None:
                self._groups.setdefault(group, []).append(lease_id)
        return lease

    def _queue(self, lease: Lease) -> None:
        self._queued[lease.lease_id] = lease.deadline_s
        heapq.heappush(self._deadlines, (lease.deadline_s, lease.lease_id))
        if len(self._deadlines) > 2 * len(self._queued) + 64:
            self._deadlines = [(deadline_s, lease_id) for lease_id, deadline_s in self._queued.items()]
            heapq.heapify(self._deadlines)

    def get(self, lease_id: str) -> Lease | None:
        """The lease with this id, in any status, or None."""
        return self._leases.get(lease_id)

    def require_active(self, lease_id: str, holder: str, kind: LeaseKind) -> Lease:
        """The active lease ``lease_id`` held by ``holder``.

        Raises:
            NotFound: no such lease (never issued, forgotten, or issued before a restart).
            FailedPrecondition: the lease ended, is held by another worker, or its deadline passed.
        """
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind is not kind:
            raise NotFound(f"lease {lease_id!r} not found")
        if lease.status is not LeaseStatus.ACTIVE:
            raise FailedPrecondition(f"lease {lease_id!r} is no longer held ({lease.status.value}: "
                                     f"{lease.end_reason})")
        if lease.holder != holder:
            raise FailedPrecondition(f"lease {lease_id!r} is held by {lease.holder!r}, not {holder!r}")
        if self._now_s() > lease.deadline_s:
            raise FailedPrecondition(f"lease {lease_id!r} expired")
        return lease

    def renew(self, lease: Lease, now_s: float | None = None) -> float:
        """Extends an active lease by its timeout from now (``now_s``: the caller's reading of this clock)."""
        lease.deadline_s = (self._now_s() if now_s is None else now_s) + lease.timeout_s
        queued_s = self._queued.get(lease.lease_id)
        # Queued again only when due() returned it, or when its deadline moved earlier (a clock set back).
        if lease.status is LeaseStatus.ACTIVE and (queued_s is None or lease.deadline_s < queued_s):
            self._queue(lease)
        return lease.deadline_s

    @staticmethod
    def record_progress(lease: Lease, progress: int, now_s: float) -> None:
        """Notes the holder's progress figure; only a figure above the last one counts as progress."""
        if progress > lease.progress:
            lease.progress = progress
            lease.progress_at_s = now_s

    def end(self, lease: Lease, status: LeaseStatus, reason: str) -> None:
        """Ends a lease (no-op when it already ended)."""
        if lease.status is LeaseStatus.ACTIVE:
            lease.status = status
            lease.end_reason = reason
            self._active[lease.kind].pop(lease.lease_id, None)
            self._queued.pop(lease.lease_id, None)

    def due(self) -> list[Lease]:
        """Active leases whose deadline has passed (not ended here: the caller decides what follows)."""
        now_s = self._now_s()
        found: list[Lease] = []
        while self._deadlines and self._deadlines[0][0] < now_s:
            deadline_s, lease_id = heapq.heappop(self._deadlines)
            if self._queued.get(lease_id) != deadline_s:
                continue  # stale: the lease ended, or an earlier entry replaced this one
            lease = self._leases.get(lease_id)
            if lease is None or lease.status is not LeaseStatus.ACTIVE:
                self._queued.pop(lease_id, None)
                continue
            if lease.deadline_s > deadline_s:
                self._queue(lease)  # renewed since: due at its deadline (it comes up again here if that passed too)
                continue
            del self._queued[lease_id]  # returned once; a renewal queues it again
            found.append(lease)
        return found

    def queued_deadlines(self) -> dict[str, float]:
        """Each active lease's entry in the expiry heap (tests compare them with the leases)."""
        return {lease_id: deadline_s for deadline_s, lease_id in self._deadlines
                if self._queued.get(lease_id) == deadline_s}

    def active(self, kind: LeaseKind | None = None) -> list[Lease]:
        """Active leases, optionally of one kind (in issue order)."""
        if kind is not None:
            return list(self._active[kind].values())
        return [lease for lease in self._leases.values() if lease.status is LeaseStatus.ACTIVE]

    def active_count(self, kind: LeaseKind) -> int:
        """How many leases of ``kind`` are active (O(1))."""
        return len(self._active[kind])

    def all(self) -> list[Lease]:
        """Every remembered lease, in any status."""
        return list(self._leases.values())

    def held_by(self, holder: str) -> list[Lease]:
        """Active leases of one worker."""
        return [lease for lease in self._leases.values()
                if lease.status is LeaseStatus.ACTIVE and lease.holder == holder]

    def group(self, group: Hashable) -> list[str]:
        """The ids filed under ``group`` since it was last forgotten (some may be forgotten already)."""
        return list(self._groups.get(group, ()))

    def forget_group(self, group: Hashable) -> None:
        """:meth:`forget` of the leases filed under ``group``; the group is dropped (its active leases stay kept)."""
        self.forget(self._groups.pop(group, ()))

    def forget(self, lease_ids: Iterable[str]) -> None:
        """Drops ended leases from memory (their late reports then get NOT_FOUND)."""
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.status is not LeaseStatus.ACTIVE:
                del self._leases[lease_id]
