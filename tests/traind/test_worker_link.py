"""traind's worker loop over in-memory fakes of its links: no gRPC, no etcd, a real tiny engine.

One slot goes through a step as orchestratord would drive it: a failed poll (back-off), two
micro-batches (acked), the optimizer step (published, saved, committed), a swap-out, a swap-in
for the next step, and work it cannot do (reported as a slot failure).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry

from flexmarl.cli import materialize_models
from flexmarl.experience import ExperienceRecord
from flexmarl.jobspec import spec_digest
from flexmarl.store_client import StoreClient
from traind.link import OrchestratorCallError
from traind.metrics import TrainerMetrics
from traind.work import (
    MicroBatchWork,
    OptimizerStepWork,
    ResidentAgent,
    SlotEvent,
    SlotEventKind,
    StepCommit,
    SwapOutWork,
    TrainerWork,
)
from traind.worker import TrainerSettings, TrainerWorker

from .conftest import make_group

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB, AGENT = "job", "sender"


class FakeOrchestrator:
    """An in-memory OrchestratorLink: scripted work per poll, every call recorded."""

    def __init__(self, spec_json: str, script: Sequence[TrainerWork | Exception]) -> None:
        self.spec_json = spec_json
        self.script: asyncio.Queue[TrainerWork | Exception] = asyncio.Queue()
        for item in script:
            self.script.put_nowait(item)
        self.polled_resident: list[list[ResidentAgent]] = []
        self.polled_capacity: set[float] = set()
        self.acks: list[tuple[str, str, int]] = []
        self.commits: list[StepCommit] = []
        self.events: list[SlotEvent] = []
        self.spec_fetches = 0
        self.renewals: list[tuple[str, ...]] = []
        self.progress: list[tuple[int, ...]] = []  # each renewal's progress figures
        self.lost: set[str] = set()  # leases a renewal reports lost
        self._changed = asyncio.Condition()

    async def poll_work(self, slot_id: str, resident: Sequence[ResidentAgent], wait_ms: int,
                        dp_address: str, *, capacity: float = 1.0) -> TrainerWork | None:
        self.polled_resident.append(list(resident))
        self.polled_capacity.add(capacity)
        try:
            item = await asyncio.wait_for(self.script.get(), wait_ms / 1000)
        except TimeoutError:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    async def _record(self, into: list[Any], value: Any) -> None:
        async with self._changed:
            into.append(value)
            self._changed.notify_all()

    async def ack_micro_batch(self, slot_id: str, lease_id: str, episodes: int) -> None:
        await self._record(self.acks, (slot_id, lease_id, episodes))

    async def renew_leases(self, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> frozenset[str]:
        self.progress.append(tuple(progress))
        await self._record(self.renewals, tuple(lease_ids))
        return frozenset(lease_ids) & frozenset(self.lost)

    async def commit_step(self, commit: StepCommit) -> None:
        await self._record(self.commits, commit)

    async def report_slot_event(self, event: SlotEvent) -> None:
        await self._record(self.events, event)

    async def job_spec(self, job_id: str) -> str:
        self.spec_fetches += 1
        return self.spec_json

    async def until(self, done: Callable[[], bool], timeout_s: float = 120) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(done)


class FakeStore:
    """An in-memory StoreLink holding experiences (no blobs: the test's states and weights are files).

    ``hold``: when set, a read waits for it (a slow stored, or anything that keeps a micro-batch long).
    """

    def __init__(self, records: Sequence[ExperienceRecord], hold: asyncio.Event | None = None) -> None:
        self.records = {r.experience_id: r for r in records}
        self.hold = hold

    async def read_experiences(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        if self.hold is not None:
            await self.hold.wait()
        return [self.records[i] for i in ids]

    async def client(self) -> StoreClient:
        raise AssertionError("nothing in this scenario lives in stored")

    def client_if_open(self) -> StoreClient | None:
        return None


def _micro_batch(index: int, group: Sequence[ExperienceRecord], *, step: int, step_id: str, base_version: int,
                 state_uri: str, digest: str, step_episodes: int) -> MicroBatchWork:
    return MicroBatchWork(lease_id=f"lease-{step_id}-{index}", job_id=JOB, agent=AGENT, step=step, step_id=step_id,
                          micro_batch_index=index, experience_ids=tuple(r.experience_id for r in group),
                          base_version=base_version, state_uri=state_uri, step_episodes=step_episodes,
                          spec_digest=digest)


@pytest.mark.timeout(240)
async def test_one_slot_steps_swaps_and_fails_over_fake_links(tmp_path: Path) -> None:
    raw: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "signaling" / "job.yaml").read_text())
    spec_json = json.dumps(materialize_models(raw, tmp_path / "models"))
    digest = spec_digest(spec_json)
    rng = np.random.default_rng(0)
    groups = [make_group(rng, f"t{i}", AGENT, 4) for i in range(3)]
    tokens = sum(r.response_tokens for g in groups[:2] for r in g)
    step0 = [_micro_batch(i, groups[i], step=0, step_id="s0", base_version=0, state_uri="", digest=digest,
                          step_episodes=8) for i in range(2)]
    orchestrator = FakeOrchestrator(spec_json, [
        OrchestratorCallError("PollTrainerWork", "orchestratord restarting"),
        *step0,
        OptimizerStepWork(job_id=JOB, agent=AGENT, step=0, step_id="s0", new_version=1, step_response_tokens=tokens,
                          step_episodes=8, num_micro_batches=2, base_version=0, state_uri="", spec_digest=digest),
        SwapOutWork(job_id=JOB, agent=AGENT, location="file"),
    ])
    from flexmarl import devicemodel

    profile = devicemodel.H100_SXM.with_changes(token_scale=4.0, time_scale=1e-5, trace_dir=str(tmp_path / "traces"))
    settings = TrainerSettings(worker_id="traind-fake", slots=1, work_dir=tmp_path / "work", state_location="file",
                               publish_location="file", slot_capacities=(2.0,), device_profile=profile)
    worker = TrainerWorker(settings, TrainerMetrics(CollectorRegistry()), orchestrator, FakeStore(
        [r for g in groups for r in g]))
    slot_id = worker.slots[0].slot_id
    await worker.start()
    try:
        await orchestrator.until(lambda: len(orchestrator.events) == 1)
        assert orchestrator.acks == [(slot_id, "lease-s0-0", 4), (slot_id, "lease-s0-1", 4)]
        (commit,) = orchestrator.commits
        assert (commit.slot_id, commit.job_id, commit.agent, commit.step, commit.new_version) == (
            slot_id, JOB, AGENT, 0, 1)
        assert np.isfinite(commit.loss) and commit.grad_norm > 0 and commit.step_seconds > 0
        assert any(Path(urlparse(commit.weights_uri).path).iterdir())
        swapped = orchestrator.events[0]
        assert (swapped.kind, swapped.slot_id, swapped.job_id, swapped.agent) == (
            SlotEventKind.SWAPPED_OUT, slot_id, JOB, AGENT)
        assert swapped.state_uri.startswith("file://") and worker.slots[0].trainer is None
        # The polls told orchestratord what the slot held: nothing, then v0 while it trained, then v1.
        assert ResidentAgent(JOB, AGENT, 1) in [r for rs in orchestrator.polled_resident for r in rs]
        assert orchestrator.polled_capacity == {2.0}  # every poll reports the slot's capacity

        # Step 1: swapped back in from where it went, one micro-batch, then a step it did not accumulate.
        orchestrator.script.put_nowait(_micro_batch(0, groups[2], step=1, step_id="s1", base_version=1,
                                                    state_uri=swapped.state_uri, digest=digest, step_episodes=4))
        await orchestrator.until(lambda: len(orchestrator.acks) == 3)
        # Modelled device time: the swap-in moved the agent's state over the link (the first build, from the
        # base model at version 0, did not).
        kinds = [r["kind"] for records in devicemodel.read_traces(tmp_path / "traces").values() for r in records]
        assert kinds.count("swap") == 1 and kinds.count("optimizer") == 1 and kinds.count("train") == 3
        (status,) = worker.status()
        assert (status.slot_id, status.resident, status.dp_group_id, status.dp_world_size, status.capacity) == (
            slot_id, ResidentAgent(JOB, AGENT, 1), "", 1, 2.0)
        from traind import serde

        assert serde.slot_status(status).capacity == 2.0  # GetTrainerStatus shows it
        orchestrator.script.put_nowait(OptimizerStepWork(
            job_id=JOB, agent=AGENT, step=1, step_id="s1-replay", new_version=2, step_response_tokens=1,
            step_episodes=4, num_micro_batches=1, base_version=1, state_uri=swapped.state_uri, spec_digest=digest))
        await orchestrator.until(lambda: len(orchestrator.events) == 2)
        failed = orchestrator.events[1]
        assert (failed.kind, failed.job_id, failed.agent) == (SlotEventKind.FAILED, JOB, AGENT)
        assert "not the step accumulated" in failed.error
        assert worker.slots[0].trainer is None and worker.status()[0].resident is None
        assert len(orchestrator.commits) == 1 and orchestrator.spec_fetches == 1
    finally:
        await worker.stop()


@pytest.mark.timeout(120)
async def test_a_micro_batch_keeps_its_lease_renewed_while_the_slot_works_on_it(tmp_path: Path) -> None:
    """A micro-batch that outlasts its lease (a warm start, a slow read) is renewed, then no more once acked."""
    raw: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "signaling" / "job.yaml").read_text())
    raw["leases"] = {**raw.get("leases", {}), "train_timeout_s": 1}  # renewed every 1/3 s
    spec_json = json.dumps(materialize_models(raw, tmp_path / "models"))
    digest = spec_digest(spec_json)
    groups = [make_group(np.random.default_rng(1), f"t{i}", AGENT, 4) for i in range(2)]
    first, second = (_micro_batch(i, groups[i], step=0, step_id="s0", base_version=0, state_uri="", digest=digest,
                                  step_episodes=8) for i in range(2))
    orchestrator = FakeOrchestrator(spec_json, [first])
    hold = asyncio.Event()
    settings = TrainerSettings(worker_id="traind-renew", slots=1, work_dir=tmp_path / "work", state_location="file",
                               publish_location="file")
    worker = TrainerWorker(settings, TrainerMetrics(CollectorRegistry()), orchestrator,
                           FakeStore([r for g in groups for r in g], hold))
    await worker.start()
    try:
        # The read of the first micro-batch waits: its lease (1 s) is renewed meanwhile, again and again.
        await orchestrator.until(lambda: len(orchestrator.renewals) >= 4)
        assert set(orchestrator.renewals) == {(first.lease_id,)} and not orchestrator.acks
        # Stuck in the read, the slot shows no progress (issue 36: orchestratord then stops renewing):
        # once its engine is built the figure it renews with stands still, renewal after renewal.
        await orchestrator.until(lambda: len(orchestrator.progress) >= 2
                                 and orchestrator.progress[-1] == orchestrator.progress[-2])
        stuck_at = len(orchestrator.progress)
        await orchestrator.until(lambda: len(orchestrator.renewals) >= stuck_at + 3)
        assert len(set(orchestrator.progress[stuck_at - 1:])) == 1, orchestrator.progress
        stuck_figure = orchestrator.progress[-1]
        hold.set()
        await orchestrator.until(lambda: len(orchestrator.acks) == 1)
        # The second one's lease is lost at its first renewal: renewing stops, the work goes on to its ack.
        hold.clear()
        orchestrator.lost.add(second.lease_id)
        orchestrator.script.put_nowait(second)
        await orchestrator.until(lambda: (second.lease_id,) in orchestrator.renewals)
        hold.set()
        await orchestrator.until(lambda: len(orchestrator.acks) == 2)
        assert orchestrator.renewals.count((second.lease_id,)) == 1  # renewed once, then given up
        # The first micro-batch's read and pass were progress: the second renews with a larger figure.
        second_figure = orchestrator.progress[orchestrator.renewals.index((second.lease_id,))]
        assert second_figure[0] > stuck_figure[0], (stuck_figure, second_figure)
        assert [a[1] for a in orchestrator.acks] == [first.lease_id, second.lease_id]
    finally:
        await worker.stop()


@pytest.mark.timeout(30)
async def test_a_slot_waiting_for_the_device_lock_counts_the_other_slots_work_as_progress(tmp_path: Path) -> None:
    """Two slots of one process compute one at a time: the one waiting behind a long warm start is not hung."""
    settings = TrainerSettings(worker_id="traind-wait", slots=2, work_dir=tmp_path / "work", state_location="file",
                               publish_location="file")
    worker = TrainerWorker(settings, TrainerMetrics(CollectorRegistry()), FakeOrchestrator("{}", []), FakeStore([]))
    busy, waiting = worker.slots
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with worker._device_turn(busy):
            entered.set()
            await release.wait()

    async def wait_turn() -> None:
        async with worker._device_turn(waiting):
            waiting.advance()

    holder = asyncio.create_task(hold())
    await asyncio.wait_for(entered.wait(), 10)
    waiter = asyncio.create_task(wait_turn())
    async with asyncio.timeout(10):
        while not waiting.waiting_for_device:
            await asyncio.sleep(0)
    assert not busy.waiting_for_device
    worker._credit_wait(waiting)
    start = waiting.progress
    worker._credit_wait(waiting)
    assert waiting.progress == start  # the holder did nothing (a stuck holder): the waiting slot shows nothing
    for _ in range(3):
        busy.advance()
    worker._credit_wait(waiting)
    worker._credit_wait(busy)
    assert (waiting.progress, waiting.own_progress) == (start + 3, 0)  # credited, never as its own work
    assert busy.progress == busy.own_progress == 3  # the holder is not credited with anything
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), 10)
    assert not waiting.waiting_for_device and waiting.own_progress == 1
    busy.advance()
    worker._credit_wait(waiting)
    assert waiting.progress == start + 4  # its own unit only: the wait is over


def test_serde_carries_every_field_of_the_work_messages() -> None:
    from flexmarl.v1 import orchestrator_pb2
    from traind import serde

    group = orchestrator_pb2.DataParallelGroup(group_id="job/sender/g2", rank=1, world_size=2,
                                               master_address="10.0.0.1:29500", member_slot_ids=["a", "b"],
                                               timeout_s=30)
    reply = orchestrator_pb2.PollTrainerWorkResponse(optimizer_step=orchestrator_pb2.OptimizerStepWork(
        job_id=JOB, agent=AGENT, step=3, step_id="s3", new_version=4, step_response_tokens=90, step_episodes=8,
        num_micro_batches=2, group=group, base_version=3, state_uri="file:///s", spec_digest="d"))
    work = serde.trainer_work(reply)
    assert work == OptimizerStepWork(job_id=JOB, agent=AGENT, step=3, step_id="s3", new_version=4,
                                     step_response_tokens=90, step_episodes=8, num_micro_batches=2, base_version=3,
                                     state_uri="file:///s", spec_digest="d", group=serde.data_parallel_group(group))
    assert work.group is not None and work.group.member_slot_ids == ("a", "b") and work.group.timeout_s == 30
    assert serde.trainer_work(orchestrator_pb2.PollTrainerWorkResponse()) is None
    assert serde.poll_request("w", "w/slot0", [], 100, "", 2.0).capacity == 2.0
    # A field added to a work message must reach the worker's dataclass too (the lease deadline is
    # orchestratord's to enforce: the worker never reads it).
    for message, cls in ((orchestrator_pb2.MicroBatchWork, MicroBatchWork),
                         (orchestrator_pb2.OptimizerStepWork, OptimizerStepWork),
                         (orchestrator_pb2.SwapOutWork, SwapOutWork),
                         (orchestrator_pb2.DataParallelGroup, type(work.group))):
        decoded = {f.name for f in dataclasses.fields(cls)}
        assert {f.name for f in message.DESCRIPTOR.fields} - {"deadline_unix_ms"} == decoded, cls


@pytest.mark.timeout(30)
async def test_the_grpc_link_decodes_work_and_maps_a_refused_call() -> None:
    import grpc
    import grpc.aio

    from flexmarl.connections import PeerConnections
    from flexmarl.errors import FailedPrecondition
    from flexmarl.v1 import orchestrator_pb2
    from traind.link import GrpcOrchestratorLink

    polls: list[orchestrator_pb2.PollTrainerWorkRequest] = []

    async def poll(request: orchestrator_pb2.PollTrainerWorkRequest, context: Any) -> Any:
        polls.append(request)
        return orchestrator_pb2.PollTrainerWorkResponse(micro_batch=orchestrator_pb2.MicroBatchWork(
            lease_id="l1", job_id=JOB, agent=AGENT, step_id="s0", experience_ids=["e1", "e2"], spec_digest="d"))

    async def ack(request: orchestrator_pb2.AckMicroBatchRequest, context: Any) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"lease {request.lease_id} expired")

    renewals: list[orchestrator_pb2.RenewLeasesRequest] = []

    async def renew(request: orchestrator_pb2.RenewLeasesRequest, context: Any) -> Any:
        renewals.append(request)
        return orchestrator_pb2.RenewLeasesResponse(lost_lease_ids=[i for i in request.lease_ids if i != "l1"])

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flexmarl.v1.Orchestrator", {
        "PollTrainerWork": grpc.unary_unary_rpc_method_handler(
            poll, request_deserializer=orchestrator_pb2.PollTrainerWorkRequest.FromString,
            response_serializer=orchestrator_pb2.PollTrainerWorkResponse.SerializeToString),
        "AckMicroBatch": grpc.unary_unary_rpc_method_handler(
            ack, request_deserializer=orchestrator_pb2.AckMicroBatchRequest.FromString,
            response_serializer=orchestrator_pb2.AckMicroBatchResponse.SerializeToString),
        "RenewLeases": grpc.unary_unary_rpc_method_handler(
            renew, request_deserializer=orchestrator_pb2.RenewLeasesRequest.FromString,
            response_serializer=orchestrator_pb2.RenewLeasesResponse.SerializeToString),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    registry: Any = None  # never asked: the address is configured
    peers = PeerConnections(registry, orchestrator_address=f"127.0.0.1:{port}", store_address="",
                            max_message_bytes=1 << 20)
    link = GrpcOrchestratorLink(peers, "traind-x")
    try:
        work = await link.poll_work("traind-x/slot0", [ResidentAgent(JOB, AGENT, 2)], 10, "10.0.0.1:1")
        assert isinstance(work, MicroBatchWork)
        assert (work.lease_id, work.experience_ids, work.group) == ("l1", ("e1", "e2"), None)
        (request,) = polls
        assert (request.worker_id, request.slot_id, request.wait_ms, request.dp_address) == (
            "traind-x", "traind-x/slot0", 10, "10.0.0.1:1")
        assert [(r.job_id, r.agent, r.version) for r in request.resident] == [(JOB, AGENT, 2)]
        assert await link.renew_leases(["l1", "l0"]) == frozenset({"l0"})
        assert [(r.worker_id, list(r.lease_ids)) for r in renewals] == [("traind-x", ["l1", "l0"])]
        await link.renew_leases(["l1"], [7])
        assert list(renewals[-1].progress) == [7]
        stub = await peers.orchestrator()
        with pytest.raises(OrchestratorCallError, match="lease l1 expired") as refused:
            await link.ack_micro_batch("traind-x/slot0", "l1", 4)
        assert refused.value.call == "AckMicroBatch" and isinstance(refused.value.error, FailedPrecondition)
        assert await peers.orchestrator() is not stub  # the failed call dropped the channel: rediscovery
    finally:
        await peers.close()
        await server.stop(0)


def test_pruning_follows_the_jobs_checkpoint_policy(tmp_path: Path) -> None:
    from flexmarl.jobspec import CheckpointSpec, JobSpec

    settings = TrainerSettings(worker_id="traind-prune", slots=1, work_dir=tmp_path / "work", state_location="file",
                               publish_location="file")
    worker = TrainerWorker(settings, TrainerMetrics(CollectorRegistry()), FakeOrchestrator("{}", []), FakeStore([]))
    for kind in ("weights", "states"):
        for version in range(11):
            (tmp_path / "work" / kind / "job" / "a" / f"v{version}").mkdir(parents=True)
    spec = JobSpec.model_construct(checkpoint=CheckpointSpec(keep_last=2, keep_every=5, keep_states=1))
    worker._prune("job", "a", 10, spec)

    def left(kind: str) -> list[int]:
        return sorted(int(p.name[1:]) for p in (tmp_path / "work" / kind / "job" / "a").iterdir())

    assert left("weights") == [0, 5, 9, 10]  # v0 stands for the spec's own model: never pruned
    assert left("states") == [5, 10]
