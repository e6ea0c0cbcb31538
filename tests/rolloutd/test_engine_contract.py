"""The SGLang contract, run against every server FlexMARL ships (embedded and synthetic subprocesses).

Each test names the SGLang 0.5.23 behaviour it pins (the file under sglang/ it comes from is in
rolloutd/engines/embedded/server.py and docs/engines.md). Tests that need real logits or a
tokenizer run against the embedded engine only and say so in their name (``_embedded``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from flexmarl.errors import FailedPrecondition, InvalidArgument, Unavailable
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient

PROMPT = (104, 101, 108, 108, 111)  # "hello"
# Logprobs served by a batched, KV-cached decode vs one full forward pass of the same fp32 model.
LOGPROB_TOLERANCE = 1e-4
# Long enough to still run while a test aborts it; aborted long before it ends.
LONG_TOKENS = 1500
# The batch limit conftest.py launches both servers with (ENGINE_MAX_RUNNING there).
ENGINE_MAX_RUNNING = 4


async def _call(url: str, method: str, path: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, json=body, **kwargs) as response:
            text = await response.text()
            try:
                return response.status, await response.json(content_type=None)
            except ValueError:
                return response.status, text


async def _generate(url: str, body: dict[str, Any]) -> Any:
    status, payload = await _call(url, "POST", "/generate", body)
    assert status == 200, payload
    return payload


async def _loads(url: str) -> dict[str, Any]:
    status, payload = await _call(url, "GET", "/v1/loads")
    assert status == 200
    return dict(payload["loads"][0])


async def _wait_running(url: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while (await _loads(url))["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "requests never started"
        await asyncio.sleep(0.01)


def _long(rid: str | None = None, n: int = 1, tokens: int = LONG_TOKENS, prompt: tuple[int, ...] = PROMPT) -> Any:
    body: dict[str, Any] = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "n": n},
    }
    if rid is not None:
        body["rid"] = rid
    return body


def _forward_logprobs(model: Any, prompt: tuple[int, ...], output: tuple[int, ...], temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    scaled = logits[positions] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


# ----- /generate: shapes and rids (io_struct.py, tokenizer_manager.py) ------------------------
async def test_wire_format_and_rids(engine_served: Any) -> None:
    url = engine_served.url
    body: dict[str, Any] = {
        "input_ids": list(PROMPT),
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 4},
        "return_logprob": True,
        "rid": "wire-1",
    }
    one = await _generate(url, body)
    assert isinstance(one, dict) and set(one) >= {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["id"] == "wire-1"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 4
    assert isinstance(meta["cached_tokens"], int) and isinstance(meta["weight_version"], str)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == one["output_ids"] and all(len(t) == 3 and t[0] < 0 for t in triples)

    # n > 1 answers a list; regenerate_rid gives each sample a fresh rid, which is its id.
    many = await _generate(url, {**body, "rid": "wire-n", "sampling_params": {"max_new_tokens": 4, "n": 3}})
    assert isinstance(many, list) and len(many) == 3
    ids = [sample["meta_info"]["id"] for sample in many]
    assert len(set(ids)) == 3 and not any(i.startswith("wire-n") for i in ids)
    # A batch with one rid string: _normalize_rid names the prompts rid_0, rid_1.
    batch = await _generate(
        url, {"input_ids": [list(PROMPT), [1, 2]], "rid": "b", "sampling_params": {"max_new_tokens": 1}}
    )
    assert [sample["meta_info"]["id"] for sample in batch] == ["b_0", "b_1"]
    # PUT is served like POST; unknown top-level fields are ignored (GenerateRequest ignores them).
    status, put = await _call(url, "PUT", "/generate", {"input_ids": [1], "no_such_field": 1})
    assert status == 200 and put["meta_info"]["finish_reason"]["type"] in ("length", "stop")


async def test_a_rid_in_flight_is_refused(engine_served: Any) -> None:
    url = engine_served.url
    task = asyncio.create_task(_generate(url, _long("dup")))
    await _wait_running(url, 1)
    status, payload = await _call(url, "POST", "/generate", _long("dup", tokens=1))
    assert status == 400 and payload == {"error": {"message": "Duplicate request ID detected: dup"}}
    await _call(url, "POST", "/abort_request", {"rid": "dup"})
    assert (await asyncio.wait_for(task, 30))["meta_info"]["finish_reason"]["type"] == "abort"


# ----- strictness: contract gate, verify, unsupported features, error shapes --------------------
@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"seed": 3}, "unknown field `seed`, expected one of `max_new_tokens`"),
        ({"max_new_tokens": 4.5}, "invalid type: floating point `4.5`, expected i64"),
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
    ],
)
async def test_contract_violations_are_a_bare_error_string(
    engine_served: Any, sampling: dict[str, Any], expected: str
) -> None:
    # api_contract.py via http_server.py generate_request: 400 {"error": "<text>"}.
    status, payload = await _call(
        engine_served.url, "POST", "/generate", {"input_ids": [1], "sampling_params": sampling}
    )
    assert status == 400 and isinstance(payload["error"], str) and payload["error"].startswith(expected)


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"temperature": -1}, "temperature must be a non-negative finite number, got -1.0."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty=0.5 is not supported"),
        ({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty=1.2 is not supported"),
        ({"min_new_tokens": 2}, "sampling_params.min_new_tokens=2 is not supported"),
        ({"regex": "a+"}, "sampling_params.regex='a+' is not supported"),
        ({"logit_bias": {"5": 1.0}}, "sampling_params.logit_bias={'5': 1.0} is not supported"),
    ],
)
async def test_value_errors_carry_a_message(engine_served: Any, sampling: dict[str, Any], expected: str) -> None:
    # SamplingParams.verify and the features the engine lacks: _create_error_response's shape.
    status, payload = await _call(
        engine_served.url, "POST", "/generate", {"input_ids": [1], "sampling_params": sampling}
    )
    assert status == 400 and set(payload) == {"error"} and payload["error"]["message"].startswith(expected)


async def test_defaults_of_unsupported_features_are_accepted(engine_served: Any) -> None:
    sampling = {
        "max_new_tokens": 1,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": {},
        "regex": None,
    }
    assert (await _generate(engine_served.url, {"input_ids": [1], "sampling_params": sampling}))["output_ids"]


async def test_request_validation_errors_use_the_error_response_shape(engine_served: Any) -> None:
    # FastAPI's RequestValidationError, turned into a 400 ErrorResponse by http_server.py.
    url = engine_served.url
    for data, content_type in ((b"{not json", "application/json"), (b'{"input_ids": [1]}', "text/plain")):
        headers = {"Content-Type": content_type}
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/generate", data=data, headers=headers) as response,
        ):
            payload = await response.json(content_type=None)
        assert response.status == 400
        assert set(payload) == {"object", "message", "type", "param", "code"} and payload["code"] == 400
    status, payload = await _call(url, "POST", "/generate", {"sampling_params": {}})
    assert status == 400 and payload["error"]["message"] == "Either text, input_ids or input_embeds should be provided."
    assert (await _call(url, "GET", "/generate"))[0] == 405


def test_from_wire_is_as_strict_as_sglang() -> None:
    # What rolloutd's router parses stays accepted...
    wire = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 8,
        "stop_token_ids": [2],
        "n": 4,
        "sampling_seed": 7,
        "stop": ["\n\n"],
        "no_stop_trim": True,
    }
    params = SamplingParams.from_wire(wire)
    assert params.seed == 7 and params.stop == ("\n\n",) and SamplingParams.from_wire(params.to_wire()) == params
    # ...while an alias, an unknown key or an unimplemented penalty is an error, never ignored.
    for bad in ({"seed": 1}, {"presence_penalty": 0.1}, {"json_schema": "{}"}, {"top_k": 1.5}):
        with pytest.raises(InvalidArgument):
            SamplingParams.from_wire(bad)


# ----- abort (tokenizer_manager.py abort_request, scheduler.py abort_request) --------------------
async def test_abort_by_rid_is_exact_and_a_no_op_for_n_samples(engine_served: Any) -> None:
    url = engine_served.url
    group = asyncio.create_task(_generate(url, _long("grp", n=2, tokens=300)))
    solo = asyncio.create_task(_generate(url, _long("solo-long")))
    await _wait_running(url, 3)
    # The rid sent with an n > 1 request, an unknown rid, a prefix, an empty rid: all no-ops.
    for body in ({"rid": "grp"}, {"rid": "nobody"}, {"rid": "solo"}, {"rid": "gr"}, {"rid": ""}, {}):
        assert (await _call(url, "POST", "/abort_request", body))[0] == 200
    assert (await _call(url, "POST", "/abort_request", {"rid": "solo-long"}))[0] == 200  # exact: aborted
    solo_out = await asyncio.wait_for(solo, 60)
    assert solo_out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < solo_out["meta_info"]["completion_tokens"] == len(solo_out["output_ids"]) < LONG_TOKENS
    samples = await asyncio.wait_for(group, 60)
    assert [s["meta_info"]["finish_reason"] for s in samples] == [{"type": "length", "length": 300}] * 2


async def test_a_known_rid_aborts_every_rid_it_prefixes(engine_served: Any) -> None:
    # tokenizer_manager.py passes a known rid on; scheduler.py aborts every req.rid.startswith(rid).
    url = engine_served.url
    tasks = [asyncio.create_task(_generate(url, _long(rid))) for rid in ("pfx", "pfx-2")]
    await _wait_running(url, 2)
    assert (await _call(url, "POST", "/abort_request", {"rid": "pfx"}))[0] == 200
    for out in await asyncio.wait_for(asyncio.gather(*tasks), 60):
        assert out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_all_reaches_running_and_queued(engine_served: Any) -> None:
    url = engine_served.url
    running = asyncio.create_task(_generate(url, _long(n=ENGINE_MAX_RUNNING)))
    await _wait_running(url, ENGINE_MAX_RUNNING)
    queued = asyncio.create_task(_generate(url, _long(n=2)))
    deadline = time.monotonic() + 30
    while (await _loads(url))["num_waiting_reqs"] < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert (await _call(url, "POST", "/abort_request", {"abort_all": True}))[0] == 200
    for sample in await asyncio.wait_for(running, 30):
        assert sample["meta_info"]["finish_reason"]["message"] == "Aborted"
    for sample in await asyncio.wait_for(queued, 30):
        assert sample["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert sample["output_ids"] == []


# ----- pause and continue (tokenizer_manager.py, scheduler.py pause_generation) --------------------
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pause_generation", None),  # both routes need a JSON body (FastAPI Body())
        ("/pause_generation", []),
        ("/pause_generation", {"mode": "pause"}),  # PauseGenerationReqInput.mode is a Literal
        ("/pause_generation", {"mode": 1}),
        ("/pause_generation", {"mode": "in_place", "rid": 3}),  # BaseReq.rid: Optional[str]
        ("/continue_generation", None),
        ("/continue_generation", {"torch_empty_cache": "maybe"}),
    ],
)
async def test_pause_and_continue_refuse_bad_bodies(engine_served: Any, path: str, body: Any) -> None:
    url = engine_served.url
    status, payload = await _call(url, "POST", path, body)
    assert status == 400 and payload["object"] == "error" and payload["code"] == 400
    # Nothing was paused: a request runs.
    assert (await _generate(url, _long(tokens=2)))["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_abort_answers_partial_outputs_and_continue_resumes(engine_served: Any) -> None:
    url = engine_served.url
    running = asyncio.create_task(_generate(url, {**_long(), "return_logprob": True}))
    await _wait_running(url, 1)
    status, payload = await _call(url, "POST", "/pause_generation", {})  # mode "abort" by default
    try:
        assert status == 200 and payload == {"message": "Generation paused successfully.", "status": "ok"}
        out = await asyncio.wait_for(running, 10)  # answered (before the pause returned)
        meta, count = out["meta_info"], len(out["output_ids"])
        assert meta["finish_reason"]["type"] == "abort" and 0 < count < LONG_TOKENS
        assert meta["completion_tokens"] == count == len(meta["output_token_logprobs"])
        assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": count}]
    finally:
        status, payload = await _call(url, "POST", "/continue_generation", {"torch_empty_cache": "false"})
    assert status == 200 and payload == {"message": "Generation continued successfully.", "status": "ok"}
    assert (await _generate(url, _long(tokens=2)))["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_an_update_while_paused_splits_the_weight_versions(
    engine_served: Any, engine_checkpoint: Path, mode: str
) -> None:
    url = engine_served.url
    running = asyncio.create_task(_generate(url, _long(tokens=200)))
    await _wait_running(url, 1)
    assert (await _call(url, "POST", "/pause_generation", {"mode": mode}))[0] == 200
    try:  # the replica is shared: whatever fails, continue
        load = await _loads(url)
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == ((1, 0) if mode == "in_place" else (0, 1))
        body = {"model_path": str(engine_checkpoint), "weight_version": f"{mode}-v", "flush_cache": False}
        status, payload = await _call(url, "POST", "/update_weights_from_disk", body)
        assert status == 200 and payload["success"] is True, payload  # paused: no wait for the running request
        assert not running.done()
    finally:
        assert (await _call(url, "POST", "/continue_generation", {}))[0] == 200
    meta = (await asyncio.wait_for(running, 60))["meta_info"]
    spans = meta["weight_versions"]
    assert [span["version"] for span in spans] == [spans[0]["version"], f"{mode}-v"]
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 200
    assert meta["weight_version"] == f"{mode}-v" and meta["completion_tokens"] == 200


# ----- loads, flush, health, info, weights --------------------------------------------------------
async def test_loads_count_used_plus_queued_tokens(engine_served: Any) -> None:
    # load_inquirer.py: num_total_tokens = used KV tokens + the tokens of every queued request.
    url = engine_served.url
    # The replica is shared: a request the test before saw answered may not be out of the running batch yet (SGLang
    # streams a finished request's output before its next loop iteration filters it out; the embedded engine answers
    # before it republishes its running jobs), so its KV tokens still count for a moment. A leak never drains.
    deadline = time.monotonic() + 30
    while (idle := await _loads(url))["num_total_tokens"] != 0:
        assert time.monotonic() < deadline, f"the replica never became idle: {idle}"
        await asyncio.sleep(0.01)
    assert idle["num_total_tokens"] == idle["num_used_tokens"] == 0 < idle["max_total_num_tokens"]
    running = asyncio.create_task(_generate(url, _long(n=ENGINE_MAX_RUNNING)))
    await _wait_running(url, ENGINE_MAX_RUNNING)
    prompt = tuple(range(1, 8))
    queued = asyncio.create_task(_generate(url, _long(n=3, prompt=prompt)))
    deadline = time.monotonic() + 30
    while (load := await _loads(url))["num_waiting_reqs"] < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert load["num_running_reqs"] == ENGINE_MAX_RUNNING and load["num_used_tokens"] > 0
    assert load["num_total_tokens"] == load["num_used_tokens"] + 3 * len(prompt)
    # While requests run, /flush_cache is refused (scheduler.py flush_cache; http_server.py 400).
    status, text = await _call(url, "POST", "/flush_cache")
    assert status == 400 and text == "Flush cache failed.\n"
    await _call(url, "POST", "/abort_request", {"abort_all": True})
    await asyncio.wait_for(asyncio.gather(running, queued), 30)
    # Once the aborted requests are out of the running batch, the flush succeeds. Not necessarily at
    # once: SGLang's scheduler streams a finished request's output before the next loop iteration
    # filters it out of running_batch, and handles a /flush_cache that arrived meanwhile first
    # (scheduler.py event_loop_normal: ingest_requests, then get_next_batch_to_run); the
    # embedded engine answers the aborted futures before it republishes its running jobs, likewise.
    deadline = time.monotonic() + 30
    while (status := (await _call(url, "GET", "/flush_cache"))[0]) != 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert status == 200


async def test_health_info_and_weight_versions(engine_served: Any, tmp_path: Path) -> None:
    url = engine_served.url
    async with SGLangClient(url) as client:
        assert await client.health() and await client.health_generate()
        server = await client.server_info()
        assert "version" in server and "internal_states" in server
        assert server["max_total_num_tokens"] > 0  # SGLang's KV capacity, which rolloutd's dispatch bound reads
    # 0.5.23 serves no /get_weight_version: the version is model_info's, renamed by /update_weight_version.
    assert (await _call(url, "GET", "/get_weight_version"))[0] == 404
    status, payload = await _call(url, "POST", "/update_weight_version", {"new_version": "renamed"})
    assert status == 200 and payload == {
        "success": True,
        "message": "Weight version updated to renamed",
        "new_version": "renamed",
    }
    assert (await _call(url, "GET", "/model_info"))[1]["weight_version"] == "renamed"
    assert (await _call(url, "GET", "/get_model_info"))[1]["weight_version"] == "renamed"
    status, payload = await _call(url, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and payload["success"] is False and payload["num_paused_requests"] == 0
    assert (await _call(url, "GET", "/model_info"))[1]["weight_version"] == "renamed"  # a failed load changes nothing


# ----- sampling and seeds (sampling_batch_info.py, sampler.py): embedded only -------------------
async def test_lora_routes_without_enable_lora(engine_served: Any) -> None:
    # tokenizer_control_mixin.py / tokenizer_manager.py: a server launched without --enable-lora
    # serves the LoRA routes and refuses with LoRAUpdateOutput (400); /generate names the adapter.
    not_enabled = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    url = engine_served.url
    for path, body in (("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
                       ("/unload_lora_adapter", {"lora_name": "a"})):
        status, payload = await _call(url, "POST", path, body)
        assert (status, payload) == (400, {"rid": None, "http_worker_ipc": None, "success": False,
                                           "error_message": not_enabled, "loaded_adapters": None})
    status, payload = await _call(url, "POST", "/load_lora_adapter", {"lora_path": "/p"})
    assert status == 400 and payload["object"] == "error"  # lora_name is required (FastAPI validation)
    status, payload = await _call(url, "POST", "/generate", {"input_ids": list(PROMPT), "lora_path": "a"})
    assert status == 400 and "LoRA adapter 'a' was requested, but LoRA is not enabled" in payload["error"]["message"]
    status, payload = await _call(url, "GET", "/v1/models")
    assert status == 200 and len(payload["data"]) == 1 and payload["data"][0]["object"] == "model"


async def test_seeds_are_ignored_without_deterministic_inference_embedded(engine_replica: EngineReplica) -> None:
    body = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 8, "sampling_seed": 11, "n": 4}}
    first, second = await _generate(engine_replica.url, body), await _generate(engine_replica.url, body)
    outputs = [tuple(s["output_ids"]) for s in first + second]
    assert len(set(outputs)) == 8  # every sample differs: sampling_seed did nothing


async def test_deterministic_inference_samples_from_seed_and_position_embedded(
    engine_deterministic_replica: EngineReplica,
) -> None:
    url = engine_deterministic_replica.url

    def body(seed: int | None, n: int = 1) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": 8, "n": n}
        if seed is not None:
            sampling["sampling_seed"] = seed
        return {"input_ids": list(PROMPT), "sampling_params": sampling, "return_logprob": True}

    group = await _generate(url, body(11, n=4))
    # One seed, one prompt: the n samples are identical (SGLang's GRPO-group collapse).
    assert len({tuple(s["output_ids"]) for s in group}) == 1
    # Reproducible whatever shares the batch, and a function of the seed.
    noise = [
        asyncio.create_task(_generate(url, {"input_ids": [7] * k, "sampling_params": {"max_new_tokens": 20}}))
        for k in (3, 9)
    ]
    crowded = await _generate(url, body(11))
    await asyncio.gather(*noise)
    assert crowded["output_ids"] == group[0]["output_ids"]
    assert crowded["meta_info"]["output_token_logprobs"] == group[0]["meta_info"]["output_token_logprobs"]
    distinct = {tuple((await _generate(url, body(seed)))["output_ids"]) for seed in (1, 2, 3)}
    assert len(distinct) == 3
    # No seed: seed 42.
    assert (await _generate(url, body(None)))["output_ids"] == (await _generate(url, body(42)))["output_ids"]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_equal_a_forward_pass_embedded(
    engine_deterministic_replica: EngineReplica, engine_reference_model: Any, temperature: float
) -> None:
    # Logprobs of the temperature-scaled distribution (raw when greedy), batch-invariant.
    async with SGLangClient(engine_deterministic_replica.url) as client:
        [result] = await client.generate(
            GenerationRequest(PROMPT, SamplingParams(temperature=temperature, max_new_tokens=8, seed=5))
        )
    expected = _forward_logprobs(engine_reference_model, PROMPT, result.output_ids, temperature)
    served = torch.tensor(result.output_token_logprobs)
    assert float((served - expected).abs().max()) < LOGPROB_TOLERANCE


async def test_greedy_is_argmax_and_repeatable_embedded(
    engine_replica: EngineReplica, engine_reference_model: Any
) -> None:
    request = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=5))
    async with SGLangClient(engine_replica.url) as client:
        first, second = await client.generate(request), await client.generate(request)
        [tiny] = await client.generate(GenerationRequest(PROMPT, SamplingParams(temperature=1e-7, max_new_tokens=5)))
    assert first[0].output_ids == second[0].output_ids == tiny.output_ids  # < 1e-6 is greedy in SGLang
    reference = engine_reference_model.generate(
        torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False, eos_token_id=None
    )
    assert tuple(reference[0, len(PROMPT) :].tolist()) == first[0].output_ids


async def test_stop_token_ids_end_the_sample_unless_ignore_eos_embedded(engine_replica: EngineReplica) -> None:
    every_token = list(range(320))
    url = engine_replica.url
    stopped = await _generate(
        url, {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 8, "stop_token_ids": every_token}}
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stopped["output_ids"][-1]}
    assert len(stopped["output_ids"]) == 1
    # schedule_batch.py _check_token_based_finish: ignore_eos turns stop_token_ids off too.
    ignored = await _generate(
        url,
        {
            "input_ids": list(PROMPT),
            "sampling_params": {"max_new_tokens": 4, "stop_token_ids": every_token, "ignore_eos": True},
        },
    )
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


async def test_stop_strings_embedded(engine_deterministic_replica: EngineReplica, engine_checkpoint: Path) -> None:
    # schedule_batch.py _check_str_based_finish; detokenizer_manager.py trim_matched_stop.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(engine_checkpoint))
    url = engine_deterministic_replica.url
    base: dict[str, Any] = {"max_new_tokens": 24, "sampling_seed": 3, "ignore_eos": True}
    free = {"input_ids": list(PROMPT), "sampling_params": base}
    ids = (await _generate(url, free))["output_ids"]
    printable = [k for k, token in enumerate(ids) if 32 <= token < 127]  # byte-level: one ASCII char
    assert printable, ids
    pairs = [k for k in printable if k - 1 in printable]
    stop = bytes(ids[pairs[0] - 1 : pairs[0] + 1]).decode() if pairs else chr(ids[printable[0]])
    # The first token after which the (plain) decoded output contains the stop string.
    end = next(j for j in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:j]))
    sampling = {**base, "stop": [stop]}
    trimmed = await _generate(url, {**free, "sampling_params": sampling})
    kept = await _generate(url, {**free, "sampling_params": {**sampling, "no_stop_trim": True}})
    full_text = tokenizer.decode(ids[:end], skip_special_tokens=True)
    for out in (trimmed, kept):
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == ids[:end]  # through the token that completed the match
    assert trimmed["text"] == full_text[: full_text.index(stop)]
    assert kept["text"] == full_text[: full_text.index(stop) + len(stop)]


async def test_stop_strings_are_refused_without_a_tokenizer_synthetic(engine_synthetic: Any) -> None:
    status, payload = await _call(
        engine_synthetic.urls[0], "POST", "/generate", {"input_ids": [1], "sampling_params": {"stop": "x"}}
    )
    assert status == 400 and "stop is not supported by the synthetic engine" in payload["error"]["message"]


async def test_weight_reload_changes_outputs_and_version_embedded(
    engine_replica: EngineReplica, engine_checkpoint: Path, engine_checkpoint_other: Path
) -> None:
    greedy = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6))
    async with SGLangClient(engine_replica.url) as client:
        [before] = await client.generate(greedy)
        update = await client.update_weights_from_disk(str(engine_checkpoint_other), weight_version="v1")
        assert update.success and update.message == "Succeeded to update model weights. Weight version updated to v1."
        [after] = await client.generate(greedy)
        assert (await client.model_info()).weight_version == "v1"
        with pytest.raises(FailedPrecondition):
            await client.update_weights_from_disk(str(engine_checkpoint_other / "missing"), weight_version="v9")
        assert (await client.model_info()).weight_version == "v1"
        await client.update_weights_from_disk(str(engine_checkpoint), weight_version="v2", load_format="safetensors")
        [restored] = await client.generate(greedy)
    assert after.weight_version == "v1" and after.model_path == str(engine_checkpoint_other)
    assert after.output_token_logprobs != before.output_token_logprobs
    assert restored.weight_version == "v2" and restored.output_ids == before.output_ids


async def test_bad_requests_raise_invalid_argument_embedded(engine_replica: EngineReplica) -> None:
    async with SGLangClient(engine_replica.url) as client:
        with pytest.raises(InvalidArgument):
            await client.generate(GenerationRequest((100_000,), SamplingParams(max_new_tokens=1)))  # server 400
        with pytest.raises(InvalidArgument):
            await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=10_000)))  # > context


async def test_seeded_min_p_stops_a_deterministic_engine_embedded(engine_checkpoint: Path, tmp_path: Path) -> None:
    # sampler.py asserts "With sampling seed, multinomial_with_seed will provide wrong results"
    # when a batch needs min-p; the scheduler's exception takes the SGLang server down.
    spec = ReplicaSpec("embedded", str(engine_checkpoint), extra_args=("--enable-deterministic-inference",))
    replica = await launch(spec, tmp_path, timeout_s=120)
    try:
        body = {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": 4, "min_p": 0.1}}
        try:
            status, _ = await _call(replica.url, "POST", "/generate", body)
            assert status == 503  # answered while going down, or not answered at all
        except aiohttp.ClientError:
            pass
        assert replica.process is not None
        assert await asyncio.to_thread(replica.process.wait, 30) == 1
    finally:
        replica.stop()


async def test_killed_replica_raises_unavailable(engine_checkpoint: Path, tmp_path: Path) -> None:
    replica = await launch(ReplicaSpec("embedded", str(engine_checkpoint)), tmp_path, timeout_s=120)
    try:
        async with SGLangClient(replica.url, retries=2, retry_backoff_s=0.05) as client:
            assert await client.health()
            replica.kill()
            with pytest.raises(Unavailable):
                await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2)))
            with pytest.raises(Unavailable):
                await client.health()
    finally:
        replica.stop()


def test_fixture_flag_reaches_the_engine(engine_deterministic_replica: EngineReplica) -> None:
    # ReplicaSpec(extra_args=("--enable-deterministic-inference",)) is how rolloutd turns it on.
    status, info = asyncio.run(_call(engine_deterministic_replica.url, "GET", "/server_info"))
    assert status == 200 and info["enable_deterministic_inference"] is True
