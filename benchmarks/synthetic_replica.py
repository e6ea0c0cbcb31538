"""One modelled replica of the synthetic engine: SGLang-style continuous batching of lengths, no neural net.

:class:`SyntheticReplica` is the scheduler side of :mod:`benchmarks.synthetic_engine` (which
serves it through rolloutd's SGLang-protocol server); it mirrors sglang/srt/managers/scheduler.py
as :mod:`rolloutd.engines.embedded.engine` does, with modelled time instead of a model.

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

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines import lora
from rolloutd.engines.embedded.interface import LoadSnapshot, SampleRequest, VersionChange
from rolloutd.engines.embedded.outputs import (
    queued_abort_output,
    running_abort_reason,
    sample_output,
)
from rolloutd.engines.lora import AdapterPool, LoraRef, LoraSettings, LoraUpdate
from rolloutd.engines.protocol import SamplingParams

logger = logging.getLogger(__name__)


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
class ReplicaRequest:
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

    request: ReplicaRequest
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
        self._waiting: list[ReplicaRequest | _Sequence] = []  # a _Sequence: retracted by a pause
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

    def submit(self, request: ReplicaRequest) -> None:
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
        kept: list[ReplicaRequest | _Sequence] = []
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

    def _answer_queued_abort(self, item: ReplicaRequest | _Sequence) -> None:
        if isinstance(item, ReplicaRequest):
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
    def _target_length(self, request: ReplicaRequest, sample_index: int) -> tuple[int, bool]:
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

    def _resolve_empty(self, request: ReplicaRequest) -> None:
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
        request: ReplicaRequest,
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


def _resolve(request: ReplicaRequest) -> None:
    if not request.future.done():
        request.future.set_result([output for output in request.outputs if output is not None])
