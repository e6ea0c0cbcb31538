"""Engine-neutral generation types and the abstract engine client.

The dataclasses mirror the subset of SGLang's native ``/generate`` API that RL needs
(sglang ``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput``; sampling fields of
``python/sglang/srt/sampling/sampling_params.py``), but carry no HTTP or JSON: the balancer and
the episode runner use them, and :mod:`rolloutd.engines.sglang.client` maps them to the wire.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexmarl.errors import InvalidArgument

# SGLang's SamplingParams default for max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang treats a temperature below this as greedy (sglang/srt/sampling/sampling_params.py _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-6
# Most stop strings one request may carry (sampling_params.py MAX_STOP_COUNT).
MAX_STOP_COUNT = 32
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Every key SGLang 0.5.23 accepts in ``sampling_params``, in its order (sglang/api/v1/api_types.py
# ``SamplingParams``; the /generate contract gate, sglang/srt/entrypoints/api_contract.py, rejects
# any other key). Read from the 0.5.23 wheel; not imported, so rolloutd does not need sglang.
SGLANG_SAMPLING_KEYS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

# Keys SGLang accepts that FlexMARL's engines do not implement, with the value that means "off".
# A request that sets one to anything else is rejected (never silently ignored).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "stop_regex": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "logit_bias": {},
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": [],
}
_INT_KEYS = frozenset(
    {"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width"}
)
_FLOAT_KEYS = frozenset(
    {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
)
_BOOL_KEYS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})
_STR_KEYS = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})


class FinishReason(enum.StrEnum):
    """Why a sample stopped (the ``type`` of SGLang's ``meta_info.finish_reason``)."""

    STOP = "stop"  # an EOS or stop token was generated (it is the last output token), or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # /abort_request or a server-side abort


class ContractViolation(InvalidArgument):
    """A ``/generate`` body that breaks SGLang's JSON contract (unknown key, wrong type).

    SGLang answers these with HTTP 400 and ``{"error": "<text>"}`` (a bare string, from the
    contract gate in sglang/srt/entrypoints/http_server.py ``generate_request``), unlike the
    ``{"error": {"message": ...}}`` of the checks that run after it.
    """


def _unknown_field(key: str) -> ContractViolation:
    listed = ", ".join(f"`{name}`" for name in SGLANG_SAMPLING_KEYS)
    return ContractViolation(f"unknown field `{key}`, expected one of {listed}")


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_wire_type(key: str, value: Any) -> None:
    """Raise :class:`ContractViolation` when ``value`` has the wrong JSON type for ``key``."""
    if value is None or key in ("custom_params", "watermark"):
        return
    if key in _INT_KEYS:
        ok, expected = _is_int(value), "i64"
    elif key in _FLOAT_KEYS:
        ok, expected = _is_int(value) or isinstance(value, float), "f64"
    elif key in _BOOL_KEYS:
        ok, expected = isinstance(value, bool), "a boolean"
    elif key in _STR_KEYS:
        ok, expected = isinstance(value, str), "a string"
    elif key in ("stop", "stop_regex"):
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        expected = "a value or an array of values for StringOrList"
    elif key == "stop_token_ids":
        ok, expected = isinstance(value, list) and all(_is_int(v) for v in value), "a sequence of i64"
    elif key == "logit_bias":
        ok = isinstance(value, dict) and all(_is_int(v) or isinstance(v, float) for v in value.values())
        expected = "a map of f64"
    else:  # choice
        ok, expected = isinstance(value, list) and all(isinstance(v, str) for v in value), "a sequence of strings"
    if not ok:
        raise ContractViolation(f"invalid type: {_describe(value)}, expected {expected} (sampling_params.{key})")


def check_sampling_contract(wire: Any) -> None:
    """Raise :class:`ContractViolation` unless ``wire`` passes SGLang's ``SamplingParams`` contract.

    Mirrors the decoder of sglang/api/v1/api_types.py (``decode_SamplingParams``): an object
    whose keys are all in :data:`SGLANG_SAMPLING_KEYS`, each of its JSON type (null = default).
    """
    if not isinstance(wire, Mapping):
        raise ContractViolation(f"invalid type: {_describe(wire)}, expected struct SamplingParams")
    for key, value in wire.items():
        if key not in SGLANG_SAMPLING_KEYS:
            raise _unknown_field(str(key))
        _check_wire_type(key, value)


def check_lora_path_contract(value: Any) -> None:
    """Raise :class:`ContractViolation` unless ``lora_path`` has SGLang's JSON type.

    sglang/api/v1/api_types.py ``decode_OptionalStringOrList``: null, a string, or an array of
    strings and nulls (a null entry runs its prompt on the base model).
    """
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, list):
        raise ContractViolation(
            f"invalid type: {_describe(value)}, expected a value or an array of values for OptionalStringOrList "
            "(lora_path)"
        )
    for entry in value:
        if entry is not None and not isinstance(entry, str):
            raise ContractViolation(f"invalid type: {_describe(entry)}, expected a string (lora_path)")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang ``sampling_params`` field names).

    ``temperature`` below 1e-6 means greedy decoding (SGLang sets top_k = 1). ``top_k == -1``
    disables top-k. ``seed`` goes on the wire as SGLang's ``sampling_seed``; SGLang and the
    embedded engine honour it only when launched with ``--enable-deterministic-inference``
    (docs/engines.md). ``stop`` strings end a sample once its decoded text contains one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """Whether SGLang decodes this request greedily (temperature < 1e-6)."""
        return 0 <= self.temperature < GREEDY_TEMPERATURE_EPS

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` when a field is out of range.

        The ranges of sglang/srt/sampling/sampling_params.py ``SamplingParams.verify``.
        """
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidArgument(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.n < 1:
            raise InvalidArgument(f"n must be at least 1, got {self.n}.")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be non-negative")
        if len(self.stop) > MAX_STOP_COUNT:
            raise InvalidArgument(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(self.stop)}")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise InvalidArgument(f"sampling_seed must be in [-2**63, 2**63 - 1], got {self.seed}.")

    def to_wire(self) -> dict[str, Any]:
        """The ``sampling_params`` JSON object of SGLang's ``/generate``."""
        wire: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
            "n": self.n,
        }
        if self.stop_token_ids:
            wire["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            wire["stop"] = list(self.stop)
        if self.no_stop_trim:
            wire["no_stop_trim"] = True
        if self.seed is not None:
            wire["sampling_seed"] = self.seed
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], *, engine: str = "FlexMARL's engines") -> SamplingParams:
        """Parse a ``sampling_params`` JSON object as strictly as SGLang 0.5.23.

        Unknown keys and wrong JSON types raise :class:`ContractViolation` (SGLang's contract
        gate); out-of-range values and keys SGLang accepts but ``engine`` does not implement
        (penalties, grammars, ``logit_bias``, ``min_new_tokens``, ...) set to anything but their
        default raise :class:`InvalidArgument` naming the field. Nothing is ignored.
        """
        check_sampling_contract(wire)
        for key, default in _UNSUPPORTED_DEFAULTS.items():
            value = wire.get(key)
            if value is not None and value != default:
                raise InvalidArgument(f"sampling_params.{key}={value!r} is not supported by {engine}")

        def get(key: str, default: Any) -> Any:
            value = wire.get(key)
            return default if value is None else value

        stop = get("stop", ())
        params = cls(
            temperature=float(get("temperature", 1.0)),
            top_p=float(get("top_p", 1.0)),
            top_k=int(get("top_k", -1)),
            min_p=float(get("min_p", 0.0)),
            max_new_tokens=int(get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            stop_token_ids=tuple(int(t) for t in get("stop_token_ids", ())),
            stop=(stop,) if isinstance(stop, str) else tuple(s for s in stop if s),
            no_stop_trim=bool(get("no_stop_trim", False)),
            ignore_eos=bool(get("ignore_eos", False)),
            n=int(get("n", 1)),
            seed=None if wire.get("sampling_seed") is None else int(wire["sampling_seed"]),
        )
        params.validate()
        return params


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) to complete ``sampling.n`` times.

    ``lora_path`` names a LoRA adapter loaded on the replica (``/load_lora_adapter``'s
    ``lora_name``: SGLang's ``GenerateReqInput.lora_path`` takes the name, not a path); None
    serves the base model.
    """

    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    rid: str | None = None
    lora_path: str | None = None
    #: SGLang's ``top_logprobs_num``: with ``return_logprob``, the k most likely tokens at every output position.
    top_logprobs_num: int = 0

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` on an empty prompt or bad sampling parameters."""
        if not self.input_ids:
            raise InvalidArgument("input_ids must not be empty")
        if any(token_id < 0 for token_id in self.input_ids):
            raise InvalidArgument("input_ids must be non-negative")
        if self.lora_path is not None and not self.lora_path:
            raise InvalidArgument("lora_path must name an adapter (None serves the base model)")
        if self.top_logprobs_num < 0:
            raise InvalidArgument("top_logprobs_num must be >= 0")
        self.sampling.validate()


class PauseMode(enum.StrEnum):
    """``mode`` of SGLang's ``/pause_generation`` (io_struct.py ``PauseGenerationReqInput``)."""

    ABORT = "abort"  # abort every running request (each answers its partial output), block new ones
    RETRACT = "retract"  # stop decoding; running requests go back to the waiting queue (KV recomputed)
    IN_PLACE = "in_place"  # stop decoding; running requests keep their KV cache


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` of a sample were produced while ``version`` was served.

    SGLang 0.5.23's ``meta_info.weight_versions`` (sglang/srt/utils/weight_versions.py): a new
    span starts where the served weight version changed under a running request (a weight
    update or ``/update_weight_version`` while it was paused in place or retracted).
    """

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class GenerationResult:
    """One sample of a request.

    ``output_token_logprobs[i]`` is the log-probability of ``output_ids[i]`` under the behaviour
    policy (empty when logprobs were not requested). ``weight_versions`` are the spans of
    output tokens by the weight version that produced them; ``weight_version`` is the last
    span's (SGLang's ``meta_info.weight_version``). An ``ABORT`` sample carries the tokens and
    logprobs it had when it was aborted. ``model_path`` is the checkpoint serving when the sample
    finished (embedded and synthetic engines only).
    """

    output_ids: tuple[int, ...]
    output_token_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    rid: str = ""
    text: str = ""
    matched_stop: int | None = None
    cached_tokens: int = 0
    weight_version: str = ""
    model_path: str = ""
    e2e_latency_s: float = 0.0
    weight_versions: tuple[WeightVersionSpan, ...] = ()
    #: ``meta_info.output_top_logprobs``: per output token, its (logprob, token_id) alternatives, most likely first
    #: (empty unless the request asked ``top_logprobs_num``).
    output_top_logprobs: tuple[tuple[tuple[float, int], ...], ...] = ()

    def version_of_token(self, index: int) -> str:
        """The weight version that produced ``output_ids[index]`` ("" when the engine reported no spans)."""
        for span in self.weight_versions:
            if span.start <= index < span.end:
                return span.version
        return ""


@dataclass(frozen=True)
class WeightUpdateResult:
    """Outcome of ``/update_weights_from_disk``."""

    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass(frozen=True)
class LoraAdapterResult:
    """Outcome of ``/load_lora_adapter`` or ``/unload_lora_adapter`` (io_struct.py ``LoRAUpdateOutput``).

    ``loaded_adapters`` maps each adapter name the replica holds afterwards to its path.
    """

    success: bool
    error_message: str
    loaded_adapters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """``/model_info`` (``/get_model_info``)."""

    model_path: str
    tokenizer_path: str | None
    is_generation: bool
    weight_version: str


@dataclass(frozen=True)
class EngineLoad:
    """Load of one replica, summed over its data-parallel ranks (``/v1/loads``)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_total_tokens: int


class EngineClient(abc.ABC):
    """Talks to one engine replica.

    Every call raises ``flexmarl.errors.Unavailable`` when the replica cannot be reached and
    ``InvalidArgument`` when it rejects the request.
    """

    url: str

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        """Complete ``request.input_ids``; returns ``request.sampling.n`` results in order."""

    @abc.abstractmethod
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> WeightUpdateResult:
        """Load new weights from a checkpoint directory (between requests, or at once while paused)."""

    @abc.abstractmethod
    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraAdapterResult:
        """Load the PEFT adapter directory ``lora_path`` as ``lora_name`` (``/load_lora_adapter``)."""

    @abc.abstractmethod
    async def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """Unload ``lora_name`` once no request uses it (``/unload_lora_adapter``)."""

    @abc.abstractmethod
    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> None:
        """Pause generation (``/pause_generation``); new requests wait until :meth:`continue_generation`."""

    @abc.abstractmethod
    async def continue_generation(self) -> None:
        """Resume generation (``/continue_generation``)."""

    @abc.abstractmethod
    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort the request whose rid is exactly ``rid`` (or all of them).

        On SGLang only ``abort_all`` is reliable: the samples of an ``n > 1`` request run
        under fresh rids, and an unknown rid is a no-op (docs/engines.md).
        """

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the replica answers ``/health`` with 200."""

    @abc.abstractmethod
    async def health_generate(self) -> bool:
        """True when the replica generates a token (``/health_generate``)."""

    @abc.abstractmethod
    async def model_info(self) -> ModelInfo:
        """Model path and weight version being served."""

    @abc.abstractmethod
    async def server_info(self) -> dict[str, Any]:
        """The replica's server arguments and internal state (free-form)."""

    @abc.abstractmethod
    async def flush_cache(self) -> bool:
        """Flush the prefix cache; False when the replica refused (requests running)."""

    @abc.abstractmethod
    async def loads(self) -> EngineLoad:
        """Current load."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections (idempotent)."""


def parse_input_ids(value: Any) -> list[list[int]]:
    """Normalise SGLang's ``input_ids`` (one prompt or a batch) to a list of prompts."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise InvalidArgument("input_ids must be a non-empty list of ints or of lists of ints")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [list(value)]
    prompts: list[list[int]] = []
    for item in value:
        if (
            not isinstance(item, Sequence)
            or isinstance(item, str)
            or not item
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):
            raise InvalidArgument("input_ids must be a non-empty list of ints or of lists of ints")
        prompts.append(list(item))
    return prompts
