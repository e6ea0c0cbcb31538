"""DESIGN §9 failure model on a whole local cluster: SIGKILL a daemon or an engine mid-job.

orchestratord's SIGKILL and restart from etcd is tests/chaos's (one fault of every kind, with the same
checks and the history); this module keeps the faults that need a second worker or a job of their own.

The tests share one cluster (two traind workers, two engine replicas, short registry TTLs
so a dead worker is noticed within seconds); each submits its own job, and ``heal``
restarts the previous test's victims first.

A long variant (``-m long``, ~75 s): CI leaves it out and covers its mechanisms elsewhere. A
SIGKILLed traind, rolloutd and engine restarted mid-job: tests/chaos (with exactly-once, the
history and bit-equality to a fault-free job). Work of lost workers taken over by a second
worker through lease expiry: tests/partition. Samples of a lost replica retried on another:
tests/rolloutd/test_router_fidelity.py. Run it with ``python -m pytest -m long tests/e2e``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_support import (
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    heal,
    metric_sum,
    running_cluster,
)

from flexmarl.client import JobState
from flexmarl.cluster import wait_until
from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.long

STEPS = 3
REGISTRY_TTL_S = "3"


@pytest.fixture(scope="module")
def _fault_cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[E2ECluster]:
    fast_ttl = ["--registry-ttl-s", REGISTRY_TTL_S]
    with running_cluster(tmp_path_factory.mktemp("faults"), models_dir, trainer_workers=2, trainer_slots=1,
                         engine_replicas=2, traind_args=fast_ttl, rolloutd_args=fast_ttl) as e2e:
        yield e2e


@pytest.fixture
def cluster(_fault_cluster: E2ECluster) -> E2ECluster:
    """The module's cluster with every daemon alive."""
    heal(_fault_cluster)
    return _fault_cluster


def _spec(e2e: E2ECluster, rollout_timeout_s: int = 60, train_timeout_s: int = 120) -> dict[str, Any]:
    spec: dict[str, Any] = e2e.spec(total_steps=STEPS, leases={"rollout_timeout_s": rollout_timeout_s,
                                                               "train_timeout_s": train_timeout_s})
    return spec


def _total_commits(e2e: E2ECluster, job_id: str, agents: list[str]) -> int:
    return sum(len(e2e.commits(job_id, agent)) for agent in agents)


@pytest.mark.timeout(240)
def test_traind_sigkill_replays_the_step_on_the_other_worker(cluster: E2ECluster) -> None:
    spec = _spec(cluster, train_timeout_s=10)
    job_id = cluster.client.submit(spec)
    cluster.wait_for_commits(job_id, at_least=1)

    # The victim: a traind holding an agent with steps still to go.
    progress = cluster.client.status(job_id).agents
    busy = [a for a in progress if a.version < STEPS and a.slot_id]
    assert busy, f"no agent with remaining steps is bound to a slot: {progress}"
    victim_agent = busy[0]
    victim = victim_agent.slot_id.split("/", 1)[0]
    survivor = next(name for name in ("traind-0", "traind-1") if name != victim)
    cluster.cluster.daemon(victim).kill()
    killed_at_version = len(cluster.commits(job_id, victim_agent.agent))
    assert killed_at_version < STEPS, "the victim's agent finished before its traind was killed"

    info = cluster.wait_job(job_id)
    assert_succeeded(cluster, info, STEPS)
    assert_one_commit_per_step(cluster, job_id, spec)
    assert_exactly_once(cluster, job_id, spec)
    # Every later step of the victim's agent ran on the survivor, from the last committed state.
    commits = cluster.commits(job_id, victim_agent.agent)
    later = [commits[step]["slot_id"] for step in range(killed_at_version, STEPS)]
    assert later and all(slot.startswith(survivor + "/") for slot in later), later
    survivor_metrics = cluster.metrics_text(survivor)
    assert metric_sum(survivor_metrics, "flexmarl_traind_swap_seconds_count",
                      lambda series: 'direction="in"' in series) > 0, "the survivor never loaded a saved state"


@pytest.mark.timeout(240)
def test_engine_replica_sigkill_retries_on_another_replica(cluster: E2ECluster) -> None:
    before = metric_sum(cluster.metrics_text("orchestratord"), "flexmarl_orchestratord_rollout_tasks_reported_total",
                        lambda series: "failed" in series)
    spec = _spec(cluster)
    job_id = cluster.client.submit(spec)
    wait_until(lambda: len(cluster.engine_pids()) == 2, 120, "rolloutd to launch its two engine replicas", 0.2)
    cluster.wait_for_commits(job_id, at_least=1)

    victim = cluster.engine_pids()[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: victim not in cluster.engine_pids(), 10, "the killed engine to disappear", 0.1)

    info = cluster.wait_job(job_id)
    assert_succeeded(cluster, info, STEPS)
    rolloutd_log = (cluster.run_dir / "rolloutd-0.log").read_text()
    assert "removed:" in rolloutd_log, f"rolloutd never noticed the dead replica:\n{rolloutd_log[-3000:]}"
    # Its requests were retried on the surviving replica: no task failed.
    after = metric_sum(cluster.metrics_text("orchestratord"), "flexmarl_orchestratord_rollout_tasks_reported_total",
                       lambda series: "failed" in series)
    assert after == before, "a task failed instead of being retried on another replica"


@pytest.mark.timeout(240)
def test_rolloutd_sigkill_reissues_its_task_leases(cluster: E2ECluster) -> None:
    spec = _spec(cluster, rollout_timeout_s=5)
    agents = [a["name"] for a in spec["agents"]]
    job_id = cluster.client.submit(spec)
    cluster.wait_for_commits(job_id, at_least=1)

    rolloutd = cluster.cluster.daemon("rolloutd-0")
    engines = cluster.engine_pids()
    # Kill it while it holds task leases: between batches (eta = 0) it may hold none, and then
    # nothing would need re-issuing.
    wait_until(lambda: _tasks_in_flight(rolloutd.address) > 0, 60, "rolloutd to hold task leases", 0.01)
    rolloutd.kill()
    # Its engines live in their own session and outlive it: stop them (2 cores are scarce).
    cluster.orphaned_engines.extend(engines)
    for pid in engines:
        os.kill(pid, signal.SIGKILL)
    assert _total_commits(cluster, job_id, agents) < STEPS * len(agents), "the job finished before the kill"
    assert cluster.client.status(job_id).state is JobState.RUNNING
    rolloutd.restart()

    info = cluster.wait_job(job_id)
    assert_succeeded(cluster, info, STEPS)
    assert_one_commit_per_step(cluster, job_id, spec)
    assert_exactly_once(cluster, job_id, spec)
    orchestratord_log = (cluster.run_dir / "orchestratord.log").read_text()
    assert f"re-issuing task {job_id}/" in orchestratord_log, "no task of the job was re-issued"


def _tasks_in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        status = rollout_pb2_grpc.RolloutStub(channel).GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest(),
                                                                         timeout=5)
    return int(status.tasks_in_flight)
