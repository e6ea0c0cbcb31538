"""Every daemon starts, registers, serves health and metrics, and stops cleanly."""

import concurrent.futures
import shutil
import socket
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flexmarl.cluster import EtcdServer, free_port, wait_until

pytestmark = pytest.mark.timeout(180)

KINDS = ("orchestratord", "rolloutd", "traind", "stored")


def _services(etcd: EtcdServer) -> dict[str, str]:
    """service id -> kind, read with etcdctl-free plain gRPC through our registry."""
    import asyncio

    from flexmarl.registry import Registry

    async def read() -> dict[str, str]:
        reg = Registry(etcd.endpoint, connect_timeout_s=2)
        try:
            await reg.connect()
            return {r.service_id: r.kind for r in await reg.list_services()}
        except Exception:
            return {}
        finally:
            await reg.close()

    return asyncio.run(read())


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_all_daemons_register_serve_and_survive_faults(etcd, start_daemon, tmp_path) -> None:
    args = {"stored": ("--data-dir", str(tmp_path / "stored-data"))}
    # Started together: their imports overlap (each finds its peers through etcd when it needs them).
    with concurrent.futures.ThreadPoolExecutor(len(KINDS)) as pool:
        starting = {kind: pool.submit(start_daemon, kind, *args.get(kind, ()), "--registry-ttl-s", "2", name=kind)
                    for kind in KINDS}
        procs = {kind: started.result() for kind, started in starting.items()}
    services = _services(etcd)
    assert sorted(services.values()) == sorted(KINDS)
    for kind, proc in procs.items():
        assert services[proc.service_id] == kind
        assert _health(proc.address) == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert f"flexmarl_{kind}_up 1.0" in text
        # The GC policy (flexmarl/gc_policy.py) froze start-up's objects once; collections are exported.
        frozen = next(line for line in text.splitlines() if line.startswith(f"flexmarl_{kind}_gc_frozen_objects "))
        assert float(frozen.split()[1]) > 10_000
        assert 'python_gc_collections_total{generation="0"}' in text

    # SIGKILL: the dead daemon disappears within its TTL.
    victim = procs["rolloutd"]
    victim.kill()
    wait_until(lambda: victim.service_id not in _services(etcd), 15, "the killed rolloutd to expire")

    # etcd restarts with its data lost: every live daemon registers again.
    etcd.terminate()
    shutil.rmtree(etcd.data_dir)
    etcd.start()
    alive = {p.service_id for k, p in procs.items() if k != "rolloutd"}
    wait_until(lambda: set(_services(etcd)) == alive, 30, "live daemons to re-register", interval_s=0.2)

    # SIGTERM: exit 0 and the key is gone at once (no TTL wait).
    stored = procs["stored"]
    assert stored.terminate() == 0
    assert stored.service_id not in _services(etcd)
    assert "stopped" in stored.stderr_tail()


def _run(cmd: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("kind", KINDS)
def test_help(kind: str) -> None:
    result = _run([sys.executable, "-m", kind, "--help"])
    assert result.returncode == 0
    assert "--etcd-endpoints" in result.stdout


def test_unknown_flag_is_one_line() -> None:
    result = _run([sys.executable, "-m", "orchestratord", "--no-such-flag"])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_bad_value_is_one_line() -> None:
    result = _run([sys.executable, "-m", "traind", "--port", "99999"])
    assert result.returncode == 2
    assert result.stderr.strip() == "traind: error: port: 99999 is not a valid port"


def test_a_threshold_that_would_turn_the_collector_off_is_one_line() -> None:
    result = _run([sys.executable, "-m", "stored", "--gc-gen0-threshold", "0"])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "stored: error: gc_gen0_threshold: must be >= 1 (0 would turn automatic collection off), got 0")


def test_etcd_unreachable_is_one_line() -> None:
    port = free_port()
    result = _run([sys.executable, "-m", "rolloutd", "--etcd-endpoints", f"127.0.0.1:{port}",
                   "--etcd-connect-timeout-s", "1"])
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rolloutd: error: etcd unreachable")
    assert "Traceback" not in result.stderr


def test_port_in_use_is_one_line(etcd) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = _run([sys.executable, "-m", "orchestratord", "--etcd-endpoints", etcd.endpoint,
                       "--port", str(port)])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("orchestratord: error: gRPC: cannot bind")
    assert "Traceback" not in result.stderr


def test_the_event_loop_is_uvloop_unless_asyncio_is_asked_for() -> None:
    import uvloop

    from flexmarl.daemon import event_loop_factory

    assert event_loop_factory("") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory(" AsyncIO ") is None


def test_an_unknown_event_loop_is_one_line() -> None:
    import os

    result = subprocess.run([sys.executable, "-m", "orchestratord", "--etcd-endpoints", f"127.0.0.1:{free_port()}"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "FLEXMARL_EVENT_LOOP": "trio"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "orchestratord: error: FLEXMARL_EVENT_LOOP='trio': expected uvloop or asyncio")
    assert "Traceback" not in result.stderr
