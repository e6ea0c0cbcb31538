"""Wires rolloutd's servicer into the shared daemon lifecycle."""

from __future__ import annotations

import grpc.aio

from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.v1 import rollout_pb2_grpc
from rolloutd.config import RolloutConfig


class RolloutApp(DaemonApp):
    """rolloutd: RPCs not built yet answer UNIMPLEMENTED."""

    service_names = ("flexmarl.v1.Rollout",)

    def __init__(self, config: RolloutConfig, ctx: DaemonContext) -> None:
        self.config = config
        self.ctx = ctx

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Rollout service."""
        rollout_pb2_grpc.add_RolloutServicer_to_server(rollout_pb2_grpc.RolloutServicer(), server)  # type: ignore[abstract]


def build_app(config: RolloutConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return RolloutApp(config, ctx)
