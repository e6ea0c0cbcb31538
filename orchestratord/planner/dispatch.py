"""Trainer side: micro-batches and optimizer steps handed to slots, their acks, and step commits."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.ids import MicroBatchRef, StepAttemptRef
from orchestratord.binding import DataParallelGroup
from orchestratord.failures import FailureFigures
from orchestratord.leases import Lease, LeaseKind, LeaseStatus
from orchestratord.planner import evaluation, warm_start
from orchestratord.planner.ids import is_durable_state
from orchestratord.planner.job_plan import JobPlan, MicroBatch, MicroBatchStatus, StepPlan
from orchestratord.planner.manifests import needs_step_statistics
from orchestratord.planner.types import MicroBatchWork, OptimizerStepWork, WarmStartWork
from orchestratord.state import StateMoved, StepCommit, StepCommitted


def agent_may_train(job: JobPlan, agent: str, step: int) -> bool:
    """Whether step ``step`` of ``agent`` may be trained now.

    Always, except in ``sequential`` mode, where agent k's step t waits for
    agent k-1's commit of step t (see the package docstring).
    """
    if job.spec.pipeline.mode != "sequential":
        return True
    names = job.spec.agent_names
    index = names.index(agent)
    return index == 0 or job.agents[names[index - 1]].version > step


def next_trainer_work(job: JobPlan, agent: str, slot_id: str, worker_id: str, group: DataParallelGroup | None = None
                      ) -> MicroBatchWork | OptimizerStepWork | WarmStartWork | None:
    """Work for a slot bound to ``agent``: its warm start, its micro-batch again (lost), a new one, the step.

    ``group`` = the agent's slots now (None or one member = this slot alone). An
    attempt's group is fixed when its first work is issued; each member holds at
    most one micro-batch at a time, and every member gets the optimizer step.
    """
    if job.state.terminal:
        return None
    if warm_start.pending(job, agent):
        return warm_start.next_work(job, agent, slot_id, worker_id)
    plan = job.current_plan(agent)
    if plan is None or not agent_may_train(job, agent, plan.step):
        return None
    members = plan.members
    if members and slot_id not in members:
        return None
    if not members and group is not None and slot_id not in group.members:
        return None
    held = plan.leased_to(slot_id)
    if held is not None:
        lease = job.leases.get(held.lease_id)
        if lease is not None and lease.holder == worker_id:
            return _micro_batch_work(job, plan, held, lease)  # lost response: deliver again
        return None
    if plan.group is None and (group is None or group.world_size == 1) and plan.leased_count:
        return None  # one slot: one micro-batch at a time
    ready = plan.first_ready_micro_batch()
    if ready is not None:
        _start_attempt(plan, slot_id, group)
        return _lease_micro_batch(job, plan, ready, slot_id, worker_id)
    if plan.ready_for_optimizer and plan.manifest is not None:
        _start_attempt(plan, slot_id, group)
        rank = plan.group.rank_of(slot_id) if plan.group is not None else 0
        if rank > 0 and slot_id in plan.optimizer_issued:
            return None  # a member waits for rank 0's commit
        plan.optimizer_issued.add(slot_id)
        if plan.optimizer_deadline_s is None:
            plan.optimizer_deadline_s = job.now_s() + job.spec.leases.train_timeout_s
            heapq.heappush(job.optimizer_deadlines, (plan.optimizer_deadline_s, (agent, plan.step)))
            job.touch(agent)
        state = job.agents[agent]
        return OptimizerStepWork(
            job_id=job.job_id, agent=agent, step=plan.step,
            step_id=str(StepAttemptRef(job.job_id, agent, plan.step, plan.attempt, job.epoch)),
            new_version=plan.step + 1,
            step_response_tokens=plan.manifest.step_response_tokens,
            step_episodes=plan.manifest.step_episodes, num_micro_batches=len(plan.micro_batches),
            step_sequences=len(plan.manifest.experience_ids),
            group=plan.group, rank=rank, base_version=state.version, state_uri=state.state_uri,
        )
    return None


def _start_attempt(plan: StepPlan, slot_id: str, group: DataParallelGroup | None) -> None:
    """Fixes the attempt's slots on its first work: the agent's group, or this slot alone."""
    if plan.slot_id:
        return
    if group is not None and group.world_size > 1 and slot_id in group.members:
        plan.group = group
        plan.slot_id = group.primary
    else:
        plan.group = None
        plan.slot_id = slot_id


def _lease_micro_batch(job: JobPlan, plan: StepPlan, mb: MicroBatch, slot_id: str,
                       worker_id: str) -> MicroBatchWork | None:
    eta = job.spec.pipeline.max_staleness
    # step_fill completion with mask_stale_tokens admits older groups: traind masks their tokens older than eta.
    bounded = not (job.spec.pipeline.fills_by_completion and job.spec.rollout.mask_stale_tokens)
    for group in mb.groups:
        # Defence in depth: report validation (or manifests.fill_steps) already enforces this.
        if (bounded and plan.step - group.min_behavior_version > eta) or group.max_behavior_version > plan.step:
            job.fail(f"staleness bound broken: group {group.group_id} (versions "
                     f"{group.min_behavior_version}..{group.max_behavior_version}) in step {plan.step}")
            return None
    subject = str(MicroBatchRef(plan.agent, plan.step, plan.attempt, mb.index))
    lease = job.leases.issue(LeaseKind.MICRO_BATCH, worker_id, subject, job.spec.leases.train_timeout_s)
    plan.set_status(mb, MicroBatchStatus.LEASED, lease_id=lease.lease_id, slot_id=slot_id)
    return _micro_batch_work(job, plan, mb, lease)


def _micro_batch_work(job: JobPlan, plan: StepPlan, mb: MicroBatch, lease: Lease) -> MicroBatchWork:
    agent = job.agents[plan.agent]
    return MicroBatchWork(
        lease_id=lease.lease_id, job_id=job.job_id, agent=plan.agent, step=plan.step,
        step_id=str(StepAttemptRef(job.job_id, plan.agent, plan.step, plan.attempt, job.epoch)),
        micro_batch_index=mb.index,
        experience_ids=mb.experience_ids, base_version=agent.version, state_uri=agent.state_uri,
        step_episodes=job.spec.batch.episodes_per_step, deadline_s=lease.deadline_s,
        group=plan.group, rank=plan.group.rank_of(mb.slot_id) if plan.group is not None else 0,
        step_returns=step_return_statistics(plan) if needs_step_statistics(job, plan.agent) else None,
    )


def step_return_statistics(plan: StepPlan) -> tuple[int, float, float]:
    """(count, mean, unbiased std) of the returns of every experience of the step (``advantage_norm: agent``).

    Exactly rounded sums (``math.fsum``), so the result does not depend on the order the step's
    groups were reported in; the micro-batches were held until the batch completed
    (:func:`orchestratord.planner.manifests.needs_step_statistics`), so every one gets the same.
    traind's ``traind.losses.ReturnStats.of`` computes the same numbers.
    """
    returns = [r for group in plan.groups for r in group.returns]
    count = len(returns)
    if count == 0:
        return 0, 0.0, 0.0
    mean = math.fsum(returns) / count
    std = math.sqrt(math.fsum((r - mean) * (r - mean) for r in returns) / (count - 1)) if count > 1 else 0.0
    return count, mean, std


def micro_batch_of_lease(job: JobPlan, lease: Lease) -> tuple[StepPlan, MicroBatch] | None:
    """The step and micro-batch a micro-batch lease is for; None when its attempt is over."""
    ref = MicroBatchRef.parse(lease.subject)
    plan = job.plans.get((ref.agent, ref.step))
    if plan is None or plan.attempt != ref.attempt:
        return None
    return plan, plan.micro_batches[ref.index]


def ack_micro_batch(job: JobPlan, lease_id: str, worker_id: str, slot_id: str, episodes: int) -> None:
    """A micro-batch's gradients are accumulated in the slot.

    Raises:
        NotFound: unknown lease.
        FailedPrecondition: the lease expired, was revoked (its step is being
            replayed) or belongs to another worker or slot.
        InvalidArgument: ``episodes`` (when non-zero) differs from the micro-batch's.
    """
    job.require_running()
    existing = job.leases.get(lease_id)
    if existing is not None and existing.kind is LeaseKind.MICRO_BATCH \
            and existing.status is LeaseStatus.RELEASED and existing.holder == worker_id:
        found = micro_batch_of_lease(job, existing)
        if found is not None and found[1].slot_id == slot_id:
            return  # a repeated ack of the same attempt
    lease = job.leases.require_active(lease_id, worker_id, LeaseKind.MICRO_BATCH)
    found = micro_batch_of_lease(job, lease)
    if found is None or found[1].slot_id != slot_id:
        raise FailedPrecondition(f"lease {lease_id!r} does not belong to slot {slot_id!r}")
    plan, mb = found
    if episodes and episodes != mb.episodes:
        raise InvalidArgument(f"lease {lease_id!r}: micro-batch has {mb.episodes} episodes, ack says {episodes}")
    job.leases.end(lease, LeaseStatus.RELEASED, "acked")
    plan.set_status(mb, MicroBatchStatus.ACKED)


def commit_step(job: JobPlan, worker_id: str, slot_id: str, agent: str, step: int, new_version: int,
                weights_uri: str, state_uri: str, loss: float = 0.0, grad_norm: float = 0.0,
                step_seconds: float = 0.0, figures: Mapping[str, float] | None = None) -> None:
    """The optimizer step of ``step`` ran on the slot and version ``new_version`` is published.

    ``figures`` are the trainer's other per-step figures (checked by the servicer), kept with
    the commit for its history record.

    Emits StepCommitted; the step's plan and, once every agent committed it, its batch are forgotten.

    ``new_version`` 0 is the agent's warm start instead (:func:`.warm_start.commit`).

    Raises:
        FailedPrecondition: no optimizer step of this step was issued to this
            slot (e.g. the attempt was replayed elsewhere) or the step committed
            differently already.
        InvalidArgument: ``new_version`` is not ``step + 1`` (nor a warm start's 0).
    """
    if new_version == 0:
        warm_start.commit(job, worker_id, slot_id, agent, step, weights_uri, state_uri)
        evaluation.on_version(job)  # version 0 of every agent may now be final: the before_training round
        return
    job.require_running()
    state = job.agent(agent)
    if new_version != step + 1:
        raise InvalidArgument(f"new_version must be step + 1 = {step + 1}, got {new_version}")
    if step < state.version:
        previous = job.commits.get((agent, step))
        if previous is not None and previous.slot_id == slot_id and previous.weights_uri == weights_uri:
            return  # the same commit again
        raise FailedPrecondition(f"step {step} of agent {agent!r} is already committed")
    plan = job.plans.get((agent, step))
    if step > state.version or plan is None or plan.optimizer_deadline_s is None or plan.slot_id != slot_id:
        raise FailedPrecondition(f"no optimizer step {step} of agent {agent!r} was issued to slot {slot_id!r}")
    if not weights_uri:
        raise InvalidArgument("weights_uri: must not be empty")
    commit = StepCommit(job_id=job.job_id, agent=agent, step=step, weights_uri=weights_uri,
                        state_uri=state_uri, slot_id=slot_id, committed_s=job.now_s(), loss=loss,
                        grad_norm=grad_norm, step_seconds=step_seconds,
                        figures=tuple(sorted((figures or {}).items())))
    job.commits[(agent, step)] = commit
    episodes = sum(group.episodes for group in plan.groups) or 1
    experiences = sum(len(group.experience_ids) for group in plan.groups) or 1
    state.version = new_version
    job.changes.append(StepCommitted(commit, plan.manifest or job.persisted_manifests.get((agent, step)),
                                     _commit_failures(job, step)))
    state.weights_uri = weights_uri
    state.state_uri = state_uri
    state.state_worker_id = "" if is_durable_state(state_uri) else worker_id
    state.reward_mean = sum(group.reward_sum for group in plan.groups) / experiences
    state.return_mean = sum(group.return_sum for group in plan.groups) / episodes
    state.staleness_mean = sum((step - group.min_behavior_version) * group.episodes
                               for group in plan.groups) / episodes
    state.step_seconds = step_seconds
    job.updated_s = commit.committed_s
    del job.plans[(agent, step)]
    _prune_batch(job, step)
    evaluation.on_version(job)  # an evaluation round when due; the job succeeds at total_steps (after its last round)


def _commit_failures(job: JobPlan, step: int) -> FailureFigures | None:
    """Once every agent committed ``step``: its failure figures join the job's committed totals.

    Returns the new totals (written with the commit) when the step had failures, else None.
    """
    if job.min_version() <= step:
        return None
    figures = job.step_failures.pop(step, None)
    if not figures:
        return None
    job.failures_committed = job.failures_committed.plus(figures)
    return job.failures_committed


def _prune_batch(job: JobPlan, step: int) -> None:
    """Forgets the tasks of a step once every agent committed it (under step_fill batch: rollout batch ``step``).

    Manifests and commits older than the last ``KEPT_COMMITTED_STEPS`` go too (:meth:`JobPlan.forget_history`).
    """
    if job.min_version() <= step:
        return
    # From the step's indexes (what a walk of every task and lease the job keeps would find): O(the step's work).
    tasks = job.tasks
    gone = {tid for tid in job.task_ids_by_step.pop(step, ()) if (task := tasks.get(tid)) is not None
            and task.step == step}
    for task_id in gone:
        del tasks[task_id]
        job.leases.forget_group(("task", task_id))  # ids.prune_group_of_lease
    job.leases.forget_group(("batch", step))  # its micro-batches' (and batch 0: the warm starts') leases
    job.tasks_per_step.pop(step, None)
    job.forget_history()


def slot_busy(job: JobPlan, slot_id: str) -> bool:
    """Whether some step has work in flight on the slot (a warm start, a leased micro-batch or an optimizer step)."""
    return warm_start.slot_busy(job, slot_id) or any(
        (plan.optimizer_deadline_s is not None and slot_id in plan.members) or slot_id in plan.leased_by_slot
        for plan in job.plans.values())


def busy_slots(job: JobPlan) -> set[str]:
    """Every slot :func:`slot_busy` would call busy, in one pass over the steps (not one per slot)."""
    busy = warm_start.busy_slots(job)
    for plan in job.plans.values():
        if plan.optimizer_deadline_s is not None:
            busy.update(plan.members)
        busy.update(plan.leased_by_slot)
    return busy


def release_slot(job: JobPlan, agent: str) -> None:
    """The agent leaves its slot between steps (binding change)."""
    plan = job.current_plan(agent)
    if plan is not None and not plan.mid_step:
        plan.slot_id = ""
        plan.group = None


def record_swap_out(job: JobPlan, agent: str, state_uri: str) -> None:
    """A slot saved the agent's committed state at ``state_uri`` (emits StateMoved)."""
    state = job.agent(agent)
    if not state_uri:
        raise InvalidArgument("state_uri: must not be empty for a swap-out")
    state.state_uri = state_uri
    state.state_worker_id = "" if is_durable_state(state_uri) else state.state_worker_id
    job.changes.append(StateMoved(job.job_id, agent, state.version, state_uri, job.now_s()))
