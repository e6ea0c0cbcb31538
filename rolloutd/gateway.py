"""An OpenAI-compatible HTTP endpoint over the episodes rolloutd runs (bring your own agent program).

A program written only against the official ``openai`` package (``AsyncOpenAI(base_url=...,
api_key=...)``) plays an episode through a *session* of the :class:`Gateway`: every session has
its own base URL ``http://<host>:<port>/sessions/<id>/v1`` and API key, both unguessable
(:func:`secrets.token_urlsafe`), and lives exactly as long as its episode. Routes:

* ``POST /sessions/<id>/v1/chat/completions`` (``stream`` too) and ``POST /sessions/<id>/v1/completions``:
  ``model`` names the agent; one call is one :meth:`EpisodeContext.generate` of that agent (with
  ``n`` > 1 one :meth:`EpisodeContext.generate_n`: one backend request, ``n`` turns, ``choices[i]``
  is sample ``i``), so the native code path records the turns (prompt and response token ids,
  logprobs, behaviour version, turn number) and the runner turns each into an experience.
* ``GET /sessions/<id>/v1/models``: the episode's agents.
* ``POST /sessions/<id>/reward`` ``{"agent", "value"}``: :meth:`EpisodeContext.reward`.
* ``GET /metrics``: the gateway's Prometheus metrics (no session data).

Token-in / token-out: a chat call is rendered with the agent's chat template and tokenized once.
When its messages repeat an earlier turn of the same agent in the session (the same messages,
then an assistant message whose content is exactly the text that turn returned), the recorded
token ids of that turn (its prompt and its sampled response) are reused and only the new
messages come from the template, so training sees exactly what was sampled rather than a
re-tokenization of the text (:func:`resolve_chat_prompt`). An assistant message that matches no
earlier turn is re-tokenized from its text; the response says so (``flexmarl.retokenized_messages``),
so do the ``flexmarl_gateway_retokenized_messages_total`` counter and the experience
(``ExperienceRecord.retokenized_messages``).

Tool calls: assistant ``tool_calls`` and ``tool`` messages go to the chat template; with the
agent's ``tool_call_parser`` (SGLang's qwen25 / hermes detectors) calls are parsed out of the
sampled text into ``tool_calls`` (finish ``"tool_calls"``), and a call sent back is matched to
its recorded ids on the parsed call. Top logprobs (``top_logprobs`` / completions ``logprobs``)
are the engine's (SGLang's ``top_logprobs_num``).

Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 404 for an unknown
session, route or model (agent), 400 for a malformed body (validated as the official API does:
``invalid_type``, ``missing_required_parameter``, ``invalid_value``, range codes, with ``param``
naming the field) or an unsupported parameter (``tool_choice`` "required", ``echo``, ...;
docs/gateway.md says why each is refused), 401 for a wrong API key. Every error
carries ``x-should-retry: false`` so the client never repeats a call that may have recorded a turn.

Authentication: ``Authorization: Bearer <api_key>``. When the cluster has a bearer token the key
handed to the program is ``<cluster token>.<session key>``, so the cluster token applies to every
call although an unmodified program sends one key. The gateway binds to 127.0.0.1 unless
configured otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import re
import secrets
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from flexmarl.episode import EpisodeContext, Generation
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable

logger = logging.getLogger(__name__)

__all__ = [
    "ChatTurn",
    "Gateway",
    "GatewayConfig",
    "GatewayMetrics",
    "OpenAIError",
    "ResolvedPrompt",
    "Session",
    "resolve_chat_prompt",
]

_CLIENT_MAX_SIZE = 16 << 20
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

# Request fields accepted and ignored: they do not change what is sampled here (``seed``: the
# runner seeds every request from the job seed, the episode and the prompt).
_IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "seed", "service_tier", "parallel_tool_calls", "stream_options",
     "prompt_cache_key", "safety_identifier", "modalities", "reasoning_effort", "verbosity"}
)
_CHAT_FIELDS = frozenset(
    {"model", "messages", "stream", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n",
     "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "tools", "tool_choice", "functions",
     "function_call", "response_format", "logit_bias"}
)
_COMPLETION_FIELDS = frozenset(
    {"model", "prompt", "stream", "temperature", "top_p", "max_tokens", "stop", "n", "logprobs",
     "frequency_penalty", "presence_penalty", "echo", "suffix", "best_of", "logit_bias"}
)
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """Where the gateway listens and which cluster token applies (empty: none)."""

    host: str = "127.0.0.1"
    port: int = 0
    #: The host put into session base URLs (default: ``host``, or 127.0.0.1 for a wildcard host).
    advertise_host: str = ""
    cluster_token: str = dataclasses.field(default="", repr=False)
    #: agent -> the parser of tool calls in its answers (a name of :data:`TOOL_CALL_PARSERS`); none: answers are text.
    tool_call_parsers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tool_call_parsers.values()) - set(TOOL_CALL_PARSERS))
        if unknown:
            raise InvalidArgument(f"unknown tool_call_parser {unknown[0]!r}; known: {sorted(TOOL_CALL_PARSERS)}")


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


def _bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


class GatewayMetrics:
    """Calls, reused prompt tokens and re-tokenized messages (registered on the registry given)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("flexmarl_gateway_requests_total", "Gateway calls, by route and HTTP status.",
                                ["route", "status"], registry=registry)
        self.reused_tokens = Counter("flexmarl_gateway_reused_prompt_tokens_total",
                                     "Prompt tokens taken from earlier turns' recorded ids, by agent.", ["agent"],
                                     registry=registry)
        self.retokenized = Counter("flexmarl_gateway_retokenized_messages_total",
                                   "Assistant messages that matched no earlier turn and were re-tokenized from "
                                   "their text, by agent.", ["agent"], registry=registry)
        self.sessions = Gauge("flexmarl_gateway_open_sessions", "Sessions (episodes) open.", registry=registry)


# ----- token-in / token-out ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A function call of an assistant message: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def same_call(self, other: ToolCall) -> bool:
        """The same function with equal arguments (ids and JSON spacing aside): how a returned call is recognised."""
        return self.name == other.name and _json_or_text(self.arguments) == _json_or_text(other.arguments)

    def to_api(self) -> dict[str, Any]:
        """The call as the API returns it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class Message:
    """A chat message as the template sees it (text content; an assistant's tool calls; a tool result's call id)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message for ``apply_chat_template``: tool-call arguments parsed into a mapping, as HF templates expect.

        (SGLang's ``normalize_assistant_tool_call_arguments``, srt/entrypoints/openai/serving_chat.py.)
        """
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """A chat call of one agent, as later calls may repeat it."""

    messages: tuple[Message, ...]
    #: The messages rendered and tokenized from their text (what a later call's render starts with).
    fresh_prompt_ids: tuple[int, ...]
    #: What was sent (reused ids included) and what was sampled.
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    #: The sampled ids decoded.
    text: str
    #: What the program got back: the content (the text before the first tool call when calls were parsed out
    #: of the text, else the text) and the parsed calls.
    content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def answered_by(self, message: Message) -> bool:
        """Whether ``message`` is this turn's answer as the program got it (a call matches on name and arguments)."""
        if message.role != "assistant" or message.content != self.content:
            return False
        if len(message.tool_calls) != len(self.tool_calls):
            return False
        return all(a.same_call(b) for a, b in zip(message.tool_calls, self.tool_calls, strict=True))


@dataclasses.dataclass(frozen=True)
class ResolvedPrompt:
    """The token ids a chat call is sent with, and how they were obtained."""

    input_ids: tuple[int, ...]
    fresh_ids: tuple[int, ...]
    #: Leading ids taken from an earlier turn (its prompt and sampled response).
    reused_tokens: int
    #: Assistant messages matched to no earlier turn (re-tokenized from their text).
    retokenized_messages: int


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [message.to_template() for message in messages]


def resolve_chat_prompt(ctx: EpisodeContext, agent: str, messages: Sequence[Message],
                        history: Sequence[ChatTurn], tools: Sequence[Mapping[str, Any]] | None = None,
                        ) -> ResolvedPrompt:
    r"""The prompt ids of a chat call, reusing the recorded ids of the longest earlier turn it repeats.

    A turn T is repeated when ``messages`` starts with T's messages followed by T's answer
    (:meth:`ChatTurn.answered_by`: the content the program got back, and the same tool calls).
    The call's fresh render must then start with T's fresh render, followed by the sampled
    text's own tokens (templates that rewrite earlier turns fail this and fall back to the fresh
    render). The ids sent are T's prompt ids, T's sampled ids, then the rest of the fresh
    render; a trailing sampled token the template also writes (an end-of-turn token such as
    ``<|im_end|>``) is not repeated.

    When T's answer carried tool calls (or its content is not the whole sampled text, the
    calls having been parsed out of it), the template renders them its own way (Qwen's
    ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, not the sampled spacing),
    so the rest is taken from a render in which T's answer is the sampled text itself, and it
    is used only when the true render ends with that same rest (the later messages render
    alike either way); otherwise the answer counts as re-tokenized. ``tools`` go to the
    template with the messages (a turn rendered with other tools then rarely repeats: its
    render is no prefix of this one).
    """
    fresh = tuple(ctx.tokenize(agent, _as_dicts(messages), tools=tools))
    assistants = sum(1 for m in messages if m.role == "assistant")
    for turn in sorted(history, key=lambda t: len(t.messages), reverse=True):
        n = len(turn.messages)
        if len(messages) <= n or tuple(messages[:n]) != turn.messages or not turn.answered_by(messages[n]):
            continue
        rewritten = bool(turn.tool_calls) or turn.content != turn.text
        if rewritten:
            as_sampled = [*messages[:n], Message("assistant", turn.text), *messages[n + 1:]]
            render = tuple(ctx.tokenize(agent, _as_dicts(as_sampled), tools=tools))
        else:
            render = fresh
        spliced = _splice(ctx, agent, render, turn)
        if spliced is None:
            continue
        reused = len(turn.prompt_ids) + len(turn.response_ids)
        if rewritten and fresh[len(fresh) - (len(spliced) - reused):] != spliced[reused:]:
            continue
        covered = sum(1 for m in messages[: n + 1] if m.role == "assistant")
        return ResolvedPrompt(spliced, fresh, reused, assistants - covered)
    return ResolvedPrompt(fresh, fresh, 0, assistants)


def _splice(ctx: EpisodeContext, agent: str, fresh: tuple[int, ...], turn: ChatTurn) -> tuple[int, ...] | None:
    head = turn.fresh_prompt_ids
    if fresh[: len(head)] != head:
        return None
    rest = fresh[len(head):]
    content_ids = tuple(ctx.tokenize(agent, turn.text)) if turn.text else ()
    if rest[: len(content_ids)] != content_ids:
        return None
    tail = rest[len(content_ids):]
    sampled = turn.response_ids
    overlap = 0
    for k in range(min(len(sampled), len(tail)), 0, -1):
        # Only tokens that decode to nothing (special tokens) may be shared by the sample and the template.
        if sampled[-k:] == tail[:k] and ctx.decode(agent, sampled[:-k]) == turn.text:
            overlap = k
            break
    return turn.prompt_ids + sampled + tail[overlap:]


# ----- tool calls in the sampled text ----------------------------------------------------------------
# SGLang parses tool calls out of the generated text with the detector its server was started
# with (``--tool-call-parser``; srt/function_call/function_call_parser.py); here the job chooses
# one per agent (``tool_call_parser``). Both detectors below follow SGLang's one-shot
# ``detect_and_parse`` and ``BaseFormatDetector.parse_base_json``: the content is the text before
# the first call marker (stripped), a call naming no declared tool is dropped, its arguments are
# the JSON of ``parameters`` or ``arguments``.


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
    """What a tool-call parser found in a sampled text: the normal text and the calls (name, JSON arguments)."""

    normal_text: str
    calls: tuple[tuple[str, str], ...]


ToolCallParser = Callable[[str, Sequence[Mapping[str, Any]]], ParsedToolCalls]


def _calls_of(action: Any, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """SGLang's ``parse_base_json``: one call per object naming a declared tool."""
    names = {tool["function"]["name"] for tool in tools}
    calls = []
    for act in action if isinstance(action, list) else [action]:
        if not isinstance(act, Mapping):
            raise ValueError(f"a tool call must be a JSON object, got {type(act).__name__}")
        name = act.get("name")
        if not (name and name in names):
            logger.warning("model attempted to call undefined function: %s", name)
            continue
        calls.append((str(name), json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False)))
    return calls


def parse_qwen25(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedToolCalls:
    r"""``<tool_call>\n{json}\n</tool_call>`` blocks (SGLang srt/function_call/qwen25_detector.py, Qwen25Detector)."""
    bot, eot = "<tool_call>\n", "\n</tool_call>"
    index = text.find(bot)
    if index == -1:
        return ParsedToolCalls(text, ())
    calls: list[tuple[str, str]] = []
    for block in re.findall(rf"{re.escape(bot)}(.*?){re.escape(eot)}", text, re.DOTALL):
        try:
            calls += _calls_of(json.loads(block.strip()), tools)
        except ValueError as exc:  # a malformed block is skipped, as SGLang does
            logger.warning("failed to parse tool call %r: %s", block, exc)
    return ParsedToolCalls(text[:index].strip(), tuple(calls))


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedToolCalls:
    """``<tool_call>{json}</tool_call>`` (an unclosed last one too; SGLang srt/function_call/hermes_detector.py)."""
    index = text.find("<tool_call>")
    if index == -1:
        return ParsedToolCalls(text, ())
    calls: list[tuple[str, str]] = []
    try:
        for closed, unclosed in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
            raw = closed or unclosed
            if raw:
                calls += _calls_of(json.loads(raw.strip()), tools)
    except ValueError as exc:  # any failure: the whole text is the content, as in SGLang
        logger.warning("failed to parse tool calls: %s", exc)
        return ParsedToolCalls(text, ())
    return ParsedToolCalls(text[:index].strip(), tuple(calls))


TOOL_CALL_PARSERS: Mapping[str, ToolCallParser] = {
    "qwen25": parse_qwen25, "qwen": parse_qwen25, "hermes": parse_hermes,
}
"""The tool-call parsers by SGLang's ``--tool-call-parser`` names."""


# ----- sessions ----------------------------------------------------------------------------------


class Session:
    """One episode's handle on the gateway: its id, key, context and the chat turns later calls may repeat."""

    def __init__(self, session_id: str, api_key: str, ctx: EpisodeContext) -> None:
        self.session_id = session_id
        self.api_key = api_key
        self.ctx = ctx
        self.chat_history: dict[str, list[ChatTurn]] = {}
        self.completion_history: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...], str]]] = {}
        self.closed = False
        self.calls = 0
        self.retokenized_messages = 0
        self._inflight: set[asyncio.Task[Any]] = set()

    async def run(self, call: Callable[[], Awaitable[list[Generation]]]) -> list[Generation]:
        """Runs one call's generations as a task of this session (cancelled when the session closes)."""
        if self.closed:
            raise _session_not_found()
        task: asyncio.Task[list[Generation]] = asyncio.ensure_future(call())
        self._inflight.add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self.closed and task.cancelled():
                raise _session_not_found() from None
            task.cancel()
            raise
        finally:
            self._inflight.discard(task)

    async def close(self) -> None:
        """Refuses new calls and cancels those in flight (the episode ended)."""
        self.closed = True
        pending = list(self._inflight)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _session_not_found() -> OpenAIError:
    return OpenAIError(404, "session not found (unknown, or its episode has ended)", code="session_not_found")


# ----- request parsing -----------------------------------------------------------------------------
# Validation follows the official API's answers: a wrong JSON type is 400 ``invalid_type``
# ("Invalid type for 'temperature': expected a decimal, but got a string instead."), a value out
# of range ``decimal_above_max_value`` / ``integer_below_min_value`` ..., a missing field
# ``missing_required_parameter``, a value outside an enumeration ``invalid_value``; ``param``
# names the field (``messages[1].content``). Then come the refusals of what this gateway cannot
# serve (``tool_choice`` "required", ``echo``, ...), also 400 with ``param``.

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_MAX_TOP_LOGPROBS = 20  # chat completions' top_logprobs range is [0, 20]
_MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs range is [0, 5]
_MAX_N = 128


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


def _invalid_type(name: str, expected: str, value: Any) -> OpenAIError:
    return _bad(f"Invalid type for '{name}': expected {expected}, but got {_type_name(value)} instead.", name,
                "invalid_type")


def _missing(name: str) -> OpenAIError:
    return _bad(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")


def _invalid_value(name: str, value: Any, supported: Sequence[str]) -> OpenAIError:
    listed = ", ".join(f"'{s}'" for s in supported)
    return _bad(f"Invalid value: '{value}'. Supported values are: {listed}.", name, "invalid_value")


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, integer: bool = False) -> float | None:
    """An optional number field (null: absent), type- and range-checked as the official API does."""
    value = body.get(name)
    if value is None:
        return None
    kind = "integer" if integer else "decimal"
    valid = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not valid:
        raise _invalid_type(name, f"an {kind}" if integer else f"a {kind}", value)
    if value < low:
        raise _bad(f"Invalid '{name}': {kind} below minimum value. Expected a value >= {low:g}, but got {value} "
                   "instead.", name, f"{kind}_below_min_value")
    if value > high:
        raise _bad(f"Invalid '{name}': {kind} above maximum value. Expected a value <= {high:g}, but got {value} "
                   "instead.", name, f"{kind}_above_max_value")
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: float = math.inf) -> int | None:
    value = _number(body, name, low, high, integer=True)
    return None if value is None else int(value)


def _boolean(body: Mapping[str, Any], name: str) -> bool:
    """An optional boolean field (absent or null: False)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _invalid_type(name, "a boolean", value)
    return value is True


def _object(body: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, Mapping):
        raise _invalid_type(name, "an object", value)
    return value


def check_common_fields(body: Mapping[str, Any]) -> None:
    """Types of the fields both endpoints accept and ignore or read later (``seed``, ``user``, ``stream_options``...).

    Raises:
        OpenAIError: 400 ``invalid_type`` (or ``invalid_value``) naming the field.
    """
    _integer(body, "seed", -(2**63), 2**63 - 1)
    for name in ("user", "prompt_cache_key", "safety_identifier", "service_tier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _invalid_type(name, "a string", body[name])
    for name in ("metadata", "logit_bias"):
        _object(body, name)
    for name in ("store", "parallel_tool_calls"):
        _boolean(body, name)
    stream = _boolean(body, "stream")
    options = _object(body, "stream_options")
    if options is not None:
        if not stream:
            raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        _boolean(options, "include_usage")


def sampling_of(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang sampling overrides of an OpenAI body; ``max_tokens`` is bounded by the agent's ``max_new_tokens``.

    Raises:
        OpenAIError: 400 for a value of the wrong type or range (``n`` is read by :func:`samples_of`).
    """
    samples_of(body)
    sampling: dict[str, Any] = {}
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("frequency_penalty", -2.0, 2.0),
                            ("presence_penalty", -2.0, 2.0)):
        value = _number(body, name, low, high)
        if value is not None:
            sampling[name] = value
    if "top_p" in sampling and sampling["top_p"] <= 0.0:
        raise _bad("'top_p' must be in (0, 1]", "top_p")
    max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    if max_tokens is not None:
        limit = defaults.get("max_new_tokens")
        sampling["max_new_tokens"] = min(max_tokens, int(limit)) if isinstance(limit, int) else max_tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _invalid_type("stop", "a string or an array of strings", stop)
        if not all(stops):
            raise _bad("'stop' must be a string or a list of non-empty strings", "stop")
        sampling["stop"] = list(stops)
    if body.get("logit_bias"):
        raise _bad("'logit_bias' is not supported", "logit_bias")
    return sampling


def samples_of(body: Mapping[str, Any]) -> int:
    """The ``n`` of a call (1 to 128; absent or null: 1): one ``generate_n`` with that many samples.

    Raises:
        OpenAIError: 400 for a wrong type or a value out of range.
    """
    n = _integer(body, "n", 1, _MAX_N)
    return 1 if n is None else n


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed - _IGNORED_FIELDS)
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    check_common_fields(body)


def _content_text(content: Any, index: int, *, optional: bool = False) -> str:
    name = f"messages[{index}].content"
    if content is None:
        if optional:  # an assistant message with tool calls may have none
            return ""
        raise _invalid_type(name, "a string or an array of content parts", content)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part_index, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise _invalid_type(f"{name}[{part_index}]", "an object", part)
            if not isinstance(part.get("type"), str):
                raise _missing(f"{name}[{part_index}].type")
            if part["type"] not in _TEXT_PART_TYPES:
                raise _bad(f"{name}: only text parts are supported", name)
            if not isinstance(part.get("text"), str):
                raise _invalid_type(f"{name}[{part_index}].text", "a string", part.get("text"))
            parts.append(part["text"])
        return "".join(parts)
    raise _invalid_type(name, "a string or an array of content parts", content)


def _tool_calls(value: Any, index: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``; the arguments must be a JSON object (SGLang's rule for templates)."""
    name = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise _invalid_type(name, "an array", value)
    calls = []
    for call_index, call in enumerate(value):
        where = f"{name}[{call_index}]"
        if not isinstance(call, Mapping):
            raise _invalid_type(where, "an object", call)
        if not isinstance(call.get("id"), str):
            raise _missing(f"{where}.id")
        if call.get("type", "function") != "function":
            raise _invalid_value(f"{where}.type", call.get("type"), ("function",))
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise _missing(f"{where}.function")
        for field in ("name", "arguments"):
            if not isinstance(function.get(field), str):
                raise _missing(f"{where}.function.{field}")
        # SGLang (srt/entrypoints/openai/serving_chat.py parse_tool_call_arguments) refuses what a template cannot
        # take as a mapping.
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise _bad("Assistant tool call function.arguments must be valid JSON.",
                       f"{where}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise _bad("Assistant tool call function.arguments must be a JSON object.", f"{where}.function.arguments")
        calls.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(calls)


def parse_messages(value: Any) -> tuple[Message, ...]:
    """The :class:`Message` list of an OpenAI ``messages`` array (text content, assistant tool calls, tool results).

    Tool results pair with calls as SGLang (``_tool_call_pairing_error``) and the official API
    require: a ``tool`` message answers an unanswered call of the assistant message before it
    (directly or after other tool messages), and every call of an assistant message that is
    followed by anything is answered before the next non-tool message.

    Raises:
        OpenAIError: 400 when it is not a non-empty list of messages with a known role and text content, a
            malformed tool call, or a tool message answering no call.
    """
    if value is None:
        raise _missing("messages")
    if not isinstance(value, list):
        raise _invalid_type("messages", "an array", value)
    if not value:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
                   "array instead.", "messages", "empty_array")
    messages: list[Message] = []
    pending: set[str] | None = None
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise _invalid_type(f"messages[{index}]", "an object", message)
        role = message.get("role")
        if role is None:
            raise _missing(f"messages[{index}].role")
        if role not in _ROLES:
            raise _invalid_value(f"messages[{index}].role", role, _ROLES)
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise _invalid_type(f"messages[{index}].name", "a string", message["name"])
        if role == "function" or message.get("function_call") is not None:
            raise _bad(f"messages[{index}]: function calls are not supported (use tools)", f"messages[{index}].role")
        raw_calls = message.get("tool_calls")
        if raw_calls is not None and role != "assistant":
            raise _bad(f"messages[{index}]: only assistant messages carry tool_calls", f"messages[{index}].tool_calls")
        calls = _tool_calls(raw_calls, index) if raw_calls is not None else ()
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _missing(f"messages[{index}].tool_call_id")
            if pending is None:
                raise _bad("Invalid parameter: messages with role 'tool' must be a response to a preceding message "
                           "with 'tool_calls'.", f"messages.[{index}].role")
            if call_id not in pending:
                raise _bad(f"tool_call_id {call_id!r} does not match an unanswered tool call.",
                           f"messages[{index}].tool_call_id")
            pending.discard(call_id)
            messages.append(Message(role, _content_text(message.get("content"), index), tool_call_id=call_id))
            continue
        if pending:
            raise _unanswered(pending, index - 1)
        pending = {c.id for c in calls} if calls else None
        content = _content_text(message.get("content"), index, optional=bool(calls))
        messages.append(Message(role, content, calls))
    if pending and messages[-1].role == "tool":
        raise _unanswered(pending, len(messages) - 1)
    return tuple(messages)


def _unanswered(pending: set[str], index: int) -> OpenAIError:
    return _bad("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: "
                f"{', '.join(sorted(pending))}", f"messages.[{index}].role")


def check_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Validates ``tools`` / ``tool_choice`` / ``functions`` as the API does; the tools for the chat template.

    The tools go to the agent's chat template (``tokenizer.apply_chat_template(..., tools=...)``,
    as with ``tool_choice`` "none" too); calls are parsed out of the answer by the agent's
    ``tool_call_parser`` unless ``tool_choice`` is "none". ``tool_choice`` "required" or a named
    function are refused: SGLang serves them by constraining decoding to a JSON schema or
    structural tag of the tools (srt/entrypoints/openai/serving_chat.py, ``tool_call_constraint``),
    and the episode API carries no grammar to the engine. The legacy ``functions`` are refused too.

    Returns:
        The tool definitions, or None when the call has none.

    Raises:
        OpenAIError: 400 for a malformed definition, for ``tool_choice`` without tools or naming an undeclared
            function, and for ``tool_choice`` other than "none" / "auto" (docs/gateway.md).
    """
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _invalid_type("tools", "an array", tools)
        for index, tool in enumerate(tools):
            name = f"tools[{index}]"
            if not isinstance(tool, Mapping):
                raise _invalid_type(name, "an object", tool)
            if tool.get("type") != "function":
                raise _invalid_value(f"{name}.type", tool.get("type"), ("function",))
            function = tool.get("function")
            if not isinstance(function, Mapping):
                raise _missing(f"{name}.function")
            if not isinstance(function.get("name"), str):
                raise _missing(f"{name}.function.name")
            _object(function, "parameters")
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, str | Mapping):
            raise _invalid_type("tool_choice", "a string or an object", choice)
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise _invalid_value("tool_choice", choice, ("none", "auto", "required"))
        if not tools:
            raise _bad("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                       "tool_choice")
        if isinstance(choice, Mapping):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, Mapping) or not isinstance(
                    function.get("name"), str):
                raise _missing("tool_choice.function.name")
            if function["name"] not in {t["function"]["name"] for t in tools}:
                raise _bad(f"Invalid value for 'tool_choice': function {function['name']!r} is not one of the "
                           "'tools'.", "tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise _bad("'functions' are not supported: use 'tools'", "functions")
    if choice is not None and choice not in ("none", "auto"):
        raise _bad("only tool_choice 'none' or 'auto' is supported: SGLang forces a tool call by constraining "
                   "decoding to the tools' JSON schema, and the episode API passes no grammar to the engine "
                   "(docs/gateway.md)", "tool_choice")
    return [dict(tool) for tool in tools] if tools else None


def chat_logprobs_request(body: Mapping[str, Any]) -> tuple[bool, int]:
    """Whether a chat call asks for logprobs, and how many top logprobs (``top_logprobs``: 0-20, needs ``logprobs``).

    Raises:
        OpenAIError: 400 for a wrong type or range, or ``top_logprobs`` without ``logprobs``.
    """
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, _MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("Invalid value for 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.",
                   "top_logprobs")
    return logprobs, top or 0


# ----- the server ----------------------------------------------------------------------------------


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _answer(text: str, parse: ToolCallParser | None, tools: Sequence[Mapping[str, Any]],
            ) -> tuple[str, tuple[ToolCall, ...]]:
    """The content and tool calls of a sampled text (ids ``call_<24 hex>``, as SGLang's ``_process_tool_call_id``)."""
    if parse is None:
        return text, ()
    parsed = parse(text, tools)
    return parsed.normal_text, tuple(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)
                                     for name, arguments in parsed.calls)


def _message_body(content: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [call.to_api() for call in calls]
    return message


def _usage(prompt_tokens: int, generations: Sequence[Generation]) -> dict[str, int]:
    """OpenAI's usage of one call: the prompt once, the completion tokens of every choice."""
    completion = sum(len(g.token_ids) for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _chat_logprobs(ctx: EpisodeContext, agent: str, generation: Generation) -> dict[str, Any]:
    """OpenAI's ``choices[i].logprobs``: the sampled tokens' logprobs, each with its top alternatives (if asked)."""
    content = []
    tops = generation.top_logprobs or ((),) * len(generation.token_ids)
    for token_id, logprob, top in zip(generation.token_ids, generation.logprobs, tops, strict=True):
        token = ctx.decode(agent, [token_id])
        alternatives = []
        for top_logprob, top_id in top:
            text = ctx.decode(agent, [top_id])
            alternatives.append({"token": text, "logprob": top_logprob, "bytes": list(text.encode())})
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                        "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def _listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on host:port ("" and "::" take IPv4 and IPv6 where the OS can)."""
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return socket.create_server(address, family=family)


class Gateway:
    """The OpenAI-compatible server; sessions are opened and closed by the episodes that own them."""

    def __init__(self, config: GatewayConfig | None = None, registry: CollectorRegistry | None = None) -> None:
        self.config = config or GatewayConfig()
        self.metrics = GatewayMetrics(registry if registry is not None else CollectorRegistry())
        self._sessions: dict[str, Session] = {}
        self._runner: web.AppRunner | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    # ---- lifecycle ----------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application (routes of the module docstring)."""
        app = web.Application(client_max_size=_CLIENT_MAX_SIZE, middlewares=[self._errors])
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/sessions/{sid}/v1/completions", self._completions)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_get("/sessions/{sid}/v1/models/{model}", self._model)
        app.router.add_post("/sessions/{sid}/reward", self._reward)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> int:
        """Listens on the configured host and port; returns the bound port."""
        if self._runner is not None:
            return self.port
        # The gateway owns its listening socket, so that :meth:`abandon` can close it without the loop.
        sock = _listening_socket(self.config.host, self.config.port)
        runner = web.AppRunner(self.build_app(), access_log=None)
        try:
            await runner.setup()
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner, self._socket = runner, sock
        self.port = int(sock.getsockname()[1])
        logger.info("OpenAI-compatible gateway listening on %s:%d", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Closes every session and stops listening (idempotent)."""
        for session in list(self._sessions.values()):
            await self.close_session(session)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        self._close_socket()

    def abandon(self) -> None:
        """Stops listening without the event loop (its loop has ended: :meth:`stop` can no longer run).

        Closes the listening socket, so the port is free and no descriptor leaks; the sessions are
        dropped unclosed (their episodes ended with their loop).
        """
        self._sessions.clear()
        self.metrics.sessions.set(0)
        self._runner = None
        self._close_socket()

    def _close_socket(self) -> None:
        if self._socket is not None:
            sock, self._socket = self._socket, None
            sock.close()

    @property
    def url(self) -> str:
        """The gateway's root URL as programs reach it."""
        if self._runner is None:
            raise Unavailable("the gateway is not started")
        host = self.config.advertise_host or (
            "127.0.0.1" if self.config.host in _WILDCARD_HOSTS else self.config.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # ---- sessions -----------------------------------------------------------------------------

    def open_session(self, ctx: EpisodeContext) -> Session:
        """A new session over ``ctx`` (one episode)."""
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), ctx)
        self._sessions[session.session_id] = session
        self.metrics.sessions.set(len(self._sessions))
        return session

    async def close_session(self, session: Session) -> None:
        """Ends a session: its URL answers 404 from now on and calls in flight are cancelled."""
        self._sessions.pop(session.session_id, None)
        self.metrics.sessions.set(len(self._sessions))
        await session.close()

    def base_url(self, session: Session) -> str:
        """The session's OpenAI base URL (``.../sessions/<id>/v1``)."""
        return f"{self.url}/sessions/{session.session_id}/v1"

    def api_key(self, session: Session) -> str:
        """The key a program sends as its bearer token (with the cluster token in front when one applies)."""
        token = self.config.cluster_token
        return f"{token}.{session.api_key}" if token else session.api_key

    # ---- request plumbing -------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        try:
            response = await handler(request)
        except OpenAIError as exc:
            response = exc.response()
        except web.HTTPNotFound:
            response = OpenAIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found").response()
        except web.HTTPMethodNotAllowed:
            response = OpenAIError(405, f"method {request.method} not allowed on {request.path}").response()
        except web.HTTPRequestEntityTooLarge:
            response = OpenAIError(413, f"request body over {_CLIENT_MAX_SIZE} bytes").response()
        except InvalidArgument as exc:
            response = _bad(str(exc)).response()
        except FlexmarlError as exc:
            logger.warning("gateway call %s failed: %s", request.path, exc)
            response = OpenAIError(500, f"generation failed: {exc}", type_="server_error").response()
        self.metrics.requests.labels(route, str(response.status)).inc()
        return response

    def _session(self, request: web.Request) -> Session:
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        token = self.config.cluster_token
        if token and not (scheme.lower() == "bearer" and hmac.compare_digest(
                presented.strip().encode()[: len(token) + 1], f"{token}.".encode())):
            raise OpenAIError(401, "missing or invalid bearer token", type_="invalid_request_error",
                              code="invalid_api_key")
        session = self._sessions.get(request.match_info["sid"])
        if session is None or session.closed:
            raise _session_not_found()
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(),
                                                                  self.api_key(session).encode()):
            raise OpenAIError(401, "Incorrect API key provided.", type_="invalid_request_error",
                              code="invalid_api_key")
        return session

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        return body

    @staticmethod
    def _agent(session: Session, body: Mapping[str, Any], param: str = "model") -> str:
        model = body.get(param)
        if model is None or model == "":
            raise _missing(param)
        if not isinstance(model, str):
            raise _invalid_type(param, "a string", model)
        if model not in session.ctx.agents:
            raise OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it "
                                   f"(the agents are {sorted(session.ctx.agents)}).", code="model_not_found",
                              param=param)
        return model

    # ---- handlers ---------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        session = self._session(request)
        return web.json_response({"object": "list", "data": [self._model_card(a) for a in session.ctx.agents]})

    async def _model(self, request: web.Request) -> web.Response:
        session = self._session(request)
        return web.json_response(self._model_card(self._agent(session, {"model": request.match_info["model"]})))

    @staticmethod
    def _model_card(agent: str) -> dict[str, Any]:
        return {"id": agent, "object": "model", "created": 0, "owned_by": "flexmarl"}

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._body(request)
        agent = self._agent(session, body, "agent")
        value = body.get("value")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _bad("'value' must be a finite number", "value")
        session.ctx.reward(agent, float(value))
        return web.json_response({"agent": agent, "return": session.ctx.returns()[agent]})

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        _check_fields(body, _CHAT_FIELDS)
        agent = self._agent(session, body)
        ctx = session.ctx
        messages = parse_messages(body.get("messages"))
        tools = check_tools(body)
        want_logprobs, top_logprobs = chat_logprobs_request(body)
        response_format = _object(body, "response_format")
        if response_format is not None and response_format.get("type") != "text":
            raise _bad("only response_format {'type': 'text'} is supported", "response_format")
        n = samples_of(body)
        sampling = sampling_of(body, ctx.sampling_defaults(agent))
        history = session.chat_history.setdefault(agent, [])
        parser = self.config.tool_call_parsers.get(agent)
        parse = TOOL_CALL_PARSERS[parser] if parser and tools and body.get("tool_choice") != "none" else None
        try:
            prompt = resolve_chat_prompt(ctx, agent, messages, history, tools)
        except InvalidArgument as exc:
            if tools:
                raise _bad(f"'tools' cannot be rendered for model {agent!r}: {exc}", "tools") from exc
            with_calls = [i for i, m in enumerate(messages) if m.tool_calls]
            if with_calls:
                raise _bad(f"tool calls cannot be rendered for model {agent!r}: {exc}",
                           f"messages[{with_calls[0]}].tool_calls") from exc
            raise
        generations = await session.run(lambda: ctx.generate_n(
            agent, list(prompt.input_ids), n, retokenized_messages=prompt.retokenized_messages,
            top_logprobs_num=top_logprobs, **sampling))
        answers = [_answer(g.text, parse, tools or ()) for g in generations]
        for generation, (content, calls) in zip(generations, answers, strict=True):
            history.append(ChatTurn(messages, prompt.fresh_ids, prompt.input_ids, generation.token_ids,
                                    generation.text, content, calls))
        self._count(session, agent, prompt.reused_tokens, prompt.retokenized_messages)
        version = min(g.version for g in generations)
        extra = {"behavior_version": version, "reused_prompt_tokens": prompt.reused_tokens,
                 "retokenized_messages": prompt.retokenized_messages}
        usage = _usage(len(prompt.input_ids), generations)
        logprobs = [_chat_logprobs(ctx, agent, g) if want_logprobs else None for g in generations]
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        finishes = [_finish_reason(g.finish_reason) for g in generations]
        # SGLang (serving_chat.py _process_tool_calls): a stop with parsed calls finishes as "tool_calls".
        finishes = ["tool_calls" if calls and finish == "stop" else finish
                    for finish, (_, calls) in zip(finishes, answers, strict=True)]
        if body.get("stream") is True:
            options = body.get("stream_options")
            include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
            head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": agent,
                    "system_fingerprint": f"flexmarl-v{version}"}
            chunks: list[dict[str, Any]] = []
            for i, (content, calls) in enumerate(answers):  # as OpenAI streams n > 1: each chunk names its choice
                chunks += [
                    {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]},
                    {**head, "choices": [{"index": i, "delta": {"content": content},
                                          "logprobs": logprobs[i], "finish_reason": None}]},
                ]
                if calls:
                    deltas = [{"index": k, **call.to_api()} for k, call in enumerate(calls)]
                    chunks.append({**head, "choices": [{"index": i, "delta": {"tool_calls": deltas},
                                                        "logprobs": None, "finish_reason": None}]})
            for i, finish in enumerate(finishes):
                chunk: dict[str, Any] = {**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                              "finish_reason": finish}]}
                if i == len(finishes) - 1:
                    chunk["flexmarl"] = extra
                chunks.append(chunk)
            if include_usage:
                chunks.append({**head, "choices": [], "usage": usage})
            return await self._stream(request, chunks)
        return web.json_response({
            "id": completion_id, "object": "chat.completion", "created": created, "model": agent,
            "system_fingerprint": f"flexmarl-v{version}",
            "choices": [{"index": i, "message": _message_body(*answers[i]), "logprobs": logprobs[i],
                         "finish_reason": finishes[i]} for i in range(len(generations))],
            "usage": usage, "flexmarl": extra,
        })

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        _check_fields(body, _COMPLETION_FIELDS)
        agent = self._agent(session, body)
        ctx = session.ctx
        prompt = body.get("prompt")
        if prompt is None:
            raise _missing("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string (one prompt per call)", "prompt")
        if _boolean(body, "echo"):
            raise _bad("'echo' is not supported", "echo")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _invalid_type("suffix", "a string", suffix)
        if suffix:
            raise _bad("'suffix' is not supported", "suffix")
        best_of = _integer(body, "best_of", 1, 20)
        if best_of is not None and best_of != 1:
            raise _bad("only best_of=1 is supported", "best_of")
        logprobs_n = _integer(body, "logprobs", 0, _MAX_COMPLETION_LOGPROBS)
        n = samples_of(body)
        sampling = sampling_of(body, ctx.sampling_defaults(agent))
        history = session.completion_history.setdefault(agent, [])
        input_ids, reused = self._completion_prompt(ctx, agent, prompt, history)
        generations = await session.run(lambda: ctx.generate_n(agent, list(input_ids), n,
                                                               top_logprobs_num=logprobs_n or 0, **sampling))
        for generation in generations:
            history.append((prompt, input_ids, generation.token_ids, generation.text))
        self._count(session, agent, reused, 0)
        choices = []
        for i, generation in enumerate(generations):
            logprobs = None
            if logprobs_n is not None:
                tokens = [ctx.decode(agent, [t]) for t in generation.token_ids]
                offsets, offset = [], 0
                for token in tokens:
                    offsets.append(offset)
                    offset += len(token)
                # as SGLang's serving_completions.py (and the legacy API): per token, {token text: logprob}
                top = [{ctx.decode(agent, [t]): lp for lp, t in position} for position in generation.top_logprobs]
                logprobs = {"tokens": tokens, "token_logprobs": list(generation.logprobs),
                            "top_logprobs": top if logprobs_n else None, "text_offset": offsets}
            choices.append({"index": i, "text": generation.text, "logprobs": logprobs,
                            "finish_reason": _finish_reason(generation.finish_reason)})
        usage = _usage(len(input_ids), generations)
        version = min(g.version for g in generations)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": agent, "system_fingerprint": f"flexmarl-v{version}"}
        extra = {"behavior_version": version, "reused_prompt_tokens": reused, "retokenized_messages": 0}
        if body.get("stream") is True:
            options = body.get("stream_options")
            chunks: list[dict[str, Any]] = [{**head, "choices": [choice]} for choice in choices]
            chunks[-1]["flexmarl"] = extra
            if isinstance(options, Mapping) and options.get("include_usage") is True:
                chunks.append({**head, "choices": [], "usage": usage})
            return await self._stream(request, chunks)
        return web.json_response({**head, "choices": choices, "usage": usage, "flexmarl": extra})

    @staticmethod
    def _completion_prompt(ctx: EpisodeContext, agent: str, prompt: str,
                           history: Sequence[tuple[str, tuple[int, ...], tuple[int, ...], str]],
                           ) -> tuple[tuple[int, ...], int]:
        """The prompt's ids: an earlier call's prompt + sampled ids when the prompt continues that call's text."""
        best = None
        for earlier in history:
            text = earlier[0] + earlier[3]
            if prompt.startswith(text) and (best is None or len(text) > len(best[0] + best[3])):
                best = earlier
        if best is None:
            return tuple(ctx.tokenize(agent, prompt)), 0
        rest = prompt[len(best[0] + best[3]):]
        reused = best[1] + best[2]
        return reused + (tuple(ctx.tokenize(agent, rest)) if rest else ()), len(reused)

    def _count(self, session: Session, agent: str, reused: int, retokenized: int) -> None:
        session.calls += 1
        session.retokenized_messages += retokenized
        if reused:
            self.metrics.reused_tokens.labels(agent).inc(reused)
        if retokenized:
            self.metrics.retokenized.labels(agent).inc(retokenized)
            logger.info("agent %s: %d assistant message(s) matched no earlier turn; re-tokenized from text",
                        agent, retokenized)

    @staticmethod
    async def _stream(request: web.Request, chunks: Sequence[Mapping[str, Any]]) -> web.StreamResponse:
        """Server-sent events as OpenAI frames them: one ``data: <json>`` event per chunk, then ``data: [DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
