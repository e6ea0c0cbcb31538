"""The gRPC bootstrap in-process: error mapping, metrics, health, reflection."""

import asyncio

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from flexmarl.errors import InvalidArgument, NotFound
from flexmarl.metrics import RpcMetrics
from flexmarl.server import GrpcServer
from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = pytest.mark.timeout(30)


class _Servicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self) -> None:
        self.mode = "ok"

    async def GetRolloutStatus(self, request, context):  # noqa: N802
        if self.mode == "invalid":
            raise InvalidArgument("worker_id: must not be empty")
        if self.mode == "missing":
            raise NotFound("job j1 not found")
        if self.mode == "bug":
            raise ValueError("boom")
        return rollout_pb2.RolloutStatus(worker_id="w1")


@pytest.fixture
async def served():
    registry = CollectorRegistry()
    server = GrpcServer(("flexmarl.v1.Rollout",), 4 << 20, RpcMetrics("test", registry))
    servicer = _Servicer()
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server.server)
    port = server.bind("127.0.0.1", 0)
    await server.server.start()
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel, server, registry
    finally:
        await channel.close()
        await server.server.stop(0)


async def test_error_mapping(served) -> None:
    servicer, channel, _, registry = served
    stub = rollout_pb2_grpc.RolloutStub(channel)
    assert (await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())).worker_id == "w1"
    for mode, code, text in [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "worker_id: must not be empty"),
        ("missing", grpc.StatusCode.NOT_FOUND, "job j1 not found"),
        ("bug", grpc.StatusCode.INTERNAL, "internal error in GetRolloutStatus: ValueError"),
    ]:
        servicer.mode = mode
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert exc.value.code() == code
        assert exc.value.details() == text
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.SetAgentDemand(rollout_pb2.SetAgentDemandRequest())
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    text = generate_latest(registry).decode()
    assert 'flexmarl_test_rpc_requests_total{code="OK",method="GetRolloutStatus"} 1.0' in text
    assert 'flexmarl_test_rpc_requests_total{code="INVALID_ARGUMENT",method="GetRolloutStatus"} 1.0' in text
    assert 'flexmarl_test_rpc_requests_total{code="UNIMPLEMENTED",method="SetAgentDemand"} 1.0' in text


async def test_health_flips(served) -> None:
    _, channel, server, _ = served
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service="flexmarl.v1.Rollout"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await server.set_serving(False)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_message_limit_enforced(served) -> None:
    _, channel, _, _ = served
    stub = rollout_pb2_grpc.RolloutStub(channel)
    big = rollout_pb2.SetAgentDemandRequest(
        demand=[rollout_pb2.AgentDemand(job_id="x" * 1000, agent="a") for _ in range(5000)]
    )
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.SetAgentDemand(big)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_bind_conflict_is_oserror() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        server = GrpcServer((), 4 << 20)
        with pytest.raises(OSError, match="cannot bind"):
            server.bind("127.0.0.1", port)


@pytest.mark.parametrize("server_accepts_pings", [True, False])
async def test_an_idle_channel_s_keepalive_pings_do_not_get_it_cut(monkeypatch, server_accepts_pings) -> None:
    """Our channels ping while idle; our servers take those pings (the control: gRPC's default server cuts them).

    Scaled down: the channel pings every 0.5 s and the server takes a ping every 0.2 s (as 30 s and
    10 s in flexmarl.server). gRPC's default server takes one ping in 5 minutes and, after two
    strikes, sends GOAWAY too_many_pings; the channel then leaves READY.
    """
    import flexmarl.server as server_module

    monkeypatch.setattr(server_module, "KEEPALIVE_TIME_MS", 500)
    monkeypatch.setattr(server_module, "MIN_RECV_PING_INTERVAL_MS", 200)
    options = server_module.channel_options(4 << 20)
    if not server_accepts_pings:
        options = [o for o in options if o[0] != "grpc.http2.min_ping_interval_without_data_ms"]
    server = grpc.aio.server(options=options)
    rollout_pb2_grpc.add_RolloutServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    try:
        await rollout_pb2_grpc.RolloutStub(channel).GetRolloutStatus(rollout_pb2.GetRolloutStatusRequest())
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        try:  # idle: only keepalive pings cross; 4 s is 8 of them
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 4.0)
            cut = True
        except TimeoutError:
            cut = False
        assert cut is not server_accepts_pings
    finally:
        await channel.close()
        await server.stop(0)
