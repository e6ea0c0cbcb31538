"""Held-out evaluation rounds (``evaluation:`` in the job spec): created at versions, leased beside training.

When the team's version (the lowest committed version over the agents) reaches a multiple of
``every_versions``, the final version (``total_steps``), or 0 with ``before_training`` (once every
warm start committed), :func:`on_version` opens a round: ``tasks`` eval tasks
(:class:`flexmarl.ids.EvalTaskRef`, task ``i`` plays ``Environment.eval_task(i)``), each
``samples_per_task`` episodes on at least the agents' committed versions of that moment.

Eval tasks go through the rollout-task lease machinery under their own lease kind
(``LeaseKind.EVAL_TASK``): renewed with the task leases, re-issued when the lease expires or its
worker dies, a late report refused. They never starve training: :func:`lease` hands one out only
when the job has no training task to hand out, except that one eval task may be in flight at any
time (so rounds progress while rollouts are the bottleneck). An eval task's report carries
episode outcomes and never experiences: nothing of a round is stored or joins a step.

An on-demand round (``flexmarl eval``, :func:`open_on_demand`) plays exactly the versions it was
asked for (kept ones: the coordinator checks ``checkpoint.keep_*``), also after the job succeeded;
rolloutd serves them under agent keys of their own, so older weights never replace the training
agents' newer ones. It does not hold the job's success back.

A task that fails ``max_task_attempts`` times is given up (counted in the round's
``failed_tasks``), never failing the job. When every task of a round reported or was given up,
the round's :class:`flexmarl.evaluation.EvalRecord` is emitted (``EvalRecorded``, durable before
the reply). A job with ``evaluation`` succeeds only once its final round is recorded
(:func:`maybe_succeed`).

Open rounds are durable too (``orchestratord/eval_state.py``): a round is written as it opens
(``EvalRoundOpened``) and each task as it reports or is given up (``EvalTaskFinished``, its
episodes). After an orchestrator restart :func:`restore` rebuilds them, periodic and on-demand: a
finished task is not played again, the others are leased again, and a round whose every task had
finished is recorded at once; the rounds recorded come from etcd and are never reopened.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import get_args

from flexmarl.errors import ErrorReason, FailedPrecondition, InvalidArgument
from flexmarl.evaluation import EvalEpisode, aggregate
from flexmarl.ids import EvalTaskRef, on_demand_round, periodic_round
from flexmarl.jobspec import MAX_EVAL_SAMPLES_PER_TASK, EvalSampling, EvaluationSpec
from orchestratord.eval_state import EvalRoundOpened, EvalTaskFinished, EvalTaskResult, OpenEvalRound
from orchestratord.leases import Lease, LeaseKind, LeaseStatus
from orchestratord.planner import warm_start
from orchestratord.planner.job_plan import EvalRound, EvalTask, JobPlan, TaskStatus
from orchestratord.planner.types import AgentVersion, RolloutTaskLease
from orchestratord.state import EvalRecorded, JobState

logger = logging.getLogger(__name__)

#: Most workflow roles an eval episode may name (``ctx.notes["role_correct"]``).
MAX_ROLES = 64


def due(job: JobPlan, version: int) -> bool:
    """Whether the team's ``version`` gets an evaluation round."""
    spec = job.spec.evaluation
    if spec is None:
        return False
    if version == 0:
        return spec.before_training
    return version % spec.every_versions == 0 or version == job.spec.total_steps


def settings(job: JobPlan) -> EvaluationSpec:
    """The job's evaluation settings (the defaults for an on-demand round of a job without ``evaluation``)."""
    return job.spec.evaluation or EvaluationSpec()


def evaluable(job: JobPlan) -> bool:
    """Whether the job's eval tasks may be leased and reported: while it runs, and (on-demand) once it succeeded."""
    return job.state in (JobState.RUNNING, JobState.SUCCEEDED)


def on_version(job: JobPlan) -> None:
    """After a commit (or at creation / restore): opens the current version's round if due, then maybe succeeds."""
    version = job.min_version()
    round_id = periodic_round(version)
    if (not job.state.terminal and due(job, version) and round_id not in job.eval_done
            and round_id not in job.eval_rounds and not warm_start.any_pending(job)):
        _open_round(job, round_id, version, tuple(job.versions()), settings(job).tasks, on_demand=False)
    maybe_succeed(job)


def open_on_demand(job: JobPlan, pinned: tuple[AgentVersion, ...], tasks: int, eval_file: str = "",
                   eval_sha256: str = "", sampling: str = "", samples_per_task: int = 0) -> str:
    """Opens an on-demand round on exactly the ``pinned`` versions (every agent's); returns its round id.

    ``eval_file`` (with its content's ``eval_sha256``): the held-out tasks are that file's rows.
    ``sampling`` (``greedy`` or ``policy``) and ``samples_per_task`` (episodes per task): the round's own,
    whatever the job's ``evaluation`` says ("" and 0: the job's, or their defaults without the section).

    One at a time per job (a bound on what askers can make the planner hold).

    Raises:
        FailedPrecondition: the job failed or was cancelled, or an on-demand round of it is still open.
        InvalidArgument: not one version per agent, a version the agent has not reached, ``tasks`` < 1, or
            ``sampling`` or ``samples_per_task`` outside what ``evaluation`` accepts.
    """
    if not evaluable(job):
        raise FailedPrecondition(f"job {job.job_id!r} is {job.state.name.lower()}: nothing to evaluate")
    running = [r.round_id for r in job.eval_rounds.values() if r.on_demand]
    if running:
        raise FailedPrecondition(f"job {job.job_id!r}: on-demand evaluation {running[0]} is still running")
    if sorted(v.agent for v in pinned) != sorted(job.agents):
        raise InvalidArgument(f"agent_versions: one version of each agent {sorted(job.agents)}, got "
                              f"{sorted(v.agent for v in pinned)}")
    for version in pinned:
        if not 0 <= version.version <= job.agents[version.agent].version:
            latest = job.agents[version.agent].version
            raise InvalidArgument(f"agent_versions: {version.agent} has versions 0..{latest}, not {version.version}")
    if tasks < 1:
        raise InvalidArgument(f"tasks: must be >= 1, got {tasks}")
    if sampling not in ("", *get_args(EvalSampling)):
        raise InvalidArgument(f"sampling: one of {list(get_args(EvalSampling))} (or empty: the job's), "
                              f"got {sampling!r}")
    if not 0 <= samples_per_task <= MAX_EVAL_SAMPLES_PER_TASK:
        raise InvalidArgument(f"samples_per_task: 1..{MAX_EVAL_SAMPLES_PER_TASK} (or 0: the job's), "
                              f"got {samples_per_task}")
    number = 1 + sum(1 for r in [*job.eval_done, *job.eval_rounds] if r.startswith("d"))
    round_id = on_demand_round(number)
    ordered = tuple(sorted(pinned, key=lambda v: job.spec.agent_names.index(v.agent)))
    _open_round(job, round_id, min(v.version for v in pinned), ordered, tasks, on_demand=True,
                eval_file=eval_file, eval_sha256=eval_sha256, sampling=sampling, samples_per_task=samples_per_task)
    return round_id


def _open_round(job: JobPlan, round_id: str, version: int, agent_versions: tuple[AgentVersion, ...], tasks: int,
                on_demand: bool, eval_file: str = "", eval_sha256: str = "", sampling: str = "",
                samples_per_task: int = 0) -> None:
    spec = settings(job)
    opened = OpenEvalRound(
        round_id=round_id, version=version, agent_versions=tuple((v.agent, v.version, v.weights_uri)
                                                                 for v in agent_versions),
        tasks=tasks, samples_per_task=samples_per_task or spec.samples_per_task, on_demand=on_demand,
        eval_file=eval_file, eval_sha256=eval_sha256, sampling=sampling or spec.sampling)
    _new_round(job, opened)
    job.changes.append(EvalRoundOpened(job.job_id, opened))
    logger.info("job %s: evaluation round %s opened on %s (%d tasks x %d samples, %s)", job.job_id, round_id,
                {v.agent: v.version for v in agent_versions}, tasks, opened.samples_per_task, opened.sampling)


def _new_round(job: JobPlan, opened: OpenEvalRound) -> EvalRound:
    refs = [EvalTaskRef(job.job_id, opened.round_id, index) for index in range(opened.tasks)]
    round_ = EvalRound(
        round_id=opened.round_id, version=opened.version,
        agent_versions=tuple(AgentVersion(job.job_id, a, v, w) for a, v, w in opened.agent_versions),
        tasks={str(ref): EvalTask(str(ref), ref.index) for ref in refs}, on_demand=opened.on_demand,
        samples_per_task=opened.samples_per_task, eval_file=opened.eval_file, eval_sha256=opened.eval_sha256,
        sampling=opened.sampling or settings(job).sampling)
    job.eval_rounds[opened.round_id] = round_
    return round_


def restore(job: JobPlan, rounds: Sequence[OpenEvalRound]) -> None:
    """After a restart, before :func:`on_version`: the rounds that were open, with their finished tasks.

    Only rounds that may still run: a periodic one while the job runs, an on-demand one also after it
    succeeded (:func:`evaluable`); a round whose every task had finished is recorded now.
    """
    for opened in rounds:
        if (opened.round_id in job.eval_done or not evaluable(job)
                or (not opened.on_demand and job.state is not JobState.RUNNING)):
            continue
        round_ = _new_round(job, opened)
        by_index = {task.index: task for task in round_.tasks.values()}
        for result in opened.finished:
            task = by_index.get(result.index)
            if task is None:  # pragma: no cover - a result is written for one of the round's tasks
                continue
            task.status, task.failed = TaskStatus.DONE, result.failed
            round_.episodes.extend(result.episodes)
        logger.info("job %s: evaluation round %s restored, %d of %d tasks finished", job.job_id,
                    opened.round_id, len(opened.finished), opened.tasks)
    for round_ in list(job.eval_rounds.values()):
        _finish_if_done(job, round_)


def maybe_succeed(job: JobPlan) -> None:
    """The job succeeds once every agent reached ``total_steps`` and no periodic evaluation round is open."""
    if (not job.state.terminal and job.min_version() >= job.spec.total_steps
            and not any(not r.on_demand for r in job.eval_rounds.values())):
        job.set_state(JobState.SUCCEEDED, "")
        # Success revokes every lease: an on-demand round's tasks in flight go out again.
        for round_ in job.eval_rounds.values():
            for task in round_.tasks.values():
                if task.status is TaskStatus.LEASED:
                    task.status, task.lease_id = TaskStatus.PENDING, ""


def in_flight(job: JobPlan) -> int:
    """Eval tasks leased now."""
    return sum(1 for r in job.eval_rounds.values() for t in r.tasks.values() if t.status is TaskStatus.LEASED)


def has_leasable(job: JobPlan) -> bool:
    """Whether some round has a task waiting for a lease."""
    return evaluable(job) and any(
        t.status is TaskStatus.PENDING for r in job.eval_rounds.values() for t in r.tasks.values())


def lease(job: JobPlan, worker_id: str, max_tasks: int, training_waiting: bool) -> list[RolloutTaskLease]:
    """Leases up to ``max_tasks`` eval tasks, oldest round first; at most one in flight while training waits."""
    if not evaluable(job) or max_tasks <= 0:
        return []
    allowed = min(max_tasks, max(0, 1 - in_flight(job))) if training_waiting else max_tasks
    leased: list[RolloutTaskLease] = []
    for round_ in list(job.eval_rounds.values()):
        for task in round_.tasks.values():
            if len(leased) >= allowed:
                return leased
            if task.status is TaskStatus.PENDING:
                leased.append(_lease_task(job, round_, task, worker_id))
    return leased


def _lease_task(job: JobPlan, round_: EvalRound, task: EvalTask, worker_id: str) -> RolloutTaskLease:
    task.attempts += 1
    granted = job.leases.issue(LeaseKind.EVAL_TASK, worker_id, task.task_id, job.spec.leases.rollout_timeout_s)
    task.status = TaskStatus.LEASED
    task.lease_id = granted.lease_id
    return RolloutTaskLease(
        lease_id=granted.lease_id, job_id=job.job_id, task_id=task.task_id, task_index=task.index,
        batch_index=round_.version, group_size=round_.samples_per_task, agent_versions=round_.agent_versions,
        deadline_s=granted.deadline_s, attempt=task.attempts, evaluation=True, greedy=round_.sampling == "greedy",
        pinned=round_.on_demand, eval_file=round_.eval_file, eval_sha256=round_.eval_sha256,
    )


def _find(job: JobPlan, task_id: str) -> tuple[EvalRound, EvalTask] | None:
    try:
        ref = EvalTaskRef.parse(task_id)
    except InvalidArgument:
        return None
    round_ = job.eval_rounds.get(ref.round_id)
    task = round_.tasks.get(task_id) if round_ is not None else None
    return (round_, task) if round_ is not None and task is not None else None


def requeue(job: JobPlan, task_id: str, reason: str) -> None:
    """A leased eval task's attempt ended without a result: lease it again, or give it up after too many tries."""
    found = _find(job, task_id)
    if found is None or found[1].status is not TaskStatus.LEASED:
        return
    round_, task = found
    task.lease_id = ""
    if task.attempts >= job.options.max_task_attempts:
        _give_up(job, round_, task, f"after {task.attempts} attempts (last: {reason})")
        return
    logger.info("re-issuing eval task %s after attempt %d: %s", task_id, task.attempts, reason)
    task.status = TaskStatus.PENDING


def _give_up(job: JobPlan, round_: EvalRound, task: EvalTask, why: str) -> None:
    """Gives an eval task up: done, counted in the round's ``failed_tasks``, left out of its metrics."""
    logger.warning("job %s: eval task %s given up %s", job.job_id, task.task_id, why)
    task.status = TaskStatus.DONE
    task.lease_id = ""
    task.failed = True
    job.changes.append(EvalTaskFinished(job.job_id, round_.round_id, EvalTaskResult(task.index, failed=True)))
    _finish_if_done(job, round_)


def report(job: JobPlan, granted: Lease, worker_id: str, task_id: str, succeeded: bool, error: str,
           episodes: Sequence[EvalEpisode], reason: ErrorReason = ErrorReason.UNSPECIFIED) -> None:
    """An eval task finished (its episodes) or failed.

    A failure with reason EPISODES_FAILED (an episode's reward raised or timed out: it would again)
    gives the task up at once; any other is re-issued until ``max_task_attempts``.

    Raises:
        FailedPrecondition: the lease ended, expired or is another worker's (from ``require_active``).
        InvalidArgument: a malformed report (the task is re-issued).
    """
    if not evaluable(job):
        job.require_running()
    held = job.leases.require_active(granted.lease_id, worker_id, LeaseKind.EVAL_TASK)
    if held.subject != task_id:
        raise InvalidArgument(f"lease {held.lease_id!r} is for eval task {held.subject!r}, not {task_id!r}")
    found = _find(job, task_id)
    if found is None:  # pragma: no cover - a held lease's round is open
        raise InvalidArgument(f"eval task {task_id!r} is not open")
    round_, task = found
    if not succeeded:
        job.leases.end(held, LeaseStatus.RELEASED, "failed")
        if reason is ErrorReason.EPISODES_FAILED:
            _give_up(job, round_, task, f"as its rewards failed: {error}")
            return
        requeue(job, task_id, f"worker reported failure: {error}")
        return
    try:
        _validate(job, round_, task, episodes)
    except InvalidArgument:
        job.leases.end(held, LeaseStatus.RELEASED, "rejected")
        requeue(job, task_id, "malformed report")
        raise
    job.leases.end(held, LeaseStatus.RELEASED, "reported")
    task.status = TaskStatus.DONE
    task.lease_id = ""
    round_.episodes.extend(episodes)
    job.changes.append(EvalTaskFinished(job.job_id, round_.round_id, EvalTaskResult(task.index, False,
                                                                                     tuple(episodes))))
    _finish_if_done(job, round_)


def _validate(job: JobPlan, round_: EvalRound, task: EvalTask, episodes: Sequence[EvalEpisode]) -> None:
    where = f"eval task {task.task_id}"
    samples = sorted(e.sample_index for e in episodes)
    if samples != list(range(round_.samples_per_task)):
        raise InvalidArgument(f"{where}: expected episodes 0..{round_.samples_per_task - 1}, got {samples}")
    for episode in episodes:
        if episode.task_index != task.index:
            raise InvalidArgument(f"{where}: episode of task index {episode.task_index}, expected {task.index}")
        for agent, value in episode.returns.items():
            if agent not in job.agents:
                raise InvalidArgument(f"{where}: unknown agent {agent!r}")
            if not math.isfinite(value):
                raise InvalidArgument(f"{where}: return of {agent!r} is {value}")
        if len(episode.role_correct) > MAX_ROLES:
            raise InvalidArgument(f"{where}: role_correct names {len(episode.role_correct)} roles "
                                  f"(at most {MAX_ROLES})")
        for role, share in episode.role_correct.items():
            if not role or len(role) > 64 or not role.isprintable() or not 0.0 <= share <= 1.0:
                raise InvalidArgument(f"{where}: role_correct {role!r}: a share in [0, 1] of a named role, got {share}")
        for agent, versions in episode.versions.items():
            if agent not in job.agents:
                raise InvalidArgument(f"{where}: unknown agent {agent!r}")
            if any(v < 0 or v > job.agents[agent].version for v in versions):
                raise InvalidArgument(f"{where}: versions {list(versions)} of {agent!r}, which is at version "
                                      f"{job.agents[agent].version}")


def _finish_if_done(job: JobPlan, round_: EvalRound) -> None:
    if not round_.done:
        return
    spec = settings(job)
    record = aggregate(
        round_.episodes, agents=job.spec.agent_names,
        agent_versions={v.agent: v.version for v in round_.agent_versions}, version=round_.version,
        tasks=len(round_.tasks), samples_per_task=round_.samples_per_task,
        failed_tasks=sum(1 for t in round_.tasks.values() if t.failed), sampling=round_.sampling,
        success_threshold=spec.success_threshold, finished_unix_ms=int(job.now_s() * 1000), round_id=round_.round_id)
    if round_.eval_file:
        record = dataclasses.replace(record, eval_file=round_.eval_file)
    del job.eval_rounds[round_.round_id]
    job.eval_done.add(round_.round_id)
    job.leases.forget(lease.lease_id for lease in job.leases.all()
                      if lease.kind is LeaseKind.EVAL_TASK and lease.subject in round_.tasks)
    job.changes.append(EvalRecorded(job.job_id, round_.round_id, record.as_dict()))
    logger.info("job %s: evaluation round %s (version %d): team success %.3f over %d episodes", job.job_id,
                round_.round_id, round_.version, record.team.success, record.team.episodes)
    maybe_succeed(job)


