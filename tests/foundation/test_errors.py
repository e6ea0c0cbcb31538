"""Status codes map to the domain errors of flexmarl.errors only; RPC errors describe themselves."""

from __future__ import annotations

import grpc
import grpc.aio

from flexmarl import errors
from flexmarl.connections import describe_error


class _EngineCrash(errors.FlexmarlError):
    """A subclass defined outside errors.py, with a code no domain error has."""

    code = grpc.StatusCode.INTERNAL


class _Busy(errors.Unavailable):
    pass


def test_only_the_modules_own_classes_map_status_codes() -> None:
    assert errors.error_for_status(grpc.StatusCode.INTERNAL, "boom") is None  # not _EngineCrash
    unavailable = errors.error_for_status(grpc.StatusCode.UNAVAILABLE, "down")
    assert type(unavailable) is errors.Unavailable  # not a subclass defined elsewhere
    quota = errors.error_for_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "", errors.ErrorReason.QUOTA_EXCEEDED)
    assert isinstance(quota, errors.ResourceExhausted) and quota.reason is errors.ErrorReason.QUOTA_EXCEEDED
    assert str(quota) == "RESOURCE_EXHAUSTED"


def test_an_aio_rpc_error_is_described_by_code_and_details() -> None:
    exc = grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               details="no job x")
    assert describe_error(exc) == "NOT_FOUND: no job x"
    assert describe_error(ValueError("bad")) == "ValueError: bad"
