"""DenseSignaling with a long sender message, so a partial-rollout job has generations to interrupt.

The sender writes ``long_message_tokens`` tokens (``ignore_eos``: always that many) and the receiver
answers with one, after seeing the message; the reward is DenseSignaling's function of the sampled
ids. A long message keeps the sender's generations running while the previous step trains, so
the commit of a version lands on running generations (``rollout.partial_rollout``).
"""

from __future__ import annotations

from typing import Any

from dense_signaling import REWARD_LEVELS, DenseSignaling

from flexmarl.episode import EpisodeContext, GenerationOutput, Task


class LongSignaling(DenseSignaling):
    """DenseSignaling's tasks and reward; the sender's message is ``long_message_tokens`` tokens long."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**{k: v for k, v in config.items() if k != "long_message_tokens"})
        self.long_message_tokens = int(config.get("long_message_tokens", 64))

    async def long_message(self, ctx: EpisodeContext, task: Task) -> GenerationOutput:
        """The sender's message: always ``long_message_tokens`` tokens."""
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        return await ctx.generate("sender", f"obj:{candidates} tgt:{candidates[target]}>",
                                  max_new_tokens=self.long_message_tokens, ignore_eos=True)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        candidates: str = task.data["candidates"]
        message = await self.long_message(ctx, task)
        receiver_prompt = (
            ctx.tokenize("receiver", f"obj:{candidates} msg:") + list(message.token_ids) + ctx.tokenize("receiver", ">")
        )
        answer = await ctx.generate("receiver", receiver_prompt, max_new_tokens=1)
        level = (sum(message.token_ids) + sum(answer.token_ids)) % REWARD_LEVELS
        reward = level / (REWARD_LEVELS - 1)
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)
