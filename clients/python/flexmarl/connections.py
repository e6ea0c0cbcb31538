"""Connections a worker daemon keeps to orchestratord and stored, found in etcd or configured.

rolloutd and traind both pull work from orchestratord and read/write stored; this is
their one place to discover, connect, and reconnect after the peer went away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import grpc
import grpc.aio

from flexmarl.registry import Registry
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.server import channel_options
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2_grpc

#: Calls in flight on a dropped channel get this long to end (every worker call has a shorter deadline).
CLOSE_GRACE_S = 60.0


class PeerConnections:
    """Lazily opened channels to orchestratord and stored."""

    def __init__(
        self,
        registry: Registry,
        *,
        orchestrator_address: str,
        store_address: str,
        max_message_bytes: int,
        security: TransportSecurity | None = None,
    ) -> None:
        self._registry = registry
        self._security = security
        self._orchestrator_address = orchestrator_address
        self._store_address = store_address
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None
        self._stub: orchestrator_pb2_grpc.OrchestratorStub | None = None
        self._store: StoreClient | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def address(self, kind: str, configured: str = "") -> str:
        """A configured address, else the first registered daemon of kind."""
        return configured or await self._registry.first_address(kind)

    async def orchestrator(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        """The Orchestrator stub (connecting on first use)."""
        if self._stub is None:
            address = await self.address("orchestratord", self._orchestrator_address)
            self._channel = open_channel(address, self._security, channel_options(self._max_message_bytes))
            self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        return self._stub

    async def reset_orchestrator(self) -> None:
        """Drops the orchestratord channel: the next call discovers and connects again.

        The old channel is closed in the background with a grace period longer than any call's
        deadline. Closing it at once would cancel the calls other coroutines still have on it,
        and grpc.aio raises that as ``asyncio.CancelledError`` in them: a worker's poll loop
        took it for its own cancellation and ended (a chaos test found the stalled job).
        """
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            self._close_later(channel.close(CLOSE_GRACE_S))

    async def store(self) -> StoreClient:
        """The stored client (connecting on first use)."""
        if self._store is None:
            self._store = StoreClient(await self.address("stored", self._store_address),
                                      max_message_bytes=self._max_message_bytes, security=self._security)
        return self._store

    def store_if_open(self) -> StoreClient | None:
        """The stored client when one is open (for code that runs off the event loop)."""
        return self._store

    async def reset_store(self) -> None:
        """Drops the stored client: the next call discovers and connects again (as reset_orchestrator)."""
        store, self._store = self._store, None
        if store is not None:
            self._close_later(store.close(CLOSE_GRACE_S))

    def _close_later(self, closing: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(closing, name="close a dropped channel")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Closes both, and the channels dropped earlier, now (calls in flight are cancelled)."""
        store, self._store = self._store, None
        channel, self._channel, self._stub = self._channel, None, None
        if store is not None:
            await store.close()
        if channel is not None:
            await channel.close()
        for task in list(self._closing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def describe_error(exc: BaseException) -> str:
    """One line for a failed call: the status code and details of an RPC error."""
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call) and isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def cancelled_from_outside() -> bool:
    """Inside ``except asyncio.CancelledError``: True when this task itself is being cancelled.

    False means a call was cancelled under it (grpc.aio raises CancelledError in a caller whose
    channel was closed): a failed call to retry, not a reason for a worker loop to end.
    """
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0
