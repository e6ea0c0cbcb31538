"""A standing multi-host cluster: etcd and orchestratord on one test host, stored on another, traind and
rolloutd on two more, trains a job to SUCCEEDED with every experience consumed exactly once.

The hosts are network namespaces on a virtual LAN (netns_support.py, shared with the partition test),
each with its own address. The cluster starts through the same code path as `flexmarl slurm` and
`flexmarl up` (LocalCluster with a Placement; here a NetnsRunner where Slurm has srun): every daemon
binds and advertises its host's address from that configuration, none assumes loopback, and every
call between daemons crosses the LAN.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_support import assert_exactly_once, assert_one_commit_per_step, assert_succeeded, running_cluster
from netns_support import NetnsRunner, virtual_lan

from flexmarl.placement import Placement
from flexmarl.registry import Registry

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HOSTS = ("control", "store", "trainer", "rollout")


async def _registered_addresses(endpoint: str, prefix: str) -> dict[str, str]:
    registry = Registry(endpoint, prefix)
    await registry.connect()
    try:
        return {record.kind: record.address for record in await registry.list_services()}
    finally:
        await registry.close()


def test_a_cluster_over_four_hosts_trains_a_job_exactly_once(tmp_path: Path) -> None:
    with virtual_lan(HOSTS) as lan:
        hosts = {name: lan.hosts[name].host for name in HOSTS}
        placement = Placement(control=hosts["control"], store=hosts["store"], trainer=(hosts["trainer"],),
                              rollout=(hosts["rollout"],), runner=NetnsRunner())
        with running_cluster(tmp_path / "run", tmp_path / "models", placement=placement,
                             engine_replicas=1) as e2e:
            assert e2e.cluster.etcd_endpoint.startswith(f"{hosts['control'].address}:")
            addresses = asyncio.run(_registered_addresses(e2e.cluster.etcd_endpoint, e2e.prefix))
            expected = {"orchestratord": "control", "stored": "store", "traind": "trainer", "rolloutd": "rollout"}
            assert {kind: address.rsplit(":", 1)[0] for kind, address in addresses.items()} == {
                kind: hosts[host].address for kind, host in expected.items()}

            spec = e2e.spec(total_steps=3)
            job_id = e2e.client.submit(spec)
            info = e2e.wait_job(job_id, timeout_s=240)
            assert_succeeded(e2e, info, 3)
            assert_one_commit_per_step(e2e, job_id, spec)
            assert_exactly_once(e2e, job_id, spec)
            # Every worker reached its peers over the LAN: metrics served at the hosts' addresses.
            assert "flexmarl_rolloutd_up 1.0" in e2e.metrics_text("rolloutd-0")
