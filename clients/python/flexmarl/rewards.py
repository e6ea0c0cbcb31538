r"""Verifiable rewards by name: a response's text scored against a reference (a dataset row's field).

Built in:

* ``exact_match``: the response equals the reference, whitespace trimmed and collapsed (case kept).
* ``numeric_match``: the number the response gives equals the reference's, exactly as rationals
  after normalization (``"1,000"``, ``"1000.0"``, ``" 1e3"``, ``"$1,000"`` are all 1000; ``"1/2"``
  is 0.5). The number a response gives: the first after its last ``answer`` marker (``"Answer:
  42"``, ``"the answer is 42"``, GSM8K's ``"#### 42"``), else the one in its last ``\boxed{}``,
  else its last number; ``\frac{a}{b}`` of integers reads as ``a/b``.
* ``multiple_choice``: the choice letter the response picks (``"(B)"``, ``"Answer: b"``, a bare
  ``"B"``, a line ``"B) ..."``) is the reference's letter (case-insensitive).
* ``math_equiv``: LaTeX-aware mathematical equivalence with Hugging Face's ``math-verify``
  (``\frac{1}{2}`` and ``0.5``, ``\sqrt{4}`` and ``2``, ``(x+1)^2`` and ``x^2+2x+1``).

and a user's own ``module:function``, called as ``function(response, reference)`` and returning a
number (a bool counts as 1 or 0).

Every score is a finite float. The three string rewards run in the episode's process: each is a
few linear-time regular expressions over the text, so it cannot hang. ``math_equiv`` and user
functions can (sympy on adversarial input, user code), so they run in worker processes
(:mod:`flexmarl.reward_worker`, a pool per :class:`RewardRunner`) under a time limit: a call past
it kills its worker (a fresh one replaces it) and raises :class:`RewardFailed`, as does a
function that raises. Raised in an episode it fails that episode with the reason recorded
(rolloutd/runner.py), never the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from flexmarl.entrypoints import load_entrypoint
from flexmarl.errors import InvalidArgument

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFailed",
    "RewardRunner",
    "answer_key",
    "check_reward_name",
    "exact_match",
    "extract_choice",
    "extract_number",
    "math_equiv",
    "multiple_choice",
    "numeric_match",
]

ScoreFunction = Callable[[str, Any], float]

ISOLATED_BUILTINS = frozenset({"math_equiv"})
"""Built-in rewards that run in a worker process under the time limit."""


class RewardFailed(Exception):
    """A reward call raised, timed out or returned no finite number; fails its episode."""


# --- exact_match ------------------------------------------------------------------------------

def _squash(text: str) -> str:
    return " ".join(text.split())


def exact_match(response: str, reference: Any) -> float:
    """1.0 when ``response`` is ``reference`` (as text), whitespace trimmed and collapsed; else 0.0."""
    return 1.0 if _squash(response) == _squash(str(reference)) else 0.0


# --- numeric_match ----------------------------------------------------------------------------

_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?"
)
_ANSWER_MARKER = re.compile(r"(?:\banswer\b\s*(?:is|:|=)?|####)", re.IGNORECASE)
_BOXED = "\\boxed{"
_FRACTION = re.compile(r"\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for position in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position]
    return None


def _as_fraction(token: str) -> Fraction | None:
    numerator, slash, denominator = token.replace(",", "").replace(" ", "").partition("/")
    try:
        value = Fraction(Decimal(numerator))
        if slash:
            value /= Fraction(int(denominator))
    except (InvalidOperation, ValueError, ZeroDivisionError, OverflowError):
        return None
    return value


def _first_number(text: str) -> Fraction | None:
    for match in _NUMBER.finditer(text.replace("$", " ")):
        value = _as_fraction(match.group())
        if value is not None:
            return value
    return None


def extract_number(text: str) -> Fraction | None:
    """The number ``text`` gives as its answer, exactly (see the module docstring); None if none."""
    if len(text) > 100_000:  # a bound on the work: answers are short
        text = text[-100_000:]
    text = _FRACTION.sub(r"\1/\2", text)
    markers = list(_ANSWER_MARKER.finditer(text))
    if markers:
        value = _first_number(text[markers[-1].end():])
        if value is not None:
            return value
    boxed = last_boxed(text)
    if boxed is not None:
        value = _first_number(boxed)
        if value is not None:
            return value
    values = [_as_fraction(m.group()) for m in _NUMBER.finditer(text.replace("$", " "))]
    found = [v for v in values if v is not None]
    return found[-1] if found else None


def _reference_number(reference: Any) -> Fraction:
    if isinstance(reference, bool):
        raise ValueError(f"reference {reference!r} is not a number")
    if isinstance(reference, int):
        return Fraction(reference)
    if isinstance(reference, float):
        if not math.isfinite(reference):
            raise ValueError(f"reference {reference!r} is not a finite number")
        return Fraction(Decimal(repr(reference)))  # 0.1 is 1/10, as written, not the nearest double
    value = extract_number(str(reference))
    if value is None:
        raise ValueError(f"reference {str(reference)[:80]!r} has no number")
    return value


def numeric_match(response: str, reference: Any) -> float:
    """1.0 when the number ``response`` gives equals ``reference``'s; else 0.0.

    Raises:
        ValueError: the reference has no number (a bad dataset row, not a wrong answer).
    """
    wanted = _reference_number(reference)
    given = extract_number(response)
    return 1.0 if given is not None and given == wanted else 0.0


# --- multiple_choice --------------------------------------------------------------------------

_CHOICE_AFTER_MARKER = re.compile(r"\banswer\b\s*(?:is|:|=)?\s*[:\-]?\s*\(?([A-Za-z])\)?(?![A-Za-z])", re.IGNORECASE)
_CHOICE_PARENTHESIZED = re.compile(r"\(([A-Za-z])\)")
_CHOICE_ALONE = re.compile(r"\s*\(?([A-Za-z])[).:]?\s*")
_CHOICE_LINE = re.compile(r"^\s*([A-Z])[).:](?:\s|$)", re.MULTILINE)


def extract_choice(text: str) -> str | None:
    """The choice letter ``text`` picks, upper case; None if none.

    In order: the letter after its last ``answer`` marker (``"Answer: b"``, ``"the answer is
    (C)"``), its last parenthesized letter (``"(B)"``), the text being one letter (``"b"``,
    ``"B)"``), its last line starting with a capital and ``)``, ``.`` or ``:`` (``"D) 42"``).
    """
    for pattern in (_CHOICE_AFTER_MARKER, _CHOICE_PARENTHESIZED):
        found = pattern.findall(text)
        if found:
            return str(found[-1]).upper()
    alone = _CHOICE_ALONE.fullmatch(text)
    if alone:
        return alone.group(1).upper()
    lines = _CHOICE_LINE.findall(text)
    return str(lines[-1]).upper() if lines else None


def multiple_choice(response: str, reference: Any) -> float:
    """1.0 when ``response`` picks ``reference``'s choice letter; else 0.0.

    Raises:
        ValueError: the reference names no choice letter.
    """
    wanted = extract_choice(str(reference))
    if wanted is None:
        raise ValueError(f"reference {str(reference)[:80]!r} names no choice letter")
    return 1.0 if extract_choice(response) == wanted else 0.0


# --- math_equiv -------------------------------------------------------------------------------

def math_equiv(response: str, reference: Any) -> float:
    r"""1.0 when ``math-verify`` finds the response's answer equivalent to ``reference``; else 0.0.

    A reference without ``$`` is read as one LaTeX formula, and so is a response in which
    ``math-verify`` finds no answer (``\sqrt{4}``).
    Runs without ``math-verify``'s own ``signal.alarm`` timeouts (they need the main thread):
    the caller bounds it (:class:`RewardRunner` runs it in a worker process it kills at the limit).

    Raises:
        ValueError: the reference does not parse.
    """
    from math_verify import parse, verify

    text = str(reference)
    # A bare reference is one formula ("2\pi" unwrapped would read as 2); a response is read as
    # text first (its prose would otherwise become a product of symbols).
    gold = (parse(f"${text}$", parsing_timeout=None) if "$" not in text else []) or parse(text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference {text[:80]!r} does not parse as mathematics")
    given = parse(response, parsing_timeout=None) or parse(f"${response}$", parsing_timeout=None)
    return 1.0 if given and verify(gold, given, timeout_seconds=None) else 0.0


BUILTIN_REWARDS: dict[str, ScoreFunction] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "multiple_choice": multiple_choice,
    "math_equiv": math_equiv,
}


def answer_key(name: str, response: str) -> str:
    r"""The answer ``response`` gives, as a key that equal answers share (what a majority vote counts).

    ``numeric_match``: the number; ``multiple_choice``: the letter; otherwise the content of the
    last ``\boxed{}``, else the text after the last ``answer`` marker, else the last non-empty
    line, whitespace collapsed. "" when the response gives nothing.
    """
    if name == "numeric_match":
        number = extract_number(response)
        return "" if number is None else str(number)
    if name == "multiple_choice":
        return extract_choice(response) or ""
    if name != "exact_match":
        boxed = last_boxed(response)
        if boxed is not None:
            return _squash(boxed)
        markers = list(_ANSWER_MARKER.finditer(response))
        if markers:
            return _squash(response[markers[-1].end():]).lstrip(":= ")
        lines = [line for line in response.splitlines() if line.strip()]
        return _squash(lines[-1]) if lines else ""
    return _squash(response)


def check_reward_name(name: str) -> None:
    """Refuses a reward that is neither built in nor a loadable ``module:function``.

    Raises:
        InvalidArgument: with one line naming the reward and what it may be.
    """
    if name in BUILTIN_REWARDS:
        return
    if ":" not in name:
        raise InvalidArgument(f"unknown reward {name!r}: one of {', '.join(BUILTIN_REWARDS)} or 'module:function'")
    target = load_entrypoint(name, "reward function")
    if not callable(target):
        raise InvalidArgument(f"reward {name!r} is not callable")


def score_by_name(name: str, response: str, reference: Any) -> float:
    """Calls reward ``name`` here, in this process (a worker's job), as a finite float.

    Raises:
        RewardFailed: the function raised or returned no finite number.
    """
    function: Any = BUILTIN_REWARDS.get(name) or load_entrypoint(name, "reward function")
    try:
        value = function(response, reference)
    except Exception as exc:
        raise RewardFailed(f"reward {name!r} raised {type(exc).__name__}: {exc}") from exc
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise RewardFailed(f"reward {name!r} returned {value!r}, not a number") from exc
    if not math.isfinite(score):
        raise RewardFailed(f"reward {name!r} returned {score!r}")
    return score


# --- the worker pool --------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars from parquet rows
    return item() if callable(item) else str(value)


@dataclasses.dataclass(eq=False)
class _Worker:
    process: asyncio.subprocess.Process


class RewardRunner:
    """Scores responses by reward name; isolated rewards run in a pool of worker processes.

    Create it inside the event loop that uses it (an environment does so at its first
    episode) and :meth:`aclose` it when done. Workers start on first use (``python -m
    flexmarl.reward_worker``, with this process's ``sys.path``, so a user's reward module imports
    there as here) and serve one call at a time; at most ``workers`` run. No threads are used:
    calls wait on the workers' pipes in the event loop.
    """

    #: How long a worker may take to start and import what it preloads (math-verify: ~1 s).
    START_TIMEOUT_S = 60.0

    def __init__(self, *, timeout_s: float = 10.0, workers: int = 2, preload: tuple[str, ...] = ()) -> None:
        """Builds a runner; starts nothing.

        Args:
            timeout_s: the time limit of one isolated reward call.
            workers: worker processes at most (isolated calls beyond wait for one).
            preload: reward names the workers import at start (so an import is not timed).
        """
        if not timeout_s > 0 or workers < 1:
            raise InvalidArgument("RewardRunner needs timeout_s > 0 and workers >= 1")
        self.timeout_s = float(timeout_s)
        self._preload = tuple(preload)
        # One permit per call in progress: a call holds one while it uses a worker, idle or new; a worker
        # killed mid-call (time limit) gives its permit back, so a call waiting for one goes on.
        self._permits = asyncio.Semaphore(workers)
        self._idle: list[_Worker] = []
        self._closed = False
        self._all: set[_Worker] = set()

    async def score(self, name: str, response: str, reference: Any) -> float:
        """Reward ``name`` of ``response`` against ``reference``, a finite float.

        Raises:
            RewardFailed: the function raised, returned no finite number or ran past the limit.
        """
        if name in BUILTIN_REWARDS and name not in ISOLATED_BUILTINS:
            return score_by_name(name, response, reference)
        request = json.dumps({"reward": name, "response": response, "reference": reference}, default=_jsonable)
        worker = await self._acquire()
        healthy = False
        try:
            try:
                line = await asyncio.wait_for(self._exchange(worker, request.encode() + b"\n"), self.timeout_s)
            except TimeoutError:
                raise RewardFailed(f"reward {name!r} timed out after {self.timeout_s:g} s") from None
            if not line:
                raise RewardFailed(f"reward {name!r}: its worker process exited (code {worker.process.returncode})")
            reply = json.loads(line)
            healthy = True
        finally:
            # A worker interrupted mid-call (time limit, cancellation) may still answer it: never reuse one.
            await (self._release(worker) if healthy else self._discard(worker))
        if "error" in reply:
            raise RewardFailed(str(reply["error"]))
        return float(reply["value"])

    @staticmethod
    async def _exchange(worker: _Worker, request: bytes) -> bytes:
        """Sends one request line and reads the reply line ("" when the worker exited)."""
        stdin, stdout = worker.process.stdin, worker.process.stdout
        if stdin is None or stdout is None:  # never: the process is made with both pipes
            raise RewardFailed("a reward worker without pipes")
        stdin.write(request)
        await stdin.drain()
        return await stdout.readline()

    async def _acquire(self) -> _Worker:
        """An idle worker, else a new one (at most ``workers`` run: one per permit held)."""
        if self._closed:
            raise RewardFailed("the reward runner is closed")
        await self._permits.acquire()
        if self._closed:
            self._permits.release()
            raise RewardFailed("the reward runner is closed")
        if self._idle:
            return self._idle.pop()
        try:
            return await self._spawn()
        except BaseException:
            self._permits.release()
            raise

    async def _spawn(self) -> _Worker:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flexmarl.reward_worker", *self._preload,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )
        worker = _Worker(process)
        self._all.add(worker)
        try:
            ready = await asyncio.wait_for(self._exchange(worker, b""), self.START_TIMEOUT_S)
        except BaseException:
            await self._kill(worker)
            raise
        if not ready:
            await self._kill(worker)
            raise RewardFailed(f"a reward worker exited at start (code {process.returncode}; its stderr is above)")
        return worker

    async def _release(self, worker: _Worker) -> None:
        if self._closed:
            await self._kill(worker)
        else:
            self._idle.append(worker)
        self._permits.release()

    async def _discard(self, worker: _Worker) -> None:
        try:
            await self._kill(worker)
        finally:
            self._permits.release()

    async def _kill(self, worker: _Worker) -> None:
        self._all.discard(worker)
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
        await worker.process.wait()

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The process ids of the running workers (for tests and diagnostics)."""
        return tuple(w.process.pid for w in self._all)

    async def aclose(self) -> None:
        """Stops every worker (idempotent)."""
        self._closed = True
        self._idle.clear()
        for worker in list(self._all):
            await self._kill(worker)
