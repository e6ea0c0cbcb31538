"""Tiny random-init Hugging Face checkpoints, built in code (no hub downloads).

CI and development machines have no GPU and no model hub access (DESIGN.md §11), so every
test, example and benchmark that needs a causal LM builds one here: a byte-level tokenizer
(256 byte symbols, no merges, a few special tokens and a chat template) and a small Qwen2 or
Llama model with random weights, both saved as an ordinary checkpoint directory that
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` reload offline.

The same seed always gives the same weights (bit for bit) and the same tokenizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

logger = logging.getLogger(__name__)

BOS_TOKEN: Final = "<|bos|>"
EOS_TOKEN: Final = "<|eos|>"
PAD_TOKEN: Final = "<|pad|>"
IM_START_TOKEN: Final = "<|im_start|>"
IM_END_TOKEN: Final = "<|im_end|>"
# Never produced by byte-level encoding; set so that model-specific tokenizer classes (which
# transformers picks from config.json's model_type) do not add a default unk token of their own.
UNK_TOKEN: Final = "<|unk|>"
SPECIAL_TOKENS: Final = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)

# ChatML-like: every message is "<|im_start|>role\ncontent<|im_end|>\n"; the generation prompt
# opens an assistant turn, so a model that answers and then emits <|im_end|> ends its turn.
CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SUPPORTED_ARCHS: Final = ("qwen2", "llama")


def _byte_symbols() -> list[str]:
    """The printable stand-in character of every byte 0..255, as ByteLevel pre-tokenizers use.

    Printable Latin-1 bytes stand for themselves; the others are shifted to U+0100 onwards in
    byte order (the GPT-2 byte-to-unicode convention), so token id == byte value here.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turns transformers' progress bars ("Writing model shards") on or off for the block, then restores them."""
    from transformers.utils import logging as hf_logging

    def turn(on: bool) -> None:
        (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()  # type: ignore[no-untyped-call]

    was_enabled = hf_logging.is_progress_bar_enabled()
    turn(enabled)
    try:
        yield
    finally:
        turn(was_enabled)


def _round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def build_tiny_tokenizer(path: Path) -> int:
    """Write a byte-level tokenizer to ``path`` and return its size (bytes + special tokens).

    Token id b (0..255) is byte b; the special tokens follow in the order of
    :data:`SPECIAL_TOKENS`. Any UTF-8 text round-trips.

    Args:
        path: Directory to write ``tokenizer.json`` and its config files into (created).

    Returns:
        The number of tokens, i.e. 256 + len(SPECIAL_TOKENS).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    if set(symbols) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("byte symbols disagree with tokenizers' ByteLevel alphabet")
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return len(fast)


def build_tiny_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    arch: str = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    max_position_embeddings: int = 2048,
    vocab_multiple: int = 64,
    tie_word_embeddings: bool = True,
    progress: bool = False,
) -> Path:
    """Build a tiny random-init causal LM checkpoint directory (tokenizer + config + safetensors).

    The defaults (2 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, tied embeddings) give
    about 1.3 M parameters (~5 MB in fp32); untied, the output head adds vocab x hidden (82 K).
    Weights are drawn from a generator seeded with
    ``seed`` inside a forked RNG state, so the caller's global torch RNG is left untouched.

    Args:
        path: Directory to write (created; existing files with the same names are overwritten).
        seed: Seed of the weight initialisation; equal seeds give bit-identical weights.
        arch: ``"qwen2"`` or ``"llama"``.
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        head_dim: Width of one attention head.
        intermediate_size: MLP width.
        max_position_embeddings: Longest sequence the rotary embedding is configured for.
        vocab_multiple: The embedding table is the tokenizer size rounded up to this multiple.
        tie_word_embeddings: Share the input embedding with the output head (the default). Untied,
            the head is a weight of its own (``lm_head.weight``); vLLM on CPU reloads only such a
            head (docs/engines.md), so vLLM jobs use untied models (``tiny://qwen2?seed=N&tie=0``).
        progress: Show transformers' progress bars while saving (on stderr); quiet by default.

    Returns:
        ``path``, for chaining.

    Raises:
        ValueError: On an unknown ``arch`` or non-positive sizes.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    sizes = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_multiple": vocab_multiple,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")

    path = Path(path)
    tokenizer_size = build_tiny_tokenizer(path)
    special_ids = {token: 256 + index for index, token in enumerate(SPECIAL_TOKENS)}
    common = {
        "vocab_size": _round_up(tokenizer_size, vocab_multiple),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
    }
    config_cls: Any = Qwen2Config if arch == "qwen2" else LlamaConfig
    config: PretrainedConfig = config_cls(**common)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.generation_config.bos_token_id = special_ids[BOS_TOKEN]
    model.generation_config.eos_token_id = [special_ids[EOS_TOKEN], special_ids[IM_END_TOKEN]]
    model.generation_config.pad_token_id = special_ids[PAD_TOKEN]
    with _progress_bars(progress):
        model.save_pretrained(str(path), safe_serialization=True)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny %s checkpoint at %s (%d params, seed %d)", arch, path, num_params, seed)
    return path
