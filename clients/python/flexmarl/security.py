"""Transport security: TLS (optionally mutual) on every gRPC channel and a bearer token.

Off unless configured: a :class:`TransportSecurity` with nothing set opens plaintext
channels and serves on an insecure port, exactly as before. With a CA bundle, clients
verify the server's certificate (and present their own when a cert/key pair is set);
with a cert/key pair, servers listen with TLS and, when asked to, require a client
certificate signed by the CA. With a token, clients send ``authorization: Bearer <token>``
on every call and servers answer UNAUTHENTICATED to any other call, except the health
and reflection services, which stay open for probes. The token is never logged.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from flexmarl.config import ConfigError, DaemonConfig

#: Services every client may call without a token (probes, tooling).
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
AUTHORIZATION = "authorization"


def _read(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None


def read_token(path: str, name: str = "auth_token_file") -> str:
    """The token in a file (surrounding whitespace stripped); raises ConfigError when unusable."""
    try:
        token = _read(name, path).decode().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: {path} is not UTF-8 text") from None
    if not token:
        raise ConfigError(f"{name}: {path} is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"{name}: {path} must hold one token without whitespace")
    return token


@dataclasses.dataclass(frozen=True)
class TransportSecurity:
    """PEM material and token for servers and channels; empty fields mean "off"."""

    ca_pem: bytes = b""
    cert_pem: bytes = b""
    key_pem: bytes = b""
    token: str = dataclasses.field(default="", repr=False)
    require_client_cert: bool = False

    @classmethod
    def from_files(
        cls,
        *,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        token: str = "",
        token_file: str = "",
        require_client_cert: bool = False,
    ) -> TransportSecurity:
        """Reads the named files; raises ConfigError (one line) when one is unusable."""
        if bool(tls_cert) != bool(tls_key):
            raise ConfigError("tls_cert/tls_key: give both or neither")
        if require_client_cert and not (tls_ca and tls_cert):
            raise ConfigError("tls_require_client_cert: needs tls_ca, tls_cert and tls_key")
        if token and token_file:
            raise ConfigError("token/token_file: give one, not both")
        return cls(
            ca_pem=_read("tls_ca", tls_ca) if tls_ca else b"",
            cert_pem=_read("tls_cert", tls_cert) if tls_cert else b"",
            key_pem=_read("tls_key", tls_key) if tls_key else b"",
            token=read_token(token_file, "token_file") if token_file else token.strip(),
            require_client_cert=require_client_cert,
        )

    @classmethod
    def from_config(cls, config: DaemonConfig) -> TransportSecurity:
        """A daemon's security settings (its cert/key double as its client certificate)."""
        security = cls.from_files(
            tls_ca=config.tls_ca, tls_cert=config.tls_cert, tls_key=config.tls_key,
            require_client_cert=config.tls_require_client_cert,
        )
        if config.auth_token_file:
            security = dataclasses.replace(security, token=read_token(config.auth_token_file))
        return security

    @property
    def client_tls(self) -> bool:
        """Whether channels use TLS (a CA to verify servers with is configured)."""
        return bool(self.ca_pem)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for a server port, or None to serve plaintext."""
        if not self.cert_pem:
            return None
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)],
            root_certificates=self.ca_pem or None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS (+ token) credentials for a channel, or None for a plaintext channel."""
        if not self.client_tls:
            return None
        tls = grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem or None,
            certificate_chain=self.cert_pem or None,
        )
        if not self.token:
            return tls
        return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(self.token))


#: No TLS, no token: what every component uses unless configured otherwise.
INSECURE = TransportSecurity()


def open_channel(
    address: str, security: TransportSecurity | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to address: TLS when security has a CA, plaintext otherwise; the token on every call.

    Over plaintext a configured token still travels (as metadata added by an interceptor),
    so token-only setups work; it is then readable on the wire, which is why TLS is advised.
    """
    security = security or INSECURE
    credentials = security.channel_credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=list(options))
    interceptors = _token_interceptors(security.token) if security.token else None
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def _with_token(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*header)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._header), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._header), request)


class _TokenStreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self._header), request_iterator)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, header: tuple[str, str]) -> None:
        self._header = header

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self._header), request_iterator)


def _token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    header = (AUTHORIZATION, f"Bearer {token}")
    return [_TokenUnaryUnary(header), _TokenUnaryStream(header), _TokenStreamUnary(header),
            _TokenStreamStream(header)]


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers UNAUTHENTICATED to calls without ``authorization: Bearer <token>``.

    Health and reflection stay open. The comparison takes constant time, and neither the
    expected nor the presented token is ever logged or echoed in the status details.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a token")
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call's metadata carries the expected bearer token."""
        for key, value in metadata or ():
            if key.lower() == AUTHORIZATION:
                presented = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(presented, self._expected):
                    return True
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Passes authorized and open calls through; replaces the handler of the others."""
        service = handler_call_details.method.lstrip("/").rsplit("/", 1)[0]
        if service in OPEN_SERVICES or self.authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _refusing(handler)


_REFUSAL = "missing or invalid bearer token"


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as handler that aborts with UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
        yield  # pragma: no cover - abort raises; this makes the function an async generator

    # The request of an unauthenticated caller is never parsed.
    decode, encode = None, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, decode, encode)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, decode, encode)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, decode, encode)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, decode, encode)


__all__ = ["INSECURE", "OPEN_SERVICES", "TokenAuthInterceptor", "TransportSecurity", "open_channel", "read_token"]
