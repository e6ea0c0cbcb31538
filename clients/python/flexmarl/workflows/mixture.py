"""``mixture``: K proposers answer, one aggregator combines their answers (mixture-of-agents).

Turn order: every proposer answers the task (prompt ``propose``), concurrently; then the
aggregator reads them all (``aggregate``, ``{proposals}``: one ``[name] text`` paragraph each) and
its reply is the team's answer.

Rewards (roles ``proposer``, ``aggregator``): each proposer its weight times the score of its own
answer, the aggregator its weight times the score of its reply; episode-level.
"""

from __future__ import annotations

import asyncio

import pydantic
from pydantic import Field

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import PromptedConfig, Workflow, join_outputs

PROPOSE = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
AGGREGATE = ("Problem: {question}\n\nProposed solutions:\n\n{proposals}\n\n"
             "Combine them into one correct solution. End with 'Answer: <answer>'.")


class MixtureConfig(PromptedConfig):
    """`environment.config` of `flexmarl.workflows:Mixture`: K proposers answer, one aggregator combines them.

    Roles `proposer`, `aggregator`; prompts `propose`, `aggregate` (`{proposals}`).
    """

    PROMPTS = {
        "propose": (PROPOSE, frozenset()),
        "aggregate": (AGGREGATE, frozenset({"proposals"})),
    }

    proposers: list[str] = Field(default_factory=lambda: ["proposer_0", "proposer_1"], min_length=1)
    """The proposers' agent names (one or more)."""
    aggregator: str = Field("aggregator", min_length=1)
    """The aggregator's agent name: its reply is the team's answer."""

    def roles(self) -> dict[str, tuple[str, ...]]:
        """``proposer`` (every proposer) and ``aggregator``."""
        return {"proposer": tuple(self.proposers), "aggregator": (self.aggregator,)}

    @pydantic.model_validator(mode="after")
    def _distinct(self) -> MixtureConfig:
        agents = [*self.proposers, self.aggregator]
        if len(set(agents)) != len(agents) or not all(agents):
            raise ValueError("proposers and aggregator must be distinct, non-empty agent names")
        return self


class Mixture(Workflow):
    """K proposers and an aggregator over task rows; config: :class:`MixtureConfig` (docs/workflows.md)."""

    Config = MixtureConfig
    settings: MixtureConfig

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Concurrent proposals, then the aggregation; see the module docstring."""
        row, proposers, aggregator = task.data, tuple(self.settings.proposers), self.settings.aggregator
        prompt = self.prompt("propose", row)
        texts = await asyncio.gather(*(ctx.generate(p, prompt) for p in proposers))
        proposals = [(p, g.text.strip()) for p, g in zip(proposers, texts, strict=True)]
        final = await ctx.generate(aggregator, self.prompt("aggregate", row, proposals=join_outputs(proposals)))
        answer = final.text.strip()
        scores = [await self.score("proposer", text, row) for _, text in proposals]
        for proposer, score in zip(proposers, scores, strict=True):
            self.reward_role(ctx, "proposer", proposer, score)
        aggregate_score = await self.score("aggregator", answer, row)
        self.reward_role(ctx, "aggregator", aggregator, aggregate_score)
        self.note_outcome(ctx, answer, await self.team_score(answer, row),
                          {"proposer": [self.passes(s) for s in scores], "aggregator": [self.passes(aggregate_score)]})
