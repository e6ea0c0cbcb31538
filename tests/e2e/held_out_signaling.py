"""DenseSignaling with held-out tasks whose outcome is fixed by the task, so an evaluation's metrics are known.

Held-out task i plays the game's two turns (so the versions that answered are recorded) and then
rewards by its index alone (over a task file: by its row's ``held_out`` field): the sender 1.0 when
it is even, the receiver 0.5, and the team succeeds (``ctx.notes["success"]``) when it is 0.
tests/e2e/test_evaluation_e2e.py computes the expected figures by hand from this.
"""

from __future__ import annotations

from dense_signaling import DenseSignaling

from flexmarl.episode import EpisodeContext, Task


class HeldOutSignaling(DenseSignaling):
    """Training tasks as DenseSignaling's; held-out task i rewarded by i (see the module doc)."""

    def eval_task(self, index: int, seed: int) -> Task:
        task = super().eval_task(index, seed)  # over a task file: its row (candidates, target, held_out)
        return Task(task.index, task.seed, {"held_out": index, **task.data})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        if "held_out" not in task.data:
            await super().episode(ctx, task)
            return
        candidates: str = task.data["candidates"]
        message = await ctx.generate("sender", f"obj:{candidates} tgt:{candidates[task.data['target']]}>",
                                     max_new_tokens=1)
        await ctx.generate("receiver", ctx.tokenize("receiver", f"obj:{candidates} msg:") + list(message.token_ids),
                           max_new_tokens=1)
        index = int(task.data["held_out"])
        ctx.reward("sender", 1.0 if index % 2 == 0 else 0.0)
        ctx.reward("receiver", 0.5)
        ctx.notes["success"] = index == 0
        ctx.notes["role_correct"] = {"solver": 1.0 if index % 2 == 0 else 0.0}  # as a workflow's roles
