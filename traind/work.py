"""What orchestratord asks of a traind slot, and what the slot tells back: the words of traind's link.

Plain dataclasses, no protos (:mod:`traind.serde` converts). The worker
(:mod:`traind.worker`) speaks only these to orchestratord through
:class:`traind.link.OrchestratorLink`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """The data-parallel process group a piece of work runs in (world size 1: the slot trains alone).

    Attributes:
        group_id: ``<job>/<agent>/g<epoch>``; a new id is a new process group (membership changed).
        rank: This slot's rank in the group.
        world_size: Members in the group.
        master_address: host:port of rank 0's rendezvous.
        member_slot_ids: Member slots in rank order.
        timeout_s: Bound on one collective and on the rendezvous (0: the worker's default).
    """

    group_id: str
    rank: int
    world_size: int
    master_address: str
    member_slot_ids: tuple[str, ...] = ()
    timeout_s: int = 0


@dataclasses.dataclass(frozen=True)
class ResidentAgent:
    """An agent whose engine (at ``version``) a slot holds."""

    job_id: str
    agent: str
    version: int


@dataclasses.dataclass(frozen=True)
class MicroBatchWork:
    """Accumulate the gradient of one micro-batch of a step (then ack its lease).

    Attributes:
        lease_id: The micro-batch's lease, acked once the gradient is accumulated.
        job_id: The job.
        agent: The agent trained.
        step: The step's number.
        step_id: The step attempt (a replay of a step has a new one: gradients start from zero).
        micro_batch_index: Position of the micro-batch in the step.
        experience_ids: Experiences to read from stored.
        base_version: The version the slot must hold before backward.
        state_uri: Where that version's full training state is, when the slot lacks it.
        step_episodes: Episodes in the whole step (a normaliser fixed before backward).
        spec_digest: Digest of the job's spec (fetched once per job).
        group: The data-parallel group, None when the slot trains alone.
        step_return_count: ``advantage_norm: agent``: experiences of the step (0: no statistics sent).
        step_return_mean: Their mean return.
        step_return_std: Their returns' unbiased standard deviation.
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
    step_episodes: int
    spec_digest: str
    group: DataParallelGroup | None = None
    step_return_count: int = 0
    step_return_mean: float = 0.0
    step_return_std: float = 0.0


@dataclasses.dataclass(frozen=True)
class OptimizerStepWork:
    """Take the optimizer step of an accumulated step, publish, save and commit (rank 0).

    Attributes:
        job_id: The job.
        agent: The agent trained.
        step: The step's number.
        step_id: The step attempt whose gradients are accumulated.
        new_version: The version the step produces.
        step_response_tokens: Token total of the step (token-mean losses are accumulated as sums).
        step_episodes: Episodes in the step.
        num_micro_batches: Micro-batches in the step.
        step_sequences: Experiences in the step (the ``seq-mean`` normaliser).
        base_version: The version a member that accumulated nothing builds its engine at.
        state_uri: Where that version's state is.
        spec_digest: Digest of the job's spec.
        group: The data-parallel group, None when the slot trains alone.
    """

    job_id: str
    agent: str
    step: int
    step_id: str
    new_version: int
    step_response_tokens: int
    step_episodes: int
    num_micro_batches: int
    base_version: int
    state_uri: str
    spec_digest: str
    group: DataParallelGroup | None = None
    step_sequences: int = 0


@dataclasses.dataclass(frozen=True)
class SwapOutWork:
    """Move an agent's state out of the slot to ``location`` ("mem", "file", "stored"; "": traind's default)."""

    job_id: str
    agent: str
    location: str


@dataclasses.dataclass(frozen=True)
class WarmStartWork:
    """Run the agent's warm start on a fresh engine, publish it as version 0 and commit it (new_version 0).

    ``lease_id`` is renewed while the slot works (RenewLeases), as a micro-batch's is.
    """

    lease_id: str
    job_id: str
    agent: str
    spec_digest: str


TrainerWork = MicroBatchWork | OptimizerStepWork | SwapOutWork | WarmStartWork


@dataclasses.dataclass(frozen=True)
class StepCommit:
    """A committed optimizer step, as rank 0 reports it (CommitStep)."""

    slot_id: str
    job_id: str
    agent: str
    step: int
    new_version: int
    weights_uri: str
    state_uri: str
    loss: float
    grad_norm: float
    step_seconds: float
    #: Other per-step figures for the step's history record (``kl``, ``clip_fraction``, ``ratio_mean``).
    figures: Mapping[str, float] = dataclasses.field(default_factory=dict)


class SlotEventKind(enum.Enum):
    """What happened to a slot outside the work protocol."""

    SWAPPED_OUT = "swapped_out"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class SlotEvent:
    """A slot event for orchestratord (ReportSlotEvent)."""

    slot_id: str
    job_id: str
    agent: str
    kind: SlotEventKind
    state_uri: str = ""
    error: str = ""


@dataclasses.dataclass(frozen=True)
class SlotStatus:
    """One slot as GetTrainerStatus shows it.

    Attributes:
        slot_id: The slot.
        device: "cpu" or "cuda".
        memory_bytes: The slot's capacity.
        resident: The agent whose engine the slot holds (None: empty).
        busy: Whether work runs in the slot now.
        busy_fraction: Busy time over the slot's lifetime.
        dp_group_id: The data-parallel group the process is in ("" when it trains alone).
        dp_rank: Its rank there (0 alone).
        dp_world_size: The group's size (1 alone).
        capacity: Training capacity relative to one device (traind's slot_capacity).
    """

    slot_id: str
    device: str
    memory_bytes: int
    resident: ResidentAgent | None
    busy: bool
    busy_fraction: float
    dp_group_id: str
    dp_rank: int
    dp_world_size: int
    capacity: float = 1.0
