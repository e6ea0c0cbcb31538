"""End-to-end helpers: a local cluster handle, small signaling jobs and the shared checks.

Every helper waits on a condition with a deadline (``wait_until`` or the SDK's watch);
none sleeps for luck. Checks shared by several tests (exactly-once consumption of
experiences, one commit per step) live here as plain functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from flexmarl.artifacts import local_path
from flexmarl.cli import materialize_models
from flexmarl.client import Client, JobInfo, JobState
from flexmarl.cluster import descendant_pids, wait_until
from flexmarl.errors import FailedPrecondition
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.localcluster import LocalCluster, LocalClusterConfig
from flexmarl.registry import Registry
from flexmarl.store_client import ExperienceRef, StoreClient

REPO_ROOT = Path(__file__).resolve().parents[2]
SIGNALING_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"
E2E_DIR = Path(__file__).resolve().parent
ENGINE_MODULE = "rolloutd.engines.embedded"
DENSE_ENV = "dense_signaling:DenseSignaling"

JOB_TIMEOUT_S = 150.0
# Bound on max_relative_difference for the chaos driver's comparison of a chaos run with a
# fault-free one (python -m benchmarks.chaos). Strict runs are now equal bit for bit (traind sums
# gradients exactly; test_equivalence and test_data_parallel_binding assert torch.equal), so the
# bound only matters for the rollouts' own nondeterminism under faults; see docs/reliability.md.
MAX_RELATIVE_DIFFERENCE = 1e-5


def daemon_env() -> dict[str, str]:
    """Environment of the daemons: rolloutd imports the environments from the repo and this dir."""
    paths = [str(REPO_ROOT), str(E2E_DIR), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def small_signaling_spec(models_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The signaling example with tiny models, 2 steps and small batches (a ~1 minute job on 2 CPUs).

    The environment is DenseSignaling (the example's prompts with a dense reward).

    ``overrides`` replace top-level keys of the spec (e.g. ``pipeline={"mode": "sync"}``).
    """
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw["total_steps"] = 2
    raw["batch"] = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}
    # Dense reward: a zero-gradient job would make every weight comparison vacuous.
    raw["environment"] = {"entrypoint": DENSE_ENV, "config": {"num_objects": 4}}
    raw.update(overrides)
    return materialize_models(raw, models_dir)


@dataclasses.dataclass
class E2ECluster:
    """A started LocalCluster with an SDK client and helpers that read its state."""

    cluster: LocalCluster
    client: Client
    models_dir: Path
    orphaned_engines: list[int] = dataclasses.field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        """Where the daemons' logs and work dirs are."""
        return self.cluster.run_dir

    @property
    def prefix(self) -> str:
        """The etcd key prefix of the cluster."""
        return self.cluster.config.etcd_prefix

    def spec(self, **overrides: Any) -> dict[str, Any]:
        """A small signaling job spec (see small_signaling_spec)."""
        return small_signaling_spec(self.models_dir, **overrides)

    def reconnect(self) -> None:
        """A fresh SDK client (after orchestratord moved to a new port)."""
        self.client.close()
        self.client = Client(etcd_endpoints=self.cluster.etcd_endpoint, etcd_prefix=self.prefix)

    def wait_job(self, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> JobInfo:
        """The job's final snapshot; fails with the daemons' log tails if it does not finish in time."""
        try:
            return self.client.wait(job_id, timeout_s)
        except TimeoutError:
            pytest.fail(f"job {job_id} did not finish in {timeout_s}s; logs:\n{self.log_tails()}")

    def wait_for_commits(self, job_id: str, at_least: int, timeout_s: float = JOB_TIMEOUT_S) -> None:
        """Waits until at least ``at_least`` agent-steps of the job committed (total over agents)."""

        def committed() -> bool:
            info = self.client.status(job_id)
            if info.state.finished:
                raise AssertionError(f"job {job_id} finished ({info.state.name}: {info.error}) before "
                                     f"{at_least} commits")
            return sum(a.version for a in info.agents) >= at_least

        wait_until(committed, timeout_s, f"{at_least} committed steps of {job_id}", interval_s=0.1)

    def log_tails(self) -> str:
        """The end of every daemon's log (for failure messages)."""
        return "\n".join(f"--- {name}\n{proc.stderr_tail()[-1500:]}" for name, proc in self.cluster.daemons.items())

    # ---- reading the cluster's state -------------------------------------------------------------

    def etcd_prefix_values(self, key_prefix: str) -> dict[str, bytes]:
        """Every etcd key under ``<prefix>/<key_prefix>``."""

        async def read() -> dict[str, bytes]:
            registry = Registry(self.cluster.etcd_endpoint, self.prefix)
            await registry.connect()
            try:
                values, _ = await registry.get_prefix(registry.key(key_prefix))
            finally:
                await registry.close()
            return values

        return asyncio.run(read())

    def manifests(self, job_id: str, agent: str) -> dict[int, dict[str, Any]]:
        """Step -> manifest JSON of one agent, from etcd."""
        base = f"jobs/{job_id}/agents/{agent}/steps/"
        out: dict[int, dict[str, Any]] = {}
        for key, value in self.etcd_prefix_values(base).items():
            parts = key.rsplit("/", 2)
            if parts[-1] == "manifest":
                out[int(parts[-2])] = json.loads(value)
        return out

    def commits(self, job_id: str, agent: str) -> dict[int, dict[str, Any]]:
        """Step -> commit record JSON of one agent, from etcd."""
        base = f"jobs/{job_id}/agents/{agent}/steps/"
        out: dict[int, dict[str, Any]] = {}
        for key, value in self.etcd_prefix_values(base).items():
            parts = key.rsplit("/", 2)
            if parts[-1] == "commit":
                out[int(parts[-2])] = json.loads(value)
        return out

    def stored_refs(self, job_id: str, agent: str, state: ExperienceState | None = None) -> list[ExperienceRef]:
        """Experience refs of one agent in stored, optionally in one state."""

        async def query() -> list[ExperienceRef]:
            async with StoreClient(self.cluster.daemon("stored").address) as store:
                return await store.query(job_id, agent, state=state)

        return asyncio.run(query())

    def stored_experiences(self, job_id: str, agent: str) -> list[ExperienceRecord]:
        """Every experience of one agent in stored, whole (tokens, logprobs, versions)."""

        async def read() -> list[ExperienceRecord]:
            async with StoreClient(self.cluster.daemon("stored").address) as store:
                refs = await store.query(job_id, agent)
                return await store.read(job_id, [r.experience_id for r in refs])

        return asyncio.run(read())

    def wait_finished_in_store(self, job_id: str, timeout_s: float = 60.0) -> None:
        """Waits until orchestratord told stored the job ended (FinishJob).

        The probe is a CollectGarbage that keeps everything (retention 10^12 s): refused with
        FAILED_PRECONDITION until stored knows the job finished, a no-op afterwards.
        """

        async def probe() -> bool:
            async with StoreClient(self.cluster.daemon("stored").address) as store:
                try:
                    assert await store.collect_garbage(job_id, 1e12) == (0, 0)
                except FailedPrecondition:
                    return False
                return True

        try:
            wait_until(lambda: asyncio.run(probe()), timeout_s, f"stored to hear that job {job_id} ended", 0.2)
        except TimeoutError as exc:
            pytest.fail(f"{exc}; logs:\n{self.log_tails()}")

    def metrics_text(self, daemon: str) -> str:
        """The Prometheus exposition of one daemon."""
        proc = self.cluster.daemon(daemon)
        with urllib.request.urlopen(f"http://{proc.host.address}:{proc.metrics_port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    def engine_pids(self, rolloutd: str = "rolloutd-0") -> list[int]:
        """Pids of the embedded engine replicas a rolloutd launched (its child processes)."""
        return descendant_pids(self.cluster.daemon(rolloutd).pid, ENGINE_MODULE)


@contextlib.contextmanager
def running_cluster(run_dir: Path, models_dir: Path, **fields: Any) -> Iterator[E2ECluster]:
    """A started E2ECluster (LocalClusterConfig fields; one engine replica unless told); stopped after.

    Engines are children of rolloutd in their own session: a SIGKILLed rolloutd leaves them
    behind, so every engine pid seen is killed at the end as well.
    """
    fields.setdefault("engine_replicas", 1)
    fields["env"] = {**daemon_env(), **fields.get("env", {})}
    config = LocalClusterConfig(run_dir=run_dir, etcd_prefix=f"/flexmarl-e2e-{run_dir.name}", **fields)
    cluster = LocalCluster(config)
    cluster.start()
    e2e = E2ECluster(cluster, Client(etcd_endpoints=cluster.etcd_endpoint, etcd_prefix=config.etcd_prefix),
                     models_dir)
    try:
        yield e2e
    finally:
        engines = set(e2e.orphaned_engines)
        for name, proc in cluster.daemons.items():
            if proc.kind == "rolloutd" and proc.alive():
                engines.update(e2e.engine_pids(name))
        with contextlib.suppress(Exception):
            e2e.client.close()
        cluster.stop()
        kill_pids(sorted(engines))


def heal(e2e: E2ECluster) -> None:
    """Restarts daemons an earlier test killed, and a rolloutd that lost an engine replica."""
    restarted = False
    for name, proc in e2e.cluster.daemons.items():
        if not proc.alive():
            proc.restart()
            restarted = True
        elif proc.kind == "rolloutd" and 0 < len(e2e.engine_pids(name)) < e2e.cluster.config.engine_replicas:
            proc.terminate()
            proc.restart()
    if restarted:
        e2e.reconnect()


def metric_sum(text: str, name: str, label_filter: Callable[[str], bool] = lambda _: True) -> float:
    """Sum of every sample of one metric name in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        metric = series.split("{", 1)[0]
        if metric == name and label_filter(series):
            total += float(value)
    return total


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILLs processes this test started (e.g. engines orphaned by a SIGKILLed rolloutd)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            proc = psutil.Process(pid)
            if ENGINE_MODULE in " ".join(proc.cmdline()):
                os.kill(pid, signal.SIGKILL)


def assert_succeeded(e2e: E2ECluster, info: JobInfo, total_steps: int) -> None:
    """The job succeeded and every agent reached total_steps."""
    assert info.state is JobState.SUCCEEDED, f"{info.state.name}: {info.error}\n{e2e.log_tails()}"
    assert info.agents, "the job has no agents"
    for agent in info.agents:
        assert agent.step == total_steps, agent
        assert agent.version == total_steps, agent


def assert_exactly_once(e2e: E2ECluster, job_id: str, spec: dict[str, Any]) -> None:
    """Every step's manifest is disjoint from the others, covers exactly rollout batch n, is consumed.

    Experience ids are ``<task>/<sample>/<agent>/<turn>`` with task ``<job>/b<batch>/t<position>``.
    """
    total_steps = int(spec["total_steps"])
    prompts = int(spec["batch"]["prompts_per_step"])
    group_size = int(spec["batch"]["group_size"])
    for agent in (a["name"] for a in spec["agents"]):
        manifests = e2e.manifests(job_id, agent)
        assert sorted(manifests) == list(range(total_steps)), f"{agent}: manifests of steps {sorted(manifests)}"
        owner: dict[str, int] = {}
        for step, manifest in manifests.items():
            ids = list(manifest["experience_ids"])
            assert len(ids) == len(set(ids)), f"{agent} step {step}: duplicate ids in its manifest"
            tasks: set[str] = set()
            for exp_id in ids:
                assert exp_id not in owner, f"{exp_id} is in the manifests of steps {owner.get(exp_id)} and {step}"
                owner[exp_id] = step
                task, sample, exp_agent, _turn = exp_id.rsplit("/", 3)
                assert exp_agent == agent, exp_id
                assert task.startswith(f"{job_id}/b{step}/t"), f"{exp_id} is not a task of rollout batch {step}"
                assert 0 <= int(sample) < group_size, exp_id
                tasks.add(task)
            assert len(tasks) == prompts, f"{agent} step {step}: {len(tasks)} tasks, expected {prompts}"
        # stored marks a committed step's experiences consumed right after the commit (asynchronously).
        expected = {exp_id: f"{job_id}/{agent}/step{step}" for exp_id, step in owner.items()}

        def consumed(agent: str = agent, expected: dict[str, str] = expected) -> bool:
            refs = e2e.stored_refs(job_id, agent, ExperienceState.CONSUMED)
            return {r.experience_id: r.step_id for r in refs if r.experience_id in expected} == expected

        wait_until(consumed, 30, f"stored to report every manifest experience of {agent} consumed", 0.2)
        # Nothing outside the manifests was consumed.
        extra = [r.experience_id for r in e2e.stored_refs(job_id, agent, ExperienceState.CONSUMED)
                 if r.experience_id not in expected]
        assert not extra, f"{agent}: consumed experiences outside every manifest: {extra[:5]}"


def assert_one_commit_per_step(e2e: E2ECluster, job_id: str, spec: dict[str, Any]) -> None:
    """etcd holds one commit per (agent, step), the history one record per agent-step with versions 1..T."""
    total_steps = int(spec["total_steps"])
    history = e2e.client.history(job_id)
    for agent in (a["name"] for a in spec["agents"]):
        commits = e2e.commits(job_id, agent)
        assert sorted(commits) == list(range(total_steps)), f"{agent}: commits of steps {sorted(commits)}"
        rows = sorted((r for r in history if r.agent == agent), key=lambda r: r.step)
        assert [r.step for r in rows] == list(range(total_steps)), f"{agent}: history steps {[r.step for r in rows]}"
        assert [r.version for r in rows] == list(range(1, total_steps + 1)), f"{agent}: versions"
        uris = [commits[s]["weights_uri"] for s in range(total_steps)]
        assert len(set(uris)) == total_steps, f"{agent}: two steps published the same weights {uris}"
    assert len(history) == total_steps * len(spec["agents"]), "more history records than agent-steps"


def weights_dir(uri: str) -> Path:
    """The directory of a file:// weights URI."""
    assert uri.startswith("file://"), uri
    return local_path(uri)


def max_relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest ``|actual - expected|`` over the largest ``|expected|`` (at least 1e-12)."""
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)


#: rolloutd/weight_sync.py's log lines, one per announced version a rolloutd's replicas took part in.
RECEIVED = re.compile(r"v\d+ over flexmarl-weights-(?P<job>\S+?)-e\d+ \((?:open|keep)[^)]*\): (?P<served>\d+) "
                      r"replicas served, (?P<failed>\d+) failed")
SKIPPED = re.compile(r"v\d+ over flexmarl-weights-(?P<job>\S+): no replica serves the agent here; skipped")


def rolloutd_log(e2e: E2ECluster) -> str:
    """Every rolloutd's log of the cluster, concatenated."""
    return "".join(Path(proc.log_path).read_text(errors="replace") for proc in e2e.cluster.daemons.values()
                   if proc.kind == "rolloutd")


def broadcast_counts(log: str, job_id: str) -> dict[str, int]:
    """Versions of a job's agents received by broadcast, skipped, and failed (replica-versions), from the log."""
    received = failed = skipped = 0
    for match in RECEIVED.finditer(log):
        if match["job"].startswith(f"{job_id}-"):
            received += int(match["served"])
            failed += int(match["failed"])
    for match in SKIPPED.finditer(log):
        if match["job"].startswith(f"{job_id}-"):
            skipped += 1
    return {"received": received, "skipped": skipped, "failed": failed}
