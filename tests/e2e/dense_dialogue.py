"""A two-round dialogue with a dense reward: several multi-token turns per agent in one episode.

Round 1: the sender writes a 3-token message, the receiver a 2-token reply; round 2: the sender
writes again (seeing the reply), the receiver answers with one token. Each agent has two turns,
so two experiences per episode share the agent's episode return. The reward is a function of
every sampled token id (a value in [0, 1] that differs between samples), so every group has
spread and every step moves the weights.
"""

from __future__ import annotations

from examples.signaling.env import SignalingGame
from flexmarl.episode import EpisodeContext, Task

REWARD_LEVELS = 11


class DenseDialogue(SignalingGame):
    """SignalingGame's tasks; two rounds of sender and receiver turns; reward from all token ids."""

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        first = await ctx.generate("sender", f"obj:{candidates} tgt:{candidates[target]}>", max_new_tokens=3)
        reply_prompt = ctx.tokenize("receiver", f"obj:{candidates} msg:") + list(first.token_ids)
        reply = await ctx.generate("receiver", reply_prompt + ctx.tokenize("receiver", ">"), max_new_tokens=2)
        second = await ctx.generate(
            "sender", ctx.tokenize("sender", f"tgt:{candidates[target]} re:") + list(reply.token_ids)
            + ctx.tokenize("sender", ">"), max_new_tokens=3)
        answer = await ctx.generate("receiver", reply_prompt + list(second.token_ids) + ctx.tokenize("receiver", ">"),
                                    max_new_tokens=1)
        tokens = [*first.token_ids, *reply.token_ids, *second.token_ids, *answer.token_ids]
        reward = (sum(tokens) % REWARD_LEVELS) / (REWARD_LEVELS - 1)
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)
