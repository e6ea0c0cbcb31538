"""Proto <-> domain conversion for stored (the servicer's only contact with protos)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord, ExperienceState
from flexmarl.store_client import BlobInfo, ExperienceRef, ExperienceStats
from flexmarl.v1 import common_pb2, store_pb2
from stored.experiences import ExperienceQuery


def proto_state(state: ExperienceState) -> common_pb2.ExperienceState.ValueType:
    """The proto enum value of a state."""
    return common_pb2.ExperienceState.ValueType(int(state))


def state_from_proto(value: int, *, required: bool) -> ExperienceState | None:
    """Decodes an ExperienceState; UNSPECIFIED is None unless required (InvalidArgument)."""
    if value == common_pb2.EXPERIENCE_STATE_UNSPECIFIED:
        if required:
            raise InvalidArgument("state is required (READY, LEASED or CONSUMED)")
        return None
    try:
        return ExperienceState(value)
    except ValueError:
        raise InvalidArgument(f"unknown experience state {value}") from None


def records_from_proto(messages: Iterable[common_pb2.Experience]) -> list[ExperienceRecord]:
    """Decodes appended experiences; raises InvalidArgument on ragged arrays or a bad state."""
    records = []
    for msg in messages:
        state_from_proto(msg.state, required=False)
        records.append(ExperienceRecord.from_proto(msg))
    return records


def read_response(records: Sequence[ExperienceRecord]) -> store_pb2.ReadExperiencesResponse:
    """One streamed message of a read."""
    return store_pb2.ReadExperiencesResponse(experiences=[r.to_proto() for r in records])


def query_from_proto(msg: store_pb2.QueryExperiencesRequest) -> ExperienceQuery:
    """Decodes a query filter."""
    return ExperienceQuery(
        job_id=msg.job_id,
        agent=msg.agent,
        state=state_from_proto(msg.state, required=False),
        min_behavior_version=msg.min_behavior_version,
        max_behavior_version=msg.max_behavior_version,
        complete_groups_only=msg.complete_groups_only,
        step_id=msg.step_id,
        limit=msg.limit,
        group_id=msg.group_id,
    )


def ref_to_proto(ref: ExperienceRef) -> store_pb2.ExperienceRef:
    """Encodes one query result."""
    return store_pb2.ExperienceRef(
        experience_id=ref.experience_id,
        group_id=ref.group_id,
        task_id=ref.task_id,
        sample_index=ref.sample_index,
        behavior_version=ref.behavior_version,
        response_tokens=ref.response_tokens,
        prompt_tokens=ref.prompt_tokens,
        reward=ref.reward,
        state=proto_state(ref.state),
        step_id=ref.step_id,
        episode_return=ref.episode_return,
    )


def query_response(refs: Sequence[ExperienceRef]) -> store_pb2.QueryExperiencesResponse:
    """Encodes a query's results."""
    return store_pb2.QueryExperiencesResponse(experiences=[ref_to_proto(r) for r in refs])


def stats_response(
    stats: Sequence[ExperienceStats], blob_count: int, blob_bytes: int
) -> store_pb2.GetStatsResponse:
    """Encodes store statistics."""
    return store_pb2.GetStatsResponse(
        experiences=[
            store_pb2.ExperienceStats(
                job_id=s.job_id, agent=s.agent, state=proto_state(s.state), rows=s.rows, bytes=s.bytes
            )
            for s in stats
        ],
        blob_count=blob_count,
        blob_bytes=blob_bytes,
    )


def blob_info_to_proto(info: BlobInfo) -> store_pb2.BlobInfo:
    """Encodes a blob description."""
    return store_pb2.BlobInfo(
        name=info.name, sha256=info.sha256, size_bytes=info.size_bytes, created_unix_ms=info.created_unix_ms
    )
