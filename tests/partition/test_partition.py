"""DESIGN §9 network partition: cut a rolloutd and a traind off mid-job with network namespaces.

etcd, stored and orchestratord run in the root namespace. One rolloutd (with its engine
replica) and one traind run each on a test host: a network namespace on a virtual LAN this test
creates (tests/e2e/netns_support.py, shared with the multi-host test), started through the same
placement path as every cluster (LocalCluster's DaemonProcess with a host and a NetnsRunner).
They reach etcd, orchestratord and stored at the root namespace's address on the LAN. Once both
hold work, both hosts are cut off the LAN (their switch ports down): their etcd registrations
and leases expire, a second rolloutd and traind in the root namespace take the job over, then
the hosts come back. The cut-off workers' late calls are refused, the job completes with one
commit per step, and every experience is consumed exactly once. No packet leaves loopback and
the test's own links; the namespaces and links are removed even on failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import psutil
import pytest
from e2e_support import (
    ENGINE_MODULE,
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    daemon_env,
    kill_pids,
    small_signaling_spec,
)
from netns_support import Lan, LanHost, NetnsRunner, virtual_lan

from flexmarl.client import Client
from flexmarl.cluster import DaemonProcess, EtcdServer, wait_until
from flexmarl.localcluster import DEFAULT_TORCH_EXTENSIONS_DIR, LocalCluster, LocalClusterConfig
from flexmarl.registry import Registry
from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc

#: Once its engines are warm a step takes a second or two: enough steps to cut mid-job.
STEPS = 10
REGISTRY_TTL_S = "3"
#: Leases far shorter than the cut: the cut-off workers' work is re-issued by lease expiry as well.
LEASES = {"rollout_timeout_s": 4, "train_timeout_s": 6}
CUT_OFF = ("rolloutd-part", "traind-part")
#: The test hosts of the cut-off workers (rolloutd-part on "r", traind-part on "t").
CUT_HOSTS = ("r", "t")
CUT_ATTEMPTS = 3
#: How long both namespaced workers may take to hold work before a cut.
CUT_WAIT_S = 120.0


def _worker_env() -> dict[str, str]:
    return {
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(DEFAULT_TORCH_EXTENSIONS_DIR)),
        **daemon_env(),
    }


def _worker_args(kind: str, name: str, run_dir: Path) -> list[str]:
    common = ["--work-dir", str(run_dir / name), "--service-id", name, "--registry-ttl-s", REGISTRY_TTL_S]
    if kind == "rolloutd":
        # Two tasks each: the first step's four tasks reach both rolloutds, whose engines load together.
        return ["--engine-replicas", "1", "--max-tasks", "2", *common]
    return ["--slots", "1", "--dp-host", "", *common]  # no data-parallel groups across the namespaces


def _rollout_status(address: str) -> rollout_pb2.RolloutStatus:
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)


def _episodes_done(address: str) -> int:
    return int(_rollout_status(address).episodes_done)


def _engine_pids(rolloutd: DaemonProcess) -> set[int]:
    """Pids of the engine replicas a rolloutd launched (its children)."""
    with contextlib.suppress(psutil.Error):
        children = psutil.Process(rolloutd.pid).children(recursive=True)
        return {c.pid for c in children if ENGINE_MODULE in " ".join(c.cmdline())}
    return set()


def _registered(e2e: E2ECluster) -> set[str]:
    async def read() -> set[str]:
        registry = Registry(e2e.cluster.etcd_endpoint, e2e.prefix, connect_timeout_s=5)
        await registry.connect()
        try:
            return {r.service_id for r in await registry.list_services()}
        finally:
            await registry.close()

    return asyncio.run(read())


def _total_commits(e2e: E2ECluster, job_id: str, agents: Sequence[str]) -> int:
    return sum(len(e2e.commits(job_id, agent)) for agent in agents)


def _gone_count(orch_log: Path, name: str) -> int:
    """How often orchestratord dropped a worker whose registration expired."""
    return orch_log.read_text().count(f" {name} is gone; re-issuing its work")


def _cut_while_busy(e2e: E2ECluster, job_id: str, lan: Lan, rolloutd: DaemonProcess) -> float:
    """Cuts both hosts off while the namespaced rolloutd holds task leases and traind an agent; returns when.

    Both are awaited with the rolloutd's engine running: paused early, it could hold back the very
    experiences the traind waits for before the planner issues more tasks (under load that wait
    outlasted the deadline now and then). Once both hold work, the engine is paused (SIGSTOP) so
    the leased tasks wait on it, holding their leases; if a task finished between the check and
    the pause, the engine resumes and the wait goes on. After the cut the engine resumes: the
    cut-off rolloutd keeps generating.
    """
    paused = _engine_pids(rolloutd)
    assert paused, "the namespaced rolloutd has no engine replica"

    def holding() -> tuple[list[str], int]:
        progress = e2e.client.status(job_id).agents
        bound = [f"{a.agent}@v{a.version}" for a in progress
                 if a.slot_id.startswith("traind-part/") and a.version < STEPS - 1]
        return bound, _rollout_status(rolloutd.address).tasks_in_flight

    def both_busy() -> bool:
        bound, in_flight = holding()
        return bool(bound) and in_flight > 0

    deadline = time.monotonic() + CUT_WAIT_S
    while True:
        try:
            wait_until(both_busy, max(deadline - time.monotonic(), 0.0), "", 0.02)
        except TimeoutError:
            bound, in_flight = holding()
            raise TimeoutError(f"timed out after {CUT_WAIT_S:.0f}s waiting for the namespaced rolloutd and traind "
                               f"to hold work (traind-part holds {bound or 'no agent'} with steps to go; "
                               f"rolloutd-part has {in_flight} tasks in flight)") from None
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            if both_busy():
                lan.cut(*CUT_HOSTS)
                return time.monotonic()
        finally:
            for pid in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """(series, value) of every sample of one metric in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] == name:
            out.append((series, float(value)))
    return out


@pytest.mark.timeout(300)
def test_partitioned_workers_lose_their_work_and_late_reports_are_refused(tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    run_dir = tmp_path / "run"
    with virtual_lan(CUT_HOSTS) as lan:
        # etcd also listens on the root namespace's LAN address; stored and orchestratord on every
        # address, advertising loopback to the root-namespace workers (the others are told).
        everywhere = ["--host", "0.0.0.0", "--advertise-host", "127.0.0.1"]
        debug = ["--log-level", "DEBUG"]  # orchestratord logs each task lease at DEBUG
        config = LocalClusterConfig(
            run_dir=run_dir,
            rollout_workers=0,
            trainer_workers=0,
            etcd_prefix=f"/flexmarl-partition-{os.getpid()}",
            env=daemon_env(),
            stored_args=everywhere,
            orchestratord_args=[*everywhere, *debug],
        )
        cluster = LocalCluster(config)
        cluster.etcd = EtcdServer(cluster.run_dir / "etcd", extra_hosts=[lan.root_address])
        engines: set[int] = set()
        e2e: E2ECluster | None = None
        try:
            cluster.start()
            e2e = _run_partition(cluster, lan, models_dir, engines)
        finally:
            for proc in cluster.daemons.values():
                if proc.kind == "rolloutd" and proc.alive():
                    engines.update(_engine_pids(proc))
            if e2e is not None:
                with contextlib.suppress(Exception):
                    e2e.client.close()
            with contextlib.suppress(RuntimeError):
                lan.heal(*CUT_HOSTS)
            cluster.stop()
            kill_pids(sorted(engines))


def _run_partition(cluster: LocalCluster, lan: Lan, models_dir: Path, engines: set[int]) -> E2ECluster:
    run_dir = cluster.run_dir
    stored, orch = cluster.daemon("stored"), cluster.daemon("orchestratord")
    prefix = cluster.config.etcd_prefix
    env = _worker_env()

    def namespaced(kind: str, name: str, host: LanHost) -> DaemonProcess:
        # It binds and advertises its host's address (DaemonProcess does that for a non-loopback host).
        reach = ["--orchestrator-address", f"{lan.root_address}:{orch.grpc_port}",
                 "--store-address", f"{lan.root_address}:{stored.grpc_port}"]
        proc = DaemonProcess(kind, [*_worker_args(kind, name, run_dir), *reach],
                             etcd_endpoint=cluster.etcd.endpoint_on(lan.root_address), run_dir=run_dir, env=env,
                             name=name, etcd_prefix=prefix, host=host.host, runner=NetnsRunner())
        cluster.daemons[name] = proc
        return proc

    def rooted(kind: str, name: str) -> DaemonProcess:
        proc = DaemonProcess(
            kind,
            _worker_args(kind, name, run_dir),
            etcd_endpoint=cluster.etcd.endpoint,
            run_dir=run_dir,
            env=env,
            name=name,
            etcd_prefix=prefix,
        )
        cluster.daemons[name] = proc
        return proc

    # Only the namespaced workers serve until the first cut, so they alone hold the job's work (with
    # the second pair up from the start, which pair held it was up to scheduling, and the wait for
    # "both busy" timed out now and then); the second pair starts at the cut and takes over.
    rollout_part = namespaced("rolloutd", "rolloutd-part", lan.hosts["r"])
    train_part = namespaced("traind", "traind-part", lan.hosts["t"])
    rollout_root, train_root = rooted("rolloutd", "rolloutd-1"), rooted("traind", "traind-1")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the tiny checkpoints are built meanwhile
        built = pool.submit(small_signaling_spec, models_dir, total_steps=STEPS, leases=LEASES)
        for started in [pool.submit(p.start) for p in (rollout_part, train_part)]:
            started.result()
        spec = built.result()
    phases = {"workers up": time.monotonic()}
    e2e = E2ECluster(cluster, Client(etcd_endpoints=cluster.etcd_endpoint, etcd_prefix=prefix), models_dir)
    agents = [a["name"] for a in spec["agents"]]
    job_id = e2e.client.submit(spec)

    # The namespaced workers work through their links: the rolloutd finishes a task. The cut comes
    # once it holds task leases and the namespaced traind an agent with steps to go, its engine
    # paused meanwhile so those tasks wait on generation, holding their leases (_cut_while_busy).
    wait_until(lambda: _episodes_done(rollout_part.address) > 0, 150, "the namespaced rolloutd to run a task", 0.1)
    orch_log = run_dir / "orchestratord.log"

    def reissued_from_cut_off() -> int:
        return sum("worker rolloutd-part gone" in line for line in orch_log.read_text().splitlines())

    # A task the rolloutd finished generating just before the cut may still be reported just
    # before it; a cut that caught no task lease of it (rare) is healed and made again.
    for attempt in range(1, CUT_ATTEMPTS + 1):
        reissued_before = reissued_from_cut_off()
        cut_started_s = _cut_while_busy(e2e, job_id, lan, rollout_part)
        phases[f"cut {attempt}"] = cut_started_s
        if attempt == 1:
            for proc in (rollout_root, train_root):
                proc.spawn()
            for proc in (rollout_root, train_root):
                proc.wait_ready(60)
        committed_at_cut = _total_commits(e2e, job_id, agents)
        assert committed_at_cut < STEPS * len(agents), "the job finished before the cut"
        # Cut off until etcd expired their registrations (TTL 3 s), orchestratord dropped them
        # (revoking and re-issuing their work) and every lease they held is past its timeout.
        wait_until(lambda: not set(CUT_OFF) & _registered(e2e), 30, "the cut-off workers' registrations to expire", 0.2)
        wait_until(
            lambda n=attempt: all(_gone_count(orch_log, name) >= n for name in CUT_OFF),
            30,
            "orchestratord to drop the cut-off workers",
            0.2,
        )
        cut_ends_s = cut_started_s + max(LEASES.values())
        wait_until(lambda t=cut_ends_s: time.monotonic() > t, 30, "the cut-off workers' leases to time out")
        if reissued_from_cut_off() > reissued_before:
            break
        lan.heal(*CUT_HOSTS)
        wait_until(lambda: set(CUT_OFF) <= _registered(e2e), 60, "the cut-off workers to register again", 0.2)
    else:
        pytest.fail(f"{CUT_ATTEMPTS} cuts caught no task lease of the namespaced rolloutd")

    # The second rolloutd leases every re-issued task while the first one is still cut off
    # (orchestratord logs each lease at DEBUG).
    def reissued_leased_elsewhere() -> bool:
        text = orch_log.read_text()
        reissued = re.findall(r"re-issuing task (\S+) after attempt (\d+): worker rolloutd-part gone", text)
        return bool(reissued) and all(
            f"leased {task_id} (attempt {int(attempt) + 1}) to rolloutd-1" in text for task_id, attempt in reissued
        )

    wait_until(reissued_leased_elsewhere, 60, "the second rolloutd to lease the re-issued tasks", 0.1)
    cut_s = time.monotonic()
    phases["restored"] = cut_s
    running_at_restore = not e2e.client.status(job_id).state.finished
    assert rollout_part.alive() and train_part.alive(), "a cut-off worker died instead of being cut off"
    lan.heal(*CUT_HOSTS)

    info = e2e.wait_job(job_id)
    phases["job done"] = time.monotonic()
    assert_succeeded(e2e, info, STEPS)
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)

    text = orch_log.read_text()
    reissued = [line for line in text.splitlines() if "worker rolloutd-part gone" in line]
    assert any(f"re-issuing task {job_id}/" in line for line in reissued), "no task of the cut-off rolloutd re-issued"
    assert _episodes_done(rollout_root.address) > 0, "the second rolloutd never ran a task"
    slots = {str(c["slot_id"]).split("/", 1)[0] for agent in agents for c in e2e.commits(job_id, agent).values()}
    assert "traind-1" in slots and slots <= {"traind-1", "traind-part"}, f"commits came from slots of {slots}"
    # The cut-off rolloutd came back holding leases that had ended: its late calls were refused
    # (its renewal answered "lost", its report FAILED_PRECONDITION, or stored already held the
    # re-issued attempt's experiences for its task).
    refusals = ("lost; abandoning its task", "rejected: ", "is already stored with different content")

    def late_work_refused() -> list[str]:
        lines = rollout_part.log_path.read_text().splitlines()
        return [line for line in lines if any(marker in line for marker in refusals)]

    wait_until(lambda: bool(late_work_refused()), 60, "the cut-off rolloutd's late work to be refused", 0.2)
    refused_calls = {
        series.split("{", 1)[1].rstrip("}"): value
        for series, value in _samples(e2e.metrics_text("orchestratord"), "flexmarl_orchestratord_rpc_requests_total")
        if "FAILED_PRECONDITION" in series or "NOT_FOUND" in series
    }
    start_s = phases.pop("workers up")
    timeline = ", ".join(f"{name} +{t - start_s:.1f} s" for name, t in phases.items())
    print(
        f"\npartition: {timeline}; cut for {cut_s - cut_started_s:.1f} s; job running at restore: "
        f"{running_at_restore}\n"
        f"  the cut-off rolloutd's late work refused: {[line.strip()[-110:] for line in late_work_refused()]}\n"
        f"  orchestratord answers FAILED_PRECONDITION/NOT_FOUND: {refused_calls}"
    )
    # Both cut-off workers register again once their link is back.
    wait_until(lambda: set(CUT_OFF) <= _registered(e2e), 60, "the cut-off workers to register again", 0.5)
    return e2e
