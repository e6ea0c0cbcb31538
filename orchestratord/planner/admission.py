"""Rollout side: which tasks are admitted (AReaL's staleness rule) and their leases."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from flexmarl.errors import InvalidArgument
from flexmarl.ids import TaskRef
from orchestratord.leases import Lease, LeaseKind, LeaseStatus
from orchestratord.planner import warm_start
from orchestratord.planner.ids import task_index_of
from orchestratord.planner.job_plan import JobPlan, Task, TaskStatus
from orchestratord.planner.types import RenewResult, RolloutTaskLease

logger = logging.getLogger(__name__)


def admission_limit(job: JobPlan) -> int:
    """Tasks that may have been admitted by now: (eta + v + 1) x prompts_per_step (AReaL's rule).

    The rule counts samples (N < (eta + v + 1) * B with B episodes per step);
    every task holds ``group_size`` episodes, so counting tasks against
    ``prompts_per_step`` is the same bound. Sync mode is the barrier: eta = 0. While an agent's
    warm start is not committed the limit is 0: batch 0 is sampled by the warm-started version 0
    (:mod:`orchestratord.planner.warm_start`).
    """
    if warm_start.any_pending(job):
        return 0
    prompts = job.spec.batch.prompts_per_step
    limit = job.spec.rollout_tasks_ahead + job.min_version() * prompts
    if job.spec.pipeline.fills_by_completion:
        # Any task may fill the last steps; what still runs at the end is abandoned. A task that fills no step
        # (given up, dropped as too stale, lost at a restart) is replaced, so that the open steps can fill: with
        # one trainer slot an agent part-way through step v + eta holds it until its step fills.
        return limit + job.tasks_replaced
    return min(limit, job.spec.total_steps * prompts)


def has_leasable_tasks(job: JobPlan) -> bool:
    """Whether :func:`lease_tasks` would hand out a task now (a re-issue or an admissible one)."""
    return not job.state.terminal and (bool(job.retry) or job.admitted < admission_limit(job))


def lease_tasks(job: JobPlan, worker_id: str, max_tasks: int) -> list[RolloutTaskLease]:
    """Leases up to ``max_tasks`` tasks: re-issues first, then newly admitted ones."""
    if job.state.terminal or max_tasks <= 0:
        return []
    leased: list[RolloutTaskLease] = []
    for task_id in sorted(job.retry, key=lambda tid: (job.tasks[tid].batch, job.tasks[tid].position)):
        if len(leased) >= max_tasks:
            break
        leased.append(_lease_task(job, job.tasks[task_id], worker_id))
    prompts = job.spec.batch.prompts_per_step
    while len(leased) < max_tasks and job.admitted < admission_limit(job):
        batch, position = divmod(job.admitted, prompts)
        job.admitted += 1
        task_id = str(TaskRef(job.job_id, batch, position))
        task = job.tasks.get(task_id)
        if task is None:
            task = Task(task_id, batch, position, task_index_of(batch, position, prompts))
            job.tasks[task_id] = task
        if task.status is TaskStatus.PENDING:
            leased.append(_lease_task(job, task, worker_id))
    return leased


def _lease_task(job: JobPlan, task: Task, worker_id: str) -> RolloutTaskLease:
    job.retry.discard(task.task_id)
    task.attempts += 1
    lease = job.leases.issue(LeaseKind.ROLLOUT_TASK, worker_id, task.task_id, job.spec.leases.rollout_timeout_s)
    task.status = TaskStatus.LEASED
    task.lease_id = lease.lease_id
    task.lease_version = job.min_version()
    return RolloutTaskLease(
        lease_id=lease.lease_id, job_id=job.job_id, task_id=task.task_id, task_index=task.task_index,
        batch_index=task.batch, group_size=job.spec.batch.group_size,
        agent_versions=tuple(job.versions()), deadline_s=lease.deadline_s, attempt=task.attempts,
    )


def requeue_task(job: JobPlan, task_id: str, reason: str) -> None:
    """A leased task's attempt ended without a result: lease it again, or fail the job after too many tries."""
    task = job.tasks.get(task_id)
    if task is None or task.status is not TaskStatus.LEASED:
        return
    task.status = TaskStatus.PENDING
    task.lease_id = ""
    if task.attempts >= job.options.max_task_attempts:
        job.fail(f"task {task_id} failed {task.attempts} times (last: {reason})")
        return
    logger.info("re-issuing task %s after attempt %d: %s", task_id, task.attempts, reason)
    job.retry.add(task_id)


def renew(job: JobPlan, worker_id: str, lease_ids: Sequence[str],
          progress: Sequence[int] = ()) -> tuple[RenewResult, list[Lease]]:
    """Extends the leases ``worker_id`` still holds (tasks or micro-batches); the others are reported lost.

    ``progress`` (empty, or one figure per lease id) is the work done under each lease. A lease
    whose progress has not grown for longer than the job's ``leases.progress_timeout_s`` is not
    extended: it is reported lost and returned second, for the caller to end and re-issue
    (:func:`orchestratord.planner.recovery.expire_stalled`). Without figures a renewal shows no progress.

    The hot path of every rolloutd's renew loop (all its leases every 2 s): the clock is read once
    per call, not twice per lease.
    """
    if progress and len(progress) != len(lease_ids):
        raise InvalidArgument(f"progress: {len(progress)} figures for {len(lease_ids)} lease ids")
    now_s = job.now_s()
    leases = job.leases
    bound_s = job.spec.leases.progress_timeout_s
    lost: list[str] = []
    stalled: list[Lease] = []
    deadline_s = math.inf
    for index, lease_id in enumerate(lease_ids):
        lease = leases.get(lease_id)
        if lease is None or lease.status is not LeaseStatus.ACTIVE or lease.holder != worker_id \
                or now_s > lease.deadline_s:
            lost.append(lease_id)
            continue
        if progress:
            leases.record_progress(lease, progress[index], now_s)
        if bound_s > 0 and lease.stalled_s(now_s) > bound_s:
            lost.append(lease_id)
            stalled.append(lease)
            continue
        deadline_s = min(deadline_s, leases.renew(lease, now_s))
    return RenewResult(tuple(lost), now_s if deadline_s == math.inf else deadline_s), stalled
