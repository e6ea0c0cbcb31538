"""Wires orchestratord's servicer into the shared daemon lifecycle."""

from __future__ import annotations

import grpc.aio

from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.v1 import orchestrator_pb2_grpc
from orchestratord.config import OrchestratorConfig


class OrchestratorApp(DaemonApp):
    """orchestratord: RPCs not built yet answer UNIMPLEMENTED."""

    service_names = ("flexmarl.v1.Orchestrator",)

    def __init__(self, config: OrchestratorConfig, ctx: DaemonContext) -> None:
        self.config = config
        self.ctx = ctx

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Orchestrator service."""
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(orchestrator_pb2_grpc.OrchestratorServicer(), server)  # type: ignore[abstract]


def build_app(config: OrchestratorConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return OrchestratorApp(config, ctx)
