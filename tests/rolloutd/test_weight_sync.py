"""Weight sync over a collective: traind's rank 0 broadcasts to embedded engines (real HTTP servers, gloo).

Two embedded engine subprocesses join a weight-update group hosted by a
:class:`traind.weight_sync.WeightBroadcaster` in this process, through the routes SGLang 0.5.23
serves (``/init_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from benchmarks.synthetic_engine import SyntheticServer
from benchmarks.synthetic_replica import SyntheticEngineConfig, SyntheticReplica
from flexmarl import weight_group
from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument
from flexmarl.weight_group import GroupPlan, MemberPost, WeightGroupRecord, WeightTensor, decide_plan
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch_many
from rolloutd.engines.protocol import GenerationRequest, PauseMode, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.engines.weight_messages import DESTROY_MISSING
from rolloutd.metrics import RolloutMetrics
from rolloutd.router import Replica, RolloutRouter
from rolloutd.weight_sync import SYNC_PHASES, AgentWeightGroup, SyncOutcome
from traind.weight_sync import (
    AgentBroadcast,
    ReplicaGroup,
    WeightBroadcaster,
    WeightSyncError,
    distinct_tensors,
    plan_buckets,
)

PROMPT = (104, 101, 108, 108, 111, 32, 119)
BUCKET_BYTES = 512 * 1024  # the tiny model (~5 MB in fp32) goes in about ten buckets


def test_an_announced_group_travels_from_traind_through_orchestratord_to_rolloutd() -> None:
    """traind's AnnounceWeights request -> orchestratord's record -> the streamed AgentVersion -> rolloutd's."""
    from orchestratord import serde as orchestratord_serde
    from orchestratord.planner import AgentVersion
    from rolloutd import serde as rolloutd_serde
    from traind import serde as traind_serde

    record = WeightGroupRecord("10.0.0.7", 41000, "flexmarl-weights-j-a", 0, "nccl", 30.0,
                               ((WeightTensor("model.embed_tokens.weight", "bfloat16", (64, 8)),),))
    request = traind_serde.announce_request("traind-0", "traind-0/slot0", "j", "a", 5, record)
    received = orchestratord_serde.weight_group_record(request)
    assert received == record
    streamed = rolloutd_serde.published_version(
        orchestratord_serde.announced_version(AgentVersion("j", "a", 5, ""), received))
    assert (streamed.version, streamed.weights_uri, streamed.weight_group) == (5, "", record)
    assert rolloutd_serde.published_version(orchestratord_serde.agent_version(
        AgentVersion("j", "a", 5, "file:///w"))).weight_group is None  # the commit: no group
    request.ClearField("weight_group")
    with pytest.raises(InvalidArgument, match="weight_group: required"):
        orchestratord_serde.weight_group_record(request)


class _NeverCalled:
    """A group member no test step may reach (the plan leaves its rolloutd out)."""

    url = "http://never-called"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"{name} called on a replica outside the group")


async def test_rank0_goes_on_when_no_replica_serves_the_agent_or_rolloutd_is_silent() -> None:
    """Every peer posts no replica: nothing broadcast. A silent peer: rank 0 waits its timeout, plans without
    it and gives up; the peer that posts late finds that plan (its replicas load the durable copy instead of
    joining a group nobody hosts), and a rolloutd that is no peer of the version does not post at all."""
    broadcast = AgentBroadcast("j", "a", timeout_s=1.0)
    params = {"w": torch.zeros(4)}
    try:
        record = dataclasses.replace(broadcast.announce(params), peers=("rolloutd-1", "rolloutd-2"))
        push = asyncio.ensure_future(asyncio.to_thread(broadcast.push, params, 1, record))
        outcomes = await asyncio.gather(*(AgentWeightGroup(peer).receive(1, record, [], {}) for peer in record.peers))
        assert [o.answer for o in outcomes] == ["skip", "skip"] and await push is None
        record = dataclasses.replace(broadcast.announce(params), peers=("rolloutd-1",))
        started_s = time.monotonic()
        with pytest.raises(WeightSyncError, match="no replica group answered.*rolloutd-1"):
            await asyncio.to_thread(broadcast.push, params, 2, record)
        assert time.monotonic() - started_s < 5.0
        late = await AgentWeightGroup("rolloutd-1").receive(2, record, [("r0", _NeverCalled())], {})  # type: ignore[list-item]
        assert late.answer == "lost" and not late.served
        stranger = await AgentWeightGroup("rolloutd-9").receive(2, record, [("r0", _NeverCalled())], {})  # type: ignore[list-item]
        assert stranger.answer == "lost"
    finally:
        broadcast.close()


class _PostStore:
    """Rank 0's store as a peer's client sees it, until it is broken (rank 0 restarted on the same port)."""

    def __init__(self) -> None:
        self.posts: dict[str, bytes] = {}
        self.broken = False

    def set(self, key: str, value: bytes) -> None:
        if self.broken:
            raise RuntimeError("Broken pipe (test)")
        self.posts[key] = value


async def test_a_peer_keeps_its_store_client_across_versions_and_replaces_a_broken_one() -> None:
    opened: list[tuple[int, _PostStore]] = []

    def open_store(host: str, port: int, timeout_s: float) -> _PostStore:
        opened.append((port, _PostStore()))
        return opened[-1][1]

    group = AgentWeightGroup("rolloutd-1", open_store_fn=open_store)
    record = WeightGroupRecord("127.0.0.1", 41000, "flexmarl-weights-j-a", 0, "gloo", 5.0,
                               ((WeightTensor("w", "float32", (1,)),),), peers=("rolloutd-1",))
    for version in (1, 2):  # no replica here: the post is the whole exchange
        assert (await group.receive(version, record, [], {})).answer == "skip"
    assert len(opened) == 1 and set(opened[0][1].posts) == {"flexmarl/weights/v1/members/rolloutd-1",
                                                            "flexmarl/weights/v2/members/rolloutd-1"}
    opened[0][1].broken = True
    assert (await group.receive(3, record, [], {})).answer == "skip"
    assert len(opened) == 2 and list(opened[1][1].posts) == ["flexmarl/weights/v3/members/rolloutd-1"]
    other = dataclasses.replace(record, master_port=41001)  # another rank 0: another client
    assert (await group.receive(4, other, [], {})).answer == "skip"
    assert [port for port, _ in opened] == [41000, 41000, 41001]


class _BrokenStore:
    """A rendezvous store whose every call fails as a closed TCPStore's does."""

    port = 1

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Connection reset by peer (test)")
        return fail


def test_a_broken_store_fails_the_version_as_a_weight_sync_error() -> None:
    """The trainer only expects WeightSyncError from a push (then the replicas load the checkpoint)."""
    broadcast = AgentBroadcast("j", "a", timeout_s=1.0)
    params = {"w": torch.zeros(4)}
    try:
        record = dataclasses.replace(broadcast.announce(params), peers=("rolloutd-1",))
        broadcast._store = _BrokenStore()
        with pytest.raises(WeightSyncError, match="planning the group failed: Connection reset"):
            broadcast.push(params, 1, record)
    finally:
        broadcast.close()


def test_rank0_keeps_an_epoch_only_for_the_same_members_of_every_peer() -> None:
    a, b = MemberPost(3, ("r0",)), MemberPost(3, ("r0", "r1"))
    members = {"rolloutd-a": ("r0",), "rolloutd-b": ("r0", "r1")}
    assert decide_plan({"rolloutd-b": b, "rolloutd-a": a}, 3, members, 5) == GroupPlan(
        "keep", 3, 4, {"rolloutd-a": 1, "rolloutd-b": 2})
    # A peer without replicas now is no member; one that says it left the epoch, a new replica, a missing member:
    # a new epoch after the highest ever opened, ranks in peer order.
    assert decide_plan({"rolloutd-a": a, "rolloutd-b": MemberPost(3, ()), "rolloutd-c": MemberPost(0, ())},
                       3, members, 5) == GroupPlan("open", 6, 2, {"rolloutd-a": 1})
    assert decide_plan({"rolloutd-a": a, "rolloutd-b": MemberPost(0, ("r0", "r1"))}, 3, members, 5).kind == "open"
    assert decide_plan({"rolloutd-a": a, "rolloutd-b": MemberPost(3, ("r0", "r2"))}, 3, members, 5).kind == "open"
    assert decide_plan({"rolloutd-b": b}, 3, members, 5) == GroupPlan("open", 6, 3, {"rolloutd-b": 1})
    assert decide_plan({"rolloutd-a": a, "rolloutd-b": b}, 0, members, 5).kind == "open"  # no epoch open
    assert decide_plan({"rolloutd-a": MemberPost(0, ())}, 0, {}, 0) == GroupPlan("skip", 0, 0)
    assert decide_plan({}, 0, {}, 0).kind == "skip"


@pytest.fixture(scope="module")
def engines(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineReplica]]:
    """Two embedded engines serving the seed-0 checkpoint, started together."""
    spec = ReplicaSpec("embedded", str(engine_checkpoint), seed=0)
    started = asyncio.run(launch_many([spec, spec], tmp_path_factory.mktemp("weight-sync"), timeout_s=120))
    try:
        yield started
    finally:
        for engine in started:
            engine.stop(grace_s=10)


@pytest.fixture(scope="module")
def replica(engines: list[EngineReplica]) -> EngineReplica:
    """The first engine (the last test of the module kills it)."""
    return engines[0]


@pytest.fixture(scope="module")
def second_replica(engines: list[EngineReplica]) -> EngineReplica:
    """The second engine (killed by the router's fault test)."""
    return engines[1]


@pytest.fixture(scope="module")
def trainer_model(engine_checkpoint_other: Path) -> Any:
    """The trainer's parameters: other weights (seed 1) than the engines start with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint_other), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def _reference_logprobs(model: Any, prompt: tuple[int, ...], output: tuple[int, ...]) -> list[float]:
    """Log-probabilities of ``output`` after ``prompt`` under ``model`` (one teacher-forced pass)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


async def _served_logprobs(client: SGLangClient) -> tuple[tuple[int, ...], list[float], str]:
    request = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6))
    [result] = await client.generate(request)
    return result.output_ids, list(result.output_token_logprobs), result.weight_version


def _params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_plan_buckets_bounds_bytes_and_keeps_order() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(300)), ("c", torch.zeros(5)), ("d", torch.zeros(5))]
    buckets = plan_buckets(named, 100 * 4)
    assert [[spec.name for spec in bucket.tensors] for bucket in buckets] == [["a"], ["b"], ["c", "d"]]
    assert [bucket.nbytes for bucket in buckets] == [40, 1200, 40]
    halved = plan_buckets(named, 100 * 4, send_dtype=torch.bfloat16)
    assert halved[0].request_fields() == (["a"], ["bfloat16"], [[10]])


async def test_broadcast_serves_the_trainers_parameters(replica: EngineReplica, trainer_model: Any) -> None:
    """fp32 then bf16 versions through one group: the replica serves the trainer's forward pass."""
    client = SGLangClient(replica.url)
    try:  # SGLang's answers outside a session and outside a group
        with pytest.raises(FailedPrecondition, match="update_weights_from_distributed must run between"):
            await client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[1]])
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):
            await client.destroy_weights_update_group()
        group = ReplicaGroup(WeightBroadcaster(world_size=2, timeout_s=30), [client])
        await group.open()
        params = _params(trainer_model)
        for version, dtype in (("v1", None), ("v2", torch.bfloat16)):
            await client.pause_generation(PauseMode.IN_PLACE)
            report = await group.push_version(params, version, bucket_bytes=BUCKET_BYTES, send_dtype=dtype)
            await client.continue_generation()
            assert report.buckets > 2
            reference = trainer_model
            if dtype is not None:  # the engine serves fp32 copies of the bf16 values it received
                reference = type(trainer_model)(trainer_model.config)
                reference.load_state_dict({k: v.to(dtype).float() for k, v in trainer_model.state_dict().items()})
                reference.eval()
            output_ids, logprobs, served_version = await _served_logprobs(client)
            assert served_version == version
            assert (await client.model_info()).weight_version == version
            assert logprobs == pytest.approx(_reference_logprobs(reference, PROMPT, output_ids), abs=1e-4)
        await group.close()
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):  # it left the group
            await client.destroy_weights_update_group()
    finally:
        await client.close()


class _GivesUpAfterOneBucket(WeightBroadcaster):
    """Rank 0 failing after its first bucket (a trainer that died or timed out mid-version)."""

    def broadcast(self, tensors: Any) -> None:
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.close()
            raise WeightSyncError("rank 0 gave up")
        super().broadcast(tensors)


async def test_a_failed_group_advertises_no_partial_version_and_refuses_the_next_update(
    replica: EngineReplica, trainer_model: Any, engine_checkpoint: Path, engine_reference_model: Any
) -> None:
    """The replica keeps its version, answers SGLang's receive error, and serves again after a disk reload."""
    client = SGLangClient(replica.url)
    try:
        version_before = (await client.model_info()).weight_version
        group = ReplicaGroup(_GivesUpAfterOneBucket(world_size=2, timeout_s=30), [client])
        await group.open()
        await client.pause_generation(PauseMode.IN_PLACE)
        with pytest.raises(WeightSyncError) as failure:
            await group.push_version(_params(trainer_model), "v-torn", bucket_bytes=BUCKET_BYTES)
        assert "Failed to receive weights" in failure.value.failed[replica.url]
        assert (await client.model_info()).weight_version == version_before
        with pytest.raises(FailedPrecondition, match="Failed to receive weights"):  # the group stays broken
            await client.update_weights_from_distributed(
                ["model.norm.weight"], ["float32"], [[trainer_model.config.hidden_size]], weight_version="v-late"
            )
        assert (await client.model_info()).weight_version == version_before
        await client.end_weight_update()
        await client.destroy_weights_update_group()
        # Bucket 1 was loaded (torn weights): the replica reloads the durable copy before serving again.
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="durable", flush_cache=False)
        await client.continue_generation()
        output_ids, logprobs, served_version = await _served_logprobs(client)
        assert served_version == "durable"
        assert logprobs == pytest.approx(_reference_logprobs(engine_reference_model, PROMPT, output_ids), abs=1e-4)
    finally:
        await client.close()


def test_the_group_record_round_trips_and_answers_are_checked() -> None:
    record = WeightGroupRecord("127.0.0.1", 29500, "flexmarl-weights-j-a", 3, "gloo", 30.0,
                               ((WeightTensor("w", "float32", (2, 3)), WeightTensor("b", "bfloat16", (3,))),))
    assert weight_group.from_message(weight_group.to_message(record)) == record
    assert record.nbytes == 2 * 3 * 4 + 3 * 2 and record.group_name(4) == "flexmarl-weights-j-a-e4"
    with pytest.raises(InvalidArgument, match="every bucket needs a tensor"):
        weight_group.from_message(weight_group.to_message(dataclasses.replace(record, buckets=((),))))
    with pytest.raises(InvalidArgument, match="master_address"):
        weight_group.from_message(weight_group.to_message(dataclasses.replace(record, master_port=0)))
    with_peers = dataclasses.replace(record, peers=("rolloutd-0", "rolloutd-1"))
    assert weight_group.from_message(weight_group.to_message(with_peers)) == with_peers
    with pytest.raises(InvalidArgument, match="peers"):
        weight_group.from_message(weight_group.to_message(dataclasses.replace(record, peers=("a", "a"))))
    post = MemberPost(2, ("r0", "r1"))
    assert MemberPost.decode(post.encode()) == post
    plan = GroupPlan("open", 4, 4, {"rolloutd-0": 1, "rolloutd-1": 3})
    assert GroupPlan.decode(plan.encode()) == plan
    for bad in (b"{", b"[]", b'{"epoch": -1, "members": []}', b'{"epoch": 1, "members": ["r0", "r0"]}',
                b'{"epoch": 1, "members": [""]}'):
        with pytest.raises(InvalidArgument, match="member post"):
            MemberPost.decode(bad)
    for plan in (GroupPlan("open", 0, 3, {"a": 1}), GroupPlan("open", 1, 3, {"a": 3}), GroupPlan("keep", 1, 3, {}),
                 GroupPlan("other", 1, 3, {"a": 1})):  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="group plan"):
            GroupPlan.decode(plan.encode())
    assert distinct_tensors({"a": (t := torch.zeros(2)), "tied": t, "b": torch.zeros(2)}).keys() == {"a", "b"}



ALICE, BOB = "job/alice", "job/bob"


def _router(replicas: list[Replica], owner: str = "rolloutd-test",
            mode: PauseMode = PauseMode.IN_PLACE) -> RolloutRouter:
    """A router (rolloutd ``owner``'s, interrupting in ``mode``) over ``replicas`` whose weights URIs are paths."""

    async def resolve(uri: str) -> str:
        return uri

    return RolloutRouter(replicas, resolve, owner=owner, interrupt_mode=mode)


async def _version(router: RolloutRouter, key: str, broadcast: AgentBroadcast, params: dict[str, torch.Tensor],
                   version: int) -> tuple[Any, SyncOutcome | None]:
    """One announced version: rank 0's push (on a thread, as traind runs it) beside rolloutd's receive."""
    record = dataclasses.replace(broadcast.announce(params), peers=("rolloutd-test",))  # orchestratord's part
    push = asyncio.ensure_future(asyncio.to_thread(broadcast.push, params, version, record))
    outcome = await router.receive_broadcast(key, version, record)
    return await push, outcome


async def test_router_replicas_serve_the_broadcast_version(
    replica: EngineReplica, second_replica: EngineReplica, trainer_model: Any, engine_checkpoint: Path
) -> None:
    """Two replicas of an agent join rank 0's group, receive v1 (a new epoch) and v2 (the same epoch kept),
    and serve the trainer's forward pass; a replica moved to another agent leaves that agent's group
    and joins this one's at the next version."""
    clients = [SGLangClient(replica.url), SGLangClient(second_replica.url)]
    router = _router([Replica("r0", clients[0], ALICE, 0), Replica("r1", clients[1], BOB, 0)])
    alice = AgentBroadcast("job", "alice", timeout_s=20, bucket_bytes=BUCKET_BYTES)
    bob = AgentBroadcast("job", "bob", timeout_s=20, bucket_bytes=BUCKET_BYTES)
    params = distinct_tensors(dict(trainer_model.state_dict()))
    try:
        await router.set_agents([ALICE, BOB])
        for key in (ALICE, BOB):
            router.require(key, 0, str(engine_checkpoint))
            router.set_distributed_sync(key, True)
        report, outcome = await _version(router, ALICE, alice, params, 1)
        assert outcome is not None and (outcome.answer, outcome.served) == ("open", ("r0",))
        assert report is not None and report.buckets > 2
        # Where the time went: every phase, in order, none longer than the whole (metrics export them).
        assert tuple(outcome.phases) == SYNC_PHASES
        assert all(v >= 0 for v in outcome.phases.values()) and sum(outcome.phases.values()) <= outcome.seconds
        metrics = RolloutMetrics(CollectorRegistry())
        metrics.observe_broadcast(ALICE, outcome)
        assert metrics._registry.get_sample_value("flexmarl_rolloutd_weight_sync_phase_seconds_sum",
                                                  {"agent": "alice", "phase": "transfer"}) == outcome.phases["transfer"]
        report, outcome = await _version(router, BOB, bob, params, 1)
        assert outcome is not None and (outcome.answer, outcome.served) == ("open", ("r1",))
        report, outcome = await _version(router, ALICE, alice, params, 2)
        assert outcome is not None and outcome.answer == "keep" and alice.epoch == 1
        # The balancer moves r1 from bob to alice: the move loads alice's weights from disk.
        moved = router.replicas()[1]
        router.require(ALICE, 2, str(engine_checkpoint))
        await router._reload(moved, ALICE)
        assert (moved.loaded_agent, moved.loaded_version) == (ALICE, 2)
        report, outcome = await _version(router, BOB, bob, params, 2)  # bob has no replica now
        assert report is None and outcome is not None and outcome.answer == "skip" and outcome.phases == {}
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):  # r1 left bob's group
            await clients[1].destroy_weights_update_group(bob.base_name + "-e1")
        report, outcome = await _version(router, ALICE, alice, params, 3)
        assert outcome is not None and (outcome.answer, outcome.served) == ("open", ("r0", "r1"))
        assert alice.epoch == 2 and [r.loaded_version for r in router.replicas()] == [3, 3]
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):  # r0 left alice's first epoch
            await clients[0].destroy_weights_update_group(alice.base_name + "-e1")
        for client in clients:
            output_ids, logprobs, served_version = await _served_logprobs(client)
            assert served_version == "3"
            assert logprobs == pytest.approx(_reference_logprobs(trainer_model, PROMPT, output_ids), abs=1e-4)
        [output] = await router.generate(ALICE, list(PROMPT), {"temperature": 0.0, "max_new_tokens": 6}, 1, "ep-1")
        assert output.version == 3
    finally:
        alice.close()
        bob.close()
        await router.close()
        for client in clients:  # leave alice's open epoch: the next test opens its own
            with contextlib.suppress(FlexmarlError):
                await client.destroy_weights_update_group(alice.base_name + "-e2")
            await client.close()


async def test_two_rolloutds_share_one_agents_group(
    replica: EngineReplica, second_replica: EngineReplica, trainer_model: Any, engine_checkpoint: Path
) -> None:
    """Two rolloutds, each with a replica of alice (both named r0), post their members: rank 0 opens one epoch of
    three ranks (rolloutd-a at rank 1, rolloutd-b at 2) and both serve the trainer's forward pass; v2 keeps it;
    at v3 rolloutd-b's replica serves bob, so rank 0 reopens with rolloutd-a alone and rolloutd-b leaves the
    epoch. At v4 a third peer never posts: rank 0 waits its timeout and keeps the epoch without it, and the
    late peer finds itself outside the plan."""
    clients = [SGLangClient(replica.url), SGLangClient(second_replica.url)]
    routers = {"rolloutd-a": _router([Replica("r0", clients[0], ALICE, 0)], "rolloutd-a"),
               "rolloutd-b": _router([Replica("r0", clients[1], ALICE, 0)], "rolloutd-b")}
    alice = AgentBroadcast("job", "alice-shared", timeout_s=20, bucket_bytes=BUCKET_BYTES)
    params = distinct_tensors(dict(trainer_model.state_dict()))

    async def version(number: int, peers: tuple[str, ...]) -> tuple[Any, dict[str, SyncOutcome | None]]:
        record = dataclasses.replace(alice.announce(params), peers=peers)
        push = asyncio.ensure_future(asyncio.to_thread(alice.push, params, number, record))
        outcomes = await asyncio.gather(*(r.receive_broadcast(ALICE, number, record) for r in routers.values()))
        return await push, dict(zip(routers, outcomes, strict=True))

    def answers(outcomes: dict[str, SyncOutcome | None]) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {peer: (o.answer, o.served) for peer, o in outcomes.items() if o is not None}

    try:
        for router in routers.values():
            await router.set_agents([ALICE, BOB])
            for key in (ALICE, BOB):
                router.require(key, 0, str(engine_checkpoint))
            router.set_distributed_sync(ALICE, True)
        report, outcomes = await version(1, tuple(routers))
        assert answers(outcomes) == {"rolloutd-a": ("open", ("r0",)), "rolloutd-b": ("open", ("r0",))}
        assert report is not None and alice.epoch == 1 and alice.members == {"rolloutd-a": ("r0",),
                                                                              "rolloutd-b": ("r0",)}
        for client in clients:
            output_ids, logprobs, served_version = await _served_logprobs(client)
            assert served_version == "1"
            assert logprobs == pytest.approx(_reference_logprobs(trainer_model, PROMPT, output_ids), abs=1e-4)
        _, outcomes = await version(2, tuple(routers))
        assert answers(outcomes) == {"rolloutd-a": ("keep", ("r0",)), "rolloutd-b": ("keep", ("r0",))}
        moved = routers["rolloutd-b"].replicas()[0]
        await routers["rolloutd-b"]._reload(moved, BOB)  # the balancer moves it: bob's weights from disk
        _, outcomes = await version(3, tuple(routers))
        assert answers(outcomes) == {"rolloutd-a": ("open", ("r0",)), "rolloutd-b": ("skip", ())}
        assert alice.epoch == 2 and alice.members == {"rolloutd-a": ("r0",)}
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):  # rolloutd-b's replica left epoch 1
            await clients[1].destroy_weights_update_group(alice.base_name + "-e1")
        alice.timeout_s = 2.0  # what a silent peer costs rank 0, kept short here
        started_s = time.monotonic()
        _, outcomes = await version(4, (*routers, "rolloutd-c"))
        assert time.monotonic() - started_s >= 2.0
        assert answers(outcomes) == {"rolloutd-a": ("keep", ("r0",)), "rolloutd-b": ("skip", ())}
        record = dataclasses.replace(alice.announce(params), peers=(*routers, "rolloutd-c"))
        late = await AgentWeightGroup("rolloutd-c").receive(4, record, [("r9", _NeverCalled())], {})  # type: ignore[list-item]
        assert late.answer == "lost"
        assert (await clients[0].model_info()).weight_version == "4"
    finally:
        alice.close()
        for router in routers.values():
            await router.close()
        for client in clients:
            with contextlib.suppress(FlexmarlError):
                await client.destroy_weights_update_group(alice.base_name + "-e2")
            await client.close()


async def _until_decoding(client: SGLangClient, tokens: int, generation: asyncio.Future[Any]) -> None:
    """Waits (30 s at most) until the engine holds ``tokens`` KV tokens of running requests, or the generation ended."""
    deadline = time.monotonic() + 30
    while not generation.done() and (await client.loads()).num_used_tokens < tokens:
        assert time.monotonic() < deadline, "the generation made no progress"
        await asyncio.sleep(0.005)


LONG_TOKENS = 256


async def _long_partial_generation(router: RolloutRouter, client: SGLangClient,
                                   checkpoint: Path) -> asyncio.Future[Any]:
    """alice as a partial-rollout, distributed-sync agent on v0 of ``checkpoint``, and one long sample decoding."""
    await router.set_agents([ALICE])
    router.require(ALICE, 0, str(checkpoint))  # the first request loads it as weight_version "0"
    router.set_partial_rollout(ALICE, True)
    router.set_distributed_sync(ALICE, True)
    sampling = {"max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 1.0}
    generation = asyncio.ensure_future(router.generate(ALICE, list(PROMPT), sampling, 1, "ep-0", seed=3))
    await _until_decoding(client, len(PROMPT) + 16, generation)
    assert not generation.done(), "the generation ended before the broadcast"
    return generation


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.ABORT])
async def test_a_broadcast_pauses_a_partial_rollout_agent_whose_generations_go_on_with_the_new_weights(
    replica: EngineReplica, trainer_model: Any, engine_checkpoint: Path, mode: PauseMode
) -> None:
    """With partial rollouts the replica is paused for the broadcast, not drained: the running sample goes on
    (``in_place``) or is resumed (``abort``) on the broadcast version with its budget kept, its spans (0, v0)
    then (k, v1); a fresh request afterwards is served by exactly the trainer's parameters."""
    tokens = LONG_TOKENS
    client = SGLangClient(replica.url)
    router = _router([Replica("r0", client)], mode=mode)
    broadcast = AgentBroadcast("job", f"alice-partial-{mode.value}", timeout_s=20, bucket_bytes=BUCKET_BYTES)
    params = distinct_tensors(dict(trainer_model.state_dict()))
    try:
        generation = await _long_partial_generation(router, client, engine_checkpoint)
        _, outcome = await _version(router, ALICE, broadcast, params, 1)
        assert outcome is not None and outcome.served == ("r0",) and not outcome.failed
        (output,) = await asyncio.wait_for(generation, 60)
        [served] = router.replicas()
        assert served.loaded_version == 1 and served.interruptions == 1 and served.healthy
        assert len(output.token_ids) == tokens and len(output.logprobs) == tokens
        assert [v for _, v in output.version_spans] == [0, 1] and 16 <= output.version_spans[1][0] < tokens
        assert output.version == 0
        output_ids, logprobs, served_version = await _served_logprobs(client)
        assert served_version == "1"
        assert logprobs == pytest.approx(_reference_logprobs(trainer_model, PROMPT, output_ids), abs=1e-4)
    finally:
        broadcast.close()
        await router.close()
        with contextlib.suppress(FlexmarlError):
            await client.destroy_weights_update_group(broadcast.base_name + "-e1")
        await client.close()


class _AtSecondBucket:
    """A replica's client that runs ``fault`` as its second bucket's update is about to be sent."""

    def __init__(self, client: SGLangClient, fault: Callable[[], None]) -> None:
        self.client, self.fault, self.url = client, fault, client.url
        self.updates = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> Any:
        self.updates += 1
        if self.updates == 2:
            self.fault()
        return await self.client.update_weights_from_distributed(*args, **kwargs)


def _lose_the_bucket() -> None:
    """The second bucket never reaches the (live) engine: a torn update."""
    raise FlexmarlError("the second bucket was lost (test)")


def _kills(pid: int) -> Callable[[], None]:
    """SIGKILLs the engine ``pid`` as the bucket is sent."""
    return lambda: os.kill(pid, signal.SIGKILL)


async def test_a_paused_replica_that_misses_a_broadcast_goes_on_with_the_weights_it_served(
    replica: EngineReplica, trainer_model: Any, engine_checkpoint: Path
) -> None:
    """The broadcast breaks after the first bucket landed on a paused replica: before it continues, the replica
    reloads v0 from disk, so its running sample never decodes on a torn model (one span, v0) and it serves v0."""
    from transformers import AutoModelForCausalLM

    tokens = LONG_TOKENS
    client = SGLangClient(replica.url)
    router = _router([Replica("r0", _AtSecondBucket(client, _lose_the_bucket))])  # type: ignore[arg-type]
    broadcast = AgentBroadcast("job", "alice-partial-torn", timeout_s=20, bucket_bytes=BUCKET_BYTES)
    params = distinct_tensors(dict(trainer_model.state_dict()))
    try:
        generation = await _long_partial_generation(router, client, engine_checkpoint)
        with pytest.raises(WeightSyncError):
            await _version(router, ALICE, broadcast, params, 1)
        (output,) = await asyncio.wait_for(generation, 60)
        [served] = router.replicas()
        assert served.healthy and served.loaded_version == 0
        assert len(output.token_ids) == tokens and output.version == 0 and output.version_spans == ()
        output_ids, logprobs, served_version = await _served_logprobs(client)
        assert served_version == "0"
        base = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32).eval()
        assert logprobs == pytest.approx(_reference_logprobs(base, PROMPT, output_ids), abs=1e-4)
    finally:
        broadcast.close()
        await router.close()
        await client.close()


async def test_replica_killed_mid_broadcast_neither_blocks_the_trainer_nor_serves_a_torn_model(
    replica: EngineReplica, second_replica: EngineReplica, trainer_model: Any, engine_checkpoint_other: Path
) -> None:
    """r1's engine dies at its second bucket: rank 0 gives up at once, both replicas are marked torn, and the
    request that follows the commit is served by r0 after its reload from the durable copy."""
    assert second_replica.pid is not None
    survivor = SGLangClient(replica.url)
    victim = _AtSecondBucket(SGLangClient(second_replica.url, retries=0), _kills(second_replica.pid))
    router = _router([Replica("r0", survivor, ALICE, 0), Replica("r1", victim, ALICE, 0)])  # type: ignore[arg-type]
    timeout_s = 20.0
    broadcast = AgentBroadcast("job", "alice-2", timeout_s=timeout_s, bucket_bytes=BUCKET_BYTES)
    try:
        await router.set_agents([ALICE])
        router.require(ALICE, 0, str(engine_checkpoint_other))
        router.set_distributed_sync(ALICE, True)
        started_s = time.monotonic()
        with pytest.raises(WeightSyncError):
            await _version(router, ALICE, broadcast, distinct_tensors(dict(trainer_model.state_dict())), 1)
        assert time.monotonic() - started_s < timeout_s  # the trainer went on well within the group's timeout
        assert [r.loaded_version for r in router.replicas()] == [-1, -1]  # torn: neither serves before a reload
        router.require(ALICE, 1, str(engine_checkpoint_other))  # the commit: v1's durable copy
        [output] = await router.generate(ALICE, list(PROMPT), {"temperature": 0.0, "max_new_tokens": 6}, 1, "ep-2")
        assert output.version == 1
        assert output.logprobs == pytest.approx(
            _reference_logprobs(trainer_model, PROMPT, output.token_ids), abs=1e-4)
        assert (await survivor.model_info()).weight_version == "1"
    finally:
        broadcast.close()
        await router.close()
        await survivor.close()
        await victim.client.close()


async def test_replica_killed_mid_broadcast_does_not_block_rank0(replica: EngineReplica, trainer_model: Any) -> None:
    """Rank 0 fails fast with a clear error naming the replica (last test of the module: it kills the engine)."""
    assert replica.pid is not None
    client = SGLangClient(replica.url, retries=0)
    timeout_s = 30.0
    try:
        victim = _AtSecondBucket(client, _kills(replica.pid))
        group = ReplicaGroup(WeightBroadcaster(world_size=2, timeout_s=timeout_s), [victim])
        await group.open()
        started_s = time.monotonic()
        with pytest.raises(WeightSyncError, match="bucket 2/") as failure:
            await group.push_version(_params(trainer_model), "v-killed", bucket_bytes=BUCKET_BYTES)
        assert time.monotonic() - started_s < timeout_s  # bounded by the group's timeout, not hung
        assert {group.RANK0, replica.url} <= failure.value.failed.keys()
    finally:
        await client.close()


async def test_synthetic_engine_models_a_bucket_as_its_bytes_over_the_link() -> None:
    """The synthetic engine answers as SGLang and spends bytes / link_bytes_per_s per bucket (in process)."""
    config = SyntheticEngineConfig(check_model_path=False)
    profile = config.profile().with_changes(link_bytes_per_s=40e6)  # 4 MB bucket -> 0.1 modelled s
    server = SyntheticServer(SyntheticReplica(0, config, profile))
    port = await server.start("127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(FailedPrecondition, match="must run between begin_weight_update"):
            await client.update_weights_from_distributed(["w"], ["float32"], [[1024, 1024]])
        await client.init_weights_update_group(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
        await client.begin_weight_update()
        with pytest.raises(FailedPrecondition, match="Failed to receive weights: Group other not in"):
            await client.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="other")
        started_s = time.monotonic()
        await client.update_weights_from_distributed(["w"], ["float32"], [[1024, 1024]])
        assert time.monotonic() - started_s >= 4 * 1024 * 1024 / 40e6
        assert (await client.model_info()).weight_version == "default"  # no version given: kept
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[8]], weight_version="v1")
        assert (await client.model_info()).weight_version == "v1"
        await client.end_weight_update()
        await client.destroy_weights_update_group()
        with pytest.raises(FailedPrecondition, match=DESTROY_MISSING):
            await client.destroy_weights_update_group()
    finally:
        await client.close()
        await server.stop()
