"""orchestratord's etcd defragmentation: a member whose db file is mostly free space is defragmented, rate-limited."""

from __future__ import annotations

import pytest

from flexmarl.cluster import EtcdServer
from flexmarl.registry import EtcdMemberStatus, Registry
from orchestratord.etcd_maintenance import DefragPolicy, EtcdDefragmenter

pytestmark = pytest.mark.timeout(60)
MIB = 2**20


def test_the_policy_wants_free_space_both_absolute_and_half_the_file_and_waits_between_runs() -> None:
    policy = DefragPolicy(min_free_bytes=8 * MIB, min_interval_s=100.0)
    assert policy.due(EtcdMemberStatus("e", 20 * MIB, 4 * MIB), None, 0.0)
    assert not policy.due(EtcdMemberStatus("e", 20 * MIB, 4 * MIB), 0.0, 50.0)  # defragmented 50 s ago
    assert policy.due(EtcdMemberStatus("e", 20 * MIB, 4 * MIB), 0.0, 150.0)
    assert not policy.due(EtcdMemberStatus("e", 20 * MIB, 12 * MIB), None, 0.0)  # 8 MiB free but < half
    assert not policy.due(EtcdMemberStatus("e", 6 * MIB, 1 * MIB), None, 0.0)  # mostly free but < 8 MiB
    assert not policy.due(EtcdMemberStatus("e", 0, 0), None, 0.0)


async def test_a_member_with_mostly_free_space_is_defragmented_once(etcd: EtcdServer) -> None:
    registry = Registry(etcd.endpoint, "/defrag")
    await registry.connect()
    try:
        value = b"x" * 4096
        for batch in range(15):  # ~6 MiB of keys, then deleted and compacted away: free pages in the file
            await registry.put_many({registry.key("blob", f"{batch:02d}-{i:03d}"): value for i in range(100)})
        await registry.delete_prefix(registry.key("blob") + "/")
        _, revision = await registry.get_prefix(registry.key("blob") + "/")
        await registry.client.compact(revision, physical=True)
        (before,) = await registry.member_statuses()
        assert before.endpoint == etcd.endpoint and before.free_bytes >= 4 * MIB, before

        clock = [1000.0]
        defragmenter = EtcdDefragmenter(registry, DefragPolicy(min_free_bytes=2 * MIB, min_interval_s=60.0),
                                        clock=lambda: clock[0])
        assert await defragmenter.check_once() == [etcd.endpoint]
        (after,) = await registry.member_statuses()
        assert after.db_bytes < before.db_bytes - 4 * MIB, (before, after)
        assert defragmenter.done == [(etcd.endpoint, before.db_bytes, after.db_bytes)]
        assert await defragmenter.check_once() == []  # not due: nothing free, and within the interval
    finally:
        await registry.close()
