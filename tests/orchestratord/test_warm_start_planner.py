"""Warm starts in the planner: version 0 is committed before any rollout task, and batch 0 is sampled from it."""

from __future__ import annotations

from typing import Any

import pytest

from flexmarl.errors import FailedPrecondition, InvalidArgument
from orchestratord.planner import (
    MicroBatchWork,
    Planner,
    PlannerOptions,
    SlotEventKind,
    WarmStartWork,
)
from orchestratord.state import InMemoryStateStore, JobState, WarmStartPublished, apply_changes

from .helpers import FakeClock, experiences_for, make_spec, run_job

pytestmark = pytest.mark.timeout(60)

AGENTS = ("sender", "receiver")
WARM = {"dataset": "examples.arithmetic.data:solver_examples", "steps": 3, "lr": 1e-3, "batch_size": 4}


def warm_spec(*warm_agents: str, **sections: Any) -> Any:
    agents = [{"name": name, "model": "/models/tiny", **({"warm_start": WARM} if name in warm_agents else {})}
              for name in AGENTS]
    return make_spec(agents=agents, **sections)


def commit_warm(planner: Planner, slot: str, work: WarmStartWork, worker: str = "t") -> None:
    planner.commit_step(worker, slot, work.job_id, work.agent, 0, 0, f"file:///w/{work.agent}/warm",
                        f"file:///s/{work.agent}/warm")


def test_no_task_is_admitted_until_the_warm_start_commits_and_batch_zero_samples_it() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    job = planner.submit_job("job1", warm_spec("sender"))
    assert planner.lease_rollout_tasks("roll", 100) == []
    assert not planner.has_leasable_tasks() and job.rollout_demand() == {"sender": 0, "receiver": 0}
    work = planner.poll_trainer_work("t", "s0")
    assert isinstance(work, WarmStartWork) and (work.job_id, work.agent) == ("job1", "sender")
    assert planner.poll_trainer_work("t", "s1") is None  # one warm start, on one slot
    assert planner.poll_trainer_work("t", "s0") == work  # a lost response: the same work again
    assert planner.lease_rollout_tasks("roll", 100) == []
    assert job.busy_slots() == {"s0"} and job.slot_busy("s0") and not job.slot_busy("s1")  # the warm start's slot
    commit_warm(planner, "s0", work)
    assert job.busy_slots() == set()
    assert [type(c) for c in job.take_changes() if isinstance(c, WarmStartPublished)] == [WarmStartPublished]
    commit_warm(planner, "s0", work)  # the same commit again: a no-op
    leases = planner.lease_rollout_tasks("roll", 100)
    assert leases and {lease.batch_index for lease in leases} == {0}  # max_staleness 0: batch 0 only
    versions = {v.agent: (v.version, v.weights_uri) for v in leases[0].agent_versions}
    assert versions == {"sender": (0, "file:///w/sender/warm"), "receiver": (0, "")}
    for lease in leases:
        planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", experiences_for(lease, AGENTS))
    seen: dict[str, MicroBatchWork] = {}
    for slot in ("s0", "s1"):
        mb = planner.poll_trainer_work("t", slot)
        assert isinstance(mb, MicroBatchWork)
        seen[mb.agent] = mb
    # Step 0 of the warm agent trains version 0 from its published state (the slot may not hold it).
    assert (seen["sender"].base_version, seen["sender"].state_uri) == (0, "file:///s/sender/warm")
    assert (seen["receiver"].base_version, seen["receiver"].state_uri) == (0, "")


def test_a_job_with_two_warm_starts_waits_for_both_and_then_runs_to_the_end() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    job = planner.submit_job("job1", warm_spec("sender", "receiver"))
    first, second = planner.poll_trainer_work("t", "s0"), planner.poll_trainer_work("t", "s1")
    assert isinstance(first, WarmStartWork) and isinstance(second, WarmStartWork)
    assert {first.agent, second.agent} == set(AGENTS)
    commit_warm(planner, "s0", first)
    assert planner.lease_rollout_tasks("roll", 100) == []  # the other agent still warms up
    commit_warm(planner, "s1", second)
    assert planner.lease_rollout_tasks("roll", 1)
    run_job(planner, clock, "job1", slots=("s0", "s1"))
    assert job.state is JobState.SUCCEEDED
    # Version 0 stays findable after later versions: what `flexmarl export --version 0` downloads.
    assert {a.agent: a.initial_weights_uri for a in job.snapshot().agents} == {
        name: f"file:///w/{name}/warm" for name in AGENTS}
    assert all(a.version > 0 and a.weights_uri != a.initial_weights_uri for a in job.snapshot().agents)


def test_bad_warm_start_commits_are_refused_and_lose_nothing() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    job = planner.submit_job("job1", warm_spec("sender"))
    work = planner.poll_trainer_work("t", "s0")
    assert isinstance(work, WarmStartWork)
    with pytest.raises(InvalidArgument, match="commits step 0"):
        planner.commit_step("t", "s0", "job1", "sender", 3, 0, "file:///w", "file:///s")
    with pytest.raises(InvalidArgument, match="weights_uri"):
        planner.commit_step("t", "s0", "job1", "sender", 0, 0, "", "file:///s")
    with pytest.raises(FailedPrecondition, match="no warm_start"):
        planner.commit_step("t", "s0", "job1", "receiver", 0, 0, "file:///w", "file:///s")
    with pytest.raises(FailedPrecondition, match="held by slot 's1'"):
        planner.commit_step("t", "s1", "job1", "sender", 0, 0, "file:///w", "file:///s")
    with pytest.raises(FailedPrecondition, match="held by"):
        planner.commit_step("other-worker", "s0", "job1", "sender", 0, 0, "file:///w", "file:///s")
    assert job.version("sender") == 0 and planner.lease_rollout_tasks("roll", 100) == []
    commit_warm(planner, "s0", work)
    with pytest.raises(FailedPrecondition, match="already committed"):
        planner.commit_step("t", "s0", "job1", "sender", 0, 0, "file:///w/other", "file:///s")
    assert planner.lease_rollout_tasks("roll", 1)


def test_an_expired_or_failed_warm_start_is_issued_again_and_a_late_commit_is_refused() -> None:
    clock = FakeClock()
    options = PlannerOptions(lease_epoch="e0", max_step_attempts=3)
    planner = Planner(clock, options)
    job = planner.submit_job("job1", warm_spec("sender", leases={"rollout_timeout_s": 10, "train_timeout_s": 20}))
    work = planner.poll_trainer_work("t0", "s0")
    assert isinstance(work, WarmStartWork)
    # Renewed, it outlives its timeout many times over.
    for _ in range(10):
        clock.advance(10)
        assert planner.renew_leases("t0", [work.lease_id]).lost_lease_ids == ()
        assert planner.poll_trainer_work("t1", "s1") is None
    # Not renewed, it expires: the slot counts as dead and another slot gets the warm start.
    clock.advance(21)
    again = planner.poll_trainer_work("t1", "s1")
    assert isinstance(again, WarmStartWork) and again.lease_id != work.lease_id
    with pytest.raises(FailedPrecondition):
        commit_warm(planner, "s0", work, worker="t0")
    # The slot running it fails: issued once more; the third loss fails the job.
    planner.report_slot_event("t1", "s1", "job1", "sender", SlotEventKind.FAILED, error="boom")
    third = planner.poll_trainer_work("t2", "s2")
    assert isinstance(third, WarmStartWork) and job.state is JobState.RUNNING
    clock.advance(21)
    planner.tick()
    assert job.state is JobState.FAILED and "warm start of agent 'sender' failed 3 times" in job.error


async def test_a_restored_orchestrator_knows_which_warm_starts_are_committed() -> None:
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    job = planner.submit_job("job1", warm_spec("sender", "receiver"))
    first = planner.poll_trainer_work("t", "s0")
    second = planner.poll_trainer_work("t", "s1")
    assert isinstance(first, WarmStartWork) and isinstance(second, WarmStartWork)
    commit_warm(planner, "s0", first)
    await apply_changes(store, job.take_changes())
    await apply_changes(store, job.take_changes())  # nothing twice
    persisted = await store.load_job("job1")
    assert persisted is not None
    assert persisted.agents[first.agent].weights_uri == f"file:///w/{first.agent}/warm"
    assert persisted.agents[second.agent].weights_uri == ""
    # A new orchestrator: the committed warm start stays, the one in flight is issued again.
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    restored = restarted.restore_job(persisted, [])
    assert {a.agent: a.initial_weights_uri for a in restored.snapshot().agents} == {
        first.agent: f"file:///w/{first.agent}/warm", second.agent: ""}
    assert restarted.lease_rollout_tasks("roll", 100) == []
    work = restarted.poll_trainer_work("t", "s1")
    assert isinstance(work, WarmStartWork) and work.agent == second.agent
    assert restarted.poll_trainer_work("t", "s0") is None
    commit_warm(restarted, "s1", work)
    await apply_changes(store, restored.take_changes())
    persisted = await store.load_job("job1")
    assert persisted is not None and all(r.weights_uri for r in persisted.agents.values())
    assert restarted.lease_rollout_tasks("roll", 1)
