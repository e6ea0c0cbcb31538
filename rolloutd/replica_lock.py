"""The lock of one engine replica in rolloutd's router: many generations, or one weight load."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class ReplicaLock:
    """Many generations or one weight load on a replica (a read-write lock: generations read, a load writes)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        #: Generations that have ever held the lock (a new one since some moment is a new generation).
        self.entries = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def read(self) -> Any:
        """Held by a generation; waits while a load holds the lock."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
            self.entries += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """Whether a generation holds the lock now."""
        return self._readers > 0

    @contextlib.asynccontextmanager
    async def write(self) -> Any:
        """Held by a weight load; waits until no generation and no other load holds the lock."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


__all__ = ["ReplicaLock"]
