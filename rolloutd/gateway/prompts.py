"""Token-in / token-out for chat calls: which recorded token ids a call's messages repeat.

A chat call is rendered with the agent's chat template and tokenized once. When its messages
repeat an earlier turn of the same agent in the session (the same messages, then an assistant
message whose content is exactly the text that turn returned), the recorded token ids of that
turn (its prompt and its sampled response) are reused and only the new messages come from the
template, so training sees exactly what was sampled rather than a re-tokenization of the text
(:func:`resolve_chat_prompt`). Tool calls render as SGLang renders them for templates
(srt/entrypoints/openai/serving_chat.py ``normalize_assistant_tool_call_arguments``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.episode import EpisodeContext


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A function call of an assistant message: its id, the function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str

    def same_call(self, other: ToolCall) -> bool:
        """The same function with equal arguments (ids and JSON spacing aside): how a returned call is recognised."""
        return self.name == other.name and _json_or_text(self.arguments) == _json_or_text(other.arguments)

    def to_api(self) -> dict[str, Any]:
        """The call as the API returns it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class Message:
    """A chat message as the template sees it (text content; an assistant's tool calls; a tool result's call id)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message for ``apply_chat_template``: tool-call arguments parsed into a mapping, as HF templates expect.

        (SGLang's ``normalize_assistant_tool_call_arguments``, srt/entrypoints/openai/serving_chat.py.)
        """
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """A chat call of one agent, as later calls may repeat it."""

    messages: tuple[Message, ...]
    #: The messages rendered and tokenized from their text (what a later call's render starts with).
    fresh_prompt_ids: tuple[int, ...]
    #: What was sent (reused ids included) and what was sampled.
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    #: The sampled ids decoded.
    text: str
    #: What the program got back: the content (the text before the first tool call when calls were parsed out
    #: of the text, else the text) and the parsed calls.
    content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def answered_by(self, message: Message) -> bool:
        """Whether ``message`` is this turn's answer as the program got it (a call matches on name and arguments)."""
        if message.role != "assistant" or message.content != self.content:
            return False
        if len(message.tool_calls) != len(self.tool_calls):
            return False
        return all(a.same_call(b) for a, b in zip(message.tool_calls, self.tool_calls, strict=True))


@dataclasses.dataclass(frozen=True)
class ResolvedPrompt:
    """The token ids a chat call is sent with, and how they were obtained."""

    input_ids: tuple[int, ...]
    fresh_ids: tuple[int, ...]
    #: Leading ids taken from an earlier turn (its prompt and sampled response).
    reused_tokens: int
    #: Assistant messages matched to no earlier turn (re-tokenized from their text).
    retokenized_messages: int


def _as_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [message.to_template() for message in messages]


def resolve_chat_prompt(ctx: EpisodeContext, agent: str, messages: Sequence[Message],
                        history: Sequence[ChatTurn], tools: Sequence[Mapping[str, Any]] | None = None,
                        ) -> ResolvedPrompt:
    r"""The prompt ids of a chat call, reusing the recorded ids of the longest earlier turn it repeats.

    A turn T is repeated when ``messages`` starts with T's messages followed by T's answer
    (:meth:`ChatTurn.answered_by`: the content the program got back, and the same tool calls).
    The call's fresh render must then start with T's fresh render, followed by the sampled
    text's own tokens (templates that rewrite earlier turns fail this and fall back to the fresh
    render). The ids sent are T's prompt ids, T's sampled ids, then the rest of the fresh
    render; a trailing sampled token the template also writes (an end-of-turn token such as
    ``<|im_end|>``) is not repeated.

    When T's answer carried tool calls (or its content is not the whole sampled text, the
    calls having been parsed out of it), the template renders them its own way (Qwen's
    ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``, not the sampled spacing),
    so the rest is taken from a render in which T's answer is the sampled text itself, and it
    is used only when the true render ends with that same rest (the later messages render
    alike either way); otherwise the answer counts as re-tokenized. ``tools`` go to the
    template with the messages (a turn rendered with other tools then rarely repeats: its
    render is no prefix of this one).
    """
    fresh = tuple(ctx.tokenize(agent, _as_dicts(messages), tools=tools))
    assistants = sum(1 for m in messages if m.role == "assistant")
    for turn in sorted(history, key=lambda t: len(t.messages), reverse=True):
        n = len(turn.messages)
        if len(messages) <= n or tuple(messages[:n]) != turn.messages or not turn.answered_by(messages[n]):
            continue
        rewritten = bool(turn.tool_calls) or turn.content != turn.text
        if rewritten:
            as_sampled = [*messages[:n], Message("assistant", turn.text), *messages[n + 1:]]
            render = tuple(ctx.tokenize(agent, _as_dicts(as_sampled), tools=tools))
        else:
            render = fresh
        spliced = _splice(ctx, agent, render, turn)
        if spliced is None:
            continue
        reused = len(turn.prompt_ids) + len(turn.response_ids)
        if rewritten and fresh[len(fresh) - (len(spliced) - reused):] != spliced[reused:]:
            continue
        covered = sum(1 for m in messages[: n + 1] if m.role == "assistant")
        return ResolvedPrompt(spliced, fresh, reused, assistants - covered)
    return ResolvedPrompt(fresh, fresh, 0, assistants)


def _splice(ctx: EpisodeContext, agent: str, fresh: tuple[int, ...], turn: ChatTurn) -> tuple[int, ...] | None:
    head = turn.fresh_prompt_ids
    if fresh[: len(head)] != head:
        return None
    rest = fresh[len(head):]
    content_ids = tuple(ctx.tokenize(agent, turn.text)) if turn.text else ()
    if rest[: len(content_ids)] != content_ids:
        return None
    tail = rest[len(content_ids):]
    sampled = turn.response_ids
    overlap = 0
    for k in range(min(len(sampled), len(tail)), 0, -1):
        # Only tokens that decode to nothing (special tokens) may be shared by the sample and the template.
        if sampled[-k:] == tail[:k] and ctx.decode(agent, sampled[:-k]) == turn.text:
            overlap = k
            break
    return turn.prompt_ids + sampled + tail[overlap:]
