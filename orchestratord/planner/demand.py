"""Demand: what an agent needs from the trainer pool (for the binder) and tokens still to generate (for rolloutd)."""

from __future__ import annotations

from collections.abc import Mapping

from orchestratord.binding import AgentDemand, AgentKey
from orchestratord.leases import LeaseKind
from orchestratord.planner import warm_start
from orchestratord.planner.admission import admission_limit
from orchestratord.planner.dispatch import agent_may_train
from orchestratord.planner.ids import is_durable_state
from orchestratord.planner.job_plan import JobPlan, StepPlan


def demand(job: JobPlan, agent: str) -> AgentDemand:
    """What the agent needs from the trainer pool now."""
    key = (job.job_id, agent)
    if not job.state.terminal and warm_start.pending(job, agent):
        running = warm_start.in_flight(job, agent)
        return _agent_demand(job, key, 0, warm_start_pending=not running, mid_step=running)
    plan = job.current_plan(agent)
    if job.state.terminal or plan is None or not agent_may_train(job, agent, plan.step):
        return AgentDemand(key)
    formed = len(plan.micro_batches)
    expected = _expected_micro_batches(job, plan)
    # The step's tokens as its formed micro-batches project them (a step half formed weighs as a whole one).
    step_tokens = plan.formed_tokens * max(expected, formed) // formed if formed else 0
    return _agent_demand(job, key, max(0, expected - (formed - plan.ready_count)),
                         ready_micro_batches=plan.ready_count, ready_tokens=plan.ready_tokens,
                         optimizer_pending=plan.ready_for_optimizer, mid_step=plan.mid_step,
                         step_tokens=step_tokens)


def data_parallel_demand(job: JobPlan, agent: str) -> AgentDemand:
    """:func:`demand`, also for an agent between steps (no plan yet): what the binder sizes groups with."""
    now = demand(job, agent)
    if now.has_work or now.mid_step or job.state.terminal:
        return now
    plan = job.current_plan(agent)
    version = job.agent(agent).version
    upcoming = 0
    if version < job.spec.total_steps and agent_may_train(job, agent, version):
        upcoming = _expected_micro_batches(job, plan)
    # No work and not mid-step here: only the readiness figures carry over.
    return _agent_demand(job, now.key, upcoming, ready_micro_batches=now.ready_micro_batches,
                         ready_tokens=now.ready_tokens, step_tokens=now.step_tokens)


def _expected_micro_batches(job: JobPlan, plan: StepPlan | None) -> int:
    """Micro-batches a step will have: its formed ones plus those its missing groups will form."""
    per = job.spec.batch.groups_per_micro_batch
    formed = len(plan.micro_batches) if plan is not None else 0
    pending_groups = job.spec.batch.prompts_per_step - (plan.formed_groups if plan is not None else 0)
    return formed + -(-max(0, pending_groups) // per)


def _data_parallel(job: JobPlan, agent: str) -> bool:
    spec = job.agent_specs[agent]
    return spec.max_slots > 1 and spec.zero_stage == 0


def _agent_demand(job: JobPlan, key: tuple[str, str], upcoming: int, *, ready_micro_batches: int = 0,
                  ready_tokens: int = 0, optimizer_pending: bool = False, mid_step: bool = False,
                  warm_start_pending: bool = False, step_tokens: int = 0) -> AgentDemand:
    """One demand record with the agent's data-parallel figures and version (built once, not field by field)."""
    return AgentDemand(
        key=key, ready_micro_batches=ready_micro_batches, ready_tokens=ready_tokens,
        optimizer_pending=optimizer_pending, mid_step=mid_step, max_slots=job.agent_specs[key[1]].max_slots,
        data_parallel=_data_parallel(job, key[1]), upcoming_micro_batches=upcoming,
        portable=state_is_portable(job, key[1]), warm_start_pending=warm_start_pending, step_tokens=step_tokens,
        version=job.agent(key[1]).version)


def state_is_portable(job: JobPlan, agent: str) -> bool:
    """Whether another slot could load the agent's committed state without a swap-out first."""
    state = job.agent(agent)
    return is_durable_state(state.state_uri) or (state.version == 0 and not state.state_uri)


def rolloutd_share(demand: Mapping[AgentKey, int], rolloutds: int) -> dict[AgentKey, int]:
    """One rolloutd's part of the rollout demand (:meth:`Planner.rollout_demand`): what its balancer is hinted.

    Every rolloutd pulls its own tasks and plays them on its own replicas, so of what is outstanding each
    serves about one R-th (R rolloutds). Its balancer adds the hint to the requests it queued itself and
    weighs the drain time against a weight load's cost: the whole job's demand in every one of R balancers
    counted R times the work each will see (and its own leased tasks twice), so moves that cannot pay for
    their load looked as if they did. Rounded up: an agent with demand keeps a hint, so its last replica stays.
    """
    count = max(1, rolloutds)
    return {key: -(-max(0, tokens) // count) for key, tokens in demand.items()}


def rollout_demand(job: JobPlan) -> dict[str, int]:
    """Estimated tokens still to generate per agent (leased and admissible tasks)."""
    pending_tasks = job.leases.active_count(LeaseKind.ROLLOUT_TASK) + len(job.retry)
    if not job.state.terminal:
        pending_tasks += max(0, admission_limit(job) - job.admitted)
    episodes = pending_tasks * job.spec.batch.group_size
    return {name: job.rollout_demand_estimator.estimate((job.job_id, name), episodes) for name in job.agents}
