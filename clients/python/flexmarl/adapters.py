"""LoRA adapter directories as traind publishes them, and merging one into its base.

A LoRA agent's version (``AgentSpec.lora``) is a PEFT adapter directory, exactly what
``PeftModel.save_pretrained`` writes: ``adapter_config.json`` and
``adapter_model.safetensors``. :func:`merge_adapter` folds it into its base (PEFT's
``merge_and_unload``) and writes an ordinary Hugging Face checkpoint that
``AutoModelForCausalLM.from_pretrained`` loads; ``flexmarl export --merge`` calls it.
Needs the ``train`` extra (peft, transformers).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flexmarl.errors import FailedPrecondition, InvalidArgument

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
_WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json")


def is_adapter_dir(path: Path) -> bool:
    """Whether ``path`` holds a PEFT adapter (rather than a whole model)."""
    return (path / ADAPTER_CONFIG).is_file()


def merge_adapter(adapter_dir: Path, base_dir: Path, out_dir: Path) -> Path:
    """Writes ``base_dir`` with the adapter of ``adapter_dir`` merged in, as a HF checkpoint dir (tokenizer copied).

    The base loads in the dtype its config names; ``out_dir`` must not exist, and appears whole
    (written beside it, then renamed).

    Raises:
        InvalidArgument: ``adapter_dir`` is no adapter dir, or ``out_dir`` exists.
        FailedPrecondition: peft is not installed here.
    """
    if not is_adapter_dir(adapter_dir):
        raise InvalidArgument(f"{adapter_dir}: not a LoRA adapter directory (no {ADAPTER_CONFIG})")
    if out_dir.exists():
        raise InvalidArgument(f"{out_dir}: already exists")
    try:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise FailedPrecondition(f"merging an adapter needs peft and transformers (the train extra): {exc}") from None
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    staging = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    merged.save_pretrained(staging)
    for path in base_dir.iterdir():
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES and path.name not in _WEIGHT_INDEX_NAMES:
            if not (staging / path.name).exists():
                shutil.copy2(path, staging / path.name)
    os.replace(staging, out_dir)
    return out_dir
