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
(it accepted an attempt that passes its reward's check, or rejected one that fails), times
``accept_weight`` for a right acceptance, else 0. While most attempts are wrong, rejecting
everything is right most of the time; ``accept_weight`` > 1 makes a right acceptance worth more,
so that judging beats rejecting everything.
"""

from __future__ import annotations

import pydantic
from pydantic import Field

from flexmarl.episode import EpisodeContext, Task
from flexmarl.workflows.base import PromptedConfig, Workflow

SOLVE = "Solve the problem. End with 'Answer: <answer>'.\n\n{question}"
VERIFY = ("Problem: {question}\n\nProposed solution: {attempt}\n\n"
          "Is it correct? Reply ACCEPT or REJECT, then give your reason.")
REVISE = ("Problem: {question}\n\nYour solution: {attempt}\n\nA reviewer replied: {feedback}\n\n"
          "Write a corrected solution. End with 'Answer: <answer>'.")


class SolverVerifierConfig(PromptedConfig):
    """`environment.config` of `flexmarl.workflows:SolverVerifier`: a solver answers, a verifier judges.

    The verifier accepts or rejects with a reason; the solver may revise. Roles `solver`, `verifier`;
    prompts `solve`, `verify` (`{attempt}`), `revise` (`{attempt}`, `{feedback}`).
    """

    PROMPTS = {
        "solve": (SOLVE, frozenset()),
        "verify": (VERIFY, frozenset({"attempt"})),
        "revise": (REVISE, frozenset({"attempt", "feedback"})),
    }

    solver: str = Field("solver", min_length=1)
    """The solver's agent name."""
    verifier: str = Field("verifier", min_length=1)
    """The verifier's agent name."""
    rounds: int = Field(1, ge=1)
    """Verifier turns at most; the solver revises after each rejection."""
    accept_word: str = Field("ACCEPT", min_length=1)
    """A verifier's reply accepts when this word comes in it before `reject_word` (case-insensitive)."""
    reject_word: str = Field("REJECT", min_length=1)
    """A verifier's reply with neither word rejects."""
    accept_weight: float = Field(1.0, gt=0)
    """A right acceptance earns the verifier this times its weight (a right rejection: its weight); above 1 it
    offsets the pull to reject everything while most attempts are wrong."""

    def roles(self) -> dict[str, tuple[str, ...]]:
        """``solver`` and ``verifier``."""
        return {"solver": (self.solver,), "verifier": (self.verifier,)}

    @pydantic.model_validator(mode="after")
    def _distinct(self) -> SolverVerifierConfig:
        if self.solver == self.verifier:
            raise ValueError(f"solver and verifier must be different agents, both are {self.solver!r}")
        if self.accept_word.casefold() == self.reject_word.casefold():
            raise ValueError("accept_word and reject_word must differ")
        return self


class SolverVerifier(Workflow):
    """A solver and a verifier over task rows; config: :class:`SolverVerifierConfig` (docs/workflows.md)."""

    Config = SolverVerifierConfig
    settings: SolverVerifierConfig

    def accepts(self, verdict: str) -> bool:
        """Whether a verifier's reply accepts: ``accept_word`` before ``reject_word`` (neither: rejects)."""
        text = verdict.casefold()
        accept = text.find(self.settings.accept_word.casefold())
        reject = text.find(self.settings.reject_word.casefold())
        return accept >= 0 and (reject < 0 or accept < reject)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Solve, then up to ``rounds`` of verify and (on rejection) revise; see the module docstring."""
        row, solver, verifier = task.data, self.settings.solver, self.settings.verifier
        attempt = (await ctx.generate(solver, self.prompt("solve", row))).text.strip()
        verdicts_right: list[bool] = []
        for _ in range(self.settings.rounds):
            verdict = (await ctx.generate(verifier, self.prompt("verify", row, attempt=attempt))).text.strip()
            accepted = self.accepts(verdict)
            right = accepted == self.passes(await self.score("verifier", attempt, row))
            verdicts_right.append(right)
            earned = (self.settings.accept_weight if accepted else 1.0) if right else 0.0
            self.reward_role(ctx, "verifier", verifier, earned, turn=-1)
            if accepted:
                break
            revised = await ctx.generate(solver, self.prompt("revise", row, attempt=attempt, feedback=verdict))
            attempt = revised.text.strip()
        solver_score = await self.score("solver", attempt, row)
        self.reward_role(ctx, "solver", solver, solver_score)
        team = solver_score if self.role_rewards["solver"] == self.reward_spec else await self.team_score(attempt, row)
        self.note_outcome(ctx, attempt, team, {"solver": [self.passes(solver_score)], "verifier": verdicts_right})
