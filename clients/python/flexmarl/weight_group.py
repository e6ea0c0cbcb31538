"""The weight-update group record of an agent: where its trainer broadcasts a version and in which buckets.

traind's rank 0 of an agent announces it with each new version (``AnnounceWeights``);
orchestratord adds the version's *peers*, the rolloutd workers that have the job's
``WatchAgentVersions`` stream open under their worker id, keeps the latest record per agent
and streams it with the version; each peer joins the replicas it has serving the agent to the
group and replays the bucket plan as SGLang's ``/update_weights_from_distributed`` calls while
rank 0 broadcasts.

Membership is the rolloutds' (each knows which of its replicas serve the agent at the version
boundary), the group is rank 0's. They agree per version in two phases on rank 0's rendezvous
store (the TCP store the replicas' ``/init_weights_update_group`` connects to anyway):

1. Every peer sets :func:`member_key` to a :class:`MemberPost`: its replicas serving the agent
   now (none is an answer too) and the epoch it has them in at this rank 0 (0: none).
2. Rank 0 waits for every peer's post (at most the group's timeout), then :func:`decide_plan`
   and sets :func:`plan_key` to the :class:`GroupPlan`: ``keep`` (every posting peer's members
   are the open epoch's: broadcast on the open group), ``open`` (rank 0 closes its group and
   opens a new epoch of ``world_size`` ranks; each peer's replicas join at its
   ``rank_offsets`` entry and on) or ``skip`` (no replica: nothing is broadcast). A peer that
   had not posted by then is not in the plan and its replicas load the durable copy, as does
   a rolloutd that started watching after the announcement (not a peer).
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
    #: The rolloutd workers orchestratord counts on to answer (worker ids, sorted); rank 0 waits for these.
    peers: tuple[str, ...] = ()

    def group_name(self, epoch: int) -> str:
        """The group name of an epoch (what ``group_name`` of the engine calls says)."""
        return f"{self.base_name}-e{epoch}"

    @property
    def nbytes(self) -> int:
        """Bytes a version moves (from the plan's dtypes and shapes)."""
        return sum(_nbytes(t) for bucket in self.buckets for t in bucket)


PlanKind = Literal["keep", "open", "skip"]


def _json(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"not a {what}: {raw[:80]!r}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"not a {what}: {raw[:80]!r}")
    return data


@dataclasses.dataclass(frozen=True)
class MemberPost:
    """One peer's phase-1 post: its replicas serving the agent now, and the epoch it has them in (0: none)."""

    epoch: int
    members: tuple[str, ...]

    def encode(self) -> bytes:
        """The store value."""
        return json.dumps({"epoch": self.epoch, "members": list(self.members)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MemberPost:
        """Parses a store value.

        Raises:
            InvalidArgument: Not a post (a negative epoch, a member that is not a non-empty string, a repeat).
        """
        data = _json(raw, "member post")
        epoch, members = data.get("epoch"), data.get("members")
        if (not isinstance(epoch, int) or epoch < 0 or not isinstance(members, list)
                or not all(isinstance(m, str) and m for m in members) or len(set(members)) != len(members)):
            raise InvalidArgument(f"not a member post: {raw[:80]!r}")
        return cls(epoch, tuple(members))


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Rank 0's phase-2 decision for one version (see the module doc)."""

    kind: PlanKind
    epoch: int
    world_size: int
    #: Peer -> the rank its first replica joins at (its others follow); only peers in the group.
    rank_offsets: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def encode(self) -> bytes:
        """The store value."""
        return json.dumps({"kind": self.kind, "epoch": self.epoch, "world_size": self.world_size,
                           "rank_offsets": dict(sorted(self.rank_offsets.items()))}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> GroupPlan:
        """Parses a store value.

        Raises:
            InvalidArgument: Not a plan (an unknown kind, a group without an epoch or replicas,
                rank offsets outside ``1..world_size - 1``).
        """
        data = _json(raw, "group plan")
        kind, epoch, world, offsets = data.get("kind"), data.get("epoch"), data.get("world_size"), \
            data.get("rank_offsets")
        if (kind not in ("keep", "open", "skip") or not isinstance(epoch, int) or not isinstance(world, int)
                or not isinstance(offsets, dict)
                or not all(isinstance(p, str) and isinstance(r, int) and 0 < r < world for p, r in offsets.items())):
            raise InvalidArgument(f"not a group plan: {raw[:80]!r}")
        if kind != "skip" and (epoch < 1 or world < 2 or not offsets):
            raise InvalidArgument(f"not a group plan: {raw[:80]!r}")
        return cls(kind, epoch, world, dict(offsets))


def decide_plan(posts: Mapping[str, MemberPost], open_epoch: int,
                open_members: Mapping[str, tuple[str, ...]], last_epoch: int) -> GroupPlan:
    """Rank 0's plan from the peers' posts.

    ``open_epoch`` is the epoch rank 0 has open (0: none), ``open_members`` who is in it (peer
    -> replica ids), ``last_epoch`` the highest it ever opened. ``keep`` when every peer with
    replicas posted exactly its members of the open epoch and says it is in that epoch, and no
    member of the epoch is missing or left; ``skip`` when no peer has a replica; else ``open``
    epoch ``last_epoch + 1`` with the peers' replicas at consecutive ranks from 1, in peer order.
    """
    serving = {peer: post for peer, post in sorted(posts.items()) if post.members}
    if not serving:
        return GroupPlan("skip", 0, 0)
    offsets: dict[str, int] = {}
    rank = 1
    for peer, post in serving.items():
        offsets[peer] = rank
        rank += len(post.members)
    same = ({p: post.members for p, post in serving.items()} == dict(open_members)
            and all(post.epoch == open_epoch for post in serving.values()))
    if open_epoch > 0 and same:
        return GroupPlan("keep", open_epoch, rank, offsets)
    return GroupPlan("open", last_epoch + 1, rank, offsets)


def member_key(version: int, peer: str) -> str:
    """The store key a peer posts its members of a version on (outside every group's prefix)."""
    return f"flexmarl/weights/v{version}/members/{peer}"


def plan_key(version: int) -> str:
    """The store key rank 0 sets a version's plan on."""
    return f"flexmarl/weights/v{version}/plan"


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
        epoch=record.epoch, backend=record.backend, timeout_s=record.timeout_s, peers=list(record.peers),
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
    if any(not peer for peer in msg.peers) or len(set(msg.peers)) != len(msg.peers):
        raise InvalidArgument(f"weight_group.peers: worker ids, each once, got {list(msg.peers)}")
    return WeightGroupRecord(msg.master_address, msg.master_port, msg.base_name, msg.epoch, msg.backend,
                             msg.timeout_s, tuple(buckets), tuple(msg.peers))


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


__all__ = ["GroupPlan", "MemberPost", "PlanKind", "WeightGroupRecord", "WeightTensor", "answers_by_name",
           "decide_plan", "failures_by_name", "from_message", "member_key", "plan_key", "to_message"]
