from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from byte_tokenizers import RoleBytes

from flexmarl.episode import Environment, EpisodeContext, Task, load_environment
from flexmarl.errors import Unavailable
from rolloutd.balancer import episode_affinity_key, group_affinity_key
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutRunner, RolloutTaskInput

REPO_ROOT = Path(__file__).resolve().parents[2]


class FakeBackend:
    """Deterministic: sample j of a call answers chr(ord('a') + (call_serial + j) % 26) * 2.

    Logprobs are -(position + 1) / 10; version is per agent. Optionally fails an agent.
    """

    def __init__(self, versions: dict[str, int] | None = None, fail_agent: str = "") -> None:
        self.calls: list[tuple[str, tuple[int, ...], dict[str, Any], int, str]] = []
        self.versions = versions or {}
        self.fail_agent = fail_agent
        self.max_concurrent = 0
        self._active = 0

    async def generate(
        self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int, affinity_key: str
    ) -> list[GenerationOutput]:
        serial = len(self.calls)
        self.calls.append((agent, tuple(input_ids), sampling, n, affinity_key))
        self._active += 1
        self.max_concurrent = max(self.max_concurrent, self._active)
        try:
            await asyncio.sleep(0)  # let the other episodes interleave
            if agent == self.fail_agent:
                raise Unavailable(f"no replica for {agent}")
            outputs = []
            for j in range(n):
                ids = tuple(ord("a") + (serial + j) % 26 for _ in range(2))
                outputs.append(GenerationOutput(ids, (-0.1, -0.2), "stop", self.versions.get(agent, 0)))
            return outputs
        finally:
            self._active -= 1


class EchoGame(Environment):
    """Turn 0: 'speaker' on a fixed prompt; then 'listener' on each episode's own message."""

    agents = ("speaker", "listener")

    def task(self, index: int, seed: int) -> Task:
        return Task(index, seed, {"q": f"q{index}"})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        said = await ctx.generate("speaker", f"{task.data['q']}>")
        heard = await ctx.generate("listener", f"heard {said.text}>")
        ctx.reward("speaker", 1.0)
        ctx.reward("speaker", float(ctx.sample_index))
        ctx.reward("listener", 0.5 if heard.text else 0.0)
        if self.config.get("fail_sample") == ctx.sample_index:
            raise RuntimeError("boom in user code")


def runtimes(agents: Sequence[str]) -> dict[str, AgentRuntime]:
    return {a: AgentRuntime(RoleBytes(), {"temperature": 1.0, "max_new_tokens": 2}) for a in agents}


def task_input(n: int = 4) -> RolloutTaskInput:
    return RolloutTaskInput(job_id="job", task_id="job/0/3", task_index=3, seed=0, group_size=n)


async def test_first_turn_is_coalesced_into_one_n_request() -> None:
    backend = FakeBackend(versions={"speaker": 2, "listener": 5})
    runner = RolloutRunner(EchoGame(), runtimes(EchoGame.agents), backend, clock_ms=lambda: 123)
    result = await runner.run(task_input(4))
    assert result.ok, result.errors
    first = backend.calls[0]
    assert first[0] == "speaker" and first[1] == tuple(b"q3>") and first[3] == 4
    assert first[4] == group_affinity_key("job/0/3")
    assert result.coalesced_requests == 1 and result.backend_calls == 5
    later = backend.calls[1:]
    assert all(call[3] == 1 and call[0] == "listener" for call in later)
    assert {call[4] for call in later} == {episode_affinity_key("job/0/3", i) for i in range(4)}
    assert backend.max_concurrent == 4  # the n episodes' second turns run concurrently


async def test_experience_fields() -> None:
    backend = FakeBackend(versions={"speaker": 2, "listener": 5})
    runner = RolloutRunner(EchoGame(), runtimes(EchoGame.agents), backend, clock_ms=lambda: 123)
    result = await runner.run(task_input(4))
    assert len(result.experiences) == 8
    by_id = {e.experience_id: e for e in result.experiences}
    speaker = by_id["job/0/3/2/speaker/0"]
    assert speaker.group_id == "job/0/3/speaker" and speaker.episode_id == "job/0/3/2"
    assert speaker.reward == 1.0 + 2  # the episode return, on every turn of the agent
    assert speaker.behavior_version == 2 and speaker.group_size == 4 and speaker.job_id == "job"
    assert speaker.created_unix_ms == 123
    np.testing.assert_array_equal(speaker.prompt_token_ids, np.frombuffer(b"q3>", dtype=np.uint8))
    assert speaker.response_token_ids.dtype == np.int32 and speaker.response_logprobs.dtype == np.float32
    np.testing.assert_allclose(speaker.response_logprobs, [-0.1, -0.2])
    listener = by_id["job/0/3/2/listener/0"]
    assert listener.reward == 0.5 and listener.behavior_version == 5
    # each episode's listener prompt contains the sample that episode received
    speakers = [by_id[f"job/0/3/{i}/speaker/0"] for i in range(4)]
    assert len({bytes(s.response_token_ids.astype(np.uint8)) for s in speakers}) == 4
    for i, s in enumerate(speakers):
        heard = bytes(by_id[f"job/0/3/{i}/listener/0"].prompt_token_ids.astype(np.uint8))
        assert heard == b"heard " + bytes(s.response_token_ids.astype(np.uint8)) + b">"
    assert result.returns[3] == {"speaker": 4.0, "listener": 0.5}
    assert [e.to_proto().experience_id for e in result.experiences][:2] == [
        "job/0/3/0/speaker/0",
        "job/0/3/0/listener/0",
    ]


async def test_results_are_deterministic() -> None:
    async def once() -> list[tuple[str, bytes]]:
        runner = RolloutRunner(EchoGame(), runtimes(EchoGame.agents), FakeBackend(), clock_ms=lambda: 0)
        result = await runner.run(task_input(3))
        return [(e.experience_id, e.response_token_ids.tobytes()) for e in result.experiences]

    assert await once() == await once()


async def test_no_coalescing_when_disabled_or_prompts_differ() -> None:
    backend = FakeBackend()
    runner = RolloutRunner(EchoGame(), runtimes(EchoGame.agents), backend, coalesce_first_turn=False)
    result = await runner.run(task_input(3))
    assert result.ok and result.coalesced_requests == 0 and result.backend_calls == 6

    class PerSamplePrompt(EchoGame):
        async def episode(self, ctx: EpisodeContext, task: Task) -> None:
            await ctx.generate("speaker", "same" if ctx.sample_index < 2 else f"own{ctx.sample_index}")

    backend = FakeBackend()
    result = await RolloutRunner(PerSamplePrompt(), runtimes(EchoGame.agents), backend).run(task_input(4))
    assert result.ok
    assert sorted(call[3] for call in backend.calls) == [1, 1, 2]
    assert len(result.experiences) == 4


async def test_episode_without_generation_does_not_block_the_group() -> None:
    class SometimesSilent(EchoGame):
        async def episode(self, ctx: EpisodeContext, task: Task) -> None:
            if ctx.sample_index == 1:
                ctx.reward("speaker", 0.0)
                return
            await ctx.generate("speaker", "x")

    backend = FakeBackend()
    result = await asyncio.wait_for(
        RolloutRunner(SometimesSilent(), runtimes(EchoGame.agents), backend).run(task_input(3)), timeout=5
    )
    assert result.ok and [call[3] for call in backend.calls] == [2]
    assert sorted(e.sample_index for e in result.experiences) == [0, 2]


async def test_user_exception_fails_the_group_not_the_process() -> None:
    runner = RolloutRunner(EchoGame(fail_sample=2), runtimes(EchoGame.agents), FakeBackend(), fail_fast=False)
    result = await runner.run(task_input(4))
    assert not result.ok and result.experiences == ()
    (error,) = result.errors
    assert error.sample_index == 2 and error.error_type == "RuntimeError"
    assert "boom in user code" in error.message and "Traceback" in error.traceback


async def test_backend_failure_is_an_episode_error_and_fail_fast_stops_the_group() -> None:
    backend = FakeBackend(fail_agent="listener")
    result = await RolloutRunner(EchoGame(), runtimes(EchoGame.agents), backend).run(task_input(4))
    assert not result.ok and result.experiences == ()
    assert all(e.error_type == "Unavailable" for e in result.errors)
    assert len(backend.calls) <= 5


async def test_first_turn_backend_failure_reaches_every_episode() -> None:
    backend = FakeBackend(fail_agent="speaker")
    result = await RolloutRunner(EchoGame(), runtimes(EchoGame.agents), backend, fail_fast=False).run(task_input(3))
    assert sorted(e.sample_index for e in result.errors) == [0, 1, 2]
    assert len(backend.calls) == 1


async def test_cancelling_the_runner_propagates() -> None:
    class Hangs(EchoGame):
        async def episode(self, ctx: EpisodeContext, task: Task) -> None:
            await asyncio.Event().wait()

    run = asyncio.create_task(RolloutRunner(Hangs(), runtimes(EchoGame.agents), FakeBackend()).run(task_input(2)))
    await asyncio.sleep(0)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def test_signaling_example_through_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    game = load_environment("examples.signaling.env:SignalingGame")
    backend = FakeBackend()
    result = await RolloutRunner(game, runtimes(game.agents), backend).run(task_input(8))
    assert result.ok and len(result.experiences) == 16
    assert backend.calls[0][3] == 8  # the sender's prompt is the same for the whole group
    assert all(r.response_tokens == 2 for r in result.experiences)
    assert {r.reward for r in result.experiences} <= {0.0, 1.0}


class HeldOutGame(EchoGame):
    """EchoGame whose held-out tasks differ from its training ones, asks for temperature 1.5 and notes success."""

    def eval_task(self, index: int, seed: int) -> Task:
        return Task(index, seed, {"q": f"held-out {index}"})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        said = await ctx.generate("speaker", f"{task.data['q']}>", temperature=1.5)
        await ctx.generate("listener", f"heard {said.text}>")
        ctx.reward("speaker", float(ctx.sample_index))
        ctx.notes["success"] = ctx.sample_index == 1
        ctx.notes["role_correct"] = {"speaker": float(ctx.sample_index)}


async def test_an_evaluation_plays_the_held_out_task_greedily_and_makes_no_experience() -> None:
    backend = FakeBackend(versions={"speaker": 3, "listener": 1})
    runner = RolloutRunner(HeldOutGame(), runtimes(HeldOutGame.agents), backend)
    result = await runner.evaluate(RolloutTaskInput("job", "job/ev2/t3", 3, 0, 2), greedy=True)
    assert result.ok
    assert {call[1] for call in backend.calls if call[0] == "speaker"} == {tuple(b"held-out 3>")}
    assert all(call[2]["temperature"] == 0.0 for call in backend.calls)  # the episode's 1.5 is overridden
    assert [(e.task_index, e.sample_index) for e in result.episodes] == [(3, 0), (3, 1)]
    assert [e.returns["speaker"] for e in result.episodes] == [0.0, 1.0]
    assert [e.team_success for e in result.episodes] == [False, True]
    assert all(e.versions == {"speaker": (3,), "listener": (1,)} for e in result.episodes)
    assert [e.role_correct for e in result.episodes] == [{"speaker": 0.0}, {"speaker": 1.0}]

    policy = FakeBackend()
    await RolloutRunner(HeldOutGame(), runtimes(HeldOutGame.agents), policy).evaluate(
        RolloutTaskInput("job", "job/ev2/t3", 3, 0, 2), greedy=False)
    assert {call[2]["temperature"] for call in policy.calls if call[0] == "speaker"} == {1.5}
