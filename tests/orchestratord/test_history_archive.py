"""Bounded etcd: old pages of per-step history move to stored, their manifests and commits are deleted.

The StateStore methods the archive uses are a contract run against both stores (in memory, real
etcd); the archive itself runs on each store with stored's blob calls held in a dict (the real stored
is in tests/orchestratord/test_restart_history.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from flexmarl.errors import Aborted, NotFound
from flexmarl.experience import ExperienceState, ExperienceSummary
from flexmarl.ids import StepRef
from flexmarl.store_client import ExperienceRef
from orchestratord.failures import FailureFigures
from orchestratord.history_archive import (
    HistoryArchive,
    HistoryBlobs,
    consumed_steps,
    history_page_blob_name,
)
from orchestratord.planner import Planner, PlannerOptions
from orchestratord.state import (
    HistoryArchiveIndex,
    InMemoryStateStore,
    JobState,
    PersistedJob,
    StateStore,
    StepCommit,
    StepManifest,
    apply_changes,
)

from .helpers import FakeClock, experiences_for, make_spec, run_job, train_to_version

pytestmark = pytest.mark.timeout(60)

AGENTS = ("a", "b")


class DictBlobs:
    """stored's put/get of named blobs, held in a dict (what HistoryArchive calls)."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.gets = 0

    async def put_blob_bytes(self, name: str, data: bytes, *, job_id: str = "") -> Any:
        self.blobs[name] = data

    async def get_blob_bytes(self, name: str) -> bytes:
        self.gets += 1
        if name not in self.blobs:
            raise NotFound(f"blob {name!r} not found")
        return self.blobs[name]


def _record(agent: str, step: int) -> dict[str, Any]:
    # Agent b commits each step just before a: commit order is not (agent, step) order. Steps from 10 on carry
    # their failure figures (orchestratord/failures.py), as records written before they existed do not.
    failures = FailureFigures(step % 3, step % 2, f"first {step}", f"last {step}") if step >= 10 else None
    return {"agent": agent, "step": step, "version": step + 1, "loss": step / 100,
            "committed_unix_ms": 1_000 * step + (2 if agent == "a" else 1), "weights_uri": f"file:///{agent}/{step}",
            **(failures.as_record() if failures is not None else {})}


def _totals(step: int) -> FailureFigures:
    """The job's failure totals once every agent committed ``step`` (written with the last agent's commit)."""
    return FailureFigures(step, step // 2, "first 10", f"last {step}")


async def _run_steps(store: StateStore, job_id: str, steps: range, clear: bool = True) -> None:
    for step in steps:
        for agent in AGENTS:
            await store.put_manifest(StepManifest(job_id, agent, step, (f"{job_id}/{agent}/{step}",), 1, 4,
                                                  FailureFigures.from_record(_record(agent, step))))
            await store.commit_step(StepCommit(job_id, agent, step, f"file:///{agent}/{step}", "", "slot",
                                               float(step)), _record(agent, step),
                                    _totals(step) if agent == AGENTS[-1] and step >= 10 else None)
            if clear:
                await store.clear_pending_mark(job_id, agent, step)


async def _blobs(blobs: DictBlobs) -> HistoryBlobs:
    return blobs


async def test_history_pages_and_archive_index_are_a_store_contract(store: StateStore) -> None:
    await store.create_job("j", "{}", AGENTS, 1.0)
    await _run_steps(store, "j", range(6))
    rows, more = await store.load_history_page("j", AGENTS, 2, 3)
    assert [(r["agent"], r["step"]) for r in rows] == [(a, s) for s in (2, 3, 4) for a in ("b", "a")] and more
    rows, more = await store.load_history_page("j", ["a"], 5, 10)
    assert [r["step"] for r in rows] == [5] and not more
    assert (await store.load_history_page("j", AGENTS, 6, 0))[1] is False
    assert (await store.load_history_page("j", AGENTS, 5, 0)) == ([], True)  # only "is there more"

    assert await store.load_history_archive("j") is None
    first = HistoryArchiveIndex(page_steps=2, pages=1)
    await store.put_history_archive("j", None, first)
    await store.put_history_archive("j", None, first)  # a replayed write: no-op
    with pytest.raises(Aborted):
        await store.put_history_archive("j", None, HistoryArchiveIndex(page_steps=2, pages=2))
    with pytest.raises(NotFound):
        await store.put_history_archive("nope", None, first)
    assert await store.load_history_archive("j") == first

    await store.delete_steps("j", AGENTS, 0, 2)
    await store.delete_steps("j", AGENTS, 0, 2)  # idempotent
    job = await store.load_job("j")
    assert job is not None and job.agents["a"].version == 6 and job.updated_s == 5.0
    assert sorted(job.manifests) == sorted(job.commits) == [(a, s) for a in AGENTS for s in range(2, 6)]
    assert (await store.load_history_page("j", AGENTS, 0, 2)) == ([], True)

    await store.put_eval("j", "d1", {"round_id": "d1", "finished_unix_ms": 5})
    await store.put_eval("j", "v2", {"round_id": "v2", "version": 2})
    await store.put_eval("j", "v0", {"round_id": "v0", "version": 0})
    assert [r["round_id"] for r in await store.load_evals("j")] == ["v0", "v2", "d1"]


async def test_archived_pages_move_to_stored_and_read_across_the_boundary(store: StateStore) -> None:
    await store.create_job("j", "{}", AGENTS, 1.0)
    await _run_steps(store, "j", range(23))
    expected, _ = await store.load_history_page("j", AGENTS, 0, 100)  # old state: all of it in etcd
    assert expected == [_record(agent, step) for step in range(23) for agent in ("b", "a")]
    blobs = DictBlobs()
    archive = HistoryArchive(store, lambda: _blobs(blobs), page_steps=5)
    # A page goes once every agent is a whole page past it: steps 0..14 of 23 (15..19 is the kept page).
    assert await archive.archive("j", AGENTS, min_version=23) == 3
    assert await archive.archive("j", AGENTS, min_version=23) == 0
    assert await store.load_history_archive("j") == HistoryArchiveIndex(5, pages=3, cleaned=3)
    assert sorted(blobs.blobs) == [history_page_blob_name("j", p) for p in range(3)]
    page1 = json.loads(blobs.blobs[history_page_blob_name("j", 1)])
    assert {(r["agent"], r["step"]) for r in page1["records"]} == {(a, s) for a in AGENTS for s in range(5, 10)}
    job = await store.load_job("j")
    assert job is not None and min(step for _, step in job.manifests) == min(step for _, step in job.commits) == 15
    # The job's failure totals outlive the steps' keys; a kept manifest has its step's figures.
    assert job.failure_totals == _totals(22)
    assert job.manifests[("a", 16)].failures == FailureFigures.from_record(_record("a", 16)) == FailureFigures(
        1, 0, "first 16", "last 16")
    assert (await store.load_history_page("j", AGENTS, 0, 15))[0] == []

    # GetJobHistory's contract, over archived and live steps: the same records and "more" as before.
    assert (await archive.page("j", AGENTS, 0, 100)) == (expected, False)
    for from_step, max_steps in ((0, 3), (3, 4), (13, 4), (14, 1), (15, 3), (12, 11), (20, 5), (23, 5)):
        rows, more = await archive.page("j", AGENTS, from_step, max_steps)
        assert rows == [r for r in expected if from_step <= r["step"] < from_step + max_steps], (from_step, max_steps)
        assert more == (from_step + max_steps < 23), (from_step, max_steps)
    assert (await archive.page("j", ["a"], 4, 2))[0] == [_record("a", 4), _record("a", 5)]
    reads = blobs.gets
    await archive.page("j", AGENTS, 5, 2)
    assert blobs.gets == reads  # a recently read page comes from the cache

    # A new orchestratord (nothing cached) reads the same, and goes on archiving where the index says.
    restarted = HistoryArchive(store, lambda: _blobs(blobs), page_steps=50)  # the job's page size stays 5
    assert (await restarted.page("j", AGENTS, 0, 100)) == (expected, False)
    await _run_steps(store, "j", range(23, 30))
    assert await restarted.archive("j", AGENTS, min_version=30) == 2  # steps 15..24
    assert (await store.load_history_archive("j")) == HistoryArchiveIndex(5, pages=5, cleaned=5)
    assert (await restarted.page("j", AGENTS, 0, 100)) == (
        [_record(agent, step) for step in range(30) for agent in ("b", "a")], False)


async def test_a_page_with_a_pending_mark_waits_and_a_cut_short_pass_is_finished(store: StateStore) -> None:
    await store.create_job("j", "{}", AGENTS, 1.0)
    await _run_steps(store, "j", range(12))
    blobs = DictBlobs()
    archive = HistoryArchive(store, lambda: _blobs(blobs), page_steps=4)
    archive.mark_pending("j", "b", 2)  # stored has not confirmed step 2 of b consumed
    assert await archive.archive("j", AGENTS, min_version=12) == 0
    archive.mark_cleared("j", "b", 2)
    assert await archive.archive("j", AGENTS, min_version=12) == 2

    # A pass that advanced the index but died before deleting: the next pass deletes, reads never miss.
    await store.put_history_archive("j", HistoryArchiveIndex(4, 2, 2), HistoryArchiveIndex(4, 3, 2))
    blobs.blobs[history_page_blob_name("j", 2)] = json.dumps(
        {"records": (await store.load_history_page("j", AGENTS, 8, 4))[0]}).encode()
    fresh = HistoryArchive(store, lambda: _blobs(blobs), page_steps=4)
    assert [r["step"] for r in (await fresh.page("j", ["a"], 6, 6))[0]] == [6, 7, 8, 9, 10, 11]
    await fresh.archive("j", AGENTS, min_version=12)
    assert await store.load_history_archive("j") == HistoryArchiveIndex(4, 3, 3)
    job = await store.load_job("j")
    assert job is not None and not job.manifests and not job.commits
    assert [r["step"] for r in (await fresh.page("j", ["a"], 6, 6))[0]] == [6, 7, 8, 9, 10, 11]


def _stored_ref(exp: ExperienceSummary, consumed_by: int | None) -> ExperienceRef:
    """What stored's query returns for an experience (consumed by step ``consumed_by`` of its agent)."""
    state = ExperienceState.READY if consumed_by is None else ExperienceState.CONSUMED
    step_id = "" if consumed_by is None else str(StepRef("job1", exp.agent, consumed_by))
    return ExperienceRef(exp.experience_id, exp.group_id, exp.task_id, exp.sample_index, exp.behavior_version,
                         exp.response_tokens, 0, exp.reward, state, step_id)


async def _completion_job_with_archived_step_0() -> tuple[PersistedJob, list[ExperienceSummary], set[str]]:
    """A step_fill: completion job: step 0 committed by both agents, consumed, and its keys archived away."""
    clock = FakeClock()
    store = InMemoryStateStore()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    planner.submit_job("job1", make_spec(pipeline={"max_staleness": 1, "step_fill": "completion"}))
    leases = {lease.task_id: lease for lease in planner.lease_rollout_tasks("roll", 100)}
    reported: list[ExperienceSummary] = []
    for task_id in [f"job1/b1/t{p}" for p in range(4)] + ["job1/b0/t2"]:  # b1 forms step 0; b0/t2 waits
        exps = experiences_for(leases[task_id], ("sender", "receiver"))
        planner.report_rollout_task(leases[task_id].lease_id, "roll", task_id, True, "", exps)
        reported += exps
    train_to_version(planner, "job1", 1)
    await apply_changes(store, planner.take_changes())
    step0 = {eid for agent in ("sender", "receiver")
             for eid in (planner.job("job1").manifest(agent, 0) or StepManifest("", "", 0, (), 0, 0)).experience_ids}
    assert len(step0) == 16
    await store.delete_steps("job1", ("sender", "receiver"), 0, 1)  # archived: its manifests are gone
    persisted = await store.load_job("job1")
    assert persisted is not None and not persisted.manifests
    return persisted, reported, step0


async def test_a_restart_does_not_place_again_what_an_archived_step_consumed() -> None:
    persisted, reported, step0 = await _completion_job_with_archived_step_0()
    refs = [_stored_ref(e, 0 if e.experience_id in step0 else None) for e in reported]
    consumed_by = consumed_steps(refs)
    assert consumed_by == dict.fromkeys(step0, 0)

    def steps_after_restart(consumed: dict[str, int]) -> set[str]:
        clock = FakeClock()
        restarted = Planner(clock, PlannerOptions(lease_epoch="e1"))
        job = restarted.restore_job(persisted, reported, consumed)
        run_job(restarted, clock, "job1")
        assert job.state is JobState.SUCCEEDED
        return {eid for agent in ("sender", "receiver") for step in (1, 2)
                for eid in (job.manifest(agent, step) or StepManifest("", "", 0, (), 0, 0)).experience_ids}

    assert not steps_after_restart(consumed_by) & step0  # step 0's tasks are trained once
    assert steps_after_restart({}) & step0  # the control: without stored's record they would be placed again
