"""The interface an engine implements under the SGLang-protocol server, and the values that cross it.

:class:`EngineBackend` is the scheduler-and-model side of an SGLang server
(sglang/srt/managers/scheduler.py and what it drives) as :class:`rolloutd.engines.embedded.server.SGLangServer`
(the tokenizer manager's and HTTP server's side) calls it. Two backends implement it: the
embedded engine (:class:`rolloutd.engines.embedded.backend.EmbeddedBackend`) and the synthetic
engine (``benchmarks/synthetic_engine.py``). The value types follow SGLang's own:
:class:`SampleRequest` (io_struct.py ``TokenizedGenerateReqInput``, one sample), :class:`LoadSnapshot`
(scheduler_components/load_inquirer.py), :class:`VersionChange` (sglang/srt/utils/weight_versions.py)
and :class:`DistributedUpdate` (io_struct.py ``UpdateWeightsFromDistributedReqInput``).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from typing import Any

from rolloutd.engines.lora import LoraRef, LoraSettings, LoraUpdate
from rolloutd.engines.protocol import SamplingParams


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One sample to generate: SGLang's scheduler request after the tokenizer manager expanded ``n``.

    ``params.n`` is always 1 here; an ``n > 1`` request becomes ``n`` of these with fresh rids.
    """

    rid: str
    input_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool
    created_s: float = dataclasses.field(default_factory=time.monotonic)
    lora_id: str | None = None  # the adapter the sample runs with (the registry's id); None: the base
    top_logprobs_num: int = 0  # io_struct.py GenerateReqInput.top_logprobs_num (read with return_logprob)


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    """One replica's load in the vocabulary of sglang/srt/managers/scheduler_components/load_inquirer.py.

    ``num_total_tokens`` is the used KV tokens plus the tokens of the queued requests, as
    SGLang's ``get_loads`` computes it (not the capacity: that is ``max_total_num_tokens``).
    """

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_waiting_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    gen_throughput: float

    @property
    def num_total_tokens(self) -> int:
        """Used KV tokens plus queued request tokens."""
        return self.num_used_tokens + self.num_waiting_tokens


@dataclasses.dataclass(frozen=True)
class VersionChange:
    """The weight version changed after a request's first ``output_tokens`` tokens (weight_versions.py).

    ``old_version`` served those tokens (from the previous change on).
    """

    old_version: str
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class DistributedUpdate:
    """The tensors of one ``/update_weights_from_distributed`` call (io_struct.py field names).

    Zipped as SGLang zips them: lists of different lengths are not refused.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = "weight_update_group"
    load_format: str | None = None


class EngineBackend(abc.ABC):
    """What an engine implements under :class:`SGLangServer` (the scheduler and model side).

    Methods run on the server's event loop; a backend with a worker thread hands results back
    through the futures it returns.
    """

    #: Name in error messages and ``/server_info`` (``"embedded"``, ``"synthetic"``).
    name: str = "engine"
    #: ``version`` field of ``/server_info`` and ``/v1/loads``.
    version: str = "flexmarl"

    @abc.abstractmethod
    async def start(self, port: int) -> None:
        """Start scheduling (the server listens on ``port``)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop scheduling; whatever is pending fails (idempotent)."""

    @abc.abstractmethod
    def check(self, request: SampleRequest) -> None:
        """Raise :class:`InvalidArgument` when the backend cannot serve ``request`` (context, vocab)."""

    @abc.abstractmethod
    def submit(self, request: SampleRequest) -> asyncio.Future[dict[str, Any]]:
        """Queue one sample; the future resolves with its ``/generate`` output object.

        Raises:
            Unavailable: The backend is stopping.
        """

    @abc.abstractmethod
    def abort(self, rid: str, abort_all: bool) -> None:
        """Abort queued and running samples whose rid starts with ``rid`` (or all): scheduler.py semantics."""

    @abc.abstractmethod
    async def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None,
        weight_version: str | None,
        *,
        paused: bool,
        flush_cache: bool,
    ) -> bool:
        """Swap in the checkpoint at ``model_path``; returns False when the cache flush after it was refused.

        Not ``paused`` (tokenizer_manager.py: the update takes the model lock): the running and
        queued samples finish on the old weights first, later ones wait. ``paused``: the weights
        change at the next iteration boundary under whatever runs or was retracted, and a
        version change is recorded for each of them. ``weight_version`` None keeps the version.
        With ``flush_cache`` the cache is then flushed, which is refused (False) while samples
        run, or, unless the scheduler is paused, wait (weight_updater.py).

        Raises:
            InvalidArgument: The checkpoint cannot be loaded or does not fit the served model.
        """

    @abc.abstractmethod
    async def set_weight_version(self, weight_version: str) -> None:
        """Rename the weights being served (``/update_weight_version``); live samples record the change."""

    @abc.abstractmethod
    async def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> tuple[bool, str]:
        """Join a trainer's weight-update group as rank ``rank_offset`` (blocks until all ranks joined)."""

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        """Leave the group (``(False, "The group to be destroyed does not exist.")`` when not in it)."""

    @abc.abstractmethod
    async def begin_weight_update(self, selector: str, *, paused: bool) -> tuple[bool, str]:
        """Open the update session (not ``paused``: after the running samples, like a disk update)."""

    @abc.abstractmethod
    async def end_weight_update(self, *, paused: bool) -> tuple[bool, str]:
        """Close the update session."""

    @abc.abstractmethod
    async def update_weights_from_distributed(
        self, update: DistributedUpdate, weight_version: str | None, *, paused: bool, flush_cache: bool
    ) -> tuple[bool, str]:
        """Receive ``update`` from rank 0 of its group and load it at once; SGLang's ``(success, message)``.

        Placed as :meth:`update_weights_from_disk` (``paused`` or not). On success the version
        changes when ``weight_version`` is given, then the cache flush is checked (refused: the
        flush message, success False).
        """

    @abc.abstractmethod
    async def pause(self, mode: str) -> None:
        """Pause the scheduler (scheduler.py ``pause_generation``), ``mode`` ``"in_place"`` or ``"retract"``.

        Returns once the scheduler is between iterations and paused: ``in_place`` keeps the
        running samples and their KV cache; ``retract`` moves them to the end of the waiting
        queue (they re-prefill their prompt plus their tokens when generation continues).
        Aborts still reach paused samples (a running one answers after continue).
        """

    @abc.abstractmethod
    async def resume(self) -> None:
        """Un-pause the scheduler (scheduler.py ``continue_generation``; a no-op when not paused)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> str:
        """The weight version being served."""

    @property
    @abc.abstractmethod
    def last_output_s(self) -> float:
        """``time.monotonic()`` of the scheduler's last output (a decode step or a finished sample)."""

    @abc.abstractmethod
    def load_snapshot(self) -> LoadSnapshot:
        """Current queue and batch sizes."""

    @abc.abstractmethod
    def flush_cache(self) -> bool:
        """Flush cached prefixes; False (refused) while samples run or wait (waiting ignored while paused)."""

    @abc.abstractmethod
    def model_info(self) -> dict[str, Any]:
        """``/model_info`` fields."""

    @abc.abstractmethod
    def server_info(self) -> dict[str, Any]:
        """``/server_info`` fields (server arguments and internal state)."""

    # ----- LoRA adapters (the scheduler's half: sglang/srt/lora/lora_manager.py) -----------------
    @property
    @abc.abstractmethod
    def lora_settings(self) -> LoraSettings:
        """The server's LoRA flags (its ``--lora-paths`` adapters are loaded before :meth:`start`)."""

    @abc.abstractmethod
    async def load_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Load ``ref``'s adapter between iterations; SGLang's result (``validate_new_adapter`` errors included)."""

    @abc.abstractmethod
    async def unload_lora_adapter(self, ref: LoraRef) -> LoraUpdate:
        """Drop adapter ``ref.lora_id`` (no request uses it any more: the server waited)."""
