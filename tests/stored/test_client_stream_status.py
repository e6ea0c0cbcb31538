"""A client-streaming call that the server ends early reports the server's status, every time.

grpcio's asyncio client loses that status to INTERNAL "Internal error from Core" when a request
write fails after the server ended the call (grpc/grpc#36066): CI once saw a blob put without a
token fail so instead of with UNAUTHENTICATED. ``await_client_stream`` (used by every
``StoreClient`` blob put) reports the server's status. Many calls of many small messages make the
race frequent (without the helper, 1 to 6 calls in 100 lost it here).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from flexmarl.errors import ErrorReason, ResourceExhausted, Unauthenticated
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.server import GrpcServer
from flexmarl.store_client import await_client_stream

pytestmark = pytest.mark.timeout(120)

SERVICE = "flexmarl.test.Upload"
TOKEN = "s3cret-token"
CALLS = 1000
MESSAGES = 64


async def _read_all(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    count = 0
    async for _ in requests:
        count += 1
    return str(count).encode()


async def _full_after_one(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
    async for _ in requests:
        raise ResourceExhausted("upload quota exceeded", reason=ErrorReason.QUOTA_EXCEEDED)
    return b"0"


async def _calls(
    handler: object, client: TransportSecurity, server_security: TransportSecurity, calls: int = CALLS
) -> list[object]:
    """What ``calls`` uploads of MESSAGES small messages each end with (the reply or the error raised)."""
    server = GrpcServer([SERVICE], 1 << 20, security=server_security)
    handlers = {"Up": grpc.stream_unary_rpc_method_handler(handler)}
    server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.bind("127.0.0.1", 0)
    await server.server.start()
    outcomes: list[object] = []
    try:
        async with open_channel(f"127.0.0.1:{port}", client) as channel:
            up = channel.stream_unary(f"/{SERVICE}/Up", request_serializer=bytes, response_deserializer=bytes)

            async def requests() -> AsyncIterator[bytes]:
                for _ in range(MESSAGES):
                    yield b"chunk"

            for _ in range(calls):
                try:
                    outcomes.append(await await_client_stream(up(requests(), timeout=10)))
                except Exception as exc:  # noqa: BLE001 - the test records whatever each call raised
                    outcomes.append(exc)
    finally:
        await server.server.stop(0)
    return outcomes


async def test_a_refused_token_is_unauthenticated_on_every_long_upload() -> None:
    outcomes = await _calls(_read_all, TransportSecurity(), TransportSecurity(token=TOKEN))
    wrong = [o for o in outcomes if not isinstance(o, Unauthenticated)]
    assert not wrong, f"{len(wrong)} of {CALLS} uploads did not end UNAUTHENTICATED: {wrong[:3]}"


async def test_an_upload_the_server_ends_midway_keeps_its_code_and_reason() -> None:
    outcomes = await _calls(_full_after_one, TransportSecurity(), TransportSecurity())
    wrong = [o for o in outcomes if not (isinstance(o, ResourceExhausted) and o.reason is ErrorReason.QUOTA_EXCEEDED)]
    assert not wrong, f"{len(wrong)} of {CALLS} uploads lost the server's status: {wrong[:3]}"


async def test_an_authorized_upload_gets_its_reply() -> None:
    outcomes = await _calls(_read_all, TransportSecurity(token=TOKEN), TransportSecurity(token=TOKEN), calls=50)
    assert outcomes == [str(MESSAGES).encode()] * 50
