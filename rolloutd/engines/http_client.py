"""The HTTP transport every engine client shares (SGLang's API and the embedded engine's, vLLM's).

Chosen so that long generations never make a healthy replica look dead:

- Generations hold a slot each (``n`` for an ``n > 1`` request) out of
  ``max_concurrent_generations`` (:class:`GenerationSlots`); requests beyond it wait here, and that
  wait is not counted against the replica. The HTTP connection pool itself is unbounded, so
  control calls (health, abort, weights) never queue behind generations.
- A generation that holds its slot may run ``generate_timeout_base_s +
  generate_timeout_per_token_s * max_new_tokens`` seconds (:meth:`HttpEngineClient.generate_timeout_s`):
  a deadline in proportion to the work asked for, generous enough for a slow, fully batched decode,
  so only a stuck replica hits it. A dead replica is seen at once (the connection breaks).

Errors (:meth:`HttpEngineClient._request`): connection errors (refused, reset, server gone) are
retried ``retries`` times with exponential backoff, then raised as :class:`Unavailable`; a request
that times out raises :class:`Unavailable` at once (the replica is alive but stuck). A status in
the client's ``invalid_statuses`` raises :class:`InvalidArgument`, 503 :class:`EngineBusy` (alive,
retry later), 502/504 :class:`Unavailable`, any other error :class:`FlexmarlError`; each carries
the engine's own message (:meth:`HttpEngineClient.error_message`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Self

import aiohttp

from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from flexmarl.retry import RetryPolicy, retry
from rolloutd.engines.protocol import EngineClient

logger = logging.getLogger(__name__)


class EngineBusy(Unavailable):
    """The replica is up but answered 503 to one request: retry later, do not drop the replica.

    SGLang answers 503 for a request it aborted under memory pressure ("Retracted under decode
    memory pressure without a KV backup. Retry later.", ``srt/managers/schedule_batch.py``) and
    for a few per-request refusals (``srt/managers/scheduler.py``); vLLM while its engine is not
    ready; none means the server died.
    """


class GenerationSlots:
    """Bounds the samples a client has in flight on its replica; waiters are served FIFO.

    A request takes ``n`` slots (one per sample it runs on the server), at most the whole limit.
    """

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._in_use = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def limit(self) -> int:
        """The slots there are."""
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = max(1, value)
        self._grant()

    @property
    def in_use(self) -> int:
        """The slots held now."""
        return self._in_use

    @contextlib.asynccontextmanager
    async def hold(self, samples: int) -> AsyncIterator[None]:
        """Holds ``samples`` slots (at most the limit) while the block runs."""
        taken = await self._acquire(min(max(1, samples), self._limit))
        try:
            yield
        finally:
            self._in_use -= taken
            self._grant()

    async def _acquire(self, weight: int) -> int:
        if not self._waiters and self._in_use + weight <= self._limit:
            self._in_use += weight
            return weight
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((weight, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then cancelled: hand it on
                self._in_use -= weight
                self._grant()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove((weight, granted))
            raise
        return weight

    def _grant(self) -> None:
        while self._waiters:
            weight, granted = self._waiters[0]
            if granted.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            weight = min(weight, self._limit)
            if self._in_use + weight > self._limit:
                return
            self._waiters.popleft()
            self._in_use += weight
            granted.set_result(None)


class HttpEngineClient(EngineClient):
    """An engine client over HTTP/JSON: the shared transport (see the module docstring).

    Subclasses map the engine protocol onto their engine's routes and name, in
    ``engine_label`` and ``invalid_statuses``, how their engine's errors read.
    """

    #: How error messages name the replica ("engine http://...").
    engine_label = "engine"
    #: HTTP statuses that mean the engine refused the request itself (raised as InvalidArgument).
    invalid_statuses: tuple[int, ...] = (400, 422)

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float,
        connect_timeout_s: float,
        control_timeout_s: float,
        generate_timeout_base_s: float,
        generate_timeout_per_token_s: float,
        max_concurrent_generations: int,
        retries: int,
        retry_backoff_s: float,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if max_concurrent_generations < 1:
            raise InvalidArgument(f"max_concurrent_generations must be >= 1, got {max_concurrent_generations}")
        if generate_timeout_base_s <= 0 or generate_timeout_per_token_s < 0:
            raise InvalidArgument("generate_timeout_base_s must be > 0 and generate_timeout_per_token_s >= 0")
        self.url = url.rstrip("/")
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._control_timeout_s = control_timeout_s
        self._generate_timeout_base_s = generate_timeout_base_s
        self._generate_timeout_per_token_s = generate_timeout_per_token_s
        self._retries = retries
        self._retry_backoff_s = retry_backoff_s
        self._session = session
        self._owns_session = session is None
        self._slots = GenerationSlots(max_concurrent_generations)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the owned HTTP session (idempotent)."""
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    @property
    def max_concurrent_generations(self) -> int:
        """Samples this client lets run on the replica at once (the rest wait here)."""
        return self._slots.limit

    @property
    def generations_in_flight(self) -> int:
        """Slots held by running generations."""
        return self._slots.in_use

    def generate_timeout_s(self, max_new_tokens: int) -> float:
        """How long one generation may run once it holds its slots."""
        return self._generate_timeout_base_s + self._generate_timeout_per_token_s * max(0, max_new_tokens)

    @staticmethod
    def error_message(payload: Any) -> str:
        """The human message of one of the engine's error bodies."""
        return str(payload).strip()[:2000]

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: no pool bound. Generations are bounded by the slots, and control calls
            # must never queue behind them (aiohttp counts pool waits in the request timeout).
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._owns_session = True
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        timeout_s: float | None,
        allowed_statuses: tuple[int, ...] = (),
    ) -> tuple[int, Any]:
        """Send one request with retries on connection errors; returns (status, JSON or text).

        ``timeout_s`` is the request's total timeout; None sets none (the caller bounds it).
        """
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._connect_timeout_s)

        async def send() -> tuple[int, Any]:
            async with self._get_session().request(method, self.url + path, json=body, timeout=timeout) as response:
                text = await response.text()
                if response.content_type == "application/json" and text:
                    return response.status, json.loads(text)
                return response.status, text

        def log_retry(exc: BaseException, attempt: int, delay_s: float) -> None:
            logger.debug("retrying %s %s%s in %.2fs after %r", method, self.url, path, delay_s, exc)

        policy = RetryPolicy(self._retry_backoff_s, self._retry_backoff_s * 2 ** max(self._retries - 1, 0),
                             attempts=self._retries + 1)
        label = f"{self.engine_label} {self.url}"
        try:
            status, payload = await retry(send, retryable=lambda exc: isinstance(exc, aiohttp.ClientConnectionError),
                                          policy=policy, on_retry=log_retry)
        except aiohttp.ClientConnectionError as exc:
            raise Unavailable(f"{label} unreachable ({method} {path}): {exc!r}") from exc
        except TimeoutError as exc:
            raise Unavailable(f"{label} timed out ({method} {path})") from exc
        if status in allowed_statuses or 200 <= status < 300:
            return status, payload
        detail = f"{label} {method} {path} -> HTTP {status}: {self.error_message(payload)}"
        if status in self.invalid_statuses:
            raise InvalidArgument(detail)
        if status == 503:
            raise EngineBusy(detail)
        if status in (502, 504):
            raise Unavailable(detail)
        raise FlexmarlError(detail)
