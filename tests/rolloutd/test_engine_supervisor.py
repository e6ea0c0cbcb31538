"""rolloutd relaunches an engine replica it launched when the process dies, then gives up after a limit."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rolloutd.engines.launcher import ReplicaSpec, attach, launch
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.engines.supervisor import EngineSupervisor

pytestmark = pytest.mark.timeout(180)


async def _until(condition, what: str, timeout_s: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.05)


async def test_a_killed_replica_comes_back_on_its_url_and_a_crash_loop_is_given_up(
    engine_checkpoint: Path, tmp_path: Path,
) -> None:
    spec = ReplicaSpec("embedded", str(engine_checkpoint), seed=1)
    replica = await launch(spec, tmp_path, timeout_s=120, name="engine-0")
    restarts: list[str] = []
    given_up: list[str] = []
    supervisor = EngineSupervisor([(replica, spec, "engine-0"), (attach("http://127.0.0.1:9"), spec, "remote")],
                                  tmp_path, launch_timeout_s=120, poll_s=0.05, initial_backoff_s=0.05,
                                  max_backoff_s=0.1, max_restarts=1, window_s=600, on_restart=restarts.append,
                                  on_give_up=given_up.append)
    supervisor.start()
    try:
        url, first_pid = replica.url, replica.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)  # as the OOM killer would
        await _until(lambda: restarts == ["engine-0"], "the relaunch")
        assert replica.url == url and replica.pid not in (None, first_pid)  # same URL: the router's entry holds
        async with SGLangClient(url, retries=0) as client:
            assert await client.health()

        second = replica.pid
        assert second is not None
        os.kill(second, signal.SIGKILL)  # a second crash within the window: more than max_restarts
        await _until(lambda: given_up == ["engine-0"], "giving up")
        assert supervisor.given_up == ["engine-0"] and restarts == ["engine-0"]
        assert replica.process is not None and replica.process.poll() is not None  # left down, loudly
    finally:
        await supervisor.stop()
        replica.stop(5)
