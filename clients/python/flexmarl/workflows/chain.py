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

import pydantic
from pydantic import Field

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import Template, Workflow, WorkflowConfig

PLAN = "Write a short plan for solving this problem.\n\n{question}"
WORK = "Problem: {question}\n\nPlan: {previous}\n\nFollow the plan. End with 'Answer: <answer>'."
REVIEW = ("Problem: {question}\n\nSolution: {previous}\n\n"
          "Check the solution and correct it if needed. End with 'Answer: <answer>'.")


class ChainStep(pydantic.BaseModel):
    """One step of a chain: `agent` answers `prompt`."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)

    agent: str = Field(min_length=1)
    """The agent that takes this step."""
    prompt: str = Field(min_length=1)
    """A template over the task row's fields and `{previous}`, the previous step's output (not in the first)."""


def _default_steps() -> list[ChainStep]:
    return [ChainStep(agent="planner", prompt=PLAN), ChainStep(agent="worker", prompt=WORK),
            ChainStep(agent="reviewer", prompt=REVIEW)]


class ChainConfig(WorkflowConfig):
    """`environment.config` of `flexmarl.workflows:Chain`: each agent transforms the previous agent's output.

    A role per agent (its name); step k's prompt is `steps[k].prompt`.
    """

    steps: list[ChainStep] = Field(default_factory=_default_steps, min_length=2)
    """The steps in order, two or more (default: planner -> worker -> reviewer); an agent may take several."""

    def roles(self) -> dict[str, tuple[str, ...]]:
        """One role per agent, named after it."""
        return {step.agent: (step.agent,) for step in self.steps}

    def templates(self) -> dict[str, Template]:
        """``step<k>``: step k's prompt; the first may not name ``{previous}``."""
        templates = {f"step{k}": Template.parse(f"step{k}", step.prompt, {"previous"} if k else (),
                                                f"steps[{k}].prompt") for k, step in enumerate(self.steps)}
        if "previous" in templates["step0"].fields:
            raise ValueError("steps[0].prompt: the first step has no {previous} output to read")
        return templates


class Chain(Workflow):
    """A chain of agents over task rows; config: :class:`ChainConfig` (docs/workflows.md)."""

    Config = ChainConfig
    settings: ChainConfig

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """The steps in order, each reading the previous output; see the module docstring."""
        row = task.data
        previous = ""
        for k, step in enumerate(self.settings.steps):
            variables = {"previous": previous} if k else {}
            previous = (await ctx.generate(step.agent, self.prompt(f"step{k}", row, **variables))).text.strip()
        correct: dict[str, list[bool]] = {}
        for role, (agent,) in self.roles.items():
            score = await self.score(role, previous, row)
            self.reward_role(ctx, role, agent, score)
            correct[role] = [self.passes(score)]
        self.note_outcome(ctx, previous, await self.team_score(previous, row), correct)
