"""``solver_verifier``: a solver answers, a verifier accepts or rejects with a reason, the solver may revise.

Turn order, for ``rounds`` R: the solver answers (prompt ``solve``); then up to R rounds of: the
verifier judges the latest attempt (``verify``, variable ``{attempt}``); on acceptance the episode
ends, on rejection the solver revises (``revise``, variables ``{attempt}`` and ``{feedback}``, the
verifier's whole reply). So the solver takes 1 to R + 1 turns, the verifier 1 to R, and the last
attempt (accepted, or revised after the last rejection) is the team's answer.

A verdict accepts when ``accept_word`` appears in the verifier's reply before ``reject_word``
(case-insensitive); a reply with neither rejects.

Rewards (roles ``solver``, ``verifier``): the solver's weight times the score of the team's
answer, episode-level; the verifier, at each of its turns, its weight when its verdict was right
(it accepted an attempt that passes its reward's check, or rejected one that fails), else 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import Workflow

SOLVE = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
VERIFY = ("Problem: {question}\n\nProposed solution: {attempt}\n\n"
          "Is it correct? Reply ACCEPT or REJECT, then give your reason.")
REVISE = ("Problem: {question}\n\nYour solution: {attempt}\n\nA reviewer replied: {feedback}\n\n"
          "Write a corrected solution. End with 'Answer: <answer>'.")


class SolverVerifier(Workflow):
    """A solver and a verifier over task rows; config keys: the parameters (docs/workflows.md)."""

    PROMPTS = {
        "solve": (SOLVE, frozenset()),
        "verify": (VERIFY, frozenset({"attempt"})),
        "revise": (REVISE, frozenset({"attempt", "feedback"})),
    }

    def __init__(self, *, reward: Mapping[str, Any], solver: str = "solver", verifier: str = "verifier",
                 rounds: int = 1, accept_word: str = "ACCEPT", reject_word: str = "REJECT",
                 prompts: Mapping[str, str] | None = None, rewards: Mapping[str, Any] | None = None,
                 tasks: list[Mapping[str, Any]] | None = None, eval_tasks: list[Mapping[str, Any]] | None = None,
                 chat: bool = True, system: str | None = None, success_threshold: float = 1.0,
                 reward_timeout_s: float = 10.0, reward_workers: int = 2) -> None:
        super().__init__(reward=reward, solver=solver, verifier=verifier, rounds=rounds, accept_word=accept_word,
                         reject_word=reject_word, prompts=prompts, rewards=rewards, tasks=tasks,
                         eval_tasks=eval_tasks, chat=chat, system=system, success_threshold=success_threshold,
                         reward_timeout_s=reward_timeout_s, reward_workers=reward_workers)
        if solver == verifier:
            raise ValueError(f"solver and verifier must be different agents, both are {solver!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds: must be an integer >= 1, got {rounds!r}")
        for key, word in (("accept_word", accept_word), ("reject_word", reject_word)):
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"{key}: must be a non-empty string")
        if accept_word.casefold() == reject_word.casefold():
            raise ValueError("accept_word and reject_word must differ")
        self.solver, self.verifier, self.rounds = solver, verifier, rounds
        self.accept_word, self.reject_word = accept_word.casefold(), reject_word.casefold()
        self._setup_common(roles={"solver": (solver,), "verifier": (verifier,)}, prompts=prompts, reward=reward,
                           rewards=rewards, tasks=tasks, eval_tasks=eval_tasks, chat=chat, system=system,
                           success_threshold=success_threshold, reward_timeout_s=reward_timeout_s,
                           reward_workers=reward_workers)

    def accepts(self, verdict: str) -> bool:
        """Whether a verifier's reply accepts: ``accept_word`` before ``reject_word`` (neither: rejects)."""
        text = verdict.casefold()
        accept, reject = text.find(self.accept_word), text.find(self.reject_word)
        return accept >= 0 and (reject < 0 or accept < reject)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Solve, then up to ``rounds`` of verify and (on rejection) revise; see the module docstring."""
        row = task.data
        attempt = (await ctx.generate(self.solver, self.prompt("solve", row))).text.strip()
        verdicts_right: list[bool] = []
        for _ in range(self.rounds):
            verdict = (await ctx.generate(self.verifier, self.prompt("verify", row, attempt=attempt))).text.strip()
            accepted = self.accepts(verdict)
            right = accepted == self.passes(await self.score("verifier", attempt, row))
            verdicts_right.append(right)
            self.reward_role(ctx, "verifier", self.verifier, 1.0 if right else 0.0, turn=-1)
            if accepted:
                break
            revised = await ctx.generate(self.solver, self.prompt("revise", row, attempt=attempt, feedback=verdict))
            attempt = revised.text.strip()
        solver_score = await self.score("solver", attempt, row)
        self.reward_role(ctx, "solver", self.solver, solver_score)
        team = solver_score if self.role_rewards["solver"] == self.reward_spec else await self.team_score(attempt, row)
        self.note_outcome(ctx, attempt, team, {"solver": [self.passes(solver_score)], "verifier": verdicts_right})
