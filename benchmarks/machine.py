"""When the machine, not the device model, set a benchmark's time: overrun, daemons' CPU, idle share.

A run with modelled device time is a measurement of the model only while every component's real
work fits inside the time the model charges for it. Three things can break that on a shared CPU
machine, and this module counts each over a measured wall window:

* **overrun**: the engines' and trainers' real compute that ran past its modelled time (their
  device traces' ``overrun_s``, written by ``flexmarl.devicemodel.ModelledWork``);
* **control-plane CPU wait**: the wall seconds the threads of the daemons that do no modelled work
  (orchestratord, stored, etcd) were runnable but waited for a CPU (``/proc/<pid>/task/*/schedstat``,
  second field): their work has no modelled time to hide in, so every second of it waiting is a
  second the machine added. It counts as overrun;
* **the daemons' CPU**: CPU seconds (user + system, ``/proc/<pid>/stat``, the process and its
  descendants) of every daemon in the window, in cores (CPU s / wall s), beside the machine's own
  busy share (``/proc/stat``) and the share of the window in which no engine and no trainer was busy
  (the daemons' real work between device work, enlarged 1 / time_scale in modelled time).

``machine_set`` is the one definition both ``benchmarks.run`` and ``benchmarks.time_to_reward`` use:
an overrun share above ``OVERRUN_LIMIT`` (or an unknown share) marks a run as not measured.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexmarl import devicemodel

OVERRUN_LIMIT = 0.05  # overrun wall s / run wall s above which the machine, not the model, set the time
CONTROL_PLANE = ("orchestratord", "stored", "etcd")  # daemons with no modelled work (name prefixes)


def machine_set(overrun_share: float, limit: float = OVERRUN_LIMIT) -> bool:
    """Whether an overrun share (overrun wall s / wall s) says the machine set the time (NaN: yes)."""
    return not (overrun_share <= limit)


def window_overrun_s(records: list[dict[str, Any]], start_s: float, end_s: float) -> float:
    """Overrun wall seconds of the trace records that started inside [start_s, end_s)."""
    return sum(float(r.get("overrun_s", 0.0)) for r in records if start_s <= float(r["start_s"]) < end_s)


def all_idle_share(records: list[dict[str, Any]], start_s: float, end_s: float) -> float:
    """Share of [start_s, end_s] in which none of the records' intervals was running."""
    if end_s <= start_s:
        return math.nan
    return 1.0 - devicemodel.busy_seconds(records, start_s, end_s) / (end_s - start_s)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclasses.dataclass(frozen=True)
class ProcessTimes:
    """Cumulative CPU and run-queue wait seconds of a process tree."""

    cpu_s: float
    wait_s: float


def _children(proc: Path) -> dict[int, list[int]]:
    """ppid -> pids of every process under ``proc``."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def process_times(pid: int, proc: Path = Path("/proc"), children: dict[int, list[int]] | None = None) -> ProcessTimes:
    """CPU seconds (user + system) and run-queue wait seconds of ``pid`` and its descendants so far.

    A process that is gone counts zero (sample while it runs). The wait is the sum over the live
    threads' ``schedstat``; threads that already exited are not in it. ``children``: the process
    tree (``ppid -> pids``) when the caller read it already.
    """
    if children is None:
        children = _children(proc)
    cpu_ticks = 0
    wait_ns = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        base = proc / str(current)
        try:
            stat = (base / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        cpu_ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        try:
            tasks = list((base / "task").iterdir())
        except OSError:
            tasks = []
        for task in tasks:
            try:
                wait_ns += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return ProcessTimes(cpu_ticks / _CLOCK_TICKS, wait_ns / 1e9)


def machine_busy_jiffies(proc: Path = Path("/proc")) -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the machine so far (``/proc/stat``'s first line)."""
    values = [int(v) for v in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user
    return total - idle, total


@dataclasses.dataclass
class Sample:
    """The cumulative figures at one wall moment."""

    at_s: float  # time.time()
    daemons: dict[str, ProcessTimes]
    machine_busy: int
    machine_total: int


class CpuSampler:
    """Samples the daemons' and the machine's cumulative CPU; answers for any window inside the samples."""

    def __init__(self, pids: Mapping[str, int], proc: Path = Path("/proc")) -> None:
        self.pids = dict(pids)
        self.proc = proc
        self.samples: list[Sample] = []

    def sample(self, at_s: float | None = None) -> None:
        """Records the figures now (``at_s``: the wall moment to file them under; default now)."""
        children = _children(self.proc)
        daemons = {name: process_times(pid, self.proc, children) for name, pid in self.pids.items()}
        busy, total = machine_busy_jiffies(self.proc)
        self.samples.append(Sample(time.time() if at_s is None else at_s, daemons, busy, total))

    def _at(self, at_s: float, value: Any) -> float:
        """``value(sample)`` linearly interpolated at ``at_s`` (clamped to the sampled span)."""
        if not self.samples:
            return math.nan
        before = [s for s in self.samples if s.at_s <= at_s]
        after = [s for s in self.samples if s.at_s >= at_s]
        lo = before[-1] if before else self.samples[0]
        hi = after[0] if after else self.samples[-1]
        if hi.at_s <= lo.at_s:
            return float(value(lo))
        fraction = (at_s - lo.at_s) / (hi.at_s - lo.at_s)
        return float(value(lo) + fraction * (value(hi) - value(lo)))

    def window(self, start_s: float, end_s: float) -> DaemonWindow:
        """The daemons' CPU and wait seconds and the machine's busy share between two wall moments."""

        def delta(value: Any) -> float:
            return self._at(end_s, value) - self._at(start_s, value)

        cpu = {name: delta(lambda s, n=name: s.daemons[n].cpu_s) for name in self.pids}
        wait = {name: delta(lambda s, n=name: s.daemons[n].wait_s) for name in self.pids}
        total = delta(lambda s: s.machine_total)
        busy = delta(lambda s: s.machine_busy)
        return DaemonWindow(end_s - start_s, cpu, wait, busy / total if total > 0 else math.nan)


@dataclasses.dataclass
class DaemonWindow:
    """The daemons' real work over a wall window."""

    wall_s: float
    cpu_s: dict[str, float]  # daemon -> CPU seconds in the window
    wait_s: dict[str, float]  # daemon -> run-queue wait seconds of its threads in the window
    machine_busy_share: float  # the whole machine's CPUs, every process (others' too)

    @property
    def cpu_share(self) -> float:
        """The daemons' CPU seconds over the wall seconds: cores they used on average."""
        return sum(self.cpu_s.values()) / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def control_wait_s(self) -> float:
        """Run-queue wait of the daemons that do no modelled work (orchestratord, stored, etcd)."""
        return sum(v for name, v in self.wait_s.items() if name.startswith(CONTROL_PLANE))


@dataclasses.dataclass
class WindowAccount:
    """Every component's real work past its modelled time over a measured window, and the verdict."""

    wall_s: float
    device_overrun_s: float  # engines' and trainers' overrun (traces)
    control_wait_s: float  # control-plane daemons' run-queue wait (nan when not sampled)
    daemon_cpu_share: float = math.nan  # cores
    all_idle_share: float = math.nan
    machine_busy_share: float = math.nan
    daemon_cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def overrun_s(self) -> float:
        """Device overrun plus the control plane's CPU wait (the latter counted as zero when unknown)."""
        return self.device_overrun_s + (0.0 if math.isnan(self.control_wait_s) else self.control_wait_s)

    @property
    def overrun_share(self) -> float:
        """Overrun wall seconds over the window's wall seconds."""
        return self.overrun_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def machine_set(self) -> bool:
        """Whether the machine, not the device model, set the window's time."""
        return machine_set(self.overrun_share)


def account(
    device_records: list[dict[str, Any]], start_s: float, end_s: float, daemons: DaemonWindow | None = None
) -> WindowAccount:
    """The window's account from the engines' and trainers' trace records and the daemons' samples."""
    return WindowAccount(
        wall_s=end_s - start_s,
        device_overrun_s=window_overrun_s(device_records, start_s, end_s),
        control_wait_s=daemons.control_wait_s if daemons is not None else math.nan,
        daemon_cpu_share=daemons.cpu_share if daemons is not None else math.nan,
        all_idle_share=all_idle_share(device_records, start_s, end_s),
        machine_busy_share=daemons.machine_busy_share if daemons is not None else math.nan,
        daemon_cpu_s={k: round(v, 3) for k, v in daemons.cpu_s.items()} if daemons is not None else {},
    )
