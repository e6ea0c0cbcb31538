"""The SQLite database that holds experiences, blob names and per-job accounting.

One database file (``<data_dir>/stored.db``) in WAL mode. Writes go through one
connection guarded by a lock (SQLite allows one writer at a time anyway), each in a
``BEGIN IMMEDIATE`` transaction; reads use one connection per thread, so readers
never wait for the writer (WAL snapshots).

Durability: with ``synchronous=FULL`` every commit fsyncs the WAL before it returns,
so a committed (acknowledged) transaction survives a process kill *and* an OS crash
or power loss. ``NORMAL`` would still survive a process kill (the WAL is in the page
cache) but may lose the last commits on power loss; it is allowed, not the default.

A full disk: a write transaction that fails for want of space (SQLITE_FULL, ENOSPC,
EDQUOT) is rolled back and raised as RESOURCE_EXHAUSTED with the reason DISK_FULL, and
the writer connection is left outside any transaction, so the next request simply tries
again: stored recovers by itself when space returns.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flexmarl.errors import ErrorReason, ResourceExhausted

log = logging.getLogger(__name__)

#: stored's database file in its data directory (``stored --data-dir``).
DB_FILE = "stored.db"
SYNCHRONOUS_MODES = ("FULL", "NORMAL", "EXTRA")
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# auto_vacuum must be chosen before the first table exists; INCREMENTAL lets garbage
# collection hand freed pages back to the file system without a full VACUUM.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    created_unix_ms INTEGER NOT NULL
) WITHOUT ROWID;

-- The logical table of (job_id, agent) is the partition (job_id, agent) of this
-- physical table: every query names both and is served by exp_partition.
CREATE TABLE IF NOT EXISTS experiences (
    seq INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    experience_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    task_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    episode_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    behavior_version INTEGER NOT NULL,
    reward REAL NOT NULL,
    group_size INTEGER NOT NULL,
    state INTEGER NOT NULL,
    step_id TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL,
    state_unix_ms INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    response_tokens INTEGER NOT NULL,
    payload_bytes INTEGER NOT NULL,
    prompt_token_ids BLOB NOT NULL,
    response_token_ids BLOB NOT NULL,
    response_logprobs BLOB NOT NULL,
    content_sha256 BLOB NOT NULL,
    -- int32 (start, version) pairs of an interrupted response; empty: every token has behavior_version.
    response_version_spans BLOB NOT NULL DEFAULT x'',
    -- assistant messages of the prompt re-tokenized from text (OpenAI gateway); 0: none.
    retokenized_messages INTEGER NOT NULL DEFAULT 0,
    -- the agent's unshaped episode return (reward is the turn's trained one); NULL: not recorded.
    episode_return REAL,
    UNIQUE (job_id, experience_id)
);
CREATE INDEX IF NOT EXISTS exp_partition ON experiences (job_id, agent, state, behavior_version);
CREATE INDEX IF NOT EXISTS exp_group ON experiences (job_id, agent, group_id);
CREATE INDEX IF NOT EXISTS exp_step ON experiences (job_id, step_id) WHERE step_id != '';

-- Jobs orchestratord reported ended (FinishJob): the only ones an RPC may garbage-collect.
CREATE TABLE IF NOT EXISTS finished_jobs (
    job_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    finished_unix_ms INTEGER NOT NULL
) WITHOUT ROWID;

-- Rows and payload bytes per (job, agent, state), kept in the same transactions as
-- the rows themselves: stats, metrics and quotas never scan the experiences.
CREATE TABLE IF NOT EXISTS partition_stats (
    job_id TEXT NOT NULL,
    agent TEXT NOT NULL,
    state INTEGER NOT NULL,
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (job_id, agent, state)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS blob_contents (
    sha256 TEXT PRIMARY KEY,
    size_bytes INTEGER NOT NULL,
    chunk_bytes INTEGER NOT NULL,
    chunk_digests BLOB NOT NULL,
    refcount INTEGER NOT NULL,
    created_unix_ms INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS blob_names (
    name TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL REFERENCES blob_contents (sha256),
    job_id TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_unix_ms INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blob_names_job ON blob_names (job_id);
CREATE INDEX IF NOT EXISTS blob_names_sha ON blob_names (sha256);
"""


@dataclass(frozen=True)
class JobQuotas:
    """Byte limits per job over its experience payloads plus its named blobs.

    Attributes:
        default_bytes: limit of a job without an override; 0 means unlimited.
        overrides_bytes: per-job limits that replace the default.
    """

    default_bytes: int = 0
    overrides_bytes: Mapping[str, int] = field(default_factory=dict)

    def limit_bytes(self, job_id: str) -> int:
        """The limit of a job in bytes (0 = unlimited)."""
        return self.overrides_bytes.get(job_id, self.default_bytes)

    @staticmethod
    def parse_overrides(text: str) -> dict[str, int]:
        """Parses ``"job-a=1000000,job-b=0"``; raises ValueError when malformed."""
        out: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            job_id, sep, value = item.partition("=")
            if not sep or not job_id.strip() or not value.strip().isdigit():
                raise ValueError(f"{item!r} is not job=bytes")
            out[job_id.strip()] = int(value.strip())
        return out


def job_usage_bytes(conn: sqlite3.Connection, job_id: str) -> int:
    """Bytes a job holds: experience payloads in every state plus its named blobs."""
    (experience_bytes,) = conn.execute(
        "SELECT COALESCE(SUM(bytes), 0) FROM partition_stats WHERE job_id = ?", (job_id,)
    ).fetchone()
    (blob_bytes,) = conn.execute(
        "SELECT COALESCE(SUM(size_bytes), 0) FROM blob_names WHERE job_id = ?", (job_id,)
    ).fetchone()
    return int(experience_bytes) + int(blob_bytes)


def check_quota(conn: sqlite3.Connection, quotas: JobQuotas, job_id: str, adding_bytes: int) -> None:
    """Raises ResourceExhausted when adding bytes would take a job over its quota."""
    limit = quotas.limit_bytes(job_id)
    if limit <= 0 or adding_bytes <= 0:
        return
    used = job_usage_bytes(conn, job_id)
    if used + adding_bytes > limit:
        raise ResourceExhausted(
            f"job {job_id!r} quota exceeded: {used} bytes used + {adding_bytes} new > limit {limit}",
            reason=ErrorReason.QUOTA_EXCEEDED,
        )


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in _DISK_FULL_ERRNOS
    if isinstance(exc, sqlite3.Error):
        # sqlite_errorcode is the extended code; its low byte is the primary one.
        return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL
    return False


@contextlib.contextmanager
def disk_full_errors(what: str) -> Iterator[None]:
    """Raises a full disk (ENOSPC, EDQUOT, SQLITE_FULL) in the block as ResourceExhausted(DISK_FULL).

    Other errors pass unchanged. ``what`` says what was being written, for the message.
    """
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        if not _is_disk_full(exc):
            raise
        log.warning("%s: no space left on the device (%s)", what, exc)
        raise ResourceExhausted(
            f"{what}: stored's disk is full ({exc}); retry once space is freed", reason=ErrorReason.DISK_FULL
        ) from exc


class Database:
    """One SQLite file: a locked writer connection and per-thread reader connections.

    Methods block; call them from worker threads, never from the event loop.
    """

    def __init__(self, path: Path, *, synchronous: str = "FULL", busy_timeout_s: float = 30.0) -> None:
        if synchronous.upper() not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, got {synchronous!r}")
        self.path = path
        self._synchronous = synchronous.upper()
        self._busy_timeout_s = busy_timeout_s
        self._write_lock = threading.RLock()
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closed = False
        path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = self._connect()
        self._writer.execute("PRAGMA auto_vacuum = INCREMENTAL")
        self._writer.executescript(_SCHEMA)
        self._migrate()
        log.info("opened %s (journal WAL, synchronous %s)", path, self._synchronous)

    def _migrate(self) -> None:
        """Columns added after a database was created (CREATE TABLE IF NOT EXISTS leaves old tables as they are)."""
        columns = {str(row[1]) for row in self._writer.execute("PRAGMA table_info(experiences)")}
        if "response_version_spans" not in columns:
            self._writer.execute("ALTER TABLE experiences ADD COLUMN response_version_spans BLOB NOT NULL DEFAULT x''")
            log.info("%s: added experiences.response_version_spans", self.path)
        if "retokenized_messages" not in columns:
            self._writer.execute("ALTER TABLE experiences ADD COLUMN retokenized_messages INTEGER NOT NULL DEFAULT 0")
            log.info("%s: added experiences.retokenized_messages", self.path)
        if "episode_return" not in columns:
            self._writer.execute("ALTER TABLE experiences ADD COLUMN episode_return REAL")
            log.info("%s: added experiences.episode_return", self.path)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=self._busy_timeout_s
        )
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{self.path}: cannot switch to WAL (got {mode})")
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: commits when the block ends, rolls back on an exception.

        A failed COMMIT rolls back too (SQLite may already have): the writer never stays
        inside a transaction, so one failure (a full disk) cannot block every later write.

        Raises:
            ResourceExhausted: no space left for the transaction (reason DISK_FULL).
        """
        with self._write_lock, disk_full_errors(f"{self.path.name}: write transaction"):
            if self._closed:
                raise RuntimeError("database is closed")
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds the write lock across a transaction and work that must follow its commit."""
        with self._write_lock:
            yield

    @contextlib.contextmanager
    def locked_writer(self) -> Iterator[sqlite3.Connection]:
        """The writer connection under the write lock, outside any transaction (pragmas)."""
        with self._write_lock:
            yield self._writer

    @contextlib.contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction on this thread's connection: a consistent snapshot."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise RuntimeError("database is closed")
            conn = self._connect()
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def close(self) -> None:
        """Closes every connection (checkpointing the WAL); idempotent."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            with self._readers_lock:
                for conn in self._readers:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
                self._readers.clear()
            with contextlib.suppress(sqlite3.Error):
                self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._writer.close()
