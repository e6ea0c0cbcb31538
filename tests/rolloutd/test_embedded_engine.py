"""The embedded engine in-process: continuous batching, admission, modelled time, sampling, swaps, abort."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from flexmarl import devicemodel
from flexmarl.errors import FlexmarlError, Unavailable
from rolloutd.engines.embedded import backend as embedded_backend
from rolloutd.engines.embedded.admission import BatchLimits, Demand, plan_admission
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.embedded.model import load_model
from rolloutd.engines.embedded.sampling import gumbel_max_token
from rolloutd.engines.launcher import ReplicaSpec, attach, launch, sglang_command
from rolloutd.engines.protocol import FinishReason, GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient

PROMPT = (104, 105)


@pytest.fixture
async def engine_server(engine_checkpoint: Path) -> AsyncIterator[tuple[EmbeddedServer, SGLangClient]]:
    # One intra-op thread, as the engine subprocess uses: on a shared 2-core machine two torch
    # threads per tiny matmul are ~30x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Deterministic inference: samples and logprobs do not depend on what shares the batch, which
    # is what the batching tests below compare against solo runs.
    config = EmbeddedEngineConfig(
        model_path=str(engine_checkpoint), batch_window_s=0.05, seed=0, enable_deterministic_inference=True
    )
    engine = EmbeddedEngine(config)
    server = EmbeddedServer(engine)
    port = await server.start("127.0.0.1", 0)
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()
        torch.set_num_threads(threads)


async def _wait_running(client: SGLangClient, count: int = 1) -> None:
    deadline = time.monotonic() + 20
    while (await client.loads()).num_running_reqs < count:
        assert time.monotonic() < deadline, "request never started"
        await asyncio.sleep(0.01)


async def test_concurrent_requests_share_a_batch_and_match_solo_runs(
    engine_server: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = engine_server
    prompts = [tuple(range(1, 2 + i * 3)) for i in range(5)]  # lengths differ: left padding matters
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=6, seed=i)) for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(client.generate(r) for r in requests))
    assert server.engine.max_batch_sequences == 5 and server.engine.batches_run == 1
    for request, [batched] in zip(requests, together, strict=True):
        [solo] = await client.generate(request)
        assert solo.output_ids == batched.output_ids
        assert (
            max(abs(a - b) for a, b in zip(solo.output_token_logprobs, batched.output_token_logprobs, strict=True))
            < 1e-4
        )


async def test_top_k_one_and_tiny_top_p_are_greedy(engine_server: tuple[EmbeddedServer, SGLangClient]) -> None:
    _, client = engine_server
    [greedy] = await client.generate(GenerationRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=6)))
    [top_k] = await client.generate(GenerationRequest(PROMPT, SamplingParams(top_k=1, max_new_tokens=6, seed=1)))
    [top_p] = await client.generate(GenerationRequest(PROMPT, SamplingParams(top_p=1e-6, max_new_tokens=6, seed=2)))
    assert greedy.output_ids == top_k.output_ids == top_p.output_ids
    [no_lp] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=3), return_logprob=False))
    assert no_lp.output_token_logprobs == () and len(no_lp.output_ids) == 3


async def test_zero_new_tokens_and_eos(engine_server: tuple[EmbeddedServer, SGLangClient]) -> None:
    server, client = engine_server
    [empty] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=0)))
    assert empty.output_ids == () and empty.finish_reason is FinishReason.LENGTH
    # Make every token an EOS: the first sample token ends the sequence unless ignore_eos.
    loaded = server.engine.loaded
    server.engine._loaded = type(loaded)(**{**loaded.__dict__, "eos_token_ids": frozenset(range(320))})
    [stopped] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, seed=1)))
    [ignored] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    assert stopped.finish_reason is FinishReason.STOP and len(stopped.output_ids) == 1
    assert ignored.finish_reason is FinishReason.LENGTH and len(ignored.output_ids) == 4


async def test_weight_swap_waits_for_the_running_batch(
    engine_server: tuple[EmbeddedServer, SGLangClient], engine_checkpoint_other: Path
) -> None:
    server, client = engine_server
    long_request = asyncio.create_task(
        client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=300, seed=1, ignore_eos=True)))
    )
    await _wait_running(client)
    await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v7")
    [old] = await long_request
    [new] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2)))
    # Every token of the running request came from the old weights; the next from the new ones.
    assert old.weight_version == "default" and old.completion_tokens == 300
    assert new.weight_version == "v7" and new.model_path == str(engine_checkpoint_other)


async def test_stopping_during_a_weight_load_answers_the_update_and_stops_at_once(
    engine_checkpoint: Path, engine_checkpoint_other: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The load runs off the event loop; the engine stops before it is done. The swap it then
    # submits must be refused (nothing would ever apply it): before, the update's handler waited
    # for ever and the server's stop for aiohttp's 60 s shutdown timeout.
    loading, release = threading.Event(), threading.Event()

    def slow_load(model_path: str, weight_version: str) -> Any:
        loading.set()
        release.wait(30)
        return load_model(model_path, weight_version)

    monkeypatch.setattr(embedded_backend, "load_model", slow_load)
    config = EmbeddedEngineConfig(model_path=str(engine_checkpoint), seed=0)
    server = EmbeddedServer(EmbeddedEngine(config))
    client = SGLangClient(f"http://127.0.0.1:{await server.start('127.0.0.1', 0)}")
    update = asyncio.create_task(client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v2"))
    try:
        assert await asyncio.to_thread(loading.wait, 20)
        stopping = asyncio.create_task(server.stop())
        deadline = time.monotonic() + 20
        while server.engine._thread is not None:  # the worker has joined: the engine is stopped
            assert time.monotonic() < deadline, "the engine did not stop"
            await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(FlexmarlError):
            await asyncio.wait_for(update, 20)
        await asyncio.wait_for(stopping, 20)
    finally:
        release.set()
        await client.close()
        await server.stop()


def _lm_head_tied(model: Any) -> bool:
    return bool(model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr())


def test_loads_in_several_threads_at_once_load_every_weight(engine_checkpoint: Path) -> None:
    # transformers' from_pretrained swaps module globals for a load; two loads that overlapped
    # once left them swapped, and every later load in the process left lm_head untied and
    # unloaded (the engine then sampled from NaN logits and died).
    assert _lm_head_tied(load_model(str(engine_checkpoint), "v0").model)
    loaded: list[Any] = []
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        for result in pool.map(lambda i: load_model(str(engine_checkpoint), f"v{i}"), range(12)):
            loaded.append(result)
    loaded.append(load_model(str(engine_checkpoint), "after"))
    for result in loaded:
        assert _lm_head_tied(result.model), result.weight_version
        assert not any(param.is_meta for param in result.model.parameters())


async def test_overlapping_weight_updates_load_one_at_a_time(
    engine_server: tuple[EmbeddedServer, SGLangClient], engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    # SGLang's scheduler takes update requests one at a time, in the order they came: the last answered serves.
    server, client = engine_server
    answered: list[tuple[Path, str]] = []

    async def update(path: Path, version: str) -> None:
        await client.update_weights_from_disk(str(path), weight_version=version)
        answered.append((path, version))

    paths = [engine_checkpoint_other, engine_checkpoint] * 3
    await asyncio.gather(*(update(path, f"w{index}") for index, path in enumerate(paths)))
    path, version = answered[-1]
    assert server.engine.loaded.weight_version == version and server.engine.loaded.model_path == str(path)
    assert _lm_head_tied(server.engine.loaded.model)
    samples = await asyncio.gather(*(
        client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed)))
        for seed in range(4)
    ))
    assert all(sample.weight_version == version and sample.completion_tokens > 0 for [sample] in samples)
    assert server.engine.fatal is None


@contextlib.asynccontextmanager
async def _server(config: EmbeddedEngineConfig) -> AsyncIterator[tuple[EmbeddedServer, SGLangClient]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = EmbeddedServer(EmbeddedEngine(config))
    client = SGLangClient(f"http://127.0.0.1:{await server.start('127.0.0.1', 0)}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()
        torch.set_num_threads(threads)


async def test_abort_all_and_queued(engine_checkpoint: Path) -> None:
    # One running sequence at most, so the second request (n=2) has to wait in the queue. Raw
    # HTTP: the client would hold the second request back (it keeps to the replica's capacity).
    config = EmbeddedEngineConfig(model_path=str(engine_checkpoint), max_batch_size=1, seed=0)
    async with _server(config) as (_, client), aiohttp.ClientSession() as session:

        async def generate(sampling: dict[str, Any]) -> Any:
            body = {"input_ids": list(PROMPT), "sampling_params": sampling, "return_logprob": True}
            async with session.post(client.url + "/generate", json=body) as response:
                assert response.status == 200
                return await response.json()

        running = asyncio.create_task(generate({"max_new_tokens": 1500, "ignore_eos": True}))
        await _wait_running(client)
        queued = asyncio.create_task(generate({"max_new_tokens": 1500, "ignore_eos": True, "n": 2}))
        deadline = time.monotonic() + 20
        while (await client.loads()).num_waiting_reqs < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await client.abort(abort_all=True)
        first = await asyncio.wait_for(running, 20)
        second = await asyncio.wait_for(queued, 20)
        # Running: SGLang's FINISH_ABORT() and the tokens so far (scheduler.py, schedule_batch.py).
        assert first["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < first["meta_info"]["completion_tokens"] == len(first["output_ids"]) < 1500
        # Queued: tokenizer_manager.py's shorter answer (no prompt_tokens), nothing generated.
        for sample in second:
            assert sample["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
            assert sample["output_ids"] == [] and sample["meta_info"]["completion_tokens"] == 0
            assert "prompt_tokens" not in sample["meta_info"]
        assert await client.health_generate()  # still serving after aborts


async def test_requests_join_the_running_batch_and_leave_when_done(
    engine_server: tuple[EmbeddedServer, SGLangClient],
) -> None:
    server, client = engine_server
    long_request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=250, seed=5, ignore_eos=True))
    # Longer prompts than the running one: the joining rows' caches are left-padded to merge.
    joiners = [GenerationRequest(tuple(range(3, 3 + k)), SamplingParams(max_new_tokens=4, seed=k)) for k in (7, 11)]
    long_task = asyncio.create_task(client.generate(long_request))
    await _wait_running(client)
    joined = [await client.generate(request) for request in joiners]
    # Continuous batching: each short request was admitted into the running batch and returned
    # while the long one (hundreds of iterations to go) was still decoding.
    assert not long_task.done()
    assert server.engine.max_batch_sequences == 2 and server.engine.batches_run == 3
    [long_out] = await long_task
    assert long_out.completion_tokens == 250
    # Every token and logprob equals a run alone (no padding or merge leaks into the math).
    for request, [together] in [*zip(joiners, joined, strict=True), (long_request, [long_out])]:
        [solo] = await client.generate(request)
        assert solo.output_ids == together.output_ids
        diffs = [abs(a - b) for a, b in zip(solo.output_token_logprobs, together.output_token_logprobs, strict=True)]
        assert max(diffs) < 1e-4


# ----- admission (pure) ------------------------------------------------------------------------


def test_admission_is_first_come_first_served_within_the_sequence_limit() -> None:
    limits = BatchLimits(max_running=4)
    # 2 + 1 fit into 4; the third (2 more, 5 > 4) does not.
    assert plan_admission([Demand(2, 0), Demand(1, 0), Demand(2, 0)], 0, 0.0, limits) == 2
    # 2 running + 3 = 5 > 4: the head waits and the small job behind it does not overtake it.
    assert plan_admission([Demand(3, 0), Demand(1, 0)], 2, 0.0, limits) == 0
    # A job larger than the limit alone enters an empty batch, but only as the first of the round.
    assert plan_admission([Demand(8, 0)], 0, 0.0, limits) == 1
    assert plan_admission([Demand(1, 0), Demand(8, 0)], 0, 0.0, limits) == 1
    assert plan_admission([Demand(8, 0)], 1, 0.0, limits) == 0
    assert plan_admission([], 0, 0.0, limits) == 0


def test_admission_reserves_prompt_plus_max_new_tokens_of_kv_cache() -> None:
    limits = BatchLimits(max_running=100, kv_capacity_tokens=1000.0)
    # 600 reserved: +300 = 900 fits, +200 more = 1100 does not.
    assert plan_admission([Demand(1, 300.0), Demand(1, 200.0)], 1, 600.0, limits) == 1
    assert plan_admission([Demand(1, 401.0)], 1, 600.0, limits) == 0
    assert plan_admission([Demand(1, 400.0)], 1, 600.0, limits) == 1


def test_modelled_limits_come_from_the_device_model() -> None:
    profile = devicemodel.H100_SXM.with_changes(token_scale=128.0)
    limits = BatchLimits.for_engine(32, profile)
    # (80e9 * 0.88 - 29.4e9) / 196608 = 41.0e9 / 196608 = 208,536.8 tokens; max_batch_size is a real-mode limit.
    assert limits.kv_capacity_tokens == pytest.approx(208_536.78, rel=1e-6)
    assert limits.max_running == 1024 and limits.token_scale == 128.0
    # 16 samples of a 4-token prompt with 64 new tokens, x128: 16 * 68 * 128 = 139,264 modelled tokens.
    group = limits.demand(4, 64, 16)
    assert group == Demand(16, 139_264.0)
    # One group fits, two (278,528) do not: the second waits for sequences of the first to finish.
    assert plan_admission([group, group], 0, 0.0, limits) == 1
    assert BatchLimits.for_engine(32, None) == BatchLimits(max_running=32)


# ----- modelled device time --------------------------------------------------------------------


def _modelled_profile(tmp_path: Path, **changes: float) -> Path:
    profile = devicemodel.H100_SXM.with_changes(time_scale=0.002, trace_dir=str(tmp_path / "traces"), **changes)
    path = tmp_path / "device.json"
    path.write_text(profile.to_json())
    return path


async def test_modelled_time_of_a_continuous_batch(engine_checkpoint: Path, tmp_path: Path) -> None:
    profile_path = _modelled_profile(tmp_path)
    config = EmbeddedEngineConfig(
        model_path=str(engine_checkpoint), batch_window_s=0.2, seed=0, modelled_device=str(profile_path)
    )
    async with _server(config) as (server, client):
        [short], [long] = await asyncio.gather(
            client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=1))),
            client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True))),
        )
        assert (short.completion_tokens, long.completion_tokens) == (1, 3)
        assert server.engine.batches_run == 1  # both were admitted together
    # That the short sequence leaves after its own iteration shows in the modelled schedule below
    # (iterations 2 and 3 decode one sequence), not in which response the client reads first: the
    # long one finishes two paced iterations (~25 ms) later, less than a loaded machine's HTTP jitter.
    # Hand schedule (token_scale 1): one prefill of both 2-token prompts (4 tokens); iteration 1
    # decodes 2 sequences over 2 + 2 prompt tokens + 2 new = 6 context tokens; the short one ends;
    # iterations 2 and 3 decode the long one alone over 4 and then 5 context tokens.
    profile = devicemodel.load_profile(profile_path)
    expected_s = (
        devicemodel.prefill_s(profile, 4)
        + devicemodel.decode_iteration_s(profile, 2, 6)
        + devicemodel.decode_iteration_s(profile, 1, 4)
        + devicemodel.decode_iteration_s(profile, 1, 5)
    )
    records = [r for rs in devicemodel.read_traces(tmp_path / "traces").values() for r in rs]
    assert {r["kind"] for r in records} == {"generate"}
    assert sum(r["modelled_s"] for r in records) == pytest.approx(expected_s, rel=1e-9)
    assert sum(r["tokens"] for r in records) == 4.0
    # By hand: 3 weight reads of 29.4 GB + 15 context tokens of 196,608 B at 2.345 TB/s, plus
    # 2 * 14.7e9 * 4 FLOP of prefill at 593.4 TFLOP/s = 37.61 ms + 0.0013 ms + 0.198 ms = 37.81 ms.
    assert expected_s == pytest.approx(3 * 29.4e9 / 2.345e12 + 15 * 196_608 / 2.345e12 + 2 * 14.7e9 * 4 / 593.4e12)
    assert expected_s == pytest.approx(0.037811, rel=1e-4)


async def test_the_kv_capacity_of_the_device_model_bounds_the_batch(engine_checkpoint: Path, tmp_path: Path) -> None:
    # Memory for the weights plus 10 KV tokens: a sequence reserving 2 + 4 = 6 tokens fits, two do not.
    weights = devicemodel.H100_SXM.weight_bytes
    kv = devicemodel.H100_SXM.kv_bytes_per_token
    profile_path = _modelled_profile(tmp_path, hbm_capacity_bytes=(weights + 10 * kv) / 0.88)
    config = EmbeddedEngineConfig(model_path=str(engine_checkpoint), seed=0, modelled_device=str(profile_path))
    async with _server(config) as (server, client):
        assert server.engine.limits.kv_capacity_tokens == pytest.approx(10.0)
        requests = [GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True)) for _ in range(2)]
        outputs = await asyncio.gather(*(client.generate(r) for r in requests))
        assert [out.completion_tokens for [out] in outputs] == [4, 4]
        assert server.engine.max_batch_sequences == 1 and server.engine.batches_run == 2


def test_sglang_command_uses_server_args_flags() -> None:
    spec = ReplicaSpec(
        "sglang",
        "/ckpt",
        host="0.0.0.0",
        tp_size=2,
        mem_fraction_static=0.8,
        seed=3,
        weight_version="5",
        extra_args=("--skip-tokenizer-init",),
    )
    command = sglang_command(spec, 30000)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--model-path"] == "/ckpt" and flags["--port"] == "30000" and flags["--host"] == "0.0.0.0"
    assert flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.8"
    assert flags["--random-seed"] == "3" and flags["--weight-version"] == "5"
    assert command[-1] == "--skip-tokenizer-init"


async def test_attach_and_launch_failures(tmp_path: Path) -> None:
    replica = attach("http://127.0.0.1:9/")
    assert replica.url == "http://127.0.0.1:9" and replica.pid is None and replica.stop() is None
    with pytest.raises(Unavailable):
        await replica.wait_healthy(timeout_s=0.3)
    with pytest.raises(Unavailable, match="exited"):
        await launch(ReplicaSpec("embedded", str(tmp_path / "no-such-checkpoint")), tmp_path, timeout_s=60)


# ----- seeded sampling (deterministic inference) ------------------------------------------------


def test_gumbel_max_token_is_a_function_of_seed_and_position_and_samples_probs() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert gumbel_max_token(probs, 7, 12) == gumbel_max_token(probs.clone(), 7, 12)  # same (seed, position)
    draws = [gumbel_max_token(probs, 7, position) for position in range(4000)]
    counts = [draws.count(token) / len(draws) for token in range(4)]
    # Gumbel-max over independent uniforms per position samples the distribution; a zero never wins.
    assert counts[3] == 0.0
    assert counts[:3] == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    assert len({gumbel_max_token(torch.full((64,), 1 / 64), seed, 5) for seed in range(20)}) > 10
