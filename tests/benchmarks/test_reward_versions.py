"""benchmarks.reward_versions: the per-behaviour-version reward curve from hand-made experiences, and the read of
a real stored database (no daemons)."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from benchmarks import reward_versions as rv
from flexmarl.experience import ExperienceRecord, experience_id, group_id
from stored.database import Database
from stored.experiences import ExperienceStore
from tests.stored_support import EXPERIENCE_COLUMNS, old_experiences_db

T0 = 1000.0
TIME_SCALE = 0.5


def exp(agent: str, version: int, reward: float, newest: int | None = None, written_s: float = 0.0
        ) -> rv.VersionedExperience:
    return rv.VersionedExperience(agent, version, version if newest is None else newest, reward, T0 + written_s)


def test_each_agents_versions_pool_their_experiences_at_the_publish() -> None:
    published = {("a", v): 10.0 * v for v in range(7)}
    experiences = [
        exp("a", 0, 0.0), exp("a", 0, 1.0),  # version 0: 0.5 over 2
        exp("a", 1, 0.25),
        exp("a", 1, 0.0, newest=2, written_s=9.0),  # a partial rollout resumed on version 2: counts for 2
        exp("a", 2, 1.0),
        exp("a", 3, 1.0), exp("a", 4, 1.0), exp("a", 4, 1.0, written_s=30.0),
        exp("a", 6, 1.0),  # version 5 generated nothing: no point
    ]
    [points] = rv.agent_version_curves(experiences, published, T0, TIME_SCALE).values()
    assert [p.version for p in points] == [0, 1, 2, 3, 4, 6]
    assert [p.reward for p in points] == pytest.approx([0.5, 0.25, 0.5, 1.0, 1.0, 1.0])
    assert [p.experiences for p in points] == [2, 1, 2, 1, 2, 1]
    assert [p.mixed for p in points] == [0, 0, 1, 0, 0, 0]
    assert [p.modelled_s for p in points] == [0.0, 10.0, 20.0, 30.0, 40.0, 60.0]  # publish, not generation
    assert points[2].written_s == pytest.approx(18.0) and points[4].written_s == pytest.approx(60.0)  # / 0.5
    assert all(math.isnan(p.window_reward) for p in points[:4])
    # pooled over the experiences of the last 5 measured versions: versions 0-4 (1 + 0.25 + 1 + 1 + 2) / 8,
    # then 1-4 and 6 (0.25 + 1 + 1 + 2 + 1) / 7 (the plain mean of the version means: 0.65, then 0.75)
    assert points[4].window_reward == pytest.approx(5.25 / 8)
    assert points[5].window_reward == pytest.approx(5.25 / 7)

    [excluded] = rv.agent_version_curves(experiences, published, T0, TIME_SCALE, "exclude").values()
    assert [(p.version, p.reward, p.experiences, p.mixed) for p in excluded][2] == (2, 1.0, 1, 1)


def test_the_job_curve_holds_each_agents_newest_measured_version() -> None:
    curves = {
        "a": [rv.VersionPoint("a", v, 10.0 * v, 0.1 * v, 4, 0, 0.1 * v if v >= 1 else math.nan, 0.0)
              for v in range(4)],
        "b": [rv.VersionPoint("b", v, 10.0 * v + 5.0, 0.2 * v, 4, 0, 0.2 * v if v >= 1 else math.nan, 0.0)
              for v in (0, 2, 3)],  # b's version 1 generated nothing
    }
    curve = rv.job_version_curve(curves, ["a", "b"])
    # events: a0 @0 (b has none yet: no point), b0 @5, a1 @10, a2 @20, b2 @25, a3 @30, b3 @35
    assert [p.modelled_s for p in curve] == [5.0, 10.0, 20.0, 25.0, 30.0, 35.0]
    assert [p.version for p in curve] == [0, 0, 0, 2, 2, 3]
    assert [p.reward for p in curve] == pytest.approx([0.0, 0.05, 0.1, 0.3, 0.35, 0.45])
    assert math.isnan(curve[1].window_reward)  # b's version 0 has no 5-version mean yet
    assert [p.window_reward for p in curve[3:]] == pytest.approx([0.3, 0.35, 0.45])
    assert rv.job_version_curve(curves, ["a", "b", "c"]) == []  # c never measured


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="mixed_rule"):
        rv.agent_version_curves([], {}, T0, TIME_SCALE, "oldest")
    with pytest.raises(ValueError, match="version 3, never published"):
        rv.agent_version_curves([exp("a", 3, 1.0)], {("a", 0): 0.0}, T0, TIME_SCALE)


def record(job: str, sample: int, version: int, reward: float, episode_return: float | None,
           spans: list[tuple[int, int]]) -> ExperienceRecord:
    return ExperienceRecord(
        experience_id=experience_id("t0", sample, "alice", 0), job_id=job, agent="alice", task_id="t0",
        group_id=group_id("t0", "alice"), sample_index=sample, episode_id=f"t0-{sample}", turn=0,
        behavior_version=version, reward=reward, prompt_token_ids=np.arange(4, dtype=np.int32),
        response_token_ids=np.arange(8, dtype=np.int32), response_logprobs=-np.ones(8, dtype=np.float32),
        group_size=2, response_version_spans=np.array(spans, dtype=np.int32).reshape(-1, 2),
        episode_return=episode_return)


def test_experiences_are_read_from_a_stored_database(tmp_path: Path) -> None:
    path = tmp_path / "stored.db"
    db = Database(path)
    try:
        store = ExperienceStore(db, clock_ms=lambda: 1_500_000)
        store.append([record("job1", 0, 1, 0.25, 0.75, []), record("job1", 1, 1, 0.5, None, [(0, 1), (3, 2), (6, 4)])])
    finally:
        db.close()
    plain, mixed = rv.read_experiences(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stored.db"]  # reading left no -wal or -shm beside it
    assert (plain.agent, plain.oldest_version, plain.newest_version, plain.reward, plain.mixed) == (
        "alice", 1, 1, 0.75, False)  # the episode return, not the trained reward
    assert (mixed.oldest_version, mixed.newest_version, mixed.reward, mixed.mixed) == (1, 4, 0.5, True)
    assert not mixed.return_recorded and plain.return_recorded and plain.written_unix_s == 1500.0
    assert rv.read_experiences(tmp_path / "absent.db") == []

    db = Database(path)
    try:
        ExperienceStore(db).append([record("job2", 0, 0, 0.0, None, [])])
    finally:
        db.close()
    with pytest.raises(ValueError, match="experiences of 2 jobs"):
        rv.read_experiences(path)


def test_a_database_from_before_version_spans_and_returns_is_read(tmp_path: Path) -> None:
    # the signaling runs of 2026-12-05 were kept by a stored without either column
    path = tmp_path / "stored.db"
    old_experiences_db(path, "response_version_spans")
    values = {name: 0 if "INTEGER" in kind or "REAL" in kind else (b"" if "BLOB" in kind else "x")
              for name, kind in EXPERIENCE_COLUMNS[1:23]}
    values.update(agent="bob", behavior_version=3, reward=0.5, created_unix_ms=2_000_000)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(f"INSERT INTO experiences ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                     list(values.values()))
    conn.close()
    [old] = rv.read_experiences(path)
    assert (old.agent, old.oldest_version, old.newest_version, old.reward, old.return_recorded) == (
        "bob", 3, 3, 0.5, False)  # every token of its behaviour version; the turn's reward
