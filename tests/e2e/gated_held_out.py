"""HeldOutSignaling whose held-out tasks past the first wait for a gate file, and which logs each one played.

``gate_dir``: held-out task i > 0 waits (up to ``GATE_WAIT_S``) until ``<gate_dir>/open`` exists, and each
held-out episode that finishes appends its task index to ``<gate_dir>/played``. So a test can hold an
evaluation round open with exactly task 0 finished, restart orchestratord, and count what was played
(tests/e2e/test_evaluation_e2e.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from held_out_signaling import HeldOutSignaling

from flexmarl.episode import EpisodeContext, Task

GATE_WAIT_S = 120.0


class GatedHeldOut(HeldOutSignaling):
    """See the module docstring."""

    def __init__(self, *, gate_dir: str = "", **config: Any) -> None:
        super().__init__(**config)
        self.gate_dir = Path(gate_dir) if gate_dir else None

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        index = task.data.get("held_out")
        if self.gate_dir is None or index is None:
            await super().episode(ctx, task)
            return
        deadline = time.monotonic() + GATE_WAIT_S
        while int(index) > 0 and not (self.gate_dir / "open").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await super().episode(ctx, task)
        with open(self.gate_dir / "played", "a") as played:
            played.write(f"{index}\n")
