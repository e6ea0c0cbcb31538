"""Wires orchestratord's coordinator and servicer into the shared daemon lifecycle."""

from __future__ import annotations

import grpc.aio

from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.v1 import orchestrator_pb2_grpc
from orchestratord.config import OrchestratorConfig
from orchestratord.coordinator import JobCoordinator
from orchestratord.etcd_maintenance import DefragPolicy, EtcdDefragmenter
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.planner import PlannerOptions
from orchestratord.servicer import OrchestratorServicer


def planner_options(config: OrchestratorConfig) -> PlannerOptions:
    """The planner's options that orchestratord's settings set (the rest keep PlannerOptions' defaults)."""
    return PlannerOptions(swap_location=config.swap_location, capacity_aware_binding=config.capacity_aware_binding,
                          binding_version_lead=config.binding_version_lead, max_wait_s=config.binding_max_wait_s,
                          aging_per_s=config.binding_aging_per_s)


class OrchestratorApp(DaemonApp):
    """orchestratord: the planner behind the Orchestrator service."""

    service_names = ("flexmarl.v1.Orchestrator",)

    def __init__(self, config: OrchestratorConfig, ctx: DaemonContext) -> None:
        self.config = config
        self.coordinator = JobCoordinator(
            ctx.registry, OrchestratorMetrics(ctx.metrics), store_address=config.store_address,
            lease_poll_max_ms=config.lease_poll_max_ms,
            options=planner_options(config),
            security=ctx.security,
            max_message_bytes=config.max_message_bytes, history_page_steps=config.history_page_steps,
        )
        self.defragmenter = EtcdDefragmenter(ctx.registry, DefragPolicy(
            check_interval_s=config.etcd_defrag_check_s,
            min_free_bytes=int(config.etcd_defrag_min_free_mib * 2**20),
            min_interval_s=config.etcd_defrag_min_interval_s))

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Orchestrator service."""
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(OrchestratorServicer(self.coordinator), server)

    async def start(self) -> None:
        """Restores jobs from etcd and starts the planner loops."""
        await self.coordinator.start()
        self.defragmenter.start()

    async def stop(self) -> None:
        """Stops the loops."""
        await self.defragmenter.stop()
        await self.coordinator.stop()


def build_app(config: OrchestratorConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return OrchestratorApp(config, ctx)
