"""``pipeline.step_fill: completion``: a step is the first prompts_per_step tasks to finish (AReaL/slime)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceSummary
from flexmarl.jobspec import parse_job_spec
from orchestratord.planner import Planner, PlannerOptions, RolloutTaskLease
from orchestratord.state import InMemoryStateStore, JobState, ManifestFixed, StepManifest, apply_changes

from .helpers import FakeClock, experiences_for, make_spec, run_job, spec_dict, train_to_version

AGENTS = ("sender", "receiver")
PROMPTS = 4  # helpers.BASE_SPEC: 4 tasks per step, groups of 2, 2 groups per micro-batch, 3 steps


def completion_planner(clock: FakeClock, *, masked: bool = False, eta: int = 1, steps: int = 3) -> Planner:
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    rollout = {"partial_rollout": True, "mask_stale_tokens": True} if masked else {}
    planner.submit_job("job1", make_spec(pipeline={"max_staleness": eta, "step_fill": "completion"},
                                         rollout=rollout, total_steps=steps))
    return planner


def report(planner: Planner, lease: RolloutTaskLease,
           versions: dict[str, int] | None = None) -> list[ExperienceSummary]:
    exps = experiences_for(lease, AGENTS, versions=versions)
    planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", exps)
    return exps


def report_batch(planner: Planner, leases: dict[str, RolloutTaskLease], batch: int) -> list[ExperienceSummary]:
    """Reports every task of rollout batch ``batch`` done; returns their experiences."""
    reported: list[ExperienceSummary] = []
    for position in range(PROMPTS):
        reported += report(planner, leases[f"job1/b{batch}/t{position}"])
    return reported


def manifests(planner: Planner) -> dict[tuple[str, int], StepManifest]:
    return {(c.manifest.agent, c.manifest.step): c.manifest for c in planner.job("job1").take_changes()
            if isinstance(c, ManifestFixed)}


def tasks_of(manifest: StepManifest) -> set[str]:
    return {eid.rsplit("/", 3)[0] for eid in manifest.experience_ids}


def train_step(planner: Planner, step: int) -> None:
    """Trains ``step`` of every agent on one slot each (its manifest must be fixed)."""
    train_to_version(planner, "job1", step + 1)


def by_id(leases: Sequence[RolloutTaskLease]) -> dict[str, RolloutTaskLease]:
    return {lease.task_id: lease for lease in leases}


def test_the_first_tasks_to_finish_form_a_step_and_a_step_waits_for_a_task_no_later_step_may_take() -> None:
    clock = FakeClock()
    planner = completion_planner(clock)
    leases = by_id(planner.lease_rollout_tasks("roll", 100))
    assert len(leases) == 2 * PROMPTS  # (eta + v + 1) batches, as in batch fill
    # Batch 1 finishes first: it forms step 0, and batch 0's tasks are still running.
    report_batch(planner, leases, 1)
    fixed = manifests(planner)
    assert set(fixed) == {("sender", 0), ("receiver", 0)}
    assert tasks_of(fixed[("sender", 0)]) == {f"job1/b1/t{p}" for p in range(PROMPTS)}
    # Three of batch 0 go to step 1; its last place is held for b0/t0, leased at version 0, which no step
    # after 1 may take (max_staleness 1).
    for position in (1, 2, 3):
        report(planner, leases[f"job1/b0/t{position}"])
    assert manifests(planner) == {}
    train_step(planner, 0)
    later = by_id(planner.lease_rollout_tasks("roll", 100))
    assert set(later) == {f"job1/b2/t{p}" for p in range(PROMPTS)}  # admitted at version 1
    for lease in later.values():
        report(planner, lease)
    assert manifests(planner) == {}  # batch 2 waits: step 1's last place is b0/t0's
    report(planner, leases["job1/b0/t0"])
    fixed = manifests(planner)
    assert tasks_of(fixed[("sender", 1)]) == {f"job1/b0/t{p}" for p in range(PROMPTS)}
    assert tasks_of(fixed[("receiver", 2)]) == set(later)  # then batch 2 fills step 2 at once


def test_with_masked_stale_tokens_no_place_is_held_and_a_late_task_joins_a_later_step() -> None:
    clock = FakeClock()
    planner = completion_planner(clock, masked=True)
    leases = by_id(planner.lease_rollout_tasks("roll", 100))
    for task_id, lease in sorted(leases.items()):
        if task_id != "job1/b0/t0":
            report(planner, lease)
    fixed = manifests(planner)
    assert set(fixed) == {("sender", 0), ("receiver", 0)}  # step 1 has 3 of 4: nothing is held for b0/t0
    train_step(planner, 0)
    for lease in planner.lease_rollout_tasks("roll", 100):  # batch 2
        report(planner, lease)
    fixed = manifests(planner)
    assert ("sender", 1) in fixed and "job1/b0/t0" not in tasks_of(fixed[("sender", 1)])
    train_step(planner, 1)
    # b0/t0 finishes two versions after its lease: it joins step 2 (traind masks its tokens older than v1).
    report(planner, leases["job1/b0/t0"], versions={"sender": 0, "receiver": 0})
    for lease in planner.lease_rollout_tasks("roll", 100):
        report(planner, lease)
    fixed = manifests(planner)
    assert "job1/b0/t0" in tasks_of(fixed[("sender", 2)])
    train_step(planner, 2)  # its micro-batch is leased though 2 versions stale (the masking is traind's)
    assert planner.job("job1").state is JobState.SUCCEEDED


def test_a_task_already_too_stale_for_the_open_step_is_dropped_and_replaced_and_the_job_finishes() -> None:
    clock = FakeClock()
    planner = completion_planner(clock)
    leases = by_id(planner.lease_rollout_tasks("roll", 100))
    report_batch(planner, leases, 0)
    train_step(planner, 0)
    report_batch(planner, leases, 1)
    train_step(planner, 1)
    job = planner.job("job1")
    admitted = job.admitted_tasks
    stale = planner.lease_rollout_tasks("roll", 1)[0]  # leased at version 2: step 2 or 3 expected
    # Its experiences claim version 0 (a replica that lagged far behind): too stale for step 2.
    report(planner, stale, versions={"sender": 0, "receiver": 0})
    assert stale.task_id not in job.tracked_task_ids  # dropped and forgotten, not kept for the job's life
    run_job(planner, clock, "job1")
    assert job.state is JobState.SUCCEEDED
    assert job.admitted_tasks > admitted
    placed = [tasks_of(m) for m in manifests(planner).values()]
    assert all(stale.task_id not in tasks for tasks in placed)


def test_every_task_joins_at_most_one_step_and_every_step_has_a_full_batch() -> None:
    clock = FakeClock()
    planner = completion_planner(clock, eta=2, steps=4)
    run_job(planner, clock, "job1", slots=("slot-0", "slot-1"))
    fixed = manifests(planner)
    assert sorted(fixed) == sorted((a, s) for a in AGENTS for s in range(4))
    for step in range(4):
        assert tasks_of(fixed[("sender", step)]) == tasks_of(fixed[("receiver", step)])
        assert len(tasks_of(fixed[("sender", step)])) == PROMPTS
    seen = [t for s in range(4) for t in tasks_of(fixed[("sender", s)])]
    assert len(seen) == len(set(seen))


async def test_a_restarted_orchestrator_keeps_the_fixed_steps_and_places_the_rest_again() -> None:
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = completion_planner(clock)
    leases = by_id(planner.lease_rollout_tasks("roll", 100))
    reported = report_batch(planner, leases, 1)  # batch 1 forms step 0
    reported += report(planner, leases["job1/b0/t2"])  # one task of step 1, not full yet
    await apply_changes(store, planner.take_changes())
    persisted = await store.load_job("job1")
    assert persisted is not None and sorted(persisted.manifests) == [("receiver", 0), ("sender", 0)]
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    job = restarted.restore_job(persisted, reported)
    assert job.state is JobState.RUNNING
    assert job.admitted_tasks == 2 * PROMPTS  # after the highest task stored holds (b1/t3)
    run_job(restarted, clock, "job1")
    assert job.state is JobState.SUCCEEDED and [v.version for v in job.versions()] == [3, 3]
    await apply_changes(store, job.take_changes())
    final = await store.load_job("job1")
    assert final is not None and final.manifests[("sender", 0)] == persisted.manifests[("sender", 0)]
    assert "job1/b0/t2" in tasks_of(final.manifests[("sender", 1)])


async def test_after_a_restart_no_task_id_of_a_fixed_step_is_used_again_though_stored_collected_it() -> None:
    # Batch 1 (task numbers 4-7) forms step 0, which every agent commits; stored then garbage-collects what
    # step 0 consumed, and batch 0 is still running (nothing of it in stored) when orchestratord restarts.
    # The persisted manifests still name b1's experiences: task numbers must go on above them, or b1/t0
    # would be admitted again and its experiences take the ids of step 0's.
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = completion_planner(clock)
    leases = by_id(planner.lease_rollout_tasks("roll", 100))
    report_batch(planner, leases, 1)
    train_step(planner, 0)
    await apply_changes(store, planner.take_changes())
    persisted = await store.load_job("job1")
    assert persisted is not None and ("sender", 0) in persisted.manifests
    used = tasks_of(persisted.manifests[("sender", 0)])
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    job = restarted.restore_job(persisted, [])  # stored holds nothing of the job any more
    assert job.state is JobState.RUNNING and [v.version for v in job.versions()] == [1, 1]
    assert job.admitted_tasks == 2 * PROMPTS
    fresh = {lease.task_id for lease in restarted.lease_rollout_tasks("roll", 100)}
    assert fresh and not fresh & used
    run_job(restarted, clock, "job1")
    assert job.state is JobState.SUCCEEDED
    await apply_changes(store, job.take_changes())
    final = await store.load_job("job1")
    assert final is not None
    placed = [tasks_of(final.manifests[("sender", step)]) for step in range(3)]
    assert all(not placed[0] & later for later in placed[1:])  # no task in two steps


@pytest.mark.parametrize("pipeline", [{"max_staleness": 0}, {"mode": "sync", "max_staleness": 1}])
def test_completion_fill_needs_async_mode_and_some_staleness(pipeline: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="step_fill"):
        parse_job_spec(spec_dict(pipeline={**pipeline, "step_fill": "completion"}))
