"""orchestratord's durable state across an etcd restart (a bug the chaos test found).

A commit whose etcd transaction met an etcd restart used to fail with ConnectionFailedError after
the planner had applied it in memory; etcd never got it, every later commit of that agent failed
its version check and the job stalled. EtcdStateStore now retries while etcd is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from flexmarl.cluster import EtcdServer
from flexmarl.registry import Registry
from orchestratord.etcd_state import EtcdStateStore
from orchestratord.state import StepCommit, StepManifest


async def test_writes_during_an_etcd_restart_land_once(etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="orchestratord.etcd_state")
    registry = Registry(etcd.endpoint, "/chaos-state")
    await registry.connect()
    store = EtcdStateStore(registry)
    try:
        assert await store.create_job("j", "{}", ["a"], 1.0)
        first = StepCommit("j", "a", 0, "file:///w1", "file:///s1", "slot", 2.0)
        await store.commit_step(first)

        etcd.kill()
        manifest = StepManifest("j", "a", 1, ("j/b1/t0/0/a/0",), 1, 1)
        second = StepCommit("j", "a", 1, "file:///w2", "file:///s2", "slot", 3.0)
        writes = asyncio.ensure_future(asyncio.gather(store.put_manifest(manifest), store.commit_step(second)))
        # Both writes met the outage (and wait) before etcd comes back.
        deadline_s = time.monotonic() + 20
        while caplog.text.count("etcd unavailable in") < 2:
            assert not writes.done(), f"a write ended while etcd was down: {writes.exception()}"
            assert time.monotonic() < deadline_s, "the writes never reached etcd"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(etcd.start)
        await asyncio.wait_for(writes, timeout=30)

        job = await store.load_job("j")
        assert job is not None
        assert job.agents["a"].version == 2 and job.agents["a"].weights_uri == "file:///w2"
        assert job.commits == {("a", 0): first, ("a", 1): second}
        assert job.manifests == {("a", 1): manifest}
    finally:
        await registry.close()
