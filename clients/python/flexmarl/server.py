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

from flexmarl.errors import FlexmarlError
from flexmarl.metrics import RpcMetrics

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for servers and channels: explicit message limits and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps domain errors to status codes and records per-method metrics.

    A :class:`FlexmarlError` becomes its status code with the message as details; an
    unexpected exception is logged with its traceback and becomes INTERNAL, so no bad
    request can take a daemon down.
    """

    def __init__(self, metrics: RpcMetrics | None) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wraps the method's handler with error mapping and metrics."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, handler.stream_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(method, handler.stream_stream),
            handler.request_deserializer,
            handler.response_serializer,
        )

    def _record(self, method: str, code: grpc.StatusCode, start: float) -> None:
        if self._metrics is not None:
            self._metrics.requests.labels(method, code.name).inc()
            self._metrics.seconds.labels(method).observe(time.perf_counter() - start)

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
        if isinstance(exc, FlexmarlError):
            code, details = exc.code, str(exc) or type(exc).__name__
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
    ) -> None:
        self.server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(metrics)],
            options=channel_options(max_message_bytes),
        )
        self._service_names = tuple(service_names)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.server,
        )

    def bind(self, host: str, port: int) -> int:
        """Binds host:port (0 = OS-chosen) and returns the port; raises OSError when it cannot."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
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
