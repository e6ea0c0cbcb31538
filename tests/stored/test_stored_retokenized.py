"""The per-experience re-tokenized flag (OpenAI gateway) through the wire format and the experience store."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.experience import ExperienceRecord
from stored.database import Database
from stored.experiences import ExperienceLimits, ExperienceStore, content_digest, validate_record
from tests.stored_support import old_experiences_db

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
    old_experiences_db(path, before="retokenized_messages")  # the table an older stored made
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
