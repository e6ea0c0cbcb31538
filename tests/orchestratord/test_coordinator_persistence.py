"""orchestratord never answers on top of a change it failed to write (etcd unreachable past its retries);
marking a committed step consumed in stored outlives a stored restart."""

from __future__ import annotations

import json
import types
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.errors import InvalidArgument, Unavailable
from flexmarl.ids import StepRef
from flexmarl.retry import RetryPolicy
from orchestratord import coordinator as coordinator_module
from orchestratord.coordinator import JobCoordinator
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.state import InMemoryStateStore, StepCommit

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


def _coordinator(store: FlakyStore) -> JobCoordinator:
    registry: Any = types.SimpleNamespace(prefix="/test")  # never called: nothing here reaches etcd or stored
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
    coordinator.state = store
    return coordinator


@pytest.mark.timeout(30)
async def test_a_failed_write_is_written_before_the_next_reply() -> None:
    store = FlakyStore()
    coordinator = _coordinator(store)
    spec_json = json.dumps(spec_dict())
    store.down = True
    with pytest.raises(Unavailable):
        await coordinator.submit_job(spec_json, "job-a")
    assert await store.load_job("job-a") is None  # the caller was told it failed; nothing durable yet

    store.down = False
    # The retry is idempotent in the planner (same id, same spec), so it changes nothing in memory;
    # the job must still reach the store before this reply.
    assert await coordinator.submit_job(spec_json, "job-a") == "job-a"
    persisted = await store.load_job("job-a")
    assert persisted is not None
    assert sorted(persisted.agents) == sorted(a["name"] for a in spec_dict()["agents"])


@pytest.mark.timeout(30)
async def test_any_later_mutation_writes_the_left_over_change_first() -> None:
    store = FlakyStore()
    coordinator = _coordinator(store)
    store.down = True
    with pytest.raises(Unavailable):
        await coordinator.submit_job(json.dumps(spec_dict()), "job-a")
    store.down = False
    await coordinator.submit_job(json.dumps(spec_dict(name="other")), "job-b")
    assert await store.load_job("job-a") is not None
    assert await store.load_job("job-b") is not None


class FlakyStored:
    """Stands in for the coordinator's stored connection: ``mark`` fails with the queued errors first."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.marks: list[tuple[str, str, str, list[str]]] = []
        self.resets = 0

    async def store(self) -> FlakyStored:
        return self

    async def reset_store(self) -> None:
        self.resets += 1

    async def mark(self, job_id: str, agent: str, step_id: str, ids: Iterable[str], state: object) -> int:
        if self.errors:
            raise self.errors.pop(0)
        self.marks.append((job_id, agent, step_id, list(ids)))
        return len(self.marks[-1][3])


@pytest.mark.timeout(30)
async def test_marking_consumed_rediscovers_stored_while_unavailable_and_gives_up_on_other_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coordinator_module, "MARK_CONSUMED_RETRY", RetryPolicy(0.01, 0.01))
    state = FlakyStore()
    coordinator = _coordinator(state)
    await state.create_job("job-a", "{}", ["alice"], 1.0)
    for step in (0, 1):
        await state.commit_step(StepCommit("job-a", "alice", step, f"file:///w{step}", "", "slot", 2.0 + step))
    stored = FlakyStored(Unavailable("stored restarting"), Unavailable("stored restarting"))
    coordinator._peers = stored  # type: ignore[assignment]
    await coordinator._mark_consumed("job-a", "alice", 0, ["e1", "e2"])
    assert stored.resets == 2  # rediscovered after each Unavailable
    assert stored.marks == [("job-a", "alice", str(StepRef("job-a", "alice", 0)), ["e1", "e2"])]
    persisted = await state.load_job("job-a")
    assert persisted is not None and persisted.pending_marks == {("alice", 1)}  # confirmed: cleared

    stored = FlakyStored(InvalidArgument("bad step"))
    coordinator._peers = stored  # type: ignore[assignment]
    await coordinator._mark_consumed("job-a", "alice", 1, ["e3"])  # logged, not raised, not retried
    assert (stored.resets, stored.marks) == (0, [])
