"""Rollout reports: a finished task's experiences are validated, then join their steps."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from flexmarl.errors import ErrorReason, FailedPrecondition, InvalidArgument
from flexmarl.experience import ExperienceSummary, FailedEpisode, min_episodes_to_train, reported_return
from flexmarl.ids import GroupRef
from orchestratord.leases import LeaseKind, LeaseStatus
from orchestratord.planner.admission import requeue_task
from orchestratord.planner.job_plan import Group, JobPlan, Task
from orchestratord.planner.manifests import complete_task, give_up_task


def report_task(job: JobPlan, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                experiences: Sequence[ExperienceSummary], reason: ErrorReason = ErrorReason.UNSPECIFIED,
                failed_episodes: Sequence[FailedEpisode] = ()) -> None:
    """A rollout worker finished a task (experiences durable in stored) or failed it.

    A failure with reason JOB_UNRUNNABLE (the job's environment does not load on the worker)
    fails the job at once: another attempt would fail the same way. ``failed_episodes`` are
    episodes whose reward failed: a finished task trains on its other episodes; a failure with
    reason EPISODES_FAILED (too few were left, :func:`flexmarl.experience.min_episodes_to_train`)
    gives the task up (:func:`.manifests.give_up_task`) instead of re-issuing it. Any other
    failure re-issues the task.

    Raises:
        NotFound: unknown lease.
        FailedPrecondition: the lease expired or is not the caller's; or the
            experiences break the staleness bound (the task is re-issued).
        InvalidArgument: the report is malformed (the task is re-issued).
    """
    job.require_running()
    lease = job.leases.require_active(lease_id, worker_id, LeaseKind.ROLLOUT_TASK)
    if lease.subject != task_id:
        raise InvalidArgument(f"lease {lease_id!r} is for task {lease.subject!r}, not {task_id!r}")
    task = job.tasks[task_id]
    try:
        failed = failed_samples(job, task, failed_episodes, given_up=not succeeded
                                and reason is ErrorReason.EPISODES_FAILED)
    except InvalidArgument as rejection:
        job.leases.end(lease, LeaseStatus.RELEASED, "rejected")
        requeue_task(job, task_id, str(rejection))
        raise
    if not succeeded:
        job.leases.end(lease, LeaseStatus.RELEASED, "failed")
        if reason is ErrorReason.JOB_UNRUNNABLE:
            job.fail(f"the job cannot run: {error} (task {task_id} on {worker_id})")
            return
        if reason is ErrorReason.EPISODES_FAILED:
            _count_failed(job, task, failed_episodes)
            give_up_task(job, task, error)
            return
        requeue_task(job, task_id, f"worker reported failure: {error}")
        return
    try:
        # step_fill completion: the step is chosen when the task is placed (manifests.fill_steps, which checks
        # the staleness bound there).
        step = None if job.spec.pipeline.fills_by_completion else task.batch
        groups = validate_groups(job, task, experiences, check_staleness=True, step=step, failed=failed)
    except (InvalidArgument, FailedPrecondition) as rejection:
        job.leases.end(lease, LeaseStatus.RELEASED, "rejected")
        requeue_task(job, task_id, str(rejection))
        raise
    job.leases.end(lease, LeaseStatus.RELEASED, "reported")
    _count_failed(job, task, failed_episodes)
    complete_task(job, task, groups)


def failed_samples(job: JobPlan, task: Task, failed_episodes: Sequence[FailedEpisode],
                   given_up: bool) -> frozenset[int]:
    """The sample indices of a report's failed episodes, checked: in the group, each once, as many as the outcome says.

    A given-up task (``given_up``) left fewer than :func:`flexmarl.experience.min_episodes_to_train`;
    a finished one at least that many.

    Raises:
        InvalidArgument: an index outside the group or given twice, or a count the outcome contradicts.
    """
    group_size = job.spec.batch.group_size
    indices = [episode.sample_index for episode in failed_episodes]
    bad = [i for i in indices if not 0 <= i < group_size]
    if bad:
        raise InvalidArgument(f"task {task.task_id}: failed episode {bad[0]} is not in [0, {group_size})")
    failed = frozenset(indices)
    if len(failed) != len(indices):
        raise InvalidArgument(f"task {task.task_id}: a failed episode is reported twice ({sorted(indices)})")
    left, needed = group_size - len(failed), min_episodes_to_train(group_size)
    if given_up and left >= needed:
        raise InvalidArgument(f"task {task.task_id}: given up with {left} of {group_size} episodes left "
                              f"({needed} are enough to train)")
    if not given_up and left < needed:
        raise InvalidArgument(f"task {task.task_id}: {len(failed)} of {group_size} episodes failed, fewer than "
                              f"{needed} left to train; report it given up (EPISODES_FAILED)")
    return failed


def _count_failed(job: JobPlan, task: Task, failed_episodes: Sequence[FailedEpisode]) -> None:
    """Counts a report's failed episodes in their step's figures, each with its reason (``JobPlan.count_failure``)."""
    for episode in failed_episodes:
        job.count_failure(task, f"task {task.task_id} episode {episode.sample_index}: {episode.reason}", episodes=1)


def validate_groups(job: JobPlan, task: Task, experiences: Sequence[ExperienceSummary],
                    check_staleness: bool, step: int | None, failed: frozenset[int] | None = None) -> dict[str, Group]:
    """Validates a task's experiences; returns one group per agent that still trains step ``step``.

    ``step``: the step the groups join (``task.batch`` under ``step_fill: batch``); None when not
    known yet (``step_fill: completion``): a group for every agent, no staleness check.
    ``failed``: the episodes reported failed (their rewards failed): every other episode must have
    experiences of every agent. None (a restore, from what stored holds): the episodes some agent
    has experiences of, at least :func:`flexmarl.experience.min_episodes_to_train` of them.

    Raises:
        InvalidArgument: a malformed experience, an episode some agent has no experience of, one
            reported failed that has experiences, or too few episodes.
        FailedPrecondition: an experience of a version the agent has not reached, or too stale.
    """
    group_size = job.spec.batch.group_size
    eta = job.spec.pipeline.max_staleness
    prefix = task.task_id + "/"
    by_agent: dict[str, list[ExperienceSummary]] = defaultdict(list)
    expected_groups = {name: str(GroupRef(task.task_id, name)) for name in job.agents}
    seen: set[str] = set()
    for exp in experiences:  # every report's hot loop (one experience per episode and agent): messages built on error
        expected_group = expected_groups.get(exp.agent)
        if expected_group is None:
            raise InvalidArgument(f"{_where(task, exp)}: unknown agent {exp.agent!r}")
        if exp.experience_id in seen:
            raise InvalidArgument(f"{_where(task, exp)}: reported twice")
        if not exp.experience_id.startswith(prefix):
            raise InvalidArgument(f"{_where(task, exp)}: id must start with {prefix!r}")
        if exp.group_id != expected_group:
            raise InvalidArgument(f"{_where(task, exp)}: group_id must be {expected_group!r}, "
                                  f"got {exp.group_id!r}")
        if not 0 <= exp.sample_index < group_size:
            raise InvalidArgument(f"{_where(task, exp)}: sample_index must be in [0, {group_size}), "
                                  f"got {exp.sample_index}")
        if exp.behavior_version < 0 or exp.response_tokens < 0:
            raise InvalidArgument(f"{_where(task, exp)}: negative behavior_version or response_tokens")
        seen.add(exp.experience_id)
        by_agent[exp.agent].append(exp)
    episodes = (frozenset(range(group_size)) - failed if failed is not None
                else frozenset(exp.sample_index for exp in experiences))
    if len(episodes) < min_episodes_to_train(group_size):
        raise InvalidArgument(f"task {task.task_id}: experiences of {len(episodes)} of {group_size} episodes, fewer "
                              f"than the {min_episodes_to_train(group_size)} a task trains with")
    groups: dict[str, Group] = {}
    for agent in job.agents.values():
        members = by_agent.get(agent.name, [])
        samples = {exp.sample_index for exp in members}
        reported_failed = sorted(samples - episodes)
        if reported_failed:
            raise InvalidArgument(f"task {task.task_id}: agent {agent.name!r} has experiences of episodes "
                                  f"{reported_failed}, reported failed")
        missing = sorted(episodes - samples)
        if missing:
            raise InvalidArgument(f"task {task.task_id}: agent {agent.name!r} has no experience for "
                                  f"episodes {missing} (every episode involves every agent)")
        if step is not None and agent.version > step:
            continue  # this agent already committed that step (after a restore)
        for exp in members:
            if exp.behavior_version > agent.version:
                raise FailedPrecondition(
                    f"task {task.task_id}: experience {exp.experience_id!r} claims version "
                    f"{exp.behavior_version} of agent {agent.name!r}, which is at version {agent.version}")
            if check_staleness and step is not None and step - exp.behavior_version > eta:
                raise FailedPrecondition(
                    f"task {task.task_id}: experience {exp.experience_id!r} of version {exp.behavior_version} "
                    f"is too stale for step {step} (max_staleness {eta})")
        members = sorted(members, key=lambda exp: exp.experience_id)
        groups[agent.name] = Group(
            agent=agent.name, group_id=expected_groups[agent.name], task_id=task.task_id,
            position=task.position, batch=task.batch, experience_ids=tuple(exp.experience_id for exp in members),
            returns=tuple(float(exp.reward) for exp in members),
            episodes=len(episodes), response_tokens=sum(exp.response_tokens for exp in members),
            reward_sum=sum(exp.reward for exp in members),
            return_sum=sum({exp.sample_index: reported_return(exp.reward, exp.episode_return)
                            for exp in members}.values()),
            min_behavior_version=min(exp.behavior_version for exp in members),
            max_behavior_version=max(exp.behavior_version for exp in members),
        )
    return groups


def _where(task: Task, exp: ExperienceSummary) -> str:
    return f"task {task.task_id}: experience {exp.experience_id!r}"
