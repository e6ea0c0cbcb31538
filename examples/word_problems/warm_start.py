"""Supervised warm-start data for the word-problem workflows: prompts of train.jsonl's rows and their answers.

``agents[i].warm_start.dataset: "examples.word_problems.warm_start:answer_examples"``: traind calls it
with the job's ``seed`` and ``warm_start.config``: ``prompt``, the agent's first prompt, and for an
agent that answers again (a solver revising, a debater in round 2) ``followup_prompt``, its second
prompt: the workflow's own templates, so the warm start teaches the very prompts the workflow
sends. It yields endless epochs over the training rows, each in its own seeded order; the
response is the answer's digits (traind appends the end-of-sequence token). Only
``train.jsonl``: the held-out rows are never trained on.

With ``followup_prompt`` every other example is a second answer: its variables show earlier
answers, each the answer or a near miss (``{attempt}`` / ``{previous}``: the agent's own;
``{feedback}``: a reviewer's ``y`` or ``n``; ``{others}``: one ``[name] answer`` paragraph per
name in ``others``, as the debate workflow writes them), and the response is still the answer:
the agent learns to keep a right answer whatever it reads, not to copy.

``verdict_examples`` is a verifier's: ``prompt`` (the workflow's ``verify`` prompt) over a row with
``{attempt}`` the answer or a near miss, half each, and the response ``accept`` or ``reject``:
a verifier that starts out judging, and says each word about as often.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

TRAIN = Path(__file__).resolve().parent / "train.jsonl"


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TRAIN.read_text().splitlines() if line.strip()]


def _epochs(rows: Sequence[dict[str, Any]], rng: random.Random) -> Iterator[dict[str, Any]]:
    """Endless epochs over ``rows``, each in its own order drawn from ``rng`` when the epoch starts."""
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for number in order:
            yield rows[number]


def _shown(rng: random.Random, answer: int) -> int:
    """The answer or, half the time, a near miss (never negative)."""
    return answer if rng.random() < 0.5 else max(0, answer + rng.choice((-2, -1, 1, 2)))


def answer_examples(seed: int, prompt: str = "{question} Answer:", followup_prompt: str | None = None,
                    others: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """``(prompt.format(**row), str(row["answer"]))`` over train.jsonl (with second answers: see the module)."""
    rng = random.Random(f"word-problems-warm-start/{seed}")
    for row in _epochs(_rows(), rng):
        answer = int(row["answer"])
        yield prompt.format(**row), str(answer)
        if followup_prompt is not None:
            attempt = _shown(rng, answer)
            feedback = "y" if attempt == answer and rng.random() < 0.5 else "n"
            shown = "\n\n".join(f"[{name}] {_shown(rng, answer)}" for name in others)
            yield followup_prompt.format(**row, attempt=attempt, previous=attempt, feedback=feedback,
                                         others=shown), str(answer)


def _near_miss(rng: random.Random, answer: int) -> int:
    """A wrong one-digit answer one to three away from ``answer``."""
    return rng.choice([n for n in range(10) if 0 < abs(n - answer) <= 3])


def verdict_examples(seed: int, prompt: str = "{question} Answer: {attempt} Right?", accept: str = "y",
                     reject: str = "n") -> Iterator[tuple[str, str]]:
    """``(prompt.format(**row, attempt=shown), accept or reject)`` over train.jsonl rows.

    Half the shown answers are right, half near misses (one to three away).
    """
    rng = random.Random(f"word-problems-verdicts/{seed}")
    for row in _epochs(_rows(), rng):
        answer = int(str(row["answer"]))
        right = rng.random() < 0.5
        shown = answer if right else _near_miss(rng, answer)
        yield prompt.format(**row, attempt=shown), accept if right else reject


def judge_examples(seed: int, prompt: str = "{question} Answers: {answers} Answer:",
                   debaters: Sequence[str] = ("debater_0", "debater_1")) -> Iterator[tuple[str, str]]:
    """A debate judge's: ``prompt`` over a row with ``{answers}`` the debaters' (the answer or a near miss each).

    The response is the row's answer, also when no debater gave it: the judge learns to answer,
    using the debaters' answers where they help, not to copy one of them.
    """
    rng = random.Random(f"word-problems-judge/{seed}")
    for row in _epochs(_rows(), rng):
        answer = int(row["answer"])
        answers = "\n\n".join(f"[{name}] {_shown(rng, answer)}" for name in debaters)
        yield prompt.format(**row, answers=answers), str(answer)
