"""Users' own reward functions (``module:function``) for the reward tests; imported by reward workers too."""

from __future__ import annotations

import time
from typing import Any


def length_ratio(response: str, reference: Any) -> float:
    """A partial-credit reward: the share of the reference's length the response reaches."""
    print("a reward that prints does not garble the worker's replies")
    return min(1.0, len(response) / max(1, len(str(reference))))


def contains(response: str, reference: Any) -> bool:
    """A bool reward: True counts 1."""
    return str(reference) in response


def hangs(response: str, reference: Any) -> float:
    """Never answers within any test's limit (as sympy on adversarial input may)."""
    time.sleep(600)
    return 1.0


def raises(response: str, reference: Any) -> float:
    raise ZeroDivisionError("the user's bug")


def not_a_number(response: str, reference: Any) -> Any:
    return "high"


def nan(response: str, reference: Any) -> float:
    return float("nan")


NOT_CALLABLE = 3


def raises_at_length(response: str, reference: Any) -> float:
    """An exception whose message is longer than a reply line may be."""
    raise ValueError("x" * 200_000)


def fails_on_marks(response: str, reference: Any) -> float:
    """Raises for a response that says RAISE, hangs for one that says HANG; else 1.0 when it holds the reference."""
    if "RAISE" in response:
        raise ArithmeticError(f"cannot score {response!r}")
    if "HANG" in response:
        time.sleep(600)
    return 1.0 if str(reference) in response else 0.0
