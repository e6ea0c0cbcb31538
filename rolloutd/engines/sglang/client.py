"""asyncio client for SGLang's native HTTP API (the RL subset); also drives the embedded engine.

Paths and field names are SGLang's:

- routes: sglang ``python/sglang/srt/entrypoints/http_server.py`` (``/generate``,
  ``/update_weights_from_disk``, ``/abort_request``, ``/pause_generation``,
  ``/continue_generation``, ``/health``, ``/health_generate``,
  ``/get_model_info``, ``/get_server_info``, ``/flush_cache``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
  ``/begin_weight_update``, ``/end_weight_update``) and
  ``python/sglang/srt/entrypoints/v1_loads.py`` (``/v1/loads``). Newer releases also serve
  ``/model_info`` and ``/server_info``; the client tries those first and falls back to the
  ``get_`` spellings on 404.
- request bodies: ``python/sglang/srt/managers/io_struct.py`` — ``GenerateReqInput``
  (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``, ``stream``),
  ``UpdateWeightFromDiskReqInput`` (``model_path``, ``load_format``, ``abort_all_requests``,
  ``weight_version``, ``flush_cache``), ``AbortReq`` (``rid``, ``abort_all``),
  ``PauseGenerationReqInput`` (``mode``), ``ContinueGenerationReqInput`` (no field sent); sampling fields from
  ``python/sglang/srt/sampling/sampling_params.py`` (``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``max_new_tokens``, ``stop_token_ids``, ``ignore_eos``, ``n``, ``sampling_seed``).
- response of ``/generate``: ``{"text", "output_ids", "meta_info"}`` per sample, where
  ``meta_info`` (built in ``tokenizer_manager.py``) holds ``id``, ``finish_reason``
  (``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}`` /
  ``{"type": "abort", ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``weight_version``, ``weight_versions`` (``{"version", "start", "end"}`` spans of output
  tokens, sglang/srt/utils/weight_versions.py) and, with ``return_logprob``,
  ``output_token_logprobs`` as ``[logprob, token_id, text-or-null]`` triples. An aborted
  request answers 200 with the tokens and logprobs it had and ``finish_reason``
  ``{"type": "abort", ...}``. One prompt with ``n == 1`` answers one object;
  ``n > 1`` (or a batch of prompts) answers a list of such objects, one per sample, each under
  a fresh rid. SGLang's ``meta_info`` has no ``model_path`` (the embedded engine adds one):
  :attr:`GenerationResult.model_path` is empty from SGLang.
- error bodies: see :func:`sglang_error_message`; status codes: 400 for a request SGLang rejects
  (validation or a ``ValueError`` while serving), 503 for one it cannot serve now.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import aiohttp

from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.http_client import HttpEngineClient
from rolloutd.engines.protocol import (
    EngineLoad,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LoraAdapterResult,
    ModelInfo,
    PauseMode,
    WeightUpdateResult,
    WeightVersionSpan,
)

logger = logging.getLogger(__name__)


#: Samples in flight per replica when its ``/v1/loads`` does not report ``max_running_requests``.
DEFAULT_MAX_CONCURRENT_GENERATIONS = 1024


def sglang_error_message(payload: Any) -> str:
    """The human message of an SGLang error body, whatever shape the route answers in.

    SGLang 0.5.23 uses several (``srt/entrypoints/http_server.py``):

    - ``{"error": {"message": ...}}`` (``_create_error_response``: a ``ValueError`` raised while
      serving ``/generate``, ``/abort_request``, ...);
    - ``{"error": "<text>"}`` (the ``/generate`` body contract check, the admin-key refusal);
    - ``{"object": "error", "message": ..., "type": ..., "param": ..., "code": ...}`` (the
      ``ErrorResponse`` of ``api/v1/api_types.py``: request validation errors and any
      ``HTTPException``, e.g. a 503 abort);
    - a plain-text body (``/flush_cache``).
    """
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(error, list):
            return "; ".join(str(item) for item in error)
        for name in ("message", "detail"):
            if payload.get(name) is not None:
                return str(payload[name])
        return json.dumps(payload)[:2000]
    return str(payload).strip()[:2000]


class SGLangClient(HttpEngineClient):
    """One replica's HTTP client (SGLang server or embedded engine).

    The transport is :class:`~rolloutd.engines.http_client.HttpEngineClient`'s: generations hold
    slots out of ``max_concurrent_generations``, by default the replica's own running-request
    capacity (the sum of ``max_running_requests`` over its ``/v1/loads`` ranks, read once before
    the first generation; :data:`DEFAULT_MAX_CONCURRENT_GENERATIONS` when it does not say); the
    router re-admits a dropped replica when its ``/health`` answers 200 again. HTTP 400 (and 422)
    raises :class:`InvalidArgument`, 503 :class:`EngineBusy`, 502/504 :class:`Unavailable`, other
    errors :class:`FlexmarlError`; each carries SGLang's own message (:func:`sglang_error_message`).
    """

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 30.0,
        generate_timeout_base_s: float = 300.0,
        generate_timeout_per_token_s: float = 0.25,
        max_concurrent_generations: int | None = None,
        retries: int = 2,
        retry_backoff_s: float = 0.1,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        """Builds a client; nothing is sent until the first call.

        Args:
            url: ``http://host:port`` of the replica.
            request_timeout_s: Total timeout of ``/update_weights_from_disk``.
            connect_timeout_s: Timeout of establishing one TCP connection.
            control_timeout_s: Total timeout of the other control calls. SGLang's ``/health``
                generates a token and may take up to ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) to
                answer, so keep this above that for a real server.
            generate_timeout_base_s: Fixed part of a ``/generate`` deadline.
            generate_timeout_per_token_s: Per ``max_new_tokens`` part of a ``/generate`` deadline.
            max_concurrent_generations: Samples in flight at once; None reads the replica's
                capacity from ``/v1/loads``.
            retries: Retries of a request that hit a connection error.
            retry_backoff_s: First retry delay (doubled each retry).
            session: A session to use (not closed by :meth:`close`); by default the client
                opens its own with an unbounded connection pool.
        """
        super().__init__(
            url, request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
            control_timeout_s=control_timeout_s, generate_timeout_base_s=generate_timeout_base_s,
            generate_timeout_per_token_s=generate_timeout_per_token_s,
            max_concurrent_generations=(DEFAULT_MAX_CONCURRENT_GENERATIONS if max_concurrent_generations is None
                                        else max_concurrent_generations),
            retries=retries, retry_backoff_s=retry_backoff_s, session=session)
        self._info_paths: dict[str, str] = {}
        self._capacity_known = max_concurrent_generations is not None
        self._capacity_lock = asyncio.Lock()

    @staticmethod
    def error_message(payload: Any) -> str:
        """SGLang's message in an error body (:func:`sglang_error_message`)."""
        return sglang_error_message(payload)

    # ----- generation --------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """POST ``/generate`` for one prompt; returns ``n`` results in sample order.

        Waits for ``n`` generation slots first (not counted in the request's deadline, see the
        class doc).
        """
        request.validate()
        rid = request.rid or uuid.uuid4().hex
        body: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling.to_wire(),
            "return_logprob": request.return_logprob,
            "rid": rid,
            "stream": False,
        }
        if request.lora_path is not None:
            body["lora_path"] = request.lora_path
        if request.top_logprobs_num:
            body["top_logprobs_num"] = request.top_logprobs_num
        await self._learn_capacity()
        deadline_s = self.generate_timeout_s(request.sampling.max_new_tokens)
        async with self._slots.hold(request.sampling.n):
            try:
                async with asyncio.timeout(deadline_s):
                    _, payload = await self._request("POST", "/generate", body=body, timeout_s=None)
            except TimeoutError as exc:
                raise Unavailable(
                    f"engine {self.url}: /generate (max_new_tokens={request.sampling.max_new_tokens}) "
                    f"ran past its {deadline_s:.0f}s deadline"
                ) from exc
        outputs = payload if isinstance(payload, list) else [payload]
        if len(outputs) != request.sampling.n:
            raise FlexmarlError(f"engine {self.url} returned {len(outputs)} samples, expected {request.sampling.n}")
        return [self._parse_output(output, rid, request.return_logprob) for output in outputs]

    async def _learn_capacity(self) -> None:
        """Sets the slot limit from the replica's running-request capacity, once."""
        if self._capacity_known:
            return
        async with self._capacity_lock:
            if self._capacity_known:
                return
            try:
                capacity = await self.running_capacity()
            except Unavailable:
                return  # not reachable now: the generation will tell; ask again next time
            except FlexmarlError as exc:
                logger.warning("engine %s: no running-request capacity (%s); allowing %d generations",
                               self.url, exc, self._slots.limit)
                capacity = None
            if capacity is not None:
                self._slots.limit = capacity
                logger.info("engine %s runs at most %d requests: as many generations in flight", self.url, capacity)
            self._capacity_known = True

    def _parse_output(self, output: Any, rid: str, return_logprob: bool) -> GenerationResult:
        if not isinstance(output, dict) or not isinstance(output.get("meta_info"), dict):
            raise FlexmarlError(f"engine {self.url} returned a malformed sample: {str(output)[:200]}")
        meta = output["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        logprobs = tuple(float(triple[0]) for triple in triples)
        if "output_ids" in output:
            output_ids = tuple(int(token) for token in output["output_ids"])
        else:  # older servers answer only text; the logprob triples still carry the ids
            output_ids = tuple(int(triple[1]) for triple in triples)
        if return_logprob and len(logprobs) != len(output_ids):
            raise FlexmarlError(f"engine {self.url}: {len(logprobs)} logprobs for {len(output_ids)} output tokens")
        reason = meta.get("finish_reason") or {}
        reason_type = str(reason.get("type")) if isinstance(reason, dict) else str(reason)
        try:
            finish_reason = FinishReason(reason_type)
        except ValueError as exc:
            raise FlexmarlError(f"engine {self.url}: unknown finish_reason {reason!r}") from exc
        matched = reason.get("matched") if isinstance(reason, dict) else None
        spans = tuple(
            WeightVersionSpan(str(span["version"]), int(span["start"]), int(span["end"]))
            for span in meta.get("weight_versions") or []
            if isinstance(span, dict)
        )
        return GenerationResult(
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            rid=str(meta.get("id", rid)),
            text=str(output.get("text", "")),
            output_top_logprobs=tuple(tuple((float(top[0]), int(top[1])) for top in position or ())
                                      for position in meta.get("output_top_logprobs") or ()),
            matched_stop=matched if isinstance(matched, int) else None,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version", "")),
            model_path=str(meta.get("model_path", "")),
            e2e_latency_s=float(meta.get("e2e_latency", 0.0)),
            weight_versions=spans,
        )

    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        """POST ``/abort_request``: the ``n == 1`` request of exactly this rid, or every request.

        Only two forms are reliable on SGLang 0.5.23 (``TokenizerManager.abort_request`` in
        ``srt/managers/tokenizer_manager.py``): the exact rid of a running ``n == 1`` request, or
        ``abort_all``. A rid the tokenizer manager does not know is ignored (answered 200), so
        is the rid of an ``n > 1`` request (its samples run under fresh rids), and no prefix of a
        rid matches anything. Nothing in rolloutd relies on prefixes.
        """
        if not rid and not abort_all:
            raise InvalidArgument("give a rid or abort_all=True")
        await self._request(
            "POST", "/abort_request", body={"rid": rid, "abort_all": abort_all}, timeout_s=self._control_timeout_s
        )

    # ----- weights -----------------------------------------------------------------------
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> WeightUpdateResult:
        """POST ``/update_weights_from_disk``.

        SGLang answers ``{"success", "message", "num_paused_requests"}`` with 200 on success and
        400 on failure (``srt/entrypoints/http_server.py``); a body it cannot parse gets its
        validation ``ErrorResponse`` with 400 instead. While generation is paused the update
        does not wait for running requests; after an ``in_place`` pause pass
        ``flush_cache=False``, or SGLang answers 400 (the weights did change, the cache was not
        flushed because requests still run: ``weight_updater.py``).

        Raises:
            FailedPrecondition: The engine tried and failed (its message, e.g. a missing file).
            InvalidArgument: The engine rejected the request body.
        """
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        if not flush_cache:
            body["flush_cache"] = False
        status, payload = await self._request(
            "POST", "/update_weights_from_disk", body=body, timeout_s=self._request_timeout_s, allowed_statuses=(400,)
        )
        if status == 400 and not (isinstance(payload, dict) and "success" in payload):
            raise InvalidArgument(
                f"engine {self.url} rejected the weight update of {model_path}: {sglang_error_message(payload)}"
            )
        if not isinstance(payload, dict):
            raise FlexmarlError(f"engine {self.url}: malformed weight update answer {str(payload)[:200]}")
        result = WeightUpdateResult(
            success=bool(payload.get("success")),
            message=str(payload.get("message", "")),
            num_paused_requests=int(payload.get("num_paused_requests") or 0),
        )
        if status != 200 or not result.success:
            raise FailedPrecondition(f"engine {self.url} refused weights {model_path}: {result.message}")
        return result

    # ----- LoRA adapters -------------------------------------------------------------------
    async def _lora_call(self, path: str, body: dict[str, Any], what: str) -> LoraAdapterResult:
        """POST a LoRA route: SGLang answers ``LoRAUpdateOutput`` with 200, or 400 on failure."""
        status, payload = await self._request(
            "POST", path, body=body, timeout_s=self._request_timeout_s, allowed_statuses=(400,)
        )
        if status == 400 and not (isinstance(payload, dict) and "success" in payload):
            raise InvalidArgument(f"engine {self.url} rejected {path}: {sglang_error_message(payload)}")
        if not isinstance(payload, dict):
            raise FlexmarlError(f"engine {self.url}: malformed {path} answer {str(payload)[:200]}")
        loaded = payload.get("loaded_adapters") or {}
        result = LoraAdapterResult(
            success=bool(payload.get("success")),
            error_message=str(payload.get("error_message") or ""),
            loaded_adapters={str(name): str(path) for name, path in loaded.items()} if isinstance(loaded, dict) else {},
        )
        if status != 200 or not result.success:
            raise FailedPrecondition(f"engine {self.url} refused to {what}: {result.error_message}")
        return result

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraAdapterResult:
        """POST ``/load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}``.

        SGLang loads the adapter between scheduler iterations; with ``--max-loaded-loras`` it then
        unloads least recently used unpinned adapters beyond the cap
        (``srt/managers/tokenizer_control_mixin.py``).

        Raises:
            FailedPrecondition: The engine refused (LoRA off, name taken, rank or modules not
                served, bad path, too many pinned): SGLang's ``error_message``.
            InvalidArgument: The engine rejected the request body.
        """
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self._lora_call("/load_lora_adapter", body, f"load LoRA adapter {lora_name!r} from {lora_path}")

    async def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """POST ``/unload_lora_adapter`` ``{"lora_name"}``; answers once no request uses the adapter.

        Raises:
            FailedPrecondition: LoRA off, or no adapter of that name (SGLang's ``error_message``).
            InvalidArgument: The engine rejected the request body.
        """
        return await self._lora_call("/unload_lora_adapter", {"lora_name": lora_name}, f"unload {lora_name!r}")

    # ----- weight-update groups -----------------------------------------------------------
    async def _group_call(self, path: str, body: dict[str, Any], timeout_s: float | None) -> WeightUpdateResult:
        """POST one weight-update-group route; SGLang answers ``{"success", "message"}``, 200 or 400."""
        status, payload = await self._request(
            "POST", path, body=body, timeout_s=self._request_timeout_s if timeout_s is None else timeout_s,
            allowed_statuses=(400,),
        )
        if status == 400 and not (isinstance(payload, dict) and "success" in payload):
            raise InvalidArgument(f"engine {self.url} rejected {path}: {sglang_error_message(payload)}")
        if not isinstance(payload, dict):
            raise FlexmarlError(f"engine {self.url}: malformed {path} answer {str(payload)[:200]}")
        result = WeightUpdateResult(success=bool(payload.get("success")), message=str(payload.get("message", "")))
        if status != 200 or not result.success:
            raise FailedPrecondition(f"engine {self.url} {path} failed: {result.message}")
        return result

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """POST ``/init_weights_update_group`` (io_struct.py ``InitWeightsUpdateGroupReqInput``).

        The engine joins the group hosted by rank 0 (the trainer) as rank ``rank_offset`` (plus
        its tensor-parallel rank); the call returns once every rank joined. SGLang's default
        ``backend`` is ``nccl``: a CPU engine needs ``gloo``.

        Raises:
            FailedPrecondition: The group could not be formed (SGLang's message).
        """
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._group_call("/init_weights_update_group", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightUpdateResult:
        """POST ``/destroy_weights_update_group`` (FailedPrecondition when the engine is not in the group)."""
        return await self._group_call("/destroy_weights_update_group", {"group_name": group_name}, None)

    async def begin_weight_update(self) -> WeightUpdateResult:
        """POST ``/begin_weight_update`` ``{}``: SGLang 0.5.23 loads distributed weights only inside a session."""
        return await self._group_call("/begin_weight_update", {}, None)

    async def end_weight_update(self) -> WeightUpdateResult:
        """POST ``/end_weight_update`` ``{}``: close the session (FailedPrecondition when none is open)."""
        return await self._group_call("/end_weight_update", {}, None)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """POST ``/update_weights_from_distributed``: the engine receives these tensors by broadcast from rank 0.

        The engine loads them as soon as they arrive (each call on its own), so pause generation
        around an update of several calls and give ``weight_version`` only with the last one
        (io_struct.py ``UpdateWeightsFromDistributedReqInput``). The call returns after the
        broadcast, so rank 0 must broadcast concurrently.

        Raises:
            FailedPrecondition: The engine failed to receive or load them (SGLang's message).
        """
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._group_call("/update_weights_from_distributed", body, timeout_s)

    # ----- pause and continue --------------------------------------------------------------
    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """POST ``/pause_generation`` ``{"mode"}`` (``srt/managers/tokenizer_manager.py``).

        From then on new ``/generate`` requests wait in the server (no error) until
        :meth:`continue_generation`. ``ABORT`` aborts every running request (each answers its
        partial tokens and logprobs with finish reason abort) and returns once none is left,
        polling once a second; ``IN_PLACE`` and ``RETRACT`` stop the scheduler, the running
        requests staying in the batch or going back to the waiting queue. Weight updates made
        while paused apply at once, under the paused requests, which record the new version in
        their ``weight_versions`` spans. The call may take long (``request_timeout_s``).
        """
        await self._request(
            "POST", "/pause_generation", body={"mode": PauseMode(mode).value}, timeout_s=self._request_timeout_s
        )

    async def continue_generation(self) -> None:
        """POST ``/continue_generation`` ``{}``: the paused and waiting requests go on."""
        await self._request("POST", "/continue_generation", body={}, timeout_s=self._control_timeout_s)

    # ----- health and info ---------------------------------------------------------------
    async def health(self) -> bool:
        """GET ``/health``; False on 503; Unavailable when unreachable.

        On SGLang 0.5.23 ``/health`` is ``/health_generate`` unless
        ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``: it answers 503 while starting, shutting
        down, or when no output arrived for ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) — which includes
        a long weight load that holds the model lock; it answers 200 under load.
        """
        status, _ = await self._request("GET", "/health", timeout_s=self._control_timeout_s, allowed_statuses=(503,))
        return status == 200

    async def health_generate(self) -> bool:
        """GET ``/health_generate`` (generates one token); False on 503."""
        status, _ = await self._request(
            "GET", "/health_generate", timeout_s=self._control_timeout_s, allowed_statuses=(503,)
        )
        return status == 200

    async def _get_info(self, new_path: str, old_path: str) -> Any:
        path = self._info_paths.get(new_path)
        if path is None:
            status, payload = await self._request(
                "GET", new_path, timeout_s=self._control_timeout_s, allowed_statuses=(404,)
            )
            if status != 404:
                self._info_paths[new_path] = new_path
                return payload
            path = self._info_paths[new_path] = old_path
        _, payload = await self._request("GET", path, timeout_s=self._control_timeout_s)
        return payload

    async def model_info(self) -> ModelInfo:
        """GET ``/model_info`` (or ``/get_model_info``)."""
        payload = await self._get_info("/model_info", "/get_model_info")
        if not isinstance(payload, dict):
            raise FlexmarlError(f"engine {self.url}: malformed model info")
        tokenizer_path = payload.get("tokenizer_path")
        return ModelInfo(
            model_path=str(payload.get("model_path", "")),
            tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
            is_generation=bool(payload.get("is_generation", True)),
            weight_version=str(payload.get("weight_version", "")),
        )

    async def server_info(self) -> dict[str, Any]:
        """GET ``/server_info`` (or ``/get_server_info``)."""
        payload = await self._get_info("/server_info", "/get_server_info")
        if not isinstance(payload, dict):
            raise FlexmarlError(f"engine {self.url}: malformed server info")
        return payload

    async def flush_cache(self) -> bool:
        """POST ``/flush_cache``; False when SGLang refuses (400 with a text body: requests running)."""
        status, _ = await self._request(
            "POST", "/flush_cache", timeout_s=self._control_timeout_s, allowed_statuses=(400,)
        )
        return status == 200

    async def _load_ranks(self) -> list[dict[str, Any]]:
        _, payload = await self._request("GET", "/v1/loads", timeout_s=self._control_timeout_s)
        loads = payload.get("loads") if isinstance(payload, dict) else None
        if not isinstance(loads, list):
            raise FlexmarlError(f"engine {self.url}: malformed /v1/loads answer")
        return [load for load in loads if isinstance(load, dict)]

    async def loads(self) -> EngineLoad:
        """GET ``/v1/loads``, summed over data-parallel ranks.

        Field meanings are SGLang's (``srt/managers/scheduler_components/load_inquirer.py``):
        ``num_used_tokens`` is KV tokens in use, ``num_total_tokens`` is used plus queued tokens
        (the prompts waiting) — demand, not capacity; capacity is ``max_total_num_tokens``.
        """
        loads = await self._load_ranks()

        def total(name: str) -> int:
            return sum(int(load.get(name) or 0) for load in loads)

        return EngineLoad(
            num_running_reqs=total("num_running_reqs"),
            num_waiting_reqs=total("num_waiting_reqs"),
            num_used_tokens=total("num_used_tokens"),
            num_total_tokens=total("num_total_tokens"),
        )

    async def running_capacity(self) -> int | None:
        """Requests the replica runs at once: ``max_running_requests`` summed over its ``/v1/loads`` ranks.

        None when the replica does not report it.
        """
        values = [load.get("max_running_requests") for load in await self._load_ranks()]
        known = [int(value) for value in values if isinstance(value, int) and value > 0]
        return sum(known) if known else None
