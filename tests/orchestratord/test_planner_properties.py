"""Property tests: the planner's invariants under random interleavings of completions, expiries and deaths."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flexmarl.errors import FailedPrecondition
from orchestratord.leases import LeaseKind, LeaseStatus
from orchestratord.planner import (
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    PlannerOptions,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
)
from orchestratord.planner.ids import batch_of_lease, prune_group_of_lease
from orchestratord.planner.job_plan import MicroBatchStatus
from orchestratord.state import JobState

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")
SLOTS = ("s0", "s1")
ROLLOUT_WORKERS = ("r0", "r1")
JOB = "job1"


class PlannerMachine(RuleBasedStateMachine):
    """A fake cluster (rollout workers and trainer slots that accumulate gradients) driving one job."""

    @initialize(
        mode=st.sampled_from(["async", "sync", "sequential", "static"]),
        binding=st.sampled_from([None, "static"]),
        eta=st.integers(0, 2),
        prompts=st.integers(2, 3),
        groups_per_mb=st.integers(1, 2),
        turns=st.integers(1, 2),
        max_slots=st.sampled_from([1, 2]),
    )
    def setup(self, mode: str, binding: str | None, eta: int, prompts: int, groups_per_mb: int, turns: int,
              max_slots: int) -> None:
        self.clock = FakeClock()
        self.eta = eta
        self.turns = turns
        self.planner = Planner(self.clock, PlannerOptions(lease_epoch="e", max_task_attempts=10_000,
                                                          max_step_attempts=10_000,
                                                          dp_min_micro_batches_per_member=1))
        self.spec = make_spec(pipeline={"mode": mode, "max_staleness": eta, "binding": binding},
                              agents=[{"name": agent, "model": "/models/tiny", "max_slots": max_slots}
                                      for agent in AGENTS],
                              batch={"prompts_per_step": prompts, "group_size": 2,
                                     "micro_batch_size": 2 * groups_per_mb},
                              total_steps=3)
        self.planner.submit_job(JOB, self.spec)
        self.job = self.planner.job(JOB)
        self.held: dict[str, tuple[str, RolloutTaskLease]] = {}  # lease id -> (worker, lease)
        self.accepted: dict[str, dict[str, int]] = {}  # task id -> experience id -> behaviour version
        self.inbox: dict[str, object] = {}
        self.generation = {slot: 0 for slot in SLOTS}
        self.accum: dict[str, tuple[str, list[str]]] = {}  # slot -> (step id, acked experience ids)
        self.resident: dict[str, dict[str, int]] = {slot: {} for slot in SLOTS}
        self.consumed: dict[tuple[str, int], tuple[str, ...]] = {}
        self.manifests_seen: dict[tuple[str, int], tuple[str, ...]] = {}
        self.members_of_attempt: dict[str, tuple[str, ...]] = {}  # step id -> its slots

    def worker_of(self, slot: str) -> str:
        return f"w-{slot}-{self.generation[slot]}"

    # ---- rollout workers ----------------------------------------------------------------------------

    @rule(worker=st.sampled_from(ROLLOUT_WORKERS), count=st.integers(1, 3))
    def lease_tasks(self, worker: str, count: int) -> None:
        for lease in self.planner.lease_rollout_tasks(worker, count):
            assert lease.task_id not in self.accepted, "a finished task was leased again"
            for version in lease.agent_versions:
                assert lease.batch_index - version.version <= self.eta or self.spec.pipeline.barrier
            self.held[lease.lease_id] = (worker, lease)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), succeed=st.booleans())
    def report_task(self, data: st.DataObject, succeed: bool) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.held)))
        worker, lease = self.held.pop(lease_id)
        # A worker generates with the versions it was told or newer ones it has since loaded.
        versions = {v.agent: max(v.version, self.job.version(v.agent) if data.draw(st.booleans()) else v.version)
                    for v in lease.agent_versions}
        experiences = experiences_for(lease, AGENTS, turns=self.turns, versions=versions)
        try:
            self.planner.report_rollout_task(lease_id, worker, lease.task_id, succeed, "", experiences)
        except FailedPrecondition:
            return
        if succeed:
            assert lease.task_id not in self.accepted, "a task was accepted twice"
            self.accepted[lease.task_id] = {e.experience_id: e.behavior_version for e in experiences}

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0, 25.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.planner.tick()

    @rule(worker=st.sampled_from(ROLLOUT_WORKERS))
    def kill_rollout_worker(self, worker: str) -> None:
        self.planner.worker_gone(worker)
        for lease_id in [lid for lid, (w, _) in self.held.items() if w == worker]:
            del self.held[lease_id]

    # ---- trainer slots --------------------------------------------------------------------------------

    @rule(slot=st.sampled_from(SLOTS))
    def poll(self, slot: str) -> None:
        resident = [ResidentAgent(JOB, agent, version) for agent, version in self.resident[slot].items()]
        work = self.planner.poll_trainer_work(self.worker_of(slot), slot, resident, dp_address=f"host:{slot}")
        if work is None:
            return
        self.inbox[slot] = work
        if isinstance(work, MicroBatchWork | OptimizerStepWork):
            members = work.group.members if work.group is not None else (slot,)
            assert slot in members
            assert len(members) <= self.spec.agent(work.agent).max_slots, "more slots than max_slots"
            # Fixed membership: an attempt's slots never change.
            assert self.members_of_attempt.setdefault(work.step_id, members) == members, "membership changed"
        if isinstance(work, MicroBatchWork):
            self.check_micro_batch(work)
            if self.accum.get(slot, ("", []))[0] != work.step_id:
                self.accum[slot] = (work.step_id, [])  # a new attempt: drop accumulated gradients
            self.resident[slot][work.agent] = work.base_version

    def check_micro_batch(self, work: MicroBatchWork) -> None:
        assert work.base_version == work.step == self.job.version(work.agent)
        if self.spec.pipeline.barrier:
            done = [tid for tid in self.accepted if f"/b{work.step}/" in tid]
            assert len(done) == self.spec.batch.prompts_per_step, "a barrier mode leased before the barrier"
        if self.spec.pipeline.mode == "sequential":
            index = AGENTS.index(work.agent)
            assert index == 0 or self.job.version(AGENTS[index - 1]) > work.step, "sequential order broken"
        for eid in work.experience_ids:
            task_id = eid.rsplit("/", 3)[0]
            assert f"/b{work.step}/" in task_id, "an experience of another batch"
            assert eid.split("/")[-2] == work.agent
            behaviour = self.accepted[task_id][eid]
            assert work.base_version - behaviour <= self.eta, "staleness bound exceeded"
        assert len(set(work.experience_ids)) == len(work.experience_ids)

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data())
    def finish_work(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.inbox)))
        work = self.inbox.pop(slot)
        worker = self.worker_of(slot)
        if isinstance(work, MicroBatchWork):
            try:
                self.planner.ack_micro_batch(work.lease_id, worker, slot)
            except FailedPrecondition:
                return
            step_id, ids = self.accum[slot]
            assert step_id == work.step_id
            ids.extend(work.experience_ids)
        elif isinstance(work, OptimizerStepWork):
            if work.rank > 0:
                return  # a data-parallel member steps with rank 0; only rank 0 commits
            try:
                self.planner.commit_step(worker, slot, JOB, work.agent, work.step, work.new_version,
                                         f"file:///w/{work.agent}/{work.new_version}",
                                         f"file:///s/{work.agent}/{work.new_version}")
            except FailedPrecondition:
                return
            # The step's gradient = what every member of the attempt accumulated under its step id.
            ids = []
            for member in [s for s, (step_id, _) in self.accum.items() if step_id == work.step_id]:
                ids.extend(self.accum.pop(member)[1])
            manifest = self.manifests_seen[(work.agent, work.step)]
            assert len(ids) == len(set(ids)), "an experience was accumulated twice in one step"
            assert tuple(sorted(ids)) == manifest, "the committed step did not consume exactly its manifest"
            assert work.step_episodes == self.spec.batch.episodes_per_step
            assert (work.agent, work.step) not in self.consumed
            self.consumed[(work.agent, work.step)] = manifest
            for member in work.group.members if work.group is not None else (slot,):
                self.resident[member][work.agent] = work.new_version
        elif isinstance(work, SwapOutWork):
            self.planner.report_slot_event(worker, slot, JOB, work.agent, SlotEventKind.SWAPPED_OUT,
                                           f"stored://state/{work.agent}")

    @rule(slot=st.sampled_from(SLOTS))
    def kill_trainer(self, slot: str) -> None:
        self.planner.worker_gone(self.worker_of(slot))
        self.generation[slot] += 1
        self.inbox.pop(slot, None)
        self.accum.pop(slot, None)
        self.resident[slot] = {}

    # ---- invariants -------------------------------------------------------------------------------------

    @invariant()
    def admission_bound(self) -> None:
        if hasattr(self, "job"):
            assert self.job.admitted_tasks <= self.job.admission_limit()

    @invariant()
    def manifests_are_fixed_and_exact(self) -> None:
        if not hasattr(self, "job"):
            return
        for agent in AGENTS:
            for step in range(self.spec.total_steps):
                manifest = self.job.manifest(agent, step)
                if manifest is None:
                    continue
                key = (agent, step)
                if key in self.manifests_seen:
                    assert manifest.experience_ids == self.manifests_seen[key], "a manifest changed"
                    continue
                expected = sorted(eid for tid, exps in self.accepted.items() if f"/b{step}/" in tid
                                  for eid in exps if eid.split("/")[-2] == agent)
                assert list(manifest.experience_ids) == expected
                self.manifests_seen[key] = manifest.experience_ids

    @invariant()
    def micro_batch_tallies_match_a_recount(self) -> None:
        """The counts a trainer poll reads in O(1) (StepPlan.set_status keeps them) agree with the micro-batches."""
        if not hasattr(self, "job"):
            return
        for agent in AGENTS:
            plan = self.job.current_plan(agent)
            if plan is None:
                continue
            statuses = [mb.status for mb in plan.micro_batches]
            ready = [mb for mb in plan.micro_batches if mb.status is MicroBatchStatus.READY]
            assert plan.ready_count == len(ready)
            assert plan.ready_tokens == sum(mb.response_tokens for mb in ready)
            assert plan.formed_tokens == sum(mb.response_tokens for mb in plan.micro_batches)
            assert plan.leased_count == statuses.count(MicroBatchStatus.LEASED)
            assert plan.acked_count == statuses.count(MicroBatchStatus.ACKED)
            assert plan.formed_groups == sum(len(mb.groups) for mb in plan.micro_batches)
            assert plan.first_ready_micro_batch() is (ready[0] if ready else None)
            for slot in SLOTS:
                held = [mb for mb in plan.micro_batches if mb.status is MicroBatchStatus.LEASED and mb.slot_id == slot]
                assert plan.leased_to(slot) is (held[0] if held else None)

    @invariant()
    def kept_demands_match_a_recount(self) -> None:
        """The demands a trainer poll reads (kept; recomputed for touched agents only) agree with a recount."""
        if not hasattr(self, "job"):
            return
        kept = dict(self.planner.poll_wakes.demands([self.job] if not self.job.state.terminal else []))
        expected = {} if self.job.state.terminal else {
            (JOB, agent): self.job.data_parallel_demand(agent) for agent in AGENTS}
        assert kept == expected

    @invariant()
    def kept_lease_and_deadline_indexes_match_a_recount(self) -> None:
        """The active leases by kind (what rollout_demand counts) and the optimizer deadlines recovery.tick reads.

        LeaseTable.active(kind) reads its index, not every lease it remembers; every plan with an
        optimizer deadline has its entry in JobPlan.optimizer_deadlines, so a tick finds it once due.
        """
        if not hasattr(self, "job"):
            return
        plan_job = self.job._job
        leases = plan_job.leases
        for kind in LeaseKind:
            assert leases.active(kind) == [lease for lease in leases.all()
                                           if lease.status is LeaseStatus.ACTIVE and lease.kind is kind]
            assert leases.active_count(kind) == len(leases.active(kind))
        # The expiry heap: one live entry per active lease (the planner ends every lease due() returns), at or
        # before its deadline; renewals add none.
        queued = leases.queued_deadlines()
        assert queued.keys() == {lease.lease_id for lease in leases.active()}
        assert all(queued[lease.lease_id] <= lease.deadline_s for lease in leases.active())
        # The binder's waiting agents (its index over the kept demands) are those a walk of them finds.
        kept = self.planner.poll_wakes.cached()
        assert self.planner.binder.waiting() == {key for key, demand in kept.items()
                                                 if demand.has_work and not self.planner.binder.members(key)}
        # The coordinator's slot gauges read every slot's business in one pass (busy_slots), not per slot.
        assert self.job.busy_slots() == {slot for slot in SLOTS if self.job.slot_busy(slot)}
        pending = set(plan_job.optimizer_deadlines)
        for key, plan in plan_job.plans.items():
            if plan.optimizer_deadline_s is not None:
                assert (plan.optimizer_deadline_s, key) in pending
        # What a done step's pruning reads instead of every task and lease the job keeps: each placed task is
        # filed under its step, each kept lease (but an eval task's) under its task or batch.
        for task in plan_job.tasks.values():
            if task.step is not None:
                assert task.task_id in plan_job.task_ids_by_step.get(task.step, ())
        for lease in leases.all():
            group = prune_group_of_lease(lease)
            assert group is None or lease.lease_id in leases.group(group)
        # ... and what it forgets: the tasks of the steps every agent committed, and their batches' ended leases.
        done = plan_job.min_version()
        assert all(task.step is None or task.step >= done for task in plan_job.tasks.values())
        assert all(lease.status is LeaseStatus.ACTIVE or lease.kind is not LeaseKind.MICRO_BATCH
                   or batch_of_lease(lease) >= done for lease in leases.all())
        assert all(lease.subject in plan_job.tasks for lease in leases.all()  # none given up or dropped here
                   if lease.kind is LeaseKind.ROLLOUT_TASK)

    @invariant()
    def versions_count_commits(self) -> None:
        if hasattr(self, "job"):
            for agent in AGENTS:
                assert self.job.version(agent) == sum(1 for a, _ in self.consumed if a == agent)
            assert self.job.state in (JobState.RUNNING, JobState.SUCCEEDED)

    def teardown(self) -> None:
        """Liveness: with every worker healthy from here on, the job finishes and consumes everything once."""
        if not hasattr(self, "job"):
            return
        for _ in range(2_000):
            if self.job.state is not JobState.RUNNING:
                break
            self.lease_tasks("r0", 3)
            while self.held:
                lease_id = sorted(self.held)[0]
                worker, lease = self.held.pop(lease_id)
                experiences = experiences_for(lease, AGENTS, turns=self.turns)
                try:
                    self.planner.report_rollout_task(lease_id, worker, lease.task_id, True, "", experiences)
                except FailedPrecondition:
                    continue
                self.accepted[lease.task_id] = {e.experience_id: e.behavior_version for e in experiences}
            self.manifests_are_fixed_and_exact()
            for slot in SLOTS:
                self.inbox.pop(slot, None)
                self.poll(slot)
                if slot in self.inbox:
                    self.manifests_are_fixed_and_exact()
                    self.finish_work_on(slot)
            self.clock.advance(1.0)
        assert self.job.state is JobState.SUCCEEDED, self.job.snapshot()
        all_experiences = sorted(eid for exps in self.accepted.values() for eid in exps)
        consumed = sorted(eid for ids in self.consumed.values() for eid in ids)
        assert consumed == all_experiences, "exactly-once: every accepted experience consumed exactly once"
        self.kept_lease_and_deadline_indexes_match_a_recount()  # every step done: each was pruned

    def finish_work_on(self, slot: str) -> None:
        class _Fixed:
            def draw(self, _strategy: object) -> str:
                return slot

        self.finish_work(_Fixed())  # type: ignore[arg-type]


PlannerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPlannerInvariants = PlannerMachine.TestCase


class WakingPlannerMachine(PlannerMachine):
    """The same cluster, with orchestratord's targeted long-poll wakes: no waiting poll misses work."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: set[str] = set()  # slots whose last poll found no work and that were not woken since

    @rule(slot=st.sampled_from(SLOTS))
    def poll(self, slot: str) -> None:
        self.waiting.add(slot)  # as the coordinator: registered before the call, so the call's own change wakes it
        super().poll(slot)
        if slot in self.inbox:
            self.waiting.discard(slot)
        self.wake()

    @rule(slot=st.sampled_from(SLOTS))
    def kill_trainer(self, slot: str) -> None:
        super().kill_trainer(slot)
        self.waiting.discard(slot)

    def wake(self) -> None:
        """What the coordinator does after every mutation: the slots to poll again stop waiting."""
        self.waiting -= self.planner.trainer_wakes(self.waiting)

    @invariant()
    def no_wake_is_lost(self) -> None:
        """A poll that was not woken would still find no work (on a copy of the planner, after its tick)."""
        if not hasattr(self, "job"):
            return
        self.planner.tick()  # the coordinator's tick loop
        self.wake()
        for slot in sorted(self.waiting):
            planner = copy.deepcopy(self.planner)
            resident = [ResidentAgent(JOB, agent, version) for agent, version in self.resident[slot].items()]
            work = planner.poll_trainer_work(self.worker_of(slot), slot, resident, dp_address=f"host:{slot}")
            assert work is None, f"slot {slot} waits, unwoken, while a poll would get {work}"


WakingPlannerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestNoLostWakes = WakingPlannerMachine.TestCase
