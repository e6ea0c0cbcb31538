"""PeerConnections: dropping a channel never cancels the calls other coroutines still have on it."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from flexmarl.connections import PeerConnections, cancelled_from_outside
from flexmarl.v1 import orchestrator_pb2


async def _slow_get_job(request: orchestrator_pb2.GetJobRequest, context: Any) -> orchestrator_pb2.JobStatus:
    await asyncio.sleep(0.5)
    return orchestrator_pb2.JobStatus(job_id=request.job_id)


async def _server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flexmarl.v1.Orchestrator", {
        "GetJob": grpc.unary_unary_rpc_method_handler(
            _slow_get_job, request_deserializer=orchestrator_pb2.GetJobRequest.FromString,
            response_serializer=orchestrator_pb2.JobStatus.SerializeToString),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.timeout(30)
async def test_a_reset_lets_calls_in_flight_finish() -> None:
    server, address = await _server()
    registry: Any = None  # never asked: the address is configured
    peers = PeerConnections(registry, orchestrator_address=address, store_address="", max_message_bytes=1 << 20)
    try:
        stub = await peers.orchestrator()
        async def get_job() -> orchestrator_pb2.JobStatus:
            return await stub.GetJob(orchestrator_pb2.GetJobRequest(job_id="j"), timeout=10)

        call = asyncio.create_task(get_job())
        await asyncio.sleep(0.1)  # the call is in flight
        await peers.reset_orchestrator()  # another coroutine saw a failure and drops the channel
        assert (await call).job_id == "j"  # once, grpc.aio raised CancelledError here
        fresh = await peers.orchestrator()
        assert fresh is not stub
        assert (await fresh.GetJob(orchestrator_pb2.GetJobRequest(job_id="k"), timeout=10)).job_id == "k"
    finally:
        await peers.close()
        await server.stop(0)


@pytest.mark.timeout(30)
async def test_cancelled_from_outside_tells_own_cancellation_from_a_cancelled_call() -> None:
    seen: list[bool] = []

    async def raises_cancelled() -> None:
        try:
            raise asyncio.CancelledError  # what a call on a closed channel raises
        except asyncio.CancelledError:
            seen.append(cancelled_from_outside())

    async def cancelled_while_sleeping() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(cancelled_from_outside())
            raise

    await asyncio.create_task(raises_cancelled())
    task = asyncio.create_task(cancelled_while_sleeping())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False, True]
