"""The signaling game with a dense reward, so a 2-step job of tiny random models has a gradient.

With the example's 0/1 reward a random-init byte-level model almost never wins in two
steps: every GRPO group has equal returns, zero advantages and a zero gradient, and a
test comparing trained weights would compare untouched ones. Here the reward is a
function of the sampled token ids (a value in [0, 1] that differs between samples), so
groups have spread and every step moves the weights.
"""

from __future__ import annotations

from collections.abc import Iterator

from examples.signaling.env import OBJECTS, SignalingGame
from flexmarl.episode import EpisodeContext, Task

REWARD_LEVELS = 7


class DenseSignaling(SignalingGame):
    """SignalingGame's tasks and prompts; reward = (message id + answer id) mod 7, scaled to [0, 1]."""

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        message = await ctx.generate("sender", f"obj:{candidates} tgt:{candidates[target]}>", max_new_tokens=1)
        receiver_prompt = (
            ctx.tokenize("receiver", f"obj:{candidates} msg:") + list(message.token_ids) + ctx.tokenize("receiver", ">")
        )
        answer = await ctx.generate("receiver", receiver_prompt, max_new_tokens=1)
        level = (sum(message.token_ids) + sum(answer.token_ids)) % REWARD_LEVELS
        reward = level / (REWARD_LEVELS - 1)
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)


#: The one token the sender's warm start teaches it to send (tests/e2e/test_warm_start_e2e.py).
WARM_TOKEN = ord("7")


def sender_warm_start(seed: int, num_objects: int = 4) -> Iterator[tuple[str, list[int]]]:
    """Warm-start pairs: the sender's prompts (every target) answered with :data:`WARM_TOKEN`."""
    candidates = OBJECTS[:num_objects]
    index = seed
    while True:
        yield f"obj:{candidates} tgt:{candidates[index % num_objects]}>", [WARM_TOKEN]
        index += 1
