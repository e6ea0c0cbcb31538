"""Where a training state lives: one API, three location kinds.

A training state is a directory (DeepSpeed checkpoint + per-rank trainer file,
written by :meth:`traind.model.AgentTrainer.save_state`). A
:class:`StateLocation` stores such a directory and gives it back:

* ``mem://<name>`` — the files' bytes in host memory of this traind process
  (a :class:`MemoryStateStore` the daemon owns).
* ``file:///abs/dir`` — the directory itself, on local or shared disk.
* ``stored://<name>`` — one tar blob per rank in stored, reachable from any node.

A leaf module: it knows directories and URIs, not engines (:mod:`traind.model` saves
into a location, :mod:`traind.swap` moves an agent between a slot and a location).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from flexmarl.errors import InvalidArgument, NotFound

SCHEMES = ("mem", "file", "stored")


def _scratch_root() -> str | None:
    """The tmpfs mount when the host has one: staging a state there never touches a disk."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


class BlobFileStore(Protocol):
    """The part of ``flexmarl.store_client.StoreClient`` that ``stored://`` needs.

    The methods may be coroutines (the real asyncio client): they then run on the
    event loop given to :func:`open_location`, from the calling (torch) thread.
    """

    def put_blob_file(self, name: str, path: Path, *, job_id: str = "") -> Any:
        """Uploads a file as the blob ``name``."""
        ...

    def get_blob_file(self, name: str, path: Path) -> Any:
        """Downloads the blob ``name`` into ``path`` (verified)."""
        ...


class StateLocation(abc.ABC):
    """A place that holds one agent's training-state directory."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    @abc.abstractmethod
    def writable_dir(self) -> contextlib.AbstractContextManager[Path]:
        """A directory to write the state into; the state is stored when the context exits cleanly."""

    @abc.abstractmethod
    def readable_dir(self) -> contextlib.AbstractContextManager[Path]:
        """A directory holding the stored state, valid inside the context.

        Raises:
            NotFound: nothing was stored at this location.
        """

    @abc.abstractmethod
    def delete(self) -> None:
        """Forgets the stored state (no error when there is none)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class MemoryStateStore:
    """Host-memory states of one traind process: name -> (relative path -> bytes)."""

    def __init__(self) -> None:
        self._states: dict[str, dict[str, bytes]] = {}
        self._lock = threading.Lock()

    def put(self, name: str, files: dict[str, bytes]) -> None:
        """Stores (replaces) a state."""
        with self._lock:
            self._states[name] = files

    def get(self, name: str) -> dict[str, bytes]:
        """The files of a state; raises NotFound."""
        with self._lock:
            if name not in self._states:
                raise NotFound(f"no state mem://{name}")
            return self._states[name]

    def pop(self, name: str) -> None:
        """Drops a state if present."""
        with self._lock:
            self._states.pop(name, None)

    def nbytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return sum(len(b) for files in self._states.values() for b in files.values())


class MemoryLocation(StateLocation):
    """``mem://<name>``: the state's files as bytes in this process's memory."""

    def __init__(self, uri: str, name: str, store: MemoryStateStore) -> None:
        super().__init__(uri)
        self._name = name
        self._store = store

    @contextlib.contextmanager
    def writable_dir(self) -> Iterator[Path]:
        """Stages in tmpfs, then reads the files into memory."""
        with tempfile.TemporaryDirectory(prefix="flexmarl-state-", dir=_scratch_root()) as tmp:
            root = Path(tmp)
            yield root
            files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
            self._store.put(self._name, files)

    @contextlib.contextmanager
    def readable_dir(self) -> Iterator[Path]:
        """Materialises the files in tmpfs for the engine to load."""
        files = self._store.get(self._name)
        with tempfile.TemporaryDirectory(prefix="flexmarl-state-", dir=_scratch_root()) as tmp:
            root = Path(tmp)
            for rel, data in files.items():
                path = root / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            yield root

    def delete(self) -> None:
        """Drops the bytes."""
        self._store.pop(self._name)


class FileLocation(StateLocation):
    """``file:///abs/dir``: the state directory itself (shared FS for data-parallel agents)."""

    def __init__(self, uri: str, path: Path) -> None:
        super().__init__(uri)
        self._path = path

    @contextlib.contextmanager
    def writable_dir(self) -> Iterator[Path]:
        """The target directory itself.

        Not emptied first: with data parallelism every rank writes its shard into the
        same (shared) directory concurrently; DeepSpeed overwrites files of the same tag.
        """
        self._path.mkdir(parents=True, exist_ok=True)
        yield self._path

    @contextlib.contextmanager
    def readable_dir(self) -> Iterator[Path]:
        """The directory in place."""
        if not self._path.is_dir():
            raise NotFound(f"no state at {self.uri}")
        yield self._path

    def delete(self) -> None:
        """Removes the directory."""
        shutil.rmtree(self._path, ignore_errors=True)


class StoredLocation(StateLocation):
    """``stored://<name>``: this rank's share of the state as one tar blob in stored."""

    def __init__(
        self,
        uri: str,
        name: str,
        store: BlobFileStore,
        *,
        rank: int,
        world_size: int,
        job_id: str,
        loop: asyncio.AbstractEventLoop | None,
        timeout_s: float,
    ) -> None:
        super().__init__(uri)
        self._blob_name = f"{name}/rank-{rank:05d}-of-{world_size:05d}.tar"
        self._store = store
        self._job_id = job_id
        self._loop = loop
        self._timeout_s = timeout_s

    def _wait(self, result: Any) -> Any:
        if not inspect.isawaitable(result):
            return result
        if self._loop is None:
            raise InvalidArgument("an asyncio stored client needs the event loop it runs on")
        return asyncio.run_coroutine_threadsafe(_as_coroutine(result), self._loop).result(self._timeout_s)

    @property
    def blob_name(self) -> str:
        """The blob this rank writes and reads."""
        return self._blob_name

    @contextlib.contextmanager
    def writable_dir(self) -> Iterator[Path]:
        """Stages locally, then packs one (uncompressed) tar and uploads it."""
        with tempfile.TemporaryDirectory(prefix="flexmarl-state-") as tmp:
            root = Path(tmp) / "state"
            root.mkdir()
            yield root
            archive = Path(tmp) / "state.tar"
            with tarfile.open(archive, "w") as tar:
                tar.add(root, arcname=".")
            self._wait(self._store.put_blob_file(self._blob_name, archive, job_id=self._job_id))

    @contextlib.contextmanager
    def readable_dir(self) -> Iterator[Path]:
        """Downloads and unpacks the blob."""
        with tempfile.TemporaryDirectory(prefix="flexmarl-state-") as tmp:
            archive = Path(tmp) / "state.tar"
            self._wait(self._store.get_blob_file(self._blob_name, archive))
            root = Path(tmp) / "state"
            root.mkdir()
            with tarfile.open(archive, "r") as tar:
                tar.extractall(root, filter="data")
            yield root

    def delete(self) -> None:
        """Blobs are garbage-collected by stored's retention; nothing to do here."""


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def open_location(
    uri: str,
    *,
    memory: MemoryStateStore | None = None,
    store: BlobFileStore | None = None,
    rank: int = 0,
    world_size: int = 1,
    job_id: str = "",
    loop: asyncio.AbstractEventLoop | None = None,
    timeout_s: float = 600.0,
) -> StateLocation:
    """Resolves a state URI to its location.

    Args:
        uri: ``mem://<name>``, ``file:///abs/dir`` or ``stored://<name>``.
        memory: the process's memory store (needed for ``mem://``).
        store: a stored client (needed for ``stored://``).
        rank: this process's data-parallel rank (``stored://`` keeps one blob per rank).
        world_size: the agent's data-parallel world size.
        job_id: owner recorded on ``stored://`` blobs.
        loop: the event loop an asyncio ``store`` runs on (call from another thread).
        timeout_s: bound on one blob transfer.

    Raises:
        InvalidArgument: unknown scheme, empty name, relative path, or missing backend.
    """
    parsed = urlparse(uri)
    scheme = parsed.scheme
    if scheme == "file":
        path = Path(unquote(parsed.path))
        if parsed.netloc not in ("", "localhost") or not path.is_absolute():
            raise InvalidArgument(f"file location must be file:///absolute/path, got {uri!r}")
        return FileLocation(uri, path)
    if scheme in ("mem", "stored"):
        name = (parsed.netloc + parsed.path).strip("/")
        if not name or ".." in name.split("/"):
            raise InvalidArgument(f"bad state name in {uri!r}")
        if scheme == "mem":
            if memory is None:
                raise InvalidArgument("mem:// needs this process's MemoryStateStore")
            return MemoryLocation(uri, name, memory)
        if store is None:
            raise InvalidArgument("stored:// needs a stored client")
        return StoredLocation(
            uri, name, store, rank=rank, world_size=world_size, job_id=job_id, loop=loop, timeout_s=timeout_s
        )
    raise InvalidArgument(f"unknown state location scheme {scheme!r} in {uri!r} (want one of {SCHEMES})")
