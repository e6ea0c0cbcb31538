"""A three-agent telephone game written only against the ``openai`` package (no FlexMARL import).

This is what a researcher's existing program looks like: it gets a base URL, an API key and a
task, talks to three "models" through ``openai.AsyncOpenAI`` and returns each agent's reward.
FlexMARL runs it unmodified through ``rolloutd.external_env:ExternalAgents`` (see job.yaml):
every call becomes one training turn of the agent named by ``model``.

The game (telephone, chance 1/4): the ``sender`` sees the target position (``a`` is 0, ``b``
is 1) and writes a one-token message in a code of its own; the ``relay`` sees only that
message and must *name* the target in one token; the ``receiver`` hears only the position the
relay named (the program tells it ``a`` or ``b``, nothing when the relay's token names none,
see :func:`heard`) and must name the target too. The relay gets 1.0 when it names the target;
the sender and the receiver get 1.0 when both the relay and the receiver name it; else 0.0. A
token names a position by the kind of its text: plain ASCII names 0, anything else names 1
(see :func:`position_of`).

Why the relay names the target rather than passing on a code of its own (as in a pure relay
chain): with three free codes, a sender's message helps only once both others read it, so
every agent's learning signal is a product of the two others' (second order at the random
start) and the receiver pools onto one answer before that product grows (docs/gateway.md,
"Measured"). Here the sender and relay play the two-agent signaling game (examples/signaling)
and the receiver learns to repeat the relay from the first step (whenever the relay happens to
be right, the receiver wins by naming what the relay named), so every agent has a first-order
signal.

Why the receiver hears the named position, and why the relay has a reward of its own: with the
relay's raw text and one shared reward the run pooled at 0.50 (the relay and the receiver name
one position, 1 in every run traced, for every message) in 5 of 5 seeds under the cluster's
sampling (docs/gateway.md, "Measured").
The relay's 128 high-byte answers all reach the receiver as one text (U+FFFD), its 128 ASCII
answers as 128 different ones, so the receiver learns to repeat a 1 long before a 0; under a
shared reward the relay is paid only when the receiver repeats it right, so naming 1 pays more,
the receiver hears 1 more often, and the two lock onto 1. Hearing ``a`` / ``b`` makes both
answers equally easy to repeat, and the relay's own reward (it names the target or not) no
longer depends on how well the receiver reads it (each change alone still pooled). The
sender's message stays raw text: that code is the sender's own.

Why "ASCII or not" and not the parity of the first byte (``"0"`` even, ``"1"`` odd): the
text channel is lossy. A byte-level token >= 0x80 is not valid UTF-8 on its own and decodes
to U+FFFD (bytes ``ef bf bd``), so under a parity reading the tiny models' byte tokens would
name 1 three times as often as 0 (the 64 odd ASCII bytes and the 128 high ones against the 64
even ASCII bytes); the ASCII reading splits them 128/128 (ids 256-319, the special tokens and
the embedding's padding, decode to nothing and name no position), so a random-init agent names
either position about equally often. The relay or receiver that sees a high token sees U+FFFD,
which is still "not ASCII": the reading survives the channel.

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
    """The target position of task ``index`` (deterministic per index and seed), balanced in pairs.

    Tasks ``2j`` and ``2j + 1`` have different targets (which one is ``a`` is drawn per pair), so a
    step of an even number of consecutive tasks (FlexMARL gives step t tasks ``t * prompts_per_step``
    onwards) has as many of each: a step whose targets are mostly one object pushes every agent
    towards the answer that suits it, the drift towards pooling (docs/gateway.md, "Measured").
    """
    first = random.Random(f"openai-agents/{seed}/{index // 2}").randrange(len(OBJECTS))
    return {"target": (first + index) % len(OBJECTS)}


def position_of(answer: str) -> int:
    """The position an answer names: 0 when its first character is ASCII, 1 when not, -1 for an empty answer."""
    if not answer:
        return -1
    return 0 if answer[0].isascii() else 1


def heard(relayed: str) -> str:
    """What the receiver hears of the relay's answer: the name of the position it names (``a`` / ``b``), or nothing."""
    position = position_of(relayed)
    return OBJECTS[position] if position >= 0 else ""


def rewards(relayed: str, answer: str, target: int) -> dict[str, float]:
    """An episode's 0/1 rewards: the relay's for naming the target, the others' for both naming it."""
    relay_right = position_of(relayed) == target
    through = 1.0 if relay_right and position_of(answer) == target else 0.0
    return {"sender": through, "relay": 1.0 if relay_right else 0.0, "receiver": through}


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
    relayed_text = relayed.choices[0].message.content or ""
    answer = await agents.chat.completions.create(
        model="receiver", max_tokens=1,
        messages=[{"role": "system", "content": "A"}, {"role": "user", "content": heard(relayed_text)}])
    return rewards(relayed_text, answer.choices[0].message.content or "", target)


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
    answer = await agents.completions.create(model="receiver", prompt="<" + heard(relayed.choices[0].text),
                                             max_tokens=1)
    return rewards(relayed.choices[0].text, answer.choices[0].text, target)
