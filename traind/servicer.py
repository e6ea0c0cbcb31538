"""gRPC adapter of traind's own API (status; swaps are work pulled from orchestratord)."""

from __future__ import annotations

import grpc.aio

from flexmarl.v1 import train_pb2, train_pb2_grpc
from traind import serde
from traind.worker import TrainerWorker


class TrainerServicer(train_pb2_grpc.TrainerServicer):
    """flexmarl.v1.Trainer."""

    def __init__(self, worker: TrainerWorker) -> None:
        self._worker = worker

    async def GetTrainerStatus(  # noqa: N802
        self, request: train_pb2.GetTrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> train_pb2.TrainerStatus:
        """Slots and the agents resident in them."""
        return serde.trainer_status(self._worker.settings.worker_id, self._worker.status())
