"""LoRA agents: a PEFT adapter trained over a frozen base that several agents of one slot share.

An agent with ``lora`` (``AgentSpec.lora``) trains only its adapter:

* :class:`LoraBaseCache` keeps one slot's frozen base model in memory across the LoRA agents
  that take turns on the slot. :func:`attach_adapter` injects an agent's adapter into it
  (``peft.get_peft_model``; base parameters ``requires_grad=False``) and :func:`detach_adapter`
  takes the adapter out again (PEFT's ``unload()`` without merging): the base modules come back
  as they were, bit for bit, for the next agent. Only the adapter and its optimizer state are
  built, saved, moved and loaded when the slot switches agents.
* The adapter's initial values (A: Kaiming-uniform, B: zero, so v0 equals the base) are drawn
  from a generator seeded by the agent's name (:func:`adapter_init_seed`): every build of
  version 0 is the same, on any slot.
* The training state holds the adapter alone: a ``state_dict`` hook (:func:`attach_adapter`)
  leaves the frozen base out of what DeepSpeed checkpoints (its own ``exclude_frozen_parameters``
  misses a tied ``lm_head``), and a ``load_state_dict`` hook fails a state whose adapter keys do
  not match instead of loading nothing.
* Publication writes ``PeftModel.save_pretrained``'s directory: ``adapter_config.json`` and
  ``adapter_model.safetensors``, which ``PeftModel.from_pretrained`` loads over the base.
* The KL reference is the base itself: the adapter disabled (:func:`adapter_disabled`), no copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import zlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from flexmarl.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from flexmarl.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:  # peft is imported where an adapter is built: a trainer of full models never pays for it
    from peft import LoraConfig, PeftModel

logger = logging.getLogger(__name__)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraBaseCache", "LoraSettings", "adapter_disabled",
           "adapter_init_seed", "adapter_state_dict", "attach_adapter", "detach_adapter", "optimizer_state_bytes",
           "trainable_bytes"]


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """One agent's adapter shape and training (``AgentSpec.lora``).

    Attributes:
        rank: LoRA rank r.
        alpha: scaling numerator (update = alpha / r * B A).
        dropout: dropout on the adapter's input while training.
        target_modules: names (or suffixes) of the base's modules that get an adapter.
    """

    rank: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha < 1 or not 0.0 <= self.dropout < 1.0 or not self.target_modules:
            raise InvalidArgument(f"bad LoRA settings {self}")

    def peft_config(self) -> LoraConfig:
        """PEFT's config of this adapter (bias untouched, no other module trained)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none")


def adapter_init_seed(agent: str) -> int:
    """The seed of an agent's initial adapter: the same on every slot and run, different per agent."""
    return zlib.crc32(f"flexmarl-lora/{agent}".encode())


class LoraBaseCache:
    """The frozen base model of one trainer slot, kept while LoRA agents take turns on the slot.

    Holds at most one base (by checkpoint dir and dtype); asking for another drops it. Lent to one
    trainer at a time. Not thread-safe (a slot runs one call at a time).
    """

    def __init__(self) -> None:
        self._key: tuple[str, torch.dtype] | None = None
        self._model: PreTrainedModel | None = None
        self._lent = False
        #: How many times a base was read from its checkpoint dir (for tests and logs).
        self.loads = 0

    @property
    def key(self) -> tuple[str, torch.dtype] | None:
        """(checkpoint dir, dtype) of the base held, None when empty."""
        return self._key if self._model is not None else None

    def acquire(self, model_path: str, dtype: torch.dtype) -> PreTrainedModel:
        """The base of ``model_path`` in ``dtype``, frozen, loaded unless already held; lent until :meth:`give_back`.

        Raises:
            FailedPrecondition: the base is lent to another trainer.
        """
        if self._lent:
            raise FailedPrecondition(f"the slot's base {self._key} is in use by another LoRA agent")
        if self._model is None or self._key != (model_path, dtype):
            self.clear()
            model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
            model.config.use_cache = False
            model.requires_grad_(False)
            self._model, self._key = model, (model_path, dtype)
            self.loads += 1
            logger.info("LoRA base %s (%s) loaded", model_path, dtype)
        self._lent = True
        return self._model

    def give_back(self, model: PreTrainedModel) -> None:
        """Takes the base back (its adapter detached) for the next LoRA agent of the slot."""
        if model is not self._model:
            raise FailedPrecondition("giving back a model this cache did not lend")
        self._lent = False

    def clear(self) -> None:
        """Drops the base (the slot's memory goes back); a lent base stays with its trainer."""
        self._model, self._key, self._lent = None, None, False


def _keep_trainable_only(module: torch.nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    """``state_dict`` post-hook: only the trainable (adapter) tensors, never the frozen base or its tied weights."""
    trainable = {prefix + name for name, p in module.named_parameters() if p.requires_grad}
    for key in [k for k in state if k.startswith(prefix) and k not in trainable]:
        del state[key]


def _check_adapter_loaded(module: torch.nn.Module, incompatible: Any) -> None:
    """``load_state_dict`` post-hook: a non-strict load must still have set every adapter tensor and nothing else."""
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(k for k in incompatible.missing_keys if k in trainable)
    unexpected = sorted(incompatible.unexpected_keys)
    if missing or unexpected:
        raise FailedPrecondition(f"not this agent's adapter state: missing {missing[:3]}, unexpected {unexpected[:3]}")
    incompatible.missing_keys.clear()  # the frozen base is not in an adapter state, by design


def attach_adapter(base: PreTrainedModel, settings: LoraSettings, agent: str) -> PeftModel:
    """Injects the agent's freshly initialised adapter into ``base`` (in place); only the adapter trains.

    Raises:
        InvalidArgument: a target module is not in the base (PEFT's reason).
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(adapter_init_seed(agent))
        try:
            model = get_peft_model(base, settings.peft_config())
        except ValueError as exc:
            raise InvalidArgument(f"agent {agent}: lora.target_modules: {exc}") from None
    for name, param in model.named_parameters():
        if param.requires_grad != ("lora_" in name):
            raise FailedPrecondition(f"agent {agent}: unexpected trainable state of {name}")
    model.register_state_dict_post_hook(_keep_trainable_only)  # type: ignore[no-untyped-call]
    model.register_load_state_dict_post_hook(_check_adapter_loaded)  # type: ignore[no-untyped-call]
    return model


def detach_adapter(model: PeftModel) -> PreTrainedModel:
    """Takes the adapter out (no merge): the base modules are back, bit for bit, with no hook left."""
    base: PreTrainedModel = model.unload()
    return base


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base's forward (the KL reference): the adapter is switched off inside the block."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise FailedPrecondition(f"{type(model).__name__} has no adapter to disable")
    with model.disable_adapter():
        yield


def adapter_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter tensors as PEFT saves them (names without the adapter name), on CPU."""
    from peft import get_peft_model_state_dict

    state: Mapping[str, torch.Tensor] = get_peft_model_state_dict(model)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def trainable_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that train."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state tensors (Adam's moments)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
