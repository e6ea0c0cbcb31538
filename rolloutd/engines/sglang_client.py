"""asyncio client for SGLang's native HTTP API (the RL subset); also drives the embedded engine.

Paths and field names are SGLang's:

- routes: sglang ``python/sglang/srt/entrypoints/http_server.py`` (``/generate``,
  ``/update_weights_from_disk``, ``/abort_request``, ``/health``, ``/health_generate``,
  ``/get_model_info``, ``/get_server_info``, ``/flush_cache``) and
  ``python/sglang/srt/entrypoints/v1_loads.py`` (``/v1/loads``). Newer releases also serve
  ``/model_info`` and ``/server_info``; the client tries those first and falls back to the
  ``get_`` spellings on 404.
- request bodies: ``python/sglang/srt/managers/io_struct.py`` — ``GenerateReqInput``
  (``input_ids``, ``sampling_params``, ``return_logprob``, ``rid``, ``stream``),
  ``UpdateWeightFromDiskReqInput`` (``model_path``, ``load_format``, ``abort_all_requests``,
  ``weight_version``), ``AbortReq`` (``rid``, ``abort_all``); sampling fields from
  ``python/sglang/srt/sampling/sampling_params.py`` (``temperature``, ``top_p``, ``top_k``,
  ``min_p``, ``max_new_tokens``, ``stop_token_ids``, ``ignore_eos``, ``n``, ``sampling_seed``).
- response of ``/generate``: ``{"text", "output_ids", "meta_info"}`` per sample, where
  ``meta_info`` (built in ``tokenizer_manager.py``) holds ``id``, ``finish_reason``
  (``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}`` /
  ``{"type": "abort", ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``weight_version`` and, with ``return_logprob``, ``output_token_logprobs`` as
  ``[logprob, token_id, text-or-null]`` triples. One prompt with ``n == 1`` answers one object;
  ``n > 1`` (or a batch of prompts) answers a list of such objects, one per sample.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import aiohttp

from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.protocol import (
    EngineClient,
    EngineLoad,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    WeightUpdateResult,
)

logger = logging.getLogger(__name__)


class SGLangClient(EngineClient):
    """One replica's HTTP client (SGLang server or embedded engine).

    Connection errors (refused, reset, server gone) are retried ``retries`` times with
    exponential backoff, then raised as :class:`Unavailable`; a request that times out raises
    :class:`Unavailable` at once (the replica is alive but stuck or overloaded). HTTP 400
    raises :class:`InvalidArgument`, 503 :class:`Unavailable`, other errors
    :class:`FlexmarlError`.
    """

    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        control_timeout_s: float = 30.0,
        retries: int = 2,
        retry_backoff_s: float = 0.1,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._control_timeout_s = control_timeout_s
        self._retries = retries
        self._retry_backoff_s = retry_backoff_s
        self._session = session
        self._owns_session = session is None
        self._info_paths: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the owned HTTP session (idempotent)."""
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    # ----- transport ---------------------------------------------------------------------
    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        allowed_statuses: tuple[int, ...] = (),
    ) -> tuple[int, Any]:
        """Send one request with retries on connection errors; returns (status, JSON or text)."""
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self._control_timeout_s, sock_connect=self._connect_timeout_s
        )
        attempt = 0
        while True:
            try:
                async with self._get_session().request(method, self.url + path, json=body, timeout=timeout) as response:
                    status = response.status
                    text = await response.text()
                    payload: Any = text
                    if response.content_type == "application/json" and text:
                        payload = await response.json()
                break
            except aiohttp.ClientConnectionError as exc:
                if attempt >= self._retries:
                    raise Unavailable(f"engine {self.url} unreachable ({method} {path}): {exc!r}") from exc
                delay_s = self._retry_backoff_s * (2**attempt)
                attempt += 1
                logger.debug("retrying %s %s%s in %.2fs after %r", method, self.url, path, delay_s, exc)
                await asyncio.sleep(delay_s)
            except TimeoutError as exc:
                raise Unavailable(f"engine {self.url} timed out ({method} {path})") from exc
        if status in allowed_statuses or 200 <= status < 300:
            return status, payload
        message = payload.get("message", payload) if isinstance(payload, dict) else payload
        detail = f"engine {self.url} {method} {path} -> HTTP {status}: {message}"
        if status == 400:
            raise InvalidArgument(detail)
        if status in (502, 503, 504):
            raise Unavailable(detail)
        raise FlexmarlError(detail)

    # ----- generation --------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """POST ``/generate`` for one prompt; returns ``n`` results in sample order."""
        request.validate()
        rid = request.rid or uuid.uuid4().hex
        body: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling.to_wire(),
            "return_logprob": request.return_logprob,
            "rid": rid,
            "stream": False,
        }
        _, payload = await self._request("POST", "/generate", body=body, timeout_s=self._request_timeout_s)
        outputs = payload if isinstance(payload, list) else [payload]
        if len(outputs) != request.sampling.n:
            raise FlexmarlError(f"engine {self.url} returned {len(outputs)} samples, expected {request.sampling.n}")
        return [self._parse_output(output, rid, request.return_logprob) for output in outputs]

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
        return GenerationResult(
            output_ids=output_ids,
            output_token_logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            rid=str(meta.get("id", rid)),
            text=str(output.get("text", "")),
            matched_stop=matched if isinstance(matched, int) else None,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version", "")),
            model_path=str(meta.get("model_path", "")),
            e2e_latency_s=float(meta.get("e2e_latency", 0.0)),
        )

    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        """POST ``/abort_request``; SGLang aborts every request whose rid starts with ``rid``."""
        if not rid and not abort_all:
            raise InvalidArgument("give a rid or abort_all=True")
        await self._request("POST", "/abort_request", body={"rid": rid, "abort_all": abort_all})

    # ----- weights -----------------------------------------------------------------------
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> WeightUpdateResult:
        """POST ``/update_weights_from_disk``; raises FailedPrecondition when the engine refuses."""
        body: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        status, payload = await self._request(
            "POST", "/update_weights_from_disk", body=body, timeout_s=self._request_timeout_s, allowed_statuses=(400,)
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

    # ----- health and info ---------------------------------------------------------------
    async def health(self) -> bool:
        """GET ``/health``; False on 503 (starting or shutting down); Unavailable when unreachable."""
        status, _ = await self._request("GET", "/health", allowed_statuses=(503,))
        return status == 200

    async def health_generate(self) -> bool:
        """GET ``/health_generate`` (generates one token); False on 503."""
        status, _ = await self._request("GET", "/health_generate", allowed_statuses=(503,))
        return status == 200

    async def _get_info(self, new_path: str, old_path: str) -> Any:
        path = self._info_paths.get(new_path)
        if path is None:
            status, payload = await self._request("GET", new_path, allowed_statuses=(404,))
            if status != 404:
                self._info_paths[new_path] = new_path
                return payload
            path = self._info_paths[new_path] = old_path
        _, payload = await self._request("GET", path)
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
        """POST ``/flush_cache``; False when SGLang refuses (requests are running)."""
        status, _ = await self._request("POST", "/flush_cache", allowed_statuses=(400,))
        return status == 200

    async def loads(self) -> EngineLoad:
        """GET ``/v1/loads``, summed over data-parallel ranks."""
        _, payload = await self._request("GET", "/v1/loads")
        loads = payload.get("loads") if isinstance(payload, dict) else None
        if not isinstance(loads, list):
            raise FlexmarlError(f"engine {self.url}: malformed /v1/loads answer")

        def total(name: str) -> int:
            return sum(int(load.get(name) or 0) for load in loads if isinstance(load, dict))

        return EngineLoad(
            num_running_reqs=total("num_running_reqs"),
            num_waiting_reqs=total("num_waiting_reqs"),
            num_used_tokens=total("num_used_tokens"),
            num_total_tokens=total("num_total_tokens"),
        )
