"""The synthetic engine: many modelled replicas in one process, lengths only, no neural net.

It serves SGLang's native HTTP API through the same server as the embedded engine
(:mod:`rolloutd.engines.embedded.server`: routes, parsing, validation, rids, abort and error
shapes as SGLang 0.5.23) plus ``/get_load`` (polled by sglang-router's ``power_of_two``
policy), one aiohttp application per port, so rolloutd and sglang-router drive it through
their ordinary clients. It exists for the scale-out benchmarks and the engine contract suite
(tests/rolloutd): 64 or more modelled replicas do not fit a small CPU machine as embedded
engines. It lives in benchmarks/ because the daemon never runs it; it imports rolloutd's
server, never the other way round.

What it returns: token ids drawn from a seeded ``random.Random`` (the request's
``sampling_seed``, else the engine seed and a counter; so, as SGLang with
``--enable-deterministic-inference``, the samples of one seeded ``n > 1`` request are
identical), never a stop token; stop strings are rejected (there is no tokenizer); every logprob is
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

Pauses (scheduler.py ``pause_generation``/``continue_generation``): ``in_place`` and
``retract`` stop the replica at the next iteration boundary (``retract`` puts the running
sequences at the end of the waiting queue; they re-prefill prompt plus output when admitted
again). A weight update made while paused blocks the replica for the reload at once, under the
paused sequences, which record the version change (``meta_info.weight_versions``). Pause,
continue and ``/update_weight_version`` are commands applied in order at the next iteration
boundary, as embedded/engine.py's controls (a command wakes the replica, which finishes the iteration in
progress first). A running sequence that is aborted runs one more decode step and then answers
with the tokens it has (scheduler.py; while paused in place, that step comes after continue); one
in the waiting queue (a retracted one included) answers at once.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines import lora, weight_messages
from rolloutd.engines.embedded.interface import (
    DistributedUpdate,
    EngineBackend,
    LoadSnapshot,
    SampleRequest,
    VersionChange,
)
from rolloutd.engines.embedded.outputs import (
    FLUSH_AFTER_UPDATE_FAILED,
    first_sample,
    queued_abort_output,
    running_abort_reason,
    sample_output,
)
from rolloutd.engines.embedded.server import SGLangServer
from rolloutd.engines.launcher import stop_process
from rolloutd.engines.lora import AdapterPool, LoraRef, LoraSettings, LoraUpdate
from rolloutd.engines.protocol import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_VERSION = "flexmarl-synthetic-0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]


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
    # Device profile file; "" = the H100 preset at token_scale 1 and time_scale 1 (real time of
    # the modelled accelerator). The command line falls back to $FLEXMARL_MODELLED_DEVICE.
    modelled_device: str = ""
    check_model_path: bool = True  # weight updates need an existing directory
    ready_file: str = ""
    # SGLang's LoRA flags (rolloutd/engines/lora.py): adapter configs are validated as SGLang
    # does, their weights are not read; a load costs the adapter's modelled transfer time.
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` on an out-of-range setting (the LoRA flags as SGLang checks them)."""
        self.lora.check()
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
        return devicemodel.H100_SXM.with_changes(token_scale=1.0, time_scale=1.0)


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
    lora_id: str | None = None  # its LoRA adapter; None: the base

    def sample_request(self) -> SampleRequest:
        """The request as the HTTP server's sample request."""
        return SampleRequest(
            self.rid, tuple(self.input_ids), self.params, self.return_logprob, self.created_s, self.lora_id
        )


@dataclasses.dataclass
class _Sequence:
    """One sample in the running batch."""

    request: _Request
    sample_index: int
    target_tokens: int
    stops: bool  # ends with EOS (finish reason stop) rather than at max_new_tokens
    generated: int = 0
    version_changes: list[VersionChange] = dataclasses.field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.target_tokens - self.generated

    @property
    def context_tokens(self) -> int:
        return len(self.request.input_ids) + self.generated


@dataclasses.dataclass
class _WeightUpdate:
    model_path: str
    weight_version: str | None  # None keeps the version
    future: asyncio.Future[bool]  # whether the cache flush after it succeeded
    paused: bool = False  # made while paused: applied at once, under whatever runs
    flush_cache: bool = False
    modelled_s: float | None = None  # None: a reload (weight_transfer_s); else a broadcast's modelled time


@dataclasses.dataclass
class _Control:
    """A scheduler command applied between iterations (embedded/work.py ``Control``): pause, resume or rename."""

    kind: str  # "in_place" | "retract" | "resume" | "rename"
    future: asyncio.Future[None]
    weight_version: str = ""


class SyntheticReplica:
    """One modelled replica: a continuous-batching scheduler on the event loop."""

    def __init__(self, index: int, config: SyntheticEngineConfig, profile: devicemodel.DeviceProfile) -> None:
        self.index = index
        self.config = config
        self.profile = profile
        self.model_path = config.model_path
        self.weight_version = config.weight_version
        self.port = 0
        self._waiting: list[_Request | _Sequence] = []  # a _Sequence: retracted by a pause
        self._running: list[_Sequence] = []
        self._updates: list[_WeightUpdate] = []
        self._paused_updates: list[_WeightUpdate] = []
        self._pause_mode = ""  # "in_place" / "retract" while paused (scheduler.py _engine_paused)
        # Pause, resume and rename commands, applied in order at the next iteration boundary.
        self._controls: list[_Control] = []
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
        self.last_output_s = 0.0
        self.ready = False
        self.lora_pool: AdapterPool | None = None
        if config.lora.enabled:
            self._init_lora(config.lora)

    # ---- LoRA adapters (lora_manager.py; configs only, no weights) ------------------------------------------
    def _init_lora(self, settings: LoraSettings) -> None:
        """Resolve targets and max rank, then load the ``--lora-paths`` adapters (as embedded/adapters.py).

        Raises:
            InvalidArgument: A ``--lora-paths`` adapter cannot be loaded.
        """
        settings.check()
        refs = settings.initial_refs()
        configs: list[tuple[str, lora.AdapterConfig]] = []
        try:
            for ref in refs:
                configs.append((ref.lora_name, lora.read_adapter_config(ref.lora_path, self.config.vocab_size)))
            targets, max_rank = AdapterPool.resolve_shapes(settings, configs, None)
        except ValueError as exc:
            raise InvalidArgument(f"Failed to load LoRA adapters: {exc}") from exc
        self.lora_pool = AdapterPool(settings, targets, max_rank)
        for ref, (_, config) in zip(refs, configs, strict=True):
            try:
                self.lora_pool.validate_new(config, ref)
                lora.adapter_num_params(ref.lora_path)
            except (ValueError, OSError) as exc:
                raise InvalidArgument(f"Failed to load LoRA adapter {ref.lora_name}: {exc}") from exc
            self.lora_pool.add(ref, config)

    async def load_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Validate the adapter's config and weights file, then block the replica for its modelled transfer."""
        pool = self.lora_pool
        if pool is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        try:
            config = lora.read_adapter_config(ref.lora_path, self.config.vocab_size)
            pool.validate_new(config, ref)
            params = lora.adapter_num_params(ref.lora_path)
        except (ValueError, OSError) as exc:
            return pool.result(False, str(exc))
        profile = self.profile
        # Its parameters (the adapter file's, as served: bytes_per_param each) over the profile's link,
        # spent at the next iteration boundary under whatever runs, as SGLang's scheduler loads it.
        modelled_s = lora.adapter_transfer_s(profile.link_bytes_per_s, params, profile.bytes_per_param)
        await self.update_weights(self.model_path, None, paused=True, modelled_s=modelled_s)
        pool.add(ref, config)
        return pool.result(True)

    def unload_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Forget the adapter (no request uses it: the server waited)."""
        if self.lora_pool is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        self.lora_pool.remove(ref.lora_id)
        return self.lora_pool.result(True)

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
        for item in self._waiting + self._running:
            request = item.request if isinstance(item, _Sequence) else item
            if not request.future.done():
                request.future.set_exception(FlexmarlError("engine stopped"))
        for update in self._updates + self._paused_updates:
            if not update.future.done():
                update.future.set_exception(FlexmarlError("engine stopped"))
        for control in self._controls:
            if not control.future.done():
                control.future.set_exception(FlexmarlError("engine stopped"))
        self._controls.clear()
        self._waiting.clear()
        self._running.clear()
        self._updates.clear()
        self._paused_updates.clear()
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
        """Abort waiting and running requests whose rid starts with ``rid`` (scheduler.py semantics).

        The server passes only rids it knows exactly (tokenizer_manager.py ``abort_request``).
        Waiting requests (and sequences a pause retracted) answer at once; running ones at the
        next iteration boundary, so while paused in place, after continue.
        """
        count = 0
        kept: list[_Request | _Sequence] = []
        for item in self._waiting:
            request = item.request if isinstance(item, _Sequence) else item
            if abort_all or (rid and request.rid.startswith(rid)):
                request.aborted = True
                count += 1
                self._answer_queued_abort(item)
            else:
                kept.append(item)
        self._waiting = kept
        for seq in self._running:
            if abort_all or (rid and seq.request.rid.startswith(rid)):
                seq.request.aborted = True
                count += 1
        self._wake.set()
        return count

    def _answer_queued_abort(self, item: _Request | _Sequence) -> None:
        if isinstance(item, _Request):
            item.outputs = [None] * item.params.n
            self._resolve_empty(item)
            return
        request = item.request
        sample = request.sample_request()
        if request.params.n > 1:
            sample = dataclasses.replace(sample, rid=f"{request.rid}_{item.sample_index}")
        tokens = self._tokens(item)
        request.outputs[item.sample_index] = queued_abort_output(
            sample,
            self.weight_version,
            output_ids=tokens,
            logprobs=self._logprobs(len(tokens)),
            version_changes=item.version_changes,
        )
        if all(output is not None for output in request.outputs):
            _resolve(request)

    async def update_weights(
        self,
        model_path: str,
        weight_version: str | None,
        *,
        paused: bool = False,
        flush_cache: bool = False,
        modelled_s: float | None = None,
    ) -> bool:
        """Spend the modelled reload time: after the running batch finished, or (``paused``) at once.

        ``modelled_s`` None is a reload (``devicemodel.weight_transfer_s``); else the modelled
        seconds of a broadcast bucket.

        Returns whether the cache flush after it succeeded (refused while sequences run, or,
        unless the scheduler is paused, wait; an update made unpaused finds the scheduler idle).
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        update = _WeightUpdate(
            model_path, weight_version, future, paused=paused, flush_cache=flush_cache, modelled_s=modelled_s
        )
        (self._paused_updates if paused else self._updates).append(update)
        self._wake.set()
        return await update.future

    async def pause(self, mode: str) -> None:
        """Pause at the next iteration boundary (``in_place`` keeps the batch, ``retract`` re-queues it)."""
        await self._control(mode)

    async def resume(self) -> None:
        """Un-pause (continue_generation) at the next iteration boundary, after the commands queued before."""
        await self._control("resume")

    async def rename(self, weight_version: str) -> None:
        """Serve the weights under ``weight_version`` from the next iteration boundary (``/update_weight_version``)."""
        await self._control("rename", weight_version)

    async def _control(self, kind: str, weight_version: str = "") -> None:
        """Queue a command for the scheduler (embedded/engine.py's control FIFO) and wait until it is applied."""
        if not self.ready:
            raise Unavailable("engine stopped")
        control = _Control(kind, asyncio.get_running_loop().create_future(), weight_version)
        self._controls.append(control)
        self._wake.set()
        await control.future

    def change_version(self, new_version: str) -> None:
        """scheduler.py ``record_weight_version_change``: live sequences with tokens note the old version."""
        if new_version == self.weight_version:
            return
        for item in [*self._running, *self._waiting]:
            if isinstance(item, _Sequence) and item.generated:
                item.version_changes.append(VersionChange(self.weight_version, item.generated))
        self.weight_version = new_version

    def load(self) -> LoadSnapshot:
        """Queue and batch sizes (``num_total_tokens`` = used + queued tokens, as load_inquirer.py)."""
        uptime_s = max(time.monotonic() - self._started_s, 1e-9)
        return LoadSnapshot(
            num_running_reqs=len(self._running),
            num_waiting_reqs=sum(1 if isinstance(r, _Sequence) else r.params.n for r in self._waiting),
            num_used_tokens=sum(seq.context_tokens for seq in self._running),
            num_waiting_tokens=sum(
                r.context_tokens if isinstance(r, _Sequence) else len(r.input_ids) * r.params.n for r in self._waiting
            ),
            max_total_num_tokens=int(devicemodel.kv_capacity_tokens(self.profile) / self.profile.token_scale),
            max_running_requests=self.config.max_running_requests,
            gen_throughput=self.generated_tokens / uptime_s,
        )

    def idle(self) -> bool:
        """Nothing running or reloading, and (unless paused) nothing waiting."""
        return (not self._waiting or bool(self._pause_mode)) and not self._running and not self._updates

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
        index = 0
        # scheduler.py can_schedule_lora_req: a request whose adapter does not fit the batch's
        # --max-loras-per-batch is skipped, later ones still join (embedded/admission.py admitted_indices).
        adapters = {seq.request.lora_id for seq in self._running}
        while index < len(self._waiting) and not self._updates:
            item = self._waiting[index]
            adapter = item.request.lora_id if isinstance(item, _Sequence) else item.lora_id
            if not lora.can_schedule(self.lora_pool, adapter, adapters):
                index += 1
                continue
            adapters.add(adapter)
            if isinstance(item, _Sequence):  # retracted: re-prefill prompt plus output on the weights now served
                if self._running and len(self._running) + 1 > self.config.max_running_requests:
                    break
                self._waiting.pop(index)
                prompt_tokens += item.context_tokens
                self._running.append(item)
                continue
            request = item
            if self._running and len(self._running) + request.params.n > self.config.max_running_requests:
                break
            self._waiting.pop(index)
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
        for index in range(request.params.n):
            if request.aborted:  # aborted in the waiting queue (tokenizer_manager.py's shorter answer)
                request.outputs[index] = queued_abort_output(request.sample_request(), self.weight_version)
            else:
                request.outputs[index] = self._output(request, index, [], {"type": "length", "length": 0})
        _resolve(request)

    def _plan(self, prefill_tokens: int) -> list[float]:
        """Cumulative modelled seconds to the end of each iteration until the first sequence finishes."""
        profile = self.profile
        batch = len(self._running)
        context = sum(seq.context_tokens for seq in self._running)
        steps = min(seq.remaining for seq in self._running)
        if any(seq.request.aborted for seq in self._running):
            steps = 1  # an aborted sequence runs one more decode step, then answers (see _advance)
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
            self._apply_controls()
            if self._paused_updates:
                timeline_s = await self._apply_update(max(timeline_s, loop.time()), self._paused_updates)
                continue
            if self._pause_mode:
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._running and self._updates:
                timeline_s = await self._apply_update(max(timeline_s, loop.time()), self._updates)
                continue
            prefill_tokens = self._admit()
            if not self._running:
                self._wake.clear()
                if not self._waiting and not self._updates and not self._paused_updates and not self._controls:
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
        self.last_output_s = time.monotonic()
        still: list[_Sequence] = []
        for seq in self._running:
            seq.generated += steps
            if seq.request.aborted:
                # scheduler.py (embedded/engine.py ``_step``): a running request aborted by /abort_request runs
                # one more decode step, then finishes with FINISH_ABORT and the tokens it has.
                self._finish(seq, running_abort_reason())
                continue
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

    def _apply_controls(self) -> None:
        """Apply the queued pause, continue and rename commands in order at this iteration boundary.

        scheduler.py ``pause_generation``, ``continue_generation`` and the version rename, in the
        order they came (embedded/engine.py's control FIFO): a continue sent right behind a pause ends
        unpaused, and a rename splits the weight-version spans where the batch stands now.
        """
        while self._controls:
            control = self._controls.pop(0)
            if control.kind == "retract":  # to the end of the waiting queue; they re-prefill on continue
                self._waiting.extend(self._running)
                self._running = []
            if control.kind in ("in_place", "retract"):
                self._pause_mode = control.kind
            elif control.kind == "resume":
                self._pause_mode = ""
            elif control.kind == "rename":
                self.change_version(control.weight_version)
            if not control.future.done():
                control.future.set_result(None)

    async def _apply_update(self, start_s: float, queue: list[_WeightUpdate]) -> float:
        loop = asyncio.get_running_loop()
        modelled_s = queue[0].modelled_s if queue and queue[0].modelled_s is not None else None
        if modelled_s is None:
            modelled_s = devicemodel.weight_transfer_s(self.profile)
        end_s = start_s + modelled_s * self.profile.time_scale
        await asyncio.sleep(max(0.0, end_s - loop.time()))
        if not queue:  # stopped meanwhile
            return end_s
        update = queue.pop(0)
        self.model_path = update.model_path
        if update.weight_version is not None:
            self.change_version(update.weight_version)
        if self._trace is not None:
            wall_offset_s = time.time() - loop.time()
            self._trace.record("reload", start_s + wall_offset_s, end_s + wall_offset_s, modelled_s)
        flushed = not (update.paused and update.flush_cache) or (
            not self._running and (bool(self._pause_mode) or not self._waiting)
        )
        if not update.future.done():
            update.future.set_result(flushed)
        return end_s

    # ---- outputs ----------------------------------------------------------------------------------------
    def _finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        request = seq.request
        request.outputs[seq.sample_index] = self._output(
            request, seq.sample_index, self._tokens(seq), reason, seq.version_changes
        )
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

    def _logprobs(self, count: int) -> list[float]:
        return [-math.log(self.config.vocab_size)] * count

    def _output(
        self,
        request: _Request,
        sample_index: int,
        output_ids: list[int],
        reason: dict[str, Any],
        version_changes: Sequence[VersionChange] = (),
    ) -> dict[str, Any]:
        sample = request.sample_request()
        if request.params.n > 1:  # in-process callers only: the HTTP server sends one sample per request
            sample = dataclasses.replace(sample, rid=f"{request.rid}_{sample_index}")
        return sample_output(
            sample,
            output_ids,
            self._logprobs(len(output_ids)),
            reason,
            text="",
            weight_version=self.weight_version,
            model_path=self.model_path,
            version_changes=version_changes,
        )


def _resolve(request: _Request) -> None:
    if not request.future.done():
        request.future.set_result([output for output in request.outputs if output is not None])


class SyntheticBackend(EngineBackend):
    """One :class:`SyntheticReplica` under the shared SGLang-protocol server."""

    name = "synthetic"
    version = ENGINE_VERSION

    def __init__(self, replica: SyntheticReplica) -> None:
        self.replica = replica
        self._weight_groups: dict[str, int] = {}  # group name -> world size (no real group: modelled)
        self._weight_session = False

    async def start(self, port: int) -> None:
        """Start the replica's scheduler."""
        self.replica.start(port)

    async def stop(self) -> None:
        """Stop the replica's scheduler."""
        await self.replica.stop()

    def check(self, request: SampleRequest) -> None:
        """Stop strings need a tokenizer, which the synthetic engine has not."""
        if request.params.stop:
            raise InvalidArgument("sampling_params.stop is not supported by the synthetic engine (no tokenizer)")

    def submit(self, request: SampleRequest) -> asyncio.Future[dict[str, Any]]:
        """Queue the sample; its seed is ``sampling_seed``, else a fresh one."""
        replica = self.replica
        loop = asyncio.get_running_loop()
        inner: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
        seed = request.params.seed if request.params.seed is not None else replica.new_seed()
        job = _Request(request.rid, list(request.input_ids), request.params, request.return_logprob, seed, inner)
        job.created_s = request.created_s
        job.lora_id = request.lora_id
        replica.submit(job)
        return first_sample(inner)

    def abort(self, rid: str, abort_all: bool) -> None:
        """The scheduler's abort (prefix match)."""
        self.replica.abort(rid, abort_all)

    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        weight_version: str | None,
        *,
        paused: bool,
        flush_cache: bool,
    ) -> bool:
        """Record the new path and version after the modelled reload (no weights are read)."""
        if not model_path:
            raise InvalidArgument("model_path is required")
        if self.replica.config.check_model_path and not Path(model_path).is_dir():
            raise InvalidArgument(f"{model_path} is not a directory")
        return await self.replica.update_weights(model_path, weight_version, paused=paused, flush_cache=flush_cache)

    async def set_weight_version(self, weight_version: str) -> None:
        """Rename the modelled weights at the next iteration boundary (live sequences record the change)."""
        await self.replica.rename(weight_version)

    # ----- weight-update groups, modelled (answers as rolloutd/engines/weight_messages.py) --------------
    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """Record the membership (the synthetic engine has no weights: nothing connects)."""
        if not group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        if group_name in self._weight_groups or not 0 < rank_offset < world_size:
            reason = "The specified group name has already been created" if group_name in self._weight_groups else (
                f"rank {rank_offset} is not a replica rank of a world of {world_size}"
            )
            return False, f"Failed to initialize custom process group: {reason}."
        self._weight_groups[group_name] = world_size
        return True, weight_messages.INIT_OK

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Forget the membership."""
        if self._weight_groups.pop(group_name, None) is None:
            return False, weight_messages.DESTROY_MISSING
        return True, weight_messages.DESTROY_OK

    async def begin_weight_update(self, selector: str, *, paused: bool) -> tuple[bool, str]:
        """Open the session."""
        if self._weight_session:
            return False, weight_messages.SESSION_OPEN
        self._weight_session = True
        return True, "Success"

    async def end_weight_update(self, *, paused: bool) -> tuple[bool, str]:
        """Close the session."""
        if not self._weight_session:
            return False, weight_messages.SESSION_MISSING
        self._weight_session = False
        return True, "Success"

    async def update_weights_from_distributed(
        self, update: DistributedUpdate, weight_version: str | None, *, paused: bool, flush_cache: bool
    ) -> tuple[bool, str]:
        """Spend the bucket's modelled broadcast time (its bytes over the profile's link), placed as a reload."""
        if not self._weight_session:
            return False, weight_messages.NO_SESSION
        if update.group_name not in self._weight_groups:
            return False, (
                f"Failed to receive weights: Group {update.group_name} not in {list(self._weight_groups)}. "
                "Please call `init_weights_update_group` first."
            )
        nbytes = 0
        for dtype, shape in zip(update.dtypes, update.shapes, strict=False):
            if dtype not in weight_messages.DTYPE_BYTES:
                return False, f"Failed to receive weights: module 'torch' has no attribute '{dtype}'"
            nbytes += math.prod(shape) * weight_messages.DTYPE_BYTES[dtype]
        replica = self.replica
        flushed = await replica.update_weights(
            replica.model_path, weight_version, paused=paused, flush_cache=flush_cache,
            modelled_s=nbytes / replica.profile.link_bytes_per_s,
        )
        if not flushed:
            return False, FLUSH_AFTER_UPDATE_FAILED
        return True, weight_messages.UPDATE_OK

    async def pause(self, mode: str) -> None:
        """Pause the replica's scheduler at its next iteration boundary."""
        await self.replica.pause(mode)

    @property
    def lora_settings(self) -> LoraSettings:
        """The replica's LoRA flags."""
        return self.replica.config.lora

    async def load_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Validate and load (modelled transfer time) the adapter."""
        return await self.replica.load_adapter(ref)

    async def unload_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Forget the adapter."""
        return self.replica.unload_adapter(ref)

    async def resume(self) -> None:
        """Let the replica's scheduler run again."""
        await self.replica.resume()

    @property
    def weight_version(self) -> str:
        """The modelled weight version."""
        return self.replica.weight_version

    @property
    def last_output_s(self) -> float:
        """When the scheduler last advanced."""
        return self.replica.last_output_s

    def load_snapshot(self) -> LoadSnapshot:
        """The replica's load."""
        return self.replica.load()

    def flush_cache(self) -> bool:
        """Refused while anything waits or runs, as SGLang."""
        return self.replica.idle()

    def model_info(self) -> dict[str, Any]:
        """Fields of SGLang's ``/model_info``."""
        return {
            "model_path": self.replica.model_path,
            "served_model_name": self.replica.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.replica.weight_version,
            "load_format": "auto",
        }

    def server_info(self) -> dict[str, Any]:
        """Server arguments and state (``dp_size`` for sglang-router)."""
        replica = self.replica
        info: dict[str, Any] = {k: v for k, v in dataclasses.asdict(replica.config).items() if k != "ports"}
        info.update(info.pop("lora"))
        info.update(
            {
                "model_path": replica.model_path,
                "weight_version": replica.weight_version,
                "port": replica.port,
                "tp_size": 1,
                "dp_size": 1,
                "max_running_requests": replica.config.max_running_requests,
                "device_profile": replica.profile.name,
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
        return info


class SyntheticServer(SGLangServer):
    """The HTTP face of one replica (the shared SGLang-protocol server, plus ``/get_load``)."""

    def __init__(self, replica: SyntheticReplica) -> None:
        super().__init__(SyntheticBackend(replica), serve_get_load=True)
        self.replica = replica

    async def start(self, host: str, port: int, *, backlog: int = 1024) -> int:
        """Listen (a deep backlog: benchmarks open many connections at once); returns the bound port."""
        return await super().start(host, port, backlog=backlog)


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
        """Start ``python -m benchmarks.synthetic_engine`` and wait for its ready file."""
        run_dir.mkdir(parents=True, exist_ok=True)
        ready = run_dir / "synthetic.ready.json"
        ready.unlink(missing_ok=True)
        log_path = run_dir / "synthetic.log"
        command = [sys.executable, "-m", "benchmarks.synthetic_engine", *to_args(config), "--ready-file", str(ready)]
        child_env = {**os.environ, **(env or {})}
        # benchmarks/ is not an installed package: the child finds it through the repository root.
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), child_env.get("PYTHONPATH", "")) if p)
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
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
        stop_process(self.process, grace_s)


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
    return args + config.lora.cli_args()


def _parse_args(argv: Sequence[str] | None) -> tuple[SyntheticEngineConfig, str]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.synthetic_engine",
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
    lora.add_lora_arguments(parser)
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
        # The environment is read here, once: the engine itself only sees its config.
        modelled_device=args.modelled_device or os.environ.get(devicemodel.PROFILE_ENV, ""),
        check_model_path=not args.no_check_model_path,
        lora=lora.settings_from_args(args),
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
    """``python -m benchmarks.synthetic_engine``."""
    config, ready_file = _parse_args(argv)
    try:
        config.validate()
    except InvalidArgument as exc:
        raise SystemExit(str(exc)) from exc
    asyncio.run(serve(config, ready_file))


if __name__ == "__main__":
    main()
