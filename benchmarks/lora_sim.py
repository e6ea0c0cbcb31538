"""LoRA vs full-model agents through the device model: 16 agents of one 14.7 B base on 8 devices (issue 17).

    python -m benchmarks.lora_sim                      # 16 agents, 8 devices (4 replicas + 1 slot of 4)
    python -m benchmarks.lora_sim --rank 16 --targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj

The same discrete-event simulation as :mod:`benchmarks.sim` (the real
:class:`orchestratord.planner.Planner` and :class:`rolloutd.balancer.HierarchicalBalancer` on a
virtual clock, device time from :mod:`flexmarl.devicemodel`, H100 preset, Qwen2.5-14B), run in
three modes on one cluster and one workload:

* **full**: every agent is a full 14.7 B model (what :class:`benchmarks.sim.Simulation` models).
  Each agent is its own model group on the rollout side, so a replica that serves another agent
  (or a newer version of its agent) reloads the whole weights (``weight_transfer_s``, 0.59 s)
  and the balancer moves replicas between the 16 groups; a trainer slot that switches agents
  swaps the full training state in (``swap_s``, weights + optimizer, 5.29 s) and, where the
  planner asks, out.
* **full-free-swaps**: the full mode with the trainer's state swaps charged nothing (still
  counted), to separate what the swaps cost the step from what the rollout side costs.
* **lora**: every agent is a LoRA adapter over the same frozen base (the job spec's
  ``lora: {rank, target_modules}``, ``max_slots: 1`` as the spec requires). Rollout drives what
  rolloutd does for LoRA agents:

  - the balancer is built as ``RolloutRouter.set_agents`` builds it for LoRA agents: every agent
    an ``AgentSpec(adapter=True)`` of the base's pool (``lora_pool_key``), every replica in the
    pool (``equal_split`` over one group), ``adapter_slots = {pool: max_loras_per_batch}``
    (``--max-loras-per-batch``, rolloutd's ``engine_max_loras_per_batch``, default 8 as SGLang's);
  - as the router does, a request's version is fixed when it is submitted (the one its agent
    requires then) and the request carries the adapter name it is served with
    (:meth:`LoraSimulation.adapter_name`, RolloutRouter._adapter_name): ``<agent>@v<k>``, and
    for version 0 the base alone, :data:`rolloutd.balancer.BASE_ADAPTER`, one name shared by all
    the agents. The real balancer then keeps each replica within ``max_loras_per_batch``
    distinct running names, as SGLang's scheduler counts them (requests beyond it wait in its
    per-name FIFO; an agent switching versions holds two slots while both run), and never moves
    a replica, since the pool is one group;
  - each replica has a real :class:`rolloutd.lora_residency.LoraResidency` (the one rolloutd
    keeps per replica), driven on one event loop: a request of version 1 or later enters
    ``use(agent, version)`` when it joins the batch and leaves it when it ends, so the residency
    decides when an adapter version is loaded (once per replica and version) and when older
    versions are unloaded; a version-0 request runs on the base alone and loads nothing (the
    router sends it without ``lora_path``). Each load it makes stalls the replica's batch for
    ``adapter_transfer_s`` (the adapter's ``A * bytes_per_param`` over the link, 0.50 ms at
    rank 8 on q, k, v, o). The engine behind it is :class:`ModelledAdapterEngine`, which records
    the two calls the residency makes and nothing else (time is the simulation's). rolloutd's
    ``engine_max_loaded_loras`` is 0 (no bound) by default, so an unload never forces a later
    reload;
  - a replica's first request loads the base itself (``weight_transfer_s``, once: the base is
    frozen), as a full-model replica's first request loads its agent;
  - decode: ``lora_decode_iteration_s`` with the distinct adapter versions (names) running in the
    batch, the base alone not among them (it reads no adapter), prefill ``lora_prefill_s``.

  Training: the planner binds one agent to a slot at a time, as for full models (it knows
  nothing of LoRA), and traind builds one agent's engine per slot at a time; what makes several
  adapter agents fit one slot is traind's ``LoraBaseCache``: the base stays on the slot across
  their switches, and a switch moves only the adapter and its optimizer state
  (``lora_swap_s``, 4.5 ms). The slot reads the base once, before its first adapter agent
  (``weight_transfer_s``; in step 0, outside the measured steps). Forward + backward is
  ``lora_train_tokens_s``: ``(4 P + 6 A)`` FLOPs per token, the frozen base costing 2/3 of full
  training's ``6 P`` (forward 2 P and activation gradients 2 P, which must flow through every
  frozen layer down to the lowest adapter; no weight gradients for the base), the adapter
  ``6 A`` as any trained weight. The optimizer step runs over the adapter's parameters only
  (``lora_optimizer_step_s``: ``A * optimizer_bytes_per_param`` through HBM, plus publishing the
  adapter over the link).

Both modes charge version 0 nothing on the trainer (the engine is built from the checkpoint; an
adapter starts from its initialisation). Assumptions of both modes are the device model's
(docs/benchmarks.md) and the sim's (docs/benchmarks-scale.md); besides them, not modelled:
trainer memory (a full 14.7 B agent's state, 18 B per parameter = 265 GB, must fit the slot's
4 × 80 GB, e.g. ZeRO-3 over the slot; the planner's slot model has no capacity), SGLang's LoRA GPU
memory pool (adapters moved host → device when the batch's set changes, the same order of bytes
as a load), and the LoRA kernels' efficiency against dense GEMMs. SGLang's own admission beyond
``max_loras_per_batch`` names never comes into play, since the balancer counts the names SGLang
counts: ``over_bound_starts`` in the JSON counts the requests that joined a batch which then ran
more names than that (0: the sim checks that the balancer's slots held).

Columns: step s (mean over steps 1..n-1, as :mod:`benchmarks.sim`); the device-work bound of a
step (:func:`lora_work_bound` for LoRA: :func:`benchmarks.bound.device_work_bound` with the LoRA
training, optimizer and reload costs); chain s, the latency of the step's longest episode
(:func:`chain_s`: its turns one after another, each alone on a replica; mean over the measured
steps); busy fractions of replicas and slots; per measured step, trainer state swaps (swap-ins
of a committed state and swap-outs), replica reloads (weights or adapters) and waits (requests
that found no replica when submitted and waited in the balancer: full, no replica served their
agent; lora, every pool replica ran ``max_loras_per_batch`` other adapter names); replica moves.
Writes ``<out>/lora_sim.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from benchmarks.bound import AgentStepWork, DeviceWorkBound, device_work_bound, mean_bound
from benchmarks.report import Column, render_table
from benchmarks.sim import SIM_CONFIGS, SimOutcome, SimSettings, Simulation, _Replica, _Seq, _Slot, work_version
from benchmarks.workloads import Workload, make_workload
from flexmarl import devicemodel
from orchestratord.planner import MicroBatchWork, OptimizerStepWork
from rolloutd.balancer import BASE_ADAPTER, AgentSpec, BalancerConfig, HierarchicalBalancer, equal_split
from rolloutd.engines.lora import DEFAULT_MAX_LORAS_PER_BATCH
from rolloutd.engines.protocol import EngineClient, LoraAdapterResult
from rolloutd.lora_residency import AdapterVersion, LoraResidency
from rolloutd.router import lora_pool_key

SIM_BASE = "/sim/base"  # the model every agent of benchmarks.sim's job spec names
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelledAdapterEngine:
    """The replica engine as :class:`LoraResidency` uses it: the adapter names it holds, no device time.

    LoraResidency calls only ``load_lora_adapter`` and ``unload_lora_adapter``; the simulation
    charges each load's device time to the replica's batch.
    """

    def __init__(self) -> None:
        """An engine holding no adapter."""
        self.loaded: dict[str, str] = {}

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraAdapterResult:
        """Holds ``lora_name`` from now on."""
        del pinned
        self.loaded[lora_name] = lora_path
        return LoraAdapterResult(True, "", dict(self.loaded))

    async def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """Holds ``lora_name`` no longer."""
        self.loaded.pop(lora_name, None)
        return LoraAdapterResult(True, "", dict(self.loaded))


async def _resolve_weights(uri: str) -> str:
    """The simulation's adapter URIs name no files: the URI is its own path."""
    return uri


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """What makes the agents LoRA adapters: their shape and the engines' adapter bound."""

    rank: int = 8
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH

    @property
    def shape(self) -> devicemodel.LoraShape:
        """The adapter over Qwen2.5-14B (the device model's model)."""
        return devicemodel.qwen25_14b_lora(self.rank, self.target_modules)


class LoraSimulation(Simulation):
    """:class:`benchmarks.sim.Simulation` with every agent a LoRA adapter over the one base (module docstring).

    The replicas' residencies run on an event loop of the simulation's own, which :meth:`run` closes.
    """

    def __init__(
        self,
        config: str,
        settings: SimSettings,
        workload: Workload,
        lora: LoraOptions,
        profile: devicemodel.DeviceProfile | None = None,
    ) -> None:
        """One configuration of one cluster, its agents adapters of ``lora``'s shape."""
        self.lora = lora
        self.shape = lora.shape
        self.pool = lora_pool_key(SIM_BASE)
        self.loop = asyncio.new_event_loop()
        self.residency: dict[str, LoraResidency] = {}
        self.engines: dict[str, ModelledAdapterEngine] = {}
        self.adapter_uses: dict[int, contextlib.AbstractAsyncContextManager[str]] = {}
        self.slots_with_base: set[str] = set()
        self.base_loads = 0
        self.replica_base_loads = 0
        self.over_bound_starts = 0
        super().__init__(config, settings, workload, profile)

    def agent_entry(self, agent: str) -> dict[str, Any]:
        """A LoRA agent over ``/sim/base``: the spec's ``lora`` section, one slot (the spec's rule for LoRA)."""
        entry = super().agent_entry(agent)
        entry["lora"] = {"rank": self.lora.rank, "target_modules": list(self.lora.target_modules)}
        entry["max_slots"] = 1
        return entry

    def make_balancer(self, config: BalancerConfig, replica_ids: Sequence[str]) -> HierarchicalBalancer:
        """As RolloutRouter.set_agents builds it for LoRA agents of one base: one pool, bounded adapter slots."""
        split = equal_split(list(replica_ids), [self.pool])
        agents = [AgentSpec(a, self.pool, adapter=True) for a in self.agents]
        return HierarchicalBalancer(split, agents, config, adapter_slots={self.pool: self.lora.max_loras_per_batch})

    def adapter_name(self, agent: str, version: int) -> str:
        """As RolloutRouter._adapter_name: ``<agent>@v<k>``, and the base alone (:data:`BASE_ADAPTER`) for version 0.

        Version 0 is the base: the sim's agents start from a fresh adapter (``lora_B = 0``), whose
        weights URI is the base's, so the router serves it without ``lora_path``.
        """
        return BASE_ADAPTER if version == 0 else str(AdapterVersion(agent, version))

    # ---- replicas ---------------------------------------------------------------------------------------------
    def running_adapters(self, replica: _Replica) -> set[str]:
        """The adapter names the replica's batch runs now (:data:`BASE_ADAPTER` among them: SGLang counts it)."""
        names = set()
        for seq in replica.running:
            agent = self.tickets[seq.request_id][1]
            names.add(self.adapter_name(agent, seq.episode.behaviour[agent]))
        return names

    def iteration_s(self, replica: _Replica) -> float:
        """One decode iteration of the base plus every adapter the batch runs (the base alone reads none)."""
        return devicemodel.lora_decode_iteration_s(
            self.profile,
            self.shape,
            len(replica.running),
            sum(seq.context for seq in replica.running),
            len(self.running_adapters(replica) - {BASE_ADAPTER}),
        )

    def prefill_s(self) -> float:
        """A prompt's prefill through the base and its adapter."""
        return devicemodel.lora_prefill_s(self.profile, self.shape, self.workload.prompt_tokens)

    def load_stall_s(self, replica: _Replica, request_id: int, agent: str, version: int) -> float:
        """The base once per replica, then whatever adapter load the replica's LoraResidency makes.

        As RolloutRouter._run_adapter: a version-0 request runs on the base alone (no residency,
        no load); any other enters the replica's residency (made on its first such request).
        """
        stall_s = 0.0
        if replica.loaded != (self.pool, 0):  # the frozen base: one version for the whole job
            replica.loaded = (self.pool, 0)
            self.replica_base_loads += 1
            base_s = devicemodel.weight_transfer_s(self.profile)
            self.reload_log.append((self.now_s, base_s))
            stall_s += base_s
        name = self.adapter_name(agent, version)
        names = self.running_adapters(replica) | {name}
        if len(names) > self.lora.max_loras_per_batch:  # the balancer's slots should never allow it
            self.over_bound_starts += 1
        if name == BASE_ADAPTER:
            return stall_s
        residency = self.residency.get(replica.replica_id)
        if residency is None:
            engine = self.engines[replica.replica_id] = ModelledAdapterEngine()
            residency = LoraResidency(cast(EngineClient, engine), _resolve_weights)
            self.residency[replica.replica_id] = residency
        loads = residency.loads
        use = residency.use(agent, version, f"file:///sim/{agent}/v{version}")
        self.loop.run_until_complete(use.__aenter__())
        self.adapter_uses[request_id] = use
        if residency.loads > loads:
            load_s = devicemodel.adapter_transfer_s(self.profile, self.shape)
            self.reload_log.append((self.now_s, load_s))
            stall_s += load_s
        return stall_s

    def finish_turn(self, seq: _Seq) -> None:
        """The request leaves its adapter (the residency may unload an older version), then as for full models."""
        self._leave(seq.request_id)
        super().finish_turn(seq)

    def _leave(self, request_id: int) -> None:
        use = self.adapter_uses.pop(request_id, None)
        if use is not None:
            self.loop.run_until_complete(use.__aexit__(None, None, None))

    # ---- trainer slots ----------------------------------------------------------------------------------------
    def swap_in_s(self, slot: _Slot, work: MicroBatchWork | OptimizerStepWork) -> float:
        """The base once per slot (traind's LoraBaseCache keeps it), then the adapter agent's committed state."""
        cost_s = 0.0
        if slot.slot_id not in self.slots_with_base:
            self.slots_with_base.add(slot.slot_id)
            self.base_loads += 1
            cost_s += devicemodel.weight_transfer_s(self.profile)
        if work_version(work) > 0:
            swap_s = devicemodel.lora_swap_s(self.profile, self.shape)
            self.swap_log.append((self.now_s, swap_s))
            cost_s += swap_s
        return cost_s

    def swap_out_s(self) -> float:
        """Adapter + optimizer state over the link; the base stays on the slot."""
        return devicemodel.lora_swap_s(self.profile, self.shape)

    def train_s(self, tokens: float) -> float:
        """Forward + backward with a frozen base."""
        return devicemodel.lora_train_tokens_s(self.profile, self.shape, tokens)

    def optimizer_s(self) -> float:
        """Adam over the adapter's parameters, then publishing the adapter."""
        return devicemodel.lora_optimizer_step_s(self.profile, self.shape)

    def run(self, max_events: int = 5_000_000) -> SimOutcome:
        """As :meth:`Simulation.run`; afterwards every request still running leaves its adapter and the loop closes."""
        try:
            return super().run(max_events)
        finally:
            for request_id in list(self.adapter_uses):
                self._leave(request_id)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()


class FreeSwapSimulation(Simulation):
    """Full-model agents whose trainer state swaps take no time: what the swaps cost the full mode's step."""

    def swap_in_s(self, slot: _Slot, work: MicroBatchWork | OptimizerStepWork) -> float:
        """Counted, not charged."""
        if work_version(work) > 0:
            self.swap_log.append((self.now_s, 0.0))
        return 0.0

    def swap_out_s(self) -> float:
        """Not charged."""
        return 0.0


MODES = ("full", "full-free-swaps", "lora")


def lora_work_bound(
    profile: devicemodel.DeviceProfile,
    shape: devicemodel.LoraShape,
    work: Sequence[AgentStepWork],
    *,
    prompt_tokens: float,
    replicas: int,
    slots: int,
) -> DeviceWorkBound:
    """The device-work bound of one step of LoRA agents.

    Rollout: :func:`device_work_bound`'s (prefill and decode through the base alone, a lower bound
    of the base plus adapters) with one adapter load instead of one weight reload per agent that
    worked. Training: ``lora_train_tokens_s`` of ``E P + R`` tokens and one ``lora_optimizer_step_s``
    per such agent.
    """
    full = device_work_bound(profile, work, prompt_tokens=prompt_tokens, replicas=replicas, slots=slots)
    active = [w for w in work if w.episodes > 0]
    reload_s = devicemodel.adapter_transfer_s(profile, shape) - devicemodel.weight_transfer_s(profile)
    rollout_replica_s = full.rollout_replica_s + len(active) * reload_s
    train_slot_s = sum(
        devicemodel.lora_train_tokens_s(profile, shape, prompt_tokens * w.episodes + w.response_tokens)
        + devicemodel.lora_optimizer_step_s(profile, shape)
        for w in active
    )
    return DeviceWorkBound(rollout_replica_s, train_slot_s, replicas, slots)


@dataclasses.dataclass
class ModeOutcome:
    """One mode (:data:`MODES`) of one configuration: the sim's figures plus per-step swaps, reloads and the bound.

    ``*_per_step`` are means over the measured steps; ``*_s_per_step`` the modelled device seconds
    they took (a swap on its slot, a reload stalling its replica).
    """

    mode: str
    agents: int
    sim: SimOutcome
    measured_steps: int = 0
    swaps_per_step: float = math.nan
    swap_s_per_step: float = math.nan
    reloads_per_step: float = math.nan
    reload_s_per_step: float = math.nan
    waits_per_step: float = math.nan
    bound: DeviceWorkBound | None = None
    longest_chain_s: float = math.nan
    base_loads: int = 0
    over_bound_starts: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        figures = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("bound", "sim")}
        bound = self.bound
        figures.update(
            bound_s=bound.step_s if bound is not None else math.nan,
            bound_by=bound.bound_by if bound is not None else "",
            bound_rollout_s=bound.rollout_s if bound is not None else math.nan,
            bound_train_s=bound.train_s if bound is not None else math.nan,
            sim=dataclasses.asdict(self.sim),
        )
        return figures


def chain_s(profile: devicemodel.DeviceProfile, lengths: Sequence[int], prompt_tokens: float) -> float:
    """Modelled seconds of one episode's turns one after another, each alone on a replica (no batching, no wait).

    Each turn: its prefill, then ``L`` iterations of a batch of one whose context grows from the
    prompt to ``prompt + L`` (the iteration is linear in the context, so ``L`` iterations at the
    mean context ``prompt + L / 2``, as the simulation integrates it). The base alone: a lower
    bound for LoRA agents too.
    """
    return sum(
        devicemodel.prefill_s(profile, prompt_tokens)
        + length * devicemodel.decode_iteration_s(profile, 1, prompt_tokens + length / 2.0)
        for length in lengths
    )


def measured_steps(simulation: Simulation) -> list[int]:
    """The steps every agent committed, as :meth:`Simulation.outcome` measures them (first to last)."""
    done = []
    for step in range(simulation.settings.steps):
        if all((agent, step) in simulation.commits for agent in simulation.agents):
            done.append(step)
    return done


def run_mode(mode: str, config: str, settings: SimSettings, workload: Workload, lora: LoraOptions) -> ModeOutcome:
    """One simulation of ``mode`` (one of :data:`MODES`) and its per-step swaps, reloads and bound."""
    simulation: Simulation
    if mode == "lora":
        simulation = LoraSimulation(config, settings, workload, lora)
    elif mode == "full-free-swaps":
        simulation = FreeSwapSimulation(config, settings, workload)
    elif mode == "full":
        simulation = Simulation(config, settings, workload)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    outcome = simulation.run()
    steps = measured_steps(simulation)
    if len(steps) < 2:
        return ModeOutcome(mode, len(simulation.agents), outcome)
    end_of = {s: max(simulation.commits[(a, s)] for a in simulation.agents) for s in steps}
    start_s, end_s = end_of[steps[0]], end_of[steps[-1]]
    count = steps[-1] - steps[0]

    def inside(log: list[tuple[float, float]]) -> list[float]:
        return [cost_s for at_s, cost_s in log if start_s < at_s <= end_s]

    swaps, reloads = inside(simulation.swap_log), inside(simulation.reload_log)
    work = [
        [AgentStepWork(a, *simulation.agent_work.get((b, a), [0, 0])) for a in simulation.agents] for b in steps[1:]
    ]
    shape_kwargs: dict[str, Any] = {
        "prompt_tokens": workload.prompt_tokens,
        "replicas": len(simulation.replicas),
        "slots": len(simulation.slots),
    }
    longest = [
        max(chain_s(simulation.profile, e, workload.prompt_tokens) for e in simulation.episode_lengths[b])
        for b in steps[1:]
        if simulation.episode_lengths.get(b)
    ]
    extra: dict[str, Any] = {}
    if isinstance(simulation, LoraSimulation):
        bound = mean_bound([lora_work_bound(simulation.profile, simulation.shape, w, **shape_kwargs) for w in work])
        outcome = dataclasses.replace(outcome, bound_s=bound.step_s, bound_by=bound.bound_by)  # not the full models'
        extra = {"base_loads": simulation.base_loads, "over_bound_starts": simulation.over_bound_starts}
    else:
        bound = mean_bound([device_work_bound(simulation.profile, w, **shape_kwargs) for w in work])
    return ModeOutcome(
        mode,
        len(simulation.agents),
        outcome,
        measured_steps=count,
        swaps_per_step=len(swaps) / count,
        swap_s_per_step=sum(swaps) / count,
        reloads_per_step=len(reloads) / count,
        reload_s_per_step=sum(reloads) / count,
        waits_per_step=sum(1 for at_s in simulation.wait_log if start_s < at_s <= end_s) / count,
        bound=bound,
        longest_chain_s=sum(longest) / len(longest) if longest else math.nan,
        **extra,
    )


def table(outcomes: Sequence[ModeOutcome]) -> str:
    """Step seconds, bound, busy fractions, swaps and reloads per step; LoRA against full per configuration."""
    full = {o.sim.config: o for o in outcomes if o.mode == "full"}
    columns = [
        Column("mode", 15, "<"),
        Column("config", 9, "<"),
        Column("agents", 6),
        Column("repl", 4),
        Column("slots", 5),
        Column("eps/step", 8),
        Column("state", 10, "<"),
        Column("step s", 8, fmt=".1f"),
        Column("bound s", 7, fmt=".1f"),
        Column("bound by", 8, "<"),
        Column("chain s", 7, fmt=".1f"),
        Column("roll busy", 9, fmt=".2f"),
        Column("train busy", 10, fmt=".2f"),
        Column("swaps/step", 10, fmt=".1f"),
        Column("swap s", 6, fmt=".1f"),
        Column("reloads/step", 12, fmt=".1f"),
        Column("reload s", 8, fmt=".2f"),
        Column("waits/step", 10, fmt=".1f"),
        Column("moves", 6),
        Column("vs full", 7, fmt=".2f", suffix="x"),
    ]
    rows = []
    for o in outcomes:
        ref = full.get(o.sim.config)
        speed = ref.sim.step_s / o.sim.step_s if ref is not None and o.sim.step_s > 0 else math.nan
        rows.append(
            [o.mode, o.sim.config, o.agents, o.sim.replicas, o.sim.slots, o.sim.episodes_per_step, o.sim.state,
             o.sim.step_s, o.bound.step_s if o.bound else math.nan, o.bound.bound_by if o.bound else "",
             o.longest_chain_s,
             o.sim.rollout_busy, o.sim.train_busy, o.swaps_per_step, o.swap_s_per_step,
             o.reloads_per_step, o.reload_s_per_step, o.waits_per_step, o.sim.reassignments, speed]
        )
    lines = render_table(columns, rows)
    lines.append(
        "modelled seconds (H100/Qwen2.5-14B roofline); chain = the step's longest episode, its turns one after "
        "another each alone on a replica; swaps = trainer state swap-ins of a committed version + "
        "swap-outs, swap s = their slot seconds; reloads = replica weight or adapter loads, reload s = their replica "
        "seconds (per step); waits = requests that found no replica "
        "(full: none serves their agent; lora: no adapter slot free); vs full = full step s / this step s"
    )
    return "\n".join(lines)


def cost_summary(profile: devicemodel.DeviceProfile, shape: devicemodel.LoraShape, tokens: float) -> dict[str, float]:
    """The per-event costs of both modes (modelled seconds) for the JSON and the docs."""
    return {
        "adapter_params": float(shape.params),
        "adapter_bytes": devicemodel.adapter_bytes(profile, shape),
        "weight_transfer_s": devicemodel.weight_transfer_s(profile),
        "adapter_transfer_s": devicemodel.adapter_transfer_s(profile, shape),
        "swap_s": devicemodel.swap_s(profile),
        "lora_swap_s": devicemodel.lora_swap_s(profile, shape),
        "train_tokens_s": devicemodel.train_tokens_s(profile, tokens),
        "lora_train_tokens_s": devicemodel.lora_train_tokens_s(profile, shape, tokens),
        "optimizer_step_s": devicemodel.optimizer_step_s(profile),
        "lora_optimizer_step_s": devicemodel.lora_optimizer_step_s(profile, shape),
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    """Runs both modes; returns 0 when every simulated job succeeded."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_sim", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--rollout-fraction", type=float, default=0.5)
    parser.add_argument("--devices-per-slot", type=int, default=4)
    parser.add_argument("--configs", nargs="+", default=["flexmarl"], choices=list(SIM_CONFIGS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--variant", choices=["long-tail", "uniform"], default="long-tail")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--episodes-per-replica", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated Qwen2.5-14B modules")
    parser.add_argument("--max-loras-per-batch", type=int, default=DEFAULT_MAX_LORAS_PER_BATCH)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    settings = SimSettings(
        devices=args.devices,
        rollout_fraction=args.rollout_fraction,
        devices_per_slot=args.devices_per_slot,
        episodes_per_replica=args.episodes_per_replica,
        group_size=args.group_size,
        steps=args.steps,
        agents=args.agents,
        variant=args.variant,
        seed=args.seed,
    )
    lora = LoraOptions(args.rank, tuple(args.targets.split(",")), args.max_loras_per_batch)
    workload = make_workload(args.agents, args.variant)
    outcomes = [run_mode(mode, config, settings, workload, lora) for config in args.configs for mode in args.modes]
    report = table(outcomes)
    print(report)  # noqa: T201 (a CLI report)
    profile = devicemodel.H100_SXM.with_changes(
        train_devices_per_slot=settings.devices_per_slot, rollout_devices_per_replica=1
    )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "costs_per_1000_tokens": cost_summary(profile, lora.shape, 1000.0),
        "outcomes": [o.as_dict() for o in outcomes],
        "table": report,
    }
    (args.out / "lora_sim.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(o.sim.state == "SUCCEEDED" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
