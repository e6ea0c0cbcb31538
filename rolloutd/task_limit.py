"""How many rollout tasks rolloutd leases at once: ``--max-tasks N``, or ``auto``, sized from the jobs it serves.

A job's staleness rule admits ``(max_staleness + 1) x prompts_per_step`` tasks at once
(:attr:`flexmarl.jobspec.JobSpec.rollout_tasks_ahead`; orchestratord's admission reads the same
property). A rolloutd that leases fewer keeps fewer steps of tasks in flight than the job's eta
allows: a long-tailed task holds its slot while its replicas decode its last sequences, and the
trainer waits (docs/benchmarks.md, "Where partial rollouts' step went").

orchestratord hands any running job's tasks to any rolloutd that asks (round-robin over the jobs), so
the live rolloutds share the served jobs' admitted tasks: in ``auto`` each leases
``ceil(sum of rollout_tasks_ahead / live rolloutds)`` (one more per job with ``evaluation``: the eval task
orchestratord keeps in flight beside the training tasks), never below :data:`AUTO_FLOOR` (the fixed
default it replaces: a re-issued task still finds a slot) and never above
``--max-tasks-cap`` (every task holds ``group_size`` episodes in memory). The live rolloutds are the
etcd service directory's (list + watch, no round-trip per lease), this one always counted.

An explicit ``--max-tasks N`` is the limit as before; a job whose staleness rule admits more is warned
about (:func:`fewer_tasks_than_admitted`). In ``auto`` a job whose share the cap clips is warned about
once (:func:`clipped_by_cap`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from flexmarl.jobspec import JobSpec

log = logging.getLogger(__name__)

#: ``--max-tasks`` value that sizes the limit from the served jobs.
AUTO = "auto"
#: ``auto`` never leases fewer at once (the fixed default before ``auto``).
AUTO_FLOOR = 8
#: ``--max-tasks-cap``'s default: at 16 episodes a task, 4096 episodes in flight.
DEFAULT_CAP = 256
#: Explicit ``--max-tasks`` and ``--max-tasks-cap`` stay within this.
MAX_TASKS_LIMIT = 4096


def tasks_in_flight(spec: JobSpec) -> int:
    """The most tasks of a job orchestratord keeps in flight.

    The staleness rule's, plus the one eval task it hands out beside them while an evaluation round is
    open (``orchestratord/planner/evaluation.py``).
    """
    return spec.rollout_tasks_ahead + (1 if spec.evaluation is not None else 0)


def auto_task_limit(tasks_ahead: Mapping[str, int], rolloutds: int, cap: int) -> int:
    """``auto``'s limit: the jobs' admitted tasks shared among ``rolloutds``, rounded up, within [floor, cap]."""
    return min(cap, max(AUTO_FLOOR, _share(tasks_ahead, rolloutds)))


def _share(tasks_ahead: Mapping[str, int], rolloutds: int) -> int:
    return math.ceil(sum(tasks_ahead.values()) / max(1, rolloutds))


def fewer_tasks_than_admitted(spec: JobSpec, max_tasks: int) -> str:
    """Why this rolloutd alone cannot keep the job's pipeline as far ahead as its staleness bound allows ("" if it can).

    The staleness rule admits up to ``(max_staleness + 1) x prompts_per_step`` tasks at once
    (:attr:`JobSpec.rollout_tasks_ahead`); a rolloutd leases at most ``max_tasks``. With fewer, unless other
    rolloutds take the rest, the steps run behind the tasks in flight.
    """
    wanted = spec.rollout_tasks_ahead
    if wanted <= max_tasks:
        return ""
    return (f"its staleness rule admits {wanted} tasks at once ((max_staleness {spec.pipeline.max_staleness} + 1)"
            f" x prompts_per_step {spec.batch.prompts_per_step}), this rolloutd runs at most {max_tasks} "
            f"(--max-tasks {max_tasks}; --max-tasks auto sizes it from the jobs): alone it keeps "
            f"{max_tasks / spec.batch.prompts_per_step:g} steps of tasks in flight")


def clipped_by_cap(spec: JobSpec, tasks_ahead: Mapping[str, int], rolloutds: int, cap: int) -> str:
    """Why ``auto`` leases fewer tasks than this rolloutd's share of the served jobs' admitted ones ("" if not)."""
    share = _share(tasks_ahead, rolloutds)
    if share <= cap:
        return ""
    return (f"its staleness rule admits {spec.rollout_tasks_ahead} tasks at once ((max_staleness "
            f"{spec.pipeline.max_staleness} + 1) x prompts_per_step {spec.batch.prompts_per_step}); this rolloutd's "
            f"share of the {len(tasks_ahead)} served job(s)' {sum(tasks_ahead.values())} over {rolloutds} live "
            f"rolloutd(s) is {share}, above --max-tasks-cap {cap}: it leases at most {cap} (raise --max-tasks-cap "
            f"if memory allows, or run more rolloutds)")


class TaskLimit:
    """The current lease limit: fixed, or recomputed when served jobs or live rolloutds change (``auto``).

    ``on_change(limit)`` is called with the first limit and on every change (metrics, backpressure).
    """

    def __init__(self, explicit: int | None, cap: int, on_change: Callable[[int], None]) -> None:
        """``explicit``: ``--max-tasks N``; None: ``auto`` within ``cap``."""
        self.explicit = explicit
        self.cap = cap
        self._on_change = on_change
        self._jobs: dict[str, JobSpec] = {}
        self._rolloutds = 1
        self._warned: set[str] = set()
        self.current = explicit if explicit is not None else auto_task_limit({}, 1, cap)
        on_change(self.current)

    @property
    def auto(self) -> bool:
        """Whether the limit is sized from the jobs (``--max-tasks auto``)."""
        return self.explicit is None

    @property
    def rolloutds(self) -> int:
        """The live rolloutds ``auto`` shares the jobs' tasks among (this one included)."""
        return self._rolloutds

    def set_jobs(self, jobs: Mapping[str, JobSpec]) -> None:
        """The jobs served now (by job id); warns about each new one this limit keeps behind its staleness rule."""
        added = [job_id for job_id in jobs if job_id not in self._jobs]
        self._jobs = dict(jobs)
        if not self.auto:
            for job_id in added:
                short = fewer_tasks_than_admitted(jobs[job_id], self.current)
                if short:
                    log.warning("job %s: %s", job_id, short)
            return
        self._recompute()

    def set_rolloutds(self, count: int) -> None:
        """The live rolloutds, this one included (at least 1)."""
        count = max(1, count)
        if count != self._rolloutds:
            self._rolloutds = count
            if self.auto:
                self._recompute()

    def _recompute(self) -> None:
        ahead = {job_id: tasks_in_flight(spec) for job_id, spec in self._jobs.items()}
        limit = auto_task_limit(ahead, self._rolloutds, self.cap)
        self._warned &= set(ahead)
        for job_id, spec in self._jobs.items():
            clipped = clipped_by_cap(spec, ahead, self._rolloutds, self.cap)
            if clipped and job_id not in self._warned:
                log.warning("job %s: %s", job_id, clipped)
                self._warned.add(job_id)
            elif not clipped:
                self._warned.discard(job_id)
        if limit != self.current:
            log.info("leasing at most %d tasks at once (--max-tasks auto: %d job(s) admitting %d tasks, "
                     "%d live rolloutd(s), floor %d, cap %d)", limit, len(ahead), sum(ahead.values()),
                     self._rolloutds, AUTO_FLOOR, self.cap)
            self.current = limit
            self._on_change(limit)
