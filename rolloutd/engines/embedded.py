"""The embedded engine: a CPU inference server speaking the RL subset of SGLang's HTTP API.

It serves a Hugging Face transformers causal LM with torch on CPU, so CI (no GPU) drives the
same client code path as a GPU SGLang server. The HTTP side (routes, parsing, validation, rids,
abort and error shapes, as sglang/srt/entrypoints/http_server.py and
sglang/srt/managers/io_struct.py) is the shared :mod:`rolloutd.engines.sglang_server`; this
module is its backend (see docs/engines.md for the exact subset).

Scheduling (continuous batching, as SGLang): HTTP handlers (on the event loop) enqueue
generation jobs; one worker thread runs the batch. At every decode iteration it first admits
queued jobs in arrival order (:func:`plan_admission`: while the running sequences stay within
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
``/update_weights_from_distributed``, ...; :mod:`rolloutd.engines.weight_receiver`, mirroring
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

Log-probabilities: like SGLang by default, the logprob of a sampled token is taken from the
temperature-scaled distribution ``log_softmax(logits / temperature)`` before top-k/top-p/min-p
truncation; greedy decoding (temperature below 1e-6) gives ``log_softmax(logits)``. The flag
``--return-original-logprob`` (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) returns
``log_softmax(logits)`` at every temperature.

Sampling and seeds, as SGLang 0.5.23 (sglang/srt/sampling/sampling_batch_info.py
``from_schedule_batch``, sglang/srt/layers/sampler.py): without
``--enable-deterministic-inference`` a request's ``sampling_seed`` is ignored; tokens are drawn
from the engine's own generator (seeded at start by ``--seed``, SGLang's ``--random-seed``)
in batch order, and logprobs are the batched decode's (they depend on what shared the batch).
With the flag, every sample draws its token at position ``p`` by Gumbel-max over uniforms that
are a function of (its seed, ``p``) alone (seed 42 when the request brought none), so the ``n``
samples of one ``n > 1`` request with one seed are identical, and the samples do not depend on
what else shares the batch; the logprobs are then recomputed per finished sequence in an
unpadded forward pass, so they are batch-invariant too. SGLang's seeded sampler asserts when
a batch needs min-p sampling, and a failed assertion in its scheduler takes the server down:
with the flag, a request with ``min_p > 0`` stops this engine the same way.

LoRA adapters (``--enable-lora`` and SGLang's other LoRA flags; sglang/srt/lora/lora_manager.py,
sglang/srt/managers/scheduler.py ``can_schedule_lora_req``): adapters load and unload on the
worker thread between iterations; every forward pass (prefill, decode, the in-place rerun of a
weight change, the deterministic rescoring) adds each row's own adapter delta in the target
``Linear`` modules (:class:`rolloutd.engines.lora.LoraLayers`), so one batch mixes adapters and
the base; admission skips a job whose adapter would take the batch past ``--max-loras-per-batch``.

Stop conditions (sglang/srt/managers/schedule_batch.py ``update_finish_state``): stop strings
first (the decoded output contains one: ``{"type": "stop", "matched": "<str>"}``), then stop
token ids and EOS (both off under ``ignore_eos``), then ``max_new_tokens``. ``output_ids``
keep every token through the one that completed the match; ``text`` drops the stop string
and what follows it (the matched stop token) unless ``no_stop_trim``
(detokenizer_manager.py ``trim_matched_stop``).
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
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines import lora
from rolloutd.engines.lora import AdapterPool, LoraLayers, LoraRef, LoraSettings, LoraUpdate
from rolloutd.engines.protocol import SamplingParams
from rolloutd.engines.sglang_server import (
    FLUSH_AFTER_UPDATE_FAILED,
    DistributedUpdate,
    EngineBackend,
    LoadSnapshot,
    SampleRequest,
    SGLangServer,
    VersionChange,
    first_sample,
    queued_abort_output,
    received_tokens,
    running_abort_reason,
    sample_output,
)
from rolloutd.engines.weight_receiver import UpdateOutcome, WeightUpdateGroups

logger = logging.getLogger(__name__)

ENGINE_VERSION = "flexmarl-embedded-0.1"
_LOGPROB_FLOOR = torch.finfo(torch.float32).min
# sampling_batch_info.py: the seed of a request without sampling_seed under deterministic inference.
DEFAULT_SAMPLING_SEED = 42
_UINT64_MASK = (1 << 64) - 1


class SchedulerCrash(FlexmarlError):
    """A failure SGLang's scheduler does not survive (its process exits and takes the server down)."""


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
    # SGLang's --enable-deterministic-inference: seeded, position-hashed sampling (sampling_seed
    # honoured, 42 without one) and each finished sequence's logprobs recomputed in a forward pass
    # of its own (prompt + output, no padding), so samples and logprobs depend on the weights,
    # tokens and seed only, not on which requests shared the batch. What makes sync and async
    # runs of a strict job produce the same experiences. Off: seeds are ignored, as in SGLang.
    enable_deterministic_inference: bool = False
    weight_version: str = "default"
    seed: int | None = None  # seeds the engine's sampling generator at start (SGLang --random-seed)
    ready_file: str = ""
    # Device profile file (flexmarl.devicemodel): generation takes the modelled time of that
    # accelerator; "" = real time only. The command line falls back to FLEXMARL_MODELLED_DEVICE
    # (read once, in _parse_args), so the engine itself never reads the environment.
    modelled_device: str = ""
    # SGLang's LoRA flags (--enable-lora, --max-lora-rank, --lora-target-modules, --lora-paths,
    # --max-loras-per-batch, --max-loaded-loras): adapters over the served model, see lora.py.
    lora: LoraSettings = field(default_factory=LoraSettings)


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
class _GenerationJob:
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
    lora_id: str | None = None  # the LoRA adapter it runs with; None: the base model
    top_logprobs_num: int = 0  # SGLang's top_logprobs_num: k alternatives per output token (with return_logprob)

    def sample_request(self) -> SampleRequest:
        """The job as the HTTP server's sample request (what output objects are built from)."""
        return SampleRequest(
            self.rid, tuple(self.input_ids), self.params, self.return_logprob, self.created_s, self.lora_id,
            self.top_logprobs_num,
        )

    def resolve(self) -> None:
        results = [output for output in self.outputs if output is not None]
        self.loop.call_soon_threadsafe(_set_result, self.future, results)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


@dataclass
class _WeightSwap:
    """A fully loaded replacement model.

    Not ``paused`` (queued in the FIFO): applied once the running batch has drained, and it
    stops admission until then (the tokenizer manager's model lock). ``paused`` (a control):
    applied at the next iteration boundary under whatever runs. ``weight_version`` None keeps
    the served version. The future resolves with whether the cache flush after it succeeded.
    """

    loaded: _LoadedModel
    weight_version: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]
    paused: bool = False
    flush_cache: bool = False


@dataclass
class _WeightCall(_WeightSwap):
    """A step of a weight update from a trainer's group (session, or one call's tensors), placed as a swap.

    ``run`` executes on the worker thread with the served model (the broadcast is received
    there, blocking the scheduler as SGLang's does); ``outcome`` is its ``(success, message)``,
    set before the future resolves. ``loaded`` is the model served when the call was queued.
    """

    run: Callable[[torch.nn.Module], UpdateOutcome] | None = None
    outcome: tuple[bool, str] = (False, "not run")


@dataclass
class _Control:
    """A scheduler command applied by the worker between iterations: pause, resume, rename or call."""

    kind: str  # "in_place" | "retract" | "resume" | "rename" | "call"
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]
    weight_version: str = ""
    call: Callable[[], tuple[bool, str]] | None = None  # kind "call": run on the worker thread
    outcome: tuple[bool, str] = (False, "not run")


@dataclass(frozen=True)
class _Segment:
    """From output token ``start`` on, a sequence's logits came from ``loaded``.

    ``fresh``: over a KV cache recomputed whole by ``loaded`` (admission, or the re-prefill of a
    retracted sequence); else over the cache the sequence had (an in-place weight change: the
    prefix keeps the old weights' keys and values). Deterministic inference rescores by these.
    """

    loaded: _LoadedModel
    start: int
    fresh: bool


@dataclass
class _Sequence:
    """One sample being decoded (or retracted to the waiting queue by a pause)."""

    job: _GenerationJob
    sample_index: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Per output token, the job's ``top_logprobs_num`` most likely (logprob, token id), when it asked for them.
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    version_changes: list[VersionChange] = field(default_factory=list)
    segments: list[_Segment] = field(default_factory=list)

    def tokens(self) -> list[int]:
        """Prompt plus output so far."""
        return [*self.job.input_ids, *self.output_ids]


_QueueItem = _GenerationJob | _WeightSwap | _Sequence


# ----- continuous batching: admission (pure) and the running batch ------------------------
_TRACE_SPAN_S = 0.5  # a busy period is traced in spans of about this many wall seconds


@dataclass(frozen=True)
class Demand:
    """What one queued job asks of the running batch: sequences and reserved KV-cache tokens."""

    sequences: int
    kv_tokens: float


@dataclass(frozen=True)
class BatchLimits:
    """What bounds a replica's running batch.

    Attributes:
        max_running: most sequences decoded together.
        kv_capacity_tokens: (modelled) KV-cache tokens the replica holds; ``math.inf`` = unbounded.
        token_scale: modelled tokens per real token (1 without a device model).
    """

    max_running: int
    kv_capacity_tokens: float = math.inf
    token_scale: float = 1.0

    @classmethod
    def for_engine(cls, max_batch_size: int, device: devicemodel.DeviceProfile | None) -> BatchLimits:
        """``max_batch_size`` sequences in real mode; the device model's limits in modelled mode."""
        if device is None:
            return cls(max_batch_size)
        return cls(device.max_running_requests, devicemodel.kv_capacity_tokens(device), device.token_scale)

    def sequence_kv_tokens(self, prompt_tokens: int, max_new_tokens: int) -> float:
        """KV tokens one sequence reserves: its prompt plus every token it may generate (modelled)."""
        return (prompt_tokens + max_new_tokens) * self.token_scale

    def demand(self, prompt_tokens: int, max_new_tokens: int, n: int) -> Demand:
        """The demand of a job of ``n`` samples of one prompt."""
        return Demand(n, n * self.sequence_kv_tokens(prompt_tokens, max_new_tokens))


def plan_admission(
    waiting: Sequence[Demand], running_sequences: int, reserved_kv_tokens: float, limits: BatchLimits
) -> int:
    """How many jobs from the head of the queue join the running batch at this iteration.

    First come, first served (SGLang's ``fcfs`` policy): jobs join in queue order while the
    running sequences stay within ``limits.max_running`` and the reserved KV tokens (prompt plus
    ``max_new_tokens`` of every running sequence, so a running sequence is never evicted) within
    ``limits.kv_capacity_tokens``; the first job that does not fit stops admission, so later,
    smaller jobs do not overtake it. A job larger than the limits on its own is admitted into an
    empty batch (it could otherwise never run).
    """
    return len(admitted_indices(waiting, running_sequences, reserved_kv_tokens, limits))


def admitted_indices(
    waiting: Sequence[Demand],
    running_sequences: int,
    reserved_kv_tokens: float,
    limits: BatchLimits,
    *,
    adapters: Sequence[str | None] = (),
    running_adapters: frozenset[str | None] = frozenset(),
    pool: AdapterPool | None = None,
) -> list[int]:
    """The queue positions of the jobs that join the running batch: :func:`plan_admission` plus LoRA.

    With ``pool``, ``adapters[i]`` is job ``i``'s adapter (None: the base): a job whose adapter
    would take the batch's distinct adapters past what the pool allows
    (scheduler.py ``can_schedule_lora_req``, lora_manager.py ``validate_lora_batch``:
    ``--max-loras-per-batch``, the base counted as one) is skipped and later jobs are still
    considered, as SGLang's scheduler skips it (``continue``); the capacity limits still stop
    admission at the first job that does not fit.
    """
    admitted: list[int] = []
    sequences, reserved = running_sequences, reserved_kv_tokens
    in_batch = set(running_adapters)
    for index, demand in enumerate(waiting):
        adapter = adapters[index] if pool is not None else None
        if not lora.can_schedule(pool, adapter, in_batch):
            continue
        fits = (
            sequences + demand.sequences <= limits.max_running
            and reserved + demand.kv_tokens <= limits.kv_capacity_tokens
        )
        if not fits and not (sequences == 0 and not admitted):
            break
        admitted.append(index)
        in_batch.add(adapter)
        sequences += demand.sequences
        reserved += demand.kv_tokens
    return admitted


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _mergeable(cache: Any) -> bool:
    """Whether the cache is plain per-layer key/value tensors, which rows of other batches may join."""
    from transformers.cache_utils import DynamicLayer

    layers: list[Any] = list(getattr(cache, "layers", None) or [])
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


@dataclass
class _Batch:
    """The running batch: one KV cache row, mask row and next-token logits per sequence.

    Rows are left-padded to a common length (mask 0 on the padding); the position of each row's
    next token is tracked separately, so rows of different lengths decode together.
    """

    loaded: _LoadedModel
    cache: Any
    mask: torch.Tensor
    last_position: torch.Tensor
    logits: torch.Tensor
    rows: list[_Sequence]
    mergeable: bool

    def select(self, keep: list[int]) -> None:
        """Keep only the rows ``keep`` (in order) and drop padding columns no row needs any more."""
        kept = torch.tensor(keep)
        self.cache.batch_select_indices(kept)
        self.mask, self.last_position, self.logits = self.mask[kept], self.last_position[kept], self.logits[kept]
        self.rows = [self.rows[row] for row in keep]
        if not self.mergeable:
            return
        used = torch.nonzero(self.mask.sum(dim=0)).flatten()
        first = int(used[0]) if used.numel() else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]


def _merge_batches(running: _Batch, new: _Batch) -> _Batch:
    """``running`` with the rows of ``new`` (just prefilled, same model) appended, left-padded to one length."""
    width = max(running.mask.shape[1], new.mask.shape[1])
    for old_layer, new_layer in zip(running.cache.layers, new.cache.layers, strict=True):
        old_layer.keys = torch.cat([_left_pad(old_layer.keys, width, 2), _left_pad(new_layer.keys, width, 2)])
        old_layer.values = torch.cat([_left_pad(old_layer.values, width, 2), _left_pad(new_layer.values, width, 2)])
    running.mask = torch.cat([_left_pad(running.mask, width, 1), _left_pad(new.mask, width, 1)])
    running.last_position = torch.cat([running.last_position, new.last_position])
    running.logits = torch.cat([running.logits, new.logits])
    running.rows = running.rows + new.rows
    return running


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
        self._queue: collections.deque[_QueueItem] = collections.deque()
        self._controls: collections.deque[_Control | _WeightSwap] = collections.deque()
        self._paused = False  # scheduler.py _engine_paused; written by the worker under the lock
        self._running: list[_GenerationJob] = []
        self._running_tokens = 0
        self._batch: _Batch | None = None  # worker thread only
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
        self.lora_pool: AdapterPool | None = None
        self._lora_layers: LoraLayers | None = None
        if config.lora.enabled:
            self._init_lora(config.lora)

    # ----- LoRA adapters (sglang/srt/lora/lora_manager.py) ---------------------------------
    def _init_lora(self, settings: LoraSettings) -> None:
        """lora_manager.py ``init_state``: resolve targets and max rank, then load the ``--lora-paths`` adapters.

        Raises:
            InvalidArgument: A ``--lora-paths`` adapter cannot be loaded (SGLang does not start).
        """
        settings.check()
        model = self._loaded.model
        vocab = int(model.config.vocab_size)
        refs = settings.initial_refs()
        configs: list[tuple[str, lora.AdapterConfig]] = []
        for ref in refs:
            try:
                configs.append((ref.lora_name, lora.read_adapter_config(ref.lora_path, vocab)))
            except ValueError as exc:
                raise InvalidArgument(f"Failed to load LoRA adapter {ref.lora_name}: {exc}") from exc
        try:
            targets, max_rank = AdapterPool.resolve_shapes(settings, configs, lora.model_target_modules(model))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        self.lora_pool = AdapterPool(settings, targets, max_rank)
        self._lora_layers = LoraLayers(max_rank)
        for ref in refs:
            result = self.load_adapter(ref)
            if not result.success:
                raise InvalidArgument(f"Failed to load LoRA adapter {ref.lora_name}: {result.error_message}")

    def load_adapter(self, ref: LoraRef) -> LoraUpdate:
        """lora_manager.py ``load_lora_adapter``: read the config, validate, read the weights (worker thread)."""
        pool, layers = self.lora_pool, self._lora_layers
        if pool is None or layers is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        model = self._loaded.model
        try:
            config = lora.read_adapter_config(ref.lora_path, int(model.config.vocab_size))
            pool.validate_new(config, ref)
            weights = lora.load_adapter_weights(ref.lora_path, config, model, pool.max_rank)
        except (ValueError, OSError) as exc:
            return pool.result(False, str(exc))
        if self.device is not None:  # modelled: the adapter's share of the modelled model, over the link
            started_s, pacer = time.time(), devicemodel.Pacer(self.device)
            real_params = sum(int(p.numel()) for p in model.parameters())
            params = lora.adapter_num_params(ref.lora_path) * self.device.model_params / max(real_params, 1)
            pacer.add(lora.adapter_transfer_s(self.device.link_bytes_per_s, int(params), self.device.bytes_per_param))
            pacer.wait()
            if self._trace is not None:
                self._trace.record("lora_load", started_s, time.time(), pacer.modelled_s)
        pool.add(ref, config)
        layers.adapters[ref.lora_id] = weights
        logger.info("LoRA adapter loaded: %s (rank %d, %d modules)", ref.lora_name, config.r, len(weights.modules))
        return pool.result(True)

    def unload_adapter(self, ref: LoraRef) -> LoraUpdate:
        """lora_manager.py ``unload_lora_adapter`` (worker thread; no running row uses it)."""
        pool, layers = self.lora_pool, self._lora_layers
        if pool is None or layers is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        pool.remove(ref.lora_id)
        layers.adapters.pop(ref.lora_id, None)
        return pool.result(True)

    def _adapter_rows(self, model: Any, lora_ids: Sequence[str | None]) -> contextlib.AbstractContextManager[None]:
        """The forward passes of ``model`` in the block add each row's adapter delta."""
        if self._lora_layers is None:
            return contextlib.nullcontext()
        return self._lora_layers.rows(model, lora_ids)

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
                if isinstance(item, _GenerationJob):
                    item.fail(stopped)
                elif isinstance(item, _Sequence):
                    item.job.fail(stopped)
                else:
                    item.loop.call_soon_threadsafe(_set_exception, item.future, stopped)
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
    def loaded(self) -> _LoadedModel:
        """The model now being served."""
        return self._loaded

    def submit(self, job: _GenerationJob) -> None:
        """Queue a generation job; its future resolves with one output dict per sample."""
        with self._cond:
            if self._stopping:
                raise FlexmarlError("engine stopped")
            self._queue.append(job)
            self._cond.notify_all()

    def submit_control(self, control: _Control | _WeightSwap) -> None:
        """Queue a pause, resume, rename or paused-time swap; the worker applies it between iterations."""
        with self._cond:
            if self._stopping:
                raise FlexmarlError("engine stopped")
            self._controls.append(control)
            self._cond.notify_all()

    def submit_swap(self, swap: _WeightSwap) -> None:
        """Queue a weight swap: behind every job already queued, or (``swap.paused``) as a control."""
        if swap.paused:
            self.submit_control(swap)
            return
        with self._cond:
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
            kept: collections.deque[_QueueItem] = collections.deque()
            for item in self._queue:
                if isinstance(item, _WeightSwap):
                    kept.append(item)
                    continue
                job = item.job if isinstance(item, _Sequence) else item
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

    def _answer_queued_abort(self, item: _GenerationJob | _Sequence) -> None:
        """Resolve an aborted waiting job, or a retracted sequence, with SGLang's waiting-queue answer."""
        loaded = self._loaded
        if isinstance(item, _GenerationJob):
            item.outputs = [queued_abort_output(item.sample_request(), loaded.weight_version)] * item.params.n
            item.resolve()
            return
        job = item.job
        shown = item.output_ids[: received_tokens(len(item.output_ids))]
        text = _output_text(loaded, shown, {"type": "abort"}, job.params)
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
            waiting = [item for item in self._queue if isinstance(item, _GenerationJob)]
            retracted = [item for item in self._queue if isinstance(item, _Sequence)]
            running = sum(job.params.n for job in self._running)
            used = self._running_tokens
        uptime_s = max(time.monotonic() - self._started_s, 1e-9)
        return LoadSnapshot(
            num_running_reqs=running,
            num_waiting_reqs=sum(job.params.n for job in waiting) + len(retracted),
            num_used_tokens=used,
            num_waiting_tokens=sum(len(job.input_ids) * job.params.n for job in waiting)
            + sum(len(seq.job.input_ids) + len(seq.output_ids) for seq in retracted),
            max_total_num_tokens=_max_total_tokens(self),
            max_running_requests=self._limits.max_running,
            gen_throughput=self.generated_tokens / uptime_s,
        )

    def idle(self) -> bool:
        """SGLang's ``is_fully_idle(ignore_waiting=paused)``: nothing running, and unless paused nothing queued."""
        with self._cond:
            return self._idle_locked()

    def _idle_locked(self) -> bool:
        waiting = any(not isinstance(item, _WeightSwap) for item in self._queue)
        return not self._running and self._batch is None and (self._paused or not waiting)

    # ----- worker thread -----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._controls) or (not self._paused and (bool(self._queue) or self._batch is not None))

    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            swap: _WeightSwap | None = None
            admitted: list[_GenerationJob | _Sequence] = []
            controls: list[_Control | _WeightSwap] = []
            with self._cond:
                while not self._has_work() and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                if self._controls:
                    controls = list(self._controls)
                    self._controls.clear()
                else:
                    if (self._batch is None and isinstance(self._queue[0], _GenerationJob)
                            and self.config.batch_window_s > 0):
                        # Give requests that arrive together at an idle replica a moment to share a prefill.
                        deadline = time.monotonic() + self.config.batch_window_s
                        while (remaining := deadline - time.monotonic()) > 0 and not self._stopping:
                            self._cond.wait(remaining)
                        if self._stopping:
                            break
                    head = self._queue[0] if self._queue else None
                    if self._batch is None and isinstance(head, _WeightSwap):
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

    def _die(self, exc: SchedulerCrash, admitted: list[_GenerationJob | _Sequence]) -> None:
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
        jobs: list[_GenerationJob] = []
        for item in [*items, *admitted, *rows]:
            if isinstance(item, _GenerationJob):
                jobs.append(item)
            elif isinstance(item, _Sequence):
                jobs.append(item.job)
            else:
                item.loop.call_soon_threadsafe(_set_exception, item.future, died)
        for job in {id(j): j for j in jobs}.values():
            job.fail(died)
        self._batch = None
        self._publish_running()
        if self.on_fatal is not None:
            self.on_fatal()

    def _take_admissible(self) -> list[_GenerationJob | _Sequence]:
        """Pop the queued jobs (and retracted sequences) that join the running batch now (lock held)."""
        if self._batch is not None and not self._batch.mergeable:
            return []  # a cache layout the engine cannot merge: wait for the batch to end
        demands: list[Demand] = []
        adapters: list[str | None] = []
        for item in self._queue:
            if isinstance(item, _WeightSwap) or len(demands) >= self._limits.max_running:
                break
            job = item.job if isinstance(item, _Sequence) else item
            samples = 1 if isinstance(item, _Sequence) else job.params.n
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
        return [item for index, item in enumerate(queued) if index in picked and not isinstance(item, _WeightSwap)]

    def _publish_running(self) -> None:
        """Expose the running jobs and KV tokens to load_snapshot, abort and stop."""
        batch = self._batch
        jobs = list({id(seq.job): seq.job for seq in batch.rows}.values()) if batch is not None else []
        tokens = int(batch.mask.sum()) if batch is not None else 0
        with self._cond:
            self._running = jobs
            self._running_tokens = tokens

    # ----- controls and weight swaps (worker thread) ---------------------------------------
    def _apply_control(self, control: _Control | _WeightSwap) -> None:
        if isinstance(control, _WeightSwap):
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
        control.loop.call_soon_threadsafe(_set_result, control.future, True)

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

    def _live_sequences(self) -> list[_Sequence]:
        rows = self._batch.rows if self._batch is not None else []
        with self._cond:
            queued = [item for item in self._queue if isinstance(item, _Sequence)]
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

    def _apply_swap(self, swap: _WeightSwap) -> None:
        if isinstance(swap, _WeightCall):
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
        swap.loop.call_soon_threadsafe(_set_result, swap.future, flushed)

    def _apply_weight_call(self, call: _WeightCall) -> None:
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
        call.loop.call_soon_threadsafe(_set_result, call.future, success)

    def _rerun_last_tokens(self, batch: _Batch, loaded: _LoadedModel) -> None:
        """Recompute every row's last-token KV and next-token logits with ``loaded`` (an in-place weight change).

        SGLang's decode step runs a sequence's last sampled token through the model; here that
        token was already run (by the old weights), so its cache column is dropped and run again.
        """
        batch.loaded = loaded
        for seq in batch.rows:
            seq.segments.append(_Segment(loaded, len(seq.output_ids), fresh=False))
        if not batch.mergeable:  # no per-column cache edits: recompute the rows whole on the new weights
            rows = batch.rows
            self._batch = None
            self._prefill(rows, loaded)
            return
        last_ids = torch.tensor([seq.tokens()[-1] for seq in batch.rows]).unsqueeze(1)
        for layer in batch.cache.layers:
            layer.keys = layer.keys[:, :, :-1, :]
            layer.values = layer.values[:, :, :-1, :]
        with self._adapter_rows(loaded.model, [seq.job.lora_id for seq in batch.rows]):
            out = loaded.model(
                input_ids=last_ids,
                attention_mask=batch.mask,
                position_ids=batch.last_position.unsqueeze(1),
                use_cache=True,
                **{loaded.cache_kwarg: batch.cache},
            )
        batch.logits = out.logits[:, -1, :].float()

    # ----- admission and decoding (worker thread) -------------------------------------------
    def _admit(self, items: list[_GenerationJob | _Sequence]) -> None:
        """Prefill the admitted prompts (and retracted sequences) together and add them to the running batch."""
        loaded = self._batch.loaded if self._batch is not None else self._loaded
        rows: list[_Sequence] = []
        for item in items:
            if isinstance(item, _Sequence):
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
                rows += [_Sequence(job, index) for index in range(job.params.n)]
        if rows:
            self._prefill(rows, loaded)

    def _prefill(self, rows: list[_Sequence], loaded: _LoadedModel) -> None:
        """Prefill the rows' tokens (prompt, plus output for a retracted row) and append them to the batch.

        Each distinct token sequence (of one adapter) is prefilled once (the samples of an n > 1
        request arrive as rows of one prompt, like SGLang's radix cache sharing their prefix; the
        radix cache keys prefixes by adapter too), left-padded, then its cache rows are repeated
        for every row.
        """
        self.batches_run += 1
        for seq in rows:
            seq.segments.append(_Segment(loaded, len(seq.output_ids), fresh=True))
        prompt_rows: dict[tuple[tuple[int, ...], str | None], int] = {}
        for seq in rows:
            prompt_rows.setdefault((tuple(seq.tokens()), seq.job.lora_id), len(prompt_rows))
        width = max(len(prompt) for prompt, _ in prompt_rows)
        pad_id = int(loaded.model.config.pad_token_id or 0)
        input_ids = torch.full((len(prompt_rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompt_rows), width), dtype=torch.long)
        for (prompt, _), row in prompt_rows.items():
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache(config=loaded.model.config)
        with self._adapter_rows(loaded.model, [adapter for _, adapter in prompt_rows]):
            out = loaded.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{loaded.cache_kwarg: cache},
            )
        logits = out.logits[:, -1, :].float()
        expand = torch.tensor([prompt_rows[(tuple(seq.tokens()), seq.job.lora_id)] for seq in rows])
        cache.batch_select_indices(expand)
        new = _Batch(
            loaded, cache, mask[expand], positions[expand, -1], logits[expand], rows, mergeable=_mergeable(cache)
        )
        self._batch = new if self._batch is None else _merge_batches(self._batch, new)
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
        finished: list[tuple[_Sequence, dict[str, Any]]] = []
        next_ids: list[int] = []
        keep: list[int] = []
        sampled = 0
        context_tokens = int(batch.mask.sum())
        if self.config.enable_deterministic_inference and any(seq.job.params.min_p > 0 for seq in batch.rows):
            # sampler.py top_k_top_p_min_p_sampling_from_probs_torch: "With sampling seed,
            # multinomial_with_seed will provide wrong results" (an assertion; the scheduler dies).
            raise SchedulerCrash("min_p sampling is not supported with --enable-deterministic-inference")
        for row, seq in enumerate(batch.rows):
            token_id, logprob = self._sample(batch.logits[row], seq)
            seq.output_ids.append(token_id)
            seq.logprobs.append(logprob)
            if seq.job.return_logprob and seq.job.top_logprobs_num:
                seq.top_logprobs.append(self._top_logprobs(batch.logits[row], seq.job.params, seq.job.top_logprobs_num))
            self.generated_tokens += 1
            sampled += 1
            if seq.job.aborted:
                # scheduler.py: a running request aborted by /abort_request runs one more decode
                # step and then finishes with FINISH_ABORT (its tokens so far are returned).
                finished.append((seq, running_abort_reason()))
                continue
            stop = self._stop_reason(seq, token_id, loaded)
            if stop is not None:
                finished.append((seq, stop))
                continue
            next_ids.append(token_id)
            keep.append(row)
        if keep:
            if len(keep) < len(batch.rows):
                batch.select(keep)
            batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long)], dim=1)
            batch.last_position = batch.last_position + 1
            with self._adapter_rows(loaded.model, [seq.job.lora_id for seq in batch.rows]):
                out = loaded.model(
                    input_ids=torch.tensor(next_ids).unsqueeze(1),
                    attention_mask=batch.mask,
                    position_ids=batch.last_position.unsqueeze(1),
                    use_cache=True,
                    **{loaded.cache_kwarg: batch.cache},
                )
            batch.logits = out.logits[:, -1, :].float()
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

    def _sample(self, logits: torch.Tensor, seq: _Sequence) -> tuple[int, float]:
        """One token for ``seq`` and its logprob (sampler.py's order: temperature, top-k, top-p, min-p)."""
        params = seq.job.params
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if params.greedy:  # SGLang: temperature 1 and top_k 1, whatever the seed
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
        if self.config.enable_deterministic_inference:
            seed = params.seed if params.seed is not None else DEFAULT_SAMPLING_SEED
            position = len(seq.job.input_ids) + len(seq.output_ids)
            token_id = gumbel_max_token(probs, seed, position)
        else:
            token_id = int(torch.multinomial(probs / probs.sum(), 1, generator=self._rng))
        source = raw_logprobs if self.config.return_original_logprob else scaled_logprobs
        return token_id, max(float(source[token_id]), _LOGPROB_FLOOR)

    def _top_logprobs(self, logits: torch.Tensor, params: SamplingParams, k: int) -> list[tuple[float, int]]:
        """The ``k`` most likely tokens of the distribution :meth:`_sample` takes the logprob from.

        SGLang's sampler.py hands that same ``logprobs`` tensor to ``compute_logprobs`` with
        ``top_logprobs_nums``, and logprob_processor.py ``get_top_logprobs`` takes its ``topk``.
        """
        if params.greedy or params.temperature == 0 or self.config.return_original_logprob:
            source = torch.log_softmax(logits, dim=-1)
        else:
            source = torch.log_softmax(logits / params.temperature, dim=-1)
        return _topk(source, k)

    def _rescore(self, seq: _Sequence) -> list[float]:
        """Logprobs of ``seq.output_ids`` from unpadded forward passes of the sequence alone.

        One pass of the weights that produced them, when one set did; after a weight change,
        one pass per :class:`_Segment`, each over the KV cache the sequence then had (an in-place
        change keeps the old weights' cache of the prefix; a re-prefill recomputes it whole), so
        each token's logprob is that of the weights and cache that sampled it. Same convention as
        :meth:`_sample`: the temperature-scaled distribution, the raw one at temperature 0 or
        with ``return_original_logprob``.
        """
        job, output_ids = seq.job, seq.output_ids
        prompt_length, count = len(job.input_ids), len(output_ids)
        tokens = seq.tokens()
        segments = seq.segments or [_Segment(self._loaded, 0, fresh=True)]
        pieces: list[torch.Tensor] = []
        adapter = [job.lora_id]
        with torch.inference_mode():
            if len(segments) == 1:
                model = segments[0].loaded.model
                with self._adapter_rows(model, adapter):
                    logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
                pieces.append(logits[prompt_length - 1 : prompt_length - 1 + count])
            else:
                from transformers import DynamicCache

                cache: Any = None
                for index, segment in enumerate(segments):
                    end = segments[index + 1].start if index + 1 < len(segments) else count
                    first = prompt_length - 1 + segment.start  # the fed token whose logits give token `start`
                    if segment.fresh:
                        cache = DynamicCache(config=segment.loaded.model.config)
                        feed_from = 0
                    elif end <= segment.start:
                        continue
                    else:
                        feed_from = first
                    feed = tokens[feed_from : prompt_length - 1 + end]
                    if not feed:
                        continue
                    with self._adapter_rows(segment.loaded.model, adapter):
                        out = segment.loaded.model(
                            input_ids=torch.tensor([feed]),
                            position_ids=torch.arange(feed_from, feed_from + len(feed)).unsqueeze(0),
                            use_cache=True,
                            **{segment.loaded.cache_kwarg: cache},
                        )
                    pieces.append(out.logits[0, first - feed_from :].float())
        logits = torch.cat(pieces)
        temperature = job.params.temperature
        if temperature != 0 and not self.config.return_original_logprob:
            logits = logits / temperature
        scores = torch.log_softmax(logits, dim=-1)
        chosen = scores.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)
        if job.top_logprobs_num:  # the alternatives of the same passes, so they agree with the sampled logprobs
            seq.top_logprobs = [_topk(row, job.top_logprobs_num) for row in scores]
        return [max(float(value), _LOGPROB_FLOOR) for value in chosen]

    @staticmethod
    def _stop_reason(seq: _Sequence, token_id: int, loaded: _LoadedModel) -> dict[str, Any] | None:
        """schedule_batch.py ``update_finish_state``: stop strings, then stop tokens/EOS, then length."""
        params = seq.job.params
        if params.stop and loaded.tokenizer is not None:
            decoded = loaded.tokenizer.decode(seq.output_ids)
            for stop in params.stop:
                if stop in decoded:
                    return {"type": "stop", "matched": stop}
        # _check_token_based_finish: ignore_eos turns off stop_token_ids as well as EOS.
        if not params.ignore_eos and (token_id in params.stop_token_ids or token_id in loaded.eos_token_ids):
            return {"type": "stop", "matched": token_id}
        if len(seq.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        return None

    def _finish(self, seq: _Sequence, reason: dict[str, Any], loaded: _LoadedModel) -> None:
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
        job: _GenerationJob,
        sample_index: int,
        output_ids: list[int],
        logprobs: list[float],
        reason: dict[str, Any],
        loaded: _LoadedModel,
        version_changes: Sequence[VersionChange] = (),
        top_logprobs: Sequence[Sequence[tuple[float, int]]] = (),
    ) -> dict[str, Any]:
        text = _output_text(loaded, output_ids, reason, job.params)
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


def _topk(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """(logprob, token id) of the ``k`` largest entries, largest first (floored as sampled logprobs are)."""
    values, indices = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(max(float(v), _LOGPROB_FLOOR), int(i)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]


def _output_text(loaded: _LoadedModel, output_ids: list[int], reason: dict[str, Any], params: SamplingParams) -> str:
    """The detokenized output, trimmed at the matched stop as detokenizer_manager.py ``trim_matched_stop``."""
    if loaded.tokenizer is None or not output_ids:
        return ""
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    ids = output_ids
    if isinstance(matched, int) and not params.no_stop_trim:
        ids = output_ids[:-1]  # the matched stop token is the last one
    text = str(loaded.tokenizer.decode(ids, skip_special_tokens=True))
    if isinstance(matched, str) and (position := text.find(matched)) != -1:
        text = text[: position + len(matched)] if params.no_stop_trim else text[:position]
    return text


def gumbel_max_token(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token Gumbel-max picks from ``probs`` with uniforms that depend on (seed, position) only.

    What SGLang's deterministic sampler does (sampler.py ``multinomial_with_seed``: argmax of
    ``log p + Gumbel`` noise hashed from the seed and the position), with FlexMARL's own
    uniform stream: a generator seeded by a 64-bit mix of the seed and the position. Two
    samples with one seed at one position draw the same noise, whatever shares the batch.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    mixed ^= mixed >> 31
    generator = torch.Generator()
    generator.manual_seed(mixed)
    uniforms = torch.rand(probs.shape[-1], generator=generator, dtype=torch.float64).clamp_(1e-300, 1.0 - 2.0**-53)
    gumbel = -torch.log(-torch.log(uniforms))
    scores = torch.log(probs.to(torch.float64)) + gumbel  # log 0 = -inf: filtered tokens never win
    return int(torch.argmax(scores))


def _max_total_tokens(engine: EmbeddedEngine) -> int:
    """KV-cache tokens of the replica, in real tokens (the device model's capacity when modelled)."""
    limits = engine.limits
    if math.isfinite(limits.kv_capacity_tokens):
        return int(limits.kv_capacity_tokens / limits.token_scale)
    return limits.max_running * engine.loaded.max_positions


# ----- HTTP ------------------------------------------------------------------------------
class EmbeddedBackend(EngineBackend):
    """:class:`EmbeddedEngine` under the shared SGLang-protocol server."""

    name = "embedded"
    version = ENGINE_VERSION

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    async def start(self, port: int) -> None:
        """Start the worker thread."""
        self.engine.start()

    async def stop(self) -> None:
        """Stop the worker thread (off the event loop: it joins)."""
        await asyncio.to_thread(self.engine.stop)

    def check(self, request: SampleRequest) -> None:
        """Context length and vocabulary (tokenizer_manager.py ``_validate_one_request``)."""
        loaded = self.engine.loaded
        prompt, params = request.input_ids, request.params
        if len(prompt) >= loaded.max_positions:
            raise InvalidArgument(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({loaded.max_positions} tokens)."
            )
        if len(prompt) + params.max_new_tokens > loaded.max_positions:
            raise InvalidArgument(
                f"Requested token count exceeds the model's maximum context length of {loaded.max_positions} "
                f"tokens. You requested a total of {len(prompt) + params.max_new_tokens} tokens: {len(prompt)} "
                f"tokens from the input messages and {params.max_new_tokens} tokens for the completion."
            )
        vocab = int(loaded.model.config.vocab_size)
        if max(prompt) >= vocab:
            raise InvalidArgument(f"input_ids contain a token >= vocab size {vocab}")
        if params.stop and loaded.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer; this checkpoint has none")

    def submit(self, request: SampleRequest) -> asyncio.Future[dict[str, Any]]:
        """Queue the sample as a one-sample job."""
        loop = asyncio.get_running_loop()
        inner: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
        job = _GenerationJob(request.rid, list(request.input_ids), request.params, request.return_logprob, loop, inner)
        job.created_s = request.created_s
        job.lora_id = request.lora_id
        job.top_logprobs_num = request.top_logprobs_num
        try:
            self.engine.submit(job)
        except FlexmarlError as exc:
            raise Unavailable(str(exc)) from exc
        return first_sample(inner)

    def abort(self, rid: str, abort_all: bool) -> None:
        """The scheduler's abort (prefix match)."""
        self.engine.abort(rid, abort_all)

    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        weight_version: str | None,
        *,
        paused: bool,
        flush_cache: bool,
    ) -> bool:
        """Load off to the side, then swap in: once the running sequences finished, or (paused) at once."""
        if load_format not in (None, "auto", "safetensors"):
            raise InvalidArgument(f"load_format {load_format!r} is not supported (auto, safetensors)")
        loaded = await asyncio.to_thread(load_model, model_path, weight_version or "")
        reason = _compatible(self.engine.loaded, loaded)
        if reason:
            raise InvalidArgument(f"incompatible checkpoint: {reason}")
        loop = asyncio.get_running_loop()
        swap = _WeightSwap(loaded, weight_version, loop, loop.create_future(), paused=paused, flush_cache=flush_cache)
        try:
            self.engine.submit_swap(swap)
        except FlexmarlError as exc:
            raise Unavailable(str(exc)) from exc
        return await swap.future

    async def _control(self, kind: str, weight_version: str = "") -> None:
        loop = asyncio.get_running_loop()
        control = _Control(kind, loop, loop.create_future(), weight_version)
        try:
            self.engine.submit_control(control)
        except FlexmarlError as exc:
            raise Unavailable(str(exc)) from exc
        await control.future

    async def set_weight_version(self, weight_version: str) -> None:
        """Rename the served weights at the next iteration boundary (later tokens report it)."""
        await self._control("rename", weight_version)

    # ----- weight-update groups (sglang/srt/model_executor/model_runner_components/weight_updater.py)
    async def _scheduler_call(self, call: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
        """Run ``call`` on the worker between iterations (SGLang's scheduler handles these requests so)."""
        loop = asyncio.get_running_loop()
        control = _Control("call", loop, loop.create_future(), call=call)
        try:
            self.engine.submit_control(control)
            await control.future
        except FlexmarlError as exc:
            return False, f"engine stopped: {exc}"
        return control.outcome

    async def _weight_call(
        self,
        run: Callable[[torch.nn.Module], UpdateOutcome],
        weight_version: str | None,
        *,
        paused: bool,
        flush_cache: bool,
    ) -> tuple[bool, str]:
        """Run ``run`` placed as a disk update: after the running samples, or (paused) at once."""
        loop = asyncio.get_running_loop()
        call = _WeightCall(
            self.engine.loaded, weight_version, loop, loop.create_future(), paused=paused, flush_cache=flush_cache,
            run=run,
        )
        try:
            self.engine.submit_swap(call)
            await call.future
        except FlexmarlError as exc:
            return False, f"engine stopped: {exc}"
        return call.outcome

    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """Join the trainer's group on the worker thread (it blocks until every rank joined)."""
        groups = self.engine.weight_groups
        return await self._scheduler_call(
            lambda: groups.init_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )
        )

    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Leave the group on the worker thread."""
        groups = self.engine.weight_groups
        return await self._scheduler_call(lambda: groups.destroy_group(group_name))

    async def begin_weight_update(self, selector: str, *, paused: bool) -> tuple[bool, str]:
        """Open the update session."""
        groups = self.engine.weight_groups

        def run(model: torch.nn.Module) -> UpdateOutcome:
            return UpdateOutcome(*groups.begin(selector), weights_changed=False)

        return await self._weight_call(run, None, paused=paused, flush_cache=False)

    async def end_weight_update(self, *, paused: bool) -> tuple[bool, str]:
        """Close the update session."""
        groups = self.engine.weight_groups

        def run(model: torch.nn.Module) -> UpdateOutcome:
            return UpdateOutcome(*groups.end(), weights_changed=False)

        return await self._weight_call(run, None, paused=paused, flush_cache=False)

    async def update_weights_from_distributed(
        self, update: DistributedUpdate, weight_version: str | None, *, paused: bool, flush_cache: bool
    ) -> tuple[bool, str]:
        """Receive the call's tensors on the worker thread and load them into the served model at once."""
        groups = self.engine.weight_groups
        return await self._weight_call(
            lambda model: groups.update(model, update), weight_version, paused=paused, flush_cache=flush_cache
        )

    async def pause(self, mode: str) -> None:
        """Pause the worker between iterations (``in_place`` or ``retract``)."""
        await self._control(mode)

    # ----- LoRA adapters ---------------------------------------------------------------
    @property
    def lora_settings(self) -> LoraSettings:
        """The engine's LoRA flags."""
        return self.engine.config.lora

    async def _adapter_call(self, call: Callable[[], LoraUpdate]) -> LoraUpdate:
        """Run ``call`` on the worker between iterations (SGLang's scheduler loads and unloads adapters so)."""
        result: list[LoraUpdate] = []

        def run() -> tuple[bool, str]:
            result.append(call())
            return result[-1].success, result[-1].error_message or ""

        success, message = await self._scheduler_call(run)
        return result[0] if result else LoraUpdate(success, message)

    async def load_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Load the adapter on the worker thread."""
        return await self._adapter_call(lambda: self.engine.load_adapter(ref))

    async def unload_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Drop the adapter on the worker thread."""
        return await self._adapter_call(lambda: self.engine.unload_adapter(ref))

    async def resume(self) -> None:
        """Let the worker admit and decode again."""
        await self._control("resume")

    @property
    def weight_version(self) -> str:
        """The served weight version."""
        return self.engine.loaded.weight_version

    @property
    def last_output_s(self) -> float:
        """When the worker last produced tokens."""
        return self.engine.last_output_s

    def load_snapshot(self) -> LoadSnapshot:
        """The engine's load."""
        return self.engine.load_snapshot()

    def flush_cache(self) -> bool:
        """Nothing is cached across requests; refused while anything runs or (unless paused) waits, as SGLang."""
        return self.engine.idle()

    def model_info(self) -> dict[str, Any]:
        """Fields of SGLang's ``/model_info``."""
        loaded = self.engine.loaded
        config = loaded.model.config
        return {
            "model_path": loaded.model_path,
            "served_model_name": loaded.model_path,
            "tokenizer_path": loaded.model_path if loaded.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": loaded.weight_version,
            "load_format": "auto",
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info(self) -> dict[str, Any]:
        """Server arguments plus internal state, like SGLang's ``/server_info``."""
        engine = self.engine
        info: dict[str, Any] = dataclasses.asdict(engine.config)
        info.update(info.pop("lora"))  # SGLang's server_info lists the LoRA flags among the others
        info.update(
            {
                "model_path": engine.loaded.model_path,
                "weight_version": engine.loaded.weight_version,
                "max_running_requests": engine.limits.max_running,
                "context_length": engine.loaded.max_positions,
                "random_seed": engine.config.seed,
                "internal_states": [
                    {
                        "batches_run": engine.batches_run,
                        "max_batch_sequences": engine.max_batch_sequences,
                        "max_batch_adapters": engine.max_batch_adapters,
                        "generated_tokens": engine.generated_tokens,
                    }
                ],
                "backend": "embedded",
            }
        )
        return info


class EmbeddedServer(SGLangServer):
    """The SGLang-protocol server around one :class:`EmbeddedEngine`."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        super().__init__(EmbeddedBackend(engine))
        self.engine = engine


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
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the engine's sampling generator (SGLang's --random-seed)"
    )
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="as SGLang: honour sampling_seed (42 when absent) with position-hashed sampling, and return "
        "batch-invariant logprobs",
    )
    parser.add_argument(
        "--return-original-logprob",
        action="store_true",
        help="logprobs of the raw distribution instead of the temperature-scaled one",
    )
    parser.add_argument(
        "--modelled-device",
        default="",
        help="device profile (JSON/YAML, flexmarl.devicemodel): take that accelerator's time; "
        "default: $FLEXMARL_MODELLED_DEVICE",
    )
    lora.add_lora_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads < 1 or args.max_batch_size < 1 or args.batch_window_s < 0:
        parser.error("--num-threads and --max-batch-size must be >= 1, --batch-window-s >= 0")
    lora_settings = lora.settings_from_args(args)
    try:
        lora_settings.check()
    except InvalidArgument as exc:
        parser.error(str(exc))
    return EmbeddedEngineConfig(
        model_path=args.model_path,
        host=args.host,
        port=args.port,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        batch_window_s=args.batch_window_s,
        return_original_logprob=args.return_original_logprob,
        enable_deterministic_inference=args.enable_deterministic_inference,
        weight_version=args.weight_version,
        seed=args.seed,
        ready_file=args.ready_file,
        modelled_device=args.modelled_device or os.environ.get(devicemodel.PROFILE_ENV, ""),
        lora=lora_settings,
    )


def _write_ready_file(path: str, port: int) -> None:
    """Atomically write the ready file, so a reader never sees half of it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    tmp.replace(target)


async def serve(config: EmbeddedEngineConfig) -> int:
    """Run one replica until SIGTERM or SIGINT (exit status 0), or until the engine dies (1)."""
    torch.set_num_threads(config.num_threads)
    engine = await asyncio.to_thread(EmbeddedEngine, config)
    server = EmbeddedServer(engine)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_fatal() -> None:
        loop.call_soon_threadsafe(stop.set)

    engine.on_fatal = on_fatal
    port = await server.start(config.host, config.port)
    logger.info("embedded engine serving %s on %s:%d", config.model_path, config.host, port)
    if config.ready_file:
        _write_ready_file(config.ready_file, port)
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("stopping")
    await server.stop()
    return 0 if engine.fatal is None else 1


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rolloutd.engines.embedded``."""
    raise SystemExit(asyncio.run(serve(_parse_args(argv))))


if __name__ == "__main__":
    main()
