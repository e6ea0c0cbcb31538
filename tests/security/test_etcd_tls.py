"""etcd's own TLS and auth passed through: a real etcd serving mutual TLS with auth enabled.

One etcd (dev CA, ``--client-cert-auth``, user ``root`` with a random password) and one
orchestratord started with the matching ``--etcd-*`` flags serve the module. Daemons without
the CA, without a user or with a wrong password are refused at start with exit code 1 and
one line; the password appears in no log, no command line and no error line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from aetcd import rpc

from flexmarl.client import Client
from flexmarl.cluster import DaemonProcess, EtcdServer, EtcdTls, wait_until
from flexmarl.daemon import EXIT_CONFIG, EXIT_STARTUP
from flexmarl.devcerts import DevCerts, generate
from flexmarl.errors import FlexmarlError, Unavailable
from flexmarl.registry import EtcdSecurity, Registry

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"
ETCD_SD = REPO_ROOT / "deploy" / "prometheus" / "etcd_sd.py"


@dataclasses.dataclass
class SecureEtcd:
    certs: DevCerts
    etcd: EtcdServer
    password: str
    security: EtcdSecurity
    orchestratord: DaemonProcess
    run_dir: Path


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    run_dir = tmp_path_factory.mktemp("etcd-tls")
    certs = generate(run_dir / "tls")
    etcd = EtcdServer(
        run_dir / "etcd", tls=EtcdTls(certs.server_cert, certs.server_key, certs.ca, client_cert_auth=True), auth=True
    )
    etcd.start()
    orch: DaemonProcess | None = None
    try:
        assert etcd.password_file is not None
        password = etcd.password_file.read_text().strip()
        security = EtcdSecurity.from_files(
            ca=str(certs.ca),
            cert=str(certs.server_cert),
            key=str(certs.server_key),
            username=etcd.username,
            password_file=str(etcd.password_file),
        )
        orch = DaemonProcess("orchestratord", etcd.client_args(), etcd_endpoint=etcd.endpoint, run_dir=run_dir)
        orch.start()
        yield SecureEtcd(certs, etcd, password, security, orch, run_dir)
    finally:
        if orch is not None:
            orch.terminate(timeout_s=10)
        etcd.stop()


def _services(s: SecureEtcd, security: EtcdSecurity | None = None) -> dict[str, str]:
    async def read() -> dict[str, str]:
        registry = Registry(s.etcd.endpoint, connect_timeout_s=5, security=security or s.security)
        await registry.connect()
        try:
            return {r.service_id: r.address for r in await registry.list_services()}
        finally:
            await registry.close()

    return asyncio.run(read())


def _start_failing(s: SecureEtcd, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs a daemon that must not start; returns its exit status and output."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "stored",
            "--data-dir",
            str(s.run_dir / "stored-refused"),
            "--etcd-endpoints",
            s.etcd.endpoint,
            "--etcd-connect-timeout-s",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


#: gRPC core's own log lines (glog format), written by its threads straight to fd 2.
_GRPC_CORE_LOG = re.compile(r"^[EWIF]\d{4} \d\d:\d\d:\d\d")


def _error_lines(stderr: str, prog: str = "stored") -> list[str]:
    """What the daemon itself said last, and every line it printed as an error."""
    lines = [line for line in stderr.strip().splitlines() if not _GRPC_CORE_LOG.match(line)]
    errors = [line for line in lines if line.startswith(f"{prog}: error:")]
    assert lines and errors == [lines[-1]], f"expected one error line, last:\n{stderr[-2000:]}"
    return errors


def _job() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
    spec["total_steps"] = 1
    return spec


def test_daemon_with_etcd_credentials_registers_and_serves(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    assert _services(s) == {s.orchestratord.service_id: s.orchestratord.address}
    # The SDK discovers orchestratord through the same secured etcd and uses it.
    with Client(etcd_endpoints=s.etcd.endpoint, etcd_security=s.security, timeout_s=10) as client:
        job_id = client.submit(_job())
        assert [j.job_id for j in client.list_jobs()] == [job_id]
    # A restarted etcd forgets every auth token: the daemon authenticates again and keeps writing.
    s.etcd.restart()
    submitted: list[str] = []

    def submit_once_etcd_is_back() -> bool:
        # Right after the restart orchestratord's channel may still be reconnecting (an etcd
        # "ConnectionFailedError"); any other error (a rejected token) fails the test.
        try:
            submitted.append(client.submit(_job()))
        except FlexmarlError as exc:
            if "ConnectionFailedError" not in str(exc):
                raise
            return False
        return True

    with Client(etcd_endpoints=s.etcd.endpoint, etcd_security=s.security, timeout_s=10) as client:
        wait_until(submit_once_etcd_is_back, 30, "orchestratord to write to the restarted etcd", 0.2)
        # (A SubmitJob that failed on etcd still lists its job: an orchestratord quirk, not checked here.)
        assert {job_id, *submitted} <= {j.job_id for j in client.list_jobs()}
    log_text = s.orchestratord.log_path.read_text()
    assert "authenticating again" in log_text, "the restarted etcd's fresh token was not requested"
    assert s.orchestratord.alive()
    assert s.orchestratord.service_id in _services(s)


def test_plaintext_etcd_client_is_refused(secure_etcd: SecureEtcd) -> None:
    # Without a client certificate etcd refuses the handshake; without the CA there is no TLS at all.
    for args in ([], ["--etcd-ca", str(secure_etcd.certs.ca)]):
        result = _start_failing(secure_etcd, *args)
        assert result.returncode == EXIT_STARTUP, result.stderr
        [last] = _error_lines(result.stderr)
        assert last.startswith("stored: error: etcd unreachable"), last
        assert "Traceback" not in result.stderr


def test_missing_or_wrong_credentials_are_refused_at_once(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    tls = ["--etcd-ca", str(s.certs.ca), "--etcd-cert", str(s.certs.server_cert), "--etcd-key", str(s.certs.server_key)]
    wrong = s.run_dir / "wrong-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    cases = {
        "no user": tls,
        "user 'root'": [*tls, "--etcd-username", "root", "--etcd-password-file", str(wrong)],
    }
    for who, args in cases.items():
        result = _start_failing(s, *args)
        assert result.returncode == EXIT_STARTUP, result.stderr
        [last] = _error_lines(result.stderr)
        assert last.startswith(f"stored: error: etcd rejected the credentials ({who})"), last
        assert "Traceback" not in result.stderr
        assert "not-the-password" not in result.stderr and s.password not in result.stderr


def test_incomplete_etcd_settings_are_config_errors(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    cases = {
        "stored: error: etcd_username/etcd_password_file: give both or neither": ["--etcd-username", "root"],
        "stored: error: etcd_cert/etcd_key: give both or neither": ["--etcd-cert", str(s.certs.server_cert)],
        "stored: error: etcd_password_file: cannot read /nonexistent/pw": [
            "--etcd-username",
            "root",
            "--etcd-password-file",
            "/nonexistent/pw",
        ],
    }
    for line, args in cases.items():
        result = _start_failing(s, *args)
        assert result.returncode == EXIT_CONFIG, result.stderr
        assert result.stderr.strip() == line


def test_password_is_in_no_log_and_no_command_line(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    command = " ".join(s.orchestratord.command())
    assert "--etcd-password-file" in command and s.password not in command
    log_text = s.orchestratord.log_path.read_text()
    start_line = next(line for line in log_text.splitlines() if " starting with " in line)
    settings = json.loads(start_line.split(" starting with ", 1)[1])
    assert settings["etcd_password_file"] == str(s.etcd.password_file)
    assert settings["etcd_username"] == "root"
    assert s.password not in log_text
    assert s.password not in s.etcd.stderr_tail()


def test_etcd_sd_reads_a_secured_etcd(secure_etcd: SecureEtcd, tmp_path: Path) -> None:
    s = secure_etcd
    out = tmp_path / "targets.json"
    base = [sys.executable, str(ETCD_SD), "--etcd-endpoints", s.etcd.endpoint, "--out", str(out), "--timeout-s", "2"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith("etcd_sd: etcd unreachable"), refused.stderr
    done = subprocess.run([*base, *s.etcd.client_args()], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    groups = json.loads(out.read_text())
    assert [g["labels"]["service_id"] for g in groups] == [s.orchestratord.service_id]
    assert s.password not in done.stderr


def test_registry_rejects_wrong_password_without_retrying(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    wrong = dataclasses.replace(s.security, password="nope")

    async def connect() -> None:
        registry = Registry(s.etcd.endpoint, connect_timeout_s=30, security=wrong)
        try:
            await asyncio.wait_for(registry.connect(), timeout=10)  # far below connect_timeout_s: no retry loop
        finally:
            await registry.close()

    with pytest.raises(Unavailable, match="etcd rejected the credentials"):
        asyncio.run(connect())


def _add_prefix_user(s: SecureEtcd, user: str, password: str, prefix: str) -> None:
    """As root: a user whose role may read and write the keys under prefix only (etcdctl's recipe)."""
    credentials = grpc.ssl_channel_credentials(
        s.certs.ca.read_bytes(), s.certs.server_key.read_bytes(), s.certs.server_cert.read_bytes()
    )
    with grpc.secure_channel(s.etcd.endpoint, credentials) as channel:
        auth = rpc.AuthStub(channel)
        token = auth.Authenticate(rpc.AuthenticateRequest(name="root", password=s.password), timeout=10).token
        metadata = (("token", token),)
        key = prefix.encode()
        permission = rpc.Permission(
            permType=rpc.Permission.READWRITE, key=key, range_end=key[:-1] + bytes([key[-1] + 1])
        )
        auth.RoleAdd(rpc.AuthRoleAddRequest(name=user), metadata=metadata, timeout=10)
        auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(name=user, perm=permission), metadata=metadata, timeout=10
        )
        auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), metadata=metadata, timeout=10)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=user), metadata=metadata, timeout=10)


def test_user_limited_to_the_cluster_prefix_serves_there_only(secure_etcd: SecureEtcd) -> None:
    s = secure_etcd
    prefix = "/flexmarl-limited"
    password_file = s.run_dir / "limited-password"
    password_file.write_text("limited-secret-pw\n")
    password_file.chmod(0o600)
    _add_prefix_user(s, "limited", "limited-secret-pw", prefix + "/")
    args = [
        "--etcd-ca",
        str(s.certs.ca),
        "--etcd-cert",
        str(s.certs.server_cert),
        "--etcd-key",
        str(s.certs.server_key),
        "--etcd-username",
        "limited",
        "--etcd-password-file",
        str(password_file),
    ]
    limited = dataclasses.replace(s.security, username="limited", password="limited-secret-pw")
    orch = DaemonProcess(
        "orchestratord",
        args,
        etcd_endpoint=s.etcd.endpoint,
        run_dir=s.run_dir,
        name="orchestratord-limited",
        etcd_prefix=prefix,
    )
    try:
        orch.start()
        with Client(etcd_endpoints=s.etcd.endpoint, etcd_prefix=prefix, etcd_security=limited, timeout_s=10) as client:
            job_id = client.submit(_job())
            assert [j.job_id for j in client.list_jobs()] == [job_id]
        assert "limited-secret-pw" not in orch.log_path.read_text()
    finally:
        orch.terminate(timeout_s=10)
    # The same user under another cluster's prefix is refused at once.
    result = _start_failing(s, *args)
    assert result.returncode == EXIT_STARTUP, result.stderr
    [last] = _error_lines(result.stderr)
    assert last.startswith("stored: error: etcd rejected the credentials (user 'limited')"), last
    assert "permission denied" in last and "limited-secret-pw" not in result.stderr
