"""Content-addressed blob store: files named by sha256, names and refcounts in SQLite.

Layout: ``<data_dir>/blobs/<sha[:2]>/<sha>`` holds content; ``<data_dir>/blobs/tmp``
holds uploads in progress. An upload is written to a temp file while its sha256 and
the CRC-32 of every ``chunk_bytes`` segment are computed, fsynced, checked against the
expected hash, then renamed into place (and the directory fsynced) *before* the
transaction that records the name commits. So a committed name always points to a
complete, durable file; a crash leaves at most an unreferenced file, removed by
:meth:`BlobStore.recover` at start-up.

Reads verify every segment they serve against its recorded digest (DATA_LOSS on a
mismatch, before the bad bytes leave). The segment digests were computed at upload from
the very bytes whose whole sha256 was checked, so a range that passes them is the
content that was verified; the whole-content hash is not computed again on a read (the
client checks it end to end on every download). A segment digest guards against the
disk, not an adversary (the sha256 does that, end to end): CRC-32 per 1 MiB segment, as
HDFS and GCS checksum their blocks, at about a third of a sha256's CPU per byte (zlib's
``crc32``, which releases the GIL). Contents recorded before 2026-12-02 carry a sha256 per
segment (32 bytes instead of 4); the digest's length says which, and both verify.

Speed without giving any of that up (measured in ``benchmarks/stored.py``): on upload
the whole-content hash runs in a helper thread beside the segment checksum and the file
I/O (hashlib, zlib and file I/O release the GIL on large buffers, so the two digests of a
byte take one hash's wall time), and an upload starts an ``fdatasync`` in the
background every ``sync_every_bytes`` (write-behind, like RocksDB's
``bytes_per_sync``), so the fsync that precedes the acknowledgement only has the tail
left to write. A failed background sync fails the upload: after a failed fsync the
kernel may have dropped the dirty pages, so a later fsync succeeding proves nothing.

A full disk (ENOSPC, EDQUOT, SQLITE_FULL) is RESOURCE_EXHAUSTED with the reason
DISK_FULL: the upload is dropped with its temp file and nothing is recorded, and the
next request tries again, so stored recovers by itself once space returns.

Every method blocks (file and SQLite I/O); the servicer runs them in worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sqlite3
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flexmarl.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from flexmarl.store_client import BlobInfo
from stored.database import Database, JobQuotas, check_quota, disk_full_errors
from stored.experiences import validate_job_id

log = logging.getLogger(__name__)

SHA256_RE = re.compile(r"[0-9a-f]{64}")
# Segments of [A-Za-z0-9._-] separated by '/', no empty, '.' or '..' segment.
NAME_SEGMENT_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,126}")
MAX_NAME_CHARS = 512
HASH_PREFIX = "sha256:"
#: Bytes of one segment digest: CRC-32 (big-endian) now, sha256 for contents recorded before it.
CRC_DIGEST_BYTES = 4
LEGACY_DIGEST_BYTES = 32
# Below this a helper-thread hand-off costs more than the hash it moves off the caller.
_PARALLEL_HASH_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class BlobLimits:
    """Explicit bounds on blobs.

    Attributes:
        max_blob_bytes: size of one blob.
        max_put_chunk_bytes: one chunk of an upload (one gRPC message).
        chunk_bytes: segment size of the recorded per-segment digests and of read chunks.
        max_list_results: names one list returns.
        sync_every_bytes: an upload starts a background fdatasync after this many new bytes
            (0 = only the fsync before the acknowledgement).
    """

    max_blob_bytes: int = 64 << 30
    max_put_chunk_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    max_list_results: int = 10_000
    sync_every_bytes: int = 8 << 20


def validate_name(name: str) -> None:
    """Raises InvalidArgument unless name is a well-formed reference name."""
    if not name or len(name) > MAX_NAME_CHARS:
        raise InvalidArgument(f"bad blob name {name[:80]!r}: 1..{MAX_NAME_CHARS} characters")
    if not all(NAME_SEGMENT_RE.fullmatch(segment) for segment in name.split("/")):
        raise InvalidArgument(
            f"bad blob name {name!r}: '/'-separated segments of [A-Za-z0-9._-], no empty, '.' or '..'"
        )


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _hashing_beside(helper: ThreadPoolExecutor, hasher: hashlib._Hash, data: bytes | memoryview) -> Iterator[None]:
    """Feeds data to hasher in a helper thread while the block runs; done when the block ends.

    Small buffers are hashed inline: the hand-off would cost more than it saves.
    """
    if len(data) < _PARALLEL_HASH_MIN_BYTES:
        hasher.update(data)
        yield
        return
    future = helper.submit(hasher.update, data)
    try:
        yield
    finally:
        future.result()


class BlobUpload:
    """One upload in progress: write chunks, then commit (or abort)."""

    def __init__(
        self, store: BlobStore, name: str, size_bytes: int, expected_sha256: str, job_id: str, tmp_path: Path
    ) -> None:
        self._store = store
        self.name = name
        self.size_bytes = size_bytes
        self.expected_sha256 = expected_sha256
        self.job_id = job_id
        self._tmp_path = tmp_path
        with disk_full_errors(f"blob {name!r}: opening the upload"):
            self._file: BinaryIO | None = tmp_path.open("wb")
        self._hash = hashlib.sha256()
        self._chunk_crc = 0
        self._chunk_fill = 0
        self._chunk_digests = bytearray()
        self.received_bytes = 0
        self._unsynced_bytes = 0
        self._sync: Future[None] | None = None
        self._done = False

    def write(self, data: bytes | memoryview) -> None:
        """Appends one chunk.

        Raises:
            InvalidArgument: more bytes than announced, or the upload is finished.
            ResourceExhausted: a chunk over the limit, or the disk is full (reason DISK_FULL).
        """
        if self._file is None:
            raise InvalidArgument(f"blob {self.name!r}: upload already finished")
        limits = self._store.limits
        if len(data) > limits.max_put_chunk_bytes:
            raise ResourceExhausted(f"blob chunk of {len(data)} bytes > limit {limits.max_put_chunk_bytes}")
        if self.received_bytes + len(data) > self.size_bytes:
            raise InvalidArgument(
                f"blob {self.name!r}: more than the announced {self.size_bytes} bytes were sent"
            )
        with disk_full_errors(f"blob {self.name!r}: writing the upload"), \
                _hashing_beside(self._store.helper, self._hash, data):
            self._file.write(data)
            view = memoryview(data)
            while view:
                take = min(len(view), limits.chunk_bytes - self._chunk_fill)
                self._chunk_crc = zlib.crc32(view[:take], self._chunk_crc)
                self._chunk_fill += take
                view = view[take:]
                if self._chunk_fill == limits.chunk_bytes:
                    self._seal_chunk()
            self.received_bytes += len(data)
            self._unsynced_bytes += len(data)
            if limits.sync_every_bytes and self._unsynced_bytes >= limits.sync_every_bytes:
                self._sync_behind()

    def expect(self, name: str, size_bytes: int, sha256: str, job_id: str) -> None:
        """Takes the expected sha256 from a closing header (PutBlob's trailer; see ``StoreServicer.PutBlob``).

        A client that hashes while it streams announces the hash after the content. Only an upload
        opened without a hash takes one, once, and only from a header that repeats the opening one.

        Raises:
            InvalidArgument: the upload already has a hash, the header differs, or the hash is malformed.
        """
        if self.expected_sha256 or (name, size_bytes, job_id) != (self.name, self.size_bytes, self.job_id):
            raise InvalidArgument("PutBlob: only the first message may carry a header, or the last one the sha256 "
                                  "of an upload opened without it (same name, size and job)")
        sha256 = sha256.lower()
        if not SHA256_RE.fullmatch(sha256):
            raise InvalidArgument(f"bad sha256 {sha256!r}: expected 64 hex digits")
        self.expected_sha256 = sha256

    def _sync_behind(self) -> None:
        """Starts an fdatasync of what is written so far, unless one is still running.

        A failed earlier sync raises here (the upload must fail: see the module docstring).
        """
        if self._file is None or (self._sync is not None and not self._sync.done()):
            return
        self._wait_sync()
        self._file.flush()
        self._sync = self._store.helper.submit(os.fdatasync, self._file.fileno())
        self._unsynced_bytes = 0

    def _wait_sync(self) -> None:
        """Waits for the background sync; raises what it raised."""
        sync, self._sync = self._sync, None
        if sync is not None:
            sync.result()

    def _seal_chunk(self) -> None:
        self._chunk_digests += _crc_digest(self._chunk_crc)
        self._chunk_crc = 0
        self._chunk_fill = 0

    def commit(self) -> BlobInfo:
        """Verifies size and hash, makes the content durable and points the name at it.

        Raises:
            InvalidArgument: fewer bytes than announced.
            DataLoss: the content does not match the expected sha256.
            ResourceExhausted: the job's quota would be exceeded.
        """
        if self._file is None:
            raise InvalidArgument(f"blob {self.name!r}: upload already finished")
        try:
            if self.received_bytes != self.size_bytes:
                raise InvalidArgument(
                    f"blob {self.name!r}: received {self.received_bytes} bytes, announced {self.size_bytes}"
                )
            if self._chunk_fill:
                self._seal_chunk()
            sha = self._hash.hexdigest()
            if self.expected_sha256 and sha != self.expected_sha256:
                raise DataLoss(f"blob {self.name!r}: content sha256 {sha} != expected {self.expected_sha256}")
            with disk_full_errors(f"blob {self.name!r}: syncing the upload"):
                self._wait_sync()
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            self._file = None
            info = self._store._commit(self, sha, bytes(self._chunk_digests), self._tmp_path)
            self._done = True
            return info
        finally:
            self.abort()

    def abort(self) -> None:
        """Drops the upload and its temp file (no-op after commit); idempotent."""
        if self._sync is not None:
            # The fd must outlive the sync that uses it; its outcome no longer matters.
            with contextlib.suppress(OSError):
                self._wait_sync()
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk can fail the flush of a file being dropped
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp_path.unlink()


def segment_digest_bytes(size_bytes: int, chunk_bytes: int, chunk_digests: bytes) -> int:
    """The width of each recorded segment digest: CRC_DIGEST_BYTES or LEGACY_DIGEST_BYTES (sha256).

    Raises:
        DataLoss: the record's digests fit neither width (a damaged database row).
    """
    if chunk_bytes <= 0:
        raise DataLoss(f"blob record: segment size {chunk_bytes}")
    segments = -(-size_bytes // chunk_bytes)
    for width in (CRC_DIGEST_BYTES, LEGACY_DIGEST_BYTES):
        if len(chunk_digests) == segments * width:
            return width
    raise DataLoss(f"blob record: {len(chunk_digests)} bytes of segment digests fit no digest of "
                   f"{segments} segments of {chunk_bytes} bytes")


def _crc_digest(crc: int) -> bytes:
    """A segment's recorded CRC-32 (written at upload, compared on every read)."""
    return crc.to_bytes(CRC_DIGEST_BYTES, "big")


def segment_digest(segment: bytes | memoryview, width: int) -> bytes:
    """The digest a segment is recorded with: its CRC-32 (4 bytes) or, for older contents, its sha256."""
    if width == LEGACY_DIGEST_BYTES:
        return hashlib.sha256(segment).digest()
    return _crc_digest(zlib.crc32(segment))


class BlobReader:
    """A verified, chunked read of one blob's byte range."""

    def __init__(
        self,
        info: BlobInfo,
        file: BinaryIO,
        offset: int,
        end: int,
        chunk_bytes: int,
        chunk_digests: bytes,
        digest_bytes: int,
    ) -> None:
        self.info = info
        self._file = file
        self._chunk_bytes = chunk_bytes
        self._digests = chunk_digests
        self._width = digest_bytes
        self._position = offset
        self._end = end

    def next_chunk(self) -> tuple[int, bytes] | None:
        """The next (offset, bytes) of the range, verified; None at the end.

        Raises:
            DataLoss: the segment on disk does not match its digest (or is short).
        """
        if self._position >= self._end:
            return None
        index = self._position // self._chunk_bytes
        start = index * self._chunk_bytes
        self._file.seek(start)
        segment = self._file.read(min(self._chunk_bytes, self.info.size_bytes - start))
        expected = self._digests[index * self._width : (index + 1) * self._width]
        if len(segment) != min(self._chunk_bytes, self.info.size_bytes - start) or (
            segment_digest(segment, self._width) != expected
        ):
            log.error("blob %s: segment %d on disk fails its digest", self.info.sha256, index)
            raise DataLoss(f"blob {self.info.sha256}: stored content is corrupt at byte {start}")
        piece = segment[self._position - start : min(len(segment), self._end - start)]
        offset = self._position
        self._position += len(piece)
        return offset, piece

    def close(self) -> None:
        """Closes the file."""
        self._file.close()


class BlobStore:
    """Blobs under ``<data_dir>/blobs`` with names and refcounts in the shared database."""

    def __init__(
        self,
        db: Database,
        root: Path,
        *,
        limits: BlobLimits | None = None,
        quotas: JobQuotas | None = None,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self._db = db
        self.root = root
        self.limits = limits or BlobLimits()
        self._quotas = quotas or JobQuotas()
        self._clock_ms = clock_ms
        self._tmp = root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)
        # Whole-content hashes of uploads and write-behind syncs; a task never
        # waits on another task here, so a few threads shared by every transfer cannot deadlock.
        self.helper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="stored-blob")

    def close(self) -> None:
        """Stops the helper threads (after the transfers using them ended); idempotent."""
        self.helper.shutdown(wait=True)

    def content_path(self, sha256: str) -> Path:
        """Where the content with this hash lives."""
        return self.root / sha256[:2] / sha256

    # ---- start-up -----------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Removes leftovers of interrupted uploads/deletes; returns (temp files, orphans).

        Also logs (does not delete) recorded contents whose file is missing or short:
        reading them answers DATA_LOSS.
        """
        temps = 0
        for path in self._tmp.iterdir():
            path.unlink()
            temps += 1
        with self._db.read() as conn:
            known = {str(sha): int(size) for sha, size in conn.execute("SELECT sha256, size_bytes FROM blob_contents")}
        orphans = 0
        for directory in self.root.iterdir():
            if directory == self._tmp or not directory.is_dir():
                continue
            for path in directory.iterdir():
                if path.name not in known:
                    path.unlink()
                    orphans += 1
        for sha, size in known.items():
            path = self.content_path(sha)
            actual = path.stat().st_size if path.exists() else -1
            if actual != size:
                log.error("blob %s: file %s has %d bytes, recorded %d", sha, path, actual, size)
        if temps or orphans:
            log.info("blob recovery: removed %d temp file(s) and %d unreferenced content file(s)", temps, orphans)
        return temps, orphans

    # ---- write --------------------------------------------------------------------

    def begin_upload(self, name: str, size_bytes: int, sha256: str = "", job_id: str = "") -> BlobUpload:
        """Validates an upload header and opens its temp file.

        Raises:
            InvalidArgument: a bad name, hash or job id.
            ResourceExhausted: larger than the blob limit or the job's quota.
        """
        validate_name(name)
        if name.startswith(HASH_PREFIX):
            raise InvalidArgument(f"bad blob name {name!r}: the {HASH_PREFIX} prefix is reserved")
        sha256 = sha256.lower()
        if sha256 and not SHA256_RE.fullmatch(sha256):
            raise InvalidArgument(f"bad sha256 {sha256!r}: expected 64 hex digits")
        if job_id:
            validate_job_id(job_id)
        if size_bytes < 0:
            raise InvalidArgument(f"bad size_bytes {size_bytes}")
        if size_bytes > self.limits.max_blob_bytes:
            raise ResourceExhausted(f"blob {name!r}: {size_bytes} bytes > limit {self.limits.max_blob_bytes}")
        if job_id:
            with self._db.read() as conn:
                check_quota(conn, self._quotas, job_id, size_bytes - self._named_bytes(conn, name, job_id))
        tmp_path = self._tmp / f"{uuid.uuid4().hex}.upload"
        return BlobUpload(self, name, size_bytes, sha256, job_id, tmp_path)

    @staticmethod
    def _named_bytes(conn: sqlite3.Connection, name: str, job_id: str) -> int:
        row = conn.execute("SELECT size_bytes FROM blob_names WHERE name = ? AND job_id = ?", (name, job_id)).fetchone()
        return int(row[0]) if row else 0

    def _commit(self, upload: BlobUpload, sha: str, chunk_digests: bytes, tmp_path: Path) -> BlobInfo:
        now_ms = self._clock_ms()
        final = self.content_path(sha)
        dropped: str | None = None
        # Rename and record under the write lock: a concurrent delete of the same
        # content cannot unlink the file between the two.
        with self._db.exclusive():
            with self._db.write() as conn:
                if upload.job_id:
                    check_quota(
                        conn, self._quotas, upload.job_id,
                        upload.size_bytes - self._named_bytes(conn, upload.name, upload.job_id),
                    )
                exists = conn.execute("SELECT 1 FROM blob_contents WHERE sha256 = ?", (sha,)).fetchone()
                if exists is None:
                    final.parent.mkdir(exist_ok=True)
                    os.replace(tmp_path, final)
                    _fsync_dir(final.parent)
                    conn.execute(
                        "INSERT INTO blob_contents (sha256, size_bytes, chunk_bytes, chunk_digests, refcount, "
                        "created_unix_ms) VALUES (?, ?, ?, ?, 0, ?)",
                        (sha, upload.size_bytes, self.limits.chunk_bytes, chunk_digests, now_ms),
                    )
                old = conn.execute("SELECT sha256 FROM blob_names WHERE name = ?", (upload.name,)).fetchone()
                if old is not None and str(old[0]) == sha:
                    conn.execute(
                        "UPDATE blob_names SET job_id = ?, created_unix_ms = ? WHERE name = ?",
                        (upload.job_id, now_ms, upload.name),
                    )
                else:
                    conn.execute(
                        "INSERT OR REPLACE INTO blob_names (name, sha256, job_id, size_bytes, created_unix_ms) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (upload.name, sha, upload.job_id, upload.size_bytes, now_ms),
                    )
                    conn.execute("UPDATE blob_contents SET refcount = refcount + 1 WHERE sha256 = ?", (sha,))
                    if old is not None:
                        dropped = self._unref(conn, str(old[0]))
            self._remove_content(dropped)
        log.info("blob %r -> %s (%d bytes)", upload.name, sha, upload.size_bytes)
        return BlobInfo(name=upload.name, sha256=sha, size_bytes=upload.size_bytes, created_unix_ms=now_ms)

    @staticmethod
    def _unref(conn: sqlite3.Connection, sha: str) -> str | None:
        conn.execute("UPDATE blob_contents SET refcount = refcount - 1 WHERE sha256 = ?", (sha,))
        row = conn.execute("SELECT refcount FROM blob_contents WHERE sha256 = ?", (sha,)).fetchone()
        if row is not None and int(row[0]) <= 0:
            conn.execute("DELETE FROM blob_contents WHERE sha256 = ?", (sha,))
            return sha
        return None

    def _remove_content(self, sha: str | None) -> None:
        """Removes a content file after the commit that dropped it, under the write lock.

        After the commit: a crash in between leaves an unreferenced file that recover()
        removes, never a row without its file. Under the lock: an upload of the same
        content cannot re-create the file in between and lose it to this unlink.
        """
        if sha is not None:
            with contextlib.suppress(FileNotFoundError):
                self.content_path(sha).unlink()

    # ---- read ---------------------------------------------------------------------

    def _resolve(self, conn: sqlite3.Connection, name: str) -> tuple[BlobInfo, int, bytes]:
        if name.startswith(HASH_PREFIX):
            sha = name[len(HASH_PREFIX) :].lower()
            if not SHA256_RE.fullmatch(sha):
                raise InvalidArgument(f"bad blob reference {name!r}: expected sha256:<64 hex digits>")
            row = conn.execute(
                "SELECT sha256, size_bytes, created_unix_ms, chunk_bytes, chunk_digests FROM blob_contents "
                "WHERE sha256 = ?",
                (sha,),
            ).fetchone()
        else:
            validate_name(name)
            row = conn.execute(
                "SELECT c.sha256, c.size_bytes, n.created_unix_ms, c.chunk_bytes, c.chunk_digests "
                "FROM blob_names n JOIN blob_contents c ON c.sha256 = n.sha256 WHERE n.name = ?",
                (name,),
            ).fetchone()
        if row is None:
            raise NotFound(f"blob {name!r} not found")
        sha, size, created, chunk_bytes, digests = row
        return BlobInfo(name=name, sha256=str(sha), size_bytes=int(size), created_unix_ms=int(created)), int(
            chunk_bytes
        ), bytes(digests)

    def stat(self, name: str) -> BlobInfo:
        """The blob a name or ``sha256:<hex>`` refers to; raises NotFound."""
        with self._db.read() as conn:
            return self._resolve(conn, name)[0]

    def open_reader(self, name: str, offset: int = 0, length: int = 0) -> BlobReader:
        """Opens a verified read of [offset, offset + length) (length 0 = to the end).

        Raises:
            NotFound: unknown name or missing content.
            InvalidArgument: offset past the end.
        """
        with self._db.read() as conn:
            info, chunk_bytes, digests = self._resolve(conn, name)
        if offset < 0 or length < 0 or offset > info.size_bytes:
            raise InvalidArgument(f"blob {name!r}: offset {offset} outside its {info.size_bytes} bytes")
        end = info.size_bytes if length == 0 else min(info.size_bytes, offset + length)
        width = segment_digest_bytes(info.size_bytes, chunk_bytes, digests)
        try:
            file = self.content_path(info.sha256).open("rb")
        except FileNotFoundError:
            log.error("blob %s: content file is missing", info.sha256)
            raise DataLoss(f"blob {name!r}: content file {info.sha256} is missing") from None
        return BlobReader(info, file, offset, end, chunk_bytes, digests, width)

    def read_bytes(self, name: str, offset: int = 0, length: int = 0) -> bytes:
        """A whole verified range in memory; for tests and small blobs."""
        reader = self.open_reader(name, offset, length)
        try:
            parts: list[bytes] = []
            while (item := reader.next_chunk()) is not None:
                parts.append(item[1])
            return b"".join(parts)
        finally:
            reader.close()

    def list(self, prefix: str = "", limit: int = 0) -> list[BlobInfo]:
        """Named blobs whose names start with prefix, in name order."""
        if len(prefix) > MAX_NAME_CHARS:
            raise InvalidArgument("prefix too long")
        limit = min(limit or self.limits.max_list_results, self.limits.max_list_results)
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        with self._db.read() as conn:
            rows = conn.execute(
                "SELECT name, sha256, size_bytes, created_unix_ms FROM blob_names WHERE name LIKE ? ESCAPE '\\' "
                "ORDER BY name LIMIT ?",
                (escaped + "%", limit),
            ).fetchall()
        return [BlobInfo(name=str(n), sha256=str(s), size_bytes=int(b), created_unix_ms=int(c)) for n, s, b, c in rows]

    # ---- delete and totals --------------------------------------------------------

    def delete(self, name: str) -> bool:
        """Removes a name; True when its content was deleted too (no name left on it).

        Raises:
            NotFound: no blob has this name.
        """
        validate_name(name)
        with self._db.exclusive():
            with self._db.write() as conn:
                row = conn.execute("SELECT sha256 FROM blob_names WHERE name = ?", (name,)).fetchone()
                if row is None:
                    raise NotFound(f"blob {name!r} not found")
                conn.execute("DELETE FROM blob_names WHERE name = ?", (name,))
                dropped = self._unref(conn, str(row[0]))
            self._remove_content(dropped)
        log.info("blob %r deleted%s", name, " with its content" if dropped else "")
        return dropped is not None

    def totals(self) -> tuple[int, int]:
        """(number of distinct contents, their total bytes)."""
        with self._db.read() as conn:
            count, size = conn.execute("SELECT COUNT(*), COALESCE(SUM(size_bytes), 0) FROM blob_contents").fetchone()
        return int(count), int(size)
