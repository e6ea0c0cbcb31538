"""One agent writing a long message, so a partial-rollout job has generations to interrupt, by design.

The ``sender`` writes ``long_message_tokens`` tokens (``ignore_eos``: always that many) and is
rewarded by a function of the sampled ids (DenseSignaling's, without a receiver), so every GRPO
group has spread. With one agent on one replica and one slot nothing else shares the engine or
the trainer, and the pipeline's own order puts a commit inside a running batch (see
tests/e2e/test_partial_e2e.py); LongSignaling is the two-agent variant the benchmarks use.
"""

from __future__ import annotations

from typing import Any

from dense_signaling import REWARD_LEVELS

from examples.signaling.env import SignalingGame
from rolloutd.episode import EpisodeContext, Task


class LongSolo(SignalingGame):
    """SignalingGame's tasks and sender prompt; one agent, reward = (sum of the message ids mod 7) / 6."""

    agents = ("sender",)

    def __init__(self, **config: Any) -> None:
        super().__init__(**{k: v for k, v in config.items() if k != "long_message_tokens"})
        self.long_message_tokens = int(config.get("long_message_tokens", 64))

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        message = await ctx.generate("sender", f"obj:{candidates} tgt:{candidates[target]}>",
                                     max_new_tokens=self.long_message_tokens, ignore_eos=True)
        ctx.reward("sender", (sum(message.token_ids) % REWARD_LEVELS) / (REWARD_LEVELS - 1))
