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
from typing import Any

from flexmarl.episode import EpisodeContext, Task
from flexmarl.rewards import answer_key
from flexmarl.workflows.base import Workflow, join_outputs

ANSWER = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
DEBATE = ("Problem: {question}\n\nYour previous answer: {previous}\n\nThe other agents answered:\n\n{others}\n\n"
          "Considering their answers, give your answer again. End with 'Answer: <answer>'.")
JUDGE = ("Problem: {question}\n\nThe agents answered:\n\n{answers}\n\n"
         "Which answer is right? Give the final answer. End with 'Answer: <answer>'.")


class Debate(Workflow):
    """N debaters and an optional judge over task rows; config keys: the parameters (docs/workflows.md)."""

    PROMPTS = {
        "answer": (ANSWER, frozenset()),
        "debate": (DEBATE, frozenset({"previous", "others"})),
        "judge": (JUDGE, frozenset({"answers"})),
    }

    def __init__(self, *, reward: Mapping[str, Any], debaters: Sequence[str] = ("debater_0", "debater_1"),
                 judge: str | None = None, rounds: int = 2,
                 prompts: Mapping[str, str] | None = None, rewards: Mapping[str, Any] | None = None,
                 tasks: list[Mapping[str, Any]] | None = None, eval_tasks: list[Mapping[str, Any]] | None = None,
                 chat: bool = True, system: str | None = None, success_threshold: float = 1.0,
                 reward_timeout_s: float = 10.0, reward_workers: int = 2) -> None:
        super().__init__(reward=reward, debaters=debaters, judge=judge, rounds=rounds, prompts=prompts,
                         rewards=rewards, tasks=tasks, eval_tasks=eval_tasks, chat=chat, system=system,
                         success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                         reward_workers=reward_workers)
        if isinstance(debaters, str) or not isinstance(debaters, Sequence) or len(debaters) < 2:
            raise ValueError(f"debaters: must list two agents or more, got {debaters!r}")
        if len(set(debaters)) != len(debaters) or judge in debaters:
            raise ValueError("debaters and judge must be distinct agents")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds: must be an integer >= 1, got {rounds!r}")
        self.debaters, self.judge, self.rounds = tuple(debaters), judge, rounds
        roles: dict[str, Sequence[str]] = {"debater": self.debaters}
        if judge is not None:
            roles["judge"] = (judge,)
        self._setup_common(roles=roles, prompts=prompts, reward=reward, rewards=rewards, tasks=tasks,
                           eval_tasks=eval_tasks, chat=chat, system=system, success_threshold=success_threshold,
                           reward_timeout_s=reward_timeout_s, reward_workers=reward_workers)
        if judge is None:  # the judge prompt is never used: it may name what it likes
            self.templates.pop("judge")

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """R rounds of concurrent answers, then the judge or the majority; see the module docstring."""
        row = task.data

        async def answer(debater: str, previous: Mapping[str, str] | None) -> str:
            if previous is None:
                prompt = self.prompt("answer", row)
            else:
                others = join_outputs([(d, previous[d]) for d in self.debaters if d != debater])
                prompt = self.prompt("debate", row, previous=previous[debater], others=others)
            return (await ctx.generate(debater, prompt)).text.strip()

        answers: dict[str, str] | None = None
        for _ in range(self.rounds):
            texts = await asyncio.gather(*(answer(d, answers) for d in self.debaters))
            answers = dict(zip(self.debaters, texts, strict=True))
        assert answers is not None  # rounds >= 1
        scores = [await self.score("debater", answers[d], row) for d in self.debaters]
        for debater, score in zip(self.debaters, scores, strict=True):
            self.reward_role(ctx, "debater", debater, score)
        correct: dict[str, list[bool]] = {"debater": [self.passes(s) for s in scores]}
        if self.judge is not None:
            listed = join_outputs([(d, answers[d]) for d in self.debaters])
            final = (await ctx.generate(self.judge, self.prompt("judge", row, answers=listed))).text.strip()
            judge_score = await self.score("judge", final, row)
            self.reward_role(ctx, "judge", self.judge, judge_score)
            correct["judge"] = [self.passes(judge_score)]
        else:
            final = self.majority([answers[d] for d in self.debaters])
        self.note_outcome(ctx, final, await self.team_score(final, row), correct)

    def majority(self, answers: Sequence[str]) -> str:
        """The most common answer by the team reward's answer key (ties: the earliest); answers give nothing last."""
        keys = [answer_key(self.reward_spec.function, a) for a in answers]
        counts = {key: keys.count(key) for key in keys}
        best = max(range(len(answers)), key=lambda i: (keys[i] != "", counts[keys[i]], -i))
        return answers[best]
