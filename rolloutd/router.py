"""The generation backend of rolloutd: balancer + engine replicas + versioned weights.

Agents are keyed ``"<job>/<agent>"``. Each replica serves one agent's weights at a
time; the hierarchical balancer decides which agent each replica serves (inter-agent)
and which replica of an agent takes a request (intra-agent). Before a request runs on
a replica, the replica holds at least the version the agent requires; a weight load
takes the replica's write lock, so it waits for the requests in flight there to end
and no request is ever served by a half-loaded model. A replica that fails a request
with Unavailable is removed and the request is retried on another; a background probe
re-admits it once its ``/health`` answers 200 again (its weights are then loaded afresh). A
replica that answers 503 (SGLang: alive but unable to serve the request now) is kept and the
request retried after a backoff. Seeded ``n > 1`` requests are sent as one request per sample
(see :meth:`RolloutRouter.generate`).

Interruptible (partial) rollouts, for the agents of jobs with ``rollout.partial_rollout``
(:meth:`RolloutRouter.set_partial_rollout`): a version published for such an agent
(:meth:`RolloutRouter.publish`) interrupts the generations running on its replicas. Each
replica is paused (``/pause_generation``, :class:`PauseMode` of the router), loads the new
weights and continues. In ``in_place`` and ``retract`` mode the engine keeps the requests and
records the version change in their ``weight_versions`` spans; in ``abort`` mode they come back
with their partial tokens (finish reason abort) and the router resubmits prompt + partial
tokens with the **remaining** budget and the same sampling parameters once the reload is done
(:meth:`RolloutRouter.generate`). Either way each token of a sample carries the version that
sampled it (:attr:`GenerationOutput.version_spans`), and ``version`` is the oldest token's. The
paused engine applies the new weights between two iterations, so even then no token comes from
a half-loaded model.

LoRA agents (:meth:`RolloutRouter.set_lora_agents`): the agents that are adapters of one base
share the base's replica pool (one balancer group, ``lora-base:<base>``; :mod:`rolloutd.balancer`),
whose replicas hold the base's weights and never reload them for a version: a request of such an
agent runs inside :meth:`LoraResidency.use <rolloutd.lora_residency.LoraResidency.use>` of its
replica, which loads the required version as the adapter ``<agent>@v<k>`` beside older ones, and
is sent with ``lora_path`` set to that name. A published version therefore needs no drain or
interruption. Version 0 is the base alone (traind's fresh adapter has ``lora_B = 0``, PEFT's
default init, and publishes no adapter for it): its requests carry no ``lora_path``. A request's
version is fixed when it is routed (the one its agent requires then): the balancer counts the name
it will carry (``<agent>@v<k>``, or :data:`~rolloutd.balancer.BASE_ADAPTER` for version 0) toward
the replica's ``--max-loras-per-batch``, as SGLang's scheduler counts the names of a batch, and
the request is served with exactly that name.

The balancer decides on measured figures (``BalancerConfig.measured_rates``): each replica's
delivered tokens per busy second, from its generations (:mod:`rolloutd.replica_rates`), and the
seconds of a weight load from disk, each fed to the balancer as it changes.

Distributed weight sync (``rollout.weight_sync: distributed``,
:meth:`RolloutRouter.set_distributed_sync`): a version the agent's trainer announces is received
by its replicas over the trainer's weight-update group (:meth:`RolloutRouter.receive_broadcast`,
:mod:`rolloutd.weight_sync`) under their write locks; a replica that misses it reloads from disk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from flexmarl.episode import TOP_LOGPROBS_KEY, GenerationOutput
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from flexmarl.retry import Backoff
from flexmarl.weight_group import WeightGroupRecord, failures_by_name
from rolloutd.balancer import (
    BASE_ADAPTER,
    AgentSpec,
    BalancerConfig,
    HierarchicalBalancer,
    ReplicaAssignment,
    ReplicaPhase,
    Ticket,
    TokenEstimator,
)
from rolloutd.balancer_types import split_keeping_loaded
from rolloutd.engines.http_client import EngineBusy
from rolloutd.engines.protocol import (
    FinishReason,
    GenerationResult,
    PauseMode,
    SamplingParams,
)
from rolloutd.generation_parts import engine_spans, joined_output, run_parts, sample_parts
from rolloutd.job_backend import JobBackend, request_seed
from rolloutd.job_backend import agent_key as agent_key  # re-exported: the public name of before
from rolloutd.lora_residency import AdapterVersion, LoraResidency
from rolloutd.move_patience import EvictionAborts
from rolloutd.replica import Replica as Replica  # re-exported: rolloutd.router.Replica is the public name
from rolloutd.replica_rates import BalancerFeed, RateSettings
from rolloutd.weight_sync import AgentWeightGroup, GroupMember, SyncOutcome

log = logging.getLogger(__name__)

#: Resolves a weights URI (or a base model path) to a local checkpoint dir.
WeightsResolver = Callable[[str], Awaitable[str]]

MAX_ATTEMPTS = 3
#: How often a replica moved away from a partial-rollout agent checks whether to abort again, and the
#: longest wait between its repeated aborts (RolloutRouter._evict, move_patience.EvictionAborts).
EVICT_POLL_S = 0.05
EVICT_REPEAT_MAX_S = 1.0
#: Most resubmissions of one interrupted sample (each follows an interruption that aborted it).
MAX_RESUMES = 64


def lora_pool_key(base: str) -> str:
    """The balancer group (and ``loaded_agent``) of the replicas that serve base model ``base`` to LoRA agents."""
    return f"lora-base:{base}"


@dataclasses.dataclass(frozen=True)
class WantedWeights:
    """The version an agent's requests need now, and where its weights are."""

    version: int
    uri: str


class RolloutRouter:
    """Routes agent generations to replicas; loads the right weights first."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        resolve_weights: WeightsResolver,
        config: BalancerConfig | None = None,
        on_reload: Callable[[str, float], None] | None = None,
        *,
        health_probe_interval_s: float = 5.0,
        busy_backoff_s: float = 1.0,
        interrupt_mode: PauseMode = PauseMode.IN_PLACE,
        owner: str = "rolloutd",
        on_broadcast: Callable[[str, SyncOutcome], None] | None = None,
        rate_settings: RateSettings | None = None,
    ) -> None:
        """Routes over ``replicas``.

        Args:
            replicas: The engine replicas (ids unique).
            resolve_weights: Maps a weights URI to a directory the engines can load.
            config: Balancer tunables. With ``measured_rates`` the router measures each replica's
                delivered tokens/s and the seconds of its weight loads (:mod:`rolloutd.replica_rates`)
                and the balancer decides on those (``prior_tokens_per_s`` and ``reassignment_cost_s``
                until measured); without, on the configured ones.
            on_reload: Called with (agent key, seconds) after each weight load.
            health_probe_interval_s: How often a dropped replica's ``/health`` is asked whether
                it may serve again.
            busy_backoff_s: First wait before retrying a request a replica answered 503
                (doubled per attempt).
            interrupt_mode: How a published version interrupts the generations of a
                partial-rollout agent (see the module doc): ``in_place`` keeps their KV cache,
                ``retract`` recomputes it, ``abort`` returns them for resubmission.
            owner: This rolloutd's worker id (the peer name it posts its members to a weight-update group under).
            on_broadcast: Called with (agent key, outcome) after each version received over a
                weight-update group (its phases' seconds included).
            rate_settings: How replica rates and load costs are measured (tests shorten the windows).
        """
        if health_probe_interval_s <= 0 or busy_backoff_s < 0:
            raise InvalidArgument("health_probe_interval_s must be > 0 and busy_backoff_s >= 0")
        self._health_probe_interval_s = health_probe_interval_s
        self._busy_backoff_s = busy_backoff_s
        self._probe: asyncio.Task[None] | None = None
        self._replicas = {r.replica_id: r for r in replicas}
        self._resolve = resolve_weights
        self._config = config or BalancerConfig()
        self._estimator = TokenEstimator()
        self._measured = BalancerFeed(self._config.prior_tokens_per_s, self._config.reassignment_cost_s, rate_settings)
        self._wanted: dict[str, WantedWeights] = {}
        self._balancer: HierarchicalBalancer | None = None
        self._agents: tuple[str, ...] = ()
        self._placed: dict[int, asyncio.Future[Ticket]] = {}
        self._in_flight = 0
        self._in_flight_by_key: collections.Counter[str] = collections.Counter()
        self._membership = asyncio.Lock()  # one set_agents at a time
        self._leaving: set[str] = set()  # agent keys set_agents is removing: no new request
        self._demand_hints: dict[str, int] = {}  # last hint per agent key (the balancer may drop one)
        self._quiet = asyncio.Condition()
        self._rebuilding = False
        self._on_reload = on_reload
        self._on_broadcast = on_broadcast
        self._loads: set[asyncio.Task[None]] = set()
        self._interrupt_mode = PauseMode(interrupt_mode)
        self._interruptible: set[str] = set()
        self._owner = owner
        #: Agents with rollout.weight_sync distributed -> their weight-update groups here.
        self._weight_groups: dict[str, AgentWeightGroup] = {}
        self._broadcast_locks: dict[str, asyncio.Lock] = {}
        #: LoRA agent key -> its base model (set_lora_agents); the adapter slots of a pool replica.
        self._lora_bases: dict[str, str] = {}
        self._adapter_slots: int | None = None

    # ---- agents and versions -------------------------------------------------------------------

    @property
    def reassignments(self) -> int:
        """Inter-agent replica moves so far."""
        return self._balancer.reassignments if self._balancer is not None else 0

    def replicas(self) -> list[Replica]:
        """Every known replica (healthy or not)."""
        return list(self._replicas.values())

    def delivered_tokens_per_s(self, replica_id: str) -> float:
        """A replica's own measured rate (tokens per busy second; the prior until measured)."""
        return self._measured.rates.tokens_per_s(replica_id)

    def balancer(self) -> HierarchicalBalancer | None:
        """The current balancer (None before the first job)."""
        return self._balancer

    def require(self, key: str, version: int, uri: str) -> None:
        """Requests of agent key need at least this version (weights at uri)."""
        current = self._wanted.get(key)
        if current is None or version > current.version:
            self._wanted[key] = WantedWeights(version, uri)

    def set_distributed_sync(self, key: str, enabled: bool) -> None:
        """Whether agent key's versions arrive by its trainer's broadcast (:meth:`announce`) besides the disk."""
        if enabled:
            self._weight_groups.setdefault(key, AgentWeightGroup(self._owner))
        else:
            self._weight_groups.pop(key, None)

    def announce(self, key: str, version: int, record: WeightGroupRecord) -> None:
        """Agent key's trainer is about to broadcast ``version`` over ``record``: its replicas receive it."""
        if key in self._weight_groups:
            self._spawn(self._announced(key, version, record))

    async def _announced(self, key: str, version: int, record: WeightGroupRecord) -> None:
        await self.receive_broadcast(key, version, record)

    async def receive_broadcast(self, key: str, version: int, record: WeightGroupRecord) -> SyncOutcome | None:
        """Has the agent's replicas receive the broadcast (:mod:`rolloutd.weight_sync`), drained or paused.

        The replicas serving the agent now are the group's members. For a partial-rollout agent
        each is paused (``/pause_generation`` in the router's interrupt mode, as for a disk
        version: ``in_place`` keeps the running generations, which continue on the new weights
        and record the switch in their version spans), receives the version without a cache flush
        (SGLang refuses one under running requests) and continues; slime pauses the same way
        around its broadcast (update_weight_from_distributed.py). Any other agent's replicas are
        drained (the write lock: running generations end, new ones wait). Either way for at most
        half the group's timeout, so rank 0 still finds the post in time. A replica that received
        the whole version serves it at once (before the trainer's commit, which only adds the
        durable copy). One that failed may hold torn weights: a drained one is reloaded from the
        durable copy before it serves again (``loaded_version`` -1: the next request reloads the
        agent's required version); a paused one first reloads the version it served from disk,
        still paused, so its running generations never decode on a torn model (it is dropped if
        that fails too).

        Returns:
            What the version did (None: the agent does not sync over a group here).
        """
        group = self._weight_groups.get(key)
        if group is None:
            return None
        paused = key in self._interruptible and key not in self._lora_bases
        lock = self._broadcast_locks.setdefault(key, asyncio.Lock())
        async with lock, contextlib.AsyncExitStack() as held:
            start = time.perf_counter()
            members: list[Replica] = []
            try:
                async with asyncio.timeout(record.timeout_s / 2):
                    for replica in sorted(self._replicas.values(), key=lambda r: r.replica_id):
                        if not (replica.healthy and replica.loaded_agent == key
                                and isinstance(replica.client, GroupMember)):
                            continue
                        await held.enter_async_context(replica.reload_lock)
                        if not paused:
                            await held.enter_async_context(replica.lock.write())
                        if replica.healthy and replica.loaded_agent == key:  # not moved meanwhile
                            members.append(replica)
            except TimeoutError:
                log.warning("%s v%d: only %d replicas drained in %.0fs; the others load it from disk", key,
                            version, len(members), record.timeout_s / 2)
            if paused:
                members = await self._pause_for_broadcast(members, record.timeout_s / 2)
            clients = {r.replica_id: r.client for r in self._replicas.values() if isinstance(r.client, GroupMember)}
            try:
                outcome = await group.receive(version, record, [(r.replica_id, clients[r.replica_id]) for r in members],
                                              clients, flush_cache=not paused)
                for replica in members:
                    if replica.replica_id in outcome.served:
                        replica.loaded_version = version
                        replica.reloads += 1
                        if paused and replica.lock.busy:  # running generations continue on the new weights
                            replica.interruptions += 1
                            log.info("replica %s interrupted (%s) to serve %s v%d by broadcast", replica.replica_id,
                                     self._interrupt_mode.value, key, version)
                    elif replica.replica_id in outcome.failed:
                        log.warning("replica %s missed %s v%d (%s); it reloads from the durable copy",
                                    replica.replica_id, key, version, outcome.failed[replica.replica_id])
                        if paused:
                            await self._restore_paused(replica, key)
                        else:
                            replica.loaded_version = -1  # torn: reloaded from the durable copy before it serves
            finally:
                if paused:
                    await self._continue_all(members)
            if outcome.served and self._on_reload is not None:
                self._on_reload(key, time.perf_counter() - start)
            if self._on_broadcast is not None:
                self._on_broadcast(key, outcome)
            return outcome

    async def _pause_for_broadcast(self, members: list[Replica], timeout_s: float) -> list[Replica]:
        """Pauses each member's generation for a broadcast; the ones that paused (a failed one is dropped)."""
        calls = {r.replica_id: r.client.pause_generation(self._interrupt_mode) for r in members}
        failures = await failures_by_name(calls, timeout_s, "pause_generation")
        for replica in members:
            if replica.replica_id in failures:
                self._drop_replica(replica, f"pause_generation for a broadcast: {failures[replica.replica_id]}")
        return [r for r in members if r.replica_id not in failures]

    async def _restore_paused(self, replica: Replica, key: str) -> None:
        """A paused replica that missed a broadcast reloads the weights it served before, still paused."""
        wanted = self._wanted.get(key)
        try:
            if wanted is None or wanted.version != replica.loaded_version:
                raise FlexmarlError(f"serves v{replica.loaded_version}, its durable copy is not known here")
            path = await self._resolve(wanted.uri)
            await replica.client.update_weights_from_disk(path, weight_version=str(wanted.version),
                                                          flush_cache=False)
            replica.reloads += 1
        except FlexmarlError as exc:  # no whole model to continue the paused generations on
            self._drop_replica(replica, f"could not restore v{replica.loaded_version} after a failed broadcast: {exc}")

    async def _continue_all(self, members: list[Replica]) -> None:
        calls = {r.replica_id: r.client.continue_generation() for r in members if r.healthy}
        for rid, exc in (await failures_by_name(calls, 30.0, "continue_generation")).items():
            self._drop_replica(self._replicas[rid], f"continue_generation after a broadcast: {exc}")

    def set_lora_agents(self, bases: Mapping[str, str], adapter_slots: int | None = None) -> None:
        """Which agent keys are LoRA adapters, each of its base model; call before :meth:`set_agents`.

        ``adapter_slots`` is the engines' ``--max-loras-per-batch`` (None: no bound here). Keys
        not in ``bases`` are full-model agents. Takes effect for the agents :meth:`set_agents` adds next.
        """
        self._lora_bases = dict(bases)
        self._adapter_slots = adapter_slots
        for base in set(bases.values()):
            self._wanted[lora_pool_key(base)] = WantedWeights(0, base)  # the pool serves the base itself

    def model_key(self, key: str) -> str:
        """What a replica must hold to serve agent key: the agent's own weights, or its base's pool."""
        base = self._lora_bases.get(key)
        return key if base is None else lora_pool_key(base)

    def set_partial_rollout(self, key: str, enabled: bool) -> None:
        """Whether a version published for agent key interrupts its running generations.

        And, with ``BalancerConfig.move_evicts``, whether a replica the balancer moves away from the
        agent hands its generations on instead of draining them (:meth:`_evict`).
        """
        if enabled:
            self._interruptible.add(key)
        else:
            self._interruptible.discard(key)
        self._tell_evicting_groups()

    def _tell_evicting_groups(self) -> None:
        """Tells the balancer the groups whose moved replicas hand their generations on (see :meth:`_evict`)."""
        if self._balancer is not None:
            self._balancer.set_evicting_groups(
                {key for key in self._interruptible if key in self._agents and key not in self._lora_bases}
                if self._config.move_evicts else ())

    def publish(self, key: str, version: int, uri: str) -> None:
        """A new version of agent key was published (weights at uri).

        For a partial-rollout agent, every healthy replica serving an older version is reloaded
        now, its running generations interrupted (see the module doc); for any other agent
        nothing happens (its requests keep the versions their tasks require), nor for a LoRA
        agent (a version is an adapter loaded beside the old one: nothing to drain or interrupt).
        """
        if key not in self._interruptible or key in self._lora_bases:
            return
        self.require(key, version, uri)
        for replica in self._replicas.values():
            if replica.healthy and replica.loaded_agent == key and replica.loaded_version < version:
                self._spawn(self._interrupt(replica, key))

    async def _interrupt(self, replica: Replica, key: str) -> None:
        """Brings a replica of key to the wanted version, pausing its running generations if any."""
        async with replica.reload_lock:
            wanted = self._wanted[key]
            if not replica.healthy or replica.loaded_agent != key or replica.loaded_version >= wanted.version:
                return
            try:
                if not replica.lock.busy:  # nothing to interrupt: an ordinary reload
                    await self._reload(replica, key)
                    return
                start = time.perf_counter()
                path = await self._resolve(wanted.uri)  # before the pause: keep it short
                mode = self._interrupt_mode
                # The start is logged too: benchmarks.chaos --partial SIGKILLs rolloutd right after it.
                log.info("replica %s pausing (%s) to serve %s v%d", replica.replica_id, mode.value, key, wanted.version)
                await replica.client.pause_generation(mode)
                try:
                    # After an in-place pause the running requests keep their KV: SGLang refuses the flush.
                    await replica.client.update_weights_from_disk(path, weight_version=str(wanted.version),
                                                                  flush_cache=mode is not PauseMode.IN_PLACE)
                    replica.loaded_version = wanted.version
                    replica.reloads += 1
                    replica.interruptions += 1
                finally:
                    await replica.client.continue_generation()
            except Unavailable as exc:
                self._drop_replica(replica, str(exc))
                return
            except FlexmarlError as exc:  # the next request reloads through the write lock
                log.error("interrupting %s on %s for v%d failed: %s", key, replica.replica_id, wanted.version, exc)
                return
            seconds = time.perf_counter() - start
            log.info("replica %s interrupted (%s) to serve %s v%d (%.2fs)", replica.replica_id, mode.value, key,
                     wanted.version, seconds)
            self._reloaded(key, seconds)

    async def set_agents(self, keys: Sequence[str]) -> None:
        """Serves exactly these agents (a job or an evaluation round joined or left).

        The agents that join are added to the balancer and those that leave are removed once their own
        requests ended; every other agent's requests go on meanwhile. A replica serves one model at a
        time, as an SGLang or vLLM server does, so a joining agent is served by replicas the balancer
        moves to it, and a group left without agents hands its replicas on as moves. Static and
        round-robin balancing then move replicas until the shares are equal again
        (:meth:`HierarchicalBalancer.even_out`), each draining only its own requests. The first agents
        and the last ones leaving rebuild the balancer after every request in flight drained.
        """
        wanted = tuple(sorted(set(keys)))
        async with self._membership:
            if wanted == self._agents:
                return
            if self._balancer is None or not wanted:
                await self._rebuild(wanted)
                return
            leaving = set(self._agents) - set(wanted)
            joining = [k for k in wanted if k not in self._agents]
            self._leaving |= leaving
            try:
                async with self._quiet:
                    await self._quiet.wait_for(lambda: not any(self._in_flight_by_key[k] for k in leaving))
                await self._release_adapters([r for r in self._replicas.values() if r.healthy], wanted)
                balancer = self._balancer
                assert balancer is not None  # only _rebuild replaces it, under the same lock
                pools = {lora_pool_key(self._lora_bases[k]) for k in joining if k in self._lora_bases}
                balancer.add_agents([self._agent_spec(k) for k in joining],
                                    {} if self._adapter_slots is None else dict.fromkeys(pools, self._adapter_slots))
                balancer.remove_agents(leaving, time.monotonic())
                if not self._config.rebalance_enabled:
                    balancer.even_out(time.monotonic())
                self._agents = wanted
                self._tell_evicting_groups()
                for key in leaving:
                    self._demand_hints.pop(key, None)
                    self._in_flight_by_key.pop(key, None)
            finally:
                self._leaving -= leaving
            log.info("serving agents %s (joined %s, left %s) on %s", list(wanted), joining, sorted(leaving),
                     balancer.replica_counts())
            self._rebalance()

    async def _rebuild(self, wanted: tuple[str, ...]) -> None:
        """A new balancer for ``wanted``, after every request in flight drained."""
        async with self._quiet:
            self._rebuilding = True
            try:
                await self._quiet.wait_for(lambda: self._in_flight == 0)
                self._in_flight_by_key.clear()
                healthy = [r for r in self._replicas.values() if r.healthy]
                if not healthy:
                    raise Unavailable("no healthy engine replica")
                await self._release_adapters(healthy, wanted)
                self._agents = wanted
                if not wanted:
                    self._balancer = None
                    return
                groups = tuple(sorted({self.model_key(k) for k in wanted}))
                specs = self._initial_assignment(healthy, groups)
                pools = {lora_pool_key(b) for k, b in self._lora_bases.items() if k in wanted}
                slots = {} if self._adapter_slots is None else dict.fromkeys(pools, self._adapter_slots)
                self._balancer = HierarchicalBalancer(specs, [self._agent_spec(k) for k in wanted], self._config,
                                                      adapter_slots=slots, estimator=self._estimator)
                self._tell_evicting_groups()
                if self._config.dispatch_kv_factor > 0:
                    for replica in healthy:
                        await self._set_kv_capacity(replica)
                if self._config.measured_rates:
                    self._balancer.set_reassignment_cost_s(self._measured.reload_cost.seconds)
                log.info("serving agents %s on %d replicas: %s", list(wanted), len(specs),
                         {s.replica_id: s.model_key for s in specs})
            finally:
                self._rebuilding = False
                self._quiet.notify_all()

    def _agent_spec(self, key: str) -> AgentSpec:
        return AgentSpec(key, self.model_key(key), adapter=key in self._lora_bases)

    async def _set_kv_capacity(self, replica: Replica) -> None:
        """Tells the balancer the replica's KV capacity (read from its engine once; unbounded if it does not say)."""
        if replica.kv_capacity_tokens is None:
            try:
                info = await replica.client.server_info()
            except FlexmarlError as exc:  # its next request shows what is wrong; until then it is not bounded
                log.warning("replica %s: no server info (%s); its requests are not bounded by its KV cache",
                            replica.replica_id, exc)
                return
            tokens = info.get("max_total_num_tokens")
            replica.kv_capacity_tokens = float(tokens) if isinstance(tokens, int | float) and tokens > 0 else math.inf
        if self._balancer is not None and self._balancer.replica(replica.replica_id) is not None:
            self._balancer.set_replica_kv_capacity(replica.replica_id, replica.kv_capacity_tokens)

    @staticmethod
    async def _release_adapters(replicas: Sequence[Replica], served: Sequence[str]) -> None:
        """Unloads the adapters of LoRA agents no longer served (their job ended); no request uses them now."""
        for replica in replicas:
            if replica.lora is None:
                continue
            for agent in replica.lora.agents():
                if agent not in served:
                    try:
                        await replica.lora.release_agent(agent)
                    except FlexmarlError as exc:  # the replica's problem shows at its next request
                        log.warning("unloading %s's adapters on %s failed: %s", agent, replica.replica_id, exc)

    def _initial_assignment(self, healthy: Sequence[Replica], agents: Sequence[str]) -> list[ReplicaAssignment]:
        """Keeps replicas on the agent they already hold where possible (no reload), else deals them out."""
        assigned = split_keeping_loaded({r.replica_id: r.loaded_agent for r in healthy}, agents)
        return [self._assignment(rid, assigned[rid]) for rid in sorted(assigned)]

    # ---- generation ------------------------------------------------------------------------------

    def backend(self, job_id: str, seed: int | None = None, seed_scope: str = "") -> JobBackend:
        """The GenerationBackend of one job's runner (seeded sampling when seed is given).

        ``seed_scope``: the job whose task ids the episodes carry, when it is not ``job_id`` (a pinned
        evaluation round served as ``<job>@<round>``).
        """
        return JobBackend(self, job_id, seed, seed_scope)

    async def generate(
        self, key: str, input_ids: list[int], sampling: Mapping[str, Any], n: int, affinity_key: str,
        seed: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples n responses with agent key's required version; retries on another replica.

        ``seed`` (when given and the sampling has none) makes the samples a function of the
        request and the weights alone, whatever replica or batch serves it: the same job and
        seed then roll out the same experiences in sync and async mode.

        A seeded request with ``n > 1`` goes out as ``n`` requests with ``n = 1`` and seeds
        ``seed + i`` (sample ``i``), sent together to one replica: SGLang gives all samples of
        one request the one seed, and its seeded sampler hashes only the seed and the position
        (``srt/layers/sampler.py`` ``multinomial_with_seed``, ``srt/sampling/sampling_batch_info.py``),
        so one ``n``-request would return ``n`` identical samples (slime does the same,
        ``slime/rollout/sglang_rollout.py``). The radix cache keeps the shared prompt cheap.
        Unseeded ``n > 1`` requests stay one request. Samples come back in sample order, each
        with the version that generated it; samples a failed replica did not deliver are retried
        on another.

        For a partial-rollout agent each sample carries its tokens' versions (the engine's
        ``weight_versions`` spans), and a sample an interruption aborted is resubmitted as
        prompt + its tokens so far, one sample, with the same sampling parameters (stop strings,
        stop token ids, seed) and ``max_new_tokens`` minus the tokens it has; tokens, logprobs and
        version spans of the pieces are concatenated, however many interruptions it meets. A
        resumed sample is not the one an uninterrupted run would have drawn, seeded or not: the
        new weights change it, and the resubmission samples from output position 0 again.
        """
        # top_logprobs_num rides in the sampling dict (flexmarl/episode.py TOP_LOGPROBS_KEY) but is a /generate field.
        wire = {**{k: v for k, v in sampling.items() if k != TOP_LOGPROBS_KEY}, "n": n}
        top_logprobs_num = int(sampling.get(TOP_LOGPROBS_KEY) or 0)
        if seed is not None and wire.get("sampling_seed") is None:
            wire["sampling_seed"] = request_seed(seed, key, affinity_key, input_ids)
        return await self._generate(key, input_ids, SamplingParams.from_wire(wire), affinity_key, MAX_RESUMES,
                                    top_logprobs_num)

    async def _generate(
        self, key: str, input_ids: list[int], params: SamplingParams, affinity_key: str, resumes_left: int,
        top_logprobs_num: int = 0, prior_tokens: int = 0,
    ) -> list[GenerationOutput]:
        """:meth:`generate`; ``prior_tokens``: a resumed sample's tokens so far (the tail of ``input_ids``)."""
        parts = sample_parts(params)
        done: dict[int, list[GenerationOutput]] = {}
        last_error: FlexmarlError | None = None
        busy = Backoff(self._busy_backoff_s, self._busy_backoff_s * 2 ** (MAX_ATTEMPTS - 1))
        for attempt in range(MAX_ATTEMPTS):
            observed: list[int] = []  # response lengths, fed to the estimator as the request ends
            todo = [index for index in range(len(parts)) if index not in done]
            samples = sum(parts[index].n for index in todo)
            served = self._wanted.get(key) if key in self._lora_bases else None  # this attempt's adapter version
            ticket = await self._acquire(key, len(input_ids), params.max_new_tokens, samples, affinity_key,
                                         self._adapter_name(key, served))
            replica = self._replicas[str(ticket.replica_id)]
            model_key = self.model_key(key)
            try:
                with replica.request():
                    await self._ensure_weights(replica, model_key)
                    async with replica.lock.read():
                        if replica.loaded_agent != model_key:  # a concurrent load won; route again
                            raise _Reroute
                        todo_parts = [parts[index] for index in todo]
                        with self._generation(replica.replica_id, model_key) as delivered:
                            if model_key == key:
                                version = replica.loaded_version
                                outcomes = await run_parts(replica.client, input_ids, todo_parts, top_logprobs_num)
                            else:
                                version, outcomes = await self._run_adapter(replica, key, served, input_ids,
                                                                            todo_parts, top_logprobs_num)
                            delivered.append(sum(r.completion_tokens for outcome in outcomes
                                                 if not isinstance(outcome, Unavailable) for r in outcome))
                failures: list[Unavailable] = []
                for index, outcome in zip(todo, outcomes, strict=True):
                    if isinstance(outcome, Unavailable):
                        failures.append(outcome)
                        continue
                    # A sample's whole length, once: an aborted piece is observed with the piece that ends it.
                    observed.extend(prior_tokens + result.completion_tokens for result in outcome
                                    if result.finish_reason != FinishReason.ABORT)
                    done[index] = [self._output(key, r, version) for r in outcome]
                if not failures:
                    break
                raise next((f for f in failures if not isinstance(f, EngineBusy)), failures[0])
            except _Reroute:
                continue
            except EngineBusy as exc:  # alive but could not serve now: back off, keep the replica
                last_error = exc
                log.info("replica %s busy: %s", replica.replica_id, exc)
            except Unavailable as exc:
                last_error = exc
                self._drop_replica(replica, str(exc))
            finally:
                self._release(ticket, observed)
            if isinstance(last_error, EngineBusy) and attempt + 1 < MAX_ATTEMPTS:
                await busy.sleep()
        else:
            raise last_error or Unavailable(f"{key}: no replica could serve the request")
        outputs = [(parts[index], output) for index in range(len(parts)) for output in done[index]]
        if key not in self._interruptible:
            return [output for _, output in outputs]
        if all(output.finish_reason != FinishReason.ABORT for _, output in outputs):
            return [output for _, output in outputs]
        try:
            async with asyncio.TaskGroup() as group:  # a failed resumption cancels the others
                resumed = [group.create_task(self._resume(key, input_ids, part, output, affinity_key, resumes_left,
                                                          top_logprobs_num, prior_tokens))
                           for part, output in outputs]
        except ExceptionGroup as failed:  # callers handle the domain error, not the group
            raise failed.exceptions[0] from None
        return [task.result() for task in resumed]

    @contextlib.contextmanager
    def _generation(self, replica_id: str, model_key: str) -> Iterator[list[int]]:
        """Measures one generation on a replica serving ``model_key``: the body appends the tokens it delivered.

        A generation that raises is charged nothing; a replica serving another model is measured
        afresh. The balancer counts every replica at their capacity (:class:`BalancerFeed
        <rolloutd.replica_rates.BalancerFeed>`).
        """
        delivered: list[int] = []
        if not self._config.measured_rates:
            yield delivered
            return
        mark = self._measured.begin(replica_id, model_key, time.monotonic())
        try:
            yield delivered
        except BaseException:
            self._measured.end(replica_id, mark, time.monotonic(), None, self._balancer)
            raise
        self._measured.end(replica_id, mark, time.monotonic(), sum(delivered), self._balancer)

    def _reloaded(self, key: str, seconds: float) -> None:
        """A weight load from disk took ``seconds``: the balancer's move cost follows it (measured rates)."""
        if self._config.measured_rates:
            self._measured.reloaded(seconds, self._balancer)
        if self._on_reload is not None:
            self._on_reload(key, seconds)

    def _assignment(self, replica_id: str, model_key: str) -> ReplicaAssignment:
        """A replica's place in a new balancer, at the replicas' measured capacity (the prior before one)."""
        return ReplicaAssignment(replica_id, model_key, self._measured.capacity)

    def _adapter_name(self, key: str, served: WantedWeights | None) -> str | None:
        """The adapter name a LoRA agent's request served with ``served`` carries (None: a full model's request).

        What the balancer counts toward a replica's adapter slots; the name
        :meth:`LoraResidency.use <rolloutd.lora_residency.LoraResidency.use>` yields for it.
        """
        if key not in self._lora_bases or served is None:
            return None  # (no weights known: the request fails in _run_adapter)
        if served.uri == self._lora_bases[key]:  # the initial version: the base alone (see the module doc)
            return BASE_ADAPTER
        return str(AdapterVersion(key, served.version))

    async def _run_adapter(
        self, replica: Replica, key: str, wanted: WantedWeights | None, input_ids: list[int],
        parts: Sequence[SamplingParams], top_logprobs_num: int,
    ) -> tuple[int, list[list[GenerationResult] | Unavailable]]:
        """The parts of a LoRA agent's request on a pool replica, with version ``wanted`` as adapter.

        ``wanted`` is the version the request's ticket was routed with (its adapter name counted
        by the balancer). Returns the version served and the parts' outcomes (see :func:`run_parts`).
        """
        if wanted is None:
            raise Unavailable(f"no weights known for {key}")
        if self._adapter_name(key, wanted) == BASE_ADAPTER:  # the initial version: the base alone
            return wanted.version, await run_parts(replica.client, input_ids, parts, top_logprobs_num)
        if replica.lora is None:
            replica.lora = LoraResidency(replica.client, self._resolve)
        async with replica.lora.use(key, wanted.version, wanted.uri) as name:
            return wanted.version, await run_parts(replica.client, input_ids, parts, top_logprobs_num, name)

    def _output(self, key: str, result: GenerationResult, version: int) -> GenerationOutput:
        """One sample; a partial-rollout agent's carries the versions its tokens were sampled with."""
        output = GenerationOutput(tuple(result.output_ids), tuple(result.output_token_logprobs),
                                  str(result.finish_reason), version, top_logprobs=result.output_top_logprobs)
        if key not in self._interruptible or key in self._lora_bases:  # an adapter's engine spans name the base
            return output
        spans = engine_spans(result)
        if not spans:
            return output
        return dataclasses.replace(output, version=spans[0][1], version_spans=spans if len(spans) > 1 else ())

    async def _resume(
        self, key: str, input_ids: list[int], params: SamplingParams, output: GenerationOutput, affinity_key: str,
        resumes_left: int, top_logprobs_num: int = 0, prior_tokens: int = 0,
    ) -> GenerationOutput:
        """An aborted sample completed on the weights now served (see :meth:`generate`)."""
        if output.finish_reason != FinishReason.ABORT:
            return output
        remaining = params.max_new_tokens - len(output.token_ids)
        if remaining <= 0:
            return dataclasses.replace(output, finish_reason=str(FinishReason.LENGTH))
        if output.token_ids and output.token_ids[-1] in params.stop_token_ids:
            return dataclasses.replace(output, finish_reason=str(FinishReason.STOP))
        if resumes_left <= 0:
            raise Unavailable(f"{key}: a sample was interrupted more than {MAX_RESUMES} times")
        rest_params = dataclasses.replace(params, n=1, max_new_tokens=remaining)
        (rest,) = await self._generate(key, [*input_ids, *output.token_ids], rest_params, affinity_key,
                                       resumes_left - 1, top_logprobs_num, prior_tokens + len(output.token_ids))
        return joined_output(output, rest)

    async def _acquire(
        self, key: str, prompt_tokens: int, max_new_tokens: int, n: int, affinity_key: str, adapter: str | None = None,
    ) -> Ticket:
        async with self._quiet:
            await self._quiet.wait_for(lambda: not self._rebuilding)
            if self._balancer is None or key not in self._agents or key in self._leaving:
                raise Unavailable(f"agent {key} is not served by this rolloutd")
            ticket = self._balancer.route(key, prompt_tokens, max_new_tokens, n, affinity_key, adapter,
                                          kv_tokens=n * (prompt_tokens + max_new_tokens))
            self._in_flight += 1
            self._in_flight_by_key[key] += 1
        if ticket.replica_id is not None:
            return ticket
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._placed[ticket.request_id] = future
        self._rebalance()
        try:
            return await future
        except BaseException:
            self._placed.pop(ticket.request_id, None)
            self._release(ticket)
            raise

    def _release(self, ticket: Ticket, observed: Sequence[int] = ()) -> None:
        """A request ended: the balancer frees its ticket and learns its response lengths (``observed``)."""
        settled = False
        if self._balancer is not None:
            with contextlib.suppress(FlexmarlError):
                settled = self._balancer.release(ticket.request_id, time.monotonic(), observed)
                observed = ()  # the balancer fed them to the estimator
        for tokens in observed:  # no balancer, or it no longer knew the request: the estimator learns them here
            self._estimator.observe(ticket.agent, tokens)
        self._in_flight -= 1
        left = self._in_flight_by_key[ticket.agent] - 1
        self._in_flight_by_key[ticket.agent] = left
        if not settled:
            self._rebalance()
        if self._in_flight == 0 or (not left and ticket.agent in self._leaving):
            self._spawn(self._notify_quiet())

    async def _notify_quiet(self) -> None:
        async with self._quiet:
            self._quiet.notify_all()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def _rebalance(self) -> None:
        """Applies balancer moves: drained replicas load their new agent's weights."""
        balancer = self._balancer
        if balancer is None:
            return
        now_s = time.monotonic()
        if balancer.settled(now_s):  # nothing waits, no rebalance is due: what follows would do nothing
            return
        starved = balancer.starved_agents()
        if starved:
            # A queued agent has no replica: decide now. The balancer's own urgency flag is
            # cleared by a rebalance that found no donor yet (the donor's last requests were
            # still running), and nothing else would call back before the next interval.
            # Waiting requests are real demand, a hint only demand to come: an agent holding
            # the last replica with nothing but a hint must give way, or two agents that take
            # turns in an episode deadlock (the idle one's hint keeps its replica forever).
            for key, hint in self._demand_hints.items():
                if hint and key not in starved and key in self._agents and balancer.demand_tokens(key) == hint:
                    balancer.set_demand_hint(key, 0)
            moves = balancer.rebalance(now_s)
        else:
            moves = balancer.maybe_rebalance(now_s)
        for move in moves:  # with what it was decided on
            view = balancer.replica(move.replica_id)
            log.info("moving replica %s from %s to %s (measured %.1f tokens/s, counted %.1f there; a load %.2fs, "
                     "a drain from there %.1fs)", move.replica_id, move.from_model_key, move.to_model_key,
                     self.delivered_tokens_per_s(move.replica_id), view.tokens_per_s if view is not None else 0.0,
                     balancer.reassignment_cost_s, balancer.drain_estimate_s(move.from_model_key))
            if balancer.evicts(move.from_model_key):
                self._spawn(self._evict(move.replica_id, move.from_model_key))
        for move in balancer.replicas_awaiting_load():
            balancer.begin_load(move.replica_id, now_s)  # its drain, measured
            self._spawn(self._move(move.replica_id, move.to_model_key))
        self._wake_placed(balancer.place_queued())

    async def _evict(self, replica_id: str, key: str) -> None:
        """Hands on the generations of partial-rollout agent ``key`` of a replica the balancer moved away.

        They come back aborted with their tokens so far (``/abort_request`` of all, repeated while the
        replica drains as :class:`~rolloutd.move_patience.EvictionAborts` says, for a request that
        reached the engine after an abort; an abort-mode pause would hold SGLang for its 1 s poll)
        and :meth:`generate` resumes each on another replica of ``key`` (none is placed on a
        draining replica), as after a version published in abort mode: the replica drains at once
        and no token is lost. An engine that refuses the abort drains its generations.
        """
        replica, balancer = self._replicas[replica_id], self._balancer
        aborts = EvictionAborts(EVICT_POLL_S, EVICT_REPEAT_MAX_S)
        while replica.healthy and replica.loaded_agent == key and balancer is self._balancer:
            view = None if balancer is None else balancer.replica(replica_id)
            if view is None or view.phase is not ReplicaPhase.DRAINING or view.target_model_key == key:
                return
            if replica.lock.busy and aborts.due(time.monotonic(), replica.lock.entries):
                try:
                    await replica.client.abort(abort_all=True)
                except Unavailable as exc:
                    self._drop_replica(replica, str(exc))
                    return
                except FlexmarlError as exc:
                    log.error("handing on %s's generations on %s failed (it drains them): %s", key, replica_id, exc)
                    return
                replica.evictions += aborts.count == 1
                replica.eviction_aborts += 1
                log.info("replica %s handed its %s generations on to move (abort %d)", replica_id, key, aborts.count)
            await asyncio.sleep(EVICT_POLL_S)

    def _wake_placed(self, tickets: Sequence[Ticket]) -> None:
        for ticket in tickets:
            future = self._placed.pop(ticket.request_id, None)
            if future is not None and not future.done():
                future.set_result(ticket)

    async def _move(self, replica_id: str, key: str) -> None:
        replica = self._replicas[replica_id]
        try:
            await self._ensure_weights(replica, key)
        except Unavailable as exc:
            self._drop_replica(replica, str(exc))
            return
        except FlexmarlError as exc:
            log.error("loading %s onto %s failed: %s", key, replica_id, exc)
        balancer = self._balancer
        if balancer is not None and replica_id in {v.replica_id for v in balancer.replicas()}:
            balancer.complete_load(replica_id)
            self._rebalance()  # places what waits, and loads it again if its group left meanwhile

    async def _ensure_weights(self, replica: Replica, key: str) -> None:
        wanted = self._wanted.get(key)
        if wanted is None:
            raise Unavailable(f"no weights known for {key}")
        if replica.loaded_agent == key and replica.loaded_version >= wanted.version:
            return
        async with replica.reload_lock:
            wanted = self._wanted[key]
            if replica.loaded_agent == key and replica.loaded_version >= wanted.version:
                return
            await self._reload(replica, key)

    async def _reload(self, replica: Replica, key: str) -> None:
        async with replica.lock.write():
            wanted = self._wanted[key]
            if replica.loaded_agent == key and replica.loaded_version >= wanted.version:
                return
            start = time.perf_counter()
            path = await self._resolve(wanted.uri)
            if replica.lora is not None:  # leaving a base's pool: its adapters go (no request uses them now)
                for agent in replica.lora.agents():
                    await replica.lora.release_agent(agent)
                replica.lora = None
            await replica.client.update_weights_from_disk(path, weight_version=str(wanted.version))
            replica.loaded_agent, replica.loaded_version = key, wanted.version
            replica.reloads += 1
            seconds = time.perf_counter() - start
            log.info("replica %s now serves %s v%d (%.2fs)", replica.replica_id, key, wanted.version, seconds)
            self._reloaded(key, seconds)

    def drop_hung(self, stall_s: float) -> list[str]:
        """Drops the replicas that hold requests and answered none for longer than ``stall_s``; returns their ids.

        A hung engine (SIGSTOPped, a stuck device call) keeps its connections open and answers
        nothing, so its requests never fail over by themselves before the ``/generate`` deadline
        (minutes). Dropped, it gets no new request and is re-admitted once ``/health`` answers
        again; the requests it holds end with their tasks, whose leases orchestratord stops
        renewing for lack of progress (docs/reliability.md, Hung workers).
        """
        now_s = time.monotonic()
        hung = [r for r in self._replicas.values() if r.healthy and r.hung_s(now_s) > stall_s]
        for replica in hung:
            self._drop_replica(replica, f"hung: {replica.requests_in_flight} requests, none answered for "
                                        f"{replica.hung_s(now_s):.0f} s")
        return [r.replica_id for r in hung]

    def _drop_replica(self, replica: Replica, reason: str) -> None:
        if not replica.healthy:
            return
        replica.healthy = False
        log.warning("replica %s removed: %s", replica.replica_id, reason)
        if self._balancer is not None:
            with contextlib.suppress(FlexmarlError):
                self._balancer.remove_replica(replica.replica_id)
            self._rebalance()
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_dropped())

    async def _probe_dropped(self) -> None:
        """Asks each dropped replica's ``/health`` every interval; re-admits those that answer 200.

        Runs while some replica is dropped (started by the drop, ended by the last re-admission
        or :meth:`close`). SGLang's ``/health`` answers 200 only once it can generate again.
        """
        while dropped := [r for r in self._replicas.values() if not r.healthy]:
            await asyncio.sleep(self._health_probe_interval_s)
            answers = await asyncio.gather(*(self._answers_health(r) for r in dropped))
            for replica, healthy in zip(dropped, answers, strict=True):
                if healthy:
                    self.readmit(replica)

    @staticmethod
    async def _answers_health(replica: Replica) -> bool:
        try:
            return await replica.client.health()
        except FlexmarlError as exc:
            log.debug("replica %s still down: %s", replica.replica_id, exc)
            return False

    def readmit(self, replica: Replica, *, relaunched: bool = False) -> None:
        """A dropped replica, or one ``relaunched`` (maybe unseen by requests), serves again; weights load afresh."""
        if relaunched:
            self._drop_replica(replica, "its engine was relaunched")
        if replica.healthy:
            return
        replica.healthy = True
        replica.kv_capacity_tokens = None  # read again: the relaunched engine may hold another
        replica.loaded_agent, replica.loaded_version = "", -1
        replica.lora = None  # it may have restarted without its adapters
        log.warning("replica %s re-admitted: /health answers 200", replica.replica_id)
        balancer = self._balancer
        if balancer is None:
            return  # the next set_agents deals it out with the others
        # The group with the fewest replicas (most demand on ties) gets it; a rebalance may move it.
        balancer.add_replica(self._assignment(replica.replica_id, balancer.home_group()))
        if self._config.dispatch_kv_factor > 0:
            self._spawn(self._set_kv_capacity(replica))
        self._rebalance()

    def set_demand_hints(self, hints: Mapping[str, int]) -> None:
        """Not-yet-submitted demand of agents (one SetAgentDemand): set together, then one rebalance."""
        # Hint by hint, the first agent's rebalance would take replicas the next agents' hints take back.
        balancer = self._balancer
        served = {key: tokens for key, tokens in hints.items() if key in self._agents}
        if balancer is None or not served:
            return
        balancer.set_demand_hints(served)  # first: a bad hint is refused with nothing set
        self._demand_hints.update(served)
        self._rebalance()

    async def close(self) -> None:
        """Cancels pending loads and the health probe of dropped replicas; waits for them to end."""
        tasks = [*self._loads, *([self._probe] if self._probe is not None else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._probe = None


class _Reroute(Exception):
    """The replica changed agents between placement and the request; place again."""
