"""benchmarks.workloads' ablation shapes and benchmarks.run's ablation configurations (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import run as bench
from benchmarks.workloads import HEAVY, LIGHT, TRAIN_HEAVY, TRAIN_LIGHT, SkewedAgentsEnv, make_workload
from flexmarl.jobspec import parse_job_spec


def test_the_heavy_role_moves_to_another_agent_every_few_steps() -> None:
    workload = make_workload(3, "shifting", rotate_every_steps=2, prompts_per_step=4)
    assert [dist for _, dist in workload.agents] == [HEAVY, LIGHT, LIGHT]
    env = SkewedAgentsEnv(**workload.environment_config(128.0))
    heavy = [[a for a in env.agents if env.length_distribution(a, task) == HEAVY] for task in range(0, 32, 4)]
    # tasks 0-7 (steps 0-1): planner; 8-15: reviewer (draws from agent 2 + 1 = 0); 16-23: coder; 24-31: planner
    assert heavy == [["planner"]] * 2 + [["reviewer"]] * 2 + [["coder"]] * 2 + [["planner"]] * 2
    # no rotation: every agent keeps its own
    assert SkewedAgentsEnv(**make_workload(3, "long-tail").environment_config(128.0)).length_distribution(
        "planner", 100) == make_workload(3, "long-tail").agents[0][1]
    with pytest.raises(ValueError, match="rotate_every_tasks"):
        SkewedAgentsEnv(**{**workload.environment_config(128.0), "rotate_every_tasks": -1})
    with pytest.raises(ValueError, match="variant"):
        make_workload(3, "skewed")


def test_two_heavy_puts_both_heavy_agents_on_one_static_slot_set() -> None:
    workload = make_workload(3, "two-heavy")
    assert [dist for _, dist in workload.agents] == [TRAIN_HEAVY, TRAIN_LIGHT, TRAIN_HEAVY]
    # static binding with S = 2 slots < K = 3 agents: agent i on slot i % 2, so agents 0 and 2 share slot 0
    assert [i % 2 for i, (_, dist) in enumerate(workload.agents) if dist == TRAIN_HEAVY] == [0, 0]


@pytest.mark.parametrize("config", ["partial-no-lb", "partial-no-binding", "partial-no-interrupt"])
def test_each_ablation_is_flexmarl_partial_less_one_mechanism(config: str) -> None:
    workload = make_workload(3, "shifting")
    full = bench.job_spec(workload, "flexmarl-partial", Path("/m"), 4, 128.0)
    spec = bench.job_spec(workload, config, Path("/m"), 4, 128.0)
    parse_job_spec(spec)  # a valid job
    differs = {(section, key) for section in ("pipeline", "rollout")
               for key in {*full[section], *spec[section]} if full[section].get(key) != spec[section].get(key)}
    expected = {
        "partial-no-lb": {("rollout", "balancing")},
        "partial-no-binding": {("pipeline", "binding")},
        "partial-no-interrupt": {("rollout", "partial_rollout"), ("rollout", "mask_stale_tokens")},
    }[config]
    assert differs == expected
    assert spec["environment"]["config"]["rotate_every_tasks"] == 12


@pytest.mark.parametrize(("config", "eta", "max_tasks"), [
    ("no-async", None, 8), ("flexmarl", None, 8), ("flexmarl-partial", 4, 20), ("flexmarl-partial", None, 36)])
def test_rolloutd_runs_as_many_tasks_as_the_staleness_rule_admits(config: str, eta: int | None,
                                                                  max_tasks: int) -> None:
    """(eta + 1) x 4 prompts per step, never below rolloutd's default of 8 (sync needs 4, eta 1 8)."""
    spec = bench.job_spec(make_workload(3, "long-tail"), config, Path("/m"), 24, 128.0, eta)
    assert bench.rolloutd_args(spec) == ["--max-tasks", str(max_tasks)]


def test_the_balancer_moves_replicas_on_the_rates_rolloutd_measures_and_not_on_the_fixed_ones() -> None:
    from benchmarks.balancer_units import decisions

    # the shifting shape's demand in real tokens: 400 heavy requests of 24, 4 light ones of 1 per light agent
    fixed, measured, own_rates = decisions(400, 128.0, 0.5, 2500.0)
    assert fixed.replicas == {"planner": 2, "coder": 2, "reviewer": 2}
    assert measured.rates == pytest.approx((2500.0 / 0.5 / 128,) * 6)  # every replica at the best measured
    assert measured.reload_s == pytest.approx(0.29, abs=0.01)
    assert measured.replicas == {"planner": 4, "coder": 1, "reviewer": 1}
    assert own_rates.rates[2] < 2.0  # a light agent's replica, one short request at a time
    assert own_rates.replicas == {"planner": 2, "coder": 2, "reviewer": 2}
