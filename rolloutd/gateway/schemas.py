"""The OpenAI requests the gateway serves, declared once as pydantic models, and OpenAI's error shape.

The field set follows the official API's request types (the ``openai`` package's
``CompletionCreateParams`` of ``openai.types.chat`` and ``openai.types``); the fields this gateway
reads are validated as the official API validates them, the ones it accepts and ignores
(``user``, ``seed``, ``metadata``, ...) are type-checked, any other is refused. A body that
fails a model becomes the official API's 400 (:func:`openai_error`): a wrong JSON type is
``invalid_type`` ("Invalid type for 'temperature': expected a decimal, but got a string
instead."), a value out of range ``decimal_above_max_value`` / ``integer_below_min_value`` ...,
a missing field ``missing_required_parameter``, a value outside an enumeration
``invalid_value``, an unknown field "Unrecognized request argument supplied"; ``param`` names
the field (``messages[1].content``). Then come the refusals of what this gateway cannot serve
(``tool_choice`` "required", ``echo``, ...; docs/gateway.md says why), also 400 with ``param``.
As in the official API, null is the same as an absent field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rolloutd.gateway.prompts import Message, ToolCall


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def response(self) -> web.Response:
        """The HTTP response: ``{"error": {"message", "type", "param", "code"}}``."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers={"x-should-retry": "false"})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, param=param, code=code)


def missing(param: str) -> OpenAIError:
    """400 ``missing_required_parameter``."""
    return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


# ----- errors raised by the models' own rules (turned into OpenAI errors by openai_error) ------------
_REFUSED = "refused"  # a 400 with no code: a rule of the API, or something this gateway does not serve
_MISSING = "missing_required_parameter"
_INVALID_TYPE = "invalid_type"


def _refused(message: str, param: str | None = None) -> PydanticCustomError:
    """A rule broken; ``param`` overrides the field the error is found at."""
    return PydanticCustomError(_REFUSED, message, {"param": param} if param else None)


def _required(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A field the API reports missing unless it holds a value of its type (the official API's rule for ids)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(_MISSING, "Missing required parameter") from None


def _required_object(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """An object the API reports missing unless one is there (what is wrong inside it is reported as such)."""
    if not isinstance(value, Mapping):
        raise PydanticCustomError(_MISSING, "Missing required parameter")
    return handler(value)


RequiredStr = Annotated[str, WrapValidator(_required)]


def _json_kind(value: Any) -> str:
    """The union tag of a JSON value: its JSON type (``<string>``, ``<array>``, ``<object>``, ...)."""
    if value is None:
        return "<null>"
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, list):
        return "<array>"
    if isinstance(value, Mapping):
        return "<object>"
    return "<other>"


def _one_of(expected: str) -> Discriminator:
    """A union picked by the value's JSON type; any other type is ``invalid_type`` (expected ``expected``).

    Its ``<null>`` member is the default of an absent field (a null field is absent: never validated).
    """
    return Discriminator(_json_kind, custom_error_type=_INVALID_TYPE, custom_error_message="Invalid type",
                         custom_error_context={"expected": expected})


Stop = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[str], Tag("<array>")] | Annotated[None, Tag("<null>")],
    _one_of("a string or an array of strings"),
]


class _Model(BaseModel):
    """Strict JSON types (no coercion); unknown keys of nested objects ignored, as the official API does."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _NullIsAbsent(_Model):
    """An object whose null fields are absent ones."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# ----- messages -----------------------------------------------------------------------------------
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(_Model):
    """A text part of a message's content."""

    type: RequiredStr
    text: str = Field(None, validate_default=True)  # absent: invalid_type, as the API


Content = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[ContentPart], Tag("<array>")] | Annotated[None, Tag("<null>")],
    _one_of("a string or an array of content parts"),
]


class FunctionCallParam(_Model):
    """The function of an assistant's tool call; its arguments must be a JSON object (SGLang's rule for templates)."""

    name: RequiredStr
    arguments: RequiredStr

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        # SGLang (srt/entrypoints/openai/serving_chat.py parse_tool_call_arguments) refuses what a template
        # cannot take as a mapping.
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise _refused("Assistant tool call function.arguments must be valid JSON.") from None
        if not isinstance(parsed, dict):
            raise _refused("Assistant tool call function.arguments must be a JSON object.")
        return arguments


class ToolCallParam(_Model):
    """A tool call of an assistant message."""

    id: RequiredStr
    type: Literal["function"] = "function"
    function: Annotated[FunctionCallParam, WrapValidator(_required_object)]


class ChatMessage(_NullIsAbsent):
    """One message of ``messages``: text content, an assistant's tool calls, a tool result's call id."""

    role: Role
    name: str | None = None
    content: Content = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: Any = None
    function_call: Any = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list) and isinstance(data.get("role"), str):
            for part in parts:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if isinstance(kind, str) and kind not in _TEXT_PART_TYPES:
                    raise _refused("content: only text parts are supported", ".content")
        return data

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role == "function" or self.function_call is not None:
            raise _refused("function calls are not supported (use tools)", ".role")
        if self.tool_calls is not None and self.role != "assistant":
            raise _refused("only assistant messages carry tool_calls", ".tool_calls")
        if self.role == "tool" and not isinstance(self.tool_call_id, str):
            raise PydanticCustomError(_MISSING, "Missing required parameter", {"param": ".tool_call_id"})
        if self.content is None and not (self.role != "tool" and self.tool_calls):
            # an assistant message with tool calls may have no content
            raise PydanticCustomError(_INVALID_TYPE, "Invalid type", {
                "param": ".content", "expected": "a string or an array of content parts"})
        return self

    def to_message(self) -> Message:
        """The message as the chat template sees it."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        if self.role == "tool":
            return Message(self.role, content, tool_call_id=self.tool_call_id)
        return Message(self.role, content, calls)


def _pairing_errors(messages: Sequence[ChatMessage]) -> None:
    """Tool results pair with calls as SGLang (``_tool_call_pairing_error``) and the official API require.

    A ``tool`` message answers an unanswered call of the assistant message before it (directly
    or after other tool messages), and every call of an assistant message that is followed by
    anything is answered before the next non-tool message.
    """
    pending: set[str] | None = None
    for index, message in enumerate(messages):
        if message.role == "tool":
            if pending is None:
                raise _refused("Invalid parameter: messages with role 'tool' must be a response to a preceding "
                               "message with 'tool_calls'.", f"messages.[{index}].role")
            if message.tool_call_id not in pending:
                raise _refused(f"tool_call_id {message.tool_call_id!r} does not match an unanswered tool call.",
                               f"messages[{index}].tool_call_id")
            pending.discard(message.tool_call_id)
            continue
        if pending:
            raise _unanswered(pending, index - 1)
        pending = {c.id for c in message.tool_calls} if message.tool_calls else None
    if pending and messages[-1].role == "tool":
        raise _unanswered(pending, len(messages) - 1)


def _unanswered(pending: set[str], index: int) -> PydanticCustomError:
    return _refused("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                    f"'tool_call_id'. The following tool_call_ids did not have response messages: "
                    f"{', '.join(sorted(pending))}", f"messages.[{index}].role")


# ----- tools ----------------------------------------------------------------------------------------
class FunctionDefinition(_Model):
    """A tool's function: a name and, optionally, its JSON-schema parameters."""

    name: RequiredStr
    parameters: dict[str, Any] | None = None


class ToolParam(_Model):
    """One entry of ``tools``: a function tool."""

    type: Literal["function"] = Field(None, validate_default=True)  # absent: invalid_value
    function: Annotated[FunctionDefinition, WrapValidator(_required_object)]


class ToolChoiceFunction(_Model):
    """The function ``tool_choice`` names."""

    name: str


class NamedToolChoice(_Model):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    function: ToolChoiceFunction

    @model_validator(mode="wrap")
    @classmethod
    def _named(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(data)
        except ValidationError:
            raise PydanticCustomError(_MISSING, "Missing required parameter",
                                      {"param": "tool_choice.function.name"}) from None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("<string>")] | Annotated[NamedToolChoice, Tag("<object>")]
    | Annotated[None, Tag("<null>")],
    _one_of("a string or an object"),
]


# ----- requests -----------------------------------------------------------------------------------
class StreamOptions(_Model):
    """``stream_options``."""

    include_usage: bool | None = None


_MAX_N = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _GenerationRequest(_NullIsAbsent):
    """What chat completions and completions share: the agent, the sampling fields, the accepted-and-ignored ones.

    ``seed`` and the other ignored fields do not change what is sampled here (the runner seeds
    every request from the job seed, the episode and the prompt).
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=_MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    stop: Stop = None
    logit_bias: dict[str, Any] | None = None
    # accepted and ignored
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool = False
    parallel_tool_calls: bool = False
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    @field_validator("model")
    @classmethod
    def _named(cls, model: str) -> str:
        if not model:
            raise PydanticCustomError(_MISSING, "Missing required parameter")
        return model

    @model_validator(mode="after")
    def _sampling_rules(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise _refused("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           "stream_options")
        if self.top_p is not None and self.top_p <= 0.0:
            raise _refused("'top_p' must be in (0, 1]", "top_p")
        if isinstance(self.stop, list) and not all(self.stop) or self.stop == "":
            raise _refused("'stop' must be a string or a list of non-empty strings", "stop")
        if self.logit_bias:
            raise _refused("'logit_bias' is not supported", "logit_bias")
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage is True

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """SGLang sampling overrides of the call; ``max_tokens`` is bounded by the agent's ``max_new_tokens``."""
        sampling: dict[str, Any] = {
            name: value for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty")
            if (value := getattr(self, name)) is not None
        }
        max_tokens = self._max_tokens()
        if max_tokens is not None:
            limit = defaults.get("max_new_tokens")
            sampling["max_new_tokens"] = min(max_tokens, int(limit)) if isinstance(limit, int) else max_tokens
        if self.stop is not None:
            sampling["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return sampling


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions`` (openai.types.chat ``CompletionCreateParams``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice = None
    functions: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        _pairing_errors(self.messages)
        self._tool_rules()
        if self.top_logprobs is not None and not self.logprobs:
            raise _refused("Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is "
                           "used.", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise _refused("only response_format {'type': 'text'} is supported", "response_format")
        return self

    def _tool_rules(self) -> None:
        """``tool_choice`` "required" or a named function and the legacy ``functions`` are refused.

        SGLang serves them by constraining decoding to a JSON schema or structural tag of the tools
        (srt/entrypoints/openai/serving_chat.py, ``tool_call_constraint``), and the episode API
        carries no grammar to the engine.
        """
        choice = self.tool_choice
        if choice is not None:
            if not self.tools:
                raise _refused("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                               "specified.", "tool_choice")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                    t.function.name for t in self.tools}:
                raise _refused(f"Invalid value for 'tool_choice': function {choice.function.name!r} is not one of "
                               "the 'tools'.", "tool_choice")
        if self.functions is not None or self.function_call is not None:
            raise _refused("'functions' are not supported: use 'tools'", "functions")
        if choice is not None and choice not in ("none", "auto"):
            raise _refused("only tool_choice 'none' or 'auto' is supported: SGLang forces a tool call by "
                           "constraining decoding to the tools' JSON schema, and the episode API passes no grammar "
                           "to the engine (docs/gateway.md)", "tool_choice")

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> tuple[Message, ...]:
        """The messages as the chat template sees them."""
        return tuple(message.to_message() for message in self.messages)



class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions`` (openai.types ``CompletionCreateParams``): one prompt per call."""

    prompt: Any = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=20)

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        prompt = self.prompt
        if prompt is None:
            raise PydanticCustomError(_MISSING, "Missing required parameter", {"param": "prompt"})
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _refused("'prompt' must be a non-empty string (one prompt per call)", "prompt")
        if self.echo:
            raise _refused("'echo' is not supported", "echo")
        if self.suffix:
            raise _refused("'suffix' is not supported", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise _refused("only best_of=1 is supported", "best_of")
        return self

    @property
    def text(self) -> str:
        """The prompt (a one-string list taken as its string)."""
        return str(self.prompt[0] if isinstance(self.prompt, list) else self.prompt)


class RewardRequest(_NullIsAbsent):
    """``POST /sessions/<id>/reward``: a reward for an agent."""

    agent: str
    value: float = Field(allow_inf_nan=False)

    @field_validator("agent")
    @classmethod
    def _named(cls, agent: str) -> str:
        if not agent:
            raise PydanticCustomError(_MISSING, "Missing required parameter")
        return agent


# ----- parsing and errors -------------------------------------------------------------------------
_EXPECTED = {
    "int_type": "an integer", "float_type": "a decimal", "finite_number": "a decimal", "bool_type": "a boolean",
    "string_type": "a string", "list_type": "an array", "dict_type": "an object", "model_type": "an object",
    "model_attributes_type": "an object",
}

RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model: type[RequestT], body: Mapping[str, Any]) -> RequestT:
    """``body`` validated by ``model``.

    Raises:
        OpenAIError: 400 in the official API's shape (:func:`openai_error`).
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise openai_error(exc) from None


def _param(loc: Sequence[int | str]) -> str:
    """``messages[1].content`` from pydantic's location (union tags such as ``<array>`` left out)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not part.startswith("<"):
            param += f".{part}" if param else part
    return param


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def openai_error(exc: ValidationError) -> OpenAIError:
    """The official API's 400 for the first thing wrong with a body (an unknown field first)."""
    errors = exc.errors()
    unknown = sorted((e for e in errors if e["type"] == "extra_forbidden"), key=lambda e: _param(e["loc"]))
    error = unknown[0] if unknown else errors[0]
    kind, value, ctx = error["type"], error["input"], error.get("ctx") or {}
    param = _param(error["loc"])
    override = ctx.get("param")
    if isinstance(override, str):
        param = param + override if override.startswith(".") else override
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind in ("missing", _MISSING):
        return missing(param)
    if kind == _INVALID_TYPE or kind in _EXPECTED:
        if kind == _INVALID_TYPE and override == ".content":
            value = None  # the message's content is absent
        expected = ctx.get("expected") or _EXPECTED[kind]
        return bad_request(f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)} instead.",
                           param, _INVALID_TYPE)
    if kind == "literal_error":
        return bad_request(f"Invalid value: '{value}'. Supported values are: {ctx.get('expected')}.", param,
                           "invalid_value")
    if kind in ("greater_than_equal", "less_than_equal"):
        below = kind == "greater_than_equal"
        limit = ctx["ge" if below else "le"]
        number = "integer" if isinstance(limit, int) else "decimal"  # the field's type: int fields have int bounds
        bound = float(limit)
        side, word, sign = ("below", "minimum", ">=") if below else ("above", "maximum", "<=")
        return bad_request(f"Invalid '{param}': {number} {side} {word} value. Expected a value {sign} {bound:g}, but "
                           f"got {value} instead.", param, f"{number}_{side}_{'min' if below else 'max'}_value")
    if kind == "too_short":
        return bad_request(f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got an "
                           "empty array instead.", param, "empty_array")
    if kind == _REFUSED:
        return bad_request(error["msg"], param)
    return bad_request(f"Invalid '{param}': {error['msg']}", param)


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object.

    Raises:
        OpenAIError: 400 when it is not.
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body
