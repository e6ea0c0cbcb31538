"""Supervised warm-start data for examples/arithmetic, generated like the environment's tasks.

Each function is a ``warm_start.dataset`` entrypoint: called with the job's ``seed`` (keyword),
it returns an endless iterator of (prompt, response) pairs; traind takes
``warm_start.steps * warm_start.batch_size`` of them (traind/sft.py). The responses are text,
so each gets the agent's end-of-sequence token appended (the agent learns to stop).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from examples.arithmetic.env import NO, YES, digit_checks, question


def solver_examples(seed: int, min_operand: int = 10, max_operand: int = 99) -> Iterator[tuple[str, str]]:
    """``("a+b=", "sum")`` for random operands."""
    rng = random.Random(f"arithmetic-sft-solver/{seed}")
    while True:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        yield question(a, b), str(a + b)


def _near_miss(rng: random.Random, total: int) -> int:
    """A wrong answer like a warm-started solver's mistakes (never negative, never ``total``).

    Such a solver mostly writes the right tens and a wrong ones digit; so: 60% the ones digit
    replaced by another, 20% another digit replaced, 20% off by one or ten in a digit (a carry).
    """
    while True:
        digits = list(str(total))
        kind = rng.random()
        if kind < 0.8:
            position = len(digits) - 1 if kind < 0.6 or len(digits) == 1 else rng.randrange(len(digits) - 1)
            digits[position] = rng.choice([d for d in "0123456789" if d != digits[position]])
            wrong = int("".join(digits))
        else:
            wrong = total + rng.choice((-11, -10, -9, -1, 1, 9, 10, 11))
        if wrong >= 0 and wrong != total:
            return wrong


def verifier_examples(seed: int, min_operand: int = 10, max_operand: int = 99) -> Iterator[tuple[str, str]]:
    """``("a+b=c?", sum + checks + "y"/"n")``: the verifier's own sum, its per-digit checks, its judgement.

    Half the shown answers are right, half near misses (:func:`_near_miss`).
    """
    rng = random.Random(f"arithmetic-sft-verifier/{seed}")
    while True:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        right = rng.random() < 0.5
        shown = a + b if right else _near_miss(rng, a + b)
        yield f"{question(a, b)}{shown}?", f"{a + b}{digit_checks(shown, a + b)}{YES if right else NO}"
