"""One agent writing a long message, so a partial-rollout job has generations to interrupt, by design.

The ``sender`` writes LongSignaling's message (``long_message_tokens`` tokens, ``ignore_eos``) and
is rewarded by a function of the sampled ids (DenseSignaling's, without a receiver), so every
GRPO group has spread. With one agent on one replica and one slot nothing else shares the engine
or the trainer, and the pipeline's own order puts a commit inside a running batch (see
tests/e2e/test_partial_e2e.py); LongSignaling is the two-agent variant the benchmarks use.
"""

from __future__ import annotations

from dense_signaling import REWARD_LEVELS
from long_signaling import LongSignaling

from flexmarl.episode import EpisodeContext, Task


class LongSolo(LongSignaling):
    """LongSignaling's tasks and sender message; one agent, reward = (sum of the message ids mod 7) / 6."""

    agents = ("sender",)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        message = await self.long_message(ctx, task)
        ctx.reward("sender", (sum(message.token_ids) % REWARD_LEVELS) / (REWARD_LEVELS - 1))
