"""Generates the arithmetic word-problem dataset: train.jsonl and eval.jsonl beside this file.

    python -m examples.word_problems.make_data          # rewrites both files (deterministic)
    python -m examples.word_problems.make_data --check  # exit 1 if the files differ from what it makes

Each row is one short problem a tiny byte-level model can read (a question under ~60 bytes, a
small non-negative integer answer), with what the ready-made workflows need besides:

* ``id``: ``wp-<split>-<n>``;
* ``question``: ``"Ana has 3 apples and gets 4 more. How many apples now?"``;
* ``answer``: the integer answer (7), what a solver must produce and a verifier check;
* ``expression``: the arithmetic behind it (``"3+4"``), for a verifier's or a debater's reasoning;
* ``operation``: ``add``, ``sub``, ``mul`` or ``div``;
* ``choices``: four distinct integers, the answer among them; ``label``: its letter (``A``-``D``),
  for a multiple-choice reward.

The split is by arithmetic fact: no (operation, a, b) of an eval problem appears in train, so the
held-out accuracy measures arithmetic the agents never trained on, not memorised wordings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN_PATH = HERE / "train.jsonl"
EVAL_PATH = HERE / "eval.jsonl"
TRAIN_ROWS = 400
EVAL_ROWS = 100
SEED = 2026
LABELS = "ABCD"

NAMES = ("Ana", "Ben", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy")
ITEMS = ("apples", "cards", "coins", "pens", "eggs", "books")

# (operation, template): {n} a name, {i} an item, {a} and {b} the operands.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("add", "{n} has {a} {i} and gets {b} more. How many {i} now?"),
    ("add", "{n} buys {a} {i}, then {b} {i}. How many in all?"),
    ("sub", "{n} has {a} {i} and gives away {b}. How many are left?"),
    ("sub", "{n} had {a} {i} and lost {b}. How many now?"),
    ("mul", "{n} has {a} bags of {b} {i}. How many {i}?"),
    ("div", "{n} shares {a} {i} among {b} friends. How many each?"),
)


def _operands(operation: str, rng: random.Random) -> tuple[int, int]:
    if operation == "add":
        return rng.randint(1, 20), rng.randint(1, 20)
    if operation == "sub":
        a = rng.randint(2, 30)
        return a, rng.randint(1, a)
    if operation == "mul":
        return rng.randint(2, 9), rng.randint(2, 9)
    b = rng.randint(2, 9)  # div: exact, so the answer is an integer
    return b * rng.randint(1, 9), b


def _answer(operation: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b, "div": a // b}[operation]


def _choices(answer: int, rng: random.Random) -> list[int]:
    """The answer and three distinct near misses (non-negative), shuffled."""
    wrong: set[int] = set()
    while len(wrong) < 3:
        candidate = answer + rng.choice((-10, -2, -1, 1, 2, 10))
        if candidate >= 0 and candidate != answer:
            wrong.add(candidate)
    choices = [answer, *sorted(wrong)]
    rng.shuffle(choices)
    return choices


def _facts(rng: random.Random) -> Iterator[tuple[str, int, int]]:
    """Distinct (operation, a, b) arithmetic facts, operations in turn."""
    seen: set[tuple[str, int, int]] = set()
    operations = ("add", "sub", "mul", "div")
    turn = 0
    while True:
        operation = operations[turn % len(operations)]
        turn += 1
        a, b = _operands(operation, rng)
        if (operation, a, b) not in seen:
            seen.add((operation, a, b))
            yield operation, a, b


def _row(split: str, number: int, fact: tuple[str, int, int], rng: random.Random) -> dict[str, Any]:
    operation, a, b = fact
    template = rng.choice([text for op, text in TEMPLATES if op == operation])
    answer = _answer(operation, a, b)
    choices = _choices(answer, rng)
    symbol = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[operation]
    return {
        "id": f"wp-{split}-{number}",
        "question": template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b),
        "answer": answer,
        "expression": f"{a}{symbol}{b}",
        "operation": operation,
        "choices": choices,
        "label": LABELS[choices.index(answer)],
    }


def make_rows(seed: int = SEED) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, eval rows): disjoint arithmetic facts, deterministic in ``seed``."""
    rng = random.Random(f"word-problems/{seed}")
    facts = _facts(rng)
    held_out = [next(facts) for _ in range(EVAL_ROWS)]
    training = [next(facts) for _ in range(TRAIN_ROWS)]
    train = [_row("train", n, fact, rng) for n, fact in enumerate(training)]
    eval_rows = [_row("eval", n, fact, rng) for n, fact in enumerate(held_out)]
    return train, eval_rows


def jsonl(rows: list[dict[str, Any]]) -> str:
    """Rows as JSON Lines (one compact object a line)."""
    return "".join(json.dumps(row, separators=(", ", ": ")) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare the checked-in files with a fresh run")
    args = parser.parse_args(argv)
    train, eval_rows = make_rows()
    outputs = {TRAIN_PATH: jsonl(train), EVAL_PATH: jsonl(eval_rows)}
    if args.check:
        stale = [str(path) for path, text in outputs.items() if not path.is_file() or path.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python -m examples.word_problems.make_data", file=sys.stderr)
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path} ({text.count(chr(10))} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
