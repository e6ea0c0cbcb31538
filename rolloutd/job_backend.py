"""A job's view of the router: agent names without the job prefix, and seeded sampling per episode.

:class:`JobBackend` is what a job's episode runner generates through (``rolloutd.runner.GenerationBackend``);
:func:`request_seed` is the seed a seeded job's request samples with, a function of the job seed, the
agent, the episode and the prompt only, so the same job and seed roll out the same experiences in
sync and async mode, on any replica.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from flexmarl.episode import GenerationOutput

#: The round part of an evaluation task's episode key after its job (``e<round>/``, :class:`flexmarl.ids.EvalTaskRef`).
_EVAL_ROUND_PART = re.compile(r"e[vd][0-9]+/")


class Generator(Protocol):
    """What a job generates through (:class:`rolloutd.router.RolloutRouter`)."""

    async def generate(
        self, key: str, input_ids: list[int], sampling: Mapping[str, Any], n: int, affinity_key: str,
        seed: int | None = None,
    ) -> list[GenerationOutput]:
        """Samples ``n`` responses of agent ``key`` (``"<job>/<agent>"``)."""


def agent_key(job_id: str, agent: str) -> str:
    """The router's name of an agent of a job."""
    return f"{job_id}/{agent}"


def request_seed(job_seed: int, key: str, affinity_key: str, input_ids: Sequence[int]) -> int:
    """A sampling seed fixed by the job seed, the agent, the episode and the prompt."""
    digest = hashlib.sha256(f"{job_seed}|{key}|{affinity_key}|".encode())
    digest.update(",".join(map(str, input_ids)).encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 2


class JobBackend:
    """GenerationBackend of one job (agent names without the job prefix)."""

    def __init__(self, router: Generator, job_id: str, seed: int | None, seed_scope: str = "") -> None:
        self._router = router
        self._job_id = job_id
        self._seed = seed
        self._seed_scope = seed_scope or job_id

    async def generate(
        self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int, affinity_key: str
    ) -> list[GenerationOutput]:
        """See rolloutd.runner.GenerationBackend."""
        if self._seed is not None and sampling.get("sampling_seed") is None:
            # The seed must not depend on the job id (the agent key and the task ids carry it):
            # the same spec and seed then sample the same tokens in any job (sync vs async runs).
            episode = affinity_key.removeprefix(f"{self._seed_scope}/")
            # A held-out task draws the same numbers in every round, periodic or pinned: between rounds, and
            # between jobs of one seed, only the weights differ (common random numbers for a curve's points).
            if (round_part := _EVAL_ROUND_PART.match(episode)) is not None:
                episode = "e/" + episode[round_part.end():]
            sampling = {**sampling, "sampling_seed": request_seed(self._seed, agent, episode, input_ids)}
        return await self._router.generate(agent_key(self._job_id, agent), input_ids, sampling, n, affinity_key)


__all__ = ["Generator", "JobBackend", "agent_key", "request_seed"]
