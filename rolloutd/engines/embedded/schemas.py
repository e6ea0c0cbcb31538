"""Requests of SGLang's HTTP API as the server parses them, and SGLang's error bodies.

Mirrors FastAPI's parse of SGLang's request structs (sglang/srt/managers/io_struct.py,
sglang/api/v1/api_types.py; pydantic lax mode) and the error shapes of
sglang/srt/entrypoints/http_server.py: a request-validation failure (``validation_exception_handler``),
the ``/generate`` contract gate (sglang/srt/entrypoints/api_contract.py) and a ``ValueError``
of request handling (``_create_error_response``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from rolloutd.engines.protocol import check_lora_path_contract, check_sampling_contract

#: io_struct.py PauseGenerationReqInput.mode.
PAUSE_MODES = ("abort", "retract", "in_place")

#: io_struct.py ``selector`` of the weight-update requests.
WEIGHT_UPDATE_SELECTORS = ("target", "draft", "all")


# ----- error bodies (http_server.py) ------------------------------------------------------
def validation_error(message: str) -> web.Response:
    """FastAPI request-validation failure: ``validation_exception_handler``'s ErrorResponse, 400."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def contract_error(message: str) -> web.Response:
    """The ``/generate`` contract gate: 400 ``{"error": "<text>"}``."""
    return web.json_response({"error": message}, status=400)


def value_error(message: str, status: int = 400) -> web.Response:
    """A ``ValueError`` of request handling: ``_create_error_response``'s ``{"error": {"message"}}``."""
    return web.json_response({"error": {"message": message}}, status=status)


class ValidationFailure(Exception):
    """The body failed FastAPI-level parsing (not JSON, wrong content type, missing field)."""


async def json_object(request: web.Request) -> dict[str, Any]:
    """The JSON object body, parsed as FastAPI parses a body parameter.

    FastAPI reads the body as JSON only when the content type is absent or ``application/json``
    (or ``application/*+json``); anything else, or bytes that are not a JSON object, fail
    validation.
    """
    content_type = request.headers.get("Content-Type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and not (media_type == "application/json" or media_type.endswith("+json")):
        raise ValidationFailure(f"body of content type {media_type!r} is not a JSON object")
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationFailure(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise ValidationFailure("Input should be a valid dictionary or object to extract fields from")
    return body


def is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_generate_fields(body: Mapping[str, Any]) -> None:
    """Raise :class:`ValidationFailure` where FastAPI's parse of ``GenerateReqInput`` would fail.

    Unknown top-level keys are ignored by SGLang (sglang/api/v1/api_types.py ``GenerateRequest``:
    "unknown keys ignored") and here; the fields FlexMARL's engines read are type-checked.
    """
    for key in ("stream", "return_text_in_logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ValidationFailure(f"{key}: Input should be a valid boolean")
    rid = body.get("rid")
    if rid is not None and not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise ValidationFailure("rid: Input should be a valid string or a list of strings")
    logprob = body.get("return_logprob")
    if logprob is not None and not (
        isinstance(logprob, bool) or (isinstance(logprob, list) and all(isinstance(v, bool) for v in logprob))
    ):
        raise ValidationFailure("return_logprob: Input should be a valid boolean or a list of booleans")
    top = body.get("top_logprobs_num")
    if top is not None and not (is_int(top) or (isinstance(top, list) and all(is_int(k) for k in top))):
        raise ValidationFailure("top_logprobs_num: Input should be a valid integer or a list of integers")
    input_ids = body.get("input_ids")
    if input_ids is not None:
        flat = isinstance(input_ids, list) and all(is_int(t) for t in input_ids)
        nested = isinstance(input_ids, list) and all(
            isinstance(p, list) and all(is_int(t) for t in p) for p in input_ids
        )
        if not (flat or nested):
            raise ValidationFailure("input_ids: Input should be a list of integers or a list of lists of integers")
    sampling = body.get("sampling_params")
    if sampling is not None and not isinstance(sampling, (dict, list)):
        raise ValidationFailure("sampling_params: Input should be a valid dictionary or list")
    lora_path = body.get("lora_path")
    if lora_path is not None and not (
        isinstance(lora_path, str)
        or (isinstance(lora_path, list) and all(name is None or isinstance(name, str) for name in lora_path))
    ):
        raise ValidationFailure("lora_path: Input should be a valid string or a list of strings or nulls")


def check_sampling_contracts(body: Mapping[str, Any]) -> None:
    """The contract gate on every ``sampling_params`` object and ``lora_path`` (raises :class:`ContractViolation`)."""
    check_lora_path_contract(body.get("lora_path"))
    sampling = body.get("sampling_params")
    if sampling is not None:
        for wire in sampling if isinstance(sampling, list) else [sampling]:
            check_sampling_contract(wire)



def lax_bool(value: Any, name: str) -> bool:
    """A ``bool`` field as pydantic's lax mode reads it (FastAPI validates SGLang's request structs so)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in LAX_TRUE | LAX_FALSE:
        return value.strip().lower() in LAX_TRUE
    raise ValidationFailure(f"{name}: Input should be a valid boolean")


LAX_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
LAX_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def check_base_req_fields(body: Mapping[str, Any]) -> None:
    """io_struct.py ``BaseReq``: ``rid`` and ``http_worker_ipc`` are optional strings; unknown keys are dropped."""
    for key in ("rid", "http_worker_ipc"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise ValidationFailure(f"{key}: Input should be a valid string")



def required_str(body: Mapping[str, Any], name: str) -> str:
    """The required string field ``name``."""
    value = body.get(name)
    if not isinstance(value, str):
        raise ValidationFailure(f"{name}: Field required (a string)")
    return value


def optional_str(body: Mapping[str, Any], name: str, default: str | None) -> Any:
    """The optional string field ``name`` (``default`` when absent)."""
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise ValidationFailure(f"{name}: Input should be a valid string")
    return value


def lax_int(body: Mapping[str, Any], name: str) -> int:
    """A required ``int`` field as pydantic's lax mode reads it (integral floats and numeric strings too)."""
    if name not in body:
        raise ValidationFailure(f"{name}: Field required")
    value = body[name]
    if is_int(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value.strip())
    raise ValidationFailure(f"{name}: Input should be a valid integer")


def str_list(body: Mapping[str, Any], name: str) -> list[str]:
    """The required list-of-strings field ``name``."""
    value = body.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValidationFailure(f"{name}: Field required (a list of strings)")
    return list(value)


def shape_list(body: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """The required ``shapes`` field: a list of lists of integers."""
    value = body.get("shapes")
    if not isinstance(value, list) or not all(
        isinstance(shape, list) and all(is_int(dim) for dim in shape) for shape in value
    ):
        raise ValidationFailure("shapes: Field required (a list of lists of integers)")
    return [tuple(int(dim) for dim in shape) for shape in value]
