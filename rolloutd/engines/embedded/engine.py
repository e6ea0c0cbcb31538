"""The embedded engine's scheduler: continuous batching on one worker thread, pauses, weight swaps.

Mirrors sglang/srt/managers/scheduler.py (``event_loop_normal``, ``get_next_batch_to_run``,
``pause_generation``, ``continue_generation``, ``abort_request``) over the embedded engine's
model runner (:mod:`rolloutd.engines.embedded.runner`) and sampler
(:mod:`rolloutd.engines.embedded.sampling`).

Scheduling (continuous batching, as SGLang): HTTP handlers (on the event loop) enqueue
generation jobs; one worker thread runs the batch. At every decode iteration it first admits
queued jobs in arrival order (:mod:`~rolloutd.engines.embedded.admission`: while the running sequences stay within
the batch limit and, with a device model, their reserved KV tokens within the replica's KV
capacity), prefills the new prompts together (left padding + attention mask + KV cache; each
prompt once, its cache rows repeated for its ``n`` samples) and appends their rows to the
running batch's cache (left-padded to a common length); then it samples one token for every
running sequence and returns each sequence as soon as it finishes. Only an idle replica waits
``batch_window_s`` for co-arriving jobs. Weight reloads are queued in the same FIFO: a queued
reload stops admission, the running sequences finish on the old weights, then the new weights
are applied (so no token is produced by a half-loaded model) and admission resumes. Pauses
(``/pause_generation`` ``in_place``/``retract``, sglang/srt/managers/scheduler.py) stop the
worker between iterations; a reload made while paused applies at once under the paused
sequences, which then carry per-token weight-version spans (sglang/srt/utils/weight_versions.py);
see :class:`EmbeddedEngine`. Weight-update groups (``/init_weights_update_group``,
``/update_weights_from_distributed``, ...; :mod:`rolloutd.engines.embedded.weight_receiver`, mirroring
sglang/srt/model_executor/model_runner_components/weight_updater.py) run on the worker thread
as SGLang's scheduler runs them: joining blocks it until every rank joined, and an update is
placed as a reload (in the FIFO, or at once while paused), receives its tensors by broadcast
there and loads them into the served model at once.

Modelled device time (``--modelled-device``): the real tiny-model tokens are computed as above,
and every real iteration of b sequences stands for ``token_scale`` modelled decode iterations
of those b sequences (plus the modelled prefill of the prompts admitted at it, during which the
running sequences stall); the worker sleeps until the busy period's modelled time has passed
before returning the sequences that finished, so each sequence leaves at its modelled finish
time. Limits then come from the device model: ``max_running_requests`` sequences and
``devicemodel.kv_capacity_tokens`` KV tokens (HBM minus weights over KV bytes per token).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, Unavailable
from rolloutd.engines.embedded import runner, sampling
from rolloutd.engines.embedded.adapters import EngineAdapters
from rolloutd.engines.embedded.admission import BatchLimits, Demand, admitted_indices
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.interface import LoadSnapshot, VersionChange
from rolloutd.engines.embedded.model import LoadedModel, load_model
from rolloutd.engines.embedded.outputs import (
    FLUSH_AFTER_UPDATE_FAILED,
    queued_abort_output,
    received_tokens,
    running_abort_reason,
    sample_output,
)
from rolloutd.engines.embedded.runner import Batch
from rolloutd.engines.embedded.weight_receiver import UpdateOutcome, WeightUpdateGroups
from rolloutd.engines.embedded.work import (
    Control,
    GenerationJob,
    QueueItem,
    Segment,
    SequenceState,
    WeightCall,
    WeightSwap,
    set_exception,
    set_result,
)
from rolloutd.engines.lora import AdapterPool, LoraRef, LoraUpdate

logger = logging.getLogger(__name__)

_TRACE_SPAN_S = 0.5  # a busy period is traced in spans of about this many wall seconds


class SchedulerCrash(FlexmarlError):
    """A failure SGLang's scheduler does not survive (its process exits and takes the server down)."""


class EmbeddedEngine:
    """Continuously batched CPU generation behind a worker thread, plus weight swaps and pauses.

    Pauses mirror sglang/srt/managers/scheduler.py ``pause_generation`` (``in_place``: the
    running batch stays, KV cache included; ``retract``: its sequences go to the end of the
    waiting queue, their cache dropped, and re-prefill prompt plus output on admission) and
    ``continue_generation``. While paused nothing is admitted or decoded; controls (a weight
    swap made while paused, a rename) still apply at once. A weight change records a
    :class:`VersionChange` on every live sequence with tokens (weight_versions.py). An
    in-place change re-runs each running row's last token through the new weights, as
    SGLang's next decode step runs it (its KV of that token and the logits of the next one
    come from the new weights; the rest of the prefix keeps the old weights' KV).
    """

    def __init__(self, config: EmbeddedEngineConfig) -> None:
        self.config = config
        self._loaded = load_model(config.model_path, config.weight_version)
        self._cond = threading.Condition()
        self._queue: collections.deque[QueueItem] = collections.deque()
        self._controls: collections.deque[Control | WeightSwap] = collections.deque()
        self._paused = False  # scheduler.py _engine_paused; written by the worker under the lock
        self._running: list[GenerationJob] = []
        self._running_tokens = 0
        self._batch: Batch | None = None  # worker thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rng = torch.Generator()
        self._rng.manual_seed(secrets.randbits(63) if config.seed is None else config.seed)
        self.last_output_s = 0.0  # monotonic time of the last decode step (health checks read it)
        self.fatal: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # called from the worker thread once the engine died
        self.batches_run = 0
        self.max_batch_sequences = 0
        self.max_batch_adapters = 0  # most distinct adapters (the base counted) in the running batch
        self.generated_tokens = 0
        self._started_s = time.monotonic()
        self.device = devicemodel.load_profile(config.modelled_device) if config.modelled_device else None
        self._trace = devicemodel.TraceWriter(self.device, f"engine-{os.getpid()}") if self.device else None
        self._limits = BatchLimits.for_engine(config.max_batch_size, self.device)
        self._pacer: devicemodel.Pacer | None = None  # modelled time of the current busy period
        self.weight_groups = WeightUpdateGroups()  # the trainers' groups joined (worker thread only)
        self._span_started_s, self._span_modelled_s, self._span_tokens = 0.0, 0.0, 0
        # LoRA (lora_manager.py): the adapters held and their per-row deltas; worker thread only after start.
        self.adapters = EngineAdapters(self.device, self._trace)
        if config.lora.enabled:
            self.adapters.init(config.lora, self._loaded.model)

    # ----- LoRA adapters (rolloutd.engines.embedded.adapters) -----------------------------
    @property
    def lora_pool(self) -> AdapterPool | None:
        """The adapters held (None without ``--enable-lora``)."""
        return self.adapters.pool

    def load_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Load an adapter for the served model (worker thread)."""
        return self.adapters.load(ref, self._loaded.model)

    def unload_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Drop an adapter (worker thread; no running row uses it)."""
        return self.adapters.unload(ref)

    @property
    def limits(self) -> BatchLimits:
        """What bounds the running batch."""
        return self._limits

    @property
    def paused(self) -> bool:
        """Whether the scheduler is paused (``in_place`` or ``retract``)."""
        with self._cond:
            return self._paused

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
            stopped = FlexmarlError("engine stopped")
            for item in [*self._queue, *self._controls]:
                if isinstance(item, GenerationJob):
                    item.fail(stopped)
                elif isinstance(item, SequenceState):
                    item.job.fail(stopped)
                else:
                    item.loop.call_soon_threadsafe(set_exception, item.future, stopped)
            self._queue.clear()
            self._controls.clear()
            for job in self._running:
                job.aborted = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.weight_groups.close()

    # ----- requests (called on the event loop) -------------------------------------------
    @property
    def loaded(self) -> LoadedModel:
        """The model now being served."""
        return self._loaded

    def submit(self, job: GenerationJob) -> None:
        """Queue a generation job; its future resolves with one output dict per sample."""
        with self._cond:
            if self._stopping:
                raise FlexmarlError("engine stopped")
            self._queue.append(job)
            self._cond.notify_all()

    def submit_control(self, control: Control | WeightSwap) -> None:
        """Queue a pause, resume, rename or paused-time swap; the worker applies it between iterations."""
        with self._cond:
            if self._stopping:
                raise FlexmarlError("engine stopped")
            self._controls.append(control)
            self._cond.notify_all()

    def submit_swap(self, swap: WeightSwap) -> None:
        """Queue a weight swap: behind every job already queued, or (``swap.paused``) as a control."""
        if swap.paused:
            self.submit_control(swap)
            return
        with self._cond:
            if self._stopping:  # as submit: nothing would ever answer it
                raise FlexmarlError("engine stopped")
            self._queue.append(swap)
            self._cond.notify_all()

    def abort(self, rid: str, abort_all: bool) -> int:
        """Abort queued and running jobs whose rid starts with ``rid``.

        This is the scheduler's half of SGLang's abort (scheduler.py ``abort_request``, prefix
        match); the server only passes rids it knows exactly (tokenizer_manager.py). Queued
        jobs (and sequences a pause retracted) answer at once, paused or not; running ones
        after their next decode step, so while paused in place, after continue.
        """
        count = 0
        with self._cond:
            kept: collections.deque[QueueItem] = collections.deque()
            for item in self._queue:
                if isinstance(item, WeightSwap):
                    kept.append(item)
                    continue
                job = item.job if isinstance(item, SequenceState) else item
                if abort_all or (rid and job.rid.startswith(rid)):
                    job.aborted = True
                    count += 1
                    self._answer_queued_abort(item)
                else:
                    kept.append(item)
            self._queue = kept
            for job in self._running:
                if abort_all or (rid and job.rid.startswith(rid)):
                    job.aborted = True
                    count += 1
            self._cond.notify_all()
        return count

    def _answer_queued_abort(self, item: GenerationJob | SequenceState) -> None:
        """Resolve an aborted waiting job, or a retracted sequence, with SGLang's waiting-queue answer."""
        loaded = self._loaded
        if isinstance(item, GenerationJob):
            item.outputs = [queued_abort_output(item.sample_request(), loaded.weight_version)] * item.params.n
            item.resolve()
            return
        job = item.job
        shown = item.output_ids[: received_tokens(len(item.output_ids))]
        text = sampling.output_text(loaded, shown, {"type": "abort"}, job.params)
        request = job.sample_request()
        if job.params.n > 1:
            request = dataclasses.replace(request, rid=f"{job.rid}_{item.sample_index}")
        job.outputs[item.sample_index] = queued_abort_output(
            request,
            loaded.weight_version,
            output_ids=item.output_ids,
            logprobs=item.logprobs,
            top_logprobs=item.top_logprobs,
            text=text,
            version_changes=item.version_changes,
        )
        if all(output is not None for output in job.outputs):
            job.resolve()

    def load_snapshot(self) -> LoadSnapshot:
        """Queue and batch sizes; queued tokens count once per sample, as SGLang's waiting queue holds them."""
        with self._cond:
            waiting = [item for item in self._queue if isinstance(item, GenerationJob)]
            retracted = [item for item in self._queue if isinstance(item, SequenceState)]
            running = sum(job.params.n for job in self._running)
            used = self._running_tokens
        uptime_s = max(time.monotonic() - self._started_s, 1e-9)
        return LoadSnapshot(
            num_running_reqs=running,
            num_waiting_reqs=sum(job.params.n for job in waiting) + len(retracted),
            num_used_tokens=used,
            num_waiting_tokens=sum(len(job.input_ids) * job.params.n for job in waiting)
            + sum(len(seq.job.input_ids) + len(seq.output_ids) for seq in retracted),
            max_total_num_tokens=self._max_total_tokens(),
            max_running_requests=self._limits.max_running,
            gen_throughput=self.generated_tokens / uptime_s,
        )

    def _max_total_tokens(self) -> int:
        """KV-cache tokens of the replica, in real tokens (the device model's capacity when modelled)."""
        limits = self._limits
        if math.isfinite(limits.kv_capacity_tokens):
            return int(limits.kv_capacity_tokens / limits.token_scale)
        return limits.max_running * self._loaded.max_positions

    def idle(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=paused)``: nothing running, and unless paused nothing queued."""
        with self._cond:
            return self._idle_locked()

    def _idle_locked(self) -> bool:
        waiting = any(not isinstance(item, WeightSwap) for item in self._queue)
        return not self._running and self._batch is None and (self._paused or not waiting)

    # ----- worker thread -----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._controls) or (not self._paused and (bool(self._queue) or self._batch is not None))

    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            swap: WeightSwap | None = None
            admitted: list[GenerationJob | SequenceState] = []
            controls: list[Control | WeightSwap] = []
            with self._cond:
                while not self._has_work() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                if self._controls:
                    controls = list(self._controls)
                    self._controls.clear()
                else:
                    if (self._batch is None and isinstance(self._queue[0], GenerationJob)
                            and self.config.batch_window_s > 0):
                        # Give requests that arrive together at an idle replica a moment to share a prefill.
                        deadline = time.monotonic() + self.config.batch_window_s
                        while (remaining := deadline - time.monotonic()) > 0 and not self._stopping:
                            self._cond.wait(remaining)
                        if self._stopping:
                            break
                    head = self._queue[0] if self._queue else None
                    if self._batch is None and isinstance(head, WeightSwap):
                        self._queue.popleft()  # only between busy periods: the running batch finished
                        swap = head
                    else:
                        admitted = self._take_admissible()
            try:
                for control in controls:
                    self._apply_control(control)
                if swap is not None:
                    self._apply_swap(swap)
                if admitted:
                    self._admit(admitted)
                if self._batch is not None and not controls and swap is None and not self.paused:
                    self._step()
            except SchedulerCrash as exc:
                self._die(exc, admitted)
                return
            except Exception as exc:
                # scheduler.py run_scheduler_process: any exception in the scheduler loop is logged
                # and takes the whole SGLang server down (SIGQUIT to its parent); so here.
                logger.exception("decode iteration failed")
                self._die(SchedulerCrash(repr(exc)), admitted)
                return
            finally:
                self._publish_running()
        if self._batch is not None:  # stopping: what is still running ends as aborted
            loaded = self._batch.loaded
            for seq in self._batch.rows:
                self._finish(seq, running_abort_reason(), loaded)
            self._batch = None
            self._publish_running()

    def _die(self, exc: SchedulerCrash, admitted: list[GenerationJob | SequenceState]) -> None:
        """Fail everything and stop, as SGLang's scheduler process does on an exception."""
        logger.error("Scheduler hit an exception: %s", exc)
        self.fatal = exc
        died = Unavailable(f"engine died: {exc}")
        with self._cond:
            self._stopping = True
            items = [*self._queue, *self._controls]
            self._queue.clear()
            self._controls.clear()
        rows = self._batch.rows if self._batch is not None else []
        jobs: list[GenerationJob] = []
        for item in [*items, *admitted, *rows]:
            if isinstance(item, GenerationJob):
                jobs.append(item)
            elif isinstance(item, SequenceState):
                jobs.append(item.job)
            else:
                item.loop.call_soon_threadsafe(set_exception, item.future, died)
        for job in {id(j): j for j in jobs}.values():
            job.fail(died)
        self._batch = None
        self._publish_running()
        if self.on_fatal is not None:
            self.on_fatal()

    def _take_admissible(self) -> list[GenerationJob | SequenceState]:
        """Pop the queued jobs (and retracted sequences) that join the running batch now (lock held)."""
        if self._batch is not None and not self._batch.mergeable:
            return []  # a cache layout the engine cannot merge: wait for the batch to end
        demands: list[Demand] = []
        adapters: list[str | None] = []
        for item in self._queue:
            if isinstance(item, WeightSwap) or len(demands) >= self._limits.max_running:
                break
            job = item.job if isinstance(item, SequenceState) else item
            samples = 1 if isinstance(item, SequenceState) else job.params.n
            demands.append(self._limits.demand(len(job.input_ids), job.params.max_new_tokens, samples))
            adapters.append(job.lora_id)
        rows = self._batch.rows if self._batch is not None else []
        reserved = sum(self._limits.sequence_kv_tokens(len(s.job.input_ids), s.job.params.max_new_tokens) for s in rows)
        chosen = admitted_indices(
            demands, len(rows), reserved, self._limits,
            adapters=adapters, running_adapters=frozenset(s.job.lora_id for s in rows), pool=self.lora_pool,
        )
        queued = list(self._queue)
        picked = set(chosen)
        self._queue = collections.deque(item for index, item in enumerate(queued) if index not in picked)
        return [item for index, item in enumerate(queued) if index in picked and not isinstance(item, WeightSwap)]

    def _publish_running(self) -> None:
        """Expose the running jobs and KV tokens to load_snapshot, abort and stop."""
        batch = self._batch
        jobs = list({id(seq.job): seq.job for seq in batch.rows}.values()) if batch is not None else []
        tokens = int(batch.mask.sum()) if batch is not None else 0
        with self._cond:
            self._running = jobs
            self._running_tokens = tokens

    # ----- controls and weight swaps (worker thread) ---------------------------------------
    def _apply_control(self, control: Control | WeightSwap) -> None:
        if isinstance(control, WeightSwap):
            self._apply_swap(control)
            return
        if control.kind in ("in_place", "retract"):
            if control.kind == "retract" and self._batch is not None:
                self._retract()
            with self._cond:
                self._paused = True
        elif control.kind == "resume":
            with self._cond:
                self._paused = False
        elif control.kind == "rename":
            self._change_version(control.weight_version)
        elif control.kind == "call" and control.call is not None:
            control.outcome = control.call()
        control.loop.call_soon_threadsafe(set_result, control.future, True)

    def _retract(self) -> None:
        """Move the running sequences to the end of the waiting queue (scheduler.py retract): cache dropped."""
        batch = self._batch
        if batch is None:
            return
        self._batch = None
        self._end_busy_period()
        with self._cond:
            self._queue.extend(batch.rows)
        self._publish_running()  # before the pause answers: loads show them waiting

    def _live_sequences(self) -> list[SequenceState]:
        rows = self._batch.rows if self._batch is not None else []
        with self._cond:
            queued = [item for item in self._queue if isinstance(item, SequenceState)]
        return [*rows, *queued]

    def _change_version(self, new_version: str) -> None:
        """scheduler.py ``record_weight_version_change``: serve ``new_version``; live sequences with tokens note it."""
        old_version = self._loaded.weight_version
        if new_version == old_version:
            return
        for seq in self._live_sequences():
            if seq.output_ids:
                seq.version_changes.append(VersionChange(old_version, len(seq.output_ids)))
        self._loaded = dataclasses.replace(self._loaded, weight_version=new_version)
        if self._batch is not None:
            self._batch.loaded = dataclasses.replace(self._batch.loaded, weight_version=new_version)

    def _apply_swap(self, swap: WeightSwap) -> None:
        if isinstance(swap, WeightCall):
            self._apply_weight_call(swap)
            return
        if self.device is not None:  # the replica serves nothing while the modelled reload runs
            started_s, pacer = time.time(), devicemodel.Pacer(self.device)
            pacer.add(devicemodel.weight_transfer_s(self.device))
            pacer.wait()
            if self._trace is not None:
                self._trace.record("reload", started_s, time.time(), pacer.modelled_s)
        version = self._loaded.weight_version if swap.weight_version is None else swap.weight_version
        self._loaded = dataclasses.replace(swap.loaded, weight_version=self._loaded.weight_version)
        self._change_version(version)
        if self._batch is not None:  # in place: the running rows go on from their cache on the new weights
            self._rerun_last_tokens(self._batch, self._loaded)
        logger.info("serving %s (weight_version %s)", self._loaded.model_path, self._loaded.weight_version)
        # Not paused, the update ran once everything before it finished, and what came after waits
        # at the model lock (not in the scheduler): the flush succeeds.
        with self._cond:
            flushed = not (swap.paused and swap.flush_cache) or self._idle_locked()
        swap.loop.call_soon_threadsafe(set_result, swap.future, flushed)

    def _apply_weight_call(self, call: WeightCall) -> None:
        """Run a weight-update step on the served model (scheduler_components/weight_updater.py).

        Tensors that were loaded change the weights in place at once, under whatever runs
        (paused); a successful call then records its version and checks the cache flush.
        """
        if call.run is None:
            outcome = UpdateOutcome(False, "nothing to run", weights_changed=False)
        else:
            outcome = call.run(self._loaded.model)
        if outcome.weights_changed and self._batch is not None:
            self._rerun_last_tokens(self._batch, self._loaded)
        success, message = outcome.success, outcome.message
        if success and call.weight_version is not None:
            self._change_version(call.weight_version)
        if success and call.flush_cache:
            with self._cond:
                refused = call.paused and not self._idle_locked()
            if refused:
                success, message = False, FLUSH_AFTER_UPDATE_FAILED
        call.outcome = (success, message)
        call.loop.call_soon_threadsafe(set_result, call.future, success)

    def _rerun_last_tokens(self, batch: Batch, loaded: LoadedModel) -> None:
        """Recompute every row's last-token KV and next-token logits with ``loaded`` (an in-place weight change).

        SGLang's decode step runs a sequence's last sampled token through the model; here that
        token was already run (by the old weights), so its cache column is dropped and run again
        (a cache the engine cannot edit per column: the rows are prefilled again, whole).
        """
        batch.loaded = loaded
        for seq in batch.rows:
            seq.segments.append(Segment(loaded, len(seq.output_ids), fresh=False))
        if not batch.mergeable:  # no per-column cache edits: recompute the rows whole on the new weights
            rows = batch.rows
            self._batch = None
            self._prefill(rows, loaded)
            return
        runner.rerun_last_tokens(batch, self.adapters.rows)

    # ----- admission and decoding (worker thread) -------------------------------------------
    def _admit(self, items: list[GenerationJob | SequenceState]) -> None:
        """Prefill the admitted prompts (and retracted sequences) together and add them to the running batch."""
        loaded = self._batch.loaded if self._batch is not None else self._loaded
        rows: list[SequenceState] = []
        for item in items:
            if isinstance(item, SequenceState):
                if item.job.aborted:  # aborted between leaving the queue and here
                    self._answer_queued_abort(item)
                else:
                    rows.append(item)
                continue
            job = item
            job.outputs = [None] * job.params.n
            if job.aborted:  # still in the waiting queue: SGLang answers without running it
                job.outputs = [queued_abort_output(job.sample_request(), loaded.weight_version)] * job.params.n
                job.resolve()
            elif job.params.max_new_tokens == 0:
                for index in range(job.params.n):
                    job.outputs[index] = self._output(job, index, [], [], {"type": "length", "length": 0}, loaded)
                job.resolve()
            else:
                rows += [SequenceState(job, index) for index in range(job.params.n)]
        if rows:
            self._prefill(rows, loaded)

    def _prefill(self, rows: list[SequenceState], loaded: LoadedModel) -> None:
        """Prefill the rows' tokens (prompt, plus output for a retracted row) and append them to the batch."""
        self.batches_run += 1
        for seq in rows:
            seq.segments.append(Segment(loaded, len(seq.output_ids), fresh=True))
        new = runner.prefill(rows, loaded, self.adapters.rows)
        self._batch = new if self._batch is None else runner.merge_batches(self._batch, new)
        self.max_batch_sequences = max(self.max_batch_sequences, len(self._batch.rows))
        self.max_batch_adapters = max(self.max_batch_adapters, len({seq.job.lora_id for seq in self._batch.rows}))
        device = self.device
        if device is not None:  # the running sequences stall while the new prompts prefill (no chunking)
            prefill_tokens = sum({id(seq.job): len(seq.tokens()) for seq in rows}.values())  # once per job
            self._busy_pacer().add(devicemodel.prefill_s(device, prefill_tokens * device.token_scale))

    def _step(self) -> None:
        """One decode iteration: a token for every running sequence; finished ones leave the batch."""
        batch = self._batch
        if batch is None:
            return
        loaded, device = batch.loaded, self.device
        finished: list[tuple[SequenceState, dict[str, Any]]] = []
        next_ids: list[int] = []
        keep: list[int] = []
        sampled = 0
        context_tokens = int(batch.mask.sum())
        if self.config.enable_deterministic_inference and any(seq.job.params.min_p > 0 for seq in batch.rows):
            # sampler.py top_k_top_p_min_p_sampling_from_probs_torch: "With sampling seed,
            # multinomial_with_seed will provide wrong results" (an assertion; the scheduler dies).
            raise SchedulerCrash("min_p sampling is not supported with --enable-deterministic-inference")
        for row, seq in enumerate(batch.rows):
            token_id, logprob = sampling.sample_token(
                batch.logits[row],
                seq.job.params,
                position=len(seq.job.input_ids) + len(seq.output_ids),
                deterministic=self.config.enable_deterministic_inference,
                original_logprob=self.config.return_original_logprob,
                rng=self._rng,
            )
            seq.output_ids.append(token_id)
            seq.logprobs.append(logprob)
            if seq.job.return_logprob and seq.job.top_logprobs_num:
                seq.top_logprobs.append(sampling.top_logprobs(
                    batch.logits[row], seq.job.params, seq.job.top_logprobs_num,
                    original_logprob=self.config.return_original_logprob,
                ))
            self.generated_tokens += 1
            sampled += 1
            if seq.job.aborted:
                # scheduler.py: a running request aborted by /abort_request runs one more decode
                # step and then finishes with FINISH_ABORT (its tokens so far are returned).
                finished.append((seq, running_abort_reason()))
                continue
            stop = sampling.stop_reason(seq, token_id, loaded)
            if stop is not None:
                finished.append((seq, stop))
                continue
            next_ids.append(token_id)
            keep.append(row)
        if keep:
            if len(keep) < len(batch.rows):
                batch.select(keep)
            runner.decode(batch, next_ids, self.adapters.rows)
        else:
            self._batch = None
        self.last_output_s = time.monotonic()
        if device is not None:
            # This real iteration stands for token_scale modelled iterations of the live batch; the
            # sequences that finished in it are returned only once their modelled time has passed.
            pacer = self._busy_pacer()
            pacer.add(devicemodel.real_decode_iteration_s(device, sampled, float(context_tokens + sampled)))
            pacer.wait()
            if self._batch is None:
                self._end_busy_period()
            elif time.time() - self._span_started_s >= _TRACE_SPAN_S:
                self._record_span(overrun_s=0.0)
        for seq, reason in finished:
            self._finish(seq, reason, loaded)

    # ----- modelled time of a busy period (device model only) --------------------------------
    def _busy_pacer(self) -> devicemodel.Pacer:
        """The pacer of the current busy period (one starts when an idle replica admits work)."""
        if self._pacer is None and self.device is not None:
            self._pacer = devicemodel.Pacer(self.device)
            self._span_started_s, self._span_modelled_s, self._span_tokens = time.time(), 0.0, self.generated_tokens
        if self._pacer is None:
            raise FlexmarlError("no device model")
        return self._pacer

    def _record_span(self, overrun_s: float) -> None:
        """Trace the busy time since the last record (busy periods are cut into short spans)."""
        pacer, device = self._pacer, self.device
        if pacer is None or device is None:
            return
        now_s = time.time()
        if self._trace is not None:
            self._trace.record(
                "generate",
                self._span_started_s,
                now_s,
                pacer.modelled_s - self._span_modelled_s,
                tokens=(self.generated_tokens - self._span_tokens) * device.token_scale,
                overrun_s=overrun_s,
            )
        self._span_started_s, self._span_modelled_s, self._span_tokens = now_s, pacer.modelled_s, self.generated_tokens

    def _end_busy_period(self) -> None:
        if self._pacer is not None:
            self._record_span(overrun_s=self._pacer.overrun_s)
        self._pacer = None

    def _rescore(self, seq: SequenceState) -> list[float]:
        """Logprobs of ``seq.output_ids`` (and its top alternatives) from passes of the sequence alone."""
        logits = runner.rescore_logits(seq, self._loaded, self.adapters.rows)
        logprobs, top = sampling.rescored_logprobs(
            logits, seq.output_ids, seq.job.params, seq.job.top_logprobs_num,
            original_logprob=self.config.return_original_logprob,
        )
        if top is not None:
            seq.top_logprobs = top
        return logprobs

    def _finish(self, seq: SequenceState, reason: dict[str, Any], loaded: LoadedModel) -> None:
        job = seq.job
        if job.return_logprob and self.config.enable_deterministic_inference and seq.output_ids:
            seq.logprobs = self._rescore(seq)
        job.outputs[seq.sample_index] = self._output(
            job, seq.sample_index, seq.output_ids, seq.logprobs, reason, loaded, seq.version_changes, seq.top_logprobs
        )
        self.last_output_s = time.monotonic()
        if all(output is not None for output in job.outputs):
            job.resolve()

    @staticmethod
    def _output(
        job: GenerationJob,
        sample_index: int,
        output_ids: list[int],
        logprobs: list[float],
        reason: dict[str, Any],
        loaded: LoadedModel,
        version_changes: Sequence[VersionChange] = (),
        top_logprobs: Sequence[Sequence[tuple[float, int]]] = (),
    ) -> dict[str, Any]:
        text = sampling.output_text(loaded, output_ids, reason, job.params)
        request = job.sample_request()
        if job.params.n > 1:  # in-process callers only: the HTTP server sends one sample per job
            request = dataclasses.replace(request, rid=f"{job.rid}_{sample_index}")
        return sample_output(
            request,
            output_ids,
            logprobs,
            reason,
            text=text,
            weight_version=loaded.weight_version,
            model_path=loaded.model_path,
            version_changes=version_changes,
            top_logprobs=top_logprobs,
        )
