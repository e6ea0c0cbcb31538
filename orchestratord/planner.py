"""The step plan of orchestratord: rollout tasks, leases, admission, micro-batches, steps.

Pure domain logic: no I/O, no threads, time from an injected clock
(``now_s``, wall-clock seconds since the epoch, because deadlines travel as
unix milliseconds). Durable changes go to an outbox (:meth:`JobPlanner.take_changes`)
that the daemon wiring applies to a ``StateStore`` before answering (see
``orchestratord.state``). ``docs/pipeline.md`` explains the consistency argument.

Vocabulary: rollout *batch* t = the ``prompts_per_step`` tasks whose
experiences form *step* t of every agent; step t of an agent trains version t
into version t + 1. A step's *manifest* is the exact set of its experience ids.
A step *attempt* is one try at training it on one slot; a slot death starts a
new attempt from the last committed version with the same manifest.

Pipeline modes (``pipeline.mode``):

* ``async``: a micro-batch is formed and leased as soon as enough complete
  groups of an agent arrived; admission follows AReaL's rule with eta =
  ``max_staleness``.
* ``sync``: the barrier baseline. Admission uses eta = 0 (batch t + 1 is
  admitted only once every agent committed step t) and micro-batches are formed
  only when the whole batch arrived, in task order.
* ``sequential`` (MAS-RL-like): ``sync``, and in addition the agents train one
  after another in spec order. Precisely: with agents a_0 .. a_{K-1}, no
  micro-batch or optimizer step of step t of a_k (k >= 1) is leased before a_{k-1}
  committed step t (its version is > t). An episode involves every agent, so
  the rollouts of step t are one joint batch generated before a_0 trains; batch
  t + 1 is admitted only after a_{K-1} committed step t. Hence, per step:
  rollout(t) -> train a_0 -> commit -> train a_1 -> ... -> commit a_{K-1}.
* ``static`` (MARTI-like): ``sync`` with static binding (each agent only on its
  fixed slot set, see ``orchestratord.binding``); rolloutd keeps each agent's
  fixed replica share (``JobSpec.balancing``).

``pipeline.binding: static`` alone (any mode) is the "no agent-centric
binding" ablation. None of the modes changes what a step trains on: the
manifest of step t of an agent is the same set of experience ids in every mode.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

from flexmarl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from flexmarl.jobspec import JobSpec, parse_job_spec
from orchestratord.binding import (
    AgentDemand,
    AgentKey,
    DataParallelGroup,
    DecisionKind,
    RolloutDemandEstimator,
    SlotBinder,
)
from orchestratord.leases import Lease, LeaseKind, LeaseStatus, LeaseTable
from orchestratord.state import (
    AgentVersionRecord,
    JobCreated,
    JobState,
    JobStateChanged,
    ManifestFixed,
    PersistedJob,
    StateChange,
    StateMoved,
    StepCommit,
    StepCommitted,
    StepManifest,
)

logger = logging.getLogger(__name__)

JOB_ID_MAX_LENGTH = 64
DURABLE_STATE_SCHEMES = ("file://", "stored://")


# ---- public dataclasses ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExperienceSummary:
    """One experience as reported by rolloutd (arrays stay in stored)."""

    experience_id: str
    agent: str
    group_id: str
    sample_index: int
    behavior_version: int
    response_tokens: int
    reward: float = 0.0

    @property
    def task_id(self) -> str:
        """The task of the experience, derived from its group id ("<task_id>/<agent>")."""
        return self.group_id.rsplit("/", 1)[0]


@dataclasses.dataclass(frozen=True)
class AgentVersion:
    """A committed policy version of one agent."""

    job_id: str
    agent: str
    version: int
    weights_uri: str


@dataclasses.dataclass(frozen=True)
class RolloutTaskLease:
    """A rollout task leased to a worker: one environment task x ``group_size`` episodes."""

    lease_id: str
    job_id: str
    task_id: str
    task_index: int
    batch_index: int
    group_size: int
    # Minimum version of each agent to generate with.
    agent_versions: tuple[AgentVersion, ...]
    deadline_s: float
    attempt: int


@dataclasses.dataclass(frozen=True)
class RenewResult:
    """Outcome of a renewal: leases no longer held, and the earliest new deadline."""

    lost_lease_ids: tuple[str, ...]
    deadline_s: float


@dataclasses.dataclass(frozen=True)
class ResidentAgent:
    """An agent whose training state a slot holds now."""

    job_id: str
    agent: str
    version: int


@dataclasses.dataclass(frozen=True)
class MicroBatchWork:
    """Accumulate the gradients of these complete groups into the slot (no optimizer step).

    A ``step_id`` different from the one the slot is accumulating means a new
    attempt: drop the accumulated gradients and, when the slot's version of the
    agent is not ``base_version``, load the state at ``state_uri`` first
    (``""`` with base version 0 = the initial model of the spec).
    """

    lease_id: str
    job_id: str
    agent: str
    step: int
    step_id: str
    micro_batch_index: int
    experience_ids: tuple[str, ...]
    base_version: int
    state_uri: str
    # Normaliser fixed before backward: episodes of the whole step.
    step_episodes: int
    deadline_s: float
    # The attempt's data-parallel group and this slot's rank in it (None = one slot).
    group: DataParallelGroup | None = None
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerStepWork:
    """Every micro-batch of the step is accumulated: scale, step, publish, then CommitStep."""

    job_id: str
    agent: str
    step: int
    step_id: str
    new_version: int
    step_response_tokens: int
    step_episodes: int
    num_micro_batches: int
    # Data parallelism: every member gets the step; only rank 0 publishes and commits. A member
    # that accumulated nothing builds the engine from base_version / state_uri first.
    group: DataParallelGroup | None = None
    rank: int = 0
    base_version: int = 0
    state_uri: str = ""


@dataclasses.dataclass(frozen=True)
class SwapOutWork:
    """Save the agent's training state to ``location`` and report it (ReportSlotEvent SWAPPED_OUT)."""

    job_id: str
    agent: str
    location: str


TrainerWork = MicroBatchWork | OptimizerStepWork | SwapOutWork


class SlotEventKind(enum.Enum):
    """What a slot reports outside of acks and commits."""

    SWAPPED_OUT = 1
    FAILED = 2


@dataclasses.dataclass(frozen=True)
class AgentProgress:
    """Progress of one agent (for JobStatus)."""

    agent: str
    version: int
    total_steps: int
    weights_uri: str
    state_uri: str
    slot_id: str
    reward_mean: float
    staleness_mean: float
    step_seconds: float
    # Every bound slot in data-parallel rank order (slot_ids[0] == slot_id).
    slot_ids: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """A job's status at one instant."""

    job_id: str
    name: str
    state: JobState
    error: str
    created_s: float
    updated_s: float
    spec_json: str
    agents: tuple[AgentProgress, ...]
    tasks_done: int
    tasks_total: int


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner that are not part of a job spec."""

    # Leases a task may get (expiries and failed reports count) before its job fails.
    max_task_attempts: int = 5
    # Attempts a step may get (trainer deaths and expiries) before its job fails.
    max_step_attempts: int = 5
    # Where SwapOutWork asks a slot to save a state that is not yet durable.
    swap_location: str = "stored"
    # A bound slot with no work in flight that has not polled for this long is dead.
    slot_silence_s: float = 120.0
    # Distinguishes lease ids across orchestrator restarts; random when empty.
    lease_epoch: str = ""
    # Binder knobs (see orchestratord.binding).
    aging_per_s: float = 0.05
    affinity_bonus: float = 1.0
    max_wait_s: float = 60.0
    # Data parallelism (see orchestratord.binding): micro-batches a member must be worth,
    # how recently a free slot must have polled to be recruited, and the collective timeout.
    dp_min_micro_batches_per_member: int = 2
    dp_recruit_fresh_s: float = 10.0
    dp_timeout_s: int = 60


# ---- ids -----------------------------------------------------------------------------------------------


def validate_job_id(job_id: str) -> None:
    """Job ids name etcd keys and prefix task ids: letters, digits, '_', '.', '-'; no '/'."""
    if not job_id or len(job_id) > JOB_ID_MAX_LENGTH or not all(ch.isalnum() or ch in "_.-" for ch in job_id) \
            or not job_id[0].isalnum() or not job_id.isascii():
        raise InvalidArgument(f"job_id: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,63}}, got {job_id!r}")


def task_id_of(job_id: str, batch_index: int, position: int) -> str:
    """Deterministic task id: ``<job>/b<t>/t<i>``."""
    return f"{job_id}/b{batch_index}/t{position}"


def task_index_of(batch_index: int, position: int, prompts_per_step: int) -> int:
    """Position of a task in the environment's task stream (seeded by ``spec.seed``).

    Task i of batch t is element ``t * prompts_per_step + i`` of the stream the
    environment derives from the job seed, so the same (seed, t, i) always
    yields the same task and consecutive batches never repeat a task.
    """
    return batch_index * prompts_per_step + position


def step_id_of(job_id: str, agent: str, step: int, attempt: int, epoch: str = "") -> str:
    """Id of one attempt at one step: ``<job>/<agent>/s<t>[/e<epoch>]/a<k>``.

    ``epoch`` names the orchestrator process: after a restart, the restored planner has forgotten
    which micro-batches a slot already accumulated and issues them all again, so its step ids
    must differ from the dead process's, or the slot would add a micro-batch's gradient twice.
    """
    return f"{job_id}/{agent}/s{step}/e{epoch}/a{attempt}" if epoch else f"{job_id}/{agent}/s{step}/a{attempt}"


def manifest_id_of(job_id: str, agent: str, step: int) -> str:
    """Id of a step independent of attempts (what stored marks experiences with)."""
    return f"{job_id}/{agent}/s{step}"


def is_durable_state(uri: str) -> bool:
    """Whether a state URI is reachable from any node (file:// on shared disk, stored://)."""
    return uri.startswith(DURABLE_STATE_SCHEMES)


# ---- internal state ---------------------------------------------------------------------------------


class _TaskStatus(enum.Enum):
    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"


@dataclasses.dataclass
class _Task:
    task_id: str
    batch: int
    position: int
    task_index: int
    status: _TaskStatus = _TaskStatus.PENDING
    attempts: int = 0
    lease_id: str = ""


@dataclasses.dataclass(frozen=True)
class _Group:
    """An agent's experiences of one task: the unit micro-batches are made of."""

    agent: str
    group_id: str
    task_id: str
    position: int
    experience_ids: tuple[str, ...]
    episodes: int
    response_tokens: int
    reward_sum: float
    min_behavior_version: int
    max_behavior_version: int


class _MicroBatchStatus(enum.Enum):
    READY = "ready"
    LEASED = "leased"
    ACKED = "acked"


@dataclasses.dataclass
class _MicroBatch:
    index: int
    groups: tuple[_Group, ...]
    status: _MicroBatchStatus = _MicroBatchStatus.READY
    lease_id: str = ""
    slot_id: str = ""

    @property
    def experience_ids(self) -> tuple[str, ...]:
        return tuple(eid for group in self.groups for eid in group.experience_ids)

    @property
    def episodes(self) -> int:
        return sum(group.episodes for group in self.groups)

    @property
    def response_tokens(self) -> int:
        return sum(group.response_tokens for group in self.groups)


@dataclasses.dataclass
class _StepPlan:
    agent: str
    step: int
    groups: list[_Group] = dataclasses.field(default_factory=list)
    unformed: list[_Group] = dataclasses.field(default_factory=list)
    micro_batches: list[_MicroBatch] = dataclasses.field(default_factory=list)
    manifest: StepManifest | None = None
    attempt: int = 0
    # Primary slot of the attempt (the one that commits); "" before the attempt started.
    slot_id: str = ""
    optimizer_deadline_s: float | None = None
    # The attempt's group, fixed when its first work is issued (None = not started).
    group: DataParallelGroup | None = None
    # Members that were given the optimizer step of this attempt.
    optimizer_issued: set[str] = dataclasses.field(default_factory=set)

    @property
    def members(self) -> tuple[str, ...]:
        if self.group is not None:
            return self.group.members
        return (self.slot_id,) if self.slot_id else ()

    @property
    def mid_step(self) -> bool:
        return self.optimizer_deadline_s is not None or any(
            mb.status is not _MicroBatchStatus.READY for mb in self.micro_batches)

    @property
    def ready_for_optimizer(self) -> bool:
        return (self.manifest is not None and not self.unformed and bool(self.micro_batches)
                and all(mb.status is _MicroBatchStatus.ACKED for mb in self.micro_batches))


@dataclasses.dataclass
class _AgentState:
    name: str
    version: int
    weights_uri: str
    state_uri: str
    # Worker whose memory alone holds the committed state (non-durable state_uri), else "".
    state_worker_id: str = ""
    reward_mean: float = 0.0
    staleness_mean: float = 0.0
    step_seconds: float = 0.0


# ---- one job ----------------------------------------------------------------------------------------------


class JobPlanner:
    """The whole plan of one job. Create with :meth:`create` or :meth:`restore`."""

    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        now_s: Callable[[], float],
        options: PlannerOptions,
        *,
        created_s: float,
        agents: Mapping[str, AgentVersionRecord],
        manifests: Mapping[tuple[str, int], StepManifest] | None = None,
        commits: Mapping[tuple[str, int], StepCommit] | None = None,
        state: JobState = JobState.RUNNING,
        error: str = "",
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.spec_json = spec.to_json()
        self._now_s = now_s
        self._options = options
        self._created_s = created_s
        self._updated_s = created_s
        self._state = state
        self._error = error
        self._changes: list[StateChange] = []
        epoch = options.lease_epoch or secrets.token_hex(3)
        self._epoch = epoch
        self._leases = LeaseTable(now_s, f"{job_id}/{epoch}-")
        self._agents: dict[str, _AgentState] = {}
        for name in spec.agent_names:
            record = agents.get(name, AgentVersionRecord())
            self._agents[name] = _AgentState(name, record.version, record.weights_uri, record.state_uri)
        self._persisted_manifests: dict[tuple[str, int], StepManifest] = dict(manifests or {})
        self._commits: dict[tuple[str, int], StepCommit] = dict(commits or {})
        self._tasks: dict[str, _Task] = {}
        self._retry: set[str] = set()
        self._done_per_batch: dict[int, int] = defaultdict(int)
        self._plans: dict[tuple[str, int], _StepPlan] = {}
        # Tasks admitted so far (N of the admission rule counts every admitted task's episodes).
        self._admitted = self._min_version() * spec.batch.prompts_per_step
        self._tasks_done_total = self._admitted
        self.rollout_demand_estimator = RolloutDemandEstimator()
        for agent in spec.agents:
            self.rollout_demand_estimator.set_prior((job_id, agent.name), float(agent.sampling.max_new_tokens))
        if not state.terminal and self._min_version() >= spec.total_steps:
            self._set_state(JobState.SUCCEEDED, "")

    @classmethod
    def create(cls, job_id: str, spec: JobSpec, now_s: Callable[[], float],
               options: PlannerOptions | None = None) -> JobPlanner:
        """A new job at version 0 of every agent; emits JobCreated."""
        validate_job_id(job_id)
        created_s = now_s()
        planner = cls(job_id, spec, now_s, options or PlannerOptions(), created_s=created_s, agents={})
        planner._changes.append(JobCreated(job_id, planner.spec_json, spec.agent_names, created_s))
        return planner

    @classmethod
    def restore(cls, persisted: PersistedJob, now_s: Callable[[], float],
                options: PlannerOptions | None = None) -> JobPlanner:
        """Rebuilds a job from durable state after an orchestrator restart.

        Leases that were in flight are forgotten (their tasks and micro-batches
        are issued again); call :meth:`recover` with the experiences stored
        already reported so that finished rollouts are not redone.
        """
        spec = parse_job_spec(json.loads(persisted.spec_json))  # JSON text, never read as a path
        planner = cls(persisted.job_id, spec, now_s, options or PlannerOptions(),
                      created_s=persisted.created_s, agents=persisted.agents, manifests=persisted.manifests,
                      commits=persisted.commits, state=persisted.state, error=persisted.error)
        planner._updated_s = persisted.updated_s
        return planner

    # ---- status ------------------------------------------------------------------------------------------

    @property
    def state(self) -> JobState:
        """The job's state."""
        return self._state

    @property
    def error(self) -> str:
        """Why the job failed ("" otherwise)."""
        return self._error

    def take_changes(self) -> list[StateChange]:
        """Durable changes since the last call, in order (apply them before answering)."""
        changes, self._changes = self._changes, []
        return changes

    def versions(self) -> list[AgentVersion]:
        """Committed version of every agent, in spec order."""
        return [AgentVersion(self.job_id, a.name, a.version, a.weights_uri) for a in self._agents.values()]

    def version(self, agent: str) -> int:
        """Committed version of one agent."""
        return self._agent(agent).version

    def manifest(self, agent: str, step: int) -> StepManifest | None:
        """The fixed manifest of a step, or None when not fixed yet (or pruned after commit)."""
        plan = self._plans.get((agent, step))
        if plan is not None and plan.manifest is not None:
            return plan.manifest
        return self._persisted_manifests.get((agent, step))

    def snapshot(self, slot_of: Callable[[str], str] | None = None,
                 members_of: Callable[[str], tuple[str, ...]] | None = None) -> JobSnapshot:
        """The job's status now; ``slot_of(agent)`` names the bound slot, ``members_of`` all of them."""
        agents = tuple(
            AgentProgress(
                agent=a.name, version=a.version, total_steps=self.spec.total_steps,
                weights_uri=a.weights_uri, state_uri=a.state_uri,
                slot_id=slot_of(a.name) if slot_of is not None else "",
                reward_mean=a.reward_mean, staleness_mean=a.staleness_mean, step_seconds=a.step_seconds,
                slot_ids=members_of(a.name) if members_of is not None else (),
            )
            for a in self._agents.values()
        )
        return JobSnapshot(
            job_id=self.job_id, name=self.spec.name, state=self._state, error=self._error,
            created_s=self._created_s, updated_s=self._updated_s, spec_json=self.spec_json, agents=agents,
            tasks_done=self._tasks_done_total,
            tasks_total=self.spec.total_steps * self.spec.batch.prompts_per_step,
        )

    def cancel(self) -> None:
        """Cancels the job (no-op once it ended)."""
        if not self._state.terminal:
            self._set_state(JobState.CANCELLED, "cancelled")

    def fail(self, error: str) -> None:
        """Fails the job (no-op once it ended)."""
        if not self._state.terminal:
            logger.error("job %s failed: %s", self.job_id, error)
            self._set_state(JobState.FAILED, error)

    def _set_state(self, state: JobState, error: str) -> None:
        self._state = state
        self._error = error
        self._updated_s = self._now_s()
        self._changes.append(JobStateChanged(self.job_id, state, error, self._updated_s))
        if state.terminal:
            for lease in self._leases.active():
                self._leases.end(lease, LeaseStatus.REVOKED, f"job {state.name.lower()}")

    def _require_running(self) -> None:
        if self._state.terminal:
            raise FailedPrecondition(f"job {self.job_id!r} is {self._state.name.lower()}")

    def _agent(self, agent: str) -> _AgentState:
        state = self._agents.get(agent)
        if state is None:
            raise NotFound(f"job {self.job_id!r} has no agent {agent!r}")
        return state

    def _min_version(self) -> int:
        return min(a.version for a in self._agents.values())

    # ---- time ---------------------------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Expires overdue leases and optimizer steps; returns slots whose work expired (treat as dead)."""
        dead_slots: list[str] = []
        if self._state.terminal:
            return dead_slots
        for lease in self._leases.due():
            self._leases.end(lease, LeaseStatus.EXPIRED, "deadline passed")
            if lease.kind is LeaseKind.ROLLOUT_TASK:
                self._requeue_task(lease.subject, "lease expired")
            else:
                plan = self._plan_of_lease(lease)
                if plan is not None:
                    mb = plan.micro_batches[int(lease.subject.rsplit("/", 1)[1])]
                    dead = mb.slot_id or plan.slot_id
                    dead_slots.append(dead)
                    self._replay(plan, f"micro-batch lease {lease.lease_id} expired on slot {dead}")
        now_s = self._now_s()
        for plan in list(self._plans.values()):
            if plan.optimizer_deadline_s is not None and now_s > plan.optimizer_deadline_s:
                dead_slots.append(plan.slot_id)
                self._replay(plan, f"optimizer step not committed in time on slot {plan.slot_id}")
        return dead_slots

    # ---- rollout side ---------------------------------------------------------------------------------

    def admission_limit(self) -> int:
        """Tasks that may have been admitted by now: (eta + v + 1) x prompts_per_step (AReaL's rule).

        The rule counts samples (N < (eta + v + 1) * B with B episodes per step);
        every task holds ``group_size`` episodes, so counting tasks against
        ``prompts_per_step`` is the same bound. Sync mode is the barrier: eta = 0.
        """
        eta = 0 if self.spec.pipeline.barrier else self.spec.pipeline.max_staleness
        prompts = self.spec.batch.prompts_per_step
        return min((eta + self._min_version() + 1) * prompts, self.spec.total_steps * prompts)

    @property
    def admitted_tasks(self) -> int:
        """Tasks admitted so far (N of the admission rule, in tasks)."""
        return self._admitted

    def lease_tasks(self, worker_id: str, max_tasks: int) -> list[RolloutTaskLease]:
        """Leases up to ``max_tasks`` tasks: re-issues first, then newly admitted ones."""
        if self._state.terminal or max_tasks <= 0:
            return []
        leased: list[RolloutTaskLease] = []
        for task_id in sorted(self._retry, key=lambda tid: (self._tasks[tid].batch, self._tasks[tid].position)):
            if len(leased) >= max_tasks:
                break
            leased.append(self._lease_task(self._tasks[task_id], worker_id))
        prompts = self.spec.batch.prompts_per_step
        while len(leased) < max_tasks and self._admitted < self.admission_limit():
            batch, position = divmod(self._admitted, prompts)
            self._admitted += 1
            task_id = task_id_of(self.job_id, batch, position)
            task = self._tasks.get(task_id)
            if task is None:
                task = _Task(task_id, batch, position, task_index_of(batch, position, prompts))
                self._tasks[task_id] = task
            if task.status is _TaskStatus.PENDING:
                leased.append(self._lease_task(task, worker_id))
        return leased

    def _lease_task(self, task: _Task, worker_id: str) -> RolloutTaskLease:
        self._retry.discard(task.task_id)
        task.attempts += 1
        lease = self._leases.issue(LeaseKind.ROLLOUT_TASK, worker_id, task.task_id,
                                   self.spec.leases.rollout_timeout_s)
        task.status = _TaskStatus.LEASED
        task.lease_id = lease.lease_id
        return RolloutTaskLease(
            lease_id=lease.lease_id, job_id=self.job_id, task_id=task.task_id, task_index=task.task_index,
            batch_index=task.batch, group_size=self.spec.batch.group_size,
            agent_versions=tuple(self.versions()), deadline_s=lease.deadline_s, attempt=task.attempts,
        )

    def _requeue_task(self, task_id: str, reason: str) -> None:
        task = self._tasks.get(task_id)
        if task is None or task.status is not _TaskStatus.LEASED:
            return
        task.status = _TaskStatus.PENDING
        task.lease_id = ""
        if task.attempts >= self._options.max_task_attempts:
            self.fail(f"task {task_id} failed {task.attempts} times (last: {reason})")
            return
        logger.info("re-issuing task %s after attempt %d: %s", task_id, task.attempts, reason)
        self._retry.add(task_id)

    def renew(self, worker_id: str, lease_ids: Sequence[str]) -> RenewResult:
        """Extends the leases ``worker_id`` still holds; the others are reported lost."""
        lost: list[str] = []
        deadlines: list[float] = []
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.status is not LeaseStatus.ACTIVE or lease.holder != worker_id \
                    or self._now_s() > lease.deadline_s:
                lost.append(lease_id)
                continue
            deadlines.append(self._leases.renew(lease))
        return RenewResult(tuple(lost), min(deadlines) if deadlines else self._now_s())

    def revoke_worker(self, worker_id: str) -> None:
        """A rollout worker died: its task leases end now and the tasks are re-issued."""
        for lease in self._leases.held_by(worker_id):
            if lease.kind is LeaseKind.ROLLOUT_TASK:
                self._leases.end(lease, LeaseStatus.REVOKED, f"worker {worker_id} gone")
                self._requeue_task(lease.subject, f"worker {worker_id} gone")
        for agent in self._agents.values():
            if agent.state_worker_id == worker_id:
                self.fail(f"training state of agent {agent.name!r} at version {agent.version} was only in the "
                          f"memory of worker {worker_id}, which is gone ({agent.state_uri})")

    def report_task(self, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                    experiences: Sequence[ExperienceSummary]) -> None:
        """A rollout worker finished a task (experiences durable in stored) or failed it.

        Raises:
            NotFound: unknown lease.
            FailedPrecondition: the lease expired or is not the caller's; or the
                experiences break the staleness bound (the task is re-issued).
            InvalidArgument: the report is malformed (the task is re-issued).
        """
        self._require_running()
        lease = self._leases.require_active(lease_id, worker_id, LeaseKind.ROLLOUT_TASK)
        if lease.subject != task_id:
            raise InvalidArgument(f"lease {lease_id!r} is for task {lease.subject!r}, not {task_id!r}")
        task = self._tasks[task_id]
        if not succeeded:
            self._leases.end(lease, LeaseStatus.RELEASED, "failed")
            self._requeue_task(task_id, f"worker reported failure: {error}")
            return
        try:
            groups = self._groups_of(task, experiences, check_staleness=True)
        except (InvalidArgument, FailedPrecondition) as rejection:
            self._leases.end(lease, LeaseStatus.RELEASED, "rejected")
            self._requeue_task(task_id, str(rejection))
            raise
        self._leases.end(lease, LeaseStatus.RELEASED, "reported")
        self._complete_task(task, groups)

    def _groups_of(self, task: _Task, experiences: Sequence[ExperienceSummary],
                   check_staleness: bool) -> dict[str, _Group]:
        """Validates a task's experiences; returns one group per agent that still trains on batch ``task.batch``."""
        group_size = self.spec.batch.group_size
        eta = self.spec.pipeline.max_staleness
        prefix = task.task_id + "/"
        by_agent: dict[str, list[ExperienceSummary]] = defaultdict(list)
        seen: set[str] = set()
        for exp in experiences:
            where = f"task {task.task_id}: experience {exp.experience_id!r}"
            if exp.agent not in self._agents:
                raise InvalidArgument(f"{where}: unknown agent {exp.agent!r}")
            if exp.experience_id in seen:
                raise InvalidArgument(f"{where}: reported twice")
            if not exp.experience_id.startswith(prefix):
                raise InvalidArgument(f"{where}: id must start with {prefix!r}")
            if exp.group_id != f"{task.task_id}/{exp.agent}":
                raise InvalidArgument(f"{where}: group_id must be {task.task_id + '/' + exp.agent!r}, "
                                      f"got {exp.group_id!r}")
            if not 0 <= exp.sample_index < group_size:
                raise InvalidArgument(f"{where}: sample_index must be in [0, {group_size}), got {exp.sample_index}")
            if exp.behavior_version < 0 or exp.response_tokens < 0:
                raise InvalidArgument(f"{where}: negative behavior_version or response_tokens")
            seen.add(exp.experience_id)
            by_agent[exp.agent].append(exp)
        groups: dict[str, _Group] = {}
        for agent in self._agents.values():
            members = by_agent.get(agent.name, [])
            missing = sorted(set(range(group_size)) - {exp.sample_index for exp in members})
            if missing:
                raise InvalidArgument(f"task {task.task_id}: agent {agent.name!r} has no experience for "
                                      f"episodes {missing} (every episode involves every agent)")
            if agent.version > task.batch:
                continue  # this agent already committed step task.batch (after a restore)
            for exp in members:
                if exp.behavior_version > agent.version:
                    raise FailedPrecondition(
                        f"task {task.task_id}: experience {exp.experience_id!r} claims version "
                        f"{exp.behavior_version} of agent {agent.name!r}, which is at version {agent.version}")
                if check_staleness and task.batch - exp.behavior_version > eta:
                    raise FailedPrecondition(
                        f"task {task.task_id}: experience {exp.experience_id!r} of version {exp.behavior_version} "
                        f"is too stale for step {task.batch} (max_staleness {eta})")
            groups[agent.name] = _Group(
                agent=agent.name, group_id=f"{task.task_id}/{agent.name}", task_id=task.task_id,
                position=task.position, experience_ids=tuple(sorted(exp.experience_id for exp in members)),
                episodes=group_size, response_tokens=sum(exp.response_tokens for exp in members),
                reward_sum=sum(exp.reward for exp in members),
                min_behavior_version=min(exp.behavior_version for exp in members),
                max_behavior_version=max(exp.behavior_version for exp in members),
            )
        return groups

    def _complete_task(self, task: _Task, groups: Mapping[str, _Group]) -> None:
        task.status = _TaskStatus.DONE
        task.lease_id = ""
        self._retry.discard(task.task_id)
        self._tasks_done_total += 1
        self._done_per_batch[task.batch] += 1
        complete = self._done_per_batch[task.batch] == self.spec.batch.prompts_per_step
        for name, group in groups.items():
            self.rollout_demand_estimator.observe((self.job_id, name), group.episodes, group.response_tokens)
            plan = self._plan(name, task.batch)
            plan.groups.append(group)
            plan.unformed.append(group)
        for agent in self._agents.values():
            if agent.version <= task.batch:
                plan = self._plan(agent.name, task.batch)
                if complete:
                    self._fix_manifest(plan)
                self._form_micro_batches(plan, complete)

    def _plan(self, agent: str, step: int) -> _StepPlan:
        plan = self._plans.get((agent, step))
        if plan is None:
            plan = _StepPlan(agent, step)
            self._plans[(agent, step)] = plan
        return plan

    def _fix_manifest(self, plan: _StepPlan) -> None:
        if plan.manifest is not None:
            return
        manifest = StepManifest(
            job_id=self.job_id, agent=plan.agent, step=plan.step,
            experience_ids=tuple(sorted(eid for group in plan.groups for eid in group.experience_ids)),
            step_episodes=sum(group.episodes for group in plan.groups),
            step_response_tokens=sum(group.response_tokens for group in plan.groups),
        )
        persisted = self._persisted_manifests.get((plan.agent, plan.step))
        if persisted is not None and persisted != manifest:
            self.fail(f"step {plan.step} of agent {plan.agent!r}: recovered experiences do not match the "
                      f"stored manifest")
            return
        plan.manifest = manifest
        if persisted is None:
            self._persisted_manifests[(plan.agent, plan.step)] = manifest
            self._changes.append(ManifestFixed(manifest))

    def _form_micro_batches(self, plan: _StepPlan, batch_complete: bool) -> None:
        """Complete groups -> micro-batches of ``micro_batch_size`` episodes.

        Async: as soon as enough groups arrived (arrival order); the remainder
        when the batch completes. Barrier modes (sync, sequential, static):
        only when the batch is complete, in task order.
        """
        per_micro_batch = self.spec.batch.groups_per_micro_batch
        if self.spec.pipeline.barrier:
            if not batch_complete:
                return
            plan.unformed.sort(key=lambda group: group.position)
        while len(plan.unformed) >= per_micro_batch or (batch_complete and plan.unformed):
            taken, plan.unformed = plan.unformed[:per_micro_batch], plan.unformed[per_micro_batch:]
            plan.micro_batches.append(_MicroBatch(len(plan.micro_batches), tuple(taken)))

    # ---- recovery -----------------------------------------------------------------------------------------

    def recover(self, reported: Iterable[ExperienceSummary]) -> int:
        """Marks done the tasks whose experiences stored already holds (after :meth:`restore`).

        ``reported`` = every experience of the job in stored. A task counts as
        done when it has a complete, valid group for every agent; anything
        partial is re-issued. Returns the number of tasks recovered.
        """
        if self._state.terminal:
            return 0
        by_task: dict[str, list[ExperienceSummary]] = defaultdict(list)
        for exp in reported:
            by_task[exp.task_id].append(exp)
        prompts = self.spec.batch.prompts_per_step
        min_version = self._min_version()
        recovered = 0
        for task_id in sorted(by_task):
            location = _parse_task_id(self.job_id, task_id)
            if location is None:
                continue
            batch, position = location
            if batch < min_version or batch >= self.spec.total_steps or position >= prompts:
                continue
            task = self._tasks.get(task_id)
            if task is None:
                task = _Task(task_id, batch, position, task_index_of(batch, position, prompts))
            if task.status is _TaskStatus.DONE:
                continue
            try:
                groups = self._groups_of(task, by_task[task_id], check_staleness=True)
            except (InvalidArgument, FailedPrecondition) as rejection:
                logger.info("not recovering task %s: %s", task_id, rejection)
                continue
            self._tasks[task_id] = task
            self._complete_task(task, groups)
            recovered += 1
        return recovered

    # ---- trainer side -------------------------------------------------------------------------------

    def current_plan(self, agent: str) -> _StepPlan | None:
        """The plan of the step the agent trains next (None when nothing arrived for it yet)."""
        version = self._agent(agent).version
        return self._plans.get((agent, version))

    def agent_may_train(self, agent: str, step: int) -> bool:
        """Whether step ``step`` of ``agent`` may be trained now.

        Always, except in ``sequential`` mode, where agent k's step t waits for
        agent k-1's commit of step t (see the module docstring).
        """
        if self.spec.pipeline.mode != "sequential":
            return True
        names = self.spec.agent_names
        index = names.index(agent)
        return index == 0 or self._agents[names[index - 1]].version > step

    def demand(self, agent: str) -> AgentDemand:
        """What the agent needs from the trainer pool now."""
        key = (self.job_id, agent)
        plan = self.current_plan(agent)
        if self._state.terminal or plan is None or not self.agent_may_train(agent, plan.step):
            return AgentDemand(key)
        ready = [mb for mb in plan.micro_batches if mb.status is _MicroBatchStatus.READY]
        taken = sum(1 for mb in plan.micro_batches if mb.status is not _MicroBatchStatus.READY)
        return self._with_parallelism(AgentDemand(
            key=key, ready_micro_batches=len(ready), ready_tokens=sum(mb.response_tokens for mb in ready),
            optimizer_pending=plan.ready_for_optimizer, mid_step=plan.mid_step,
        ), max(0, self._expected_micro_batches(plan) - taken))

    def data_parallel_demand(self, agent: str) -> AgentDemand:
        """:meth:`demand`, also for an agent between steps (no plan yet): what the binder sizes groups with."""
        demand = self.demand(agent)
        if demand.has_work or demand.mid_step or self._state.terminal:
            return demand
        plan = self.current_plan(agent)
        version = self._agent(agent).version
        upcoming = 0
        if version < self.spec.total_steps and self.agent_may_train(agent, version):
            upcoming = self._expected_micro_batches(plan)
        return self._with_parallelism(demand, upcoming)

    def _expected_micro_batches(self, plan: _StepPlan | None) -> int:
        """Micro-batches a step will have: its formed ones plus those its missing groups will form."""
        per = self.spec.batch.groups_per_micro_batch
        formed = len(plan.micro_batches) if plan is not None else 0
        pending_groups = self.spec.batch.prompts_per_step - (
            sum(len(mb.groups) for mb in plan.micro_batches) if plan is not None else 0)
        return formed + -(-max(0, pending_groups) // per)

    def _with_parallelism(self, demand: AgentDemand, upcoming: int) -> AgentDemand:
        spec = self.spec.agent(demand.key[1])
        return dataclasses.replace(
            demand, max_slots=spec.max_slots, data_parallel=spec.max_slots > 1 and spec.zero_stage == 0,
            upcoming_micro_batches=upcoming, portable=self.state_is_portable(demand.key[1]))

    def slot_busy(self, slot_id: str) -> bool:
        """Whether some step has work in flight on the slot (a leased micro-batch or an optimizer step)."""
        return any((plan.optimizer_deadline_s is not None and slot_id in plan.members) or any(
            mb.status is _MicroBatchStatus.LEASED and mb.slot_id == slot_id for mb in plan.micro_batches)
            for plan in self._plans.values())

    def state_is_portable(self, agent: str) -> bool:
        """Whether another slot could load the agent's committed state without a swap-out first."""
        state = self._agent(agent)
        return is_durable_state(state.state_uri) or (state.version == 0 and not state.state_uri)

    def next_trainer_work(self, agent: str, slot_id: str, worker_id: str,
                          group: DataParallelGroup | None = None) -> MicroBatchWork | OptimizerStepWork | None:
        """Work for a slot bound to ``agent``: its micro-batch in flight again, a new one, or the optimizer step.

        ``group`` = the agent's slots now (None or one member = this slot alone). An
        attempt's group is fixed when its first work is issued; each member holds at
        most one micro-batch at a time, and every member gets the optimizer step.
        """
        if self._state.terminal:
            return None
        plan = self.current_plan(agent)
        if plan is None or not self.agent_may_train(agent, plan.step):
            return None
        members = plan.members
        if members and slot_id not in members:
            return None
        if not members and group is not None and slot_id not in group.members:
            return None
        for mb in plan.micro_batches:
            if mb.status is _MicroBatchStatus.LEASED and mb.slot_id == slot_id:
                lease = self._leases.get(mb.lease_id)
                if lease is not None and lease.holder == worker_id:
                    return self._micro_batch_work(plan, mb, lease)  # lost response: deliver again
                return None
        if plan.group is None and (group is None or group.world_size == 1) and any(
                mb.status is _MicroBatchStatus.LEASED for mb in plan.micro_batches):
            return None  # one slot: one micro-batch at a time
        for mb in plan.micro_batches:
            if mb.status is _MicroBatchStatus.READY:
                self._start_attempt(plan, slot_id, group)
                return self._lease_micro_batch(plan, mb, slot_id, worker_id)
        if plan.ready_for_optimizer and plan.manifest is not None:
            self._start_attempt(plan, slot_id, group)
            rank = plan.group.rank_of(slot_id) if plan.group is not None else 0
            if rank > 0 and slot_id in plan.optimizer_issued:
                return None  # a member waits for rank 0's commit
            plan.optimizer_issued.add(slot_id)
            if plan.optimizer_deadline_s is None:
                plan.optimizer_deadline_s = self._now_s() + self.spec.leases.train_timeout_s
            state = self._agents[agent]
            return OptimizerStepWork(
                job_id=self.job_id, agent=agent, step=plan.step,
                step_id=step_id_of(self.job_id, agent, plan.step, plan.attempt, self._epoch), new_version=plan.step + 1,
                step_response_tokens=plan.manifest.step_response_tokens,
                step_episodes=plan.manifest.step_episodes, num_micro_batches=len(plan.micro_batches),
                group=plan.group, rank=rank, base_version=state.version, state_uri=state.state_uri,
            )
        return None

    @staticmethod
    def _start_attempt(plan: _StepPlan, slot_id: str, group: DataParallelGroup | None) -> None:
        """Fixes the attempt's slots on its first work: the agent's group, or this slot alone."""
        if plan.slot_id:
            return
        if group is not None and group.world_size > 1 and slot_id in group.members:
            plan.group = group
            plan.slot_id = group.primary
        else:
            plan.group = None
            plan.slot_id = slot_id

    def _lease_micro_batch(self, plan: _StepPlan, mb: _MicroBatch, slot_id: str,
                           worker_id: str) -> MicroBatchWork | None:
        eta = self.spec.pipeline.max_staleness
        for group in mb.groups:
            # Defence in depth: report validation already enforces this.
            if plan.step - group.min_behavior_version > eta or group.max_behavior_version > plan.step:
                self.fail(f"staleness bound broken: group {group.group_id} (versions "
                          f"{group.min_behavior_version}..{group.max_behavior_version}) in step {plan.step}")
                return None
        subject = f"{plan.agent}/{plan.step}/{plan.attempt}/{mb.index}"
        lease = self._leases.issue(LeaseKind.MICRO_BATCH, worker_id, subject, self.spec.leases.train_timeout_s)
        mb.status = _MicroBatchStatus.LEASED
        mb.lease_id = lease.lease_id
        mb.slot_id = slot_id
        return self._micro_batch_work(plan, mb, lease)

    def _micro_batch_work(self, plan: _StepPlan, mb: _MicroBatch, lease: Lease) -> MicroBatchWork:
        agent = self._agents[plan.agent]
        return MicroBatchWork(
            lease_id=lease.lease_id, job_id=self.job_id, agent=plan.agent, step=plan.step,
            step_id=step_id_of(self.job_id, plan.agent, plan.step, plan.attempt, self._epoch),
            micro_batch_index=mb.index,
            experience_ids=mb.experience_ids, base_version=agent.version, state_uri=agent.state_uri,
            step_episodes=self.spec.batch.episodes_per_step, deadline_s=lease.deadline_s,
            group=plan.group, rank=plan.group.rank_of(mb.slot_id) if plan.group is not None else 0,
        )

    def _plan_of_lease(self, lease: Lease) -> _StepPlan | None:
        agent, step, attempt, _index = lease.subject.rsplit("/", 3)
        plan = self._plans.get((agent, int(step)))
        if plan is None or plan.attempt != int(attempt):
            return None
        return plan

    def ack_micro_batch(self, lease_id: str, worker_id: str, slot_id: str, episodes: int) -> None:
        """A micro-batch's gradients are accumulated in the slot.

        Raises:
            NotFound: unknown lease.
            FailedPrecondition: the lease expired, was revoked (its step is being
                replayed) or belongs to another worker or slot.
            InvalidArgument: ``episodes`` (when non-zero) differs from the micro-batch's.
        """
        self._require_running()
        existing = self._leases.get(lease_id)
        if existing is not None and existing.kind is LeaseKind.MICRO_BATCH \
                and existing.status is LeaseStatus.RELEASED and existing.holder == worker_id:
            plan = self._plan_of_lease(existing)
            if plan is not None and plan.micro_batches[int(existing.subject.rsplit("/", 1)[1])].slot_id == slot_id:
                return  # a repeated ack of the same attempt
        lease = self._leases.require_active(lease_id, worker_id, LeaseKind.MICRO_BATCH)
        plan = self._plan_of_lease(lease)
        mb = plan.micro_batches[int(lease.subject.rsplit("/", 1)[1])] if plan is not None else None
        if plan is None or mb is None or mb.slot_id != slot_id:
            raise FailedPrecondition(f"lease {lease_id!r} does not belong to slot {slot_id!r}")
        if episodes and episodes != mb.episodes:
            raise InvalidArgument(f"lease {lease_id!r}: micro-batch has {mb.episodes} episodes, ack says {episodes}")
        self._leases.end(lease, LeaseStatus.RELEASED, "acked")
        mb.status = _MicroBatchStatus.ACKED

    def commit_step(self, worker_id: str, slot_id: str, agent: str, step: int, new_version: int,
                    weights_uri: str, state_uri: str, loss: float = 0.0, grad_norm: float = 0.0,
                    step_seconds: float = 0.0) -> None:
        """The optimizer step of ``step`` ran on the slot and version ``new_version`` is published.

        Raises:
            FailedPrecondition: no optimizer step of this step was issued to this
                slot (e.g. the attempt was replayed elsewhere) or the step committed
                differently already.
            InvalidArgument: ``new_version`` is not ``step + 1``.
        """
        self._require_running()
        state = self._agent(agent)
        if new_version != step + 1:
            raise InvalidArgument(f"new_version must be step + 1 = {step + 1}, got {new_version}")
        if step < state.version:
            previous = self._commits.get((agent, step))
            if previous is not None and previous.slot_id == slot_id and previous.weights_uri == weights_uri:
                return  # the same commit again
            raise FailedPrecondition(f"step {step} of agent {agent!r} is already committed")
        plan = self._plans.get((agent, step))
        if step > state.version or plan is None or plan.optimizer_deadline_s is None or plan.slot_id != slot_id:
            raise FailedPrecondition(f"no optimizer step {step} of agent {agent!r} was issued to slot {slot_id!r}")
        if not weights_uri:
            raise InvalidArgument("weights_uri: must not be empty")
        commit = StepCommit(job_id=self.job_id, agent=agent, step=step, weights_uri=weights_uri,
                            state_uri=state_uri, slot_id=slot_id, committed_s=self._now_s(), loss=loss,
                            grad_norm=grad_norm, step_seconds=step_seconds)
        self._commits[(agent, step)] = commit
        self._changes.append(StepCommitted(commit))
        episodes = sum(group.episodes for group in plan.groups) or 1
        experiences = sum(len(group.experience_ids) for group in plan.groups) or 1
        state.version = new_version
        state.weights_uri = weights_uri
        state.state_uri = state_uri
        state.state_worker_id = "" if is_durable_state(state_uri) else worker_id
        state.reward_mean = sum(group.reward_sum for group in plan.groups) / experiences
        state.staleness_mean = sum((step - group.min_behavior_version) * group.episodes
                                   for group in plan.groups) / episodes
        state.step_seconds = step_seconds
        self._updated_s = commit.committed_s
        del self._plans[(agent, step)]
        self._prune_batch(step)
        if self._min_version() >= self.spec.total_steps:
            self._set_state(JobState.SUCCEEDED, "")

    def _prune_batch(self, batch: int) -> None:
        """Forgets a rollout batch once every agent committed its step."""
        if self._min_version() <= batch:
            return
        for task_id in [tid for tid, task in self._tasks.items() if task.batch == batch]:
            del self._tasks[task_id]
        self._leases.forget(lease.lease_id for lease in self._leases.all() if self._batch_of_lease(lease) == batch)
        self._done_per_batch.pop(batch, None)

    @staticmethod
    def _batch_of_lease(lease: Lease) -> int:
        if lease.kind is LeaseKind.ROLLOUT_TASK:
            return int(lease.subject.rsplit("/", 2)[1][1:])
        return int(lease.subject.rsplit("/", 3)[1])

    def slot_lost(self, slot_id: str, reason: str) -> None:
        """A trainer slot died or failed: steps with work on it restart from the last committed version."""
        for plan in list(self._plans.values()):
            if slot_id not in plan.members:
                continue
            if plan.mid_step:
                self._replay(plan, reason)
            else:
                plan.slot_id = ""
                plan.group = None

    def _replay(self, plan: _StepPlan, reason: str) -> None:
        """Starts a new attempt of a step: every micro-batch again, same manifest, from the committed version."""
        for mb in plan.micro_batches:
            lease = self._leases.get(mb.lease_id) if mb.lease_id else None
            if lease is not None:
                self._leases.end(lease, LeaseStatus.REVOKED, f"step replayed: {reason}")
            mb.status = _MicroBatchStatus.READY
            mb.lease_id = ""
            mb.slot_id = ""
        plan.attempt += 1
        plan.slot_id = ""
        plan.group = None
        plan.optimizer_issued = set()
        plan.optimizer_deadline_s = None
        logger.warning("job %s: replaying step %d of agent %s (attempt %d): %s",
                       self.job_id, plan.step, plan.agent, plan.attempt, reason)
        if plan.attempt >= self._options.max_step_attempts:
            self.fail(f"step {plan.step} of agent {plan.agent!r} failed {plan.attempt} times (last: {reason})")

    def release_slot(self, agent: str) -> None:
        """The agent leaves its slot between steps (binding change)."""
        plan = self.current_plan(agent)
        if plan is not None and not plan.mid_step:
            plan.slot_id = ""
            plan.group = None

    def record_swap_out(self, agent: str, state_uri: str) -> None:
        """A slot saved the agent's committed state at ``state_uri``."""
        state = self._agent(agent)
        if not state_uri:
            raise InvalidArgument("state_uri: must not be empty for a swap-out")
        state.state_uri = state_uri
        state.state_worker_id = "" if is_durable_state(state_uri) else state.state_worker_id
        self._changes.append(StateMoved(self.job_id, agent, state.version, state_uri, self._now_s()))

    def has_leasable_tasks(self) -> bool:
        """Whether :meth:`lease_tasks` would hand out a task now (a re-issue or an admissible one)."""
        return not self._state.terminal and (bool(self._retry) or self._admitted < self.admission_limit())

    def rollout_demand(self) -> dict[str, int]:
        """Estimated tokens still to generate per agent (leased and admissible tasks)."""
        pending_tasks = len(self._leases.active(LeaseKind.ROLLOUT_TASK)) + len(self._retry)
        if not self._state.terminal:
            pending_tasks += max(0, self.admission_limit() - self._admitted)
        episodes = pending_tasks * self.spec.batch.group_size
        return {name: self.rollout_demand_estimator.estimate((self.job_id, name), episodes)
                for name in self._agents}


def _parse_task_id(job_id: str, task_id: str) -> tuple[int, int] | None:
    """``<job>/b<t>/t<i>`` -> (t, i), or None when it is not a task id of the job."""
    parts = task_id.split("/")
    if len(parts) != 3 or parts[0] != job_id or not parts[1].startswith("b") or not parts[2].startswith("t"):
        return None
    if not (parts[1][1:].isdigit() and parts[2][1:].isdigit()):
        return None
    return int(parts[1][1:]), int(parts[2][1:])


# ---- every job, and the trainer pool --------------------------------------------------------------


class Planner:
    """Every job of the orchestrator plus the shared trainer-slot binder: what the servicer calls."""

    def __init__(self, now_s: Callable[[], float], options: PlannerOptions | None = None) -> None:
        self._now_s = now_s
        self._options = options or PlannerOptions()
        self._jobs: dict[str, JobPlanner] = {}
        self.binder = SlotBinder(now_s, aging_per_s=self._options.aging_per_s,
                                 affinity_bonus=self._options.affinity_bonus, max_wait_s=self._options.max_wait_s,
                                 dp_min_micro_batches_per_member=self._options.dp_min_micro_batches_per_member,
                                 recruit_fresh_s=self._options.dp_recruit_fresh_s,
                                 dp_timeout_s=self._options.dp_timeout_s, incarnation=self._options.lease_epoch)
        self._next_job = 0

    # ---- jobs ----------------------------------------------------------------------------------------------

    def submit_job(self, job_id: str, spec: JobSpec) -> JobPlanner:
        """Adds a job; resubmitting the same id with the same spec returns the existing job.

        Raises:
            AlreadyExists: the id is taken by a different spec.
        """
        validate_job_id(job_id)
        existing = self._jobs.get(job_id)
        if existing is not None:
            if existing.spec_json != spec.to_json():
                raise AlreadyExists(f"job {job_id!r} exists with a different spec")
            return existing
        job = JobPlanner.create(job_id, spec, self._now_s, self._options)
        self._jobs[job_id] = job
        self._register_binding(job)
        return job

    def _register_binding(self, job: JobPlanner) -> None:
        if job.spec.pipeline.effective_binding == "static" and not job.state.terminal:
            self.binder.set_static(job.job_id, job.spec.agent_names)

    def restore_job(self, persisted: PersistedJob, reported: Iterable[ExperienceSummary]) -> JobPlanner:
        """Rebuilds a job after a restart from its durable state and the experiences stored holds."""
        job = JobPlanner.restore(persisted, self._now_s, self._options)
        job.recover(reported)
        self._jobs[persisted.job_id] = job
        self._register_binding(job)
        return job

    def job(self, job_id: str) -> JobPlanner:
        """A job; raises NotFound."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def jobs(self) -> list[JobPlanner]:
        """Every job, in submission order."""
        return list(self._jobs.values())

    def cancel_job(self, job_id: str) -> JobSnapshot:
        """Cancels a job; its leases end and its slots are freed."""
        job = self.job(job_id)
        job.cancel()
        self._sweep()
        return self.snapshot(job_id)

    def snapshot(self, job_id: str) -> JobSnapshot:
        """Status of one job, with the slot bound to each agent."""
        job = self.job(job_id)
        return job.snapshot(lambda agent: self.binder.slot_of((job_id, agent)) or "",
                            lambda agent: self.binder.members((job_id, agent)))

    def take_changes(self) -> list[StateChange]:
        """Durable changes of every job, in order within each job."""
        changes: list[StateChange] = []
        for job in self._jobs.values():
            changes.extend(job.take_changes())
        return changes

    def _running(self) -> list[JobPlanner]:
        return [job for job in self._jobs.values() if not job.state.terminal]

    def _sweep(self) -> None:
        for job in self._jobs.values():
            if job.state.terminal:
                self.binder.forget_agents(job.job_id)

    def _job_of_lease(self, lease_id: str) -> JobPlanner:
        job = self._jobs.get(lease_id.split("/", 1)[0])
        if job is None:
            raise NotFound(f"lease {lease_id!r} not found")
        return job

    # ---- time and deaths ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expires overdue leases everywhere and forgets silent slots. Call often (and before every RPC)."""
        for job in self._running():
            for slot_id in job.tick():
                self._slot_lost(slot_id, "work expired")
        now_s = self._now_s()
        for slot in self.binder.slots():
            if now_s - slot.last_seen_s > self._options.slot_silence_s and not any(
                    job.slot_busy(slot.slot_id) for job in self._running()):
                self._slot_lost(slot.slot_id, f"slot silent for {now_s - slot.last_seen_s:.0f} s")
        self._sweep()

    def _slot_lost(self, slot_id: str, reason: str) -> None:
        self.binder.remove_slot(slot_id)
        for job in self._running():
            job.slot_lost(slot_id, reason)

    def worker_gone(self, worker_id: str) -> None:
        """A worker's registration expired: its task leases and slots are dead."""
        for slot_id in self.binder.slots_of_worker(worker_id):
            self._slot_lost(slot_id, f"worker {worker_id} gone")
        for job in self._running():
            job.revoke_worker(worker_id)
        self._sweep()

    # ---- rollout workers ------------------------------------------------------------------------------

    def lease_rollout_tasks(self, worker_id: str, max_tasks: int) -> list[RolloutTaskLease]:
        """Up to ``max_tasks`` tasks, round-robin over running jobs (oldest first)."""
        self.tick()
        leased: list[RolloutTaskLease] = []
        progress = True
        while len(leased) < max_tasks and progress:
            progress = False
            for job in self._running():
                if len(leased) >= max_tasks:
                    break
                got = job.lease_tasks(worker_id, 1)
                if got:
                    leased.extend(got)
                    progress = True
        return leased

    def has_leasable_tasks(self) -> bool:
        """Whether some running job has a rollout task to hand out now (no tick, no side effects)."""
        return any(job.has_leasable_tasks() for job in self._jobs.values())

    def renew_leases(self, worker_id: str, lease_ids: Sequence[str]) -> RenewResult:
        """Renews task or micro-batch leases across jobs."""
        self.tick()
        by_job: dict[str, list[str]] = defaultdict(list)
        lost: list[str] = []
        for lease_id in lease_ids:
            job = self._jobs.get(lease_id.split("/", 1)[0])
            if job is None:
                lost.append(lease_id)
            else:
                by_job[job.job_id].append(lease_id)
        deadlines: list[float] = []
        for job_id, ids in by_job.items():
            result = self._jobs[job_id].renew(worker_id, ids)
            lost.extend(result.lost_lease_ids)
            if len(result.lost_lease_ids) < len(ids):
                deadlines.append(result.deadline_s)
        lost_set = set(lost)
        return RenewResult(tuple(lease_id for lease_id in lease_ids if lease_id in lost_set),
                           min(deadlines) if deadlines else self._now_s())

    def report_rollout_task(self, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                            experiences: Sequence[ExperienceSummary]) -> None:
        """See :meth:`JobPlanner.report_task`."""
        self.tick()
        try:
            self._job_of_lease(lease_id).report_task(lease_id, worker_id, task_id, succeeded, error, experiences)
        finally:
            self._sweep()

    def rollout_demand(self) -> dict[AgentKey, int]:
        """Estimated outstanding generation tokens per (job, agent), for rolloutd's balancer."""
        demand: dict[AgentKey, int] = {}
        for job in self._running():
            for agent, tokens in job.rollout_demand().items():
                demand[(job.job_id, agent)] = tokens
        return demand

    # ---- trainer slots ---------------------------------------------------------------------------------

    def _demands(self) -> dict[AgentKey, AgentDemand]:
        demands: dict[AgentKey, AgentDemand] = {}
        for job in self._running():
            for agent in job.spec.agent_names:
                demands[(job.job_id, agent)] = job.data_parallel_demand(agent)
        return demands

    def poll_trainer_work(self, worker_id: str, slot_id: str,
                          resident: Sequence[ResidentAgent] = (), dp_address: str = "") -> TrainerWork | None:
        """The next work for one trainer slot, or None (the servicer long-polls and asks again).

        ``dp_address``: the slot's data-parallel rendezvous (``""`` = it cannot join a group).
        """
        self.tick()
        slot = self.binder.observe_poll(slot_id, worker_id, {(r.job_id, r.agent): r.version for r in resident},
                                        dp_address)
        if slot.swapping_out is not None:
            job_id, agent = slot.swapping_out
            if job_id in self._jobs and not self._jobs[job_id].state.terminal:
                return SwapOutWork(job_id, agent, self._options.swap_location)
            slot.swapping_out = None
        demands = self._demands()
        self.binder.note_demand(demands.values())
        decision = self.binder.decide(slot_id, demands)
        if decision.kind is DecisionKind.RELEASE and decision.agent is not None:
            job_id, agent = decision.agent
            primary = self.binder.slot_of(decision.agent) == slot_id
            self.binder.release(slot_id)
            self._jobs[job_id].release_slot(agent)
            if primary and not self._jobs[job_id].state_is_portable(agent):
                # A non-primary member never holds the only copy: rank 0 holds the same version.
                slot.swapping_out = decision.agent
                return SwapOutWork(job_id, agent, self._options.swap_location)
            if decision.successor is None:
                return None
            self.binder.bind(slot_id, decision.successor)
            return self._trainer_work(decision.successor, slot_id, worker_id, demands)
        if decision.kind is DecisionKind.BIND and decision.agent is not None:
            self.binder.bind(slot_id, decision.agent)
        if decision.kind is DecisionKind.JOIN and decision.agent is not None:
            self.binder.join(slot_id, decision.agent)
        if decision.kind in (DecisionKind.BIND, DecisionKind.KEEP, DecisionKind.JOIN) and decision.agent is not None:
            return self._trainer_work(decision.agent, slot_id, worker_id, demands)
        return None

    def _trainer_work(self, agent: AgentKey, slot_id: str, worker_id: str,
                      demands: Mapping[AgentKey, AgentDemand]) -> TrainerWork | None:
        """Grows the agent's group at a step boundary (data parallelism), then the slot's next work."""
        demand = demands.get(agent)
        if demand is not None and not demand.mid_step:
            joined = self.binder.grow(agent, demands)
            if joined:
                logger.info("agent %s/%s: slots %s joined its data-parallel group (now %s)", agent[0], agent[1],
                            joined, list(self.binder.members(agent)))
        return self._jobs[agent[0]].next_trainer_work(agent[1], slot_id, worker_id, self.binder.group(agent))

    def ack_micro_batch(self, lease_id: str, worker_id: str, slot_id: str, episodes: int = 0) -> None:
        """See :meth:`JobPlanner.ack_micro_batch`."""
        self.tick()
        self._job_of_lease(lease_id).ack_micro_batch(lease_id, worker_id, slot_id, episodes)

    def commit_step(self, worker_id: str, slot_id: str, job_id: str, agent: str, step: int, new_version: int,
                    weights_uri: str, state_uri: str, loss: float = 0.0, grad_norm: float = 0.0,
                    step_seconds: float = 0.0) -> None:
        """See :meth:`JobPlanner.commit_step`."""
        self.tick()
        try:
            self.job(job_id).commit_step(worker_id, slot_id, agent, step, new_version, weights_uri, state_uri,
                                         loss, grad_norm, step_seconds)
        finally:
            self._sweep()

    def report_slot_event(self, worker_id: str, slot_id: str, job_id: str, agent: str, kind: SlotEventKind,
                          state_uri: str = "", error: str = "") -> None:
        """A slot finished a swap-out or failed.

        Raises:
            FailedPrecondition: a swap-out that was not asked of this slot.
        """
        self.tick()
        if kind is SlotEventKind.FAILED:
            self._slot_lost(slot_id, f"slot reported failure: {error}")
            self._sweep()
            return
        slot = self.binder.slot(slot_id)
        if slot is None or slot.worker_id != worker_id or slot.swapping_out != (job_id, agent):
            raise FailedPrecondition(f"slot {slot_id!r} was not asked to swap out agent {agent!r} of {job_id!r}")
        slot.swapping_out = None
        job = self.job(job_id)
        if not job.state.terminal:
            job.record_swap_out(agent, state_uri)
