"""The SGLang-protocol HTTP server every engine FlexMARL ships speaks, over a small backend interface.

The embedded engine (:mod:`rolloutd.engines.embedded`) and the synthetic engine
(:mod:`benchmarks.synthetic_engine`) implement :class:`EngineBackend`; this module owns what a
client sees: routes, methods, body parsing, validation, rids and error shapes, each as SGLang
0.5.23 does it, never kinder. The SGLang files mirrored:

* routes and methods: sglang/srt/entrypoints/http_server.py (``/generate`` POST and PUT;
  ``/health`` and ``/health_generate`` GET, both generating one token since
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` defaults on; ``/model_info``, ``/get_model_info``,
  ``/server_info``, ``/get_server_info`` GET; ``/flush_cache`` GET and POST, 400 while requests
  run or wait; ``/abort_request``, ``/update_weights_from_disk``, ``/update_weight_version``
  POST; ``/v1/loads`` GET from sglang/srt/entrypoints/v1_loads.py). There is no
  ``/get_weight_version`` in 0.5.23; the weight version is ``/model_info``'s ``weight_version``.
* error bodies: a body that is not JSON (or not sent as ``application/json``) fails FastAPI's
  request validation: 400 with the ``ErrorResponse`` shape (``validation_exception_handler``).
  A ``/generate`` body that breaks the contract of sglang/api/v1/api_types.py (an unknown
  ``sampling_params`` key such as ``seed``, a wrong JSON type) is refused by the contract gate
  (sglang/srt/entrypoints/api_contract.py) with 400 ``{"error": "<text>"}``. A ``ValueError``
  raised while the tokenizer manager normalises and checks the request is 400
  ``{"error": {"message": ...}}`` (``_create_error_response``).
* rids (sglang/srt/managers/io_struct.py ``_normalize_rid``, ``regenerate_rid``;
  tokenizer_manager.py ``_handle_batch_request``, ``_init_req_state``): a batch with one rid
  string gets ``rid_0``, ``rid_1``...; every sample of an ``n > 1`` request runs under a fresh
  uuid rid, which is the ``meta_info.id`` it reports; a rid already in flight is a 400.
* abort (tokenizer_manager.py ``abort_request``, scheduler.py ``abort_request``): an empty rid
  without ``abort_all`` is ignored; a rid the server does not know exactly (an unknown rid,
  the rid of an ``n > 1`` request, a prefix) is a no-op; a known rid is passed to the
  scheduler, which aborts every request whose rid starts with it. ``abort_all`` aborts all.

The synthetic engine also serves ``/get_load`` (``serve_get_load``), which sglang-router's
``power_of_two`` policy polls; SGLang 0.5.23's own server does not.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from flexmarl.errors import FlexmarlError, InvalidArgument
from rolloutd.engines.protocol import ContractViolation, SamplingParams, check_sampling_contract, parse_input_ids

logger = logging.getLogger(__name__)

# http_server.py: HEALTH_CHECK_TIMEOUT (SGLANG_HEALTH_CHECK_TIMEOUT, default 20 s); the health
# handler looks for a scheduler response once a second, so a health check takes >= 1 s.
HEALTH_CHECK_TIMEOUT_S = 20.0
HEALTH_CHECK_POLL_S = 1.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
FLUSH_CACHE_OK_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_CACHE_FAILED_TEXT = "Flush cache failed.\n"
_CLIENT_MAX_SIZE = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One sample to generate: SGLang's scheduler request after the tokenizer manager expanded ``n``.

    ``params.n`` is always 1 here; an ``n > 1`` request becomes ``n`` of these with fresh rids.
    """

    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool
    created_s: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    """One replica's load in the vocabulary of sglang/srt/managers/scheduler_components/load_inquirer.py.

    ``num_total_tokens`` is the used KV tokens plus the tokens of the queued requests, as
    SGLang's ``get_loads`` computes it (not the capacity: that is ``max_total_num_tokens``).
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_waiting_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float

    @property
    def num_total_tokens(self) -> int:
        """Used KV tokens plus queued request tokens."""
        return self.num_used_tokens + self.num_waiting_tokens


class EngineBackend(abc.ABC):
    """What an engine implements under :class:`SGLangServer` (the scheduler and model side).

    Methods run on the server's event loop; a backend with a worker thread hands results back
    through the futures it returns.
    """

    #: Name in error messages and ``/server_info`` (``"embedded"``, ``"synthetic"``).
    name: str = "engine"
    #: ``version`` field of ``/server_info`` and ``/v1/loads``.
    version: str = "flexmarl"

    @abc.abstractmethod
    async def start(self, port: int) -> None:
        """Start scheduling (the server listens on ``port``)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop scheduling; whatever is pending fails (idempotent)."""

    @abc.abstractmethod
    def check(self, request: SampleRequest) -> None:
        """Raise :class:`InvalidArgument` when the backend cannot serve ``request`` (context, vocab)."""

    @abc.abstractmethod
    def submit(self, request: SampleRequest) -> asyncio.Future[dict[str, Any]]:
        """Queue one sample; the future resolves with its ``/generate`` output object.

        Raises:
            Unavailable: The backend is stopping.
        """

    @abc.abstractmethod
    def abort(self, rid: str, abort_all: bool) -> None:
        """Abort queued and running samples whose rid starts with ``rid`` (or all): scheduler.py semantics."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, load_format: str | None, weight_version: str) -> None:
        """Swap in the checkpoint at ``model_path`` once the running samples finished.

        Raises:
            InvalidArgument: The checkpoint cannot be loaded or does not fit the served model.
        """

    @abc.abstractmethod
    def set_weight_version(self, weight_version: str) -> None:
        """Rename the weights being served (``/update_weight_version``)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> str:
        """The weight version being served."""

    @property
    @abc.abstractmethod
    def last_output_s(self) -> float:
        """``time.monotonic()`` of the scheduler's last output (a decode step or a finished sample)."""

    @abc.abstractmethod
    def load_snapshot(self) -> LoadSnapshot:
        """Current queue and batch sizes."""

    @abc.abstractmethod
    def flush_cache(self) -> bool:
        """Flush cached prefixes; False (refused) while samples run or wait, as SGLang's scheduler."""

    @abc.abstractmethod
    def model_info(self) -> dict[str, Any]:
        """``/model_info`` fields."""

    @abc.abstractmethod
    def server_info(self) -> dict[str, Any]:
        """``/server_info`` fields (server arguments and internal state)."""


# ----- output objects shared by the backends --------------------------------------------
def first_sample(job: asyncio.Future[list[dict[str, Any]]]) -> asyncio.Future[dict[str, Any]]:
    """A future of the one output of a one-sample job's future (cancellation and errors carried over)."""
    sample: asyncio.Future[dict[str, Any]] = job.get_loop().create_future()

    def relay(done: asyncio.Future[list[dict[str, Any]]]) -> None:
        if sample.done():
            return
        if done.cancelled():
            sample.cancel()
        elif (exc := done.exception()) is not None:
            sample.set_exception(exc)
        else:
            sample.set_result(done.result()[0])

    job.add_done_callback(relay)
    return sample


def running_abort_reason() -> dict[str, Any]:
    """``finish_reason`` of a sample aborted while running (schedule_batch.py ``FINISH_ABORT()``)."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def sample_output(
    request: SampleRequest,
    output_ids: Sequence[int],
    logprobs: Sequence[float],
    reason: Mapping[str, Any],
    *,
    text: str,
    weight_version: str,
    model_path: str,
) -> dict[str, Any]:
    """The ``/generate`` object of a finished (or running-aborted) sample.

    ``model_path`` in ``meta_info`` is a FlexMARL extension: the checkpoint that produced it.
    """
    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": dict(reason),
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
        "model_path": model_path,
        "e2e_latency": time.monotonic() - request.created_s,
    }
    if request.return_logprob:
        # SGLang's shape: one [logprob, token_id, text-or-null] triple per output token.
        meta_info["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, output_ids, strict=True)]
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info}


def queued_abort_output(request: SampleRequest, weight_version: str) -> dict[str, Any]:
    """The object of a sample aborted in the waiting queue (tokenizer_manager.py ``_handle_abort_req``).

    SGLang answers it with fewer ``meta_info`` fields than a finished sample: no
    ``prompt_tokens`` and no ``cached_tokens``.
    """
    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": weight_version,
        "e2e_latency": time.monotonic() - request.created_s,
        "completion_tokens": 0,
    }
    if request.return_logprob:
        meta_info["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta_info}


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


class _ValidationFailure(Exception):
    """The body failed FastAPI-level parsing (not JSON, wrong content type, missing field)."""


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The JSON object body, parsed as FastAPI parses a body parameter.

    FastAPI reads the body as JSON only when the content type is absent or ``application/json``
    (or ``application/*+json``); anything else, or bytes that are not a JSON object, fail
    validation.
    """
    content_type = request.headers.get("Content-Type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type and not (media_type == "application/json" or media_type.endswith("+json")):
        raise _ValidationFailure(f"body of content type {media_type!r} is not a JSON object")
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _ValidationFailure(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise _ValidationFailure("Input should be a valid dictionary or object to extract fields from")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_generate_fields(body: Mapping[str, Any]) -> None:
    """Raise :class:`_ValidationFailure` where FastAPI's parse of ``GenerateReqInput`` would fail.

    Unknown top-level keys are ignored by SGLang (sglang/api/v1/api_types.py ``GenerateRequest``:
    "unknown keys ignored") and here; the fields FlexMARL's engines read are type-checked.
    """
    for key in ("stream", "return_text_in_logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _ValidationFailure(f"{key}: Input should be a valid boolean")
    rid = body.get("rid")
    if rid is not None and not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise _ValidationFailure("rid: Input should be a valid string or a list of strings")
    logprob = body.get("return_logprob")
    if logprob is not None and not (
        isinstance(logprob, bool) or (isinstance(logprob, list) and all(isinstance(v, bool) for v in logprob))
    ):
        raise _ValidationFailure("return_logprob: Input should be a valid boolean or a list of booleans")
    input_ids = body.get("input_ids")
    if input_ids is not None:
        flat = isinstance(input_ids, list) and all(_is_int(t) for t in input_ids)
        nested = isinstance(input_ids, list) and all(
            isinstance(p, list) and all(_is_int(t) for t in p) for p in input_ids
        )
        if not (flat or nested):
            raise _ValidationFailure("input_ids: Input should be a list of integers or a list of lists of integers")
    sampling = body.get("sampling_params")
    if sampling is not None and not isinstance(sampling, (dict, list)):
        raise _ValidationFailure("sampling_params: Input should be a valid dictionary or list")


def _check_sampling_contracts(body: Mapping[str, Any]) -> None:
    """The contract gate on every ``sampling_params`` object (raises :class:`ContractViolation`)."""
    sampling = body.get("sampling_params")
    if sampling is not None:
        for wire in sampling if isinstance(sampling, list) else [sampling]:
            check_sampling_contract(wire)


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve a finished probe's outcome, so a failed one logs no 'never retrieved' warning."""
    if not future.cancelled():
        future.exception()


class SGLangServer:
    """SGLang's native HTTP API around one :class:`EngineBackend` (one aiohttp app, one port)."""

    def __init__(self, backend: EngineBackend, *, serve_get_load: bool = False) -> None:
        self.backend = backend
        self.serve_get_load = serve_get_load
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._ready = False
        self._inflight: dict[str, SampleRequest] = {}  # the tokenizer manager's rid_to_state

    # ----- lifecycle ------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        """Routes and methods as in SGLang's http_server.py (the subset FlexMARL serves)."""
        app = web.Application(client_max_size=_CLIENT_MAX_SIZE)
        for method in ("POST", "PUT"):
            app.router.add_route(method, "/generate", self.generate)
        app.router.add_get("/health", self.health_generate)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        for method in ("GET", "POST"):
            app.router.add_route(method, "/flush_cache", self.flush_cache)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        if self.serve_get_load:
            app.router.add_get("/get_load", self.get_load)
        return app

    async def start(self, host: str, port: int, *, backlog: int = 128) -> int:
        """Listen, start the backend and return the bound port."""
        self._runner = web.AppRunner(self.build_app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, backlog=backlog).start()
        self.port = int(self._runner.addresses[0][1])
        await self.backend.start(self.port)
        self._ready = True
        return self.port

    async def stop(self) -> None:
        """Answer 503 to health checks, stop the backend, stop listening (idempotent)."""
        self._ready = False
        await self.backend.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----- /generate ------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``/generate``: one object for one prompt with n == 1, else a list (prompt-major)."""
        try:
            body = await _json_object(request)
            _check_generate_fields(body)
        except _ValidationFailure as exc:
            return validation_error(str(exc))
        try:
            _check_sampling_contracts(body)
        except ContractViolation as exc:
            return contract_error(str(exc))
        try:
            samples, single = self._normalize(body)
            self._register(samples)
        except InvalidArgument as exc:
            return value_error(str(exc))
        try:
            for sample in samples:
                self.backend.check(sample)
            futures = [self.backend.submit(sample) for sample in samples]
        except InvalidArgument as exc:
            self._unregister(samples)
            return value_error(str(exc))
        except FlexmarlError as exc:
            self._unregister(samples)
            return value_error(str(exc), status=503)
        try:
            outputs = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            # The client went away: SGLang aborts the request (tokenizer_manager.py, disconnect).
            for sample in samples:
                self.backend.abort(sample.rid, abort_all=False)
            raise
        except FlexmarlError as exc:
            return value_error(str(exc), status=503)
        finally:
            self._unregister(samples)
        return web.json_response(outputs[0] if single else list(outputs))

    def _normalize(self, body: Mapping[str, Any]) -> tuple[list[SampleRequest], bool]:
        """The samples of a ``/generate`` body (GenerateReqInput.normalize_batch_and_arguments)."""
        if body.get("stream"):
            raise InvalidArgument(f"stream is not supported by the {self.backend.name} engine")
        if body.get("input_ids") is None:
            if body.get("text") is not None:
                raise InvalidArgument(f"text input is not supported by the {self.backend.name} engine (send input_ids)")
            raise InvalidArgument("Either text, input_ids or input_embeds should be provided.")
        prompts = parse_input_ids(body["input_ids"])
        batch = isinstance(body["input_ids"][0], list)
        raw_params = body.get("sampling_params") or {}
        params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgument("The number of sampling_params does not match the number of prompts.")
        engine = f"the {self.backend.name} engine"
        parsed = [SamplingParams.from_wire(raw, engine=engine) for raw in params_list]
        n = parsed[0].n
        if any(p.n != n for p in parsed):
            raise InvalidArgument("The parallel_sample_num should be the same for all samples in sample params.")
        logprob_field = body.get("return_logprob")
        if isinstance(logprob_field, list) and len(logprob_field) != len(prompts):
            raise InvalidArgument("return_logprob must have one entry per prompt")
        rids = self._prompt_rids(body.get("rid"), len(prompts), batch or n > 1)
        samples: list[SampleRequest] = []
        for index, (prompt, params) in enumerate(zip(prompts, parsed, strict=True)):
            wants = logprob_field[index] if isinstance(logprob_field, list) else bool(logprob_field)
            one = dataclasses.replace(params, n=1)
            if n == 1:
                samples.append(SampleRequest(rids[index], tuple(prompt), one, wants))
            else:  # regenerate_rid: every sample of a parallel-sampling request gets a fresh rid
                samples += [SampleRequest(uuid.uuid4().hex, tuple(prompt), one, wants) for _ in range(n)]
        return samples, not batch and n == 1

    @staticmethod
    def _prompt_rids(rid: Any, count: int, batch: bool) -> list[str]:
        """io_struct.py ``_normalize_rid``: uuids, ``rid`` itself, ``rid_i``, or the given list."""
        if rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        if isinstance(rid, str):
            return [rid] if not batch else [f"{rid}_{i}" for i in range(count)]
        if len(rid) != count:
            raise InvalidArgument("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            raise InvalidArgument(f"Duplicate request IDs detected within the request: {sorted(set(rid))}")
        return [str(r) for r in rid]

    def _register(self, samples: Sequence[SampleRequest]) -> None:
        """Record the samples' rids as in flight; a rid already in flight is a 400 (``_init_req_state``)."""
        for sample in samples:
            if sample.rid in self._inflight:
                raise InvalidArgument(f"Duplicate request ID detected: {sample.rid}")
        for sample in samples:
            self._inflight[sample.rid] = sample

    def _unregister(self, samples: Sequence[SampleRequest]) -> None:
        for sample in samples:
            if self._inflight.get(sample.rid) is sample:
                del self._inflight[sample.rid]

    # ----- control routes --------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request`` ``{"rid", "abort_all"}`` with tokenizer_manager.py's gates."""
        try:
            body = await _json_object(request)
        except _ValidationFailure as exc:
            return validation_error(str(exc))
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            return validation_error("rid must be a string and abort_all a boolean")
        if not abort_all and not rid:
            logger.warning("Ignore abort_request with empty rid and abort_all=False")
        elif abort_all or rid in self._inflight:
            self.backend.abort(rid, abort_all)
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk``: ``{"success", "message", "num_paused_requests"}``, 400 on failure."""
        try:
            body = await _json_object(request)
            model_path, load_format = body.get("model_path"), body.get("load_format")
            version = body.get("weight_version")
            if not isinstance(model_path, str):
                raise _ValidationFailure("model_path: Field required (a string)")
            if load_format is not None and not isinstance(load_format, str):
                raise _ValidationFailure("load_format must be a string")
            if version is not None and not isinstance(version, str):
                raise _ValidationFailure("weight_version must be a string")
        except _ValidationFailure as exc:
            return validation_error(str(exc))
        if body.get("abort_all_requests"):
            self.backend.abort("", abort_all=True)
        new_version = self.backend.weight_version if version is None else version
        try:
            await self.backend.update_weights_from_disk(model_path, load_format, new_version)
        except InvalidArgument as exc:
            failed = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return web.json_response(failed, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version`` ``{"new_version", "abort_all_requests" = true}``."""
        try:
            body = await _json_object(request)
            new_version = body.get("new_version")
            if not isinstance(new_version, str):
                raise _ValidationFailure("new_version: Field required (a string)")
        except _ValidationFailure as exc:
            return validation_error(str(exc))
        if body.get("abort_all_requests", True):
            self.backend.abort("", abort_all=True)
        self.backend.set_weight_version(new_version)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        """``/health`` and ``/health_generate``: 200 once the scheduler answers after the check began.

        As http_server.py: a one-token greedy request is queued, and any scheduler output since
        the check began counts (a busy replica answers through its running batch); 503 while
        starting or stopping, or after ``HEALTH_CHECK_TIMEOUT_S`` without an answer.
        """
        if not self._ready:
            return web.Response(status=503)
        started_s = time.monotonic()
        probe = SampleRequest(
            f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
            (0,),
            SamplingParams(temperature=0.0, max_new_tokens=1),
            False,
        )
        try:
            future = self.backend.submit(probe)
        except FlexmarlError:
            return web.Response(status=503)
        try:
            while time.monotonic() < started_s + HEALTH_CHECK_TIMEOUT_S:
                await asyncio.sleep(HEALTH_CHECK_POLL_S)
                if self.backend.last_output_s > started_s and self._ready:
                    return web.Response(status=200)
            logger.error("health check failed: no scheduler output for %.0f s", HEALTH_CHECK_TIMEOUT_S)
            return web.Response(status=503)
        finally:
            future.add_done_callback(_consume)
            if not future.done():
                self.backend.abort(probe.rid, abort_all=False)

    async def model_info(self, request: web.Request) -> web.Response:
        """``/model_info`` (and the deprecated ``/get_model_info``)."""
        return web.json_response(self.backend.model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        """``/server_info`` (and the deprecated ``/get_server_info``)."""
        return web.json_response({**self.backend.server_info(), "version": self.backend.version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """``/flush_cache``: 200 when idle, 400 while requests run or wait (scheduler.py ``flush_cache``)."""
        if self.backend.flush_cache():
            return web.Response(text=FLUSH_CACHE_OK_TEXT, status=200)
        return web.Response(text=FLUSH_CACHE_FAILED_TEXT, status=400)

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads``: the ``core`` fields of SGLang's per-DP-rank load, one rank."""
        snapshot = self.backend.load_snapshot()
        capacity = max(snapshot.max_total_num_tokens, 1)
        load = {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": snapshot.num_running_reqs,
            "num_waiting_reqs": snapshot.num_waiting_reqs,
            "num_used_tokens": snapshot.num_used_tokens,
            "num_total_tokens": snapshot.num_total_tokens,
            "max_total_num_tokens": snapshot.max_total_num_tokens,
            "token_usage": round(snapshot.num_used_tokens / capacity, 4),
            "max_running_requests": snapshot.max_running_requests,
            "gen_throughput": snapshot.gen_throughput,
            "utilization": 1.0 if snapshot.num_running_reqs else 0.0,
            "cache_hit_rate": 0.0,
        }
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": self.backend.version,
                "accelerator": None,
                "num_accelerators": 0,
                "loads": [load],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load`` (synthetic only): sglang-router's power-of-two policy reads ``num_tokens``."""
        snapshot = self.backend.load_snapshot()
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": snapshot.num_running_reqs + snapshot.num_waiting_reqs,
                    "num_waiting_reqs": snapshot.num_waiting_reqs,
                    "num_tokens": snapshot.num_total_tokens,
                }
            ]
        )


__all__ = [
    "EngineBackend",
    "LoadSnapshot",
    "SGLangServer",
    "SampleRequest",
    "queued_abort_output",
    "running_abort_reason",
    "sample_output",
]
