"""Interruptible (partial) rollouts: the router against the real embedded engine (in-process, over HTTP).

A version published for a partial-rollout agent pauses the replica's running generations,
reloads the weights and continues them (``in_place``), or gets them back aborted and resubmits
prompt + partial tokens with the remaining budget (``abort``). Either way a sample interrupted
twice has three version spans, exactly ``max_new_tokens`` tokens and a logprob per token; an
agent without partial rollouts is never interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio
import pytest
import torch
from prometheus_client import CollectorRegistry

from flexmarl.client import JobState
from flexmarl.connections import PeerConnections
from flexmarl.episode import GenerationOutput
from flexmarl.errors import FlexmarlError, NotFound, Unavailable
from flexmarl.jobspec import JobSpec
from flexmarl.registry import Registry
from flexmarl.retry import RetryPolicy
from flexmarl.v1 import common_pb2, orchestrator_pb2
from rolloutd import worker as worker_module
from rolloutd.balancer import BalancerConfig
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch_many
from rolloutd.engines.protocol import PauseMode
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.link import GrpcOrchestratorLink, OrchestratorLink
from rolloutd.metrics import RolloutMetrics
from rolloutd.router import Replica, RolloutRouter
from rolloutd.types import PublishedVersion, RenewResult, RolloutTask, TaskReport
from rolloutd.worker import RolloutWorker, WorkerSettings

KEY = "job-1/planner"
PROMPT = [104, 101, 108, 108, 111]
TOKENS = 96


@contextlib.asynccontextmanager
async def _router(
    checkpoint: Path, other: Path, mode: PauseMode
) -> AsyncIterator[tuple[EmbeddedServer, RolloutRouter, Replica]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = EmbeddedServer(EmbeddedEngine(EmbeddedEngineConfig(model_path=str(checkpoint), seed=0)))
    port = await server.start("127.0.0.1", 0)
    replica = Replica("replica-0", SGLangClient(f"http://127.0.0.1:{port}"))
    paths = {"v0": str(checkpoint), "v1": str(other), "v2": str(checkpoint)}

    async def resolve(uri: str) -> str:
        return paths[uri]

    router = RolloutRouter([replica], resolve, interrupt_mode=mode)
    try:
        await router.set_agents([KEY])
        router.require(KEY, 0, "v0")
        yield server, router, replica
    finally:
        await router.close()
        await replica.client.close()
        await server.stop()
        torch.set_num_threads(threads)


async def _until(predicate: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.002)


async def _interrupted_twice(server: EmbeddedServer, router: RolloutRouter, replica: Replica) -> GenerationOutput:
    router.set_partial_rollout(KEY, True)
    sampling = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0}
    generation = asyncio.ensure_future(router.generate(KEY, PROMPT, sampling, 1, "episode-0", seed=3))
    for version in (1, 2):
        start = server.engine.generated_tokens
        await _until(lambda s=start: server.engine.generated_tokens >= s + 10 or generation.done(),
                     "the generation made no progress")
        assert not generation.done(), "the generation ended before it could be interrupted"
        router.publish(KEY, version, f"v{version}")
        await _until(lambda v=version: replica.loaded_version == v, f"v{version} never loaded")
    (output,) = await asyncio.wait_for(generation, 60)
    return output


@pytest.mark.parametrize("mode", [PauseMode.IN_PLACE, PauseMode.ABORT])
async def test_interrupted_twice_keeps_budget_and_has_three_spans(
    engine_checkpoint: Path, engine_checkpoint_other: Path, mode: PauseMode
) -> None:
    async with _router(engine_checkpoint, engine_checkpoint_other, mode) as (server, router, replica):
        balancer = router.balancer()
        assert balancer is not None
        balancer.estimator.observe(KEY, 10)  # a mean of 10 tokens so far
        output = await _interrupted_twice(server, router, replica)
        # The sample's whole length was observed once: an aborted piece is no response.
        assert balancer.estimator.expected_response_tokens(KEY, 1000) == pytest.approx(0.95 * 10 + 0.05 * TOKENS)
    assert replica.interruptions == 2
    # The remaining budget was respected across both interruptions (never reset to max_new_tokens).
    assert len(output.token_ids) == TOKENS, output.finish_reason
    assert output.finish_reason == "length"
    assert len(output.logprobs) == TOKENS and all(lp <= 0.0 for lp in output.logprobs)
    starts = [start for start, _ in output.version_spans]
    assert [version for _, version in output.version_spans] == [0, 1, 2]
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == 3 and starts[-1] < TOKENS
    assert output.version == 0  # the oldest token's


async def test_agent_without_partial_rollout_is_never_interrupted(
    engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    async with _router(engine_checkpoint, engine_checkpoint_other, PauseMode.IN_PLACE) as (server, router, replica):
        sampling = {"max_new_tokens": 32, "ignore_eos": True}
        generation = asyncio.ensure_future(router.generate(KEY, PROMPT, sampling, 1, "episode-0", seed=3))
        await _until(lambda: server.engine.generated_tokens >= 8 or generation.done(), "no progress")
        router.publish(KEY, 1, "v1")  # strict jobs never turn partial rollouts on: a no-op
        (output,) = await asyncio.wait_for(generation, 60)
        assert (replica.interruptions, replica.loaded_version) == (0, 0)
        assert output.version == 0 and output.version_spans == () and len(output.token_ids) == 32
        # The next request still runs the version its task requires, not the published one.
        (again,) = await router.generate(KEY, PROMPT, {"max_new_tokens": 4}, 1, "episode-1", seed=3)
        assert again.version == 0 and replica.reloads == 1


#: Two agents of one job on three replicas: one agent starts with two, the other with one.
MOVE_KEYS = ("job-1/a", "job-1/b")
#: Long enough that a weight load of the tiny model ends well before one such generation.
LONG = 600


@pytest.fixture(scope="module")
def three_engines(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineReplica]]:
    """Three embedded engine subprocesses (one process each, as rolloutd launches them), shared by the module."""
    specs = [ReplicaSpec("embedded", str(engine_checkpoint), seed=0) for _ in range(3)]
    engines = asyncio.run(launch_many(specs, tmp_path_factory.mktemp("three-engines"), timeout_s=120))
    try:
        yield engines
    finally:
        for engine in engines:
            engine.stop(grace_s=10)


@contextlib.asynccontextmanager
async def _two_agents(
    engines: Sequence[EngineReplica], checkpoint: Path, evicts: bool
) -> AsyncIterator[tuple[RolloutRouter, list[Replica]]]:
    replicas = [Replica(f"replica-{i}", SGLangClient(engine.url)) for i, engine in enumerate(engines)]

    async def resolve(uri: str) -> str:
        return str(checkpoint)

    config = BalancerConfig(rebalance_interval_s=0.0, move_patience=0.0, measured_rates=False, move_evicts=evicts)
    router = RolloutRouter(replicas, resolve, config)
    try:
        await router.set_agents(MOVE_KEYS)
        for key in MOVE_KEYS:
            router.require(key, 0, "v0")
            router.set_partial_rollout(key, True)
        yield router, replicas
    finally:
        await router.close()
        for replica in replicas:
            await replica.client.abort(abort_all=True)  # nothing left running for the next test
            await replica.client.close()


@pytest.mark.parametrize("evicts", [True, False])
async def test_a_replica_moved_away_hands_its_generations_on_or_drains_them(
    three_engines: list[EngineReplica], engine_checkpoint: Path, evicts: bool
) -> None:
    """A partial-rollout agent's replica moved to another agent loads at once; its generations end elsewhere.

    With ``move_evicts`` off it drains them first: the move's load waits for the generation to end.
    """
    async with _two_agents(three_engines, engine_checkpoint, evicts) as (router, replicas):
        balancer = router.balancer()
        assert balancer is not None and balancer.evicts(MOVE_KEYS[0]) is evicts
        counts = balancer.replica_counts()
        donor = max(MOVE_KEYS, key=lambda k: counts[k])
        taker = next(k for k in MOVE_KEYS if k != donor)
        sampling = {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 1.0}
        generations = [asyncio.ensure_future(router.generate(donor, PROMPT, sampling, 1, f"episode-{i}", seed=i))
                       for i in range(2)]
        await _until(lambda: sum(r.lock.busy for r in replicas) == 2, "both replicas of the donor generate")
        # The taker wants every replica the donor can spare; the donor keeps its last (its hint outlives its requests).
        router.set_demand_hints({taker: 10_000_000, donor: 1})
        await _until(lambda: any(r.loaded_agent == taker for r in replicas), "no replica moved to the taker")
        ended = sum(g.done() for g in generations)
        assert ended == 0 if evicts else ended >= 1  # a draining donor loads once its own generation ended
        outputs = [output for (output,) in await asyncio.wait_for(asyncio.gather(*generations), 120)]
    [moved] = [r for r in replicas if r.loaded_agent == taker]
    assert moved.evictions == (1 if evicts else 0) and (moved.eviction_aborts >= 1) is evicts
    for output in outputs:  # nothing of the handed-on generation was lost, nor its budget reset
        assert len(output.token_ids) == LONG and output.finish_reason == "length"
        assert len(output.logprobs) == LONG and all(lp <= 0.0 for lp in output.logprobs)


async def test_generations_survive_moves_hand_overs_and_versions_at_once(
    three_engines: list[EngineReplica], engine_checkpoint: Path
) -> None:
    """Generations of two partial-rollout agents while the demand swings between them and versions are published.

    Replicas move back and forth (handing their generations on), versions interrupt what runs, and
    every sample still ends with its whole budget, a finite logprob per token and version spans in order.
    """
    rng = random.Random(5)
    outputs: list[tuple[int, GenerationOutput]] = []
    async with _two_agents(three_engines, engine_checkpoint, evicts=True) as (router, replicas):
        versions = dict.fromkeys(MOVE_KEYS, 0)

        async def generate(index: int, key: str, budget: int) -> None:
            sampling = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 1.0}
            for output in await router.generate(key, [104, 105, index % 200], sampling, 1 + index % 2,
                                                f"episode-{index}", seed=index):
                outputs.append((budget, output))

        generations = []
        for turn in range(16):  # the demand turns every second; a version every other turn
            router.set_demand_hints({MOVE_KEYS[turn % 2]: 10_000_000, MOVE_KEYS[1 - turn % 2]: 1})
            if turn % 2:
                published = rng.choice(MOVE_KEYS)
                versions[published] += 1
                router.publish(published, versions[published], f"v{versions[published]}")
            for _ in range(5):  # long enough that a moved replica is still generating
                generations.append(asyncio.ensure_future(
                    generate(len(generations), rng.choice(MOVE_KEYS), rng.randrange(100, 600))))
                await asyncio.sleep(0.2)
        await asyncio.wait_for(asyncio.gather(*generations), 120)
    moved = (sum(r.evictions for r in replicas), sum(r.interruptions for r in replicas))
    assert moved[0] >= 1 and moved[1] >= 1, moved
    for budget, output in outputs:
        assert len(output.token_ids) == budget and output.finish_reason == "length"
        assert len(output.logprobs) == budget and all(math.isfinite(lp) and lp <= 0.0 for lp in output.logprobs)
        starts = [start for start, _ in output.version_spans]
        assert starts == sorted(starts) and (not starts or starts[0] == 0)
        assert [v for _, v in output.version_spans] == sorted(v for _, v in output.version_spans)


def _spec(pipeline: dict[str, object], rollout: dict[str, object]) -> dict[str, object]:
    return {"name": "partial", "environment": {"entrypoint": "m:E"}, "agents": [{"name": "a", "model": "m"}],
            "batch": {"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2}, "total_steps": 1,
            "pipeline": pipeline, "rollout": rollout}


@pytest.mark.parametrize(("pipeline", "rollout", "problem"), [
    ({"max_staleness": 0}, {"partial_rollout": True}, "rollout.partial_rollout: needs pipeline.mode async"),
    ({"mode": "sync", "max_staleness": 1}, {"partial_rollout": True}, "mode 'sync'"),
    ({"max_staleness": 1}, {"mask_stale_tokens": True}, "rollout.mask_stale_tokens: needs rollout.partial_rollout"),
])
def test_spec_rejects_partial_rollout_where_nothing_may_interrupt(
    pipeline: dict[str, object], rollout: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        JobSpec.model_validate(_spec(pipeline, rollout))
    spec = JobSpec.model_validate(_spec({"max_staleness": 1}, {"partial_rollout": True, "mask_stale_tokens": True}))
    assert spec.rollout.partial_rollout and spec.rollout.mask_stale_tokens


# ---- learning versions: the WatchAgentVersions stream, the link and the worker's loop ----------------


class _WatchLink(OrchestratorLink):
    """A link whose version streams are scripted: each item yields its versions, then raises its error."""

    def __init__(self, streams: list[tuple[list[PublishedVersion], FlexmarlError]]) -> None:
        self.streams = streams
        self.watched: list[str] = []

    async def lease_tasks(self, worker_id: str, max_tasks: int, wait_ms: int) -> list[RolloutTask]:
        raise NotImplementedError

    async def renew(self, worker_id: str, lease_ids: Sequence[str], progress: Sequence[int] = ()) -> RenewResult:
        raise NotImplementedError

    async def report(self, worker_id: str, report: TaskReport) -> None:
        raise NotImplementedError

    async def job_spec(self, job_id: str) -> str:
        raise NotImplementedError

    async def job_state(self, job_id: str) -> JobState:
        raise NotImplementedError

    async def watch_versions(self, job_id: str, worker_id: str = "") -> AsyncIterator[PublishedVersion]:
        assert worker_id == "w"  # the worker watches as a peer of the job's weight-update groups
        self.watched.append(job_id)
        versions, error = self.streams.pop(0)
        for version in versions:
            yield version
        raise error


class _RecordingRouter:
    def __init__(self) -> None:
        self.published: list[tuple[str, int, str]] = []

    def publish(self, key: str, version: int, uri: str) -> None:
        self.published.append((key, version, uri))


async def test_the_worker_hands_each_committed_version_to_the_router_and_watches_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "VERSION_WATCH_RETRY", RetryPolicy(initial_s=0.001, max_s=0.001))
    spec = JobSpec.model_validate(_spec({"max_staleness": 1}, {"partial_rollout": True}))
    link = _WatchLink([
        ([PublishedVersion("job-1", "a", 0), PublishedVersion("job-1", "gone", 4)], Unavailable("stream broke")),
        ([PublishedVersion("job-1", "a", 1, "stored://weights/a/1")], NotFound("job-1 ended")),
    ])
    settings = WorkerSettings(worker_id="w", work_dir=tmp_path, max_tasks=1, engine_backend="embedded",
                              engine_replicas=1, engine_urls=(), engine_threads=1, orchestrator_address="",
                              store_address="", max_message_bytes=1 << 20)
    worker = RolloutWorker(settings, cast(Registry, object()), RolloutMetrics(CollectorRegistry()), link=link)
    router = _RecordingRouter()
    job = worker_module._ServedJob("job-1", spec, cast(Any, None), cast(Any, None), cast(RolloutRouter, router))
    await asyncio.wait_for(worker._watch_versions(job), 10)  # ends when the job is gone
    assert link.watched == ["job-1", "job-1"]  # watched again after the broken stream
    # Version 0 is the spec's base model; an agent the job does not have is skipped.
    assert router.published == [("job-1/a", 0, "m"), ("job-1/a", 1, "stored://weights/a/1")]


class _StreamPeers:
    def __init__(self, messages: list[common_pb2.AgentVersion], error: BaseException | None) -> None:
        self.messages, self.error, self.resets = messages, error, 0
        self.requests: list[orchestrator_pb2.WatchAgentVersionsRequest] = []

    async def orchestrator(self) -> Any:
        peers = self

        class Stub:
            def WatchAgentVersions(self, request: Any) -> AsyncIterator[common_pb2.AgentVersion]:  # noqa: N802
                peers.requests.append(request)

                async def stream() -> AsyncIterator[common_pb2.AgentVersion]:
                    for message in peers.messages:
                        yield message
                    if peers.error is not None:
                        raise peers.error

                return stream()

        return Stub()

    async def reset_orchestrator(self) -> None:
        self.resets += 1


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


async def test_the_grpc_link_streams_versions_and_maps_a_broken_stream() -> None:
    version = common_pb2.AgentVersion(job_id="job-1", agent="a", version=2, weights_uri="u")
    for error, expected, resets in ((_rpc_error(grpc.StatusCode.UNAVAILABLE), Unavailable, 1),
                                    (_rpc_error(grpc.StatusCode.NOT_FOUND), NotFound, 0)):
        peers = _StreamPeers([version], error)
        link = GrpcOrchestratorLink(cast(PeerConnections, peers))
        got: list[PublishedVersion] = []
        with pytest.raises(expected):
            async for published in link.watch_versions("job-1"):
                got.append(published)
        assert got == [PublishedVersion("job-1", "a", 2, "u")] and peers.resets == resets
        assert peers.requests[0].job_id == "job-1"
