"""The simulation drives the real planner and balancer; a tiny sweep finishes every configuration."""

from __future__ import annotations

import math

from benchmarks import sim
from benchmarks.workloads import make_workload
from orchestratord.planner import Planner
from rolloutd.balancer import HierarchicalBalancer


def test_simulation_uses_the_real_policies() -> None:
    simulation = sim.Simulation(
        "flexmarl", sim.SimSettings(devices=12, devices_per_slot=2, steps=2), make_workload(2, "long-tail")
    )
    assert type(simulation.planner) is Planner
    assert type(simulation.balancer) is HierarchicalBalancer


def test_tiny_sweep_completes_and_orders_the_baselines() -> None:
    base = sim.SimSettings(devices_per_slot=2, episodes_per_replica=2, group_size=4, steps=3, agents=3)
    outcomes = sim.sweep([12, 24], ["flexmarl", "static", "sequential"], base)
    assert len(outcomes) == 6
    for outcome in outcomes:
        assert outcome.state == "SUCCEEDED", outcome
        assert math.isfinite(outcome.step_s) and outcome.step_s > 0
        assert 0 < outcome.rollout_busy <= 1 and 0 < outcome.train_busy <= 1
    by = {(o.devices, o.config): o for o in outcomes}
    for devices in (12, 24):
        # sequential trains the agents one after another after a barrier: never faster than static
        assert by[(devices, "sequential")].step_s >= by[(devices, "static")].step_s
    assert "speedup" in sim.table(outcomes)


def test_simulation_is_deterministic() -> None:
    settings = sim.SimSettings(devices=12, devices_per_slot=2, group_size=4, steps=2)
    workload = make_workload(3, "long-tail")
    first = sim.Simulation("static", settings, workload).run()
    second = sim.Simulation("static", settings, workload).run()
    assert (first.step_s, first.tokens_per_s, first.events) == (second.step_s, second.tokens_per_s, second.events)


def test_a_sixteen_agent_spec_longer_than_a_file_name_loads() -> None:
    """rolloutd and traind receive the spec as one line of JSON; at 16 agents it exceeds NAME_MAX (255)."""
    import json

    from flexmarl.jobspec import load_job_spec

    agents = [{"name": f"agent{i}", "model": "base-model"} for i in range(16)]
    text = json.dumps(
        {
            "name": "wide",
            "environment": {"entrypoint": "benchmarks.workloads:SkewedAgentsEnv"},
            "agents": agents,
            "algorithm": {"name": "grpo"},
            "total_steps": 1,
            "batch": {"prompts_per_step": 1, "group_size": 2, "micro_batch_size": 2},
        }
    )
    assert len(text) > 255 and "\n" not in text
    assert load_job_spec(text).agent_names == tuple(f"agent{i}" for i in range(16))
