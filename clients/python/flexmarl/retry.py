"""The one retry policy of every daemon: exponential back-off, an optional deadline or attempt cap.

Two shapes cover every retry loop in the tree:

- :func:`retry` calls an operation until it succeeds, a non-retryable error escapes, or the
  deadline / attempt cap is reached (then the last retryable error is raised).
- :class:`Backoff` is the delay sequence alone, for long-running loops (polls, renewals) that
  keep going after an error and go back to the first delay after a success (:meth:`Backoff.reset`).

Delays double from ``initial_s`` up to ``max_s``. No jitter by default: the daemons' retries are
driven by a peer restarting, not by a thundering herd on one server, and deterministic delays keep
the fault tests' timing reproducible; pass ``jitter`` where many clients retry against one server.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["Backoff", "RetryPolicy", "retry"]

T = TypeVar("T")


@dataclass
class Backoff:
    """A doubling delay sequence: ``initial_s``, ``2 * initial_s``, ... capped at ``max_s``.

    Attributes:
        initial_s: The first delay (and the delay after :meth:`reset`).
        max_s: The largest delay.
        multiplier: Growth factor per delay (> 1).
        jitter: Fraction of each delay drawn uniformly at random and added (0 = none).
    """

    initial_s: float = 0.2
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.0
    _next_s: float = field(default=-1.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0 <= self.initial_s <= self.max_s) or self.multiplier < 1 or self.jitter < 0:
            raise ValueError(f"invalid back-off {self.initial_s=} {self.max_s=} {self.multiplier=} {self.jitter=}")
        self._next_s = self.initial_s

    def next_delay(self) -> float:
        """Returns the next delay and advances the sequence."""
        delay_s = self._next_s
        self._next_s = min(self.max_s, self._next_s * self.multiplier)
        if self.jitter:
            delay_s += random.uniform(0.0, self.jitter * delay_s)
        return delay_s

    def reset(self) -> None:
        """Starts the sequence over (after a success)."""
        self._next_s = self.initial_s

    async def sleep(self) -> float:
        """Sleeps for the next delay; returns it."""
        delay_s = self.next_delay()
        await asyncio.sleep(delay_s)
        return delay_s


@dataclass(frozen=True)
class RetryPolicy:
    """How long :func:`retry` keeps trying.

    Attributes:
        initial_s: First delay.
        max_s: Largest delay.
        deadline_s: Give up on the first error that comes later than this many seconds after the
            first attempt (None: no limit).
        attempts: Give up after this many attempts in all (None: no limit).
        jitter: See :class:`Backoff`.
    """

    initial_s: float = 0.2
    max_s: float = 2.0
    deadline_s: float | None = None
    attempts: int | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ValueError("deadline_s must be >= 0")
        Backoff(self.initial_s, self.max_s, jitter=self.jitter)  # validates the delays

    def backoff(self) -> Backoff:
        """A fresh delay sequence for one :func:`retry` call."""
        return Backoff(self.initial_s, self.max_s, jitter=self.jitter)


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    retryable: Callable[[BaseException], bool],
    policy: RetryPolicy,
    on_retry: Callable[[BaseException, int, float], Awaitable[None] | None] | None = None,
) -> T:
    """Awaits ``operation()`` until it succeeds; retries the errors ``retryable`` accepts.

    Args:
        operation: Called afresh for every attempt.
        retryable: True for an error worth another attempt; any other error propagates at once.
        policy: Delays and limits. When a limit is reached the last error is raised.
        on_retry: Called as ``on_retry(error, attempt, delay_s)`` before each wait (logging,
            rediscovering a peer); may be a coroutine function.

    Returns:
        What ``operation`` returned.
    """
    backoff = policy.backoff()
    started_s = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await operation()
        except Exception as exc:
            if not retryable(exc):
                raise
            if policy.attempts is not None and attempt >= policy.attempts:
                raise
            if policy.deadline_s is not None and time.monotonic() - started_s > policy.deadline_s:
                raise
            delay_s = backoff.next_delay()
            if on_retry is not None:
                pending = on_retry(exc, attempt, delay_s)
                if pending is not None:
                    await pending
            await asyncio.sleep(delay_s)
