"""Checkpoint directories addressed by URI: ``file:///abs/dir`` or ``stored://<blob name>``.

traind publishes weights (a Hugging Face checkpoint dir) either on a shared path
(``file://``) or as a tar blob in stored (``stored://weights/<job>/<agent>/<version>.tar``)
for hosts without shared storage; rolloutd and the SDK resolve either to a local dir.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tarfile
import tempfile
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from flexmarl.errors import InvalidArgument, NotFound
from flexmarl.store_client import StoreClient

if TYPE_CHECKING:  # torch is imported where tensors are read: rolloutd resolves URIs without it
    import torch

FILE_SCHEME = "file://"
STORED_SCHEME = "stored://"


def file_uri(path: Path) -> str:
    """The file:// URI of a local directory."""
    return FILE_SCHEME + urllib.parse.quote(str(path.resolve()))


def local_path(uri: str) -> Path:
    """The directory of a file:// URI; raises InvalidArgument otherwise."""
    if not uri.startswith(FILE_SCHEME):
        raise InvalidArgument(f"not a file:// URI: {uri!r}")
    return Path(urllib.parse.unquote(uri[len(FILE_SCHEME):]))


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint directory's safetensors shards, by name.

    Raises:
        NotFound: the directory holds no ``*.safetensors`` shard with a tensor.
    """
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    if not out:
        raise NotFound(f"no safetensors in {directory}")
    return out


def weights_blob_name(job_id: str, agent: str, version: int) -> str:
    """The stored blob name of an agent version's weights."""
    return f"weights/{job_id}/{agent}/{version}.tar"


def _pack(src: Path, archive: Path) -> None:
    with tarfile.open(archive, "w") as tar:
        for item in sorted(src.iterdir()):
            tar.add(item, arcname=item.name)


def _unpack(archive: Path, dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        with tarfile.open(archive, "r") as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


async def publish_dir(src: Path, blob_name: str, store: StoreClient, job_id: str = "") -> str:
    """Uploads a checkpoint dir to stored as one tar blob; returns its stored:// URI."""
    with tempfile.TemporaryDirectory(prefix="flexmarl-pack-") as tmp:
        archive = Path(tmp) / "dir.tar"
        await asyncio.to_thread(_pack, src, archive)
        await store.put_blob_file(blob_name, archive, job_id=job_id)
    return STORED_SCHEME + blob_name


async def resolve_dir(uri: str, cache_dir: Path, store: StoreClient | None) -> Path:
    """A local directory holding the checkpoint at uri (downloaded once into cache_dir)."""
    if uri.startswith(FILE_SCHEME):
        return local_path(uri)
    if uri.startswith(STORED_SCHEME):
        if store is None:
            raise InvalidArgument(f"{uri}: a stored:// URI needs a stored client")
        name = uri[len(STORED_SCHEME):]
        dest = cache_dir / name.replace("/", "__").removesuffix(".tar")
        if dest.is_dir():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="flexmarl-fetch-", dir=cache_dir) as tmp:
            archive = Path(tmp) / "dir.tar"
            await store.get_blob_file(name, archive)
            if not dest.is_dir():
                await asyncio.to_thread(_unpack, archive, dest)
        return dest
    if uri.startswith("/"):
        return Path(uri)
    raise InvalidArgument(f"unsupported checkpoint URI {uri!r} (file:// or stored://)")
