"""gRPC server bootstrap: message-size limits, error mapping, RPC metrics, health, reflection."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from flexmarl.errors import FlexmarlError, InvalidArgument
from flexmarl.metrics import RpcMetrics
from flexmarl.security import INSECURE, TokenAuthInterceptor, TransportSecurity

log = logging.getLogger(__name__)


#: How often a channel pings its server (keepalive).
KEEPALIVE_TIME_MS = 30_000
#: The shortest gap between pings without data a server accepts (below KEEPALIVE_TIME_MS).
MIN_RECV_PING_INTERVAL_MS = 10_000


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for servers and channels: explicit message limits, keepalive, reconnect back-off.

    gRPC's default reconnect back-off grows to 120 s; after a partition heals, a client's retries
    would run out before its channel tried again. 5 s bounds how long a healed link stays unused.

    Keepalive: a channel pings every 30 s, idle or not. A server by default counts a ping that
    comes within 5 minutes of the last one, with no data between, as a strike and after two sends
    GOAWAY ``too_many_pings``: an idle channel (a traind whose slots are busy for minutes on a warm
    start) was cut and its next call failed. The server here takes a ping every 10 s.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Server side (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS); ignored by a channel.
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps domain errors to status codes and records per-method metrics.

    A :class:`FlexmarlError` becomes its status code with the message as details; an
    unexpected exception is logged with its traceback and becomes INTERNAL, so no bad
    request can take a daemon down.
    """

    def __init__(self, metrics: RpcMetrics | None) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wraps the method's handler with error mapping and metrics."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        # Generic handlers hand out the same handler object per method: wrap it once, not per RPC.
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler_call_details.method.rsplit("/", 1)[-1], handler)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        decode = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, _checked_request(method, handler.unary_unary)),
                decode,
                handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, _checked_stream(method, handler.stream_unary)),
                decode,
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, _checked_request(method, handler.unary_stream)),
                decode,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(method, _checked_stream(method, handler.stream_stream)),
            decode,
            handler.response_serializer,
        )

    def _record(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self._metrics is not None:
            self._metrics.observe(method, code.name, time.perf_counter() - start)

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        if isinstance(exc, FlexmarlError):
            code, details = exc.code, str(exc) or type(exc).__name__
            trailing = exc.trailing_metadata()  # the machine-readable reason, if any
            if trailing:
                await context.abort(code, details, trailing)
        elif isinstance(exc, NotImplementedError):
            code, details = grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented yet"
        else:
            log.exception("unexpected error in %s", method)
            code, details = grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}"
        await context.abort(code, details)
        raise AssertionError("unreachable")  # pragma: no cover - abort always raises

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
            except grpc.aio.AbortError:
                self._record(method, context.code() or grpc.StatusCode.UNKNOWN, start)
                raise
            except Exception as exc:
                self._record(method, _code_of(exc), start)
                await self._fail(method, exc, context)
            self._record(method, context.code() or grpc.StatusCode.OK, start)
            return result

        return wrapper

    def _wrap_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                async for item in result:
                    yield item
            except grpc.aio.AbortError:
                self._record(method, context.code() or grpc.StatusCode.UNKNOWN, start)
                raise
            except Exception as exc:
                self._record(method, _code_of(exc), start)
                await self._fail(method, exc, context)
            self._record(method, context.code() or grpc.StatusCode.OK, start)

        return wrapper


class _Undecodable:
    """Stands for request bytes that are not the method's message (answered INVALID_ARGUMENT)."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that turns undecodable bytes into _Undecodable instead of failing the call.

    grpc.aio answers a decode failure with UNKNOWN before any handler runs; passing a marker
    through lets the handler answer a clear INVALID_ARGUMENT.
    """
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return decode


def _invalid(method: str, item: _Undecodable) -> InvalidArgument:
    return InvalidArgument(f"request is not a valid {method} message ({item.error})")


def _checked_request(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            raise _invalid(method, request)
        return behavior(request, context)

    return call


def _checked_stream(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    def call(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        async def requests() -> AsyncIterator[Any]:
            async for item in request_iterator:
                if isinstance(item, _Undecodable):
                    raise _invalid(method, item)
                yield item

        return behavior(requests(), context)

    return call


def _code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, FlexmarlError):
        return exc.code
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


class GrpcServer:
    """A grpc.aio server with health and reflection for a set of services."""

    def __init__(
        self,
        service_names: Sequence[str],
        max_message_bytes: int,
        metrics: RpcMetrics | None = None,
        security: TransportSecurity = INSECURE,
    ) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if security.token:
            interceptors.append(TokenAuthInterceptor(security.token))
        interceptors.append(ErrorMappingInterceptor(metrics))
        self.server = grpc.aio.server(interceptors=interceptors, options=channel_options(max_message_bytes))
        self._credentials = security.server_credentials()
        self._service_names = tuple(service_names)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )

    def bind(self, host: str, port: int) -> int:
        """Binds host:port (0 = OS-chosen), with TLS when configured; returns the port or raises OSError."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if self._credentials is not None:
                bound = self.server.add_secure_port(address, self._credentials)
            else:
                bound = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind {address}: {exc}") from None
        if bound == 0:
            raise OSError(f"cannot bind {address}: address in use or not available")
        return int(bound)

    async def set_serving(self, serving: bool) -> None:
        """Flips the health status of every service (and the server as a whole)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self._service_names):
            await self.health.set(name, status)
