"""Every request rolloutd's SGLang client sends passes SGLang 0.5.23's own request definitions.

The real client (and, for a job's first turn, the router in front of it) drives a capture
server (aiohttp, port 0) that records each request's method, path, query and JSON body and
answers in SGLang's shapes. Each captured request is then judged by SGLang's code, from the
installed wheel (``pip install --no-deps sglang==0.5.23``, done by ``./dev.sh setup``):

- ``/generate`` bodies: ``sglang/srt/entrypoints/api_contract.py`` ``generate_contract_error``
  (``sglang/api/v1/api_types.py`` ``GenerateRequest.from_json_value``; http_server.py answers
  400 ``{"error": <text>}`` on any violation), then
  ``sglang/srt/managers/io_struct.py`` ``GenerateReqInput(**body).normalize_batch_and_arguments()``
  (what ``tokenizer_manager.py`` runs first), then
  ``sglang/srt/sampling/sampling_params.py`` ``SamplingParams(**sampling_params)``,
  ``.normalize(tokenizer)`` and ``.verify(vocab_size)`` (``tokenizer_manager.py``
  ``_create_tokenized_object``; the tiny byte-level tokenizer stands in for the model's, as
  ``stop`` strings need one: a server launched with ``--skip-tokenizer-init`` refuses them).
- ``/update_weights_from_disk``, ``/abort_request``, ``/pause_generation`` and
  ``/continue_generation`` bodies: io_struct.py ``UpdateWeightFromDiskReqInput`` / ``AbortReq`` /
  ``PauseGenerationReqInput`` / ``ContinueGenerationReqInput``, validated the way FastAPI does it (a pydantic
  ``TypeAdapter`` over the struct's own ``__get_pydantic_core_schema__``) and also built with
  ``**body``, which rejects keys SGLang would silently drop; abort bodies also pass api_types.py
  ``AbortRequest.from_json_value``. So are the ``/load_lora_adapter`` and ``/unload_lora_adapter``
  bodies (``LoadLoRAAdapterReqInput``, ``UnloadLoRAAdapterReqInput``); ``/generate`` bodies with
  ``lora_path`` (a string, or one entry per prompt) go through ``GenerateReqInput`` as above.
- every (method, path): a route of ``sglang/srt/entrypoints/http_server.py`` (or the ``/v1/loads``
  router of ``v1_loads.py`` it includes), read from the decorators in the installed source.

Only the schema modules are loaded: ``sglang/__init__.py`` (frontend language, HF patches, cache
redirects) and ``sglang/srt/utils/__init__.py`` (``common.py``: triton, PIL, starlette) never run;
bare package objects stand in for those two packages while the schema modules import.
``io_struct.py`` itself cannot be imported on a CPU machine without SGLang's runtime (it imports
the scheduler, ``schedule_batch.py``, which pulls in triton and sgl_kernel), so its statements
are executed one by one from the installed file, skipping only the imports listed in
:data:`_IO_STRUCT_RUNTIME_IMPORTS`; the classes tested here are SGLang's own, unmodified.
"""

from __future__ import annotations
import __future__

import ast
import asyncio
import builtins
import contextlib
import copy
import importlib
import importlib.metadata
import importlib.util
import re
import socket
import sys
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from flexmarl.tiny import build_tiny_tokenizer
from rolloutd.engines.embedded import schemas as embedded_schemas
from rolloutd.engines.protocol import GenerationRequest, PauseMode, SamplingParams, WeightVersionSpan
from rolloutd.engines.sglang.client import SGLangClient

SGLANG_VERSION = "0.5.23"
PROMPT = (104, 101, 108, 108, 111)  # "hello" in the tiny byte-level tokenizer

# Imports of io_struct.py that need SGLang's runtime, not its schema; the names they bind are
# used only by code paths rolloutd's requests never reach (a NameError there fails the test).
_IO_STRUCT_RUNTIME_IMPORTS: dict[str, str] = {
    "zmq": "IPC transport",
    "zmq.asyncio": "IPC transport",
    "sglang.srt.managers.schedule_batch": "the scheduler (triton, sgl_kernel, CUDA kernels)",
    "sglang.srt.multimodal.mm_utils": "image and video processing (PIL, pybase64)",
    "sglang.srt.lora.lora_registry": "LoRA registry (needs sglang.srt.utils.common: triton)",
    "sglang.srt.utils": "ImageData/VideoData of sglang.srt.utils.common (triton, PIL)",
}


def _hidden_states_mode_off_only(mode: Any) -> None:
    """Stands in for schedule_batch.py ``get_return_hidden_states_mode`` (not importable on CPU).

    ``GenerateReqInput._normalize_return_hidden_states`` calls it on every batched request.
    rolloutd never asks for hidden states, so this accepts only the field's default (False).
    """
    if mode is not False:
        raise AssertionError(f"return_hidden_states={mode!r}: not checkable without schedule_batch.py")


@dataclass(frozen=True)
class SGLangSchema:
    """SGLang 0.5.23's request definitions, loaded from the installed wheel."""

    package_root: Path
    api_contract: types.ModuleType
    api_types: types.ModuleType
    sampling_params: types.ModuleType
    io_struct: dict[str, Any]
    struct_adapters: dict[str, Any]
    routes: frozenset[tuple[str, str]]
    tokenizer: Any  # the server's tokenizer: SamplingParams.normalize encodes stop strings with it

    def cls(self, name: str) -> Any:
        """One class of io_struct.py."""
        return self.io_struct[name]


# The request structs of the control routes the client calls (FastAPI validates their JSON bodies).
_CONTROL_STRUCTS = (
    "UpdateWeightFromDiskReqInput",
    "AbortReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "InitWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "BeginWeightUpdateReqInput",
    "EndWeightUpdateReqInput",
    "LoadLoRAAdapterReqInput",
    "UnloadLoRAAdapterReqInput",
)
# Route -> its body's struct.
_BODY_STRUCTS = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}
# Weight-update-group routes: SGLang answers {"success", "message"} (http_server.py).
_GROUP_ROUTES = (
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
)


def _sglang_package_root() -> Path:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            f"sglang {SGLANG_VERSION} is not installed; `./dev.sh setup` installs it "
            f"(pip install --no-deps sglang=={SGLANG_VERSION})",
            pytrace=False,
        )
    if version != SGLANG_VERSION:
        pytest.fail(f"sglang {version} is installed; these checks are written against {SGLANG_VERSION}", pytrace=False)
    spec = importlib.util.find_spec("sglang")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("sglang is installed but not importable as a package", pytrace=False)
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _bare_sglang_packages(root: Path) -> Iterator[None]:
    """Make ``sglang`` and ``sglang.srt.utils`` bare packages for the duration; restore sys.modules after."""
    saved = {name: module for name, module in sys.modules.items() if name == "sglang" or name.startswith("sglang.")}
    for name in saved:
        del sys.modules[name]
    try:
        for name, path in (("sglang", root), ("sglang.srt.utils", root / "srt" / "utils")):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
        yield
    finally:
        for name in [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return [alias.name for alias in node.names]


def _load_io_struct(path: Path) -> dict[str, Any]:
    """Execute io_struct.py statement by statement, skipping only its runtime imports.

    A statement that needs a name from a skipped import (the multimodal input aliases, the IPC
    decoder) is skipped too; a schema import that fails fails the test. Returns the namespace.
    """
    module_name = "sglang.srt.managers.io_struct"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    namespace = module.__dict__
    namespace["__builtins__"] = builtins
    namespace["get_return_hidden_states_mode"] = _hidden_states_mode_off_only
    sys.modules[module_name] = module  # dataclasses and msgspec resolve string annotations through it
    tree = ast.parse(path.read_text(), filename=str(path))
    # The file's own `from __future__` imports (annotations: string annotations), not this file's.
    future_flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                future_flags |= getattr(__future__, alias.name).compiler_flag
    for node in tree.body:
        imports = isinstance(node, ast.Import | ast.ImportFrom)
        if imports and any(name in _IO_STRUCT_RUNTIME_IMPORTS for name in _imported_modules(node)):
            continue
        statement = ast.Module(body=[node], type_ignores=[])
        code = compile(statement, str(path), "exec", flags=future_flags, dont_inherit=True)
        if imports:
            exec(code, namespace)
            continue
        with contextlib.suppress(NameError):
            exec(code, namespace)
    return namespace


def _parse_routes(root: Path) -> frozenset[tuple[str, str]]:
    """(method, path) of every route declared in http_server.py and the v1_loads router it includes."""
    http_server = (root / "srt" / "entrypoints" / "http_server.py").read_text()
    sources = [http_server]
    if "app.include_router(v1_loads_router)" in http_server:
        sources.append((root / "srt" / "entrypoints" / "v1_loads.py").read_text())
    routes: set[tuple[str, str]] = set()
    for source in sources:
        for verb, route in re.findall(r'@(?:app|router)\.(get|post|put|delete|patch|head)\(\s*"([^"]+)"', source):
            routes.add((verb.upper(), route))
        for route, methods in re.findall(
            r'@(?:app|router)\.api_route\(\s*"([^"]+)"\s*,\s*methods=\[([^\]]*)\]', source, flags=re.S
        ):
            routes.update((method, route) for method in re.findall(r'"([A-Z]+)"', methods))
    return frozenset(routes)


@pytest.fixture(scope="module")
def sglang_schema(tmp_path_factory: pytest.TempPathFactory) -> SGLangSchema:
    """SGLang's request definitions from the installed 0.5.23 wheel (no SGLang runtime, no CUDA)."""
    from pydantic import TypeAdapter
    from transformers import AutoTokenizer

    tokenizer_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    root = _sglang_package_root()
    with _bare_sglang_packages(root):
        api_contract = importlib.import_module("sglang.srt.entrypoints.api_contract")
        api_types = importlib.import_module("sglang.api.v1.api_types")
        sampling_params = importlib.import_module("sglang.srt.sampling.sampling_params")
        io_struct = _load_io_struct(root / "srt" / "managers" / "io_struct.py")
        for name in ("GenerateReqInput", *_CONTROL_STRUCTS):
            if name not in io_struct:
                pytest.fail(f"io_struct.py of sglang {SGLANG_VERSION} did not define {name}", pytrace=False)
        # Built while the module is registered: the schema resolves the string annotations.
        adapters = {name: TypeAdapter(io_struct[name]) for name in _CONTROL_STRUCTS}
    routes = _parse_routes(root)
    return SGLangSchema(root, api_contract, api_types, sampling_params, io_struct, adapters, routes, tokenizer)


# ----- capture server ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CapturedRequest:
    """One HTTP request the client sent."""

    method: str
    path: str
    query: dict[str, str]
    body: Any  # the parsed JSON body, None when there was none


@dataclass
class CaptureServer:
    """An SGLang-shaped HTTP server that records every request."""

    url: str = ""
    requests: list[CapturedRequest] = field(default_factory=list)

    def bodies(self, path: str) -> list[Any]:
        """JSON bodies sent to ``path``, in order."""
        return [request.body for request in self.requests if request.path == path]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Record the request; answer as SGLang 0.5.23 does for that route."""
        raw = await request.read()
        body = await request.json() if raw else None
        self.requests.append(CapturedRequest(request.method, request.path, dict(request.query), body))
        route = (request.method, request.path)
        if route in (("POST", "/generate"), ("PUT", "/generate")):
            return web.json_response(_generate_answer(body))
        if route == ("POST", "/update_weights_from_disk"):
            message = "Succeeded to update model weights."
            return web.json_response({"success": True, "message": message, "num_paused_requests": 0})
        if request.method == "POST" and request.path in _GROUP_ROUTES:
            return web.json_response({"success": True, "message": "Success"})
        if route in (("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter")):
            # LoRAUpdateOutput as msgspec_to_builtins writes it (http_server.py).
            loaded = {body["lora_name"]: body["lora_path"]} if request.path == "/load_lora_adapter" else {}
            return web.json_response(
                {"rid": None, "http_worker_ipc": None, "success": True, "error_message": None,
                 "loaded_adapters": loaded}
            )
        if route == ("POST", "/pause_generation"):
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if route == ("POST", "/continue_generation"):
            return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
        if route == ("POST", "/abort_request") or route in (("GET", "/health"), ("GET", "/health_generate")):
            return web.Response(status=200)
        if route in (("GET", "/flush_cache"), ("POST", "/flush_cache")):
            return web.Response(status=200, text="Cache flushed.\n")
        if route in (("GET", "/model_info"), ("GET", "/get_model_info")):
            return web.json_response(
                {"model_path": "/models/tiny", "tokenizer_path": "/models/tiny", "is_generation": True,
                 "weight_version": "default"}
            )
        if route in (("GET", "/server_info"), ("GET", "/get_server_info")):
            return web.json_response({"version": SGLANG_VERSION, "max_total_num_tokens": 4096})
        if route == ("GET", "/v1/loads"):
            load = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                    "num_total_tokens": 0, "max_running_requests": 16, "max_total_num_tokens": 4096}
            return web.json_response({"version": SGLANG_VERSION, "loads": [load]})
        return web.json_response({"detail": "Not Found"}, status=404)


def _generate_answer(body: dict[str, Any]) -> Any:
    """``/generate``'s answer: one object for one sample, a list for ``n > 1`` (tokenizer_manager.py)."""
    sampling = body.get("sampling_params") or {}
    n = int(sampling.get("n") or 1)
    length = min(3, int(sampling.get("max_new_tokens") or 3))
    samples = []
    for index in range(n):
        output_ids = [7 + index + i for i in range(length)]
        meta: dict[str, Any] = {
            "id": body["rid"] if n == 1 else f"{index:032x}",
            "finish_reason": {"type": "length", "length": length},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": length,
            "cached_tokens": 0,
            "weight_version": "v1",
            "weight_versions": [
                {"version": "default", "start": 0, "end": 1},
                {"version": "v1", "start": 1, "end": length},
            ],
            "e2e_latency": 0.01,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, token, None] for token in output_ids]
        samples.append({"text": "", "output_ids": output_ids, "meta_info": meta, "index": index})
    return samples[0] if n == 1 else samples


@pytest.fixture
async def capture_server() -> AsyncIterator[CaptureServer]:
    """A running capture server on an OS-chosen port."""
    server = CaptureServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the OS picks the port
    await web.SockSite(runner, sock).start()
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


# ----- the requests rolloutd sends ---------------------------------------------------------------
GENERATE_CASES: dict[str, GenerationRequest] = {
    "greedy": GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4), return_logprob=False),
    "greedy-logprobs": GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4)),
    "sampled-seeded": GenerationRequest(PROMPT, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234)),
    "sampled-min-p": GenerationRequest(PROMPT, SamplingParams(temperature=1.0, min_p=0.05, max_new_tokens=8)),
    "n4": GenerationRequest(PROMPT, SamplingParams(temperature=1.0, n=4, max_new_tokens=8)),
    "n4-seeded": GenerationRequest(PROMPT, SamplingParams(temperature=1.0, n=4, seed=7)),
    "stop-token-ids": GenerationRequest(PROMPT, SamplingParams(stop_token_ids=(2, 257), ignore_eos=False)),
    "ignore-eos": GenerationRequest(PROMPT, SamplingParams(ignore_eos=True, max_new_tokens=16)),
    "stop-strings": GenerationRequest(PROMPT, SamplingParams(stop=("\n\n", "</answer>"), no_stop_trim=True)),
    "explicit-rid": GenerationRequest(PROMPT, SamplingParams(max_new_tokens=2), rid="episode-3-turn-0"),
    "zero-new-tokens": GenerationRequest(PROMPT, SamplingParams(max_new_tokens=0), return_logprob=False),
    "lora": GenerationRequest(PROMPT, SamplingParams(max_new_tokens=4), lora_path="job/agent@v1"),
    "lora-n4": GenerationRequest(PROMPT, SamplingParams(n=4, max_new_tokens=4), lora_path="job/agent@v1"),
}


async def _drive_client(server: CaptureServer) -> None:
    """Every call of the client's API, with the arguments rolloutd uses."""
    async with SGLangClient(server.url) as client:
        assert await client.health()
        assert await client.health_generate()
        await client.model_info()
        await client.server_info()
        await client.loads()
        for request in GENERATE_CASES.values():
            results = await client.generate(request)
            assert len(results) == request.sampling.n
        await client.update_weights_from_disk("/ckpt/step-1")
        await client.update_weights_from_disk("/ckpt/step-2", weight_version="2", abort_all_requests=True)
        await client.update_weights_from_disk("/ckpt/step-3", weight_version="3", load_format="safetensors")
        assert await client.flush_cache()
        await client.abort(abort_all=True)
        await client.abort("episode-3-turn-0")
        for mode in PauseMode:
            await client.pause_generation(mode)
            await client.continue_generation()
        await client.pause_generation(PauseMode.IN_PLACE)
        await client.update_weights_from_disk("/ckpt/step-4", weight_version="4", flush_cache=False)
        await client.continue_generation()
        # A version over a weight-update group, as traind.weight_sync drives it (gloo on CPU).
        await client.init_weights_update_group(
            master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=3, backend="gloo"
        )
        await client.begin_weight_update()
        await client.update_weights_from_distributed(["model.embed_tokens.weight"], ["bfloat16"], [[320, 256]])
        await client.update_weights_from_distributed(
            ["model.norm.weight", "lm_head.weight"], ["float32", "float32"], [[256], [320, 256]],
            weight_version="5", flush_cache=True,
        )
        await client.update_weights_from_distributed(
            ["model.norm.weight"], ["float32"], [[256]], load_format="flattened_bucket", group_name="g2"
        )
        await client.end_weight_update()
        await client.destroy_weights_update_group()
        # An adapter version, as rolloutd publishes one (a PEFT directory under a versioned name).
        loaded = await client.load_lora_adapter("job/agent@v1", "/ckpt/agent/v1")
        assert loaded.loaded_adapters == {"job/agent@v1": "/ckpt/agent/v1"}
        await client.load_lora_adapter("job/agent@v2", "/ckpt/agent/v2", pinned=True)
        await client.unload_lora_adapter("job/agent@v1")


@pytest.fixture
async def captured(capture_server: CaptureServer) -> CaptureServer:
    """The capture server after the client has made every call."""
    await asyncio.wait_for(_drive_client(capture_server), timeout=60)
    return capture_server


async def _drive_router(server: CaptureServer) -> None:
    """A job's first turn through rolloutd's router: weight load, seeded n > 1, unseeded n > 1."""
    from rolloutd.router import Replica, RolloutRouter

    async def resolve(uri: str) -> str:
        return "/ckpt/" + uri.rsplit("/", 1)[-1]

    async with SGLangClient(server.url) as client:
        router = RolloutRouter([Replica("r0", client)], resolve)
        try:
            router.require("job/agent", 1, "stored://job/agent/v1")
            await router.set_agents(["job/agent"])
            sampling = {"temperature": 1.0, "max_new_tokens": 4}
            seeded = await router.generate("job/agent", list(PROMPT), sampling, 4, "job/episode-0", seed=11)
            unseeded = await router.generate("job/agent", list(PROMPT), sampling, 3, "job/episode-1")
            assert (len(seeded), len(unseeded)) == (4, 3)
        finally:
            await router.close()


# ----- checks, by SGLang's own code --------------------------------------------------------------
def _check_generate_body(schema: SGLangSchema, body: dict[str, Any]) -> None:
    """Raise unless SGLang 0.5.23 admits ``body`` on ``/generate`` up to tokenization."""
    body = copy.deepcopy(body)  # SGLang normalizes in place
    contract_error = schema.api_contract.generate_contract_error(body)  # http_server.py answers 400 with it
    if contract_error is not None:
        raise ValueError(contract_error)
    request = schema.cls("GenerateReqInput")(**body)
    request.normalize_batch_and_arguments()
    for sampling in _per_sample_sampling_params(request.sampling_params):
        params = schema.sampling_params.SamplingParams(**sampling)
        params.normalize(schema.tokenizer)  # a server launched without --skip-tokenizer-init
        params.verify(len(schema.tokenizer))


def _per_sample_sampling_params(sampling: Any) -> list[dict[str, Any]]:
    return list(sampling) if isinstance(sampling, list) else [sampling]


def _check_struct_body(schema: SGLangSchema, name: str, body: dict[str, Any]) -> None:
    """Raise unless SGLang's FastAPI route admits ``body`` as ``name`` and every key is a field of it."""
    schema.struct_adapters[name].validate_python(body)  # what FastAPI does with the JSON body
    schema.cls(name)(**body)  # TypeError on a key SGLang would silently drop


async def test_every_generate_body_passes_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    bodies = captured.bodies("/generate")
    assert len(bodies) == len(GENERATE_CASES)
    for case, body in zip(GENERATE_CASES, bodies, strict=True):
        try:
            _check_generate_body(sglang_schema, body)
        except Exception as exc:  # the test reports which case SGLang refused, and why
            pytest.fail(f"SGLang {SGLANG_VERSION} refuses /generate body of case {case!r}: {exc!r}\n{body}")


async def test_generate_bodies_carry_what_was_asked(captured: CaptureServer) -> None:
    by_case = dict(zip(GENERATE_CASES, captured.bodies("/generate"), strict=True))
    assert by_case["sampled-seeded"]["sampling_params"]["sampling_seed"] == 1234
    assert by_case["n4"]["sampling_params"]["n"] == 4
    assert by_case["stop-token-ids"]["sampling_params"]["stop_token_ids"] == [2, 257]
    assert by_case["stop-strings"]["sampling_params"]["stop"] == ["\n\n", "</answer>"]
    assert by_case["greedy"]["return_logprob"] is False
    assert by_case["greedy-logprobs"]["return_logprob"] is True
    assert by_case["explicit-rid"]["rid"] == "episode-3-turn-0"
    assert by_case["lora"]["lora_path"] == by_case["lora-n4"]["lora_path"] == "job/agent@v1"
    assert not any("lora_path" in body for case, body in by_case.items() if not case.startswith("lora"))
    assert all(body["stream"] is False and "input_ids" in body and "text" not in body for body in by_case.values())


async def test_weight_update_bodies_pass_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    bodies = captured.bodies("/update_weights_from_disk")
    assert [body["model_path"] for body in bodies] == ["/ckpt/step-1", "/ckpt/step-2", "/ckpt/step-3", "/ckpt/step-4"]
    assert bodies[1]["weight_version"] == "2"
    assert "flush_cache" not in bodies[0] and bodies[3]["flush_cache"] is False
    for body in bodies:
        _check_struct_body(sglang_schema, "UpdateWeightFromDiskReqInput", body)


async def test_weight_group_bodies_pass_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    for path in _GROUP_ROUTES:
        bodies = captured.bodies(path)
        assert bodies, path
        for body in bodies:
            _check_struct_body(sglang_schema, _BODY_STRUCTS[path], body)
    [init] = captured.bodies("/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 3, "gloo")
    updates = captured.bodies("/update_weights_from_distributed")
    assert "weight_version" not in updates[0] and updates[1]["weight_version"] == "5"  # the last bucket only
    assert updates[2]["load_format"] == "flattened_bucket" and updates[2]["group_name"] == "g2"


async def test_lora_adapter_bodies_pass_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    loads = captured.bodies("/load_lora_adapter")
    assert loads == [
        {"lora_name": "job/agent@v1", "lora_path": "/ckpt/agent/v1", "pinned": False},
        {"lora_name": "job/agent@v2", "lora_path": "/ckpt/agent/v2", "pinned": True},
    ]
    for body in loads:
        _check_struct_body(sglang_schema, "LoadLoRAAdapterReqInput", body)
    unloads = captured.bodies("/unload_lora_adapter")
    assert unloads == [{"lora_name": "job/agent@v1"}]
    for body in unloads:
        _check_struct_body(sglang_schema, "UnloadLoRAAdapterReqInput", body)


def test_lora_path_forms_the_engines_accept_pass_sglang(sglang_schema: SGLangSchema) -> None:
    # A batch naming one adapter (or the base: null) per prompt, as rolloutd's engines take it.
    batch = {**_valid_body(), "input_ids": [list(PROMPT), list(PROMPT)], "rid": ["x", "y"]}
    _check_generate_body(sglang_schema, {**batch, "lora_path": ["job/a@v1", None]})
    _check_generate_body(sglang_schema, {**batch, "lora_path": "job/a@v1"})
    with pytest.raises((ValueError, TypeError)):
        _check_generate_body(sglang_schema, {**_valid_body(), "lora_path": 3})  # the contract gate
    with pytest.raises((ValueError, TypeError)):
        _check_generate_body(sglang_schema, {**batch, "lora_path": {"a": 1}})


async def test_abort_bodies_pass_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    bodies = captured.bodies("/abort_request")
    assert bodies and bodies[0]["abort_all"] is True
    for body in bodies:
        _check_struct_body(sglang_schema, "AbortReq", body)
        sglang_schema.api_types.AbortRequest.from_json_value(body)


async def test_pause_and_continue_bodies_pass_sglang(captured: CaptureServer, sglang_schema: SGLangSchema) -> None:
    pauses = captured.bodies("/pause_generation")
    assert [body["mode"] for body in pauses] == ["abort", "retract", "in_place", "in_place"]
    for body in pauses:
        _check_struct_body(sglang_schema, "PauseGenerationReqInput", body)
    continues = captured.bodies("/continue_generation")
    assert continues == [{}] * 4  # a JSON object, as the route requires a body
    for body in continues:
        _check_struct_body(sglang_schema, "ContinueGenerationReqInput", body)


async def test_generate_answers_carry_weight_version_spans(capture_server: CaptureServer) -> None:
    async with SGLangClient(capture_server.url) as client:
        [result] = await client.generate(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=3)))
    assert result.weight_versions == (WeightVersionSpan("default", 0, 1), WeightVersionSpan("v1", 1, 3))
    assert result.weight_version == "v1" and result.version_of_token(0) == "default"


async def test_bodiless_calls_send_no_body(captured: CaptureServer) -> None:
    # /health, /flush_cache, /v1/loads, ... take no body in SGLang; /flush_cache reads only ?timeout=.
    for request in captured.requests:
        if request.path not in ("/generate", *_BODY_STRUCTS):
            assert request.body is None, request
            assert not request.query or (request.path == "/flush_cache" and set(request.query) <= {"timeout"})


async def test_every_route_the_client_uses_is_served_by_sglang(
    captured: CaptureServer, sglang_schema: SGLangSchema
) -> None:
    used = {(request.method, request.path) for request in captured.requests}
    missing = sorted(used - sglang_schema.routes)
    assert not missing, f"routes sglang {SGLANG_VERSION} http_server.py does not serve: {missing}"


async def test_router_bodies_pass_sglang(capture_server: CaptureServer, sglang_schema: SGLangSchema) -> None:
    await asyncio.wait_for(_drive_router(capture_server), timeout=60)
    for body in capture_server.bodies("/update_weights_from_disk"):
        _check_struct_body(sglang_schema, "UpdateWeightFromDiskReqInput", body)
    generate = capture_server.bodies("/generate")
    for body in generate:
        _check_generate_body(sglang_schema, body)
    # The seeded n=4 turn went out as 4 one-sample requests with distinct seeds (SGLang gives one
    # request's samples one seed); the unseeded n=3 one as one request.
    seeded = [body["sampling_params"] for body in generate if "sampling_seed" in body["sampling_params"]]
    assert [params["n"] for params in seeded] == [1, 1, 1, 1]
    seeds = sorted(params["sampling_seed"] for params in seeded)
    assert seeds == list(range(seeds[0], seeds[0] + 4))
    unseeded = [body for body in generate if "sampling_seed" not in body["sampling_params"]]
    assert [body["sampling_params"]["n"] for body in unseeded] == [3]
    used = {(request.method, request.path) for request in capture_server.requests}
    assert not used - sglang_schema.routes


def test_route_table_is_read_from_sglang(sglang_schema: SGLangSchema) -> None:
    # The parse is not vacuous: SGLang's RL routes are found, and a route 0.5.23 lacks is absent.
    assert {("POST", "/generate"), ("PUT", "/generate"), ("POST", "/update_weights_from_disk"),
            ("POST", "/pause_generation"), ("POST", "/continue_generation"),
            ("POST", "/abort_request"), ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/v1/loads"),
            ("POST", "/flush_cache"), ("GET", "/model_info"), ("GET", "/server_info"),
            ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"),
            ("GET", "/v1/models")} <= sglang_schema.routes


def test_fake_generate_answers_are_sglang_shaped(sglang_schema: SGLangSchema) -> None:
    # The capture server's answers pass SGLang's response schema, so the client parses real shapes.
    for n in (1, 3):
        body = {"input_ids": list(PROMPT), "rid": "r", "return_logprob": True, "sampling_params": {"n": n}}
        answer = _generate_answer(body)
        for sample in answer if isinstance(answer, list) else [answer]:
            sglang_schema.api_types.GenerateResponse.from_json_value(sample)


def test_rolloutd_sampling_key_list_is_sglangs(sglang_schema: SGLangSchema) -> None:
    from rolloutd.engines import protocol

    assert protocol.SGLANG_SAMPLING_KEYS == sglang_schema.api_types.SamplingParams.__struct_fields__


# ----- the harness can fail ----------------------------------------------------------------------
def _valid_body() -> dict[str, Any]:
    return {
        "input_ids": list(PROMPT),
        "sampling_params": SamplingParams(temperature=0.7, n=2, seed=3).to_wire(),
        "return_logprob": True,
        "rid": "r-1",
        "stream": False,
    }


def test_valid_body_passes(sglang_schema: SGLangSchema) -> None:
    _check_generate_body(sglang_schema, _valid_body())


@pytest.mark.parametrize(
    ("sampling_update", "refused_by"),
    [
        ({"seed": 3}, "contract gate: unknown field"),
        ({"max_new_tokens": "8"}, "contract gate: wrong type"),
        ({"stop_token_ids": [2.5]}, "contract gate: wrong element type"),
        ({"top_k": 0}, "SamplingParams.verify"),
        ({"top_p": 0.0}, "SamplingParams.verify"),
        ({"temperature": -1.0}, "SamplingParams.verify"),
        ({"sampling_seed": 2**63}, "SamplingParams.verify"),
        ({"max_new_tokens": -1}, "SamplingParams.verify"),
    ],
)
def test_bad_sampling_params_are_refused(
    sglang_schema: SGLangSchema, sampling_update: dict[str, Any], refused_by: str
) -> None:
    body = _valid_body()
    body["sampling_params"] = {**body["sampling_params"], **sampling_update}
    with pytest.raises((ValueError, TypeError)):
        _check_generate_body(sglang_schema, body)


def test_unknown_sampling_key_is_a_type_error_in_sampling_params(sglang_schema: SGLangSchema) -> None:
    # tokenizer_manager.py builds SamplingParams(**sampling_params): a key past the gate is a TypeError.
    with pytest.raises(TypeError, match="seed"):
        sglang_schema.sampling_params.SamplingParams(seed=3)


@pytest.mark.parametrize(
    "update",
    [
        {"input_ids": None},  # no prompt at all
        {"return_logprob": "yes"},  # wrong type at the gate
        {"stream": "no"},  # wrong type at the gate
        {"input_ids": [1, "2"]},  # wrong element type at the gate
    ],
)
def test_bad_generate_bodies_are_refused(sglang_schema: SGLangSchema, update: dict[str, Any]) -> None:
    body = {**_valid_body(), **update}
    with pytest.raises((ValueError, TypeError)):
        _check_generate_body(sglang_schema, body)


def test_unknown_top_level_key_is_flagged(sglang_schema: SGLangSchema) -> None:
    # SGLang ignores unknown top-level keys (FastAPI drops them); this harness flags them, so a
    # misspelt field (silently ignored by a real server) cannot pass.
    with pytest.raises(TypeError, match="return_logprobs"):
        _check_generate_body(sglang_schema, {**_valid_body(), "return_logprobs": True})


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("UpdateWeightFromDiskReqInput", {}),  # model_path is required
        ("UpdateWeightFromDiskReqInput", {"model_path": "/ckpt", "abort_all_requests": "maybe"}),
        ("UpdateWeightFromDiskReqInput", {"model_path": "/ckpt", "version": "2"}),  # SGLang's key is weight_version
        ("AbortReq", {"rid": "r", "abort_all": [True]}),
        ("AbortReq", {"rid": "r", "all": True}),
        # What rolloutd's engines refuse on /pause_generation and /continue_generation.
        ("PauseGenerationReqInput", {"mode": "pause"}),
        ("PauseGenerationReqInput", {"mode": 1}),
        ("PauseGenerationReqInput", {"mode": "in_place", "rid": 3}),
        ("ContinueGenerationReqInput", {"torch_empty_cache": "maybe"}),
        # What rolloutd's engines refuse on the weight-update-group routes.
        ("InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": 1, "rank_offset": 1}),  # world_size
        ("InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": "x", "rank_offset": 1,
                                            "world_size": 2}),
        ("UpdateWeightsFromDistributedReqInput", {"names": ["a"], "dtypes": ["float32"]}),  # shapes required
        ("UpdateWeightsFromDistributedReqInput", {"names": ["a"], "dtypes": ["float32"], "shapes": [["1"]],
                                                  "selector": "both"}),
        ("DestroyWeightsUpdateGroupReqInput", {"group_name": 3}),
        ("DestroyWeightsUpdateGroupReqInput", {"group_name": None}),  # a str with a default: null is no name
        # What rolloutd's engines refuse on the LoRA routes.
        ("LoadLoRAAdapterReqInput", {"lora_name": "a"}),  # lora_path is required
        ("LoadLoRAAdapterReqInput", {"lora_name": "a", "lora_path": "/p", "pinned": "maybe"}),
        ("LoadLoRAAdapterReqInput", {"name": "a", "lora_path": "/p"}),
        ("UnloadLoRAAdapterReqInput", {}),
        ("UnloadLoRAAdapterReqInput", {"lora_name": 3}),
    ],
)
def test_bad_control_bodies_are_refused(sglang_schema: SGLangSchema, name: str, body: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError)):
        _check_struct_body(sglang_schema, name, body)
    model = _server_model(name)
    if set(body) <= set(model.model_fields):  # a key SGLang's FastAPI route drops is dropped by ours too
        with pytest.raises(ValueError):
            model.model_validate(body)


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("PauseGenerationReqInput", {}),  # mode "abort" by default
        ("PauseGenerationReqInput", {"mode": "retract", "rid": "r"}),
        ("ContinueGenerationReqInput", {}),
        ("ContinueGenerationReqInput", {"torch_empty_cache": "false"}),  # FastAPI's lax booleans
        ("UpdateWeightFromDiskReqInput", {"model_path": "/ckpt", "flush_cache": "no"}),
        ("InitWeightsUpdateGroupReqInput", {"master_address": "h", "master_port": "29500", "rank_offset": 1.0,
                                            "world_size": 2}),  # lax integers
        ("UpdateWeightsFromDistributedReqInput", {"names": [], "dtypes": [], "shapes": [], "flush_cache": "off"}),
        ("BeginWeightUpdateReqInput", {"selector": "target"}),
        ("EndWeightUpdateReqInput", {}),
        ("LoadLoRAAdapterReqInput", {"lora_name": "a", "lora_path": "/p", "pinned": "yes"}),  # lax booleans
        ("UnloadLoRAAdapterReqInput", {"lora_name": "a", "rid": "r"}),
    ],
)
def test_control_bodies_rolloutds_engines_accept_pass_sglang(
    sglang_schema: SGLangSchema, name: str, body: dict[str, Any]
) -> None:
    sglang_schema.struct_adapters[name].validate_python(body)
    _server_model(name).model_validate(body)  # the embedded server's model of the request accepts it too


def _server_model(name: str) -> type[embedded_schemas.SGLangRequest]:
    """The embedded server's model of SGLang's request struct ``name`` (same class name)."""
    model = getattr(embedded_schemas, name)
    assert isinstance(model, type) and issubclass(model, embedded_schemas.SGLangRequest)
    return model


_SERVER_MODELS = sorted(
    (m for m in vars(embedded_schemas).values()
     if isinstance(m, type) and issubclass(m, embedded_schemas.SGLangRequest)
     and m not in (embedded_schemas.SGLangRequest, embedded_schemas.BaseReq)),
    key=lambda m: m.__name__,
)
_REQUIRED = object()


def _sglang_fields(struct: Any) -> dict[str, Any]:
    """Field name -> default (``_REQUIRED`` when it has none) of an io_struct.py dataclass or msgspec struct."""
    import dataclasses

    import msgspec

    if dataclasses.is_dataclass(struct):
        return {f.name: _REQUIRED if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                else f.default for f in dataclasses.fields(struct)}
    # msgspec.structs.fields would resolve the annotations, which need io_struct.py's namespace: read the
    # defaults as it does (NODEFAULT for a required field, a trailing tuple aligned with the last fields).
    names, defaults = struct.__struct_fields__, struct.__struct_defaults__
    padded = (msgspec.NODEFAULT,) * (len(names) - len(defaults)) + tuple(defaults)
    return {name: _REQUIRED if default is msgspec.NODEFAULT else default
            for name, default in zip(names, padded, strict=True)}


@pytest.mark.parametrize("model", _SERVER_MODELS, ids=lambda m: m.__name__)
def test_the_embedded_servers_request_models_declare_sglangs_fields(
    sglang_schema: SGLangSchema, model: type[embedded_schemas.SGLangRequest]
) -> None:
    # Every field the embedded server reads is a field of SGLang's struct of the same name, required
    # where SGLang requires it and with SGLang's default (AbortReq's __post_init__ turns rid None into "").
    theirs = _sglang_fields(sglang_schema.cls(model.__name__))
    for name, field_info in model.model_fields.items():
        assert name in theirs, f"{model.__name__}.{name} is not a field of SGLang's {model.__name__}"
        if model is embedded_schemas.GenerateReqInput:
            continue  # its fields are read strictly and default to None; SGLang normalises them later
        ours = _REQUIRED if field_info.is_required() else field_info.default
        expected = "" if (model.__name__, name, theirs[name]) == ("AbortReq", "rid", None) else theirs[name]
        assert ours == expected, f"{model.__name__}.{name}: default {ours!r}, SGLang's {expected!r}"


def test_pause_modes_are_sglangs(sglang_schema: SGLangSchema) -> None:
    for mode in PauseMode:
        sglang_schema.struct_adapters["PauseGenerationReqInput"].validate_python({"mode": mode.value})
    with pytest.raises(ValueError):
        sglang_schema.struct_adapters["PauseGenerationReqInput"].validate_python({"mode": "inplace"})


def test_unserved_route_is_flagged(sglang_schema: SGLangSchema) -> None:
    # Routes earlier FlexMARL servers answered that 0.5.23 does not serve (docs: use /model_info).
    assert not {route for route in sglang_schema.routes if route[1] == "/get_weight_version"}
    assert ("GET", "/get_load") not in sglang_schema.routes
    assert ("POST", "/health") not in sglang_schema.routes
