"""Loading a warm start's dataset (``agents[i].warm_start.dataset``): shared by traind and the preflight.

The entrypoint ``module:attr`` names a callable; called with ``seed=`` the job's seed (and the
keyword arguments of ``warm_start.config``) it returns
an iterable of (prompt, response) pairs, each side text or a list of token ids (ints >= 0).
traind trains on the first ``steps * batch_size`` pairs (traind/sft.py); ``flexmarl submit``'s
preflight loads the same callable and checks that it yields usable pairs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flexmarl.entrypoints import load_entrypoint
from flexmarl.errors import InvalidArgument

#: What one side of a pair may be: text, or token ids.
PairSide = str | list[int]


def load_dataset(entrypoint: str) -> Callable[..., Iterable[Any]]:
    """The callable ``module:attr`` names (imported here, as rolloutd imports an environment).

    Raises:
        InvalidArgument: not ``module:attr``, it does not import, or it is not callable.
    """
    target = load_entrypoint(entrypoint, "warm-start dataset")
    if not callable(target):
        raise InvalidArgument(f"warm-start dataset {entrypoint!r} is not callable (it is called with seed=...)")
    return target  # type: ignore[no-any-return]


def first_items(entrypoint: str, seed: int, count: int, config: Mapping[str, Any] | None = None) -> list[Any]:
    """The first ``count`` items of the dataset called with ``seed`` (and ``config``'s keyword arguments).

    Raises:
        InvalidArgument: it does not load, raises, or yields fewer than ``count`` items.
    """
    factory = load_dataset(entrypoint)
    try:
        items = list(itertools.islice(iter(factory(**dict(config or {}), seed=seed)), count))
    except Exception as exc:
        raise InvalidArgument(f"warm-start dataset {entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    if len(items) < count:
        raise InvalidArgument(f"warm-start dataset {entrypoint!r} yielded {len(items)} examples; steps * batch_size "
                              f"needs {count}")
    return items


def _side(value: Any) -> PairSide | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in value):
        return [int(t) for t in value]
    return None


def as_pair(item: Any, index: int) -> tuple[PairSide, PairSide]:
    """One dataset item as a (prompt, response) pair, each side non-empty text or token ids.

    Raises:
        InvalidArgument: naming the item, when it is not such a pair.
    """
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise InvalidArgument(f"warm-start example {index}: expected a (prompt, response) pair, got "
                              f"{type(item).__name__}")
    prompt, response = _side(item[0]), _side(item[1])
    if prompt is None or response is None:
        raise InvalidArgument(f"warm-start example {index}: prompt and response must each be text or a list of "
                              f"token ids >= 0")
    if not prompt or not response:
        raise InvalidArgument(f"warm-start example {index}: empty {'prompt' if not prompt else 'response'}")
    return prompt, response
