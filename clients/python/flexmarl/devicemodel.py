"""Modelled device time: how long a stated accelerator would take for what a tiny CPU model just did.

The benchmarks run the real daemons (gRPC, etcd, stored, balancer, planner) with tiny CPU
models, but make every compute step take the time a stated accelerator serving a stated
model would take. This module is the model (pure functions of a :class:`DeviceProfile`)
plus two small helpers the engine and the trainer use to apply it (:class:`Pacer`,
:class:`TraceWriter`). ``docs/benchmarks.md`` documents it.

Roofline, per replica (``rollout_devices_per_replica`` devices, tensor parallel) or per
trainer slot (``train_devices_per_slot`` devices, data parallel):

* prefill of T prompt tokens: ``2 * P * T / (peak_flops * prefill_mfu * d)`` (compute bound;
  the attention term, ~4·layers·hidden·T² FLOPs, is left out);
* one decode iteration of a batch of b sequences holding C context tokens in total:
  ``max((W + kv_bytes_per_token * C) / (hbm_bytes_per_s * hbm_efficiency * d),
  2 * P * b / (peak_flops * prefill_mfu * d))`` — the weights W = P · bytes_per_param and the
  KV cache are read once per iteration however many sequences share it (why batching helps);
* training on T tokens (forward + backward): ``6 * P * T / (peak_flops * train_mfu * d)``;
* optimizer step: ``P * optimizer_bytes_per_param / (hbm_bytes_per_s * hbm_efficiency * d)``
  (mixed-precision Adam reads and writes master weights, two moments and the gradient) plus
  publishing the new weights, ``W / link_bytes_per_s``;
* weight reload on a replica, agent-state swap: bytes ``/ link_bytes_per_s`` (a swap: what one of
  the slot's devices holds, each over its own link; :func:`swap_s`);
* KV-cache capacity of a replica (what bounds its running batch, as in SGLang):
  ``(hbm_capacity_bytes * kv_memory_fraction * d - W) / kv_bytes_per_token`` tokens.

Scales: each real token stands for ``token_scale`` modelled tokens (a 64-token CPU response
is modelled as a 64 × 128 = 8192-token one), and a modelled second takes ``time_scale`` wall
seconds. Components wait until ``max(real elapsed, modelled × time_scale)``: real compute
overlaps the modelled time and is only visible when it is slower (a *model overrun*, which
the trace records).

Datasheet numbers of the presets (dense BF16 tensor-core peak; the datasheets' 1,979 TFLOP/s
figures are with 2:4 sparsity):

* NVIDIA H100 SXM5: 989 TFLOP/s BF16, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s
  (NVIDIA H100 Tensor Core GPU datasheet).
* NVIDIA H200 SXM: 989 TFLOP/s BF16, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s
  (NVIDIA H200 Tensor Core GPU datasheet).
* Inter-node link for weight loads and swaps: one 400 Gb/s InfiniBand NDR port = 50 GB/s.
* Model: Qwen2.5-14B (Qwen2.5 technical report / its config.json): 14.7 B parameters,
  48 layers, 8 KV heads of dimension 128, so KV cache per token in BF16 =
  2 (K, V) × 48 × 8 × 128 × 2 B = 196,608 B.

Efficiencies are assumptions, not datasheet numbers: 40 % MFU for training, 60 % for
prefill, 70 % of HBM bandwidth for decode. So are the serving limits: 88 % of HBM for weights
plus KV cache (the order of SGLang's ``mem_fraction_static``; the rest is activations and
CUDA graphs) and at most 1,024 running requests (a cap; on these shapes the KV capacity binds
first: 208,537 tokens on one H100 for Qwen2.5-14B).

LoRA agents (:class:`LoraShape`, rank r on some linear matrices of every layer; the frozen base is
the profile's model): an adapter has ``A = r * sum(d_in + d_out) * layers`` parameters (one
``d_in x r`` and one ``r x d_out`` matrix per target); on Qwen2.5-14B (hidden 5120, 40 query and 8
KV heads of 128, MLP 13824, 48 layers) rank 8 on q, k, v, o is 12,582,912 parameters, 25.2 MB in
BF16. Costs, with the same efficiencies and bytes per parameter as the full model:

* loading or publishing an adapter: ``A * bytes_per_param / link_bytes_per_s`` (0.50 ms);
* swapping an adapter agent's training state (adapter + optimizer; the base stays on the slot):
  ``A * (bytes_per_param + optimizer_bytes_per_param) / link_bytes_per_s`` (4.5 ms, against
  5.29 s for the full model);
* training on T tokens: ``(4 * P + 6 * A) * T / (peak_flops * train_mfu * d)``. Forward is 2 P
  per token and the backward's activation gradients (dX = dY Wᵀ) another 2 P, through every
  frozen layer down to the lowest adapter; the weight gradients (dW = Xᵀ dY, the last 2 P of
  full training's 6 P) are skipped for the frozen base, so the base costs 2/3 of full training;
  the adapter's own matrices cost 6 A like any trained weight;
* optimizer step: ``A * optimizer_bytes_per_param / (hbm_bytes_per_s * hbm_efficiency * d)`` plus
  publishing the adapter;
* prefill: ``2 * (P + A) * T`` FLOPs; a decode iteration of a batch running ``n`` distinct
  adapters reads the base once and each of those adapters once,
  ``max((W + n * A * bytes_per_param + kv_bytes_per_token * C) / (hbm_bytes_per_s * hbm_efficiency
  * d), 2 * (P + A) * b / (peak_flops * prefill_mfu * d))``. The segmented LoRA kernels' own
  inefficiency (SGLang's triton / csgmv backends against a dense GEMM) is not modelled.

``benchmarks/lora_sim.py`` uses them (docs/benchmarks-scale.md, "LoRA vs full-model agents").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from flexmarl.errors import InvalidArgument

PROFILE_ENV = "FLEXMARL_MODELLED_DEVICE"
"""Environment variable naming a profile file; daemons and engines started with it model device time."""

TB = 1.0e12
GB = 1.0e9

QWEN25_14B_PARAMS = 14.7e9
QWEN25_14B_KV_BYTES_PER_TOKEN = 2 * 48 * 8 * 128 * 2
QWEN25_14B_LAYERS = 48
#: (d_in, d_out) of each linear matrix of one Qwen2.5-14B layer (its config.json: hidden 5120,
#: 40 query heads and 8 KV heads of dimension 128, intermediate 13824); PEFT's module names.
QWEN25_14B_LINEAR_SHAPES: Mapping[str, tuple[int, int]] = {
    "q_proj": (5120, 5120),
    "k_proj": (5120, 1024),
    "v_proj": (5120, 1024),
    "o_proj": (5120, 5120),
    "gate_proj": (5120, 13824),
    "up_proj": (5120, 13824),
    "down_proj": (13824, 5120),
}
#: Training FLOPs per frozen-base parameter and token: forward (2) + activation gradients (2), no weight gradients.
FROZEN_TRAIN_FLOPS_PER_PARAM = 4.0
#: Training FLOPs per trained parameter and token: forward (2) + activation and weight gradients (4).
TRAIN_FLOPS_PER_PARAM = 6.0


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """An accelerator, the model it runs, and the scales that map real work onto modelled time.

    Attributes:
        name: label for tables.
        peak_flops: dense BF16 FLOP/s of one device.
        hbm_bytes_per_s: memory bandwidth of one device.
        link_bytes_per_s: bandwidth of the link weights and agent states travel over.
        prefill_mfu: achievable fraction of ``peak_flops`` in prefill (and batched decode compute).
        train_mfu: achievable fraction of ``peak_flops`` in training.
        hbm_efficiency: achievable fraction of ``hbm_bytes_per_s``.
        hbm_capacity_bytes: memory of one device.
        kv_memory_fraction: fraction of a replica's memory for weights plus KV cache.
        max_running_requests: most sequences a replica decodes together (besides the KV bound).
        model_params: parameters of the modelled model (P).
        bytes_per_param: bytes of one served/published weight (2 for BF16).
        kv_bytes_per_token: KV-cache bytes of one context token.
        optimizer_bytes_per_param: bytes the optimizer step reads and writes per parameter.
        rollout_devices_per_replica: devices of one engine replica (tensor parallel).
        train_devices_per_slot: devices of one trainer slot (data parallel).
        token_scale: modelled tokens per real token.
        time_scale: wall seconds per modelled second.
        trace_dir: where components append busy-interval traces ("" = no trace).
    """

    name: str = "H100-SXM/Qwen2.5-14B"
    peak_flops: float = 989.0 * TB
    hbm_bytes_per_s: float = 3.35 * TB
    link_bytes_per_s: float = 50.0 * GB
    prefill_mfu: float = 0.6
    train_mfu: float = 0.4
    hbm_efficiency: float = 0.7
    hbm_capacity_bytes: float = 80.0 * GB
    kv_memory_fraction: float = 0.88
    max_running_requests: int = 1024
    model_params: float = QWEN25_14B_PARAMS
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = float(QWEN25_14B_KV_BYTES_PER_TOKEN)
    optimizer_bytes_per_param: float = 16.0
    rollout_devices_per_replica: int = 1
    train_devices_per_slot: int = 8
    token_scale: float = 1.0
    time_scale: float = 1.0
    trace_dir: str = ""

    def __post_init__(self) -> None:
        positive = (
            "peak_flops",
            "hbm_bytes_per_s",
            "link_bytes_per_s",
            "model_params",
            "bytes_per_param",
            "token_scale",
            "time_scale",
            "hbm_capacity_bytes",
        )
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InvalidArgument(f"device profile: {name} must be a positive number, got {value!r}")
        for name in ("prefill_mfu", "train_mfu", "hbm_efficiency", "kv_memory_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise InvalidArgument(f"device profile: {name} must be in (0, 1], got {value!r}")
        for name in ("kv_bytes_per_token", "optimizer_bytes_per_param"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"device profile: {name} must be >= 0")
        if self.rollout_devices_per_replica < 1 or self.train_devices_per_slot < 1:
            raise InvalidArgument("device profile: devices per replica and per slot must be >= 1")
        if self.max_running_requests < 1:
            raise InvalidArgument("device profile: max_running_requests must be >= 1")

    @property
    def weight_bytes(self) -> float:
        """Bytes of the served weights (W)."""
        return self.model_params * self.bytes_per_param

    def with_changes(self, **changes: Any) -> DeviceProfile:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The profile as JSON (what :func:`load_profile` reads)."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


H100_SXM = DeviceProfile()
H200_SXM = DeviceProfile(name="H200-SXM/Qwen2.5-14B", hbm_bytes_per_s=4.8 * TB, hbm_capacity_bytes=141.0 * GB)
PRESETS: Mapping[str, DeviceProfile] = {"h100": H100_SXM, "h200": H200_SXM}


def parse_profile(data: Mapping[str, Any]) -> DeviceProfile:
    """A profile from a mapping: optional ``preset`` (h100, h200) plus field overrides."""
    fields = {f.name for f in dataclasses.fields(DeviceProfile)}
    values = dict(data)
    preset_name = str(values.pop("preset", "h100")).lower()
    if preset_name not in PRESETS:
        raise InvalidArgument(f"device profile: preset must be one of {sorted(PRESETS)}, got {preset_name!r}")
    unknown = sorted(set(values) - fields)
    if unknown:
        raise InvalidArgument(f"device profile: unknown field(s) {unknown}")
    for key in ("rollout_devices_per_replica", "train_devices_per_slot", "max_running_requests"):
        if key in values:
            values[key] = int(values[key])
    return PRESETS[preset_name].with_changes(**values)


def load_profile(path: str | Path) -> DeviceProfile:
    """Reads a JSON or YAML profile file (see :func:`parse_profile`).

    A ``.json`` file is parsed as JSON: YAML 1.1 reads ``1e-05`` (how JSON writes small floats)
    as a string.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise InvalidArgument(f"device profile {str(path)!r}: {error}") from None
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"device profile {str(path)!r}: must be a mapping")
    return parse_profile(data)


def profile_from_env(environ: Mapping[str, str] | None = None) -> DeviceProfile | None:
    """The profile named by ``FLEXMARL_MODELLED_DEVICE``, or None when it is unset or empty."""
    path = (environ if environ is not None else os.environ).get(PROFILE_ENV, "")
    return load_profile(path) if path else None


# ---- the roofline ------------------------------------------------------------------------------------


def prefill_s(profile: DeviceProfile, prompt_tokens: float) -> float:
    """Modelled seconds to prefill ``prompt_tokens`` (modelled) tokens on one replica."""
    devices = profile.rollout_devices_per_replica
    return 2.0 * profile.model_params * prompt_tokens / (profile.peak_flops * profile.prefill_mfu * devices)


def decode_iteration_s(profile: DeviceProfile, batch_sequences: int, context_tokens: float) -> float:
    """Modelled seconds of one decode iteration (one token for each of ``batch_sequences``)."""
    if batch_sequences <= 0:
        return 0.0
    devices = profile.rollout_devices_per_replica
    memory_s = (profile.weight_bytes + profile.kv_bytes_per_token * context_tokens) / (
        profile.hbm_bytes_per_s * profile.hbm_efficiency * devices
    )
    compute_s = 2.0 * profile.model_params * batch_sequences / (profile.peak_flops * profile.prefill_mfu * devices)
    return max(memory_s, compute_s)


def train_tokens_s(profile: DeviceProfile, tokens: float) -> float:
    """Modelled seconds of forward + backward over ``tokens`` (modelled) tokens on one slot."""
    devices = profile.train_devices_per_slot
    return 6.0 * profile.model_params * tokens / (profile.peak_flops * profile.train_mfu * devices)


def optimizer_step_s(profile: DeviceProfile) -> float:
    """Modelled seconds of an optimizer step on one slot, including publishing the new weights."""
    devices = profile.train_devices_per_slot
    update_s = (
        profile.model_params
        * profile.optimizer_bytes_per_param
        / (profile.hbm_bytes_per_s * profile.hbm_efficiency * devices)
    )
    return update_s + weight_transfer_s(profile)


def weight_transfer_s(profile: DeviceProfile) -> float:
    """Modelled seconds to move the served weights over the link (a replica's weight reload)."""
    return profile.weight_bytes / profile.link_bytes_per_s


def swap_s(profile: DeviceProfile, zero_stage: int = 0) -> float:
    """Modelled seconds to move an agent's full training state (weights + optimizer) onto its slot.

    Each of the slot's ``train_devices_per_slot`` devices moves what it holds over its own link,
    all in parallel, so the time is one device's share: under ZeRO 0 every device holds the whole
    state (data-parallel replicas) and the slot's size changes nothing; from ZeRO 1 the optimizer
    state is sharded over the devices, at ZeRO 3 the weights too (DeepSpeed's partitioning).
    """
    if not 0 <= zero_stage <= 3:
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
    devices = profile.train_devices_per_slot
    weight_bytes = profile.model_params * profile.bytes_per_param / (devices if zero_stage >= 3 else 1)
    optimizer_bytes = profile.model_params * profile.optimizer_bytes_per_param / (devices if zero_stage >= 1 else 1)
    return (weight_bytes + optimizer_bytes) / profile.link_bytes_per_s


def kv_capacity_tokens(profile: DeviceProfile) -> float:
    """Modelled context tokens one replica's KV cache holds: memory left after the weights, per token.

    Never below zero (a model that does not fit leaves no KV cache); unbounded when the profile
    states no KV bytes per token.
    """
    if profile.kv_bytes_per_token <= 0:
        return math.inf
    memory = profile.hbm_capacity_bytes * profile.kv_memory_fraction * profile.rollout_devices_per_replica
    return max(0.0, (memory - profile.weight_bytes) / profile.kv_bytes_per_token)


def real_decode_iteration_s(profile: DeviceProfile, batch_sequences: int, real_context_tokens: float) -> float:
    """Modelled seconds that one *real* decode iteration stands for: ``token_scale`` modelled iterations."""
    scale = profile.token_scale
    return scale * decode_iteration_s(profile, batch_sequences, real_context_tokens * scale)


# ---- LoRA adapters over the profile's model -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoraShape:
    """A LoRA adapter of rank ``rank`` on some linear matrices of every layer of the profile's model.

    Attributes:
        rank: the adapter's rank r.
        target_shapes: (d_in, d_out) of each target matrix of one layer.
        layers: layers that carry the targets.
    """

    rank: int
    target_shapes: tuple[tuple[int, int], ...]
    layers: int

    def __post_init__(self) -> None:
        if self.rank < 1 or self.layers < 1:
            raise InvalidArgument(f"LoRA shape: rank and layers must be >= 1, got {self.rank}, {self.layers}")
        if not self.target_shapes or any(d_in < 1 or d_out < 1 for d_in, d_out in self.target_shapes):
            raise InvalidArgument(f"LoRA shape: needs target matrices of positive size, got {self.target_shapes}")

    @property
    def params(self) -> int:
        """Adapter parameters A: ``rank * (d_in + d_out)`` per target matrix and layer."""
        return self.rank * sum(d_in + d_out for d_in, d_out in self.target_shapes) * self.layers


def qwen25_14b_lora(rank: int, target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> LoraShape:
    """A rank-``rank`` adapter on ``target_modules`` of every Qwen2.5-14B layer."""
    unknown = sorted(set(target_modules) - set(QWEN25_14B_LINEAR_SHAPES))
    if unknown:
        known = sorted(QWEN25_14B_LINEAR_SHAPES)
        raise InvalidArgument(f"LoRA shape: {unknown} are not Qwen2.5-14B linear modules {known}")
    return LoraShape(rank, tuple(QWEN25_14B_LINEAR_SHAPES[m] for m in target_modules), QWEN25_14B_LAYERS)


def adapter_bytes(profile: DeviceProfile, shape: LoraShape) -> float:
    """Bytes of a served (or published) adapter: ``A * bytes_per_param``."""
    return shape.params * profile.bytes_per_param


def adapter_transfer_s(profile: DeviceProfile, shape: LoraShape) -> float:
    """Modelled seconds to move an adapter over the link (an adapter load on a replica, or its publish)."""
    return adapter_bytes(profile, shape) / profile.link_bytes_per_s


def lora_swap_s(profile: DeviceProfile, shape: LoraShape) -> float:
    """Modelled seconds to move an adapter agent's training state (adapter + optimizer; the base stays)."""
    return shape.params * (profile.bytes_per_param + profile.optimizer_bytes_per_param) / profile.link_bytes_per_s


def lora_prefill_s(profile: DeviceProfile, shape: LoraShape, prompt_tokens: float) -> float:
    """Modelled seconds to prefill ``prompt_tokens`` through the base and one adapter on one replica."""
    devices = profile.rollout_devices_per_replica
    flops = 2.0 * (profile.model_params + shape.params) * prompt_tokens
    return flops / (profile.peak_flops * profile.prefill_mfu * devices)


def lora_decode_iteration_s(
    profile: DeviceProfile, shape: LoraShape, batch_sequences: int, context_tokens: float, adapters: int
) -> float:
    """Modelled seconds of one decode iteration of a batch that runs ``adapters`` distinct adapters.

    The base weights and each running adapter are read once per iteration; every sequence
    computes through the base and its own adapter.
    """
    if batch_sequences <= 0:
        return 0.0
    devices = profile.rollout_devices_per_replica
    weights = profile.weight_bytes + max(0, adapters) * adapter_bytes(profile, shape)
    memory_s = (weights + profile.kv_bytes_per_token * context_tokens) / (
        profile.hbm_bytes_per_s * profile.hbm_efficiency * devices
    )
    flops = 2.0 * (profile.model_params + shape.params) * batch_sequences
    compute_s = flops / (profile.peak_flops * profile.prefill_mfu * devices)
    return max(memory_s, compute_s)


def lora_train_tokens_s(profile: DeviceProfile, shape: LoraShape, tokens: float) -> float:
    """Modelled seconds of forward + backward over ``tokens`` with a frozen base: ``(4 P + 6 A)`` FLOPs a token.

    The frozen base needs no weight gradients (2 of full training's 6 FLOPs per parameter and
    token) but still propagates activation gradients down to the lowest adapter.
    """
    devices = profile.train_devices_per_slot
    flops = (FROZEN_TRAIN_FLOPS_PER_PARAM * profile.model_params + TRAIN_FLOPS_PER_PARAM * shape.params) * tokens
    return flops / (profile.peak_flops * profile.train_mfu * devices)


def lora_optimizer_step_s(profile: DeviceProfile, shape: LoraShape) -> float:
    """Modelled seconds of an optimizer step over the adapter's parameters, including publishing the adapter."""
    devices = profile.train_devices_per_slot
    update_s = shape.params * profile.optimizer_bytes_per_param / (
        profile.hbm_bytes_per_s * profile.hbm_efficiency * devices
    )
    return update_s + adapter_transfer_s(profile, shape)


# ---- applying it --------------------------------------------------------------------------------------


class Pacer:
    """Makes a piece of work last ``max(real, modelled × time_scale)`` wall seconds.

    ``add(modelled_s)`` accumulates modelled time since ``start``; ``wait()`` sleeps until
    ``start + modelled × time_scale``. Clock and sleep are injectable for tests.
    """

    def __init__(
        self,
        profile: DeviceProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.profile = profile
        self._clock = clock
        self._sleep = sleep
        self.start_s = clock()
        self.modelled_s = 0.0
        self.overrun_s = 0.0

    def add(self, modelled_s: float) -> None:
        """Accounts modelled seconds of work done since the start."""
        self.modelled_s += max(0.0, modelled_s)

    @property
    def end_s(self) -> float:
        """When the modelled time has passed (on the pacer's clock): ``start + modelled × time_scale``."""
        return self.start_s + self.modelled_s * self.profile.time_scale

    def wait(self) -> float:
        """Sleeps until the modelled time has passed; returns the seconds slept."""
        remaining_s = self.end_s - self._clock()
        if remaining_s > 0:
            self._sleep(remaining_s)
            return remaining_s
        self.overrun_s = -remaining_s
        return 0.0


class TraceWriter:
    """Appends busy intervals as JSON lines to ``<trace_dir>/<who>.jsonl`` (thread-safe, one file per writer)."""

    def __init__(self, profile: DeviceProfile, who: str) -> None:
        self._path = Path(profile.trace_dir) / f"{who}.jsonl" if profile.trace_dir else None
        self._lock = threading.Lock()
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, kind: str, start_s: float, end_s: float, modelled_s: float, **extra: float | str) -> None:
        """One interval (wall clock ``time.time()`` seconds) of ``kind`` work."""
        if self._path is None:
            return
        line = json.dumps({"kind": kind, "start_s": start_s, "end_s": end_s, "modelled_s": modelled_s, **extra})
        with self._lock, self._path.open("a", encoding="utf-8") as out:
            out.write(line + "\n")


def read_traces(trace_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Every trace file of a directory: writer name -> its records."""
    traces: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        traces[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return traces


def busy_seconds(records: list[dict[str, Any]], start_s: float, end_s: float) -> float:
    """Wall seconds inside [start_s, end_s] covered by the union of the records' intervals."""
    spans = sorted((max(r["start_s"], start_s), min(r["end_s"], end_s)) for r in records)
    total = 0.0
    current_start, current_end = -math.inf, -math.inf
    for span_start, span_end in spans:
        if span_end <= span_start:
            continue
        if span_start > current_end:
            total += max(0.0, current_end - current_start) if current_end > -math.inf else 0.0
            current_start, current_end = span_start, span_end
        else:
            current_end = max(current_end, span_end)
    if current_end > -math.inf:
        total += current_end - current_start
    return total
