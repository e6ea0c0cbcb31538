"""LoRA costs of the device model against hand-computed values, and the LoRA mode of the simulation."""

from __future__ import annotations

import math

import pytest

from benchmarks import lora_sim, sim
from benchmarks.bound import AgentStepWork, device_work_bound
from benchmarks.workloads import make_workload
from flexmarl import devicemodel as dm
from flexmarl.errors import InvalidArgument
from rolloutd.balancer import BASE_ADAPTER, HierarchicalBalancer
from rolloutd.lora_residency import AdapterVersion, LoraResidency

# Hand computation, Qwen2.5-14B (hidden 5120, k/v 8 heads x 128 = 1024, MLP 13824, 48 layers):
#   rank 8 on q, k, v, o: per layer (5120 + 5120) + (5120 + 1024) + (5120 + 1024) + (5120 + 5120) = 32768
#   A = 8 * 32768 * 48 = 12,582,912 parameters; BF16: 25,165,824 B.
A = 12_582_912
ADAPTER_BYTES = 25_165_824
LINK = 50e9
P = 14.7e9


def test_adapter_parameters_are_rank_times_the_matrices_sides_per_layer() -> None:
    shape = dm.qwen25_14b_lora(8)
    assert shape.params == A
    assert dm.adapter_bytes(dm.H100_SXM, shape) == ADAPTER_BYTES
    # rank 16 on all seven linear modules: 32768 + 2 * (5120 + 13824) + (13824 + 5120) = 89600 per layer
    every = dm.qwen25_14b_lora(16, tuple(dm.QWEN25_14B_LINEAR_SHAPES))
    assert every.params == 16 * 89_600 * 48 == 68_812_800
    with pytest.raises(InvalidArgument):
        dm.qwen25_14b_lora(8, ("q_proj", "attn.c_attn"))
    with pytest.raises(InvalidArgument):
        dm.LoraShape(0, ((8, 8),), 1)


def test_adapter_load_and_swap_move_the_adapter_not_the_model() -> None:
    shape = dm.qwen25_14b_lora(8)
    assert dm.adapter_transfer_s(dm.H100_SXM, shape) == pytest.approx(ADAPTER_BYTES / LINK)  # 0.503 ms
    assert dm.adapter_transfer_s(dm.H100_SXM, shape) == pytest.approx(5.0331648e-4)
    # adapter + optimizer: 12,582,912 * (2 + 16) B = 226,492,416 B over 50 GB/s = 4.53 ms, the full state 5.292 s
    assert dm.lora_swap_s(dm.H100_SXM, shape) == pytest.approx(4.52984832e-3)
    assert dm.swap_s(dm.H100_SXM) == pytest.approx(5.292)
    assert dm.swap_s(dm.H100_SXM) / dm.lora_swap_s(dm.H100_SXM, shape) == pytest.approx(1168.3, rel=1e-4)


def test_training_with_a_frozen_base_costs_two_thirds_of_full_training_plus_the_adapter() -> None:
    shape = dm.qwen25_14b_lora(8)
    # (4 * 14.7e9 + 6 * 12,582,912) * 1000 / (989e12 * 0.4 * 8) = 5.8875497472e13 / 3.1648e15
    assert dm.lora_train_tokens_s(dm.H100_SXM, shape, 1000) == pytest.approx(0.0186032, rel=1e-5)
    adapter_s = 6 * A * 1000 / (989e12 * 0.4 * 8)
    base_s = dm.lora_train_tokens_s(dm.H100_SXM, shape, 1000) - adapter_s
    assert base_s == pytest.approx(2 / 3 * dm.train_tokens_s(dm.H100_SXM, 1000))
    # Adam over the adapter: 12,582,912 * 16 B / (3.35e12 * 0.7 * 8) = 10.73 us, plus publishing it (0.503 ms)
    assert dm.lora_optimizer_step_s(dm.H100_SXM, shape) == pytest.approx(1.07317e-5 + 5.0331648e-4, rel=1e-5)


def test_a_batch_reads_the_base_once_and_each_running_adapter_once() -> None:
    shape = dm.qwen25_14b_lora(8)
    # batch of one, no context, eight adapters: (29.4e9 + 8 * 25,165,824) / 2.345e12 = 12.623 ms
    assert dm.lora_decode_iteration_s(dm.H100_SXM, shape, 1, 0, 8) == pytest.approx(0.0126232, rel=1e-5)
    base_only = dm.decode_iteration_s(dm.H100_SXM, 1, 0)
    assert dm.lora_decode_iteration_s(dm.H100_SXM, shape, 1, 0, 0) == pytest.approx(base_only)
    assert dm.lora_decode_iteration_s(dm.H100_SXM, shape, 0, 0, 0) == 0.0
    assert dm.lora_prefill_s(dm.H100_SXM, shape, 512) == pytest.approx(dm.prefill_s(dm.H100_SXM, 512) * (1 + A / P))


def test_the_lora_bound_swaps_reloads_and_training_for_the_adapter_costs() -> None:
    profile, shape = dm.H100_SXM, dm.qwen25_14b_lora(8)
    work = [AgentStepWork("a", 8, 4000.0), AgentStepWork("b", 8, 1000.0), AgentStepWork("idle", 0, 0.0)]
    full = device_work_bound(profile, work, prompt_tokens=512, replicas=4, slots=1)
    lora = lora_sim.lora_work_bound(profile, shape, work, prompt_tokens=512, replicas=4, slots=1)
    delta = 2 * (dm.adapter_transfer_s(profile, shape) - dm.weight_transfer_s(profile))
    assert lora.rollout_replica_s == pytest.approx(full.rollout_replica_s + delta)
    train = sum(dm.lora_train_tokens_s(profile, shape, 8 * 512 + r) for r in (4000.0, 1000.0))
    assert lora.train_slot_s == pytest.approx(train + 2 * dm.lora_optimizer_step_s(profile, shape))


class _CheckedLoraSimulation(lora_sim.LoraSimulation):
    """Records the most distinct agents and adapter names any replica's batch ran at once.

    Also checks that every name a batch runs is one the balancer counts on that replica.
    """

    most_agents = 0
    most_names = 0

    def iteration_s(self, replica: sim._Replica) -> float:
        agents = {self.tickets[seq.request_id][1] for seq in replica.running}
        self.most_agents = max(self.most_agents, len(agents))
        names = self.running_adapters(replica)
        self.most_names = max(self.most_names, len(names))
        (view,) = [v for v in self.balancer.replicas() if v.replica_id == replica.replica_id]
        assert names <= set(view.adapters), (names, view.adapters)
        return super().iteration_s(replica)


def test_the_sim_submits_the_names_the_router_serves() -> None:
    settings = sim.SimSettings(devices=6, devices_per_slot=2, group_size=4, episodes_per_replica=2, steps=2)
    workload = make_workload(3, "long-tail")
    lora = lora_sim.LoraSimulation("flexmarl", settings, workload, lora_sim.LoraOptions())
    lora.loop.close()
    assert lora.adapter_name("a", 0) == BASE_ADAPTER  # version 0: the base alone, one name for the pool
    assert lora.adapter_name("a", 3) == str(AdapterVersion("a", 3)) == "a@v3"
    assert sim.Simulation("flexmarl", settings, workload).adapter_name("a", 3) is None  # a full model: no name


def test_lora_agents_share_the_pool_within_the_adapter_bound_and_swap_cheaply() -> None:
    settings = sim.SimSettings(devices=6, devices_per_slot=2, group_size=4, episodes_per_replica=2, steps=3)
    workload = make_workload(3, "long-tail")
    simulation = _CheckedLoraSimulation("flexmarl", settings, workload, lora_sim.LoraOptions(max_loras_per_batch=1))
    assert type(simulation.balancer) is HierarchicalBalancer
    outcome = simulation.run()
    assert outcome.state == "SUCCEEDED", outcome
    assert simulation.most_names == 1  # the real balancer's adapter-slot rule held every replica to one name
    assert simulation.most_agents > 1  # version 0 of every agent is the one base name: they share the slot
    assert simulation.over_bound_starts == 0
    assert outcome.reassignments == 0  # one pool: no replica moves between agents
    assert all(type(r) is LoraResidency for r in simulation.residency.values())
    adapter_loads = sum(r.loads for r in simulation.residency.values())
    assert adapter_loads > 0 and len(simulation.reload_log) == adapter_loads + simulation.replica_base_loads
    assert simulation.replica_base_loads == len(simulation.replicas)  # each replica read the frozen base once
    assert simulation.base_loads == 1 and simulation.swap_log  # the one slot read the base once, then swapped
    full = lora_sim.run_mode("full", "flexmarl", settings, workload, lora_sim.LoraOptions())
    assert full.sim.state == "SUCCEEDED" and math.isfinite(full.sim.step_s)
    assert outcome.train_busy < full.sim.train_busy  # 4.5 ms adapter swaps instead of 5.3 s state swaps
