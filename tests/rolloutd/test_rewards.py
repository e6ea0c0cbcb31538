"""Verifiable rewards by name (flexmarl/rewards.py): each on its edge cases, and the worker pool's time limit."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import psutil
import pytest

from flexmarl.errors import InvalidArgument
from flexmarl.rewards import (
    RewardFailed,
    RewardRunner,
    answer_key,
    check_reward_name,
    exact_match,
    extract_choice,
    extract_number,
    multiple_choice,
    numeric_match,
)


@pytest.mark.parametrize(("response", "reference"), [
    ("1,000", 1000), ("1000.0", "1e3"), (" 1e3", "1,000"), ("$1,000", 1000.0), ("Answer: 1000.", "1000"),
    ("1/2", 0.5), ("0.1", 0.1), ("-3", "-3.0"), ("+7", 7), (".5", "1/2"), ("\\boxed{42} and then 7", 42),
    ("3 apples, then 5 more: the answer is 8 apples", 8), ("working: 12 ... #### 72", "#### 72"),
    ("the answer: 12; check 12 - 4 = 8", 12), ("1,000,000", "1e6"), ("I answered 5 at first; it is 7", 7),
])
def test_numeric_match_normalizes(response: str, reference: object) -> None:
    assert numeric_match(response, reference) == 1.0


@pytest.mark.parametrize(("response", "reference"), [
    ("999", 1000), ("1,0000", 10000), ("", 1), ("no number here", 0), ("1, 000", 1000), ("0.33", "1/3"),
    ("Answer: 7 (not 8)", 8), ("12", True),
])
def test_numeric_match_refuses(response: str, reference: object) -> None:
    if isinstance(reference, bool):
        with pytest.raises(ValueError, match="not a number"):
            numeric_match(response, reference)
        return
    assert numeric_match(response, reference) == 0.0


def test_numeric_match_edge_cases() -> None:
    assert extract_number("1, 000") == 0  # a list, not a thousands separator: the last number
    assert extract_number("x1000y") is None  # digits glued to a word are no number
    assert extract_number("7/0") is None  # no number, not an error
    with pytest.raises(ValueError, match="has no number"):
        numeric_match("1", "n/a")
    with pytest.raises(ValueError, match="finite"):
        numeric_match("1", float("inf"))
    assert extract_number("1" * 50 + "e-50") == Fraction(int("1" * 50), 10**50)


def test_exact_match_trims_and_collapses_whitespace_only() -> None:
    assert exact_match("  Paris \n", "Paris") == 1.0
    assert exact_match("New   York", "New York") == 1.0
    assert exact_match("paris", "Paris") == 0.0
    assert exact_match("42", 42) == 1.0
    assert exact_match("", "") == 1.0


@pytest.mark.parametrize(("response", "letter"), [
    ("(B)", "B"), ("Answer: b", "B"), ("b", "B"), (" C) ", "C"), ("The answer is (d).", "D"),
    ("I pick a letter: (A) looks wrong, (C) is right", "C"), ("Reasoning...\nD) 42\n", "D"),
    ("answer is E", "E"), ("Answer:c because", "C"), ("a bad day", None), ("", None),
    ("I answered b first, now (D)", "D"),
])
def test_multiple_choice_finds_the_letter(response: str, letter: str | None) -> None:
    assert extract_choice(response) == letter


def test_multiple_choice_scores_and_refuses_a_bad_reference() -> None:
    assert multiple_choice("Answer: b", "(B)") == 1.0
    assert multiple_choice("(A)", "B") == 0.0
    assert multiple_choice("nothing", "B") == 0.0
    with pytest.raises(ValueError, match="names no choice letter"):
        multiple_choice("(A)", "the first one")


def test_answer_keys_group_equal_answers() -> None:
    assert answer_key("numeric_match", "it is 1,000") == answer_key("numeric_match", "Answer: 1e3") == "1000"
    assert answer_key("multiple_choice", "(c)") == "C"
    assert answer_key("math_equiv", "so \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert answer_key("math_equiv", "work\nAnswer: x + 1") == "x + 1"
    assert answer_key("exact_match", " a  b ") == "a b"
    assert answer_key("numeric_match", "none") == ""


def test_reward_names_are_checked() -> None:
    for name in ("exact_match", "numeric_match", "multiple_choice", "math_equiv", "reward_functions:contains"):
        check_reward_name(name)
    with pytest.raises(InvalidArgument, match="unknown reward 'exact'.*exact_match, numeric_match"):
        check_reward_name("exact")
    with pytest.raises(InvalidArgument, match="cannot load reward function 'no_such_module:f'"):
        check_reward_name("no_such_module:f")
    with pytest.raises(InvalidArgument, match="cannot load reward function 'reward_functions:missing'"):
        check_reward_name("reward_functions:missing")
    with pytest.raises(InvalidArgument, match="not callable"):
        check_reward_name("reward_functions:NOT_CALLABLE")


MATH_EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"), ("$0.5$", "\\frac{1}{2}"), ("\\sqrt{4}", 2), ("\\boxed{\\frac{2}{4}}", "0.5"),
    ("The answer is $(x+1)^2$", "x^2+2x+1"), ("1/2", 0.5), ("$\\dfrac{3}{6}$", "\\frac{1}{2}"),
    ("\\boxed{2\\pi}", "2\\pi"), ("1,000", 1000),
]
MATH_DIFFERENT = [("3", 4), ("\\frac{1}{3}", "0.5"), ("x+1", "x-1"), ("no math at all", "2")]


async def test_the_runner_scores_math_and_user_functions_in_workers() -> None:
    runner = RewardRunner(timeout_s=60.0, workers=2, preload=("math_equiv",))  # a loaded CI machine is slow
    try:
        assert await runner.score("numeric_match", "1,000", 1000) == 1.0  # in process: no worker
        assert runner.worker_pids == ()
        same = await asyncio.gather(*(runner.score("math_equiv", r, g) for r, g in MATH_EQUIVALENT))
        assert same == [1.0] * len(MATH_EQUIVALENT)
        different = await asyncio.gather(*(runner.score("math_equiv", r, g) for r, g in MATH_DIFFERENT))
        assert different == [0.0] * len(MATH_DIFFERENT)
        assert len(runner.worker_pids) == 2
        assert await runner.score("reward_functions:length_ratio", "ab", "abcd") == 0.5  # it prints, too
        assert await runner.score("reward_functions:contains", "it is 42", 42) == 1.0
        with pytest.raises(RewardFailed, match="'reward_functions:raises' raised ZeroDivisionError: the user's bug"):
            await runner.score("reward_functions:raises", "x", 1)
        with pytest.raises(RewardFailed, match="returned 'high', not a number"):
            await runner.score("reward_functions:not_a_number", "x", 1)
        with pytest.raises(RewardFailed, match="raised ValueError: xxx") as long:
            await runner.score("reward_functions:raises_at_length", "x", 1)
        assert len(str(long.value)) <= 2000
        with pytest.raises(RewardFailed, match="returned nan"):
            await runner.score("reward_functions:nan", "x", 1)
        with pytest.raises(RewardFailed, match="does not parse"):
            await runner.score("math_equiv", "1", " ")
        pids = runner.worker_pids
    finally:
        await runner.aclose()
    assert not any(psutil.pid_exists(p) for p in pids)
    with pytest.raises(RewardFailed, match="closed"):
        await runner.score("math_equiv", "1", 1)


async def test_a_call_past_the_time_limit_kills_its_worker_and_the_pool_goes_on() -> None:
    runner = RewardRunner(timeout_s=0.5, workers=1)
    try:
        assert await runner.score("reward_functions:contains", "42", 42) == 1.0  # the worker is up
        (before,) = runner.worker_pids
        with pytest.raises(RewardFailed, match="'reward_functions:hangs' timed out after 0.5 s"):
            await runner.score("reward_functions:hangs", "x", 1)
        assert runner.worker_pids == () and not psutil.pid_exists(before)  # killed and reaped, not leaked
        assert await runner.score("reward_functions:contains", "7", 7) == 1.0  # a fresh worker
        (after,) = runner.worker_pids
        assert after != before
    finally:
        await runner.aclose()
    assert not psutil.pid_exists(after)


async def test_a_call_waiting_for_a_worker_goes_on_when_the_busy_one_is_killed_at_the_limit() -> None:
    runner = RewardRunner(timeout_s=0.5, workers=1)
    try:
        hung, waited = await asyncio.wait_for(asyncio.gather(
            runner.score("reward_functions:hangs", "x", 1), runner.score("reward_functions:contains", "7", 7),
            return_exceptions=True), 60)
        assert isinstance(hung, RewardFailed) and waited == 1.0
        assert len(runner.worker_pids) == 1  # the fresh worker, idle: never more than `workers`
    finally:
        await runner.aclose()


async def test_a_cancelled_call_kills_its_worker() -> None:
    """An episode cancelled while its reward runs (its group failed) leaves no worker busy with it."""
    runner = RewardRunner(timeout_s=30.0, workers=1)
    try:
        call = asyncio.create_task(runner.score("reward_functions:hangs", "x", 1))
        deadline = asyncio.get_running_loop().time() + 60
        while not runner.worker_pids:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        pid = runner.worker_pids[0]
        await asyncio.sleep(0.2)  # the request is on its way
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert runner.worker_pids == () and not psutil.pid_exists(pid)
        assert await runner.score("reward_functions:contains", "42", 42) == 1.0  # one worker again
    finally:
        await runner.aclose()


def test_numeric_match_reads_latex_fractions_and_nested_boxes() -> None:
    assert numeric_match("so \\boxed{\\frac{1}{2}}", 0.5) == 1.0
    assert numeric_match("\\dfrac{-3}{4}", "-0.75") == 1.0
    assert numeric_match("\\boxed{\\frac{1}{2}} is not 1", 1) == 0.0
