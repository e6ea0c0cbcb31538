"""The sampling seed of a held-out episode: the same in every round and job of one seed; only the weights differ.

Training tasks already sample the same tokens in any job of one spec and seed (sync against async runs: the
seed leaves the job id out). A held-out task's seed used to carry its round id, and a pinned round's its job
id too (served as ``<job>@<round>``, whose prefix was not stripped): two jobs' rounds on the same weights drew
different samples, and every point of a sampled curve its own noise.
"""

from __future__ import annotations

from typing import Any

import pytest

from flexmarl.ids import EvalTaskRef, TaskRef
from rolloutd.balancer import episode_affinity_key
from rolloutd.job_backend import JobBackend, request_seed

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """Stands in for RolloutRouter.generate: keeps the key and seed each request went out with."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    async def generate(self, key: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[Any]:
        self.sent.append((key, sampling["sampling_seed"]))
        return []


async def seed_of(backend: JobBackend, recorder: Recorder, task_id: str) -> int:
    await backend.generate("solver", [5, 6], {"max_new_tokens": 4}, 1, episode_affinity_key(task_id, 1))
    return recorder.sent[-1][1]


async def test_a_held_out_task_draws_the_same_numbers_in_every_round_and_job_and_training_tasks_as_before() -> None:
    recorder = Recorder()
    sync = JobBackend(recorder, "sync-job", 7)  # type: ignore[arg-type]
    other = JobBackend(recorder, "async-job", 7)  # type: ignore[arg-type]
    pinned = JobBackend(recorder, "async-job@d3", 7, seed_scope="async-job")  # type: ignore[arg-type]
    seeds = {await seed_of(sync, recorder, str(EvalTaskRef("sync-job", "v2", 4))),
             await seed_of(sync, recorder, str(EvalTaskRef("sync-job", "v6", 4))),
             await seed_of(other, recorder, str(EvalTaskRef("async-job", "v2", 4))),
             await seed_of(pinned, recorder, str(EvalTaskRef("async-job", "d3", 4)))}
    assert len(seeds) == 1
    assert recorder.sent[-1][0] == "async-job@d3/solver"  # served under the round's own key
    # another held-out task, sample or seed draws other numbers
    assert await seed_of(sync, recorder, str(EvalTaskRef("sync-job", "v2", 5))) not in seeds
    assert await seed_of(JobBackend(recorder, "sync-job", 8), recorder,  # type: ignore[arg-type]
                         str(EvalTaskRef("sync-job", "v2", 4))) not in seeds
    # a training task's seed leaves only the job id out, as before
    training = await seed_of(sync, recorder, str(TaskRef("sync-job", 3, 1)))
    assert training == request_seed(7, "solver", "b3/t1#1", [5, 6])
    assert training == await seed_of(other, recorder, str(TaskRef("async-job", 3, 1)))
