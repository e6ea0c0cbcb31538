"""Synthetic multi-agent workloads with the paper's shape: skewed, long-tailed response lengths.

Each episode is a chain of turns, one per agent in order (a planner, a coder, a reviewer, ...);
every agent's response length is drawn from that agent's distribution. With modelled device
time only lengths matter (the device model turns them into seconds), so the responses are
whatever the tiny model samples, with ``ignore_eos`` and ``max_new_tokens`` set to the drawn
length. Lengths are in *modelled* tokens; the environment asks the tiny model for
``ceil(length / token_scale)`` real tokens (the same ``token_scale`` as the device profile).

Reward (so that learning still happens): the fraction of response tokens with an even id.

Three shapes are built for one mechanism each (docs/benchmarks.md, "The ablations on top of
partial rollouts"): ``shifting`` (one agent writes long answers, the others short ones, and the
long role moves one agent back in the chain (planner, reviewer, coder, ...) every
``rotate_every_tasks`` tasks: skewed demand that shifts,
for hierarchical balancing), ``saturating`` (the same agents, with enough tasks in flight
(``Workload.rollout_tasks``) that the heavy agent's replicas stay full and queue, and the heavy role
moving rarely: demand that more replicas serve faster, for hierarchical balancing) and ``two-heavy``
(two agents with long answers and one with short ones between them: static slot sets ``i % S`` put
both heavy ones on one slot, for agent-centric binding). A fourth, ``sized``, is built for binding on
slots of different capacities (``Workload.slot_capacity``, 2/1/1 devices): the second agent trains ~4x
the tokens of each of the others, so its step is twice as long on a one-device slot as on the
two-device one, and static sets ``i % S`` put it alone on a one-device slot. Its role stays put unless
``rotate_every_steps`` is given: with eta 8 a role that moves every few steps averages every agent's
training to less than one small slot's worth (docs/benchmarks.md, "Binding on slots of different sizes").
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from flexmarl.episode import Environment, EpisodeContext, Task, task_rng

PROMPT_ALPHABET = range(97, 123)  # byte ids of "a".."z" in the tiny byte-level tokenizer


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Response lengths in modelled tokens: ``lognormal`` (median, sigma) or ``uniform`` [low, high], clipped."""

    kind: str = "lognormal"
    median: float = 512.0
    sigma: float = 1.0
    low: int = 1
    high: int = 8192

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.kind == "uniform":
            value = rng.uniform(self.low, self.high)
        elif self.kind == "lognormal":
            value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return int(min(max(round(value), self.low), self.high))

    def mean(self, samples: int = 20_000, seed: int = 0) -> float:
        """Monte-Carlo mean (for tables)."""
        rng = random.Random(seed)
        return sum(self.sample(rng) for _ in range(samples)) / samples


# Long tail: one agent writes long answers (median 1024, up to 8192), one medium, one short.
LONG_TAIL_SHAPES = (
    LengthDistribution("lognormal", median=1024, sigma=1.0, high=8192),
    LengthDistribution("lognormal", median=384, sigma=0.8, high=4096),
    LengthDistribution("lognormal", median=96, sigma=0.5, high=1024),
)
# Uniform: the same mean work for every agent, no tail.
UNIFORM_SHAPES = (LengthDistribution("uniform", low=256, high=1280),)
# Throughput-bound rollout: long answers without a tail (the heaviest of 16 draws is ~1.6x the median) and
# short ones; the replicas' KV capacity, not one sequence's latency, limits how fast a step's tokens come.
HEAVY = LengthDistribution("lognormal", median=3072, sigma=0.3, low=1024, high=6144)
LIGHT = LengthDistribution("lognormal", median=128, sigma=0.3, low=32, high=512)
# Train-bound: two agents that train ~2.6x the tokens of the third (prompt 512 + response).
TRAIN_HEAVY = LengthDistribution("lognormal", median=1024, sigma=0.3, low=256, high=2048)
TRAIN_LIGHT = LengthDistribution("lognormal", median=96, sigma=0.3, low=32, high=512)
# Train-bound on slots of different capacities: prompt 512 + response ~2,560 tokens against ~608 (4.2x).
SIZED_HEAVY = LengthDistribution("lognormal", median=2048, sigma=0.3, low=512, high=4096)
VARIANTS = ("long-tail", "uniform", "shifting", "saturating", "two-heavy", "sized")
#: Steps between moves of the heavy role, by variant (``make_workload``'s default).
ROTATE_EVERY_STEPS = {"shifting": 3, "saturating": 8}
#: sized: traind's --slot-capacity (devices of each slot; the modelled slots train at that many devices).
SIZED_SLOT_CAPACITY = "2,1,1"
#: saturating: tasks rolloutd runs at once (x 16 episodes = 320 in flight): the heavy agent's sequences
#: fill four replicas' KV caches (55 sequences of ~3,700 reserved tokens each, 208,537 tokens on an H100)
#: with a queue behind them, so its step is its replica-seconds over its replicas, not one sequence's latency.
#: The queue waits in rolloutd (dispatch_kv_factor 1), where a replica moved to the heavy agent can take it.
SATURATING_ROLLOUT_TASKS = 20
ROLES = ("planner", "coder", "reviewer", "tester", "critic")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named agent mix."""

    name: str
    agents: tuple[tuple[str, LengthDistribution], ...]
    prompt_tokens: int = 512
    #: > 0: task t's agent i draws from agent (i + t // rotate_every_tasks) % agents' distribution
    rotate_every_tasks: int = 0
    #: > 0: rollout tasks rolloutd runs concurrently (its ``--max-tasks``); 0: rolloutd's default
    rollout_tasks: int = 0
    #: rolloutd's ``--balancer-dispatch-kv-factor`` (0: every request goes to an engine at once)
    dispatch_kv_factor: float = 0.0
    #: traind's ``--slot-capacity`` the shape is built for ("": every slot ``--train-devices-per-slot``)
    slot_capacity: str = ""

    def environment_config(self, token_scale: float) -> dict[str, Any]:
        """The ``environment.config`` of a job running this workload."""
        return {
            "token_scale": token_scale,
            "prompt_tokens": self.prompt_tokens,
            "agents": [{"name": name, **dataclasses.asdict(dist)} for name, dist in self.agents],
            "rotate_every_tasks": self.rotate_every_tasks,
        }

    def max_real_tokens(self, token_scale: float) -> int:
        """The largest real response (the agents' ``max_new_tokens``)."""
        return max(math.ceil(dist.high / token_scale) for _, dist in self.agents)


def make_workload(
    agent_count: int, variant: str, rotate_every_steps: int | None = None, prompts_per_step: int = 4
) -> Workload:
    """``agent_count`` agents cycling through the ``variant``'s shapes.

    "long-tail": LONG_TAIL_SHAPES; "uniform": all uniform; "shifting": agent 0 heavy, the rest light, the heavy
    role moving one agent back (0, K - 1, K - 2, ...) every ``rotate_every_steps`` steps (of ``prompts_per_step``
    tasks; default ``ROTATE_EVERY_STEPS``); "saturating": "shifting" with ``SATURATING_ROLLOUT_TASKS`` tasks in
    flight; "two-heavy": heavy, light, heavy, light, ... for training; "sized": light, heavy, light, ...
    (the heavy agent training ~4x the tokens of a light one), on slots of 2, 1 and 1 devices, the heavy role
    moving as in "shifting" only when ``rotate_every_steps`` is given.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown workload variant {variant!r} (one of {', '.join(VARIANTS)})")
    rotate = tasks = 0
    factor = 0.0
    capacity = SIZED_SLOT_CAPACITY if variant == "sized" else ""
    if variant in ROTATE_EVERY_STEPS:
        shapes: tuple[LengthDistribution, ...] = (HEAVY, *([LIGHT] * (agent_count - 1)))
        every = ROTATE_EVERY_STEPS[variant] if rotate_every_steps is None else rotate_every_steps
        rotate = every * prompts_per_step
        if variant == "saturating":
            tasks, factor = SATURATING_ROLLOUT_TASKS, 1.0
    elif variant == "two-heavy":
        shapes = (TRAIN_HEAVY, TRAIN_LIGHT)
    elif variant == "sized":
        shapes = (TRAIN_LIGHT, SIZED_HEAVY, *([TRAIN_LIGHT] * max(0, agent_count - 2)))
        rotate = (rotate_every_steps or 0) * prompts_per_step
    else:
        shapes = LONG_TAIL_SHAPES if variant == "long-tail" else UNIFORM_SHAPES
    agents = []
    for index in range(agent_count):
        role = ROLES[index % len(ROLES)]
        name = role if agent_count <= len(ROLES) else f"{role}{index // len(ROLES)}"
        agents.append((name, shapes[index % len(shapes)]))
    return Workload(f"{agent_count}-agent {variant}", tuple(agents), rotate_every_tasks=rotate, rollout_tasks=tasks,
                    dispatch_kv_factor=factor, slot_capacity=capacity)


class SkewedAgentsEnv(Environment):
    """The environment of a :class:`Workload` (config from :meth:`Workload.environment_config`)."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.token_scale = float(config.get("token_scale", 1.0))
        self.prompt_tokens = int(config.get("prompt_tokens", 512))
        self.lengths: dict[str, LengthDistribution] = {}
        for entry in config["agents"]:
            fields = {k: v for k, v in entry.items() if k != "name"}
            self.lengths[str(entry["name"])] = LengthDistribution(**fields)
        self.agents = tuple(self.lengths)
        self.rotate_every_tasks = int(config.get("rotate_every_tasks", 0))
        if self.rotate_every_tasks < 0:
            raise ValueError(f"environment.config.rotate_every_tasks must be >= 0, not {self.rotate_every_tasks}")

    def length_distribution(self, agent: str, task_index: int) -> LengthDistribution:
        """The distribution ``agent``'s responses to task ``task_index`` are drawn from (after rotation)."""
        if not self.rotate_every_tasks:
            return self.lengths[agent]
        shift = task_index // self.rotate_every_tasks
        return self.lengths[self.agents[(self.agents.index(agent) + shift) % len(self.agents)]]

    def real_tokens(self, modelled_tokens: int) -> int:
        """Real tokens the tiny model generates for a modelled length."""
        return max(1, math.ceil(modelled_tokens / self.token_scale))

    def task(self, index: int, seed: int) -> Task:
        """A random lowercase prompt of ``prompt_tokens`` modelled tokens."""
        rng = task_rng(index, seed)
        length = self.real_tokens(self.prompt_tokens)
        return Task(index=index, seed=seed, data={"prompt": [rng.choice(PROMPT_ALPHABET) for _ in range(length)]})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Every agent answers once, in order, with a length drawn from its distribution."""
        prompt: list[int] = list(task.data["prompt"])
        for agent in self.agents:
            length = self.real_tokens(self.length_distribution(agent, task.index).sample(ctx.rng))
            out = await ctx.generate(agent, prompt, max_new_tokens=length, ignore_eos=True)
            even = sum(1 for token in out.token_ids if token % 2 == 0)
            ctx.reward(agent, even / max(1, len(out.token_ids)))
