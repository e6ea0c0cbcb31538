"""Domain errors that map one-to-one onto gRPC status codes.

Domain logic raises these; the server's error-mapping interceptor
(``flexmarl.server.ErrorMappingInterceptor``) turns them into a gRPC status with
the message as details, so servicers stay thin and no handler crashes a daemon
on bad input. Where callers must tell two causes of one status code apart, the
error carries an :class:`ErrorReason`: it travels as the trailing metadata entry
``flexmarl-reason`` and :func:`error_for_rpc` puts it back on the client's error.
Callers decide on the reason, never on the message text (which is for people).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import grpc

#: Trailing-metadata key of an error's :class:`ErrorReason`.
REASON_METADATA_KEY = "flexmarl-reason"


class ErrorReason(enum.StrEnum):
    """Machine-readable cause of an error, beside its status code (like google.rpc.ErrorInfo.reason)."""

    UNSPECIFIED = ""
    #: A job's byte quota in stored is full: room may come back (GC, a raised quota), so retry.
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    #: A job cannot run at all (its environment does not load, its agents do not match the
    #: environment's): a rollout task failing so fails the job at once instead of being retried.
    JOB_UNRUNNABLE = "JOB_UNRUNNABLE"
    #: stored's disk (or its file-system quota) is full: nothing of the request was acknowledged,
    #: and stored serves it once space returns (GC, an operator), so retry with back-off.
    DISK_FULL = "DISK_FULL"
    #: A rollout task's episodes failed in their reward (raised, timed out) until fewer than
    #: :func:`flexmarl.experience.min_episodes_to_train` were left: the task is given up, not re-issued.
    EPISODES_FAILED = "EPISODES_FAILED"

    @classmethod
    def parse(cls, text: str) -> ErrorReason:
        """The reason named by text; UNSPECIFIED for one this version does not know."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNSPECIFIED


class FlexmarlError(Exception):
    """Base of every error that a FlexMARL RPC may return to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, *args: object, reason: ErrorReason = ErrorReason.UNSPECIFIED) -> None:
        super().__init__(*args)
        self.reason = reason

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata the server sends with this error's status (empty without a reason)."""
        return ((REASON_METADATA_KEY, self.reason.value),) if self.reason else ()


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


_ERROR_FOR_CODE: dict[grpc.StatusCode, type[FlexmarlError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted, DataLoss, Aborted,
                Unavailable, Unauthenticated)
}


def error_for_status(
    code: grpc.StatusCode, details: str, reason: ErrorReason = ErrorReason.UNSPECIFIED
) -> FlexmarlError | None:
    """The domain error a failed RPC's status code stands for (None for codes without one).

    Only the classes of this module: a subclass defined elsewhere (say an engine's INTERNAL
    error) never captures a status code for every caller in its process.
    """
    cls = _ERROR_FOR_CODE.get(code)
    return cls(details or code.name, reason=reason) if cls is not None else None


def reason_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> ErrorReason:
    """The :class:`ErrorReason` in a call's trailing metadata (UNSPECIFIED when none)."""
    for key, value in metadata or ():
        if key == REASON_METADATA_KEY:
            return ErrorReason.parse(value.decode() if isinstance(value, bytes) else value)
    return ErrorReason.UNSPECIFIED


def error_for_rpc(exc: grpc.RpcError) -> FlexmarlError | None:
    """The domain error of a failed call, reason included (None for codes without one)."""
    if not hasattr(exc, "code"):  # a channel-level error without a status
        return None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return error_for_status(exc.code(), details or "", reason_in(metadata))
