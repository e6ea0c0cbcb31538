"""Contract of StateStore (run against every implementation) and planner recovery after a restart."""

from __future__ import annotations

import dataclasses

import pytest

from flexmarl.errors import Aborted, AlreadyExists, FailedPrecondition, NotFound
from flexmarl.evaluation import EvalEpisode
from flexmarl.experience import ExperienceSummary
from orchestratord.eval_state import EvalTaskResult, OpenEvalRound
from orchestratord.planner import Planner, PlannerOptions
from orchestratord.state import (
    JobState,
    StateStore,
    StepCommit,
    StepManifest,
    apply_changes,
    manifest_key,
)

from .helpers import FakeClock, experiences_for, make_spec, run_job, train_to_version

pytestmark = pytest.mark.timeout(60)



async def test_create_is_idempotent_and_conflicts_on_other_spec(store: StateStore) -> None:
    assert await store.create_job("j", "{}", ["a"], 1.0)
    assert not await store.create_job("j", "{}", ["a"], 2.0)
    with pytest.raises(AlreadyExists):
        await store.create_job("j", '{"x":1}', ["a"], 3.0)
    job = await store.load_job("j")
    assert job is not None and job.state is JobState.RUNNING and job.agents["a"].version == 0
    assert await store.list_job_ids() == ["j"] and await store.load_job("nope") is None


async def test_an_open_evaluation_round_and_its_finished_tasks_are_durable_until_recorded(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a", "b"], 1.0)
    opened = OpenEvalRound("d1", 1, (("a", 1, "file:///w/a/1"), ("b", 0, "")), tasks=3, samples_per_task=2,
                           on_demand=True, eval_file="/data/eval.jsonl", eval_sha256="ab" * 32)
    periodic = OpenEvalRound("v2", 2, (("a", 2, "file:///w/a/2"), ("b", 2, "file:///w/b/2")), 1, 1)
    await store.open_eval("j", opened)
    await store.open_eval("j", opened)  # the same write again: no-op
    await store.open_eval("j", periodic)
    with pytest.raises(AlreadyExists):
        await store.open_eval("j", OpenEvalRound("d1", 1, opened.agent_versions, tasks=4, samples_per_task=2))
    with pytest.raises(NotFound):
        await store.open_eval("nope", opened)
    episodes = tuple(EvalEpisode(2, i, {"a": 0.5 * i, "b": 1.0}, i == 1 or None, {"a": (1,), "b": (0, 1)},
                                 {"solver": 0.5}) for i in range(2))
    await store.put_eval_task("j", "d1", EvalTaskResult(2, False, episodes))
    await store.put_eval_task("j", "d1", EvalTaskResult(0, failed=True))
    await store.put_eval_task("j", "d1", EvalTaskResult(0, failed=True))  # again: no-op
    job = await store.load_job("j")
    assert job is not None and job.eval_rounds == frozenset()
    assert job.open_evals == (periodic, dataclasses.replace(  # periodic rounds first, then on-demand ones
        opened, finished=(EvalTaskResult(0, failed=True), EvalTaskResult(2, False, episodes))))

    await store.put_eval("j", "d1", {"round_id": "d1"})
    await store.put_eval_task("j", "d1", EvalTaskResult(1))  # a replayed write after the record: nothing
    job = await store.load_job("j")
    assert job is not None and job.eval_rounds == frozenset({"d1"}) and job.open_evals == (periodic,)


async def test_commit_is_compare_and_swap(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a"], 1.0)
    commit = StepCommit("j", "a", 0, "file:///w1", "file:///s1", "slot", 2.0)
    await store.commit_step(commit)
    await store.commit_step(commit)  # same commit again: no-op
    with pytest.raises(Aborted):
        await store.commit_step(StepCommit("j", "a", 0, "file:///other", "", "slot", 3.0))
    with pytest.raises(Aborted):
        await store.commit_step(StepCommit("j", "a", 5, "file:///w", "", "slot", 3.0))
    await store.set_state_uri("j", "a", 1, "stored://s", 4.0)
    with pytest.raises(Aborted):
        await store.set_state_uri("j", "a", 0, "stored://old", 4.0)
    job = await store.load_job("j")
    assert job is not None
    assert job.agents["a"].version == 1 and job.agents["a"].state_uri == "stored://s"
    assert job.commits[("a", 0)] == commit


async def test_a_warm_start_fills_version_zero_once(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a", "b"], 1.0)
    await store.publish_warm_start("j", "a", "file:///w0", "file:///s0", 2.0)
    await store.publish_warm_start("j", "a", "file:///w0", "file:///s0", 2.0)  # the same write again: no-op
    with pytest.raises(Aborted, match="already has weights"):
        await store.publish_warm_start("j", "a", "file:///other", "file:///s0", 3.0)
    job = await store.load_job("j")
    assert job is not None
    assert (job.agents["a"].version, job.agents["a"].weights_uri, job.agents["a"].state_uri) == (
        0, "file:///w0", "file:///s0")
    assert job.agents["b"].weights_uri == ""
    await store.commit_step(StepCommit("j", "a", 0, "file:///w1", "file:///s1", "slot", 4.0))
    await store.commit_step(StepCommit("j", "b", 0, "file:///b1", "", "slot", 4.0))
    job = await store.load_job("j")
    assert job is not None  # version 0's warm-started weights outlive later commits; b's version 0 is the spec's
    assert (job.agents["a"].weights_uri, job.agents["a"].initial_weights_uri) == ("file:///w1", "file:///w0")
    assert job.agents["b"].initial_weights_uri == ""
    with pytest.raises(Aborted, match="version 1"):  # past version 0: a warm start cannot rewrite it
        await store.publish_warm_start("j", "a", "file:///w0", "file:///s0", 5.0)
    with pytest.raises(NotFound):
        await store.publish_warm_start("j", "nope", "file:///w0", "", 5.0)


async def test_a_commit_leaves_a_pending_consumption_mark_until_cleared(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a", "b"], 1.0)
    await store.commit_step(StepCommit("j", "a", 0, "file:///w1", "", "slot", 2.0))
    await store.commit_step(StepCommit("j", "a", 1, "file:///w2", "", "slot", 3.0))
    await store.commit_step(StepCommit("j", "b", 0, "file:///w3", "", "slot", 3.0))
    job = await store.load_job("j")
    assert job is not None and job.pending_marks == {("a", 0), ("a", 1), ("b", 0)}
    await store.clear_pending_mark("j", "a", 0)
    await store.clear_pending_mark("j", "a", 0)  # idempotent
    await store.clear_pending_mark("nope", "a", 0)  # unknown job: nothing to clear
    job = await store.load_job("j")
    assert job is not None and job.pending_marks == {("a", 1), ("b", 0)}
    assert set(job.commits) == {("a", 0), ("a", 1), ("b", 0)}  # the commits themselves stay


async def test_evaluation_rounds_are_recorded_by_version(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a"], 1.0)
    await store.put_eval("j", "v2", {"version": 2})
    await store.put_eval("j", "v2", {"version": 2})  # the same record again
    await store.put_eval("j", "v0", {"version": 0})
    await store.put_eval("j", "d1", {"version": 1})
    job = await store.load_job("j")
    assert job is not None and job.eval_rounds == {"v0", "v2", "d1"}
    with pytest.raises(NotFound):
        await store.put_eval("nope", "v0", {"version": 0})


async def test_manifests_are_immutable(store: StateStore) -> None:
    await store.create_job("j", "{}", ["a"], 1.0)
    manifest = StepManifest("j", "a", 0, ("x", "y"), 4, 10)
    await store.put_manifest(manifest)
    await store.put_manifest(manifest)
    with pytest.raises(AlreadyExists):
        await store.put_manifest(StepManifest("j", "a", 0, ("x",), 4, 10))
    assert StepManifest.from_json(manifest.to_json()) == manifest
    assert manifest_key("/flexmarl", "j", "a", 0) == "/flexmarl/jobs/j/agents/a/steps/0/manifest"


async def test_planner_restarts_from_persisted_state_and_finishes(store: StateStore) -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="first"))
    planner.submit_job("job1", make_spec(pipeline={"max_staleness": 1}))
    reported: list[ExperienceSummary] = []
    # Step 0 of both agents commits; some tasks of batches 1 and 2 are reported, others in flight.
    for lease in planner.lease_rollout_tasks("roll", 100):
        exps = experiences_for(lease, ("sender", "receiver"))
        if lease.batch_index == 1 and lease.task_id.endswith("t3"):
            continue  # in flight when the orchestrator dies
        planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", exps)
        reported.extend(exps)
    job0 = planner.job("job1")
    train_to_version(planner, "job1", 1)  # one slot per agent: a mid-step agent waits for batch 1 on its own
    assert min(job0.version(a) for a in ("sender", "receiver")) == 1
    more = planner.lease_rollout_tasks("roll", 100)  # batch 2 admitted now (v=1, eta=1)
    assert {lease.batch_index for lease in more} == {2}  # b1/t3 is still leased to the first incarnation
    for lease in more:
        if lease.batch_index == 2 and lease.task_id.endswith("t0"):
            exps = experiences_for(lease, ("sender", "receiver"))
            planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", exps)
            reported.extend(exps)
    await apply_changes(store, planner.take_changes())
    # A partial task in stored (a worker died mid-write) must be re-run, not recovered.
    assert more[-1].task_id == "job1/b2/t3"
    partial = [e for e in experiences_for(more[-1], ("sender", "receiver")) if e.sample_index == 0]

    # ---- restart ----
    persisted = await store.load_job("job1")
    assert persisted is not None and persisted.agents["sender"].version == 1
    restarted = Planner(clock, PlannerOptions(lease_epoch="second"))
    job = restarted.restore_job(persisted, reported + partial)
    assert job.version("sender") == 1 and job.admitted_tasks >= 4
    with pytest.raises(Exception) as old:  # leases of the first incarnation are unknown
        restarted.report_rollout_task(more[0].lease_id, "roll", more[0].task_id, True, "", [])
    assert type(old.value).__name__ in ("NotFound", "FailedPrecondition")
    reissued = restarted.lease_rollout_tasks("roll", 100)
    reissued_ids = {lease.task_id for lease in reissued}
    assert {"job1/b1/t3", "job1/b2/t3"} <= reissued_ids and "job1/b2/t0" not in reissued_ids
    for lease in reissued:
        restarted.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "",
                                      experiences_for(lease, ("sender", "receiver")))
    run_job(restarted, clock, "job1")
    assert job.state is JobState.SUCCEEDED and [v.version for v in job.versions()] == [3, 3]
    await apply_changes(store, restarted.take_changes())
    final = await store.load_job("job1")
    assert final is not None and final.state is JobState.SUCCEEDED and final.agents["receiver"].version == 3
    assert len(final.manifests) == 6


async def test_restored_manifest_must_match_recovered_experiences(store: StateStore) -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="a"))
    planner.submit_job("job1", make_spec())
    reported: list[ExperienceSummary] = []
    for lease in planner.lease_rollout_tasks("roll", 100):
        exps = experiences_for(lease, ("sender", "receiver"))
        planner.report_rollout_task(lease.lease_id, "roll", lease.task_id, True, "", exps)
        reported.extend(exps)
    await apply_changes(store, planner.take_changes())
    persisted = await store.load_job("job1")
    assert persisted is not None and len(persisted.manifests) == 2
    # stored lost one experience's sibling turn: the task is incomplete, the manifest cannot be rebuilt
    restarted = Planner(clock, PlannerOptions(lease_epoch="b"))
    job = restarted.restore_job(persisted, reported[1:])
    assert job.state is JobState.RUNNING  # the incomplete task is simply re-run
    lease = restarted.lease_rollout_tasks("roll", 10)
    assert [item.task_id for item in lease] == ["job1/b0/t0"]
    with pytest.raises(FailedPrecondition):
        restarted.commit_step("t", "slot", "job1", "sender", 0, 1, "file:///w", "")


async def test_unknown_jobs_and_agents_are_not_found_and_commits_touch_the_job(store: StateStore) -> None:
    with pytest.raises(NotFound):
        await store.set_job_state("nope", JobState.FAILED, "x", 1.0)
    await store.create_job("j", "{}", ["a"], 1.0)
    with pytest.raises(NotFound):
        await store.commit_step(StepCommit("j", "b", 0, "file:///w", "", "slot", 2.0))
    with pytest.raises(NotFound):
        await store.set_state_uri("j", "b", 0, "stored://s", 2.0)
    await store.commit_step(StepCommit("j", "a", 0, "file:///w", "", "slot", 5.0), history={"loss": 1.0})
    job = await store.load_job("j")
    assert job is not None and job.updated_s == 5.0 and job.created_s == 1.0
    await store.set_job_state("j", JobState.SUCCEEDED, "", 6.0)
    job = await store.load_job("j")
    assert job is not None and (job.state, job.error, job.updated_s) == (JobState.SUCCEEDED, "", 6.0)
