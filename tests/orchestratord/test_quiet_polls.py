"""A quiet slot's poll is answered from its last empty answer (Planner.quiet_polls) only while nothing can change it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from orchestratord.planner import (
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    PlannerOptions,
    ResidentAgent,
    SlotEventKind,
    TrainerWork,
)
from orchestratord.planner.poll_wakes import QUIET_POLL_MAX_AGE_S, QuietPolls

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")
SLOTS = ("s0", "s1")


def _planner(clock: FakeClock) -> Planner:
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    # One task forms one micro-batch of each agent; two tasks make a step.
    planner.submit_job("job", make_spec(batch={"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2},
                                        pipeline={"mode": "async", "max_staleness": 0}))
    return planner


def _poll(planner: Planner, slot: str, resident: Sequence[ResidentAgent] = (),
          dp_address: str = "") -> TrainerWork | None:
    return planner.poll_trainer_work(f"w-{slot}", slot, resident, dp_address)


def _report_one(planner: Planner) -> None:
    (lease,) = planner.lease_rollout_tasks("r0", 1)
    planner.report_rollout_task(lease.lease_id, "r0", lease.task_id, True, "", experiences_for(lease, AGENTS))


def _quiet(planner: Planner) -> None:
    """Every slot polls (and the coordinator's wakes run) until each found no work and nothing wakes it."""
    for _ in range(10):
        assert all(_poll(planner, slot) is None for slot in SLOTS)
        if not planner.trainer_wakes(set(SLOTS)):
            assert all(slot in planner.quiet_polls for slot in SLOTS)
            return
    raise AssertionError("the polls did not settle")


def test_a_quiet_slot_is_answered_again_without_the_binder_and_never_past_new_work() -> None:
    clock = FakeClock()
    planner = _planner(clock)
    _quiet(planner)
    answered = planner.quiet_polls.answered
    assert _poll(planner, "s0") is None
    assert planner.quiet_polls.answered == answered + 1

    # A report gives both agents a micro-batch. No wake has run yet (the change is pending): the poll is in full.
    _report_one(planner)
    assert isinstance(_poll(planner, "s0"), MicroBatchWork)
    # s1 was not waiting when the coordinator asked for wakes (its long poll had ended): its kept answer goes too.
    assert planner.trainer_wakes(set()) == set()
    assert "s1" not in planner.quiet_polls
    assert isinstance(_poll(planner, "s1"), MicroBatchWork)
    assert planner.quiet_polls.answered == answered + 1


def test_a_slot_polling_with_other_inputs_or_after_the_bound_is_answered_in_full() -> None:
    clock = FakeClock()
    planner = _planner(clock)
    _quiet(planner)
    answered = planner.quiet_polls.answered
    assert _poll(planner, "s0", [ResidentAgent("job", "sender", 0)]) is None  # what it holds changed
    assert _poll(planner, "s1", dp_address="host:1") is None  # its rendezvous moved: every kept answer goes
    assert "s0" not in planner.quiet_polls
    assert planner.quiet_polls.answered == answered

    kept = QuietPolls()
    kept.quiet("s0", ("w", (), ""), now_s=100.0)
    assert kept.still_quiet("s0", ("w", (), ""), now_s=100.0 + QUIET_POLL_MAX_AGE_S)
    assert not kept.still_quiet("s0", ("w", (), ""), now_s=100.1 + QUIET_POLL_MAX_AGE_S)
    assert not kept.still_quiet("s0", ("w2", (), ""), now_s=100.0)


@pytest.mark.parametrize("change", ["cancel", "slot lost", "commit"])
def test_a_cancel_a_lost_slot_and_a_commit_drop_the_kept_answers(change: str) -> None:
    clock = FakeClock()
    planner = _planner(clock)
    if change == "commit":
        # Both tasks of step 0: each slot trains one agent's step; s1's commit comes while s0 is quiet.
        _report_one(planner)
        _report_one(planner)
        step_of: dict[str, OptimizerStepWork] = {}
        for _ in range(20):
            for slot in SLOTS:
                if slot in step_of:
                    continue
                work = _poll(planner, slot)
                if isinstance(work, MicroBatchWork):
                    planner.ack_micro_batch(work.lease_id, f"w-{slot}", slot)
                elif isinstance(work, OptimizerStepWork):
                    step_of[slot] = work
        assert set(step_of) == set(SLOTS)
        for work in (step_of["s0"],):
            planner.commit_step("w-s0", "s0", "job", work.agent, work.step, work.new_version,
                                f"file:///w/{work.agent}/1", f"file:///s/{work.agent}/1")
        planner.trainer_wakes(set())
        assert _poll(planner, "s0") is None  # s0's agent waits for the next batch
        planner.trainer_wakes(set())
        assert "s0" in planner.quiet_polls
    else:
        _quiet(planner)
    answered = planner.quiet_polls.answered
    if change == "cancel":
        planner.cancel_job("job")
    elif change == "slot lost":
        planner.report_slot_event("w-s1", "s1", "job", "", SlotEventKind.FAILED, error="device lost")
    else:
        work = step_of["s1"]
        planner.commit_step("w-s1", "s1", "job", work.agent, work.step, work.new_version,
                            f"file:///w/{work.agent}/1", f"file:///s/{work.agent}/1")
    planner.trainer_wakes(set())
    assert "s0" not in planner.quiet_polls
    assert _poll(planner, "s0") is None
    assert planner.quiet_polls.answered == answered
