"""Pure simulation from 48 to 10,240 devices: the real planner and balancers on a discrete-event clock.

    python -m benchmarks.sim                                   # sweep 48..768 devices, 3 configurations
    python -m benchmarks.sim --devices 48 96 --steps 3 --configs flexmarl static

Nothing here re-implements a policy. The simulation drives

* :class:`orchestratord.planner.Planner` (admission, task leases, micro-batches, staleness,
  the pipeline modes, and through it :mod:`orchestratord.binding`'s slot binder) with a
  virtual clock, calling exactly the methods orchestratord's servicer calls: lease,
  report, poll, ack, commit, slot events;
* :class:`rolloutd.balancer.HierarchicalBalancer` (inter-agent replica assignment with
  weight-load costs, intra-agent least-tokens routing with episode affinity) and
  :class:`rolloutd.balancer.TokenEstimator`, as rolloutd's router drives them, with the
  orchestrator's outstanding-demand estimate as the balancer's hint;

As the product runs them: one balancer per rolloutd process over that process's replicas
(``--replicas-per-rolloutd``, :mod:`benchmarks.sim_rolloutd`; each leases, plays and renews its own
tasks, and each gets its share of the demand hints, as orchestratord sends them), and orchestratord's tick loop
(:mod:`benchmarks.sim_orchestratord`: the planner's tick every 0.2 s, the slot gauges, the demand push
every 1 s). The CPU of the real code is kept per process (:class:`benchmarks.control_cpu.CpuMeter`),
measured under the daemons' garbage-collector policy, applied as a daemon applies it once its cluster
is built, and under CPython's defaults (``--gc``, :mod:`benchmarks.sim_gc`).
Each balancer decides on what its router measures (``--balancer-rates measured``, rolloutd's
default): the process keeps rolloutd's :class:`rolloutd.replica_rates.BalancerFeed`, fed by its
modelled generations and weight loads as ``RolloutRouter._generation`` and ``_reloaded`` feed it;
``prior`` keeps 1,000 tokens/s and 10 s.

The simulation models only device time, with :mod:`flexmarl.devicemodel` (H100 preset):

* a replica is continuous batching: every running sequence advances one token per
  iteration of ``decode_iteration_s(batch, context)`` (re-evaluated at every event and at
  least every ``refresh_tokens`` tokens as the context grows); a request that joins stalls
  the batch for its prefill; a replica that must serve a newer version of its agent or a
  different agent pays ``weight_transfer_s`` first;
* a trainer slot (``devices_per_slot`` devices, data parallel) takes ``train_tokens_s`` per
  micro-batch of (prompt + response) tokens, ``optimizer_step_s`` per step and ``swap_s`` to
  bring an agent's state in or out.

Every slot is a one-slot traind process (its own worker id) that advertises a ``dp_address``,
so agents with ``max_slots`` > 1 (ZeRO 0) get data-parallel groups from the planner's slot
binder, and the slots handle group work as traind does: a slot whose group changes drops its
engine and loads the agent's committed state again (``swap_s``; the rendezvous itself is not
modelled); each member trains the micro-batches it is leased; every member runs the optimizer
step, a collective that ends for all members together, ``allreduce_s`` after the last member
reaches it, then ``optimizer_step_s``; only rank 0 commits. :func:`allreduce_s` is the sim's
own all-reduce cost (the device model has none): a ring all-reduce of the BF16 gradients over
one link per slot.

Devices: a fraction ``--rollout-fraction`` of them are rollout replicas (one device each),
the rest trainer slots of ``--devices-per-slot``. The batch grows with the cluster (weak
scaling, ``--episodes-per-replica`` episodes per replica and step). Configurations as in
``benchmarks.run``: ``flexmarl`` (async, eta 1, hierarchical balancing, dynamic binding),
``static`` (MARTI-like barrier, fixed slots and replica shares), ``sequential``
(MAS-RL-like: batch, then each agent trains in turn, fixed replica shares).

Every outcome carries the step's device-work bound (:mod:`benchmarks.bound`, over the tokens
the simulated steps generated and trained), printed beside the step.

What one agent costs is in a few methods a subclass may change (``agent_entry``,
``make_balancer``, ``adapter_name``, ``iteration_s``, ``prefill_s``, ``load_stall_s``,
``swap_in_s``, ``swap_out_s``, ``train_s``, ``optimizer_s``): :mod:`benchmarks.lora_sim` makes
the agents LoRA adapters over one base that way. As rolloutd's router does, a request is
submitted with the version its agent requires then and the adapter name it will be served with
(``adapter_name``; None here, a full model's request); a request with a name is served with that
version when it starts, a full model's with the version its agent requires when it starts (the
router's ``_ensure_weights`` loads that one). The simulation logs every replica reload, trainer
state swap and request that waited for a replica (``reload_log``, ``swap_log``, ``wait_log``)
and every episode's turn lengths (``episode_lengths``); :class:`SimOutcome` does not carry them.

Writes ``<out>/sim.json`` and ``<out>/sim.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.bound import AgentStepWork, device_work_bound, mean_bound
from benchmarks.control_cpu import CpuMeter
from benchmarks.sim_gc import GC_POLICIES, run_under, same_model
from benchmarks.sim_model import (
    SimOutcome,
    SimSettings,
    _Episode,
    _Replica,
    _Seq,
    _Slot,
    allreduce_s,
    work_version,
)
from benchmarks.sim_orchestratord import DEMAND_INTERVAL_S, TICK_INTERVAL_S, CoordinatorTick
from benchmarks.sim_report import chart, cpu_table, growth_exponents, table
from benchmarks.sim_rolloutd import RolloutProcess, max_tasks, partition, request_key, split_request_key
from benchmarks.workloads import Workload, make_workload
from flexmarl import devicemodel
from flexmarl.experience import ExperienceSummary
from flexmarl.jobspec import parse_job_spec
from orchestratord.planner import (
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    PlannerOptions,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
)
from orchestratord.planner.demand import rolloutd_share
from rolloutd.balancer import AgentSpec, BalancerConfig, HierarchicalBalancer, RoutingPolicy, Ticket
from rolloutd.balancer import ReplicaAssignment as BalancerReplica
from rolloutd.replica_rates import BalancerFeed

# name -> (pipeline section, rollout balancing, rest of the rollout section), the settings of benchmarks.run.CONFIGS
SIM_CONFIGS: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "flexmarl": ({"mode": "async", "max_staleness": 1}, "hierarchical", {}),
    "static": ({"mode": "static"}, "static", {}),
    "sequential": ({"mode": "sequential"}, "static", {}),
    "no-lb": ({"mode": "async", "max_staleness": 1}, "static", {}),
    "flexmarl-partial": (
        {"mode": "async", "max_staleness": 8, "step_fill": "completion"},
        "hierarchical",
        {"partial_rollout": True, "mask_stale_tokens": True},
    ),
}
EPOCH_S = 1.0e9  # the planner's clock is unix seconds; any fixed origin will do
TICK_S = 2.0  # traind re-polls every POLL_WAIT_MS; rolloutd renews its leases every RENEW_INTERVAL_S
#: The CLI's replicas per rolloutd (SimSettings' default is one rolloutd over all): eight nodes of eight
#: one-device replicas. A one-node rolloutd (8) cannot keep a replica per agent of a 64-agent job, so its
#: balancer reloads weights for almost every turn (768 devices: 45,162 moves against 1,000 at 64; 20 % of
#: the step in balancer CPU); a rolloutd attaches any number of engines (``engine_urls``).
DEFAULT_REPLICAS_PER_ROLLOUTD = 64
STALL_S = 3600.0  # a job with no event but ticks for this long has stalled
DONE_TOKENS = 1e-3  # a sequence this close to its length is complete (float round-off)


class Simulation:
    """One configuration of one cluster size, to completion of ``steps`` steps."""

    def __init__(
        self, config: str, settings: SimSettings, workload: Workload, profile: devicemodel.DeviceProfile | None = None
    ) -> None:
        pipeline, balancing, rollout = SIM_CONFIGS[config]
        self.partial_rollout = bool(rollout.get("partial_rollout", False))
        self.config, self.settings, self.workload = config, settings, workload
        self.profile = (profile or devicemodel.H100_SXM).with_changes(
            train_devices_per_slot=settings.devices_per_slot, rollout_devices_per_replica=1
        )
        self.now_s = 0.0  # simulated seconds; the planner sees EPOCH_S + now_s
        self.rng = random.Random(settings.seed)
        self.agents = [name for name, _ in workload.agents]
        self.lengths = dict(workload.agents)
        spec = parse_job_spec(
            {
                "name": f"sim-{config}",
                "seed": settings.seed,
                "environment": {"entrypoint": "benchmarks.workloads:SkewedAgentsEnv", "config": {}},
                "agents": [self.agent_entry(a) for a in self.agents],
                "algorithm": {"name": "grpo"},
                "batch": {
                    "prompts_per_step": settings.prompts_per_step,
                    "group_size": settings.group_size,
                    "micro_batch_size": settings.group_size * settings.micro_batch_groups,
                },
                "total_steps": settings.steps,
                "pipeline": {"max_staleness": 0, **pipeline},
                "rollout": {"balancing": balancing, **rollout},
                "leases": {"rollout_timeout_s": 86_400.0, "train_timeout_s": 86_400.0},
            }
        )
        self.planner = Planner(
            lambda: EPOCH_S + self.now_s, PlannerOptions(slot_silence_s=1.0e9, max_wait_s=60.0, swap_location="file")
        )
        self.job_id = "sim"
        self.planner.submit_job(self.job_id, spec)
        self.replicas = {f"r{i:04d}": _Replica(f"r{i:04d}") for i in range(settings.replicas)}
        # As rolloutd/worker.py builds it: defaults but for the policy and --balancer-measured-rates;
        # only --hysteresis (an experiment) overrides a default.
        balancer_config = BalancerConfig(
            rebalance_enabled=balancing == "hierarchical", routing=RoutingPolicy.LEAST_TOKENS,
            measured_rates=settings.measured_rates,  # --balancer-measured-rates, as the worker passes it
        )
        if settings.hysteresis is not None:
            balancer_config = dataclasses.replace(balancer_config, hysteresis=settings.hysteresis)
        # CPU of the real code: the planner (orchestratord), and per rolloutd its balancer and estimator.
        self.cpu = CpuMeter()
        self.cpu.wrap("planner", self.planner)
        self.coordinator = CoordinatorTick(self.planner)  # orchestratord's tick loop (benchmarks/sim_orchestratord.py)
        self.cpu.wrap("planner", self.coordinator)
        self.orchestratord_ticks = 0
        # The rolloutd processes (benchmarks/sim_rolloutd.py): each its own balancer over its own replicas.
        groups = partition(sorted(self.replicas), settings.replicas_per_rolloutd)
        window = (spec.pipeline.max_staleness + 1) * settings.prompts_per_step
        self.rolloutds: list[RolloutProcess] = []
        for index, replica_ids in enumerate(groups):
            meter = CpuMeter()
            process = RolloutProcess(
                index,
                f"rollout-{index}",
                replica_ids,
                self.make_balancer(balancer_config, replica_ids),  # with its estimator (route, release)
                max_tasks(len(replica_ids), settings.replicas, window, len(groups), settings.max_tasks_per_rolloutd),
                meter,
            )
            if settings.measured_rates:  # rolloutd's default: its router measures what the balancer decides on
                process.measured = BalancerFeed(balancer_config.prior_tokens_per_s, balancer_config.reassignment_cost_s)
            meter.wrap("balancer", process.balancer)
            for replica_id in replica_ids:
                self.replicas[replica_id].rolloutd = index
            self.rolloutds.append(process)
        self.lease_turn = 0  # the rolloutd that leases first next time (their long polls take turns)
        # Lease operations as orchestratord counts them (benchmarks/load.py): a task leased, a task
        # reported, a lease renewed (RenewLeases of k leases = k); a trainer's work leased, acked,
        # committed, a slot event. Polls that found no work are counted apart (a long poll's wake-ups).
        self.lease_ops: Counter[str] = Counter()
        # One traind process per slot (the GPU deployment): its own worker id and rendezvous.
        self.slots = [_Slot(f"trainer-{i}/slot0", f"trainer-{i}", f"trainer-{i}:29500") for i in range(settings.slots)]
        self.by_slot = {slot.slot_id: slot for slot in self.slots}
        # Slots whose long poll waits (found no work, not yet answered); slots yet to poll for the first time.
        self.waiting: set[str] = set()
        self.unpolled: set[str] = set(self.by_slot)
        # Optimizer steps of data-parallel groups: (group id, step id) -> members arrived.
        self.collectives: dict[tuple[str, str], list[_Slot]] = {}
        self.max_group_size = 1
        self.events: list[tuple[float, int, str, Any]] = []
        self.counter = 0
        self.tickets: dict[int, tuple[_Episode, str]] = {}
        self.routed_versions: dict[int, int] = {}  # request id -> the version its agent required when it was routed
        self.task_episodes: dict[str, list[_Episode]] = {}
        self.task_left: dict[str, int] = {}
        self.experience_tokens: dict[str, int] = {}
        self.commits: dict[tuple[str, int], float] = {}
        self.response_tokens: dict[int, int] = {}
        self.agent_work: dict[tuple[int, str], list[int]] = {}  # (batch, agent) -> [episodes, response tokens]
        self.wanted: dict[str, int] = dict.fromkeys(self.agents, 0)
        self.loads: set[str] = set()
        self.event_count = 0
        self.reported = False
        # (when, modelled seconds it took) of every replica reload (weights or an adapter) and slot state swap.
        self.reload_log: list[tuple[float, float]] = []
        self.swap_log: list[tuple[float, float]] = []
        # When a request found no replica to run on as it was submitted (it waited in the balancer).
        self.wait_log: list[float] = []
        self.episode_lengths: dict[int, list[tuple[int, ...]]] = {}  # batch -> every reported episode's turn lengths

    def agent_entry(self, agent: str) -> dict[str, Any]:
        """The job spec's entry of one agent (every agent trains the same ``/sim/base``, ZeRO 0)."""
        return {
            "name": agent,
            "model": "/sim/base",
            "sampling": {"max_new_tokens": self.lengths[agent].high},
            "zero_stage": 0,
            "max_slots": self.settings.agent_max_slots(self.config),
        }

    def adapter_name(self, agent: str, version: int) -> str | None:
        """The adapter name a request of ``agent`` routed with ``version`` is served with (``submit``'s ``adapter``).

        None: a full model's request, which holds no adapter slot (RolloutRouter._adapter_name).
        """
        del agent, version
        return None

    @property
    def balancer(self) -> HierarchicalBalancer:
        """The first rolloutd's balancer (the only one unless ``replicas_per_rolloutd`` splits the replicas)."""
        return self.rolloutds[0].balancer

    def make_balancer(self, config: BalancerConfig, replica_ids: Sequence[str]) -> HierarchicalBalancer:
        """One rolloutd's balancer as its router builds it: one model group per agent, an equal split.

        RolloutRouter._initial_assignment's ReplicaAssignment (default tokens_per_s) on an equal
        split of the process's replicas over the agents.
        """
        agent_keys = list(self.agents)
        split = [BalancerReplica(rid, agent_keys[i % len(agent_keys)]) for i, rid in enumerate(replica_ids)]
        return HierarchicalBalancer(split, [AgentSpec(a, a) for a in agent_keys], config)

    # ---- event queue ----------------------------------------------------------------------------------------
    def push(self, at_s: float, kind: str, payload: Any) -> None:
        """Schedule an event."""
        self.counter += 1
        heapq.heappush(self.events, (at_s, self.counter, kind, payload))

    # ---- replicas ---------------------------------------------------------------------------------------------
    def iteration_s(self, replica: _Replica) -> float:
        """Modelled seconds of one decode iteration of the replica's batch now."""
        return devicemodel.decode_iteration_s(
            self.profile, len(replica.running), sum(seq.context for seq in replica.running)
        )

    def settle(self, replica: _Replica) -> None:
        """Advance the replica's sequences to now."""
        start_s = max(replica.updated_s, replica.resume_s)
        if replica.running and self.now_s > start_s:
            tokens = (self.now_s - start_s) / self.iteration_s(replica)
            for seq in replica.running:
                seq.remaining -= tokens
                seq.context += tokens
        if replica.running or self.now_s < replica.resume_s:
            replica.busy_s += self.now_s - replica.updated_s
        replica.updated_s = self.now_s

    def reschedule(self, replica: _Replica) -> None:
        """Schedule the replica's next completion (or context refresh)."""
        replica.generation += 1
        if not replica.running:
            return
        tokens = max(0.0, min(seq.remaining for seq in replica.running))
        step_tokens = min(tokens, self.settings.refresh_tokens)
        at_s = max(self.now_s, replica.resume_s) + step_tokens * self.iteration_s(replica)
        self.push(at_s, "replica", (replica.replica_id, replica.generation))

    def on_replica(self, replica_id: str, generation: int) -> None:
        """A completion or a refresh point of one replica."""
        replica = self.replicas[replica_id]
        if generation != replica.generation:
            return
        self.settle(replica)
        done = [seq for seq in replica.running if seq.remaining <= DONE_TOKENS]
        replica.running = [seq for seq in replica.running if seq.remaining > DONE_TOKENS]
        for seq in done:
            self.finish_turn(seq)
        self.reschedule(replica)

    # ---- rollouts ---------------------------------------------------------------------------------------------
    def lease_tasks(self) -> None:
        """The rolloutd processes with room lease what the planner admits (their lease loops' long polls).

        A long poll returns once the planner has a task to hand out (the coordinator wakes the
        lease waiters on ``has_leasable_tasks``); the processes take turns being first.
        """
        count = len(self.rolloutds)
        for offset in range(count):
            if not self.planner.has_leasable_tasks():
                return
            process = self.rolloutds[(self.lease_turn + offset) % count]
            if process.free_tasks <= 0:
                continue
            for task in self.planner.lease_rollout_tasks(process.worker_id, process.free_tasks):
                self.take_task(process, task)
        self.lease_turn = (self.lease_turn + 1) % count

    def take_task(self, process: RolloutProcess, task: RolloutTaskLease) -> None:
        """A leased task's episodes start on ``process``'s replicas."""
        self.lease_ops["lease"] += 1
        process.leased += 1
        process.held_leases[task.task_id] = task.lease_id
        process.task_progress[task.task_id] = 0
        episodes = []
        for sample in range(task.group_size):
            lengths = tuple(self.lengths[a].sample(self.rng) for a in self.agents)
            episodes.append(_Episode(task, sample, lengths, rolloutd=process.index))
        self.task_episodes[task.task_id] = episodes
        self.task_left[task.task_id] = len(episodes)
        for version in task.agent_versions:
            self.wanted[version.agent] = max(self.wanted[version.agent], version.version)
        for episode in episodes:
            self.submit_turn(episode)

    def submit_turn(self, episode: _Episode) -> None:
        """Hand the episode's next turn to its rolloutd's balancer."""
        process = self.rolloutds[episode.rolloutd]
        agent = self.agents[episode.turn]
        version = self.wanted[agent]  # RolloutRouter._generate fixes it when it routes (``served``)
        ticket = process.balancer.route(  # RolloutRouter._acquire: estimated and submitted in one call
            agent, self.workload.prompt_tokens, self.lengths[agent].high, 1,
            f"{episode.task.task_id}#{episode.sample_index}", self.adapter_name(agent, version)
        )
        key = request_key(process.index, ticket.request_id)
        self.tickets[key] = (episode, agent)
        self.routed_versions[key] = version
        if ticket.replica_id is not None:
            self.start(process, ticket)
        else:
            self.wait_log.append(self.now_s)
            self.rebalance(process)  # RolloutRouter._acquire: a queued request

    def start(self, process: RolloutProcess, ticket: Ticket) -> None:
        """A placed request joins its replica's batch (after a weight load if its version is old).

        An adapter's request is served with the version it was routed with (the name the balancer
        counted); a full model's with the one its agent requires now (RolloutRouter._ensure_weights).
        """
        key = request_key(process.index, ticket.request_id)
        episode, agent = self.tickets[key]
        replica = self.replicas[str(ticket.replica_id)]
        if replica.rolloutd != process.index:
            raise RuntimeError(f"rolloutd {process.index} placed a request on {replica.replica_id}, not its own")
        self.settle(replica)
        routed = self.routed_versions.pop(key)
        version = routed if ticket.adapter is not None else self.wanted[agent]
        stall_s = self.prefill_s() + self.load_stall_s(replica, key, agent, version)
        replica.resume_s = max(replica.resume_s, self.now_s) + stall_s
        episode.behaviour[agent] = version
        length = episode.lengths[episode.turn]
        replica.running.append(_Seq(key, episode, float(length), float(self.workload.prompt_tokens)))
        process.generation_started(key, replica.replica_id, ticket.agent, self.now_s)  # its group: the agent's own
        self.reschedule(replica)

    def prefill_s(self) -> float:
        """Modelled seconds of one request's prompt prefill."""
        return devicemodel.prefill_s(self.profile, self.workload.prompt_tokens)

    def load_stall_s(self, replica: _Replica, request_id: int, agent: str, version: int) -> float:
        """Seconds the replica stalls before request ``request_id`` of ``agent`` v``version`` joins its batch.

        A full-model replica holds one agent version: serving another reloads the weights.
        """
        if replica.loaded == (agent, version):
            return 0.0
        replica.loaded = (agent, version)
        load_s = devicemodel.weight_transfer_s(self.profile)
        self.reload_log.append((self.now_s, load_s))
        self.rolloutds[replica.rolloutd].reloaded(load_s)
        return load_s

    def finish_turn(self, seq: _Seq) -> None:
        """A response is complete: free its ticket, start the episode's next turn or report the task."""
        episode, agent = self.tickets.pop(seq.request_id)
        process = self.rolloutds[episode.rolloutd]
        process.generation_finished(seq.request_id, episode.lengths[episode.turn], self.now_s)
        # RolloutRouter._release: the ticket freed, the length observed, and whether anything is left to do.
        request = split_request_key(seq.request_id)[1]
        self.rebalance(process, process.balancer.release(request, self.now_s, (episode.lengths[episode.turn],)))
        process.task_progress[episode.task.task_id] += 1
        episode.turn += 1
        if episode.turn < len(self.agents):
            self.submit_turn(episode)
            return
        task_id = episode.task.task_id
        self.task_left[task_id] -= 1
        if self.task_left[task_id] == 0:
            self.report(process, task_id)
            self.lease_tasks()  # its lease loop has room again

    def report(self, process: RolloutProcess, task_id: str) -> None:
        """ReportRolloutTask with every experience of the task."""
        episodes = self.task_episodes.pop(task_id)
        task = episodes[0].task
        self.episode_lengths.setdefault(task.batch_index, []).extend(episode.lengths for episode in episodes)
        experiences = []
        for episode in episodes:
            for index, agent in enumerate(self.agents):
                experience_id = f"{task_id}/{agent}/{episode.sample_index}"
                tokens = episode.lengths[index]
                self.experience_tokens[experience_id] = tokens + self.workload.prompt_tokens
                work = self.agent_work.setdefault((task.batch_index, agent), [0, 0])
                work[0] += 1
                work[1] += tokens
                experiences.append(
                    ExperienceSummary(
                        experience_id,
                        agent,
                        f"{task_id}/{agent}",
                        episode.sample_index,
                        episode.behaviour[agent],
                        tokens,
                        0.0,
                    )
                )
        self.planner.report_rollout_task(task.lease_id, process.worker_id, task_id, True, "", experiences)
        self.lease_ops["report"] += 1
        del process.held_leases[task_id]
        del process.task_progress[task_id]
        self.reported = True
        self.response_tokens[task.batch_index] = self.response_tokens.get(task.batch_index, 0) + sum(
            e.response_tokens for e in experiences
        )

    def renew(self) -> None:
        """Each rolloutd's renewal: one RenewLeases of every task lease it holds, every RENEW_INTERVAL_S (= TICK_S).

        With each lease its task's progress (turns finished), as rolloutd reports its tasks' progress, so that a
        task of long episodes (64 turns) is not taken for stalled after ``leases.progress_timeout_s``.
        """
        for process in self.rolloutds:
            if process.held_leases:
                self.planner.renew_leases(
                    process.worker_id,
                    list(process.held_leases.values()),
                    [process.task_progress[t] for t in process.held_leases],
                )
                self.lease_ops["renew"] += len(process.held_leases)

    def balance(self) -> None:
        """orchestratord's demand push (``_push_demand``): one SetAgentDemand per rolloutd, its share of the demand."""
        demand = rolloutd_share(self.planner.rollout_demand(), len(self.rolloutds))
        for process in self.rolloutds:
            # RolloutRouter.set_demand_hints: every hint of the push set, then one rebalance.
            hints = {agent: tokens for (_, agent), tokens in sorted(demand.items())}
            process.demand_hints.update(hints)
            process.balancer.set_demand_hints(hints)
            self.rebalance(process)

    def rebalance(self, process: RolloutProcess, settled: bool | None = None) -> None:
        """``RolloutRouter._rebalance`` on its occasions (a queued request, a release, a hint); ``settled``: known."""
        balancer = process.balancer
        if balancer.settled(self.now_s) if settled is None else settled:  # as the router: nothing waits or is due
            return
        starved = balancer.starved_agents()
        if starved:
            for agent, hint in process.demand_hints.items():
                if hint and agent not in starved and balancer.demand_tokens(agent) == hint:
                    balancer.set_demand_hint(agent, 0)
            balancer.rebalance(self.now_s)
        else:
            balancer.maybe_rebalance(self.now_s)
        self.place(process)

    def place(self, process: RolloutProcess) -> None:
        """Start weight loads of moved replicas and requests ``process``'s balancer can place now."""
        self.start_loads(process)
        for ticket in process.balancer.place_queued():
            self.start(process, ticket)

    def start_loads(self, process: RolloutProcess) -> None:
        """Drained replicas load their new agent's weights."""
        for move in process.balancer.replicas_awaiting_load():
            process.balancer.begin_load(move.replica_id, self.now_s)  # its drain, measured as the router does
            replica = self.replicas[move.replica_id]
            replica.loaded = (move.to_model_key, self.wanted[move.to_model_key])
            load_s = devicemodel.weight_transfer_s(self.profile)
            self.reload_log.append((self.now_s, load_s))
            process.reloaded(load_s)
            self.push(self.now_s + load_s, "loaded", move.replica_id)

    # ---- trainer slots ------------------------------------------------------------------------------------
    def poll_slots(self, slot_ids: Iterable[str] = ()) -> None:
        """``slot_ids`` poll, then every waiting poll a change woke, until none is (orchestratord's long polls).

        As the coordinator does: a poll that finds no work waits (``self.waiting``) until the planner
        says a change may have given its slot work (``Planner.trainer_wakes``, asked after every
        change) or its long poll ends (``tick``: traind polls again every ``POLL_WAIT_MS``).
        """
        queue = collections.deque(slot_ids)
        queued = set(queue)
        polls = 0
        while True:
            # Changes since the last poll (reports, acks, commits, the tick) wake the polls they concern.
            for slot_id in sorted(self.planner.trainer_wakes(self.waiting) - queued):
                queue.append(slot_id)
                queued.add(slot_id)
            if not queue:
                return
            slot_id = queue.popleft()
            queued.discard(slot_id)
            polls += 1
            if polls > 100 * len(self.slots) + 100:
                raise RuntimeError("trainer polls keep waking each other (a wake loop)")
            self.poll_slot(self.by_slot[slot_id])

    def poll_slot(self, slot: _Slot) -> None:
        """One poll of an idle slot; it waits (in ``self.waiting``) when it finds no work."""
        if slot.busy_until_s > self.now_s or slot.pending is not None:  # (its own "slot" event polls at once)
            self.waiting.discard(slot.slot_id)
            return
        self.waiting.add(slot.slot_id)  # registered before the call, as the coordinator does
        resident = [slot.resident] if slot.resident is not None else []
        work = self.planner.poll_trainer_work(slot.worker_id, slot.slot_id, resident, slot.dp_address)
        if work is None:
            self.lease_ops["empty poll"] += 1
            return
        self.waiting.discard(slot.slot_id)
        self.lease_ops["trainer lease"] += 1
        duration_s = self.work_seconds(slot, work)
        slot.pending = work
        slot.busy_s += duration_s
        group = work.group if not isinstance(work, SwapOutWork) else None
        if isinstance(work, OptimizerStepWork) and group is not None and group.world_size > 1:
            self.join_collective(slot, work, self.now_s + duration_s)
            return
        slot.busy_until_s = self.now_s + duration_s
        self.push(slot.busy_until_s, "slot", slot.slot_id)

    def join_collective(self, slot: _Slot, work: OptimizerStepWork, ready_s: float) -> None:
        """A member reaches its group's optimizer step (after any state load); the last one starts it.

        The step's all-reduce (and the publish and save barriers after it) completes only when
        every member runs it, so all members finish together, ``allreduce_s`` plus
        ``optimizer_step_s`` after the last arrival.
        """
        group = work.group
        if group is None:
            return
        key = (group.group_id, work.step_id)
        arrived = self.collectives.setdefault(key, [])
        arrived.append(slot)
        slot.busy_until_s = ready_s  # then blocked in the collective (``pending`` keeps it from polling)
        if len(arrived) < group.world_size:
            return
        del self.collectives[key]
        step_s = allreduce_s(self.profile, group.world_size) + self.optimizer_s()
        done_s = max(member.busy_until_s for member in arrived) + step_s
        for member in arrived:
            member.busy_s += step_s
            member.busy_until_s = done_s
            self.push(done_s, "slot", member.slot_id)

    def work_seconds(self, slot: _Slot, work: Any) -> float:
        """Modelled seconds of one piece of trainer work (swap-in included; a group's collective step not)."""
        if isinstance(work, SwapOutWork):
            swap_out_s = self.swap_out_s()
            self.swap_log.append((self.now_s, swap_out_s))
            return swap_out_s
        group_id = work.group.group_id if work.group is not None and work.group.world_size > 1 else ""
        if group_id != slot.group_id:
            # traind releases every engine of the process and joins the new process group.
            slot.group_id = group_id
            slot.resident = None
        if work.group is not None:
            self.max_group_size = max(self.max_group_size, work.group.world_size)
        swap_in_s = 0.0
        if slot.resident is None or (slot.resident.agent, slot.resident.version) != (work.agent, work_version(work)):
            swap_in_s = self.swap_in_s(slot, work)
            slot.resident = ResidentAgent(self.job_id, work.agent, work_version(work))
        if isinstance(work, MicroBatchWork):
            tokens = sum(self.experience_tokens[e] for e in work.experience_ids)
            return swap_in_s + self.train_s(tokens)
        if work.group is not None and work.group.world_size > 1:
            return swap_in_s  # the collective step is charged in join_collective
        return swap_in_s + self.optimizer_s()

    def swap_in_s(self, slot: _Slot, work: MicroBatchWork | OptimizerStepWork) -> float:
        """Seconds to make the work's agent version resident in a slot that holds another (its full state)."""
        if work_version(work) <= 0:
            return 0.0  # version 0 is the checkpoint the engine is built from
        swap_s = devicemodel.swap_s(self.profile)
        self.swap_log.append((self.now_s, swap_s))
        return swap_s

    def swap_out_s(self) -> float:
        """Seconds of a swap-out (the agent's full state over the link)."""
        return devicemodel.swap_s(self.profile)

    def train_s(self, tokens: float) -> float:
        """Seconds of forward + backward over ``tokens`` (prompt + response) on one slot."""
        return devicemodel.train_tokens_s(self.profile, tokens)

    def optimizer_s(self) -> float:
        """Seconds of one optimizer step on one slot (publishing the new weights included)."""
        return devicemodel.optimizer_step_s(self.profile)

    def on_slot(self, slot_id: str) -> None:
        """A slot finished its work: ack, commit or report the swap-out."""
        slot = self.by_slot[slot_id]
        work, slot.pending = slot.pending, None
        if isinstance(work, MicroBatchWork):
            self.planner.ack_micro_batch(work.lease_id, slot.worker_id, slot_id, len(work.experience_ids))
            self.lease_ops["ack"] += 1
        elif isinstance(work, OptimizerStepWork):
            # Every member holds the new version; only rank 0 publishes, saves and commits.
            slot.resident = ResidentAgent(self.job_id, work.agent, work.new_version)
            if work.rank == 0:
                uri = f"file:///sim/{work.agent}/v{work.new_version}"
                self.planner.commit_step(
                    slot.worker_id, slot_id, self.job_id, work.agent, work.step, work.new_version, uri, uri
                )
                self.lease_ops["commit"] += 1
                self.commits[(work.agent, work.step)] = self.now_s
                if self.partial_rollout:
                    self.interrupt(work.agent, work.new_version)
        elif isinstance(work, SwapOutWork):
            version = slot.resident.version if slot.resident is not None else 0
            self.planner.report_slot_event(
                slot.worker_id,
                slot_id,
                self.job_id,
                work.agent,
                SlotEventKind.SWAPPED_OUT,
                f"file:///sim/{work.agent}/v{version}",
            )
            self.lease_ops["slot event"] += 1
            slot.resident = None

    def on_orchestratord_tick(self) -> None:
        """The coordinator's tick loop: the planner's tick, the polls it woke, the slot gauges, the demand push."""
        self.orchestratord_ticks += 1
        self.planner.tick()
        self.lease_tasks()  # the lease long polls wake when a task is leasable (an expiry re-queued one)
        self.poll_slots()  # trainer_wakes after the mutation, as after every other
        self.coordinator.observe_slots()
        every = max(1, round(DEMAND_INTERVAL_S / TICK_INTERVAL_S))
        if self.orchestratord_ticks % every == 1 % every:
            self.balance()

    def on_loaded(self, replica_id: str) -> None:
        """A moved replica's weight load finished (RolloutRouter._move): it serves; queued requests may start."""
        process = self.rolloutds[self.replicas[replica_id].rolloutd]
        process.balancer.complete_load(replica_id)
        for ticket in process.balancer.place_queued():
            self.start(process, ticket)

    def reassignments(self) -> int:
        """Replica moves made by every rolloutd's balancer."""
        return sum(p.balancer.reassignments for p in self.rolloutds)

    def interrupt(self, agent: str, version: int) -> None:
        """A partial-rollout agent's new version interrupts its replicas (RolloutRouter.publish, in place).

        Every replica holding an older version of the agent pauses its batch, loads the new
        weights (``weight_transfer_s``) and continues its running generations on them; their
        behaviour version stays the oldest token's (the version they started with).
        """
        self.wanted[agent] = max(self.wanted[agent], version)
        for replica in self.replicas.values():
            if replica.loaded[0] != agent or replica.loaded[1] >= version:
                continue
            self.settle(replica)
            stall_s = self.load_stall_s(replica, -1, agent, version)
            replica.resume_s = max(replica.resume_s, self.now_s) + stall_s
            self.reschedule(replica)

    # ---- main loop ------------------------------------------------------------------------------------------
    def run(self, max_events: int = 5_000_000) -> SimOutcome:
        """Run until the job finishes (or stalls); return its figures."""
        started = time.perf_counter()
        self.push(self.now_s, "tick", None)
        self.push(self.now_s, "orchestratord", None)
        job = self.planner.job(self.job_id)
        last_progress_s = 0.0
        while self.events and not job.state.terminal and self.event_count < max_events:
            at_s, _, kind, payload = heapq.heappop(self.events)
            self.now_s = max(self.now_s, at_s)
            self.event_count += 1
            if kind == "replica":
                self.on_replica(*payload)
            elif kind == "slot":
                self.on_slot(payload)
            elif kind == "loaded":
                self.on_loaded(payload)
            elif kind == "tick":  # rolloutd's lease renewal and the slots' long-poll period
                if self.now_s - last_progress_s < STALL_S:
                    self.push(self.now_s + TICK_S, "tick", None)
            elif kind == "orchestratord":
                self.on_orchestratord_tick()
                if self.now_s - last_progress_s < STALL_S:
                    self.push(self.now_s + TICK_INTERVAL_S, "orchestratord", None)
                continue
            if kind != "tick":
                last_progress_s = self.now_s
            # The planner is asked when its answer can have changed (orchestratord's long polls
            # wake on the changes that concern them): after reports and slot events; on every tick
            # every waiting poll again (traind's long poll ends after POLL_WAIT_MS and it polls again).
            if kind in ("slot", "tick"):
                self.lease_tasks()
            if kind == "tick":
                self.renew()
                self.reported = False
                self.poll_slots(sorted(self.waiting | self.unpolled))
                self.unpolled.clear()
            elif kind == "slot":
                self.reported = False
                self.poll_slots((payload,))
            elif self.reported:
                self.reported = False
                self.poll_slots()
        for replica in self.replicas.values():
            self.settle(replica)
        outcome = self.outcome(job.state.name, time.perf_counter() - started)
        return dataclasses.replace(
            outcome,
            planner_cpu_s=self.cpu.seconds["planner"],
            balancer_cpu_s=sum(p.cpu_s for p in self.rolloutds),
            planner_calls=self.cpu.calls["planner"],
            balancer_calls=sum(p.cpu.calls["balancer"] for p in self.rolloutds),
            rolloutds=len(self.rolloutds),
            busiest_rolloutd_cpu_s=max(p.cpu_s for p in self.rolloutds),
            modelled_s=self.now_s,
            lease_ops=dict(self.lease_ops),
            agents=len(self.agents),
            method_cpu=self.method_cpu(),
        )

    def method_cpu(self) -> dict[str, tuple[int, float]]:
        """Calls and CPU seconds per outermost method (``planner.x``, ``balancer.x``: every rolloutd's summed)."""
        meters = [self.cpu, *(p.cpu for p in self.rolloutds)]
        methods: dict[str, tuple[int, float]] = {}
        for meter in meters:
            for label, seconds in meter.method_seconds.items():
                calls, total_s = methods.get(label, (0, 0.0))
                methods[label] = (calls + meter.method_calls[label], total_s + seconds)
        return {label: figures for label, figures in sorted(methods.items()) if figures[0]}

    def outcome(self, state: str, sim_wall_s: float) -> SimOutcome:
        """Step seconds between the first and last complete steps (step 0 left out, as in benchmarks.run)."""
        s = self.settings
        done = {}
        for step in range(s.steps):
            times = [self.commits.get((a, step)) for a in self.agents]
            if all(t is not None for t in times):
                done[step] = max(t for t in times if t is not None)
        nan = math.nan
        steps = sorted(done)
        if len(steps) < 2:
            return SimOutcome(
                self.config,
                s.devices,
                s.replicas,
                s.slots,
                s.prompts_per_step * s.group_size,
                state,
                nan,
                nan,
                nan,
                nan,
                self.reassignments(),
                self.event_count,
                sim_wall_s,
                self.max_group_size,
            )
        window_s = done[steps[-1]] - done[steps[0]]
        step_s = window_s / (steps[-1] - steps[0])
        tokens = sum(self.response_tokens.get(b, 0) for b in steps[1:])
        total_s = self.now_s
        rollout_busy = sum(r.busy_s for r in self.replicas.values()) / (len(self.replicas) * total_s)
        train_busy = sum(slot.busy_s for slot in self.slots) / (len(self.slots) * total_s)
        bound = mean_bound(
            [
                device_work_bound(
                    self.profile,
                    [AgentStepWork(a, *self.agent_work.get((b, a), [0, 0])) for a in self.agents],
                    prompt_tokens=self.workload.prompt_tokens,
                    replicas=len(self.replicas),
                    slots=len(self.slots),
                )
                for b in steps[1:]
            ]
        )
        return SimOutcome(
            self.config,
            s.devices,
            s.replicas,
            s.slots,
            s.prompts_per_step * s.group_size,
            state,
            step_s,
            tokens / window_s,
            rollout_busy,
            train_busy,
            self.reassignments(),
            self.event_count,
            sim_wall_s,
            self.max_group_size,
            bound.step_s,
            bound.bound_by,
        )


def sweep(
    devices: Sequence[int],
    configs: Sequence[str],
    base: SimSettings,
    progress: bool = False,
    gc_policies: Sequence[str] = ("daemon",),
    max_events: int = 5_000_000,
) -> list[SimOutcome]:
    """Every configuration at every size (same workload shape and seed), once under each GC policy.

    ``gc_policies`` name :data:`benchmarks.sim_gc.GC_POLICIES` (the daemons' policy, CPython's
    defaults): each run is a fresh simulation, built, then measured under the policy as a daemon
    applies it after start-up. ``progress`` prints each run's line.
    """
    workload = make_workload(base.agents, base.variant)
    outcomes = []
    for count in devices:
        settings = dataclasses.replace(base, devices=count)
        for config in configs:
            for policy in gc_policies:
                outcome = run_under(Simulation(config, settings, workload), policy, max_events)
                first = next((o for o in outcomes if (o.devices, o.config) == (count, config)), outcome)
                if not same_model(first, outcome):  # a GC policy must change no decision
                    print(f"{count} devices {config}: gc {policy} modelled other events than gc {first.gc_policy}",  # noqa: T201
                          flush=True)
                outcomes.append(outcome)
                if progress:
                    print(  # noqa: T201 (a CLI report)
                        f"{count} devices {config} gc {policy}: {outcome.state} step {outcome.step_s:.1f} s, bound "
                        f"{outcome.bound_s:.1f} s, control cpu {outcome.control_cpu_per_step_s:.3f} s/step "
                        f"({outcome.control_cpu_share:.2%}; busiest process {outcome.busiest_process_share:.2%} of a "
                        f"core, {outcome.rolloutds} rolloutd), {outcome.events} events, collections "
                        f"{list(outcome.gc_collections)} ({outcome.gc_cpu_s:.2f} s), sim wall "
                        f"{outcome.sim_wall_s:.0f} s, load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    return outcomes


def uptime() -> str:
    """``uptime``'s line (the machine's load beside the CPU figures; they are thread CPU, which load changes little)."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    """Runs the sweep; returns 0 when every simulated job succeeded."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[48, 96, 192, 384, 768])
    parser.add_argument("--configs", nargs="+", default=["flexmarl", "static", "sequential"], choices=list(SIM_CONFIGS))
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--variant", choices=["long-tail", "uniform"], default="long-tail")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--episodes-per-replica", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--devices-per-slot", type=int, default=8)
    parser.add_argument("--rollout-fraction", type=float, default=2.0 / 3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-slots",
        type=int,
        default=0,
        help="agents' max_slots (0 = per config: sequential every slot, else ceil(slots/agents); 1 = no DP)",
    )
    parser.add_argument("--hysteresis", type=float, default=None, help="balancer hysteresis (default: rolloutd's)")
    parser.add_argument("--balancer-rates", choices=("measured", "prior"), default="measured",
                        help="balancers decide on the rates and load cost their routers measure (rolloutd's default) "
                             "or on the priors (1,000 tokens/s per replica, a 10 s load)")
    parser.add_argument(
        "--replicas-per-rolloutd",
        type=int,
        default=DEFAULT_REPLICAS_PER_ROLLOUTD,
        help="engine replicas per rolloutd process, each with its own balancer (0 = one rolloutd over all)",
    )
    parser.add_argument(
        "--max-tasks-per-rolloutd",
        type=int,
        default=0,
        help="each rolloutd's max_tasks (0 = unbounded for one rolloutd, else its share of the admission window)",
    )
    parser.add_argument(
        "--gc",
        choices=("both", *GC_POLICIES),
        default="both",
        help="garbage-collector policy each run is measured under, applied as the daemons apply it once started "
             "(benchmarks/sim_gc.py): daemon (--gc-freeze, --gc-gen0-threshold defaults), cpython (its defaults), "
             "or both (every run twice)",
    )
    parser.add_argument("--max-events", type=int, default=5_000_000, help="events after which a run stops")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--name", default="sim", help="file stem of the results (<out>/<name>.json, .png)")
    args = parser.parse_args(argv)
    base = SimSettings(
        rollout_fraction=args.rollout_fraction,
        devices_per_slot=args.devices_per_slot,
        episodes_per_replica=args.episodes_per_replica,
        group_size=args.group_size,
        steps=args.steps,
        agents=args.agents,
        variant=args.variant,
        seed=args.seed,
        max_slots=args.max_slots,
        hysteresis=args.hysteresis,
        measured_rates=args.balancer_rates == "measured",
        replicas_per_rolloutd=args.replicas_per_rolloutd,
        max_tasks_per_rolloutd=args.max_tasks_per_rolloutd,
    )
    started_uptime = uptime()
    print(started_uptime, flush=True)  # noqa: T201 (a CLI report)
    policies = tuple(GC_POLICIES) if args.gc == "both" else (args.gc,)
    outcomes = sweep(args.devices, args.configs, base, progress=True, gc_policies=policies, max_events=args.max_events)
    report = table(outcomes) + "\n\n" + cpu_table(outcomes)
    print(report)  # noqa: T201 (a CLI report)
    print(uptime())  # noqa: T201 (a CLI report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python -m benchmarks.sim " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg": os.getloadavg(),
        "uptime": [started_uptime, uptime()],
        "settings": {k: str(v) for k, v in vars(args).items()},
        "outcomes": [
            {**dataclasses.asdict(o), "control_cpu_share": o.control_cpu_share,
             "busiest_process_share": o.busiest_process_share, "rolloutd_share": o.rolloutd_share,
             "control_cpu_per_step_s": o.control_cpu_per_step_s, "lease_ops_per_s": o.lease_ops_per_s}
            for o in outcomes
        ],
        "cpu_growth_exponents": {f"{c}@{d}": e for (c, d), e in growth_exponents(outcomes).items()},
        "table": report,
    }
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=2))
    chart(outcomes, args.out / f"{args.name}.png")
    return 0 if all(o.state == "SUCCEEDED" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
