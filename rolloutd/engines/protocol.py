"""Engine-neutral generation types and the abstract engine client.

The dataclasses mirror the subset of SGLang's native ``/generate`` API that RL needs
(sglang ``python/sglang/srt/managers/io_struct.py``: ``GenerateReqInput``; sampling fields of
``python/sglang/srt/sampling/sampling_params.py``), but carry no HTTP or JSON: the balancer and
the episode runner use them, and :mod:`rolloutd.engines.sglang_client` maps them to the wire.
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


class FinishReason(enum.StrEnum):
    """Why a sample stopped (the ``type`` of SGLang's ``meta_info.finish_reason``)."""

    STOP = "stop"  # an EOS or stop token was generated (it is the last output token)
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # /abort_request or a server-side abort


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (SGLang ``sampling_params`` field names).

    ``temperature == 0`` means greedy decoding. ``top_k == -1`` disables top-k. ``seed`` is the
    embedded engine's per-request seed (SGLang spells it ``sampling_seed``; both engines accept
    it under that name, see docs/engines.md).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` when a field is out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidArgument(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.n < 1:
            raise InvalidArgument(f"n must be >= 1, got {self.n}")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids must be non-negative")

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
        if self.seed is not None:
            wire["sampling_seed"] = self.seed
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> SamplingParams:
        """Parse a ``sampling_params`` JSON object; unknown keys are ignored, bad types rejected."""
        try:
            seed = wire.get("sampling_seed", wire.get("seed"))
            params = cls(
                temperature=float(wire.get("temperature", 1.0)),
                top_p=float(wire.get("top_p", 1.0)),
                top_k=int(wire.get("top_k", -1)),
                min_p=float(wire.get("min_p", 0.0)),
                max_new_tokens=int(wire.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
                stop_token_ids=tuple(int(t) for t in (wire.get("stop_token_ids") or ())),
                ignore_eos=bool(wire.get("ignore_eos", False)),
                n=int(wire.get("n", 1)),
                seed=None if seed is None else int(seed),
            )
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"bad sampling_params: {exc}") from exc
        params.validate()
        return params


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) to complete ``sampling.n`` times."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    rid: str | None = None

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` on an empty prompt or bad sampling parameters."""
        if not self.input_ids:
            raise InvalidArgument("input_ids must not be empty")
        if any(token_id < 0 for token_id in self.input_ids):
            raise InvalidArgument("input_ids must be non-negative")
        self.sampling.validate()


@dataclass(frozen=True)
class GenerationResult:
    """One sample of a request.

    ``output_token_logprobs[i]`` is the log-probability of ``output_ids[i]`` under the behaviour
    policy (empty when logprobs were not requested). ``weight_version`` and ``model_path`` name
    the weights that produced every token of this sample.
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


@dataclass(frozen=True)
class WeightUpdateResult:
    """Outcome of ``/update_weights_from_disk``."""

    success: bool
    message: str
    num_paused_requests: int = 0


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
    ) -> WeightUpdateResult:
        """Load new weights from a checkpoint directory between requests."""

    @abc.abstractmethod
    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        """Abort the request(s) whose rid starts with ``rid`` (or all of them)."""

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
