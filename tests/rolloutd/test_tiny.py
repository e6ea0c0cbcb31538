from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flexmarl.tiny import EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS, build_tiny_checkpoint


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_checkpoint(tmp_path / "a", seed=7)
    after = torch.rand(1)
    b = build_tiny_checkpoint(tmp_path / "b", seed=7)
    c = build_tiny_checkpoint(tmp_path / "c", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)
    assert torch.equal(before, after), "building must not consume the caller's RNG"


def test_reloads_offline_with_expected_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_checkpoint(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 256, 4)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (2, 64, True)
    assert len(tokenizer) == 256 + len(SPECIAL_TOKENS)
    assert config.vocab_size == 320  # 262 rounded up to a multiple of 64
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 1_500_000
    output_embeddings: Any = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    input_embeddings: Any = model.get_input_embeddings()
    assert output_embeddings.weight.data_ptr() == input_embeddings.weight.data_ptr()
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert tokenizer.pad_token_id == config.pad_token_id
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_tokenizer_is_byte_level_with_chat_template(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "héllo wörld\n\t~"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())  # token id == byte value
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == f"{IM_START_TOKEN}user\nhi{IM_END_TOKEN}\n{IM_START_TOKEN}assistant\n"
    chat_ids: Any = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == tokenizer.convert_tokens_to_ids(IM_START_TOKEN)


def test_llama_arch_and_custom_sizes(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(
        tmp_path / "l",
        arch="llama",
        num_layers=1,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 128
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("a b", add_special_tokens=False)["input_ids"] == list(b"a b")


@pytest.mark.parametrize("kwargs", [{"arch": "gpt2"}, {"num_layers": 0}, {"num_heads": 4, "num_kv_heads": 3}])
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        build_tiny_checkpoint(tmp_path / "x", **kwargs)  # type: ignore[arg-type]


def test_untied_checkpoint_has_its_own_output_head(tmp_path: Path) -> None:
    from safetensors import safe_open

    tied = build_tiny_checkpoint(tmp_path / "tied", seed=3)
    untied = build_tiny_checkpoint(tmp_path / "untied", seed=3, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(untied)
    assert model.config.tie_word_embeddings is False
    output_embeddings: Any = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    input_embeddings: Any = model.get_input_embeddings()
    assert output_embeddings.weight.data_ptr() != input_embeddings.weight.data_ptr()
    assert not torch.equal(output_embeddings.weight, input_embeddings.weight)
    with safe_open(str(untied / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" in set(saved.keys())
    with safe_open(str(tied / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" not in set(saved.keys())
    assert _digest(untied) == _digest(build_tiny_checkpoint(tmp_path / "again", seed=3, tie_word_embeddings=False))


def test_tiny_uri_tie_parameter(tmp_path: Path) -> None:
    from flexmarl.cli import tiny_models
    from flexmarl.errors import InvalidArgument

    def plan(uri: str) -> tuple[Path, dict[str, Any]]:
        return tiny_models({"agents": [{"name": "a", "model": uri}]}, tmp_path)[uri]

    directory, kwargs = plan("tiny://qwen2?seed=1&tie=0")
    assert kwargs == {"arch": "qwen2", "seed": 1, "tie_word_embeddings": False}
    assert directory != plan("tiny://qwen2?seed=1")[0] != plan("tiny://qwen2?seed=1&tie=1")[0]
    assert plan("tiny://qwen2?seed=1&tie=1")[1]["tie_word_embeddings"] is True
    with pytest.raises(InvalidArgument, match="tie must be 0 or 1"):
        plan("tiny://qwen2?seed=1&tie=no")
