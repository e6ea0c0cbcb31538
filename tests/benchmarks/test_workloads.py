"""benchmarks.workloads' ablation shapes and benchmarks.run's ablation configurations (no cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import run as bench
from benchmarks.shares import assignment_estimate
from benchmarks.workloads import (
    HEAVY,
    LIGHT,
    SIZED_HEAVY,
    TRAIN_HEAVY,
    TRAIN_LIGHT,
    SkewedAgentsEnv,
    make_workload,
)
from flexmarl import devicemodel
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


def test_saturating_keeps_the_heavy_agents_replicas_full_so_fixed_shares_take_twice_the_best_step() -> None:
    workload = make_workload(3, "saturating")
    assert [dist for _, dist in workload.agents] == [HEAVY, LIGHT, LIGHT]
    assert workload.rotate_every_tasks == 8 * 4 and workload.rollout_tasks == 20  # the role moves every 8 steps
    assert make_workload(3, "shifting").rollout_tasks == 0  # rolloutd's default (8 tasks)
    env = SkewedAgentsEnv(**workload.environment_config(128.0))
    assert [a for a in env.agents if env.length_distribution(a, 32) == HEAVY] == ["reviewer"]
    profile = devicemodel.PRESETS["h100"].with_changes(token_scale=128.0)
    args = bench_args("--variant", "saturating")
    assert bench.rollout_max_tasks(workload, args) == 20
    assert bench.rollout_max_tasks(workload, bench_args("--rollout-max-tasks", "12")) == 12
    assert bench.rollout_max_tasks(make_workload(3, "shifting"), args) is None  # the staleness rule's
    spec = bench.job_spec(workload, "partial-no-lb", Path("/m"), 16, 128.0)
    assert bench.rolloutd_args(spec, 20, 1.0) == ["--max-tasks", "20", "--balancer-dispatch-kv-factor", "1.0"]
    # its backlog waits in rolloutd, not in the engines' queues (rolloutd --balancer-dispatch-kv-factor)
    assert bench.dispatch_kv_factor(workload, args) == 1.0
    assert bench.dispatch_kv_factor(make_workload(3, "shifting"), args) == 0.0
    assert bench.dispatch_kv_factor(workload, bench_args("--dispatch-kv-factor", "0")) == 0.0
    saturated = assignment_estimate(workload, profile, replicas=6, episodes=64, in_flight_episodes=20 * 16)
    heavy = saturated.best[0]
    # 4 replicas to the heavy agent, each full (its KV cache: ~55 sequences of 512 + ~3,200 tokens), 1 to each light
    assert [load.replicas for load in saturated.best] == [4, 1, 1]
    assert heavy.batch == pytest.approx(heavy.full_batch) and 50 < heavy.full_batch < 60
    assert saturated.ratio == pytest.approx(2.0, abs=0.01)  # full replicas: twice the replicas halve the heavy step
    assert saturated.fixed_step_s >= 1.4 * saturated.spread_s
    # rolloutd's default 8 tasks in flight (the shifting shape's) leave four heavy replicas half full: 1.44x at most
    starved = assignment_estimate(workload, profile, replicas=6, episodes=64, in_flight_episodes=8 * 16)
    assert starved.best[0].batch == pytest.approx(8 * 16 / 4)
    assert starved.ratio < 1.5


def bench_args(*argv: str) -> argparse.Namespace:
    """``benchmarks.run``'s parsed arguments (its parser, without running anything)."""
    return bench.parser().parse_args(list(argv))


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


def test_sized_runs_a_moving_heavy_agent_on_slots_of_2_1_1_devices_and_the_blind_ablation_differs_in_one_flag() -> None:
    workload = make_workload(4, "sized")
    assert [dist for _, dist in workload.agents] == [TRAIN_LIGHT, SIZED_HEAVY, TRAIN_LIGHT, TRAIN_LIGHT]
    # static sets (S = 3 < K = 4: agent i on slot i % 3) put the heavy agent alone on slot 1, of one device
    assert [i % 3 for i, (_, dist) in enumerate(workload.agents) if dist == SIZED_HEAVY] == [1]
    assert workload.rotate_every_tasks == 0 and make_workload(4, "sized", 6).rotate_every_tasks == 6 * 4
    args = bench_args("--variant", "sized", "--agents", "4")
    assert bench.slot_capacities(workload, args) == (2, 1, 1)
    assert bench.slot_capacities(workload, bench_args("--slot-capacity", "4,2")) == (4, 2)
    assert bench.slot_capacities(make_workload(3, "shifting"), bench_args("--slots", "3",
                                                                          "--train-devices-per-slot", "4")) == (4,) * 3
    # The job is flexmarl-partial's; only orchestratord's flag differs.
    assert bench.job_spec(workload, "partial-size-blind", Path("/m"), 4, 128.0)["pipeline"] == \
        bench.job_spec(workload, "flexmarl-partial", Path("/m"), 4, 128.0)["pipeline"]
    assert bench.ORCHESTRATORD_ARGS == {"partial-size-blind": ("--no-capacity-aware-binding",),
                                        "partial-no-lead": ("--binding-version-lead", "0")}
    # The binder's wall clocks run in modelled seconds at the run's time scale, before the ablation's flag.
    from flexmarl.config import load_config
    from orchestratord.config import OrchestratorConfig
    from orchestratord.planner import PlannerOptions
    flags = bench.orchestratord_args("partial-size-blind", 0.25)
    assert flags[-1] == "--no-capacity-aware-binding"
    config = load_config(OrchestratorConfig, list(flags), "orchestratord", env={})
    assert config.binding_max_wait_s == pytest.approx(PlannerOptions().max_wait_s * 0.25)
    assert config.binding_aging_per_s == pytest.approx(PlannerOptions().aging_per_s * 4)
    assert not config.capacity_aware_binding
    plain = load_config(OrchestratorConfig, list(bench.orchestratord_args("flexmarl-partial", 1.0)), "orchestratord",
                        env={})
    assert (plain.binding_max_wait_s, plain.binding_aging_per_s) == (PlannerOptions().max_wait_s,
                                                                     PlannerOptions().aging_per_s)
    # The bound counts devices: the heavy agent's own training on the 2-device slot, the rest over 4 devices.
    profile = devicemodel.PRESETS["h100"].with_changes(token_scale=128.0)
    trainer, slots = bench.bound_shape(profile, (2, 1, 1))
    assert (trainer.train_devices_per_slot, slots) == (1, 4)
    assert bench.bound_shape(profile, (4, 4, 4))[0].train_devices_per_slot == 4
    bound = bench.sized_bound(bench.workload_bound(workload, trainer, 6, slots, episodes=64), (2, 1, 1))
    assert bound.bound_by == "train" and bound.rollout_s < 0.6 * bound.train_s
    assert bound.train_s < bound.busiest_agent_train_s < 1.3 * bound.train_s
    # Device-busy seconds weigh each trace record by its slot's devices.
    records = [{"start_s": 0.0, "end_s": 2.0, "devices": 2}, {"start_s": 2.0, "end_s": 3.0, "devices": 1}]
    assert bench.device_busy_seconds([records, [{"start_s": 0.0, "end_s": 1.0}]], 0.0, 10.0) == 6.0


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


def test_the_impatient_ablation_is_flexmarl_partial_with_rolloutd_moving_at_once() -> None:
    from flexmarl.config import load_config
    from rolloutd.config import RolloutConfig
    workload = make_workload(3, "shifting")
    assert bench.job_spec(workload, "partial-impatient", Path("/m"), 4, 128.0) == \
        bench.job_spec(workload, "flexmarl-partial", Path("/m"), 4, 128.0) | {
            "name": bench.job_spec(workload, "partial-impatient", Path("/m"), 4, 128.0)["name"]}
    plain = bench.rolloutd_args(bench.job_spec(workload, "flexmarl-partial", Path("/m"), 4, 128.0))
    flags = [*plain, *bench.ROLLOUTD_ARGS["partial-impatient"]]
    assert load_config(RolloutConfig, flags, "rolloutd", env={}).balancer_move_patience == 0.0
    assert load_config(RolloutConfig, plain, "rolloutd", env={}).balancer_move_patience == 1.0
