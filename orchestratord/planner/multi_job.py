"""``Planner``: every job of the orchestrator plus the trainer-slot binder they share."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from flexmarl.errors import AlreadyExists, ErrorReason, FailedPrecondition, InvalidArgument, NotFound
from flexmarl.evaluation import EvalEpisode
from flexmarl.experience import ExperienceSummary, FailedEpisode
from flexmarl.ids import job_id_of_lease, validate_job_id
from flexmarl.jobspec import JobSpec
from orchestratord.binding import AgentDemand, AgentKey, DecisionKind, SlotBinder
from orchestratord.planner.job import JobPlanner
from orchestratord.planner.poll_wakes import TrainerPollWakes
from orchestratord.planner.types import (
    JobSnapshot,
    PlannerOptions,
    RenewResult,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
    TrainerWork,
)
from orchestratord.state import AgentVersionRecord, PersistedJob, StateChange

logger = logging.getLogger(__name__)


class Planner:
    """Every job of the orchestrator plus the shared trainer-slot binder: what the servicer calls."""

    def __init__(self, now_s: Callable[[], float], options: PlannerOptions | None = None) -> None:
        self._now_s = now_s
        self._options = options or PlannerOptions()
        self._jobs: dict[str, JobPlanner] = {}
        self.binder = SlotBinder(now_s, aging_per_s=self._options.aging_per_s,
                                 affinity_bonus=self._options.affinity_bonus, max_wait_s=self._options.max_wait_s,
                                 dp_min_micro_batches_per_member=self._options.dp_min_micro_batches_per_member,
                                 recruit_fresh_s=self._options.dp_recruit_fresh_s,
                                 dp_timeout_s=self._options.dp_timeout_s, incarnation=self._options.lease_epoch,
                                 capacity_aware=self._options.capacity_aware_binding,
                                 version_lead=self._options.binding_version_lead)
        self._next_job = 0
        # No slot can be silent before then (the earliest last_seen_s at the last sweep + slot_silence_s; a
        # slot's last_seen_s only grows, a new one starts at now): tick skips its sweep over every slot.
        self._silence_sweep_after_s = -math.inf
        #: The demands kept between trainer polls, and which waiting polls a change can have answered.
        self.poll_wakes = TrainerPollWakes(self.binder)
        #: Jobs whose bindings the binder may still hold (forgotten once, by _sweep, when the job ends).
        self._bound_jobs: set[str] = set()

    # ---- jobs ----------------------------------------------------------------------------------------------

    def submit_job(self, job_id: str, spec: JobSpec,
                   initial: Mapping[str, AgentVersionRecord] | None = None) -> JobPlanner:
        """Adds a job (at ``initial`` versions when resumed); the same id with the same spec returns the existing job.

        Raises:
            AlreadyExists: the id is taken by a different spec.
        """
        validate_job_id(job_id)
        existing = self._jobs.get(job_id)
        if existing is not None:
            if existing.spec_json != spec.to_json():
                raise AlreadyExists(f"job {job_id!r} exists with a different spec")
            return existing
        job = JobPlanner.create(job_id, spec, self._now_s, self._options, initial)
        self._jobs[job_id] = job
        self._register_binding(job)
        return job

    def _register_binding(self, job: JobPlanner) -> None:
        self._bound_jobs.add(job.job_id)
        if job.spec.pipeline.effective_binding == "static" and not job.state.terminal:
            self.binder.set_static(job.job_id, job.spec.agent_names)

    def restore_job(self, persisted: PersistedJob, reported: Iterable[ExperienceSummary],
                    consumed_by: Mapping[str, int] | None = None) -> JobPlanner:
        """Rebuilds a job after a restart from its durable state and the experiences stored holds.

        ``consumed_by``: experience id -> the step stored says consumed it (see :meth:`JobPlanner.recover`).
        """
        job = JobPlanner.restore(persisted, self._now_s, self._options)
        job.recover(reported, consumed_by)
        self._jobs[persisted.job_id] = job
        self._register_binding(job)
        return job

    def job(self, job_id: str) -> JobPlanner:
        """A job; raises NotFound."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    def jobs(self) -> list[JobPlanner]:
        """Every job, in submission order."""
        return list(self._jobs.values())

    def cancel_job(self, job_id: str) -> JobSnapshot:
        """Cancels a job; its leases end and its slots are freed."""
        job = self.job(job_id)
        job.cancel()
        self._sweep()
        return self.snapshot(job_id)

    def snapshot(self, job_id: str) -> JobSnapshot:
        """Status of one job, with the slot bound to each agent."""
        job = self.job(job_id)
        return job.snapshot(lambda agent: self.binder.slot_of((job_id, agent)) or "",
                            lambda agent: self.binder.members((job_id, agent)))

    def take_changes(self) -> list[StateChange]:
        """Durable changes of every job, in order within each job."""
        changes: list[StateChange] = []
        for job in self._jobs.values():
            changes.extend(job.take_changes())
        return changes

    def _running(self) -> list[JobPlanner]:
        return [job for job in self._jobs.values() if not job.state.terminal]

    def _leasing(self) -> list[JobPlanner]:
        """Jobs whose rollout or eval work may be leased: running ones, and ended ones with an evaluation open."""
        return [job for job in self._jobs.values() if not job.state.terminal or job.evaluating]

    def _sweep(self) -> None:
        for job in self._jobs.values():
            if job.state.terminal and job.job_id in self._bound_jobs:
                self.binder.forget_agents(job.job_id)
                self._bound_jobs.discard(job.job_id)
                self.poll_wakes.mark_all()

    def _job_of_lease(self, lease_id: str) -> JobPlanner:
        job = self._jobs.get(job_id_of_lease(lease_id))
        if job is None:
            raise NotFound(f"lease {lease_id!r} not found")
        return job

    # ---- time and deaths ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expires overdue leases everywhere and forgets silent slots. Call often (and before every RPC)."""
        for job in self._leasing():
            for slot_id in job.tick():
                self._slot_lost(slot_id, "work expired")
        now_s = self._now_s()
        if now_s > self._silence_sweep_after_s:
            for slot in self.binder.slots():
                if now_s - slot.last_seen_s > self._options.slot_silence_s and not any(
                        job.slot_busy(slot.slot_id) for job in self._running()):
                    self._slot_lost(slot.slot_id, f"slot silent for {now_s - slot.last_seen_s:.0f} s")
            earliest_s = min((slot.last_seen_s for slot in self.binder.slots()), default=now_s)
            self._silence_sweep_after_s = min(earliest_s, now_s) + self._options.slot_silence_s
        self._sweep()

    def _slot_lost(self, slot_id: str, reason: str) -> None:
        self.poll_wakes.mark_all()
        self.binder.remove_slot(slot_id)
        for job in self._running():
            job.slot_lost(slot_id, reason)

    def worker_gone(self, worker_id: str) -> None:
        """A worker's registration expired: its task leases and slots are dead."""
        for slot_id in self.binder.slots_of_worker(worker_id):
            self._slot_lost(slot_id, f"worker {worker_id} gone")
        for job in self._leasing():
            job.revoke_worker(worker_id)
        self._sweep()

    # ---- rollout workers ------------------------------------------------------------------------------

    def lease_rollout_tasks(self, worker_id: str, max_tasks: int) -> list[RolloutTaskLease]:
        """Up to ``max_tasks`` tasks, round-robin over running jobs (oldest first)."""
        self.tick()
        leased: list[RolloutTaskLease] = []
        progress = True
        while len(leased) < max_tasks and progress:
            progress = False
            for job in self._leasing():
                if len(leased) >= max_tasks:
                    break
                got = job.lease_tasks(worker_id, 1)
                if got:
                    leased.extend(got)
                    progress = True
        return leased

    def has_leasable_tasks(self) -> bool:
        """Whether some running job has a rollout task to hand out now (no tick, no side effects)."""
        return any(job.has_leasable_tasks() for job in self._jobs.values())

    def renew_leases(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        """Renews task or micro-batch leases across jobs (``progress``: empty, or one figure per lease id)."""
        if progress and len(progress) != len(lease_ids):
            raise InvalidArgument(f"progress: {len(progress)} figures for {len(lease_ids)} lease ids")
        self.tick()
        job_ids = {job_id_of_lease(lease_id) for lease_id in lease_ids}
        if len(job_ids) == 1:  # the common call (a rolloutd's leases of one job): no regrouping
            only = self._jobs.get(job_ids.pop())
            if only is not None:
                return self._drop_stalled_slots(only.renew(worker_id, lease_ids, progress))
        by_job: dict[str, list[int]] = defaultdict(list)  # positions in lease_ids
        lost: list[str] = []
        for index, lease_id in enumerate(lease_ids):
            job = self._jobs.get(job_id_of_lease(lease_id))
            if job is None:
                lost.append(lease_id)
            else:
                by_job[job.job_id].append(index)
        deadlines: list[float] = []
        stalled_slots: list[str] = []
        for job_id, positions in by_job.items():
            result = self._jobs[job_id].renew(worker_id, [lease_ids[i] for i in positions],
                                              [progress[i] for i in positions] if progress else ())
            lost.extend(result.lost_lease_ids)
            stalled_slots.extend(result.stalled_slots)
            if len(result.lost_lease_ids) < len(positions):
                deadlines.append(result.deadline_s)
        lost_set = set(lost)
        return self._drop_stalled_slots(RenewResult(
            tuple(lease_id for lease_id in lease_ids if lease_id in lost_set),
            min(deadlines) if deadlines else self._now_s(), tuple(stalled_slots)))

    def _drop_stalled_slots(self, result: RenewResult) -> RenewResult:
        """Slots whose trainer work stalled are treated as dead (as slots whose work expired)."""
        for slot_id in result.stalled_slots:
            self._slot_lost(slot_id, "its work made no progress")
        return result

    def report_rollout_task(self, lease_id: str, worker_id: str, task_id: str, succeeded: bool, error: str,
                            experiences: Sequence[ExperienceSummary],
                            reason: ErrorReason = ErrorReason.UNSPECIFIED,
                            eval_episodes: Sequence[EvalEpisode] = (),
                            failed_episodes: Sequence[FailedEpisode] = ()) -> None:
        """See :meth:`JobPlanner.report_task`."""
        self.tick()
        try:
            self._job_of_lease(lease_id).report_task(lease_id, worker_id, task_id, succeeded, error, experiences,
                                                     reason, eval_episodes, failed_episodes)
        finally:
            self._sweep()

    def rollout_demand(self) -> dict[AgentKey, int]:
        """Estimated outstanding generation tokens per (job, agent), for rolloutd's balancer."""
        demand: dict[AgentKey, int] = {}
        for job in self._running():
            for agent, tokens in job.rollout_demand().items():
                demand[(job.job_id, agent)] = tokens
        return demand

    # ---- trainer slots ---------------------------------------------------------------------------------

    def _demands(self) -> dict[AgentKey, AgentDemand]:
        return self.poll_wakes.demands(self._running())

    def trainer_wakes(self, waiting: Collection[str]) -> set[str]:
        """Of the slots whose long poll waits (found no work), those a change since the last call may have given work.

        Call after every change (see :mod:`.poll_wakes`); a slot not returned would get the same answer.
        """
        return self.poll_wakes.wakes(self._running(), waiting)

    def poll_trainer_work(self, worker_id: str, slot_id: str, resident: Sequence[ResidentAgent] = (),
                          dp_address: str = "", capacity: float = 1.0) -> TrainerWork | None:
        """The next work for one trainer slot, or None (the servicer long-polls and asks again).

        ``dp_address``: the slot's data-parallel rendezvous (``""`` = it cannot join a group); ``capacity``:
        its training capacity (:mod:`orchestratord.binding`, "Slot capacity").
        """
        self.tick()
        slot = self.binder.observe_poll(slot_id, worker_id, {(r.job_id, r.agent): r.version for r in resident},
                                        dp_address, capacity)
        if slot.swapping_out is not None:
            job_id, agent = slot.swapping_out
            if job_id in self._jobs and not self._jobs[job_id].state.terminal:
                return SwapOutWork(job_id, agent, self._options.swap_location)
            slot.swapping_out = None
        demands = self._demands()  # tracked by the binder: its waiting agents follow them
        self.binder.note_waiting()
        decision = self.binder.decide(slot_id, demands)
        if decision.kind in (DecisionKind.BIND, DecisionKind.JOIN, DecisionKind.RELEASE):
            self.poll_wakes.mark((decision.agent, decision.successor))  # bindings change (not on KEEP: no loop)
        if decision.kind is DecisionKind.RELEASE and decision.agent is not None:
            job_id, agent = decision.agent
            primary = self.binder.slot_of(decision.agent) == slot_id
            self.binder.release(slot_id)
            self._jobs[job_id].release_slot(agent)
            if primary and not self._jobs[job_id].state_is_portable(agent):
                # A non-primary member never holds the only copy: rank 0 holds the same version.
                slot.swapping_out = decision.agent
                return SwapOutWork(job_id, agent, self._options.swap_location)
            if decision.successor is None:
                return None
            self.binder.bind(slot_id, decision.successor)
            return self._trainer_work(decision.successor, slot_id, worker_id, demands)
        if decision.kind is DecisionKind.BIND and decision.agent is not None:
            self.binder.bind(slot_id, decision.agent)
        if decision.kind is DecisionKind.JOIN and decision.agent is not None:
            self.binder.join(slot_id, decision.agent)
        if decision.kind in (DecisionKind.BIND, DecisionKind.KEEP, DecisionKind.JOIN) and decision.agent is not None:
            return self._trainer_work(decision.agent, slot_id, worker_id, demands)
        return None

    def _trainer_work(self, agent: AgentKey, slot_id: str, worker_id: str,
                      demands: Mapping[AgentKey, AgentDemand]) -> TrainerWork | None:
        """Grows the agent's group at a step boundary (data parallelism), then the slot's next work."""
        demand = demands.get(agent)
        if demand is not None and not demand.mid_step:
            joined = self.binder.grow(agent, demands)
            if joined:
                self.poll_wakes.mark((agent,))
                logger.info("agent %s/%s: slots %s joined its data-parallel group (now %s)", agent[0], agent[1],
                            joined, list(self.binder.members(agent)))
        return self._jobs[agent[0]].next_trainer_work(agent[1], slot_id, worker_id, self.binder.group(agent))

    def ack_micro_batch(self, lease_id: str, worker_id: str, slot_id: str, episodes: int = 0) -> None:
        """See :meth:`JobPlanner.ack_micro_batch`.

        The ack speaks for the slot: it polled last before this micro-batch, which may have run for
        longer than the silence bound (a large state swapping in, a slow device).
        """
        self.binder.touch(slot_id, worker_id)
        self.tick()
        self._job_of_lease(lease_id).ack_micro_batch(lease_id, worker_id, slot_id, episodes)

    def commit_step(self, worker_id: str, slot_id: str, job_id: str, agent: str, step: int, new_version: int,
                    weights_uri: str, state_uri: str, loss: float = 0.0, grad_norm: float = 0.0,
                    step_seconds: float = 0.0, figures: Mapping[str, float] | None = None) -> None:
        """See :meth:`JobPlanner.commit_step` (the commit speaks for the slot, as an ack does)."""
        self.binder.touch(slot_id, worker_id)
        self.tick()
        try:
            self.job(job_id).commit_step(worker_id, slot_id, agent, step, new_version, weights_uri, state_uri,
                                         loss, grad_norm, step_seconds, figures)
        finally:
            self._sweep()

    def report_slot_event(self, worker_id: str, slot_id: str, job_id: str, agent: str, kind: SlotEventKind,
                          state_uri: str = "", error: str = "") -> None:
        """A slot finished a swap-out or failed.

        Raises:
            FailedPrecondition: a swap-out that was not asked of this slot.
        """
        self.tick()
        if kind is SlotEventKind.FAILED:
            self._slot_lost(slot_id, f"slot reported failure: {error}")
            self._sweep()
            return
        slot = self.binder.slot(slot_id)
        if slot is None or slot.worker_id != worker_id or slot.swapping_out != (job_id, agent):
            raise FailedPrecondition(f"slot {slot_id!r} was not asked to swap out agent {agent!r} of {job_id!r}")
        slot.swapping_out = None
        self.poll_wakes.mark_all()
        job = self.job(job_id)
        if not job.state.terminal:
            job.record_swap_out(agent, state_uri)
