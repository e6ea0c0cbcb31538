"""Modelled device time of one agent's trainer (benchmarks): work lasts what a stated accelerator would take.

traind started with a device profile (``--modelled-device`` / ``FLEXMARL_MODELLED_DEVICE``,
read once into :class:`traind.config.TrainerConfig`) gives each trainer it builds a
:class:`ModelledDeviceClock`. The trainer charges it with the work it did (real math still
runs); the owner settles the charges, i.e. waits out the modelled time, outside any lock it
computes under, so a daemon holding several slots in one process models them as separate
devices. Without a profile there is no clock and training runs in real time.
"""

from __future__ import annotations

import time

from flexmarl import devicemodel


class ModelledDeviceClock:
    """Charges of one trainer, waited out in order by :meth:`settle` and traced to the profile's trace dir.

    Not thread-safe: the trainer charges and its owner settles from one thread at a time.
    """

    def __init__(self, profile: devicemodel.DeviceProfile, who: str) -> None:
        """A clock for the trainer named ``who`` (the trace file name)."""
        self.profile = profile
        self._trace = devicemodel.TraceWriter(profile, who)
        self._charged: list[tuple[str, float, devicemodel.Pacer]] = []

    def train(self, started_perf_s: float, real_tokens: float) -> None:
        """Charges forward + backward over ``real_tokens`` (prompt + response) started at ``started_perf_s``."""
        profile = self.profile
        self._charge("train", started_perf_s, devicemodel.train_tokens_s(profile, real_tokens * profile.token_scale))

    def optimizer_step(self, started_perf_s: float) -> None:
        """Charges one optimizer step (weights published included) started at ``started_perf_s``."""
        self._charge("optimizer", started_perf_s, devicemodel.optimizer_step_s(self.profile))

    def _charge(self, kind: str, started_perf_s: float, modelled_s: float) -> None:
        wall_started_s = time.time() - (time.perf_counter() - started_perf_s)
        pacer = devicemodel.Pacer(self.profile, clock=time.perf_counter)
        pacer.start_s = started_perf_s
        pacer.add(float(modelled_s))
        self._charged.append((kind, wall_started_s, pacer))

    def settle(self) -> None:
        """Waits until every charge's modelled time has passed since it started, in order, and traces each."""
        while self._charged:
            kind, wall_started_s, pacer = self._charged.pop(0)
            pacer.wait()
            self._trace.record(kind, wall_started_s, time.time(), pacer.modelled_s, overrun_s=pacer.overrun_s,
                               devices=self.profile.train_devices_per_slot)
