"""Several signaling pairs in one episode, for jobs whose agents are LoRA adapters of one base.

``pairs`` pairs ``sender<i>``/``receiver<i>`` each play examples/signaling's game on the episode's
task, pair ``i`` with the target shifted by ``i`` (so the pairs do not learn one code): the same
prompts, the same modular reading of an answer (examples/signaling/env.py explains both), and
a 0/1 reward per pair, given to both of its agents. With ``observer`` a further agent,
``observer`` (a full-model agent in examples/signaling_lora/job.yaml's mixed variant), reads
pair 0's message and answers too, rewarded by its own success. ``dense`` replaces every 0/1
reward by ``(message ids + answer id) mod 7 / 6`` (tests/e2e/dense_signaling.py's reward), so a
2-step job of random-init models has a gradient.
"""

from __future__ import annotations

from examples.signaling.env import SignalingGame
from flexmarl import EpisodeContext, Task

MAX_PAIRS = 8
DENSE_LEVELS = 7


def pair_agents(pairs: int, observer: bool = False) -> tuple[str, ...]:
    """The agents of a game of ``pairs`` pairs (and the observer)."""
    names = tuple(name for i in range(pairs) for name in (f"sender{i}", f"receiver{i}"))
    return (*names, "observer") if observer else names


class PairedSignaling(SignalingGame):
    """``pairs`` independent signaling pairs per episode (config: SignalingGame's, plus ``pairs``, ``observer``,
    ``dense``)."""

    def __init__(self, *, num_objects: int = 4, shuffle_candidates: bool = False, message_tokens: int = 1,
                 pairs: int = 4, observer: bool = False, dense: bool = False) -> None:
        super().__init__(num_objects=num_objects, shuffle_candidates=shuffle_candidates, message_tokens=message_tokens)
        self.config.update(pairs=pairs, observer=observer, dense=dense)
        self.pairs = int(pairs)
        self.observer = bool(observer)
        self.dense = bool(dense)
        if not 1 <= self.pairs <= MAX_PAIRS:
            raise ValueError(f"pairs must be in 1..{MAX_PAIRS}")
        if self.shuffle_candidates:
            raise ValueError("PairedSignaling plays the fixed candidate order (shuffle_candidates false)")
        self.agents = pair_agents(self.pairs, self.observer)

    def _reward(self, message: tuple[int, ...], answer: tuple[int, ...], target: int) -> float:
        if self.dense:
            return ((sum(message) + sum(answer)) % DENSE_LEVELS) / (DENSE_LEVELS - 1)
        return 1.0 if answer and self.position_of(answer[0]) == target else 0.0

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Each pair plays once, in turn; then the observer answers pair 0's message."""
        candidates: str = task.data["candidates"]
        first_message: tuple[int, ...] = ()
        for pair in range(self.pairs):
            target = (task.data["target"] + pair) % self.num_objects
            message = await ctx.generate(f"sender{pair}", candidates[target], max_new_tokens=self.message_tokens)
            answer = await ctx.generate(f"receiver{pair}", ctx.tokenize(f"receiver{pair}", ">")
                                        + list(message.token_ids), max_new_tokens=1)
            reward = self._reward(message.token_ids, answer.token_ids, target)
            ctx.reward(f"sender{pair}", reward)
            ctx.reward(f"receiver{pair}", reward)
            if pair == 0:
                first_message = message.token_ids
        if self.observer:
            guess = await ctx.generate("observer", ctx.tokenize("observer", ">") + list(first_message),
                                       max_new_tokens=1)
            ctx.reward("observer", self._reward(first_message, guess.token_ids, task.data["target"]))
