"""The dataclasses rolloutd's worker speaks: what orchestratord leases and is told, and what rolloutd reports.

Protos stop at :mod:`rolloutd.serde`; the worker, its link to orchestratord
(:mod:`rolloutd.link`) and the servicer's callers see only these.
"""

from __future__ import annotations

import dataclasses

from flexmarl.errors import ErrorReason
from flexmarl.evaluation import EvalEpisode
from flexmarl.experience import ExperienceSummary, FailedEpisode
from flexmarl.ids import EvalTaskRef, TaskRef
from flexmarl.weight_group import WeightGroupRecord


@dataclasses.dataclass(frozen=True)
class AgentVersion:
    """The least policy version of an agent a task must run (and where its weights are)."""

    agent: str
    version: int
    #: A checkpoint URI (``file://`` or ``stored://``); "": the agent's base model from the job spec.
    weights_uri: str = ""


@dataclasses.dataclass(frozen=True)
class PublishedVersion:
    """A committed version of a job's agent, as orchestratord's WatchAgentVersions streams it.

    With ``weight_group`` set, the version is not committed yet: its trainer is about to broadcast
    it over that group (``rollout.weight_sync: distributed``); the committed one follows.
    """

    job_id: str
    agent: str
    version: int
    #: A checkpoint URI; "": the agent's base model from the job spec (version 0).
    weights_uri: str = ""
    weight_group: WeightGroupRecord | None = None


@dataclasses.dataclass(frozen=True)
class ActiveJob:
    """A pending or running job, as rolloutd learns of it before any of its tasks (its engines are prepared then)."""

    job_id: str
    #: JobStatus.spec_digest: the spec the job's tasks will name.
    spec_digest: str


@dataclasses.dataclass(frozen=True)
class RolloutTask:
    """A rollout task leased to this worker: one environment prompt, ``group_size`` episodes."""

    lease_id: str
    #: A training task, or a held-out evaluation task (``evaluation``).
    ref: TaskRef | EvalTaskRef
    #: Index into the environment's seeded task stream (an eval task's: into its held-out stream).
    task_index: int
    group_size: int
    #: 1 for a first attempt; more for a task re-issued after a lost lease.
    attempt: int
    #: JobStatus.spec_digest of the job (the spec is fetched once per job, checked against it).
    spec_digest: str
    agent_versions: tuple[AgentVersion, ...] = ()
    #: Play ``Environment.eval_task(task_index)``, store nothing, report the episodes (:class:`TaskReport`).
    evaluation: bool = False
    #: With ``evaluation``: every turn at temperature 0.
    greedy: bool = False
    #: With ``evaluation``: ``agent_versions`` are exact (an on-demand round), served under agent keys of their own.
    pinned: bool = False
    #: With ``pinned``: held-out task i is row i of this task file, whose content has sha256 ``eval_sha256``.
    eval_file: str = ""
    eval_sha256: str = ""

    @property
    def job_id(self) -> str:
        """The job the task belongs to."""
        return self.ref.job_id

    @property
    def task_id(self) -> str:
        """The task's id on the wire."""
        return str(self.ref)


@dataclasses.dataclass(frozen=True)
class TaskReport:
    """The outcome of a task, for orchestratord: its durable experiences, or why it failed."""

    lease_id: str
    task_id: str
    #: "" for a task that succeeded; else why it failed (for people).
    error: str = ""
    #: The experiences durable in stored (empty for a failed task).
    experiences: tuple[ExperienceSummary, ...] = ()
    #: Why it failed, machine-readable (JOB_UNRUNNABLE: the job's environment does not load).
    reason: ErrorReason = ErrorReason.UNSPECIFIED
    #: An eval task's episodes (its experiences stay empty: nothing of it is stored).
    eval_episodes: tuple[EvalEpisode, ...] = ()
    #: Episodes dropped as their reward failed (none of their experiences are in ``experiences``).
    failed_episodes: tuple[FailedEpisode, ...] = ()

    @property
    def succeeded(self) -> bool:
        """Whether the task succeeded."""
        return not self.error


@dataclasses.dataclass(frozen=True)
class RenewResult:
    """orchestratord's answer to a lease renewal."""

    #: Leases no longer held (expired or unknown): their tasks must stop.
    lost_lease_ids: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class AgentDemand:
    """A demand hint for the inter-agent balancer: an agent's outstanding tokens (queued + in flight)."""

    job_id: str
    agent: str
    tokens: int


@dataclasses.dataclass(frozen=True)
class ReplicaStatus:
    """One engine replica as GetRolloutStatus reports it."""

    replica_id: str
    url: str
    #: The "job/agent" keys the replica serves now.
    agents: tuple[str, ...]
    healthy: bool
    outstanding_tokens: int
    in_flight_requests: int
    #: "embedded" or "sglang".
    backend: str


@dataclasses.dataclass(frozen=True)
class RolloutStatus:
    """What GetRolloutStatus reports: the worker's replicas, tasks and episodes."""

    worker_id: str
    tasks_in_flight: int
    episodes_done: int
    #: Inter-agent replica moves so far.
    reassignments: int
    replicas: tuple[ReplicaStatus, ...] = ()
    #: Every job listed or leased here, sorted by job id.
    jobs: tuple[JobPreparation, ...] = ()
    #: Tasks leased at most at once now (``--max-tasks``), whether ``auto`` sizes it, and among how many rolloutds.
    max_tasks: int = 0
    max_tasks_auto: bool = False
    live_rolloutds: int = 1


@dataclasses.dataclass(frozen=True)
class JobPreparation:
    """A job's preparation on this worker (engines, LoRA flags, router, weight groups, environment)."""

    job_id: str
    #: "preparing", "ready" or "failed" (not yet handed to a task, which tries again or fails unrunnable).
    state: str
    #: Preparing: seconds so far; ready or failed: how long it took.
    seconds: float
    error: str = ""
