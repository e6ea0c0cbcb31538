"""Warm starts: an agent's version 0 trained by SFT (``agents[].warm_start``) before any rollout.

A job with warm-start agents admits no rollout task until every one of them has committed its
version 0 (:func:`any_pending`, read by ``admission.admission_limit``), so batch 0 is sampled by
the warm-started models and the behaviour policy of step 0 is the policy it trains (the on-policy
argument of docs/pipeline.md holds from the first step). Meanwhile the agent's demand asks the
binder for a slot (``AgentDemand.warm_start_pending``), and the slot it binds gets one
:class:`WarmStartWork` under a ``WARM_START`` lease of ``leases.train_timeout_s``, which the slot
renews while it works, as it renews a micro-batch's. The slot runs the warm start on a fresh
engine from the base checkpoint (traind/sft.py), publishes its weights and training state as
version 0 and calls CommitStep with ``step 0, new_version 0``; :func:`commit` records them
(:class:`orchestratord.state.WarmStartPublished`, durable before the reply) and admission opens
once no agent of the job still waits.

An expired lease or a lost slot issues the warm start again (its examples and RNG come from the
job seed, so a second run is bit-identical); after ``max_step_attempts`` tries the job fails.
Whether an agent still waits needs no state of its own: its version 0 record has no weights
until the commit, so a restored orchestrator reads it from etcd, and a job resumed from
checkpoints starts from versions that have weights.
"""

from __future__ import annotations

from flexmarl.errors import FailedPrecondition, InvalidArgument
from orchestratord.leases import Lease, LeaseKind, LeaseStatus
from orchestratord.planner.ids import is_durable_state
from orchestratord.planner.job_plan import JobPlan, WarmStartAttempt
from orchestratord.planner.types import WarmStartWork
from orchestratord.state import WarmStartPublished


def pending(job: JobPlan, agent: str) -> bool:
    """Whether the agent has a warm start whose version 0 is not committed yet."""
    state = job.agent(agent)
    return job.agent_specs[agent].warm_start is not None and state.version == 0 and not state.weights_uri


def any_pending(job: JobPlan) -> bool:
    """Whether some agent of the job still waits for its warm start (the job admits no task then)."""
    return job.has_warm_starts and any(pending(job, name) for name in job.agents)


def _held_lease(job: JobPlan, attempt: WarmStartAttempt | None) -> Lease | None:
    """The attempt's lease while it is held, else None."""
    lease = job.leases.get(attempt.lease_id) if attempt is not None and attempt.lease_id else None
    return lease if lease is not None and lease.status is LeaseStatus.ACTIVE else None


def in_flight(job: JobPlan, agent: str) -> bool:
    """Whether a slot holds the agent's warm start now (it must keep the agent until it commits)."""
    return pending(job, agent) and _held_lease(job, job.warm_starts.get(agent)) is not None


def slot_busy(job: JobPlan, slot_id: str) -> bool:
    """Whether the slot runs a warm start of this job now."""
    return any(attempt.slot_id == slot_id and _held_lease(job, attempt) is not None
               for attempt in job.warm_starts.values())


def busy_slots(job: JobPlan) -> set[str]:
    """The slots that run a warm start of this job now (every slot :func:`slot_busy` is true of)."""
    return {attempt.slot_id for attempt in job.warm_starts.values() if _held_lease(job, attempt) is not None}


def next_work(job: JobPlan, agent: str, slot_id: str, worker_id: str) -> WarmStartWork | None:
    """The agent's warm start for a slot bound to it: issued now, again (a lost response), or None (elsewhere)."""
    if job.state.terminal or not pending(job, agent):
        return None
    attempt = job.warm_starts.setdefault(agent, WarmStartAttempt())
    held = _held_lease(job, attempt)
    if held is not None:
        if attempt.slot_id == slot_id and held.holder == worker_id:
            return WarmStartWork(held.lease_id, job.job_id, agent, held.deadline_s)
        return None
    lease = job.leases.issue(LeaseKind.WARM_START, worker_id, agent, job.spec.leases.train_timeout_s)
    attempt.slot_id, attempt.lease_id = slot_id, lease.lease_id
    attempt.attempts += 1
    return WarmStartWork(lease.lease_id, job.job_id, agent, lease.deadline_s)


def commit(job: JobPlan, worker_id: str, slot_id: str, agent: str, step: int, weights_uri: str,
           state_uri: str) -> None:
    """The slot published the agent's warm start as version 0 (emits WarmStartPublished).

    Raises:
        InvalidArgument: ``step`` is not 0, or ``weights_uri`` is empty.
        FailedPrecondition: the agent has no warm start, its version 0 is committed with other
            weights, or no warm start of it is held by this slot (expired, or issued elsewhere).
    """
    job.require_running()
    state = job.agent(agent)
    if step != 0:
        raise InvalidArgument(f"new_version 0 is a warm start, which commits step 0, got step {step}")
    if not weights_uri:
        raise InvalidArgument("weights_uri: must not be empty")
    if job.spec.agent(agent).warm_start is None:
        raise FailedPrecondition(f"agent {agent!r} has no warm_start: only an optimizer step commits it")
    if not pending(job, agent):
        if state.version == 0 and state.weights_uri == weights_uri:
            return  # the same commit again
        raise FailedPrecondition(f"the warm start of agent {agent!r} is already committed")
    attempt = job.warm_starts.get(agent)
    held = _held_lease(job, attempt)
    if attempt is None or held is None or attempt.slot_id != slot_id:
        raise FailedPrecondition(f"no warm start of agent {agent!r} is held by slot {slot_id!r}")
    lease = job.leases.require_active(held.lease_id, worker_id, LeaseKind.WARM_START)
    job.leases.end(lease, LeaseStatus.RELEASED, "committed")
    job.leases.forget([lease.lease_id])
    del job.warm_starts[agent]
    state.weights_uri, state.state_uri = weights_uri, state_uri
    state.initial_weights_uri = weights_uri
    state.state_worker_id = "" if is_durable_state(state_uri) else worker_id
    job.updated_s = job.now_s()
    job.changes.append(WarmStartPublished(job.job_id, agent, weights_uri, state_uri, job.updated_s))


def lost(job: JobPlan, agent: str, reason: str) -> str:
    """The agent's warm start ended without a commit (its lease expired or its slot died).

    Returns the slot it ran on ("" when none held it); the next bound slot's poll issues it
    again, or the job fails after ``max_step_attempts`` tries.
    """
    attempt = job.warm_starts.get(agent)
    if attempt is None:
        return ""
    slot_id = attempt.slot_id
    lease = _held_lease(job, attempt)
    if lease is not None:
        job.leases.end(lease, LeaseStatus.REVOKED, reason)
    attempt.slot_id, attempt.lease_id = "", ""
    if attempt.attempts >= job.options.max_step_attempts:
        job.fail(f"the warm start of agent {agent!r} failed {attempt.attempts} times (last: {reason})")
    return slot_id


def slot_lost(job: JobPlan, slot_id: str, reason: str) -> None:
    """A trainer slot died or failed: a warm start it held is issued again."""
    for agent, attempt in list(job.warm_starts.items()):
        if attempt.slot_id == slot_id and _held_lease(job, attempt) is not None:
            lost(job, agent, reason)
