"""The shared retry policy: delays, limits, which errors it retries."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl import retry as retry_mod
from flexmarl.retry import Backoff, RetryPolicy, retry


def test_backoff_doubles_to_cap_and_resets() -> None:
    b = Backoff(0.1, 0.5)
    assert [b.next_delay() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    b.reset()
    assert b.next_delay() == pytest.approx(0.1)
    with pytest.raises(ValueError):
        Backoff(1.0, 0.5)


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []

    async def fake_sleep(delay_s: float) -> None:
        slept.append(delay_s)

    monkeypatch.setattr(retry_mod.asyncio, "sleep", fake_sleep)
    return slept


def test_retry_until_success_then_returns(no_sleep: list[float]) -> None:
    calls = []

    async def op() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionError("down")
        return "ok"

    seen: list[int] = []
    result = asyncio.run(retry(op, retryable=lambda e: isinstance(e, ConnectionError),
                               policy=RetryPolicy(0.1, 0.3), on_retry=lambda e, n, d: seen.append(n)))
    assert result == "ok" and len(calls) == 4 and seen == [1, 2, 3]
    assert no_sleep == pytest.approx([0.1, 0.2, 0.3])


def test_retry_stops_at_attempts_and_raises_last(no_sleep: list[float]) -> None:
    calls = []

    async def op() -> None:
        calls.append(1)
        raise ConnectionError(f"down {len(calls)}")

    with pytest.raises(ConnectionError, match="down 3"):
        asyncio.run(retry(op, retryable=lambda e: True, policy=RetryPolicy(attempts=3)))
    assert len(calls) == 3


def test_non_retryable_error_propagates_at_once(no_sleep: list[float]) -> None:
    calls = []

    async def op() -> None:
        calls.append(1)
        raise KeyError("bad input")

    with pytest.raises(KeyError):
        asyncio.run(retry(op, retryable=lambda e: isinstance(e, ConnectionError), policy=RetryPolicy()))
    assert len(calls) == 1 and no_sleep == []


def test_deadline_gives_up(no_sleep: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(retry_mod.time, "monotonic", lambda: now[0])

    async def op() -> None:
        now[0] += 1.0
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        asyncio.run(retry(op, retryable=lambda e: True, policy=RetryPolicy(deadline_s=2.5)))
    assert len(no_sleep) == 2  # errors at +1 s and +2 s are retried, the one at +3 s is raised
