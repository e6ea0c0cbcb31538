"""``module:attr`` entrypoints of user code (environments, agent programs, warm-start datasets)."""

from __future__ import annotations

import importlib
from typing import Any

from flexmarl.errors import InvalidArgument

__all__ = ["load_entrypoint"]


def load_entrypoint(entrypoint: str, what: str, named: str = "") -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted), imported here.

    Args:
        entrypoint: ``module:attr``.
        what: what it is, for messages ("environment", "agent program", "warm-start dataset").
        named: how the spec names it when that differs from ``what`` (e.g. "environment entrypoint").

    Raises:
        InvalidArgument: not ``module:attr``, it does not import or has no such attribute, or
            importing the module raised (user code failing at import time).
    """
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgument(f"{named or what} {entrypoint!r} is not 'module:attr'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"cannot load {what} {entrypoint!r}: {exc}") from exc
    except Exception as exc:  # user code failing at import time (SyntaxError, a missing file...)
        raise InvalidArgument(f"importing {what} {entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    return target
