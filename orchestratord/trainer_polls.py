"""Trainer long polls (PollTrainerWork) waiting for work, by slot: woken one slot at a time.

The coordinator asks the planner after every mutation which waiting slots the change may have
given work (:meth:`orchestratord.planner.Planner.trainer_wakes`) and wakes only those, instead of
every waiting poll on every change (which made the polls per step grow as slots x changes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable


class TrainerPollWaiters:
    """The futures of the trainer polls that found no work, by slot id."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        #: Wake-ups delivered so far (for metrics and tests).
        self.woken = 0

    def slots(self) -> Collection[str]:
        """The slots with a waiting poll."""
        return self._waiters.keys()

    def register(self, slot_id: str) -> asyncio.Future[None]:
        """A poll of ``slot_id`` starts waiting; the future completes when it is woken."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(slot_id, set()).add(waiter)
        return waiter

    def discard(self, slot_id: str, waiter: asyncio.Future[None]) -> None:
        """The poll stopped waiting (woken, timed out or cancelled)."""
        waiting = self._waiters.get(slot_id)
        if waiting is None:
            return
        waiting.discard(waiter)
        if not waiting:
            del self._waiters[slot_id]

    def wake(self, slot_ids: Iterable[str]) -> None:
        """Wakes every poll waiting for the given slots."""
        for slot_id in slot_ids:
            for waiter in self._waiters.pop(slot_id, ()):
                if not waiter.done():
                    waiter.set_result(None)
                    self.woken += 1
