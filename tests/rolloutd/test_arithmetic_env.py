"""examples/arithmetic: the verifier's worked judgement (sum, check digits, y/n), its class-weighted reward,
and warm-start data whose checks and judgements agree with the sums."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from byte_tokenizers import ContentBytes

from examples.arithmetic.data import digit_checks, solver_examples, verifier_examples
from examples.arithmetic.env import ArithmeticGame, digit_share, judgement, parse_answer, work_agrees
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutRunner, RolloutTaskInput

EOS = 257


class Scripted:
    """The solver writes the sum in even episodes and the sum + 1 in odd ones; the verifier always says ``y``."""

    def __init__(self) -> None:
        self.calls = 0
        self.verifier_prompts: list[str] = []
        self.budgets: dict[str, int] = {}

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        self.budgets[agent] = int(sampling["max_new_tokens"])
        text = bytes(input_ids).decode()
        if agent == "solver":
            a, b = (int(x) for x in text.rstrip("=").split("+"))
            self.calls += 1
            answer = [*str(a + b + (0 if self.calls % 2 else 1)).encode(), EOS]
            return [GenerationOutput(tuple(answer), (-1.0,) * len(answer), "stop", len(input_ids))]
        self.verifier_prompts.append(text)
        return [GenerationOutput((*b"4600y", EOS), (-1.0,) * 6, "stop", len(input_ids))]


async def test_the_verifier_sees_the_answer_and_earns_its_class_weight() -> None:
    env = ArithmeticGame(min_operand=10, max_operand=39, judge_tokens=6, correct_weight=3.0, wrong_weight=0.5)
    backend = Scripted()
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 4}) for a in env.agents}
    result = await RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/0", 0, 0, 4))
    assert result.ok
    rewards = {(r.agent, r.sample_index): r.reward for r in result.experiences}
    a, b = env.task(0, 0).data["a"], env.task(0, 0).data["b"]
    right = sorted(backend.verifier_prompts).count(f"{a}+{b}={a + b}?")
    assert right == 2 and len(backend.verifier_prompts) == 4  # the EOS is not shown to the verifier
    solver = [rewards[("solver", e)] for e in range(4)]
    verifier = [rewards[("verifier", e)] for e in range(4)]
    assert sorted(solver) == [0.0, 0.0, 1.0, 1.0]
    # "y" is right on a correct answer (weight 3) and wrong on a wrong one (0, never the 0.5 of a right "n").
    assert verifier == [3.0 if s == 1.0 else 0.0 for s in solver]
    assert backend.budgets == {"solver": 4, "verifier": 6}


async def test_digit_credit_rewards_a_wrong_answer_by_its_right_digits() -> None:
    """The scripted solver's odd episodes answer sum + 1; with digit_credit 0.5 those earn 0.5 x their right digits."""
    env = ArithmeticGame(min_operand=10, max_operand=39, judge_tokens=6, digit_credit=0.5)
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 4}) for a in env.agents}
    result = await RolloutRunner(env, runtimes, Scripted(), clock_ms=lambda: 0, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/0", 0, 0, 4))
    a, b = env.task(0, 0).data["a"], env.task(0, 0).data["b"]
    wrong = 0.5 * digit_share(a + b + 1, a + b)
    assert 0.0 < wrong < 1.0
    assert sorted(r.reward for r in result.experiences if r.agent == "solver") == [wrong, wrong, 1.0, 1.0]
    assert digit_share(47, 46) == 0.5 and digit_share(56, 46) == 0.5 and digit_share(46, 46) == 1.0
    assert digit_share(146, 46) == 2 / 3 and digit_share(6, 46) == 0.5 and digit_share(None, 46) == 0.0
    assert digit_share(64, 46) == 0.0  # right digits in the wrong places earn nothing
    for credit in (-0.1, 1.0):
        with pytest.raises(ValueError, match="digit_credit"):
            ArithmeticGame(digit_credit=credit)


async def test_a_grounded_judgement_earns_only_what_its_work_supports() -> None:
    """The scripted verifier writes "4600y" on every answer: with grounded_judgement only 46 + its y can earn."""
    env = ArithmeticGame(min_operand=10, max_operand=39, judge_tokens=6, grounded_judgement=True)
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 4}) for a in env.agents}
    result = await RolloutRunner(env, runtimes, Scripted(), clock_ms=lambda: 0, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/0", 0, 0, 4))
    a, b = env.task(0, 0).data["a"], env.task(0, 0).data["b"]
    verifier = [r.reward for r in result.experiences if r.agent == "verifier"]
    # "4600y" is the work of a verifier whose sum is 46: it agrees with the judgement only for a shown 46.
    assert verifier == [1.0 if a + b == 46 else 0.0, 0.0] * 2
    with pytest.raises(ValueError, match="grounded_judgement"):
        ArithmeticGame(grounded_judgement="yes")


def test_work_agrees_reads_the_sum_the_checks_and_the_judgement() -> None:
    assert work_agrees(list(b"4600y"), 46)
    assert work_agrees([*b"4601n", EOS], 47)
    assert work_agrees(list(b"4501n"), 46)  # a wrong sum, consistently checked: the work agrees (the reward may not)
    assert not work_agrees(list(b"4600n"), 46)  # the checks say equal, the judgement not
    assert not work_agrees(list(b"4601y"), 47)
    assert not work_agrees(list(b"4600n"), 47)  # wrong checks for the shown 47
    assert not work_agrees(list(b"n"), 47)  # a bare judgement has no work
    assert not work_agrees(list(b"460n"), 47)  # an odd number of digits is no sum + checks
    assert not work_agrees(list(b"0647n"), 47)  # a sum with a leading zero
    assert not work_agrees(list(b"4600"), 46)  # no judgement
    assert work_agrees(list(b"4600n"), 146)  # an extra leading digit: checks 00 and n
    assert work_agrees(list(b"n"), None) and not work_agrees(list(b"4600y"), None)  # nothing shown: n


def test_judgement_is_the_token_after_the_digits() -> None:
    assert judgement(list(b"4600y")) is True
    assert judgement(list(b"4601n")) is False
    assert judgement(list(b"y")) is True  # no work shown is still a judgement
    assert judgement([*b"46", EOS]) is None  # stopped before judging
    assert judgement(list(b"46x")) is None
    assert judgement([]) is None
    assert parse_answer([*b"46", EOS]) == 46


def test_digit_checks_are_zero_exactly_on_the_sum_s_digits() -> None:
    assert digit_checks(46, 46) == "00"
    assert digit_checks(47, 46) == "01"
    assert digit_checks(37, 46) == "91"
    assert digit_checks(9, 20) == "89"  # the shown answer right-aligned, padded with zeros
    assert digit_checks(146, 46) == "00"  # an extra leading digit is not checked: the judgement says n


def test_warm_start_data_agrees_with_the_sums() -> None:
    for prompt, response in itertools.islice(solver_examples(seed=3, min_operand=10, max_operand=39), 200):
        a, b = (int(x) for x in prompt.rstrip("=").split("+"))
        assert 10 <= a <= 39 and 10 <= b <= 39 and response == str(a + b)
    judged = []
    for prompt, response in itertools.islice(verifier_examples(seed=3, min_operand=10, max_operand=39), 400):
        question, shown = prompt.rstrip("?").split("=")
        total = sum(int(x) for x in question.split("+"))
        checks = digit_checks(int(shown), total)
        assert response == f"{total}{checks}{'y' if int(shown) == total else 'n'}"
        judged.append(response[-1] == "y")
    assert 0.4 < sum(judged) / len(judged) < 0.6  # balanced classes


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="judge_tokens"):
        ArithmeticGame(judge_tokens=0)
    with pytest.raises(ValueError, match="weight"):
        ArithmeticGame(correct_weight=-1)
