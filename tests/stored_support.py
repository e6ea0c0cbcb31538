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


#: The experiences table's columns in the order they were added (migrations append to it), with the
#: definitions older stored versions created; the table of an older stored is a prefix of it.
EXPERIENCE_COLUMNS = (
    ("seq", "INTEGER PRIMARY KEY"), ("job_id", "TEXT NOT NULL"), ("experience_id", "TEXT NOT NULL"),
    ("agent", "TEXT NOT NULL"), ("task_id", "TEXT NOT NULL"), ("group_id", "TEXT NOT NULL"),
    ("sample_index", "INTEGER NOT NULL"), ("episode_id", "TEXT NOT NULL"), ("turn", "INTEGER NOT NULL"),
    ("behavior_version", "INTEGER NOT NULL"), ("reward", "REAL NOT NULL"), ("group_size", "INTEGER NOT NULL"),
    ("state", "INTEGER NOT NULL"), ("step_id", "TEXT NOT NULL"), ("created_unix_ms", "INTEGER NOT NULL"),
    ("state_unix_ms", "INTEGER NOT NULL"), ("prompt_tokens", "INTEGER NOT NULL"),
    ("response_tokens", "INTEGER NOT NULL"), ("payload_bytes", "INTEGER NOT NULL"),
    ("prompt_token_ids", "BLOB NOT NULL"), ("response_token_ids", "BLOB NOT NULL"),
    ("response_logprobs", "BLOB NOT NULL"), ("content_sha256", "BLOB NOT NULL"),
    ("response_version_spans", "BLOB NOT NULL DEFAULT x''"), ("retokenized_messages", "INTEGER NOT NULL DEFAULT 0"),
    ("episode_return", "REAL"),
)


def old_experiences_db(path: Path, before: str) -> None:
    """Writes an SQLite file holding the experiences table as stored created it before column ``before``."""
    import sqlite3

    names = [name for name, _ in EXPERIENCE_COLUMNS]
    columns = EXPERIENCE_COLUMNS[:names.index(before)]
    conn = sqlite3.connect(path)
    try:
        conn.executescript("CREATE TABLE experiences (" + ", ".join(f"{n} {d}" for n, d in columns)
                           + ", UNIQUE (job_id, experience_id));")
    finally:
        conn.close()
