"""Which queued jobs join the embedded engine's running batch at a decode iteration (pure policy).

Mirrors SGLang 0.5.23's first-come-first-served admission (sglang/srt/managers/schedule_policy.py
``PrefillAdder`` under the ``fcfs`` policy, sglang/srt/managers/scheduler.py
``get_new_batch_prefill``): jobs join in arrival order while the running sequences stay within
the batch limit and, with a device model, their reserved KV tokens within the replica's KV
capacity; LoRA adapters past ``--max-loras-per-batch`` are skipped as scheduler.py
``can_schedule_lora_req`` skips them. :class:`rolloutd.engines.embedded.engine.EmbeddedEngine`
applies it; unit tested without a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flexmarl import devicemodel
from rolloutd.engines import lora
from rolloutd.engines.lora import AdapterPool


@dataclass(frozen=True)
class Demand:
    """What one queued job asks of the running batch: sequences and reserved KV-cache tokens."""

    sequences: int
    kv_tokens: float


@dataclass(frozen=True)
class BatchLimits:
    """What bounds a replica's running batch.

    Attributes:
        max_running: most sequences decoded together.
        kv_capacity_tokens: (modelled) KV-cache tokens the replica holds; ``math.inf`` = unbounded.
        token_scale: modelled tokens per real token (1 without a device model).
    """

    max_running: int
    kv_capacity_tokens: float = math.inf
    token_scale: float = 1.0

    @classmethod
    def for_engine(cls, max_batch_size: int, device: devicemodel.DeviceProfile | None) -> BatchLimits:
        """``max_batch_size`` sequences in real mode; the device model's limits in modelled mode."""
        if device is None:
            return cls(max_batch_size)
        return cls(device.max_running_requests, devicemodel.kv_capacity_tokens(device), device.token_scale)

    def sequence_kv_tokens(self, prompt_tokens: int, max_new_tokens: int) -> float:
        """KV tokens one sequence reserves: its prompt plus every token it may generate (modelled)."""
        return (prompt_tokens + max_new_tokens) * self.token_scale

    def demand(self, prompt_tokens: int, max_new_tokens: int, n: int) -> Demand:
        """The demand of a job of ``n`` samples of one prompt."""
        return Demand(n, n * self.sequence_kv_tokens(prompt_tokens, max_new_tokens))


def plan_admission(
    waiting: Sequence[Demand], running_sequences: int, reserved_kv_tokens: float, limits: BatchLimits
) -> int:
    """How many jobs from the head of the queue join the running batch at this iteration.

    First come, first served (SGLang's ``fcfs`` policy): jobs join in queue order while the
    running sequences stay within ``limits.max_running`` and the reserved KV tokens (prompt plus
    ``max_new_tokens`` of every running sequence, so a running sequence is never evicted) within
    ``limits.kv_capacity_tokens``; the first job that does not fit stops admission, so later,
    smaller jobs do not overtake it. A job larger than the limits on its own is admitted into an
    empty batch (it could otherwise never run).
    """
    return len(admitted_indices(waiting, running_sequences, reserved_kv_tokens, limits))


def admitted_indices(
    waiting: Sequence[Demand],
    running_sequences: int,
    reserved_kv_tokens: float,
    limits: BatchLimits,
    *,
    adapters: Sequence[str | None] = (),
    running_adapters: frozenset[str | None] = frozenset(),
    pool: AdapterPool | None = None,
) -> list[int]:
    """The queue positions of the jobs that join the running batch: :func:`plan_admission` plus LoRA.

    With ``pool``, ``adapters[i]`` is job ``i``'s adapter (None: the base): a job whose adapter
    would take the batch's distinct adapters past what the pool allows
    (scheduler.py ``can_schedule_lora_req``, lora_manager.py ``validate_lora_batch``:
    ``--max-loras-per-batch``, the base counted as one) is skipped and later jobs are still
    considered, as SGLang's scheduler skips it (``continue``); the capacity limits still stop
    admission at the first job that does not fit.
    """
    admitted: list[int] = []
    sequences, reserved = running_sequences, reserved_kv_tokens
    in_batch = set(running_adapters)
    for index, demand in enumerate(waiting):
        adapter = adapters[index] if pool is not None else None
        if not lora.can_schedule(pool, adapter, in_batch):
            continue
        fits = (
            sequences + demand.sequences <= limits.max_running
            and reserved + demand.kv_tokens <= limits.kv_capacity_tokens
        )
        if not fits and not (sequences == 0 and not admitted):
            break
        admitted.append(index)
        in_batch.add(adapter)
        sequences += demand.sequences
        reserved += demand.kv_tokens
    return admitted

