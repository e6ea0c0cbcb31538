"""Seeded chaos on a whole local cluster: SIGKILL and restart every kind of process during a job.

One strict job (``pipeline.mode: async``, ``max_staleness: 0``, seeded sampling) runs on a real
LocalCluster (etcd, stored, orchestratord, traind workers, rolloutd workers with embedded
engines) while a schedule drawn from a seed SIGKILLs processes of every kind: etcd (restarted on
its data dir and ports), stored (on its data dir), orchestratord, traind and rolloutd (on their
work dirs and etcd prefix; new ports, found again through etcd) and an engine replica (its
rolloutd is then restarted, or, with ``engine_relaunched_by_rolloutd``, relaunches it itself).
After each fault the driver waits, with a deadline, until the job commits a step again (or ends)
before drawing the next one.

A fault-free job with the same spec and seed runs first on the same cluster (the reference).
Afterwards the driver checks (:func:`check_outcome`), and raises :class:`ChaosFailure` naming
what broke:

* the chaos job SUCCEEDED with every agent at ``total_steps``;
* exactly once: every step of every agent has one manifest and one commit in etcd; the
  manifests are disjoint, cover exactly rollout batch ``step``; stored marks exactly the
  manifests' experiences consumed, each by its step;
* nothing acknowledged is lost: every experience stored lists for the job reads back, and a
  probe writer that appended experiences and blobs to stored throughout the chaos finds every
  one that got an OK reply, byte for byte;
* every published version's weights load (``transformers.AutoModelForCausalLM``);
* the final parameters equal the fault-free job's within test_equivalence's tolerance.

Used by ``tests/chaos/test_chaos.py`` (a few faults, one of each kind) and
``benchmarks/chaos.py`` (the full variant, figures as JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import torch
import yaml

from flexmarl.artifacts import checkpoint_tensors, local_path
from flexmarl.cli import materialize_models
from flexmarl.client import Client, JobInfo, JobState
from flexmarl.cluster import EtcdCluster, descendant_pids
from flexmarl.errors import NotFound
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.localcluster import LocalCluster, LocalClusterConfig
from flexmarl.registry import Registry
from flexmarl.store_client import StoreClient

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SIGNALING_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"
E2E_DIR = REPO_ROOT / "tests" / "e2e"
if str(E2E_DIR) not in sys.path:  # e2e_support: the parameter comparison shared with test_equivalence
    sys.path.insert(0, str(E2E_DIR))

# test_equivalence's bound: same gradients, only the order of fp32 sums may differ.
from e2e_support import MAX_RELATIVE_DIFFERENCE, max_relative_difference  # noqa: E402

ENGINE_MODULE = "rolloutd.engines.embedded"
DENSE_ENV = "dense_signaling:DenseSignaling"

#: Every kind of process the schedule kills (the CI variant: one of each).
FAULT_KINDS: tuple[str, ...] = ("etcd", "stored", "orchestratord", "traind", "rolloutd", "engine")
#: Faults beyond SIGKILL: ``sigstop`` freezes a traind, a rolloutd or an engine replica for
#: ``ChaosConfig.stop_s`` (hung, not dead: its process and, for an engine, its rolloutd live on),
#: then SIGCONT; ``etcd-member`` SIGKILLs one member of a three-member etcd and starts it again.
HANG_KINDS: tuple[str, ...] = ("sigstop", "etcd-member")
ALL_FAULT_KINDS: tuple[str, ...] = FAULT_KINDS + HANG_KINDS
REGISTRY_TTL_S = 3
PROBE_JOB = "chaos-probe"
#: orchestratord.state.JobState values of SUCCEEDED, FAILED, CANCELLED (as stored in etcd).
TERMINAL_STATES = (3, 4, 5)

T = TypeVar("T")


class ChaosFailure(AssertionError):
    """A chaos check failed; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    """One chaos run."""

    run_dir: Path
    seed: int = 0
    faults: int = len(FAULT_KINDS)
    #: Steps of the job; 0 = steps_per_fault x faults + 4 (each fault waits for two new steps of every agent).
    total_steps: int = 0
    #: With one worker of each kind every fault stalls the job, and 3 steps per fault suffice; a
    #: second traind or rolloutd keeps the job running during a restart, which then needs more.
    steps_per_fault: int = 3
    rollout_workers: int = 1
    trainer_workers: int = 1
    engine_replicas: int = 1
    #: Upper bound of the seeded pause between a recovery and the next kill.
    max_kill_delay_s: float = 1.0
    recovery_timeout_s: float = 150.0
    job_timeout_s: float = 600.0
    #: Run the fault-free reference job first and compare parameters (a figure).
    baseline: bool = False
    #: Fail unless the final parameters equal the reference's within max_relative_difference (the CI
    #: variant). Off (the long variant): the difference is reported with the first rollout batch where
    #: the two jobs' experiences differ (see docs/reliability.md, "Chaos").
    require_equal_parameters: bool = False
    #: The bound of that check (the CI variant: 1e-6; exact accumulation makes strict runs bit-equal).
    max_relative_difference: float = MAX_RELATIVE_DIFFERENCE
    #: After an engine SIGKILL wait for rolloutd's own supervisor to relaunch the replica (rolloutd
    #: /engines/supervisor.py) instead of restarting rolloutd; the kill must be followed by a
    #: "relaunched" line in rolloutd's log. Off: the driver restarts rolloutd (the long variant's figures).
    engine_relaunched_by_rolloutd: bool = False
    #: The kinds the schedule draws from (every kind once first, then random ones).
    kinds: tuple[str, ...] = FAULT_KINDS
    #: etcd members; ``etcd-member`` faults need 3 (or 5).
    etcd_members: int = 1
    #: How long a ``sigstop`` fault keeps its process frozen: longer than the registry TTL (3 s) and
    #: the rollout lease (10 s), so a frozen worker's registration and leases run out.
    stop_s: float = 15.0

    @property
    def steps(self) -> int:
        """The job's total_steps."""
        return self.total_steps or self.steps_per_fault * self.faults + 4


@dataclasses.dataclass
class FaultRecord:
    """One injected fault and how long the cluster took to recover from it."""

    index: int
    kind: str
    target: str
    delay_s: float
    #: The lowest agent version when the process was killed.
    version_at_kill: int
    restart_s: float = 0.0
    recovery_s: float = 0.0
    recovered_by: str = ""


@dataclasses.dataclass
class ChaosResult:
    """Figures of a chaos run (filled as it goes; ``check_outcome`` adds the checks)."""

    seed: int
    total_steps: int
    kinds: tuple[str, ...] = FAULT_KINDS
    job_id: str = ""
    baseline_job_id: str = ""
    cluster_start_s: float = 0.0
    baseline_wall_s: float = 0.0
    job_wall_s: float = 0.0
    faults: list[FaultRecord] = dataclasses.field(default_factory=list)
    faults_planned: int = 0
    tasks_leased: int = 0
    tasks: int = 0
    reissued_log_lines: int = 0
    job_state: str = ""
    job_error: str = ""
    experiences_checked: int = 0
    experiences_consumed: int = 0
    probe_experiences_acked: int = 0
    probe_blobs_acked: int = 0
    probe_errors: int = 0
    versions_loaded: int = 0
    max_relative_difference: float = float("nan")
    #: First rollout batch whose experiences (tokens, logprobs, rewards) differ from the reference's.
    first_differing_batch: int = -1
    #: Largest |logprob difference| of that batch (1 ulp says rounding, not a lost or doubled sample).
    first_difference_logprob: float = 0.0
    checks: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def reissued_leases(self) -> int:
        """Task leases issued beyond one per task (re-issues; from orchestratord's /metrics)."""
        return self.tasks_leased - self.tasks

    def faults_by_kind(self) -> dict[str, int]:
        """Injected faults per kind."""
        counts = Counter(f.kind for f in self.faults)
        return {kind: counts.get(kind, 0) for kind in self.kinds}

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-able data."""
        data = dataclasses.asdict(self)
        data["reissued_leases"] = self.reissued_leases
        data["faults_by_kind"] = self.faults_by_kind()
        return data


def plan_faults(seed: int, count: int, kinds: Sequence[str] = FAULT_KINDS) -> list[str]:
    """The seeded kinds of ``count`` faults: every kind once (shuffled) first, then random kinds."""
    rng = random.Random(f"chaos-plan/{seed}")
    first = list(kinds)
    rng.shuffle(first)
    plan = first[:count]
    plan.extend(rng.choice(list(kinds)) for _ in range(count - len(plan)))
    return plan


def job_spec(models_dir: Path, seed: int, total_steps: int) -> dict[str, Any]:
    """The signaling example, tiny models, dense reward, strict async (max_staleness 0), seeded."""
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw["seed"] = seed
    raw["total_steps"] = total_steps
    raw["batch"] = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}
    raw["environment"] = {"entrypoint": DENSE_ENV, "config": {"num_objects": 4}}
    raw["pipeline"] = {"mode": "async", "max_staleness": 0}
    # Short rollout leases: a task of a killed rolloutd comes back within seconds. Training
    # leases are generous: an expired one only replays work a slow (not dead) slot was doing.
    raw["leases"] = {"rollout_timeout_s": 10, "train_timeout_s": 60}
    # The driver loads every published version (WeightsWatcher): the policy pins them all, so a
    # watcher that could not reach etcd for a while finds none pruned when it catches up.
    raw["checkpoint"] = {"keep_last": total_steps + 1}
    return materialize_models(raw, models_dir)


def _run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


class ChaosDriver:
    """Owns the cluster, the schedule and the checks of one chaos run (see the module docstring)."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(f"chaos-faults/{config.seed}")
        if "etcd-member" in config.kinds and config.etcd_members < 3:
            raise ChaosFailure("etcd-member faults need a cluster of 3 or 5 etcd members (etcd_members)")
        self.result = ChaosResult(seed=config.seed, total_steps=config.steps, kinds=config.kinds)
        run_dir = config.run_dir.resolve()
        self.models_dir = run_dir / "models"
        ttl = ["--registry-ttl-s", str(REGISTRY_TTL_S)]
        paths = [str(REPO_ROOT), str(E2E_DIR), os.environ.get("PYTHONPATH", "")]
        self.cluster = LocalCluster(
            LocalClusterConfig(
                run_dir=run_dir / "cluster",
                rollout_workers=config.rollout_workers,
                engine_replicas=config.engine_replicas,
                trainer_workers=config.trainer_workers,
                trainer_slots=1,
                etcd_prefix=f"/flexmarl-chaos-{config.seed}",
                env={"PYTHONPATH": os.pathsep.join(p for p in paths if p)},
                rolloutd_args=ttl,
                traind_args=ttl,
                orchestratord_args=ttl,
                stored_args=ttl,
                etcd_members=config.etcd_members,
            )
        )
        self.spec = job_spec(self.models_dir, config.seed, config.steps)
        self.agents = [str(a["name"]) for a in self.spec["agents"]]
        self.client: Client | None = None
        self.weights = WeightsWatcher(self)
        self.engines_seen: set[int] = set()
        self.probe = ProbeWriter(lambda: self.cluster.daemon("stored").address)
        # Task leases issued during the chaos job: orchestratord's counter restarts with it, so the
        # finished incarnations' last scrapes are summed (minus the reference job's leases).
        self._leased_done = 0.0
        self._leased_base = 0.0
        self._leased_last = 0.0

    # ---- lifecycle ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[ChaosDriver]:
        """Starts the cluster; stops it (and every engine it launched) afterwards."""
        start = time.monotonic()
        self.cluster.start()
        self.result.cluster_start_s = time.monotonic() - start
        self.client = Client(etcd_endpoints=self.cluster.etcd_endpoint, etcd_prefix=self.cluster.config.etcd_prefix)
        try:
            yield self
        finally:
            self.probe.stop()
            self.weights.stop()
            self._note_engines()
            with contextlib.suppress(Exception):
                self.client.close()
            self.cluster.stop()
            _kill_engines(sorted(self.engines_seen))

    def run(self) -> ChaosResult:
        """The reference job (when configured), then the chaos job; returns the figures (unchecked)."""
        cfg = self.config
        spec = self.spec
        if cfg.baseline:
            self.result.baseline_job_id = f"chaos-reference-{cfg.seed}"
            start = time.monotonic()
            self._client().submit(spec, job_id=self.result.baseline_job_id)
            info = self._client().wait(self.result.baseline_job_id, cfg.job_timeout_s)
            self.result.baseline_wall_s = time.monotonic() - start
            if info.state is not JobState.SUCCEEDED:
                raise ChaosFailure(
                    f"the fault-free reference job ended {info.state.name}: {info.error}\n{self.log_tails()}"
                )
        self._leased_base = self._leased_last = self._scrape_leased()
        self.result.job_id = f"chaos-{cfg.seed}"
        self.result.tasks = cfg.steps * int(spec["batch"]["prompts_per_step"])
        plan = plan_faults(cfg.seed, cfg.faults, cfg.kinds)
        self.result.faults_planned = len(plan)
        self.probe.start()
        start = time.monotonic()
        self._client().submit(spec, job_id=self.result.job_id)
        self.weights.start()
        self._wait_version(1, cfg.recovery_timeout_s, "the first step of the chaos job")
        for index, kind in enumerate(plan):
            if self._finished():
                log.warning("the job finished after %d of %d faults", index, len(plan))
                break
            self._inject(index, kind)
        info = self._wait_job(cfg.job_timeout_s - (time.monotonic() - start))
        self.result.job_wall_s = time.monotonic() - start
        self.probe.stop()
        self.weights.stop()
        self.result.job_state = info.state.name
        self.result.job_error = info.error
        self.result.tasks_leased = int(self._leased_done + self._scrape_leased() - self._leased_base)
        log_text = (self.cluster.run_dir / "orchestratord.log").read_text(errors="replace")
        self.result.reissued_log_lines = log_text.count(f"re-issuing task {self.result.job_id}/")
        return self.result

    # ---- faults ---------------------------------------------------------------------------------

    def _inject(self, index: int, kind: str) -> None:
        delay_s = round(self.rng.uniform(0.0, self.config.max_kill_delay_s), 3)
        target = self._target(kind)
        time.sleep(delay_s)  # the seeded moment of the kill (not a wait for a condition)
        version = self.min_version()
        record = FaultRecord(index, kind, target, delay_s, version)
        log.info("fault %d: %s %s (%s) at version %d", index, "SIGSTOP" if kind == "sigstop" else "SIGKILL", target,
                 kind, version)
        killed_at = time.monotonic()
        if kind == "etcd":
            self.cluster.etcd.kill()
            self.cluster.etcd.start()
        elif kind == "etcd-member":
            etcd = self.cluster.etcd
            if not isinstance(etcd, EtcdCluster):
                raise ChaosFailure("etcd-member fault on a one-member etcd")
            member = next(m for m in etcd.members if m.member == target)
            member.kill()
            member.start()
        elif kind == "sigstop":
            self._freeze(target)
        elif kind == "engine":
            rolloutd = self.cluster.daemon(target)
            victims = self.engine_pids(target)
            if not victims:
                raise ChaosFailure(f"{target} has no engine replica to kill\n{self.log_tails()}")
            noticed = rolloutd.log_path.read_text(errors="replace").count("removed:")
            relaunched = rolloutd.log_path.read_text(errors="replace").count(" relaunched at ")
            os.kill(self.rng.choice(victims), signal.SIGKILL)
            if self.config.engine_relaunched_by_rolloutd:
                _wait_until(
                    lambda: rolloutd.log_path.read_text(errors="replace").count(" relaunched at ") > relaunched,
                    self.config.recovery_timeout_s,
                    f"{target} to relaunch its dead engine",
                    interval_s=0.2,
                    on_timeout=self.log_tails,
                )
                self.engine_pids(target)  # the relaunched replica, to be killed after the run
            else:
                # The long variant's figures: restart rolloutd (SIGTERM) once it noticed.
                _wait_until(
                    lambda: rolloutd.log_path.read_text(errors="replace").count("removed:") > noticed,
                    30,
                    f"{target} to notice its dead engine",
                )
                rolloutd.terminate()
                rolloutd.restart()
        else:
            proc = self.cluster.daemon(target)
            if kind == "orchestratord":
                self._scrape_leased_live()
                self._leased_done += self._leased_last - self._leased_base
                self._leased_base = self._leased_last = 0.0
            if kind == "rolloutd":
                self._note_engines()
            proc.kill()
            proc.restart()
            if kind == "orchestratord":
                self._reconnect()
        record.restart_s = round(time.monotonic() - killed_at, 3)
        self.cluster.write_cluster_file()
        try:
            # Steps v and v + 1 committed: batch v + 1 was rolled out with both agents at
            # version v + 1, which did not exist before the kill, so a whole cycle (lease,
            # rollout, append, train, commit) ran after it.
            record.recovered_by = self._wait_version(
                version + 2, self.config.recovery_timeout_s, f"two steps after fault {index} ({kind} {target})"
            )
        finally:
            record.recovery_s = round(time.monotonic() - killed_at, 3)
            self.result.faults.append(record)
        log.info(
            "fault %d (%s): restarted in %.1fs, recovered in %.1fs", index, kind, record.restart_s, record.recovery_s
        )

    def _freeze(self, target: str) -> None:
        """SIGSTOP a process (a daemon by name, or ``<rolloutd>/engine``) for stop_s, then SIGCONT."""
        name, _, engine = target.partition("/")
        pids = [self.rng.choice(self.engine_pids(name))] if engine else [self.cluster.daemon(name).pid]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.config.stop_s)  # the fault's length (a hang of stop_s), not a wait for a condition
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def _target(self, kind: str) -> str:
        if kind in ("etcd", "stored", "orchestratord"):
            return kind
        if kind == "etcd-member":
            etcd = self.cluster.etcd
            return self.rng.choice([m.member for m in etcd.members]) if isinstance(etcd, EtcdCluster) else "etcd"
        if kind == "sigstop":
            workers = sorted(n for n in self.cluster.daemons if n.startswith(("traind-", "rolloutd-")))
            name = self.rng.choice(workers)
            return f"{name}/engine" if name.startswith("rolloutd-") and self.rng.random() < 0.5 else name
        prefix = "traind" if kind == "traind" else "rolloutd"
        names = sorted(n for n in self.cluster.daemons if n.startswith(prefix + "-"))
        return self.rng.choice(names)

    def engine_pids(self, rolloutd: str) -> list[int]:
        """Pids of the embedded engines a rolloutd launched."""
        pids = descendant_pids(self.cluster.daemon(rolloutd).pid, ENGINE_MODULE)
        self.engines_seen.update(pids)
        return pids

    def _note_engines(self) -> None:
        for name, proc in self.cluster.daemons.items():
            if proc.kind == "rolloutd" and proc.alive():
                self.engine_pids(name)

    # ---- observing the job ----------------------------------------------------------------------

    def _client(self) -> Client:
        if self.client is None:
            raise ChaosFailure("the cluster is not running")
        return self.client

    def _reconnect(self) -> None:
        with contextlib.suppress(Exception):
            self._client().close()
        self.client = Client(etcd_endpoints=self.cluster.etcd_endpoint, etcd_prefix=self.cluster.config.etcd_prefix)

    def etcd_values(self, key_prefix: str) -> dict[str, bytes]:
        """Every etcd key under ``<prefix>/<key_prefix>``."""

        async def read() -> dict[str, bytes]:
            registry = Registry(self.cluster.etcd_endpoint, self.cluster.config.etcd_prefix, connect_timeout_s=2.0)
            await registry.connect()
            try:
                values, _ = await registry.get_prefix(registry.key(key_prefix))
            finally:
                await registry.close()
            return values

        result: dict[str, bytes] = _run(read)
        return result

    def step_records(self, job_id: str, agent: str, what: str) -> dict[int, dict[str, Any]]:
        """Step -> ``manifest`` or ``commit`` JSON of one agent, read from etcd."""
        out: dict[int, dict[str, Any]] = {}
        for key, value in self.etcd_values(f"jobs/{job_id}/agents/{agent}/steps/").items():
            parts = key.rsplit("/", 2)
            if parts[-1] == what:
                out[int(parts[-2])] = json.loads(value)
        return out

    def versions(self, job_id: str) -> dict[str, int]:
        """Agent -> committed steps of a job (from the commit records in etcd)."""
        counts: Counter[str] = Counter()
        base = f"{self.cluster.config.etcd_prefix}/jobs/{job_id}/agents/"
        for key in self.etcd_values(f"jobs/{job_id}/agents/"):
            if key.endswith("/commit"):
                counts[key.removeprefix(base).split("/", 1)[0]] += 1
        return dict(counts)

    def min_version(self) -> int:
        """The lowest version over the chaos job's agents."""
        versions = self.versions(self.result.job_id)
        return min(versions.values()) if len(versions) == len(self.agents) else 0

    def _finished(self) -> bool:
        """Whether etcd records the chaos job as ended (``jobs/<job>/meta``, written by orchestratord)."""
        key = f"{self.cluster.config.etcd_prefix}/jobs/{self.result.job_id}/meta"
        value = self.etcd_values(f"jobs/{self.result.job_id}/meta").get(key)
        return value is not None and int(json.loads(value)["state"]) in TERMINAL_STATES

    def _wait_version(self, at_least: int, timeout_s: float, what: str) -> str:
        """Waits until every agent of the chaos job reached ``at_least`` (or it ended); returns which."""
        outcome = ""

        def progressed() -> bool:
            nonlocal outcome
            try:
                self._scrape_leased_live()
                if self.min_version() >= at_least:
                    outcome = "progress"
                    return True
                if self._finished():
                    outcome = "job ended"
                    return True
            except Exception as exc:  # etcd or orchestratord still coming back: poll again
                log.debug("progress poll failed: %s", exc)
            return False

        _wait_until(progressed, timeout_s, what, interval_s=0.25, on_timeout=self.log_tails)
        return outcome

    def _scrape_leased_live(self) -> None:
        """Keeps the latest lease count of the current orchestratord (it may be SIGKILLed next)."""
        with contextlib.suppress(Exception):
            self._leased_last = self._scrape_leased()

    def _scrape_leased(self) -> float:
        port = self.cluster.daemon("orchestratord").metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return metric_sum(text, "flexmarl_orchestratord_rollout_tasks_leased_total")

    def _wait_job(self, timeout_s: float) -> JobInfo:
        deadline = time.monotonic() + max(1.0, timeout_s)
        while True:
            try:
                return self._client().wait(self.result.job_id, max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ChaosFailure(f"job {self.result.job_id} did not finish in time\n{self.log_tails()}") from None
            except Exception as exc:  # orchestratord moved: discover it again
                if time.monotonic() > deadline:
                    raise ChaosFailure(f"job {self.result.job_id}: {exc}\n{self.log_tails()}") from exc
                time.sleep(0.5)
                self._reconnect()

    def log_tails(self) -> str:
        """The end of every process's log (for failure messages)."""
        etcd = self.cluster.etcd
        members = etcd.members if isinstance(etcd, EtcdCluster) else [etcd]
        parts = [f"--- etcd {m.member}\n{m.stderr_tail()[-800:]}" for m in members]
        parts += [f"--- {name}\n{proc.stderr_tail()[-1500:]}" for name, proc in self.cluster.daemons.items()]
        return "\n".join(parts)

    # ---- checks ---------------------------------------------------------------------------------

    def check_outcome(self) -> ChaosResult:
        """Runs every check (see the module docstring); raises ChaosFailure on the first that fails."""
        res = self.result
        spec, agents = self.spec, self.agents
        if res.job_state != JobState.SUCCEEDED.name:
            raise ChaosFailure(f"job ended {res.job_state}: {res.job_error}\n{self.log_tails()}")
        info = self._client().status(res.job_id)
        for agent in info.agents:
            if agent.version != self.config.steps:
                raise ChaosFailure(f"{agent.agent} ended at version {agent.version}, not {self.config.steps}")
        res.checks["succeeded"] = "ok"
        if self.config.baseline:  # a figure; computed first so that it exists when a check below fails
            self._compare_with_reference(agents)
        self._check_exactly_once(res.job_id, spec, agents)
        res.checks["exactly_once"] = "ok"
        self._check_history(res.job_id, agents)
        res.checks["history"] = "ok"
        self._check_nothing_lost(res.job_id, agents)
        res.checks["nothing_lost"] = "ok"
        self._check_weights_load()
        res.checks["weights_load"] = "ok"
        if self.config.baseline:
            bound = self.config.max_relative_difference
            res.checks["equal_to_fault_free"] = (
                "ok"
                if res.max_relative_difference <= bound
                else f"differs ({res.max_relative_difference:.3g}; first at rollout batch {res.first_differing_batch})"
            )
            if self.config.require_equal_parameters and res.max_relative_difference > bound:
                raise ChaosFailure(
                    f"final parameters differ from the fault-free run: {res.checks['equal_to_fault_free']}"
                )
        return res

    def _check_exactly_once(self, job_id: str, spec: dict[str, Any], agents: list[str]) -> None:
        steps = int(spec["total_steps"])
        prompts = int(spec["batch"]["prompts_per_step"])
        group_size = int(spec["batch"]["group_size"])
        for agent in agents:
            manifests = self.step_records(job_id, agent, "manifest")
            commits = self.step_records(job_id, agent, "commit")
            if sorted(manifests) != list(range(steps)) or sorted(commits) != list(range(steps)):
                raise ChaosFailure(f"{agent}: manifests of steps {sorted(manifests)}, commits {sorted(commits)}")
            owner: dict[str, int] = {}
            for step, manifest in manifests.items():
                ids = [str(i) for i in manifest["experience_ids"]]
                tasks: set[str] = set()
                for exp_id in ids:
                    if exp_id in owner:
                        raise ChaosFailure(f"{exp_id} is in the manifests of steps {owner[exp_id]} and {step}")
                    owner[exp_id] = step
                    task, sample, exp_agent, _turn = exp_id.rsplit("/", 3)
                    if (
                        exp_agent != agent
                        or not task.startswith(f"{job_id}/b{step}/t")
                        or not 0 <= int(sample) < group_size
                    ):
                        raise ChaosFailure(f"{agent} step {step}: {exp_id} does not belong to rollout batch {step}")
                    tasks.add(task)
                if len(tasks) != prompts:
                    raise ChaosFailure(f"{agent} step {step}: {len(tasks)} tasks, expected {prompts}")
            expected = {exp_id: f"{job_id}/{agent}/step{step}" for exp_id, step in owner.items()}

            def consumed(agent: str = agent) -> dict[str, str]:
                async def query() -> dict[str, str]:
                    async with StoreClient(self.cluster.daemon("stored").address) as store:
                        refs = await store.query(job_id, agent, state=ExperienceState.CONSUMED)
                    return {r.experience_id: r.step_id for r in refs}

                result: dict[str, str] = _run(query)
                return result

            # stored marks a committed step consumed right after the commit (asynchronously).
            def settled(agent: str = agent, expected: dict[str, str] = expected) -> bool:
                return consumed(agent) == expected

            def difference(agent: str = agent, expected: dict[str, str] = expected) -> str:
                return _diff(consumed(agent), expected)

            _wait_until(
                settled,
                30,
                f"stored to mark exactly {agent}'s manifests consumed",
                interval_s=0.2,
                on_timeout=difference,
            )
            self.result.experiences_consumed += len(expected)

    def _check_history(self, job_id: str, agents: list[str]) -> None:
        """The job's history holds one record per agent-step, versions 1..T, whatever was killed on the way."""
        steps = self.config.steps
        history = self._client().history(job_id)
        for agent in agents:
            rows = sorted((r for r in history if r.agent == agent), key=lambda r: r.step)
            if [r.step for r in rows] != list(range(steps)) or [r.version for r in rows] != list(range(1, steps + 1)):
                raise ChaosFailure(
                    f"{agent}: history steps {[r.step for r in rows]}, versions {[r.version for r in rows]}"
                )
        if len(history) != steps * len(agents):
            raise ChaosFailure(f"{len(history)} history records for {steps * len(agents)} agent-steps")

    def _check_nothing_lost(self, job_id: str, agents: list[str]) -> None:
        async def check() -> int:
            checked = 0
            async with StoreClient(self.cluster.daemon("stored").address) as store:
                for agent in agents:
                    refs = await store.query(job_id, agent)
                    ids = [r.experience_id for r in refs]
                    records = await store.read(job_id, ids)
                    if [r.experience_id for r in records] != ids:
                        raise ChaosFailure(
                            f"{agent}: stored lists {len(ids)} experiences but reads back {len(records)}"
                        )
                    checked += len(records)
                await self.probe.verify(store)
            return checked

        self.result.experiences_checked = int(_run(check))
        self.result.probe_experiences_acked = len(self.probe.acked_experiences)
        self.result.probe_blobs_acked = len(self.probe.acked_blobs)
        self.result.probe_errors = self.probe.errors

    def _check_weights_load(self) -> None:
        self.weights.poll(load_budget_s=float("inf"))  # the rest, and versions committed since the last poll
        res, watcher = self.result, self.weights
        published = sum(self.versions(res.job_id).values())
        res.versions_loaded = len(watcher.loaded)
        if watcher.failed:
            raise ChaosFailure(f"published weights that do not load: {watcher.failed[:3]}")
        if watcher.missed:
            raise ChaosFailure(f"published weights pruned before the driver could load them: {watcher.missed}")
        if len(watcher.loaded) != published:
            raise ChaosFailure(f"{len(watcher.loaded)} of {published} published versions were loaded")

    def _compare_with_reference(self, agents: list[str]) -> None:
        """Largest relative parameter difference to the reference, and where the rollouts first differ."""
        worst = 0.0
        for agent in agents:
            chaos = _tensors(self._final_weights(self.result.job_id, agent))
            reference = _tensors(self._final_weights(self.result.baseline_job_id, agent))
            if chaos.keys() != reference.keys():
                raise ChaosFailure(f"{agent}: parameter names differ from the fault-free run")
            for name, expected in reference.items():
                worst = max(worst, max_relative_difference(chaos[name], expected))
        self.result.max_relative_difference = worst

        async def experiences(job_id: str) -> dict[str, ExperienceRecord]:
            async with StoreClient(self.cluster.daemon("stored").address) as store:
                out: dict[str, ExperienceRecord] = {}
                for agent in agents:
                    ids = [r.experience_id for r in await store.query(job_id, agent)]
                    out.update({r.experience_id.removeprefix(job_id + "/"): r for r in await store.read(job_id, ids)})
                return out

        chaos_exps: dict[str, ExperienceRecord] = _run(lambda: experiences(self.result.job_id))
        reference_exps: dict[str, ExperienceRecord] = _run(lambda: experiences(self.result.baseline_job_id))
        differing: dict[int, float] = {}
        for key, want in reference_exps.items():
            got = chaos_exps.get(key)
            batch = int(key.split("/", 1)[0].removeprefix("b"))
            if (
                got is None
                or not np.array_equal(got.response_token_ids, want.response_token_ids)
                or got.reward != want.reward
                or got.response_logprobs.shape != want.response_logprobs.shape
            ):
                differing[batch] = float("inf")
            elif not np.array_equal(got.response_logprobs, want.response_logprobs):
                delta = float(np.abs(got.response_logprobs - want.response_logprobs).max())
                differing[batch] = max(differing.get(batch, 0.0), delta)
        if differing:
            first = min(differing)
            self.result.first_differing_batch = first
            self.result.first_difference_logprob = differing[first]

    def _final_weights(self, job_id: str, agent: str) -> Path:
        commits = self.step_records(job_id, agent, "commit")
        return local_path(str(commits[max(commits)]["weights_uri"]))


class WeightsWatcher:
    """Loads every version the chaos job publishes, as soon as its commit is in etcd.

    The chaos job's checkpoint policy keeps every version (``job_spec``: ``checkpoint.keep_last``
    above the step count), and each version's files are still hard-linked as soon as its commit
    is seen and loaded from the links (``transformers.AutoModelForCausalLM.from_pretrained``); a
    version missing when first seen is recorded as missed.
    """

    def __init__(self, driver: ChaosDriver, interval_s: float = 0.2) -> None:
        self._driver = driver
        self._interval_s = interval_s
        self.loaded: dict[tuple[str, int], str] = {}
        self.failed: list[str] = []
        self.missed: list[str] = []
        self._seen: set[tuple[str, int]] = set()
        self._pinned: list[tuple[str, int, Path]] = []
        self._pin_dir = driver.config.run_dir.resolve() / "published"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts watching in a background thread."""
        self._thread = threading.Thread(target=self._loop, name="chaos-weights", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops watching (waits for the thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll()
            except Exception as exc:  # etcd down or restarting: poll again
                log.debug("weights poll failed: %s", exc)

    def poll(self, load_budget_s: float = 0.5) -> None:
        """Pins every newly committed version (hard links), then loads pinned ones for up to load_budget_s.

        Linking the files takes microseconds, so traind's pruning (3 versions later) cannot win the
        race the way a slow load could; a version is loaded from its links, which are then removed.
        """
        driver = self._driver
        with self._lock:
            for agent in driver.agents:
                commits = driver.step_records(driver.result.job_id, agent, "commit")
                for step, commit in sorted(commits.items()):
                    if (agent, step) in self._seen:
                        continue
                    self._seen.add((agent, step))
                    pinned = self._pin_dir / agent / f"v{step + 1}"
                    if _link_tree(local_path(str(commit["weights_uri"])), pinned):
                        self._pinned.append((agent, step, pinned))
                    else:
                        self.missed.append(f"{agent} v{step + 1}")
            deadline_s = time.monotonic() + load_budget_s
            while self._pinned and time.monotonic() < deadline_s:
                self._load(*self._pinned.pop(0))

    def _load(self, agent: str, step: int, pinned: Path) -> None:
        from transformers import AutoModelForCausalLM

        what = f"{agent} v{step + 1}"
        try:
            model = AutoModelForCausalLM.from_pretrained(str(pinned), local_files_only=True)
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                self.failed.append(f"{what}: non-finite parameters")
        except Exception as exc:
            self.failed.append(f"{what}: {type(exc).__name__}: {exc}")
        self.loaded[(agent, step)] = str(pinned)
        shutil.rmtree(pinned, ignore_errors=True)


def _link_tree(source: Path, dest: Path) -> bool:
    """Hard-links every file of a weights directory into dest; False when it is gone (pruned)."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.is_file():
                os.link(item, dest / item.name)
        return any(dest.iterdir())
    except FileNotFoundError:
        shutil.rmtree(dest, ignore_errors=True)
        return False


class ProbeWriter:
    """Appends experiences and blobs to stored in a thread during the chaos; remembers what got OK.

    Each append or put is retried under the same id/name after an error (both are idempotent),
    so an OK reply may come for a record whose first attempt failed; only OK replies count.
    """

    def __init__(self, store_address: Callable[[], str], interval_s: float = 0.2) -> None:
        self._store_address = store_address
        self._interval_s = interval_s
        self.acked_experiences: dict[str, ExperienceRecord] = {}
        self.acked_blobs: dict[str, bytes] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts writing in a background thread."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), name="chaos-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops writing (waits for the thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    async def _loop(self) -> None:
        rng = np.random.default_rng(7)
        store: StoreClient | None = None
        n = 0
        while not self._stop.is_set():
            record = _probe_record(n, rng)
            blob = (f"{PROBE_JOB}/blob-{n:06d}", rng.bytes(int(rng.integers(1, 200_000)))) if n % 5 == 0 else None
            try:
                if store is None or store.address != self._store_address():
                    if store is not None:
                        await store.close()
                    store = StoreClient(self._store_address())
                await asyncio.wait_for(store.append([record]), timeout=5)
                self.acked_experiences[record.experience_id] = record
                if blob is not None:
                    await asyncio.wait_for(store.put_blob_bytes(blob[0], blob[1], job_id=PROBE_JOB), timeout=10)
                    self.acked_blobs[blob[0]] = blob[1]
                n += 1
            except Exception as exc:  # stored down or moving: retry the same record
                self.errors += 1
                log.debug("probe write failed: %s", exc)
            await asyncio.sleep(self._interval_s)
        if store is not None:
            await store.close()

    async def verify(self, store: StoreClient) -> None:
        """Raises ChaosFailure unless every acknowledged experience and blob reads back unchanged."""
        ids = sorted(self.acked_experiences)
        records = {r.experience_id: r for r in await store.read(PROBE_JOB, ids)}
        for exp_id in ids:
            want, got = self.acked_experiences[exp_id], records.get(exp_id)
            if got is None:
                raise ChaosFailure(f"acknowledged experience {exp_id} is lost")
            if (
                got.to_proto().SerializeToString()
                != dataclasses.replace(want, state=got.state, created_unix_ms=got.created_unix_ms)
                .to_proto()
                .SerializeToString()
            ):
                raise ChaosFailure(f"acknowledged experience {exp_id} reads back changed")
        for name, data in sorted(self.acked_blobs.items()):
            try:
                back = await store.get_blob_bytes(name)
            except Exception as exc:
                raise ChaosFailure(f"acknowledged blob {name} is lost: {exc}") from exc
            if back != data:
                raise ChaosFailure(f"acknowledged blob {name} reads back changed ({len(back)} of {len(data)} bytes)")


def _probe_record(n: int, rng: np.random.Generator) -> ExperienceRecord:
    tokens = int(rng.integers(1, 64))
    task = f"{PROBE_JOB}/b0/t{n}"
    return ExperienceRecord(
        experience_id=f"{task}/0/probe/0",
        job_id=PROBE_JOB,
        agent="probe",
        task_id=task,
        group_id=f"{task}/probe",
        sample_index=0,
        episode_id=f"{task}/0",
        turn=0,
        behavior_version=0,
        reward=float(rng.random()),
        prompt_token_ids=rng.integers(0, 256, size=8, dtype=np.int32),
        response_token_ids=rng.integers(0, 256, size=tokens, dtype=np.int32),
        response_logprobs=-rng.random(tokens, dtype=np.float32),
        group_size=1,
    )


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of one metric in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{", 1)[0] == name:
            total += float(value)
    return total


def _wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            detail = on_timeout() if on_timeout is not None else ""
            raise ChaosFailure(f"timed out after {timeout_s:.0f}s waiting for {what}\n{detail}")
        time.sleep(interval_s)


def _diff(got: dict[str, str], want: dict[str, str]) -> str:
    missing = sorted(set(want) - set(got))[:5]
    extra = sorted(set(got) - set(want))[:5]
    wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])[:5]
    return f"not consumed: {missing}; consumed outside every manifest: {extra}; consumed by another step: {wrong}"


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    try:
        return checkpoint_tensors(checkpoint)
    except NotFound as exc:
        raise ChaosFailure(str(exc)) from None


def _kill_engines(pids: Sequence[int]) -> None:
    """SIGKILLs engines this driver's rolloutds launched that are still alive (only engine processes)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if ENGINE_MODULE in " ".join(psutil.Process(pid).cmdline()):
                os.kill(pid, signal.SIGKILL)


def run_chaos(config: ChaosConfig) -> ChaosResult:
    """Starts a cluster, runs the reference and the chaos job, checks; returns the figures."""
    driver = ChaosDriver(config)
    with driver.running():
        driver.run()
        return driver.check_outcome()
