"""Wires traind's servicer into the shared daemon lifecycle."""

from __future__ import annotations

import grpc.aio

from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.v1 import train_pb2_grpc
from traind.config import TrainerConfig


class TrainerApp(DaemonApp):
    """traind: RPCs not built yet answer UNIMPLEMENTED."""

    service_names = ("flexmarl.v1.Trainer",)

    def __init__(self, config: TrainerConfig, ctx: DaemonContext) -> None:
        self.config = config
        self.ctx = ctx

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Trainer service."""
        train_pb2_grpc.add_TrainerServicer_to_server(train_pb2_grpc.TrainerServicer(), server)  # type: ignore[abstract]


def build_app(config: TrainerConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return TrainerApp(config, ctx)
