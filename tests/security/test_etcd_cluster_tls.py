"""Three etcd members serving mutual TLS with auth: the registry follows the cluster when its member dies.

The members serve clients and each other over mutual TLS (one dev CA, the server certificate at both
ends of the peer links) and auth is enabled once for the cluster. One orchestratord and one registry
reach all three through one TLS channel; the member they use (the first: gRPC's pick_first) is killed,
and both keep writing through the two that remain. A registry told a name the certificates lack is
refused with one line, as an unreachable etcd is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aetcd import rpc

from flexmarl.client import Client
from flexmarl.cluster import DaemonProcess, EtcdCluster, EtcdTls, wait_until
from flexmarl.devcerts import DevCerts, generate
from flexmarl.errors import FlexmarlError, Unavailable
from flexmarl.registry import EtcdSecurity, Registry

pytestmark = pytest.mark.timeout(180)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"


@dataclasses.dataclass
class SecureCluster:
    certs: DevCerts
    etcd: EtcdCluster
    security: EtcdSecurity
    orchestratord: DaemonProcess


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    run_dir = tmp_path_factory.mktemp("etcd-cluster-tls")
    certs = generate(run_dir / "tls")
    tls = EtcdTls(certs.server_cert, certs.server_key, certs.ca, client_cert_auth=True)
    etcd = EtcdCluster(run_dir / "etcd", 3, tls=tls, auth=True)
    etcd.start(timeout_s=60)
    orch: DaemonProcess | None = None
    try:
        assert etcd.password_file is not None
        security = EtcdSecurity.from_files(ca=str(certs.ca), cert=str(certs.client_cert), key=str(certs.client_key),
                                           username=etcd.username, password_file=str(etcd.password_file))
        orch = DaemonProcess("orchestratord", etcd.client_args(), etcd_endpoint=etcd.endpoint, run_dir=run_dir)
        orch.start()
        yield SecureCluster(certs, etcd, security, orch)
    finally:
        if orch is not None:
            orch.terminate(timeout_s=10)
        etcd.stop()


def _job() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
    spec["total_steps"] = 1
    return spec


async def _peer_urls(registry: Registry) -> list[str]:
    reply = await registry.client.clusterstub.MemberList(rpc.MemberListRequest(), timeout=5)
    return [url for member in reply.members for url in member.peerURLs]


def test_members_talk_tls_to_each_other_and_require_auth(secure_cluster: SecureCluster) -> None:
    s = secure_cluster
    assert s.etcd.client_args()[:2] == ["--etcd-ca", str(s.certs.ca)]
    assert "--etcd-password-file" in s.etcd.client_args()

    async def check() -> None:
        registry = Registry(s.etcd.endpoint, connect_timeout_s=10, security=s.security)
        await registry.connect()
        try:
            urls = await _peer_urls(registry)
        finally:
            await registry.close()
        assert len(urls) == 3 and all(url.startswith("https://") for url in urls), urls
        # Auth is on for the whole cluster: the CA and a certificate alone get no key.
        anonymous = Registry(s.etcd.endpoint, connect_timeout_s=3,
                             security=dataclasses.replace(s.security, username="", password=""))
        with pytest.raises(Unavailable, match=r"^etcd rejected the credentials \(no user\)"):
            await anonymous.connect()
        await anonymous.close()

    asyncio.run(check())


def test_a_name_the_certificates_lack_is_refused(secure_cluster: SecureCluster) -> None:
    s = secure_cluster

    async def check() -> None:
        registry = Registry(s.etcd.endpoint, connect_timeout_s=1.5,
                            security=dataclasses.replace(s.security, server_name="etcd.elsewhere.example"))
        with pytest.raises(Unavailable, match=r"^etcd unreachable"):
            await registry.connect()
        await registry.close()

    asyncio.run(check())


def test_daemons_and_clients_follow_the_cluster_when_their_member_dies(secure_cluster: SecureCluster) -> None:
    """Runs last in the module: it kills the first member for good."""
    s = secure_cluster
    with Client(etcd_endpoints=s.etcd.endpoint, etcd_security=s.security, timeout_s=10) as client:
        first = client.submit(_job())
        s.etcd.members[0].kill()  # every channel started on it (pick_first over the list)
        submitted: list[str] = []

        def submit_once_moved() -> bool:
            # Until orchestratord's channel has moved to a live member its etcd write fails as
            # unreachable or runs out of time; any other error (a refused certificate or token)
            # fails the test, and a channel that never moves fails the wait.
            try:
                submitted.append(client.submit(_job()))
            except FlexmarlError as exc:
                text = str(exc)
                if not any(m in text for m in ("ConnectionFailedError", "UNAVAILABLE", "DEADLINE_EXCEEDED")):
                    raise
                return False
            return True

        wait_until(submit_once_moved, 60, "orchestratord to write through a live member", 0.5)
        assert {first, *submitted} <= {j.job_id for j in client.list_jobs()}

    async def read_back() -> list[str]:
        # A fresh registry finds the live members too (the dead one is skipped) and reads the writes.
        registry = Registry(s.etcd.endpoint, connect_timeout_s=10, security=s.security)
        await registry.connect()
        try:
            return [r.service_id for r in await registry.list_services()]
        finally:
            await registry.close()

    assert s.orchestratord.service_id in asyncio.run(read_back())
    assert s.orchestratord.alive()
    wait_until(lambda: not s.etcd.members[0].alive(), 5, "the killed member to be gone")
