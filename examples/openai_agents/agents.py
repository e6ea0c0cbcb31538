"""A three-agent relay game written only against the ``openai`` package (no FlexMARL import).

This is what a researcher's existing program looks like: it gets a base URL, an API key and a
task, talks to three "models" through ``openai.AsyncOpenAI`` and returns each agent's reward.
FlexMARL runs it unmodified through ``rolloutd.external_env:ExternalAgents`` (see job.yaml):
every call becomes one training turn of the agent named by ``model``.

The game (a three-party signaling game, chance 1/2): the ``sender`` sees the target object
(``a`` or ``b``) and writes a one-token message; the ``relay`` sees only that message and
writes one token; the ``receiver`` sees only the relay's token and answers with one token,
read as a position by the parity of its first byte (``"0"`` names position 0, ``"1"`` position
1, like examples/signaling). All three get 1.0 when the receiver names the target, else 0.0.

Two versions of the same game: :func:`run_raw` (``/v1/completions``, raw prompts that end with
the byte that matters; what job.yaml trains) and :func:`run` (``/v1/chat/completions`` under the
chat template). Both build one HTTP connection pool per event loop and share it between
episodes: an ``AsyncOpenAI`` with a pool of its own builds an SSL context, ~0.1 s of CPU (more
than half of a CPU step's wall time when every episode paid it).
"""

from __future__ import annotations

import asyncio
import random
import weakref
from typing import Any

import openai
from openai import AsyncOpenAI

OBJECTS = "ab"
#: Seconds a call may take (the client's default connect timeout, 5 s, is short for a busy CPU box).
CALL_TIMEOUT_S = 120.0

_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, openai.DefaultAsyncHttpxClient] = (
    weakref.WeakKeyDictionary())


def client(base_url: str, api_key: str) -> AsyncOpenAI:
    """An episode's client over the event loop's shared connection pool (not closed per episode)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = openai.DefaultAsyncHttpxClient(timeout=CALL_TIMEOUT_S)
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=CALL_TIMEOUT_S, http_client=pool)


def make_task(index: int, seed: int) -> dict[str, Any]:
    """The target position of task ``index`` (deterministic per index and seed)."""
    return {"target": random.Random(f"openai-agents/{seed}/{index}").randrange(len(OBJECTS))}


def position_of(answer: str) -> int:
    """The position an answer names: the parity of its first UTF-8 byte (-1 for an empty answer)."""
    raw = answer.encode()
    return raw[0] % len(OBJECTS) if raw else -1


def rewards(answer: str, target: int) -> dict[str, float]:
    """The shared 0/1 reward of an episode."""
    reward = 1.0 if position_of(answer) == target else 0.0
    return {"sender": reward, "relay": reward, "receiver": reward}


async def run(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    """Plays one episode with chat completions; returns each agent's reward."""
    target = int(task["data"]["target"])
    agents = client(base_url, api_key)
    sent = await agents.chat.completions.create(
        model="sender", max_tokens=1,
        messages=[{"role": "system", "content": "S"}, {"role": "user", "content": OBJECTS[target]}])
    relayed = await agents.chat.completions.create(
        model="relay", max_tokens=1,
        messages=[{"role": "system", "content": "R"},
                  {"role": "user", "content": sent.choices[0].message.content or ""}])
    answer = await agents.chat.completions.create(
        model="receiver", max_tokens=1,
        messages=[{"role": "system", "content": "A"},
                  {"role": "user", "content": relayed.choices[0].message.content or ""}])
    return rewards(answer.choices[0].message.content or "", target)


async def run_raw(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    """The same game on raw prompts (``/v1/completions``, no chat template) that end with the byte that matters.

    A tiny random-init model conditions on its last prompt byte far more easily than on a byte
    inside a chat template, whose prompts all end with the same ``<|im_start|>assistant\\n``
    (as in examples/signaling); this variant is the one to use for learning on CPU.
    """
    target = int(task["data"]["target"])
    agents = client(base_url, api_key)
    sent = await agents.completions.create(model="sender", prompt=OBJECTS[target], max_tokens=1)
    relayed = await agents.completions.create(model="relay", prompt=">" + sent.choices[0].text, max_tokens=1)
    answer = await agents.completions.create(model="receiver", prompt="<" + relayed.choices[0].text, max_tokens=1)
    return rewards(answer.choices[0].text, target)
