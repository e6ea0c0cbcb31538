"""benchmarks.machine and benchmarks.run's overrun accounting: synthetic traces, a synthetic /proc, no cluster."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import pytest

from benchmarks import machine
from benchmarks import run as bench
from benchmarks.workloads import make_workload
from flexmarl import devicemodel
from flexmarl.client import StepRecord

TICKS = os.sysconf("SC_CLK_TCK")


def span(start: float, end: float, overrun: float = 0.0) -> dict[str, float | str]:
    return {"kind": "decode", "start_s": start, "end_s": end, "modelled_s": end - start, "overrun_s": overrun}


def test_window_overrun_counts_the_records_that_started_inside_it() -> None:
    records = [span(5.0, 12.0, 9.0), span(10.0, 20.0, 1.0), span(15.0, 30.0, 2.0), span(30.0, 35.0, 4.0)]
    # [10, 30): the second and third start inside it; the first started before, the last at its end
    assert machine.window_overrun_s(records, 10.0, 30.0) == pytest.approx(3.0)
    # busy over [10, 30] is the union 10..30 minus nothing: idle 0; over [0, 40]: busy 5..35 = 30 of 40
    assert machine.all_idle_share(records, 10.0, 30.0) == pytest.approx(0.0)
    assert machine.all_idle_share(records, 0.0, 40.0) == pytest.approx(0.25)
    assert math.isnan(machine.all_idle_share(records, 5.0, 5.0))


def test_the_limit_marks_machine_set_and_an_unknown_share_too() -> None:
    assert not machine.machine_set(machine.OVERRUN_LIMIT)
    assert machine.machine_set(machine.OVERRUN_LIMIT + 1e-6)
    assert machine.machine_set(math.nan)
    window = machine.DaemonWindow(100.0, {"orchestratord": 3.0, "stored": 1.0, "traind-0": 60.0},
                                  {"orchestratord": 2.0, "stored": 0.5, "etcd": 0.5, "traind-0": 40.0}, 0.9)
    # 2 s of device overrun + 3 s the control plane waited (traind's wait is its pacer's business): 5 % of 100 s
    account = machine.account([span(10.0, 50.0, 2.0)], 0.0, 100.0, window)
    assert account.control_wait_s == pytest.approx(3.0)
    assert account.overrun_s == pytest.approx(5.0)
    assert account.overrun_share == pytest.approx(0.05)
    assert not account.machine_set
    assert account.daemon_cpu_share == pytest.approx(0.64)
    assert account.all_idle_share == pytest.approx(0.6)
    assert machine.account([span(10.0, 50.0, 2.1)], 0.0, 100.0, window).machine_set
    # without samples the control plane counts zero and the figures are unknown
    bare = machine.account([span(10.0, 50.0, 2.0)], 0.0, 100.0)
    assert bare.overrun_share == pytest.approx(0.02) and math.isnan(bare.daemon_cpu_share)


def fake_proc(root: Path, processes: dict[int, tuple[int, int, int, list[int]]], busy: int, total: int) -> None:
    """pid -> (ppid, utime + stime ticks, run-queue wait ns per thread, thread ids); /proc/stat's cpu line."""
    for pid, (ppid, ticks, wait_ns, tids) in processes.items():
        base = root / str(pid)
        (base / "task").mkdir(parents=True, exist_ok=True)
        # comm with a space and a parenthesis, as a real one may have
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(ticks - ticks // 3), str(ticks // 3)] + ["0"] * 10
        (base / "stat").write_text(f"{pid} (py thon) x) " + " ".join(rest) + "\n")
        for tid in tids:
            (base / "task" / str(tid)).mkdir(exist_ok=True)
            (base / "task" / str(tid) / "schedstat").write_text(f"123 {wait_ns} 7\n")
    idle = total - busy
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_the_sampler_sums_a_process_tree_and_interpolates_a_window(tmp_path: Path) -> None:
    # orchestratord (pid 10) has a child 11; stored is 20; a stranger 30 is nobody's
    fake_proc(tmp_path, {10: (1, 100, 1_000_000_000, [10, 12]), 11: (10, 50, 0, [11]), 20: (1, 10, 0, [20]),
                         30: (1, 999, 5_000_000_000, [30])}, busy=1000, total=4000)
    sampler = machine.CpuSampler({"orchestratord": 10, "stored": 20}, proc=tmp_path)
    assert machine.process_times(10, tmp_path) == machine.ProcessTimes(150 / TICKS, 2.0)
    sampler.sample(at_s=100.0)
    fake_proc(tmp_path, {10: (1, 100 + 4 * TICKS, 3_000_000_000, [10, 12]), 11: (10, 50, 0, [11]),
                         20: (1, 10 + 2 * TICKS, 1_000_000_000, [20])}, busy=1600, total=4800)
    sampler.sample(at_s=110.0)
    window = sampler.window(102.5, 107.5)  # the middle half of the samples
    assert window.wall_s == pytest.approx(5.0)
    assert window.cpu_s == pytest.approx({"orchestratord": 2.0, "stored": 1.0})
    assert window.wait_s == pytest.approx({"orchestratord": 2.0, "stored": 0.5})  # (2 threads x 2 s) / 2, 1 s / 2
    assert window.cpu_share == pytest.approx(0.6)
    assert window.machine_busy_share == pytest.approx(600 / 800)
    assert window.control_wait_s == pytest.approx(2.5)


def test_this_process_cpu_is_read_from_the_real_proc() -> None:
    before = machine.process_times(os.getpid())
    deadline = time.monotonic() + 10.0
    after = before
    while after.cpu_s <= before.cpu_s and time.monotonic() < deadline:  # spin until a clock tick is charged
        after = machine.process_times(os.getpid())
    assert after.cpu_s > before.cpu_s and after.wait_s >= before.wait_s


def record(agent: str, step: int, committed_s: float) -> StepRecord:
    return StepRecord(agent=agent, step=step, version=step + 1, reward_mean=0.5, loss=0.0, grad_norm=0.0,
                      step_seconds=0.0, tokens_per_s=0.0, staleness_mean=1.0, episodes=64, response_tokens=640,
                      committed_unix_ms=int(committed_s * 1000), weights_uri="")


def measured(tmp_path: Path, engine_overrun: float, trainer_overrun: float) -> bench.RunResult:
    """A 3-agent job whose steps committed at 100, 110, 120 wall s; device work with the given overruns."""
    workload = make_workload(3, "long-tail")
    history = [record(name, step, 100.0 + 10.0 * step + i) for step in range(3)
               for i, (name, _) in enumerate(workload.agents)]
    traces = tmp_path / "traces"
    traces.mkdir(exist_ok=True)
    # a span before the window (step 0's DeepSpeed start-up) whose overrun is left out
    (traces / "engine-0.jsonl").write_text(
        "\n".join(json.dumps(s) for s in [span(90.0, 95.0, 50.0), span(104.0, 118.0, engine_overrun)]) + "\n")
    (traces / "traind-0.jsonl").write_text(json.dumps(span(112.0, 121.0, trainer_overrun)) + "\n")
    profile = devicemodel.PRESETS["h100"].with_changes(token_scale=128.0, time_scale=0.25)
    args = argparse.Namespace(replicas=1, slots=1)
    return bench.measure("flexmarl-partial", workload, "SUCCEEDED", history, profile, traces, args, 40.0)


def test_run_counts_engine_and_trainer_overrun_in_the_window_and_marks_the_config(tmp_path: Path) -> None:
    quiet = measured(tmp_path, engine_overrun=0.4, trainer_overrun=0.6)
    # window: every agent committed step 0 at 102 s, step 2 at 122 s: 20 wall s, 4 modelled per wall s
    assert quiet.window_wall_s == pytest.approx(20.0) and quiet.step_s == pytest.approx(40.0)
    assert quiet.device_overrun_s == pytest.approx(1.0) and quiet.overrun_share == pytest.approx(0.05)
    assert quiet.model_overrun_s == pytest.approx(51.0)  # the whole job's, as before
    assert quiet.all_idle_share == pytest.approx(3.0 / 20.0)  # 102..104 idle; 104..121 busy; 121..122 idle
    assert not quiet.machine_set and quiet.measured
    loaded = measured(tmp_path, engine_overrun=0.4, trainer_overrun=1.0)  # the trainer's slip alone tips it
    assert loaded.machine_set and not loaded.measured

    sequential = measured(tmp_path, 0.0, 0.0)
    sequential.config, sequential.step_s = "sequential", 200.0
    text = bench.table([sequential, quiet])
    row = next(line for line in text.splitlines() if line.startswith("sequential"))
    assert "5.00x" in row and ">= 5.0x: met" in row
    text = bench.table([sequential, loaded])
    ref_row = next(line for line in text.splitlines() if line.startswith("flexmarl-partial"))
    row = next(line for line in text.splitlines() if line.startswith("sequential"))
    assert bench.NOT_MEASURED in ref_row and "7.0%" in ref_row
    assert " – " in row and "5.00x" not in row and f"flexmarl-partial {bench.NOT_MEASURED}" in row
    assert math.isnan(bench.speedup(sequential, loaded))
