"""The bearer token without TLS, in process: client interceptors add it, the server checks it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flexmarl.errors import FlexmarlError
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.server import GrpcServer
from flexmarl.store_client import await_client_stream
from flexmarl.v1 import store_pb2, store_pb2_grpc

TOKEN = "s3cret-token"


async def _codes(client: TransportSecurity) -> dict[str, grpc.StatusCode]:
    server = GrpcServer(["flexmarl.v1.Store"], 4 << 20, security=TransportSecurity(token=TOKEN))
    # The generated base servicer answers UNIMPLEMENTED: reaching it means the token was accepted.
    store_pb2_grpc.add_StoreServicer_to_server(store_pb2_grpc.StoreServicer(), server.server)
    port = server.bind("127.0.0.1", 0)
    await server.server.start()
    await server.set_serving(True)
    codes: dict[str, grpc.StatusCode] = {}
    try:
        async with open_channel(f"127.0.0.1:{port}", client) as channel:
            stub = store_pb2_grpc.StoreStub(channel)

            async def puts() -> AsyncIterator[store_pb2.PutBlobRequest]:
                yield store_pb2.PutBlobRequest(chunk=b"x")

            # The client stream through the SDK's await_client_stream, as every StoreClient put: grpcio's asyncio
            # client can lose the server's status of a client-streaming call it ends early (grpc/grpc#36066).
            calls = {
                "unary": lambda: stub.GetStats(store_pb2.GetStatsRequest(), timeout=5),
                "stream_unary": lambda: await_client_stream(stub.PutBlob(puts(), timeout=5)),
            }
            for name, call in calls.items():
                try:
                    await call()
                    codes[name] = grpc.StatusCode.OK
                except (grpc.aio.AioRpcError, FlexmarlError) as exc:
                    codes[name] = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else exc.code
            try:
                async for _ in stub.ReadExperiences(store_pb2.ReadExperiencesRequest(), timeout=5):
                    pass
                codes["unary_stream"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                codes["unary_stream"] = exc.code()
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.server.stop(0)
    return codes


def test_missing_token_is_unauthenticated() -> None:
    codes = asyncio.run(_codes(TransportSecurity()))
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes


def test_wrong_token_is_unauthenticated() -> None:
    codes = asyncio.run(_codes(TransportSecurity(token="other")))
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes


def test_right_token_reaches_the_servicer() -> None:
    codes = asyncio.run(_codes(TransportSecurity(token=TOKEN)))
    assert set(codes.values()) == {grpc.StatusCode.UNIMPLEMENTED}, codes
