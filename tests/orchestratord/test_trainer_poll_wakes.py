"""PollTrainerWork long polls wake when their slot may have work, not on every change (JobCoordinator)."""

from __future__ import annotations

import asyncio
import collections
import json
import time
import types
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from orchestratord.coordinator import JobCoordinator
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.planner import MicroBatchWork, RolloutTaskLease, TrainerWork
from orchestratord.state import InMemoryStateStore

from .helpers import experiences_for, spec_dict

AGENTS = ("sender", "receiver")
WAIT_MS = 4000


class CountedCoordinator:
    """A coordinator whose planner counts each slot's poll checks (each run of the long poll's predicate)."""

    def __init__(self) -> None:
        registry: Any = types.SimpleNamespace(prefix="/test")  # never called: nothing here reaches etcd or stored
        self.coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
        self.coordinator.state = InMemoryStateStore()
        self.checks: collections.Counter[str] = collections.Counter()
        poll = self.coordinator.planner.poll_trainer_work

        def counted(worker_id: str, slot_id: str, *args: Any, **kwargs: Any) -> TrainerWork | None:
            self.checks[slot_id] += 1
            return poll(worker_id, slot_id, *args, **kwargs)

        self.coordinator.planner.poll_trainer_work = counted  # type: ignore[method-assign]

    def poll(self, slot_id: str) -> asyncio.Task[TrainerWork | None]:
        return asyncio.get_running_loop().create_task(
            self.coordinator.poll_trainer_work(f"w-{slot_id}", slot_id, [], WAIT_MS))

    async def waiting(self, *slot_ids: str) -> None:
        """Until every given slot's poll found no work and sleeps."""
        while not all(slot_id in self.coordinator._trainer_polls.slots() for slot_id in slot_ids):
            await asyncio.sleep(0.005)

    async def ack(self, slot_id: str, work: TrainerWork | None) -> None:
        """The slot accumulated its micro-batch."""
        assert isinstance(work, MicroBatchWork)
        await self.coordinator.ack_micro_batch(work.lease_id, f"w-{slot_id}", slot_id, len(work.experience_ids))

    async def report(self, lease: RolloutTaskLease) -> None:
        await self.coordinator.report_task(lease.lease_id, "r0", lease.task_id, True, "",
                                           experiences_for(lease, AGENTS))


@pytest.mark.timeout(30)
async def test_a_poll_wakes_when_its_work_appears_and_sleeps_through_unrelated_changes() -> None:
    counted = CountedCoordinator()
    coordinator = counted.coordinator
    # One task forms one micro-batch of each agent (a group of 2 episodes per micro-batch).
    await coordinator.submit_job(json.dumps(spec_dict(batch={"prompts_per_step": 4, "group_size": 2,
                                                             "micro_batch_size": 2})), "job")
    polls = {slot: counted.poll(slot) for slot in ("s0", "s1")}
    await counted.waiting("s0", "s1")
    assert counted.checks == {"s0": 1, "s1": 1}

    # Rollout-side changes (leases, renewals) cannot give a trainer work: no check runs.
    leases = await coordinator.lease_rollout_tasks("r0", 4, 0)
    assert len(leases) == 4
    await coordinator.renew("r0", [lease.lease_id for lease in leases], [1] * len(leases))
    await asyncio.sleep(0.05)
    assert counted.checks == {"s0": 1, "s1": 1}

    # A report forms a micro-batch of each agent: both polls wake (both slots are free) and get work at once.
    started = time.monotonic()
    await counted.report(leases[0])
    works = {slot: await poll for slot, poll in polls.items()}
    assert time.monotonic() - started < 1.0  # woken, not the 4 s re-check
    assert all(isinstance(work, MicroBatchWork) for work in works.values())
    agent_of = {slot: work.agent for slot, work in works.items() if isinstance(work, MicroBatchWork)}
    assert sorted(agent_of.values()) == sorted(AGENTS)

    # Each slot accumulates its micro-batch, acks it and polls again: nothing more is ready, so both wait.
    counted.checks.clear()
    for slot in ("s1", "s0"):
        await counted.ack(slot, works[slot])
    polls = {slot: counted.poll(slot) for slot in ("s0", "s1")}
    await counted.waiting("s0", "s1")
    assert counted.checks == {"s0": 1, "s1": 1}

    # The next report forms a micro-batch of each agent: each bound slot is woken for its agent's.
    await counted.report(leases[1])
    works = {slot: await poll for slot, poll in polls.items()}
    assert {slot: getattr(work, "agent", None) for slot, work in works.items()} == agent_of
    assert counted.checks == {"s0": 2, "s1": 2}

    # s1 acks and waits again; s0's ack changes only s0's agent (s0 is busy): s1's check does not run.
    await counted.ack("s1", works["s1"])
    poll = counted.poll("s1")
    await counted.waiting("s1")
    await counted.ack("s0", works["s0"])
    await asyncio.sleep(0.05)
    assert counted.checks == {"s0": 2, "s1": 3}
    assert not poll.done()
    poll.cancel()


def test_the_slot_gauges_count_as_idle_the_slots_no_job_keeps_busy() -> None:
    """_observe_slots reads every slot's business in one pass per job (busy_slots), as slot_busy would per slot."""
    from .helpers import make_spec

    registry: Any = types.SimpleNamespace(prefix="/test")
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
    planner = coordinator.planner
    job = planner.submit_job("job", make_spec(batch={"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2}))
    for lease in planner.lease_rollout_tasks("r0", 2):
        planner.report_rollout_task(lease.lease_id, "r0", lease.task_id, True, "", experiences_for(lease, AGENTS))
    works = {slot: planner.poll_trainer_work(f"w-{slot}", slot) for slot in ("s0", "s1", "s2")}
    working = {slot for slot, work in works.items() if isinstance(work, MicroBatchWork)}
    assert working and len(working) < 3  # two agents, one slot each: one slot at least stays idle
    assert job.busy_slots() == working == {slot for slot in works if job.slot_busy(slot)}
    coordinator._observe_slots(2.0)
    assert coordinator._metrics.known_slots._value.get() == 3
    assert coordinator._metrics.bubble_seconds._value.get() == 2.0 * (3 - len(working))
