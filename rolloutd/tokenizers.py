"""The tokenizers rolloutd loads for a job's agents: Hugging Face tokenizers from the model paths.

They implement the SDK's :class:`flexmarl.episode.AgentTokenizer`, the one thing an episode
needs from a tokenizer; loading them (and importing ``transformers``) is rolloutd's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.episode import AgentTokenizer, ChatMessage
from flexmarl.errors import InvalidArgument


class HFTokenizer:
    """An :class:`AgentTokenizer` over a local Hugging Face tokenizer (loaded offline)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a tokenizer is loaded

        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.path = path

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None,
                    ) -> list[int]:
        """Token ids of messages under the chat template, with the generation prompt.

        Raises:
            InvalidArgument: ``tools`` given and the chat template never mentions ``tools``, or a
                message carries ``tool_calls`` and it never mentions ``tool_calls`` (it would
                silently drop them; the tiny byte-level tokenizer's ChatML template is one).
        """
        template = self._tokenizer.chat_template
        texts = template.values() if isinstance(template, Mapping) else [template]
        if any(m.get("tool_calls") for m in messages) and not any(isinstance(t, str) and "tool_calls" in t
                                                                  for t in texts):
            raise InvalidArgument(f"the chat template of the tokenizer at {self.path!r} does not render tool_calls")
        if tools:
            if not any(isinstance(t, str) and "tools" in t for t in texts):
                raise InvalidArgument(f"the chat template of the tokenizer at {self.path!r} does not render tools")
            text = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=[dict(t) for t in tools], tokenize=False,
                add_generation_prompt=True,
            )
        else:
            text = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
            )
        if not isinstance(text, str):
            raise InvalidArgument(f"tokenizer at {self.path!r}: chat template did not render text")
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizers(model_paths: Mapping[str, str]) -> dict[str, AgentTokenizer]:
    """One tokenizer per agent, loaded once per distinct model path."""
    by_path: dict[str, AgentTokenizer] = {}
    result: dict[str, AgentTokenizer] = {}
    for agent, path in model_paths.items():
        if path not in by_path:
            by_path[path] = HFTokenizer(path)
        result[agent] = by_path[path]
    return result
