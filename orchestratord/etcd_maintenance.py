"""Defragmentation of etcd, run by orchestratord (the one writer of job state).

etcd's auto-compaction (deploy/config/etcd.env) drops old revisions, and orchestratord deletes a
job's old steps (``orchestratord/history_archive.py``), but the freed pages stay inside etcd's db
file: only a defragmentation gives them back, and the db's size counts against etcd's quota. Every
``check_interval_s`` orchestratord reads each member's db size and the part in use, and defragments
a member whose free space is at least ``min_free_bytes`` and at least half its file, one member at a
time, each at most once per ``min_interval_s`` (a defragmentation blocks that member while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

from flexmarl.registry import ETCD_ERRORS, EtcdMemberStatus, Registry

log = logging.getLogger(__name__)

#: The free share of a member's db file at which it is defragmented (with ``min_free_bytes``).
MIN_FREE_RATIO = 0.5


@dataclasses.dataclass(frozen=True)
class DefragPolicy:
    """When orchestratord defragments an etcd member."""

    check_interval_s: float = 300.0
    min_free_bytes: int = 64 * 1024 * 1024
    min_interval_s: float = 3600.0

    def due(self, status: EtcdMemberStatus, last_defrag_s: float | None, now_s: float) -> bool:
        """Whether ``status``'s member should be defragmented now."""
        if last_defrag_s is not None and now_s - last_defrag_s < self.min_interval_s:
            return False
        return (status.free_bytes >= self.min_free_bytes
                and status.free_bytes >= MIN_FREE_RATIO * status.db_bytes > 0)


class EtcdDefragmenter:
    """The check loop of :class:`DefragPolicy` over the registry's configured members."""

    def __init__(self, registry: Registry, policy: DefragPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self.policy = policy
        self._clock = clock
        self._last: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        #: Members defragmented so far (endpoint, db bytes before, after), newest last.
        self.done: list[tuple[str, int, int]] = []

    def start(self) -> None:
        """Starts the loop (no-op when the policy's interval is 0)."""
        if self.policy.check_interval_s > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="etcd defragmentation")

    async def stop(self) -> None:
        """Stops the loop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.check_interval_s)
            try:
                await self.check_once()
            except ETCD_ERRORS as exc:
                log.warning("etcd defragmentation check failed: %s", exc)

    async def check_once(self) -> list[str]:
        """Defragments every member that is due, one at a time; returns their endpoints."""
        defragmented: list[str] = []
        for status in await self._registry.member_statuses():
            if not self.policy.due(status, self._last.get(status.endpoint), self._clock()):
                continue
            log.info("defragmenting etcd member %s: db %.1f MiB, %.1f MiB in use", status.endpoint,
                     status.db_bytes / 2**20, status.db_in_use_bytes / 2**20)
            self._last[status.endpoint] = self._clock()
            await self._registry.defragment(status.endpoint)
            after = next((s.db_bytes for s in await self._registry.member_statuses()
                          if s.endpoint == status.endpoint), -1)
            log.info("defragmented etcd member %s: db %.1f -> %.1f MiB", status.endpoint,
                     status.db_bytes / 2**20, after / 2**20)
            self.done.append((status.endpoint, status.db_bytes, after))
            defragmented.append(status.endpoint)
        return defragmented
