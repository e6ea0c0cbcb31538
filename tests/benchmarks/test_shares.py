"""benchmarks.shares: an agent's step on its replicas at the batch its in-flight sequences allow (hand-checked)."""

from __future__ import annotations

import pytest

from benchmarks.shares import agent_step_s, full_batch
from flexmarl import devicemodel


def test_a_replica_decodes_as_many_sequences_as_its_kv_cache_reserves_and_charges_each_its_share() -> None:
    profile = devicemodel.PRESETS["h100"].with_changes(token_scale=128.0)
    # 208,537 KV tokens on one H100 over 512 + 3,584 reserved per sequence
    assert full_batch(profile, 512, [3584] * 8) == pytest.approx(208_536.78 / 4096, rel=1e-4)
    # one sequence in flight: batch 1, its 1,024 iterations at one sequence's context (512 + 512 on average)
    alone = agent_step_s(profile, "a", 512, [1024], replicas=1, in_flight=1)
    iteration_s = (29.4e9 + 196_608 * 1024) / (3.35e12 * 0.7)
    assert alone.batch == 1 and alone.latency_s == pytest.approx(1024 * iteration_s)
    assert alone.replica_s == pytest.approx(devicemodel.prefill_s(profile, 512) + 1024 * iteration_s)
    # 64 sequences over 2 replicas with 256 in flight: each replica full (~50 of 512 + 3,584), each token 1/50 of
    # an iteration of the full batch; the step is the replica-seconds over the 2 replicas
    full = agent_step_s(profile, "a", 512, [3584] * 64, replicas=2, in_flight=256)
    batch = 208_536.78 / 4096
    iteration_s = (29.4e9 + 196_608 * batch * (512 + 1792)) / (3.35e12 * 0.7)
    assert full.batch == pytest.approx(batch, rel=1e-4)
    assert full.replica_s == pytest.approx(devicemodel.prefill_s(profile, 512 * 64) + 64 * 3584 * iteration_s / batch,
                                           rel=1e-3)
    assert full.step_s == pytest.approx(full.replica_s / 2)
    # the same on 4 replicas with 128 in flight: 32 a replica, not full, so each token costs more of a replica
    half = agent_step_s(profile, "a", 512, [3584] * 64, replicas=4, in_flight=128)
    assert half.batch == 32 and half.replica_s > full.replica_s and half.latency_s < full.latency_s
