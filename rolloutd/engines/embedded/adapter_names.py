"""The tokenizer manager's half of SGLang's LoRA adapters: names, the requests using them, loads and evictions.

Mirrors sglang/srt/managers/tokenizer_manager.py (``_validate_and_resolve_lora``,
``_release_lora_once``), tokenizer_control_mixin.py (``load_lora_adapter``,
``_unload_lora_adapter_locked``: LRU eviction past ``--max-loaded-loras``, unloads that wait for
the requests using an adapter, implicit reloads of an evicted adapter) and io_struct.py
``_normalize_lora_paths``, over :class:`rolloutd.engines.lora.LoraRegistry`. The backend loads,
validates and applies the adapters (lora_manager.py); :mod:`rolloutd.engines.embedded.server`
serves the routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rolloutd.engines.embedded.interface import EngineBackend
from rolloutd.engines.lora import NOT_ENABLED_MESSAGE, LoraRef, LoraRegistry, LoraUpdate

logger = logging.getLogger(__name__)


class AdapterNames:
    """The adapters a server has loaded by name, and how many requests use each."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.registry = LoraRegistry(backend.lora_settings)

    @property
    def enabled(self) -> bool:
        """Whether the server runs with LoRA (``--enable-lora``)."""
        return self.registry.enabled

    @staticmethod
    def sample_names(lora_path: str | Sequence[str | None] | None, count: int, n: int) -> list[str | None] | None:
        """The adapter name of every sample of ``count`` prompts of ``n`` samples (prompt-major); None: no adapters.

        io_struct.py ``_normalize_lora_paths``: a string names the adapter of every prompt; a list
        names one per prompt (an entry null: the base) and must have one entry per prompt.
        """
        if not lora_path:  # _validate_and_resolve_lora: None, "" or [] run on the base
            return None
        if isinstance(lora_path, str):
            per_prompt: list[str | None] = [lora_path] * count
        else:
            if len(lora_path) != count:
                raise ValueError(f"lora_path list length ({len(lora_path)}) must match batch size ({count})")
            per_prompt = list(lora_path)
        return [name for name in per_prompt for _ in range(n)]

    async def resolve(self, names: list[str | None] | None, samples: int) -> list[str | None]:
        """tokenizer_manager.py ``_validate_and_resolve_lora``: each sample's adapter id, counted as in use.

        An adapter that was loaded once and unloaded since is loaded again from its path (SGLang's
        "Reloading evicted adapter"); a name never loaded is an error.

        Raises:
            ValueError: LoRA off, too many adapters, an unknown name, or a failed implicit reload.
        """
        if names is None:
            return [None] * samples
        registry = self.registry
        registry.check_request(names)
        for name in registry.unregistered(dict.fromkeys(names)):
            if name is None:
                continue
            ref = registry.ref_cache.get(name)
            if ref is None:
                raise registry.never_loaded(name)
            logger.info("Reloading evicted adapter: %s", name)
            result = await self.load(ref.lora_name, ref.lora_path, ref.pinned)
            if not result.success and "already loaded" not in (result.error_message or ""):
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {result.error_message}")
        return registry.acquire(names)

    def releaser(self, lora_id: str | None) -> Callable[[asyncio.Future[dict[str, Any]]], None]:
        """A done-callback that releases a finished sample's adapter (``_release_lora_once``)."""

        def release(_: asyncio.Future[dict[str, Any]]) -> None:
            self.registry.release(lora_id)

        return release

    def release_unsubmitted(self, lora_ids: Sequence[str | None], submitted: int) -> None:
        """Release the adapters of the samples from ``submitted`` on (never submitted: no done-callback)."""
        for lora_id in lora_ids[submitted:]:
            self.registry.release(lora_id)

    async def load(self, lora_name: str, lora_path: str, pinned: bool) -> LoraUpdate:
        """tokenizer_control_mixin.py ``load_lora_adapter``: load, register, then evict LRU adapters past the cap."""
        registry = self.registry
        if not registry.enabled:
            return LoraUpdate(False, NOT_ENABLED_MESSAGE)
        try:
            async with registry.lock:
                if lora_name in registry.pending_unloads:
                    raise ValueError(
                        f"LoRA adapter '{lora_name}' has an incomplete unload. "
                        "Retry the unload before loading it again."
                    )
                ref = LoraRef.new(lora_name, lora_path, pinned)
                result = await self.backend.load_lora_adapter(ref)
                if result.success:
                    registry.register(ref)
                limit = registry.settings.max_loaded_loras
                loaded = dict(result.loaded_adapters or {})
                while limit is not None and len(registry.adapters()) > limit:
                    lru = registry.lru_name(exclude_pinned=True)
                    if lru is None:
                        raise ValueError(
                            "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                            f"LoRA registry is: {registry.adapters()}"
                        )
                    logger.info("Unloading least recently used LoRA adapter '%s'", lru)
                    unloaded = await self._unload_locked(lru)
                    if not unloaded.success:
                        raise ValueError(f"Error while unloading LRU LoRA adapter '{lru}': {unloaded.error_message}")
                    loaded.pop(lru, None)
                return dataclasses.replace(result, loaded_adapters=None if result.loaded_adapters is None else loaded)
        except ValueError as exc:
            return LoraUpdate(False, str(exc))

    async def _unload_locked(self, lora_name: str) -> LoraUpdate:
        """``_unload_lora_adapter_locked``: unregister, wait until no request uses it, then unload."""
        registry = self.registry
        lora_id = registry.pending_unloads.get(lora_name)
        if lora_id is None:
            lora_id = registry.unregister(lora_name)
            registry.pending_unloads[lora_name] = lora_id
        await registry.wait_for_unload(lora_id)
        result = await self.backend.unload_lora_adapter(LoraRef(lora_id, lora_name, ""))
        if result.success:
            registry.pending_unloads.pop(lora_name, None)
        return result

    async def unload(self, lora_name: str) -> LoraUpdate:
        """tokenizer_control_mixin.py ``unload_lora_adapter``: waits for the requests using it."""
        if not self.registry.enabled:
            return LoraUpdate(False, NOT_ENABLED_MESSAGE)
        try:
            async with self.registry.lock:
                return await self._unload_locked(lora_name)
        except ValueError as exc:
            return LoraUpdate(False, str(exc))
