"""Solver + verifier on generated two-digit addition, learnable by tiny byte-level models on CPU.

A ``solver`` answers ``"a+b="`` with the digits of the sum (then its end-of-sequence token);
a ``verifier`` sees the question and the solver's answer, ``"a+b=" + answer + "?"``, works it
out and judges: it writes its own sum, one check digit per digit of it (the shown digit minus
its own, mod 10, the shown answer right-aligned), then one judgement token, ``y`` (correct) or
``n`` (incorrect), then its end-of-sequence token (``"12+34=47?"`` -> ``"4601n"``). Rewards:

* solver: 1 when its answer is the sum, else ``digit_credit`` (default 0) times the share of
  the sum's digits it has right (right-aligned; an answer of another length is judged over
  the longer of the two), a shaped reward that tells "the ones digit is wrong" from "nothing
  is right" (:func:`digit_share`);
* verifier: ``correct_weight`` (default 1) for ``y`` on a correct answer, ``wrong_weight``
  (default 1) for ``n`` on a wrong one, else 0 (a response with no ``y``/``n`` after its
  digits is no judgement and earns 0). The two weights let a job reward the rarer class more,
  so that calling everything incorrect is not what a weak solver's answers make best. With
  ``grounded_judgement: true`` a judgement earns its reward only when it follows from the
  verifier's own written work (:func:`work_agrees`): its sum, the checks of the shown answer
  against that sum, then ``y`` exactly when the shown answer is that sum. A bare ``n`` (or ``y``)
  that its work contradicts earns 0, so "call everything incorrect" is no longer a one-token
  shortcut: on a wrong answer the reward goes to work that finds the difference.

Why the verifier writes its work: a tiny model does not learn to judge ``a+b=c`` from one bit
per example in a few CPU minutes (measured: chance after 600 steps, docs/examples.md); nor an
equality of its own digits with the shown ones (a pairwise interaction with no first-order
signal). Its sum and its check digits are ten-way targets at fixed offsets, learnt like the
solver's digits, and the judgement is then "are all checks 0", which one token can read.

A random-init model never writes a sum, so both agents start from a supervised warm start
(``agents[i].warm_start``) on data the same generator makes (:mod:`examples.arithmetic.data`),
stopped at a middling accuracy for multi-agent RL to take it from there
(benchmarks/arithmetic_learning.py; docs/examples.md "Solver + verifier").

Prompts are raw byte strings (no chat template): a tiny byte-level model reads the digits
directly. The verifier receives the solver's answer as the solver's token ids (special
tokens such as the end-of-sequence token dropped), not re-tokenized text.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexmarl import Environment, EpisodeContext, Task, task_rng

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


def digit_share(answer: int | None, target: int) -> float:
    """The share of ``target``'s digits ``answer`` has right, right-aligned, over the longer of the two (0 for None)."""
    if answer is None:
        return 0.0
    shown, wanted = str(answer), str(target)
    matches = sum(x == y for x, y in zip(reversed(shown), reversed(wanted), strict=False))
    return matches / max(len(shown), len(wanted))


def judgement(token_ids: Sequence[int]) -> bool | None:
    """A verifier's judgement: the token after its leading ASCII digits (its sum and checks): ``y`` True, ``n`` False.

    None when that token is anything else (a special token, another byte) or there is none.
    """
    after = len(written_digits(token_ids))
    if after >= len(token_ids):
        return None
    return {ord(YES): True, ord(NO): False}.get(token_ids[after])


def digit_checks(shown: int, total: int) -> str:
    """Per digit of ``total`` (right-aligned, ``shown`` padded with zeros): ``(shown digit - total digit) mod 10``.

    All zeros when ``shown`` ends like ``total`` (the judgement is then ``y`` exactly when the
    lengths agree too).
    """
    own = str(total)
    theirs = str(shown).rjust(len(own), "0")[-len(own):]
    return "".join(str((int(s) - int(o)) % 10) for s, o in zip(theirs, own, strict=True))


def written_digits(token_ids: Sequence[int]) -> str:
    """The leading ASCII digits of a response: a verifier's written work (its sum, then its checks)."""
    digits = ""
    for token in token_ids:
        if not ord("0") <= token <= ord("9"):
            break
        digits += chr(token)
    return digits


def work_agrees(token_ids: Sequence[int], shown: int | None) -> bool:
    """Whether a verifier's judgement follows from its written work, for the ``shown`` answer (None: no number).

    The work is the leading ASCII digits: ``2k`` of them, a ``k``-digit sum (no leading zero)
    then ``k`` check digits equal to :func:`digit_checks` of ``shown`` against that sum; the
    judgement (:func:`judgement`) must be ``y`` exactly when ``shown`` is that sum. A shown
    answer with no number has nothing to check: the judgement must be ``n``.
    """
    verdict = judgement(token_ids)
    if verdict is None:
        return False
    if shown is None:
        return verdict is False
    digits = written_digits(token_ids)
    half = len(digits) // 2
    if half == 0 or len(digits) % 2 or (digits[0] == "0" and half > 1):
        return False
    own, checks = int(digits[:half]), digits[half:]
    return checks == digit_checks(shown, own) and verdict == (shown == own)


class ArithmeticGame(Environment):
    """Two-digit addition between a ``solver`` and a ``verifier``.

    Config: ``min_operand`` / ``max_operand`` (default 10 / 99), ``answer_tokens`` (the solver's
    token budget, default 4: three digits and the end-of-sequence token), ``judge_tokens`` (the
    verifier's, default 8: three digits of its sum, three checks, the judgement, end-of-sequence),
    ``correct_weight`` / ``wrong_weight`` (the verifier's reward for a right judgement of a
    correct / a wrong answer, default 1 / 1), ``digit_credit`` (the solver's reward for a wrong
    answer per share of right digits, in [0, 1), default 0), ``grounded_judgement`` (reward a
    judgement only when the verifier's work agrees with it, default false). Rewards: see the module.
    """

    agents = ("solver", "verifier")

    def __init__(self, *, min_operand: int = 10, max_operand: int = 99, answer_tokens: int = 4, judge_tokens: int = 8,
                 correct_weight: float = 1.0, wrong_weight: float = 1.0, digit_credit: float = 0.0,
                 grounded_judgement: bool = False) -> None:
        super().__init__(min_operand=min_operand, max_operand=max_operand, answer_tokens=answer_tokens,
                         judge_tokens=judge_tokens, correct_weight=correct_weight, wrong_weight=wrong_weight,
                         digit_credit=digit_credit, grounded_judgement=grounded_judgement)
        self.min_operand = int(min_operand)
        self.max_operand = int(max_operand)
        self.answer_tokens = int(answer_tokens)
        self.judge_tokens = int(judge_tokens)
        self.correct_weight = float(correct_weight)
        self.wrong_weight = float(wrong_weight)
        self.digit_credit = float(digit_credit)
        if not isinstance(grounded_judgement, bool):
            raise ValueError("grounded_judgement must be true or false")
        self.grounded_judgement = grounded_judgement
        if not 0.0 <= self.digit_credit < 1.0:
            raise ValueError("digit_credit must be in [0, 1): a wrong answer earns less than a right one")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError("need 0 <= min_operand <= max_operand")
        if self.answer_tokens < 1 or self.judge_tokens < 1:
            raise ValueError("answer_tokens and judge_tokens must be >= 1")
        if self.correct_weight < 0 or self.wrong_weight < 0:
            raise ValueError("correct_weight and wrong_weight must be >= 0")

    def task(self, index: int, seed: int) -> Task:
        """Two operands drawn from the task's seeded stream."""
        rng = task_rng(index, seed)
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        return Task(index=index, seed=seed, data={"a": a, "b": b})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """One answer, one judgement; solver rewarded by correctness, verifier by being right (weighted)."""
        a: int = task.data["a"]
        b: int = task.data["b"]
        answer = await ctx.generate("solver", question(a, b), max_new_tokens=self.answer_tokens)
        value = parse_answer(answer.token_ids)
        correct = value == a + b
        shown = [t for t in answer.token_ids if t < BYTE_TOKENS]
        judge_prompt = ctx.tokenize("verifier", question(a, b)) + shown + ctx.tokenize("verifier", "?")
        judged = (await ctx.generate("verifier", judge_prompt, max_new_tokens=self.judge_tokens)).token_ids
        verdict = judgement(judged)
        ctx.reward("solver", 1.0 if correct else self.digit_credit * digit_share(value, a + b))
        right = verdict is not None and verdict == correct
        if self.grounded_judgement and not work_agrees(judged, value):
            right = False
        ctx.reward("verifier", (self.correct_weight if correct else self.wrong_weight) if right else 0.0)
