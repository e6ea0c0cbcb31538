"""The planner and credit assignment: an agent normalised over its whole step waits for the step's rewards."""

from __future__ import annotations

from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, PlannerOptions
from traind.losses import ReturnStats

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")


def test_agent_normalisation_holds_micro_batches_until_the_step_is_complete() -> None:
    planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e0"))
    agents = [{"name": "sender", "model": "/models/tiny"},
              {"name": "receiver", "model": "/models/tiny", "algorithm": {"advantage_norm": "agent"}}]
    planner.submit_job("job1", make_spec(agents=agents))
    leases = planner.lease_rollout_tasks("roll-0", 4)
    for lease in leases[:3]:
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                    experiences_for(lease, AGENTS))
    # Async: the sender trains its first micro-batch while rollouts run; the receiver waits.
    work = planner.poll_trainer_work("t", "slot-0")
    assert isinstance(work, MicroBatchWork) and work.agent == "sender"
    planner.ack_micro_batch(work.lease_id, "t", "slot-0")
    receiver = planner.job("job1").current_plan("receiver")
    assert receiver is not None and receiver.micro_batches == [] and len(receiver.unformed) == 3
    last = leases[3]
    planner.report_rollout_task(last.lease_id, "roll-0", last.task_id, True, "", experiences_for(last, AGENTS))
    # Released with the batch, in task order (as a barrier mode forms them).
    assert [[g.position for g in mb.groups] for mb in receiver.micro_batches] == [[0, 1], [2, 3]]
    assert receiver.manifest is not None and not receiver.unformed


def step_zero_work(planner: Planner) -> dict[str, list[MicroBatchWork | OptimizerStepWork]]:
    """Every agent's trainer work of step 0 on one slot (micro-batches acked, optimizer steps committed)."""
    out: dict[str, list[MicroBatchWork | OptimizerStepWork]] = {a: [] for a in AGENTS}
    while not all(work and isinstance(work[-1], OptimizerStepWork) for work in out.values()):
        work = planner.poll_trainer_work("t", "slot-0")
        assert isinstance(work, (MicroBatchWork, OptimizerStepWork)), work
        out[work.agent].append(work)
        if isinstance(work, MicroBatchWork):
            planner.ack_micro_batch(work.lease_id, "t", "slot-0")
        else:
            planner.commit_step("t", "slot-0", "job1", work.agent, 0, 1, "file:///w", "file:///s")
    return out


def test_micro_batches_carry_the_exact_step_statistics_and_the_optimizer_step_counts_experiences() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    agents = [{"name": "sender", "model": "/models/tiny", "algorithm": {"advantage_norm": "agent"}},
              {"name": "receiver", "model": "/models/tiny"}]
    planner.submit_job("job1", make_spec(agents=agents))
    leases = planner.lease_rollout_tasks("roll-0", 4)
    for lease in reversed(leases):
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                    experiences_for(lease, AGENTS, turns=3))
    work = step_zero_work(planner)
    sender = work["sender"]
    micro_batches = [w for w in sender if isinstance(w, MicroBatchWork)]
    # experiences_for rewards sample s with s: 4 tasks x 2 episodes x 3 turns of returns 0 or 1
    expected = ReturnStats.of([float(s) for _ in range(4) for s in (0, 1) for _ in range(3)])
    assert {w.step_returns for w in micro_batches} == {(expected.count, expected.mean, expected.std)}
    step = sender[-1]
    assert isinstance(step, OptimizerStepWork) and step.step_sequences == 24 and step.step_episodes == 8
    assert all(isinstance(w, OptimizerStepWork) or w.step_returns is None for w in work["receiver"])
