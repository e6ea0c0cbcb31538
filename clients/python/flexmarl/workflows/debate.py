"""``debate``: N agents answer, read each other's answers for R rounds; a final answer by majority or a judge.

Turn order, for ``rounds`` R (>= 1) and debaters d_1..d_N: round 1, every debater answers the task
(prompt ``answer``), concurrently; rounds 2..R, every debater answers again, concurrently, having
read its own previous answer (``{previous}``) and the others' (``{others}``, one ``[name] text``
paragraph each). Then, with a ``judge``, the judge reads the last round's answers (``judge``,
``{answers}``) and its reply is the team's answer; without one, the team's answer is the most
common final answer among the debaters (by the team reward's answer key,
:func:`flexmarl.rewards.answer_key`: the number for ``numeric_match``, the letter for
``multiple_choice``; ties go to the debater listed first).

Rewards (roles ``debater``, ``judge``): each debater its weight times the score of its own final
answer, the judge its weight times the score of its reply; episode-level.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pydantic
from pydantic import Field

from flexmarl.episode import EpisodeContext, Task
from flexmarl.rewards import answer_key
from flexmarl.workflows.base import PromptedConfig, Template, Workflow, join_outputs

ANSWER = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
DEBATE = ("Problem: {question}\n\nYour previous answer: {previous}\n\nThe other agents answered:\n\n{others}\n\n"
          "Considering their answers, give your answer again. End with 'Answer: <answer>'.")
JUDGE = ("Problem: {question}\n\nThe agents answered:\n\n{answers}\n\n"
         "Which answer is right? Give the final answer. End with 'Answer: <answer>'.")


class DebateConfig(PromptedConfig):
    """`environment.config` of `flexmarl.workflows:Debate`: N agents answer, read each other's answers, R rounds.

    The final answer by majority or by a judge. Roles `debater`, `judge`; prompts `answer`, `debate`
    (`{previous}`, `{others}`), `judge` (`{answers}`).
    """

    PROMPTS = {
        "answer": (ANSWER, frozenset()),
        "debate": (DEBATE, frozenset({"previous", "others"})),
        "judge": (JUDGE, frozenset({"answers"})),
    }

    debaters: list[str] = Field(default_factory=lambda: ["debater_0", "debater_1"], min_length=2)
    """The debaters' agent names (two or more)."""
    judge: str | None = None
    """An agent that reads the last round's answers and gives the team's answer; unset: the majority does."""
    rounds: int = Field(2, ge=1)
    """Rounds of answers; from the second on, each debater reads the others' last answers."""

    def roles(self) -> dict[str, tuple[str, ...]]:
        """``debater`` (every debater) and, with one, ``judge``."""
        roles = {"debater": tuple(self.debaters)}
        if self.judge is not None:
            roles["judge"] = (self.judge,)
        return roles

    def templates(self) -> dict[str, Template]:
        """The prompts; without a judge the ``judge`` prompt is never used (it may name what it likes)."""
        templates = super().templates()
        if self.judge is None:
            templates.pop("judge")
        return templates

    @pydantic.model_validator(mode="after")
    def _distinct(self) -> DebateConfig:
        agents = [*self.debaters, *([self.judge] if self.judge is not None else [])]
        if len(set(agents)) != len(agents) or not all(agents):
            raise ValueError("debaters and judge must be distinct, non-empty agent names")
        return self


class Debate(Workflow):
    """N debaters and an optional judge over task rows; config: :class:`DebateConfig` (docs/workflows.md)."""

    Config = DebateConfig
    settings: DebateConfig

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """R rounds of concurrent answers, then the judge or the majority; see the module docstring."""
        row, debaters, judge = task.data, tuple(self.settings.debaters), self.settings.judge

        async def answer(debater: str, previous: Mapping[str, str] | None) -> str:
            if previous is None:
                prompt = self.prompt("answer", row)
            else:
                others = join_outputs([(d, previous[d]) for d in debaters if d != debater])
                prompt = self.prompt("debate", row, previous=previous[debater], others=others)
            return (await ctx.generate(debater, prompt)).text.strip()

        answers: dict[str, str] = {}
        for round_number in range(self.settings.rounds):
            texts = await asyncio.gather(*(answer(d, answers if round_number else None) for d in debaters))
            answers = dict(zip(debaters, texts, strict=True))
        scores = [await self.score("debater", answers[d], row) for d in debaters]
        for debater, score in zip(debaters, scores, strict=True):
            self.reward_role(ctx, "debater", debater, score)
        correct: dict[str, list[bool]] = {"debater": [self.passes(s) for s in scores]}
        if judge is not None:
            listed = join_outputs([(d, answers[d]) for d in debaters])
            final = (await ctx.generate(judge, self.prompt("judge", row, answers=listed))).text.strip()
            judge_score = await self.score("judge", final, row)
            self.reward_role(ctx, "judge", judge, judge_score)
            correct["judge"] = [self.passes(judge_score)]
        else:
            final = self.majority([answers[d] for d in debaters])
        self.note_outcome(ctx, final, await self.team_score(final, row), correct)

    def majority(self, answers: Sequence[str]) -> str:
        """The most common answer by the team reward's answer key (ties: the earliest); answers give nothing last."""
        keys = [answer_key(self.reward_spec.function, a) for a in answers]
        counts = {key: keys.count(key) for key in keys}
        best = max(range(len(answers)), key=lambda i: (keys[i] != "", counts[keys[i]], -i))
        return answers[best]
