"""Unit tests of the blob store (no network)."""

from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import pytest

from flexmarl.errors import DataLoss, InvalidArgument, NotFound, ResourceExhausted
from stored.blobs import BlobLimits, BlobStore
from stored.database import Database, JobQuotas

CHUNK = 1024


@pytest.fixture
def blobs(db: Database, tmp_path: Path) -> BlobStore:
    store = BlobStore(db, tmp_path / "blobs", limits=BlobLimits(chunk_bytes=CHUNK, max_put_chunk_bytes=4096))
    store.recover()
    return store


def put(store: BlobStore, name: str, data: bytes, *, piece: int = 700, sha: str | None = None, job: str = ""):
    upload = store.begin_upload(name, len(data), hashlib.sha256(data).hexdigest() if sha is None else sha, job)
    for start in range(0, len(data), piece):
        upload.write(data[start : start + piece])
    return upload.commit()


def test_round_trip_ranges_and_hash_name(blobs: BlobStore) -> None:
    data = os.urandom(5 * CHUNK + 123)
    info = put(blobs, "weights/job1/alice/3", data)
    assert info.sha256 == hashlib.sha256(data).hexdigest() and info.size_bytes == len(data)
    assert blobs.read_bytes("weights/job1/alice/3") == data
    assert blobs.read_bytes(f"sha256:{info.sha256}") == data
    for offset, length in [(0, 1), (CHUNK - 1, 2), (1500, 0), (len(data) - 1, 0), (len(data), 0), (10, 3000)]:
        expected = data[offset : offset + length] if length else data[offset:]
        assert blobs.read_bytes("weights/job1/alice/3", offset, length) == expected
    assert blobs.stat("weights/job1/alice/3") == info
    with pytest.raises(InvalidArgument):
        blobs.open_reader("weights/job1/alice/3", len(data) + 1)
    reader = blobs.open_reader("weights/job1/alice/3")
    offsets = []
    while (item := reader.next_chunk()) is not None:
        offsets.append(item[0])
    reader.close()
    assert offsets == [i * CHUNK for i in range(6)]


def test_empty_blob(blobs: BlobStore) -> None:
    info = put(blobs, "empty", b"")
    assert info.size_bytes == 0 and blobs.read_bytes("empty") == b""


def test_dedup_refcount_and_delete(blobs: BlobStore) -> None:
    data = os.urandom(3000)
    a = put(blobs, "a", data)
    put(blobs, "b", data)
    assert blobs.totals() == (1, 3000)
    assert not blobs.delete("a")
    assert blobs.read_bytes("b") == data
    assert blobs.delete("b")
    assert blobs.totals() == (0, 0)
    assert not blobs.content_path(a.sha256).exists()
    with pytest.raises(NotFound):
        blobs.delete("b")
    with pytest.raises(NotFound):
        blobs.stat("a")


def test_overwrite_moves_the_name(blobs: BlobStore) -> None:
    first = put(blobs, "state/job1/alice", b"one" * 500)
    put(blobs, "state/job1/alice", b"two" * 500)
    assert blobs.read_bytes("state/job1/alice") == b"two" * 500
    assert not blobs.content_path(first.sha256).exists()
    assert [b.name for b in blobs.list("state/")] == ["state/job1/alice"]
    put(blobs, "state/job1/alice", b"two" * 500)  # same content again: no change
    assert blobs.totals() == (1, 1500)


def test_list_prefix_is_literal(blobs: BlobStore) -> None:
    for name in ["w/a_1", "w/ab", "x/1"]:
        put(blobs, name, name.encode())
    assert [b.name for b in blobs.list("w/a_")] == ["w/a_1"]
    assert [b.name for b in blobs.list("")] == ["w/a_1", "w/ab", "x/1"]
    assert len(blobs.list("", limit=2)) == 2


def test_bad_uploads(blobs: BlobStore, db: Database, tmp_path: Path) -> None:
    data = os.urandom(2000)
    with pytest.raises(DataLoss):
        put(blobs, "x", data, sha="0" * 64)
    with pytest.raises(InvalidArgument):
        put(blobs, "x", data, sha="xyz")
    for name in ["", "/a", "a//b", "a/../b", "sha256:abc", "a b", "x" * 600]:
        with pytest.raises(InvalidArgument):
            blobs.begin_upload(name, 1)
    upload = blobs.begin_upload("short", 10)
    upload.write(b"12345")
    with pytest.raises(InvalidArgument, match="announced"):
        upload.commit()
    upload = blobs.begin_upload("long", 3)
    with pytest.raises(InvalidArgument):
        upload.write(b"1234")
    upload.abort()
    upload = blobs.begin_upload("chunky", 10_000)
    with pytest.raises(ResourceExhausted):
        upload.write(b"x" * 5000)
    upload.abort()
    small = BlobStore(db, tmp_path / "blobs", limits=BlobLimits(max_blob_bytes=100))
    with pytest.raises(ResourceExhausted):
        small.begin_upload("big", 101)
    assert blobs.totals() == (0, 0)
    assert list((tmp_path / "blobs" / "tmp").iterdir()) == []


def test_job_quota_counts_named_blobs(db: Database, tmp_path: Path) -> None:
    store = BlobStore(db, tmp_path / "blobs", quotas=JobQuotas(default_bytes=5000))
    put(store, "j/a", os.urandom(3000), job="j")
    with pytest.raises(ResourceExhausted, match="quota"):
        put(store, "j/b", os.urandom(3000), job="j")
    put(store, "j/a", os.urandom(4000), job="j")  # replacing a name is charged the difference
    put(store, "other", os.urandom(3000), job="k")
    with pytest.raises(InvalidArgument):
        store.begin_upload("j/c", 1, job_id="bad job")


def test_corruption_is_detected_per_chunk_and_whole(blobs: BlobStore) -> None:
    data = os.urandom(4 * CHUNK)
    info = put(blobs, "c", data)
    path = blobs.content_path(info.sha256)
    os.chmod(path, 0o644)
    with path.open("r+b") as f:
        f.seek(2 * CHUNK + 5)
        f.write(b"\x00" if data[2 * CHUNK + 5] else b"\x01")
    assert blobs.read_bytes("c", 0, CHUNK) == data[:CHUNK]  # untouched chunk still verifies
    with pytest.raises(DataLoss):
        blobs.read_bytes("c", 2 * CHUNK, 10)
    with pytest.raises(DataLoss):
        blobs.read_bytes("c")
    path.unlink()
    with pytest.raises(DataLoss):
        blobs.read_bytes("c")


def _segments(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]


def _recorded_digests(db: Database, sha: str) -> bytes:
    with db.read() as conn:
        return bytes(conn.execute("SELECT chunk_digests FROM blob_contents WHERE sha256 = ?", (sha,)).fetchone()[0])


def test_segments_are_recorded_with_their_crc32(blobs: BlobStore, db: Database) -> None:
    data = os.urandom(3 * CHUNK + 17)
    info = put(blobs, "c", data, piece=333)  # pieces straddle segment boundaries
    expected = b"".join(zlib.crc32(s).to_bytes(4, "big") for s in _segments(data))
    assert _recorded_digests(db, info.sha256) == expected


def test_contents_recorded_with_sha256_segment_digests_still_verify(blobs: BlobStore, db: Database) -> None:
    """A content uploaded before the CRC-32 digests (32-byte sha256 per segment) reads and detects damage."""
    data = os.urandom(4 * CHUNK + 5)
    info = put(blobs, "old", data)
    legacy = b"".join(hashlib.sha256(s).digest() for s in _segments(data))
    with db.write() as conn:
        conn.execute("UPDATE blob_contents SET chunk_digests = ? WHERE sha256 = ?", (legacy, info.sha256))
    assert blobs.read_bytes("old") == data
    assert blobs.read_bytes("old", CHUNK + 3, 2 * CHUNK) == data[CHUNK + 3 : 3 * CHUNK + 3]
    path = blobs.content_path(info.sha256)
    os.chmod(path, 0o644)
    with path.open("r+b") as f:
        f.seek(4 * CHUNK + 1)
        f.write(b"\x00" if data[4 * CHUNK + 1] else b"\x01")
    assert blobs.read_bytes("old", 0, 4 * CHUNK) == data[: 4 * CHUNK]
    with pytest.raises(DataLoss, match="corrupt at byte 4096"):
        blobs.read_bytes("old", 4 * CHUNK)


def test_a_damaged_digest_record_is_data_loss_not_a_wrong_read(blobs: BlobStore, db: Database) -> None:
    data = os.urandom(2 * CHUNK)
    info = put(blobs, "d", data)
    with db.write() as conn:
        conn.execute("UPDATE blob_contents SET chunk_digests = ? WHERE sha256 = ?", (b"\x00" * 7, info.sha256))
    with pytest.raises(DataLoss, match="fit no digest of 2 segments"):
        blobs.read_bytes("d")


def test_recover_removes_leftovers(blobs: BlobStore, tmp_path: Path) -> None:
    keep = put(blobs, "keep", b"k" * 100)
    (tmp_path / "blobs" / "tmp" / "x.upload").write_bytes(b"half")
    orphan = tmp_path / "blobs" / "ab" / ("ab" + "0" * 62)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"orphan")
    assert blobs.recover() == (1, 1)
    assert not orphan.exists() and blobs.read_bytes("keep") == b"k" * 100
    assert blobs.content_path(keep.sha256).exists()
