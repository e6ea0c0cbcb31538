"""The requests of SGLang's HTTP API as pydantic models, and SGLang's error bodies.

Each model is named after, and declares the fields the server reads of, its SGLang 0.5.23
request struct (sglang/srt/managers/io_struct.py; ``/generate`` also
sglang/api/v1/api_types.py ``GenerateRequest``): unknown keys are dropped as SGLang drops
them, and fields are parsed as FastAPI parses SGLang's structs (pydantic lax mode: ``"yes"`` is
a bool, ``"8"`` an int), except where SGLang's contract gate is stricter (``/generate``'s fields
are strict). tests/rolloutd/test_sglang_schema.py compares these models with SGLang's structs.

Error bodies are those of sglang/srt/entrypoints/http_server.py: a body that fails a model is
``validation_exception_handler``'s ErrorResponse (400, :func:`validation_error`); the
``/generate`` contract gate (sglang/srt/entrypoints/api_contract.py, the sampling parameters
checked by :func:`rolloutd.engines.protocol.check_sampling_contract`) answers 400
``{"error": "<text>"}`` (:func:`contract_error`); a ``ValueError`` of request handling is
``_create_error_response``'s ``{"error": {"message"}}`` (:func:`value_error`).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from rolloutd.engines.protocol import check_lora_path_contract, check_sampling_contract

#: io_struct.py PauseGenerationReqInput.mode.
PAUSE_MODES = ("abort", "retract", "in_place")
PauseMode = Literal["abort", "retract", "in_place"]
#: io_struct.py ``selector`` of the weight-update requests.
WEIGHT_UPDATE_SELECTORS = ("target", "draft", "all")
WeightUpdateSelector = Literal["target", "draft", "all"]
DEFAULT_GROUP_NAME = "weight_update_group"


class RequestInvalid(Exception):
    """The body failed FastAPI-level parsing (not JSON, wrong content type, a field of the wrong type)."""


class SGLangRequest(BaseModel):
    """A request body: unknown keys are dropped (SGLang's structs ignore them)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class BaseReq(SGLangRequest):
    """io_struct.py ``BaseReq``: what every control request may carry."""

    rid: str | None = None
    http_worker_ipc: str | None = None


class GenerateReqInput(SGLangRequest):
    """io_struct.py ``GenerateReqInput``: the fields FlexMARL's engines read, type-checked strictly.

    ``sampling_params`` objects are checked by the contract gate
    (:func:`check_generate_contracts`), then parsed by :meth:`SamplingParams.from_wire`.
    """

    text: Any = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[Any] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    stream: StrictBool | None = None
    return_text_in_logprobs: StrictBool | None = None
    lora_path: StrictStr | list[StrictStr | None] | None = None


class AbortReq(SGLangRequest):
    """io_struct.py ``AbortReq`` (``rid`` None or empty: ``""``, as its ``__post_init__``)."""

    rid: StrictStr = ""
    abort_all: StrictBool = False

    @field_validator("rid", mode="before")
    @classmethod
    def _empty_rid(cls, value: Any) -> Any:
        return value or ""


class UpdateWeightFromDiskReqInput(SGLangRequest):
    """io_struct.py ``UpdateWeightFromDiskReqInput``."""

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateWeightVersionReqInput(SGLangRequest):
    """io_struct.py ``UpdateWeightVersionReqInput``."""

    new_version: str
    abort_all_requests: bool = True


class PauseGenerationReqInput(BaseReq):
    """io_struct.py ``PauseGenerationReqInput``."""

    mode: PauseMode = "abort"


class ContinueGenerationReqInput(BaseReq):
    """io_struct.py ``ContinueGenerationReqInput``."""

    torch_empty_cache: bool = True  # read, not acted on: no CUDA cache to empty


class InitWeightsUpdateGroupReqInput(BaseReq):
    """io_struct.py ``InitWeightsUpdateGroupReqInput``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(BaseReq):
    """io_struct.py ``DestroyWeightsUpdateGroupReqInput``."""

    group_name: str = DEFAULT_GROUP_NAME


class BeginWeightUpdateReqInput(BaseReq):
    """io_struct.py ``BeginWeightUpdateReqInput``."""

    selector: WeightUpdateSelector = "all"


class EndWeightUpdateReqInput(BaseReq):
    """io_struct.py ``EndWeightUpdateReqInput``."""


class UpdateWeightsFromDistributedReqInput(BaseReq):
    """io_struct.py ``UpdateWeightsFromDistributedReqInput``."""

    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: str = DEFAULT_GROUP_NAME
    load_format: str | None = None
    weight_version: str | None = None
    selector: WeightUpdateSelector = "all"
    flush_cache: bool = True
    abort_all_requests: bool = False
    torch_empty_cache: bool = False


class LoadLoRAAdapterReqInput(BaseReq):
    """io_struct.py ``LoadLoRAAdapterReqInput``."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterReqInput(BaseReq):
    """io_struct.py ``UnloadLoRAAdapterReqInput``."""

    lora_name: str
    lora_id: str | None = None


RequestT = TypeVar("RequestT", bound=SGLangRequest)


async def parse_body(request: web.Request, model: type[RequestT]) -> RequestT:
    """The JSON object body, parsed as FastAPI parses a body parameter, validated by ``model``.

    FastAPI reads the body as JSON only when the content type is absent or ``application/json``
    (or ``application/*+json``); anything else, or bytes that are not a JSON object, fail
    validation.

    Raises:
        RequestInvalid: The body is not a JSON object or fails the model (the message lists the fields).
    """
    content_type = request.headers.get("Content-Type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and not (media_type == "application/json" or media_type.endswith("+json")):
        raise RequestInvalid(f"body of content type {media_type!r} is not a JSON object")
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestInvalid(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestInvalid("Input should be a valid dictionary or object to extract fields from")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestInvalid(
            "; ".join(f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors())
        ) from exc


def check_generate_contracts(request: GenerateReqInput) -> None:
    """The contract gate on every ``sampling_params`` object and ``lora_path`` (raises ``ContractViolation``)."""
    check_lora_path_contract(request.lora_path)
    sampling = request.sampling_params
    if sampling is not None:
        for wire in sampling if isinstance(sampling, list) else [sampling]:
            check_sampling_contract(wire)


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
