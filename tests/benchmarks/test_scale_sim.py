"""The simulation drives the real planner and balancer; a tiny sweep finishes every configuration."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks import sim
from benchmarks.workloads import make_workload
from flexmarl import devicemodel
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


def test_allreduce_cost_follows_the_ring_formula() -> None:
    profile = devicemodel.H100_SXM
    assert sim.allreduce_s(profile, 1) == 0.0
    two, many = sim.allreduce_s(profile, 2), sim.allreduce_s(profile, 32)
    gradient_s = profile.model_params * profile.bytes_per_param / profile.link_bytes_per_s
    assert math.isclose(two, gradient_s) and math.isclose(many, 2 * 31 / 32 * gradient_s)


def test_agents_train_on_data_parallel_groups_and_only_rank_0_commits() -> None:
    """Slots advertise a dp_address, so the planner forms groups; a commit from another rank would be refused."""
    settings = sim.SimSettings(devices=24, devices_per_slot=2, group_size=4, steps=3)
    simulation = sim.Simulation("sequential", settings, make_workload(3, "long-tail"))
    outcome = simulation.run()
    assert outcome.state == "SUCCEEDED", outcome
    # sequential trains one agent at a time: every slot joins it
    assert outcome.max_group_size == settings.slots == 4
    assert all(slot.busy_s > 0 for slot in simulation.slots)
    single = sim.Simulation(
        "sequential", dataclasses.replace(settings, max_slots=1), make_workload(3, "long-tail")
    ).run()
    assert single.max_group_size == 1
    assert outcome.step_s < single.step_s


def test_the_hysteresis_applies_to_the_whole_plan_so_a_group_of_ten_still_grows() -> None:
    """One replica more cuts a group of n's drain time by only 1/(n+1) < 10 %.

    The balancer once applied its 10 % hysteresis to each move, so a bottleneck group of ten
    never grew (the sweep showed no moves). The margin now applies to the whole plan: the idle
    groups give all their replicas (only a group with demand keeps its last one), and a plan that cannot reach the
    margin is undone.
    """
    from rolloutd.balancer import AgentSpec, BalancerConfig, ReplicaAssignment

    def balancer(hysteresis: float) -> HierarchicalBalancer:
        replicas = [ReplicaAssignment(f"r{i:02d}", ("a", "b", "c")[i % 3]) for i in range(30)]
        made = HierarchicalBalancer(
            replicas, [AgentSpec(k, k) for k in "abc"], BalancerConfig(hysteresis=hysteresis, reassignment_cost_s=0.0)
        )
        made.set_demand_hint("a", 10_000_000)
        return made

    moves = balancer(BalancerConfig().hysteresis).rebalance(0.0)
    assert {m.to_model_key for m in moves} == {"a"}
    assert len(moves) == 20  # every replica of the groups without demand
    # 30 replicas instead of 10 cut the drain time by 67 %: a 0.7 margin blocks the plan, whole.
    blocked = balancer(0.7)
    assert blocked.rebalance(0.0) == []
    assert blocked.replica_counts() == {"a": 10, "b": 10, "c": 10}
    assert blocked.reassignments == 0


def test_the_control_plane_cpu_is_measured_around_the_real_calls_and_leases_are_counted() -> None:
    """Partial rollouts (interruption on publish) finish; CPU is timed inside the planner and balancer themselves."""
    settings = sim.SimSettings(devices=12, devices_per_slot=2, group_size=4, steps=3)
    simulation = sim.Simulation("flexmarl-partial", settings, make_workload(3, "long-tail"))
    assert type(simulation.planner) is Planner and type(simulation.balancer) is HierarchicalBalancer
    outcome = simulation.run()
    assert outcome.state == "SUCCEEDED"
    assert outcome.planner_cpu_s > 0 and outcome.balancer_cpu_s > 0
    assert outcome.planner_calls > 0 and outcome.balancer_calls > 0
    ops = outcome.lease_ops
    # step_fill completion at eta 8 leases ahead: the steps take the first tasks to finish; the rest are abandoned.
    assert ops["lease"] >= ops["report"] >= 3 * settings.prompts_per_step
    assert ops["commit"] == 3 * 3 and ops["renew"] > 0
    assert outcome.modelled_s > 0 and 0 < outcome.control_cpu_share < 1
    assert outcome.control_cpu_per_step_s == outcome.control_cpu_share * outcome.step_s
    # A published version interrupted replicas serving the agent: they reloaded while generations ran.
    assert len(simulation.reload_log) > 3
    assert "cpu/step" in sim.cpu_table([outcome])


def test_each_rolloutd_balances_its_own_replicas_and_leases_its_share() -> None:
    """One balancer per rolloutd process over its own replicas, as rolloutd runs (benchmarks/sim_rolloutd.py).

    Every request runs on a replica of the process that leased its task (the simulation raises
    otherwise), each process leases tasks up to its share of the admission window, and the CPU is
    kept per process: the busiest one's share is at most the whole control plane's.
    """
    settings = sim.SimSettings(devices=30, devices_per_slot=2, group_size=4, steps=3, replicas_per_rolloutd=5)
    simulation = sim.Simulation("flexmarl", settings, make_workload(3, "long-tail"))
    assert settings.replicas == 20 and settings.rolloutds == 4
    processes = simulation.rolloutds
    assert [len(p.replica_ids) for p in processes] == [5, 5, 5, 5]
    for process in processes:
        assert type(process.balancer) is HierarchicalBalancer
        assert {v.replica_id for v in process.balancer.replicas()} == set(process.replica_ids)
        # the admission window, (max_staleness 1 + 1) x 10 prompts, a quarter each
        assert process.max_tasks == 5
    outcome = simulation.run()
    assert outcome.state == "SUCCEEDED", outcome
    assert outcome.rolloutds == 4
    assert all(p.leased > 0 and p.cpu_s > 0 for p in processes)
    assert sum(p.leased for p in processes) == outcome.lease_ops["lease"]
    assert math.isclose(outcome.balancer_cpu_s, sum(p.cpu_s for p in processes))
    assert outcome.busiest_rolloutd_cpu_s == max(p.cpu_s for p in processes) < outcome.balancer_cpu_s
    assert 0 < outcome.busiest_process_share <= outcome.control_cpu_share
    assert outcome.reassignments == sum(p.balancer.reassignments for p in processes)
    # Spread evenly, 64 or more each (sizes differ by one at most), not 64 each and a small rest: 2,560 devices.
    from benchmarks.sim_rolloutd import partition

    ids = [f"r{i:04d}" for i in range(1707)]
    runs = partition(ids, 64)
    assert len(runs) == 26 and {len(r) for r in runs} == {65, 66} and [i for r in runs for i in r] == ids
    assert [len(r) for r in partition(ids[:100], 64)] == [100] and len(partition(ids[:10], 64)) == 1
    assert partition(ids, 0) == [tuple(ids)]


def test_the_default_share_of_slots_is_the_floor_so_agents_meeting_at_a_step_boundary_all_get_it() -> None:
    """64 agents reaching a step boundary together: ceil(106 / 64) = 2 each left 22 agents one slot."""
    at_2560 = sim.SimSettings(devices=2560, agents=64)
    assert at_2560.slots == 106 and at_2560.agent_max_slots("flexmarl") == 1
    assert at_2560.agent_max_slots("sequential") == 106
    at_10240 = sim.SimSettings(devices=10240, agents=64)
    assert at_10240.slots == 426 and at_10240.agent_max_slots("flexmarl") == 6
    assert sim.SimSettings(devices=48, agents=64).agent_max_slots("flexmarl") == 1


def test_orchestratords_tick_and_demand_push_run_at_the_coordinators_intervals() -> None:
    """The simulation's orchestratord loop uses the coordinator's own intervals, and its CPU counts as the planner's."""
    from benchmarks import sim_orchestratord
    from orchestratord import coordinator

    assert sim_orchestratord.TICK_INTERVAL_S == coordinator.TICK_INTERVAL_S
    assert sim_orchestratord.DEMAND_INTERVAL_S == coordinator.DEMAND_INTERVAL_S
    settings = sim.SimSettings(devices=12, devices_per_slot=2, group_size=4, steps=2)
    simulation = sim.Simulation("flexmarl", settings, make_workload(3, "long-tail"))
    pushes = 0
    push = simulation.balance

    def counted() -> None:
        nonlocal pushes
        pushes += 1
        push()

    simulation.balance = counted  # type: ignore[method-assign]
    outcome = simulation.run()
    assert outcome.state == "SUCCEEDED"
    ticks = simulation.orchestratord_ticks
    assert abs(ticks - outcome.modelled_s / coordinator.TICK_INTERVAL_S) <= 2
    assert abs(pushes - outcome.modelled_s / coordinator.DEMAND_INTERVAL_S) <= 2
    assert simulation.coordinator.bubble_slots > 0  # observed: some slot sat idle while the job ran


def test_each_balancer_decides_on_what_its_router_measures_unless_told_the_priors() -> None:
    """As rolloutd's router (--balancer-measured-rates, its default): the replicas' measured capacity and the
    measured weight-load seconds reach every process's balancer; with the priors they stay 1,000 tokens/s, 10 s."""
    settings = sim.SimSettings(devices=30, devices_per_slot=2, group_size=4, steps=3, replicas_per_rolloutd=5)
    measured = sim.Simulation("flexmarl", settings, make_workload(3, "long-tail"))
    assert measured.run().state == "SUCCEEDED"
    load_s = devicemodel.weight_transfer_s(measured.profile)
    for process in measured.rolloutds:
        assert process.measured is not None and not process.marks  # every generation begun was ended
        rates = {view.tokens_per_s for view in process.balancer.replicas()}
        assert rates == {process.measured.capacity} and process.measured.capacity != 1000.0
        assert math.isclose(process.balancer.reassignment_cost_s, load_s)
    priors = sim.Simulation("flexmarl", dataclasses.replace(settings, measured_rates=False),
                            make_workload(3, "long-tail"))
    assert priors.run().state == "SUCCEEDED"
    for process in priors.rolloutds:
        assert process.measured is None
        assert {view.tokens_per_s for view in process.balancer.replicas()} == {1000.0}
        assert process.balancer.reassignment_cost_s == 10.0


def test_each_run_is_measured_under_the_daemons_gc_policy_and_cpythons_and_both_model_the_same() -> None:
    """benchmarks/sim_gc.py applies flexmarl.gc_policy as a daemon does; the policy changes no decision."""
    import gc

    from benchmarks.sim_gc import same_model

    thresholds = gc.get_threshold()
    base = sim.SimSettings(devices_per_slot=2, episodes_per_replica=2, group_size=4, steps=2, agents=3)
    daemon, cpython = sim.sweep([12], ["flexmarl-partial"], base, gc_policies=("daemon", "cpython"))
    assert (daemon.gc_policy, cpython.gc_policy) == ("daemon", "cpython")
    assert same_model(daemon, cpython) and daemon.events > 0
    assert daemon.gc_frozen_objects > 1000 and cpython.gc_frozen_objects == 0  # the sim's start-up, frozen once
    assert sum(cpython.gc_collections) > 0 and cpython.gc_cpu_s > 0  # CPython collects every 700 allocations
    assert sum(daemon.gc_collections) < sum(cpython.gc_collections)
    assert 0 <= cpython.gc_measured_cpu_s <= cpython.gc_cpu_s
    # Nothing stays frozen after a run (a sweep frees each run's objects) and CPython's thresholds are back.
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds and gc.isenabled()
    assert "flexmarl-partial/daemon" in sim.cpu_table([daemon, cpython])
    assert sim.table([daemon, cpython]).count("flexmarl-partial") == 1


def test_collections_inside_a_measured_call_are_told_apart() -> None:
    """benchmarks.sim_gc.CollectionMeter: a collection that a timed call runs is counted in the measured CPU."""
    import gc

    from benchmarks.control_cpu import CpuMeter
    from benchmarks.sim_gc import CollectionMeter

    class Planner:
        def plan(self) -> int:
            return gc.collect(0)

    cpu = CpuMeter()
    planner = Planner()
    cpu.wrap("planner", planner)
    meter = CollectionMeter([cpu])
    gc.callbacks.append(meter)
    try:
        gc.collect(0)  # outside any measured call
        outside_s = meter.seconds
        for _ in range(20):
            planner.plan()
    finally:
        gc.callbacks.remove(meter)
    assert meter.collections[0] == 21 and not cpu.inside
    assert meter.measured_seconds == pytest.approx(meter.seconds - outside_s)
    assert 0 < meter.measured_seconds <= cpu.seconds["planner"]
