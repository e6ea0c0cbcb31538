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
re-tokenization of the text (:func:`rolloutd.gateway.prompts.resolve_chat_prompt`). An assistant message that matches no
earlier turn is re-tokenized from its text; the response says so (``flexmarl.retokenized_messages``),
so do the ``flexmarl_gateway_retokenized_messages_total`` counter and the experience
(``ExperienceRecord.retokenized_messages``).

Tool calls: assistant ``tool_calls`` and ``tool`` messages go to the chat template; with the
agent's ``tool_call_parser`` (SGLang's qwen25 / hermes detectors) calls are parsed out of the
sampled text into ``tool_calls`` (finish ``"tool_calls"``), and a call sent back is matched to
its recorded ids on the parsed call. Top logprobs (``top_logprobs`` / completions ``logprobs``)
are the engine's (SGLang's ``top_logprobs_num``).

Errors are OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 404 for an unknown
session, route or model (agent), 400 for a malformed body (the request models of
:mod:`rolloutd.gateway.schemas` validate it as the official API does: ``invalid_type``,
``missing_required_parameter``, ``invalid_value``, range codes, with ``param`` naming the
field) or an unsupported parameter (``tool_choice`` "required", ``echo``, ...; docs/gateway.md
says why each is refused), 401 for a wrong API key. Every error
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
from rolloutd.gateway.prompts import ChatTurn, ToolCall, resolve_chat_prompt
from rolloutd.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    RewardRequest,
    bad_request,
    json_object,
    parse_request,
)
from rolloutd.gateway.tool_calls import TOOL_CALL_PARSERS, ToolCallParser

logger = logging.getLogger(__name__)

_CLIENT_MAX_SIZE = 16 << 20
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


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
            response = bad_request(str(exc)).response()
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
        return json_object(await request.read())

    @staticmethod
    def _agent(session: Session, model: str, param: str = "model") -> str:
        """The agent a call names (a model of the official API): 404 when the episode has no such agent."""
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
        return web.json_response(self._model_card(self._agent(session, request.match_info["model"])))

    @staticmethod
    def _model_card(agent: str) -> dict[str, Any]:
        return {"id": agent, "object": "model", "created": 0, "owned_by": "flexmarl"}

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session(request)
        reward = parse_request(RewardRequest, await self._body(request))
        agent = self._agent(session, reward.agent, "agent")
        session.ctx.reward(agent, reward.value)
        return web.json_response({"agent": agent, "return": session.ctx.returns()[agent]})

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request)
        call = parse_request(ChatCompletionRequest, body)
        agent = self._agent(session, call.model)
        ctx = session.ctx
        messages = call.template_messages()
        # The tools go to the chat template as sent (``apply_chat_template(..., tools=...)``, as with
        # ``tool_choice`` "none" too); calls are parsed out of the answer unless ``tool_choice`` is "none".
        tools = [dict(tool) for tool in body["tools"]] if call.tools else None
        want_logprobs, top_logprobs = call.logprobs, call.top_logprobs or 0
        n = call.n
        sampling = call.sampling(ctx.sampling_defaults(agent))
        history = session.chat_history.setdefault(agent, [])
        parser = self.config.tool_call_parsers.get(agent)
        parse = TOOL_CALL_PARSERS[parser] if parser and tools and call.tool_choice != "none" else None
        try:
            prompt = resolve_chat_prompt(ctx, agent, messages, history, tools)
        except InvalidArgument as exc:
            if tools:
                raise bad_request(f"'tools' cannot be rendered for model {agent!r}: {exc}", "tools") from exc
            with_calls = [i for i, m in enumerate(messages) if m.tool_calls]
            if with_calls:
                raise bad_request(f"tool calls cannot be rendered for model {agent!r}: {exc}",
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
        if call.stream:
            include_usage = call.include_usage
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
        call = parse_request(CompletionRequest, await self._body(request))
        agent = self._agent(session, call.model)
        ctx = session.ctx
        prompt = call.text
        logprobs_n = call.logprobs
        n = call.n
        sampling = call.sampling(ctx.sampling_defaults(agent))
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
        if call.stream:
            chunks: list[dict[str, Any]] = [{**head, "choices": [choice]} for choice in choices]
            chunks[-1]["flexmarl"] = extra
            if call.include_usage:
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
