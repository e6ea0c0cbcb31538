"""A trainer slot busy for longer than the silence bound on one micro-batch stays bound.

A slot shows it is alive by polling; while it works on a micro-batch it does not poll, but it
renews the micro-batch's lease, and its ack and commit speak for it too. The slot-silence sweep
must not take a slot away right after such a micro-batch (seen through the daemons: an agent's
first micro-batch runs its warm start for minutes, its step was replayed on "slot silent" and the
warm start redone, over and over).
"""

from __future__ import annotations

import logging

import pytest

from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, PlannerOptions

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")


@pytest.mark.timeout(30)
def test_a_slot_that_renewed_through_a_long_micro_batch_is_not_silent_after_it(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    options = PlannerOptions(lease_epoch="e0")
    planner = Planner(clock, options)
    planner.submit_job("job1", make_spec(leases={"rollout_timeout_s": 10, "train_timeout_s": 60},
                                         batch={"prompts_per_step": 4, "group_size": 2, "micro_batch_size": 8}))
    for lease in planner.lease_rollout_tasks("roll", 100):
        if lease.batch_index == 0:
            planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "",
                                        experiences_for(lease, AGENTS))
    work = planner.poll_trainer_work("t", "s0")
    assert isinstance(work, MicroBatchWork)
    # The micro-batch takes 4x the silence bound; the lease is renewed every 20 s meanwhile.
    busy_s = 4 * options.slot_silence_s
    for _ in range(int(busy_s // 20)):
        clock.advance(20)
        assert planner.renew_leases("t", [work.lease_id]).lost_lease_ids == ()
    with caplog.at_level(logging.WARNING):
        planner.ack_micro_batch(work.lease_id, "t", "s0", episodes=work.step_episodes)
        after = planner.poll_trainer_work("t", "s0", dp_address="")
    assert isinstance(after, OptimizerStepWork) and (after.agent, after.step) == (work.agent, 0)
    assert "silent" not in caplog.text and "replaying" not in caplog.text
