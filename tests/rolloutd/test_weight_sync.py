"""Weight sync over a collective: traind's rank 0 broadcasts to embedded engines (real HTTP servers, gloo).

Two embedded engine subprocesses join a weight-update group hosted by a
:class:`traind.weight_sync.WeightBroadcaster` in this process, through the routes SGLang 0.5.23
serves (``/init_weights_update_group``, ``/begin_weight_update``,
``/update_weights_from_distributed``, ``/end_weight_update``, ``/destroy_weights_update_group``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.synthetic_engine import SyntheticEngineConfig, SyntheticReplica, SyntheticServer
from flexmarl.errors import FailedPrecondition
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch
from rolloutd.engines.protocol import GenerationRequest, PauseMode, SamplingParams
from rolloutd.engines.sglang_client import SGLangClient
from rolloutd.engines.weight_messages import DESTROY_MISSING
from traind.weight_sync import ReplicaGroup, WeightBroadcaster, WeightSyncError, plan_buckets

PROMPT = (104, 101, 108, 108, 111, 32, 119)
BUCKET_BYTES = 512 * 1024  # the tiny model (~5 MB in fp32) goes in about ten buckets


@pytest.fixture(scope="module")
def replica(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineReplica]:
    """An embedded engine serving the seed-0 checkpoint (the last test of the module kills it)."""
    spec = ReplicaSpec("embedded", str(engine_checkpoint), seed=0)
    started = asyncio.run(launch(spec, tmp_path_factory.mktemp("weight-sync"), timeout_s=120))
    try:
        yield started
    finally:
        started.stop(grace_s=10)


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


class _KillsItsEngine:
    """A replica's client that SIGKILLs its engine as the second bucket's update is sent."""

    def __init__(self, client: SGLangClient, pid: int) -> None:
        self.client, self.pid, self.url = client, pid, client.url
        self.updates = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> Any:
        self.updates += 1
        if self.updates == 2:
            os.kill(self.pid, signal.SIGKILL)
        return await self.client.update_weights_from_distributed(*args, **kwargs)


async def test_replica_killed_mid_broadcast_does_not_block_rank0(replica: EngineReplica, trainer_model: Any) -> None:
    """Rank 0 fails fast with a clear error naming the replica (last test of the module: it kills the engine)."""
    assert replica.pid is not None
    client = SGLangClient(replica.url, retries=0)
    timeout_s = 30.0
    try:
        victim = _KillsItsEngine(client, replica.pid)
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
