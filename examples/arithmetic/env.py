"""Solver + verifier on generated two-digit addition, learnable by tiny byte-level models on CPU.

A ``solver`` answers ``"a+b="`` with the digits of the sum (then its end-of-sequence token);
a ``verifier`` sees the question and the solver's answer, ``"a+b=" + answer + "?"``, and
judges it with one token: ``y`` (correct) or ``n`` (incorrect). Rewards:

* solver: 1 when its answer is the sum, else 0;
* verifier: 1 when its judgement is right (``y`` on a correct answer, ``n`` on a wrong one),
  else 0 (any other token is no judgement and earns 0).

A random-init model never writes a sum, so both agents start from a supervised warm start
(``agents[i].warm_start``) on data the same generator makes (:mod:`examples.arithmetic.data`),
meant to stop at a middling accuracy for multi-agent RL to take it from there
(benchmarks/arithmetic_learning.py; docs/examples.md records that the job's settings do not get
there yet).

Prompts are raw byte strings (no chat template): a tiny byte-level model reads the digits
directly. The verifier receives the solver's answer as the solver's token ids (special
tokens such as the end-of-sequence token dropped), not re-tokenized text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rolloutd.episode import Environment, EpisodeContext, Task, task_rng

YES = "y"
NO = "n"
BYTE_TOKENS = 256  # the tiny tokenizer's ids 0..255 are bytes; specials follow


def question(a: int, b: int) -> str:
    """The solver's prompt for ``a + b``."""
    return f"{a}+{b}="


def parse_answer(token_ids: Sequence[int]) -> int | None:
    """The number an answer writes: its leading ASCII digit bytes (special tokens dropped), or None."""
    digits = ""
    for token in token_ids:
        if token >= BYTE_TOKENS:
            continue
        char = chr(token)
        if not "0" <= char <= "9":  # not str.isdigit: that takes bytes such as "¹" (0xB9) too
            break
        digits += char
    return int(digits) if digits else None


def judgement(token_ids: Sequence[int]) -> bool | None:
    """A verifier's judgement: True for ``y``, False for ``n``, None for anything else."""
    if not token_ids:
        return None
    first = token_ids[0]
    if first == ord(YES):
        return True
    if first == ord(NO):
        return False
    return None


class ArithmeticGame(Environment):
    """Two-digit addition between a ``solver`` and a ``verifier``.

    Config: ``min_operand`` / ``max_operand`` (default 10 / 99), ``answer_tokens`` (the solver's
    token budget, default 4: three digits and the end-of-sequence token). Rewards: see the module.
    """

    agents = ("solver", "verifier")

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.min_operand = int(config.get("min_operand", 10))
        self.max_operand = int(config.get("max_operand", 99))
        self.answer_tokens = int(config.get("answer_tokens", 4))
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError("need 0 <= min_operand <= max_operand")
        if self.answer_tokens < 1:
            raise ValueError("answer_tokens must be >= 1")

    def task(self, index: int, seed: int) -> Task:
        """Two operands drawn from the task's seeded stream."""
        rng = task_rng(index, seed)
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        return Task(index=index, seed=seed, data={"a": a, "b": b})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """One answer, one judgement; solver rewarded by correctness, verifier by being right."""
        a: int = task.data["a"]
        b: int = task.data["b"]
        answer = await ctx.generate("solver", question(a, b), max_new_tokens=self.answer_tokens)
        correct = parse_answer(answer.token_ids) == a + b
        shown = [t for t in answer.token_ids if t < BYTE_TOKENS]
        judge_prompt = ctx.tokenize("verifier", question(a, b)) + shown + ctx.tokenize("verifier", "?")
        verdict = judgement((await ctx.generate("verifier", judge_prompt, max_new_tokens=1)).token_ids)
        ctx.reward("solver", 1.0 if correct else 0.0)
        ctx.reward("verifier", 1.0 if verdict is not None and verdict == correct else 0.0)
