"""Weight sync over a collective: an agent's trainer rank 0 broadcasts its parameters to the replicas serving it.

The replicas speak SGLang 0.5.23's weight-update-group API (sglang/srt/entrypoints/http_server.py
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``; the embedded engine serves the same routes). In that API the
trainer is rank 0 of a custom process group and every engine rank joins it at
``rank_offset + tp_rank``; each ``/update_weights_from_distributed`` call names the tensors
(names, dtypes, shapes) that rank 0 then broadcasts, and the engine loads them as soon as they
arrive. This module is rank 0's side, as slime drives it
(slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py: pause, buckets,
continue):

* :class:`WeightBroadcaster` hosts the group's rendezvous (a TCP store on ``host:port``),
  forms the group with the replicas and broadcasts buckets; ``gloo`` on CPU, ``nccl`` on CUDA,
  the same code. Every collective runs under the group's timeout, so a dead or stalled replica
  costs the trainer at most ``timeout_s`` and then a clear :class:`WeightSyncError`.
* :func:`plan_buckets` splits the parameters into buckets of at most ``bucket_bytes`` (a tensor
  larger than that is a bucket of its own), so one bucket's copies are all a broadcast holds.
* :func:`push_version` drives one version: begin the engines' update sessions, then per bucket
  one ``/update_weights_from_distributed`` call on every replica concurrently with rank 0's
  broadcast, ``weight_version`` on the last bucket only (a replica never advertises a version
  it has not completely received), then end the sessions. Whoever drives the engines pauses
  generation around it (each bucket is loaded on arrival, so a replica that generated between
  buckets would use a torn model).
* :class:`ReplicaGroup` keeps the group across versions: open once, push many versions, close
  (or reopen with other members) at a version boundary. A failed push closes the group: every
  replica still in it then fails at once (its connections close), and the caller reloads the
  replicas that did not complete the version from the durable copy.

The engines are reached through :class:`WeightReceiver`, the part of rolloutd's SGLang client
this module needs (traind does not import rolloutd; the client satisfies the protocol).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from flexmarl import collective
from flexmarl.errors import FlexmarlError
from flexmarl.weight_group import (
    GroupPlan,
    MemberPost,
    WeightGroupRecord,
    WeightTensor,
    decide_plan,
    failures_by_name,
    member_key,
    plan_key,
)

logger = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"  # io_struct.py's default group_name
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0


class WeightSyncError(FlexmarlError):
    """A version could not be broadcast; ``failed`` names the replicas (and rank 0) that failed, and why."""

    def __init__(self, message: str, failed: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})


class WeightReceiver(Protocol):
    """One engine replica of the group (rolloutd's ``SGLangClient`` has exactly these calls)."""

    url: str

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = ...,
        backend: str = ...,
        timeout_s: float | None = ...,
    ) -> Any:
        """Join the group as ``rank_offset``; raises when the engine answers ``success: false``."""

    async def begin_weight_update(self) -> Any:
        """Open the engine's update session."""

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = ...,
        weight_version: str | None = ...,
        flush_cache: bool = ...,
        abort_all_requests: bool = ...,
        load_format: str | None = ...,
        timeout_s: float | None = ...,
    ) -> Any:
        """Receive and load one bucket; raises when the engine answers ``success: false``."""

    async def end_weight_update(self) -> Any:
        """Close the engine's update session."""

    async def destroy_weights_update_group(self, group_name: str = ...) -> Any:
        """Leave the group."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a bucket, as ``/update_weights_from_distributed`` names it."""

    name: str
    dtype: str  # the torch attribute name: "float32", "bfloat16"
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors broadcast together after one update call."""

    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return sum(spec.nbytes for spec in self.tensors)

    def request_fields(self) -> tuple[list[str], list[str], list[list[int]]]:
        """``names``, ``dtypes`` and ``shapes`` of the update call."""
        return (
            [spec.name for spec in self.tensors],
            [spec.dtype for spec in self.tensors],
            [list(spec.shape) for spec in self.tensors],
        )


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with ``getattr(torch, name)`` (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, send_dtype: torch.dtype | None = None
) -> list[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (an oversized tensor alone).

    ``send_dtype`` (e.g. ``torch.bfloat16``) is the dtype on the wire; None keeps each tensor's.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    current_bytes = 0
    for name, tensor in named:
        dtype = send_dtype or tensor.dtype
        spec = TensorSpec(name, dtype_name(dtype), tuple(tensor.shape), tensor.numel() * dtype.itemsize)
        if current and current_bytes + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current)))
            current, current_bytes = [], 0
        current.append(spec)
        current_bytes += spec.nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


@dataclasses.dataclass(frozen=True)
class GroupAddress:
    """Where the replicas meet rank 0, and the group's shape (the fields of ``/init_weights_update_group``)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str


class WeightBroadcaster:
    """Rank 0 of one weight-update group: hosts the rendezvous, forms the group, broadcasts buckets.

    Blocking methods (:meth:`connect`, :meth:`broadcast`) run on a worker thread in
    :func:`push_version`; each is bounded by ``timeout_s`` (the group's own timeout).
    """

    def __init__(
        self,
        *,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        store: Any = None,
    ) -> None:
        """A group of ``world_size`` ranks; ``store``: a rendezvous store someone else hosts (and keeps)."""
        if world_size < 2:
            raise ValueError(f"a weight-update group needs rank 0 and a replica, got world_size {world_size}")
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend
        self.host = host
        self.timeout_s = timeout_s
        self._owns_store = store is None
        self._store: Any = store
        self._port = port if store is None else int(store.port)
        self._group: Any = None

    @property
    def connected(self) -> bool:
        """Whether the group is formed (and not closed)."""
        return self._group is not None

    def listen(self) -> GroupAddress:
        """Open the rendezvous store (idempotent); returns what the replicas are sent."""
        if self._store is None:
            self._store = collective.host_store(self.host, self._port, self.world_size, self.timeout_s)
            self._port = int(self._store.port)
        return GroupAddress(self.host, self._port, self.world_size, self.group_name, self.backend)

    def connect(self) -> None:
        """Form the group as rank 0 (blocks until every replica joined, at most ``timeout_s``).

        Raises:
            WeightSyncError: Not every replica joined in time.
        """
        self.listen()
        try:
            self._group = collective.create_group(
                self._store,
                backend=self.backend,
                world_size=self.world_size,
                rank=0,
                group_name=self.group_name,
                timeout_s=self.timeout_s,
            )
        except Exception as exc:  # torch raises DistStoreError, RuntimeError, ValueError here
            self.close()
            raise WeightSyncError(f"weight-update group {self.group_name} did not form: {exc}") from exc

    def broadcast(self, tensors: Iterable[torch.Tensor]) -> None:
        """Broadcast one bucket's tensors, in order, from rank 0.

        Each tensor's broadcast is posted as soon as the iterable yields it, so a lazy iterable
        (:func:`wire_tensors`) converts the next tensor while the previous ones are on the wire.

        Raises:
            WeightSyncError: A replica died, left or stalled (the group is closed then).
        """
        if self._group is None:
            raise WeightSyncError(f"weight-update group {self.group_name} is not connected")
        try:
            works = []
            sent = []  # every tensor stays alive until its broadcast completed
            for tensor in tensors:
                works.append(dist.broadcast(tensor, src=0, group=self._group, async_op=True))
                sent.append(tensor)
            for work in works:
                if work is not None:
                    work.wait()
        except Exception as exc:  # gloo/NCCL errors (peer closed, timeout) are RuntimeErrors of many kinds
            self.close()
            raise WeightSyncError(f"broadcast in {self.group_name} failed: {exc}") from exc

    def close(self) -> None:
        """Destroy the group and the store (idempotent): every replica still in the group fails at once."""
        group, self._group = self._group, None
        if group is not None:
            try:
                collective.destroy_group(group)
            except Exception as exc:  # already broken: nothing left to release
                logger.warning("destroying weight-update group %s: %s", self.group_name, exc)
        if self._owns_store:
            self._store = None


def wire_tensors(params: dict[str, torch.Tensor], bucket: Iterable[tuple[str, str]],
                 backend: str = "gloo") -> Iterator[torch.Tensor]:
    """The bucket's ``(name, dtype)`` tensors as the bucket announces them, converted one at a time.

    Lazy: :meth:`WeightBroadcaster.broadcast` posts each one before the next is converted.
    """
    for name, dtype in bucket:
        yield _wire(params[name], dtype, backend)


@dataclasses.dataclass(frozen=True)
class PushReport:
    """One version pushed: sizes and the time from the first call to the last replica's answer."""

    weight_version: str
    buckets: int
    bytes: int
    seconds: float


class ReplicaGroup:
    """One weight-update group across versions: rank 0 plus ``receivers`` at ranks 1..n."""

    RANK0 = "rank0"

    def __init__(self, broadcaster: WeightBroadcaster, receivers: Sequence[WeightReceiver]) -> None:
        if broadcaster.world_size != len(receivers) + 1:
            raise ValueError(f"world_size {broadcaster.world_size} != 1 + {len(receivers)} replicas")
        self.broadcaster = broadcaster
        self.receivers = list(receivers)

    @property
    def timeout_s(self) -> float:
        """The bound on every step (group formation, one bucket)."""
        return self.broadcaster.timeout_s

    async def open(self) -> None:
        """Form the group: every replica joins (``rank_offset`` 1, 2, ...) while rank 0 connects.

        Raises:
            WeightSyncError: A replica or rank 0 failed to join within the timeout (the group is closed).
        """
        address = self.broadcaster.listen()
        calls: dict[str, Any] = {self.RANK0: asyncio.to_thread(self.broadcaster.connect)}
        for rank, receiver in enumerate(self.receivers, start=1):
            calls[receiver.url] = receiver.init_weights_update_group(
                master_address=address.master_address,
                master_port=address.master_port,
                rank_offset=rank,
                world_size=address.world_size,
                group_name=address.group_name,
                backend=address.backend,
                timeout_s=self.timeout_s,
            )
        failures = await failures_by_name(calls, self.timeout_s + 5.0, "joining the group")
        if failures:
            self.broadcaster.close()
            raise WeightSyncError(
                f"weight-update group {address.group_name} did not form: {_describe(failures)}",
                {name: str(exc) for name, exc in failures.items()},
            )

    async def push_version(
        self,
        params: dict[str, torch.Tensor],
        weight_version: str,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        send_dtype: torch.dtype | None = None,
        flush_cache: bool = True,
    ) -> PushReport:
        """Broadcast ``params`` as ``weight_version`` (see the module doc); the caller has paused generation.

        Raises:
            WeightSyncError: A replica or rank 0 failed or timed out; the group is closed and
                ``failed`` lists who. Replicas not listed completed every bucket they were sent,
                but only a failure on the last bucket leaves any replica on ``weight_version``.
        """
        started_s = time.monotonic()
        buckets = plan_buckets(params.items(), bucket_bytes, send_dtype=send_dtype)
        if not buckets:
            raise ValueError("no parameters to push")
        group_name = self.broadcaster.group_name
        await self._step({r.url: r.begin_weight_update() for r in self.receivers}, "begin_weight_update")
        for index, bucket in enumerate(buckets):
            last = index == len(buckets) - 1
            names, dtypes, shapes = bucket.request_fields()
            tensors = wire_tensors(params, ((spec.name, spec.dtype) for spec in bucket.tensors),
                                   self.broadcaster.backend)
            calls: dict[str, Any] = {self.RANK0: asyncio.to_thread(self.broadcaster.broadcast, tensors)}
            for receiver in self.receivers:
                calls[receiver.url] = receiver.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    group_name=group_name,
                    weight_version=weight_version if last else None,
                    flush_cache=flush_cache and last,
                    timeout_s=self.timeout_s + 5.0,
                )
            await self._step(calls, f"bucket {index + 1}/{len(buckets)} of {weight_version}")
        await self._step({r.url: r.end_weight_update() for r in self.receivers}, "end_weight_update")
        seconds = time.monotonic() - started_s
        total = sum(bucket.nbytes for bucket in buckets)
        logger.info("pushed %s: %d buckets, %.1f MB in %.2fs", weight_version, len(buckets), total / 1e6, seconds)
        return PushReport(weight_version, len(buckets), total, seconds)

    async def _step(self, calls: dict[str, Any], what: str) -> None:
        failures = await failures_by_name(calls, self.timeout_s + 5.0, what)
        if failures:
            self.broadcaster.close()
            raise WeightSyncError(
                f"{what} failed: {_describe(failures)}", {name: str(exc) for name, exc in failures.items()}
            )

    async def close(self) -> None:
        """Leave the group at a version boundary: rank 0 destroys it, each replica leaves (best effort)."""
        self.broadcaster.close()
        calls = {r.url: r.destroy_weights_update_group(self.broadcaster.group_name) for r in self.receivers}
        failures = await failures_by_name(calls, self.timeout_s, "destroy_weights_update_group")
        for name, exc in failures.items():
            logger.info("replica %s leaving %s: %s", name, self.broadcaster.group_name, exc)


def _describe(failures: dict[str, BaseException]) -> str:
    return "; ".join(f"{name}: {exc}" for name, exc in failures.items())


def distinct_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict without the second name of a tied tensor (``lm_head.weight`` = the embedding).

    The engine loads by parameter name with the tied names included (a tied parameter is one
    tensor), so sending it once is enough; ``save_pretrained`` drops it the same way.
    """
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


class AgentBroadcast:
    """rank 0 of one agent across versions: its rendezvous store, its open group (epoch), each version's push.

    Per version (:mod:`flexmarl.weight_group`): :meth:`announce` plans the buckets and names the
    group (host, port, open epoch); orchestratord adds the version's peers (the rolloutds
    watching the job); each peer posts its members on the store; :meth:`push` (blocking: run it
    on a thread) waits for every peer's post, decides and posts the plan (keep the open group, or
    open a new epoch over the posted members), and broadcasts the buckets. Every wait is bounded
    by ``timeout_s``: a peer that has not posted by then is left out (its replicas load the
    durable copy). Any failure closes the group (the store stays: the next version opens a new
    epoch) and raises :class:`WeightSyncError`, after which the version reaches the replicas
    from its durable copy.
    """

    def __init__(self, job_id: str, agent: str, *, host: str = "127.0.0.1", backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 send_dtype: torch.dtype | None = None) -> None:
        self.base_name = f"flexmarl-weights-{job_id}-{agent}"
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.send_dtype = send_dtype
        self._store: Any = None
        self._group: WeightBroadcaster | None = None
        self.epoch = 0  # the epoch open now (0: none)
        self.members: dict[str, tuple[str, ...]] = {}  # peer -> its replicas in the open epoch
        self._last_epoch = 0  # the highest epoch ever opened on this store

    def announce(self, params: dict[str, torch.Tensor]) -> WeightGroupRecord:
        """Opens the store (once) and plans the version's buckets; what AnnounceWeights carries."""
        if self._store is None:
            self._store = collective.host_store(self.host, 0, 2, self.timeout_s)
        buckets = plan_buckets(params.items(), self.bucket_bytes, send_dtype=self.send_dtype)
        if not buckets:
            raise ValueError("no parameters to broadcast")
        plan = tuple(tuple(WeightTensor(t.name, t.dtype, t.shape) for t in b.tensors) for b in buckets)
        return WeightGroupRecord(self.host, int(self._store.port), self.base_name,
                                 self.epoch if self._group is not None else 0, self.backend, self.timeout_s, plan)

    def push(self, params: dict[str, torch.Tensor], version: int, record: WeightGroupRecord) -> PushReport | None:
        """Broadcasts ``params`` as ``version`` along ``record``'s plan to its peers' replicas (blocking).

        Returns None when no peer has a replica serving the agent now.

        Raises:
            WeightSyncError: No peer posted within ``timeout_s``, the group did not form, or a
                broadcast failed (the group is closed then).
        """
        started_s = time.monotonic()
        try:
            plan, members = self._plan(version, record.peers)
        except Exception as exc:
            self._close_group()
            if isinstance(exc, WeightSyncError):
                raise
            # The rendezvous store broke under us (torch raises many kinds here).
            raise WeightSyncError(f"{self.base_name} v{version}: planning the group failed: {exc}") from exc
        group = self._group
        if plan.kind == "skip":
            self._close_group()
            logger.info("%s v%d: no replica serves the agent now; nothing broadcast", self.base_name, version)
            return None
        if plan.kind == "open":
            self._close_group()
            self._last_epoch = self.epoch = plan.epoch
            group = WeightBroadcaster(world_size=plan.world_size, group_name=record.group_name(plan.epoch),
                                      backend=self.backend, host=self.host, timeout_s=self.timeout_s,
                                      store=self._store)
            group.connect()  # raises WeightSyncError (and closes) when the replicas do not join
            self._group = group
        assert group is not None  # keep: decide_plan keeps only an open epoch
        self.members = members
        total = 0
        try:
            for bucket in record.buckets:
                group.broadcast(wire_tensors(params, ((t.name, t.dtype) for t in bucket), self.backend))
                total += sum(math.prod(t.shape) * getattr(torch, t.dtype).itemsize for t in bucket)
        except WeightSyncError:
            self._close_group()  # broadcast() closed the group already; this forgets it
            raise
        seconds = time.monotonic() - started_s
        logger.info("broadcast %s v%d: epoch %d (%s), %d ranks from %d rolloutds, %d buckets, %.1f MB in %.2fs",
                    self.base_name, version, self.epoch, plan.kind, group.world_size, len(plan.rank_offsets),
                    len(record.buckets), total / 1e6, seconds)
        return PushReport(str(version), len(record.buckets), total, seconds)

    def _plan(self, version: int, peers: Sequence[str]) -> tuple[GroupPlan, dict[str, tuple[str, ...]]]:
        """Waits for every peer's post (at most ``timeout_s``), then decides and posts the version's plan.

        Returns the plan and the members it has in the group (peer -> replica ids).

        The plan is posted in every case, so a peer that posts late finds it without itself and
        leaves its replicas to the durable copy instead of waiting for a rank 0 that went on.

        Raises:
            WeightSyncError: Peers were expected and none posted in time (nothing to broadcast to).
        """
        keys = {peer: member_key(version, peer) for peer in peers}
        try:
            if keys:
                self._store.wait(list(keys.values()), datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # the store's timeout is a DistStoreError; who posted is checked below
            logger.warning("%s v%d: not every rolloutd posted within %.0fs (%s)", self.base_name, version,
                           self.timeout_s, exc)
        posts: dict[str, MemberPost] = {}
        for peer, key in keys.items():
            try:
                if self._store.check([key]):
                    posts[peer] = MemberPost.decode(bytes(self._store.get(key)))
            except Exception as exc:  # a garbled post (InvalidArgument), a broken store
                logger.warning("%s v%d: the post of %s is unusable: %s", self.base_name, version, peer, exc)
        plan = decide_plan(posts, self.epoch if self._group is not None else 0, self.members, self._last_epoch)
        self._store.set(plan_key(version), plan.encode())
        missing = sorted(set(peers) - set(posts))
        if missing:
            logger.warning("%s v%d: %s did not post in time; their replicas load the durable copy", self.base_name,
                           version, ", ".join(missing))
        if plan.kind == "skip" and missing and not posts:
            raise WeightSyncError(f"{self.base_name} v{version}: no replica group answered within "
                                  f"{self.timeout_s:.0f}s (waited for {', '.join(missing)})")
        return plan, {peer: posts[peer].members for peer in plan.rank_offsets}

    def _close_group(self) -> None:
        group, self._group, self.epoch, self.members = self._group, None, 0, {}
        if group is not None:
            group.close()

    def close(self) -> None:
        """Closes the group and the store (idempotent)."""
        self._close_group()
        self._store = None


def _wire(tensor: torch.Tensor, dtype_name: str, backend: str) -> torch.Tensor:
    """The tensor as the bucket announces it, where the backend sends from (NCCL: the current CUDA device)."""
    dtype = getattr(torch, dtype_name)
    tensor = tensor.detach()
    if backend == "nccl" and not tensor.is_cuda:
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor.to(dtype).contiguous() if tensor.dtype != dtype else tensor.contiguous()


__all__ = [
    "AgentBroadcast",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_GROUP_NAME",
    "DEFAULT_TIMEOUT_S",
    "Bucket",
    "GroupAddress",
    "PushReport",
    "ReplicaGroup",
    "TensorSpec",
    "WeightBroadcaster",
    "WeightReceiver",
    "WeightSyncError",
    "distinct_tensors",
    "dtype_name",
    "plan_buckets",
    "wire_tensors",
]
