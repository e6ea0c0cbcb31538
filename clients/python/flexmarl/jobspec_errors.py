"""The job spec's validation messages: one readable line per pydantic error, naming the field path.

Kept apart from :mod:`flexmarl.jobspec` (the models), which calls :func:`format_errors`; e.g.
``batch.micro_batch_size: must be a multiple of batch.group_size (4), got 6``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def _format_location(loc: tuple[int | str, ...], skip: tuple[str, ...]) -> str:
    text = ""
    for part in loc:
        if part in skip:  # a one-or-many union's branch (TaskFiles): not a key of the spec
            continue
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


_BOUND_WORDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _describe(detail: Any) -> str:
    """One readable reason for one pydantic error."""
    kind = str(detail["type"])
    ctx = detail.get("ctx") or {}
    got = detail.get("input")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field missing"
    if kind == "value_error":
        return str(ctx.get("error", detail["msg"]))
    if kind == "string_pattern_mismatch":
        return f"must match {ctx['pattern']}, got {got!r}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {got!r}"
    if kind in _BOUND_WORDS:
        key, word = _BOUND_WORDS[kind]
        return f"must be {word} {ctx[key]}, got {got!r}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} item(s), got {ctx['actual_length']}"
    if kind in _TYPE_WORDS:
        return f"must be {_TYPE_WORDS[kind]}, got {got!r}"
    return f"{detail['msg']}, got {got!r}"


def format_errors(error: ValidationError, skip: tuple[str, ...] = ()) -> list[str]:
    """One line per problem, ``<field path>: <reason>``; ``skip``: tags of union branches left out of paths."""
    lines: list[str] = []
    for detail in error.errors(include_url=False):
        if detail["type"] == "job_spec":
            lines.extend(str(detail["msg"]).splitlines())
            continue
        path = _format_location(tuple(detail["loc"]), skip)
        reason = _describe(detail)
        lines.append(f"{path}: {reason}" if path else reason)
    return lines
