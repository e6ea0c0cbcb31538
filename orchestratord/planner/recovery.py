"""When something ends early: expiries, dead slots and workers, step replays, orchestrator restarts.

After a restart, :func:`recover` rebuilds a job's progress from the experiences stored holds.
"""

from __future__ import annotations

import heapq
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.experience import ExperienceSummary
from flexmarl.ids import ExperienceKey, TaskRef
from orchestratord.failures import FailureFigures
from orchestratord.leases import Lease, LeaseKind, LeaseStatus
from orchestratord.planner import evaluation, warm_start
from orchestratord.planner.admission import requeue_task
from orchestratord.planner.dispatch import micro_batch_of_lease
from orchestratord.planner.ids import task_index_of
from orchestratord.planner.job_plan import JobPlan, MicroBatchStatus, StepPlan, Task, TaskStatus
from orchestratord.planner.manifests import complete_task, fill_steps, place_given_up, place_task
from orchestratord.planner.reports import validate_groups

logger = logging.getLogger(__name__)


def tick(job: JobPlan) -> list[str]:
    """Expires overdue leases and optimizer steps; returns slots whose work expired (treat as dead)."""
    dead_slots: list[str] = []
    if job.state.terminal:  # an on-demand evaluation round may still run (planner.evaluation)
        for lease in job.leases.due():
            if lease.kind is LeaseKind.EVAL_TASK and evaluation.evaluable(job):
                expire_lease(job, lease, "deadline passed")
        return dead_slots
    for lease in job.leases.due():
        dead = expire_lease(job, lease, "deadline passed")
        if dead:
            dead_slots.append(dead)
    now_s = job.now_s()
    # Only plans whose optimizer deadline passed (JobPlan.optimizer_deadlines: O(expired) per tick, not O(plans)),
    # replayed in the plans' order.
    expired: set[tuple[str, int]] = set()
    deadlines = job.optimizer_deadlines
    while deadlines and deadlines[0][0] < now_s:
        deadline_s, key = heapq.heappop(deadlines)
        plan = job.plans.get(key)
        if plan is not None and plan.optimizer_deadline_s == deadline_s:
            expired.add(key)
    if expired:
        for key, plan in list(job.plans.items()):
            if key in expired and plan.optimizer_deadline_s is not None and now_s > plan.optimizer_deadline_s:
                dead_slots.append(plan.slot_id)
                replay(job, plan, f"optimizer step not committed in time on slot {plan.slot_id}")
    return dead_slots


def expire_lease(job: JobPlan, lease: Lease, reason: str) -> str:
    """Ends an active lease as expired and re-issues its work; returns the slot it leaves dead ("" for a task)."""
    job.touch_all()
    job.leases.end(lease, LeaseStatus.EXPIRED, reason)
    if lease.kind is LeaseKind.ROLLOUT_TASK:
        requeue_task(job, lease.subject, f"lease expired ({reason})")
        return ""
    if lease.kind is LeaseKind.EVAL_TASK:
        evaluation.requeue(job, lease.subject, f"lease expired ({reason})")
        return ""
    if lease.kind is LeaseKind.WARM_START:
        return warm_start.lost(job, lease.subject, f"warm-start lease {lease.lease_id} expired ({reason})") or ""
    found = micro_batch_of_lease(job, lease)
    if found is None:
        return ""
    plan, mb = found
    dead = mb.slot_id or plan.slot_id
    replay(job, plan, f"micro-batch lease {lease.lease_id} expired on slot {dead} ({reason})")
    return dead


def expire_stalled(job: JobPlan, stalled: Iterable[Lease]) -> list[str]:
    """Ends leases whose work made no progress within the job's bound (:func:`.admission.renew`).

    They go the way of an expired lease: a task is re-issued, trainer work replayed on another slot,
    and the slot that held it is returned as dead (alive but hung: it gets no more work until it polls
    again). A late report or ack of the hung holder is refused, as after any expiry.
    """
    dead: list[str] = []
    now_s = job.now_s()
    for lease in stalled:
        reason = (f"no progress for {lease.stalled_s(now_s):.0f} s "
                  f"(leases.progress_timeout_s {job.spec.leases.progress_timeout_s:g})")
        logger.warning("lease %s of %s held by %s: %s; not renewed, its work is re-issued",
                       lease.lease_id, lease.subject, lease.holder, reason)
        slot = expire_lease(job, lease, reason)
        if slot:
            dead.append(slot)
    return dead


def slot_lost(job: JobPlan, slot_id: str, reason: str) -> None:
    """A trainer slot died or failed: steps with work on it restart from the last committed version."""
    warm_start.slot_lost(job, slot_id, reason)
    for plan in list(job.plans.values()):
        if slot_id not in plan.members:
            continue
        if plan.mid_step:
            replay(job, plan, reason)
        else:
            plan.slot_id = ""
            plan.group = None


def revoke_worker(job: JobPlan, worker_id: str) -> None:
    """A rollout worker died: its task leases end now and the tasks are re-issued.

    The job fails when the worker's memory held the only copy of an agent's training state.
    """
    for lease in job.leases.held_by(worker_id):
        if lease.kind is LeaseKind.ROLLOUT_TASK:
            job.leases.end(lease, LeaseStatus.REVOKED, f"worker {worker_id} gone")
            requeue_task(job, lease.subject, f"worker {worker_id} gone")
        elif lease.kind is LeaseKind.EVAL_TASK:
            job.leases.end(lease, LeaseStatus.REVOKED, f"worker {worker_id} gone")
            evaluation.requeue(job, lease.subject, f"worker {worker_id} gone")
    for agent in job.agents.values():
        if agent.state_worker_id == worker_id:
            job.fail(f"training state of agent {agent.name!r} at version {agent.version} was only in the "
                     f"memory of worker {worker_id}, which is gone ({agent.state_uri})")


def replay(job: JobPlan, plan: StepPlan, reason: str) -> None:
    """Starts a new attempt of a step: every micro-batch again, same manifest, from the committed version."""
    job.touch_all()
    for mb in plan.micro_batches:
        lease = job.leases.get(mb.lease_id) if mb.lease_id else None
        if lease is not None:
            job.leases.end(lease, LeaseStatus.REVOKED, f"step replayed: {reason}")
        plan.set_status(mb, MicroBatchStatus.READY, lease_id="", slot_id="")
    plan.attempt += 1
    plan.slot_id = ""
    plan.group = None
    plan.optimizer_issued = set()
    plan.optimizer_deadline_s = None
    logger.warning("job %s: replaying step %d of agent %s (attempt %d): %s",
                   job.job_id, plan.step, plan.agent, plan.attempt, reason)
    if plan.attempt >= job.options.max_step_attempts:
        job.fail(f"step {plan.step} of agent {plan.agent!r} failed {plan.attempt} times (last: {reason})")


def restore_failures(job: JobPlan, totals: FailureFigures) -> None:
    """The failure figures of a restored job: ``totals`` (durable) over the steps every agent committed.

    A step whose manifest was fixed has its figures in the manifest; those of the other steps are
    rebuilt by :func:`recover` from what stored holds, without their reasons.
    """
    job.failures_committed = totals
    min_version = job.min_version()
    for (_, step), manifest in job.persisted_manifests.items():
        if step >= min_version and manifest.failures is not None:
            job.step_failures.setdefault(step, manifest.failures)


def _count_recovered(job: JobPlan, known: frozenset[int], task: Task, step: int | None,
                     experiences: Sequence[ExperienceSummary]) -> None:
    """Counts the episodes a recovered task had dropped (those stored holds nothing of), unless its step's are known."""
    if step is not None and step in known:
        return
    dropped = job.spec.batch.group_size - len({exp.sample_index for exp in experiences})
    if dropped > 0:
        job.count_failure(task, f"task {task.task_id}: {dropped} episodes dropped before orchestratord restarted "
                                f"(reasons not kept)", episodes=dropped, step=step)


def recover(job: JobPlan, reported: Iterable[ExperienceSummary], consumed_by: Mapping[str, int] | None = None) -> int:
    """Marks done the tasks whose experiences stored already holds (after a restore).

    ``reported`` = every experience of the job in stored. A task counts as
    done when it has a complete, valid group for every agent (its episodes but those dropped
    as their reward failed); anything partial is re-issued. Under ``step_fill: batch`` a task of
    a step whose manifest was fixed of which stored holds nothing was given up
    (:func:`.manifests.give_up_task`) and is again. Returns the number of tasks recovered.
    """
    if job.state.terminal:
        return 0
    by_task: dict[str, list[ExperienceSummary]] = defaultdict(list)
    for exp in reported:
        by_task[exp.task_id].append(exp)
    known = frozenset(job.step_failures)  # (restore_failures: the steps whose manifests were fixed)
    if job.spec.pipeline.fills_by_completion:
        return _recover_completion_fill(job, by_task, consumed_by or {}, known)
    prompts = job.spec.batch.prompts_per_step
    min_version = job.min_version()
    recovered = 0
    for task_id in sorted(by_task):
        ref = TaskRef.of_job(job.job_id, task_id)
        if ref is None:
            continue
        batch, position = ref.batch, ref.position
        if batch < min_version or batch >= job.spec.total_steps or position >= prompts:
            continue
        task = job.tasks.get(task_id)
        if task is None:
            task = Task(task_id, batch, position, task_index_of(batch, position, prompts))
        if task.status is TaskStatus.DONE:
            continue
        try:
            groups = validate_groups(job, task, by_task[task_id], check_staleness=True, step=batch)
        except (InvalidArgument, FailedPrecondition) as rejection:
            logger.info("not recovering task %s: %s", task_id, rejection)
            continue
        job.tasks[task_id] = task
        _count_recovered(job, known, task, batch, by_task[task_id])
        complete_task(job, task, groups)
        recovered += 1
    _recover_given_up(job, by_task, known)
    return recovered


def _recover_given_up(job: JobPlan, by_task: Mapping[str, object], known: frozenset[int]) -> None:
    """``step_fill: batch``: the tasks of fixed steps that stored holds nothing of were given up; so they are again.

    A step's manifest is fixed once each of its tasks is done or given up, and a done task's
    experiences are durable in stored before it is reported, so such a task was given up: it
    takes its empty place again rather than being played again (a second play, a flaky reward
    passing this time, would not rebuild the persisted manifest).
    """
    prompts = job.spec.batch.prompts_per_step
    min_version = job.min_version()
    for step in sorted({step for (_, step) in job.persisted_manifests if min_version <= step < job.spec.total_steps}):
        for position in range(prompts):
            task_id = str(TaskRef(job.job_id, step, position))
            task = job.tasks.get(task_id)
            if task_id in by_task or (task is not None and task.status is TaskStatus.DONE):
                continue
            task = task or Task(task_id, step, position, task_index_of(step, position, prompts))
            job.tasks[task_id] = task
            if step not in known:  # (its dropped episodes are not known)
                job.count_failure(task, f"task {task_id} given up before orchestratord restarted (reason not kept)",
                                  tasks=1)
            place_given_up(job, task, "given up before orchestratord restarted")


def _recover_completion_fill(job: JobPlan, by_task: dict[str, list[ExperienceSummary]],
                             consumed_by: Mapping[str, int], known: frozenset[int]) -> int:
    """:func:`recover` under ``pipeline.step_fill: completion``, where a task's step is not its batch.

    The persisted manifests say where the tasks of every full step went: those of a step some
    agent still has to train join it again (the rebuilt manifest must equal the persisted one);
    those of steps every agent committed are consumed. The other done tasks are placed again as
    they would be on arrival (:func:`fill_steps`), so a step that was not full may take other
    tasks than before; nothing trained depends on that. Admission goes on after the highest task
    stored holds (tasks that were running are abandoned, not re-run: any task may fill a step), and
    the tasks admitted before that fill no step are replaced (:func:`_count_replaced`). It goes on above the tasks
    that filled any step on record too, whose experiences stored may have garbage-collected: a task id is
    never used twice.
    Where a step's manifests were archived away, ``consumed_by`` (stored's record of the step that
    consumed each experience) tells the same.
    """
    prompts = job.spec.batch.prompts_per_step
    min_version = job.min_version()
    step_of: dict[str, int] = dict(consumed_by)
    for (_, step), manifest in job.persisted_manifests.items():
        for eid in manifest.experience_ids:
            step_of[eid] = step
    # Task numbers go on above every task that filled a step still on record (its manifest, or stored's mark
    # of the step that consumed it), though stored may have collected its experiences: a task admitted again
    # under a used id would give its experiences the ids of consumed ones, which a later restart would take
    # for consumed and drop.
    for experience_id in step_of:
        job.admitted = max(job.admitted, _task_number(job, experience_id) + 1)
    full_steps = {step for (_, step) in job.persisted_manifests}
    job.open_step = min_version
    while job.open_step in full_steps:
        job.open_step += 1
    recovered = 0
    for task_id in sorted(by_task):
        ref = TaskRef.of_job(job.job_id, task_id)
        if ref is None or ref.position >= prompts:
            continue
        job.admitted = max(job.admitted, task_index_of(ref.batch, ref.position, prompts) + 1)
        steps = {step_of.get(exp.experience_id) for exp in by_task[task_id]}
        placed = next(iter(steps)) if len(steps) == 1 else None
        if placed is not None and placed < min_version:
            continue  # consumed by a step every agent committed
        task = job.tasks.get(task_id) or Task(task_id, ref.batch, ref.position,
                                              task_index_of(ref.batch, ref.position, prompts))
        if task.status is TaskStatus.DONE:
            continue
        try:
            groups = validate_groups(job, task, by_task[task_id], check_staleness=placed is not None, step=placed)
        except (InvalidArgument, FailedPrecondition) as rejection:
            logger.info("not recovering task %s: %s", task_id, rejection)
            continue
        job.tasks[task_id] = task
        task.status = TaskStatus.DONE
        job.tasks_done_total += 1
        _count_recovered(job, known, task, placed, by_task[task_id])
        recovered += 1
        if placed is not None:
            place_task(job, task, placed, groups)
        else:
            job.unplaced.append((task, groups))  # placed below, as on arrival
    fill_steps(job)
    _count_replaced(job)
    return recovered


def _task_number(job: JobPlan, experience_id: str) -> int:
    """The admission number of the task of one of ``job``'s experiences (-1 for an id of no task of the job)."""
    try:
        ref = TaskRef.of_job(job.job_id, ExperienceKey.parse(experience_id).task_id)
    except InvalidArgument:
        return -1
    return -1 if ref is None else task_index_of(ref.batch, ref.position, job.spec.batch.prompts_per_step)


def _count_replaced(job: JobPlan) -> None:
    """``step_fill: completion``: the admitted tasks that fill no step, after a restart (``JobPlan.tasks_replaced``).

    Of the tasks admitted, ``min_version x prompts_per_step`` filled the steps every agent committed
    and the recovered ones fill the open steps; every other one fills none: given up (the open
    step's are forgotten with their figures, stored holding nothing of them), dropped as too
    stale, or running at the restart (abandoned). Each is replaced, so the open steps get exactly
    the places left of the admission rule's ``(eta + 1) x prompts_per_step``: with fewer, and one
    trainer slot, an agent part-way through step ``v + eta`` would hold the slot for good waiting
    for its last tasks, and the agent still to commit step ``v`` would never get it. Counted from
    what fills the steps, not from the task numbers stored lacks: those of committed steps may
    have been garbage-collected.
    """
    filling = sum(count for step, count in job.tasks_per_step.items() if step >= job.min_version())
    known = job.min_version() * job.spec.batch.prompts_per_step + filling + len(job.unplaced)
    job.admitted = max(job.admitted, known)  # task numbers go on above every task known to be admitted
    job.tasks_replaced = job.admitted - known
