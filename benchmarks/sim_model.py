"""The simulation's shapes (:mod:`benchmarks.sim`): the cluster and job settings, a run's outcome, the modelled parts.

Split out of :mod:`benchmarks.sim`, which re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flexmarl import devicemodel
from orchestratord.planner import MicroBatchWork, OptimizerStepWork, ResidentAgent, RolloutTaskLease


@dataclasses.dataclass(frozen=True)
class SimSettings:
    """Shape of one simulated cluster and job."""

    devices: int = 48
    rollout_fraction: float = 2.0 / 3.0
    devices_per_slot: int = 8
    episodes_per_replica: int = 2
    group_size: int = 8
    micro_batch_groups: int = 1
    steps: int = 3
    agents: int = 3
    variant: str = "long-tail"
    seed: int = 0
    refresh_tokens: float = 256.0
    # Data parallelism: agents' max_slots (0 = per configuration, see agent_max_slots; 1 = none).
    max_slots: int = 0
    # None = the balancer's production default (what rolloutd's worker configures).
    hysteresis: float | None = None
    # Replicas per rolloutd process (each runs its own router and balancer over its own replicas);
    # 0 = one rolloutd over every replica (an upper bound on one balancer's work, not a deployment).
    replicas_per_rolloutd: int = 0
    # Each rolloutd's ``max_tasks`` (0 = one rolloutd: unbounded; several: its share of the admission window).
    max_tasks_per_rolloutd: int = 0
    # Whether each balancer decides on the rates and load cost its router measures (rolloutd's default,
    # --balancer-measured-rates) or on the priors (1,000 tokens/s per replica, a 10 s load).
    measured_rates: bool = True

    @property
    def replicas(self) -> int:
        """Rollout replicas (one device each)."""
        return max(1, round(self.devices * self.rollout_fraction))

    @property
    def rolloutds(self) -> int:
        """rolloutd processes: ``floor(replicas / replicas_per_rolloutd)`` (at least 1), the replicas spread evenly."""
        if self.replicas_per_rolloutd <= 0:
            return 1
        return max(1, self.replicas // self.replicas_per_rolloutd)

    @property
    def slots(self) -> int:
        """Trainer slots."""
        return max(1, (self.devices - self.replicas) // self.devices_per_slot)

    def agent_max_slots(self, config: str) -> int:
        """The agents' ``max_slots`` in the job spec of ``config``.

        ``max_slots`` 0 means: ``sequential`` (one agent trains at a time) every slot; the
        others a fair share, ``floor(slots / agents)`` (at least 1). A larger cap hurts async
        FlexMARL: an agent's group grows at its step boundary to every free slot and keeps them
        for the whole step while its micro-batches trickle in, so the other agents wait (768
        devices: 119 s per step with every slot against 61 s with a fair share). ``ceil`` was
        too much once the agents reach a step boundary together (64 agents): the first ones
        take ``ceil`` slots each and the last get one, or none until a group ends, for a whole
        step whose work grows with the cluster, so the modelled step doubled with the devices
        (5,120 devices: 205.7 s with ``ceil``, 74.9 s with ``floor``). Static binding bounds
        each agent to its fixed set anyway.
        """
        if self.max_slots > 0:
            return min(1024, self.max_slots)
        if config == "sequential":
            return min(1024, self.slots)
        return min(1024, max(1, self.slots // self.agents))

    @property
    def prompts_per_step(self) -> int:
        """Tasks per batch (each one GRPO group of ``group_size`` episodes)."""
        return max(1, self.replicas * self.episodes_per_replica // self.group_size)


@dataclasses.dataclass
class SimOutcome:
    """Figures of one configuration at one size."""

    config: str
    devices: int
    replicas: int
    slots: int
    episodes_per_step: int
    state: str
    step_s: float
    tokens_per_s: float
    rollout_busy: float
    train_busy: float
    reassignments: int
    events: int
    sim_wall_s: float
    max_group_size: int = 1
    bound_s: float = math.nan  # device-work bound of a step (benchmarks/bound.py), modelled seconds
    bound_by: str = ""
    # Real CPU seconds (thread time) inside the planner's and the balancer's code over the whole run, the
    # modelled seconds of the run, and the lease operations it made (CpuMeter, Simulation.lease_ops).
    agents: int = 0
    planner_cpu_s: float = 0.0
    balancer_cpu_s: float = 0.0
    planner_calls: int = 0
    balancer_calls: int = 0
    modelled_s: float = 0.0
    lease_ops: dict[str, int] = dataclasses.field(default_factory=dict)
    # rolloutd processes, and the balancer CPU seconds of the busiest one (balancer_cpu_s is their sum).
    rolloutds: int = 1
    busiest_rolloutd_cpu_s: float = 0.0
    # The garbage-collector policy the run was measured under (benchmarks/sim_gc.py: "daemon" or "cpython"; "" when
    # run without one), the objects it froze, the collections per generation during the run and their thread CPU.
    # Calls and thread CPU seconds per outermost method of the measured code ("planner.poll_trainer_work", ...).
    method_cpu: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    gc_policy: str = ""
    gc_frozen_objects: int = 0
    gc_collections: tuple[int, int, int] = (0, 0, 0)
    gc_cpu_s: float = 0.0
    gc_measured_cpu_s: float = 0.0  # of gc_cpu_s, collections inside a measured call (in planner/balancer CPU)

    @property
    def control_cpu_share(self) -> float:
        """Planner + balancer CPU seconds per modelled second (= CPU per step / step, the core share they need)."""
        return (self.planner_cpu_s + self.balancer_cpu_s) / self.modelled_s if self.modelled_s > 0 else math.nan

    @property
    def busiest_process_share(self) -> float:
        """CPU seconds per modelled second of the busiest control-plane process (orchestratord or one rolloutd).

        orchestratord runs the planner; each rolloutd its own balancer: the share of its own core that one
        process needs for this code, beside :attr:`control_cpu_share`, the whole control plane's.
        """
        if self.modelled_s <= 0:
            return math.nan
        return max(self.planner_cpu_s, self.busiest_rolloutd_cpu_s) / self.modelled_s

    @property
    def rolloutd_share(self) -> float:
        """CPU seconds per modelled second of the busiest rolloutd's balancer."""
        return self.busiest_rolloutd_cpu_s / self.modelled_s if self.modelled_s > 0 else math.nan

    @property
    def control_cpu_per_step_s(self) -> float:
        """Planner + balancer CPU seconds per modelled step (at the run's mean rate)."""
        return self.control_cpu_share * self.step_s

    @property
    def lease_ops_per_s(self) -> float:
        """Lease operations per modelled second (polls that found no work not counted)."""
        ops = sum(n for kind, n in self.lease_ops.items() if kind != "empty poll")
        return ops / self.modelled_s if self.modelled_s > 0 else math.nan


@dataclasses.dataclass
class _Seq:
    request_id: int
    episode: _Episode
    remaining: float
    context: float


@dataclasses.dataclass
class _Replica:
    replica_id: str
    running: list[_Seq] = dataclasses.field(default_factory=list)
    updated_s: float = 0.0
    resume_s: float = 0.0  # prefill or weight load in progress until then
    loaded: tuple[str, int] = ("", -1)
    busy_s: float = 0.0
    generation: int = 0
    rolloutd: int = 0  # the index of the rolloutd process whose engine it is


@dataclasses.dataclass
class _Episode:
    task: RolloutTaskLease
    sample_index: int
    lengths: tuple[int, ...]
    turn: int = 0
    behaviour: dict[str, int] = dataclasses.field(default_factory=dict)
    rolloutd: int = 0  # the rolloutd process that leased its task (every turn goes to its balancer)


@dataclasses.dataclass
class _Slot:
    slot_id: str
    worker_id: str
    dp_address: str
    resident: ResidentAgent | None = None
    busy_until_s: float = -1.0
    busy_s: float = 0.0
    pending: Any = None
    # The process group the slot's process is in ("" = a world of one), as traind's GroupKey.
    group_id: str = ""


def allreduce_s(profile: devicemodel.DeviceProfile, members: int) -> float:
    """Modelled seconds of one gradient all-reduce over ``members`` data-parallel slots.

    Ring all-reduce of the BF16 gradients (``model_params * bytes_per_param`` bytes): every
    member sends and receives ``2 (n - 1) / n`` of them over its link,
    ``2 (n - 1) / n * P * bytes_per_param / link_bytes_per_s``; 0 for one member. One
    ``link_bytes_per_s`` link per slot (conservative: a node with one NIC per device could
    reduce ``train_devices_per_slot`` shards in parallel); the reduction inside a slot is part
    of ``train_tokens_s``' data parallelism and not charged again.
    """
    if members <= 1:
        return 0.0
    gradient_bytes = profile.model_params * profile.bytes_per_param
    return 2.0 * (members - 1) / members * gradient_bytes / profile.link_bytes_per_s


def work_version(work: MicroBatchWork | OptimizerStepWork) -> int:
    """The agent version a piece of work starts from."""
    return work.base_version if isinstance(work, MicroBatchWork) else work.new_version - 1

