"""A done task's groups join their steps: the step's manifest is fixed and micro-batches are formed."""

from __future__ import annotations

from collections.abc import Mapping

from orchestratord.planner.job_plan import Group, JobPlan, MicroBatch, StepPlan, Task, TaskStatus
from orchestratord.state import ManifestFixed, StepManifest


def complete_task(job: JobPlan, task: Task, groups: Mapping[str, Group]) -> None:
    """Marks a task done and adds its validated groups to the steps of its batch."""
    task.status = TaskStatus.DONE
    task.lease_id = ""
    job.retry.discard(task.task_id)
    job.tasks_done_total += 1
    job.done_per_batch[task.batch] += 1
    complete = job.done_per_batch[task.batch] == job.spec.batch.prompts_per_step
    for name, group in groups.items():
        job.rollout_demand_estimator.observe((job.job_id, name), group.episodes, group.response_tokens)
        plan = step_plan(job, name, task.batch)
        plan.groups.append(group)
        plan.unformed.append(group)
    for agent in job.agents.values():
        if agent.version <= task.batch:
            plan = step_plan(job, agent.name, task.batch)
            if complete:
                fix_manifest(job, plan)
            form_micro_batches(job, plan, complete)


def step_plan(job: JobPlan, agent: str, step: int) -> StepPlan:
    """The plan of a step, created empty on first use."""
    plan = job.plans.get((agent, step))
    if plan is None:
        plan = StepPlan(agent, step)
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
    )
    persisted = job.persisted_manifests.get((plan.agent, plan.step))
    if persisted is not None and persisted != manifest:
        job.fail(f"step {plan.step} of agent {plan.agent!r}: recovered experiences do not match the "
                 f"stored manifest")
        return
    plan.manifest = manifest
    if persisted is None:
        job.persisted_manifests[(plan.agent, plan.step)] = manifest
        job.changes.append(ManifestFixed(manifest))


def needs_step_statistics(job: JobPlan, agent: str) -> bool:
    """Whether the agent's advantages need its whole step's returns (``advantage_norm: agent``, Dr. MAS).

    Its micro-batches are then held until the step's batch is complete, so that every one is sent
    with the same exact statistics (docs/training.md, "Credit assignment").
    """
    return job.spec.algorithm_of(agent).advantage_norm == "agent"


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
        plan.unformed.sort(key=lambda group: group.position)
    while len(plan.unformed) >= per_micro_batch or (batch_complete and plan.unformed):
        taken, plan.unformed = plan.unformed[:per_micro_batch], plan.unformed[per_micro_batch:]
        plan.micro_batches.append(MicroBatch(len(plan.micro_batches), tuple(taken)))
