"""orchestratord never answers on top of a change it failed to write (etcd unreachable past its retries)."""

from __future__ import annotations

import json
import types
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.errors import Unavailable
from orchestratord.coordinator import JobCoordinator
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.state import InMemoryStateStore

from .helpers import spec_dict


class FlakyStore(InMemoryStateStore):
    """An in-memory state store whose job creation fails while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def create_job(self, job_id: str, spec_json: str, agents: Iterable[str], created_s: float) -> bool:
        if self.down:
            raise Unavailable("etcd unreachable (test)")
        return await super().create_job(job_id, spec_json, agents, created_s)


def _service(store: FlakyStore) -> JobCoordinator:
    registry: Any = types.SimpleNamespace(prefix="/test")  # never called: nothing here reaches etcd or stored
    service = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
    service.state = store
    return service


@pytest.mark.timeout(30)
async def test_a_failed_write_is_written_before_the_next_reply() -> None:
    store = FlakyStore()
    service = _service(store)
    spec_json = json.dumps(spec_dict())
    store.down = True
    with pytest.raises(Unavailable):
        await service.submit_job(spec_json, "job-a")
    assert await store.load_job("job-a") is None  # the caller was told it failed; nothing durable yet

    store.down = False
    # The retry is idempotent in the planner (same id, same spec), so it changes nothing in memory;
    # the job must still reach the store before this reply.
    assert await service.submit_job(spec_json, "job-a") == "job-a"
    persisted = await store.load_job("job-a")
    assert persisted is not None
    assert sorted(persisted.agents) == sorted(a["name"] for a in spec_dict()["agents"])


@pytest.mark.timeout(30)
async def test_any_later_mutation_writes_the_left_over_change_first() -> None:
    store = FlakyStore()
    service = _service(store)
    store.down = True
    with pytest.raises(Unavailable):
        await service.submit_job(json.dumps(spec_dict()), "job-a")
    store.down = False
    await service.submit_job(json.dumps(spec_dict(name="other")), "job-b")
    assert await store.load_job("job-a") is not None
    assert await store.load_job("job-b") is not None
