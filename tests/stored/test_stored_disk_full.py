"""stored on a full disk: RESOURCE_EXHAUSTED (reason DISK_FULL), nothing unpersisted acknowledged, recovery.

The data dir is a real 16 MiB tmpfs (``mount -t tmpfs``, root only), filled with a ballast file
until the kernel answers ENOSPC; deleting the ballast gives the space back to the same, still
running stored. Where the OS cannot mount one (not root, no tmpfs) the test is skipped: nothing
else makes the kernel return ENOSPC for a directory honestly.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from flexmarl.errors import ErrorReason, ResourceExhausted
from flexmarl.experience import ExperienceRecord
from flexmarl.store_client import StoreClient
from stored.app import StoredApp
from tests.stored_support import inprocess_stored

pytestmark = pytest.mark.timeout(60)

RecordFactory = Callable[..., ExperienceRecord]
TMPFS_BYTES = 16 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted at tmp_path/disk (skips where mounting is not permitted)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root: without one the OS gives no ENOSPC for a directory")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, timeout=10, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the OS gives no ENOSPC for a directory")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10, check=False)


@pytest.fixture
async def stored_on_small_disk(small_disk: Path) -> AsyncIterator[tuple[StoredApp, StoreClient]]:
    async with inprocess_stored(small_disk / "data") as (app, client, _):
        yield app, client


def fill(path: Path) -> None:
    """Writes path until the file system is full (ENOSPC)."""
    block = b"\xff" * (1 << 20)
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                block = block[: len(block) // 2]
                if len(block) < 512:
                    return


async def test_full_disk_answers_disk_full_persists_nothing_and_recovers(
    stored_on_small_disk: tuple[StoredApp, StoreClient], small_disk: Path, record_factory: RecordFactory
) -> None:
    app, client = stored_on_small_disk
    assert await client.append([record_factory("t0", i) for i in range(4)]) == (4, 0)
    blob = os.urandom(3 << 20)
    ballast = small_disk / "ballast"
    fill(ballast)

    batch = [record_factory(f"t{n}", i, response_tokens=256) for n in range(1, 9) for i in range(4)]
    with pytest.raises(ResourceExhausted) as appended:
        await client.append(batch)
    assert appended.value.reason is ErrorReason.DISK_FULL
    with pytest.raises(ResourceExhausted) as put:
        await client.put_blob_bytes("weights/job1/alice/1", blob, job_id="job1")
    assert put.value.reason is ErrorReason.DISK_FULL
    # nothing that failed is there (reads still work on a full disk), and the upload left no temp file
    stats = await client.stats("job1")
    assert sum(s.rows for s in stats.experiences) == 4 and stats.blob_count == 0
    assert await client.stat_blob("weights/job1/alice/1") is None
    assert list((app.data_dir / "blobs" / "tmp").iterdir()) == []

    ballast.unlink()  # space returns; the same stored serves again, no restart
    assert await client.append(batch) == (len(batch), 0)
    info = await client.put_blob_bytes("weights/job1/alice/1", blob, job_id="job1")
    assert info.sha256 == hashlib.sha256(blob).hexdigest()
    assert await client.get_blob_bytes("weights/job1/alice/1") == blob
    assert len(await client.read("job1", [r.experience_id for r in batch])) == len(batch)
    with contextlib.suppress(FileNotFoundError):
        ballast.unlink()
