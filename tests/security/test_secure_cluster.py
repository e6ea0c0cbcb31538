"""A whole local cluster with TLS and the token on every daemon, and etcd with mutual TLS and auth, trains a job.

Also checks that the cluster's etcd refuses a plaintext client, a TLS client without a client
certificate and an authenticated-TLS client without the root user (in-process registry
connections, no extra daemons: a second or two).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest

from flexmarl.cli import materialize_models
from flexmarl.client import Client, JobState
from flexmarl.errors import Unavailable
from flexmarl.localcluster import CLUSTER_FILE, LocalCluster, LocalClusterConfig
from flexmarl.registry import EtcdSecurity, Registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_support import small_job  # noqa: E402


def _connect(endpoint: str, security: EtcdSecurity, connect_timeout_s: float = 10.0) -> None:
    """Connects a registry to etcd and lists the services (raises what the connection raised).

    ``connect_timeout_s``: a client etcd cannot talk to (no TLS, no certificate) is refused by the timeout, so
    those cases take a short one; a mutual-TLS handshake with an auth check must not be cut short by it on a
    loaded machine (under the full suite 1 s turned "rejected the credentials" into "unreachable").
    """

    async def connect() -> None:
        registry = Registry(endpoint, connect_timeout_s=connect_timeout_s, security=security)
        try:
            await asyncio.wait_for(registry.connect(), timeout=10)
            await asyncio.wait_for(registry.list_services(), timeout=10)
        finally:
            await registry.close()

    asyncio.run(connect())


def test_secure_local_cluster_trains_and_keeps_the_token_out_of_logs(tmp_path: Path) -> None:
    with LocalCluster(LocalClusterConfig(run_dir=tmp_path / "run", engine_replicas=1, secure=True)) as cluster:
        certs = cluster.certs
        assert certs is not None
        etcd_security = cluster.etcd_security()
        assert etcd_security.cert_pem and etcd_security.username == "root" and etcd_security.password
        spec = materialize_models(small_job(), tmp_path / "models")
        with Client(etcd_endpoints=cluster.etcd_endpoint, tls_ca=str(certs.ca), token_file=str(certs.token_file),
                    etcd_security=etcd_security, timeout_s=10) as client:
            job_id = client.submit(spec)
            # While the job runs: etcd serves mutual TLS with auth, so every other client is refused.
            refused = {  # who -> (their settings, how etcd refuses them, the connect timeout)
                "plaintext": (EtcdSecurity(), "etcd unreachable", 1.0),
                "TLS without a client certificate": (EtcdSecurity(ca_pem=etcd_security.ca_pem), "etcd unreachable",
                                                     1.0),
                "mutual TLS without a user": (dataclasses.replace(etcd_security, username="", password=""),
                                              "etcd rejected the credentials (no user)", 10.0),
                "a wrong password": (dataclasses.replace(etcd_security, password="not-" + etcd_security.password),
                                     "etcd rejected the credentials (user 'root')", 10.0),
            }
            for who, (security, refusal, timeout_s) in refused.items():
                with pytest.raises(Unavailable) as exc:
                    _connect(cluster.etcd_endpoint, security, timeout_s)
                assert str(exc.value).startswith(refusal), (who, str(exc.value))
                assert etcd_security.password not in str(exc.value), who
            _connect(cluster.etcd_endpoint, etcd_security)  # the cluster's own settings are let in
            final = client.wait(job_id, timeout_s=240)
        assert final.state is JobState.SUCCEEDED, final.error
        token = certs.token_file.read_text().strip()
        cluster_file = (cluster.run_dir / CLUSTER_FILE).read_text()
        assert etcd_security.password not in cluster_file and "etcd_password_file" in cluster_file
        for proc in cluster.daemons.values():
            text = proc.log_path.read_text()
            assert token not in text and etcd_security.password not in text, proc.name
            assert "UNAUTHENTICATED" not in text, proc.name
            assert "--etcd-password-file" in proc.command() and "--etcd-cert" in proc.command(), proc.name
