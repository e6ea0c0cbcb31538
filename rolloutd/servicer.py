"""gRPC adapter of rolloutd's own API (status and demand hints)."""

from __future__ import annotations

from typing import Any

from flexmarl.errors import InvalidArgument
from flexmarl.v1 import rollout_pb2, rollout_pb2_grpc
from rolloutd.router import agent_key
from rolloutd.worker import RolloutWorker

MAX_DEMAND_ENTRIES = 4096


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """flexmarl.v1.Rollout."""

    def __init__(self, worker: RolloutWorker) -> None:
        self._worker = worker

    async def GetRolloutStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Replicas, their agents and load."""
        router = self._worker.router
        replicas = []
        if router is not None:
            balancer = router.balancer()
            views = {v.replica_id: v for v in balancer.replicas()} if balancer is not None else {}
            for replica in router.replicas():
                view = views.get(replica.replica_id)
                replicas.append(rollout_pb2.ReplicaStatus(
                    replica_id=replica.replica_id, url=replica.client.url,
                    agents=[view.model_key] if view is not None else [],
                    healthy=replica.healthy,
                    outstanding_tokens=view.outstanding_tokens if view is not None else 0,
                    in_flight_requests=view.in_flight_requests if view is not None else 0,
                    backend=self._worker.settings.engine_backend,
                ))
        status = self._worker.status()
        return rollout_pb2.RolloutStatus(
            worker_id=self._worker.settings.worker_id, replicas=replicas,
            tasks_in_flight=status["tasks_in_flight"], episodes_done=status["episodes_done"],
            reassignments=router.reassignments if router is not None else 0,
        )

    async def SetAgentDemand(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Demand hints for the inter-agent balancer."""
        if len(request.demand) > MAX_DEMAND_ENTRIES:
            raise InvalidArgument(f"demand: more than {MAX_DEMAND_ENTRIES} entries")
        for entry in request.demand:
            if not entry.job_id or not entry.agent:
                raise InvalidArgument("demand: job_id and agent must not be empty")
        router = self._worker.router
        if router is not None:
            for entry in request.demand:
                router.set_demand_hint(agent_key(entry.job_id, entry.agent), entry.tokens)
        return rollout_pb2.SetAgentDemandResponse()
