"""The rolloutd processes of :mod:`benchmarks.sim`: each its own router's balancer over its own replicas.

As the product runs (rolloutd/worker.py, rolloutd/router.py, orchestratord/coordinator.py):

* every rolloutd process owns the engine replicas it launched or attached (``engine_replicas`` /
  ``engine_urls``) and one :class:`~rolloutd.router.RolloutRouter` with one
  :class:`~rolloutd.balancer.HierarchicalBalancer` over them, started on an equal split of its
  replicas over the agents (``RolloutRouter._initial_assignment``);
* it pulls tasks itself (``LeaseRolloutTasks``, up to ``max_tasks`` in flight, long-polling while
  the planner has none to hand out) and plays every turn of a task's episodes on its own replicas;
* it renews its own leases (one ``RenewLeases`` of all it holds every ``RENEW_INTERVAL_S``);
* orchestratord pushes each rolloutd its share of the demand hints (``Planner.rollout_demand``, one per agent,
  divided by the rolloutds: ``orchestratord.planner.demand.rolloutd_share``) to
  every rolloutd it finds in the registry (``Coordinator._push_demand``).

There is no level above the per-rolloutd balancer: no component assigns agents or replicas to
rolloutd processes or moves replicas between them. What spreads the work over them is the task
pull (a rolloutd with room leases the next admitted tasks) and nothing else; each balancer sees
its share of the job's hint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from benchmarks.control_cpu import CpuMeter
from rolloutd.balancer import HierarchicalBalancer
from rolloutd.replica_rates import BalancerFeed, GenerationMark

#: One rolloutd's max_tasks when the simulation runs a single one over every replica (no bound, as before).
UNBOUNDED_TASKS = 10_000
#: Request ids are per balancer; the simulation keys a request by (rolloutd, request id) in one int.
_KEY_BITS = 32


@dataclasses.dataclass
class RolloutProcess:
    """One rolloutd process: its replicas, its balancer (with its estimator, timed), its leases and hints."""

    index: int
    worker_id: str
    replica_ids: tuple[str, ...]
    balancer: HierarchicalBalancer
    max_tasks: int
    cpu: CpuMeter
    demand_hints: dict[str, int] = dataclasses.field(default_factory=dict)
    held_leases: dict[str, str] = dataclasses.field(default_factory=dict)  # task id -> lease id, until reported
    task_progress: dict[str, int] = dataclasses.field(default_factory=dict)  # task id -> turns finished
    leased: int = 0  # tasks it leased so far
    # What its router measures and feeds the balancer (RolloutRouter._generation / _reloaded); None: priors only.
    measured: BalancerFeed | None = None
    marks: dict[int, tuple[str, GenerationMark]] = dataclasses.field(default_factory=dict)  # request key -> mark

    def generation_started(self, request: int, replica_id: str, model_key: str, now_s: float) -> None:
        """A request joins a replica's batch (RolloutRouter._generation's begin)."""
        if self.measured is not None:
            self.marks[request] = (replica_id, self.measured.begin(replica_id, model_key, now_s))

    def generation_finished(self, request: int, tokens: int, now_s: float) -> None:
        """A request's response is complete: its rate share is measured, a changed capacity fed to the balancer."""
        if self.measured is not None:
            replica_id, mark = self.marks.pop(request)
            self.measured.end(replica_id, mark, now_s, tokens, self.balancer)

    def reloaded(self, seconds: float) -> None:
        """A weight load took ``seconds`` (RolloutRouter._reloaded): the move cost follows it."""
        if self.measured is not None:
            self.measured.reloaded(seconds, self.balancer)

    @property
    def free_tasks(self) -> int:
        """Tasks it would lease now (``max_tasks`` less those in flight)."""
        return self.max_tasks - len(self.held_leases)

    @property
    def cpu_s(self) -> float:
        """Thread CPU seconds inside its balancer and estimator so far."""
        return self.cpu.seconds["balancer"]


def request_key(rolloutd: int, request_id: int) -> int:
    """The simulation's key of request ``request_id`` of rolloutd ``rolloutd`` (its own id for rolloutd 0)."""
    return (rolloutd << _KEY_BITS) | request_id


def split_request_key(key: int) -> tuple[int, int]:
    """(rolloutd, the balancer's request id) of a key made by :func:`request_key`."""
    return key >> _KEY_BITS, key & ((1 << _KEY_BITS) - 1)


def partition(replica_ids: Sequence[str], per_process: int) -> list[tuple[str, ...]]:
    """``floor(replicas / per_process)`` consecutive runs of replicas, as even as can be: ``per_process`` or more each.

    All in one for ``per_process`` <= 0. Not ``per_process`` each and the rest in a last small
    process: a last rolloutd of 21 replicas for 64 agents (5,120 devices) reloaded weights for
    almost every turn, and its balancer was the busiest process only for that; nor fewer than
    ``per_process`` (``ceil``: 63 replicas for 64 agents move a replica for nearly every turn too).
    """
    if per_process <= 0:
        return [tuple(replica_ids)]
    count = max(1, len(replica_ids) // per_process)
    base, extra = divmod(len(replica_ids), count)
    runs: list[tuple[str, ...]] = []
    start = 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        runs.append(tuple(replica_ids[start : start + size]))
        start += size
    return runs


def max_tasks(replicas: int, total_replicas: int, window_tasks: int, processes: int, configured: int) -> int:
    """One rolloutd's ``max_tasks``: ``configured``, or unbounded for a single rolloutd, or its share of the window.

    The share: ``ceil(window_tasks * replicas / total_replicas)``, the tasks the planner admits at
    once (``(max_staleness + 1) * prompts_per_step``) in proportion to the process's replicas, so
    that together the processes can hold every task the planner would hand a single one.
    """
    if configured > 0:
        return configured
    if processes <= 1:
        return UNBOUNDED_TASKS
    return max(1, math.ceil(window_tasks * replicas / total_replicas))
