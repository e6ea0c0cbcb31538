"""The SGLang-protocol HTTP server every engine FlexMARL ships speaks, over a small backend interface.

The embedded engine (:class:`rolloutd.engines.embedded.backend.EmbeddedBackend`) and the synthetic
engine (:mod:`benchmarks.synthetic_engine`) implement
:class:`~rolloutd.engines.embedded.interface.EngineBackend`; this module owns what a
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
  A running request that is aborted answers 200 with the tokens (and logprobs) it has and
  ``finish_reason`` ``{"type": "abort", "message": "Aborted", ...}``; one aborted in the
  waiting queue answers ``"Abort in waiting queue"`` with what the tokenizer manager had
  received of it (nothing, or for a request retracted by a pause, its tokens up to the last
  multiple of ``SGLANG_FORCE_STREAM_INTERVAL``: output_streamer.py sends a non-streaming
  request's tokens every 50).
* pause (tokenizer_manager.py ``pause_generation``, ``continue_generation``; scheduler.py
  ``pause_generation``, ``continue_generation``; io_struct.py ``PauseGenerationReqInput``,
  ``ContinueGenerationReqInput``): ``/pause_generation`` ``{"mode"}`` (``"abort"`` by
  default) and ``/continue_generation`` ``{}`` both need a JSON object body. While paused,
  a new ``/generate`` is parsed and its rid registered, then it waits (no error) until
  ``/continue_generation``. ``abort`` aborts every request every second until none is in
  flight, then answers (the scheduler itself is not paused); ``in_place`` stops the
  scheduler between iterations, the running requests keeping their KV cache; ``retract``
  stops it and moves the running requests back to the waiting queue (their KV cache freed;
  on continue each re-prefills its prompt plus the tokens it has, with the weights then
  served). ``/update_weights_from_disk`` while paused does not wait for running requests:
  the weights change under them, and with ``flush_cache`` (default true) it answers 400
  ``success: false`` ("Weights were updated, but the cache was not flushed ...") when
  requests still run (``in_place``), though the weights and the scheduler's version did
  change; ``/model_info`` keeps the version of the last successful update.
* weight versions (sglang/srt/utils/weight_versions.py): every answer carries
  ``meta_info.weight_versions``, the ``{"version", "start", "end"}`` spans of output tokens by
  the weight version serving when they were produced (a version change is recorded for every
  live request that has tokens), and ``weight_version``, the version of the last span.

* weight-update groups (http_server.py ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``, ``/begin_weight_update``,
  ``/end_weight_update``; io_struct.py ``InitWeightsUpdateGroupReqInput``,
  ``UpdateWeightsFromDistributedReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
  ``BeginWeightUpdateReqInput``, ``EndWeightUpdateReqInput``; tokenizer_control_mixin.py): every
  answer is ``{"success", "message"}``, 200 or 400. An update runs only between begin and end
  (a session, scheduler_components/weight_updater.py); ``abort_all_requests`` aborts first; not
  paused, it waits for running requests (the model lock), paused it applies at once under them;
  each call's tensors are loaded as soon as they are received (a multi-call update is torn
  unless the caller pauses around it); ``weight_version`` is recorded only by a successful call
  and ``flush_cache`` is checked as for ``/update_weights_from_disk``.

* LoRA adapters (http_server.py ``/load_lora_adapter``, ``/unload_lora_adapter``, ``/v1/models``;
  io_struct.py ``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``, ``LoRAUpdateOutput``,
  ``GenerateReqInput.lora_path``): the tokenizer manager's half lives here (lora_registry.py and
  tokenizer_control_mixin.py, see :mod:`rolloutd.engines.lora`): names, LRU eviction past
  ``--max-loaded-loras``, unloads that wait for the requests using an adapter, implicit reloads;
  the backend loads, validates and applies the adapters (lora_manager.py). A request's adapters
  are resolved after the pause gate, before its sampling parameters are parsed.

The synthetic engine also serves ``/get_load`` (``serve_get_load``), which sglang-router's
``power_of_two`` policy polls; SGLang 0.5.23's own server does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from flexmarl.errors import FlexmarlError, InvalidArgument
from rolloutd.engines.embedded.adapter_names import AdapterNames
from rolloutd.engines.embedded.interface import DistributedUpdate, EngineBackend, SampleRequest
from rolloutd.engines.embedded.outputs import FLUSH_AFTER_UPDATE_FAILED
from rolloutd.engines.embedded.schemas import (
    AbortReq,
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    RequestInvalid,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightVersionReqInput,
    check_generate_contracts,
    contract_error,
    parse_body,
    validation_error,
    value_error,
)
from rolloutd.engines.protocol import ContractViolation, SamplingParams, parse_input_ids

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
#: tokenizer_manager.py pause_generation(mode="abort"): abort all, then re-check every second.
PAUSE_ABORT_POLL_S = 1.0


def _consume(future: asyncio.Future[Any]) -> None:
    """Retrieve a finished probe's outcome, so a failed one logs no 'never retrieved' warning."""
    if not future.cancelled():
        future.exception()


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A ``/generate`` body after normalisation: prompts, raw sampling objects, rids, samples per prompt."""

    prompts: list[list[int]]
    params: list[Mapping[str, Any]]
    rids: list[str]
    n: int
    single: bool
    created_s: float = dataclasses.field(default_factory=time.monotonic)  # e2e latency counts a pause wait



def _outcome(success: bool, message: str) -> web.Response:
    """The ``{"success", "message"}`` answer of SGLang's weight-update routes: 200, or 400 on failure."""
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)



def _model_card(model_id: str, root: str, parent: str | None, max_model_len: Any, created: int) -> dict[str, Any]:
    """sglang/srt/entrypoints/openai/protocol.py ``ModelCard``."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


class SGLangServer:
    """SGLang's native HTTP API around one :class:`EngineBackend` (one aiohttp app, one port)."""

    def __init__(self, backend: EngineBackend, *, serve_get_load: bool = False) -> None:
        self.backend = backend
        self.serve_get_load = serve_get_load
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._ready = False
        self._inflight: dict[str, object] = {}  # the tokenizer manager's rid_to_state
        # tokenizer_manager.py is_pause / is_pause_cond: pause and continue hold the condition's
        # lock while they run; a /generate waits on it before it reaches the scheduler.
        self._paused = False
        self._pause_cond = asyncio.Condition()
        # model_update_lock: readers are the /generate calls past the pause gate, the writer an
        # update that is not made while paused.
        self._generating = 0
        self._updating = 0
        # The tokenizer manager's weight_version (/model_info): set by a successful update only.
        self._info_weight_version: str | None = None
        self._lora = AdapterNames(backend)

    @property
    def paused(self) -> bool:
        """Whether generation is paused (``/pause_generation`` without ``/continue_generation`` yet)."""
        return self._paused

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
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/init_weights_update_group", self.init_weights_update_group)
        app.router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.router.add_post("/begin_weight_update", self.begin_weight_update)
        app.router.add_post("/end_weight_update", self.end_weight_update)
        app.router.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        app.router.add_post("/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/v1/models", self.available_models)
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
        self._info_weight_version = self.backend.weight_version
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
        """``/generate``: one object for one prompt with n == 1, else a list (prompt-major).

        The order of SGLang's checks: the body (FastAPI), the contract gate, the batch and rid
        normalisation and the rid registry, then the pause gate (a paused server holds the
        request here), then the sampling parameters and the engine's limits.
        """
        try:
            body = await parse_body(request, GenerateReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        try:
            check_generate_contracts(body)
        except ContractViolation as exc:
            return contract_error(str(exc))
        try:
            layout = self._layout(body)
            self._register(layout.rids)
        except InvalidArgument as exc:
            return value_error(str(exc))
        try:
            await self._pass_pause_gate()
            self._generating += 1
            try:
                return await self._run(body, layout)
            finally:
                self._generating -= 1
        finally:
            self._unregister(layout.rids)

    async def _pass_pause_gate(self) -> None:
        async with self._pause_cond:
            await self._pause_cond.wait_for(lambda: not self._paused)

    async def _run(self, body: GenerateReqInput, layout: _Layout) -> web.Response:
        try:
            names = AdapterNames.sample_names(body.lora_path, len(layout.prompts), layout.n)
            lora_ids = await self._lora.resolve(names, len(layout.prompts) * layout.n)
        except ValueError as exc:
            return value_error(str(exc))
        futures: list[asyncio.Future[dict[str, Any]]] = []
        try:
            samples = self._samples(body, layout, lora_ids)
            for sample in samples:
                self.backend.check(sample)
            for sample in samples:
                futures.append(self.backend.submit(sample))
                futures[-1].add_done_callback(self._lora.releaser(sample.lora_id))
        except InvalidArgument as exc:
            self._lora.release_unsubmitted(lora_ids, len(futures))
            return value_error(str(exc))
        except FlexmarlError as exc:
            self._lora.release_unsubmitted(lora_ids, len(futures))
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
        return web.json_response(outputs[0] if layout.single else list(outputs))

    def _layout(self, body: GenerateReqInput) -> _Layout:
        """Prompts, rids and ``n`` of a ``/generate`` body (GenerateReqInput.normalize_batch_and_arguments)."""
        if body.stream:
            raise InvalidArgument(f"stream is not supported by the {self.backend.name} engine")
        if body.input_ids is None:
            if body.text is not None:
                raise InvalidArgument(f"text input is not supported by the {self.backend.name} engine (send input_ids)")
            raise InvalidArgument("Either text, input_ids or input_embeds should be provided.")
        prompts = parse_input_ids(body.input_ids)
        batch = isinstance(body.input_ids[0], list)
        raw_params = body.sampling_params or {}
        params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidArgument("The number of sampling_params does not match the number of prompts.")
        counts = [int(raw.get("n") or 1) for raw in params_list]
        if any(count != counts[0] for count in counts):
            raise InvalidArgument("The parallel_sample_num should be the same for all samples in sample params.")
        n = counts[0]
        logprob_field = body.return_logprob
        if isinstance(logprob_field, list) and len(logprob_field) != len(prompts):
            raise InvalidArgument("return_logprob must have one entry per prompt")
        prompt_rids = self._prompt_rids(body.rid, len(prompts), batch or n > 1)
        if n == 1:
            rids = prompt_rids
        else:  # regenerate_rid: every sample of a parallel-sampling request gets a fresh rid
            rids = [uuid.uuid4().hex for _ in range(len(prompts) * n)]
        return _Layout(prompts, params_list, rids, max(n, 1), not batch and n == 1)

    def _samples(self, body: GenerateReqInput, layout: _Layout, lora_ids: Sequence[str | None]) -> list[SampleRequest]:
        """The samples of a laid-out body, their sampling parameters parsed (after the pause gate)."""
        engine = f"the {self.backend.name} engine"
        parsed = [SamplingParams.from_wire(raw, engine=engine) for raw in layout.params]
        logprob_field = body.return_logprob
        top_field = body.top_logprobs_num or 0
        if isinstance(top_field, list) and len(top_field) != len(layout.prompts):
            raise InvalidArgument("top_logprobs_num must have one entry per prompt")
        samples: list[SampleRequest] = []
        rids, adapters = iter(layout.rids), iter(lora_ids)
        for index, (prompt, params) in enumerate(zip(layout.prompts, parsed, strict=True)):
            wants = logprob_field[index] if isinstance(logprob_field, list) else bool(logprob_field)
            top = int(top_field[index] if isinstance(top_field, list) else top_field)
            one = dataclasses.replace(params, n=1)
            samples += [
                SampleRequest(next(rids), tuple(prompt), one, wants, layout.created_s, next(adapters),
                              top_logprobs_num=max(top, 0))
                for _ in range(layout.n)
            ]
        return samples

    # ----- LoRA adapters (adapter_names.py) ----------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """``/load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}``: LoRAUpdateOutput, 200 or 400."""
        try:
            body = await parse_body(request, LoadLoRAAdapterReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        result = await self._lora.load(body.lora_name, body.lora_path, body.pinned)
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """``/unload_lora_adapter`` ``{"lora_name"}``: waits for the requests using it; 200 or 400."""
        try:
            lora_name = (await parse_body(request, UnloadLoRAAdapterReqInput)).lora_name
        except RequestInvalid as exc:
            return validation_error(str(exc))
        result = await self._lora.unload(lora_name)
        return web.json_response(result.to_json(), status=200 if result.success else 400)

    async def available_models(self, request: web.Request) -> web.Response:
        """``/v1/models``: the base model, then every loaded adapter with the base as its parent."""
        info = self.backend.model_info()
        served = str(info.get("served_model_name") or info.get("model_path") or "")
        context = self.backend.server_info().get("context_length")
        created = int(time.time())
        cards: list[dict[str, Any]] = [_model_card(served, served, None, context, created)]
        if self._lora.enabled:
            for ref in self._lora.registry.adapters().values():
                cards.append(_model_card(ref.lora_name, ref.lora_path, served, None, created))
        return web.json_response({"object": "list", "data": cards})

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

    def _register(self, rids: Sequence[str]) -> None:
        """Record the rids as in flight; a rid already in flight is a 400 (``_init_req_state``)."""
        for rid in rids:
            if rid in self._inflight:
                raise InvalidArgument(f"Duplicate request ID detected: {rid}")
        for rid in rids:
            self._inflight[rid] = rids

    def _unregister(self, rids: Sequence[str]) -> None:
        for rid in rids:
            if self._inflight.get(rid) is rids:
                del self._inflight[rid]

    # ----- control routes --------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request`` ``{"rid", "abort_all"}`` with tokenizer_manager.py's gates."""
        try:
            body = await parse_body(request, AbortReq)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        rid, abort_all = body.rid, body.abort_all
        if not abort_all and not rid:
            logger.warning("Ignore abort_request with empty rid and abort_all=False")
        elif abort_all or rid in self._inflight:
            self.backend.abort(rid, abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """``/pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` (tokenizer_manager.py)."""
        try:
            mode = (await parse_body(request, PauseGenerationReqInput)).mode
        except RequestInvalid as exc:
            return validation_error(str(exc))
        async with self._pause_cond:
            self._paused = True
            if mode != "abort":
                await self.backend.pause(mode)
            else:
                # Abort everything until no /generate (nor weight update) holds the model lock.
                while True:
                    self.backend.abort("", abort_all=True)
                    if not self._generating and not self._updating:
                        break
                    await asyncio.sleep(PAUSE_ABORT_POLL_S)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        """``/continue_generation`` ``{}``: un-pause the scheduler, then release the waiting requests."""
        try:
            await parse_body(request, ContinueGenerationReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        async with self._pause_cond:
            self._paused = False
            await self.backend.resume()
            self._pause_cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """``/update_weights_from_disk``: ``{"success", "message", "num_paused_requests"}``, 400 on failure."""
        try:
            body = await parse_body(request, UpdateWeightFromDiskReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        version = body.weight_version
        if body.abort_all_requests:
            self.backend.abort("", abort_all=True)
        async with self._pause_cond:
            paused = self._paused
        if not paused:
            self._updating += 1
        try:
            flushed = await self.backend.update_weights_from_disk(
                body.model_path, body.load_format, version, paused=paused, flush_cache=body.flush_cache
            )
        except InvalidArgument as exc:
            failed = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return web.json_response(failed, status=400)
        finally:
            if not paused:
                self._updating -= 1
        if not flushed:
            failed = {"success": False, "message": FLUSH_AFTER_UPDATE_FAILED, "num_paused_requests": 0}
            return web.json_response(failed, status=400)
        message = "Succeeded to update model weights."
        if version is not None:
            self._info_weight_version = version
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    # ----- weight-update groups (http_server.py, tokenizer_control_mixin.py) -------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """``/init_weights_update_group``: join the trainer's group; 400 when the group cannot be formed."""
        try:
            body = await parse_body(request, InitWeightsUpdateGroupReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        success, message = await self.backend.init_weights_update_group(
            master_address=body.master_address,
            master_port=body.master_port,
            rank_offset=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )
        return _outcome(success, message)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        """``/destroy_weights_update_group`` ``{"group_name"}``."""
        try:
            group_name = (await parse_body(request, DestroyWeightsUpdateGroupReqInput)).group_name
        except RequestInvalid as exc:
            return validation_error(str(exc))
        return _outcome(*await self.backend.destroy_weights_update_group(group_name))

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        """``/begin_weight_update`` ``{"selector"}``: open the session (under the model lock unless paused)."""
        try:
            selector = (await parse_body(request, BeginWeightUpdateReqInput)).selector
        except RequestInvalid as exc:
            return validation_error(str(exc))
        return _outcome(
            *await self._locked_update(lambda paused: self.backend.begin_weight_update(selector, paused=paused))
        )

    async def end_weight_update(self, request: web.Request) -> web.Response:
        """``/end_weight_update`` ``{}``: close the session."""
        try:
            await parse_body(request, EndWeightUpdateReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        return _outcome(*await self._locked_update(lambda paused: self.backend.end_weight_update(paused=paused)))

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """``/update_weights_from_distributed``: receive one call's tensors from rank 0 and load them."""
        try:
            body = await parse_body(request, UpdateWeightsFromDistributedReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        update = DistributedUpdate(
            names=tuple(body.names),
            dtypes=tuple(body.dtypes),
            shapes=tuple(tuple(shape) for shape in body.shapes),
            group_name=body.group_name,
            load_format=body.load_format,
        )
        version, flush = body.weight_version, body.flush_cache
        if body.abort_all_requests:
            self.backend.abort("", abort_all=True)
        success, message = await self._locked_update(
            lambda paused: self.backend.update_weights_from_distributed(
                update, version, paused=paused, flush_cache=flush
            )
        )
        if success and version is not None:
            self._info_weight_version = version
            message += f" Weight version updated to {version}."
        return _outcome(success, message)

    async def _locked_update(
        self, call: Callable[[bool], Awaitable[tuple[bool, str]]]
    ) -> tuple[bool, str]:
        """Run a weight-update step as the tokenizer manager does.

        Paused: at once, holding the pause condition so a continue waits for it to end. Not
        paused: as the model lock's writer (after the running samples; later ones wait).
        """
        async with self._pause_cond:
            if self._paused:
                return await call(True)
        self._updating += 1
        try:
            return await call(False)
        finally:
            self._updating -= 1

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """``/update_weight_version`` ``{"new_version", "abort_all_requests" = true}``."""
        try:
            body = await parse_body(request, UpdateWeightVersionReqInput)
        except RequestInvalid as exc:
            return validation_error(str(exc))
        new_version = body.new_version
        if body.abort_all_requests:
            self.backend.abort("", abort_all=True)
        await self.backend.set_weight_version(new_version)
        self._info_weight_version = new_version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}
        )

    async def health_generate(self, request: web.Request) -> web.Response:
        """``/health`` and ``/health_generate``: 200 once the scheduler answers after the check began.

        As http_server.py: a one-token greedy request is queued, and any scheduler output since
        the check began counts (a busy replica answers through its running batch); 503 while
        starting or stopping, or after ``HEALTH_CHECK_TIMEOUT_S`` without an answer. The probe
        is a ``/generate`` like any other: while generation is paused it waits at the pause gate
        (so a paused replica answers 503 unless it continues within the timeout).
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
        future: asyncio.Future[dict[str, Any]] | None = None
        try:
            while True:
                if future is None and not self._paused:
                    try:
                        future = self.backend.submit(probe)
                    except FlexmarlError:
                        return web.Response(status=503)
                if time.monotonic() >= started_s + HEALTH_CHECK_TIMEOUT_S:
                    break
                await asyncio.sleep(HEALTH_CHECK_POLL_S)
                if self.backend.last_output_s > started_s and self._ready:
                    return web.Response(status=200)
            logger.error("health check failed: no scheduler output for %.0f s", HEALTH_CHECK_TIMEOUT_S)
            return web.Response(status=503)
        finally:
            if future is not None:
                future.add_done_callback(_consume)
                if not future.done():
                    self.backend.abort(probe.rid, abort_all=False)

    async def model_info(self, request: web.Request) -> web.Response:
        """``/model_info`` (and the deprecated ``/get_model_info``)."""
        info = self.backend.model_info()
        if self._info_weight_version is not None:
            info["weight_version"] = self._info_weight_version
        return web.json_response(info)

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
