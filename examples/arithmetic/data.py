"""Supervised warm-start data for examples/arithmetic, generated like the environment's tasks.

Each function is a ``warm_start.dataset`` entrypoint: called with the job's ``seed`` (keyword),
it returns an endless iterator of (prompt, response) pairs; traind takes
``warm_start.steps * warm_start.batch_size`` of them (traind/sft.py). A text response gets the
agent's end-of-sequence token appended (the solver learns to stop); a token-id response is
taken as it is (the verifier's one judgement token, as it generates it).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from examples.arithmetic.env import NO, YES, question


def solver_examples(seed: int, min_operand: int = 10, max_operand: int = 99) -> Iterator[tuple[str, str]]:
    """``("a+b=", "sum")`` for random operands."""
    rng = random.Random(f"arithmetic-sft-solver/{seed}")
    while True:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        yield question(a, b), str(a + b)


def _near_miss(rng: random.Random, total: int) -> int:
    """A wrong answer like a solver's mistakes: off by one or ten in a digit (never negative)."""
    while True:
        wrong = total + rng.choice((-11, -10, -9, -1, 1, 9, 10, 11))
        if wrong >= 0:
            return wrong


def verifier_examples(seed: int, min_operand: int = 10, max_operand: int = 99) -> Iterator[tuple[str, list[int]]]:
    """``("a+b=c?", [y or n])``: half the answers right, half near misses."""
    rng = random.Random(f"arithmetic-sft-verifier/{seed}")
    while True:
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        right = rng.random() < 0.5
        shown = a + b if right else _near_miss(rng, a + b)
        yield f"{question(a, b)}{shown}?", [ord(YES if right else NO)]
