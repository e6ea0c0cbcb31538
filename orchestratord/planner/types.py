"""The planner's public types: what it takes from and hands to the servicer, and its options."""

from __future__ import annotations

import dataclasses
import enum

from orchestratord.binding import DataParallelGroup
from orchestratord.state import JobState


@dataclasses.dataclass(frozen=True)
class AgentVersion:
    """A committed policy version of one agent."""

    job_id: str
    agent: str
    version: int
    weights_uri: str


@dataclasses.dataclass(frozen=True)
class RolloutTaskLease:
    """A rollout task leased to a worker: one environment task x ``group_size`` episodes."""

    lease_id: str
    job_id: str
    task_id: str
    task_index: int
    batch_index: int
    group_size: int
    # Minimum version of each agent to generate with.
    agent_versions: tuple[AgentVersion, ...]
    deadline_s: float
    attempt: int
    #: A held-out evaluation task (``planner.evaluation``): play it, store nothing, report its episodes.
    evaluation: bool = False
    #: With ``evaluation``: every turn at temperature 0.
    greedy: bool = False
    #: With ``evaluation``: ``agent_versions`` are exact (an on-demand round on kept versions), not minimums.
    pinned: bool = False
    #: With ``pinned``: held-out rows from this task file and the sha256 of its content ("": the job's tasks).
    eval_file: str = ""
    eval_sha256: str = ""


@dataclasses.dataclass(frozen=True)
class RenewResult:
    """Outcome of a renewal: leases no longer held, and the earliest new deadline."""

    lost_lease_ids: tuple[str, ...]
    deadline_s: float
    #: Trainer slots whose work stalled (no progress within the job's bound): the caller drops them as dead.
    stalled_slots: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ResidentAgent:
    """An agent whose training state a slot holds now."""

    job_id: str
    agent: str
    version: int


@dataclasses.dataclass(frozen=True)
class MicroBatchWork:
    """Accumulate the gradients of these complete groups into the slot (no optimizer step).

    A ``step_id`` different from the one the slot is accumulating means a new
    attempt: drop the accumulated gradients and, when the slot's version of the
    agent is not ``base_version``, load the state at ``state_uri`` first
    (``""`` with base version 0 = the initial model of the spec).
    """

    lease_id: str
    job_id: str
    agent: str
    step: int
    step_id: str
    micro_batch_index: int
    experience_ids: tuple[str, ...]
    base_version: int
    state_uri: str
    # Normaliser fixed before backward: episodes of the whole step.
    step_episodes: int
    deadline_s: float
    # The attempt's data-parallel group and this slot's rank in it (None = one slot).
    group: DataParallelGroup | None = None
    rank: int = 0
    # advantage_norm agent: (count, mean, unbiased std) of the returns of the step's experiences.
    step_returns: tuple[int, float, float] | None = None


@dataclasses.dataclass(frozen=True)
class OptimizerStepWork:
    """Every micro-batch of the step is accumulated: scale, step, publish, then CommitStep."""

    job_id: str
    agent: str
    step: int
    step_id: str
    new_version: int
    step_response_tokens: int
    step_episodes: int
    num_micro_batches: int
    # The seq-mean normaliser: experiences of the step (several per episode for a multi-turn agent).
    step_sequences: int = 0
    # Data parallelism: every member gets the step; only rank 0 publishes and commits. A member
    # that accumulated nothing builds the engine from base_version / state_uri first.
    group: DataParallelGroup | None = None
    rank: int = 0
    base_version: int = 0
    state_uri: str = ""


@dataclasses.dataclass(frozen=True)
class SwapOutWork:
    """Save the agent's training state to ``location`` and report it (ReportSlotEvent SWAPPED_OUT)."""

    job_id: str
    agent: str
    location: str


@dataclasses.dataclass(frozen=True)
class WarmStartWork:
    """Run the agent's warm start on a fresh engine, publish it as version 0, then CommitStep(new_version=0).

    Issued once per agent with ``agents[].warm_start``, before the job admits any rollout task
    (``orchestratord.planner.warm_start``), under a lease the slot renews while it works.
    """

    lease_id: str
    job_id: str
    agent: str
    deadline_s: float


TrainerWork = MicroBatchWork | OptimizerStepWork | SwapOutWork | WarmStartWork


class SlotEventKind(enum.Enum):
    """What a slot reports outside of acks and commits."""

    SWAPPED_OUT = 1
    FAILED = 2


@dataclasses.dataclass(frozen=True)
class AgentProgress:
    """Progress of one agent (for JobStatus)."""

    agent: str
    version: int
    total_steps: int
    weights_uri: str
    state_uri: str
    slot_id: str
    # Mean trained reward (shaped, discounted turn return) over the last step's experiences.
    reward_mean: float
    staleness_mean: float
    step_seconds: float
    # Every bound slot in data-parallel rank order (slot_ids[0] == slot_id).
    slot_ids: tuple[str, ...] = ()
    # Mean unshaped episode return over the last step's episodes: the reported reward.
    return_mean: float = 0.0
    # Version 0's weights where a warm start published them ("": the spec's model).
    initial_weights_uri: str = ""


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    """A job's status at one instant."""

    job_id: str
    name: str
    state: JobState
    error: str
    created_s: float
    updated_s: float
    spec_json: str
    spec_digest: str
    agents: tuple[AgentProgress, ...]
    tasks_done: int
    tasks_total: int
    # Episodes dropped as their reward failed and tasks given up (too few left) over the whole job (kept across
    # an orchestratord restart: orchestratord/failures.py); the latest such failure's reason. tasks_done does
    # not count the given-up tasks.
    episodes_failed: int = 0
    tasks_given_up: int = 0
    last_episode_failure: str = ""


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner that are not part of a job spec."""

    # Leases a task may get (expiries and failed reports count) before its job fails.
    max_task_attempts: int = 5
    # Attempts a step may get (trainer deaths and expiries) before its job fails.
    max_step_attempts: int = 5
    # Where SwapOutWork asks a slot to save a state that is not yet durable.
    swap_location: str = "stored"
    # A bound slot with no work in flight that has not polled for this long is dead.
    slot_silence_s: float = 120.0
    # Distinguishes lease ids across orchestrator restarts; random when empty.
    lease_epoch: str = ""
    # Binder knobs (see orchestratord.binding).
    aging_per_s: float = 0.05
    affinity_bonus: float = 1.0
    max_wait_s: float = 60.0
    # Data parallelism (see orchestratord.binding): micro-batches a member must be worth,
    # how recently a free slot must have polled to be recruited, and the collective timeout.
    dp_min_micro_batches_per_member: int = 2
    dp_recruit_fresh_s: float = 10.0
    dp_timeout_s: int = 60
    # Whether the binder weighs the slots' reported capacities (orchestratord.binding, "Slot capacity").
    capacity_aware_binding: bool = True
    # At its step boundary a bound agent gives way to a waiting agent of its job this many versions behind it
    # (orchestratord.binding; 0: off).
    binding_version_lead: int = 1
