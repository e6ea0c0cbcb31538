"""Error reasons travel in the status (trailing metadata), and callers decide on them, not on text.

stored answers RESOURCE_EXHAUSTED for a full job quota (rolloutd holds the experiences and retries)
and for a record over its size limit (it never fits: not retried). Only the reason tells them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from flexmarl.errors import REASON_METADATA_KEY, ErrorReason, ResourceExhausted, error_for_rpc, reason_in
from flexmarl.experience import ExperienceRecord
from flexmarl.server import GrpcServer
from flexmarl.store_client import StoreClient
from flexmarl.v1 import store_pb2, store_pb2_grpc
from rolloutd.worker import _append_retry_code
from stored.app import StoredApp
from stored.config import StoredConfig

pytestmark = pytest.mark.timeout(60)

RecordFactory = Callable[..., ExperienceRecord]


@pytest.fixture
async def stored_address(tmp_path: Path) -> AsyncIterator[str]:
    """An in-process stored on port 0: job "tiny" has a 2000-byte quota, records are at most 4096 bytes."""
    config = StoredConfig(data_dir=str(tmp_path / "data"), gc_interval_s=0, max_record_bytes=4096,
                          job_quota_overrides="tiny=2000")
    config.validate()
    app = StoredApp(config, CollectorRegistry())
    server = GrpcServer(app.service_names, config.max_message_bytes)
    app.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await app.start()
    await server.server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.server.stop(0)
        await app.stop()


async def _append_error(address: str, records: list[ExperienceRecord]) -> ResourceExhausted:
    client = StoreClient(address)
    try:
        with pytest.raises(ResourceExhausted) as info:
            await client.append(records)
    finally:
        await client.close()
    return info.value


async def test_a_full_quota_is_retried_and_a_too_large_record_is_not(
    stored_address: str, record_factory: RecordFactory
) -> None:
    quota = await _append_error(stored_address, [record_factory(f"t{i}", 0, job_id="tiny") for i in range(20)])
    assert quota.reason is ErrorReason.QUOTA_EXCEEDED
    assert _append_retry_code(quota) is grpc.StatusCode.RESOURCE_EXHAUSTED

    too_large = await _append_error(stored_address, [record_factory("big", 0, response_tokens=4096)])
    assert too_large.reason is ErrorReason.UNSPECIFIED
    assert _append_retry_code(too_large) is None


async def test_the_reason_rides_in_trailing_metadata(stored_address: str, record_factory: RecordFactory) -> None:
    request = store_pb2.AppendExperiencesRequest(
        experiences=[record_factory(f"t{i}", 0, job_id="tiny").to_proto() for i in range(20)]
    )
    async with grpc.aio.insecure_channel(stored_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await store_pb2_grpc.StoreStub(channel).AppendExperiences(request)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (REASON_METADATA_KEY, "QUOTA_EXCEEDED") in tuple(info.value.trailing_metadata())
    mapped = error_for_rpc(info.value)
    assert isinstance(mapped, ResourceExhausted) and mapped.reason is ErrorReason.QUOTA_EXCEEDED


def test_the_decision_does_not_read_the_message() -> None:
    reworded = ResourceExhausted("job 'tiny' is out of room", reason=ErrorReason.QUOTA_EXCEEDED)
    assert _append_retry_code(reworded) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _append_retry_code(ResourceExhausted("job 'tiny' quota exceeded")) is None


def test_unknown_or_missing_reasons_are_unspecified() -> None:
    assert reason_in(None) is ErrorReason.UNSPECIFIED
    assert reason_in([("other", "x")]) is ErrorReason.UNSPECIFIED
    assert reason_in([(REASON_METADATA_KEY, "FROM_A_NEWER_SERVER")]) is ErrorReason.UNSPECIFIED
    assert reason_in([(REASON_METADATA_KEY, b"QUOTA_EXCEEDED")]) is ErrorReason.QUOTA_EXCEEDED
