"""The etcd registry against a real etcd server."""

import asyncio

import pytest

from flexmarl.cluster import EtcdServer
from flexmarl.errors import Unavailable
from flexmarl.registry import Registry, ServiceRecord

pytestmark = pytest.mark.timeout(90)


def _record(kind: str, sid: str) -> ServiceRecord:
    return ServiceRecord(kind=kind, service_id=sid, address="127.0.0.1:1", metrics_port=2, pid=3,
                         started_unix_ms=4, info={"slots": 1})


async def test_register_list_deregister(etcd: EtcdServer) -> None:
    reg = Registry(etcd.endpoint, "/t1")
    await reg.connect()
    try:
        await reg.register(_record("stored", "s1"), ttl_s=5)
        await reg.register(_record("traind", "t1"), ttl_s=5)
        kinds = {(r.kind, r.service_id) for r in await reg.list_services()}
        assert kinds == {("stored", "s1"), ("traind", "t1")}
        assert [r.info for r in await reg.list_services("traind")] == [{"slots": 1}]
        await reg.deregister("stored", "s1")
        assert [r.service_id for r in await reg.list_services()] == ["t1"]
    finally:
        await reg.close()


async def test_kv_and_compare_and_swap(etcd: EtcdServer) -> None:
    reg = Registry(etcd.endpoint, "/t2")
    await reg.connect()
    try:
        key = reg.key("jobs", "j1", "spec")
        assert key == "/t2/jobs/j1/spec"
        assert await reg.compare_and_swap(key, None, b"v1")
        assert not await reg.compare_and_swap(key, None, b"v2")
        assert await reg.compare_and_swap(key, b"v1", b"v2")
        assert await reg.get(key) == b"v2"
        await reg.put_many({reg.key("jobs", "j1", "a"): b"1", reg.key("jobs", "j1", "b"): b"2"}, deletes=(key,))
        values, revision = await reg.get_prefix(reg.key("jobs", "j1") + "/")
        assert values == {"/t2/jobs/j1/a": b"1", "/t2/jobs/j1/b": b"2"} and revision > 0
    finally:
        await reg.close()


async def test_lease_expiry_removes_dead_service(etcd: EtcdServer) -> None:
    """A registration whose keep-alive stops (process death) disappears within the TTL."""
    owner = Registry(etcd.endpoint, "/t3")
    watcher = Registry(etcd.endpoint, "/t3")
    await owner.connect()
    await watcher.connect()
    directory = watcher.directory()
    directory.start()
    try:
        await owner.register(_record("rolloutd", "r1"), ttl_s=2)
        await directory.wait_for(lambda s: "r1" in s, timeout_s=10)
        # Simulate death: stop refreshing without deregistering.
        for registration in list(owner._registrations.values()):
            await registration.cancel()
        await directory.wait_for(lambda s: "r1" not in s, timeout_s=10)
    finally:
        await directory.stop()
        await owner.close()
        await watcher.close()


async def test_reregisters_and_rewatches_after_etcd_restart_with_fresh_data(tmp_path) -> None:
    """etcd comes back empty (data lost): the lease is gone, the daemon re-registers, watchers re-list."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    owner = Registry(server.endpoint, "/t4", connect_timeout_s=2)
    watcher = Registry(server.endpoint, "/t4", connect_timeout_s=2)
    try:
        await owner.connect()
        await watcher.connect()
        directory = watcher.directory()
        directory.start()
        await owner.register(_record("stored", "s1"), ttl_s=2)
        await directory.wait_for(lambda s: "s1" in s, timeout_s=10)
        server.terminate()
        import shutil

        shutil.rmtree(server.data_dir)
        await asyncio.to_thread(server.start)
        await directory.wait_for(lambda s: directory.resyncs > 0, timeout_s=20)
        # The owner notices its lease is gone and registers again ...
        deadline = asyncio.get_running_loop().time() + 20
        while [r.service_id for r in await _list_quietly(watcher)] != ["s1"]:
            assert asyncio.get_running_loop().time() < deadline, "s1 did not re-register"
            await asyncio.sleep(0.1)
        # ... and the re-watched directory sees new registrations again.
        await owner.register(_record("traind", "t9"), ttl_s=5)
        await directory.wait_for(lambda s: "t9" in s and "s1" in s, timeout_s=20)
        await directory.stop()
    finally:
        await owner.close()
        await watcher.close()
        server.stop()


async def test_unreachable_etcd_is_unavailable() -> None:
    from flexmarl.cluster import free_port

    reg = Registry(f"127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    with pytest.raises(Unavailable, match="etcd unreachable"):
        await reg.connect()


async def _list_quietly(reg: Registry) -> list[ServiceRecord]:
    try:
        return await reg.list_services()
    except Exception:
        return []
