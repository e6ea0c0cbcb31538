"""TLS and the bearer token against real daemons: etcd + stored + orchestratord on loopback.

One secure set of daemons (dev CA, server certs, token) serves the module; the mutual-TLS
orchestratord gets its own etcd prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flexmarl.client import Client
from flexmarl.cluster import DaemonProcess, EtcdServer
from flexmarl.config import ConfigError, DaemonConfig, load_config
from flexmarl.devcerts import DevCerts, generate
from flexmarl.errors import FlexmarlError, InvalidArgument, Unauthenticated
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.store_client import StoreClient
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"


@dataclasses.dataclass
class SecureSet:
    certs: DevCerts
    token: str
    etcd: EtcdServer
    stored: DaemonProcess
    orchestratord: DaemonProcess
    run_dir: Path


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureSet]:
    run_dir = tmp_path_factory.mktemp("secure")
    certs = generate(run_dir / "tls")
    etcd = EtcdServer(run_dir / "etcd")
    etcd.start()
    started: list[DaemonProcess] = []
    try:
        stored = DaemonProcess("stored", ["--data-dir", str(run_dir / "stored-data"), *certs.daemon_args()],
                               etcd_endpoint=etcd.endpoint, run_dir=run_dir)
        started.append(stored)
        stored.start()
        orch = DaemonProcess("orchestratord", certs.daemon_args(), etcd_endpoint=etcd.endpoint, run_dir=run_dir)
        started.append(orch)
        orch.start()
        yield SecureSet(certs, certs.token_file.read_text().strip(), etcd, stored, orch, run_dir)
    finally:
        for proc in started:
            proc.terminate(timeout_s=10)
        etcd.stop()


def _job() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
    spec["total_steps"] = 1
    return spec


def _client(s: SecureSet, **kwargs: Any) -> Client:
    return Client(s.orchestratord.address, timeout_s=5.0, **kwargs)


def test_plaintext_client_is_refused(secure: SecureSet) -> None:
    with _client(secure) as client, pytest.raises(FlexmarlError) as exc:
        client.list_jobs()
    assert not isinstance(exc.value, Unauthenticated)  # the TLS handshake fails before any RPC
    with _client(secure, token_file=str(secure.certs.token_file)) as client, pytest.raises(FlexmarlError):
        client.list_jobs()


def test_tls_without_token_is_unauthenticated(secure: SecureSet) -> None:
    with _client(secure, tls_ca=str(secure.certs.ca)) as client:
        with pytest.raises(Unauthenticated) as exc:
            client.submit(_job())
        assert secure.token not in str(exc.value)
        with pytest.raises(Unauthenticated):
            client.list_jobs()
        with pytest.raises(Unauthenticated):
            list(client.watch("nope"))


def test_wrong_token_is_unauthenticated(secure: SecureSet) -> None:
    with _client(secure, tls_ca=str(secure.certs.ca), token="not-" + secure.token) as client:
        with pytest.raises(Unauthenticated):
            client.submit(_job())
        with pytest.raises(Unauthenticated):
            client.status("nope")


def test_tls_and_token_work(secure: SecureSet) -> None:
    with _client(secure, tls_ca=str(secure.certs.ca), token_file=str(secure.certs.token_file)) as client:
        job_id = client.submit(_job())
        assert client.status(job_id).job_id == job_id
        assert job_id in {j.job_id for j in client.list_jobs()}
        client.cancel(job_id)


def test_worker_rpcs_need_the_token(secure: SecureSet) -> None:
    async def lease(security: TransportSecurity) -> grpc.StatusCode:
        async with open_channel(secure.orchestratord.address, security) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            try:
                await stub.LeaseRolloutTasks(orchestrator_pb2.LeaseRolloutTasksRequest(worker_id="w", max_tasks=0),
                                             timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    ca = secure.certs.ca.read_bytes()
    assert asyncio.run(lease(TransportSecurity(ca_pem=ca))) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(lease(TransportSecurity(ca_pem=ca, token=secure.token))) != grpc.StatusCode.UNAUTHENTICATED


def test_health_over_tls_needs_no_token(secure: SecureSet) -> None:
    async def check() -> int:
        security = TransportSecurity(ca_pem=secure.certs.ca.read_bytes())
        async with open_channel(secure.orchestratord.address, security) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return int(reply.status)

    assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING


def test_store_client_over_tls_with_token(secure: SecureSet) -> None:
    async def roundtrip(security: TransportSecurity) -> bytes:
        async with StoreClient(secure.stored.address, security=security) as store:
            await store.put_blob_bytes("security/probe", b"hello")
            return await store.get_blob_bytes("security/probe")

    ca = secure.certs.ca.read_bytes()
    assert asyncio.run(roundtrip(TransportSecurity(ca_pem=ca, token=secure.token))) == b"hello"
    with pytest.raises(Unauthenticated):
        asyncio.run(roundtrip(TransportSecurity(ca_pem=ca)))


def test_orchestratord_reaches_stored_over_tls_after_restart(secure: SecureSet) -> None:
    """A restart restores unfinished jobs by querying stored: the daemon-to-daemon channel."""
    with _client(secure, tls_ca=str(secure.certs.ca), token_file=str(secure.certs.token_file)) as client:
        job_id = client.submit(_job())
    secure.orchestratord.restart(timeout_s=60)
    with _client(secure, tls_ca=str(secure.certs.ca), token_file=str(secure.certs.token_file)) as client:
        assert client.status(job_id).job_id == job_id
        client.cancel(job_id)
    assert "waiting for stored" not in secure.orchestratord.stderr_tail()


def test_logs_never_contain_the_token(secure: SecureSet) -> None:
    with _client(secure, tls_ca=str(secure.certs.ca), token="wrong") as client, pytest.raises(Unauthenticated):
        client.list_jobs()
    for proc in (secure.orchestratord, secure.stored):
        text = proc.log_path.read_text()
        assert secure.token not in text
        assert str(secure.certs.token_file) in text  # the path is shown, not the contents


def test_mutual_tls_refuses_clients_without_a_certificate(secure: SecureSet) -> None:
    certs = secure.certs
    proc = DaemonProcess("orchestratord", [*certs.daemon_args(), "--tls-require-client-cert"],
                         etcd_endpoint=secure.etcd.endpoint, run_dir=secure.run_dir, name="orchestratord-mtls",
                         etcd_prefix="/mtls")
    proc.start()
    try:
        common = {"tls_ca": str(certs.ca), "token_file": str(certs.token_file), "timeout_s": 5.0}
        with Client(proc.address, **common) as client, pytest.raises(FlexmarlError) as exc:
            client.list_jobs()
        assert not isinstance(exc.value, Unauthenticated)
        with Client(proc.address, tls_cert=str(certs.client_cert), tls_key=str(certs.client_key),
                    **common) as client:
            assert client.list_jobs() == []
    finally:
        proc.terminate(timeout_s=10)


def test_devcerts_keeps_secrets_private(secure: SecureSet) -> None:
    for path in (secure.certs.token_file, secure.certs.server_key, secure.certs.client_key):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_config_validation(tmp_path: Path) -> None:
    certs = generate(tmp_path / "tls")
    with pytest.raises(ConfigError, match="tls_cert/tls_key"):
        load_config(DaemonConfig, ["--tls-cert", str(certs.server_cert)], "x", env={})
    with pytest.raises(ConfigError, match="auth_token_file: cannot read") as exc:
        load_config(DaemonConfig, ["--auth-token-file", str(tmp_path / "missing")], "x", env={})
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="tls_require_client_cert"):
        load_config(DaemonConfig, ["--tls-ca", str(certs.ca), "--tls-require-client-cert"], "x", env={})
    cfg = load_config(DaemonConfig, [], "x", env={"FLEXMARL_AUTH_TOKEN_FILE": str(certs.token_file)})
    assert cfg.masked()["auth_token_file"] == str(certs.token_file)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        TransportSecurity.from_config(DaemonConfig(auth_token_file=str(empty)))
    with pytest.raises(InvalidArgument):
        Client("127.0.0.1:1", tls_ca=str(tmp_path / "missing"))
