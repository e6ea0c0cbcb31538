"""Unit tests of the experience store (no network)."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from flexmarl.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from flexmarl.experience import ExperienceRecord, ExperienceState
from stored.database import Database, JobQuotas
from stored.experiences import ExperienceLimits, ExperienceQuery, ExperienceStore, GarbageCollected
from tests.stored_support import old_experiences_db

RecordFactory = Callable[..., ExperienceRecord]
READY, LEASED, CONSUMED = ExperienceState.READY, ExperienceState.LEASED, ExperienceState.CONSUMED


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(db: Database, clock: Clock) -> ExperienceStore:
    return ExperienceStore(db, clock_ms=clock)


def group(make: RecordFactory, task: str, size: int = 4, **kw: object) -> list:
    return [make(task, s, group_size=size, **kw) for s in range(size)]


def assert_same(a, b) -> None:
    for f in dataclasses.fields(a):
        if f.name in ("state", "step_id", "created_unix_ms"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f.name
        else:
            assert x == y, f.name


def test_append_read_round_trip_byte_for_byte(store: ExperienceStore, record_factory: RecordFactory) -> None:
    records = group(record_factory, "t0") + group(record_factory, "t1", agent="bob")
    assert store.append(records).appended == 8
    ids = [r.experience_id for r in reversed(records)]
    got = store.read("job1", ids)
    assert [g.experience_id for g in got] == ids
    for g, r in zip(got, reversed(records), strict=True):
        assert_same(g, r)
        assert g.state == READY and g.created_unix_ms == 1_000_000


def test_append_is_idempotent_and_rejects_conflicts(store: ExperienceStore, record_factory: RecordFactory) -> None:
    records = group(record_factory, "t0")
    first = store.append(records)
    again = store.append(records + [record_factory("t1", 0)])
    assert (first.appended, first.duplicates) == (4, 0)
    assert (again.appended, again.duplicates) == (1, 4)
    changed = dataclasses.replace(records[0], reward=-1.0)
    with pytest.raises(AlreadyExists):
        store.append([record_factory("t2", 0), changed])
    # all or nothing: t2 was not stored either
    with pytest.raises(NotFound):
        store.read("job1", [record_factory("t2", 0).experience_id])
    with pytest.raises(AlreadyExists):
        store.append([record_factory("t3", 0), dataclasses.replace(record_factory("t3", 0), reward=5.0)])
    dup = store.append([record_factory("t4", 0), record_factory("t4", 0)])
    assert (dup.appended, dup.duplicates) == (1, 1)


@pytest.mark.parametrize(
    "change, error",
    [
        ({"experience_id": "nope"}, InvalidArgument),
        ({"group_id": "t0/other"}, InvalidArgument),
        ({"job_id": "bad job"}, InvalidArgument),
        ({"agent": "Bad"}, InvalidArgument),
        ({"sample_index": 9}, InvalidArgument),
        ({"group_size": 0}, InvalidArgument),
        ({"reward": float("nan")}, InvalidArgument),
        ({"behavior_version": -1}, InvalidArgument),
        ({"response_logprobs": np.zeros(3, dtype=np.float32)}, InvalidArgument),
        ({"prompt_token_ids": np.zeros((2, 2), dtype=np.int32)}, InvalidArgument),
        ({"prompt_token_ids": np.array([1 << 40], dtype=np.int64)}, InvalidArgument),
        ({"state": ExperienceState.LEASED}, InvalidArgument),
    ],
)
def test_append_rejects_bad_records(
    store: ExperienceStore, record_factory: RecordFactory, change: dict, error: type
) -> None:
    record = record_factory("t0", 0)
    if "sample_index" in change:
        change = {**change, "experience_id": "t0/9/alice/0"}
    with pytest.raises(error):
        store.append([dataclasses.replace(record, **change)])
    with pytest.raises(InvalidArgument):
        store.append([])


def test_limits_and_quota(db: Database, record_factory: RecordFactory) -> None:
    limits = ExperienceLimits(max_record_bytes=1000, max_append_records=3)
    quotas = JobQuotas(default_bytes=0, overrides_bytes={"small": 400})
    store = ExperienceStore(db, limits=limits, quotas=quotas)
    with pytest.raises(ResourceExhausted, match="payload bytes"):
        store.append([record_factory(response_tokens=200)])
    with pytest.raises(ResourceExhausted, match="per request"):
        store.append(group(record_factory, "t0"))
    small = [record_factory("t0", s, job_id="small", response_tokens=16, prompt_tokens=8) for s in range(3)]
    store.append(small[:2])  # 2 * 160 bytes
    with pytest.raises(ResourceExhausted, match="quota"):
        store.append(small[2:])
    assert store.append(small[:2]).duplicates == 2  # retries are not charged


def test_read_unknown_job_and_missing_ids(store: ExperienceStore, record_factory: RecordFactory) -> None:
    store.append([record_factory()])
    with pytest.raises(NotFound, match="unknown job"):
        store.read("other", ["x"])
    with pytest.raises(NotFound, match="not found"):
        store.read("job1", ["t0/0/alice/0", "t9/0/alice/0"])
    with pytest.raises(InvalidArgument):
        store.read("bad job", ["x"])


def test_read_batches_are_bounded(db: Database, record_factory: RecordFactory) -> None:
    store = ExperienceStore(db, limits=ExperienceLimits(read_batch_bytes=1000))
    records = [record_factory(f"t{i}", 0, group_size=1, response_tokens=50) for i in range(10)]  # 432 B each
    store.append(records)
    batches = store.plan_read("job1", [r.experience_id for r in records])
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2]
    big = record_factory("big", 0, group_size=1, response_tokens=1000)
    store.append([big])
    assert store.plan_read("job1", [big.experience_id, records[0].experience_id]) == [
        [big.experience_id], [records[0].experience_id]
    ]


def test_corrupt_row_is_data_loss(store: ExperienceStore, db: Database, record_factory: RecordFactory) -> None:
    record = record_factory()
    store.append([record])
    conn = sqlite3.connect(db.path)
    conn.execute("UPDATE experiences SET response_logprobs = zeroblob(64)")
    conn.commit()
    conn.close()
    with pytest.raises(DataLoss):
        store.read("job1", [record.experience_id])


def test_query_filters(store: ExperienceStore, record_factory: RecordFactory) -> None:
    store.append(group(record_factory, "t0", version=0) + group(record_factory, "t1", version=2))
    store.append(group(record_factory, "t2", agent="bob", version=1))
    q = ExperienceQuery(job_id="job1", agent="alice")
    assert len(store.query(q)) == 8
    assert {r.task_id for r in store.query(dataclasses.replace(q, min_behavior_version=1))} == {"t1"}
    assert {r.task_id for r in store.query(dataclasses.replace(q, max_behavior_version=1))} == {"t0"}
    assert len(store.query(dataclasses.replace(q, limit=3))) == 3
    ref = store.query(q)[0]
    assert (ref.response_tokens, ref.prompt_tokens, ref.state, ref.group_id) == (16, 8, READY, "t0/alice")
    assert store.query(ExperienceQuery(job_id="unknown", agent="alice")) == []
    with pytest.raises(InvalidArgument):
        store.query(ExperienceQuery(job_id="job1", agent="Alice"))


def test_query_complete_groups(store: ExperienceStore, record_factory: RecordFactory) -> None:
    store.append(group(record_factory, "t0")[:3])  # incomplete
    store.append(group(record_factory, "t1"))
    # multi-turn: 2 samples x 2 turns, complete when both samples are present
    store.append([record_factory("t2", s, turn=k, group_size=2) for s in range(2) for k in range(2)])
    q = ExperienceQuery(job_id="job1", agent="alice", state=READY, complete_groups_only=True)
    assert [r.task_id for r in store.query(q)] == ["t1"] * 4 + ["t2"] * 4
    # the limit never splits a group, but the first group always comes back
    assert len(store.query(dataclasses.replace(q, limit=6))) == 4
    assert len(store.query(dataclasses.replace(q, limit=1))) == 4
    store.append([record_factory("t0", 3)])
    assert [r.task_id for r in store.query(q)][:4] == ["t0"] * 4


def test_mark_transitions(store: ExperienceStore, record_factory: RecordFactory) -> None:
    records = group(record_factory, "t0")
    store.append(records)
    ids = [r.experience_id for r in records]
    assert store.mark("job1", "alice", "s0", ids[:2], LEASED) == 2
    assert store.mark("job1", "alice", "s0", ids[:2], LEASED) == 0  # idempotent
    with pytest.raises(FailedPrecondition):
        store.mark("job1", "alice", "s1", ids[:3], LEASED)  # ids[0] held by s0
    # the failed mark changed nothing (transactional)
    assert store.query(ExperienceQuery("job1", "alice", state=READY)) != []
    assert len(store.query(ExperienceQuery("job1", "alice", state=READY))) == 2
    assert {r.step_id for r in store.query(ExperienceQuery("job1", "alice", step_id="s0"))} == {"s0"}
    assert store.mark("job1", "alice", "s0", ids[:1], READY) == 1  # release
    assert store.mark("job1", "alice", "s0", ids, CONSUMED) == 4  # from READY and LEASED(s0)
    assert store.mark("job1", "alice", "s0", ids, CONSUMED) == 0
    with pytest.raises(FailedPrecondition):
        store.mark("job1", "alice", "s0", ids, READY)
    with pytest.raises(FailedPrecondition):
        store.mark("job1", "alice", "s1", ids, CONSUMED)
    with pytest.raises(NotFound):
        store.mark("job1", "bob", "s0", ids, CONSUMED)  # ids of another agent
    with pytest.raises(NotFound):
        store.mark("nojob", "alice", "s0", ids, CONSUMED)
    with pytest.raises(InvalidArgument):
        store.mark("job1", "alice", "", ids, CONSUMED)


def test_stats_and_gc(store: ExperienceStore, clock: Clock, record_factory: RecordFactory) -> None:
    records = group(record_factory, "t0") + group(record_factory, "t1")
    store.append(records)
    payload = 8 * 4 + 16 * 8
    ids = [r.experience_id for r in records]
    store.mark("job1", "alice", "s0", ids[:4], CONSUMED)
    stats = {(s.agent, s.state): (s.rows, s.bytes) for s in store.stats("job1")}
    assert stats == {("alice", READY): (4, 4 * payload), ("alice", CONSUMED): (4, 4 * payload)}
    clock.now_ms += 5_000
    with pytest.raises(FailedPrecondition, match="has not finished"):
        store.collect_garbage("job1", retention_s=0)
    assert store.collect_garbage("", retention_s=0) == GarbageCollected(0, 0, ("job1",))  # running: skipped
    assert store.finish_job("job1", "SUCCEEDED") and not store.finish_job("job1", "SUCCEEDED")
    assert store.collect_garbage("job1", retention_s=10).deleted_rows == 0
    store.mark("job1", "alice", "s1", ids[4:6], CONSUMED)
    clock.now_ms += 6_000
    gc = store.collect_garbage("job1", retention_s=10)
    assert (gc.deleted_rows, gc.deleted_bytes) == (4, 4 * payload)
    assert store.collect_garbage("", retention_s=0).deleted_rows == 2
    stats = {(s.agent, s.state): (s.rows, s.bytes) for s in store.stats()}
    assert stats == {("alice", READY): (2, 2 * payload)}
    with pytest.raises(NotFound):
        store.read("job1", ids[:1])
    with pytest.raises(NotFound):
        store.stats("nojob")
    with pytest.raises(InvalidArgument):
        store.collect_garbage("job1", retention_s=-1)


def test_data_survives_reopen(tmp_path: Path, record_factory: RecordFactory) -> None:
    db = Database(tmp_path / "s.db")
    ExperienceStore(db).append([record_factory()])
    db.close()
    db2 = Database(tmp_path / "s.db")
    try:
        assert_same(ExperienceStore(db2).read("job1", ["t0/0/alice/0"])[0], record_factory())
    finally:
        db2.close()


def test_version_spans_round_trip_and_old_databases_gain_the_column(
    tmp_path: Path, record_factory: RecordFactory
) -> None:
    """An interrupted response keeps its per-token versions; a database made before the column is migrated."""
    from flexmarl.experience import version_spans_array
    from stored.experiences import content_digest, validate_record

    plain = record_factory("t0", 0, version=2)
    spans = version_spans_array([(0, 2), (5, 3), (11, 4)])
    interrupted = dataclasses.replace(record_factory("t0", 1, version=2), response_version_spans=spans)
    # no spans: the digest is the one every record had before spans existed
    packed = validate_record(plain, ExperienceLimits())
    assert packed.spans == b"" and packed.digest == content_digest(plain, packed.prompt, packed.response,
                                                                   packed.logprobs)
    with pytest.raises(InvalidArgument, match="malformed response_version_spans"):
        validate_record(dataclasses.replace(interrupted, response_version_spans=version_spans_array([(0, 1)])),
                        ExperienceLimits())

    path = tmp_path / "old.db"
    old_experiences_db(path, before="response_version_spans")  # the table an older stored made
    db = Database(path)
    try:
        store = ExperienceStore(db)
        assert store.append([plain, interrupted]).appended == 2
        got = {r.experience_id: r for r in store.read("job1", [plain.experience_id, interrupted.experience_id])}
        assert_same(got[interrupted.experience_id], interrupted)
        assert got[interrupted.experience_id].token_versions().tolist() == [2] * 5 + [3] * 6 + [4] * 5
        assert got[plain.experience_id].response_version_spans.shape == (0, 2)
        with db.write() as conn:  # a corrupt span blob is data loss, not a client error
            conn.execute("UPDATE experiences SET response_version_spans = ? WHERE experience_id = ?",
                         (np.array([0, 9], dtype="<i4").tobytes(), interrupted.experience_id))
        with pytest.raises(DataLoss):
            store.read("job1", [interrupted.experience_id])
    finally:
        db.close()
