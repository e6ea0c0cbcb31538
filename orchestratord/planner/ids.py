"""The planner's own readings of ids (the ids themselves live in :mod:`flexmarl.ids`)."""

from __future__ import annotations

from flexmarl.ids import MicroBatchRef, TaskRef
from orchestratord.leases import Lease, LeaseKind

DURABLE_STATE_SCHEMES = ("file://", "stored://")


def task_index_of(batch_index: int, position: int, prompts_per_step: int) -> int:
    """Position of a task in the environment's task stream (seeded by ``spec.seed``).

    Task i of batch t is element ``t * prompts_per_step + i`` of the stream the
    environment derives from the job seed, so the same (seed, t, i) always
    yields the same task and consecutive batches never repeat a task.
    """
    return batch_index * prompts_per_step + position


def prune_group_of_lease(lease: Lease) -> tuple[str, str | int] | None:
    """What forgets a lease once its batch is done (``LeaseTable`` ``group_of``; dispatch's ``_prune_batch``).

    A rollout task's lease goes with its task (``("task", task id)``), a micro-batch's or a warm
    start's with its batch (``("batch", batch_of_lease)``); an eval task's by its round (None: not here).
    """
    if lease.kind is LeaseKind.EVAL_TASK:
        return None
    if lease.kind is LeaseKind.ROLLOUT_TASK:
        return ("task", lease.subject)
    return ("batch", batch_of_lease(lease))


def batch_of_lease(lease: Lease) -> int:
    """The rollout batch a lease works on: the task's batch, the micro-batch's step, 0 for a warm start."""
    if lease.kind is LeaseKind.ROLLOUT_TASK:
        return TaskRef.parse(lease.subject).batch
    if lease.kind is LeaseKind.WARM_START:
        return 0  # it comes before batch 0, and is forgotten with it at the latest
    return MicroBatchRef.parse(lease.subject).step


def is_durable_state(uri: str) -> bool:
    """Whether a state URI is reachable from any node (file:// on shared disk, stored://)."""
    return uri.startswith(DURABLE_STATE_SCHEMES)
