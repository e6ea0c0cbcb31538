"""Byte-level tokenizer doubles of the rolloutd tests: token id == byte, ids >= 256 decode to nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ContentBytes:
    """A chat renders as its messages' contents joined (no roles, no template)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")


class RoleBytes(ContentBytes):
    """A chat renders as ``role:content|`` per message, then ``assistant:``."""

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode("".join(f"{m['role']}:{m['content']}|" for m in messages) + "assistant:")
