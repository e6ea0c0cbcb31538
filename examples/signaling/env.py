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
"""

from __future__ import annotations

from typing import Any

from rolloutd.episode import Environment, EpisodeContext, Task, task_rng

OBJECTS = "abcdefghij"
MAX_MESSAGE_TOKENS = 4


class SignalingGame(Environment):
    """Lewis signaling game between a ``sender`` and a ``receiver``.

    Config: ``num_objects`` (K, 2..10, default 4), ``shuffle_candidates`` (default False),
    ``message_tokens`` (1..4, default 1: the sender's message is exactly that many tokens, unless
    it emits an EOS first). Reward: 1.0 to both agents when the receiver's answer token id mod K
    is the target's position, else 0.0.
    """

    agents = ("sender", "receiver")

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.num_objects = int(config.get("num_objects", 4))
        self.shuffle_candidates = bool(config.get("shuffle_candidates", False))
        self.message_tokens = int(config.get("message_tokens", 1))
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
        answer = await ctx.generate("receiver", receiver_prompt, max_new_tokens=1)
        won = bool(answer.token_ids) and self.position_of(answer.token_ids[0]) == target
        reward = 1.0 if won else 0.0
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)
