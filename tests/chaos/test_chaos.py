"""CI variant of the seeded chaos test: one fault of every kind during one strict job.

etcd, stored, orchestratord, traind, rolloutd and an engine replica are each SIGKILLed once, in
an order and at moments drawn from the seed (``FLEXMARL_CHAOS_SEED``, default 1), on a cluster
with one worker of each kind; every fault waits for two new steps of every agent (a killed engine
is relaunched by rolloutd's supervisor). A fault-free job with the same spec and seed runs first
on the same cluster, and the chaos job's final parameters must equal it (max relative difference
<= 1e-6; strict mode with exact accumulation makes them bit-equal). The driver and its checks are
in chaos_driver.py; ``python -m benchmarks.chaos`` runs the long variant.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chaos_driver import FAULT_KINDS, ChaosConfig, ChaosDriver, ChaosResult, plan_faults


def _summary(result: ChaosResult) -> str:
    recovery = ", ".join(f"{f.kind} {f.recovery_s:.1f}s" for f in result.faults)
    return (
        f"chaos seed {result.seed}: {result.job_state} in {result.job_wall_s:.1f}s, "
        f"{len(result.faults)} faults ({recovery}); re-issued leases {result.reissued_leases}; "
        f"{result.experiences_consumed} experiences consumed once; probe acked "
        f"{result.probe_experiences_acked} experiences + {result.probe_blobs_acked} blobs; "
        f"{result.versions_loaded} versions loaded; fault-free job {result.baseline_wall_s:.1f}s, max relative "
        f"parameter difference {result.max_relative_difference:.3g}; checks {result.checks}"
    )


def test_plan_covers_every_kind_first() -> None:
    for seed in range(20):
        plan = plan_faults(seed, 20)
        assert sorted(plan[: len(FAULT_KINDS)]) == sorted(FAULT_KINDS), plan
        assert plan == plan_faults(seed, 20), "the plan is not a function of the seed"


#: The strict chaos job equals the fault-free one up to this relative difference (0 expected).
MAX_RELATIVE_DIFFERENCE = 1e-6


@pytest.mark.timeout(600)
def test_one_fault_of_every_kind(tmp_path: Path) -> None:
    seed = int(os.environ.get("FLEXMARL_CHAOS_SEED", "1"))
    config = ChaosConfig(
        run_dir=tmp_path,
        seed=seed,
        faults=len(FAULT_KINDS),
        baseline=True,
        require_equal_parameters=True,
        max_relative_difference=MAX_RELATIVE_DIFFERENCE,
        engine_relaunched_by_rolloutd=True,
    )
    driver = ChaosDriver(config)
    with driver.running():
        result = driver.run()
        assert result.faults_by_kind() == dict.fromkeys(FAULT_KINDS, 1), (
            f"the job ended before every kind of fault was injected: {result.faults_by_kind()}"
        )
        driver.check_outcome()
    print(_summary(result))
    assert result.checks == {
        "succeeded": "ok",
        "exactly_once": "ok",
        "history": "ok",
        "nothing_lost": "ok",
        "weights_load": "ok",
        "equal_to_fault_free": "ok",
    }
    assert result.max_relative_difference <= MAX_RELATIVE_DIFFERENCE
    assert result.experiences_consumed == result.total_steps * 4 * 4 * 2  # steps x prompts x group x agents
    assert result.probe_experiences_acked > 0 and result.probe_blobs_acked > 0
    assert result.versions_loaded == result.total_steps * 2
