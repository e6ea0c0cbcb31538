"""The synthetic engine: many modelled replicas in one process, lengths only, no neural net.

It serves the same subset of SGLang's native HTTP API as the embedded engine (``/generate``,
``/health``, ``/health_generate``, ``/update_weights_from_disk``, ``/abort_request``,
``/get_model_info`` and ``/model_info``, ``/get_server_info`` and ``/server_info``,
``/flush_cache``, ``/v1/loads``, ``/get_weight_version``) plus ``/get_load`` (polled by
sglang-router's ``power_of_two`` policy), one aiohttp application per port, so rolloutd and
sglang-router drive it through their ordinary clients. It exists for the scale-out benchmark:
64 or more modelled replicas do not fit a small CPU machine as embedded engines.

What it returns: token ids drawn from a seeded ``random.Random`` (the request's
``sampling_seed``, else the engine seed and a counter), never a stop token; every logprob is
``-ln(vocab_size)`` (a uniform policy). Length: ``max_new_tokens`` when ``ignore_eos`` is set
or no EOS length is configured; otherwise a lognormal draw (``eos_median_tokens``,
``eos_sigma``) capped at ``max_new_tokens``, ending with the EOS id (finish reason ``stop``).

Time (:mod:`flexmarl.devicemodel`): each replica runs SGLang-style continuous batching. At
every iteration boundary waiting requests join the running batch (up to
``max_running_requests`` sequences, prefill of their prompts charged once); one iteration
produces one token for each running sequence and costs
``devicemodel.real_decode_iteration_s`` (``token_scale`` modelled iterations of the live
batch and its context). Rather than sleeping per iteration, a replica computes the iterations
up to its next completion and sleeps once (an arrival wakes it, and it admits the newcomer at
the next iteration boundary). Wall time = modelled time × ``time_scale``; when the process
falls behind, the replica's timeline slips and the slip is traced as ``overrun_s``. A weight
update stops admission, waits for the running batch, then blocks the replica for
``devicemodel.weight_transfer_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.protocol import SamplingParams, parse_input_ids

logger = logging.getLogger(__name__)

ENGINE_VERSION = "flexmarl-synthetic-0.1"


@dataclasses.dataclass(frozen=True)
class SyntheticEngineConfig:
    """Settings of a synthetic engine process (every replica shares them)."""

    replicas: int = 1
    host: str = "127.0.0.1"
    ports: tuple[int, ...] = ()  # one per replica; empty: the OS picks every port
    model_path: str = "synthetic"
    weight_version: str = "default"
    vocab_size: int = 256
    eos_token_id: int = 257
    eos_median_tokens: float = 0.0  # 0: every sample runs to max_new_tokens
    eos_sigma: float = 1.0
    max_running_requests: int = 256
    seed: int = 0
    # Device profile file; "" = $FLEXMARL_MODELLED_DEVICE, and without either the H100 preset
    # at token_scale 1 and time_scale 1 (real time of the modelled accelerator).
    modelled_device: str = ""
    check_model_path: bool = True  # weight updates need an existing directory
    ready_file: str = ""

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` on an out-of-range setting."""
        if self.replicas < 1:
            raise InvalidArgument("replicas must be >= 1")
        if self.ports and len(self.ports) != self.replicas:
            raise InvalidArgument(f"{len(self.ports)} ports for {self.replicas} replicas")
        if self.vocab_size < 2 or self.max_running_requests < 1:
            raise InvalidArgument("vocab_size must be >= 2 and max_running_requests >= 1")
        if self.eos_median_tokens < 0 or self.eos_sigma < 0:
            raise InvalidArgument("eos_median_tokens and eos_sigma must be >= 0")

    def profile(self) -> devicemodel.DeviceProfile:
        """The device profile that sets modelled time."""
        if self.modelled_device:
            return devicemodel.load_profile(self.modelled_device)
        return devicemodel.profile_from_env() or devicemodel.H100_SXM.with_changes(token_scale=1.0, time_scale=1.0)


@dataclasses.dataclass
class _Request:
    """One prompt to complete ``params.n`` times."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    seed: int
    future: asyncio.Future[list[dict[str, Any]]]
    created_s: float = dataclasses.field(default_factory=time.monotonic)
    aborted: bool = False
    outputs: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Sequence:
    """One sample in the running batch."""

    request: _Request
    sample_index: int
    target_tokens: int
    stops: bool  # ends with EOS (finish reason stop) rather than at max_new_tokens
    generated: int = 0

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated

    @property
    def context_tokens(self) -> int:
        return len(self.request.input_ids) + self.generated


@dataclasses.dataclass
class _WeightUpdate:
    model_path: str
    weight_version: str
    future: asyncio.Future[None]


class SyntheticReplica:
    """One modelled replica: a continuous-batching scheduler on the event loop."""

    def __init__(self, index: int, config: SyntheticEngineConfig, profile: devicemodel.DeviceProfile) -> None:
        self.index = index
        self.config = config
        self.profile = profile
        self.model_path = config.model_path
        self.weight_version = config.weight_version
        self.port = 0
        self._waiting: list[_Request] = []
        self._running: list[_Sequence] = []
        self._updates: list[_WeightUpdate] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seed_counter = 0
        self._trace: devicemodel.TraceWriter | None = None
        self._started_s = time.monotonic()
        self.generated_tokens = 0
        self.iterations = 0
        self.max_batch_sequences = 0
        self.modelled_busy_s = 0.0
        self.overrun_s = 0.0
        self.ready = False

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self, port: int) -> None:
        """Start the scheduler (the port names the trace file)."""
        self.port = port
        self._trace = devicemodel.TraceWriter(self.profile, f"engine-synth-{os.getpid()}-{self.index}")
        self._task = asyncio.get_running_loop().create_task(self._scheduler(), name=f"synthetic replica {self.index}")
        self.ready = True

    async def stop(self) -> None:
        """Fail everything pending and stop the scheduler (idempotent)."""
        self.ready = False
        for request in self._waiting + [seq.request for seq in self._running]:
            if not request.future.done():
                request.future.set_exception(FlexmarlError("engine stopped"))
        self._waiting.clear()
        self._running.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---- requests ---------------------------------------------------------------------------------------
    def new_seed(self) -> int:
        """Seed of a request that brought none: the engine seed, the replica and a counter."""
        self._seed_counter += 1
        return (self.config.seed * 1_000_003 + self.index * 7_919 + self._seed_counter) % (1 << 62)

    def submit(self, request: _Request) -> None:
        """Queue a request; it joins the batch at the next iteration boundary."""
        if not self.ready:
            raise Unavailable("engine stopped")
        self._waiting.append(request)
        self._wake.set()

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort waiting and running requests whose rid starts with ``rid``."""
        count = 0
        for request in self._waiting + [seq.request for seq in self._running]:
            if abort_all or (rid and request.rid.startswith(rid)):
                request.aborted = True
                count += 1
        self._wake.set()
        return count

    async def update_weights(self, model_path: str, weight_version: str) -> None:
        """Stop admission, let the running batch finish, then spend the modelled reload time."""
        update = _WeightUpdate(model_path, weight_version, asyncio.get_running_loop().create_future())
        self._updates.append(update)
        self._wake.set()
        await update.future

    def load(self) -> dict[str, int]:
        """Queue and batch sizes in SGLang's ``/v1/loads`` vocabulary."""
        used = sum(seq.context_tokens for seq in self._running)
        waiting = sum(len(r.input_ids) * r.params.n for r in self._waiting)
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": sum(r.params.n for r in self._waiting),
            "num_used_tokens": used,
            "num_total_tokens": used + waiting,
        }

    # ---- scheduling -------------------------------------------------------------------------------------
    def _target_length(self, request: _Request, sample_index: int) -> tuple[int, bool]:
        params = request.params
        if params.ignore_eos or self.config.eos_median_tokens <= 0:
            return params.max_new_tokens, False
        rng = random.Random(f"len|{request.seed}|{sample_index}")
        drawn = self.config.eos_median_tokens * math.exp(self.config.eos_sigma * rng.gauss(0.0, 1.0))
        length = max(1, round(drawn))
        return (length, True) if length < params.max_new_tokens else (params.max_new_tokens, False)

    def _admit(self) -> int:
        """Move waiting requests into the batch; returns the prompt tokens to prefill."""
        prompt_tokens = 0
        while self._waiting and not self._updates:
            request = self._waiting[0]
            if self._running and len(self._running) + request.params.n > self.config.max_running_requests:
                break
            self._waiting.pop(0)
            request.outputs = [None] * request.params.n
            if request.aborted or request.params.max_new_tokens == 0:
                self._resolve_empty(request)
                continue
            prompt_tokens += len(request.input_ids)  # one prefill per prompt, shared by its n samples
            for index in range(request.params.n):
                target, stops = self._target_length(request, index)
                self._running.append(_Sequence(request, index, target, stops))
        self.max_batch_sequences = max(self.max_batch_sequences, len(self._running))
        return prompt_tokens

    def _resolve_empty(self, request: _Request) -> None:
        reason = _abort_reason() if request.aborted else {"type": "length", "length": 0}
        for index in range(request.params.n):
            request.outputs[index] = self._output(request, index, [], reason)
        _resolve(request)

    def _plan(self, prefill_tokens: int) -> list[float]:
        """Cumulative modelled seconds to the end of each iteration until the first sequence finishes."""
        profile = self.profile
        batch = len(self._running)
        context = sum(seq.context_tokens for seq in self._running)
        steps = min(seq.remaining for seq in self._running)
        elapsed_s = devicemodel.prefill_s(profile, prefill_tokens * profile.token_scale) if prefill_tokens else 0.0
        cumulative: list[float] = []
        for step in range(steps):
            elapsed_s += devicemodel.real_decode_iteration_s(profile, batch, float(context + batch * step))
            cumulative.append(elapsed_s)
        return cumulative

    async def _scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        timeline_s = loop.time()  # wall time at which this replica's modelled work reaches "now"
        while True:
            self._drop_aborted()
            if not self._running and self._updates:
                timeline_s = await self._apply_update(max(timeline_s, loop.time()))
                continue
            prefill_tokens = self._admit()
            if not self._running:
                self._wake.clear()
                if not self._waiting and not self._updates:
                    await self._wake.wait()
                continue
            start_s = max(timeline_s, loop.time())
            cumulative = self._plan(prefill_tokens)
            scale = self.profile.time_scale
            self._wake.clear()
            steps = len(cumulative)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), start_s + cumulative[-1] * scale - loop.time())
                # Woken by an arrival, abort or weight update: finish the iteration in progress.
                done_s = (loop.time() - start_s) / scale
                steps = min(bisect.bisect_left(cumulative, done_s) + 1, len(cumulative))
                await asyncio.sleep(max(0.0, start_s + cumulative[steps - 1] * scale - loop.time()))
            end_s = start_s + cumulative[steps - 1] * scale
            overrun_s = max(0.0, loop.time() - end_s)
            self.overrun_s += overrun_s
            timeline_s = end_s
            self._advance(steps, cumulative[steps - 1], start_s, end_s, overrun_s)

    def _advance(self, steps: int, modelled_s: float, start_s: float, end_s: float, overrun_s: float) -> None:
        batch = len(self._running)
        self.iterations += steps
        self.generated_tokens += steps * batch
        self.modelled_busy_s += modelled_s
        if self._trace is not None:
            wall_offset_s = time.time() - asyncio.get_running_loop().time()
            self._trace.record(
                "generate",
                start_s + wall_offset_s,
                end_s + wall_offset_s,
                modelled_s,
                tokens=steps * batch * self.profile.token_scale,
                overrun_s=overrun_s,
            )
        still: list[_Sequence] = []
        for seq in self._running:
            seq.generated += steps
            if seq.remaining > 0:
                still.append(seq)
                continue
            reason = (
                {"type": "stop", "matched": self.config.eos_token_id}
                if seq.stops
                else {"type": "length", "length": seq.request.params.max_new_tokens}
            )
            self._finish(seq, reason)
        self._running = still

    def _drop_aborted(self) -> None:
        kept = []
        for seq in self._running:
            if seq.request.aborted:
                self._finish(seq, _abort_reason())
            else:
                kept.append(seq)
        self._running = kept

    async def _apply_update(self, start_s: float) -> float:
        loop = asyncio.get_running_loop()
        modelled_s = devicemodel.weight_transfer_s(self.profile)
        end_s = start_s + modelled_s * self.profile.time_scale
        await asyncio.sleep(max(0.0, end_s - loop.time()))
        update = self._updates.pop(0)
        self.model_path, self.weight_version = update.model_path, update.weight_version
        if self._trace is not None:
            wall_offset_s = time.time() - loop.time()
            self._trace.record("reload", start_s + wall_offset_s, end_s + wall_offset_s, modelled_s)
        if not update.future.done():
            update.future.set_result(None)
        return end_s

    # ---- outputs ----------------------------------------------------------------------------------------
    def _finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        request = seq.request
        request.outputs[seq.sample_index] = self._output(request, seq.sample_index, self._tokens(seq), reason)
        if all(output is not None for output in request.outputs):
            _resolve(request)

    def _tokens(self, seq: _Sequence) -> list[int]:
        count = seq.generated
        rng = random.Random(seq.request.seed * 1_000_003 + seq.sample_index)
        stop_ids = set(seq.request.params.stop_token_ids) | {self.config.eos_token_id}
        tokens: list[int] = []
        while len(tokens) < count - (1 if seq.stops else 0):
            token = rng.randrange(self.config.vocab_size)
            if token not in stop_ids:
                tokens.append(token)
        if seq.stops:
            tokens.append(self.config.eos_token_id)
        return tokens[:count]

    def _output(
        self, request: _Request, sample_index: int, output_ids: list[int], reason: dict[str, Any]
    ) -> dict[str, Any]:
        meta_info: dict[str, Any] = {
            "id": request.rid if request.params.n == 1 else f"{request.rid}-{sample_index}",
            "finish_reason": reason,
            "prompt_tokens": len(request.input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "model_path": self.model_path,
            "e2e_latency": time.monotonic() - request.created_s,
        }
        if request.return_logprob:
            logprob = -math.log(self.config.vocab_size)
            meta_info["output_token_logprobs"] = [[logprob, token, None] for token in output_ids]
        return {"text": "", "output_ids": output_ids, "meta_info": meta_info}


def _resolve(request: _Request) -> None:
    if not request.future.done():
        request.future.set_result([output for output in request.outputs if output is not None])


def _abort_reason() -> dict[str, Any]:
    return {"type": "abort", "message": "Abort request", "status_code": 200, "err_type": None}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}, "message": message}, status=status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


class SyntheticServer:
    """The HTTP face of one replica (SGLang's paths and field names)."""

    def __init__(self, replica: SyntheticReplica) -> None:
        self.replica = replica
        self._runner: web.AppRunner | None = None

    def build_app(self) -> web.Application:
        """Routes as in SGLang's http_server.py (the subset rolloutd and sglang-router use)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("POST", "/generate", self.generate)
        app.router.add_route("PUT", "/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self.server_info)
        app.router.add_get("/get_weight_version", self.get_weight_version)
        for method in ("GET", "POST"):
            app.router.add_route(method, "/flush_cache", self.flush_cache)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/get_load", self.get_load)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen and start the replica's scheduler; returns the bound port."""
        self._runner = web.AppRunner(self.build_app(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, backlog=1024).start()
        bound = int(self._runner.addresses[0][1])
        self.replica.start(bound)
        return bound

    async def stop(self) -> None:
        """Stop the replica and stop listening (idempotent)."""
        await self.replica.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def generate(self, request: web.Request) -> web.Response:
        """``/generate``: one dict for one prompt with n == 1, otherwise a list."""
        replica = self.replica
        try:
            body = await _json_body(request)
            if body.get("stream"):
                raise InvalidArgument("stream is not supported by the synthetic engine")
            if "input_ids" not in body:
                raise InvalidArgument("input_ids is required (the synthetic engine does not take text)")
            prompts = parse_input_ids(body["input_ids"])
            jobs = self._make_requests(body, prompts)
            for job in jobs:
                replica.submit(job)
        except FlexmarlError as exc:
            return _error(503 if isinstance(exc, Unavailable) else 400, str(exc))
        try:
            results = await asyncio.gather(*(job.future for job in jobs))
        except asyncio.CancelledError:
            for job in jobs:
                job.aborted = True
            raise
        except FlexmarlError as exc:
            return _error(503, str(exc))
        outputs = [output for result in results for output in result]
        if len(prompts) == 1 and jobs[0].params.n == 1 and not isinstance(body["input_ids"][0], list):
            return web.json_response(outputs[0])
        return web.json_response(outputs)

    def _make_requests(self, body: dict[str, Any], prompts: list[list[int]]) -> list[_Request]:
        raw_params = body.get("sampling_params") or {}
        params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(params_list) != len(prompts) or not all(isinstance(p, dict) for p in params_list):
            raise InvalidArgument("sampling_params must be an object or one object per prompt")
        rid_field = body.get("rid")
        return_logprob = body.get("return_logprob") or False
        loop = asyncio.get_running_loop()
        requests = []
        for index, (prompt, raw) in enumerate(zip(prompts, params_list, strict=True)):
            params = SamplingParams.from_wire(raw)
            if isinstance(rid_field, list):
                rid = str(rid_field[index])
            elif rid_field is not None:
                rid = str(rid_field) if len(prompts) == 1 else f"{rid_field}-{index}"
            else:
                rid = uuid.uuid4().hex
            wants = return_logprob[index] if isinstance(return_logprob, list) else return_logprob
            seed = params.seed if params.seed is not None else self.replica.new_seed()
            requests.append(_Request(rid, prompt, params, bool(wants), seed, loop.create_future()))
        return requests

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving."""
        return web.Response(status=200 if self.replica.ready else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generate one token through the scheduler."""
        if not self.replica.ready:
            return web.Response(status=503)
        job = _Request(
            f"HEALTH_CHECK_{time.time()}",
            [0],
            SamplingParams(max_new_tokens=1),
            False,
            0,
            asyncio.get_running_loop().create_future(),
        )
        try:
            self.replica.submit(job)
            await asyncio.wait_for(job.future, timeout=20)
        except (TimeoutError, FlexmarlError):
            return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """Fields of SGLang's ``/get_model_info``."""
        return web.json_response(
            {
                "model_path": self.replica.model_path,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.replica.weight_version,
            }
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        """``/get_weight_version``."""
        return web.json_response({"weight_version": self.replica.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        """Server arguments and state, like SGLang's ``/get_server_info`` (``dp_size`` for sglang-router)."""
        replica = self.replica
        info: dict[str, Any] = {k: v for k, v in dataclasses.asdict(replica.config).items() if k != "ports"}
        info.update(
            {
                "model_path": replica.model_path,
                "weight_version": replica.weight_version,
                "port": replica.port,
                "tp_size": 1,
                "dp_size": 1,
                "max_running_requests": replica.config.max_running_requests,
                "device_profile": replica.profile.name,
                "version": ENGINE_VERSION,
                "backend": "synthetic",
                "internal_states": [
                    {
                        "iterations": replica.iterations,
                        "generated_tokens": replica.generated_tokens,
                        "max_batch_sequences": replica.max_batch_sequences,
                        "modelled_busy_s": replica.modelled_busy_s,
                        "overrun_s": replica.overrun_s,
                    }
                ],
            }
        )
        return web.json_response(info)

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Nothing is cached, so flushing always succeeds."""
        return web.Response(text="Cache flushed.\n", status=200)

    async def loads(self, request: web.Request) -> web.Response:
        """``/v1/loads`` (the ``core`` fields of SGLang's ``GetLoadsReqOutput``)."""
        replica = self.replica
        snapshot = replica.load()
        uptime_s = max(time.monotonic() - replica._started_s, 1e-9)
        load = {
            "dp_rank": 0,
            "timestamp": time.time(),
            **snapshot,
            "max_running_requests": replica.config.max_running_requests,
            "gen_throughput": replica.generated_tokens / uptime_s,
            "utilization": 1.0 if snapshot["num_running_reqs"] else 0.0,
        }
        return web.json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": ENGINE_VERSION,
                "loads": [load],
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        """``/get_load``: sglang-router's power-of-two policy reads ``num_tokens``."""
        snapshot = self.replica.load()
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": snapshot["num_running_reqs"] + snapshot["num_waiting_reqs"],
                    "num_waiting_reqs": snapshot["num_waiting_reqs"],
                    "num_tokens": snapshot["num_total_tokens"],
                }
            ]
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        """``/abort_request`` with ``rid`` and ``abort_all``."""
        try:
            body = await _json_body(request)
        except FlexmarlError as exc:
            return _error(400, str(exc))
        self.replica.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """Record the new model path and version after the modelled reload (no weights are read)."""
        replica = self.replica
        try:
            body = await _json_body(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise InvalidArgument("model_path is required")
            if replica.config.check_model_path and not Path(model_path).is_dir():
                raise InvalidArgument(f"{model_path} is not a directory")
        except FlexmarlError as exc:
            return web.json_response(
                {"success": False, "message": f"Failed to update weights: {exc}", "num_paused_requests": 0}, status=400
            )
        version = body.get("weight_version")
        new_version = replica.weight_version if version is None else str(version)
        if body.get("abort_all_requests"):
            replica.abort("", abort_all=True)
        await replica.update_weights(model_path, new_version)
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {new_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


class SyntheticEngine:
    """Every replica of one process."""

    def __init__(self, config: SyntheticEngineConfig) -> None:
        config.validate()
        self.config = config
        profile = config.profile()
        self.servers = [SyntheticServer(SyntheticReplica(i, config, profile)) for i in range(config.replicas)]
        self.ports: list[int] = []

    async def start(self) -> list[int]:
        """Listen on every port; returns the bound ports in replica order."""
        wanted = self.config.ports or (0,) * self.config.replicas
        self.ports = [
            await server.start(self.config.host, port) for server, port in zip(self.servers, wanted, strict=True)
        ]
        return self.ports

    @property
    def urls(self) -> list[str]:
        """``http://host:port`` of every replica."""
        return [f"http://{self.config.host}:{port}" for port in self.ports]

    async def stop(self) -> None:
        """Stop every replica (idempotent)."""
        for server in self.servers:
            await server.stop()


# ---- launching a fleet as a child process ----------------------------------------------------------------


class SyntheticFleet:
    """A synthetic engine process started by a benchmark: its replicas' URLs, and stop()."""

    def __init__(self, process: subprocess.Popen[bytes], urls: list[str], log_path: Path) -> None:
        self.process = process
        self.urls = urls
        self.log_path = log_path

    @classmethod
    def start(
        cls, config: SyntheticEngineConfig, run_dir: Path, *, env: dict[str, str] | None = None, timeout_s: float = 60.0
    ) -> SyntheticFleet:
        """Start ``python -m rolloutd.engines.synthetic`` and wait for its ready file."""
        run_dir.mkdir(parents=True, exist_ok=True)
        ready = run_dir / "synthetic.ready.json"
        ready.unlink(missing_ok=True)
        log_path = run_dir / "synthetic.log"
        command = [sys.executable, "-m", "rolloutd.engines.synthetic", *to_args(config), "--ready-file", str(ready)]
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                tail = log_path.read_bytes()[-4000:].decode(errors="replace")
                raise Unavailable(f"synthetic engine did not start (exit {process.poll()}):\n{tail}")
            time.sleep(0.05)
        ports = json.loads(ready.read_text())["ports"]
        return cls(process, [f"http://{config.host}:{port}" for port in ports], log_path)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=grace_s)


def to_args(config: SyntheticEngineConfig) -> list[str]:
    """Command-line flags that rebuild ``config`` (without the ready file)."""
    args = [
        "--replicas",
        str(config.replicas),
        "--host",
        config.host,
        "--model-path",
        config.model_path,
        "--weight-version",
        config.weight_version,
        "--vocab-size",
        str(config.vocab_size),
        "--eos-token-id",
        str(config.eos_token_id),
        "--eos-median-tokens",
        str(config.eos_median_tokens),
        "--eos-sigma",
        str(config.eos_sigma),
        "--max-running-requests",
        str(config.max_running_requests),
        "--seed",
        str(config.seed),
    ]
    if config.ports:
        args += ["--ports", ",".join(map(str, config.ports))]
    if config.modelled_device:
        args += ["--modelled-device", config.modelled_device]
    if not config.check_model_path:
        args.append("--no-check-model-path")
    return args


def _parse_args(argv: Sequence[str] | None) -> tuple[SyntheticEngineConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m rolloutd.engines.synthetic",
        description="FlexMARL synthetic engine: modelled replicas, lengths only",
    )
    parser.add_argument("--replicas", type=int, default=1, help="replicas served by this process (one port each)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ports", default="", help="comma-separated ports, one per replica (default: OS picks)")
    parser.add_argument("--model-path", default="synthetic", help="model path reported until the first update")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn from [0, vocab-size)")
    parser.add_argument("--eos-token-id", type=int, default=257)
    parser.add_argument(
        "--eos-median-tokens",
        type=float,
        default=0.0,
        help="median of lognormal response lengths without ignore_eos (0: max_new_tokens)",
    )
    parser.add_argument("--eos-sigma", type=float, default=1.0)
    parser.add_argument("--max-running-requests", type=int, default=256, help="sequences per continuous batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modelled-device", default="", help="device profile (default: $FLEXMARL_MODELLED_DEVICE)")
    parser.add_argument("--no-check-model-path", action="store_true", help="accept weight updates of any path")
    parser.add_argument("--ready-file", default="", help='write {"ports", "pid"} JSON here once listening')
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ports = tuple(int(p) for p in args.ports.split(",") if p.strip())
    config = SyntheticEngineConfig(
        replicas=args.replicas,
        host=args.host,
        ports=ports,
        model_path=args.model_path,
        weight_version=args.weight_version,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        eos_median_tokens=args.eos_median_tokens,
        eos_sigma=args.eos_sigma,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        modelled_device=args.modelled_device,
        check_model_path=not args.no_check_model_path,
    )
    return config, args.ready_file


async def serve(config: SyntheticEngineConfig, ready_file: str = "") -> None:
    """Serve every replica until SIGTERM or SIGINT."""
    engine = SyntheticEngine(config)
    ports = await engine.start()
    logger.info("synthetic engine: %d replicas on %s ports %s..%s", len(ports), config.host, ports[0], ports[-1])
    if ready_file:
        target = Path(ready_file)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({"ports": ports, "pid": os.getpid()}))
        tmp.replace(target)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping")
    await engine.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rolloutd.engines.synthetic``."""
    config, ready_file = _parse_args(argv)
    try:
        config.validate()
    except InvalidArgument as exc:
        raise SystemExit(str(exc)) from exc
    asyncio.run(serve(config, ready_file))


if __name__ == "__main__":
    main()
