"""What an engine attached by URL on another host receives in ``/update_weights_from_disk``.

rolloutd resolves a weights URI to a directory in *its* filesystem; an attached engine
elsewhere sees the shared filesystem under another prefix. ``engine_path_map`` names the
directory as the engine sees it, and a directory outside every mapped prefix is refused
before anything is sent. The end-to-end test runs a real embedded engine in its own mount
namespace (root + ``unshare``): there rolloutd's cache is hidden and mounted elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexmarl.artifacts import file_uri
from flexmarl.config import ConfigError, load_config
from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.store_client import StoreClient
from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.config import EnginePathMap, RolloutConfig
from rolloutd.engines.launcher import attach
from rolloutd.worker import WorkerSettings, weights_resolver


async def _no_store() -> StoreClient:
    raise AssertionError("a file:// URI needs no stored client")


def test_path_map_takes_the_longest_prefix_on_whole_components() -> None:
    path_map = EnginePathMap.parse("/data=/mnt/shared, /data/cache=/cache/rolloutd")
    assert path_map.to_engine("/data/cache/v3") == "/cache/rolloutd/v3"
    assert path_map.to_engine("/data/models/base") == "/mnt/shared/models/base"
    assert path_map.to_engine("/data") == "/mnt/shared"
    with pytest.raises(InvalidArgument, match="outside every engine_path_map prefix"):
        path_map.to_engine("/database/v1")  # /data is a prefix of the string, not of the path
    with pytest.raises(InvalidArgument, match="outside every engine_path_map prefix"):
        path_map.to_engine("/home/me/ckpt")
    assert EnginePathMap.parse("").to_engine("/anything") == "/anything"  # no rules: same path on both hosts
    assert EnginePathMap.parse("/=/remote").to_engine("/a/b") == "/remote/a/b"


def test_path_map_config_is_validated() -> None:
    for bad in ("/data", "data=/mnt", "/data=mnt"):
        with pytest.raises(ConfigError, match="engine_path_map"):
            load_config(RolloutConfig, ["--engine-urls", "http://h:1", "--engine-path-map", bad], prog="rolloutd",
                        env={})
    with pytest.raises(ConfigError, match="applies to engines attached by engine_urls"):
        load_config(RolloutConfig, ["--engine-path-map", "/a=/b"], prog="rolloutd", env={})
    config = load_config(RolloutConfig, ["--engine-urls", "http://h:1", "--engine-path-map", "/a=/b",
                                         "--weights-cache-dir", "/a/cache"], prog="rolloutd", env={})
    assert config.path_map().to_engine("/a/cache/x") == "/b/cache/x"


def test_weights_cache_can_live_outside_the_work_dir(tmp_path: Path) -> None:
    settings = WorkerSettings(worker_id="w", work_dir=tmp_path / "work", max_tasks=1, engine_backend="embedded",
                              engine_replicas=1, engine_urls=(), engine_threads=1, orchestrator_address="",
                              store_address="", max_message_bytes=1 << 26)
    assert settings.weights_cache == tmp_path / "work" / "weights"
    shared = tmp_path / "shared" / "cache"
    assert dataclasses.replace(settings, weights_cache_dir=shared).weights_cache == shared


async def test_resolver_names_the_directory_as_the_engine_sees_it(tmp_path: Path) -> None:
    resolve = weights_resolver(tmp_path, EnginePathMap.parse(f"{tmp_path}=/remote/view"), _no_store)
    assert await resolve(file_uri(tmp_path / "job" / "v2")) == "/remote/view/job/v2"
    with pytest.raises(InvalidArgument, match="outside every engine_path_map prefix"):
        await resolve("file:///elsewhere/v2")


# ---- an engine whose filesystem differs from rolloutd's -----------------------------------------


def _can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                           check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def _engine_in_other_mount_namespace(base: Path, local_cache: Path, engine_view: Path,
                                     run_dir: Path) -> Iterator[str]:
    """An embedded engine that sees ``local_cache`` only at ``engine_view`` (the local path is an empty tmpfs)."""
    ready = run_dir / "engine.ready.json"
    log_path = run_dir / "engine.log"
    script = (f'mount --bind "{local_cache}" "{engine_view}" && mount -t tmpfs tmpfs "{local_cache}" && '
              f'exec "{sys.executable}" -m rolloutd.engines.embedded --model-path "{base}" --port 0 '
              f'--ready-file "{ready}"')
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                   stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if process.poll() is not None:
                pytest.fail(f"engine exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"engine not listening after 120 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs root and unshare --mount")
async def test_attached_engine_with_another_filesystem_view_loads_mapped_weights(tmp_path: Path) -> None:
    base = build_tiny_checkpoint(tmp_path / "models" / "base", seed=0)
    local_cache = tmp_path / "rolloutd" / "weights"  # rolloutd's cache (a shared filesystem, here)
    build_tiny_checkpoint(local_cache / "job__agent__v1", seed=1)
    engine_view = tmp_path / "engine-host" / "shared-weights"  # where the engine's host mounts it
    engine_view.mkdir(parents=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = file_uri(local_cache / "job__agent__v1")

    with _engine_in_other_mount_namespace(base, local_cache, engine_view, run_dir) as url:
        async with attach(url).client() as client:
            # Without a mapping the engine is sent rolloutd's own path: it cannot see it there.
            unmapped = weights_resolver(local_cache, EnginePathMap(), _no_store)
            with pytest.raises(FailedPrecondition, match="refused weights"):
                await client.update_weights_from_disk(await unmapped(uri), weight_version="1")

            mapped = weights_resolver(local_cache, EnginePathMap.parse(f"{local_cache}={engine_view}"), _no_store)
            path = await mapped(uri)
            assert path == str(engine_view / "job__agent__v1")
            await client.update_weights_from_disk(path, weight_version="1")
            info = await client.model_info()
            assert info.model_path == path and info.weight_version == "1"

            # A directory outside every mapped prefix never reaches the engine.
            with pytest.raises(InvalidArgument, match="outside every engine_path_map prefix"):
                await mapped(file_uri(base))
            assert (await client.model_info()).model_path == path
