"""The per-experience re-tokenized flag (OpenAI gateway) through the wire format and the experience store."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.experience import ExperienceRecord
from stored.database import Database
from stored.experiences import ExperienceLimits, ExperienceStore, content_digest, validate_record

RecordFactory = Callable[..., ExperienceRecord]


def test_the_flag_round_trips_and_is_part_of_the_digest(tmp_path: Path, record_factory: RecordFactory) -> None:
    plain = record_factory("t0", 0)
    flagged = dataclasses.replace(record_factory("t0", 1), retokenized_messages=2)
    assert ExperienceRecord.from_proto(flagged.to_proto()).retokenized_messages == 2
    assert ExperienceRecord.from_proto(plain.to_proto()).retokenized_messages == 0
    # 0 hashes as before the flag existed; a count changes the digest (a retried append must match it)
    packed = validate_record(plain, ExperienceLimits())
    assert packed.digest == content_digest(plain, packed.prompt, packed.response, packed.logprobs)
    unflagged = dataclasses.replace(flagged, retokenized_messages=0)
    packed_flagged = validate_record(flagged, ExperienceLimits())
    assert packed_flagged.digest != validate_record(unflagged, ExperienceLimits()).digest
    with pytest.raises(InvalidArgument, match="retokenized_messages"):
        validate_record(dataclasses.replace(plain, retokenized_messages=-1), ExperienceLimits())

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)  # the experiences table as it was before retokenized_messages
    old.executescript(
        "CREATE TABLE experiences (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL, experience_id TEXT NOT NULL, "
        "agent TEXT NOT NULL, task_id TEXT NOT NULL, group_id TEXT NOT NULL, sample_index INTEGER NOT NULL, "
        "episode_id TEXT NOT NULL, turn INTEGER NOT NULL, behavior_version INTEGER NOT NULL, reward REAL NOT NULL, "
        "group_size INTEGER NOT NULL, state INTEGER NOT NULL, step_id TEXT NOT NULL, "
        "created_unix_ms INTEGER NOT NULL, state_unix_ms INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, "
        "response_tokens INTEGER NOT NULL, payload_bytes INTEGER NOT NULL, prompt_token_ids BLOB NOT NULL, "
        "response_token_ids BLOB NOT NULL, response_logprobs BLOB NOT NULL, content_sha256 BLOB NOT NULL, "
        "response_version_spans BLOB NOT NULL DEFAULT x'', UNIQUE (job_id, experience_id));")
    old.close()
    db = Database(path)
    try:
        store = ExperienceStore(db)
        assert store.append([plain, flagged]).appended == 2
        assert store.append([flagged]).duplicates == 1  # a retried append is recognised with its flag
        got = {r.experience_id: r for r in store.read("job1", [plain.experience_id, flagged.experience_id])}
        assert got[flagged.experience_id].retokenized_messages == 2
        assert got[plain.experience_id].retokenized_messages == 0
        with db.write() as conn:  # a changed flag fails the digest: data loss, never a silently different record
            conn.execute("UPDATE experiences SET retokenized_messages = 0 WHERE experience_id = ?",
                         (flagged.experience_id,))
        with pytest.raises(DataLoss):
            store.read("job1", [flagged.experience_id])
    finally:
        db.close()
