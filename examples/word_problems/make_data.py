"""Generates the arithmetic word-problem dataset: train.jsonl and eval.jsonl beside this file.

    python -m examples.word_problems.make_data          # rewrites both files (deterministic)
    python -m examples.word_problems.make_data --check  # exit 1 if the files differ from what it makes

Each row is one short problem a tiny byte-level model can read (a question under ~60 bytes, a
one-digit answer), with what the ready-made workflows need besides:

* ``id``: ``wp-<split>-<n>``;
* ``question``: ``"Ana has 3 apples and gets 4 more. How many apples now?"``;
* ``answer``: the integer answer (7, always 0-9), what a solver must produce and a verifier check;
* ``expression``: the arithmetic behind it (``"3+4"``), for a verifier's or a debater's reasoning;
* ``operation``: ``add`` or ``sub``;
* ``choices``: four distinct integers, the answer among them; ``label``: its letter (``A``-``D``),
  for a multiple-choice reward;
* ``held_out`` (eval rows only): ``fact`` or ``wording``, see below.

The facts are every one-digit sum of two positive operands up to 9 (36) and every difference
``a - b`` with ``1 <= b <= a <= 9`` (45). Train has 400 rows over 73 of them, each fact at least
five times, in random wordings (template, name, item). The eval rows share structure with train
but are never in it, in two kinds, interleaved:

* ``fact`` (32 rows): the 8 held-out sums ``a + b`` with ``a > b`` (4 wordings each); train has
  none of them, but it has every commuted ``b + a``: the held-out success of these rows measures
  arithmetic the agents saw only the other way round;
* ``wording`` (68 rows): train's facts in questions that appear nowhere in train (a template,
  name and item combination train has not got for that fact).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRAIN_PATH = HERE / "train.jsonl"
EVAL_PATH = HERE / "eval.jsonl"
TRAIN_ROWS = 400
HELD_OUT_FACTS = 8
FACT_WORDINGS = 4
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
)

Fact = tuple[str, int, int]


def all_facts() -> list[Fact]:
    """Every fact: sums of two positive operands up to 9, differences a - b with 1 <= b <= a <= 9."""
    sums = [("add", a, b) for a in range(1, 10) for b in range(1, 10) if a + b <= 9]
    differences = [("sub", a, b) for a in range(1, 10) for b in range(1, a + 1)]
    return sums + differences


def _answer(operation: str, a: int, b: int) -> int:
    return a + b if operation == "add" else a - b


def _choices(answer: int, rng: random.Random) -> list[int]:
    """The answer and three distinct near misses (0-9), shuffled."""
    wrong: set[int] = set()
    while len(wrong) < 3:
        candidate = answer + rng.choice((-3, -2, -1, 1, 2, 3))
        if 0 <= candidate <= 9 and candidate != answer:
            wrong.add(candidate)
    choices = [answer, *sorted(wrong)]
    rng.shuffle(choices)
    return choices


def _question(fact: Fact, rng: random.Random) -> str:
    operation, a, b = fact
    template = rng.choice([text for op, text in TEMPLATES if op == operation])
    return template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)


def _row(split: str, number: int, fact: Fact, question: str, rng: random.Random) -> dict[str, Any]:
    operation, a, b = fact
    answer = _answer(operation, a, b)
    choices = _choices(answer, rng)
    return {
        "id": f"wp-{split}-{number}",
        "question": question,
        "answer": answer,
        "expression": f"{a}{'+' if operation == 'add' else '-'}{b}",
        "operation": operation,
        "choices": choices,
        "label": LABELS[choices.index(answer)],
    }


def _fresh_question(fact: Fact, taken: set[str], rng: random.Random) -> str:
    """A wording of ``fact`` not in ``taken`` (which it joins)."""
    while True:
        question = _question(fact, rng)
        if question not in taken:
            taken.add(question)
            return question


def make_rows(seed: int = SEED) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, eval rows), deterministic in ``seed``; the split is in the module docstring."""
    rng = random.Random(f"word-problems/{seed}")
    facts = all_facts()
    commutable = [f for f in facts if f[0] == "add" and f[1] > f[2]]
    held_out = sorted(rng.sample(commutable, HELD_OUT_FACTS))
    training = [f for f in facts if f not in held_out]
    # Every training fact about equally often: whole shuffled passes over them, the last one cut short.
    picks: list[Fact] = []
    while len(picks) < TRAIN_ROWS:
        shuffled = list(training)
        rng.shuffle(shuffled)
        picks.extend(shuffled)
    taken: set[str] = set()
    train = [_row("train", n, fact, _fresh_question(fact, taken, rng), rng)
             for n, fact in enumerate(picks[:TRAIN_ROWS])]
    kinds = [("fact", fact) for fact in held_out for _ in range(FACT_WORDINGS)]
    kinds += [("wording", rng.choice(training)) for _ in range(EVAL_ROWS - len(kinds))]
    rng.shuffle(kinds)
    eval_rows = []
    for n, (kind, fact) in enumerate(kinds):
        row = _row("eval", n, fact, _fresh_question(fact, taken, rng), rng)
        eval_rows.append({**row, "held_out": kind})
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
