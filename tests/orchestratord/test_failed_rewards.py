"""Episodes whose reward failed: dropped from their group, a task left with too few given up, never the job.

rolloutd reports the episodes whose reward raised or timed out (``failed_episodes``) beside the
others' experiences; a task left with fewer than ``min_episodes_to_train`` (2) is reported given
up (``EPISODES_FAILED``). The planner trains the rest, never re-issues a given-up task, forms
every step without what failed, and fails a job only when a step is left with nothing to train
(``step_fill: batch``) or ``prompts_per_step`` tasks in a row are given up (``completion``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import pytest

from flexmarl.client import StepRecord
from flexmarl.errors import ErrorReason, InvalidArgument
from flexmarl.experience import ExperienceSummary, FailedEpisode, min_episodes_to_train
from flexmarl.tracking import StepFigures
from orchestratord import serde
from orchestratord.failures import MAX_REASON_CHARS, FailureFigures
from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, PlannerOptions, RolloutTaskLease
from orchestratord.state import (
    EvalRecorded,
    InMemoryStateStore,
    JobState,
    ManifestFixed,
    StateChange,
    StepCommitted,
    StepManifest,
    apply_changes,
)

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")
#: Task position -> its failed episodes: t1 loses one episode of 4, every episode of t2 fails (given up).
FAILURES: dict[int, dict[int, str]] = {
    1: {3: "reward 'm:f' timed out after 10 s"},
    2: {i: "reward 'm:f' raised ValueError: no" for i in range(4)},
}

Policy = Callable[[RolloutTaskLease], Mapping[int, str]]


def by_position(lease: RolloutTaskLease) -> Mapping[int, str]:
    return FAILURES.get(int(lease.task_id.rsplit("/t", 1)[1]), {})


def report(planner: Planner, lease: RolloutTaskLease, failed: Mapping[int, str]) -> list[ExperienceSummary]:
    """Reports the lease as rolloutd does: the survivors' experiences and the failed episodes, or given up."""
    episodes = [FailedEpisode(i, reason) for i, reason in sorted(failed.items())]
    if lease.group_size - len(failed) < min_episodes_to_train(lease.group_size):
        error = f"{len(failed)} of {lease.group_size} episodes failed in their reward ({episodes[0].reason})"
        planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, False, error, [],
                                    ErrorReason.EPISODES_FAILED, failed_episodes=episodes)
        return []
    kept = [e for e in experiences_for(lease, AGENTS) if e.sample_index not in failed]
    planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", kept, failed_episodes=episodes)
    return kept


def drive(planner: Planner, clock: FakeClock, policy: Policy = by_position,
          until: Callable[[RolloutTaskLease], bool] = lambda lease: False,
          outbox: list[StateChange] | None = None, reported: list[ExperienceSummary] | None = None,
          hold: Callable[[RolloutTaskLease], bool] = lambda lease: False,
          ) -> tuple[list[RolloutTaskLease], list[OptimizerStepWork], dict[tuple[str, int], StepManifest]]:
    """Runs job1 to its end (or to the first lease ``until`` stops at, unplayed), every task reported by ``policy``.

    Returns the leases, optimizer steps and manifests; the job's changes go to ``outbox``, the
    experiences reported to ``reported``. A lease ``hold`` is true of stays running, never reported
    (its lease expires and the task is re-issued).
    """
    job = planner.job("job1")
    leases: list[RolloutTaskLease] = []
    steps: list[OptimizerStepWork] = []
    manifests: dict[tuple[str, int], StepManifest] = {}
    outbox = [] if outbox is None else outbox
    reported = [] if reported is None else reported
    for _ in range(1000):
        if job.state.terminal:
            break
        for lease in planner.lease_rollout_tasks("roll", 3):
            if job.state.terminal:  # the job failed at a report: its other leases were revoked
                break
            if until(lease):
                outbox += job.take_changes()
                return leases, steps, manifests
            leases.append(lease)
            if not hold(lease):
                reported += report(planner, lease, policy(lease))
        work = planner.poll_trainer_work("t", "slot-0")
        if isinstance(work, MicroBatchWork):
            planner.ack_micro_batch(work.lease_id, "t", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            steps.append(work)
            planner.commit_step("t", "slot-0", "job1", work.agent, work.step, work.new_version,
                                f"file:///w/{work.agent}/{work.new_version}", f"file:///s/{work.agent}")
        elif not leases or work is None:
            clock.advance(1.0)
        changes = job.take_changes()
        outbox += changes
        manifests.update({(c.manifest.agent, c.manifest.step): c.manifest for c in changes
                          if isinstance(c, ManifestFixed)})
    return leases, steps, manifests


def planner_of(clock: FakeClock, options: PlannerOptions | None = None, **sections: object) -> Planner:
    planner = Planner(clock, options or PlannerOptions(lease_epoch="e0"))
    planner.submit_job("job1", make_spec(**{"batch": {"group_size": 4, "micro_batch_size": 8}, "total_steps": 2,
                                            **sections}))
    return planner


@pytest.mark.parametrize("pipeline", [{"mode": "sync"}, {"mode": "async", "max_staleness": 0},
                                      {"mode": "async", "max_staleness": 1}])
def test_failed_episodes_are_dropped_a_task_without_enough_is_given_up_and_the_job_trains_on(
        pipeline: dict[str, object]) -> None:
    clock = FakeClock()
    planner = planner_of(clock, pipeline=pipeline)
    leases, steps, manifests = drive(planner, clock)
    job = planner.job("job1")
    assert job.state is JobState.SUCCEEDED, job.snapshot().error
    assert all(lease.attempt == 1 for lease in leases) and len(leases) == 8  # nothing re-issued
    for step in range(2):
        for agent in AGENTS:
            ids = manifests[(agent, step)].experience_ids
            samples = {(eid.rsplit("/", 3)[0].rsplit("/t", 1)[1], eid.rsplit("/", 3)[1]) for eid in ids}
            # t0 and t3 whole, t1 without episode 3, nothing of t2.
            assert samples == {(t, str(i)) for t in "03" for i in range(4)} | {("1", str(i)) for i in range(3)}
            assert manifests[(agent, step)].step_episodes == 11
    assert {work.step_episodes for work in steps} == {11}
    status = job.snapshot()
    assert (status.episodes_failed, status.tasks_given_up) == (10, 2)
    assert status.tasks_done == 6
    assert status.last_episode_failure.startswith("task job1/b1/t2 given up: 4 of 4 episodes failed in their reward")


def test_strict_async_forms_the_same_steps_as_sync_without_the_failed_episodes() -> None:
    runs = []
    for pipeline in ({"mode": "sync"}, {"mode": "async", "max_staleness": 0}):
        clock = FakeClock()
        _, _, manifests = drive(planner_of(clock, pipeline=pipeline), clock)
        runs.append({key: (m.experience_ids, m.step_episodes, m.step_response_tokens) for key, m in manifests.items()})
    assert runs[0] == runs[1] and len(runs[0]) == 4


def test_a_step_whose_every_task_was_given_up_fails_the_job_naming_it() -> None:
    clock = FakeClock()
    planner = planner_of(clock)
    leases, steps, _ = drive(planner, clock, lambda lease: {i: "reward 'm:f' timed out after 10 s" for i in range(4)})
    job = planner.job("job1")
    assert job.state is JobState.FAILED and not steps and len(leases) == 4  # one step's tasks, each played once
    assert job.snapshot().error.startswith("step 0 has nothing to train: every one of its 4 tasks was given up")
    assert "timed out after 10 s" in job.snapshot().error


def test_under_completion_fill_a_given_up_task_is_replaced_and_a_steps_worth_in_a_row_fails_the_job() -> None:
    clock = FakeClock()
    planner = planner_of(clock, pipeline={"max_staleness": 1, "step_fill": "completion"})
    leases, _, manifests = drive(planner, clock)
    job = planner.job("job1")
    assert job.state is JobState.SUCCEEDED, job.snapshot().error
    assert all(m.step_episodes >= 4 + 4 + 3 for m in manifests.values())  # 4 tasks each, none given up
    assert all("/t2/" not in eid for m in manifests.values() for eid in m.experience_ids)
    assert job.snapshot().tasks_given_up >= 2 and all(lease.attempt == 1 for lease in leases)
    # Each failure is in the figures of the step being filled when it was reported: they add up to the totals.
    for agent in AGENTS:
        per_step = [manifests[(agent, step)].failures or FailureFigures() for step in range(2)]
        assert (sum(f.episodes_failed for f in per_step), sum(f.tasks_given_up for f in per_step)) == (
            job.snapshot().episodes_failed, job.snapshot().tasks_given_up)

    clock = FakeClock()
    planner = planner_of(clock, pipeline={"max_staleness": 1, "step_fill": "completion"})
    leases, _, _ = drive(planner, clock, lambda lease: {i: "reward 'm:f' raised KeyError" for i in range(4)})
    job = planner.job("job1")
    assert job.state is JobState.FAILED and len(leases) == 4
    assert job.snapshot().error.startswith("4 tasks in a row were given up")


def test_reports_that_contradict_their_failed_episodes_are_refused_and_the_task_re_issued() -> None:
    clock = FakeClock()
    planner = planner_of(clock, PlannerOptions(lease_epoch="e0", max_task_attempts=10))
    agents = AGENTS
    cases = [  # (succeeded, experiences' samples, failed samples, reason, error)
        (True, {0, 1, 2}, {4}, ErrorReason.UNSPECIFIED, "failed episode 4 is not in \\[0, 4\\)"),
        (True, {0, 1}, {2}, ErrorReason.UNSPECIFIED, "reported twice"),
        (True, {0}, {1, 2, 3}, ErrorReason.UNSPECIFIED, "fewer than 2 left to train; report it given up"),
        (False, set(), {3}, ErrorReason.EPISODES_FAILED, "given up with 3 of 4 episodes left"),
        (True, {0, 1, 2, 3}, {3}, ErrorReason.UNSPECIFIED, "has experiences of episodes \\[3\\], reported failed"),
        (True, {0, 1}, {3}, ErrorReason.UNSPECIFIED, "has no experience for episodes \\[2\\]"),
    ]
    for succeeded, samples, failed, reason, error in cases:
        (lease,) = planner.lease_rollout_tasks("roll", 1)
        exps = [e for e in experiences_for(lease, agents) if e.sample_index in samples]
        twice = [FailedEpisode(2, "x")] if error == "reported twice" else []
        episodes = [FailedEpisode(i, "x") for i in sorted(failed)] + twice
        with pytest.raises(InvalidArgument, match=error):
            planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, succeeded, "e", exps, reason,
                                        failed_episodes=episodes)
    status = planner.job("job1").snapshot()
    assert status.state is JobState.RUNNING and (status.episodes_failed, status.tasks_given_up) == (0, 0)
    (lease,) = planner.lease_rollout_tasks("roll", 1)
    assert (lease.task_id, lease.attempt) == ("job1/b0/t0", len(cases) + 1)  # re-issued after each


def test_a_failure_that_is_not_the_rewards_is_re_issued_until_it_fails_the_job() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0", max_task_attempts=2))
    planner.submit_job("job1", make_spec())
    for attempt in (1, 2):
        (lease,) = planner.lease_rollout_tasks("roll", 1)
        assert (lease.task_id, lease.attempt) == ("job1/b0/t0", attempt)
        planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, False, "episode 0: Unavailable: engine", [])
    assert planner.job("job1").state is JobState.FAILED


async def test_a_restarted_orchestrator_gives_a_fixed_steps_given_up_task_up_again() -> None:
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = planner_of(clock)
    reported: list[ExperienceSummary] = []
    for lease in planner.lease_rollout_tasks("roll", 4):  # step 0's batch: its manifests are fixed
        reported += report(planner, lease, by_position(lease))
    await apply_changes(store, planner.take_changes())
    persisted = await store.load_job("job1")
    assert persisted is not None and sorted(persisted.manifests) == [("receiver", 0), ("sender", 0)]
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    job = restarted.restore_job(persisted, reported)  # a rebuilt manifest differing from the stored one fails it
    assert job.state is JobState.RUNNING, job.snapshot().error
    leases, _, _ = drive(restarted, clock)
    assert job.state is JobState.SUCCEEDED, job.snapshot().error
    assert {lease.batch_index for lease in leases} == {1}  # t2 of step 0 was not played again


def test_an_eval_task_whose_rewards_failed_is_given_up_at_once_and_the_round_recorded_without_it() -> None:
    planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e0"))
    evaluation = {"every_versions": 1, "tasks": 1, "samples_per_task": 2, "sampling": "policy", "before_training": True}
    planner.submit_job("job1", make_spec(evaluation=evaluation, pipeline={"mode": "sync"}))
    (lease,) = [t for t in planner.lease_rollout_tasks("roll", 8) if t.evaluation]
    planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, False,
                                "episode 0: RewardFailed: reward 'm:f' timed out after 10 s", [],
                                ErrorReason.EPISODES_FAILED)
    recorded = [c for c in planner.take_changes() if isinstance(c, EvalRecorded)]
    assert len(recorded) == 1 and recorded[0].record["failed_tasks"] == 1  # one attempt, not max_task_attempts
    assert lease.attempt == 1 and not [t for t in planner.lease_rollout_tasks("roll", 8) if t.evaluation]
    assert planner.job("job1").state is JobState.RUNNING


def history_of(change: StepCommitted) -> dict[str, object]:
    """The failure part of the history record orchestratord writes with a commit (JobCoordinator._history_record)."""
    manifest = change.manifest
    assert manifest is not None and manifest.failures is not None
    return {"agent": change.commit.agent, "step": change.commit.step, **manifest.failures.as_record()}


STEP_FIGURES = (5, 1)  # per step: t1's dropped episode and t2's 4; t2 given up


@pytest.mark.parametrize("stop", ["b1/t0", "b1/t2"])  # step 1 not yet played; half of it reported
async def test_each_steps_failures_are_in_its_history_record_and_the_totals_survive_restarts(stop: str) -> None:
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = planner_of(clock)
    outbox: list[StateChange] = []
    reported: list[ExperienceSummary] = []
    drive(planner, clock, until=lambda lease: lease.task_id.endswith(stop), outbox=outbox, reported=reported)
    before = planner.job("job1").snapshot()
    await apply_changes(store, outbox, history_of)
    persisted = await store.load_job("job1")
    assert persisted is not None and min(a.version for a in persisted.agents.values()) == 1
    # Step 0, committed by every agent: its figures in each agent's history record and in the durable totals.
    assert persisted.failure_totals == FailureFigures(
        *STEP_FIGURES, first_failure="task job1/b0/t1 episode 3: reward 'm:f' timed out after 10 s",
        last_failure="task job1/b0/t2 given up: 4 of 4 episodes failed in their reward "
                     "(reward 'm:f' raised ValueError: no)")
    rows, _ = await store.load_history_page("job1", AGENTS, 0, 10)
    assert [FailureFigures.from_record(r) for r in rows] == [persisted.failure_totals] * 2

    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    job = restarted.restore_job(persisted, reported)
    after = job.snapshot()
    # Step 1's t1 (reported before the restart): what stored holds of it tells its dropped episode, not the reason.
    half = stop == "b1/t2"
    assert (after.episodes_failed, after.tasks_given_up, after.tasks_done) == (
        before.episodes_failed, before.tasks_given_up, before.tasks_done) == (5 + half, 1, 3 + 2 * half)
    assert after.last_episode_failure == ("task job1/b1/t1: 1 episodes dropped before orchestratord restarted "
                                          "(reasons not kept)" if half else persisted.failure_totals.last_failure)
    outbox = []
    drive(restarted, clock, outbox=outbox)
    assert job.state is JobState.SUCCEEDED, job.snapshot().error
    await apply_changes(store, outbox, history_of)
    final = await store.load_job("job1")
    assert final is not None and (final.failure_totals.episodes_failed, final.failure_totals.tasks_given_up) == (10, 2)
    rows, _ = await store.load_history_page("job1", AGENTS, 1, 1)
    assert {(r["episodes_failed"], r["tasks_given_up"]) for r in rows} == {STEP_FIGURES}
    assert {str(r["last_failure"]) for r in rows} == {persisted.failure_totals.last_failure.replace("b0", "b1")}

    # The finished job restored again: the same totals, and tasks done are those that trained.
    status = Planner(clock, PlannerOptions(lease_epoch="e2")).restore_job(final, []).snapshot()
    assert (status.episodes_failed, status.tasks_given_up, status.tasks_done, status.tasks_total) == (10, 2, 6, 8)
    assert status.last_episode_failure.startswith("task job1/b1/t2 given up")


def test_a_record_or_manifest_written_before_the_failure_figures_reads_as_empty_not_zero() -> None:
    old = {"agent": "a", "step": 0, "version": 1, "reward_mean": 0.5, "episodes": 8, "loss": 0.1}
    record = StepRecord.from_proto(serde.step_record(old))
    assert (record.episodes_failed, record.tasks_given_up, record.first_failure, record.return_mean) == (
        None, None, "", None)
    assert FailureFigures.from_record(old) is None
    new = {**old, **FailureFigures(0, 0).as_record()}
    record = StepRecord.from_proto(serde.step_record(new))
    assert (record.episodes_failed, record.tasks_given_up) == (0, 0) and "episodes_failed" not in record.figures
    # The trackers write the counts as figures (the reasons are text: in the history only); an old record has none.
    assert {"episodes_failed", "tasks_given_up"} <= set(StepFigures.of_record(new).values) - set(
        StepFigures.of_record(old).values)
    figures = FailureFigures().add("x" * 1000, episodes=1).add("last", tasks=1)
    assert (len(figures.first_failure), figures.last_failure, figures.episodes_failed, figures.tasks_given_up) == (
        MAX_REASON_CHARS, "last", 1, 1)
    manifest = StepManifest("j", "a", 0, ("e",), 1, 2)
    assert StepManifest.from_json(manifest.to_json()).failures is None
    assert StepManifest.from_json(dataclasses.replace(manifest, failures=figures).to_json()).failures == figures


async def test_under_completion_fill_the_totals_after_a_restart_are_the_steps_figures() -> None:
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = planner_of(clock, pipeline={"max_staleness": 1, "step_fill": "completion"}, total_steps=3)
    outbox: list[StateChange] = []
    reported: list[ExperienceSummary] = []
    drive(planner, clock, until=lambda lease: lease.task_id.endswith("b3/t0"), outbox=outbox, reported=reported)
    before = planner.job("job1").snapshot()
    await apply_changes(store, outbox, history_of)
    persisted = await store.load_job("job1")
    assert persisted is not None and persisted.failure_totals.tasks_given_up == 1  # step 0, committed by both
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    job = restarted.restore_job(persisted, reported)
    after = job.snapshot()
    # The open step's given-up task is forgotten (stored holds nothing of it; another task takes its place).
    assert (after.episodes_failed, after.tasks_given_up) == (before.episodes_failed - 4, before.tasks_given_up - 1)
    outbox = []
    drive(restarted, clock, outbox=outbox)
    assert job.state is JobState.SUCCEEDED, job.snapshot().error
    await apply_changes(store, outbox, history_of)
    final = await store.load_job("job1")
    assert final is not None
    for agent in AGENTS:
        rows, _ = await store.load_history_page("job1", [agent], 0, 10)
        assert (sum(int(r["episodes_failed"]) for r in rows), sum(int(r["tasks_given_up"]) for r in rows)) == (
            final.failure_totals.episodes_failed, final.failure_totals.tasks_given_up) == (
            job.snapshot().episodes_failed, job.snapshot().tasks_given_up)


COMPLETION = {"max_staleness": 1, "step_fill": "completion"}


async def restarted_at(stop: Callable[[RolloutTaskLease], bool], policy: Policy = by_position,
                       hold: Callable[[RolloutTaskLease], bool] = lambda lease: False) -> tuple[Planner, FakeClock]:
    """A 3-step completion-fill job on one trainer slot, restarted at the first lease ``stop`` is true of."""
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = planner_of(clock, pipeline=COMPLETION, total_steps=3)
    outbox: list[StateChange] = []
    reported: list[ExperienceSummary] = []
    drive(planner, clock, policy, until=stop, outbox=outbox, reported=reported, hold=hold)
    await apply_changes(store, outbox, history_of)
    persisted = await store.load_job("job1")
    assert persisted is not None
    restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
    restarted.restore_job(persisted, reported)
    return restarted, clock


async def test_under_completion_fill_a_restart_after_the_open_step_gave_a_task_up_does_not_stall_one_slot() -> None:
    # b0/t2 was given up while step 0 was filling: a restart forgets it with its figures (stored holds nothing
    # of it), so step 0 and 1 need one more task than before. With one trainer slot, the receiver (at version 1)
    # held the slot part-way through step 1 while the sender, still to commit step 0, never got it.
    restarted, clock = await restarted_at(lambda lease: lease.task_id.endswith("b1/t0"))
    job = restarted.job("job1")
    assert job.snapshot().tasks_given_up == 0  # forgotten with its figures (docs/workflows.md), not by admission
    drive(restarted, clock)
    assert job.state is JobState.SUCCEEDED, job.snapshot()
    assert [v.version for v in job.versions()] == [3, 3]


def _leases_of_a_whole_run(policy: Policy, hold: Callable[[RolloutTaskLease], bool]) -> int:
    clock = FakeClock()
    planner = planner_of(clock, pipeline=COMPLETION, total_steps=3)
    leases, _, _ = drive(planner, clock, policy, hold=hold)
    assert planner.job("job1").state is JobState.SUCCEEDED
    return len(leases)


def _first_attempt_of_b1_t1(lease: RolloutTaskLease) -> bool:
    return lease.task_id.endswith("b1/t1") and lease.attempt == 1


@pytest.mark.parametrize("running", [False, True], ids=["given-up", "running"])
async def test_under_completion_fill_a_restart_at_any_lease_lets_the_open_steps_fill(running: bool) -> None:
    """Wherever orchestratord restarts, the tasks admitted for the open steps can fill them, on one trainer slot.

    Tasks that fill no step after the restart are replaced: given-up ones (t2 of each batch), or
    without failures a task still running at the restart below the highest one stored holds (b1/t1's
    first attempt, until it expires and is re-issued).
    """
    policy: Policy = (lambda lease: {}) if running else by_position
    hold = _first_attempt_of_b1_t1 if running else (lambda lease: False)
    for stop in range(_leases_of_a_whole_run(policy, hold) + 1):
        seen: list[RolloutTaskLease] = []

        def at(lease: RolloutTaskLease, stop: int = stop, seen: list[RolloutTaskLease] = seen) -> bool:
            seen.append(lease)
            return len(seen) > stop

        restarted, clock = await restarted_at(at, policy, hold)
        job = restarted.job("job1")
        if job.state is JobState.RUNNING:
            drive(restarted, clock)
        assert job.state is JobState.SUCCEEDED and [v.version for v in job.versions()] == [3, 3], (stop, job.snapshot())
