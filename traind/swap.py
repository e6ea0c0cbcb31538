"""Swapping an agent's engine out of a slot into a state location, and back in.

The checkpoint path works at every ZeRO stage (DESIGN §5). The engine is
destroyed on swap-out and rebuilt on swap-in, so the slot's memory is free in
between. LoRA agents (:mod:`traind.lora`) leave their frozen base in the slot's
:class:`traind.lora.LoraBaseCache`: their state, and what a swap moves, is the
adapter and its optimizer state. Locations (``mem://``, ``file://``, ``stored://``) are :mod:`traind.locations`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from traind.locations import StateLocation
from traind.lora import LoraBaseCache
from traind.model import AgentTrainer, AgentTrainerConfig
from traind.pacing import ModelledDeviceClock

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SwapStats:
    """One swap direction: bytes this rank moved and how long it took."""

    uri: str
    bytes_moved: int
    seconds: float


def swap_out(trainer: AgentTrainer, location: StateLocation) -> SwapStats:
    """Saves the agent's state to ``location`` and frees its engine."""
    started = time.perf_counter()
    moved = trainer.save_state(location)
    trainer.release()
    stats = SwapStats(location.uri, moved, time.perf_counter() - started)
    logger.info(
        "agent %s swapped out to %s: %d bytes in %.3f s", trainer.config.agent, location.uri, moved, stats.seconds
    )
    return stats


def swap_in(
    config: AgentTrainerConfig, location: StateLocation, device_clock: ModelledDeviceClock | None = None, *,
    lora_bases: LoraBaseCache | None = None,
) -> tuple[AgentTrainer, SwapStats]:
    """Builds the agent's engine (with ``device_clock``, see :class:`AgentTrainer`) and restores its state.

    A LoRA agent borrows the slot's base from ``lora_bases`` (read from disk only when the cache
    holds another one), so what moves is its adapter and optimizer state. Under modelled device
    time the move is charged to ``device_clock`` (:meth:`ModelledDeviceClock.swap_in`).
    """
    started = time.perf_counter()
    trainer = AgentTrainer(config, device_clock, lora_bases=lora_bases)
    try:
        moved = trainer.load_state(location)
    except BaseException:
        trainer.release()  # a LoRA agent's base goes back to the slot's cache
        raise
    if device_clock is not None:  # the state crossed the slot's link
        lora = config.lora
        device_clock.swap_in(started, lora.rank if lora is not None else 0,
                             tuple(lora.target_modules) if lora is not None else (), config.zero_stage)
    stats = SwapStats(location.uri, moved, time.perf_counter() - started)
    logger.info("agent %s swapped in from %s: %d bytes in %.3f s", config.agent, location.uri, moved, stats.seconds)
    return trainer, stats
