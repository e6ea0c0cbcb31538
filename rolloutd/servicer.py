"""gRPC adapter of rolloutd's own API (status and demand hints): decode, call the worker, encode."""

from __future__ import annotations

import grpc.aio

from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc
from rolloutd import serde
from rolloutd.worker import RolloutWorker


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """flexmarl.v1.Rollout."""

    def __init__(self, worker: RolloutWorker) -> None:
        self._worker = worker

    async def GetRolloutStatus(  # noqa: N802
        self, request: rollout_pb2.GetRolloutStatusRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RolloutStatus:
        """Replicas, their agents and load."""
        return serde.rollout_status(self._worker.status())

    async def SetAgentDemand(  # noqa: N802
        self, request: rollout_pb2.SetAgentDemandRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.SetAgentDemandResponse:
        """Demand hints for the inter-agent balancer."""
        self._worker.set_demand(serde.agent_demand(request))
        return rollout_pb2.SetAgentDemandResponse()
