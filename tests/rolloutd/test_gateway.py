"""The OpenAI-compatible gateway with the official ``openai`` client, in process, over a deterministic backend.

The runner, the episode API, the gateway and the tiny byte-level Hugging Face tokenizer (with
its ChatML template) are real; the generation backend is a small deterministic fake whose
answers are a function of the agent and the prompt ids, so every assertion on token ids is exact.
tests/rolloutd/test_gateway_engine.py runs the same path over real embedded engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from flexmarl.episode import EpisodeContext, Task, load_environment
from flexmarl.experience import ExperienceRecord
from flexmarl.tiny import IM_END_TOKEN, build_tiny_tokenizer
from rolloutd.external_env import ExternalAgents
from rolloutd.gateway.server import Gateway, GatewayConfig
from rolloutd.gateway.tool_calls import ParsedToolCalls, parse_hermes, parse_qwen25
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutResult, RolloutRunner, RolloutTaskInput
from rolloutd.tokenizers import HFTokenizer

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
EOS, IM_END = 257, 260


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("gateway-tok")
    build_tiny_tokenizer(path)
    return HFTokenizer(str(path))


class PromptBackend:
    """Answers a function of (agent, prompt ids): ``ending`` decides the last token (im_end, eos or none).

    The text part is two lowercase letters picked by a hash of the prompt; logprobs are
    -(i + 1) / 8; version 7. ``max_new_tokens`` bounds the answer as an engine would. With
    ``top_logprobs_num`` k (the router's request option) each position's top k are the sampled
    token, then the next token ids, each 1 less likely.
    """

    def __init__(self, ending: str = "im_end") -> None:
        self.ending = ending
        self.requests: list[tuple[str, tuple[int, ...], dict[str, Any]]] = []

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        self.requests.append((agent, tuple(input_ids), dict(sampling)))
        await asyncio.sleep(0)
        outputs = []
        for j in range(n):
            digest = hashlib.sha256(f"{agent}|{input_ids}|{j}".encode()).digest()
            ids = [ord("a") + digest[0] % 26, ord("a") + digest[1] % 26]
            ids += {"im_end": [IM_END], "eos": [EOS], "none": []}[self.ending]
            ids = ids[: int(sampling.get("max_new_tokens", 16))]
            reason = "length" if self.ending == "none" else "stop"
            logprobs = tuple(-(i + 1) / 8 for i in range(len(ids)))
            k = int(sampling.get("top_logprobs_num", 0))
            top = tuple(tuple((lp - j, t + j) for j in range(k)) for lp, t in zip(logprobs, ids, strict=True))
            outputs.append(GenerationOutput(tuple(ids), logprobs, reason, 7, top_logprobs=top))
        return outputs


Program = Callable[[str, str, dict[str, Any]], Any]


async def run_program(tokenizer: HFTokenizer, program: Program | str, *, agents: Sequence[str] = ("a", "b"),
                      group_size: int = 2, backend: Any = None, **config: Any) -> tuple[RolloutResult, ExternalAgents]:
    env = ExternalAgents(agents=list(agents), program=program, **config)
    runtimes = {a: AgentRuntime(tokenizer, {"temperature": 1.0, "max_new_tokens": 8}) for a in agents}
    runner = RolloutRunner(env, runtimes, backend or PromptBackend(), clock_ms=lambda: 0)
    try:
        result = await runner.run(RolloutTaskInput("job", "job/0/1", 1, 0, group_size))
    finally:
        await env.aclose()
    return result, env


def by_id(result: RolloutResult) -> dict[str, ExperienceRecord]:
    assert result.ok, result.errors
    return {e.experience_id: e for e in result.experiences}


def ids(record: ExperienceRecord) -> list[int]:
    return [int(t) for t in record.prompt_token_ids]


# ----- chat, completions, models, rewards ----------------------------------------------------------


async def test_a_chat_call_is_one_turn_with_the_templated_prompt_and_the_sampled_tokens(tokenizer: HFTokenizer) -> None:
    seen: dict[int, Any] = {}

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        async with client:
            models = await client.models.list()
            reply = await client.chat.completions.create(
                model="a", messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
                temperature=0.5, top_p=0.9, max_tokens=50, stop=["zz"], logprobs=True)
            text = await client.completions.create(model="b", prompt="raw>", max_tokens=2, logprobs=1)
        seen[task["sample_index"]] = (models, reply, text)
        return {"a": 1.0, "b": 0.25}

    backend = PromptBackend()
    result, _ = await run_program(tokenizer, program, backend=backend)
    records = by_id(result)
    models, reply, text = seen[1]
    assert [m.id for m in models.data] == ["a", "b"]
    a = records["job/0/1/1/a/0"]
    assert ids(a) == tokenizer.render_chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    response = [int(t) for t in a.response_token_ids]
    assert response[-1] == IM_END and reply.choices[0].message.content == tokenizer.decode(response)
    assert reply.choices[0].finish_reason == "stop" and reply.model == "a"
    assert [c.logprob for c in reply.choices[0].logprobs.content] == pytest.approx(list(a.response_logprobs))
    assert reply.usage.prompt_tokens == len(ids(a)) and reply.usage.completion_tokens == len(response)
    assert a.behavior_version == 7 and a.reward == 1.0
    b = records["job/0/1/1/b/0"]
    assert ids(b) == list(b"raw>") and b.reward == 0.25 and len(b.response_token_ids) == 2
    assert text.choices[0].text == tokenizer.decode([int(t) for t in b.response_token_ids])
    assert text.choices[0].logprobs.token_logprobs == pytest.approx(list(b.response_logprobs))
    assert text.choices[0].logprobs.top_logprobs == [  # logprobs=1: the top one of each position
        {tokenizer.decode([int(t)]): float(lp)}
        for t, lp in zip(b.response_token_ids, b.response_logprobs, strict=True)]
    assert text.choices[0].finish_reason == "stop"
    # sampling: the OpenAI names map onto SGLang's, max_tokens bounded by the agent's max_new_tokens (8)
    chat_sampling = next(s for agent, p, s in backend.requests if agent == "a")
    assert chat_sampling == {"temperature": 0.5, "top_p": 0.9, "max_new_tokens": 8, "stop": ["zz"]}
    assert next(s for agent, p, s in backend.requests if agent == "b")["max_new_tokens"] == 2


async def test_rewards_posted_to_the_session_add_up_per_agent(tokenizer: HFTokenizer) -> None:
    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        reward_url = base_url.removesuffix("/v1") + "/reward"
        headers = {"Authorization": f"Bearer {api_key}"}
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])
        async with aiohttp.ClientSession(headers=headers) as http:
            for value in (1.5, task["sample_index"]):
                async with http.post(reward_url, json={"agent": "a", "value": value}) as response:
                    assert response.status == 200
            async with http.post(reward_url, json={"agent": "nobody", "value": 1}) as response:
                assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
            async with http.post(reward_url, json={"agent": "a", "value": "high"}) as response:
                assert response.status == 400 and (await response.json())["error"]["param"] == "value"

    records = by_id((await run_program(tokenizer, program, group_size=3))[0])
    assert [records[f"job/0/1/{i}/a/0"].reward for i in range(3)] == [1.5, 2.5, 3.5]


# ----- token-in / token-out ------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["im_end", "eos", "none"])
async def test_a_later_call_reuses_the_recorded_ids_of_the_turns_it_repeats(tokenizer: HFTokenizer,
                                                                          ending: str) -> None:
    replies: list[Any] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages: list[Any] = [{"role": "system", "content": "s"}, {"role": "user", "content": "one"}]
            for question in ("two", "three"):
                reply = await client.chat.completions.create(model="a", messages=messages)
                replies.append(reply)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),  # as programs append it
                             {"role": "user", "content": question}]
            replies.append(await client.chat.completions.create(model="a", messages=messages))

    records = by_id((await run_program(tokenizer, program, group_size=1, backend=PromptBackend(ending)))[0])
    turns = [records[f"job/0/1/0/a/{t}"] for t in range(3)]
    for earlier, later, question in ((turns[0], turns[1], "two"), (turns[1], turns[2], "three")):
        sampled = [int(t) for t in earlier.response_token_ids]
        # the template writes <|im_end|> after the assistant's content; a sampled one is not repeated
        end = "" if sampled[-1:] == [IM_END] else IM_END_TOKEN
        tail = tokenizer.encode(f"{end}\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        assert ids(later) == ids(earlier) + sampled + tail
    assert [r.model_extra["flexmarl"]["reused_prompt_tokens"] for r in replies] == [
        0, len(ids(turns[0])) + len(turns[0].response_token_ids), len(ids(turns[1])) + len(turns[1].response_token_ids)]
    assert all(r.model_extra["flexmarl"]["retokenized_messages"] == 0 for r in replies)
    assert all(t.retokenized_messages == 0 for t in turns)
    if ending == "eos":  # re-tokenizing the text would have lost the sampled <|eos|>
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "one"},
                    {"role": "assistant", "content": replies[0].choices[0].message.content},
                    {"role": "user", "content": "two"}]
        assert tokenizer.render_chat(messages) != ids(turns[1]) and EOS in ids(turns[1])


async def test_messages_that_match_no_turn_are_retokenized_and_counted(tokenizer: HFTokenizer) -> None:
    replies: list[Any] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            first = await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "q"}])
            said = first.choices[0].message.content or ""
            edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said + "!"},  # edited
                      {"role": "assistant", "content": "made up"}, {"role": "user", "content": "q2"}]
            replies.append(await client.chat.completions.create(model="a", messages=edited))  # type: ignore[arg-type]
            # b never said what a said: b's own history does not match it
            replies.append(await client.chat.completions.create(model="b", messages=[
                {"role": "user", "content": "q"}, {"role": "assistant", "content": said},
                {"role": "user", "content": "q2"}]))
        assert env.gateway is not None
        registry = env.gateway.metrics.registry
        counts.extend(registry.get_sample_value("flexmarl_gateway_retokenized_messages_total", {"agent": agent})
                      for agent in ("a", "b"))

    counts: list[float | None] = []
    env = ExternalAgents(agents=["a", "b"], program=program)
    runtimes = {a: AgentRuntime(tokenizer, {"max_new_tokens": 8}) for a in ("a", "b")}
    try:
        result = await RolloutRunner(env, runtimes, PromptBackend()).run(RolloutTaskInput("job", "job/0/1", 1, 0, 1))
    finally:
        await env.aclose()
    records = by_id(result)
    said = tokenizer.decode([int(t) for t in records["job/0/1/0/a/0"].response_token_ids])
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": said + "!"},
                {"role": "assistant", "content": "made up"}, {"role": "user", "content": "q2"}]
    assert ids(records["job/0/1/0/a/1"]) == tokenizer.render_chat(messages)  # no reuse: the fresh render
    assert [r.model_extra["flexmarl"]["retokenized_messages"] for r in replies] == [2, 1]
    assert [r.model_extra["flexmarl"]["reused_prompt_tokens"] for r in replies] == [0, 0]
    assert counts == [2.0, 1.0]
    # the experience says it too: exactly the calls whose prompt holds re-tokenized messages are flagged
    assert {i: r.retokenized_messages for i, r in records.items()} == {
        "job/0/1/0/a/0": 0, "job/0/1/0/a/1": 2, "job/0/1/0/b/0": 1}


# ----- streaming -----------------------------------------------------------------------------------


async def test_streamed_chat_and_completions_carry_the_same_turns(tokenizer: HFTokenizer) -> None:
    streamed: dict[str, Any] = {}

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="a", messages=[{"role": "user", "content": "hello"}], stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            streamed["chat"] = chunks
            text_stream = await client.completions.create(model="b", prompt="p>", stream=True)
            streamed["text"] = [chunk async for chunk in text_stream]
        async with aiohttp.ClientSession() as http:  # the wire format itself
            async with http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                                 json={"model": "a", "messages": [{"role": "user", "content": "hello"}],
                                       "stream": True}) as response:
                assert response.headers["Content-Type"].startswith("text/event-stream")
                streamed["raw"] = (await response.read()).decode()

    records = by_id((await run_program(tokenizer, program, group_size=1))[0])
    chat = streamed["chat"]
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    a = records["job/0/1/0/a/0"]
    assert text == tokenizer.decode([int(t) for t in a.response_token_ids])
    assert chat[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] == "stop"
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == len(a.response_token_ids)
    b = records["job/0/1/0/b/0"]
    assert "".join(c.choices[0].text for c in streamed["text"]) == tokenizer.decode(
        [int(t) for t in b.response_token_ids])
    frames = streamed["raw"].split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and all(f.startswith("data: {") for f in frames[:-2])
    assert json.loads(frames[0][len("data: "):])["object"] == "chat.completion.chunk"
    # the raw call repeated the first one's messages exactly: its prompt is the same fresh render
    assert ids(records["job/0/1/0/a/1"]) == ids(a)


async def test_n_samples_are_one_request_and_n_turns(tokenizer: HFTokenizer) -> None:
    seen: dict[int, Any] = {}

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            chat = await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], n=2)
            stream = await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "yo"}],
                                                          n=2, stream=True)
            chunks = [chunk async for chunk in stream]
            text = await client.completions.create(model="b", prompt="p>", n=3, max_tokens=2)
        seen[task["sample_index"]] = (chat, chunks, text)

    backend = PromptBackend()
    result, _ = await run_program(tokenizer, program, backend=backend)
    records = by_id(result)
    # one backend request per call (n=2, n=2, n=3) per episode; none joins the first-turn coalescing
    assert len(backend.requests) == 6 and result.coalesced_requests == 0
    chat, chunks, text = seen[1]
    a0, a1 = records["job/0/1/1/a/0"], records["job/0/1/1/a/1"]
    assert ids(a0) == ids(a1) == tokenizer.render_chat([{"role": "user", "content": "hi"}])
    answers = [c.message.content for c in chat.choices]
    assert [c.index for c in chat.choices] == [0, 1] and answers[0] != answers[1]
    assert answers == [tokenizer.decode([int(t) for t in r.response_token_ids]) for r in (a0, a1)]
    assert chat.usage.prompt_tokens == len(ids(a0))
    assert chat.usage.completion_tokens == len(a0.response_token_ids) + len(a1.response_token_ids)
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in (0, 1)]
    assert streamed == [tokenizer.decode([int(t) for t in records[f"job/0/1/1/a/{turn}"].response_token_ids])
                        for turn in (2, 3)]
    assert [c.index for c in text.choices] == [0, 1, 2]
    assert [c.text for c in text.choices] == [
        tokenizer.decode([int(t) for t in records[f"job/0/1/1/b/{turn}"].response_token_ids]) for turn in range(3)]
    assert {records[f"job/0/1/1/b/{turn}"].turn for turn in range(3)} == {0, 1, 2}


async def test_tools_reach_a_chat_template_that_renders_them(tmp_path: Path) -> None:
    build_tiny_tokenizer(tmp_path)
    tooled = HFTokenizer(str(tmp_path))
    tooled._tokenizer.chat_template = (  # ChatML with a tool list in front
        "{% for t in tools or [] %}<tool>{{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}\n{{ m.content }}\n{% endfor %}assistant")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "q"}],
                                                 tools=tools, tool_choice="auto")

    records = by_id((await run_program(tooled, program, agents=("a",), group_size=1))[0])
    assert tooled.decode(ids(records["job/0/1/0/a/0"])) == "<tool>lookup\nuser\nq\nassistant"


QWEN_TOOLS_TEMPLATE = (  # the shape of Qwen2.5's template: tools in the system turn, calls as <tool_call> blocks
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{{- '<|im_start|>assistant\\n' }}")
LOOKUP = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


class ScriptedBackend:
    """Answers the texts given, one per call in order (then "ok"), each followed by <|im_end|>."""

    def __init__(self, tokenizer: HFTokenizer, texts: Sequence[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        text = self.texts.pop(0) if self.texts else "ok"
        ids = [*self.tokenizer.encode(text), IM_END]
        return [GenerationOutput(tuple(ids), tuple(-0.5 for _ in ids), "stop", 7)] * n


async def test_a_tool_call_round_trip_reuses_the_sampled_call(tmp_path: Path) -> None:
    build_tiny_tokenizer(tmp_path)
    tooled = HFTokenizer(str(tmp_path))
    tooled._tokenizer.chat_template = QWEN_TOOLS_TEMPLATE
    sampled_call = 'Let me look.\n<tool_call>\n{"name":"lookup","arguments":{"q":"x"}}\n</tool_call>'
    seen: dict[str, Any] = {}

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": "find x"}]
            first = await client.chat.completions.create(model="a", messages=messages, tools=LOOKUP)  # type: ignore
            call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "42"}]
            second = await client.chat.completions.create(model="a", messages=messages, tools=LOOKUP)  # type: ignore
            edited = [*messages[:1], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
                "name": "lookup", "arguments": '{"q": "y"}'}}]}, messages[2]]  # the program changed the call
            third = await client.chat.completions.create(model="a", messages=edited, tools=LOOKUP)  # type: ignore
            stream = await client.chat.completions.create(model="a", messages=messages[:1], tools=LOOKUP,
                                                          stream=True)  # type: ignore[call-overload]
            seen.update(first=first, second=second, third=third, chunks=[c async for c in stream])

    backend = ScriptedBackend(tooled, [sampled_call, "ok", "ok", sampled_call])
    records = by_id((await run_program(tooled, program, agents=("a",), group_size=1, backend=backend,
                                       tool_call_parser="qwen25"))[0])
    first = seen["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("lookup", {"q": "x"})]
    assert first.message.tool_calls[0].id.startswith("call_")
    turn0, turn1, turn2 = (records[f"job/0/1/0/a/{t}"] for t in range(3))
    assert tooled.decode([int(t) for t in turn0.response_token_ids]) == sampled_call  # the sampled text trains
    # the second call's prompt: the first one's ids, the sampled call, then the template's rendering of the rest
    tail = tooled.encode("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert ids(turn1) == ids(turn0) + [int(t) for t in turn0.response_token_ids] + tail
    assert seen["second"].model_extra["flexmarl"]["retokenized_messages"] == 0
    assert seen["second"].choices[0].finish_reason == "stop" and seen["second"].choices[0].message.tool_calls is None
    # the template's own rendering of the call differs from what was sampled ({"q": "x"} vs {"q":"x"})
    fresh = [{"role": "user", "content": "find x"},
             {"role": "assistant", "content": "Let me look.", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
             {"role": "tool", "tool_call_id": "c", "content": "42"}]
    assert tooled.render_chat(fresh, tools=LOOKUP) != ids(turn1)
    # an edited call matches no turn: re-tokenized from the template and said so
    assert seen["third"].model_extra["flexmarl"]["retokenized_messages"] == 1
    assert [t.retokenized_messages for t in (turn0, turn1, turn2)] == [0, 0, 1]
    assert '"q": "y"' in tooled.decode(ids(turn2))
    deltas = [c.choices[0].delta for c in seen["chunks"] if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [(0, "lookup", {"q": "x"})]
    assert [c.choices[0].finish_reason for c in seen["chunks"] if c.choices][-1] == "tool_calls"


def test_tool_call_parsers_follow_sglangs_detectors() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    two = ('hi\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "g"}\n</tool_call>')
    assert parse_qwen25(two, tools) == ParsedToolCalls("hi", (("f", '{"a": 1}'), ("g", "{}")))
    # a block that is not JSON is skipped, a call of an undeclared function dropped; the content is the text before
    odd = '<tool_call>\n{bad}\n</tool_call>\n<tool_call>\n{"name": "h", "arguments": {}}\n</tool_call>'
    assert parse_qwen25(odd, tools) == ParsedToolCalls("", ())
    assert parse_qwen25("no call", tools) == ParsedToolCalls("no call", ())
    assert parse_qwen25('<tool_call>{"name": "f"}</tool_call>', tools).calls == ()  # qwen25 needs the newlines
    assert parse_hermes('x <tool_call>{"name": "f", "parameters": {"b": 2}}</tool_call>', tools) == ParsedToolCalls(
        "x", (("f", '{"b": 2}'),))
    assert parse_hermes('<tool_call>{"name": "g", "arguments": {}}', tools).calls == (("g", "{}"),)  # unclosed
    assert parse_hermes("a <tool_call>{bad}</tool_call>", tools) == ParsedToolCalls("a <tool_call>{bad}</tool_call>",
                                                                                   ())


# ----- errors and security ---------------------------------------------------------------------------


async def test_errors_have_openai_shapes_and_codes(tokenizer: HFTokenizer) -> None:
    checks: list[str] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as missing:
                await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
            assert missing.value.code == "model_not_found" and missing.value.param == "model"
            with pytest.raises(openai.BadRequestError) as many:
                await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}], n=129)
            assert many.value.param == "n" and many.value.code == "integer_above_max_value"
            with pytest.raises(openai.BadRequestError) as empty:
                await client.chat.completions.create(model="a", messages=[])
            assert empty.value.param == "messages"
            with pytest.raises(openai.BadRequestError) as tools:
                await client.chat.completions.create(
                    model="a", messages=[{"role": "user", "content": "x"}],
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
            # the tiny tokenizer's ChatML template never mentions tools: refused, never silently dropped
            assert tools.value.param == "tools" and "does not render tools" in tools.value.message
            with pytest.raises(openai.BadRequestError) as required:
                await client.chat.completions.create(
                    model="a", messages=[{"role": "user", "content": "x"}], tool_choice="required",
                    tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
            assert required.value.param == "tool_choice"
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}],
                                                     temperature=7)
        async with AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as intruder:
            with pytest.raises(openai.AuthenticationError) as denied:
                await intruder.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])
            assert denied.value.code == "invalid_api_key"
        other_session = base_url.rsplit("/sessions/", 1)[0] + "/sessions/" + "x" * 43 + "/v1"
        async with AsyncOpenAI(base_url=other_session, api_key=api_key, max_retries=0) as lost:
            with pytest.raises(openai.NotFoundError) as unknown:
                await lost.models.list()
            assert unknown.value.code == "session_not_found"
        headers = {"Authorization": f"Bearer {api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            for body in (b"{not json", b"[1, 2]", b'{"model": "a", "messages": [{"content": "no role"}]}',
                         b'{"model": "a", "messages": [{"role": "user", "content": "x"}], "bogus": 1}'):
                async with http.post(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as response:
                    error = (await response.json())["error"]
                    assert response.status == 400 and response.headers["x-should-retry"] == "false"
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["type"] == "invalid_request_error"
            async with http.get(f"{base_url}/embeddings") as response:
                assert response.status == 404 and "error" in await response.json()
        checks.append("done")

    result, _ = await run_program(tokenizer, program, group_size=1)
    assert checks == ["done"]
    assert [e.agent for e in result.experiences] == []  # no call got through: no turns


USER = {"role": "user", "content": "x"}
# (body fields, expected param, expected code): each answered 400 as the official API answers it.
MALFORMED: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("chat", {"temperature": "hot"}, "temperature", "invalid_type"),
    ("chat", {"temperature": 2.5}, "temperature", "decimal_above_max_value"),
    ("chat", {"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ("chat", {"max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ("chat", {"n": "2"}, "n", "invalid_type"),
    ("chat", {"stream": "yes"}, "stream", "invalid_type"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", None),
    ("chat", {"logprobs": 1}, "logprobs", "invalid_type"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", None),
    ("chat", {"seed": "s"}, "seed", "invalid_type"),
    ("chat", {"user": 3}, "user", "invalid_type"),
    ("chat", {"stop": 3}, "stop", "invalid_type"),
    ("chat", {"model": 3}, "model", "invalid_type"),
    ("chat", {"model": None}, "model", "missing_required_parameter"),
    ("chat", {"messages": None}, "messages", "missing_required_parameter"),
    ("chat", {"messages": "x"}, "messages", "invalid_type"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages[0].content", "invalid_type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "invalid_type"),
    ("chat", {"messages": [USER, {"role": "tool", "content": "42"}]}, "messages[1].tool_call_id",
     "missing_required_parameter"),
    ("chat", {"messages": [USER, {"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "messages.[1].role",
     None),
    ("chat", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls", None),  # the tiny ChatML template does not render tool calls
    ("chat", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[1].tool_calls[0].function.arguments", None),
    ("chat", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c2"}]}, "messages[2].tool_call_id", None),
    ("chat", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, USER]},
     "messages.[1].role", None),
    ("chat", {"messages": [{**USER, "tool_calls": []}]}, "messages[0].tool_calls", None),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", None),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", None),
    ("chat", {"tools": {"type": "function"}}, "tools", "invalid_type"),
    ("chat", {"tools": [{"type": "web"}]}, "tools[0].type", "invalid_value"),
    ("chat", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name",
     "missing_required_parameter"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", None),
    ("chat", {"response_format": "json"}, "response_format", "invalid_type"),
    ("completions", {"logprobs": True}, "logprobs", "invalid_type"),
    ("completions", {"logprobs": 6}, "logprobs", "integer_above_max_value"),
    ("completions", {"echo": "no"}, "echo", "invalid_type"),
    ("completions", {"best_of": 2}, "best_of", None),
]


async def test_malformed_fields_are_answered_as_the_official_api_answers(tokenizer: HFTokenizer) -> None:
    answers: list[tuple[int, dict[str, Any]]] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
            for route, fields, _, _ in MALFORMED:
                base: dict[str, Any] = ({"model": "a", "messages": [USER]} if route == "chat"
                                        else {"model": "a", "prompt": "x"})
                async with http.post(f"{base_url}/{'chat/' if route == 'chat' else ''}completions",
                                     json={**base, **fields}) as response:
                    answers.append((response.status, (await response.json())["error"]))

    result, _ = await run_program(tokenizer, program, group_size=1)
    assert result.ok and result.experiences == ()  # nothing got through
    for (_, fields, param, code), (status, error) in zip(MALFORMED, answers, strict=True):
        assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), (fields, error)
        if code is not None:
            assert error["code"] == code, (fields, error)


async def test_a_session_expires_with_its_episode(tokenizer: HFTokenizer) -> None:
    handed_out: list[tuple[str, str]] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        handed_out.append((base_url, api_key))
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])

    env = ExternalAgents(agents=["a"], program=program)
    runtimes = {"a": AgentRuntime(tokenizer, {"max_new_tokens": 4})}
    result = await RolloutRunner(env, runtimes, PromptBackend()).run(RolloutTaskInput("job", "job/0/1", 1, 0, 2))
    assert result.ok and len(result.experiences) == 2
    try:
        assert len({url for url, _ in handed_out}) == 2 and len({key for _, key in handed_out}) == 2
        for base_url, api_key in handed_out:
            assert len(base_url.split("/sessions/")[1].removesuffix("/v1")) >= 43  # 32 random bytes
            async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as late:
                with pytest.raises(openai.NotFoundError):
                    await late.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])
    finally:
        await env.aclose()


async def test_the_cluster_token_applies_to_every_session(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("cluster-secret\n")
    keys: list[str] = []

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        keys.append(api_key)
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])
        session_key = api_key.removeprefix("cluster-secret.")
        async with AsyncOpenAI(base_url=base_url, api_key=session_key, max_retries=0) as no_token:
            with pytest.raises(openai.AuthenticationError):
                await no_token.models.list()

    result, env = await run_program(tokenizer, program, agents=("a",), group_size=1,
                                    gateway={"token_file": str(token_file)})
    assert result.ok and keys[0].startswith("cluster-secret.")
    assert "cluster-secret" not in repr(env.gateway_config)


async def test_the_gateway_binds_to_loopback_by_default() -> None:
    gateway = Gateway()
    await gateway.start()
    try:
        assert gateway.config.host == "127.0.0.1" and gateway.url == f"http://127.0.0.1:{gateway.port}"
    finally:
        await gateway.stop()
    assert Gateway(GatewayConfig(host="0.0.0.0", advertise_host="node-3")).config.advertise_host == "node-3"


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def test_a_stopped_gateway_frees_its_port_and_wildcard_hosts_listen() -> None:
    for host in ("127.0.0.1", "0.0.0.0", ""):
        gateway = Gateway(GatewayConfig(host=host))
        port = await gateway.start()
        assert _accepts(port) and gateway.url == f"http://127.0.0.1:{port}"
        await gateway.stop()
        assert not _accepts(port)


def test_an_environment_moved_to_a_new_event_loop_closes_the_old_gateways_socket() -> None:
    """A caller running asyncio.run per batch: the old loop's gateway stops listening, the new one serves."""
    env = ExternalAgents(agents=["a"], program=lambda *_: None)

    async def port_of_this_loop() -> int:
        return (await env._gateway()).port

    first = asyncio.run(port_of_this_loop())
    assert _accepts(first)  # the loop ended, its server did not close the socket by itself
    second = asyncio.run(port_of_this_loop())
    assert not _accepts(first) and _accepts(second)
    asyncio.run(env.aclose())
    assert not _accepts(second)


# ----- concurrency -----------------------------------------------------------------------------------


async def test_a_hundred_concurrent_sessions_keep_their_own_records(tokenizer: HFTokenizer) -> None:
    # One connection pool for all clients: building an AsyncOpenAI's own pool costs ~0.1 s (its SSL context).
    pool = openai.DefaultAsyncHttpxClient()

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
        mark = f"episode {task['sample_index']}"
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=pool)
        messages: list[Any] = [{"role": "user", "content": mark}]
        first = await client.chat.completions.create(model="a", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        second, other = await asyncio.gather(
            client.chat.completions.create(model="a", messages=messages),
            client.completions.create(model="b", prompt=mark))
        assert (second.model_extra or {})["flexmarl"]["reused_prompt_tokens"] > 0
        return {"a": float(task["sample_index"]), "b": 1.0}

    try:
        result, _ = await run_program(tokenizer, program, group_size=100)
    finally:
        await pool.aclose()
    records = by_id(result)
    assert len(records) == 3 * 100
    for i in range(100):
        mark = f"episode {i}".encode()
        first, second = records[f"job/0/1/{i}/a/0"], records[f"job/0/1/{i}/a/1"]
        assert mark in bytes(first.prompt_token_ids.astype(np.uint8))
        assert ids(second)[: len(ids(first)) + len(first.response_token_ids)] == ids(first) + [
            int(t) for t in first.response_token_ids]
        assert ids(records[f"job/0/1/{i}/b/0"]) == list(mark)
        assert first.reward == second.reward == float(i)


# ----- programs: sync, command line, failures, config ------------------------------------------------


async def test_a_sync_program_runs_in_threads_of_its_own(tokenizer: HFTokenizer) -> None:
    pool = openai.DefaultHttpxClient()

    def sync_program(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=pool)
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": str(task["data"])}])
        return {"a": 2.0}

    # 40 episodes block in their first call until all 40 made one (the first-turn barrier): a shared
    # thread pool smaller than the group would deadlock here.
    try:
        result, _ = await run_program(tokenizer, sync_program, agents=("a",), group_size=40)
    finally:
        pool.close()
    assert len(by_id(result)) == 40 and {e.reward for e in result.experiences} == {2.0}


async def test_a_command_line_program_gets_its_session_in_the_environment(tokenizer: HFTokenizer) -> None:
    script = (
        "import json, os, urllib.request\n"
        "from openai import OpenAI\n"
        "task = json.loads(os.environ['FLEXMARL_TASK'])\n"
        "with OpenAI(max_retries=0) as client:\n"  # OPENAI_BASE_URL and OPENAI_API_KEY come from the env
        "    client.chat.completions.create(model='a', messages=[{'role': 'user', 'content': 'cmd'}])\n"
        "request = urllib.request.Request(os.environ['FLEXMARL_REWARD_URL'], method='POST',\n"
        "    data=json.dumps({'agent': 'a', 'value': task['sample_index'] + 0.5}).encode(),\n"
        "    headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY'], 'Content-Type': 'application/json'})\n"
        "urllib.request.urlopen(request).read()\n"
    )
    env = ExternalAgents(agents=["a"], command=[sys.executable, "-c", script])
    runtimes = {"a": AgentRuntime(tokenizer, {"max_new_tokens": 4})}
    try:
        result = await RolloutRunner(env, runtimes, PromptBackend()).run(RolloutTaskInput("job", "job/0/1", 1, 0, 1))
    finally:
        await env.aclose()
    records = by_id(result)
    assert ids(records["job/0/1/0/a/0"]) == tokenizer.render_chat([{"role": "user", "content": "cmd"}])
    assert records["job/0/1/0/a/0"].reward == 0.5

    failing = ExternalAgents(agents=["a"], command=[sys.executable, "-c", "import sys; sys.exit('no luck')"])
    try:
        failed = await RolloutRunner(failing, runtimes, PromptBackend()).run(RolloutTaskInput("j", "j/0/1", 1, 0, 1))
    finally:
        await failing.aclose()
    assert not failed.ok and failed.errors[0].error_type == "ProgramFailed" and "no luck" in failed.errors[0].message


async def test_a_failing_or_slow_program_fails_the_group(tokenizer: HFTokenizer) -> None:
    async def raises(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        raise RuntimeError("agent bug")

    result, _ = await run_program(tokenizer, raises, group_size=2)
    assert not result.ok and result.errors[0].message == "agent bug" and not result.experiences

    async def hangs(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        await asyncio.Event().wait()

    slow, _ = await run_program(tokenizer, hangs, group_size=1, episode_timeout_s=0.2)
    assert not slow.ok and "episode_timeout_s" in slow.errors[0].message

    async def bad_return(base_url: str, api_key: str, task: dict[str, Any]) -> Any:
        return [1.0]

    wrong, _ = await run_program(tokenizer, bad_return, group_size=1)
    assert not wrong.ok and wrong.errors[0].error_type == "ProgramFailed"


def test_the_example_reads_tokens_as_ascii_or_not_and_balances_its_targets(
    tokenizer: HFTokenizer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two properties the example's learning rests on (docs/gateway.md, "Measured")."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    from examples.openai_agents import agents

    # Ids 0-319 (the tiny model's embedding): 128 name 0, 128 name 1 (a lone high byte is U+FFFD), the rest none.
    named = [agents.position_of(tokenizer.decode([token_id])) for token_id in range(320)]
    assert (named.count(0), named.count(1), named.count(-1)) == (128, 128, 64)
    assert named[:256] == [0] * 128 + [1] * 128
    # Both the relay and the receiver must name the target.
    assert agents.rewards("x", "0", 0) == dict.fromkeys(("sender", "relay", "receiver"), 1.0)
    assert agents.rewards("\ufffd", "\ufffd", 1)["relay"] == 1.0
    assert {agents.rewards(r, a, 0)["receiver"] for r, a in (("x", "\ufffd"), ("\ufffd", "x"), ("", "x"))} == {0.0}
    # Tasks 2j and 2j+1 have different targets, so a step of an even number of tasks is balanced.
    for seed in (0, 1):
        targets = [agents.make_task(index, seed)["target"] for index in range(64)]
        assert all(targets[j] != targets[j + 1] for j in range(0, 64, 2))
    assert [agents.make_task(i, 0) for i in range(0, 64, 2)] != [agents.make_task(i, 1) for i in range(0, 64, 2)]


def test_the_config_is_checked_and_the_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    entry = "rolloutd.external_env:ExternalAgents"
    with pytest.raises(Exception, match="agents"):
        load_environment(entry, {"program": "examples.openai_agents.agents:run"})
    with pytest.raises(Exception, match="exactly one"):
        load_environment(entry, {"agents": ["a"]})
    with pytest.raises(Exception, match="cannot load agent program"):
        load_environment(entry, {"agents": ["a"], "program": "examples.openai_agents.agents:nope"})
    with pytest.raises(Exception, match="gateway settings"):
        load_environment(entry, {"agents": ["a"], "command": "true", "gateway": {"hots": "x"}})
    with pytest.raises(Exception, match="unknown tool_call_parser 'nope'"):
        load_environment(entry, {"agents": ["a"], "command": "true", "tool_call_parser": "nope"})
    with pytest.raises(Exception, match="unknown agents"):
        load_environment(entry, {"agents": ["a"], "command": "true", "tool_call_parser": {"b": "qwen25"}})
    parsed = load_environment(entry, {"agents": ["a", "b"], "command": "true", "tool_call_parser": "hermes"})
    assert isinstance(parsed, ExternalAgents) and parsed.gateway_config.tool_call_parsers == {"a": "hermes",
                                                                                              "b": "hermes"}
    env = load_environment(entry, {"agents": ["sender", "relay", "receiver"],
                                   "program": "examples.openai_agents.agents:run",
                                   "tasks": "examples.openai_agents.agents:make_task"})
    assert env.agents == ("sender", "relay", "receiver")
    assert env.task(3, 0) == Task(3, 0, {"target": env.task(3, 0).data["target"]}) == env.task(3, 0)
    assert {env.task(i, 0).data["target"] for i in range(20)} == {0, 1}


async def test_native_context_helpers(tokenizer: HFTokenizer) -> None:
    async def sampler(index: int, request: Any) -> GenerationOutput:
        raise AssertionError("not called")

    import random

    ctx = EpisodeContext(agents={"a": tokenizer}, sampling_defaults={"a": {"max_new_tokens": 3}}, sample_index=0,
                         rng=random.Random(0), sampler=sampler)
    assert ctx.decode("a", [104, 105, IM_END]) == "hi" and ctx.sampling_defaults("a") == {"max_new_tokens": 3}


class StuckBackend(PromptBackend):
    """Never answers (a request stuck in an engine)."""

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_call_in_flight_when_the_episode_ends_is_answered_404(tokenizer: HFTokenizer) -> None:
    outcome: asyncio.Queue[BaseException] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def blocked(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])
        except BaseException as exc:  # what the program sees once its episode timed out
            loop.call_soon_threadsafe(outcome.put_nowait, exc)
            raise

    env = ExternalAgents(agents=["a"], program=blocked, episode_timeout_s=0.5)
    runner = RolloutRunner(env, {"a": AgentRuntime(tokenizer, {"max_new_tokens": 4})}, StuckBackend())
    try:
        result = await runner.run(RolloutTaskInput("job", "job/0/1", 1, 0, 1))
        assert not result.ok and "episode_timeout_s" in result.errors[0].message
        seen = await asyncio.wait_for(outcome.get(), 10)
    finally:
        await env.aclose()
    assert isinstance(seen, openai.NotFoundError) and seen.code == "session_not_found"


def test_episodes_in_successive_event_loops_get_a_live_gateway(tokenizer: HFTokenizer) -> None:
    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(model="a", messages=[{"role": "user", "content": "x"}])

    env = ExternalAgents(agents=["a"], program=lambda *args: program(*args))  # a sync callable returning a coroutine
    runner = RolloutRunner(env, {"a": AgentRuntime(tokenizer, {"max_new_tokens": 4})}, PromptBackend())
    for step in range(2):  # asyncio.run per batch, as benchmarks/signaling_learning.py does
        result = asyncio.run(runner.run(RolloutTaskInput("job", f"job/{step}/0", 0, 0, 2)))
        assert result.ok, result.errors
        assert len(result.experiences) == 2
    asyncio.run(env.aclose())
