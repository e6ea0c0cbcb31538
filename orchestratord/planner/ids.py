"""Every id and URI the planner builds or reads back, in one place.

Task ids (``<job>/b<t>/t<i>``) and group ids (``<task>/<agent>``) cross daemon
boundaries (rolloutd names experiences after them); lease ids and lease subjects
stay inside orchestratord.
"""

from __future__ import annotations

from flexmarl.errors import InvalidArgument
from orchestratord.leases import Lease, LeaseKind

JOB_ID_MAX_LENGTH = 64
DURABLE_STATE_SCHEMES = ("file://", "stored://")


def validate_job_id(job_id: str) -> None:
    """Job ids name etcd keys and prefix task ids: letters, digits, '_', '.', '-'; no '/'."""
    if not job_id or len(job_id) > JOB_ID_MAX_LENGTH or not all(ch.isalnum() or ch in "_.-" for ch in job_id) \
            or not job_id[0].isalnum() or not job_id.isascii():
        raise InvalidArgument(f"job_id: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,63}}, got {job_id!r}")


def task_id_of(job_id: str, batch_index: int, position: int) -> str:
    """Deterministic task id: ``<job>/b<t>/t<i>``."""
    return f"{job_id}/b{batch_index}/t{position}"


def parse_task_id(job_id: str, task_id: str) -> tuple[int, int] | None:
    """``<job>/b<t>/t<i>`` -> (t, i), or None when it is not a task id of the job."""
    parts = task_id.split("/")
    if len(parts) != 3 or parts[0] != job_id or not parts[1].startswith("b") or not parts[2].startswith("t"):
        return None
    if not (parts[1][1:].isdigit() and parts[2][1:].isdigit()):
        return None
    return int(parts[1][1:]), int(parts[2][1:])


def task_index_of(batch_index: int, position: int, prompts_per_step: int) -> int:
    """Position of a task in the environment's task stream (seeded by ``spec.seed``).

    Task i of batch t is element ``t * prompts_per_step + i`` of the stream the
    environment derives from the job seed, so the same (seed, t, i) always
    yields the same task and consecutive batches never repeat a task.
    """
    return batch_index * prompts_per_step + position


def group_id_of(task_id: str, agent: str) -> str:
    """Id of an agent's experiences of one task: ``<task_id>/<agent>``."""
    return f"{task_id}/{agent}"


def task_id_of_group(group_id: str) -> str:
    """The task of a group id (``<task_id>/<agent>`` -> ``<task_id>``)."""
    return group_id.rsplit("/", 1)[0]


def step_id_of(job_id: str, agent: str, step: int, attempt: int, epoch: str = "") -> str:
    """Id of one attempt at one step: ``<job>/<agent>/s<t>[/e<epoch>]/a<k>``.

    ``epoch`` names the orchestrator process: after a restart, the restored planner has forgotten
    which micro-batches a slot already accumulated and issues them all again, so its step ids
    must differ from the dead process's, or the slot would add a micro-batch's gradient twice.
    """
    return f"{job_id}/{agent}/s{step}/e{epoch}/a{attempt}" if epoch else f"{job_id}/{agent}/s{step}/a{attempt}"


def manifest_id_of(job_id: str, agent: str, step: int) -> str:
    """Id of a step independent of attempts (what stored marks experiences with)."""
    return f"{job_id}/{agent}/s{step}"


def lease_id_prefix(job_id: str, epoch: str) -> str:
    """What every lease id of a job starts with: ``<job>/<epoch>-``."""
    return f"{job_id}/{epoch}-"


def job_id_of_lease(lease_id: str) -> str:
    """The job a lease id belongs to (see :func:`lease_id_prefix`)."""
    return lease_id.split("/", 1)[0]


def micro_batch_subject(agent: str, step: int, attempt: int, index: int) -> str:
    """Subject of a micro-batch lease: ``<agent>/<step>/<attempt>/<index>``."""
    return f"{agent}/{step}/{attempt}/{index}"


def parse_micro_batch_subject(subject: str) -> tuple[str, int, int, int]:
    """``<agent>/<step>/<attempt>/<index>`` -> (agent, step, attempt, index)."""
    agent, step, attempt, index = subject.rsplit("/", 3)
    return agent, int(step), int(attempt), int(index)


def batch_of_lease(lease: Lease) -> int:
    """The rollout batch a lease works on: the task's batch, or the micro-batch's step."""
    if lease.kind is LeaseKind.ROLLOUT_TASK:
        return int(lease.subject.rsplit("/", 2)[1][1:])
    return parse_micro_batch_subject(lease.subject)[1]


def is_durable_state(uri: str) -> bool:
    """Whether a state URI is reachable from any node (file:// on shared disk, stored://)."""
    return uri.startswith(DURABLE_STATE_SCHEMES)
