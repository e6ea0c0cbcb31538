"""Skewed three-agent workflow: planner -> solver (long responses) -> verifier.

Task: a small addition problem "a+b" (single digits by default). The planner writes a short
hint, the solver writes a long free-form answer whose last integer is its result, and the
verifier says whether the solver is right ("Y"/"N", one token). The solver's budget is 10x
the others' tokens: the case the hierarchical balancer exists for.

Rewards (verifiable, dense enough for tiny models):
* solver and planner: 1 - |result - answer| / 10, clipped to [0, 1] (0 with no integer);
* verifier: 1 if its verdict matches whether the solver's result is exactly right, else 0.
"""

from __future__ import annotations

import re

from flexmarl import Environment, EpisodeContext, Task, task_rng

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer in ``text``, or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def closeness(result: int | None, answer: int, scale: float = 10.0) -> float:
    """1 for the exact answer, falling linearly to 0 at ``scale`` away (0 without a result)."""
    if result is None:
        return 0.0
    return max(0.0, 1.0 - abs(result - answer) / scale)


class ArithmeticWorkflow(Environment):
    """Config: max_operand (default 9), planner_tokens (4), solver_tokens (40), verifier_tokens (1)."""

    agents = ("planner", "solver", "verifier")

    def __init__(self, *, max_operand: int = 9, planner_tokens: int = 4, solver_tokens: int = 40,
                 verifier_tokens: int = 1) -> None:
        super().__init__(max_operand=max_operand, planner_tokens=planner_tokens, solver_tokens=solver_tokens,
                         verifier_tokens=verifier_tokens)
        self.max_operand = int(max_operand)
        self.planner_tokens = int(planner_tokens)
        self.solver_tokens = int(solver_tokens)
        self.verifier_tokens = int(verifier_tokens)
        if self.max_operand < 1:
            raise ValueError("max_operand must be >= 1")

    def task(self, index: int, seed: int) -> Task:
        rng = task_rng(index, seed)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Task(index=index, seed=seed, data={"problem": f"{a}+{b}", "answer": a + b})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        problem: str = task.data["problem"]
        answer: int = task.data["answer"]
        plan = await ctx.generate(
            "planner",
            [{"role": "user", "content": f"Plan: {problem}"}],
            max_new_tokens=self.planner_tokens,
        )
        solution = await ctx.generate(
            "solver",
            [{"role": "user", "content": f"{problem}= hint:{plan.text}"}],
            max_new_tokens=self.solver_tokens,
        )
        result = last_integer(solution.text)
        verdict = await ctx.generate(
            "verifier",
            [{"role": "user", "content": f"{problem}={result if result is not None else '?'} ok?"}],
            max_new_tokens=self.verifier_tokens,
        )
        score = closeness(result, answer)
        ctx.reward("solver", score)
        ctx.reward("planner", score)
        says_correct = verdict.text.strip()[:1].upper() == "Y"
        ctx.reward("verifier", 1.0 if says_correct == (result == answer) else 0.0)
