"""LoRA adapters in the shipped engines, as SGLang 0.5.23 serves them (rolloutd/engines/lora.py).

The served logprobs of an adapter are checked against ``peft.PeftModel`` over the same tiny
base; one forward pass mixes adapters and the base; every refusal answers SGLang's message;
the synthetic engine serves the same routes with the same answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from benchmarks.synthetic_engine import SyntheticServer
from benchmarks.synthetic_replica import SyntheticEngineConfig, SyntheticReplica
from flexmarl import devicemodel
from flexmarl.errors import FailedPrecondition, InvalidArgument
from rolloutd.engines import lora
from rolloutd.engines.embedded.admission import BatchLimits, Demand, admitted_indices, plan_admission
from rolloutd.engines.embedded.backend import EmbeddedServer
from rolloutd.engines.embedded.config import EmbeddedEngineConfig
from rolloutd.engines.embedded.engine import EmbeddedEngine
from rolloutd.engines.embedded.server import SGLangServer
from rolloutd.engines.launcher import ReplicaSpec, embedded_command, sglang_command
from rolloutd.engines.lora import AdapterPool, LoraRef, LoraSettings
from rolloutd.engines.protocol import GenerationRequest, PauseMode, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.lora_residency import AdapterVersion, LoraResidency

PROMPTS = ((104, 101, 108, 108, 111), (119, 111, 114, 108, 100, 33))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SERVED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj")


def _peft_adapter(base: Any, path: Path, *, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT adapter over ``base`` with random (nonzero) A and B, saved as PeftModel.save_pretrained does."""
    from peft import LoraConfig, get_peft_model

    generator = torch.Generator().manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.1, target_modules=targets)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def adapters(engine_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters of the tiny base: two servable ones, and ones the server must refuse."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-adapters")
    base = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32)
    made = {
        "a": _peft_adapter(base, root / "a", rank=4, targets=["q_proj", "v_proj"], seed=1),
        "b": _peft_adapter(base, root / "b", rank=8, targets=list(SERVED_TARGETS), seed=2),
        "rank16": _peft_adapter(base, root / "rank16", rank=16, targets=["q_proj"], seed=3),
        "down": _peft_adapter(base, root / "down", rank=4, targets=["down_proj"], seed=4),
    }
    dora = root / "dora"
    dora.mkdir()
    config = json.loads((made["a"] / lora.ADAPTER_CONFIG_FILE).read_text())
    (dora / lora.ADAPTER_CONFIG_FILE).write_text(json.dumps({**config, "use_dora": True}))
    made["dora"] = dora
    return made


def _settings(**changes: Any) -> LoraSettings:
    values: dict[str, Any] = {
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_target_modules": SERVED_TARGETS,
        "max_loras_per_batch": 3,
    }
    return LoraSettings(**{**values, **changes})


@contextlib.asynccontextmanager
async def _serve(server: SGLangServer) -> AsyncIterator[SGLangClient]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    client = SGLangClient(f"http://127.0.0.1:{await server.start('127.0.0.1', 0)}")
    try:
        yield client
    finally:
        await client.close()
        await server.stop()
        torch.set_num_threads(threads)


def _embedded(checkpoint: Path, settings: LoraSettings, **config: Any) -> EmbeddedServer:
    return EmbeddedServer(
        EmbeddedEngine(EmbeddedEngineConfig(str(checkpoint), seed=0, batch_window_s=0.05, lora=settings, **config))
    )


async def _post(client: SGLangClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(client.url + path, json=body) as response:
        return response.status, await response.json()


class _PeftReference:
    """``peft.PeftModel`` over the tiny base with the named adapters (one model, adapters switched)."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        (first, path), *rest = adapters.items()
        self.model: Any = PeftModel.from_pretrained(model, str(path), adapter_name=first)
        for name, other in rest:
            self.model.load_adapter(str(other), adapter_name=name)
        self.model.eval()

    def logprobs(self, adapter: str | None, prompt: tuple[int, ...], output: tuple[int, ...]) -> list[float]:
        """Greedy logprobs of ``output`` after ``prompt`` from one forward pass (``None``: adapters off)."""
        context = self.model.disable_adapter() if adapter is None else contextlib.nullcontext()
        if adapter is not None:
            self.model.set_adapter(adapter)
        with torch.no_grad(), context:
            logits = self.model(input_ids=torch.tensor([[*prompt, *output]])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [float(logprobs[len(prompt) - 1 + index, token]) for index, token in enumerate(output)]


# ----- pure logic ------------------------------------------------------------------------------
def test_admission_skips_a_request_whose_adapter_does_not_fit_the_batch() -> None:
    pool = AdapterPool(_settings(max_loras_per_batch=2), {"qkv_proj"}, 8)
    limits = BatchLimits(max_running=8)
    waiting = [Demand(1, 0.0)] * 4
    # Running: the base. "x" fits (2 distinct), "y" would be a third: skipped, the later "x" and base join.
    chosen = admitted_indices(
        waiting, 1, 0.0, limits, adapters=["x", "y", "x", None], running_adapters=frozenset({None}), pool=pool
    )
    assert chosen == [0, 2, 3]
    # Capacity still stops admission at the first job that does not fit (no overtaking).
    assert admitted_indices(waiting, 7, 0.0, limits, adapters=[None] * 4, pool=pool) == [0]
    assert plan_admission(waiting, 0, 0.0, limits) == 4


def test_pinned_adapters_leave_a_slot_and_settings_checks_are_sglangs() -> None:
    pool = AdapterPool(_settings(), {"qkv_proj"}, 8)
    config = lora.AdapterConfig("/a", ["q_proj"], 4, 8.0, False, 0)
    pool.validate_new(config, LoraRef("1", "a", "/a", pinned=True))
    pool.add(LoraRef("1", "a", "/a", pinned=True), config)
    pool.validate_new(config, LoraRef("2", "b", "/b", pinned=True))
    pool.add(LoraRef("2", "b", "/b", pinned=True), config)
    with pytest.raises(ValueError, match="not allowed to pin all slots"):
        pool.validate_new(config, LoraRef("3", "c", "/c", pinned=True))
    normalized = lora.normalized_target_modules(["model.layers.0.self_attn.k_proj", "up_proj"])
    assert normalized == {"qkv_proj", "gate_up_proj"}
    with pytest.raises(InvalidArgument, match="both --max-lora-rank and --lora-target-modules"):
        LoraSettings(enable_lora=True, max_lora_rank=8).check()
    with pytest.raises(InvalidArgument, match="max_loaded_loras should be greater than or equal"):
        _settings(max_loaded_loras=2).check()
    with pytest.raises(InvalidArgument, match="should be the only module"):
        _settings(lora_target_modules=("all", "q_proj")).check()
    assert LoraSettings(lora_paths=("x=/p",)).enabled  # --lora-paths alone enables LoRA (lora_hook.py)
    ref = lora.parse_lora_path('{"lora_name": "n", "lora_path": "/p", "pinned": true}')
    assert (ref.lora_name, ref.lora_path, ref.pinned) == ("n", "/p", True)
    assert ref.lora_id == LoraRef.deterministic_id("n", "/p")


def test_both_engines_parse_sglangs_lora_flags() -> None:
    from benchmarks import synthetic_engine
    from rolloutd.engines.embedded import cli

    flags = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
             "--max-loras-per-batch", "2", "--lora-paths", "a=/adapters/a"]
    config = cli.parse_args(["--model-path", "/m", *flags])
    assert config.lora == LoraSettings(True, 8, ("q_proj", "v_proj"), ("a=/adapters/a",), 2, None)
    with pytest.raises(SystemExit):  # SGLang refuses to start: no --lora-paths, no --lora-target-modules
        cli.parse_args(["--model-path", "/m", "--enable-lora", "--max-lora-rank", "8"])
    synthetic = SyntheticEngineConfig(lora=config.lora)
    assert synthetic_engine._parse_args(synthetic_engine.to_args(synthetic))[0].lora == config.lora


def test_launcher_passes_sglangs_lora_flags() -> None:
    settings = _settings(max_loaded_loras=4, lora_paths=("a=/adapters/a",))
    spec = ReplicaSpec("sglang", "/m", lora=settings)
    command = sglang_command(spec, 30000)
    for flags in (
        ["--enable-lora"],
        ["--max-lora-rank", "8"],
        ["--lora-target-modules", *SERVED_TARGETS],
        ["--max-loras-per-batch", "3"],
        ["--max-loaded-loras", "4"],
        ["--lora-paths", "a=/adapters/a"],
    ):
        start = command.index(flags[0])
        assert command[start : start + len(flags)] == flags
    assert "--enable-lora" in embedded_command(ReplicaSpec("embedded", "/m", lora=settings), Path("/r"))
    assert "--enable-lora" not in sglang_command(ReplicaSpec("sglang", "/m"), 30000)


# ----- the embedded engine ------------------------------------------------------------------------
def test_an_lm_head_adapter_of_a_tied_base_gives_peft_logits_beside_base_rows(
    engine_checkpoint: Path, tmp_path: Path
) -> None:
    """examples/signaling_lora adapts ``lm_head``, which the tiny base ties to its embeddings: the per-row delta
    applies to the logits only (the tied embedding stays the base's), as PEFT computes them."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(engine_checkpoint), dtype=torch.float32)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    path = _peft_adapter(base, tmp_path / "head", rank=4, targets=["lm_head", "q_proj"], seed=5)
    from safetensors import safe_open

    with safe_open(str(path / lora.ADAPTER_WEIGHTS_FILE), "pt") as saved:  # PEFT saves the tied base beside it
        assert "base_model.model.lm_head.base_layer.weight" in set(saved.keys())
    config = lora.read_adapter_config(str(path), base.config.vocab_size)
    layers = lora.LoraLayers(max_rank=8)
    layers.adapters["head"] = lora.load_adapter_weights(str(path), config, base, 8)
    assert set(layers.adapters["head"].modules) == {"lm_head", "model.layers.0.self_attn.q_proj",
                                                    "model.layers.1.self_attn.q_proj"}
    ids = torch.tensor([list(PROMPTS[0]), list(PROMPTS[0])])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        with layers.rows(base, ["head", None]):
            served = base(input_ids=ids).logits
    reference = _PeftReference(engine_checkpoint, {"head": path})
    with torch.no_grad():
        want = reference.model(input_ids=ids[:1]).logits
    assert not torch.allclose(served[0], plain[0], atol=1e-3)  # the adapter moves the logits
    assert torch.allclose(served[0], want[0], atol=1e-5)
    assert torch.equal(served[1], plain[1])  # a base row of the same batch is the base


async def test_adapter_logprobs_equal_a_peft_forward_and_one_batch_mixes_adapters(
    engine_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    server = _embedded(engine_checkpoint, _settings())
    async with _serve(server) as client:
        loaded = await client.load_lora_adapter("a", str(adapters["a"]))
        assert loaded.loaded_adapters == {"a": str(adapters["a"])}
        await client.load_lora_adapter("b", str(adapters["b"]))
        alone = {}
        for name in (None, "a", "b"):
            [result] = await client.generate(GenerationRequest(PROMPTS[0], GREEDY, lora_path=name))
            alone[name] = result
        # One /generate of three prompts, one per adapter and the base: prefilled and decoded together.
        body = {
            "input_ids": [list(PROMPTS[0])] * 3,
            "sampling_params": GREEDY.to_wire(),
            "return_logprob": True,
            "lora_path": [None, "a", "b"],
        }
        status, mixed = await _post(client, "/generate", body)
        assert status == 200, mixed
        info = await client.server_info()
    assert info["internal_states"][0]["max_batch_adapters"] == 3
    for name, row in zip((None, "a", "b"), mixed, strict=True):
        assert tuple(row["output_ids"]) == alone[name].output_ids
        served = [triple[0] for triple in row["meta_info"]["output_token_logprobs"]]
        assert served == pytest.approx(list(alone[name].output_token_logprobs), abs=1e-5)
    peft = _PeftReference(engine_checkpoint, {"a": adapters["a"], "b": adapters["b"]})
    for name in (None, "a", "b"):
        result = alone[name]
        reference = peft.logprobs(name, PROMPTS[0], result.output_ids)
        assert list(result.output_token_logprobs) == pytest.approx(reference, abs=1e-4)
        if name is not None:  # the adapter matters: the base gives those tokens other logprobs
            base_view = peft.logprobs(None, PROMPTS[0], result.output_ids)
            assert max(abs(x - y) for x, y in zip(reference, base_view, strict=True)) > 1e-3


async def test_deterministic_inference_with_adapters_is_batch_invariant(
    engine_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    server = _embedded(
        engine_checkpoint, _settings(lora_paths=(f"a={adapters['a']}",)), enable_deterministic_inference=True
    )
    sampled = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=5)
    async with _serve(server) as client:
        [alone] = await client.generate(GenerationRequest(PROMPTS[1], sampled, lora_path="a"))
        together = await asyncio.gather(
            client.generate(GenerationRequest(PROMPTS[1], sampled, lora_path="a")),
            client.generate(GenerationRequest(PROMPTS[0], sampled)),
        )
    assert together[0][0].output_ids == alone.output_ids
    assert together[0][0].output_token_logprobs == alone.output_token_logprobs


async def test_refusals_answer_sglangs_messages(engine_checkpoint: Path, adapters: dict[str, Path]) -> None:
    server = _embedded(engine_checkpoint, _settings(max_loaded_loras=3))
    async with _serve(server) as client:
        await client.load_lora_adapter("a", str(adapters["a"]))
        refusals = {
            "already loaded": ("a", adapters["b"]),
            "with rank 16 is incompatible": ("r16", adapters["rank16"]),
            "with rank 4 is incompatible": ("down", adapters["down"]),  # down_proj is not served
            "doesn't support DoRA": ("dora", adapters["dora"]),
            "Repo id must be in the form": ("missing", adapters["a"].parent / "nowhere"),
            "No such file or directory": ("empty", adapters["a"].parent),
        }
        for message, (name, path) in refusals.items():
            status, answer = await _post(client, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            assert status == 400 and answer["success"] is False and message in answer["error_message"], answer
        assert set(answer) == {"rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"}
        status, answer = await _post(client, "/unload_lora_adapter", {"lora_name": "nope"})
        assert status == 400 and "LoRA with name nope does not exist" in answer["error_message"]
        status, answer = await _post(client, "/load_lora_adapter", {"lora_name": "x"})  # lora_path is required
        assert status == 400 and answer["object"] == "error"
        with pytest.raises(InvalidArgument, match="has never been loaded: nope"):
            await client.generate(GenerationRequest(PROMPTS[0], GREEDY, lora_path="nope"))
        status, answer = await _post(
            client, "/generate", {"input_ids": [list(PROMPTS[0])] * 2, "lora_path": ["a"], "sampling_params": {}}
        )
        assert status == 400 and "must match batch size" in answer["error"]["message"]
        status, answer = await _post(client, "/generate", {"input_ids": list(PROMPTS[0]), "lora_path": 3})
        assert status == 400
        # --max-loaded-loras 3: the fourth load evicts the least recently used unpinned adapter ("b";
        # "a" was used by a request since).
        await client.load_lora_adapter("b", str(adapters["b"]))
        await client.load_lora_adapter("c", str(adapters["a"]), pinned=True)
        await client.generate(GenerationRequest(PROMPTS[0], GREEDY, lora_path="a"))
        fourth = await client.load_lora_adapter("d", str(adapters["b"]))
        assert set(fourth.loaded_adapters) == {"a", "c", "d"}
        async with aiohttp.ClientSession() as session, session.get(client.url + "/v1/models") as response:
            models = await response.json()
        # The base, then the adapters in the registry's LRU order (http_server.py available_models).
        assert [card["id"] for card in models["data"]] == [str(engine_checkpoint), "c", "a", "d"]
        assert models["data"][1]["parent"] == str(engine_checkpoint)

    plain = _embedded(engine_checkpoint, LoraSettings())
    async with _serve(plain) as client:
        with pytest.raises(FailedPrecondition, match="LoRA is not enabled"):
            await client.load_lora_adapter("a", str(adapters["a"]))
        with pytest.raises(InvalidArgument, match="was requested, but LoRA is not enabled"):
            await client.generate(GenerationRequest(PROMPTS[0], GREEDY, lora_path="a"))


async def test_unload_waits_for_its_requests_and_a_later_request_reloads_it(
    engine_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    server = _embedded(engine_checkpoint, _settings(max_loras_per_batch=1))
    long = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    async with _serve(server) as client:
        await client.load_lora_adapter("a", str(adapters["a"]))
        await client.load_lora_adapter("b", str(adapters["b"]))
        running = asyncio.ensure_future(client.generate(GenerationRequest(PROMPTS[0], long, lora_path="a")))
        while (await client.loads()).num_running_reqs < 1:
            await asyncio.sleep(0.01)
        # Paused in place, "a"'s request cannot finish: the unload must wait for it (SGLang's registry).
        await client.pause_generation(PauseMode.IN_PLACE)
        unload = asyncio.ensure_future(client.unload_lora_adapter("a"))
        await asyncio.sleep(0.1)
        assert not unload.done() and not running.done()
        await client.continue_generation()
        # --max-loras-per-batch 1: "b" cannot join "a"'s batch; it waits for it.
        other = asyncio.ensure_future(client.generate(GenerationRequest(PROMPTS[1], GREEDY, lora_path="b")))
        [result] = await running
        assert len(result.output_ids) == 24 and result.finish_reason.value == "length"
        assert (await unload).loaded_adapters == {"b": str(adapters["b"])}
        await other
        info = await client.server_info()
        assert info["internal_states"][0]["max_batch_adapters"] == 1  # "b" never joined "a"'s batch
        [again] = await client.generate(GenerationRequest(PROMPTS[0], GREEDY, lora_path="a"))  # reloaded
        assert again.output_ids == result.output_ids[: len(again.output_ids)]


async def test_modelled_adapter_load_takes_its_transfer_time(
    engine_checkpoint: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    # The adapter's share of the modelled model (its parameters per base parameter), over the link.
    profile = devicemodel.H100_SXM.with_changes(
        link_bytes_per_s=2.5e5, model_params=1e6, time_scale=1.0, trace_dir=str(tmp_path / "traces")
    )
    profile_path = tmp_path / "device.json"
    profile_path.write_text(profile.to_json())
    server = _embedded(engine_checkpoint, _settings(), modelled_device=str(profile_path))
    real_params = sum(int(p.numel()) for p in server.engine.loaded.model.parameters())
    params = lora.adapter_num_params(str(adapters["b"])) * profile.model_params / real_params
    expected_s = params * profile.bytes_per_param / profile.link_bytes_per_s
    assert 0.1 < expected_s < 1.0
    async with _serve(server) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.load_lora_adapter("b", str(adapters["b"]))
        assert loop.time() - started >= expected_s * 0.95


# ----- adapter versions of LoRA agents on a replica (rolloutd/lora_residency.py) -------------------
async def test_a_version_switch_loads_beside_the_old_one_without_a_drain(
    engine_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    assert AdapterVersion.parse(str(AdapterVersion("job/x", 12))) == AdapterVersion("job/x", 12)
    with pytest.raises(InvalidArgument):
        AdapterVersion.parse("job/x@12")
    uris = {"stored://job/x/v1": adapters["a"], "stored://job/x/v2": adapters["b"]}

    async def resolve(uri: str) -> str:
        return str(uris[uri])

    server = _embedded(engine_checkpoint, _settings())
    long = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    async with _serve(server) as client:
        residency = LoraResidency(client, resolve)
        started, release = asyncio.Event(), asyncio.Event()

        async def old_request() -> Any:
            async with residency.use("job/x", 1, "stored://job/x/v1") as name:
                started.set()
                [result] = await client.generate(GenerationRequest(PROMPTS[0], long, lora_path=name))
                await release.wait()  # still "using" v1 while v2 arrives
                return result

        old = asyncio.ensure_future(old_request())
        await started.wait()
        async with residency.use("job/x", 2, "stored://job/x/v2") as name:
            assert name == "job/x@v2" and residency.loaded_versions("job/x") == (1, 2)  # no drain of v1
            [new] = await client.generate(GenerationRequest(PROMPTS[1], GREEDY, lora_path=name))
        assert residency.loaded_versions("job/x") == (1, 2)  # v1 still in use
        release.set()
        result = await old
        assert len(result.output_ids) == 16 and len(new.output_ids) == GREEDY.max_new_tokens
        assert residency.loaded_versions("job/x") == (2,) and (residency.loads, residency.unloads) == (2, 1)
        async with aiohttp.ClientSession() as session, session.get(client.url + "/v1/models") as response:
            models = await response.json()
        assert [card["id"] for card in models["data"]][1:] == ["job/x@v2"]


# ----- the synthetic engine: same routes, same answers ---------------------------------------------
@pytest.fixture
def synthetic_lora_config() -> Iterator[SyntheticEngineConfig]:
    yield SyntheticEngineConfig(max_running_requests=4, lora=_settings(max_loaded_loras=3))


async def test_synthetic_engine_serves_the_same_lora_routes(
    synthetic_lora_config: SyntheticEngineConfig, adapters: dict[str, Path]
) -> None:
    config = synthetic_lora_config
    replica = SyntheticReplica(0, config, config.profile())
    async with _serve(SyntheticServer(replica)) as client:
        loaded = await client.load_lora_adapter("a", str(adapters["a"]))
        assert loaded.loaded_adapters == {"a": str(adapters["a"])}
        for name, path, message in (
            ("a", adapters["b"], "already loaded"),
            ("r16", adapters["rank16"], "with rank 16 is incompatible"),
            ("down", adapters["down"], "with rank 4 is incompatible"),
        ):
            status, answer = await _post(client, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            assert status == 400 and message in answer["error_message"]
        params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        [result] = await client.generate(GenerationRequest(PROMPTS[0], params, lora_path="a"))
        assert len(result.output_ids) == 4
        with pytest.raises(InvalidArgument, match="has never been loaded"):
            await client.generate(GenerationRequest(PROMPTS[0], params, lora_path="nope"))
        assert (await client.unload_lora_adapter("a")).loaded_adapters == {}
