"""What the embedded engine's scheduler queues and runs: generation jobs, their samples, weight swaps, controls.

A :class:`GenerationJob` is one prompt of a ``/generate`` (SGLang's ``Req`` before the tokenizer
manager expands ``n``); each of its samples decodes as a :class:`SequenceState`, which a
``retract`` pause (sglang/srt/managers/scheduler.py ``pause_generation``) puts back in the
waiting queue with the tokens it has. Weight swaps and controls share the scheduler's FIFOs
(see :mod:`rolloutd.engines.embedded.engine`). Results go back to the event loop through the
item's future, set from the worker thread with :func:`set_result` / :func:`set_exception`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rolloutd.engines.embedded.interface import SampleRequest, VersionChange
from rolloutd.engines.embedded.model import LoadedModel
from rolloutd.engines.embedded.weight_receiver import UpdateOutcome
from rolloutd.engines.protocol import SamplingParams


@dataclass
class GenerationJob:
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
        """Answer the job's future with its samples' outputs (from the worker thread)."""
        results = [output for output in self.outputs if output is not None]
        self.loop.call_soon_threadsafe(set_result, self.future, results)

    def fail(self, exc: BaseException) -> None:
        """Fail the job's future with ``exc`` (from the worker thread)."""
        self.loop.call_soon_threadsafe(set_exception, self.future, exc)


@dataclass
class WeightSwap:
    """A fully loaded replacement model.

    Not ``paused`` (queued in the FIFO): applied once the running batch has drained, and it
    stops admission until then (the tokenizer manager's model lock). ``paused`` (a control):
    applied at the next iteration boundary under whatever runs. ``weight_version`` None keeps
    the served version. The future resolves with whether the cache flush after it succeeded.
    """

    loaded: LoadedModel
    weight_version: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]
    paused: bool = False
    flush_cache: bool = False


@dataclass
class WeightCall(WeightSwap):
    """A step of a weight update from a trainer's group (session, or one call's tensors), placed as a swap.

    ``run`` executes on the worker thread with the served model (the broadcast is received
    there, blocking the scheduler as SGLang's does); ``outcome`` is its ``(success, message)``,
    set before the future resolves. ``loaded`` is the model served when the call was queued.
    """

    run: Callable[[torch.nn.Module], UpdateOutcome] | None = None
    outcome: tuple[bool, str] = (False, "not run")


@dataclass
class Control:
    """A scheduler command applied by the worker between iterations: pause, resume, rename or call."""

    kind: str  # "in_place" | "retract" | "resume" | "rename" | "call"
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[bool]
    weight_version: str = ""
    call: Callable[[], tuple[bool, str]] | None = None  # kind "call": run on the worker thread
    outcome: tuple[bool, str] = (False, "not run")


@dataclass(frozen=True)
class Segment:
    """From output token ``start`` on, a sequence's logits came from ``loaded``.

    ``fresh``: over a KV cache recomputed whole by ``loaded`` (admission, or the re-prefill of a
    retracted sequence); else over the cache the sequence had (an in-place weight change: the
    prefix keeps the old weights' keys and values). Deterministic inference rescores by these.
    """

    loaded: LoadedModel
    start: int
    fresh: bool


@dataclass
class SequenceState:
    """One sample being decoded (or retracted to the waiting queue by a pause)."""

    job: GenerationJob
    sample_index: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    #: Per output token, the job's ``top_logprobs_num`` most likely (logprob, token id), when it asked for them.
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    version_changes: list[VersionChange] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def tokens(self) -> list[int]:
        """Prompt plus output so far."""
        return [*self.job.input_ids, *self.output_ids]


QueueItem = GenerationJob | WeightSwap | SequenceState


def set_result(future: asyncio.Future[Any], value: Any) -> None:
    """Resolve ``future`` unless it is done already (called on its loop)."""
    if not future.done():
        future.set_result(value)


def set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``future`` unless it is done already (called on its loop)."""
    if not future.done():
        future.set_exception(exc)
