"""The embedded engine: a CPU inference server speaking the RL subset of SGLang's HTTP API.

It serves a Hugging Face transformers causal LM with torch on CPU, so CI (no GPU) drives the
same client code path as a GPU SGLang server. Endpoints, request fields and response fields
follow sglang ``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py`` (see docs/engines.md for the exact subset).

Scheduling: HTTP handlers (on the event loop) enqueue generation jobs; one worker thread takes
every job waiting (up to ``max_batch_size`` sequences), prefills their prompts together
(left padding + attention mask + KV cache), expands each prompt's cache to its ``n`` samples
(the prefill is shared) and decodes the batch token by token, dropping finished sequences.
Jobs that arrive meanwhile wait for the next batch. Weight reloads are queued in the same FIFO
and applied by the worker between batches, so no token is produced by a half-loaded model.

Log-probabilities: like SGLang by default, the logprob of a sampled token is taken from the
temperature-scaled distribution ``log_softmax(logits / temperature)`` before top-k/top-p/min-p
truncation; with ``temperature == 0`` (greedy) it is ``log_softmax(logits)``. The flag
``--return-original-logprob`` (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) returns
``log_softmax(logits)`` at every temperature.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, InvalidArgument
from rolloutd.engines.protocol import SamplingParams, parse_input_ids

logger = logging.getLogger(__name__)

ENGINE_VERSION = "flexmarl-embedded-0.1"
_LOGPROB_FLOOR = torch.finfo(torch.float32).min


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """Settings of one embedded engine replica."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 0
    num_threads: int = 1
    max_batch_size: int = 32
    batch_window_s: float = 0.002
    return_original_logprob: bool = False
    weight_version: str = "default"
    seed: int | None = None
    ready_file: str = ""
    # Device profile file (flexmarl.devicemodel): generation takes the modelled time of that
    # accelerator; "" = the FLEXMARL_MODELLED_DEVICE environment variable, unset = real time only.
    modelled_device: str = ""


@dataclass(frozen=True)
class _LoadedModel:
    """A fully loaded model and the names reported with every token it produces."""

    model: Any
    tokenizer: Any
    model_path: str
    weight_version: str
    eos_token_ids: frozenset[int]
    max_positions: int
    cache_kwarg: str  # transformers >= 5.2x names the KV cache argument "cache"


@dataclass
class _Job:
    """One prompt to complete ``params.n`` times (one entry of a /generate batch)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[dict[str, Any]]]
    created_s: float = field(default_factory=time.monotonic)
    aborted: bool = False
    outputs: list[dict[str, Any] | None] = field(default_factory=list)

    def resolve(self) -> None:
        results = [output for output in self.outputs if output is not None]
        self.loop.call_soon_threadsafe(_set_result, self.future, results)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


@dataclass
class _WeightSwap:
    """A fully loaded replacement model, applied by the worker between batches."""

    loaded: _LoadedModel
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class _Sequence:
    """One sample being decoded."""

    job: _Job
    sample_index: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def load_model(model_path: str, weight_version: str) -> _LoadedModel:
    """Load a causal LM (fp32, eval mode) and, when present, its tokenizer from a checkpoint dir.

    Raises:
        InvalidArgument: The directory does not hold a loadable checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{model_path} is not a checkpoint directory (no config.json)")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"cannot load {model_path}: {exc}") from exc
    model.eval()  # type: ignore[no-untyped-call]
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s); responses carry no text", model_path, exc)
    eos: set[int] = set()
    for source in (model.config.eos_token_id, model.generation_config.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(int(token) for token in source)
    max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    forward_params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
    return _LoadedModel(model, tokenizer, str(path), weight_version, frozenset(eos), max_positions, cache_kwarg)


def _compatible(current: _LoadedModel, new: _LoadedModel) -> str:
    """Empty when ``new`` may replace ``current`` in place, else the reason it may not."""
    for name in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        old_value = getattr(current.model.config, name, None)
        new_value = getattr(new.model.config, name, None)
        if old_value != new_value:
            return f"{name} differs: {old_value} != {new_value}"
    return ""


class EmbeddedEngine:
    """Batched CPU generation behind a worker thread, plus weight swaps between batches."""

    def __init__(self, config: EmbeddedEngineConfig) -> None:
        self.config = config
        self._loaded = load_model(config.model_path, config.weight_version)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job | _WeightSwap] = collections.deque()
        self._running: list[_Job] = []
        self._running_tokens = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._seed_source = secrets.SystemRandom() if config.seed is None else None
        self._seed_counter = 0
        self.batches_run = 0
        self.max_batch_sequences = 0
        self.generated_tokens = 0
        self._started_s = time.monotonic()
        self.device = (devicemodel.load_profile(config.modelled_device) if config.modelled_device
                       else devicemodel.profile_from_env())
        self._trace = devicemodel.TraceWriter(self.device, f"engine-{os.getpid()}") if self.device else None

    # ----- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start the generation worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="embedded-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Abort everything queued or running and stop the worker (idempotent)."""
        with self._cond:
            self._stopping = True
            for item in self._queue:
                if isinstance(item, _Job):
                    item.fail(FlexmarlError("engine stopped"))
                else:
                    item.loop.call_soon_threadsafe(_set_exception, item.future, FlexmarlError("engine stopped"))
            self._queue.clear()
            for job in self._running:
                job.aborted = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ----- requests (called on the event loop) -------------------------------------------
    @property
    def loaded(self) -> _LoadedModel:
        """The model now being served."""
        return self._loaded

    def submit(self, job: _Job) -> None:
        """Queue a generation job; its future resolves with one output dict per sample."""
        with self._cond:
            if self._stopping:
                raise FlexmarlError("engine stopped")
            self._queue.append(job)
            self._cond.notify_all()

    def submit_swap(self, swap: _WeightSwap) -> None:
        """Queue a weight swap behind every job already queued."""
        with self._cond:
            self._queue.append(swap)
            self._cond.notify_all()

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort queued and running jobs whose rid starts with ``rid`` (SGLang matches prefixes)."""
        count = 0
        with self._cond:
            for item in [*self._queue, *self._running]:
                if isinstance(item, _Job) and (abort_all or (rid and item.rid.startswith(rid))):
                    item.aborted = True
                    count += 1
            self._cond.notify_all()
        return count

    def load_snapshot(self) -> dict[str, Any]:
        """Queue and batch sizes in SGLang's ``/v1/loads`` vocabulary."""
        with self._cond:
            waiting = [item for item in self._queue if isinstance(item, _Job)]
            running = sum(job.params.n for job in self._running)
            used = self._running_tokens
        pending_tokens = sum(len(job.input_ids) for job in waiting)
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": sum(job.params.n for job in waiting),
            "num_used_tokens": used,
            "num_total_tokens": used + pending_tokens,
        }

    def new_seed(self) -> int:
        """A seed for a request that brought none (from the engine seed, else OS entropy)."""
        if self._seed_source is not None:
            return self._seed_source.getrandbits(62)
        self._seed_counter += 1
        return (int(self.config.seed or 0) * 1_000_003 + self._seed_counter) % (1 << 62)

    # ----- worker thread -----------------------------------------------------------------
    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                if isinstance(self._queue[0], _Job) and self.config.batch_window_s > 0:
                    # Give requests that arrive together a moment to share the batch.
                    deadline = time.monotonic() + self.config.batch_window_s
                    while (remaining := deadline - time.monotonic()) > 0 and not self._stopping:
                        self._cond.wait(remaining)
                if self._stopping or not self._queue:
                    continue
                batch = self._take_batch()
            if isinstance(batch, _WeightSwap):
                self._apply_swap(batch)
                continue
            try:
                self._run_batch(batch)
            except Exception as exc:  # a failing batch must not kill the replica
                logger.exception("batch of %d jobs failed", len(batch))
                for job in batch:
                    job.fail(exc)
            finally:
                with self._cond:
                    self._running = []
                    self._running_tokens = 0

    def _take_batch(self) -> list[_Job] | _WeightSwap:
        """Pop a weight swap, or the queued jobs before the next swap (up to the batch size)."""
        head = self._queue[0]
        if isinstance(head, _WeightSwap):
            self._queue.popleft()
            return head
        jobs: list[_Job] = []
        sequences = 0
        while self._queue:
            job = self._queue[0]
            if not isinstance(job, _Job):
                break
            if jobs and sequences + job.params.n > self.config.max_batch_size:
                break
            jobs.append(job)
            sequences += job.params.n
            self._queue.popleft()
        self._running = jobs
        return jobs

    def _apply_swap(self, swap: _WeightSwap) -> None:
        if self.device is not None:  # the replica serves nothing while the modelled reload runs
            started_s, pacer = time.time(), devicemodel.Pacer(self.device)
            pacer.add(devicemodel.weight_transfer_s(self.device))
            pacer.wait()
            if self._trace is not None:
                self._trace.record("reload", started_s, time.time(), pacer.modelled_s)
        self._loaded = swap.loaded
        logger.info("serving %s (weight_version %s)", swap.loaded.model_path, swap.loaded.weight_version)
        swap.loop.call_soon_threadsafe(_set_result, swap.future, None)

    def _run_batch(self, jobs: list[_Job]) -> None:
        loaded = self._loaded  # one model for the whole batch, whatever swaps are queued
        live: list[_Job] = []
        for job in jobs:
            job.outputs = [None] * job.params.n
            if job.aborted or job.params.max_new_tokens == 0:
                reason: dict[str, Any] = _abort_reason() if job.aborted else {"type": "length", "length": 0}
                for index in range(job.params.n):
                    job.outputs[index] = self._output(job, index, [], [], reason, loaded)
                job.resolve()
            else:
                live.append(job)
        if not live:
            return
        self.batches_run += 1
        self.max_batch_sequences = max(self.max_batch_sequences, sum(job.params.n for job in live))
        device, batch_started_s = self.device, time.time()
        pacer = devicemodel.Pacer(device) if device is not None else None
        tokens_before = self.generated_tokens

        # Prefill each distinct prompt once, left-padded, then repeat its cache rows n times.
        width = max(len(job.input_ids) for job in live)
        pad_id = int(loaded.model.config.pad_token_id or 0)
        input_ids = torch.full((len(live), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for row, job in enumerate(live):
            input_ids[row, width - len(job.input_ids) :] = torch.tensor(job.input_ids)
            mask[row, width - len(job.input_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=loaded.model.config)
        out = loaded.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{loaded.cache_kwarg: cache},
        )
        logits = out.logits[:, -1, :].float()
        if pacer is not None and device is not None:  # modelled prefill of each distinct prompt
            pacer.add(devicemodel.prefill_s(device, sum(len(job.input_ids) for job in live) * device.token_scale))
            pacer.wait()
        expand = torch.tensor([row for row, job in enumerate(live) for _ in range(job.params.n)])
        cache.batch_select_indices(expand)
        logits, mask, last_position = logits[expand], mask[expand], positions[expand, -1]
        sequences = [
            _Sequence(job, index, self._generator(job, index)) for job in live for index in range(job.params.n)
        ]
        with self._cond:
            self._running_tokens = int(mask.sum())

        while sequences:
            next_ids: list[int] = []
            keep: list[int] = []
            for row, seq in enumerate(sequences):
                if seq.job.aborted:
                    self._finish(seq, _abort_reason(), loaded)
                    continue
                token_id, logprob = self._sample(logits[row], seq)
                seq.output_ids.append(token_id)
                seq.logprobs.append(logprob)
                self.generated_tokens += 1
                stop = self._stop_reason(seq, token_id, loaded)
                if stop is not None:
                    self._finish(seq, stop, loaded)
                    continue
                next_ids.append(token_id)
                keep.append(row)
            if not keep:
                break
            if len(keep) < len(sequences):
                kept = torch.tensor(keep)
                cache.batch_select_indices(kept)
                mask, last_position = mask[kept], last_position[kept]
                sequences = [sequences[row] for row in keep]
            mask = torch.cat([mask, torch.ones((len(keep), 1), dtype=torch.long)], dim=1)
            last_position = last_position + 1
            with self._cond:
                self._running_tokens = int(mask.sum())
            out = loaded.model(
                input_ids=torch.tensor(next_ids).unsqueeze(1),
                attention_mask=mask,
                position_ids=last_position.unsqueeze(1),
                use_cache=True,
                **{loaded.cache_kwarg: cache},
            )
            logits = out.logits[:, -1, :].float()
            if pacer is not None and device is not None:  # token_scale modelled iterations of this batch
                pacer.add(devicemodel.real_decode_iteration_s(device, len(keep), float(mask.sum())))
                pacer.wait()
        if pacer is not None and self._trace is not None:
            self._trace.record("generate", batch_started_s, time.time(), pacer.modelled_s,
                               tokens=(self.generated_tokens - tokens_before) * (device.token_scale if device else 1.0),
                               overrun_s=pacer.overrun_s)

    def _generator(self, job: _Job, sample_index: int) -> torch.Generator:
        seed = job.params.seed if job.params.seed is not None else self.new_seed()
        generator = torch.Generator()
        generator.manual_seed((seed * 1_000_003 + sample_index) % (1 << 63))
        return generator

    def _sample(self, logits: torch.Tensor, seq: _Sequence) -> tuple[int, float]:
        params = seq.job.params
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if params.temperature == 0:
            token_id = int(torch.argmax(logits))
            return token_id, max(float(raw_logprobs[token_id]), _LOGPROB_FLOOR)
        scaled_logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = scaled_logprobs.exp()
        if params.top_k > 0 and params.top_k < probs.numel():
            threshold = torch.topk(probs, params.top_k).values[-1]
            probs = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = (cumulative - sorted_probs) > params.top_p * cumulative[-1]
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        if params.min_p > 0:
            probs = torch.where(probs >= params.min_p * probs.max(), probs, torch.zeros_like(probs))
        token_id = int(torch.multinomial(probs / probs.sum(), 1, generator=seq.generator))
        source = raw_logprobs if self.config.return_original_logprob else scaled_logprobs
        return token_id, max(float(source[token_id]), _LOGPROB_FLOOR)

    @staticmethod
    def _stop_reason(seq: _Sequence, token_id: int, loaded: _LoadedModel) -> dict[str, Any] | None:
        params = seq.job.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in loaded.eos_token_ids):
            return {"type": "stop", "matched": token_id}
        if len(seq.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def _finish(self, seq: _Sequence, reason: dict[str, Any], loaded: _LoadedModel) -> None:
        job = seq.job
        job.outputs[seq.sample_index] = self._output(
            job, seq.sample_index, seq.output_ids, seq.logprobs, reason, loaded
        )
        if all(output is not None for output in job.outputs):
            job.resolve()

    @staticmethod
    def _output(
        job: _Job,
        sample_index: int,
        output_ids: list[int],
        logprobs: list[float],
        reason: dict[str, Any],
        loaded: _LoadedModel,
    ) -> dict[str, Any]:
        text = ""
        if loaded.tokenizer is not None and output_ids:
            text = loaded.tokenizer.decode(output_ids, skip_special_tokens=True)
        meta_info: dict[str, Any] = {
            "id": job.rid if job.params.n == 1 else f"{job.rid}-{sample_index}",
            "finish_reason": reason,
            "prompt_tokens": len(job.input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": loaded.weight_version,
            "model_path": loaded.model_path,  # FlexMARL extension: the checkpoint dir served
            "e2e_latency": time.monotonic() - job.created_s,
        }
        if job.return_logprob:
            # SGLang's shape: one [logprob, token_id, text-or-null] triple per output token.
            meta_info["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(logprobs, output_ids, strict=True)]
        return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info}


def _abort_reason() -> dict[str, Any]:
    return {"type": "abort", "message": "Abort request", "status_code": 200, "err_type": None}


# ----- HTTP ------------------------------------------------------------------------------
def _error(status: int, message: str) -> web.Response:
    """SGLang's ErrorResponse shape (http_server.py, _create_error_response)."""
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
    return web.json_response(body, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


class EmbeddedServer:
    """The aiohttp application around one :class:`EmbeddedEngine`."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self._runner: web.AppRunner | None = None
        self._ready = False
        self.port = 0

    def build_app(self) -> web.Application:
        """Routes, methods and paths as in SGLang's http_server.py."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/get_weight_version", self.weight_version)
        for method in ("GET", "POST"):
            app.router.add_route(method, "/flush_cache", self.flush_cache)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        return app

    async def start(self, host: str, port: int) -> int:
        """Start the worker thread and listen; returns the bound port."""
        self.engine.start()
        self._runner = web.AppRunner(self.build_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._ready = True
        return self.port

    async def stop(self) -> None:
        """Stop listening and stop the engine (idempotent)."""
        self._ready = False
        await asyncio.to_thread(self.engine.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----- handlers ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``/generate``: one dict for one prompt with n == 1, otherwise a list (prompt-major)."""
        try:
            body = await _json_body(request)
            if body.get("stream"):
                raise InvalidArgument("stream is not supported by the embedded engine")
            if "input_ids" not in body:
                raise InvalidArgument("input_ids is required (the embedded engine does not take text)")
            prompts = parse_input_ids(body["input_ids"])
            jobs = self._make_jobs(body, prompts)
        except FlexmarlError as exc:
            return _error(400, str(exc))
        for job in jobs:
            self.engine.submit(job)
        try:
            results = await asyncio.gather(*(job.future for job in jobs))
        except asyncio.CancelledError:
            for job in jobs:
                job.aborted = True  # the client went away: stop spending tokens on it
            raise
        outputs = [output for result in results for output in result]
        if len(prompts) == 1 and jobs[0].params.n == 1 and not isinstance(body["input_ids"][0], list):
            return web.json_response(outputs[0])
        return web.json_response(outputs)

    def _make_jobs(self, body: dict[str, Any], prompts: list[list[int]]) -> list[_Job]:
        raw_params = body.get("sampling_params") or {}
        params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(params_list) != len(prompts) or not all(isinstance(p, dict) for p in params_list):
            raise InvalidArgument("sampling_params must be an object or one object per prompt")
        rid_field = body.get("rid")
        rids = rid_field if isinstance(rid_field, list) else None
        if rids is not None and len(rids) != len(prompts):
            raise InvalidArgument("rid must have one entry per prompt")
        return_logprob = body.get("return_logprob") or False
        loaded = self.engine.loaded
        loop = asyncio.get_running_loop()
        jobs: list[_Job] = []
        for index, (prompt, raw) in enumerate(zip(prompts, params_list, strict=True)):
            params = SamplingParams.from_wire(raw)
            if len(prompt) + params.max_new_tokens > loaded.max_positions:
                raise InvalidArgument(
                    f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                    f"context length {loaded.max_positions}"
                )
            vocab = int(loaded.model.config.vocab_size)
            if max(prompt) >= vocab:
                raise InvalidArgument(f"input_ids contain a token >= vocab size {vocab}")
            if rids is not None:
                rid = str(rids[index])
            elif rid_field is not None:
                rid = str(rid_field) if len(prompts) == 1 else f"{rid_field}-{index}"
            else:
                rid = uuid.uuid4().hex
            wants_logprob = return_logprob[index] if isinstance(return_logprob, list) else return_logprob
            jobs.append(_Job(rid, prompt, params, bool(wants_logprob), loop, loop.create_future()))
        return jobs

    async def health(self, request: web.Request) -> web.Response:
        """200 once serving, 503 while starting or stopping."""
        return web.Response(status=200 if self._ready else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one greedy token end to end (as SGLang's health check does)."""
        if not self._ready:
            return web.Response(status=503)
        loop = asyncio.get_running_loop()
        job = _Job(
            f"HEALTH_CHECK_{time.time()}",
            [0],
            SamplingParams(temperature=0.0, max_new_tokens=1),
            False,
            loop,
            loop.create_future(),
        )
        try:
            self.engine.submit(job)
            await asyncio.wait_for(job.future, timeout=20)
        except (TimeoutError, FlexmarlError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """Fields of SGLang's ``/get_model_info``."""
        loaded = self.engine.loaded
        return web.json_response(
            {
                "model_path": loaded.model_path,
                "tokenizer_path": loaded.model_path if loaded.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": loaded.weight_version,
            }
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version``."""
        return web.json_response({"weight_version": self.engine.loaded.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """Server arguments plus internal state, like SGLang's ``/get_server_info``."""
        engine = self.engine
        info: dict[str, Any] = dataclasses.asdict(engine.config)
        info.update(
            {
                "model_path": engine.loaded.model_path,
                "weight_version": engine.loaded.weight_version,
                "max_running_requests": engine.config.max_batch_size,
                "context_length": engine.loaded.max_positions,
                "internal_states": [
                    {
                        "batches_run": engine.batches_run,
                        "max_batch_sequences": engine.max_batch_sequences,
                        "generated_tokens": engine.generated_tokens,
                    }
                ],
                "version": ENGINE_VERSION,
                "backend": "embedded",
            }
        )
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Nothing is cached across requests here, so flushing always succeeds."""
        return web.Response(text="Cache flushed.\n", status=200)

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` with the ``core`` fields of SGLang's ``GetLoadsReqOutput``."""
        engine = self.engine
        snapshot = engine.load_snapshot()
        uptime_s = max(time.monotonic() - engine._started_s, 1e-9)
        load = {
            "dp_rank": 0,
            "timestamp": time.time(),
            **snapshot,
            "max_total_num_tokens": engine.config.max_batch_size * engine.loaded.max_positions,
            "token_usage": 0.0,
            "gen_throughput": engine.generated_tokens / uptime_s,
            "cache_hit_rate": 0.0,
            "utilization": 1.0 if snapshot["num_running_reqs"] else 0.0,
            "max_running_requests": engine.config.max_batch_size,
        }
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": ENGINE_VERSION,
                "accelerator": None,
                "num_accelerators": 0,
                "loads": [load],
            }
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request`` with SGLang's ``AbortReq`` fields ``rid`` and ``abort_all``."""
        try:
            body = await _json_body(request)
        except FlexmarlError as exc:
            return _error(400, str(exc))
        self.engine.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Load ``model_path`` off to the side, then swap it in between batches."""
        try:
            body = await _json_body(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise InvalidArgument("model_path is required")
            load_format = body.get("load_format")
            if load_format not in (None, "auto", "safetensors"):
                raise InvalidArgument(f"load_format {load_format!r} is not supported (auto, safetensors)")
            current = self.engine.loaded
            version = body.get("weight_version")
            new_version = current.weight_version if version is None else str(version)
            loaded = await asyncio.to_thread(load_model, model_path, new_version)
            reason = _compatible(current, loaded)
            if reason:
                raise InvalidArgument(f"incompatible checkpoint: {reason}")
        except FlexmarlError as exc:
            body_out = {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}
            return web.json_response(body_out, status=400)
        if body.get("abort_all_requests"):
            self.engine.abort("", abort_all=True)
        loop = asyncio.get_running_loop()
        swap = _WeightSwap(loaded, loop, loop.create_future())
        self.engine.submit_swap(swap)
        await swap.future
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {new_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


# ----- entry point -----------------------------------------------------------------------
def _parse_args(argv: Sequence[str] | None) -> EmbeddedEngineConfig:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutd.engines.embedded", description="FlexMARL embedded CPU inference engine"
    )
    parser.add_argument("--model-path", required=True, help="Hugging Face causal-LM checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (loopback by default)")
    parser.add_argument("--port", type=int, default=0, help="listen port (0: the OS picks)")
    parser.add_argument("--ready-file", default="", help='write {"port", "pid"} JSON here once listening')
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most sequences decoded together")
    parser.add_argument("--batch-window-s", type=float, default=0.002, help="wait for co-arriving requests")
    parser.add_argument("--weight-version", default="default", help="initial weight_version reported")
    parser.add_argument("--seed", type=int, default=None, help="seed for requests that bring none")
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        help="logprobs of the raw distribution instead of the temperature-scaled one",
    )
    parser.add_argument("--modelled-device", default="",
                        help="device profile (JSON/YAML, flexmarl.devicemodel): take that accelerator's time; "
                             "default: $FLEXMARL_MODELLED_DEVICE")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads < 1 or args.max_batch_size < 1 or args.batch_window_s < 0:
        parser.error("--num-threads and --max-batch-size must be >= 1, --batch-window-s >= 0")
    return EmbeddedEngineConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        batch_window_s=args.batch_window_s,
        return_original_logprob=args.return_original_logprob,
        weight_version=args.weight_version,
        seed=args.seed,
        ready_file=args.ready_file,
        modelled_device=args.modelled_device,
    )


def _write_ready_file(path: str, port: int) -> None:
    """Atomically write the ready file, so a reader never sees half of it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(target)


async def serve(config: EmbeddedEngineConfig) -> None:
    """Run one replica until SIGTERM or SIGINT."""
    torch.set_num_threads(config.num_threads)
    engine = await asyncio.to_thread(EmbeddedEngine, config)
    server = EmbeddedServer(engine)
    port = await server.start(config.host, config.port)
    logger.info("embedded engine serving %s on %s:%d", config.model_path, config.host, port)
    if config.ready_file:
        _write_ready_file(config.ready_file, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping")
    await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rolloutd.engines.embedded``."""
    asyncio.run(serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
