"""rolloutd's side of distributed weight sync: the replicas of an agent follow its trainer's broadcast.

For an agent of a job with ``rollout.weight_sync: distributed``, traind's rank 0 announces each
new version with its weight-update group (:class:`flexmarl.weight_group.WeightGroupRecord`:
rendezvous, open epoch, bucket plan) before it commits it; the router hands the announcement
to :meth:`AgentWeightGroup.receive` with the agent's replicas already drained (their write
locks held) or, for a partial-rollout agent, paused (``/pause_generation``), so no generation
decodes on them during the update. Per version:

1. Agree on the group with rank 0 and the other peers in two phases on rank 0's rendezvous store
   (:mod:`flexmarl.weight_group`): post this rolloutd's members (the replicas serving the agent
   now, maybe none) and the epoch it has them in, then wait for rank 0's plan. ``keep``:
   broadcast on the open epoch; ``open``: leave the old epoch (``/destroy_weights_update_group``
   on its members, a replica moved to another agent included), then every replica joins the new
   one (``/init_weights_update_group`` at the plan's rank offset for this rolloutd and on) while
   rank 0 connects; not in the plan (posted too late, or not a peer of the version): the
   replicas load the durable copy.
2. Replay the plan: ``/begin_weight_update`` on each (while rank 0 plans when the members are
   those of the open epoch, which rank 0 then likely keeps; any other plan ends those sessions
   before the members leave the epoch), per bucket one
   ``/update_weights_from_distributed`` on each concurrently with rank 0's broadcast (the
   version's ``weight_version`` on the last bucket only), ``/end_weight_update``.
3. Verify: each replica's ``/model_info`` names the version.

A replica that failed any step is reported as failed (its weights may be torn: the router
marks it for a reload from the durable copy before it serves again) and the epoch is closed on
every member (a broken group fails every later call), so the next version opens a new one.
Every call is bounded by the record's ``timeout_s`` (+5 s for the HTTP answer): a dead or stalled
replica costs rank 0 at most its timeout, then it goes on (it never waits for rolloutd).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from flexmarl.errors import FlexmarlError
from flexmarl.weight_group import (
    GroupPlan,
    MemberPost,
    WeightGroupRecord,
    answers_by_name,
    failures_by_name,
    member_key,
    plan_key,
)

log = logging.getLogger(__name__)

#: Extra seconds an engine's HTTP answer may take beyond the group's own timeout.
ANSWER_SLACK_S = 5.0
#: At most this long to reach rank 0's rendezvous store.
STORE_CONNECT_S = 10.0


@runtime_checkable
class GroupMember(Protocol):
    """An engine replica that serves SGLang's weight-update-group routes (rolloutd's ``SGLangClient``)."""

    url: str

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = ..., backend: str = ...,
                                        timeout_s: float | None = ...) -> Any:
        """Join the group as ``rank_offset``."""

    async def destroy_weights_update_group(self, group_name: str = ...) -> Any:
        """Leave the group."""

    async def begin_weight_update(self) -> Any:
        """Open the update session."""

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
                                              group_name: str = ..., weight_version: str | None = ...,
                                              flush_cache: bool = ..., abort_all_requests: bool = ...,
                                              load_format: str | None = ..., timeout_s: float | None = ...) -> Any:
        """Receive and load one bucket."""

    async def end_weight_update(self) -> Any:
        """Close the update session."""

    async def model_info(self) -> Any:
        """``/model_info`` (its ``weight_version``)."""


@dataclasses.dataclass(frozen=True)
class SyncOutcome:
    """What one announced version did: which replicas serve it now and which failed (and why)."""

    version: int
    #: "keep", "open", "skip" (no replica here), or "lost" (not in the version's group: the durable copy).
    answer: str
    served: tuple[str, ...] = ()
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    #: Seconds per phase, in order (:data:`SYNC_PHASES`; those reached): ``plan`` (post the members,
    #: rank 0's plan, joining a new epoch; a kept epoch's ``/begin_weight_update`` is sent meanwhile),
    #: ``begin`` (``/begin_weight_update``, what is left of it after the plan), ``transfer`` (every bucket's
    #: ``/update_weights_from_distributed``: the broadcast received and loaded on every member),
    #: ``end`` (``/end_weight_update``), ``verify`` (``/model_info`` names the version).
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)


#: The phases of one version's sync in order (:attr:`SyncOutcome.phases`).
SYNC_PHASES = ("plan", "begin", "transfer", "end", "verify")


class _PhaseClock:
    """Seconds of consecutive phases: each :meth:`mark` closes the phase that ran since the previous one."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last_s = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = now - self._last_s
        self._last_s = now


@dataclasses.dataclass(frozen=True)
class _Epoch:
    """The epoch this rolloutd's replicas are in: rank 0's endpoint, the epoch, its group and members."""

    endpoint: tuple[str, int]
    epoch: int
    group_name: str
    members: tuple[str, ...]


#: Opens a client of rank 0's rendezvous store (blocking; tests replace it).
StoreOpener = Callable[[str, int, float], Any]


def open_store(host: str, port: int, timeout_s: float) -> Any:
    """A client of the TCP store rank 0 hosts (the one the replicas' rendezvous uses)."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


class AgentWeightGroup:
    """The weight-update groups of one agent's replicas on this rolloutd, across versions."""

    def __init__(self, owner: str, *, open_store_fn: StoreOpener = open_store) -> None:
        """``owner``: this rolloutd's worker id (the peer name it posts under)."""
        self.owner = owner
        self._open_store = open_store_fn
        self._epoch: _Epoch | None = None
        #: The client of rank 0's store the last version was agreed on, kept for the next one (a
        #: connection fewer on the way to the plan): (host, port) -> client.
        self._store: tuple[tuple[str, int], Any] | None = None

    @property
    def members(self) -> tuple[str, ...]:
        """Replica ids in the open epoch (() when none is open)."""
        return self._epoch.members if self._epoch is not None else ()

    async def leave(self, clients: Mapping[str, GroupMember]) -> None:
        """Leaves the open epoch on every member still known (best effort; at a version boundary)."""
        epoch, self._epoch = self._epoch, None
        if epoch is None:
            return
        calls = {rid: clients[rid].destroy_weights_update_group(epoch.group_name)
                 for rid in epoch.members if rid in clients}
        for rid, exc in (await _bounded(calls, 10.0, "destroy_weights_update_group")).items():
            log.info("replica %s leaving %s: %s", rid, epoch.group_name, exc)

    async def receive(self, version: int, record: WeightGroupRecord, members: Sequence[tuple[str, GroupMember]],
                      clients: Mapping[str, GroupMember], *, flush_cache: bool = True) -> SyncOutcome:
        """Brings ``members`` (drained or paused by the caller) to ``version`` from rank 0's broadcast (module doc).

        ``clients``: every replica this rolloutd knows, to leave an old epoch with. ``flush_cache``
        False for paused members: SGLang refuses a flush while requests are running.
        """
        started_s = time.monotonic()
        clock = _PhaseClock()

        def outcome(answer: str, served: tuple[str, ...] = (), failed: Mapping[str, str] | None = None) -> SyncOutcome:
            return SyncOutcome(version, answer, served, dict(failed or {}), time.monotonic() - started_s,
                               dict(clock.phases))

        endpoint = (record.master_address, record.master_port)
        ids = tuple(rid for rid, _ in members)
        current = self._epoch if self._epoch is not None and self._epoch.endpoint == endpoint else None
        plan: GroupPlan | None = None
        problem = ""
        sessions: asyncio.Future[dict[str, str]] | None = None
        if self.owner in record.peers:  # else it began watching after the announcement: rank 0 does not wait for it
            exchange = asyncio.to_thread(self._exchange, record, version, MemberPost(
                current.epoch if current is not None else 0, ids))
            if members and current is not None and current.members == ids:
                # Rank 0 is likely to keep the epoch: the sessions open while it plans (on the group
                # the members are in; vLLM opens one only on a joined group, and leaves none while open).
                sessions = asyncio.ensure_future(self._begin(members, record))
            try:
                plan = await exchange
            except Exception as exc:  # rank 0 gone (connection refused, store timeout), a garbled plan
                problem = f"no group plan from rank 0: {exc}"
        offset = plan.rank_offsets.get(self.owner) if plan is not None else None
        keeps = (plan is not None and plan.kind == "keep" and offset is not None and current is not None
                 and current.epoch == plan.epoch and current.members == ids)
        if not keeps:  # any other outcome ends this rolloutd's epoch (another rank 0's included)
            await _end_sessions(sessions, members)  # before the members leave it
            sessions = None
            await self.leave(clients)
        unused = self._not_received(version, record, plan, problem, keeps, ids)
        if unused is not None:
            return outcome(*unused)
        assert plan is not None and offset is not None  # keep: _not_received answers every other case
        group_name = record.group_name(plan.epoch)
        if plan.kind == "open":
            failed = await self._join(record, plan, offset, group_name, members)
            if failed:
                await self._close(group_name, members)
                return outcome("open", failed=failed)
            self._epoch = _Epoch(endpoint, plan.epoch, group_name, ids)
        clock.mark("plan")
        failed = await self._replay(version, record, group_name, members, flush_cache, clock,
                                    sessions if sessions is not None else self._begin(members, record))
        if failed:
            await self._close(group_name, members)
        served = tuple(rid for rid in ids if rid not in failed)
        log.info("v%d over %s (%s, ranks %d-%d of %d): %d replicas served, %d failed (%.2fs: %s)", version,
                 group_name, plan.kind, offset, offset + len(ids) - 1, plan.world_size, len(served), len(failed),
                 time.monotonic() - started_s, " ".join(f"{k} {v:.2f}" for k, v in clock.phases.items()))
        return outcome(plan.kind, served, failed)

    def _not_received(self, version: int, record: WeightGroupRecord, plan: GroupPlan | None, problem: str,
                      keeps: bool, ids: tuple[str, ...]) -> tuple[str, tuple[str, ...], dict[str, str]] | None:
        """The outcome of a version this rolloutd's replicas do not receive by broadcast (None: they do)."""
        if problem:
            return "lost", (), {"rank0": problem}
        if self.owner not in record.peers:
            return "lost", (), {}
        if plan is None:
            log.info("v%d over %s: no replica serves the agent here; skipped", version, record.base_name)
            return "skip", (), {}
        if plan.kind == "skip" or self.owner not in plan.rank_offsets:
            log.warning("v%d over %s: not in rank 0's group (%s); the replicas load the durable copy", version,
                        record.base_name, plan.kind)
            return "lost", (), {}
        if plan.kind == "keep" and not keeps:  # rank 0 keeps only what we posted: a plan we cannot follow
            return "lost", (), {rid: f"rank 0 keeps epoch {plan.epoch}, which these replicas are not in" for rid in ids}
        return None

    async def _begin(self, members: Sequence[tuple[str, GroupMember]], record: WeightGroupRecord) -> dict[str, str]:
        """Opens every member's update session; the failed ones."""
        return _text(await _bounded({rid: c.begin_weight_update() for rid, c in members},
                                    record.timeout_s + ANSWER_SLACK_S, "begin_weight_update"))

    def _exchange(self, record: WeightGroupRecord, version: int, post: MemberPost) -> GroupPlan | None:
        """Posts this rolloutd's members and waits for rank 0's plan (blocking); None when it has none to join.

        The store client of the previous version is reused when rank 0 is the same; a kept client
        whose connection broke (rank 0 restarted on the same port) is replaced once.
        """
        endpoint = (record.master_address, record.master_port)
        kept = self._store[1] if self._store is not None and self._store[0] == endpoint else None
        self._store = None
        store = kept
        try:
            if store is None:
                raise ConnectionError("no client kept")
            store.set(member_key(version, self.owner), post.encode())
        except Exception:
            # A rank 0 that cannot be reached is gone: do not hold the drained replicas for its whole timeout.
            store = self._open_store(record.master_address, record.master_port,
                                     min(record.timeout_s, STORE_CONNECT_S))
            store.set(member_key(version, self.owner), post.encode())
        self._store = (endpoint, store)
        if not post.members:
            return None
        # Rank 0 may wait its whole timeout for the other peers before it plans.
        store.wait([plan_key(version)], datetime.timedelta(seconds=record.timeout_s + ANSWER_SLACK_S))
        return GroupPlan.decode(bytes(store.get(plan_key(version))))  # InvalidArgument: garbled

    async def _join(self, record: WeightGroupRecord, plan: GroupPlan, offset: int, group_name: str,
                    members: Sequence[tuple[str, GroupMember]]) -> dict[str, str]:
        calls = {rid: client.init_weights_update_group(
            master_address=record.master_address, master_port=record.master_port, rank_offset=rank,
            world_size=plan.world_size, group_name=group_name, backend=record.backend, timeout_s=record.timeout_s)
            for rank, (rid, client) in enumerate(members, start=offset)}
        return _text(await _bounded(calls, record.timeout_s + ANSWER_SLACK_S, f"joining {group_name}"))

    async def _replay(self, version: int, record: WeightGroupRecord, group_name: str,
                      members: Sequence[tuple[str, GroupMember]], flush_cache: bool,
                      clock: _PhaseClock, sessions: Awaitable[dict[str, str]]) -> dict[str, str]:
        """The plan's buckets, end and verify on every member; the failed ones (a failure stops all).

        ``sessions``: the members' begin, opened while rank 0 planned (its failures).
        """
        bound_s = record.timeout_s + ANSWER_SLACK_S
        failed = await sessions
        clock.mark("begin")
        if failed:
            return failed
        last = len(record.buckets) - 1
        for index, bucket in enumerate(record.buckets):
            names = [t.name for t in bucket]
            dtypes = [t.dtype for t in bucket]
            shapes = [list(t.shape) for t in bucket]
            calls = {rid: c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=group_name,
                weight_version=str(version) if index == last else None, flush_cache=flush_cache and index == last,
                timeout_s=bound_s) for rid, c in members}
            failed = _text(await _bounded(calls, bound_s, f"bucket {index + 1}/{len(record.buckets)} of v{version}"))
            if failed:
                # The others' receives fail too once the group closes; their weights are torn as well.
                clock.mark("transfer")
                return {rid: failed.get(rid, "the group broke under another replica") for rid, _ in members}
        clock.mark("transfer")
        failed = _text(await _bounded({rid: c.end_weight_update() for rid, c in members}, bound_s,
                                      "end_weight_update"))
        clock.mark("end")
        # After the end: vLLM tags the version when its session finishes.
        infos = await answers_by_name({rid: c.model_info() for rid, c in members if rid not in failed}, bound_s,
                                      "model_info")
        clock.mark("verify")
        for rid, info in infos.items():
            if isinstance(info, BaseException):
                failed[rid] = f"model_info: {info}"
            elif str(getattr(info, "weight_version", "")) != str(version):
                failed[rid] = f"serves weight_version {getattr(info, 'weight_version', '?')!r}, not {version}"
        return failed

    async def _close(self, group_name: str, members: Sequence[tuple[str, GroupMember]]) -> None:
        """A broken epoch: every member ends its session and leaves it (it fails every later call)."""
        self._epoch = None
        await _bounded({rid: c.end_weight_update() for rid, c in members}, 10.0, "end_weight_update")
        calls = {rid: c.destroy_weights_update_group(group_name) for rid, c in members}
        for rid, exc in (await _bounded(calls, 10.0, "destroy_weights_update_group")).items():
            log.info("replica %s leaving broken %s: %s", rid, group_name, exc)


async def _end_sessions(sessions: asyncio.Future[dict[str, str]] | None,
                        members: Sequence[tuple[str, GroupMember]]) -> None:
    """Ends the sessions opened for a version the members do not receive (once their begin answered)."""
    if sessions is None:
        return
    failed = await sessions
    calls = {rid: c.end_weight_update() for rid, c in members if rid not in failed}
    await _bounded(calls, 10.0, "end_weight_update")


async def _bounded(calls: Mapping[str, Awaitable[Any]], timeout_s: float, what: str) -> dict[str, BaseException]:
    """The failures of concurrent calls (and those past ``timeout_s``), by name, each logged."""
    failures = await failures_by_name(calls, timeout_s, what)
    for name, exc in failures.items():
        log.warning("%s: %s failed: %s", what, name, exc)
    return failures


def _text(failures: Mapping[str, BaseException]) -> dict[str, str]:
    return {name: (str(exc) if isinstance(exc, FlexmarlError) else f"{type(exc).__name__}: {exc}")
            for name, exc in failures.items()}


__all__ = ["ANSWER_SLACK_S", "STORE_CONNECT_S", "SYNC_PHASES", "AgentWeightGroup", "GroupMember", "SyncOutcome",
           "open_store"]
