"""The device-work bound (hand-checked) and the RPC overhead read from real Prometheus histograms."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks import sim
from benchmarks.bound import AgentStepWork, DeviceWorkBound, device_work_bound, mean_bound, rpc_overhead, rpc_times
from benchmarks.run import turn_phase_s
from benchmarks.workloads import make_workload
from flexmarl import devicemodel
from flexmarl.metrics import RpcMetrics

H100 = devicemodel.H100_SXM.with_changes(train_devices_per_slot=1)


def test_bound_of_one_agent_by_hand() -> None:
    # 64 episodes of 1,000 response tokens after a 512-token prompt, H100 preset, 1 device per slot.
    bound = device_work_bound(H100, [AgentStepWork("a", 64, 64_000.0)], prompt_tokens=512, replicas=6, slots=2)
    prefill = 2 * 14.7e9 * 512 * 64 / (989e12 * 0.6)  # 1.6235 s
    # KV token-iterations held: 64 x (512 + 1000) x 1000 over 208,537 tokens of KV = 464.0 iterations
    # (> 64,000 / 1,024 running); each reads the 29.4 GB of weights; the KV read is 512 x 64,000 +
    # 64,000^2 / 128 context tokens of 196,608 B; all at 3.35 TB/s x 0.7.
    capacity = (80e9 * 0.88 - 29.4e9) / 196_608
    memory = (64 * 1512 * 1000 / capacity * 29.4e9 + 196_608 * (512 * 64_000 + 64_000**2 / 128)) / 2.345e12
    assert memory == pytest.approx(11.248, abs=1e-3)
    compute = 2 * 14.7e9 * 64_000 / (989e12 * 0.6)  # 3.171 s: memory binds
    reload = 29.4e9 / 50e9
    assert bound.rollout_replica_s == pytest.approx(prefill + max(memory, compute) + reload, rel=1e-9)
    train = 6 * 14.7e9 * (512 * 64 + 64_000) / (989e12 * 0.4) + 14.7e9 * 16 / 2.345e12 + reload
    assert bound.train_slot_s == pytest.approx(train, rel=1e-9)  # 22.26 slot-s
    assert bound.rollout_s == pytest.approx(bound.rollout_replica_s / 6)
    assert bound.step_s == bound.train_s == pytest.approx(train / 2) and bound.bound_by == "train"


def test_the_rollout_bound_is_below_a_modelled_continuous_batch() -> None:
    # One replica decoding a turn's 64 lognormal sequences as one continuous batch (run.py's model of a
    # turn) takes at least the bound's prefill + decode of the same tokens.
    rng = random.Random(3)
    lengths = [min(8192, math.ceil(1024 * math.exp(rng.gauss(0.0, 1.0)))) for _ in range(64)]
    one = device_work_bound(H100, [AgentStepWork("a", 64, float(sum(lengths)))], prompt_tokens=512, replicas=1, slots=1)
    phase_s = turn_phase_s(H100, 512, lengths, replicas=1)
    assert one.rollout_replica_s - devicemodel.weight_transfer_s(H100) <= phase_s
    # Equal lengths reach it closely (the long tail costs latency beyond it).
    equal = [1000] * 64
    even = device_work_bound(H100, [AgentStepWork("a", 64, 64_000.0)], prompt_tokens=512, replicas=1, slots=1)
    assert even.rollout_replica_s - devicemodel.weight_transfer_s(H100) <= turn_phase_s(H100, 512, equal, 1)


def test_agents_add_up_and_steps_average() -> None:
    one = device_work_bound(H100, [AgentStepWork("a", 8, 8_000.0)], prompt_tokens=512, replicas=2, slots=1)
    both = device_work_bound(
        H100, [AgentStepWork("a", 8, 8_000.0), AgentStepWork("b", 8, 8_000.0)], prompt_tokens=512, replicas=2, slots=1
    )
    assert both.train_slot_s == pytest.approx(2 * one.train_slot_s)
    assert both.rollout_replica_s == pytest.approx(2 * one.rollout_replica_s)
    mean = mean_bound([one, both])
    assert mean == DeviceWorkBound(1.5 * one.rollout_replica_s, 1.5 * one.train_slot_s, 2, 1, one.train_slot_s)
    # One agent's step trains on one slot: with two slots the two agents take one each (the bound halves),
    # never less than one agent's own training.
    wide = device_work_bound(
        H100, [AgentStepWork("a", 8, 8_000.0), AgentStepWork("b", 8, 1_000.0)], prompt_tokens=512, replicas=2, slots=4
    )
    assert wide.busiest_agent_train_s == pytest.approx(one.train_slot_s)
    assert wide.train_s < wide.agent_step_s == pytest.approx(one.train_slot_s)
    with pytest.raises(ValueError):
        device_work_bound(H100, [], prompt_tokens=512, replicas=0, slots=1)


def test_rpc_overhead_counts_served_long_polls_and_data_path_rpcs() -> None:
    registry = CollectorRegistry()
    metrics = RpcMetrics("orchestratord", registry)
    before = rpc_times("orchestratord", "orchestratord", generate_latest(registry).decode())
    metrics.observe("CommitStep", "OK", 0.02)
    metrics.observe("ReportRolloutTask", "OK", 0.003)
    metrics.observe("LeaseRolloutTasks", "OK", 0.004)  # served at once: counted at its bucket's edge, 0.005
    metrics.observe("LeaseRolloutTasks", "OK", 2.0)  # parked for 2 s waiting for work: left out
    metrics.observe("GetJob", "OK", 0.5)  # the user's status poll: not orchestration of the job
    after = rpc_times("orchestratord", "orchestratord", generate_latest(registry).decode())
    counted = {t.method: t for t in rpc_overhead(before, after)}
    assert set(counted) == {"CommitStep", "ReportRolloutTask", "LeaseRolloutTasks"}
    assert counted["CommitStep"].seconds == pytest.approx(0.02)
    assert counted["ReportRolloutTask"].seconds == pytest.approx(0.003)
    lease = counted["LeaseRolloutTasks"]
    assert lease.seconds == pytest.approx(0.005) and (lease.calls, lease.left_out_calls) == (1, 1)
    assert rpc_times("rolloutd-0", "rolloutd", generate_latest(registry).decode()) == []


def test_no_simulated_step_beats_its_bound() -> None:
    # benchmarks.sim decodes, prefills and trains on the same device model: its steps can only be slower.
    settings = sim.SimSettings(devices=12, devices_per_slot=2, group_size=4, steps=3)
    for config in ("flexmarl", "sequential"):
        outcome = sim.Simulation(config, settings, make_workload(3, "long-tail")).run()
        assert outcome.state == "SUCCEEDED" and 0 < outcome.bound_s <= outcome.step_s
        assert outcome.bound_by in ("rollout", "train")
