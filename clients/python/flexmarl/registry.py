"""The one module that talks to etcd: service registration, discovery and job-state keys.

Built on ``aetcd`` (the maintained asyncio client). The ``etcd3`` package does not
import with protobuf >= 4, so it is not an option.

Keys live under a configurable prefix (default ``/flexmarl``):
``services/<kind>/<id>`` holds a JSON :class:`ServiceRecord` attached to the
daemon's TTL lease, so a daemon that dies disappears within its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aetcd
import aetcd.exceptions

from flexmarl.config import etcd_endpoints
from flexmarl.errors import Unavailable

log = logging.getLogger(__name__)

#: Errors that mean "etcd is not reachable right now" (retry later).
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)

#: Errors after which a watch re-lists (etcd errors and records it cannot parse).
_WATCH_ERRORS: tuple[type[BaseException], ...] = (*ETCD_ERRORS, ValueError, KeyError)


@dataclasses.dataclass(frozen=True)
class ServiceRecord:
    """What a daemon publishes about itself in etcd."""

    kind: str
    service_id: str
    address: str
    metrics_port: int
    pid: int
    started_unix_ms: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> bytes:
        """Serialises the record for etcd."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ServiceRecord:
        """Parses a record written by :meth:`to_json`."""
        raw = json.loads(data)
        return cls(
            kind=str(raw["kind"]),
            service_id=str(raw["service_id"]),
            address=str(raw["address"]),
            metrics_port=int(raw["metrics_port"]),
            pid=int(raw["pid"]),
            started_unix_ms=int(raw["started_unix_ms"]),
            info=dict(raw.get("info") or {}),
        )


class Registry:
    """A connection to etcd with the key layout of FlexMARL."""

    def __init__(
        self,
        endpoints: str,
        prefix: str = "/flexmarl",
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 5.0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self._endpoints = etcd_endpoints(endpoints)
        self.prefix = prefix
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._username = username
        self._password = password
        self._client: aetcd.Client | None = None
        self._endpoint_index = 0
        self._registrations: dict[str, _Registration] = {}

    # ---- connection ----

    @property
    def client(self) -> aetcd.Client:
        """The live aetcd client; raises Unavailable before connect()."""
        if self._client is None:
            raise Unavailable("etcd: not connected")
        return self._client

    async def connect(self) -> None:
        """Connects to the first reachable endpoint; raises Unavailable when none answers in time."""
        deadline = time.monotonic() + self._connect_timeout_s
        last_error = ""
        while True:
            for _ in range(len(self._endpoints)):
                host, port = self._endpoints[self._endpoint_index]
                client = aetcd.Client(
                    host=host,
                    port=port,
                    username=self._username,
                    password=self._password,
                    timeout=int(max(1, self._request_timeout_s)),
                )
                try:
                    await asyncio.wait_for(client.status(), timeout=max(0.2, min(2.0, self._connect_timeout_s)))
                except ETCD_ERRORS as exc:
                    last_error = f"{host}:{port}: {type(exc).__name__} {exc}".strip()
                    with contextlib.suppress(*ETCD_ERRORS):
                        await client.close()
                    self._endpoint_index = (self._endpoint_index + 1) % len(self._endpoints)
                    continue
                self._client = client
                return
            if time.monotonic() >= deadline:
                raise Unavailable(f"etcd unreachable ({last_error})")
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        """Stops keep-alives (without deregistering) and closes the client."""
        for reg in list(self._registrations.values()):
            await reg.cancel()
        self._registrations.clear()
        if self._client is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._client.close()
            self._client = None

    # ---- plain keys ----

    def key(self, *parts: str) -> str:
        """The absolute key for a path under the prefix: ("jobs", id, "spec") -> <prefix>/jobs/id/spec."""
        return "/".join((self.prefix, *parts))

    async def get(self, key: str) -> bytes | None:
        """The value of a key, or None."""
        result = await self.client.get(key.encode())
        return None if result is None else bytes(result.value)

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        """Every key under a prefix and the store revision the read saw."""
        result = await self.client.get_prefix(prefix.encode())
        values = {kv.key.decode(): bytes(kv.value) for kv in result}
        return values, int(result.header.revision)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Writes a key."""
        await self.client.put(key.encode(), value, lease=lease)

    async def delete(self, key: str) -> bool:
        """Deletes a key; True if it existed."""
        return bool(await self.client.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under a prefix."""
        await self.client.delete_prefix(prefix.encode())

    async def compare_and_swap(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Writes value only if the key holds expected (None = absent); True on success."""
        return await self.transact({key: expected}, {key: value})

    async def transact(self, expect: dict[str, bytes | None], puts: dict[str, bytes]) -> bool:
        """Writes every key in puts only if each key in expect holds its value (None = absent)."""
        tx = self.client.transactions
        compare = [
            tx.version(k.encode()) == 0 if v is None else tx.value(k.encode()) == v for k, v in expect.items()
        ]
        ops = [tx.put(k.encode(), v) for k, v in puts.items()]
        ok, _ = await self.client.transaction(compare=compare, success=ops, failure=[])
        return bool(ok)

    async def put_many(self, items: dict[str, bytes], deletes: tuple[str, ...] = ()) -> None:
        """Writes several keys (and deletes some) in one transaction."""
        tx = self.client.transactions
        ops: list[Any] = [tx.put(k.encode(), v) for k, v in items.items()]
        ops += [tx.delete(k.encode()) for k in deletes]
        await self.client.transaction(compare=[], success=ops, failure=[])

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[tuple[str, str, bytes]]:
        """Yields (kind "PUT"/"DELETE", key, value) from a revision on; raises on a broken stream."""
        watch = await self.client.watch_prefix(prefix.encode(), start_revision=start_revision)
        try:
            async for event in watch:
                yield str(event.kind), event.kv.key.decode(), bytes(event.kv.value)
        finally:
            with contextlib.suppress(*ETCD_ERRORS, RuntimeError):
                await watch.cancel()

    # ---- services ----

    def service_key(self, kind: str, service_id: str) -> str:
        """The registration key of a daemon."""
        return self.key("services", kind, service_id)

    async def register(self, record: ServiceRecord, ttl_s: int) -> None:
        """Registers a daemon under a TTL lease and keeps it alive (re-registering after loss)."""
        key = self.service_key(record.kind, record.service_id)
        reg = _Registration(self, key, record, ttl_s)
        await reg.establish()
        self._registrations[key] = reg
        reg.start()

    async def deregister(self, kind: str, service_id: str) -> None:
        """Stops the keep-alive, revokes the lease and deletes the key (best effort)."""
        key = self.service_key(kind, service_id)
        reg = self._registrations.pop(key, None)
        if reg is not None:
            await reg.cancel()
            await reg.revoke()
        with contextlib.suppress(*ETCD_ERRORS):
            await asyncio.wait_for(self.delete(key), timeout=self._request_timeout_s)

    async def list_services(self, kind: str = "") -> list[ServiceRecord]:
        """Registered daemons, optionally of one kind."""
        prefix = self.key("services", kind) + "/" if kind else self.key("services") + "/"
        values, _ = await self.get_prefix(prefix)
        return [ServiceRecord.from_json(v) for _, v in sorted(values.items())]

    async def first_address(self, kind: str) -> str:
        """The address of the first registered daemon of kind; raises Unavailable when there is none."""
        services = await self.list_services(kind)
        if not services:
            raise Unavailable(f"no {kind} registered in etcd at {self.prefix}")
        return services[0].address

    def directory(self, kind: str = "") -> ServiceDirectory:
        """A live, self-healing view of registered daemons (list + watch)."""
        return ServiceDirectory(self, kind)


class _Registration:
    """One registered key kept alive by refreshing its lease."""

    def __init__(self, registry: Registry, key: str, record: ServiceRecord, ttl_s: int) -> None:
        self._registry = registry
        self._key = key
        self._record = record
        self._ttl_s = ttl_s
        self._lease: Any = None
        self._task: asyncio.Task[None] | None = None

    async def establish(self) -> None:
        client = self._registry.client
        self._lease = await client.lease(self._ttl_s)
        await client.put(self._key.encode(), self._record.to_json(), lease=self._lease)
        log.info("registered %s (lease %x, ttl %ss)", self._key, self._lease.id, self._ttl_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name=f"keepalive {self._key}")

    async def _keep_alive(self) -> None:
        interval_s = max(0.5, self._ttl_s / 3)
        lost = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                if lost:
                    await asyncio.wait_for(self.establish(), timeout=interval_s * 2)
                    lost = False
                    continue
                reply = await asyncio.wait_for(self._registry.client.refresh_lease(self._lease.id), interval_s * 2)
                if reply is None or reply.TTL <= 0:
                    # etcd forgot the lease (it expired while we were cut off): register anew.
                    log.warning("lease of %s lost; re-registering", self._key)
                    lost = True
            except ETCD_ERRORS as exc:
                log.warning("keep-alive of %s failed (%s); retrying", self._key, type(exc).__name__)
                lost = lost or _lease_missing(exc)

    async def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def revoke(self) -> None:
        if self._lease is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await asyncio.wait_for(self._lease.revoke(), timeout=2.0)


def _lease_missing(exc: BaseException) -> bool:
    return "lease not found" in str(exc)


class ServiceDirectory:
    """A live map of service id -> record for one kind (or all), healed after etcd errors.

    Lists the prefix, then watches from the listed revision + 1; after any watch error it
    re-lists and re-watches, so an etcd restart costs only the time until etcd is back.
    """

    def __init__(self, registry: Registry, kind: str = "") -> None:
        self._registry = registry
        self._prefix = (registry.key("services", kind) if kind else registry.key("services")) + "/"
        self.services: dict[str, ServiceRecord] = {}
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[dict[str, ServiceRecord]], None]] = []
        self.resyncs = 0

    def on_change(self, callback: Callable[[dict[str, ServiceRecord]], None]) -> None:
        """Calls callback(snapshot) after every change (on the event loop)."""
        self._listeners.append(callback)

    def start(self) -> None:
        """Starts following etcd in the background."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"directory {self._prefix}")

    async def stop(self) -> None:
        """Stops following etcd."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_for(
        self, predicate: Callable[[dict[str, ServiceRecord]], bool], timeout_s: float
    ) -> dict[str, ServiceRecord]:
        """Waits until predicate(snapshot) holds; raises TimeoutError after timeout_s."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(dict(self.services))), timeout_s)
            return dict(self.services)

    async def _publish(self, services: dict[str, ServiceRecord]) -> None:
        async with self._changed:
            self.services = services
            self._changed.notify_all()
        for callback in self._listeners:
            callback(dict(services))

    async def _run(self) -> None:
        backoff_s = 0.1
        while True:
            try:
                values, revision = await self._registry.get_prefix(self._prefix)
                await self._publish(
                    {_service_id(k): ServiceRecord.from_json(v) for k, v in values.items()}
                )
                backoff_s = 0.1
                async for kind, key, value in self._registry.watch_prefix(self._prefix, revision + 1):
                    services = dict(self.services)
                    if kind == "PUT":
                        services[_service_id(key)] = ServiceRecord.from_json(value)
                    else:
                        services.pop(_service_id(key), None)
                    await self._publish(services)
                raise ConnectionError("watch stream ended")
            except asyncio.CancelledError:
                raise
            except _WATCH_ERRORS as exc:
                self.resyncs += 1
                log.info("service watch on %s broke (%s); re-listing", self._prefix, type(exc).__name__)
                await asyncio.sleep(backoff_s)
                backoff_s = min(2.0, backoff_s * 2)


def _service_id(key: str) -> str:
    return key.rsplit("/", 1)[-1]
