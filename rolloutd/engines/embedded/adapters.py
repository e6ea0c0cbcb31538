"""The LoRA adapters an embedded engine holds: loading, validation and the per-row deltas of its passes.

Mirrors sglang/srt/lora/lora_manager.py (``init_state``, ``load_lora_adapter``,
``unload_lora_adapter``) for SGLang's LoRA flags (``--enable-lora``, ``--max-lora-rank``,
``--lora-target-modules``, ``--lora-paths``, ``--max-loras-per-batch``): adapters load and
unload on the engine's worker thread between iterations; every forward pass (prefill, decode,
the in-place rerun of a weight change, the deterministic rescoring) adds each row's own adapter
delta in the target ``Linear`` modules (:class:`rolloutd.engines.lora.LoraLayers`), so one batch
mixes adapters and the base. The tokenizer manager's half (names, eviction) is the server's
(:mod:`rolloutd.engines.embedded.server`); the admission limit is
:func:`rolloutd.engines.embedded.admission.admitted_indices`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from flexmarl import devicemodel
from flexmarl.errors import InvalidArgument
from rolloutd.engines import lora
from rolloutd.engines.lora import AdapterPool, LoraLayers, LoraRef, LoraSettings, LoraUpdate

logger = logging.getLogger(__name__)


class EngineAdapters:
    """The adapter pool and per-row deltas of one engine (worker thread only once the engine started).

    With a device model, loading an adapter takes the modelled time of moving its share of the
    modelled model over the host link (traced as ``lora_load``).
    """

    def __init__(
        self, device: devicemodel.DeviceProfile | None = None, trace: devicemodel.TraceWriter | None = None
    ) -> None:
        self.pool: AdapterPool | None = None
        self.layers: LoraLayers | None = None
        self._device = device
        self._trace = trace

    def init(self, settings: LoraSettings, model: Any) -> None:
        """lora_manager.py ``init_state``: resolve targets and max rank, then load the ``--lora-paths`` adapters.

        Raises:
            InvalidArgument: A ``--lora-paths`` adapter cannot be loaded (SGLang does not start).
        """
        settings.check()
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
        self.pool = AdapterPool(settings, targets, max_rank)
        self.layers = LoraLayers(max_rank)
        for ref in refs:
            result = self.load(ref, model)
            if not result.success:
                raise InvalidArgument(f"Failed to load LoRA adapter {ref.lora_name}: {result.error_message}")

    def load(self, ref: LoraRef, model: Any) -> LoraUpdate:
        """lora_manager.py ``load_lora_adapter``: read the config, validate, read the weights for ``model``."""
        pool, layers = self.pool, self.layers
        if pool is None or layers is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        try:
            config = lora.read_adapter_config(ref.lora_path, int(model.config.vocab_size))
            pool.validate_new(config, ref)
            weights = lora.load_adapter_weights(ref.lora_path, config, model, pool.max_rank)
        except (ValueError, OSError) as exc:
            return pool.result(False, str(exc))
        if self._device is not None:  # modelled: the adapter's share of the modelled model, over the link
            device = self._device
            started_s, pacer = time.time(), devicemodel.Pacer(device)
            real_params = sum(int(p.numel()) for p in model.parameters())
            params = lora.adapter_num_params(ref.lora_path) * device.model_params / max(real_params, 1)
            pacer.add(lora.adapter_transfer_s(device.link_bytes_per_s, int(params), device.bytes_per_param))
            pacer.wait()
            if self._trace is not None:
                self._trace.record("lora_load", started_s, time.time(), pacer.modelled_s)
        pool.add(ref, config)
        layers.adapters[ref.lora_id] = weights
        logger.info("LoRA adapter loaded: %s (rank %d, %d modules)", ref.lora_name, config.r, len(weights.modules))
        return pool.result(True)

    def unload(self, ref: LoraRef) -> LoraUpdate:
        """lora_manager.py ``unload_lora_adapter`` (no running row uses it)."""
        pool, layers = self.pool, self.layers
        if pool is None or layers is None:
            return LoraUpdate(False, lora.NOT_ENABLED_MESSAGE)
        pool.remove(ref.lora_id)
        layers.adapters.pop(ref.lora_id, None)
        return pool.result(True)

    def rows(self, model: Any, lora_ids: Sequence[str | None]) -> contextlib.AbstractContextManager[None]:
        """The forward passes of ``model`` in the block add each row's adapter delta."""
        if self.layers is None:
            return contextlib.nullcontext()
        return self.layers.rows(model, lora_ids)
