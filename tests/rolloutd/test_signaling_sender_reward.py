"""examples/signaling's ``sender_reward: receiver_probability``: the sender trains on the receiver's probability
of the target, both agents report the 0/1 success, and the default job is unchanged."""

from __future__ import annotations

import math
from typing import Any

import pytest
from byte_tokenizers import ContentBytes

from examples.signaling.env import SignalingGame
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutRunner, RolloutTaskInput

# The receiver's answer distribution over an 8-token vocabulary (K = 4: token t names position t mod 4),
# per message token: after message 10 it names position 2 (tokens 2 and 6) with probability 0.6, after 11 with 0.2.
ANSWERS = {10: [0.1, 0.1, 0.3, 0.1, 0.1, 0.0, 0.3, 0.0], 11: [0.2, 0.2, 0.1, 0.1, 0.2, 0.05, 0.1, 0.05]}


class Scripted:
    """Sender: message 10 in even episodes, 11 in odd ones; receiver: always answers token 2 (position 2)."""

    def __init__(self) -> None:
        self.calls = 0
        self.requests: list[dict[str, Any]] = []

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        self.requests.append({"agent": agent, **sampling})
        if agent == "sender":
            self.calls += 1
            return [GenerationOutput((10 + self.calls % 2,), (-1.0,), "length", 3)]
        probs = ANSWERS[input_ids[-1]]
        k = int(sampling.get("top_logprobs_num", 0))
        ranked = sorted(((math.log(p), t) for t, p in enumerate(probs) if p > 0), reverse=True)[:k]
        return [GenerationOutput((2,), (math.log(probs[2]),), "length", 3, top_logprobs=(tuple(ranked),) if k else ())]


async def play(config: dict[str, Any]) -> tuple[dict[tuple[str, int], float], list[float], Scripted]:
    env = SignalingGame(num_objects=4, **config)
    backend = Scripted()
    runtimes = {a: AgentRuntime(ContentBytes(), {"max_new_tokens": 1}) for a in env.agents}
    # Task 0 of seed 0 (task_rng): its target is position 2, as the receiver's scripted answer.
    assert env.task(0, 0).data["target"] == 2
    result = await RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/0", 0, 0, 4))
    assert result.ok
    trained = {(r.agent, r.sample_index): r.reward for r in result.experiences}
    return trained, [ret["sender"] for ret in result.returns.values()], backend


async def test_sender_trains_on_the_receivers_probability_of_the_target() -> None:
    trained, reported, backend = await play({"sender_reward": "receiver_probability", "answer_top_logprobs": 8})
    assert reported == [1.0, 1.0, 1.0, 1.0]  # the game's 0/1 success, never the shaped reward
    for episode in range(4):
        expected = 0.6 if episode % 2 == 1 else 0.2  # odd episodes sent message 10, even ones 11
        assert trained[("sender", episode)] == pytest.approx(expected)
        assert trained[("receiver", episode)] == 1.0
    assert all(r.get("top_logprobs_num") == 8 for r in backend.requests if r["agent"] == "receiver")


async def test_default_sender_reward_is_the_success_and_asks_no_top_logprobs() -> None:
    trained, reported, backend = await play({})
    assert reported == [1.0, 1.0, 1.0, 1.0]
    assert all(trained[(agent, e)] == 1.0 for agent in ("sender", "receiver") for e in range(4))
    assert not any("top_logprobs_num" in r for r in backend.requests)


def test_target_probability_counts_uncovered_mass_evenly() -> None:
    env = SignalingGame(num_objects=4, sender_reward="receiver_probability", answer_top_logprobs=2)
    top = ((math.log(0.5), 5), (math.log(0.3), 2))  # 0.2 of the mass not covered: 0.05 per position
    assert env.target_probability(top, 1) == pytest.approx(0.55)
    assert env.target_probability(top, 2) == pytest.approx(0.35)
    assert env.target_probability(top, 3) == pytest.approx(0.05)


def test_receiver_probability_needs_top_logprobs() -> None:
    with pytest.raises(ValueError, match="answer_top_logprobs"):
        SignalingGame(num_objects=4, sender_reward="receiver_probability")
    with pytest.raises(ValueError, match="sender_reward"):
        SignalingGame(num_objects=4, sender_reward="bonus")
