"""``mixture``: K proposers answer, one aggregator combines their answers (mixture-of-agents).

Turn order: every proposer answers the task (prompt ``propose``), concurrently; then the
aggregator reads them all (``aggregate``, ``{proposals}``: one ``[name] text`` paragraph each) and
its reply is the team's answer.

Rewards (roles ``proposer``, ``aggregator``): each proposer its weight times the score of its own
answer, the aggregator its weight times the score of its reply; episode-level.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import Workflow, join_outputs

PROPOSE = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
AGGREGATE = ("Problem: {question}\n\nProposed solutions:\n\n{proposals}\n\n"
             "Combine them into one correct solution. End with 'Answer: <answer>'.")


class Mixture(Workflow):
    """K proposers and an aggregator over task rows; config keys: the parameters (docs/workflows.md)."""

    PROMPTS = {
        "propose": (PROPOSE, frozenset()),
        "aggregate": (AGGREGATE, frozenset({"proposals"})),
    }

    def __init__(self, *, reward: Mapping[str, Any], proposers: Sequence[str] = ("proposer_0", "proposer_1"),
                 aggregator: str = "aggregator",
                 prompts: Mapping[str, str] | None = None, rewards: Mapping[str, Any] | None = None,
                 tasks: list[Mapping[str, Any]] | None = None, eval_tasks: list[Mapping[str, Any]] | None = None,
                 chat: bool = True, system: str | None = None, success_threshold: float = 1.0,
                 reward_timeout_s: float = 10.0, reward_workers: int = 2) -> None:
        super().__init__(reward=reward, proposers=proposers, aggregator=aggregator, prompts=prompts, rewards=rewards,
                         tasks=tasks, eval_tasks=eval_tasks, chat=chat, system=system,
                         success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                         reward_workers=reward_workers)
        if isinstance(proposers, str) or not isinstance(proposers, Sequence) or len(proposers) < 1:
            raise ValueError(f"proposers: must list one agent or more, got {proposers!r}")
        if len(set(proposers)) != len(proposers) or aggregator in proposers:
            raise ValueError("proposers and aggregator must be distinct agents")
        self.proposers, self.aggregator = tuple(proposers), aggregator
        self._setup_common(roles={"proposer": self.proposers, "aggregator": (aggregator,)}, prompts=prompts,
                           reward=reward, rewards=rewards, tasks=tasks, eval_tasks=eval_tasks, chat=chat,
                           system=system, success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                           reward_workers=reward_workers)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Concurrent proposals, then the aggregation; see the module docstring."""
        row = task.data
        prompt = self.prompt("propose", row)
        texts = await asyncio.gather(*(ctx.generate(p, prompt) for p in self.proposers))
        proposals = [(p, g.text.strip()) for p, g in zip(self.proposers, texts, strict=True)]
        final = (await ctx.generate(self.aggregator, self.prompt("aggregate", row, proposals=join_outputs(proposals))))
        answer = final.text.strip()
        scores = [await self.score("proposer", text, row) for _, text in proposals]
        for proposer, score in zip(self.proposers, scores, strict=True):
            self.reward_role(ctx, "proposer", proposer, score)
        aggregate_score = await self.score("aggregator", answer, row)
        self.reward_role(ctx, "aggregator", self.aggregator, aggregate_score)
        self.note_outcome(ctx, answer, await self.team_score(answer, row),
                          {"proposer": [self.passes(s) for s in scores], "aggregator": [self.passes(aggregate_score)]})
