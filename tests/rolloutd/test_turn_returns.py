"""Turn-level rewards, discounted per-agent returns and the environment's reward-shaping hook."""

from __future__ import annotations

from typing import Any

import pytest
from byte_tokenizers import ContentBytes

from flexmarl.episode import Environment, EpisodeContext, EpisodeRecord, Task, TurnRecord, reward_shaper
from flexmarl.errors import InvalidArgument
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutRunner, RolloutTaskInput, turn_returns


class OneToken:
    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        return [GenerationOutput((ord("x"),), (-0.5,), "length", 0) for _ in range(n)]


class Debate(Environment):
    """'pro' speaks three times, rewarded per turn (+ a final reward); 'judge' once, at the episode's end."""

    agents = ("pro", "judge")

    def task(self, index: int, seed: int) -> Task:
        return Task(index, seed)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        for k in range(3):
            await ctx.generate("pro", f"turn {k}")
            ctx.reward("pro", float(k + 1), turn=-1)
        await ctx.generate("judge", "verdict")
        ctx.reward("pro", 10.0)  # episode-level: counted at pro's last turn
        ctx.reward("judge", 1.0)
        ctx.reward("judge", 0.5)
        if self.config.get("bad_turn"):
            ctx.reward("judge", 1.0, turn=1)


class Shaped(Debate):
    def shape_reward(self, task: Task, turn: TurnRecord, reward: float) -> float:
        return reward - 1.0 if turn.agent == "pro" else reward


class ShapedByTheJudge(Debate):
    """Shapes pro's turns with the whole episode: the judge's turn, its return and a note the episode left."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.seen: list[EpisodeRecord] = []

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        await super().episode(ctx, task)
        ctx.notes["judge_weight"] = 2.0

    def shape_reward(self, task: Task, turn: TurnRecord, reward: float, *, episode: EpisodeRecord) -> float:
        self.seen.append(episode)
        if turn.agent != "pro":
            return reward
        (judge_turn,) = episode.turns_of("judge")
        assert judge_turn.turn == 0 and judge_turn.response_token_ids == (ord("x"),)
        return reward + episode.notes["judge_weight"] * episode.returns["judge"]


async def play(env: Environment, gamma: float) -> dict[tuple[str, int], float]:
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 1}, gamma=gamma if a == "pro" else 1.0)
                for a in env.agents}
    result = await RolloutRunner(env, runtimes, OneToken(), clock_ms=lambda: 0).run(
        RolloutTaskInput("j", "j/b0/t0", 0, 0, 2))
    assert result.ok, result.errors
    assert all(r[s] == {"pro": 16.0, "judge": 1.5}[s] for r in result.returns.values() for s in r)
    rewards = {(e.agent, e.turn, e.sample_index): e.reward for e in result.experiences}
    # beside its trained return (shaped, discounted) every turn carries its agent's unshaped episode return
    assert {(e.agent, e.episode_return) for e in result.experiences} == {("pro", 16.0), ("judge", 1.5)}
    assert all(rewards[(a, k, 0)] == rewards[(a, k, 1)] for a, k, _ in rewards)
    return {(a, k): v for (a, k, s), v in rewards.items() if s == 0}


def test_turn_returns_discount_later_rewards() -> None:
    assert turn_returns([1.0, 2.0, 13.0], 0.5) == [1.0 + 0.5 * (2.0 + 0.5 * 13.0), 2.0 + 0.5 * 13.0, 13.0]
    assert turn_returns([1.0, 2.0, 13.0], 1.0) == [16.0, 15.0, 13.0]
    assert turn_returns([], 0.9) == []


async def test_turn_rewards_become_discounted_returns_per_agent() -> None:
    got = await play(Debate(), gamma=0.5)
    # pro's rewards per turn: 1, 2, 3 + 10 (the episode-level reward at its last turn)
    assert got == {("pro", 0): 1.0 + 0.5 * 2.0 + 0.25 * 13.0, ("pro", 1): 2.0 + 0.5 * 13.0, ("pro", 2): 13.0,
                   ("judge", 0): 1.5}


async def test_episode_level_rewards_with_gamma_one_are_the_episode_return_on_every_turn() -> None:
    got = await play(Debate(), gamma=1.0)
    assert got[("pro", 2)] == 13.0 and got[("pro", 0)] == 16.0 and got[("judge", 0)] == 1.5


async def test_shape_reward_sees_each_turn_before_discounting() -> None:
    got = await play(Shaped(), gamma=1.0)
    assert got == {("pro", 0): 13.0, ("pro", 1): 13.0, ("pro", 2): 12.0, ("judge", 0): 1.5}  # 0, 1, 12 shaped


async def test_shape_reward_with_episode_sees_every_agents_turns_the_unshaped_returns_and_the_notes() -> None:
    env = ShapedByTheJudge()
    got = await play(env, gamma=1.0)
    # pro's rewards 1, 2, 13, each + 2.0 * 1.5 (the judge's unshaped return): 4, 5, 16
    assert got == {("pro", 0): 25.0, ("pro", 1): 21.0, ("pro", 2): 16.0, ("judge", 0): 1.5}
    first = env.seen[0]
    assert [(t.agent, t.turn) for t in first.turns] == [("pro", 0), ("pro", 1), ("pro", 2), ("judge", 0)]
    assert first.returns == {"pro": 16.0, "judge": 1.5} and first.notes == {"judge_weight": 2.0}
    assert sorted({e.sample_index for e in env.seen}) == [0, 1]


def test_a_shaper_without_episode_is_called_with_three_arguments() -> None:
    task, turn = Task(0, 0), TurnRecord("pro", 0, (1,), (2,), (-0.1,), 0)
    episode = EpisodeRecord(0, (turn,), {"pro": 1.0}, {})
    assert reward_shaper(Shaped())(task, turn, 5.0, episode) == 4.0
    assert reward_shaper(Debate())(task, turn, 5.0, episode) == 5.0

    class Keywords(Debate):
        def shape_reward(self, task: Task, turn: TurnRecord, reward: float, **extra: Any) -> float:
            return reward + len(extra["episode"].turns)

    assert reward_shaper(Keywords())(task, turn, 5.0, episode) == 6.0


async def test_reward_for_a_turn_not_taken_fails_the_episode() -> None:
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 1}) for a in Debate.agents}
    result = await RolloutRunner(Debate(bad_turn=True), runtimes, OneToken()).run(
        RolloutTaskInput("j", "j/b0/t0", 0, 0, 1))
    assert not result.ok and "turn 1 not taken" in result.errors[0].message


def test_reward_turn_indexing() -> None:
    async def sampler(index: int, request: Any) -> GenerationOutput:
        return GenerationOutput((1,), (-0.1,), "length", 0)

    import asyncio
    import random

    ctx = EpisodeContext(agents={"a": ContentBytes()}, sampling_defaults={}, sample_index=0, rng=random.Random(0),
                         sampler=sampler)
    with pytest.raises(InvalidArgument, match="not taken"):
        ctx.reward("a", 1.0, turn=-1)
    asyncio.run(ctx.generate("a", "x"))
    asyncio.run(ctx.generate("a", "y"))
    ctx.reward("a", 1.0, turn=-1)
    ctx.reward("a", 2.0, turn=0)
    ctx.reward("a", 4.0)
    assert ctx.turn_rewards() == {"a": {1: 1.0, 0: 2.0}} and ctx.episode_rewards() == {"a": 4.0}
    assert ctx.returns() == {"a": 7.0}
