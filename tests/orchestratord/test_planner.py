from __future__ import annotations

import pytest

from flexmarl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from flexmarl.ids import TaskRef
from orchestratord.planner import (
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    PlannerOptions,
    SlotEventKind,
    SwapOutWork,
)
from orchestratord.planner.demand import rolloutd_share
from orchestratord.state import JobState, ManifestFixed, StepCommitted

from .helpers import FakeClock, experiences_for, make_spec, run_job

AGENTS = ("sender", "receiver")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def new_planner(clock: FakeClock, **spec_sections: object) -> Planner:
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    planner.submit_job("job1", make_spec(**spec_sections))
    return planner


def report(planner: Planner, lease, worker: str = "roll-0", **kw) -> None:  # type: ignore[no-untyped-def]
    planner.report_rollout_task(lease.lease_id, worker, lease.task_id, True, "", experiences_for(lease, AGENTS, **kw))


def test_task_ids_and_indices_are_deterministic(clock: FakeClock) -> None:
    planner = new_planner(clock)
    leases = planner.lease_rollout_tasks("roll-0", 10)
    assert [lease.task_id for lease in leases] == [str(TaskRef("job1", 0, i)) for i in range(4)]
    assert [lease.task_index for lease in leases] == [0, 1, 2, 3]
    assert all(lease.batch_index == 0 and lease.attempt == 1 and lease.group_size == 2 for lease in leases)
    assert {v.agent: v.version for v in leases[0].agent_versions} == {"sender": 0, "receiver": 0}
    assert leases[0].deadline_s == clock.now + 10


def test_admission_eta0_waits_for_every_agent_commit(clock: FakeClock) -> None:
    planner = new_planner(clock)
    job = planner.job("job1")
    leases = planner.lease_rollout_tasks("roll-0", 100)
    assert len(leases) == 4 and planner.lease_rollout_tasks("roll-0", 100) == []
    for lease in leases:
        report(planner, lease)
    # Train one agent's step 0 only: batch 1 must still wait for the other agent.
    while max(job.version(a) for a in AGENTS) == 0:
        work = planner.poll_trainer_work("t", "slot-0")
        if isinstance(work, MicroBatchWork):
            planner.ack_micro_batch(work.lease_id, "t", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("t", "slot-0", "job1", work.agent, work.step, work.new_version, "file:///w", "file:///s")
    assert job.admitted_tasks == 4 and planner.lease_rollout_tasks("roll-0", 100) == []


def test_admission_with_staleness_one_admits_two_batches(clock: FakeClock) -> None:
    planner = new_planner(clock, pipeline={"max_staleness": 1})
    leases = planner.lease_rollout_tasks("roll-0", 100)
    assert [lease.batch_index for lease in leases] == [0] * 4 + [1] * 4
    assert planner.job("job1").admission_limit() == 8


def test_expired_task_lease_is_reissued_and_late_report_rejected(clock: FakeClock) -> None:
    planner = new_planner(clock)
    first = planner.lease_rollout_tasks("roll-0", 1)[0]
    clock.advance(10.5)
    again = planner.lease_rollout_tasks("roll-1", 1)[0]
    assert again.task_id == first.task_id and again.attempt == 2 and again.lease_id != first.lease_id
    with pytest.raises(FailedPrecondition, match="no longer held"):
        report(planner, first)
    report(planner, again, worker="roll-1")


def test_unknown_lease_and_wrong_worker(clock: FakeClock) -> None:
    planner = new_planner(clock)
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    with pytest.raises(NotFound):
        planner.report_rollout_task("job1/zz-task-9", "roll-0", lease.task_id, True, "", [])
    with pytest.raises(NotFound):
        planner.report_rollout_task("nojob/zz-task-9", "roll-0", lease.task_id, True, "", [])
    with pytest.raises(FailedPrecondition, match="held by"):
        report(planner, lease, worker="roll-9")


def test_renew_extends_and_reports_lost(clock: FakeClock) -> None:
    planner = new_planner(clock)
    a, b = planner.lease_rollout_tasks("roll-0", 2)
    clock.advance(8)
    result = planner.renew_leases("roll-0", [a.lease_id, "job1/x-task-1", "other/x"])
    assert result.lost_lease_ids == ("job1/x-task-1", "other/x") and result.deadline_s == clock.now + 10
    clock.advance(5)  # b expired, a renewed
    assert planner.renew_leases("roll-0", [a.lease_id, b.lease_id]).lost_lease_ids == (b.lease_id,)


def test_failed_report_reissues_until_max_attempts_then_job_fails(clock: FakeClock) -> None:
    planner = Planner(clock, PlannerOptions(lease_epoch="e0", max_task_attempts=2))
    planner.submit_job("job1", make_spec())
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, False, "boom", [])
    retry = planner.lease_rollout_tasks("roll-0", 1)[0]
    assert retry.task_id == lease.task_id and retry.attempt == 2
    planner.report_rollout_task(retry.lease_id, "roll-0", retry.task_id, False, "boom", [])
    job = planner.job("job1")
    assert job.state is JobState.FAILED and "failed 2 times" in job.error
    assert planner.lease_rollout_tasks("roll-0", 1) == []


def test_an_unrunnable_job_fails_on_its_first_report(clock: FakeClock) -> None:
    from flexmarl.errors import ErrorReason

    planner = Planner(clock, PlannerOptions(lease_epoch="e0", max_task_attempts=5))
    planner.submit_job("job1", make_spec())
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, False,
                                "cannot load environment 'examples.signalling.env:X'", [],
                                reason=ErrorReason.JOB_UNRUNNABLE)
    job = planner.job("job1")
    assert job.state is JobState.FAILED
    assert "cannot load environment 'examples.signalling.env:X'" in job.error and "roll-0" in job.error
    assert planner.lease_rollout_tasks("roll-0", 1) == []


def test_malformed_and_stale_reports_are_rejected_and_reissued(clock: FakeClock) -> None:
    planner = new_planner(clock)
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    partial = [e for e in experiences_for(lease, AGENTS) if not (e.agent == "receiver" and e.sample_index == 1)]
    with pytest.raises(InvalidArgument, match="no experience for episodes \\[1\\]"):
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "", partial)
    retry = planner.lease_rollout_tasks("roll-0", 1)[0]
    assert retry.task_id == lease.task_id
    with pytest.raises(FailedPrecondition, match="claims version 3"):
        report(planner, retry, versions={"sender": 3, "receiver": 0})
    bad_group = planner.lease_rollout_tasks("roll-0", 1)[0]
    exps = experiences_for(bad_group, AGENTS)
    exps[0] = type(exps[0])(**{**exps[0].__dict__, "group_id": "x/sender"})
    with pytest.raises(InvalidArgument, match="group_id must be"):
        planner.report_rollout_task(bad_group.lease_id, "roll-0", bad_group.task_id, True, "", exps)


def test_micro_batches_form_from_complete_groups_while_rollouts_run(clock: FakeClock) -> None:
    planner = new_planner(clock)
    leases = planner.lease_rollout_tasks("roll-0", 4)
    assert planner.poll_trainer_work("t", "slot-0") is None
    report(planner, leases[2])
    assert planner.poll_trainer_work("t", "slot-0") is None  # one group < micro_batch_size 4 episodes
    report(planner, leases[0])
    work = planner.poll_trainer_work("t", "slot-0")
    assert isinstance(work, MicroBatchWork)
    assert work.step == 0 and work.base_version == 0 and work.step_episodes == 8 and work.micro_batch_index == 0
    # arrival order: task 2 then task 0, complete groups only
    agent = work.agent
    assert work.experience_ids == (f"job1/b0/t2/0/{agent}/0", f"job1/b0/t2/1/{agent}/0",
                                   f"job1/b0/t0/0/{agent}/0", f"job1/b0/t0/1/{agent}/0")
    # the same poll again delivers the same lease (lost response)
    assert planner.poll_trainer_work("t", "slot-0") == work
    planner.ack_micro_batch(work.lease_id, "t", "slot-0", episodes=4)
    planner.ack_micro_batch(work.lease_id, "t", "slot-0")  # idempotent
    assert planner.poll_trainer_work("t", "slot-0") is None  # tasks 1 and 3 still running
    assert planner.job("job1").manifest(agent, 0) is None
    report(planner, leases[1])
    report(planner, leases[3])
    manifest = planner.job("job1").manifest(agent, 0)
    assert manifest is not None and manifest.step_episodes == 8 and len(manifest.experience_ids) == 8
    assert list(manifest.experience_ids) == sorted(manifest.experience_ids)
    second = planner.poll_trainer_work("t", "slot-0")
    assert isinstance(second, MicroBatchWork) and second.agent == agent and second.micro_batch_index == 1
    planner.ack_micro_batch(second.lease_id, "t", "slot-0")
    step = planner.poll_trainer_work("t", "slot-0")
    assert isinstance(step, OptimizerStepWork)
    assert step.new_version == 1 and step.num_micro_batches == 2 and step.step_episodes == 8
    assert step.step_response_tokens == manifest.step_response_tokens
    changes = planner.take_changes()
    assert sum(isinstance(c, ManifestFixed) for c in changes) == 2
    planner.commit_step("t", "slot-0", "job1", agent, 0, 1, "file:///w1", "file:///s1")
    planner.commit_step("t", "slot-0", "job1", agent, 0, 1, "file:///w1", "file:///s1")  # idempotent
    assert planner.job("job1").version(agent) == 1
    assert [type(c) for c in planner.take_changes()] == [StepCommitted]
    with pytest.raises(FailedPrecondition, match="already committed"):
        planner.commit_step("t", "slot-0", "job1", agent, 0, 1, "file:///other", "file:///s1")


def test_sync_mode_is_a_barrier(clock: FakeClock) -> None:
    planner = new_planner(clock, pipeline={"mode": "sync", "max_staleness": 2})
    leases = planner.lease_rollout_tasks("roll-0", 100)
    assert len(leases) == 4  # sync: eta is 0 for admission
    for lease in reversed(leases[1:]):
        report(planner, lease)
    assert planner.poll_trainer_work("t", "slot-0") is None  # 3 of 4 tasks done: no micro-batch yet
    report(planner, leases[0])
    work = planner.poll_trainer_work("t", "slot-0")
    assert isinstance(work, MicroBatchWork)
    # sync forms micro-batches in task order, whatever the arrival order
    assert work.experience_ids[0].startswith("job1/b0/t0/")


def test_trainer_death_replays_whole_step_with_same_manifest(clock: FakeClock) -> None:
    planner = new_planner(clock)
    for lease in planner.lease_rollout_tasks("roll-0", 4):
        report(planner, lease)
    first = planner.poll_trainer_work("t0", "slot-0")
    assert isinstance(first, MicroBatchWork)
    planner.ack_micro_batch(first.lease_id, "t0", "slot-0")
    second = planner.poll_trainer_work("t0", "slot-0")
    assert isinstance(second, MicroBatchWork)
    planner.worker_gone("t0")
    with pytest.raises(FailedPrecondition):
        planner.ack_micro_batch(second.lease_id, "t0", "slot-0")
    replayed = [planner.poll_trainer_work("t1", "slot-1") for _ in range(1)][0]
    assert isinstance(replayed, MicroBatchWork)
    assert replayed.agent == first.agent and replayed.micro_batch_index == 0
    assert replayed.step_id.endswith("/a1") and first.step_id.endswith("/a0")
    assert replayed.experience_ids == first.experience_ids and replayed.base_version == 0


def test_micro_batch_lease_expiry_replays_step(clock: FakeClock) -> None:
    planner = new_planner(clock)
    for lease in planner.lease_rollout_tasks("roll-0", 4):
        report(planner, lease)
    first = planner.poll_trainer_work("t0", "slot-0")
    assert isinstance(first, MicroBatchWork)
    clock.advance(21)
    with pytest.raises(FailedPrecondition):
        planner.ack_micro_batch(first.lease_id, "t0", "slot-0")
    seen = []
    for _ in range(20):
        work = planner.poll_trainer_work("t0", "slot-0")
        if isinstance(work, MicroBatchWork):
            seen.append(work)
            planner.ack_micro_batch(work.lease_id, "t0", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("t0", "slot-0", "job1", work.agent, 0, 1, "file:///w", "file:///s")
    again = [w for w in seen if w.agent == first.agent]
    assert again[0].step_id.endswith("/a1") and again[0].experience_ids == first.experience_ids


def test_late_commit_of_replayed_attempt_is_rejected(clock: FakeClock) -> None:
    planner = new_planner(clock)
    for lease in planner.lease_rollout_tasks("roll-0", 4):
        report(planner, lease)
    agent = None
    while True:
        work = planner.poll_trainer_work("t0", "slot-0")
        if isinstance(work, MicroBatchWork):
            agent = work.agent
            planner.ack_micro_batch(work.lease_id, "t0", "slot-0")
        else:
            assert isinstance(work, OptimizerStepWork)
            break
    planner.report_slot_event("t0", "slot-0", "", "", SlotEventKind.FAILED, error="oom")
    with pytest.raises(FailedPrecondition, match="no optimizer step"):
        planner.commit_step("t0", "slot-0", "job1", work.agent, 0, 1, "file:///w", "file:///s")
    assert agent == work.agent and planner.job("job1").version(work.agent) == 0


def test_swap_out_when_state_is_not_durable(clock: FakeClock) -> None:
    planner = new_planner(clock)
    for lease in planner.lease_rollout_tasks("roll-0", 4):
        report(planner, lease)
    first_agent = None
    while True:
        work = planner.poll_trainer_work("t0", "slot-0")
        if isinstance(work, MicroBatchWork):
            first_agent = work.agent
            planner.ack_micro_batch(work.lease_id, "t0", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("t0", "slot-0", "job1", work.agent, 0, 1, "file:///w", "mem://slot-0/state")
            break
    from orchestratord.planner import ResidentAgent
    swap = planner.poll_trainer_work("t0", "slot-0", [ResidentAgent("job1", first_agent, 1)])
    assert swap == SwapOutWork("job1", first_agent, "stored")
    assert planner.poll_trainer_work("t0", "slot-0") == swap  # until confirmed
    with pytest.raises(FailedPrecondition):
        planner.report_slot_event("t0", "slot-1", "job1", first_agent, SlotEventKind.SWAPPED_OUT, "stored://x")
    planner.report_slot_event("t0", "slot-0", "job1", first_agent, SlotEventKind.SWAPPED_OUT, "stored://x")
    other = planner.poll_trainer_work("t0", "slot-0")
    assert isinstance(other, MicroBatchWork) and other.agent != first_agent


def test_job_runs_to_success_on_one_slot_and_two_slots(clock: FakeClock) -> None:
    for slots in (("slot-0",), ("slot-0", "slot-1")):
        planner = new_planner(clock)
        run_job(planner, clock, "job1", slots=slots)
        job = planner.job("job1")
        assert job.state is JobState.SUCCEEDED
        assert [v.version for v in job.versions()] == [3, 3]
        snap = planner.snapshot("job1")
        assert snap.tasks_done == 12 == snap.tasks_total


def test_submit_is_idempotent_and_rejects_other_spec(clock: FakeClock) -> None:
    planner = new_planner(clock)
    assert planner.submit_job("job1", make_spec()) is planner.job("job1")
    with pytest.raises(AlreadyExists):
        planner.submit_job("job1", make_spec(total_steps=9))
    with pytest.raises(InvalidArgument):
        planner.submit_job("bad/id", make_spec())


def test_cancel_ends_leases(clock: FakeClock) -> None:
    planner = new_planner(clock)
    lease = planner.lease_rollout_tasks("roll-0", 1)[0]
    assert planner.cancel_job("job1").state is JobState.CANCELLED
    with pytest.raises(FailedPrecondition, match="cancelled"):
        report(planner, lease)
    assert planner.lease_rollout_tasks("roll-0", 1) == []


def test_rollout_demand_counts_outstanding_tokens(clock: FakeClock) -> None:
    planner = new_planner(clock, agents=[
        {"name": "sender", "model": "/m", "sampling": {"max_new_tokens": 10}},
        {"name": "receiver", "model": "/m", "sampling": {"max_new_tokens": 100}},
    ])
    demand = planner.rollout_demand()
    assert demand == {("job1", "sender"): 80, ("job1", "receiver"): 800}

    # Each of 3 rolloutds is hinted its share (rounded up: an agent with demand keeps a hint), not the job's.
    assert rolloutd_share(demand, 3) == {("job1", "sender"): 27, ("job1", "receiver"): 267}
    assert rolloutd_share(demand, 0) == demand and rolloutd_share({("job1", "sender"): 0}, 4) == {("job1", "sender"): 0}


def test_a_restarted_orchestrator_issues_a_step_under_new_step_ids(clock: FakeClock) -> None:
    """After a restart every micro-batch of an uncommitted step is issued again; the new step id
    tells a slot that already accumulated some of them (acks lost with the old process) to start
    the step over instead of adding their gradients twice."""
    before = Planner(clock, PlannerOptions(lease_epoch="e0"))
    after = Planner(clock, PlannerOptions(lease_epoch="e1"))
    works = []
    for planner in (before, after):
        planner.submit_job("job1", make_spec())
        for lease in planner.lease_rollout_tasks("roll-0", 4):
            report(planner, lease)
        work = planner.poll_trainer_work("t0", "slot-0")
        assert isinstance(work, MicroBatchWork)
        works.append(work)
    assert works[0].experience_ids == works[1].experience_ids and works[0].step == works[1].step
    assert works[0].step_id != works[1].step_id
    assert works[0].step_id.endswith("/a0") and works[1].step_id.endswith("/a0")
