"""A real stored, in this test's process and event loop, on an OS-chosen port (tests that need no subprocess)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from flexmarl.server import GrpcServer
from flexmarl.store_client import StoreClient
from stored.app import StoredApp
from stored.config import StoredConfig


@contextlib.asynccontextmanager
async def inprocess_stored(data_dir: Path) -> AsyncIterator[tuple[StoredApp, StoreClient, str]]:
    """stored serving ``data_dir`` (no background GC): its app, a client, and its address."""
    config = StoredConfig(data_dir=str(data_dir), gc_interval_s=0)
    config.validate()
    app = StoredApp(config, CollectorRegistry())
    server = GrpcServer(app.service_names, config.max_message_bytes)
    app.add_to_server(server.server)
    address = f"127.0.0.1:{server.bind('127.0.0.1', 0)}"
    await app.start()
    await server.server.start()
    client = StoreClient(address)
    try:
        yield app, client, address
    finally:
        await client.close()
        await server.server.stop(0)
        await app.stop()
