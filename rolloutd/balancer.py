"""Hierarchical load balancer for engine replicas: pure logic, no I/O, no clock.

Two levels (DESIGN.md §4):

* **Inter-agent** (:mod:`rolloutd.replica_planner`): replicas are assigned to *model groups* (the
  agents that share one ``model_key`` can be served by the same replica without a weight load) so
  that the estimated time to drain each group's outstanding token demand is balanced; a move costs
  a weight load plus the donor's drain, and is made only when a whole plan beats the hysteresis
  and has been wanted as long as it costs (``BalancerConfig.move_patience``). The rates and the load cost
  are the caller's measurements where it has them (rolloutd: :mod:`rolloutd.replica_rates`, fed
  through :meth:`HierarchicalBalancer.set_replica_rate` and
  :meth:`~HierarchicalBalancer.set_reassignment_cost_s`; the configured ones are the priors). A
  measured rate is what a replica delivered under its group's load, so a moved replica is counted
  at its new group's mean rate per replica (``BalancerConfig.measured_rates``; rolloutd counts
  every replica at their measured capacity, :meth:`rolloutd.replica_rates.ReplicaRates.capacity`).
* **Intra-agent**: a request goes to the group replica with the least outstanding estimated
  tokens, except that turns of one episode prefer the replica that served earlier turns
  (KV prefix reuse) while the group is balanced. "Imbalanced" follows sglang-router's
  cache-aware policy: ``(max - min) > balance_abs_threshold and max > balance_rel_threshold *
  min`` (sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs``; the router's CLI
  defaults are ``balance_abs_threshold = 64`` and ``balance_rel_threshold = 1.5`` in
  ``sgl-router/py_src/sglang_router/router_args.py``). sglang-router measures load in
  in-flight requests; we measure it in outstanding estimated tokens, so the absolute
  threshold is in tokens here. With ``BalancerConfig.dispatch_kv_factor`` a replica takes a
  request only while the KV-cache tokens its requests reserve (prompt + ``max_new_tokens`` per
  sample, what the embedded engine holds for a running sequence; SGLang's scheduler holds less and
  retracts when it runs out, so a factor above 1 suits it) stay within that factor of its KV
  capacity (the engine's ``max_total_num_tokens``,
  :meth:`HierarchicalBalancer.set_replica_kv_capacity`); the other requests wait in their group's
  queue, FIFO, and are placed as requests finish. Sent at once instead, a group's backlog waits in
  its replicas' own queues, where a replica moved to the group cannot take any of it and a replica
  moved away works through all of it before its load (its drain is the backlog, not one batch).

LoRA agents (``AgentSpec.adapter``) over one base form one model group, the base's replica pool (no
replica moves between its adapters). A replica runs at most ``adapter_slots[group]`` distinct adapter
names at once, counted as SGLang's scheduler counts ``lora_id`` (sglang/srt/managers/scheduler.py
``can_schedule_lora_req``; the base alone, :data:`BASE_ADAPTER`, is one); a request waits, FIFO per
name, for a replica running its name or with a slot free (docs/rollout.md, "LoRA agents").

The caller (the async rollout router, or the simulator in ``benchmarks.balancer_sim``) owns time and
I/O: it calls :meth:`HierarchicalBalancer.submit` per request, :meth:`~HierarchicalBalancer.finish`
when a request ends, :meth:`~HierarchicalBalancer.maybe_rebalance` periodically, performs
the weight loads the balancer asks for and reports them with
:meth:`~HierarchicalBalancer.complete_load`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from flexmarl.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from rolloutd.affinity_map import SEPARATOR, AffinityMap, affinity_parent, episode_affinity_key, group_affinity_key
from rolloutd.balancer_state import (
    GroupIndex,
    ReplicaAssignment,
    ReplicaPhase,
    ReplicaState,
    ReplicaView,
    SavedAssignment,
)
from rolloutd.balancer_types import (
    AgentSpec,
    BalancerConfig,
    ReplicaMove,
    RoutingPolicy,
    Ticket,
    TokenEstimator,
    equal_split,
)
from rolloutd.replica_planner import ReplicaPlanner

__all__ = [
    "AFFINITY_SEPARATOR", "BASE_ADAPTER", "AgentSpec", "BalancerConfig", "HierarchicalBalancer", "ReplicaAssignment",
    "ReplicaMove", "ReplicaPhase", "ReplicaView", "RoutingPolicy", "Ticket", "TokenEstimator", "affinity_parent",
    "episode_affinity_key", "equal_split", "group_affinity_key",
]

AFFINITY_SEPARATOR = SEPARATOR

#: Least-tokens routing reads a group of up to this many serving replicas in one pass, a larger one from
#: its load heaps (two heap entries per load change of a replica: dearer than the pass below ~30 replicas).
SCAN_GROUP_MAX = 32

#: The adapter name of a LoRA agent's request served by the base alone (sent without ``lora_path``):
#: SGLang's ``lora_id`` None, which its scheduler counts as one of a batch's adapters.
BASE_ADAPTER = ""


class HierarchicalBalancer:
    """Inter-agent replica assignment plus intra-agent request routing (see module doc)."""

    def __init__(
        self,
        replicas: Sequence[ReplicaAssignment],
        agents: Sequence[AgentSpec],
        config: BalancerConfig | None = None,
        adapter_slots: Mapping[str, int] | None = None,
        estimator: TokenEstimator | None = None,
    ) -> None:
        """Balances ``agents`` over ``replicas``.

        Args:
            replicas: The replicas and the model group each serves at start.
            agents: The agents and their model groups.
            config: Tunables of both levels.
            adapter_slots: Per model group of LoRA agents, the most distinct adapters one replica
                runs at once (the engines' ``--max-loras-per-batch``); a group of adapters without
                an entry has no bound.
            estimator: What :meth:`route` estimates a request's tokens with and :meth:`release` feeds the
                response lengths to (the router's, kept across rebuilds); a fresh one when None.
        """
        #: Request costs from observed response lengths (:meth:`route`, :meth:`release`).
        self.estimator = estimator if estimator is not None else TokenEstimator()
        self._config = config or BalancerConfig()
        self._reassignment_cost_s = self._config.reassignment_cost_s
        #: Groups whose moved replicas hand their generations on instead of draining them (set_evicting_groups).
        self._evicting: frozenset[str] = frozenset()
        self._agent_model: dict[str, str] = {}
        self._adapters: set[str] = set()
        self._adapter_slots: dict[str, int] = {}
        self._model_keys: tuple[str, ...] = ()
        self._queued: dict[str, collections.deque[int]] = {}
        self._register(agents, adapter_slots or {})
        self._replicas: dict[str, ReplicaState] = {}
        for spec in replicas:
            if spec.replica_id in self._replicas:
                raise InvalidArgument(f"replica {spec.replica_id!r} listed twice")
            if spec.tokens_per_s <= 0:
                raise InvalidArgument(f"replica {spec.replica_id!r}: tokens_per_s must be > 0")
            self._replicas[spec.replica_id] = ReplicaState(spec, spec.model_key, spec.model_key, spec.tokens_per_s)
        self._replica_order: tuple[str, ...] = tuple(sorted(self._replicas))
        # Derived from the replicas' groups and phases, rebuilt after a move, a load or a membership change
        # (rare) instead of scanning every replica on each request: O(group) routing at thousands of replicas.
        self._groups_epoch = 0
        self._groups_cache: GroupIndex | None = None
        self._planner = ReplicaPlanner(self._config, _Assignments(self))
        # Replicas that may have reached AWAITING_LOAD since the last replicas_awaiting_load (a superset).
        self._maybe_awaiting: set[str] = set()
        self._tickets: dict[int, Ticket] = {}
        self._detached: set[int] = set()  # in flight on a replica that was removed since
        self._waiting_groups: set[str] = set()  # the model groups whose queue is not empty
        self._demand_hint_tokens: dict[str, int] = {}
        self._ticket_tokens: dict[str, int] = {}  # per agent: estimated tokens of its queued and in-flight tickets
        self._affinity = AffinityMap(self._config.max_affinity_keys)
        self._round_robin_next: dict[str, int] = collections.defaultdict(int)
        self._next_request_id = 0
        self._last_rebalance_s = -math.inf
        self._rebalance_urgent = False
        self.reassignments = 0

    # ----------------------------------------------------------------- views
    @property
    def config(self) -> BalancerConfig:
        """The balancer's configuration."""
        return self._config

    def replicas(self) -> list[ReplicaView]:
        """State of every replica, ordered by id."""
        return [self._replicas[r].view() for r in self._replica_order]

    def replica(self, replica_id: str) -> ReplicaView | None:
        """State of one replica (None: not balanced here)."""
        replica = self._replicas.get(replica_id)
        return None if replica is None else replica.view()

    def replica_counts(self) -> dict[str, int]:
        """Replicas serving or moving to each model group."""
        return dict(self._groups().counts)

    def model_key_of(self, agent: str) -> str:
        """The model group of an agent (a LoRA agent's: its base's pool); NotFound if not balanced here."""
        return self._model_of(agent)

    def demand_tokens(self, agent: str) -> int:
        """Outstanding demand of an agent: hint + queued + in-flight estimated tokens."""
        self._model_of(agent)
        return self._demand_hint_tokens.get(agent, 0) + self._ticket_tokens.get(agent, 0)

    def model_demand_tokens(self) -> dict[str, int]:
        """Outstanding demand per model group (O(agents): the tickets' tokens are kept per agent)."""
        demand = dict.fromkeys(self._model_keys, 0)
        for totals in (self._demand_hint_tokens, self._ticket_tokens):
            for agent, tokens in totals.items():
                demand[self._agent_model[agent]] += tokens
        return demand

    def queued(self, agent: str | None = None) -> list[Ticket]:
        """Tickets waiting for a replica (of one agent, or all), in FIFO order."""
        waiting = [self._tickets[i] for key in sorted(self._waiting_groups) for i in self._queued[key]]
        return [t for t in waiting if agent is None or t.agent == agent]

    def starved_agents(self) -> set[str]:
        """Agents with a waiting ticket whose group has no replica serving or moving to it.

        Reads only the queues of such groups (the other waiting groups cost one lookup each), so it
        is cheap enough to ask after every event.
        """
        if not self._waiting_groups:  # the common case: asked after every event
            return set()
        counts = self._groups().counts
        return {self._tickets[i].agent for key in self._waiting_groups if not counts.get(key, 0)
                for i in self._queued[key]}

    # --------------------------------------------------------------- demand
    def set_demand_hint(self, agent: str, tokens: int) -> None:
        """Sets the not-yet-submitted demand of an agent (e.g. from SetAgentDemand)."""
        model_key = self._model_of(agent)
        if tokens < 0:
            raise InvalidArgument(f"demand hint for {agent!r} must be >= 0, got {tokens}")
        self._demand_hint_tokens[agent] = tokens
        if tokens and not self._has_replica(model_key):
            self._rebalance_urgent = True

    def set_demand_hints(self, hints: Mapping[str, int]) -> None:
        """:meth:`set_demand_hint` of every agent of a push (SetAgentDemand); NotFound or InvalidArgument sets none."""
        model_of = self._model_of
        entries = [(agent, model_of(agent), tokens) for agent, tokens in hints.items()]
        negative = {agent: tokens for agent, _, tokens in entries if tokens < 0}
        if negative:
            raise InvalidArgument(f"demand hints must be >= 0, got {negative}")
        demand = self._demand_hint_tokens
        counts = self._groups().counts
        for agent, model_key, tokens in entries:
            demand[agent] = tokens
            if tokens and not counts.get(model_key, 0) and not self._has_replica(model_key):
                self._rebalance_urgent = True

    # ------------------------------------------------------------- routing
    def submit(self, agent: str, estimated_tokens: int, affinity_key: str = "", adapter: str | None = None,
               kv_tokens: int = 0) -> Ticket:
        """Routes a request now, or queues it when no serving replica of its group can take it.

        Args:
            agent: The agent the request is for.
            estimated_tokens: Its estimated token cost.
            affinity_key: Its episode's (or group's) affinity key; "" for none.
            adapter: A LoRA agent's request: the adapter name it will be served with, what SGLang
                counts toward ``--max-loras-per-batch`` (rolloutd's ``<agent>@v<k>``, or
                :data:`BASE_ADAPTER` for the base alone); None: the agent's own name (one name
                per agent). Must be None for a full-model agent.
            kv_tokens: The KV-cache tokens its samples reserve on a replica (prompt +
                ``max_new_tokens`` each); what ``BalancerConfig.dispatch_kv_factor`` bounds.

        Raises:
            NotFound: The agent is not balanced here.
            InvalidArgument: Negative ``estimated_tokens`` or ``kv_tokens``, or ``adapter`` for a full-model agent.
        """
        return self._submit(agent, estimated_tokens, affinity_key, adapter, kv_tokens)

    def _submit(self, agent: str, estimated_tokens: int, affinity_key: str, adapter: str | None,
                kv_tokens: int) -> Ticket:
        model_key = self._model_of(agent)
        if estimated_tokens < 0 or kv_tokens < 0:
            raise InvalidArgument(f"estimated_tokens and kv_tokens must be >= 0, got {estimated_tokens}, {kv_tokens}")
        if agent in self._adapters:
            if adapter is None:
                adapter = agent
        elif adapter is not None:
            raise InvalidArgument(f"agent {agent!r} is a full model: its requests carry no adapter")
        request_id = self._next_request_id
        self._next_request_id += 1
        ticket_tokens = self._ticket_tokens
        ticket_tokens[agent] = ticket_tokens.get(agent, 0) + estimated_tokens
        if self._config.routing is RoutingPolicy.LEAST_TOKENS and (
                adapter is None or model_key not in self._adapter_slots):
            # _try_place's first case, with one ticket built (the placed one) instead of two: a frozen
            # dataclass costs a fair part of a request's routing to build.
            chosen = self._least_tokens_in_group(model_key, affinity_key)
            if chosen is not None and not self._has_kv_room(chosen, kv_tokens):
                chosen = self._most_kv_room(model_key, kv_tokens)
            if chosen is not None:
                return self._take(Ticket(request_id, agent, estimated_tokens, affinity_key, chosen.spec.replica_id,
                                         adapter, kv_tokens), chosen)
            placed = None
            ticket = Ticket(request_id, agent, estimated_tokens, affinity_key, None, adapter, kv_tokens)
        else:
            ticket = Ticket(request_id, agent, estimated_tokens, affinity_key, None, adapter, kv_tokens)
            placed = self._try_place(ticket, model_key)
        if placed is None:
            self._tickets[request_id] = ticket
            self._queued[model_key].append(request_id)
            self._waiting_groups.add(model_key)
            if not self._has_replica(model_key):
                self._rebalance_urgent = True
            return ticket
        return placed

    def route(self, agent: str, prompt_tokens: int, max_new_tokens: int, n: int = 1, affinity_key: str = "",
              adapter: str | None = None, kv_tokens: int = 0) -> Ticket:
        """:meth:`submit` of a request estimated by :attr:`estimator`: one call per request, not two.

        Raises:
            As :meth:`submit`.
        """
        return self._submit(agent, self.estimator.estimate(agent, prompt_tokens, max_new_tokens, n), affinity_key,
                            adapter, kv_tokens)

    def release(self, request_id: int, now_s: float, response_tokens: Iterable[int] = ()) -> bool:
        """:meth:`finish`, with the request's response lengths fed to :attr:`estimator`; returns :meth:`settled`.

        One call where a request's end made three (the finish, the estimator's observations, the
        router's question whether anything is left to do after the event).

        Raises:
            NotFound: the request is not in flight (nothing is observed then).
        """
        agent = self._finish(request_id).agent
        observe = self.estimator.observe
        for tokens in response_tokens:
            observe(agent, tokens)
        return self._settled(now_s)

    def place_queued(self) -> list[Ticket]:
        """Places waiting tickets on replicas that can now serve them (FIFO per group; per adapter name in a pool).

        Visits only the groups with waiting tickets (in model key order): it is called after every event.
        """
        placed: list[Ticket] = []
        if not self._waiting_groups:  # the common case: asked after every event
            return placed
        for model_key in sorted(self._waiting_groups):
            queue = self._queued[model_key]
            self._place_group(queue, placed)
            if not queue:
                self._waiting_groups.discard(model_key)
        return placed

    def _place_group(self, queue: collections.deque[int], placed: list[Ticket]) -> None:
        # The head, while it places: a full model's queue stops at its first ticket that finds no
        # replica, so placing costs what it places, not the queue's length. A pool's queue goes on
        # past adapters whose oldest ticket found no slot.
        while queue and self._tickets[queue[0]].adapter is None:
            done = self._try_place(self._tickets[queue[0]])
            if done is None:
                break
            queue.popleft()
            placed.append(done)
        if not queue or self._tickets[queue[0]].adapter is None:
            return
        blocked: set[str] = set()  # adapter names whose oldest waiting ticket found no slot
        for request_id in list(queue):
            ticket = self._tickets[request_id]
            if ticket.adapter in blocked:
                continue
            done = self._try_place(ticket)
            if done is None:
                if ticket.adapter is None:
                    break
                blocked.add(ticket.adapter)
                continue
            queue.remove(request_id)
            placed.append(done)

    def adapter_slots_free(self, replica_id: str) -> int | None:
        """Adapter slots of a replica no running adapter name holds (None: its group has no bound)."""
        replica = self._replica(replica_id)
        slots = self._adapter_slots.get(replica.model_key)
        return None if slots is None else slots - len(replica.adapter_requests)

    def finish(self, request_id: int) -> Ticket:
        """Ends an in-flight request (success or failure); returns its ticket."""
        return self._finish(request_id)

    def _finish(self, request_id: int) -> Ticket:
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            raise NotFound(f"request {request_id} is not in flight")
        left = self._ticket_tokens[ticket.agent] - ticket.estimated_tokens
        if left:
            self._ticket_tokens[ticket.agent] = left
        else:
            del self._ticket_tokens[ticket.agent]
        if request_id in self._detached:  # its replica was removed while it ran
            self._detached.discard(request_id)
            return ticket
        if ticket.replica_id is None:
            model_key = self._agent_model[ticket.agent]
            self._queued[model_key].remove(request_id)
            if not self._queued[model_key]:
                self._waiting_groups.discard(model_key)
            return ticket
        replica = self._replicas.get(ticket.replica_id)
        if replica is None:  # the replica was removed while the request ran
            return ticket
        replica.outstanding_tokens -= ticket.estimated_tokens
        replica.kv_tokens -= ticket.kv_tokens
        replica.in_flight_requests -= 1
        phase = replica.phase
        if phase is ReplicaPhase.SERVING:
            self._groups().push_load(replica)
        if ticket.adapter is not None:  # its name's last request here frees the name's slot
            replica.adapter_requests[ticket.adapter] -= 1
            if replica.adapter_requests[ticket.adapter] <= 0:
                del replica.adapter_requests[ticket.adapter]
        if phase is ReplicaPhase.DRAINING and replica.in_flight_requests == 0:
            replica.phase = ReplicaPhase.AWAITING_LOAD
            self._maybe_awaiting.add(replica.spec.replica_id)
        return ticket

    def _try_place(self, ticket: Ticket, model_key: str | None = None) -> Ticket | None:
        if model_key is None:
            model_key = self._agent_model[ticket.agent]
        if self._config.routing is RoutingPolicy.LEAST_TOKENS and (
                ticket.adapter is None or model_key not in self._adapter_slots):
            # Every serving replica of the group is a candidate: O(log group) from the group's load heaps.
            chosen = self._least_tokens_in_group(model_key, ticket.affinity_key)
            if chosen is not None and not self._has_kv_room(chosen, ticket.kv_tokens):
                chosen = self._most_kv_room(model_key, ticket.kv_tokens)
            return None if chosen is None else self._assign(ticket, chosen)
        candidates = [
            replica for replica in self._groups().serving.get(model_key, ())
            if self._has_adapter_slot(replica, ticket.adapter) and self._has_kv_room(replica, ticket.kv_tokens)
        ]
        if not candidates:
            return None
        if self._config.routing is RoutingPolicy.ROUND_ROBIN:
            index = self._round_robin_next[model_key] % len(candidates)
            self._round_robin_next[model_key] = index + 1
            chosen = candidates[index]
        else:
            chosen = self._least_tokens_with_affinity(candidates, ticket.affinity_key)
        return self._assign(ticket, chosen)

    def _assign(self, ticket: Ticket, chosen: ReplicaState) -> Ticket:
        # Built directly: dataclasses.replace (which re-reads every field by name) was a fifth of a request's routing.
        return self._take(Ticket(ticket.request_id, ticket.agent, ticket.estimated_tokens, ticket.affinity_key,
                                 chosen.spec.replica_id, ticket.adapter, ticket.kv_tokens), chosen)

    def _take(self, ticket: Ticket, chosen: ReplicaState) -> Ticket:
        """``chosen`` takes the placed ``ticket``: its load, its adapter name's slot, the ticket, the affinity."""
        chosen.outstanding_tokens += ticket.estimated_tokens
        chosen.kv_tokens += ticket.kv_tokens
        chosen.in_flight_requests += 1
        self._groups().push_load(chosen)
        if ticket.adapter is not None:
            chosen.adapter_requests[ticket.adapter] += 1
        self._tickets[ticket.request_id] = ticket
        if ticket.affinity_key:
            self._affinity.remember(ticket.affinity_key, chosen.spec.replica_id)
        return ticket

    def _least_tokens_in_group(self, model_key: str, affinity_key: str) -> ReplicaState | None:
        """:meth:`_least_tokens_with_affinity` over every serving replica of the group.

        A group of up to :data:`SCAN_GROUP_MAX` replicas is read in one pass; a larger one from its load
        heaps (O(log group)), which every load change of its replicas then keeps (:meth:`GroupIndex.push_load`).
        """
        extremes = self._groups().extremes(model_key, self._replicas, SCAN_GROUP_MAX)
        if extremes is None:
            return None
        least, low, high = extremes
        if self._imbalanced(high, low):
            return least
        preferred = self._replicas.get(self._lookup_affinity(affinity_key)) if affinity_key else None
        if preferred is not None and preferred.phase is ReplicaPhase.SERVING and preferred.model_key == model_key:
            return preferred
        return least

    def _has_kv_room(self, replica: ReplicaState, kv_tokens: int) -> bool:
        """Whether ``replica`` may take a request of ``kv_tokens`` within ``dispatch_kv_factor`` of its KV capacity.

        Always when it is idle.
        """
        factor = self._config.dispatch_kv_factor
        if factor <= 0 or math.isinf(replica.kv_capacity_tokens) or not replica.in_flight_requests:
            return True
        return replica.kv_tokens + kv_tokens <= factor * replica.kv_capacity_tokens

    def _most_kv_room(self, model_key: str, kv_tokens: int) -> ReplicaState | None:
        """The serving replica of the group with the fewest reserved KV tokens, if it may take ``kv_tokens`` more.

        Asked only when the least loaded one (by estimated tokens) is full: O(group).
        """
        serving = self._groups().serving.get(model_key, ())
        emptiest = min(serving, key=lambda r: (r.kv_tokens, r.spec.replica_id), default=None)
        return emptiest if emptiest is not None and self._has_kv_room(emptiest, kv_tokens) else None

    def set_replica_kv_capacity(self, replica_id: str, tokens: float) -> None:
        """The KV-cache tokens the replica holds (its engine's ``max_total_num_tokens``; inf: unbounded).

        Call :meth:`place_queued` next: a larger capacity may place waiting requests.
        """
        if not tokens > 0:
            raise InvalidArgument(f"replica {replica_id!r}: KV capacity must be > 0, got {tokens}")
        self._replica(replica_id).kv_capacity_tokens = tokens

    def _has_adapter_slot(self, replica: ReplicaState, adapter: str | None) -> bool:
        """Whether a request with ``adapter`` may run on ``replica`` now (scheduler.py ``can_schedule_lora_req``).

        Always for a full-model agent's request (``adapter`` None) and for a name already running
        there; otherwise only while a bounded pool's replica runs fewer names than its slots.
        """
        if adapter is None or adapter in replica.adapter_requests:
            return True
        slots = self._adapter_slots.get(replica.model_key)
        return slots is None or len(replica.adapter_requests) < slots

    def _least_tokens_with_affinity(self, candidates: list[ReplicaState], affinity_key: str) -> ReplicaState:
        least = min(candidates, key=lambda r: r.outstanding_tokens)  # first in id order on ties
        loads = [r.outstanding_tokens for r in candidates]
        if self.is_imbalanced(loads):
            return least
        preferred = self._lookup_affinity(affinity_key)
        for replica in candidates:
            if replica.spec.replica_id == preferred:
                return replica
        return least

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        """sglang-router's rule: (max - min) > abs threshold and max > rel threshold × min."""
        if not loads:
            return False
        return self._imbalanced(max(loads), min(loads))

    def _imbalanced(self, high: int, low: int) -> bool:
        return (
            high - low > self._config.balance_abs_threshold_tokens and high > self._config.balance_rel_threshold * low
        )

    def _lookup_affinity(self, key: str) -> str:
        while key:
            replica_id = self._affinity.get(key)
            if replica_id is not None:
                return replica_id
            key = affinity_parent(key)
        return ""

    def forget_affinity(self, key: str) -> None:
        """Drops a key and its descendants (call when a task is done); O(the task's keys)."""
        self._affinity.forget_tree(key)

    def add_replica(self, spec: ReplicaAssignment) -> None:
        """Adds a replica (a re-admitted one) serving ``spec.model_key``; the inverse of :meth:`remove_replica`.

        Call :meth:`place_queued` next. Requests still in flight from the replica's previous
        membership stay detached from it (their :meth:`finish` does not count against it).
        """
        if spec.replica_id in self._replicas:
            raise AlreadyExists(f"replica {spec.replica_id!r} is already served")
        if spec.tokens_per_s <= 0:
            raise InvalidArgument(f"replica {spec.replica_id!r}: tokens_per_s must be > 0")
        self._replicas[spec.replica_id] = ReplicaState(spec, spec.model_key, spec.model_key, spec.tokens_per_s)
        self._replica_order = tuple(sorted(self._replicas))
        self._groups_epoch += 1

    def remove_replica(self, replica_id: str) -> None:
        """Forgets a dead replica: nothing is routed to it again; its group is re-served by a rebalance."""
        replica = self._replica(replica_id)
        del self._replicas[replica_id]
        self._groups_epoch += 1
        self._maybe_awaiting.discard(replica_id)
        for request_id, ticket in self._tickets.items():
            if ticket.replica_id == replica_id:
                self._detached.add(request_id)
        self._replica_order = tuple(sorted(self._replicas))
        self._affinity.forget_replica(replica_id)
        if not self._has_replica(replica.target_model_key):
            self._rebalance_urgent = True

    def add_agents(self, agents: Sequence[AgentSpec], adapter_slots: Mapping[str, int] | None = None) -> None:
        """Balances ``agents`` too, beside the others (a job or an evaluation round joined); nothing stops.

        A new model group starts with no replica: its first request makes it starved, and the next
        :meth:`rebalance` gives it one from the group that loses least, as for a group a dead
        replica emptied. ``adapter_slots`` bounds new LoRA pools, as in the constructor.

        Raises:
            AlreadyExists: an agent is balanced here already (nothing is added then).
            InvalidArgument: a group would hold LoRA and full-model agents, or a bound is < 1 (nothing added).
        """
        known = sorted(a.agent for a in agents if a.agent in self._agent_model)
        if known:
            raise AlreadyExists(f"agents {known} are balanced here already")
        before = self._model_keys
        self._register(agents, adapter_slots or {})
        if self._model_keys != before:
            self._groups_epoch += 1

    def remove_agents(self, agents: Iterable[str], now_s: float) -> list[ReplicaMove]:
        """Stops balancing ``agents`` (their job or round ended); the others' requests go on meanwhile.

        A model group left without agents hands its replicas to the groups that stay, each to the one
        with the fewest replicas (most demand on ties), as moves: the caller loads them
        (:meth:`replicas_awaiting_load`). A replica already loading for such a group is handed on
        when its load completes (:meth:`complete_load`).

        Raises:
            NotFound: an agent is not balanced here. FailedPrecondition: an agent has requests queued
            or in flight, or none would be left while some group has replicas (nothing changes then).
        """
        gone = set(agents)
        unknown = sorted(gone - self._agent_model.keys())
        if unknown:
            raise NotFound(f"unknown agents {unknown}")
        busy = sorted({t.agent for t in self._tickets.values() if t.agent in gone})
        if busy:
            raise FailedPrecondition(f"agents {busy} have requests queued or in flight")
        kept = {a: m for a, m in self._agent_model.items() if a not in gone}
        if not kept and self._replicas:
            raise FailedPrecondition("no agent would be left to serve; build a new balancer instead")
        for agent in gone:
            del self._agent_model[agent]
            self._adapters.discard(agent)
            self._demand_hint_tokens.pop(agent, None)
        left = set(kept.values())
        moves = []
        for replica_id in self._replica_order:
            replica = self._replicas[replica_id]
            if replica.target_model_key not in left and replica.phase is not ReplicaPhase.LOADING:
                moves.append(self._move(replica, self.home_group(left), now_s))
        for key in set(self._model_keys) - left:
            del self._queued[key]
            self._adapter_slots.pop(key, None)
        self._model_keys = tuple(sorted(left))
        self._groups_epoch += 1
        return moves

    def _register(self, agents: Sequence[AgentSpec], adapter_slots: Mapping[str, int]) -> None:
        """Adds agents and their groups after checking them all (nothing is added on an error)."""
        model = dict(self._agent_model)
        adapters = set(self._adapters)
        for agent in agents:
            if agent.agent in model:
                raise InvalidArgument(f"agent {agent.agent!r} listed twice")
            model[agent.agent] = agent.model_key
            if agent.adapter:
                adapters.add(agent.agent)
        full = {model[a] for a in model if a not in adapters}
        mixed = sorted(full & {model[a] for a in adapters})
        if mixed:
            raise InvalidArgument(f"model groups {mixed} hold both LoRA agents and full-model agents")
        for key, slots in adapter_slots.items():
            if slots < 1:
                raise InvalidArgument(f"adapter_slots[{key!r}] must be >= 1, got {slots}")
        self._agent_model, self._adapters = model, adapters
        self._adapter_slots.update(adapter_slots)
        self._model_keys = tuple(sorted(set(model.values())))
        for key in self._model_keys:
            self._queued.setdefault(key, collections.deque())

    def home_group(self, groups: Iterable[str] | None = None) -> str:
        """The group (of ``groups``, or any) a replica without one joins: fewest replicas, then most demand."""
        counts, demand = self._groups().counts, self.model_demand_tokens()  # a LoRA pool's group is its base
        pick = self._model_keys if groups is None else groups
        return min(pick, key=lambda k: (counts.get(k, 0), -demand.get(k, 0), k))

    def even_out(self, now_s: float) -> list[ReplicaMove]:
        """Moves replicas until no group holds two more than another: static shares after agents joined or left.

        The shares a new balancer's equal split would deal, reached by moves (each replica drains only its
        own requests) instead of a rebuild after every request drained. Each move takes the least loaded
        replica not loading of the group with the most replicas to :meth:`home_group`; the fewest moves.
        """
        moves: list[ReplicaMove] = []
        for _ in range(len(self._replicas)):
            low = self.home_group()
            donor = self._groups().spare_of_fullest(low)
            if donor is None:
                break
            moves.append(self._move(donor, low, now_s))
        return moves

    # ------------------------------------------------------- inter-agent
    def settled(self, now_s: float) -> bool:
        """Whether the asks after an event would all answer nothing now (the router then skips them).

        True when no ticket waits (:meth:`starved_agents` and :meth:`place_queued` empty), no
        rebalance is due (:meth:`maybe_rebalance` would return [] without deciding) and no
        replica may await its load (:meth:`replicas_awaiting_load` empty): one call instead of
        four after most events.
        """
        return self._settled(now_s)

    def _settled(self, now_s: float) -> bool:
        if self._waiting_groups or self._maybe_awaiting:
            return False
        config = self._config
        return not config.rebalance_enabled or (
            not self._rebalance_urgent and now_s - self._last_rebalance_s < config.rebalance_interval_s)

    def maybe_rebalance(self, now_s: float) -> list[ReplicaMove]:
        """Re-evaluates the assignment if the interval passed or a group is starved (static: only the latter)."""
        if not self._config.rebalance_enabled:
            return self.rebalance(now_s) if self._rebalance_urgent and self._waiting_groups else []
        if not self._rebalance_urgent and now_s - self._last_rebalance_s < self._config.rebalance_interval_s:
            return []
        return self.rebalance(now_s)

    def rebalance(self, now_s: float) -> list[ReplicaMove]:
        """Decides replica moves now (:meth:`rolloutd.replica_planner.ReplicaPlanner.plan`); moved replicas drain."""
        self._last_rebalance_s = now_s
        self._rebalance_urgent = False
        return self._planner.plan(self.model_demand_tokens(), now_s)

    def _move(self, replica: ReplicaState, to_model_key: str, now_s: float) -> ReplicaMove:
        move = ReplicaMove(replica.spec.replica_id, replica.model_key, to_model_key)
        index = self._groups()
        old_target, was_serving = replica.target_model_key, replica.phase is ReplicaPhase.SERVING
        replica.tokens_per_s = self._rate_in(replica, to_model_key)
        replica.target_model_key = to_model_key
        replica.last_move_s = now_s
        replica.phase = ReplicaPhase.DRAINING if replica.in_flight_requests else ReplicaPhase.AWAITING_LOAD
        if replica.phase is ReplicaPhase.DRAINING and replica.draining_since_s is None:
            replica.draining_since_s = now_s
        if replica.phase is ReplicaPhase.AWAITING_LOAD:
            self._maybe_awaiting.add(replica.spec.replica_id)
        self._groups_epoch += 1
        index.retarget(replica, old_target, was_serving)
        index.epoch = self._groups_epoch
        self.reassignments += 1
        return move

    def _undo_move(self, replica: ReplicaState, saved: SavedAssignment) -> None:
        replica.restore(saved)
        self._groups_epoch += 1
        if replica.phase is ReplicaPhase.AWAITING_LOAD:
            self._maybe_awaiting.add(replica.spec.replica_id)
        self.reassignments -= 1

    def _rate_in(self, replica: ReplicaState, model_key: str) -> float:
        """The rate ``replica`` is expected to deliver serving ``model_key`` (see ``BalancerConfig.measured_rates``).

        A measured rate is what the replica delivered under its group's load (a decode step of one
        sequence costs nearly what one of many does), so a replica moved from a light group to a heavy
        one delivers what the heavy group's replicas do, not what it did: its new group's mean.
        """
        index = self._groups()
        count = index.counts.get(model_key, 0)
        if not self._config.measured_rates or count <= 0 or replica.target_model_key == model_key:
            return replica.tokens_per_s
        return index.rates[model_key] / count

    def set_replica_rate(self, replica_id: str, tokens_per_s: float) -> None:
        """The replica's rate is now ``tokens_per_s`` (measured); the group index follows in O(its group)."""
        if not tokens_per_s > 0 or math.isinf(tokens_per_s):
            raise InvalidArgument(f"replica {replica_id!r}: tokens_per_s must be finite and > 0, got {tokens_per_s}")
        replica = self._replica(replica_id)
        replica.tokens_per_s = tokens_per_s
        index = self._groups_cache
        if index is None or index.epoch != self._groups_epoch:
            return  # the next rebuild reads it
        index.recount(replica.target_model_key)

    def set_every_replica_rate(self, tokens_per_s: float) -> None:
        """:meth:`set_replica_rate` of every replica (a measured capacity counted for all), in one call."""
        if not tokens_per_s > 0 or math.isinf(tokens_per_s):
            raise InvalidArgument(f"tokens_per_s must be finite and > 0, got {tokens_per_s}")
        for replica in self._replicas.values():
            replica.tokens_per_s = tokens_per_s
        index = self._groups_cache
        if index is None or index.epoch != self._groups_epoch:
            return  # the next rebuild reads them
        for key in {replica.target_model_key for replica in self._replicas.values()}:
            index.recount(key)

    def drain_estimate_s(self, model_key: str) -> float:
        """The seconds a replica with requests in flight is expected to take to drain from ``model_key``.

        The drains measured from the group, or the longest one under way at the last rebalance if longer;
        0 while none was measured or under way (the donor then counts its outstanding tokens over its rate).
        """
        return self._planner.drains.estimate_s(model_key)

    def set_evicting_groups(self, model_keys: Collection[str]) -> None:
        """The groups whose replicas, moved away, hand their generations on instead of draining them.

        The caller aborts a moved replica's generations of such a group and resumes each on another
        replica of the group with its tokens so far (rolloutd: the partial-rollout agents'
        groups, :meth:`rolloutd.router.RolloutRouter.set_partial_rollout`): a donor from there costs
        the planner its weight load, not its drain. Replaces the groups set before.
        """
        self._evicting = frozenset(model_keys)

    def evicts(self, model_key: str) -> bool:
        """Whether a replica moved away from ``model_key`` hands its generations on (:meth:`set_evicting_groups`)."""
        return model_key in self._evicting

    @property
    def reassignment_cost_s(self) -> float:
        """The estimated seconds of one weight load a move pays (configured, or measured by the caller)."""
        return self._reassignment_cost_s

    def set_reassignment_cost_s(self, seconds: float) -> None:
        """The estimated seconds of one weight load (the caller's measurement) from now on."""
        if not 0 <= seconds < math.inf:
            raise InvalidArgument(f"reassignment_cost_s must be finite and >= 0, got {seconds}")
        self._reassignment_cost_s = seconds

    def replicas_awaiting_load(self) -> list[ReplicaMove]:
        """Drained replicas whose new weights the caller must now load (in replica id order)."""
        if not self._maybe_awaiting:  # the common case: asked after every event
            return []
        awaiting = sorted(
            i for i in self._maybe_awaiting
            if i in self._replicas and self._replicas[i].phase is ReplicaPhase.AWAITING_LOAD
        )
        self._maybe_awaiting = set(awaiting)
        return [ReplicaMove(i, self._replicas[i].model_key, self._replicas[i].target_model_key) for i in awaiting]

    def begin_load(self, replica_id: str, now_s: float | None = None) -> None:
        """Marks that the caller started loading the replica's new weights (at ``now_s``: its drain is measured)."""
        replica = self._replica(replica_id)
        if replica.phase is not ReplicaPhase.AWAITING_LOAD:
            raise FailedPrecondition(f"replica {replica_id!r} is {replica.phase.value}, not awaiting a load")
        if now_s is not None and replica.draining_since_s is not None:
            self._planner.drains.observe(replica.model_key, max(0.0, now_s - replica.draining_since_s))
        replica.draining_since_s = None
        index = self._groups()
        replica.phase = ReplicaPhase.LOADING
        self._groups_epoch += 1
        index.epoch = self._groups_epoch  # neither phase serves nor changes the target: the index holds

    def complete_load(self, replica_id: str) -> None:
        """The replica now serves its new group; call place_queued() next."""
        replica = self._replica(replica_id)
        if replica.phase not in (ReplicaPhase.LOADING, ReplicaPhase.AWAITING_LOAD):
            raise FailedPrecondition(f"replica {replica_id!r} is {replica.phase.value}, not loading")
        index = self._groups()
        replica.model_key = replica.target_model_key
        replica.phase = ReplicaPhase.SERVING
        self._groups_epoch += 1
        index.serve(replica)
        index.epoch = self._groups_epoch
        self._affinity.forget_replica(replica_id)  # its KV cache is gone with the old weights
        if replica.model_key not in self._queued and self._model_keys:  # its group left while it loaded
            self._move(replica, self.home_group(), replica.last_move_s)

    # ------------------------------------------------------------ helpers
    def _groups(self) -> GroupIndex:
        """Per model group: serving replicas (id order), replica counts and rates (of targets), up to date."""
        cache = self._groups_cache
        if cache is None or cache.epoch != self._groups_epoch:
            cache = self._groups_cache = GroupIndex.build(
                self._groups_epoch, self._model_keys, [self._replicas[r] for r in self._replica_order])
        return cache

    def _has_replica(self, model_key: str) -> bool:
        count = self._groups().counts.get(model_key)
        if count is not None:
            return count > 0
        return any(r.target_model_key == model_key for r in self._replicas.values())

    def _model_of(self, agent: str) -> str:
        model_key = self._agent_model.get(agent)
        if model_key is None:
            raise NotFound(f"unknown agent {agent!r}")
        return model_key

    def _replica(self, replica_id: str) -> ReplicaState:
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise NotFound(f"unknown replica {replica_id!r}")
        return replica


class _Assignments:
    """The balancer's replicas as its planner sees them (:class:`rolloutd.replica_planner.Assignments`)."""

    def __init__(self, balancer: HierarchicalBalancer) -> None:
        self._balancer = balancer

    @property
    def model_keys(self) -> tuple[str, ...]:
        return self._balancer._model_keys

    @property
    def reassignment_cost_s(self) -> float:
        return self._balancer._reassignment_cost_s

    def groups(self) -> GroupIndex:
        return self._balancer._groups()

    def replica_states(self) -> Collection[ReplicaState]:
        return self._balancer._replicas.values()

    def has_replica(self, model_key: str) -> bool:
        return self._balancer._has_replica(model_key)

    def evicts(self, model_key: str) -> bool:
        return self._balancer.evicts(model_key)

    def rate_in(self, replica: ReplicaState, model_key: str) -> float:
        return self._balancer._rate_in(replica, model_key)

    def move(self, replica: ReplicaState, to_model_key: str, now_s: float) -> ReplicaMove:
        return self._balancer._move(replica, to_model_key, now_s)

    def undo_move(self, replica: ReplicaState, saved: SavedAssignment) -> None:
        self._balancer._undo_move(replica, saved)
