"""``module:attr`` entrypoints of user code (environments, agent programs, warm-start datasets)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from flexmarl.errors import InvalidArgument

__all__ = ["load_entrypoint", "loaded_digest", "source_digest"]

#: module name -> :func:`source_digest` of its file when this process first loaded an entrypoint from it.
_LOADED_DIGESTS: dict[str, str] = {}


def source_digest(module_name: str) -> str:
    """``sha256:<hex>`` of the source file of ``module_name`` as it is on disk now; "" when it has none.

    The file is the one this process imported (its ``__spec__.origin``), or, for a module not
    imported yet, the one an import would load. Compiled-only and built-in modules have no
    source to compare: "".
    """
    module = sys.modules.get(module_name)
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return ""
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return ""
    try:
        data = Path(origin).read_bytes()
    except OSError:
        return ""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def loaded_digest(module_name: str) -> str:
    """The :func:`source_digest` of ``module_name`` when :func:`load_entrypoint` first loaded it here; "" if never.

    Python runs a module's code as it was when first imported: an edit made since then is on
    disk (:func:`source_digest`) but not running. A module some other import had loaded before
    is recorded as its file was at that first :func:`load_entrypoint`.
    """
    return _LOADED_DIGESTS.get(module_name, "")


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
        # Read before the import when the import is the first (the file an edit would change next).
        first = "" if module_name in sys.modules else source_digest(module_name)
        target: Any = importlib.import_module(module_name)
        _LOADED_DIGESTS.setdefault(module_name, first or source_digest(module_name))
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"cannot load {what} {entrypoint!r}: {exc}") from exc
    except Exception as exc:  # user code failing at import time (SyntaxError, a missing file...)
        raise InvalidArgument(f"importing {what} {entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    return target
