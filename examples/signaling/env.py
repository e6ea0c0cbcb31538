"""Two-agent referential (signaling) game, learnable by tiny byte-level models on CPU.

A sender sees the target among K objects and emits a one-token message; a receiver sees only
the message and answers with one token that names a position. Both get reward 1 when the
receiver names the target's position, else 0: the reward *is* the success indicator (no
shaping), so the mean reward of a step is exactly its accuracy.

How an answer names a position: the answer token with id ``t`` names position ``t mod K``.
For the digits this is the obvious reading (``"0"`` is byte 48, a multiple of 2, 3 and 4, so
``"0"``..``"K-1"`` name positions 0..K-1), and every other token is a guess too. Why not "only
a digit counts": a random-init byte-level model puts ~1/300 of its mass on each token, so
with digit-only answers the receiver is right ~1/300 of the time, every GRPO group is all
zeros and nothing is learned; a format reward for any digit fixes that but first collapses
both agents onto one symbol for every target (a pooling equilibrium with zero group variance,
observed in benchmarks/signaling_learning.py). With the modular reading the untrained pair
scores exactly chance (1/K) and every group has variance from the first step. This changes
how the environment reads an answer, never what the model samples: the logprobs recorded at
rollout are those of the trained policy.

Prompts are raw byte strings (no chat template) that end with the one byte that matters, so
that the last position's hidden state, and therefore the next-token distribution, depends on
it directly rather than through attention over a long constant prefix:

Sender prompt:   "{target}"                e.g. "c"
Receiver prompt: ">" + message token ids   e.g. ">X"   (answer: a token t with t mod K == 2)

With ``shuffle_candidates`` the candidate order varies per task, so both prompts start with
it ("{candidates}>{target}" and "{candidates}>" + message); that variant is harder and is
not what examples/signaling/job.yaml runs.

Measured (benchmarks/signaling_learning.py, docs/examples.md): K=2, 2-layer tiny Qwen2,
lr 1e-2, 8 tasks x 8 episodes per step reach mean reward >= 0.9 in 11-17 steps on three
seeds; K=3 and K=4 fall into partial-pooling equilibria within 40 steps at these settings.
K=4 learns with ``sender_reward: receiver_probability`` and the settings of
examples/signaling/job_k4.yaml: 0.9 by step 33-45 on three seeds, held to step 70 on all three.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flexmarl import Environment, EpisodeContext, EpisodeRecord, Task, TurnRecord, task_rng

OBJECTS = "abcdefghij"
MAX_MESSAGE_TOKENS = 4
SENDER_REWARDS = ("success", "receiver_probability")


class SignalingGame(Environment):
    """Lewis signaling game between a ``sender`` and a ``receiver``.

    Config: ``num_objects`` (K, 2..10, default 4), ``shuffle_candidates`` (default False),
    ``message_tokens`` (1..4, default 1: the sender's message is exactly that many tokens, unless
    it emits an EOS first), ``sender_reward`` (``success``, the default, or
    ``receiver_probability``, see :meth:`shape_reward`) and ``answer_top_logprobs`` (how many of
    the receiver's most likely answers the episode asks for, ``top_logprobs_num``; 0, the
    default, asks none; ``receiver_probability`` needs it, exact at the model's vocabulary size).
    Reward: 1.0 to both agents when the receiver's answer token id mod K is the target's
    position, else 0.0; that is what both report, whatever the sender trains on.
    """

    agents = ("sender", "receiver")

    def __init__(self, *, num_objects: int = 4, shuffle_candidates: bool = False, message_tokens: int = 1,
                 sender_reward: str = SENDER_REWARDS[0], answer_top_logprobs: int = 0) -> None:
        super().__init__(num_objects=num_objects, shuffle_candidates=shuffle_candidates, message_tokens=message_tokens,
                         sender_reward=sender_reward, answer_top_logprobs=answer_top_logprobs)
        self.num_objects = int(num_objects)
        self.shuffle_candidates = bool(shuffle_candidates)
        self.message_tokens = int(message_tokens)
        self.sender_reward = str(sender_reward)
        self.answer_top_logprobs = int(answer_top_logprobs)
        if self.sender_reward not in SENDER_REWARDS:
            raise ValueError(f"sender_reward must be one of {SENDER_REWARDS}")
        if self.sender_reward == "receiver_probability" and self.answer_top_logprobs < 1:
            raise ValueError("sender_reward receiver_probability needs answer_top_logprobs >= 1")
        if not 2 <= self.num_objects <= len(OBJECTS):
            raise ValueError(f"num_objects must be in 2..{len(OBJECTS)}")
        if not 1 <= self.message_tokens <= MAX_MESSAGE_TOKENS:
            raise ValueError(f"message_tokens must be in 1..{MAX_MESSAGE_TOKENS}")

    def task(self, index: int, seed: int) -> Task:
        """Candidates (shuffled when configured) and the target's position among them."""
        rng = task_rng(index, seed)
        candidates = list(OBJECTS[: self.num_objects])
        if self.shuffle_candidates:
            rng.shuffle(candidates)
        target = rng.randrange(self.num_objects)
        return Task(index=index, seed=seed, data={"candidates": "".join(candidates), "target": target})

    def position_of(self, answer_token_id: int) -> int:
        """The candidate position an answer token names: its id mod K (digits name themselves)."""
        return answer_token_id % self.num_objects

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """One message, one answer, a shared 0/1 reward."""
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        prefix = f"{candidates}>" if self.shuffle_candidates else ""
        message = await ctx.generate("sender", prefix + candidates[target], max_new_tokens=self.message_tokens)
        # The receiver sees the sender's tokens verbatim (ids, not re-tokenized text), so any
        # token (even a special one) is a usable signal.
        receiver_prompt = ctx.tokenize("receiver", prefix or ">") + list(message.token_ids)
        answer = await ctx.generate("receiver", receiver_prompt, max_new_tokens=1,
                                    top_logprobs_num=self.answer_top_logprobs)
        won = bool(answer.token_ids) and self.position_of(answer.token_ids[0]) == target
        reward = 1.0 if won else 0.0
        if self.sender_reward == "receiver_probability" and answer.top_logprobs:
            ctx.notes["receiver_probability"] = self.target_probability(answer.top_logprobs[0], target)
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)

    def target_probability(self, top: Sequence[tuple[float, int]], target: int) -> float:
        """The receiver's probability of answering ``target``: the mass of its answers naming it.

        ``top`` is the receiver's (logprob, token id) alternatives at its answer; the mass they do
        not cover (fewer than the whole vocabulary) counts 1/K for each position.
        """
        named = math.fsum(math.exp(lp) for lp, token in top if self.position_of(token) == target)
        rest = max(0.0, 1.0 - math.fsum(math.exp(lp) for lp, _ in top))
        return min(1.0, named + rest / self.num_objects)

    def shape_reward(self, task: Task, turn: TurnRecord, reward: float, *, episode: EpisodeRecord) -> float:
        """``receiver_probability``: the sender's turn trains on the receiver's probability of the target.

        That is the episode's expected success given the message (the receiver's answer summed
        out), an unbiased, lower-variance stand-in for the sampled 0/1 success, and it still
        ranks messages when the receiver never names the target (the pooled case, where the
        0/1 reward of every episode of the group is 0). The receiver trains on the 0/1 success;
        the reported reward is the 0/1 success for both. The episode leaves the probability in its
        notes (``ctx.notes``); an episode without one (an answer without top logprobs) keeps the
        sender's 0/1 reward.
        """
        if self.sender_reward != "receiver_probability" or turn.agent != "sender":
            return reward
        return float(episode.notes.get("receiver_probability", reward))
