"""The gateway over real engines: the router, seeded sampling and embedded engines serving tiny models.

The same episode played through the gateway by an ``openai`` client program and through the
native episode API gives byte-identical experiences for the same seed; the example program
(examples/openai_agents) runs end to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from flexmarl.episode import Environment, EpisodeContext, Task, load_environment
from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.external_env import ExternalAgents
from rolloutd.router import Replica, RolloutRouter, agent_key
from rolloutd.runner import AgentRuntime, RolloutResult, RolloutRunner, RolloutTaskInput
from rolloutd.tokenizers import HFTokenizer

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB = "gw-job"
AGENTS = ("sender", "relay", "receiver")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gateway-ckpt")
    return {agent: build_tiny_checkpoint(root / agent, seed=seed, num_layers=1, hidden_size=64, num_heads=2,
                                         num_kv_heads=1, head_dim=32, intermediate_size=128)
            for seed, agent in enumerate(AGENTS, start=1)}


async def _resolve(uri: str) -> str:
    return uri


@pytest.fixture
async def router(checkpoints: dict[str, Path]) -> AsyncIterator[RolloutRouter]:
    """One deterministic embedded engine per agent, in this process, behind the real router."""
    servers: list[EmbeddedServer] = []
    routed: RolloutRouter | None = None
    try:
        for agent in AGENTS:
            config = EmbeddedEngineConfig(model_path=str(checkpoints[agent]), enable_deterministic_inference=True)
            server = EmbeddedServer(await asyncio.to_thread(EmbeddedEngine, config))
            await server.start("127.0.0.1", 0)
            servers.append(server)
        replicas = [Replica(f"replica-{i}", SGLangClient(f"http://127.0.0.1:{s.port}")) for i, s in enumerate(servers)]
        routed = RolloutRouter(replicas, _resolve)
        for agent in AGENTS:
            routed.require(agent_key(JOB, agent), 0, str(checkpoints[agent]))
        await routed.set_agents([agent_key(JOB, agent) for agent in AGENTS])
        yield routed
    finally:
        if routed is not None:
            await routed.close()
            for replica in routed.replicas():
                await replica.client.close()
        for server in servers:
            await server.stop()


def _runtimes(checkpoints: dict[str, Path]) -> dict[str, AgentRuntime]:
    return {agent: AgentRuntime(HFTokenizer(str(checkpoints[agent])), SAMPLING) for agent in AGENTS}


async def _run(env: Environment, router: RolloutRouter, checkpoints: dict[str, Path], group_size: int,
               task_index: int = 2) -> RolloutResult:
    runner = RolloutRunner(env, _runtimes(checkpoints), router.backend(JOB, seed=11), clock_ms=lambda: 0)
    return await runner.run(RolloutTaskInput(JOB, f"{JOB}/0/{task_index}", task_index, 11, group_size))


class NativeRelay(Environment):
    """The episode of :func:`gateway_relay`, written against the native API.

    The sender's second turn repeats its first; the native code builds that prompt from the
    recorded ids by hand (the first turn's prompt and response, then the template's next
    messages), which is what the gateway must do on its own.
    """

    agents = AGENTS

    def task(self, index: int, seed: int) -> Task:
        return Task(index, seed, {"word": f"w{index}"})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        first = [{"role": "system", "content": "S"}, {"role": "user", "content": task.data["word"]}]
        said = await ctx.generate("sender", first, max_new_tokens=3)
        end = "" if list(said.token_ids[-1:]) == ctx.tokenize("sender", "<|im_end|>") else "<|im_end|>"
        tail = ctx.tokenize("sender", f"{end}\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
        again = await ctx.generate("sender", [*said.prompt_token_ids, *said.token_ids, *tail])
        relayed = await ctx.generate("relay", [{"role": "user", "content": said.text + again.text}], stop=["x"])
        answer = await ctx.generate("receiver", [{"role": "user", "content": relayed.text}], temperature=0.7)
        ctx.reward("receiver", float(len(answer.text)))
        ctx.reward("sender", 1.0)


async def gateway_relay(base_url: str, api_key: str, task: dict[str, Any]) -> dict[str, float]:
    """The same episode as NativeRelay, as an openai-client program."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list[Any] = [{"role": "system", "content": "S"}, {"role": "user", "content": task["data"]["word"]}]
        said = await client.chat.completions.create(model="sender", messages=messages, max_tokens=3)
        messages += [{"role": "assistant", "content": said.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        again = await client.chat.completions.create(model="sender", messages=messages)
        text = (said.choices[0].message.content or "") + (again.choices[0].message.content or "")
        relayed = await client.chat.completions.create(model="relay", messages=[{"role": "user", "content": text}],
                                                       stop="x")
        answer = await client.chat.completions.create(
            model="receiver", messages=[{"role": "user", "content": relayed.choices[0].message.content or ""}],
            temperature=0.7)
    return {"receiver": float(len(answer.choices[0].message.content or "")), "sender": 1.0}


class GatewayRelay(ExternalAgents):
    def __init__(self) -> None:
        super().__init__(agents=list(AGENTS), program=gateway_relay)

    def task(self, index: int, seed: int) -> Task:
        return NativeRelay().task(index, seed)


def _fingerprint(result: RolloutResult) -> list[tuple[Any, ...]]:
    assert result.ok, result.errors
    return [(e.experience_id, e.turn, e.behavior_version, e.reward, e.prompt_token_ids.tobytes(),
             e.response_token_ids.tobytes(), e.response_logprobs.tobytes()) for e in result.experiences]


async def test_gateway_and_native_episodes_give_byte_identical_experiences(
    router: RolloutRouter, checkpoints: dict[str, Path],
) -> None:
    native = _fingerprint(await _run(NativeRelay(), router, checkpoints, group_size=3))
    gateway_env = GatewayRelay()
    try:
        through_gateway = _fingerprint(await _run(gateway_env, router, checkpoints, group_size=3))
    finally:
        await gateway_env.aclose()
    assert len(native) == 3 * 4
    assert through_gateway == native
    assert len({row[5] for row in native if "/sender/0" in row[0]}) > 1  # the seeded samples differ per episode


async def test_the_example_program_runs_end_to_end(router: RolloutRouter, checkpoints: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    env = load_environment("rolloutd.external_env:ExternalAgents", {
        "agents": list(AGENTS), "program": "examples.openai_agents.agents:run",
        "tasks": "examples.openai_agents.agents:make_task"})
    try:
        result = await _run(env, router, checkpoints, group_size=4, task_index=5)
    finally:
        await env.aclose()
    assert result.ok, result.errors
    assert sorted({(e.agent, e.turn) for e in result.experiences}) == sorted((a, 0) for a in AGENTS)
    assert len(result.experiences) == 3 * 4
    assert all(len(e.response_token_ids) == 1 for e in result.experiences)  # max_tokens=1
    for sample in range(4):  # 0/1 rewards: the relay's for naming the target, the others' for both naming it
        rewards = {e.agent: e.reward for e in result.experiences if e.sample_index == sample}
        assert set(rewards.values()) <= {0.0, 1.0} and rewards["sender"] == rewards["receiver"] <= rewards["relay"]


async def test_top_logprobs_are_the_engines(router: RolloutRouter, checkpoints: dict[str, Path]) -> None:
    """``top_logprobs`` (chat) and ``logprobs: k`` (completions) are the engine's top-k of the sampling distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    answers: dict[str, Any] = {}

    async def program(base_url: str, api_key: str, task: dict[str, Any]) -> None:
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            answers["chat"] = await client.chat.completions.create(
                model="sender", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3,
                temperature=0.7)
            answers["text"] = await client.completions.create(model="relay", prompt="abc", logprobs=2)

    env = ExternalAgents(agents=list(AGENTS), program=program)
    try:
        result = await _run(env, router, checkpoints, group_size=1)
    finally:
        await env.aclose()
    assert result.ok, result.errors
    records = {e.agent: e for e in result.experiences}
    for agent, temperature, k in (("sender", 0.7, 3), ("relay", 1.0, 2)):
        record = records[agent]
        prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
        model = AutoModelForCausalLM.from_pretrained(str(checkpoints[agent]))
        with torch.inference_mode():  # the distribution the engine samples from, recomputed here
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1].float()
        expected = torch.log_softmax(logits / temperature, dim=-1).topk(k)
        tokenizer = HFTokenizer(str(checkpoints[agent]))
        if agent == "sender":
            content = answers["chat"].choices[0].logprobs.content
            assert [c.logprob for c in content] == pytest.approx(record.response_logprobs.tolist(), abs=1e-5)
            got = [[t.logprob for t in c.top_logprobs] for c in content]
            assert [[t.token for t in c.top_logprobs] for c in content] == [
                [tokenizer.decode([i]) for i in row] for row in expected.indices.tolist()]
            assert got == [pytest.approx(row, abs=1e-4) for row in expected.values.tolist()]
        else:  # {token text: logprob}, built as SGLang builds it (tokens that decode alike share an entry)
            tops = answers["text"].choices[0].logprobs.top_logprobs
            assert [set(top) for top in tops] == [{tokenizer.decode([i]) for i in row}
                                                  for row in expected.indices.tolist()]
            rows = zip(expected.values.tolist(), expected.indices.tolist(), strict=True)
            assert tops == [{tokenizer.decode([i]): pytest.approx(v, abs=1e-4)
                             for v, i in zip(values, ids, strict=True)} for values, ids in rows]
        assert len(expected.values) == len(response)
