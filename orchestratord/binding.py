"""Agent-centric allocation of trainer slots (the rollout demand estimate is in ``orchestratord.planner.estimator``).

Trainer slots (a GPU, or a CPU slot in tests) are not statically owned by an
agent: a slot is bound to an agent when that agent has work ready for it, and
an agent that has no work gives its slot up when another agent is waiting.

Rules (DESIGN section 5):

* **On demand.** Only agents with leasable work (ready micro-batches or a due
  optimizer step) compete for a free slot.
* **Never mid-step.** While a slot accumulates an agent's step gradients
  (some micro-batch leased or acked, or the optimizer step issued) the binding
  holds; it ends only with the commit or the slot's death.
* **Affinity.** A slot already holding an agent's training state (its
  ``resident`` list) scores a bonus for that agent, and an idle bound agent
  keeps its slot while nobody else waits: no needless swaps.
* **No agent of a job runs ahead of one waiting for its slot.** At its step
  boundary a bound agent gives its slot up to a waiting agent of the same job
  whose committed version is ``version_lead`` or more behind its own (the most
  behind of them; 0 turns the rule off). The job's slowest agent gates its
  rollout (admission counts the minimum version, AReaL's rule), so an agent
  kept off a shared slot for several steps stalls every agent's rollout, the
  others' too; the wall-clock starvation bound below does not see versions. With
  the default of 1 two agents sharing a slot alternate in runs of about two
  steps each, so one swap-in serves about two steps.
* **No starvation.** A waiting agent's score grows with its wait (aging); once
  it has waited ``max_wait_s`` it is *starving*: it outranks every non-starving
  agent and makes a bound agent give its slot up at its next step boundary even
  if that agent has more work.
* **Static binding (baselines, ablation).** Agents of a job whose
  ``pipeline.binding`` is ``static`` may only bind to their fixed slot set:
  with S known slots (sorted by id, index j) and K agents (spec order, index
  i), agent i may use slot j iff ``j % K == i`` when S >= K, else iff
  ``i % S == j``. The other rules still apply within that set. The set follows
  the known slots: when a slot appears or dies the sets are recomputed and a
  binding outside its set ends at the agent's next step boundary.
* **Data parallelism (``agents[].max_slots`` > 1).** An agent is bound to an
  ordered *group* of slots (member 0 = the primary, which commits). A group
  grows only at a step boundary (no micro-batch of the current step leased or
  acked), only with free slots that advertise a data-parallel rendezvous
  address (``dp_address``: a traind process with exactly one slot), for which
  no other agent is waiting, that polled within ``recruit_fresh_s``, that the
  agent may use (static sets), and only while the agent's committed state is
  portable (a new member must load it) and its engine is ZeRO 0
  (``AgentDemand.data_parallel``). Its size is at most ``max_slots`` and at
  most ``1 + upcoming // dp_min_micro_batches_per_member`` (``upcoming`` =
  micro-batches of the current step not yet leased or acked): a member is only
  worth its process-group set-up with a few micro-batches of its own. A
  non-primary member leaves at a step boundary when another agent waits for a
  slot (no starvation) or when the group is larger than the upcoming work
  warrants (e.g. the job's last step is committed: the group dissolves). Every
  membership change starts a new group *epoch*: a new process group in traind.
* **Slot capacity.** A slot reports its training capacity (``capacity``: its
  devices, or a relative speed; traind's ``slot_capacity``). Where the known
  slots' capacities differ, an agent's *weight* (the tokens of its current
  step, ``AgentDemand.step_tokens``) decides where it goes: a slot of more
  capacity than the smallest takes the heaviest waiting agents first (those
  no other outranks, then by the usual score); a slot
  leaves a waiting agent to a *larger slot* that would take it soon (one of more
  capacity, unbound and recently polled, or bound to a lone agent it *outranks*:
  more than ``capacity_margin`` times that agent's weight, and it is the
  heaviest such agent); at its step boundary an agent moves off its slot when a
  larger slot would take it (it waits, and the larger slot takes it), and gives
  a larger slot up to a waiting agent that outranks it. The margin keeps
  step-to-step noise from moving anyone; starvation still overrides.
  Data-parallel agents are left out of these rules. With equal capacities (or
  ``capacity_aware`` off) every decision is the same as without them.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets
from collections.abc import Callable, Iterable, Mapping

AgentKey = tuple[str, str]
"""(job_id, agent name)."""


@dataclasses.dataclass(frozen=True)
class AgentDemand:
    """What one agent needs from the trainer pool right now (computed by the planner)."""

    key: AgentKey
    ready_micro_batches: int = 0
    ready_tokens: int = 0
    optimizer_pending: bool = False
    # Gradients of the current step live in the bound slot: it cannot move.
    mid_step: bool = False
    # Data parallelism: the spec's max_slots; whether the agent's engine may span slots
    # (max_slots > 1 and ZeRO 0); micro-batches of the current step not yet leased or acked
    # (counting those still to be formed); whether a new member could load the committed state.
    max_slots: int = 1
    data_parallel: bool = False
    upcoming_micro_batches: int = 0
    portable: bool = True
    # The agent's warm start waits for a slot (agents[].warm_start; one in flight counts as mid_step).
    warm_start_pending: bool = False
    # Response tokens of the current step as its formed micro-batches (in any state) project them onto
    # the micro-batches it will have: how much the step trains (its weight against slot capacities).
    step_tokens: int = 0
    # The agent's committed version (steps trained): the version-lead rule compares agents of one job by it.
    version: int = 0

    @property
    def weight(self) -> int:
        """The agent's training weight now: the tokens of its current step."""
        return max(self.step_tokens, self.ready_tokens)

    @property
    def has_work(self) -> bool:
        """Whether a slot polling now could be given work for this agent."""
        return self.ready_micro_batches > 0 or self.optimizer_pending or self.warm_start_pending


@dataclasses.dataclass
class TrainerSlot:
    """One trainer slot as seen from its polls."""

    slot_id: str
    worker_id: str
    last_seen_s: float
    resident: dict[AgentKey, int] = dataclasses.field(default_factory=dict)
    agent: AgentKey | None = None
    bound_since_s: float = 0.0
    # Agent whose state the slot was asked to save (SwapOutWork) and has not confirmed yet.
    swapping_out: AgentKey | None = None
    # host:port of the slot process's data-parallel rendezvous; "" = cannot join a group.
    dp_address: str = ""
    # Training capacity relative to one reference device (its devices, or a relative speed).
    capacity: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataParallelGroup:
    """The slots an agent is bound to, in rank order, at one membership epoch."""

    agent: AgentKey
    group_id: str
    members: tuple[str, ...]
    master_address: str
    timeout_s: int

    @property
    def world_size(self) -> int:
        """Number of member slots (data-parallel ranks)."""
        return len(self.members)

    @property
    def primary(self) -> str:
        """Member 0: it publishes, saves and commits."""
        return self.members[0]

    def rank_of(self, slot_id: str) -> int:
        """A member's rank; raises ValueError for a non-member."""
        return self.members.index(slot_id)


class DecisionKind(enum.Enum):
    """What the planner should do with a polling slot."""

    KEEP = "keep"        # stay bound to `agent` and serve its work
    BIND = "bind"        # bind the free slot to `agent`
    JOIN = "join"        # the free slot joins `agent`'s data-parallel group
    RELEASE = "release"  # give up `agent` (save its state first when needed), then `successor` may bind
    IDLE = "idle"        # nothing to do


@dataclasses.dataclass(frozen=True)
class BindingDecision:
    """The binder's answer for one polling slot."""

    kind: DecisionKind
    agent: AgentKey | None = None
    successor: AgentKey | None = None


class SlotBinder:
    """Binds trainer slots to agents by pending work, with affinity and aging."""

    def __init__(
        self,
        now_s: Callable[[], float],
        *,
        aging_per_s: float = 0.05,
        affinity_bonus: float = 1.0,
        max_wait_s: float = 60.0,
        dp_min_micro_batches_per_member: int = 2,
        recruit_fresh_s: float = 10.0,
        dp_timeout_s: int = 60,
        incarnation: str = "",
        capacity_aware: bool = True,
        capacity_margin: float = 1.25,
        version_lead: int = 1,
    ) -> None:
        self._now_s = now_s
        self._aging_per_s = aging_per_s
        self._affinity_bonus = affinity_bonus
        self._max_wait_s = max_wait_s
        self._dp_per_member = max(1, dp_min_micro_batches_per_member)
        self._recruit_fresh_s = recruit_fresh_s
        self._dp_timeout_s = dp_timeout_s
        self._capacity_aware = capacity_aware
        self._capacity_margin = capacity_margin
        self._version_lead = max(0, version_lead)
        # Known slots per capacity: the capacity rules apply only while there are several.
        self._capacities: dict[float, int] = {}
        # Group ids must not repeat across orchestrator restarts (traind reuses a process group
        # whose id it already joined).
        self._incarnation = incarnation or secrets.token_hex(3)
        self._slots: dict[str, TrainerSlot] = {}
        # Bound agents: their member slots in rank order (index 0 = primary), and membership epoch.
        self._members: dict[AgentKey, list[str]] = {}
        #: Counts changes of the slot set that may change other slots' decisions (a slot forgotten; a new
        #: one under static binding, whose eligibility depends on the slot set).
        self.slot_set_changes = 0
        self._epoch: dict[AgentKey, int] = {}
        self._waiting_since_s: dict[AgentKey, float] = {}
        # Agents under static binding: key -> (index in its job's spec order, agents of the job).
        self._static: dict[AgentKey, tuple[int, int]] = {}
        # The demands the planner keeps and reports each change of (track_demands, demand_changed), and
        # what decide reads from them instead of walking every agent: the agents with work, those of them
        # unbound (waiting for a slot: the candidates of a free slot), the bound ones that could take
        # another member, and the agents whose waiting may have changed since note_waiting last ran.
        self._tracked: Mapping[AgentKey, AgentDemand] | None = None
        self._with_work: set[AgentKey] = set()
        self._candidates: set[AgentKey] = set()
        self._recruiting: set[AgentKey] = set()
        self._unnoted: set[AgentKey] = set()

    # ---- static binding -----------------------------------------------------------------------------

    def set_static(self, job_id: str, agents: Iterable[str]) -> None:
        """Puts a job's agents under static binding (see the module docstring)."""
        names = list(agents)
        for index, name in enumerate(names):
            self._static[(job_id, name)] = (index, len(names))

    def eligible(self, agent: AgentKey, slot_id: str) -> bool:
        """Whether ``agent`` may bind to ``slot_id`` (always, unless it is under static binding)."""
        fixed = self._static.get(agent)
        if fixed is None:
            return True
        ordered = sorted(self._slots)
        if slot_id not in self._slots:
            return False
        index, count = fixed
        slots = len(ordered)
        position = ordered.index(slot_id)
        return position % count == index if slots >= count else index % slots == position

    # ---- slots -------------------------------------------------------------------------------------

    def touch(self, slot_id: str, worker_id: str) -> None:
        """A known slot spoke (an ack or a commit): it is alive now, as a poll would show."""
        slot = self._slots.get(slot_id)
        if slot is not None and slot.worker_id == worker_id:
            slot.last_seen_s = self._now_s()

    def observe_poll(self, slot_id: str, worker_id: str, resident: Mapping[AgentKey, int],
                     dp_address: str = "", capacity: float = 1.0) -> TrainerSlot:
        """Registers or refreshes a slot from its poll (what it holds now, its rendezvous address, its capacity)."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.worker_id != worker_id:
            if slot is not None:
                self.remove_slot(slot_id)
            slot = TrainerSlot(slot_id=slot_id, worker_id=worker_id, last_seen_s=self._now_s(), capacity=capacity)
            self._slots[slot_id] = slot
            self._count_capacity(capacity, 1)
            # Static eligibility depends on the slot set, and where capacities differ a new slot is a place
            # waiting agents may be left for; otherwise a new slot changes no other's decision.
            if self._static or self.capacities_differ:
                self.slot_set_changes += 1
        elif slot.capacity != capacity:
            self._count_capacity(slot.capacity, -1)
            slot.capacity = capacity
            self._count_capacity(capacity, 1)
            self.slot_set_changes += 1
        slot.last_seen_s = self._now_s()
        slot.resident = dict(resident)
        slot.dp_address = dp_address
        return slot

    def slot(self, slot_id: str) -> TrainerSlot | None:
        """A known slot, or None."""
        return self._slots.get(slot_id)

    def slots(self) -> list[TrainerSlot]:
        """Every known slot."""
        return list(self._slots.values())

    def slots_of_worker(self, worker_id: str) -> list[str]:
        """Ids of the slots a worker registered."""
        return [slot.slot_id for slot in self._slots.values() if slot.worker_id == worker_id]

    def remove_slot(self, slot_id: str) -> TrainerSlot | None:
        """Forgets a slot (dead or failed); its binding ends. Returns it, or None when unknown."""
        slot = self._slots.get(slot_id)
        if slot is not None and slot.agent is not None:
            self._leave(slot)
        if slot is not None:
            self.slot_set_changes += 1
            self._count_capacity(slot.capacity, -1)
        return self._slots.pop(slot_id, None)

    def _count_capacity(self, capacity: float, delta: int) -> None:
        count = self._capacities.get(capacity, 0) + delta
        if count > 0:
            self._capacities[capacity] = count
        else:
            self._capacities.pop(capacity, None)

    @property
    def capacities_differ(self) -> bool:
        """Whether the capacity rules apply: the known slots' capacities differ (and the binder weighs them)."""
        return self._capacity_aware and len(self._capacities) > 1

    # ---- bindings ------------------------------------------------------------------------------------

    def slot_of(self, agent: AgentKey) -> str | None:
        """The (primary) slot bound to an agent, or None."""
        members = self._members.get(agent)
        return members[0] if members else None

    def members(self, agent: AgentKey) -> tuple[str, ...]:
        """Every slot bound to an agent, in rank order (empty when unbound)."""
        return tuple(self._members.get(agent, ()))

    def group(self, agent: AgentKey) -> DataParallelGroup | None:
        """The agent's current group (world size 1 when it trains on one slot), or None when unbound."""
        members = self._members.get(agent)
        if not members:
            return None
        job_id, name = agent
        return DataParallelGroup(
            agent=agent, group_id=f"{job_id}/{name}/{self._incarnation}-g{self._epoch.get(agent, 0)}",
            members=tuple(members), master_address=self._slots[members[0]].dp_address,
            timeout_s=self._dp_timeout_s)

    def bind(self, slot_id: str, agent: AgentKey) -> None:
        """Binds a free slot to an unbound agent (a group of one)."""
        slot = self._slots[slot_id]
        if slot.agent is not None and slot.agent != agent:
            self.release(slot_id)
        for previous in self.members(agent):
            if previous != slot_id:
                self.release(previous)
        slot.agent = agent
        slot.bound_since_s = self._now_s()
        self._members[agent] = [slot_id]
        self._epoch[agent] = self._epoch.get(agent, 0) + 1
        self._waiting_since_s.pop(agent, None)
        self._reindex(agent)

    def join(self, slot_id: str, agent: AgentKey) -> None:
        """Adds a free slot to a bound agent's group as its last rank (a new epoch)."""
        slot = self._slots[slot_id]
        members = self._members.get(agent)
        if members is None or slot.agent is not None:
            raise ValueError(f"slot {slot_id} cannot join {agent}: slot bound or agent unbound")
        slot.agent = agent
        slot.bound_since_s = self._now_s()
        members.append(slot_id)
        self._epoch[agent] = self._epoch.get(agent, 0) + 1
        self._reindex(agent)

    def _leave(self, slot: TrainerSlot) -> None:
        """Takes one slot out of its agent's group (a new epoch; the group ends with its last member)."""
        agent = slot.agent
        slot.agent = None
        if agent is None:
            return
        members = self._members.get(agent, [])
        if slot.slot_id in members:
            members.remove(slot.slot_id)
        if members:
            self._epoch[agent] = self._epoch.get(agent, 0) + 1
        else:
            self._members.pop(agent, None)
        self._reindex(agent)

    def release(self, slot_id: str) -> AgentKey | None:
        """Ends a slot's binding; returns the agent it was bound to.

        Releasing the primary ends the whole group (every member is free again);
        releasing another member only takes it out of the group.
        """
        slot = self._slots.get(slot_id)
        if slot is None or slot.agent is None:
            return None
        agent = slot.agent
        members = self._members.get(agent, [])
        if members and members[0] == slot_id:
            for member in members:
                if member in self._slots:
                    self._slots[member].agent = None
            self._members.pop(agent, None)
            self._epoch[agent] = self._epoch.get(agent, 0) + 1
            self._reindex(agent)
        else:
            self._leave(slot)
        return agent

    def forget_agents(self, job_id: str) -> None:
        """Ends every binding and wait of a job (it ended)."""
        for slot in self._slots.values():
            if slot.agent is not None and slot.agent[0] == job_id:
                self.release(self.slot_of(slot.agent) or slot.slot_id)
            if slot.swapping_out is not None and slot.swapping_out[0] == job_id:
                slot.swapping_out = None
        for key in [key for key in self._waiting_since_s if key[0] == job_id]:
            del self._waiting_since_s[key]
            self._unnoted.add(key)  # the next note_waiting restores the wait of one that still waits
        for key in [key for key in self._static if key[0] == job_id]:
            del self._static[key]

    # ---- decisions -------------------------------------------------------------------------------------

    def note_demand(self, demands: Iterable[AgentDemand]) -> None:
        """Updates who is waiting for a slot (an unbound agent with work), for aging: a recount of ``demands``.

        The planner instead keeps its demands tracked (:meth:`track_demands`) and calls :meth:`note_waiting`.
        """
        now_s = self._now_s()
        waiting: set[AgentKey] = set()
        for demand in demands:
            if demand.has_work and demand.key not in self._members:
                waiting.add(demand.key)
                self._waiting_since_s.setdefault(demand.key, now_s)
        for key in list(self._waiting_since_s):
            if key not in waiting:
                del self._waiting_since_s[key]

    # ---- tracked demands (O(what changed) per poll, not O(agents)) -------------------------------------------

    def track_demands(self, demands: Mapping[AgentKey, AgentDemand]) -> None:
        """Tracks ``demands``: the mapping the caller passes to :meth:`decide` and keeps up to date.

        The caller reports every key it sets or removes with :meth:`demand_changed`; decide then reads
        the waiting agents from an index instead of walking every demand. Another mapping passed to
        decide is walked.
        """
        self._tracked = demands
        self._unnoted |= self._with_work | set(self._waiting_since_s)
        self._with_work = set()
        self._candidates = set()
        self._recruiting = set()
        for key in demands:
            self.demand_changed(key)

    def demand_changed(self, key: AgentKey) -> None:
        """The tracked demand of ``key`` was set or removed."""
        demand = self._tracked.get(key) if self._tracked is not None else None
        if demand is not None and demand.has_work:
            self._with_work.add(key)
        else:
            self._with_work.discard(key)
        self._reindex(key)

    def _reindex(self, key: AgentKey) -> None:
        """Recomputes ``key``'s place in the indexes after its demand or its binding changed."""
        members = self._members.get(key)
        if key in self._with_work and not members:
            self._candidates.add(key)
        else:
            self._candidates.discard(key)
        demand = self._tracked.get(key) if self._tracked is not None else None
        if members and demand is not None and demand.data_parallel and not demand.mid_step and demand.portable \
                and len(members) < self.wanted_members(demand):
            self._recruiting.add(key)
        else:
            self._recruiting.discard(key)
        self._unnoted.add(key)

    def note_waiting(self) -> None:
        """:meth:`note_demand` for the tracked demands, in O(agents whose demand or binding changed since)."""
        now_s = self._now_s()
        for key in self._unnoted:
            if key in self._candidates:
                self._waiting_since_s.setdefault(key, now_s)
            else:
                self._waiting_since_s.pop(key, None)
        self._unnoted.clear()

    def waiting(self) -> frozenset[AgentKey]:
        """The agents with work and no slot, by the tracked demands (tests compare it with a recount)."""
        return frozenset(self._candidates)

    def recruiting(self) -> frozenset[AgentKey]:
        """The bound agents whose group could take another member, by the tracked demands."""
        return frozenset(self._recruiting)

    def starving(self) -> frozenset[AgentKey]:
        """The agents that have waited for a slot ``max_wait_s`` or longer (they may displace a bound agent)."""
        now_s = self._now_s()
        return frozenset(key for key, since_s in self._waiting_since_s.items() if now_s - since_s >= self._max_wait_s)

    def waited_s(self, agent: AgentKey) -> float:
        """How long an agent has waited for a slot (0 when not waiting)."""
        since_s = self._waiting_since_s.get(agent)
        return 0.0 if since_s is None else max(0.0, self._now_s() - since_s)

    def score(self, agent: AgentKey, slot_id: str, demand: AgentDemand) -> tuple[bool, float]:
        """Priority of binding ``agent`` to ``slot_id``: (starving, work + aging + affinity)."""
        waited_s = self.waited_s(agent)
        slot = self._slots.get(slot_id)
        affinity = self._affinity_bonus if slot is not None and agent in slot.resident else 0.0
        value = demand.ready_micro_batches + (1.0 if demand.optimizer_pending or demand.warm_start_pending else 0.0)
        return waited_s >= self._max_wait_s, value + self._aging_per_s * waited_s + affinity

    def _best_waiting(self, slot_id: str, demands: Mapping[AgentKey, AgentDemand],
                      exclude: AgentKey | None, mover: AgentKey | None = None,
                      among: Iterable[AgentKey] | None = None) -> AgentKey | None:
        """The waiting agent ``slot_id`` would take (``mover``: the agent bound to it, which may move away).

        ``among``: only these agents (default: every waiting one).
        """
        # The tracked demands' waiting agents are exactly those of the walk below (the order does not matter:
        # the best score, ties to the smallest key, is a total order).
        keys: Iterable[AgentKey] = self._candidates if demands is self._tracked else demands
        if among is not None:
            keys = among
        sized = self.capacities_differ
        left = self.left_for_larger(slot_id, demands, mover) if sized else {}
        eligible = [(key, demands[key]) for key in keys
                    if key != exclude and demands[key].has_work and key not in self._members
                    and self.eligible(key, slot_id) and key not in left]  # left to a larger slot that takes it soon
        # A slot of more than the smallest capacity takes the heaviest waiting agents first: those no other
        # outranks; among them (and on the smallest slots, among all) the usual score decides.
        top = 0
        if sized and slot_id in self._slots and self._slots[slot_id].capacity > min(self._capacities):
            top = max((demand.weight for _, demand in eligible), default=0)
        best: tuple[tuple[bool, bool, float], AgentKey] | None = None
        for key, demand in eligible:
            starving, value = self.score(key, slot_id, demand)
            ranked = ((starving, self._capacity_margin * demand.weight >= top, value), key)
            # Highest score wins; ties go to the smallest key (deterministic).
            if best is None or ranked[0] > best[0] or (ranked[0] == best[0] and key < best[1]):
                best = ranked
        return None if best is None else best[1]

    def _behind(self, slot_id: str, agent: AgentKey, demand: AgentDemand, demands: Mapping[AgentKey, AgentDemand],
                mover: AgentKey | None) -> AgentKey | None:
        """The waiting agent of ``agent``'s job ``version_lead`` or more versions behind it that the slot would take.

        The most behind first; among equals the usual choice (:meth:`_best_waiting`). When none of the most
        behind may bind here (static slot sets, or left for a larger slot), the next version up is tried, and
        so on to the floor. None when the rule is off or no agent of the job that lags that far may take it.
        """
        if self._version_lead <= 0:
            return None
        keys: Iterable[AgentKey] = self._candidates if demands is self._tracked else demands
        floor = demand.version - self._version_lead
        lagging = [key for key in keys if key[0] == agent[0] and key != agent and key in demands
                   and key not in self._members and demands[key].has_work and demands[key].version <= floor]
        for version in sorted({demands[key].version for key in lagging}):
            chosen = self._best_waiting(slot_id, demands, exclude=agent, mover=mover,
                                        among=[key for key in lagging if demands[key].version == version])
            if chosen is not None:
                return chosen
        return None

    def decide(self, slot_id: str, demands: Mapping[AgentKey, AgentDemand]) -> BindingDecision:
        """What a polling slot should do, given every agent's demand."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.swapping_out is not None:
            return BindingDecision(DecisionKind.IDLE)
        if slot.agent is not None:
            agent = slot.agent
            demand = demands.get(agent, AgentDemand(agent))
            if demand.mid_step:
                return BindingDecision(DecisionKind.KEEP, agent)
            alone = len(self.members(agent)) == 1
            successor = self._best_waiting(slot_id, demands, exclude=agent, mover=agent if alone else None)
            if self.slot_of(agent) != slot_id:
                # A non-primary member: it leaves at this step boundary when another agent waits,
                # when the slot set changed, or when the group is larger than the work warrants.
                if successor is not None or not self.eligible(agent, slot_id) \
                        or len(self.members(agent)) > self.wanted_members(demand):
                    return BindingDecision(DecisionKind.RELEASE, agent, successor)
                return BindingDecision(DecisionKind.KEEP, agent)
            if not self.eligible(agent, slot_id):
                # The slot set changed (a slot appeared or died): leave at this step boundary.
                return BindingDecision(DecisionKind.RELEASE, agent, successor)
            if alone and self._moves_for_capacity(slot, demand, successor, demands):
                return BindingDecision(DecisionKind.RELEASE, agent, successor)
            if successor is None:
                return BindingDecision(DecisionKind.KEEP, agent)
            behind = self._behind(slot_id, agent, demand, demands, mover=agent if alone else None)
            if behind is not None:
                return BindingDecision(DecisionKind.RELEASE, agent, behind)
            if not demand.has_work or self.waited_s(successor) >= self._max_wait_s:
                return BindingDecision(DecisionKind.RELEASE, agent, successor)
            return BindingDecision(DecisionKind.KEEP, agent)
        chosen = self._best_waiting(slot_id, demands, exclude=None)
        if chosen is not None:
            return BindingDecision(DecisionKind.BIND, chosen)
        # Only a group that could take a member may recruit (_may_recruit checks it again).
        for agent in sorted(self._recruiting if demands is self._tracked else self._members):
            if self._may_recruit(agent, slot_id, demands):
                return BindingDecision(DecisionKind.JOIN, agent)
        return BindingDecision(DecisionKind.IDLE)

    # ---- slot capacity ----------------------------------------------------------------------------------

    def _outranks(self, agent: AgentKey, other: AgentKey, demands: Mapping[AgentKey, AgentDemand]) -> bool:
        """Whether ``agent``'s step trains more than ``capacity_margin`` times ``other``'s."""
        mine, theirs = demands.get(agent), demands.get(other)
        return mine is not None and mine.weight > self._capacity_margin * (theirs.weight if theirs else 0)

    def left_for_larger(self, slot_id: str, demands: Mapping[AgentKey, AgentDemand],
                        mover: AgentKey | None = None) -> dict[AgentKey, str]:
        """The waiting agents (and ``mover``, bound to ``slot_id``) that slots of more capacity would take soon.

        Each larger slot (largest first, ties by id) that is not saving a state takes the heaviest agent
        not yet taken that may use it (static sets) and is neither starving nor data-parallel, if the slot
        is unbound and polled within ``recruit_fresh_s`` (it binds the agent on its next poll) or bound to
        one other agent (no group) that this one outranks (it gives the slot up at its step boundary).
        Returns agent -> that slot; empty unless capacities differ.
        """
        if not self.capacities_differ:
            return {}
        here = self._slots[slot_id].capacity if slot_id in self._slots else 0.0
        larger = sorted((slot for slot in self._slots.values() if slot.capacity > here
                         and slot.swapping_out is None), key=lambda slot: (-slot.capacity, slot.slot_id))
        if not larger:
            return {}
        keys: Iterable[AgentKey] = self._candidates if demands is self._tracked else demands
        movers = [key for key in keys if key in demands and demands[key].has_work and key not in self._members]
        if mover is not None and mover in demands:
            movers.append(mover)
        movers = sorted((key for key in movers if not demands[key].data_parallel
                         and self.waited_s(key) < self._max_wait_s), key=lambda key: (-demands[key].weight, key))
        now_s = self._now_s()
        taken: dict[AgentKey, str] = {}
        for slot in larger:
            occupant = slot.agent
            if occupant is None and now_s - slot.last_seen_s > self._recruit_fresh_s:
                continue
            if occupant is not None and len(self._members.get(occupant, ())) != 1:
                continue
            for key in movers:
                if key in taken or key == occupant or not self.eligible(key, slot.slot_id):
                    continue
                if occupant is None or self._outranks(key, occupant, demands):
                    taken[key] = slot.slot_id
                break  # the heaviest eligible agent is the slot's choice (or nobody outranks its occupant)
        return taken

    def _moves_for_capacity(self, slot: TrainerSlot, demand: AgentDemand, successor: AgentKey | None,
                            demands: Mapping[AgentKey, AgentDemand]) -> bool:
        """Whether the agent bound (alone) to ``slot``, at its step boundary, leaves it for capacity's sake.

        It leaves when a larger slot is there for it (it waits for that one), or when ``slot`` is of more
        than the smallest capacity and the waiting ``successor`` outranks it.
        """
        if not self.capacities_differ or demand.data_parallel or not demand.has_work:
            return False
        if demand.key in self.left_for_larger(slot.slot_id, demands, mover=demand.key):
            return True
        return successor is not None and slot.capacity > min(self._capacities) \
            and self._outranks(successor, demand.key, demands)

    # ---- data parallelism ------------------------------------------------------------------------------

    def wanted_members(self, demand: AgentDemand) -> int:
        """How many slots the agent's upcoming work is worth (1 without data parallelism)."""
        if not demand.data_parallel or demand.max_slots <= 1:
            return 1
        return max(1, min(demand.max_slots, 1 + demand.upcoming_micro_batches // self._dp_per_member))

    def _may_recruit(self, agent: AgentKey, slot_id: str, demands: Mapping[AgentKey, AgentDemand]) -> bool:
        """Whether the free slot ``slot_id`` may join ``agent``'s group now."""
        slot = self._slots.get(slot_id)
        members = self._members.get(agent)
        demand = demands.get(agent)
        if slot is None or not members or demand is None or slot.agent is not None or slot.swapping_out is not None:
            return False
        if demand.mid_step or not demand.portable or len(members) >= self.wanted_members(demand):
            return False
        if not slot.dp_address or not all(self._slots[m].dp_address for m in members):
            return False
        if self._now_s() - slot.last_seen_s > self._recruit_fresh_s or not self.eligible(agent, slot_id):
            return False
        # Never take a slot another agent is waiting for.
        return self._best_waiting(slot_id, demands, exclude=None) is None

    def grow(self, agent: AgentKey, demands: Mapping[AgentKey, AgentDemand]) -> list[str]:
        """Recruits free, recently seen, capable slots into a bound agent's group at a step boundary.

        Called when a member of the group polls, so that the group is formed before
        the step's first micro-batch is leased. Returns the slots that joined.
        """
        joined: list[str] = []
        if demands is self._tracked and agent not in self._recruiting:
            return joined  # _may_recruit would refuse every slot: no walk over them
        for slot_id in sorted(self._slots):
            if self._may_recruit(agent, slot_id, demands):
                self.join(slot_id, agent)
                joined.append(slot_id)
        return joined
