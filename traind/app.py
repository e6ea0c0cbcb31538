"""Wires traind's worker and servicer into the shared daemon lifecycle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc.aio

from flexmarl.connections import PeerConnections
from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.v1 import train_pb2_grpc
from traind.config import TrainerConfig
from traind.distributed import reserve_port
from traind.link import GrpcOrchestratorLink, GrpcStoreLink
from traind.metrics import TrainerMetrics
from traind.servicer import TrainerServicer
from traind.worker import TrainerSettings, TrainerWorker


def data_parallel_address(config: TrainerConfig) -> str:
    """The rendezvous ``host:port`` this process advertises, or "" when it cannot join a group.

    Only a process with exactly one slot joins (DeepSpeed uses one default process group
    per process) and only when its committed states are durable (``mem`` states would be
    in one member's memory only, and saving an engine of a group outside a step is collective).
    """
    if config.slots != 1 or config.state_location == "mem" or not config.dp_host:
        return ""
    return f"{config.dp_host}:{reserve_port(config.dp_host)}"


class TrainerApp(DaemonApp):
    """traind: training slots behind the Trainer service."""

    service_names = ("flexmarl.v1.Trainer",)

    def __init__(self, config: TrainerConfig, ctx: DaemonContext) -> None:
        self.config = config
        settings = TrainerSettings(
            worker_id=ctx.service_id, slots=config.slots, work_dir=Path(config.work_dir).resolve(),
            state_location=config.state_location, publish_location=config.publish_location,
            dp_address=data_parallel_address(config), slot_local_ranks=config.slot_local_ranks(),
            device_profile=config.device_profile(), slot_capacities=config.slot_capacities(),
            slot_profiles=config.slot_profiles(),
        )
        self._peers = PeerConnections(ctx.registry, orchestrator_address=config.orchestrator_address,
                                      store_address=config.store_address,
                                      max_message_bytes=config.max_message_bytes, security=ctx.security)
        self.worker = TrainerWorker(settings, TrainerMetrics(ctx.metrics),
                                    GrpcOrchestratorLink(self._peers, ctx.service_id), GrpcStoreLink(self._peers))

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Trainer service."""
        train_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(self.worker), server)

    async def start(self) -> None:
        """Starts the slot loops."""
        await self.worker.start()

    async def stop(self) -> None:
        """Stops the slots, then closes the connections to orchestratord and stored."""
        await self.worker.stop()
        await self._peers.close()

    def registration_info(self) -> dict[str, Any]:
        """Advertises the slots."""
        return {"slots": [s.slot_id for s in self.worker.slots], "device": self.worker.device,
                "memory_bytes_per_slot": self.worker.memory_bytes_per_slot,
                "slot_capacities": [s.capacity for s in self.worker.slots],
                "slot_local_ranks": [s.local_rank for s in self.worker.slots if s.local_rank is not None]}


def build_app(config: TrainerConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return TrainerApp(config, ctx)
