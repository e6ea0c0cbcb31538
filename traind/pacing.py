"""Modelled device time of one agent's trainer (benchmarks): work lasts what a stated accelerator would take.

traind started with a device profile (``--modelled-device`` / ``FLEXMARL_MODELLED_DEVICE``,
read once into :class:`traind.config.TrainerConfig`) gives each trainer it builds a
:class:`ModelledDeviceClock`. The trainer charges it with the work it did (real math still
runs); the owner settles the charges, i.e. waits out the modelled time, outside any lock it
computes under, so a daemon holding several slots in one process models them as separate
devices. Without a profile there is no clock and training runs in real time.
"""

from __future__ import annotations

import math
import time

from flexmarl import devicemodel


class ModelledDeviceClock:
    """Charges of one trainer, waited out in order by :meth:`settle` and traced to the profile's trace dir.

    The modelled device does one thing at a time: a charge starts when its real work started or
    when the device finishes the charges before it, whichever is later. So a swap-in followed by
    the micro-batch it was loaded for, charged before one settle, lasts the swap's time *plus* the
    micro-batch's; the micro-batch's real compute (a rebuilt engine's first pass included) may
    run while the modelled swap is still in progress and only counts as overrun past its own
    modelled end.

    Not thread-safe: the trainer charges and its owner settles from one thread at a time.
    """

    def __init__(self, profile: devicemodel.DeviceProfile, who: str) -> None:
        """A clock for the trainer named ``who`` (the trace file name)."""
        self.profile = profile
        self._trace = devicemodel.TraceWriter(profile, who)
        self._charged: list[tuple[str, float, devicemodel.Pacer]] = []
        # perf_counter seconds at which the modelled device finishes what was charged so far
        self._free_at_perf_s = -math.inf

    def train(self, started_perf_s: float, real_tokens: float) -> None:
        """Charges forward + backward over ``real_tokens`` (prompt + response) started at ``started_perf_s``."""
        profile = self.profile
        self._charge("train", started_perf_s, devicemodel.train_tokens_s(profile, real_tokens * profile.token_scale))

    def optimizer_step(self, started_perf_s: float) -> None:
        """Charges one optimizer step (weights published included) started at ``started_perf_s``."""
        self._charge("optimizer", started_perf_s, devicemodel.optimizer_step_s(self.profile))

    def swap_in(self, started_perf_s: float, lora_rank: int = 0, lora_modules: tuple[str, ...] = (),
                zero_stage: int = 0) -> None:
        """Charges moving an agent's training state onto the device (a swap-in) started at ``started_perf_s``.

        A full-model agent moves weights and optimizer state (``devicemodel.swap_s``: each of the slot's
        devices its share under the agent's ``zero_stage``, in parallel), a LoRA agent
        (``lora_rank`` > 0) its adapter and the adapter's optimizer state (``lora_swap_s`` of that rank
        on ``lora_modules`` of the modelled model; the base stays on the slot). Modules the modelled
        model lacks (a tiny model's names) count as its four attention projections.
        """
        profile = self.profile
        if lora_rank <= 0:
            seconds = devicemodel.swap_s(profile, zero_stage)
        else:
            known = tuple(m for m in lora_modules if m in devicemodel.QWEN25_14B_LINEAR_SHAPES)
            shape = devicemodel.qwen25_14b_lora(lora_rank, known) if known else devicemodel.qwen25_14b_lora(lora_rank)
            seconds = devicemodel.lora_swap_s(profile, shape)
        self._charge("swap", started_perf_s, seconds)

    def _charge(self, kind: str, started_perf_s: float, modelled_s: float) -> None:
        start_perf_s = max(started_perf_s, self._free_at_perf_s)  # after the device's earlier charges
        wall_started_s = time.time() - (time.perf_counter() - start_perf_s)
        pacer = devicemodel.Pacer(self.profile, clock=time.perf_counter)
        pacer.start_s = start_perf_s
        pacer.add(float(modelled_s))
        self._free_at_perf_s = pacer.end_s
        self._charged.append((kind, wall_started_s, pacer))

    def settle(self) -> None:
        """Waits until every charge's modelled time has passed since it started, in order, and traces each."""
        while self._charged:
            kind, wall_started_s, pacer = self._charged.pop(0)
            pacer.wait()
            self._trace.record(kind, wall_started_s, time.time(), pacer.modelled_s, overrun_s=pacer.overrun_s,
                               devices=self.profile.train_devices_per_slot)
