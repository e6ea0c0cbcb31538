"""A done task's groups join their steps: the step's manifest is fixed and micro-batches are formed."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from orchestratord.failures import FailureFigures
from orchestratord.planner.job_plan import Group, JobPlan, StepPlan, Task, TaskStatus
from orchestratord.state import ManifestFixed, StepManifest

logger = logging.getLogger(__name__)


def complete_task(job: JobPlan, task: Task, groups: Mapping[str, Group]) -> None:
    """Marks a task done; its validated groups join a step (:func:`place_task`).

    ``pipeline.step_fill: batch``: the step of its rollout batch. ``completion``: the task waits
    with the other done tasks not yet placed and :func:`fill_steps` places them.
    """
    task.status = TaskStatus.DONE
    task.lease_id = ""
    job.retry.discard(task.task_id)
    job.tasks_done_total += 1
    job.given_up_in_a_row = 0
    for name, group in groups.items():
        job.rollout_demand_estimator.observe((job.job_id, name), group.episodes, group.response_tokens)
    if job.spec.pipeline.fills_by_completion:
        job.unplaced.append((task, dict(groups)))
        fill_steps(job)
    else:
        place_task(job, task, task.batch, groups)


def give_up_task(job: JobPlan, task: Task, reason: str) -> None:
    """A task whose episodes' rewards failed until too few were left to train: done, with nothing to train.

    It is not re-issued. ``pipeline.step_fill: batch``: it takes its place in its batch's step
    empty, so the step trains on its other tasks' groups; a step whose every task was given up
    fails the job (it has nothing to train). ``completion``: no step waits for it; another task is
    admitted in its place (:func:`.admission.admission_limit`), and ``prompts_per_step`` tasks given
    up in a row, with none done between them, fail the job. Either way a job whose every reward
    fails ends after about one step's worth of tasks.
    """
    job.count_failure(task, f"task {task.task_id} given up: {reason}", tasks=1)
    job.given_up_in_a_row += 1
    job.touch_all()
    prompts = job.spec.batch.prompts_per_step
    logger.warning("job %s: giving up task %s: %s", job.job_id, task.task_id, reason)
    if job.spec.pipeline.fills_by_completion:
        job.tasks.pop(task.task_id, None)
        job.retry.discard(task.task_id)
        job.tasks_replaced += 1
        if job.given_up_in_a_row >= prompts:
            job.fail(f"{job.given_up_in_a_row} tasks in a row were given up, too few of their episodes left "
                     f"after their rewards failed (last: task {task.task_id}: {reason})")
        return
    place_given_up(job, task, reason)


def place_given_up(job: JobPlan, task: Task, reason: str) -> None:
    """``step_fill: batch``: a given-up task takes its place in its batch's step, empty (see :func:`give_up_task`)."""
    task.status = TaskStatus.DONE
    task.given_up = True
    task.lease_id = ""
    job.retry.discard(task.task_id)
    step = task.batch
    if job.tasks_per_step[step] + 1 == job.spec.batch.prompts_per_step and not any(
            plan.groups for plan in (job.plans.get((name, step)) for name in job.agents) if plan is not None):
        job.fail(f"step {step} has nothing to train: every one of its {job.spec.batch.prompts_per_step} tasks was "
                 f"given up, too few of their episodes left after their rewards failed (last: task "
                 f"{task.task_id}: {reason})")
        return
    place_task(job, task, step, {})


def place_task(job: JobPlan, task: Task, step: int, groups: Mapping[str, Group]) -> None:
    """Adds a done task's groups to ``step`` of their agents; fixes the manifests when the step is full."""
    task.step = step
    job.task_ids_by_step.setdefault(step, []).append(task.task_id)
    job.tasks_per_step[step] += 1
    complete = job.tasks_per_step[step] == job.spec.batch.prompts_per_step
    for name, group in groups.items():
        plan = step_plan(job, name, step)
        plan.groups.append(group)
        plan.unformed.append(group)
        job.touch(name)
    for agent in job.agents.values():
        if agent.version <= step:
            plan = step_plan(job, agent.name, step)
            if complete:
                fix_manifest(job, plan)
            form_micro_batches(job, plan, complete)


def task_deadline(job: JobPlan, groups: Mapping[str, Group]) -> int:
    """The last step a done task may join: its oldest experience's version + ``max_staleness``."""
    oldest = min((group.min_behavior_version for group in groups.values()), default=job.min_version())
    return oldest + job.spec.pipeline.max_staleness


def in_flight_deadline(job: JobPlan, task: Task) -> int:
    """The last step an unfinished task is expected to fit: its lease's version + ``max_staleness``."""
    return task.lease_version + job.spec.pipeline.max_staleness


def fill_steps(job: JobPlan) -> None:
    """``pipeline.step_fill: completion``: puts done tasks into the lowest steps not yet full.

    Earliest deadline first (:func:`task_deadline`, then completion order). Without
    ``rollout.mask_stale_tokens`` the staleness bound holds for every experience: a step keeps
    one place open for each unfinished task that could fit no later step
    (:func:`in_flight_deadline`), so it waits for that task rather than leave it too stale; the
    admission rule (at most ``(eta + v + 1) x prompts_per_step`` tasks leased by version ``v``)
    means such tasks never outnumber the places. A done task already too stale for the open
    step (an experience older than its lease's version: a replica still serving the previous
    version) is dropped (a re-run would report the same experiences: rolloutd reuses durable ones)
    and another task is admitted in its place (``JobPlan.tasks_replaced``); admission is not capped
    at ``total_steps`` batches under this fill, and the tasks still running when the job ends are
    abandoned. With ``mask_stale_tokens`` no place is kept: the step takes the first tasks to
    finish, and traind gives tokens older than the bound zero weight.
    """
    prompts = job.spec.batch.prompts_per_step
    masked = job.spec.rollout.mask_stale_tokens
    while job.unplaced and job.open_step < job.spec.total_steps and not job.state.terminal:
        step = job.open_step
        job.unplaced.sort(key=lambda entry: task_deadline(job, entry[1]))  # stable: completion order within
        task, groups = job.unplaced[0]
        if not masked and task_deadline(job, groups) < step:
            job.unplaced.pop(0)
            _drop_too_stale(job, task, step)
            continue
        held = 0 if masked else sum(
            1 for t in job.tasks.values()
            if t.status is not TaskStatus.DONE and t.step is None and in_flight_deadline(job, t) <= step)
        if prompts - job.tasks_per_step[step] - held <= 0:
            return  # the rest of the step is held for unfinished tasks that fit no later step
        job.unplaced.pop(0)
        place_task(job, task, step, groups)
        if job.tasks_per_step[step] == prompts:
            job.open_step = step + 1


def _drop_too_stale(job: JobPlan, task: Task, step: int) -> None:
    """Forgets a done task that no open step can take (its lease ended with its report)."""
    job.tasks.pop(task.task_id, None)
    job.tasks_replaced += 1
    job.touch_all()  # a step may now expect fewer groups
    logger.warning("job %s: dropping task %s: its oldest experience is too stale for step %d (max_staleness %d); "
                   "the admission rule leases another task in its place",
                   job.job_id, task.task_id, step, job.spec.pipeline.max_staleness)


def step_plan(job: JobPlan, agent: str, step: int) -> StepPlan:
    """The plan of a step, created empty on first use."""
    plan = job.plans.get((agent, step))
    if plan is None:
        plan = StepPlan(agent, step, touched=job.touched)
        job.touch(agent)
        job.plans[(agent, step)] = plan
    return plan


def fix_manifest(job: JobPlan, plan: StepPlan) -> None:
    """Fixes the step's manifest once its batch is complete (emits ManifestFixed the first time).

    After a restore the recovered groups must rebuild the persisted manifest exactly, else the job fails.
    """
    if plan.manifest is not None:
        return
    manifest = StepManifest(
        job_id=job.job_id, agent=plan.agent, step=plan.step,
        experience_ids=tuple(sorted(eid for group in plan.groups for eid in group.experience_ids)),
        step_episodes=sum(group.episodes for group in plan.groups),
        step_response_tokens=sum(group.response_tokens for group in plan.groups),
        failures=job.step_failures.get(plan.step, FailureFigures()),
    )
    persisted = job.persisted_manifests.get((plan.agent, plan.step))
    if persisted is not None and persisted != manifest:
        job.fail(f"step {plan.step} of agent {plan.agent!r}: recovered experiences do not match the "
                 f"stored manifest")
        return
    plan.manifest = manifest
    job.touch(plan.agent)
    if persisted is None:
        job.persisted_manifests[(plan.agent, plan.step)] = manifest
        job.changes.append(ManifestFixed(manifest))


def needs_step_statistics(job: JobPlan, agent: str) -> bool:
    """Whether the agent's advantages need its whole step's returns (``advantage_norm: agent``, Dr. MAS).

    Its micro-batches are then held until the step's batch is complete, so that every one is sent
    with the same exact statistics (docs/training.md, "Credit assignment").
    """
    return job.advantage_norms[agent] == "agent"


def form_micro_batches(job: JobPlan, plan: StepPlan, batch_complete: bool) -> None:
    """Complete groups -> micro-batches of ``micro_batch_size`` episodes.

    Async: as soon as enough groups arrived (arrival order); the remainder
    when the batch completes. Barrier modes (sync, sequential, static), and
    an agent that needs its step's statistics (:func:`needs_step_statistics`):
    only when the batch is complete, in task order.
    """
    per_micro_batch = job.spec.batch.groups_per_micro_batch
    if job.spec.pipeline.barrier or needs_step_statistics(job, plan.agent):
        if not batch_complete:
            return
        plan.unformed.sort(key=lambda group: group.task_order)
    while len(plan.unformed) >= per_micro_batch or (batch_complete and plan.unformed):
        taken, plan.unformed = plan.unformed[:per_micro_batch], plan.unformed[per_micro_batch:]
        plan.add_micro_batch(tuple(taken))
