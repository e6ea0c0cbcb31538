"""A checkpoint as the embedded engine serves it: the model, its tokenizer and what is read once from them.

Loading mirrors what SGLang's model loader (sglang/srt/model_loader/loader.py) and tokenizer
manager read at start for the subset the embedded engine needs: the weights (fp32 on CPU, eval
mode), the tokenizer when the directory has one, the EOS token ids of the model and generation
configs, and the context length (``max_position_embeddings``). A replacement checkpoint
(``/update_weights_from_disk``) must keep the architecture (:func:`incompatibility`), as SGLang's
in-place weight update requires.
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flexmarl.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: transformers' ``from_pretrained`` is not safe in two threads at once: it swaps module globals
#: for the load (``initialization.no_init_weights`` stubs ``torch.nn.init``, ``no_tie_weights`` the
#: tying) and restores what it found, so two overlapping loads can leave the stubs in place for the
#: process. Every later load then leaves ``lm_head`` untied, on the meta device or uninitialised
#: (seen: an engine whose next decode sampled from NaN logits and died, after two
#: ``/update_weights_from_disk`` calls that overlapped). One load at a time per process.
_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class LoadedModel:
    """A fully loaded model and the names reported with every token it produces."""

    model: Any
    tokenizer: Any
    model_path: str
    weight_version: str
    eos_token_ids: frozenset[int]
    max_positions: int
    cache_kwarg: str  # transformers >= 5.2x names the KV cache argument "cache"


def load_model(model_path: str, weight_version: str) -> LoadedModel:
    """Load a causal LM (fp32, eval mode) and, when present, its tokenizer from a checkpoint dir.

    Raises:
        InvalidArgument: The directory does not hold a loadable checkpoint.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{model_path} is not a checkpoint directory (no config.json)")
    with _LOAD_LOCK:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"cannot load {model_path}: {exc}") from exc
        unloaded = [name for name, param in model.named_parameters() if param.is_meta]
        if unloaded:  # not served: a forward pass would fail or sample from garbage
            raise InvalidArgument(f"cannot load {model_path}: parameters {unloaded} were left unloaded")
        model.eval()  # type: ignore[no-untyped-call]
        _own_weights(model)
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
    return LoadedModel(model, tokenizer, str(path), weight_version, frozenset(eos), max_positions, cache_kwarg)


def _own_weights(model: torch.nn.Module) -> None:
    """Copies the parameters out of the checkpoint's memory map into memory the engine owns.

    transformers leaves CPU parameters as copy-on-write views of the mmapped safetensors files;
    SGLang's loader copies the files' tensors into parameters it allocated. Without this copy the
    load skips work the next in-place update then pays (the first write into each page faults and
    copies it: 0.075 s instead of 0.03 s of one thread for 138 MB), and a checkpoint file rewritten
    in place would change pages the engine has not written yet.
    """
    with torch.no_grad():
        for param in model.parameters():  # tied parameters once: the tie is kept
            param.data = param.data.clone()


def incompatibility(current: LoadedModel, new: LoadedModel) -> str:
    """Empty when ``new`` may replace ``current`` in place, else the reason it may not."""
    for name in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        old_value = getattr(current.model.config, name, None)
        new_value = getattr(new.model.config, name, None)
        if old_value != new_value:
            return f"{name} differs: {old_value} != {new_value}"
    return ""

