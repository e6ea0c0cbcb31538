"""A two-agent environment over a dataset, with no task code: the sender reads the row's question.

Its tasks are the job's ``environment.dataset`` rows (``Environment.task``'s default), so the
sender's prompt in every stored experience names the row its task played. The reward is dense
(a function of the sampled ids, as in dense_signaling.py) so every step has a gradient.
"""

from __future__ import annotations

from flexmarl.episode import Environment, EpisodeContext, Task

REWARD_LEVELS = 7


class DatasetRows(Environment):
    """sender: the row's question -> one token; receiver: that token -> one token."""

    agents = ("sender", "receiver")

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        message = await ctx.generate("sender", str(task.data["question"]), max_new_tokens=1)
        answer = await ctx.generate("receiver", ctx.tokenize("receiver", "msg:") + list(message.token_ids),
                                    max_new_tokens=1)
        reward = ((sum(message.token_ids) + sum(answer.token_ids)) % REWARD_LEVELS) / (REWARD_LEVELS - 1)
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)
