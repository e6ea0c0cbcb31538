"""Two-agent referential (signaling) game, learnable by tiny byte-level models on CPU.

A sender sees the target among K objects and emits a one-token message; a receiver sees
the message (and the candidate list) and answers the target's position as one digit. Both
get reward 1 when the answer is right, else 0; chance is 1/K. Prompts are short, fixed
format raw strings (no chat template) so a randomly initialised byte-level model only has
to learn two small mappings: target -> message byte, message byte -> digit.

Sender prompt:   "obj:{candidates} tgt:{target}>"     e.g. "obj:abcd tgt:c>"
Receiver prompt: "obj:{candidates} msg:{message}>"    e.g. "obj:abcd msg:X>"  (answer "2")
"""

from __future__ import annotations

from typing import Any

from rolloutd.episode import Environment, EpisodeContext, Task, task_rng

OBJECTS = "abcdefghij"


class SignalingGame(Environment):
    """Config: num_objects (K, 2..10, default 4), shuffle_candidates (default False),
    message_tokens (default 1)."""

    agents = ("sender", "receiver")

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.num_objects = int(config.get("num_objects", 4))
        self.shuffle_candidates = bool(config.get("shuffle_candidates", False))
        self.message_tokens = int(config.get("message_tokens", 1))
        if not 2 <= self.num_objects <= len(OBJECTS):
            raise ValueError(f"num_objects must be in 2..{len(OBJECTS)}")
        if not 1 <= self.message_tokens <= 2:
            raise ValueError("message_tokens must be 1 or 2")

    def task(self, index: int, seed: int) -> Task:
        rng = task_rng(index, seed)
        candidates = list(OBJECTS[: self.num_objects])
        if self.shuffle_candidates:
            rng.shuffle(candidates)
        target = rng.randrange(self.num_objects)
        return Task(index=index, seed=seed, data={"candidates": "".join(candidates), "target": target})

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        candidates: str = task.data["candidates"]
        target: int = task.data["target"]
        message = await ctx.generate(
            "sender", f"obj:{candidates} tgt:{candidates[target]}>", max_new_tokens=self.message_tokens
        )
        # The receiver sees the sender's tokens verbatim (ids, not re-tokenized text), so
        # any token (even a special one) is a usable signal.
        receiver_prompt = (
            ctx.tokenize("receiver", f"obj:{candidates} msg:") + list(message.token_ids) + ctx.tokenize("receiver", ">")
        )
        answer = await ctx.generate("receiver", receiver_prompt, max_new_tokens=1)
        reward = 1.0 if answer.text.strip()[:1] == str(target) else 0.0
        ctx.reward("sender", reward)
        ctx.reward("receiver", reward)
