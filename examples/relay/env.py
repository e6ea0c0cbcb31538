"""Three-agent relay game: a speaker names the target to a relay, the relay passes it on, a listener answers.

The speaker sees the target (one of K objects) and emits one token; the relay sees only that
token and emits one token of its own; the listener sees only the relay's token and answers with
one token, read as a position (token id mod K, as in examples/signaling/env.py, so an untrained
trio scores chance, 1/K, and every GRPO group has variance from the first step). Every agent
gets the shared 0/1 success, so the reported mean reward is the accuracy.

With ``shaped`` (the default) the speaker's and the relay's turns train on the listener's
probability of the target (its top logprobs, left in ``ctx.notes`` and read back by
:meth:`RelayGame.shape_reward` through the episode): a dense, lower-variance stand-in for the
0/1 success that still ranks messages when the listener never names the target. The listener
trains on the success. docs/environments.md walks through this file.
"""

from __future__ import annotations

import math

from flexmarl import Environment, EpisodeContext, EpisodeRecord, Task, TurnRecord, task_rng

OBJECTS = "abcdefghij"


class RelayGame(Environment):
    """Speaker -> relay -> listener; config: ``num_objects`` (K), ``shaped``, ``listener_top_logprobs``."""

    agents = ("speaker", "relay", "listener")

    def __init__(self, *, num_objects: int = 2, shaped: bool = True, listener_top_logprobs: int = 320) -> None:
        super().__init__(num_objects=num_objects, shaped=shaped, listener_top_logprobs=listener_top_logprobs)
        if not 2 <= num_objects <= len(OBJECTS):
            raise ValueError(f"num_objects must be in 2..{len(OBJECTS)}")
        if shaped and listener_top_logprobs < 1:
            raise ValueError("shaped needs listener_top_logprobs >= 1 (the listener's distribution)")
        self.num_objects = num_objects
        self.shaped = shaped
        self.listener_top_logprobs = listener_top_logprobs if shaped else 0

    def task(self, index: int, seed: int) -> Task:
        """The target's position, drawn from the task's seeded stream."""
        return Task(index=index, seed=seed, data={"target": task_rng(index, seed).randrange(self.num_objects)})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """One token each, in turn; every agent gets the success."""
        target: int = task.data["target"]
        said = await ctx.generate("speaker", OBJECTS[target], max_new_tokens=1)
        # Token ids travel verbatim (no re-tokenized text): any token is a usable signal.
        passed = await ctx.generate("relay", ctx.tokenize("relay", "~") + list(said.token_ids), max_new_tokens=1)
        answer = await ctx.generate("listener", ctx.tokenize("listener", ">") + list(passed.token_ids),
                                    max_new_tokens=1, top_logprobs_num=self.listener_top_logprobs)
        won = bool(answer.token_ids) and answer.token_ids[0] % self.num_objects == target
        if answer.top_logprobs:
            ctx.notes["listener_probability"] = self.probability_of(answer.top_logprobs[0], target)
        for agent in self.agents:
            ctx.reward(agent, 1.0 if won else 0.0)

    def probability_of(self, top: tuple[tuple[float, int], ...], target: int) -> float:
        """The listener's probability of naming ``target``; mass outside ``top`` counts 1/K per position."""
        named = math.fsum(math.exp(lp) for lp, token in top if token % self.num_objects == target)
        rest = max(0.0, 1.0 - math.fsum(math.exp(lp) for lp, _ in top))
        return min(1.0, named + rest / self.num_objects)

    def shape_reward(self, task: Task, turn: TurnRecord, reward: float, *, episode: EpisodeRecord) -> float:
        """The speaker and the relay train on the listener's probability of the target (when shaped)."""
        if not self.shaped or turn.agent == "listener":
            return reward
        return float(episode.notes.get("listener_probability", reward))
