"""``JobPlanner``: the plan of one job behind one interface; the work is done by the sibling modules."""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence

from flexmarl.errors import ErrorReason, InvalidArgument
from flexmarl.evaluation import EvalEpisode
from flexmarl.experience import ExperienceSummary, FailedEpisode
from flexmarl.ids import lease_id_prefix, validate_job_id
from flexmarl.jobspec import JobSpec, parse_job_spec, spec_digest
from orchestratord.binding import AgentDemand, DataParallelGroup
from orchestratord.eval_state import OpenEvalRound
from orchestratord.failures import FailureFigures
from orchestratord.leases import LeaseKind, LeaseTable
from orchestratord.planner import admission, demand, dispatch, evaluation, recovery, reports
from orchestratord.planner.estimator import RolloutDemandEstimator
from orchestratord.planner.ids import prune_group_of_lease
from orchestratord.planner.job_plan import AgentState, JobPlan, StepPlan
from orchestratord.planner.types import (
    AgentProgress,
    AgentVersion,
    JobSnapshot,
    MicroBatchWork,
    OptimizerStepWork,
    PlannerOptions,
    RenewResult,
    RolloutTaskLease,
    WarmStartWork,
)
from orchestratord.state import (
    AgentVersionRecord,
    JobCreated,
    JobState,
    PersistedJob,
    StateChange,
    StepCommit,
    StepManifest,
)


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
        eval_rounds: Iterable[str] = (),
        open_evals: Sequence[OpenEvalRound] = (),
        failure_totals: FailureFigures | None = None,
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.spec_json = spec.to_json()
        self.spec_digest = spec_digest(self.spec_json)
        epoch = options.lease_epoch or secrets.token_hex(3)
        records = {name: agents.get(name, AgentVersionRecord()) for name in spec.agent_names}
        job = JobPlan(
            job_id=job_id, spec=spec, now_s=now_s, options=options, epoch=epoch,
            leases=LeaseTable(now_s, lease_id_prefix(job_id, epoch), group_of=prune_group_of_lease),
            agents={name: AgentState(name, r.version, r.weights_uri, r.state_uri,
                                   initial_weights_uri=r.initial_weights_uri) for name, r in records.items()},
            persisted_manifests=dict(manifests or {}), commits=dict(commits or {}),
            created_s=created_s, updated_s=created_s, state=state, error=error,
            rollout_demand_estimator=RolloutDemandEstimator(),
        )
        # Every batch below the lowest committed version is done (a restored job starts there), but its given-up
        # tasks (step_fill batch: each took its place in its batch empty; completion: another replaced each).
        recovery.restore_failures(job, failure_totals or FailureFigures())
        job.admitted = job.min_version() * spec.batch.prompts_per_step
        job.tasks_done_total = job.admitted - (0 if spec.pipeline.fills_by_completion
                                               else job.failures_committed.tasks_given_up)
        job.open_step = job.min_version()  # step_fill completion: the first step still to fill
        for agent in spec.agents:
            job.rollout_demand_estimator.set_prior((job_id, agent.name), float(agent.sampling.max_new_tokens))
        job.eval_done.update(eval_rounds)
        evaluation.restore(job, open_evals)  # the rounds open at a restart, with their finished tasks
        evaluation.on_version(job)  # a due evaluation round; a job at total_steps with none open succeeds
        self._job = job

    @classmethod
    def create(cls, job_id: str, spec: JobSpec, now_s: Callable[[], float],
               options: PlannerOptions | None = None,
               initial: Mapping[str, AgentVersionRecord] | None = None) -> JobPlanner:
        """A new job at version 0 of every agent, or at ``initial`` (a resume); emits JobCreated.

        A resumed job starts like a restored one: rollout batch ``min(version)`` comes first, so
        the step counters continue where the checkpoints left them.
        """
        validate_job_id(job_id)
        created_s = now_s()
        records = {agent: dataclasses.replace(record, updated_s=created_s)
                   for agent, record in (initial or {}).items() if agent in spec.agent_names}
        planner = cls(job_id, spec, now_s, options or PlannerOptions(), created_s=created_s, agents=records)
        # First: a round opened at creation (``evaluation.before_training``) is written into the job.
        planner._job.changes.insert(0, JobCreated(job_id, planner.spec_json, spec.agent_names, created_s,
                                                  tuple(sorted(records.items()))))
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
                      commits=persisted.commits, state=persisted.state, error=persisted.error,
                      eval_rounds=persisted.eval_rounds, open_evals=persisted.open_evals,
                      failure_totals=persisted.failure_totals)
        planner._job.updated_s = persisted.updated_s
        return planner

    # ---- status ------------------------------------------------------------------------------------------

    @property
    def state(self) -> JobState:
        """The job's state."""
        return self._job.state

    @property
    def error(self) -> str:
        """Why the job failed ("" otherwise)."""
        return self._job.error

    @property
    def rollout_demand_estimator(self) -> RolloutDemandEstimator:
        """Tokens per episode of each agent of the job."""
        return self._job.rollout_demand_estimator

    def take_changes(self) -> list[StateChange]:
        """Durable changes since the last call, in order (apply them before answering)."""
        changes, self._job.changes = self._job.changes, []
        return changes

    def versions(self) -> list[AgentVersion]:
        """Committed version of every agent, in spec order."""
        return self._job.versions()

    def version(self, agent: str) -> int:
        """Committed version of one agent."""
        return self._job.agent(agent).version

    def initial_weights_uri(self, agent: str) -> str:
        """Version 0's weights where the agent's warm start published them ("": the spec's model)."""
        return self._job.agent(agent).initial_weights_uri

    def manifest(self, agent: str, step: int) -> StepManifest | None:
        """The fixed manifest of a step, or None when not fixed yet (or forgotten: see ``KEPT_COMMITTED_STEPS``)."""
        plan = self._job.plans.get((agent, step))
        if plan is not None and plan.manifest is not None:
            return plan.manifest
        return self._job.persisted_manifests.get((agent, step))

    def snapshot(self, slot_of: Callable[[str], str] | None = None,
                 members_of: Callable[[str], tuple[str, ...]] | None = None) -> JobSnapshot:
        """The job's status now; ``slot_of(agent)`` names the bound slot, ``members_of`` all of them."""
        job = self._job
        failures = job.failure_totals()
        agents = tuple(
            AgentProgress(
                agent=a.name, version=a.version, total_steps=self.spec.total_steps,
                weights_uri=a.weights_uri, state_uri=a.state_uri, initial_weights_uri=a.initial_weights_uri,
                slot_id=slot_of(a.name) if slot_of is not None else "",
                reward_mean=a.reward_mean, staleness_mean=a.staleness_mean, step_seconds=a.step_seconds,
                slot_ids=members_of(a.name) if members_of is not None else (), return_mean=a.return_mean,
            )
            for a in job.agents.values()
        )
        return JobSnapshot(
            job_id=self.job_id, name=self.spec.name, state=job.state, error=job.error,
            created_s=job.created_s, updated_s=job.updated_s, spec_json=self.spec_json, spec_digest=self.spec_digest,
            agents=agents,
            tasks_done=job.tasks_done_total,
            tasks_total=self.spec.total_steps * self.spec.batch.prompts_per_step,
            episodes_failed=failures.episodes_failed, tasks_given_up=failures.tasks_given_up,
            last_episode_failure=job.last_episode_failure or failures.last_failure,
        )

    def cancel(self) -> None:
        """Cancels the job (no-op once it ended)."""
        if not self._job.state.terminal:
            self._job.set_state(JobState.CANCELLED, "cancelled")

    def fail(self, error: str) -> None:
        """Fails the job (no-op once it ended)."""
        self._job.fail(error)

    # ---- time and failures (recovery.py) -------------------------------------------------------------------

    def tick(self) -> list[str]:
        """Expires overdue leases and optimizer steps; returns slots whose work expired (treat as dead)."""
        return recovery.tick(self._job)

    def slot_lost(self, slot_id: str, reason: str) -> None:
        """A trainer slot died or failed: steps with work on it restart from the last committed version."""
        self._job.touch_all()
        recovery.slot_lost(self._job, slot_id, reason)

    def revoke_worker(self, worker_id: str) -> None:
        """A rollout worker died: its task leases end now and the tasks are re-issued."""
        self._job.touch_all()
        recovery.revoke_worker(self._job, worker_id)

    def recover(self, reported: Iterable[ExperienceSummary], consumed_by: Mapping[str, int] | None = None) -> int:
        """After :meth:`restore`: marks done the tasks stored holds every experience of; returns how many.

        ``consumed_by`` (experience id -> the step whose commit consumed it, stored's record) stands in
        for the manifests of steps whose keys were archived away (``orchestratord/history_archive.py``).
        Then forgets the history recovery needed (older manifests and commits stay in etcd only).
        """
        self._job.touch_all()
        recovered = recovery.recover(self._job, reported, consumed_by or {})
        self._job.forget_history()
        return recovered

    # ---- rollout side (admission.py, reports.py) ---------------------------------------------------------

    def admission_limit(self) -> int:
        """Tasks that may have been admitted by now (AReaL's rule, see :func:`.admission.admission_limit`)."""
        return admission.admission_limit(self._job)

    @property
    def admitted_tasks(self) -> int:
        """Tasks admitted so far (N of the admission rule, in tasks)."""
        return self._job.admitted

    @property
    def evaluating(self) -> bool:
        """Whether an evaluation round is open and may run (an on-demand one also after the job succeeded)."""
        return bool(self._job.eval_rounds) and evaluation.evaluable(self._job)

    def open_evaluation(self, pinned: Sequence[AgentVersion], tasks: int, eval_file: str = "",
                        eval_sha256: str = "", sampling: str = "", samples_per_task: int = 0) -> str:
        """Opens an on-demand evaluation round on exactly ``pinned``; see :func:`.evaluation.open_on_demand`."""
        self._job.touch_all()
        return evaluation.open_on_demand(self._job, tuple(pinned), tasks, eval_file, eval_sha256, sampling,
                                         samples_per_task)

    @property
    def tracked_task_ids(self) -> frozenset[str]:
        """The tasks the planner still holds (admitted, not yet forgotten with a committed step or dropped)."""
        return frozenset(self._job.tasks)

    def has_leasable_tasks(self) -> bool:
        """Whether :meth:`lease_tasks` would hand out a task now (a re-issue, an admissible one or an eval task)."""
        return admission.has_leasable_tasks(self._job) or evaluation.has_leasable(self._job)

    def lease_tasks(self, worker_id: str, max_tasks: int) -> list[RolloutTaskLease]:
        """Leases up to ``max_tasks`` tasks: re-issues first, then newly admitted ones, then eval tasks.

        An eval task goes out only when no training task waits, or as the only one in flight
        (:mod:`.evaluation`): one may come first while none is in flight.
        """
        job = self._job
        leased = []
        if job.eval_rounds and evaluation.in_flight(job) == 0:
            leased = evaluation.lease(job, worker_id, min(1, max_tasks), training_waiting=True)
        leased += admission.lease_tasks(job, worker_id, max_tasks - len(leased))
        if job.eval_rounds:
            leased += evaluation.lease(job, worker_id, max_tasks - len(leased),
                                       training_waiting=admission.has_leasable_tasks(job))
        return leased

    def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        """Extends the leases ``worker_id`` still holds and whose work progresses; the others are reported lost.

        A lease whose work stalled ends here and its work is re-issued (see :func:`.admission.renew`).
        """
        result, stalled = admission.renew(self._job, worker_id, lease_ids, progress)
        if not stalled:
            return result
        return dataclasses.replace(result, stalled_slots=tuple(recovery.expire_stalled(self._job, stalled)))

    def report_task(self, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                    experiences: Sequence[ExperienceSummary], reason: ErrorReason = ErrorReason.UNSPECIFIED,
                    eval_episodes: Sequence[EvalEpisode] = (), failed_episodes: Sequence[FailedEpisode] = ()) -> None:
        """A rollout worker finished or failed a task; see :func:`.reports.report_task` for what it raises.

        An eval task's report (:func:`.evaluation.report`) carries episodes and no experiences; a
        training task's the reverse (else InvalidArgument).
        """
        granted = self._job.leases.get(lease_id)
        if not succeeded or granted is None or granted.kind is not LeaseKind.ROLLOUT_TASK:
            self._job.touch_all()  # a failure or an eval report is rare; a success touches its agents' plans
        if granted is not None and granted.kind is LeaseKind.EVAL_TASK:
            if experiences:
                raise InvalidArgument(f"eval task {task_id!r}: an evaluation stores no experiences")
            evaluation.report(self._job, granted, worker_id, task_id, succeeded, error, eval_episodes, reason)
            return
        if eval_episodes and granted is not None:  # (an unknown lease: NotFound below)
            raise InvalidArgument(f"task {task_id!r}: eval_episodes belong to an eval task's report")
        reports.report_task(self._job, lease_id, worker_id, task_id, succeeded, error, experiences, reason,
                            failed_episodes)

    # ---- demand (demand.py) -----------------------------------------------------------------------------

    def touch_all(self) -> None:
        """Marks every agent's demand as possibly changed (see :meth:`take_touched`)."""
        self._job.touch_all()

    def take_touched(self) -> list[str]:
        """The agents whose demand or trainer work may have changed since the last call (then forgets them)."""
        job = self._job
        if job.touched_all:
            job.touched_all = False
            job.touched.clear()
            return list(job.spec.agent_names)
        if not job.touched:
            return []
        names = list(job.touched)
        job.touched.clear()
        return names

    def demand(self, agent: str) -> AgentDemand:
        """What the agent needs from the trainer pool now."""
        return demand.demand(self._job, agent)

    def data_parallel_demand(self, agent: str) -> AgentDemand:
        """:meth:`demand`, also for an agent between steps (no plan yet): what the binder sizes groups with."""
        return demand.data_parallel_demand(self._job, agent)

    def state_is_portable(self, agent: str) -> bool:
        """Whether another slot could load the agent's committed state without a swap-out first."""
        return demand.state_is_portable(self._job, agent)

    def rollout_demand(self) -> dict[str, int]:
        """Estimated tokens still to generate per agent (leased and admissible tasks)."""
        return demand.rollout_demand(self._job)

    # ---- trainer side (dispatch.py) -------------------------------------------------------------------------

    def current_plan(self, agent: str) -> StepPlan | None:
        """The plan of the step the agent trains next (None when nothing arrived for it yet)."""
        return self._job.current_plan(agent)

    def agent_may_train(self, agent: str, step: int) -> bool:
        """Whether step ``step`` of ``agent`` may be trained now (not in ``sequential`` mode before its turn)."""
        return dispatch.agent_may_train(self._job, agent, step)

    def slot_busy(self, slot_id: str) -> bool:
        """Whether some step has work in flight on the slot (a leased micro-batch or an optimizer step)."""
        return dispatch.slot_busy(self._job, slot_id)

    def busy_slots(self) -> set[str]:
        """Every slot :meth:`slot_busy` is true of (one pass over the steps: the gauges ask for all slots)."""
        return dispatch.busy_slots(self._job)

    def next_trainer_work(self, agent: str, slot_id: str, worker_id: str,
                          group: DataParallelGroup | None = None
                          ) -> MicroBatchWork | OptimizerStepWork | WarmStartWork | None:
        """Work for a slot bound to ``agent`` (see :func:`.dispatch.next_trainer_work`), or None."""
        work = dispatch.next_trainer_work(self._job, agent, slot_id, worker_id, group)
        if isinstance(work, WarmStartWork):
            self._job.touch(agent)  # a warm start went out (its demand moves from pending to in flight)
        return work

    def ack_micro_batch(self, lease_id: str, worker_id: str, slot_id: str, episodes: int) -> None:
        """A micro-batch's gradients are accumulated in the slot; see :func:`.dispatch.ack_micro_batch`."""
        granted = self._job.leases.get(lease_id)
        if granted is None or granted.kind is not LeaseKind.MICRO_BATCH:
            self._job.touch_all()
        dispatch.ack_micro_batch(self._job, lease_id, worker_id, slot_id, episodes)

    def commit_step(self, worker_id: str, slot_id: str, agent: str, step: int, new_version: int,
                    weights_uri: str, state_uri: str, loss: float = 0.0, grad_norm: float = 0.0,
                    step_seconds: float = 0.0, figures: Mapping[str, float] | None = None) -> None:
        """Version ``new_version`` of the agent is published (0: its warm start); see :func:`.dispatch.commit_step`."""
        self._job.touch_all()  # a version moves: plans, sequential turns, evaluation, the job's state
        dispatch.commit_step(self._job, worker_id, slot_id, agent, step, new_version, weights_uri, state_uri,
                             loss, grad_norm, step_seconds, figures)

    def release_slot(self, agent: str) -> None:
        """The agent leaves its slot between steps (binding change)."""
        self._job.touch(agent)
        dispatch.release_slot(self._job, agent)

    def record_swap_out(self, agent: str, state_uri: str) -> None:
        """A slot saved the agent's committed state at ``state_uri``."""
        self._job.touch_all()
        dispatch.record_swap_out(self._job, agent, state_uri)
