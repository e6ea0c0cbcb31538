"""The unshaped episode return beside the trained reward: wire format, digest, stored's rows and query results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.experience import ExperienceRecord, ExperienceSummary, reported_return
from flexmarl.store_client import ref_from_proto
from stored.database import Database
from stored.experiences import ExperienceLimits, ExperienceQuery, ExperienceStore, content_digest, validate_record
from stored.serde import ref_to_proto
from tests.stored_support import old_experiences_db

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
    old_experiences_db(path, before="episode_return")  # the table an older stored made
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
