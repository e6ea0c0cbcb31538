"""Fixtures of the reliability tests: a tally of fuzzed RPC answers, printed after the run."""

from __future__ import annotations

import collections
from typing import Any

import pytest

#: (service, rpc) -> status code name -> number of requests answered with it.
CASE_COUNTS: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)


@pytest.fixture
def case_counts() -> dict[tuple[str, str], collections.Counter[str]]:
    """The shared tally the fuzz tests add to."""
    return CASE_COUNTS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Prints how many cases each RPC received and how it answered them."""
    if not CASE_COUNTS:
        return
    codes = sorted({code for counter in CASE_COUNTS.values() for code in counter})
    short = {code: code.replace("INVALID_ARGUMENT", "INVALID").replace("FAILED_PRECONDITION", "FAILED_PRE")
             .replace("RESOURCE_EXHAUSTED", "RES_EXH").replace("DEADLINE_EXCEEDED", "OPEN_STREAM")
             for code in codes}
    width = max(len(f"{s}/{r}") for s, r in CASE_COUNTS) + 2
    terminalreporter.section("bad-input cases per RPC")
    header = f"{'rpc':<{width}}{'cases':>7}" + "".join(f"{short[c]:>16}" for c in codes)
    terminalreporter.write_line(header)
    total = 0
    for (service, rpc), counter in sorted(CASE_COUNTS.items()):
        cases = sum(counter.values())
        total += cases
        terminalreporter.write_line(
            f"{service + '/' + rpc:<{width}}{cases:>7}" + "".join(f"{counter.get(c, 0):>16}" for c in codes)
        )
    terminalreporter.write_line(f"{'total':<{width}}{total:>7}")
