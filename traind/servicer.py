"""gRPC adapter of traind's own API (status; swaps are work pulled from orchestratord)."""

from __future__ import annotations

from typing import Any

from flexmarl.v1 import train_pb2, train_pb2_grpc
from traind.worker import TrainerWorker


class TrainerServicer(train_pb2_grpc.TrainerServicer):
    """flexmarl.v1.Trainer."""

    def __init__(self, worker: TrainerWorker) -> None:
        self._worker = worker

    async def GetTrainerStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        """Slots and the agents resident in them."""
        return train_pb2.TrainerStatus(
            worker_id=self._worker.settings.worker_id,
            slots=[train_pb2.SlotStatus(slot_id=s["slot_id"], device=self._worker.device,
                                        memory_bytes=self._worker.memory_bytes_per_slot, resident=s["resident"],
                                        resident_version=s["version"], busy=s["busy"],
                                        busy_fraction=s["busy_fraction"], dp_group_id=s["dp_group_id"],
                                        dp_rank=s["dp_rank"], dp_world_size=s["dp_world_size"])
                  for s in self._worker.status()],
        )
