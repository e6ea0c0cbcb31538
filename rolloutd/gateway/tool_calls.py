"""Tool calls parsed out of a sampled text, as SGLang's ``--tool-call-parser`` detectors parse them.

SGLang parses tool calls out of the generated text with the detector its server was started
with (``--tool-call-parser``; srt/function_call/function_call_parser.py); here the job chooses
one per agent (``tool_call_parser``). Both detectors below follow SGLang's one-shot
``detect_and_parse`` and ``BaseFormatDetector.parse_base_json``: the content is the text before
the first call marker (stripped), a call naming no declared tool is dropped, its arguments are
the JSON of ``parameters`` or ``arguments``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParsedToolCalls:
    """What a tool-call parser found in a sampled text: the normal text and the calls (name, JSON arguments)."""

    normal_text: str
    calls: tuple[tuple[str, str], ...]


ToolCallParser = Callable[[str, Sequence[Mapping[str, Any]]], ParsedToolCalls]


def _calls_of(action: Any, tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """SGLang's ``parse_base_json``: one call per object naming a declared tool."""
    names = {tool["function"]["name"] for tool in tools}
    calls = []
    for act in action if isinstance(action, list) else [action]:
        if not isinstance(act, Mapping):
            raise ValueError(f"a tool call must be a JSON object, got {type(act).__name__}")
        name = act.get("name")
        if not (name and name in names):
            logger.warning("model attempted to call undefined function: %s", name)
            continue
        calls.append((str(name), json.dumps(act.get("parameters") or act.get("arguments", {}), ensure_ascii=False)))
    return calls


def parse_qwen25(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedToolCalls:
    r"""``<tool_call>\n{json}\n</tool_call>`` blocks (SGLang srt/function_call/qwen25_detector.py, Qwen25Detector)."""
    bot, eot = "<tool_call>\n", "\n</tool_call>"
    index = text.find(bot)
    if index == -1:
        return ParsedToolCalls(text, ())
    calls: list[tuple[str, str]] = []
    for block in re.findall(rf"{re.escape(bot)}(.*?){re.escape(eot)}", text, re.DOTALL):
        try:
            calls += _calls_of(json.loads(block.strip()), tools)
        except ValueError as exc:  # a malformed block is skipped, as SGLang does
            logger.warning("failed to parse tool call %r: %s", block, exc)
    return ParsedToolCalls(text[:index].strip(), tuple(calls))


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]]) -> ParsedToolCalls:
    """``<tool_call>{json}</tool_call>`` (an unclosed last one too; SGLang srt/function_call/hermes_detector.py)."""
    index = text.find("<tool_call>")
    if index == -1:
        return ParsedToolCalls(text, ())
    calls: list[tuple[str, str]] = []
    try:
        for closed, unclosed in re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL):
            raw = closed or unclosed
            if raw:
                calls += _calls_of(json.loads(raw.strip()), tools)
    except ValueError as exc:  # any failure: the whole text is the content, as in SGLang
        logger.warning("failed to parse tool calls: %s", exc)
        return ParsedToolCalls(text, ())
    return ParsedToolCalls(text[:index].strip(), tuple(calls))


TOOL_CALL_PARSERS: Mapping[str, ToolCallParser] = {
    "qwen25": parse_qwen25, "qwen": parse_qwen25, "hermes": parse_hermes,
}
"""The tool-call parsers by SGLang's ``--tool-call-parser`` names."""
