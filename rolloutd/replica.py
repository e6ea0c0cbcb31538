"""One engine replica as :class:`rolloutd.router.RolloutRouter` sees it: its engine, weights, locks and requests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator

from rolloutd.engines.protocol import EngineClient
from rolloutd.lora_residency import LoraResidency
from rolloutd.replica_lock import ReplicaLock


@dataclasses.dataclass
class Replica:
    """One engine replica as the router sees it."""

    replica_id: str
    client: EngineClient
    loaded_agent: str = ""
    loaded_version: int = -1
    healthy: bool = True
    lock: ReplicaLock = dataclasses.field(default_factory=ReplicaLock)
    # One would-be reloader at a time; the others wait here (not for the replica's readers), so
    # requests that find the reload done go straight to generation instead of queueing behind
    # each other's generations for the write lock.
    reload_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    reloads: int = 0
    #: Reloads that paused running generations (partial rollouts).
    interruptions: int = 0
    #: Moves away from a partial-rollout agent that handed its running generations on (aborted, resumed elsewhere).
    evictions: int = 0
    #: The aborts those hand-overs made (the first of each, and its repeats: RolloutRouter._evict).
    eviction_aborts: int = 0
    #: The LoRA adapters it holds while it serves a base's pool (made on its first adapter request).
    lora: LoraResidency | None = None
    #: Requests routed to it and not yet answered (a weight load they wait for included), and when it
    #: last answered one (or, idle, when its first request came): what tells a hung engine (:meth:`hung_s`).
    requests_in_flight: int = 0
    last_answer_s: float = 0.0
    #: The KV-cache tokens its engine holds (``/server_info`` ``max_total_num_tokens``): None until read,
    #: inf where the engine does not say.
    kv_capacity_tokens: float | None = None

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Counts one request in flight; its answer shows the replica alive (an error or a cancellation does not)."""
        if self.requests_in_flight == 0:
            self.last_answer_s = time.monotonic()
        self.requests_in_flight += 1
        answered = False
        try:
            yield
            answered = True
        finally:
            self.requests_in_flight -= 1
            if answered:
                self.last_answer_s = time.monotonic()

    def hung_s(self, now_s: float) -> float:
        """Seconds it has held requests without answering any (0 when it holds none)."""
        return now_s - self.last_answer_s if self.requests_in_flight else 0.0
