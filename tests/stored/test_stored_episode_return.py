"""The unshaped episode return beside the trained reward: wire format, digest, stored's rows and query results."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.experience import ExperienceRecord, ExperienceSummary, reported_return
from flexmarl.store_client import ref_from_proto
from stored.database import Database
from stored.experiences import ExperienceLimits, ExperienceQuery, ExperienceStore, content_digest, validate_record
from stored.serde import ref_to_proto

RecordFactory = Callable[..., ExperienceRecord]


def test_the_return_round_trips_beside_the_reward_and_is_part_of_the_digest(
        tmp_path: Path, record_factory: RecordFactory) -> None:
    unrecorded = record_factory("t0", 0, reward=0.25)
    shaped = dataclasses.replace(record_factory("t0", 1, reward=0.25), episode_return=1.0)
    assert ExperienceRecord.from_proto(shaped.to_proto()).episode_return == 1.0
    assert ExperienceRecord.from_proto(unrecorded.to_proto()).episode_return is None
    zero = dataclasses.replace(unrecorded, episode_return=0.0)  # a recorded 0.0 is not "not recorded"
    assert ExperienceRecord.from_proto(zero.to_proto()).episode_return == 0.0
    # none hashes as before the field existed; a value changes the digest (a retried append must match it)
    packed = validate_record(unrecorded, ExperienceLimits())
    assert packed.digest == content_digest(unrecorded, packed.prompt, packed.response, packed.logprobs)
    assert validate_record(zero, ExperienceLimits()).digest != packed.digest
    with pytest.raises(InvalidArgument, match="episode_return must be finite"):
        validate_record(dataclasses.replace(unrecorded, episode_return=float("nan")), ExperienceLimits())

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)  # the experiences table as it was before episode_return
    old.executescript(
        "CREATE TABLE experiences (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL, experience_id TEXT NOT NULL, "
        "agent TEXT NOT NULL, task_id TEXT NOT NULL, group_id TEXT NOT NULL, sample_index INTEGER NOT NULL, "
        "episode_id TEXT NOT NULL, turn INTEGER NOT NULL, behavior_version INTEGER NOT NULL, reward REAL NOT NULL, "
        "group_size INTEGER NOT NULL, state INTEGER NOT NULL, step_id TEXT NOT NULL, "
        "created_unix_ms INTEGER NOT NULL, state_unix_ms INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, "
        "response_tokens INTEGER NOT NULL, payload_bytes INTEGER NOT NULL, prompt_token_ids BLOB NOT NULL, "
        "response_token_ids BLOB NOT NULL, response_logprobs BLOB NOT NULL, content_sha256 BLOB NOT NULL, "
        "response_version_spans BLOB NOT NULL DEFAULT x'', retokenized_messages INTEGER NOT NULL DEFAULT 0, "
        "UNIQUE (job_id, experience_id));")
    old.close()
    db = Database(path)
    try:
        store = ExperienceStore(db)
        assert store.append([unrecorded, shaped]).appended == 2
        assert store.append([shaped]).duplicates == 1
        got = {r.experience_id: r for r in store.read("job1", [unrecorded.experience_id, shaped.experience_id])}
        assert (got[shaped.experience_id].reward, got[shaped.experience_id].episode_return) == (0.25, 1.0)
        assert got[unrecorded.experience_id].episode_return is None
        # query results carry it over stored's wire to the orchestrator's summaries
        refs = {r.experience_id: ref_from_proto(ref_to_proto(r)) for r in store.query(ExperienceQuery("job1", "alice"))}
        summaries = {i: ExperienceSummary.of_ref(ref, "alice") for i, ref in refs.items()}
        assert reported_return(summaries[shaped.experience_id].reward,
                               summaries[shaped.experience_id].episode_return) == 1.0
        assert summaries[unrecorded.experience_id].episode_return is None  # reported as its reward
        assert reported_return(summaries[unrecorded.experience_id].reward, None) == 0.25
        with db.write() as conn:  # a changed return fails the digest: data loss, never a silently different record
            conn.execute("UPDATE experiences SET episode_return = 0.5 WHERE experience_id = ?",
                         (shaped.experience_id,))
        with pytest.raises(DataLoss):
            store.read("job1", [shaped.experience_id])
    finally:
        db.close()
