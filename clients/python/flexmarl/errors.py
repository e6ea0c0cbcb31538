"""Domain errors that map one-to-one onto gRPC status codes.

Domain logic raises these; the server's error-mapping interceptor turns them
into a gRPC status with the message as details, so servicers stay thin and no
handler crashes a daemon on bad input.
"""

from __future__ import annotations

import grpc


class FlexmarlError(Exception):
    """Base of every error that a FlexMARL RPC may return to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(FlexmarlError):
    """The request is malformed or out of range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(FlexmarlError):
    """A named job, agent, lease, experience or blob does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(FlexmarlError):
    """A create collided with an existing, different object."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(FlexmarlError):
    """The request is valid but the system is not in a state to accept it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(FlexmarlError):
    """A size limit or quota was exceeded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(FlexmarlError):
    """Stored or received data failed verification (hash mismatch, truncation)."""

    code = grpc.StatusCode.DATA_LOSS


class Aborted(FlexmarlError):
    """A concurrent change won a race (compare-and-swap failed); retry."""

    code = grpc.StatusCode.ABORTED


class Unavailable(FlexmarlError):
    """A dependency (etcd, stored, an engine) cannot be reached right now."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(FlexmarlError):
    """Missing or wrong credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


def error_for_status(code: grpc.StatusCode, details: str) -> FlexmarlError | None:
    """The domain error a failed RPC's status code stands for (None for codes without one)."""
    for cls in FlexmarlError.__subclasses__():
        if cls.code == code:
            return cls(details or code.name)
    return None
