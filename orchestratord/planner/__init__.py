"""The step plan of orchestratord: rollout tasks, leases, admission, micro-batches, steps.

Pure domain logic: no I/O, no threads, time from an injected clock
(``now_s``, wall-clock seconds since the epoch, because deadlines travel as
unix milliseconds). Durable changes go to an outbox (:meth:`JobPlanner.take_changes`)
that the daemon wiring applies to a ``StateStore`` before answering (see
``orchestratord.state``). ``docs/pipeline.md`` explains the consistency argument.

Modules (import the public names from this package):

* ``types``: the public dataclasses and enums; ``ids``: every id the planner builds or parses.
* ``job_plan``: ``JobPlan``, the mutable state of one job, and its internal records; the
  function modules below take a ``JobPlan`` and change it, emitting durable changes to its outbox.
* ``admission``: AReaL's admission rule and rollout-task leases; ``reports``: validation of a
  finished task's experiences; ``manifests``: a done task's groups join their steps, manifests
  are fixed and micro-batches formed.
* ``dispatch``: micro-batches and optimizer steps handed to slots, acks, commits;
  ``recovery``: expiries, dead slots and workers, step replay, rebuild after a restart.
* ``demand``: trainer demand for the binder and rollout demand for rolloutd's balancer
  (``estimator``: the tokens-per-episode estimate behind the latter).
* ``job``: ``JobPlanner``, one job behind one interface; ``multi_job``: ``Planner``, every
  job plus the shared slot binder, which is what the servicer calls.

Vocabulary: rollout *batch* t = the ``prompts_per_step`` tasks whose
experiences form *step* t of every agent; step t of an agent trains version t
into version t + 1. A step's *manifest* is the exact set of its experience ids.
A step *attempt* is one try at training it on one slot; a slot death starts a
new attempt from the last committed version with the same manifest. A task's
groups hold its episodes but those whose reward failed; a task left with too
few is *given up* (``manifests.give_up_task``): never re-issued, it joins its
step empty (``step_fill: batch``) or another task takes its place (``completion``).

Pipeline modes (``pipeline.mode``):

* ``async``: a micro-batch is formed and leased as soon as enough complete
  groups of an agent arrived; admission follows AReaL's rule with eta =
  ``max_staleness``.
* ``sync``: the barrier baseline. Admission uses eta = 0 (batch t + 1 is
  admitted only once every agent committed step t) and micro-batches are formed
  only when the whole batch arrived, in task order.
* ``sequential`` (MAS-RL-like): ``sync``, and in addition the agents train one
  after another in spec order. Precisely: with agents a_0 .. a_{K-1}, no
  micro-batch or optimizer step of step t of a_k (k >= 1) is leased before a_{k-1}
  committed step t (its version is > t). An episode involves every agent, so
  the rollouts of step t are one joint batch generated before a_0 trains; batch
  t + 1 is admitted only after a_{K-1} committed step t. Hence, per step:
  rollout(t) -> train a_0 -> commit -> train a_1 -> ... -> commit a_{K-1}.
* ``static`` (MARTI-like): ``sync`` with static binding (each agent only on its
  fixed slot set, see ``orchestratord.binding``); rolloutd keeps each agent's
  fixed replica share (``JobSpec.balancing``).

``pipeline.binding: static`` alone (any mode) is the "no agent-centric
binding" ablation. None of the modes changes what a step trains on: the
manifest of step t of an agent is the same set of experience ids in every mode.
"""

from orchestratord.planner.estimator import (
    RolloutDemandEstimator,
)
from orchestratord.planner.ids import (
    DURABLE_STATE_SCHEMES,
    is_durable_state,
    task_index_of,
)
from orchestratord.planner.job import (
    JobPlanner,
)
from orchestratord.planner.multi_job import (
    Planner,
)
from orchestratord.planner.types import (
    AgentProgress,
    AgentVersion,
    JobSnapshot,
    MicroBatchWork,
    OptimizerStepWork,
    PlannerOptions,
    RenewResult,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
    TrainerWork,
    WarmStartWork,
)

__all__ = [
    "AgentProgress",
    "AgentVersion",
    "DURABLE_STATE_SCHEMES",
    "JobPlanner",
    "JobSnapshot",
    "MicroBatchWork",
    "OptimizerStepWork",
    "Planner",
    "PlannerOptions",
    "RenewResult",
    "ResidentAgent",
    "RolloutDemandEstimator",
    "RolloutTaskLease",
    "SlotEventKind",
    "SwapOutWork",
    "TrainerWork",
    "WarmStartWork",
    "is_durable_state",
    "task_index_of",
]
