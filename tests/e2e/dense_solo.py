"""A one-agent environment with a dense reward (for data-parallel binding tests).

One agent, ``speaker``, answers a short prompt with one token; the reward is a function of
the sampled token id (a value in [0, 1] that differs between samples), so every GRPO group
has spread and every step moves the weights.
"""

from __future__ import annotations

from examples.signaling.env import SignalingGame
from flexmarl.episode import EpisodeContext, Task

REWARD_LEVELS = 7


class DenseSolo(SignalingGame):
    """SignalingGame's tasks, one agent; reward = (answer id mod 7) / 6."""

    agents = ("speaker",)

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """One prompt, one token, one reward."""
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        answer = await ctx.generate("speaker", f"obj:{candidates} tgt:{candidates[target]}>", max_new_tokens=1)
        ctx.reward("speaker", (sum(answer.token_ids) % REWARD_LEVELS) / (REWARD_LEVELS - 1))
