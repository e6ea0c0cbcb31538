"""Agent-centric allocation of trainer slots, and per-agent rollout demand.

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
* **One slot per agent (v1).** ``agents[].max_slots`` is accepted by the spec
  but a step is trained on one slot: data-parallel steps across slots need a
  process group per binding, which traind does not build yet.
"""

from __future__ import annotations

import dataclasses
import enum
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

    @property
    def has_work(self) -> bool:
        """Whether a slot polling now could be given work for this agent."""
        return self.ready_micro_batches > 0 or self.optimizer_pending


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


class DecisionKind(enum.Enum):
    """What the planner should do with a polling slot."""

    KEEP = "keep"        # stay bound to `agent` and serve its work
    BIND = "bind"        # bind the free slot to `agent`
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
    ) -> None:
        self._now_s = now_s
        self._aging_per_s = aging_per_s
        self._affinity_bonus = affinity_bonus
        self._max_wait_s = max_wait_s
        self._slots: dict[str, TrainerSlot] = {}
        self._slot_of_agent: dict[AgentKey, str] = {}
        self._waiting_since_s: dict[AgentKey, float] = {}
        # Agents under static binding: key -> (index in its job's spec order, agents of the job).
        self._static: dict[AgentKey, tuple[int, int]] = {}

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

    def observe_poll(self, slot_id: str, worker_id: str, resident: Mapping[AgentKey, int]) -> TrainerSlot:
        """Registers or refreshes a slot from its poll (what it holds now)."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.worker_id != worker_id:
            if slot is not None:
                self.remove_slot(slot_id)
            slot = TrainerSlot(slot_id=slot_id, worker_id=worker_id, last_seen_s=self._now_s())
            self._slots[slot_id] = slot
        slot.last_seen_s = self._now_s()
        slot.resident = dict(resident)
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
        slot = self._slots.pop(slot_id, None)
        if slot is not None and slot.agent is not None:
            self._slot_of_agent.pop(slot.agent, None)
        return slot

    # ---- bindings ------------------------------------------------------------------------------------

    def slot_of(self, agent: AgentKey) -> str | None:
        """The slot bound to an agent, or None."""
        return self._slot_of_agent.get(agent)

    def bind(self, slot_id: str, agent: AgentKey) -> None:
        """Binds a free slot to an unbound agent."""
        slot = self._slots[slot_id]
        if slot.agent is not None and slot.agent != agent:
            self.release(slot_id)
        previous = self._slot_of_agent.get(agent)
        if previous is not None and previous != slot_id:
            self.release(previous)
        slot.agent = agent
        slot.bound_since_s = self._now_s()
        self._slot_of_agent[agent] = slot_id
        self._waiting_since_s.pop(agent, None)

    def release(self, slot_id: str) -> AgentKey | None:
        """Ends a slot's binding; returns the agent it was bound to."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.agent is None:
            return None
        agent = slot.agent
        slot.agent = None
        self._slot_of_agent.pop(agent, None)
        return agent

    def forget_agents(self, job_id: str) -> None:
        """Ends every binding and wait of a job (it ended)."""
        for slot in self._slots.values():
            if slot.agent is not None and slot.agent[0] == job_id:
                self.release(slot.slot_id)
            if slot.swapping_out is not None and slot.swapping_out[0] == job_id:
                slot.swapping_out = None
        for key in [key for key in self._waiting_since_s if key[0] == job_id]:
            del self._waiting_since_s[key]
        for key in [key for key in self._static if key[0] == job_id]:
            del self._static[key]

    # ---- decisions -------------------------------------------------------------------------------------

    def note_demand(self, demands: Iterable[AgentDemand]) -> None:
        """Updates who is waiting for a slot (an unbound agent with work), for aging."""
        now_s = self._now_s()
        waiting: set[AgentKey] = set()
        for demand in demands:
            if demand.has_work and demand.key not in self._slot_of_agent:
                waiting.add(demand.key)
                self._waiting_since_s.setdefault(demand.key, now_s)
        for key in list(self._waiting_since_s):
            if key not in waiting:
                del self._waiting_since_s[key]

    def waited_s(self, agent: AgentKey) -> float:
        """How long an agent has waited for a slot (0 when not waiting)."""
        since_s = self._waiting_since_s.get(agent)
        return 0.0 if since_s is None else max(0.0, self._now_s() - since_s)

    def score(self, agent: AgentKey, slot_id: str, demand: AgentDemand) -> tuple[bool, float]:
        """Priority of binding ``agent`` to ``slot_id``: (starving, work + aging + affinity)."""
        waited_s = self.waited_s(agent)
        slot = self._slots.get(slot_id)
        affinity = self._affinity_bonus if slot is not None and agent in slot.resident else 0.0
        value = demand.ready_micro_batches + (1.0 if demand.optimizer_pending else 0.0)
        return waited_s >= self._max_wait_s, value + self._aging_per_s * waited_s + affinity

    def _best_waiting(self, slot_id: str, demands: Mapping[AgentKey, AgentDemand],
                      exclude: AgentKey | None) -> AgentKey | None:
        best: tuple[tuple[bool, float], AgentKey] | None = None
        for key, demand in demands.items():
            if key == exclude or not demand.has_work or key in self._slot_of_agent \
                    or not self.eligible(key, slot_id):
                continue
            ranked = (self.score(key, slot_id, demand), key)
            # Highest score wins; ties go to the smallest key (deterministic).
            if best is None or ranked[0] > best[0] or (ranked[0] == best[0] and key < best[1]):
                best = ranked
        return None if best is None else best[1]

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
            successor = self._best_waiting(slot_id, demands, exclude=agent)
            if not self.eligible(agent, slot_id):
                # The slot set changed (a slot appeared or died): leave at this step boundary.
                return BindingDecision(DecisionKind.RELEASE, agent, successor)
            if successor is None:
                return BindingDecision(DecisionKind.KEEP, agent)
            if not demand.has_work or self.waited_s(successor) >= self._max_wait_s:
                return BindingDecision(DecisionKind.RELEASE, agent, successor)
            return BindingDecision(DecisionKind.KEEP, agent)
        chosen = self._best_waiting(slot_id, demands, exclude=None)
        if chosen is None:
            return BindingDecision(DecisionKind.IDLE)
        return BindingDecision(DecisionKind.BIND, chosen)


class RolloutDemandEstimator:
    """Outstanding estimated generation tokens per agent, for rolloutd's inter-agent balancer.

    Tokens per episode of an agent are an exponential moving average over
    reported tasks, starting from the prior (its ``max_new_tokens``): demand =
    episodes still to generate x that estimate.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self._smoothing = smoothing
        self._tokens_per_episode: dict[AgentKey, float] = {}

    def set_prior(self, agent: AgentKey, tokens_per_episode: float) -> None:
        """Starting estimate for an agent (kept if one exists)."""
        self._tokens_per_episode.setdefault(agent, float(tokens_per_episode))

    def observe(self, agent: AgentKey, episodes: int, response_tokens: int) -> None:
        """Folds in a finished task's tokens."""
        if episodes <= 0:
            return
        sample = response_tokens / episodes
        previous = self._tokens_per_episode.get(agent)
        self._tokens_per_episode[agent] = sample if previous is None else (
            (1.0 - self._smoothing) * previous + self._smoothing * sample)

    def tokens_per_episode(self, agent: AgentKey) -> float:
        """Current estimate (0 when unknown)."""
        return self._tokens_per_episode.get(agent, 0.0)

    def estimate(self, agent: AgentKey, outstanding_episodes: int) -> int:
        """Estimated tokens still to generate for ``outstanding_episodes`` episodes."""
        return int(round(outstanding_episodes * self.tokens_per_episode(agent)))

    def forget_job(self, job_id: str) -> None:
        """Drops a finished job's estimates."""
        for key in [key for key in self._tokens_per_episode if key[0] == job_id]:
            del self._tokens_per_episode[key]
