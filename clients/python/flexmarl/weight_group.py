"""The weight-update group record of an agent: where its trainer broadcasts a version and in which buckets.

traind's rank 0 of an agent announces it with each new version (``AnnounceWeights``),
orchestratord keeps the latest per agent and streams it with the version (``WatchAgentVersions``),
and rolloutd follows it: it joins the replicas serving the agent to the group and replays the
bucket plan as SGLang's ``/update_weights_from_distributed`` calls while rank 0 broadcasts.

Membership is rolloutd's (it knows which replicas serve the agent at the version boundary),
the group is rank 0's. They agree per version through rank 0's rendezvous store (the TCP
store the replicas' ``/init_weights_update_group`` connects to anyway): rolloutd sets
:func:`join_key` to a :class:`JoinAnswer`, ``keep`` (the members of epoch ``epoch`` are
unchanged: broadcast on the open group) or ``open`` (rank 0 closes its group and opens epoch
``epoch`` with ``world_size`` ranks, the replicas joining at rank_offset 1..n) or ``skip`` (no
replica serves the agent now: rank 0 closes its group and broadcasts nothing). The first
rolloutd to answer owns the version's group (compare-and-set); any other loads the durable copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Mapping
from typing import Any, Literal

from flexmarl.errors import InvalidArgument
from flexmarl.v1 import common_pb2


@dataclasses.dataclass(frozen=True)
class WeightTensor:
    """One tensor of a bucket as ``/update_weights_from_distributed`` names it."""

    name: str
    dtype: str  # the torch attribute name: "float32", "bfloat16"
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class WeightGroupRecord:
    """Rank 0's group for one version: its rendezvous, its open epoch and the version's bucket plan."""

    master_address: str
    master_port: int
    #: The base name; epoch ``e``'s group is :meth:`group_name` (a fresh name per epoch: torch and
    #: the store key their state by it).
    base_name: str
    #: The epoch rank 0 has open now (0: none); rolloutd answers ``keep`` only for this one.
    epoch: int
    backend: str
    #: How long rank 0 waits for an answer, for the group to form and for each bucket.
    timeout_s: float
    buckets: tuple[tuple[WeightTensor, ...], ...]

    def group_name(self, epoch: int) -> str:
        """The group name of an epoch (what ``group_name`` of the engine calls says)."""
        return f"{self.base_name}-e{epoch}"

    @property
    def nbytes(self) -> int:
        """Bytes a version moves (from the plan's dtypes and shapes)."""
        return sum(_nbytes(t) for bucket in self.buckets for t in bucket)


JoinKind = Literal["keep", "open", "skip"]


@dataclasses.dataclass(frozen=True)
class JoinAnswer:
    """rolloutd's answer for one version: broadcast on the open epoch, open ``epoch`` with ``world_size``, or skip."""

    kind: JoinKind
    epoch: int
    world_size: int
    #: The rolloutd worker that owns the version's group.
    owner: str

    def encode(self) -> bytes:
        """The store value."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> JoinAnswer:
        """Parses a store value.

        Raises:
            InvalidArgument: Not an answer.
        """
        try:
            data = json.loads(raw)
            answer = cls(str(data["kind"]), int(data["epoch"]), int(data["world_size"]),  # type: ignore[arg-type]
                         str(data["owner"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"not a weight-group answer: {raw[:80]!r}") from exc
        if answer.kind not in ("keep", "open", "skip") or (
                answer.kind != "skip" and (answer.epoch < 1 or answer.world_size < 2)):
            raise InvalidArgument(f"not a weight-group answer: {answer}")
        return answer


def join_key(version: int) -> str:
    """The store key rolloutd answers a version on (outside every group's prefix)."""
    return f"flexmarl/weights/v{version}/join"


_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


def _nbytes(tensor: WeightTensor) -> int:
    count = 1
    for dim in tensor.shape:
        count *= dim
    return count * _DTYPE_BYTES.get(tensor.dtype, 4)


def to_message(record: WeightGroupRecord) -> common_pb2.WeightGroup:
    """The record as a ``WeightGroup`` message."""
    return common_pb2.WeightGroup(
        master_address=record.master_address, master_port=record.master_port, base_name=record.base_name,
        epoch=record.epoch, backend=record.backend, timeout_s=record.timeout_s,
        buckets=[common_pb2.WeightBucket(tensors=[common_pb2.WeightTensor(name=t.name, dtype=t.dtype,
                                                                          shape=list(t.shape)) for t in bucket])
                 for bucket in record.buckets])


def from_message(msg: common_pb2.WeightGroup) -> WeightGroupRecord:
    """A ``WeightGroup`` message as a record.

    Raises:
        InvalidArgument: A field a group cannot have (no address or port, no buckets, an empty
            bucket, a negative dimension, a timeout that is not positive).
    """
    if not msg.master_address or not 0 < msg.master_port < 65536:
        raise InvalidArgument(f"weight_group: master_address and master_port are required, got "
                              f"{msg.master_address!r}:{msg.master_port}")
    if not msg.base_name or msg.backend not in ("gloo", "nccl"):
        raise InvalidArgument(f"weight_group: base_name and backend gloo|nccl are required, got "
                              f"{msg.base_name!r}, {msg.backend!r}")
    if not msg.timeout_s > 0:
        raise InvalidArgument(f"weight_group.timeout_s: must be > 0, got {msg.timeout_s}")
    if not msg.buckets or any(not bucket.tensors for bucket in msg.buckets):
        raise InvalidArgument("weight_group.buckets: every bucket needs a tensor, and a version a bucket")
    buckets = []
    for bucket in msg.buckets:
        tensors = []
        for t in bucket.tensors:
            if not t.name or t.dtype not in _DTYPE_BYTES or any(dim < 0 for dim in t.shape):
                raise InvalidArgument(f"weight_group: bad tensor {t.name!r} ({t.dtype}, {list(t.shape)})")
            tensors.append(WeightTensor(t.name, t.dtype, tuple(t.shape)))
        buckets.append(tuple(tensors))
    return WeightGroupRecord(msg.master_address, msg.master_port, msg.base_name, msg.epoch, msg.backend,
                             msg.timeout_s, tuple(buckets))


async def answers_by_name(calls: Mapping[str, Awaitable[Any]], timeout_s: float, what: str) -> dict[str, Any]:
    """Each concurrent call's result or exception, by name (no calls: none).

    A call past ``timeout_s`` is cancelled and answers TimeoutError. Both sides of a weight-update
    group (traind's broadcaster, rolloutd's group owner) ask every member at once with it.
    """
    names = list(calls)
    tasks = [asyncio.ensure_future(call) for call in calls.values()]
    if not tasks:
        return {}
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    out: dict[str, Any] = {}
    for name, task in zip(names, tasks, strict=True):
        if task in pending:
            task.cancel()
            out[name] = TimeoutError(f"{what}: no answer within {timeout_s:.0f}s")
        else:
            out[name] = task.exception() or task.result()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return out


async def failures_by_name(
    calls: Mapping[str, Awaitable[Any]], timeout_s: float, what: str
) -> dict[str, BaseException]:
    """The failures of :func:`answers_by_name`'s calls (and those past ``timeout_s``), by name."""
    answers = await answers_by_name(calls, timeout_s, what)
    return {name: a for name, a in answers.items() if isinstance(a, BaseException)}


__all__ = ["JoinAnswer", "JoinKind", "WeightGroupRecord", "WeightTensor", "answers_by_name", "failures_by_name",
           "from_message", "join_key", "to_message"]
