"""LoRA pools in the balancer (adapters share their base's replicas, bounded by adapter slots) and the router."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flexmarl.errors import InvalidArgument
from rolloutd.balancer import (
    BASE_ADAPTER,
    AgentSpec,
    BalancerConfig,
    HierarchicalBalancer,
    ReplicaAssignment,
    ReplicaPhase,
)
from rolloutd.engines.protocol import (
    EngineClient,
    EngineLoad,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    LoraAdapterResult,
    ModelInfo,
    PauseMode,
    WeightUpdateResult,
)
from rolloutd.router import Replica, RolloutRouter, agent_key

POOL = "lora:base"


def make(replicas: dict[str, str], full: dict[str, str], adapters: list[str], slots: int | None = 2,
         **config: object) -> HierarchicalBalancer:
    return HierarchicalBalancer(
        [ReplicaAssignment(r, m, 100.0) for r, m in replicas.items()],
        [AgentSpec(a, m) for a, m in full.items()] + [AgentSpec(a, POOL, adapter=True) for a in adapters],
        BalancerConfig(**config),  # type: ignore[arg-type]
        adapter_slots=None if slots is None else {POOL: slots},
    )


def test_adapters_of_one_base_share_its_replicas_without_a_move() -> None:
    b = make({"r0": POOL, "r1": POOL}, {}, ["a", "b", "c"], slots=3)
    tickets = [b.submit(agent, 10) for agent in ("a", "b", "c", "a", "b", "c")]
    assert {t.replica_id for t in tickets} == {"r0", "r1"}
    assert b.model_key_of("b") == POOL and b.replica_counts() == {POOL: 2}
    assert b.rebalance(0.0) == [] and b.reassignments == 0
    assert all(r.phase is ReplicaPhase.SERVING for r in b.replicas())


def test_a_replica_runs_at_most_its_adapter_slots_and_a_full_pool_waits() -> None:
    b = make({"r0": POOL}, {}, ["a", "b", "c"], slots=2)
    a0, b0 = b.submit("a", 10), b.submit("b", 10)
    assert a0.replica_id == b0.replica_id == "r0"
    assert b.submit("a", 10).replica_id == "r0"  # its adapter runs there: no new slot
    c0 = b.submit("c", 10)
    assert c0.replica_id is None and b.adapter_slots_free("r0") == 0
    assert b.replicas()[0].adapters == ("a", "b")
    b.finish(a0.request_id)
    assert b.place_queued() == []  # a's second request still holds its slot
    b.finish(b0.request_id)
    (placed,) = b.place_queued()
    assert placed.request_id == c0.request_id and placed.replica_id == "r0"
    assert b.replicas()[0].adapters == ("a", "c")


def test_a_waiting_adapter_does_not_hold_up_the_others_of_its_pool() -> None:
    b = make({"r0": POOL}, {}, ["a", "b", "c", "d"], slots=2)
    a0, _b0 = b.submit("a", 10), b.submit("b", 10)
    c0 = b.submit("c", 10)
    d0 = b.submit("d", 10)
    a1 = b.submit("a", 10)  # its adapter runs: placed at once, ahead of c and d
    assert a1.replica_id == "r0" and c0.replica_id is None and d0.replica_id is None
    b.finish(a0.request_id)
    b.finish(a1.request_id)
    (placed,) = b.place_queued()
    assert placed.request_id == c0.request_id  # FIFO among the waiting: c before d
    assert [t.request_id for t in b.queued()] == [d0.request_id]


def test_requests_go_to_a_replica_with_a_free_slot() -> None:
    b = make({"r0": POOL, "r1": POOL}, {}, ["a", "b", "c"], slots=1)
    assert b.submit("a", 1000).replica_id == "r0"
    assert b.submit("b", 10).replica_id == "r1"  # least tokens
    assert b.submit("a", 10).replica_id == "r0"  # r1 is lighter, but its one slot is b's
    assert b.submit("c", 10).replica_id is None  # both replicas' one slot taken


def test_unbounded_pool_and_full_model_agents_keep_replica_moves() -> None:
    b = make({"r0": POOL, "r1": "m", "r2": "m"}, {"full": "m"}, ["a", "b"], slots=None,
             rebalance_interval_s=0.0, reassignment_cost_s=0.0, hysteresis=0.0)
    assert b.submit("full", 100).replica_id in ("r1", "r2")
    for _ in range(20):
        assert b.submit("a", 100).replica_id == "r0"
        assert b.submit("b", 100).replica_id == "r0"  # no bound: any number of adapters
    moves = b.rebalance(0.0)
    assert [(m.from_model_key, m.to_model_key) for m in moves] == [("m", POOL)]  # the pool grows as one group
    assert b.replica_counts() == {POOL: 2, "m": 1}


def test_each_adapter_name_holds_a_slot_until_its_last_request_ends() -> None:
    b = make({"r0": POOL}, {}, ["a", "b"], slots=2)
    old = [b.submit("a", 10, adapter="a@v1") for _ in range(2)]
    new = b.submit("a", 10, adapter="a@v2")  # a switched versions: its requests carry two names now
    assert [t.replica_id for t in [*old, new]] == ["r0"] * 3
    assert b.replicas()[0].adapters == ("a@v1", "a@v2") and b.adapter_slots_free("r0") == 0
    waiting = b.submit("b", 10, adapter="b@v1")
    assert waiting.replica_id is None  # SGLang's batch holds two names already: it would queue b
    assert b.submit("a", 10, adapter="a@v2").replica_id == "r0"  # a running name needs no slot
    b.finish(old[0].request_id)
    assert b.place_queued() == []  # a@v1 still runs
    b.finish(old[1].request_id)  # the old name's last request: its slot is free
    (placed,) = b.place_queued()
    assert placed.request_id == waiting.request_id and placed.replica_id == "r0"
    assert b.replicas()[0].adapters == ("a@v2", "b@v1")


def test_the_base_alone_is_one_name_for_all_the_pools_agents() -> None:
    b = make({"r0": POOL, "r1": "m"}, {"full": "m"}, ["a", "b", "c"], slots=2)
    assert b.submit("a", 10, adapter=BASE_ADAPTER).replica_id == "r0"
    assert b.submit("b", 10, adapter=BASE_ADAPTER).replica_id == "r0"  # version 0 of both: the base, one name
    assert b.submit("c", 10, adapter="c@v1").replica_id == "r0"
    assert b.submit("a", 10, adapter="a@v1").replica_id is None  # a third name
    assert b.replicas()[0].adapters == (BASE_ADAPTER, "c@v1")
    with pytest.raises(InvalidArgument, match="full model"):
        b.submit("full", 10, adapter="full@v1")


def test_a_pool_cannot_mix_adapters_and_full_models() -> None:
    with pytest.raises(InvalidArgument, match="both LoRA agents and full-model agents"):
        make({"r0": POOL}, {"full": POOL}, ["a"])
    with pytest.raises(InvalidArgument, match="adapter_slots"):
        make({"r0": POOL}, {}, ["a"], slots=0)


# ---- the router over a pool: adapters per request, no reload for a version -------------------------------------
class _RecordingEngine(EngineClient):
    """An in-memory replica that records what the router asks of it (only the calls the LoRA path makes)."""

    def __init__(self) -> None:
        self.url = "memory://replica"
        self.weights: list[str] = []
        self.adapters: dict[str, str] = {}
        self.calls: list[str] = []
        self.requests: list[str | None] = []

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        self.requests.append(request.lora_path)
        if request.lora_path is not None and request.lora_path not in self.adapters:
            raise InvalidArgument(f"adapter {request.lora_path} not loaded")
        return [GenerationResult((7,), (-0.5,), FinishReason.LENGTH, len(request.input_ids), 1)]

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       load_format: str | None = None, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> WeightUpdateResult:
        self.weights.append(model_path)
        return WeightUpdateResult(True, "Succeeded to update model weights.")

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *, pinned: bool = False) -> LoraAdapterResult:
        self.calls.append(f"load {lora_name}")
        self.adapters[lora_name] = lora_path
        return LoraAdapterResult(True, "", dict(self.adapters))

    async def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        self.calls.append(f"unload {lora_name}")
        del self.adapters[lora_name]
        return LoraAdapterResult(True, "", dict(self.adapters))

    def _not_used(self) -> Any:
        raise AssertionError("the router's LoRA path does not call this")

    async def pause_generation(self, mode: PauseMode = PauseMode.ABORT) -> None:
        self._not_used()

    async def continue_generation(self) -> None:
        self._not_used()

    async def abort(self, rid: str = "", *, abort_all: bool = False) -> None:
        self._not_used()

    async def health(self) -> bool:
        return True

    async def health_generate(self) -> bool:
        return True

    async def model_info(self) -> ModelInfo:
        return self._not_used()  # type: ignore[no-any-return]

    async def server_info(self) -> dict[str, Any]:
        return self._not_used()  # type: ignore[no-any-return]

    async def flush_cache(self) -> bool:
        return True

    async def loads(self) -> EngineLoad:
        return self._not_used()  # type: ignore[no-any-return]

    async def close(self) -> None:
        return None


async def _resolve(uri: str) -> str:
    return uri


class _GatedEngine(_RecordingEngine):
    """A replica that holds each request until the gate of its adapter name (None: the base) opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: collections.defaultdict[str | None, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.arrived: collections.defaultdict[str | None, asyncio.Event] = collections.defaultdict(asyncio.Event)

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        self.arrived[request.lora_path].set()
        await self.gates[request.lora_path].wait()
        return await super().generate(request)

    async def reached(self, name: str | None) -> None:
        await asyncio.wait_for(self.arrived[name].wait(), 10.0)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):  # a bounded number of event-loop turns, no wall-clock wait
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


async def test_the_router_counts_the_adapter_name_each_request_is_served_with() -> None:
    engine = _GatedEngine()
    router = RolloutRouter([Replica("replica-0", engine)], _resolve, BalancerConfig(rebalance_interval_s=0.0))
    a, b, c = agent_key("job", "a"), agent_key("job", "b"), agent_key("job", "c")
    router.set_lora_agents({a: "/base", b: "/base", c: "/base"}, adapter_slots=2)
    for key in (a, b, c):
        router.require(key, 0, "/base")
    await router.set_agents([a, b, c])
    balancer = router.balancer()
    assert balancer is not None
    sampling = {"temperature": 1.0, "max_new_tokens": 1}

    def generate(key: str) -> asyncio.Task[list[Any]]:
        return asyncio.ensure_future(router.generate(key, [1, 2], sampling, 1, key))

    try:
        bases = [generate(a), generate(b)]  # version 0 of two agents: both the base alone, one name
        await engine.reached(None)
        await _until(lambda: balancer.replicas()[0].in_flight_requests == 2)
        assert balancer.replicas()[0].adapters == (BASE_ADAPTER,)
        engine.gates[None].set()
        await asyncio.gather(*bases)
        router.require(a, 1, "/a/v1")
        old = generate(a)
        await engine.reached("job/a@v1")
        router.require(a, 2, "/a/v2")  # a switches versions while a v1 request runs
        new = generate(a)
        await engine.reached("job/a@v2")
        assert balancer.replicas()[0].adapters == ("job/a@v1", "job/a@v2")
        router.require(c, 1, "/c/v1")
        other = generate(c)
        await _until(lambda: bool(balancer.queued(c)))
        assert [t.adapter for t in balancer.queued(c)] == ["job/c@v1"]  # a third name waits, as in SGLang
        engine.gates["job/a@v1"].set()
        (v1,) = await old
        await engine.reached("job/c@v1")  # the old name's last request ended: its slot went to c
        assert "unload job/a@v1" in engine.calls
        engine.gates["job/a@v2"].set()
        engine.gates["job/c@v1"].set()
        ((v2,), (c1,)) = await asyncio.gather(new, other)
        assert (v1.version, v2.version, c1.version) == (1, 2, 1)
        assert engine.requests == [None, None, "job/a@v1", "job/a@v2", "job/c@v1"]
    finally:
        for gate in ("job/a@v1", "job/a@v2", "job/c@v1", None):
            engine.gates[gate].set()
        await router.close()


async def test_the_router_serves_adapter_versions_on_the_base_and_moves_only_between_groups() -> None:
    engine = _RecordingEngine()
    router = RolloutRouter([Replica("replica-0", engine)], _resolve, BalancerConfig(rebalance_interval_s=0.0))
    a, b, full = agent_key("job", "a"), agent_key("job", "b"), agent_key("job", "full")
    router.set_lora_agents({a: "/base", b: "/base"}, adapter_slots=2)
    for key, uri in ((a, "/base"), (b, "/base"), (full, "/full/v0")):
        router.require(key, 0, uri)
    await router.set_agents([a, b, full])
    sampling = {"temperature": 1.0, "max_new_tokens": 1}
    try:
        (v0,) = await router.generate(a, [1, 2], sampling, 1, "t0")
        assert v0.version == 0 and engine.requests == [None]  # version 0: the base alone
        assert engine.weights == ["/base"]
        router.require(a, 1, "/a/v1")
        router.publish(a, 1, "/a/v1")  # nothing to drain or interrupt
        (v1,) = await router.generate(a, [1, 2], sampling, 1, "t1")
        router.require(a, 2, "/a/v2")
        (v2,) = await router.generate(a, [1, 2], sampling, 1, "t2")
        assert (v1.version, v2.version) == (1, 2)
        assert engine.requests[1:] == ["job/a@v1", "job/a@v2"]
        assert engine.calls == ["load job/a@v1", "load job/a@v2", "unload job/a@v1"]
        assert engine.weights == ["/base"]  # versions of an adapter never reload the base
        moves = router.reassignments
        await router.generate(b, [1, 2], sampling, 1, "t3")  # b shares the pool: no move either
        assert engine.weights == ["/base"] and router.reassignments == moves
        await router.generate(full, [1, 2], sampling, 1, "t4")  # a full model takes the replica ...
        assert engine.weights == ["/base", "/full/v0"] and engine.adapters == {}  # ... its adapters unloaded
        (again,) = await router.generate(a, [1, 2], sampling, 1, "t5")
        assert engine.weights == ["/base", "/full/v0", "/base"] and again.version == 2
        assert engine.requests[-1] == "job/a@v2" and engine.adapters == {"job/a@v2": "/a/v2"}
        await router.set_agents([b, full])  # a's job ended: its adapters go
        assert engine.adapters == {} and engine.calls[-1] == "unload job/a@v2"
    finally:
        await router.close()


def test_replicas_of_a_lora_job_launch_with_sglangs_flags_for_its_agents() -> None:
    import yaml

    from flexmarl.jobspec import JobSpec
    from rolloutd.lora_launch import engine_lora_settings, launch_model, lora_bases, target_modules

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/signaling_lora/job.yaml").read_text())
    for agent in raw["agents"]:  # the attention projections, whatever the example job file targets
        agent["lora"] = {**agent["lora"], "rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    targets = ["model.layers.0.mlp.up_proj"]
    raw["agents"][1]["lora"] = {**raw["agents"][1]["lora"], "rank": 16, "target_modules": targets}
    raw["agents"].append({**raw["agents"][0], "name": "full"})
    raw["agents"][-1].pop("lora")
    raw["agents"][-1]["model"] = raw["agents"][-1].pop("base")
    spec = JobSpec.model_validate(raw)
    settings = engine_lora_settings(spec, max_loras_per_batch=4, max_loaded_loras=None)
    assert settings.cli_args() == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "k_proj",
                                   "o_proj", "q_proj", "up_proj", "v_proj", "--max-loras-per-batch", "4"]
    settings.check()  # SGLang would start with them
    assert launch_model(spec) == "tiny://qwen2?seed=1" and "full" not in lora_bases(spec)
    assert len(lora_bases(spec)) == 8
    assert target_modules(["c_attn"]) == ("all",)  # not one of SGLang's names


async def test_a_replica_readmitted_to_a_lora_job_joins_the_pool_group() -> None:
    # readmit picks the group with the fewest replicas (most demand on ties); a LoRA pool's group is named
    # after its base, not after an agent, and asking the balancer for that "agent's" demand raised NotFound.
    engines = [_RecordingEngine(), _RecordingEngine()]
    replicas = [Replica(f"replica-{i}", engine) for i, engine in enumerate(engines)]
    router = RolloutRouter(replicas, _resolve, BalancerConfig(rebalance_interval_s=0.0))
    a, b = agent_key("job", "a"), agent_key("job", "b")
    router.set_lora_agents({a: "/base", b: "/base"}, adapter_slots=2)
    for key in (a, b):
        router.require(key, 0, "/base")
    await router.set_agents([a, b])
    try:
        balancer = router.balancer()
        assert balancer is not None
        [pool] = {replica.model_key for replica in balancer.replicas()}
        router._drop_replica(replicas[1], "a failed request")
        assert [r.replica_id for r in balancer.replicas()] == ["replica-0"]
        router.readmit(replicas[1])
        assert replicas[1].healthy
        assert sorted((r.replica_id, r.model_key) for r in balancer.replicas()) == [
            ("replica-0", pool), ("replica-1", pool)]
        (out,) = await router.generate(b, [1, 2], {"temperature": 1.0, "max_new_tokens": 1}, 1, "t0")
        assert out.version == 0
    finally:
        await router.close()
