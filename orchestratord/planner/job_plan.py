"""The mutable state of one job's plan, and the few operations every part of the planner needs.

The functions in ``admission``, ``reports``, ``manifests``, ``recovery``, ``dispatch``
and ``demand`` take a :class:`JobPlan` and change it; durable changes go to
:attr:`JobPlan.changes` (the outbox the daemon persists before it answers).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections import defaultdict
from collections.abc import Callable

from flexmarl.errors import FailedPrecondition, NotFound
from flexmarl.evaluation import EvalEpisode
from flexmarl.jobspec import AgentSpec, JobSpec
from orchestratord.binding import DataParallelGroup
from orchestratord.failures import FailureFigures
from orchestratord.leases import LeaseStatus, LeaseTable
from orchestratord.planner.estimator import RolloutDemandEstimator
from orchestratord.planner.types import AgentVersion, PlannerOptions
from orchestratord.state import JobState, JobStateChanged, StateChange, StepCommit, StepManifest

logger = logging.getLogger(__name__)

#: Steps every agent committed whose manifests and commits the planner still holds: a repeated
#: CommitStep (a lost reply) finds its commit. The coordinator takes a commit's manifest from its
#: StepCommitted change, so a write delayed by an etcd outage does not depend on this. Older ones
#: live in etcd only, so the planner's memory does not grow with history.
KEPT_COMMITTED_STEPS = 2


class TaskStatus(enum.Enum):
    """Where a rollout task is."""

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"


@dataclasses.dataclass
class Task:
    """One admitted rollout task (``group_size`` episodes of one environment task)."""

    task_id: str
    batch: int
    position: int
    task_index: int
    status: TaskStatus = TaskStatus.PENDING
    attempts: int = 0
    lease_id: str = ""
    # The step the task's groups joined (None until placed); ``batch`` under ``pipeline.step_fill: batch``.
    step: int | None = None
    # The job's lowest committed version when the task was last leased: under ``step_fill: completion``
    # its experiences are at least that new, so it may hold steps up to that + max_staleness open.
    lease_version: int = 0
    # Done without experiences: too few of its episodes were left after their rewards failed (manifests.give_up_task).
    given_up: bool = False


@dataclasses.dataclass(frozen=True)
class Group:
    """An agent's experiences of one task: the unit micro-batches are made of."""

    agent: str
    group_id: str
    task_id: str
    position: int
    experience_ids: tuple[str, ...]
    episodes: int
    response_tokens: int
    # Sum of the experiences' trained rewards; sum of the episodes' unshaped returns (one per episode).
    reward_sum: float
    min_behavior_version: int
    max_behavior_version: int
    # Each experience's return, in experience_ids order (advantage_norm agent's step statistics).
    returns: tuple[float, ...] = ()
    batch: int = 0  # the task's rollout batch: (batch, position) orders a step's groups
    return_sum: float = 0.0

    @property
    def task_order(self) -> tuple[int, int]:
        """Where the group's task is in admission order (a step's "task order")."""
        return self.batch, self.position


class MicroBatchStatus(enum.Enum):
    """Where a micro-batch of the current attempt is."""

    READY = "ready"
    LEASED = "leased"
    ACKED = "acked"


@dataclasses.dataclass
class MicroBatch:
    """Complete groups whose gradients one slot accumulates under one lease."""

    index: int
    groups: tuple[Group, ...]
    status: MicroBatchStatus = MicroBatchStatus.READY
    lease_id: str = ""
    slot_id: str = ""

    @property
    def experience_ids(self) -> tuple[str, ...]:
        """Every experience of the micro-batch, group by group."""
        return tuple(eid for group in self.groups for eid in group.experience_ids)

    @property
    def episodes(self) -> int:
        """Episodes of the micro-batch."""
        return sum(group.episodes for group in self.groups)

    @property
    def response_tokens(self) -> int:
        """Generated tokens of the micro-batch."""
        return sum(group.response_tokens for group in self.groups)


@dataclasses.dataclass
class StepPlan:
    """One step of one agent: its groups, micro-batches, manifest and current attempt."""

    agent: str
    step: int
    groups: list[Group] = dataclasses.field(default_factory=list)
    unformed: list[Group] = dataclasses.field(default_factory=list)
    micro_batches: list[MicroBatch] = dataclasses.field(default_factory=list)
    manifest: StepManifest | None = None
    attempt: int = 0
    # Primary slot of the attempt (the one that commits); "" before the attempt started.
    slot_id: str = ""
    optimizer_deadline_s: float | None = None
    # The attempt's group, fixed when its first work is issued (None = not started).
    group: DataParallelGroup | None = None
    # Members that were given the optimizer step of this attempt.
    optimizer_issued: set[str] = dataclasses.field(default_factory=set)
    # Tallies of micro_batches by status, kept by add_micro_batch and set_status (their only writers), so
    # that a trainer poll (demand, dispatch) reads them in O(1) instead of scanning the step's micro-batches.
    ready_count: int = 0
    ready_tokens: int = 0
    formed_tokens: int = 0  # response tokens of every formed micro-batch, whatever its status
    leased_count: int = 0
    acked_count: int = 0
    formed_groups: int = 0
    first_ready: int = 0  # no READY micro-batch below this index
    leased_by_slot: dict[str, set[int]] = dataclasses.field(default_factory=dict)  # slot -> LEASED indices
    # The job's set of agents whose demand may have changed (JobPlan.touched; set by manifests.step_plan):
    # the writers above add the plan's agent, so the planner recomputes only those agents' demands.
    touched: set[str] | None = dataclasses.field(default=None, repr=False, compare=False)

    def add_micro_batch(self, groups: tuple[Group, ...]) -> MicroBatch:
        """Appends a READY micro-batch of ``groups``."""
        mb = MicroBatch(len(self.micro_batches), groups)
        self.micro_batches.append(mb)
        self.ready_count += 1
        self.ready_tokens += mb.response_tokens
        self.formed_tokens += mb.response_tokens
        self.formed_groups += len(groups)
        if self.touched is not None:
            self.touched.add(self.agent)
        return mb

    def set_status(self, mb: MicroBatch, status: MicroBatchStatus, *, lease_id: str | None = None,
                   slot_id: str | None = None) -> None:
        """Moves one of the plan's micro-batches to ``status`` (and sets its lease and slot where given)."""
        if self.touched is not None:
            self.touched.add(self.agent)
        if mb.status is MicroBatchStatus.READY:
            self.ready_count -= 1
            self.ready_tokens -= mb.response_tokens
        elif mb.status is MicroBatchStatus.ACKED:
            self.acked_count -= 1
        else:
            self.leased_count -= 1
            held = self.leased_by_slot[mb.slot_id]
            held.discard(mb.index)
            if not held:
                del self.leased_by_slot[mb.slot_id]
        mb.status = status
        if lease_id is not None:
            mb.lease_id = lease_id
        if slot_id is not None:
            mb.slot_id = slot_id
        if status is MicroBatchStatus.READY:
            self.ready_count += 1
            self.ready_tokens += mb.response_tokens
            self.first_ready = min(self.first_ready, mb.index)
        elif status is MicroBatchStatus.ACKED:
            self.acked_count += 1
        else:
            self.leased_count += 1
            self.leased_by_slot.setdefault(mb.slot_id, set()).add(mb.index)
        while self.first_ready < len(self.micro_batches) and (
                self.micro_batches[self.first_ready].status is not MicroBatchStatus.READY):
            self.first_ready += 1

    def first_ready_micro_batch(self) -> MicroBatch | None:
        """The READY micro-batch of the lowest index, or None."""
        return self.micro_batches[self.first_ready] if self.ready_count else None

    def leased_to(self, slot_id: str) -> MicroBatch | None:
        """The LEASED micro-batch of the lowest index held by ``slot_id``, or None."""
        held = self.leased_by_slot.get(slot_id)
        return self.micro_batches[min(held)] if held else None

    @property
    def members(self) -> tuple[str, ...]:
        """The attempt's slots (primary first); empty before it started."""
        if self.group is not None:
            return self.group.members
        return (self.slot_id,) if self.slot_id else ()

    @property
    def mid_step(self) -> bool:
        """Whether the attempt has work out or done (a slot holds gradients of it)."""
        return self.optimizer_deadline_s is not None or self.ready_count < len(self.micro_batches)

    @property
    def ready_for_optimizer(self) -> bool:
        """Whether every micro-batch of the fixed manifest is accumulated."""
        return (self.manifest is not None and not self.unformed and bool(self.micro_batches)
                and self.acked_count == len(self.micro_batches))


@dataclasses.dataclass
class AgentState:
    """An agent's committed version and where its weights and training state are."""

    name: str
    version: int
    weights_uri: str
    state_uri: str
    # Worker whose memory alone holds the committed state (non-durable state_uri), else "".
    state_worker_id: str = ""
    # Version 0's weights where a warm start published them ("": the spec's model).
    initial_weights_uri: str = ""
    # The last step's mean trained reward (per experience) and mean unshaped episode return (per episode).
    reward_mean: float = 0.0
    return_mean: float = 0.0
    staleness_mean: float = 0.0
    step_seconds: float = 0.0


@dataclasses.dataclass
class WarmStartAttempt:
    """The agent's warm start as issued: to which slot, under which lease, how many times so far."""

    slot_id: str = ""
    lease_id: str = ""
    attempts: int = 0


@dataclasses.dataclass
class EvalTask:
    """One held-out task of an evaluation round (``samples_per_task`` episodes of ``eval_task(index)``)."""

    task_id: str
    index: int
    status: TaskStatus = TaskStatus.PENDING
    attempts: int = 0
    lease_id: str = ""
    #: Given up after too many failed attempts (counts as done, not in the metrics).
    failed: bool = False


@dataclasses.dataclass
class EvalRound:
    """An evaluation round of the team's version ``version``, played on at least ``agent_versions``.

    An on-demand round (``flexmarl eval``) is played on exactly its ``agent_versions`` (pinned).
    """

    round_id: str
    version: int
    agent_versions: tuple[AgentVersion, ...]
    tasks: dict[str, EvalTask]
    episodes: list[EvalEpisode] = dataclasses.field(default_factory=list)
    on_demand: bool = False
    #: The settings it runs with (an on-demand round may ask for another number of tasks).
    samples_per_task: int = 1
    #: An on-demand round's task file (its rows are the held-out tasks) and its content's sha256.
    eval_file: str = ""
    eval_sha256: str = ""
    #: ``greedy`` or ``policy`` (an on-demand round may ask for either); "": the job's ``evaluation.sampling``.
    sampling: str = ""

    @property
    def done(self) -> bool:
        """Whether every task reported or was given up."""
        return all(task.status is TaskStatus.DONE for task in self.tasks.values())


@dataclasses.dataclass
class JobPlan:
    """Everything the planner knows about one job (built by ``JobPlanner``)."""

    job_id: str
    spec: JobSpec
    now_s: Callable[[], float]
    options: PlannerOptions
    # Distinguishes this process's lease and step ids from a dead orchestrator's.
    epoch: str
    leases: LeaseTable
    agents: dict[str, AgentState]
    persisted_manifests: dict[tuple[str, int], StepManifest]
    commits: dict[tuple[str, int], StepCommit]
    created_s: float
    updated_s: float
    state: JobState = JobState.RUNNING
    error: str = ""
    # The outbox: durable changes not yet taken by the daemon.
    changes: list[StateChange] = dataclasses.field(default_factory=list)
    tasks: dict[str, Task] = dataclasses.field(default_factory=dict)
    # Tasks to lease again (expired, failed or rejected), before newly admitted ones.
    retry: set[str] = dataclasses.field(default_factory=set)
    # Done tasks placed in each step (under step_fill batch: the done tasks of each rollout batch).
    tasks_per_step: defaultdict[int, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    # The ids of the tasks placed in each step (manifests.place_task), read when the step is pruned: a task
    # whose step is s is in task_ids_by_step[s] (it may hold ids placed elsewhere since, or forgotten).
    task_ids_by_step: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    # step_fill completion: done tasks not yet in a step (with their groups), and the lowest step not yet full.
    unplaced: list[tuple[Task, dict[str, Group]]] = dataclasses.field(default_factory=list)
    open_step: int = 0
    plans: dict[tuple[str, int], StepPlan] = dataclasses.field(default_factory=dict)
    #: Min-heap of (optimizer deadline, plans key) as dispatch set them; stale entries (the plan replaced, its
    #: deadline reset) are skipped by recovery.tick, which reads only the entries whose deadline passed.
    optimizer_deadlines: list[tuple[float, tuple[str, int]]] = dataclasses.field(default_factory=list)
    # Tasks admitted so far (N of the admission rule counts every admitted task's episodes).
    admitted: int = 0
    # step_fill completion: admitted tasks that fill no step, each replaced by another admitted task
    # (.admission.admission_limit): given up, dropped as too stale, or lost at an orchestratord restart
    # (recovery rebuilds the count from what fills the open steps).
    tasks_replaced: int = 0
    tasks_done_total: int = 0
    # Episodes dropped as their reward failed and tasks given up as too few were left (manifests.give_up_task):
    # by step, of the steps some agent has yet to commit (orchestratord/failures.py), and over the steps every
    # agent committed (durable); the latest such reason (JobStatus), and the tasks given up since the last task done.
    step_failures: dict[int, FailureFigures] = dataclasses.field(default_factory=dict)
    failures_committed: FailureFigures = FailureFigures()
    last_episode_failure: str = ""
    given_up_in_a_row: int = 0
    rollout_demand_estimator: RolloutDemandEstimator = dataclasses.field(default_factory=RolloutDemandEstimator)
    # Warm starts issued and not yet committed, by agent (``planner.warm_start``).
    warm_starts: dict[str, WarmStartAttempt] = dataclasses.field(default_factory=dict)
    # Held-out evaluation (``planner.evaluation``): open rounds by round id (in opening order), and the rounds over.
    eval_rounds: dict[str, EvalRound] = dataclasses.field(default_factory=dict)
    eval_done: set[str] = dataclasses.field(default_factory=set)
    # Agents whose trainer demand (planner.demand) or trainer work may have changed since the planner last
    # looked (it recomputes only theirs, and wakes only their slots' polls); touched_all: every agent's.
    touched: set[str] = dataclasses.field(default_factory=set)
    touched_all: bool = True

    def touch(self, agent: str) -> None:
        """The agent's demand or trainer work may have changed."""
        self.touched.add(agent)

    def count_failure(self, task: Task, reason: str, episodes: int = 0, tasks: int = 0,
                      step: int | None = None) -> None:
        """Counts ``task``'s dropped episodes or its giving up in a step's figures (``reason``: the latest).

        The step (unless given): the task's rollout batch's (``pipeline.step_fill: batch``), or under
        ``completion`` the step being filled now (a given-up task joins none; a done one usually
        joins that one). Under ``completion`` once every step is full, a task still reporting trains
        nothing (it is abandoned): its failures are in the metrics and the logs, in no step's figures.
        """
        if step is None:
            step = self.open_step if self.spec.pipeline.fills_by_completion else task.batch
        if step >= self.spec.total_steps:
            return
        self.step_failures[step] = self.step_failures.get(step, FailureFigures()).add(reason, episodes, tasks)
        self.last_episode_failure = reason

    def failure_totals(self) -> FailureFigures:
        """Failed episodes and given-up tasks of the whole job: the committed steps', then the others' in order."""
        totals = self.failures_committed
        for step in sorted(self.step_failures):
            totals = totals.plus(self.step_failures[step])
        return totals

    def touch_all(self) -> None:
        """Every agent's demand or trainer work may have changed (a job-wide or rare change)."""
        self.touched_all = True

    @functools.cached_property
    def agent_specs(self) -> dict[str, AgentSpec]:
        """The spec of each agent by name (the spec is frozen; ``JobSpec.agent`` searches the list)."""
        return {agent.name: agent for agent in self.spec.agents}

    @functools.cached_property
    def advantage_norms(self) -> dict[str, str]:
        """Each agent's ``advantage_norm`` (``JobSpec.algorithm_of`` copies the algorithm on every call)."""
        return {name: self.spec.algorithm_of(name).advantage_norm for name in self.spec.agent_names}

    @functools.cached_property
    def has_warm_starts(self) -> bool:
        """Whether some agent has a warm start (``agents[].warm_start``)."""
        return any(agent.warm_start is not None for agent in self.spec.agents)

    def agent(self, agent: str) -> AgentState:
        """An agent of the job; raises NotFound."""
        state = self.agents.get(agent)
        if state is None:
            raise NotFound(f"job {self.job_id!r} has no agent {agent!r}")
        return state

    def min_version(self) -> int:
        """The lowest committed version over the agents."""
        return min(a.version for a in self.agents.values())

    def versions(self) -> list[AgentVersion]:
        """Committed version of every agent, in spec order."""
        return [AgentVersion(self.job_id, a.name, a.version, a.weights_uri) for a in self.agents.values()]

    def current_plan(self, agent: str) -> StepPlan | None:
        """The plan of the step the agent trains next (None when nothing arrived for it yet)."""
        return self.plans.get((agent, self.agent(agent).version))

    def require_running(self) -> None:
        """Raises FailedPrecondition once the job ended."""
        if self.state.terminal:
            raise FailedPrecondition(f"job {self.job_id!r} is {self.state.name.lower()}")

    def set_state(self, state: JobState, error: str) -> None:
        """Moves the job to ``state`` (emits JobStateChanged); a terminal state revokes every lease."""
        self.state = state
        self.error = error
        self.touch_all()
        self.updated_s = self.now_s()
        self.changes.append(JobStateChanged(self.job_id, state, error, self.updated_s))
        if state.terminal:
            for lease in self.leases.active():
                self.leases.end(lease, LeaseStatus.REVOKED, f"job {state.name.lower()}")

    def forget_history(self) -> None:
        """Drops the manifests and commits of steps every agent committed, but the last KEPT_COMMITTED_STEPS."""
        below = self.min_version() - KEPT_COMMITTED_STEPS
        for key in [key for key in self.persisted_manifests if key[1] < below]:
            del self.persisted_manifests[key]
        for key in [key for key in self.commits if key[1] < below]:
            del self.commits[key]

    def fail(self, error: str) -> None:
        """Fails the job (no-op once it ended)."""
        if not self.state.terminal:
            logger.error("job %s failed: %s", self.job_id, error)
            self.set_state(JobState.FAILED, error)
