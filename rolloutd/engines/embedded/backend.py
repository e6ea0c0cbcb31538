"""The embedded engine as an :class:`EngineBackend` under the SGLang-protocol server, and that server.

What SGLang's scheduler answers the tokenizer manager (sglang/srt/managers/scheduler.py,
io_struct.py): requests become :class:`~rolloutd.engines.embedded.work.GenerationJob` items on
:class:`~rolloutd.engines.embedded.engine.EmbeddedEngine`'s queue; weight updates, pauses and
LoRA adapters become its controls, run on its worker thread between iterations as SGLang's
scheduler runs them; the request checks are tokenizer_manager.py ``_validate_one_request``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from flexmarl.errors import FlexmarlError, InvalidArgument, Unavailable
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.embedded.interface import DistributedUpdate, EngineBackend, LoadSnapshot, SampleRequest
from rolloutd.engines.embedded.model import incompatibility, load_model
from rolloutd.engines.embedded.outputs import first_sample
from rolloutd.engines.embedded.server import SGLangServer
from rolloutd.engines.embedded.weight_receiver import UpdateOutcome
from rolloutd.engines.embedded.work import Control, GenerationJob, WeightCall, WeightSwap
from rolloutd.engines.lora import LoraRef, LoraSettings, LoraUpdate

ENGINE_VERSION = "flexmarl-embedded-0.1"


class EmbeddedBackend(EngineBackend):
    """:class:`EmbeddedEngine` under the shared SGLang-protocol server."""

    name = "embedded"
    version = ENGINE_VERSION

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self._updates = asyncio.Lock()  # /update_weights_from_disk, one at a time

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
        job = GenerationJob(request.rid, list(request.input_ids), request.params, request.return_logprob, loop, inner)
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
        # SGLang's scheduler handles update requests one at a time, in the order they came; the load
        # runs off the event loop here, so overlapping updates queue for it (FIFO) and submit their
        # swaps in that order.
        async with self._updates:
            loaded = await asyncio.to_thread(load_model, model_path, weight_version or "")
            reason = incompatibility(self.engine.loaded, loaded)
            if reason:
                raise InvalidArgument(f"incompatible checkpoint: {reason}")
            loop = asyncio.get_running_loop()
            swap = WeightSwap(loaded, weight_version, loop, loop.create_future(), paused=paused,
                              flush_cache=flush_cache)
            try:
                self.engine.submit_swap(swap)
            except FlexmarlError as exc:
                raise Unavailable(str(exc)) from exc
        return await swap.future

    async def _control(self, kind: str, weight_version: str = "") -> None:
        loop = asyncio.get_running_loop()
        control = Control(kind, loop, loop.create_future(), weight_version)
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
        control = Control("call", loop, loop.create_future(), call=call)
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
        call = WeightCall(
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
                # SGLang merges its scheduler's init info (max_total_num_tokens) into /server_info
                "max_total_num_tokens": engine.load_snapshot().max_total_num_tokens,
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
