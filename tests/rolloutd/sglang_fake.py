"""A small in-process HTTP server that answers like SGLang 0.5.23 where the client and router care.

Only the behaviours rolloutd's client and router depend on, each as SGLang has it:

- ``/generate`` with ``sampling_seed`` samples as SGLang launched with
  ``--enable-deterministic-inference`` does: the ``n`` samples of one request share the seed and
  the seeded sampler hashes seed and position only (``srt/layers/sampler.py``
  ``multinomial_with_seed``), so they are identical; without a seed every sample is random.
  ``n == 1`` answers one object, ``n > 1`` a list; the samples of an ``n > 1`` request carry
  fresh rids (``srt/managers/tokenizer_manager.py``).
- error bodies in SGLang's shapes (``srt/entrypoints/http_server.py``): queued answers let a
  test make ``/generate`` fail with any status and body.
- ``/update_weights_from_disk`` answers ``{"success", "message", "num_paused_requests"}``,
  200 or 400; ``/health`` 200 (or a set status); ``/v1/loads`` per-rank ``max_running_requests``;
  ``/server_info`` with ``max_total_num_tokens`` (the scheduler's KV capacity) when a test sets one.
- slowness: a per-request decode time, or a gate that holds every ``/generate`` until a
  number of them are in flight at once (so a test can prove concurrency), or a hang.

The server can be stopped and started again on the same port (a replica restart).
"""

from __future__ import annotations

import asyncio
import collections
import random
import uuid
from typing import Any

from aiohttp import web


class FakeSGLang:
    """One fake SGLang replica on 127.0.0.1 (port 0 picks a free one)."""

    def __init__(self, *, max_running_requests: int | None = 256, dp_ranks: int = 1) -> None:
        self.port = 0
        self.max_running_requests = max_running_requests
        self.dp_ranks = dp_ranks
        self.decode_s = 0.0  # how long each /generate runs on the "GPU"
        self.max_total_num_tokens: int | None = None  # /server_info's KV capacity (None: not stated)
        self.gate_in_flight = 0  # hold each /generate until this many are in flight (0: off)
        self.gate_timeout_s = 30.0
        self.hang = False  # /generate never answers
        self.health_status = 200
        self.weight_version = "initial"
        self.generate_answers: collections.deque[tuple[int, Any]] = collections.deque()  # next answers
        self.weights_answer: tuple[int, Any] | None = None
        self.generate_bodies: list[dict[str, Any]] = []
        self.weight_bodies: list[dict[str, Any]] = []
        self.abort_bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._gate = asyncio.Event()
        self._stopped = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listens (again, on the same port once one was picked)."""
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/update_weights_from_disk", self._update_weights)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/server_info", self._server_info)
        self._stopped.clear()
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stops listening and drops open connections (a killed server)."""
        self._stopped.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- routes --------------------------------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generate_bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.generate_answers:
                status, payload = self.generate_answers.popleft()
                return _answer(status, payload)
            if self.hang:
                await self._stopped.wait()
            if self.gate_in_flight:
                if self.in_flight >= self.gate_in_flight:
                    self._gate.set()
                try:
                    await asyncio.wait_for(self._gate.wait(), self.gate_timeout_s)
                except TimeoutError:
                    message = f"only {self.max_in_flight} of {self.gate_in_flight} requests ever arrived together"
                    return _answer(500, {"object": "error", "message": message, "type": "500", "code": 500})
            if self.decode_s:
                await asyncio.sleep(self.decode_s)  # the modelled decode time of this request
            return web.json_response(self._samples(body))
        finally:
            self.in_flight -= 1

    def _samples(self, body: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        sampling = body.get("sampling_params") or {}
        n = int(sampling.get("n", 1))
        length = int(sampling.get("max_new_tokens", 128))
        prompt = list(body["input_ids"])
        seed = sampling.get("sampling_seed")
        samples = []
        for _ in range(n):
            # One seed for the whole request: every sample draws the same tokens.
            if seed is None:
                tokens = tuple(_random_tokens(random.Random(), length))
            else:
                tokens = seeded_tokens(seed, prompt, length)
            rid = body.get("rid") if n == 1 else uuid.uuid4().hex
            samples.append({
                "text": "",
                "output_ids": list(tokens),
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "length", "length": length},
                    "prompt_tokens": len(prompt),
                    "weight_version": self.weight_version,
                    "completion_tokens": length,
                    "cached_tokens": 0,
                    "e2e_latency": 0.001,
                    "output_token_logprobs": [[-1.0, token, None] for token in tokens],
                },
            })
        return samples[0] if n == 1 else samples

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.weight_bodies.append(body)
        if self.weights_answer is not None:
            return _answer(*self.weights_answer)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def _abort(self, request: web.Request) -> web.Response:
        self.abort_bodies.append(await request.json())
        return web.Response(status=200)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"max_running_requests": self.max_running_requests}
        if self.max_total_num_tokens is not None:
            info["max_total_num_tokens"] = self.max_total_num_tokens
        return web.json_response(info)

    async def _loads(self, request: web.Request) -> web.Response:
        load: dict[str, Any] = {"num_running_reqs": self.in_flight, "num_waiting_reqs": 0,
                                "num_used_tokens": 10, "num_total_tokens": 15}
        if self.max_running_requests is not None:
            load["max_running_requests"] = self.max_running_requests
        loads = [{"dp_rank": rank, **load} for rank in range(self.dp_ranks)]
        return web.json_response({"timestamp": "", "version": "0.5.23", "loads": loads})


def seeded_tokens(seed: int, prompt: list[int], length: int) -> tuple[int, ...]:
    """The tokens the fake samples for a seed and a prompt (a function of nothing else)."""
    return tuple(_random_tokens(random.Random(f"{seed}|{prompt}"), length))


def _random_tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(length)]


def _answer(status: int, payload: Any) -> web.Response:
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.json_response(payload, status=status)
