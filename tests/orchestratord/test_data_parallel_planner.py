"""The planner with data-parallel binding: one agent's step on a group of slots."""

from __future__ import annotations

import pytest

from flexmarl.errors import FailedPrecondition
from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, PlannerOptions
from orchestratord.state import JobState

from .helpers import FakeClock, experiences_for, make_spec

AGENT = "solo"


def solo_spec(max_slots: int = 2, zero_stage: int = 0, total_steps: int = 2) -> object:
    return make_spec(agents=[{"name": AGENT, "model": "/models/tiny", "max_slots": max_slots,
                              "zero_stage": zero_stage}],
                     batch={"prompts_per_step": 4, "group_size": 2, "micro_batch_size": 2},
                     total_steps=total_steps)


def finish_rollouts(planner: Planner, job_id: str) -> None:
    for lease in planner.lease_rollout_tasks("r0", 8):
        planner.report_rollout_task(lease.lease_id, "r0", lease.task_id, True, "", experiences_for(lease, [AGENT]))


def poll(planner: Planner, slot: str) -> object:
    return planner.poll_trainer_work(f"w-{slot}", slot, dp_address=f"127.0.0.1:{slot[-1]}")


def test_a_step_is_shared_by_the_group_and_committed_by_rank_0() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("j", solo_spec())  # type: ignore[arg-type]
    for slot in ("s0", "s1"):
        assert poll(planner, slot) is None  # both slots known and idle
    finish_rollouts(planner, "j")  # 4 groups -> 4 micro-batches
    first = poll(planner, "s0")
    assert isinstance(first, MicroBatchWork) and first.group is not None
    assert first.group.members == ("s0", "s1") and first.rank == 0
    assert planner.snapshot("j").agents[0].slot_ids == ("s0", "s1")
    second = poll(planner, "s1")
    assert isinstance(second, MicroBatchWork) and second.rank == 1 and second.group == first.group
    assert poll(planner, "s0") == first  # one micro-batch at a time per member (re-delivered)
    acked: list[str] = []
    for work, slot in ((first, "s0"), (second, "s1")):
        planner.ack_micro_batch(work.lease_id, f"w-{slot}", slot)
        acked.extend(work.experience_ids)
    with pytest.raises(FailedPrecondition):
        planner.ack_micro_batch(first.lease_id, "w-s1", "s1")  # another slot's lease
    third, fourth = poll(planner, "s1"), poll(planner, "s0")
    for work, slot in ((third, "s1"), (fourth, "s0")):
        assert isinstance(work, MicroBatchWork)
        planner.ack_micro_batch(work.lease_id, f"w-{slot}", slot)
        acked.extend(work.experience_ids)
    manifest = planner.job("j").manifest(AGENT, 0)
    assert manifest is not None and sorted(acked) == list(manifest.experience_ids)  # exactly once
    step0, step1 = poll(planner, "s0"), poll(planner, "s1")
    assert isinstance(step0, OptimizerStepWork) and isinstance(step1, OptimizerStepWork)
    assert (step0.rank, step1.rank) == (0, 1) and step0.step_response_tokens == manifest.step_response_tokens
    assert poll(planner, "s1") is None  # a member gets the step once, then waits for rank 0
    with pytest.raises(FailedPrecondition):
        planner.commit_step("w-s1", "s1", "j", AGENT, 0, 1, "file:///w/1", "file:///s/1")
    planner.commit_step("w-s0", "s0", "j", AGENT, 0, 1, "file:///w/1", "file:///s/1")
    assert planner.job("j").version(AGENT) == 1
    # the group stays for the next step (its work is still expected)
    assert poll(planner, "s1") is None and planner.binder.members(("j", AGENT)) == ("s0", "s1")


def test_a_dead_member_replays_the_step_on_the_survivor() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("j", solo_spec(total_steps=1))  # type: ignore[arg-type]
    for slot in ("s0", "s1"):
        poll(planner, slot)
    finish_rollouts(planner, "j")
    first, second = poll(planner, "s0"), poll(planner, "s1")
    assert isinstance(first, MicroBatchWork) and isinstance(second, MicroBatchWork)
    planner.ack_micro_batch(first.lease_id, "w-s0", "s0")
    planner.worker_gone("w-s1")  # rank 1 dies mid-step: rank 0's collective would time out
    with pytest.raises(FailedPrecondition):
        planner.ack_micro_batch(second.lease_id, "w-s1", "s1")
    consumed: list[str] = []
    while planner.job("j").state is JobState.RUNNING:
        work = poll(planner, "s0")
        if isinstance(work, MicroBatchWork):
            assert work.group is None and work.step_id.endswith("/a1")  # a new attempt, alone
            planner.ack_micro_batch(work.lease_id, "w-s0", "s0")
            consumed.extend(work.experience_ids)
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("w-s0", "s0", "j", AGENT, work.step, work.new_version, "file:///w", "file:///s")
        else:
            raise AssertionError(f"unexpected {work}")
    manifest = planner.job("j").manifest(AGENT, 0)
    assert planner.job("j").state is JobState.SUCCEEDED
    assert manifest is not None and sorted(consumed) == list(manifest.experience_ids)


def test_no_group_for_zero_stage_above_0_or_max_slots_1() -> None:
    for spec in (solo_spec(max_slots=1), solo_spec(zero_stage=2)):
        planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e"))
        planner.submit_job("j", spec)  # type: ignore[arg-type]
        for slot in ("s0", "s1"):
            poll(planner, slot)
        finish_rollouts(planner, "j")
        work = poll(planner, "s0")
        assert isinstance(work, MicroBatchWork) and work.group is None
        assert poll(planner, "s1") is None
