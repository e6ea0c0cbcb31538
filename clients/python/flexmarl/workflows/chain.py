"""``chain``: each agent transforms the previous agent's output (planner -> worker -> reviewer).

Turn order: the ``steps`` in order, one turn each; step k's prompt is the template its step names
(``prompt``, a template over the task row's fields and ``{previous}``, the output of step k - 1;
the first step has no ``{previous}``). The last step's output is the team's answer. An agent may
take several steps (its turns, in step order).

Rewards (a role per agent): every agent is rewarded on the team's answer, its weight times the
score of its role's reward function (shared credit: the planner learns from what its plan led
to), episode-level, once per episode whatever its number of steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import Template, Workflow

DEFAULT_STEPS = (
    {"agent": "planner", "prompt": "Write a short plan for solving this problem.\n\n{question}"},
    {"agent": "worker", "prompt": "Problem: {question}\n\nPlan: {previous}\n\n"
                                  "Follow the plan. End with 'Answer: <answer>'."},
    {"agent": "reviewer", "prompt": "Problem: {question}\n\nSolution: {previous}\n\n"
                                    "Check the solution and correct it if needed. End with 'Answer: <answer>'."},
)


class ChainStep(pydantic.BaseModel):
    """One step of a chain: ``agent`` answers ``prompt``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    agent: str = pydantic.Field(min_length=1)
    prompt: str = pydantic.Field(min_length=1)


class Chain(Workflow):
    """A chain of agents over task rows; config keys: the parameters (docs/workflows.md)."""

    def __init__(self, *, reward: Mapping[str, Any], steps: Sequence[Mapping[str, Any]] = DEFAULT_STEPS,
                 rewards: Mapping[str, Any] | None = None,
                 tasks: list[Mapping[str, Any]] | None = None, eval_tasks: list[Mapping[str, Any]] | None = None,
                 chat: bool = True, system: str | None = None, success_threshold: float = 1.0,
                 reward_timeout_s: float = 10.0, reward_workers: int = 2) -> None:
        super().__init__(reward=reward, steps=steps, rewards=rewards, tasks=tasks, eval_tasks=eval_tasks, chat=chat,
                         system=system, success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                         reward_workers=reward_workers)
        if isinstance(steps, str) or not isinstance(steps, Sequence) or len(steps) < 2:
            raise ValueError("steps: must list two steps or more ({agent, prompt} each)")
        parsed = []
        for number, step in enumerate(steps):
            try:
                parsed.append(ChainStep.model_validate(step))
            except pydantic.ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise ValueError(f"steps[{number}]{'.' + where if where else ''}: {first['msg']}") from None
        self.steps = tuple(parsed)
        if "previous" in Template.parse("step0", self.steps[0].prompt, where="steps[0].prompt").fields:
            raise ValueError("steps[0].prompt: the first step has no {previous} output to read")
        # Each step's prompt is a template of its own, named step<k> (what its messages name).
        self.PROMPTS = {f"step{k}": (s.prompt, frozenset({"previous"}) if k else frozenset())
                        for k, s in enumerate(self.steps)}
        self._setup_common(roles={s.agent: (s.agent,) for s in self.steps}, prompts=None, reward=reward,
                           rewards=rewards, tasks=tasks, eval_tasks=eval_tasks, chat=chat, system=system,
                           success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                           reward_workers=reward_workers)

    def prompt_location(self, name: str) -> str:
        """Step k's prompt (template ``step<k>``) is ``steps[k].prompt``."""
        return f"steps[{name.removeprefix('step')}].prompt"

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """The steps in order, each reading the previous output; see the module docstring."""
        row = task.data
        previous = ""
        for k, step in enumerate(self.steps):
            variables = {"previous": previous} if k else {}
            previous = (await ctx.generate(step.agent, self.prompt(f"step{k}", row, **variables))).text.strip()
        correct: dict[str, list[bool]] = {}
        for role, (agent,) in self.roles.items():
            score = await self.score(role, previous, row)
            self.reward_role(ctx, role, agent, score)
            correct[role] = [self.passes(score)]
        self.note_outcome(ctx, previous, await self.team_score(previous, row), correct)
