"""Connections a worker daemon keeps to orchestratord and stored, found in etcd or configured.

rolloutd and traind both pull work from orchestratord and read/write stored; this is
their one place to discover, connect, and reconnect after the peer went away.
"""

from __future__ import annotations

import grpc
import grpc.aio

from flexmarl.registry import Registry
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.server import channel_options
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2_grpc


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
        """Drops the orchestratord channel: the next call discovers and connects again."""
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._stub = None, None

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
        """Drops the stored client: the next call discovers and connects again."""
        if self._store is not None:
            await self._store.close()
        self._store = None

    async def close(self) -> None:
        """Closes both."""
        await self.reset_store()
        await self.reset_orchestrator()


def describe_error(exc: BaseException) -> str:
    """One line for a failed call: the status code and details of an RPC error."""
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
