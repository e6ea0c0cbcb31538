"""The one module that talks to etcd: service registration, discovery and job-state keys.

Built on ``aetcd`` (the maintained asyncio client). The ``etcd3`` package does not
import with protobuf >= 4, so it is not an option.

Keys live under a configurable prefix (default ``/flexmarl``):
``services/<kind>/<id>`` holds a JSON :class:`ServiceRecord` attached to the
daemon's TTL lease, so a daemon that dies disappears within its TTL.

etcd's own security (:class:`EtcdSecurity`): aetcd 1.0 only opens plaintext channels
and authenticates once per connection, so :class:`_EtcdClient` opens the channel itself
(TLS with a CA and optionally a client certificate) and sends the auth token through an
interceptor that authenticates again when etcd forgets the token (an etcd restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import aetcd.watcher
import grpc
import grpc.aio

from flexmarl.config import ConfigError, DaemonConfig, etcd_endpoints
from flexmarl.errors import ResourceExhausted, Unavailable
from flexmarl.retry import Backoff, RetryPolicy, retry

log = logging.getLogger(__name__)

#: Errors that mean "etcd is not reachable right now" (retry later).
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)

#: Keys per request of a paged range read (:meth:`Registry.get_prefix`). State under a prefix grows
#: with a job's history (manifests, commits, per-step records), and one unpaged read of it hit gRPC's
#: 4 MiB receive limit after a few hundred steps: orchestratord could no longer restart.
RANGE_PAGE_KEYS = 256


def prefix_range_end(prefix: str) -> str:
    """The first key after every key that starts with ``prefix`` (etcd's range end of a prefix)."""
    return str(aetcd.utils.prefix_range_end(prefix.encode()).decode())


class EtcdRangeTooLarge(ResourceExhausted):
    """One etcd key's value is larger than a client may receive (a read that cannot be split further)."""


#: Errors after which a watch re-lists (etcd errors and records it cannot parse).
_WATCH_ERRORS: tuple[type[BaseException], ...] = (*ETCD_ERRORS, ValueError, KeyError)


#: etcd's answers to a bad user/password, a missing user or a missing permission (do not retry).
_AUTH_REJECTIONS = ("authentication failed", "user name is empty", "permission denied", "user name not found")


def _read_file(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How to reach etcd: TLS material and the user to authenticate as; empty fields mean off."""

    ca_pem: bytes = b""
    cert_pem: bytes = b""
    key_pem: bytes = b""
    username: str = ""
    password: str = dataclasses.field(default="", repr=False)
    #: The name every member's certificate is checked against ("": the host of the endpoint dialled;
    #: over several members, the first endpoint's host). Several members over TLS share one channel,
    #: so each member's certificate must carry this name (a SAN the members share).
    server_name: str = ""

    @classmethod
    def from_files(
        cls, *, ca: str = "", cert: str = "", key: str = "", username: str = "", password_file: str = "",
        server_name: str = "",
    ) -> EtcdSecurity:
        """Reads the named files; raises ConfigError (one line naming the setting) when one is unusable."""
        if bool(cert) != bool(key):
            raise ConfigError("etcd_cert/etcd_key: give both or neither")
        if cert and not ca:
            raise ConfigError("etcd_cert: needs etcd_ca (the CA that signed etcd's certificate)")
        if bool(username) != bool(password_file):
            raise ConfigError("etcd_username/etcd_password_file: give both or neither")
        if server_name and not ca:
            raise ConfigError("etcd_server_name: needs etcd_ca (the name is checked only over TLS)")
        password = ""
        if password_file:
            try:
                password = _read_file("etcd_password_file", password_file).decode().rstrip("\r\n")
            except UnicodeDecodeError:
                raise ConfigError(f"etcd_password_file: {password_file} is not UTF-8 text") from None
            if not password:
                raise ConfigError(f"etcd_password_file: {password_file} is empty")
        return cls(
            ca_pem=_read_file("etcd_ca", ca) if ca else b"",
            cert_pem=_read_file("etcd_cert", cert) if cert else b"",
            key_pem=_read_file("etcd_key", key) if key else b"",
            username=username,
            password=password,
            server_name=server_name,
        )

    @classmethod
    def from_config(cls, config: DaemonConfig) -> EtcdSecurity:
        """The etcd settings of a daemon config; raises ConfigError when a file is unusable."""
        return cls.from_files(ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key,
                              username=config.etcd_username, password_file=config.etcd_password_file,
                              server_name=config.etcd_server_name)

    @property
    def tls(self) -> bool:
        """Whether channels to etcd use TLS."""
        return bool(self.ca_pem)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for a channel to etcd, or None for plaintext."""
        if not self.ca_pem:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem or None, certificate_chain=self.cert_pem or None
        )


PLAINTEXT_ETCD = EtcdSecurity()


class _EtcdToken:
    """etcd's auth token of one client: fetched on first use and again when etcd forgets it."""

    def __init__(self, channel: grpc.aio.Channel, username: str, password: str, timeout_s: float | None) -> None:
        self._auth = aetcd.rpc.AuthStub(channel)
        self._username = username
        self._password = password
        self._timeout_s = timeout_s
        self._token = ""
        self._lock = asyncio.Lock()

    async def current(self, stale: str = "") -> str:
        """The token; authenticates when there is none yet or it is ``stale``."""
        async with self._lock:
            if not self._token or self._token == stale:
                reply = await self._auth.Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout_s,
                )
                self._token = str(reply.token)
            return self._token

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """One interceptor per call type (grpc.aio files each interceptor under one type only)."""
        return [_TokenUnaryUnary(self), _TokenUnaryStream(self), _TokenStreamStream(self)]


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata["token"] = token
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Sends the token; on UNAUTHENTICATED ("invalid auth token") authenticates again and retries once."""

    def __init__(self, token: _EtcdToken) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        token = await self._token.current()
        call = await continuation(_with_token(client_call_details, token), request)
        if await call.code() is not grpc.StatusCode.UNAUTHENTICATED:
            return call
        log.info("etcd rejected the auth token (%s); authenticating again", await call.details())
        token = await self._token.current(stale=token)
        return await continuation(_with_token(client_call_details, token), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends the token (a rejected stream fails; the next unary call renews the token)."""

    def __init__(self, token: _EtcdToken) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, await self._token.current()), request)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Sends the token on watch and lease keep-alive streams."""

    def __init__(self, token: _EtcdToken) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(client_call_details, await self._token.current()), request_iterator)


class _EtcdClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over a channel this module opens: TLS and token auth as configured.

    aetcd 1.0 (the only release) has no TLS and authenticates once per connection, so
    :meth:`connect` builds the channel, the stubs and the watcher itself. Without TLS and
    without a user it defers to aetcd unchanged.
    """

    def __init__(self, host: str, port: int, security: EtcdSecurity, timeout: int, *, target: str = "") -> None:
        super().__init__(host=host, port=port, timeout=timeout)
        self._security = security
        self._auth_channel: grpc.aio.Channel | None = None
        #: A gRPC target naming several members ("ipv4:a:p,b:q"): one channel that moves to another
        #: member when its own goes away (gRPC's pick_first over the list), as etcd's Go client does.
        self._target = target
        #: The name the members' certificates are checked against over TLS: the configured one, else
        #: the host dialled (``host``: the first member's when ``target`` names several).
        self._server_name = security.server_name or (host if target and security.tls else "")

    def _custom(self) -> bool:
        return self._security.tls or bool(self._security.username) or bool(self._target)

    async def connect(self) -> None:
        """Opens the channel (no I/O: grpc connects on the first call)."""
        if not self._custom():
            await super().connect()
            return
        if self._connected.is_set():
            return
        target = self._target or f"{self._host}:{self._port}"
        credentials = self._security.channel_credentials()
        interceptors: list[grpc.aio.ClientInterceptor] = []
        if self._security.username:
            self._auth_channel = _open_channel(target, credentials, [], self._server_name)
            token = _EtcdToken(self._auth_channel, self._security.username, self._security.password, self._timeout)
            interceptors = token.interceptors()
        self.channel = _open_channel(target, credentials, interceptors, self._server_name)
        self.metadata = None  # the interceptor adds the token
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout)
        self._connected.set()

    async def range_page(self, start: bytes, end: bytes, *, limit: int, revision: int, keys_only: bool) -> Any:
        """One ``Range`` call with a key limit and a pinned revision (aetcd 1.0 exposes neither).

        A reply over the channel's receive limit raises :class:`_RangePageTooLarge`; every other
        gRPC error is mapped as aetcd maps it (so callers keep telling "unreachable" by ETCD_ERRORS).
        """
        await self.connect()
        request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=limit, revision=revision,
                                         keys_only=keys_only)
        try:
            return await self.kvstub.Range(request, timeout=self._timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise _RangePageTooLarge(str(exc.details())) from None
            aetcd.exceptions._handle_exception(exc)
            raise

    async def member_status(self) -> Any:
        """The responding member's ``Status`` reply, with ``dbSizeInUse`` (aetcd's status() drops it)."""
        await self.connect()
        try:
            return await self.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=self._timeout,
                                                     metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
            raise

    async def defragment_member(self, timeout_s: float) -> None:
        """Defragments the responding member's database (it blocks that member while it runs)."""
        await self.connect()
        try:
            await self.maintenancestub.Defragment(aetcd.rpc.DefragmentRequest(), timeout=timeout_s,
                                                  metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
            raise

    async def close(self) -> None:
        """Closes the channels."""
        await super().close()
        if self._auth_channel is not None:
            await self._auth_channel.close()
            self._auth_channel = None


#: Reconnection back-off of the channels to etcd: a member that comes back (a restart, quorum
#: regained) is tried again within 2 s, not after gRPC's default of up to 120 s.
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000))


def _open_channel(
    target: str, credentials: grpc.ChannelCredentials | None, interceptors: list[grpc.aio.ClientInterceptor],
    server_name: str = "",
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS, interceptors=interceptors or None)
    # The TLS host check uses the target's authority; a target over several members ("ipv4:...", resolved
    # addresses) has none that names them, so the name is given (and sent as SNI) explicitly.
    options = (*_CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", server_name)) if server_name else _CHANNEL_OPTIONS
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors or None)


def _members_target(endpoints: list[tuple[str, int]]) -> str:
    """One gRPC target naming every member by IPv4 address ("" when one does not resolve to one)."""
    addresses = []
    for host, port in endpoints:
        try:
            info = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            return ""
        addresses.append(f"{info[0][4][0]}:{port}")
    return "ipv4:" + ",".join(addresses)


def _rejected_credentials(exc: BaseException) -> bool:
    """Whether an etcd error means "wrong or missing credentials" (not worth retrying)."""
    text = str(exc).lower()
    return isinstance(exc, aetcd.exceptions.UnauthenticatedError) or any(m in text for m in _AUTH_REJECTIONS)


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


@dataclasses.dataclass(frozen=True)
class EtcdMemberStatus:
    """One etcd member's database: its file size and the part of it live keys and revisions use."""

    endpoint: str
    db_bytes: int
    db_in_use_bytes: int

    @property
    def free_bytes(self) -> int:
        """Pages compaction freed that only a defragmentation returns to the file system."""
        return max(0, self.db_bytes - self.db_in_use_bytes)


class Registry:
    """A connection to etcd with the key layout of FlexMARL."""

    def __init__(
        self,
        endpoints: str,
        prefix: str = "/flexmarl",
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 5.0,
        security: EtcdSecurity = PLAINTEXT_ETCD,
    ) -> None:
        self._endpoints = etcd_endpoints(endpoints)
        self.prefix = prefix
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._security = security
        self._client: aetcd.Client | None = None
        self._endpoint_index = 0
        self._registrations: dict[str, _Registration] = {}

    @classmethod
    def from_config(cls, config: DaemonConfig) -> Registry:
        """A registry with a daemon's etcd settings; raises ConfigError when a TLS/password file is unusable."""
        return cls(config.etcd_endpoints, config.etcd_prefix, connect_timeout_s=config.etcd_connect_timeout_s,
                   security=EtcdSecurity.from_config(config))

    # ---- connection ----

    @property
    def client(self) -> aetcd.Client:
        """The live aetcd client; raises Unavailable before connect()."""
        if self._client is None:
            raise Unavailable("etcd: not connected")
        return self._client

    async def connect(self) -> None:
        """Connects to the first reachable endpoint; raises Unavailable when none answers in time.

        The probe reads a key under the prefix, so missing or wrong credentials of an etcd with
        auth enabled fail here at once ("etcd rejected the credentials"), without retrying.
        """
        policy = RetryPolicy(initial_s=0.2, max_s=0.2, deadline_s=max(0.0, self._connect_timeout_s))
        try:
            self._client = await retry(self._connect_once, retryable=_is_unreachable, policy=policy)
        except _EtcdUnreachable as exc:
            raise Unavailable(f"etcd unreachable ({exc})") from None

    async def _connect_once(self) -> _EtcdClient:
        """One probe of every endpoint, from the last good one; raises _EtcdUnreachable when none answers.

        Several members share one channel over all of them (:func:`_members_target`), which follows
        the cluster when the member it uses dies; over TLS every member's certificate is checked
        against one name (``EtcdSecurity.server_name``, else the first endpoint's host), so a member
        whose certificate lacks it is skipped as unreachable.
        """
        last_error = ""
        target = _members_target(self._endpoints) if len(self._endpoints) > 1 else ""
        for _ in range(1 if target else len(self._endpoints)):
            # Over several members the channel names them all; the host given is the first endpoint's,
            # always (over TLS it is the name the certificates are checked against by default).
            host, port = self._endpoints[0 if target else self._endpoint_index]
            client = _EtcdClient(host, port, self._security, timeout=int(max(1, self._request_timeout_s)),
                                 target=target)
            try:
                await asyncio.wait_for(client.get(self.key("services").encode()),
                                       timeout=max(0.2, min(2.0, self._connect_timeout_s)))
            except ETCD_ERRORS as exc:
                last_error = f"{host}:{port}: {type(exc).__name__} {exc}".strip()
                with contextlib.suppress(*ETCD_ERRORS):
                    await client.close()
                if _rejected_credentials(exc):
                    user = f"user {self._security.username!r}" if self._security.username else "no user"
                    raise Unavailable(f"etcd rejected the credentials ({user}): {last_error}") from None
                self._endpoint_index = (self._endpoint_index + 1) % len(self._endpoints)
                continue
            return client
        raise _EtcdUnreachable(last_error)

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

    async def get_prefix(self, prefix: str, *, start: str = "", limit: int = 0) -> tuple[dict[str, bytes], int]:
        """Every key under a prefix (in key order) and the store revision the read saw.

        Read in pages of at most :data:`RANGE_PAGE_KEYS` keys, every page at the first page's
        revision, so the result is one consistent snapshot however much it holds. A page whose reply
        is over the receive limit is read again in halves; a single value over the limit raises
        :class:`EtcdRangeTooLarge` naming the key (never retried as "unavailable"). ``start`` (a key
        under the prefix) skips the keys before it; ``limit`` > 0 stops after that many keys.
        """
        values: dict[str, bytes] = {}
        revision = 0
        async for kvs, page_revision in self._paged_range(prefix, keys_only=False, start=start, limit=limit):
            values.update((kv.key.decode(), bytes(kv.value)) for kv in kvs)
            revision = page_revision
        return values, revision

    async def list_keys(self, prefix: str, *, start: str = "", limit: int = 0) -> list[str]:
        """The keys under a prefix in key order (values are not read), paged like :meth:`get_prefix`.

        ``start`` (a key under the prefix) skips the keys before it; ``limit`` > 0 stops after that
        many keys.
        """
        keys: list[str] = []
        async for kvs, _ in self._paged_range(prefix, keys_only=True, start=start, limit=limit):
            keys.extend(kv.key.decode() for kv in kvs)
        return keys

    async def _paged_range(
        self, prefix: str, *, keys_only: bool, start: str = "", limit: int = 0
    ) -> AsyncIterator[tuple[Any, int]]:
        """Yields (key-values of one page, the snapshot's revision) until the prefix is read."""
        client = self.client
        if not isinstance(client, _EtcdClient):
            raise Unavailable("etcd: not connected through the registry")
        first = (start or prefix).encode()
        end = aetcd.utils.prefix_range_end(prefix.encode())
        revision, page_keys, read = 0, RANGE_PAGE_KEYS, 0
        while True:
            if limit > 0:
                page_keys = min(page_keys, limit - read)
            try:
                reply = await client.range_page(first, end, limit=page_keys, revision=revision, keys_only=keys_only)
            except _RangePageTooLarge as exc:
                if page_keys == 1:
                    raise EtcdRangeTooLarge(
                        f"etcd: the value of the key at {first.decode(errors='replace')!r} is larger than "
                        f"this client may receive ({exc})") from None
                page_keys = max(1, page_keys // 2)
                continue
            revision = revision or int(reply.header.revision)
            kvs = list(reply.kvs)
            read += len(kvs)
            yield kvs, revision
            if not reply.more or not kvs or (limit > 0 and read >= limit):
                return
            first = bytes(kvs[-1].key) + b"\0"
            page_keys = RANGE_PAGE_KEYS

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

    async def delete_many(self, keys: Sequence[str], ranges: Sequence[tuple[str, str]] = ()) -> None:
        """Deletes keys and key ranges ``[start, end)`` in one transaction (keys that are absent are no error).

        etcd refuses a transaction of more than 128 operations (``--max-txn-ops``): callers batch.
        """
        tx = self.client.transactions
        ops: list[Any] = [tx.delete(k.encode()) for k in keys]
        ops += [tx.delete(start.encode(), end.encode()) for start, end in ranges]
        if ops:
            await self.client.transaction(compare=[], success=ops, failure=[])

    # ---- maintenance ----

    def _member_client(self, host: str, port: int) -> _EtcdClient:
        return _EtcdClient(host, port, self._security, timeout=int(max(1, self._request_timeout_s)))

    async def member_statuses(self) -> list[EtcdMemberStatus]:
        """The database size of every configured member that answers (one connection each)."""
        out: list[EtcdMemberStatus] = []
        for host, port in self._endpoints:
            client = self._member_client(host, port)
            try:
                reply = await client.member_status()
            except ETCD_ERRORS as exc:
                log.debug("etcd member %s:%s did not answer a status request: %s", host, port, exc)
                continue
            finally:
                with contextlib.suppress(*ETCD_ERRORS):
                    await client.close()
            out.append(EtcdMemberStatus(f"{host}:{port}", int(reply.dbSize), int(reply.dbSizeInUse)))
        return out

    async def defragment(self, endpoint: str, timeout_s: float = 120.0) -> None:
        """Defragments one member (``host:port``, one of the configured endpoints)."""
        host, _, port = endpoint.rpartition(":")
        client = self._member_client(host, int(port))
        try:
            await client.defragment_member(timeout_s)
        finally:
            with contextlib.suppress(*ETCD_ERRORS):
                await client.close()

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
        backoff = Backoff(initial_s=0.1, max_s=2.0)
        while True:
            try:
                values, revision = await self._registry.get_prefix(self._prefix)
                await self._publish(
                    {_service_id(k): ServiceRecord.from_json(v) for k, v in values.items()}
                )
                backoff.reset()
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
                await backoff.sleep()


class _RangePageTooLarge(Exception):
    """One page of a range read is over the channel's receive limit (read it again in smaller pages)."""


class _EtcdUnreachable(Exception):
    """No endpoint answered one round of probes (the message is the last endpoint's error)."""


def _is_unreachable(exc: BaseException) -> bool:
    return isinstance(exc, _EtcdUnreachable)


def _service_id(key: str) -> str:
    return key.rsplit("/", 1)[-1]
