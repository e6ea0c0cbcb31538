"""sglang-router against rolloutd's intra-agent router, in front of the same modelled replicas.

    pip install sglang-router            # 0.3.2, a CPU wheel
    python -m benchmarks.router_compare  # ~2-4 min on 2 cores

Replicas: ``--replicas`` synthetic engine replicas (:mod:`benchmarks.synthetic_engine`, one
process, continuous batching, modelled H100 time). Workload: one agent, ``--episodes``
episodes released together (an RL rollout batch), each ``--turns`` turns in a row on the same
512-token prompt; every response length is drawn from the long-tailed ``planner`` shape of
``benchmarks.workloads`` (lognormal, median 1024, sigma 1, cap 8192 modelled tokens) with
one seed, so every router sees the same requests in the same order.

Routers:

* ``flexmarl``: :class:`rolloutd.router.RolloutRouter` with its balancer (least outstanding
  estimated tokens, episode affinity), exactly as rolloutd builds it for one agent;
* ``sglang-<policy>``: ``python -m sglang_router.launch_router --worker-urls ... --policy
  <policy>`` for each of ``--sglang-policies`` (cache_aware, round_robin, power_of_two, ...),
  driven through its ``/generate`` with the same body rolloutd sends to an engine.

Figures: makespan (modelled seconds until the last episode ends) and per-request latency
(p50, p99, modelled). Writes ``<out>/router.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.report import Column, percentile, render_table
from benchmarks.synthetic_engine import SyntheticFleet
from benchmarks.synthetic_replica import SyntheticEngineConfig
from benchmarks.workloads import LONG_TAIL_SHAPES, LengthDistribution
from flexmarl import devicemodel
from rolloutd.balancer import BalancerConfig
from rolloutd.engines.launcher import free_port
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.router import Replica, RolloutRouter

log = logging.getLogger("benchmarks.router_compare")
AGENT = "bench/agent"


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request: the episode it belongs to and its response length in real tokens."""

    episode: int
    index: int
    max_new_tokens: int


@dataclasses.dataclass
class RouterResult:
    """Figures of one router."""

    router: str
    makespan_s: float
    p50_latency_s: float
    p99_latency_s: float
    requests: int
    errors: int


def make_turns(episodes: int, turns: int, shape: LengthDistribution, token_scale: float, seed: int) -> list[list[Turn]]:
    """Each episode's turns (lengths in real tokens = modelled / token_scale)."""
    rng = random.Random(seed)
    return [
        [Turn(e, t, max(1, math.ceil(shape.sample(rng) / token_scale))) for t in range(turns)] for e in range(episodes)
    ]


async def _drive(generate: Any, episodes: list[list[Turn]], prompt: list[int]) -> tuple[float, list[float], int]:
    """Run every episode concurrently, turns in order; returns (wall makespan, wall latencies, errors)."""
    latencies: list[float] = []
    errors = 0

    async def episode(turns: list[Turn]) -> None:
        nonlocal errors
        for turn in turns:
            started = time.monotonic()
            try:
                await generate(turn, prompt)
            except Exception as exc:  # a failed request counts, the run goes on
                errors += 1
                log.warning("request %d/%d failed: %s", turn.episode, turn.index, exc)
                continue
            latencies.append(time.monotonic() - started)

    started = time.monotonic()
    await asyncio.gather(*(episode(turns) for turns in episodes))
    return time.monotonic() - started, latencies, errors


def _sampling(turn: Turn) -> dict[str, Any]:
    return {
        "temperature": 1.0,
        "max_new_tokens": turn.max_new_tokens,
        "ignore_eos": True,
        "sampling_seed": turn.episode * 1000 + turn.index,
    }


async def run_flexmarl(
    urls: list[str], episodes: list[list[Turn]], prompt: list[int], model_dir: str
) -> tuple[float, list[float], int]:
    """rolloutd's RolloutRouter + balancer for one agent (weights loaded before the clock starts)."""
    replicas = [Replica(f"replica-{i}", SGLangClient(url, request_timeout_s=3600)) for i, url in enumerate(urls)]

    async def resolve(uri: str) -> str:
        return uri

    router = RolloutRouter(replicas, resolve, config=BalancerConfig())
    router.require(AGENT, 0, model_dir)
    await router.set_agents([AGENT])
    await asyncio.gather(*(router._ensure_weights(r, AGENT) for r in replicas))  # warm: every replica serves it

    async def generate(turn: Turn, prompt_ids: list[int]) -> None:
        await router.generate(AGENT, prompt_ids, _sampling(turn), 1, f"episode-{turn.episode}")

    try:
        return await _drive(generate, episodes, prompt)
    finally:
        await router.close()
        for replica in replicas:
            await replica.client.close()


class SglangRouterProcess:
    """``python -m sglang_router.launch_router`` in front of the replicas."""

    def __init__(self, urls: list[str], policy: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--worker-urls",
            *urls,
            "--request-timeout-secs",
            "3600",
            "--log-level",
            "warn",
        ]
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, expected_workers: int, timeout_s: float = 60.0) -> None:
        """Until ``/workers`` (or ``/list_workers``) lists every worker healthy, or fail with the log tail."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    break
                try:
                    async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                        if response.status == 200 and await self._workers(session) >= expected_workers:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        tail = self.log_path.read_bytes()[-3000:].decode(errors="replace")
        raise RuntimeError(f"sglang-router not ready (exit {self.process.poll()}):\n{tail}")

    async def _workers(self, session: aiohttp.ClientSession) -> int:
        for path in ("/workers", "/list_workers"):
            try:
                async with session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status != 200:
                        continue
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
                continue
            workers = body.get("workers", body.get("urls", [])) if isinstance(body, dict) else body
            return len(workers) if isinstance(workers, list) else 0
        return 0

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


async def run_sglang(
    urls: list[str], policy: str, episodes: list[list[Turn]], prompt: list[int], run_dir: Path
) -> tuple[float, list[float], int]:
    """sglang-router with one policy, driven through its /generate."""
    router = SglangRouterProcess(urls, policy, run_dir / f"sglang-router-{policy}.log")
    try:
        await router.wait_ready(len(urls))
        client = SGLangClient(router.url, request_timeout_s=3600, control_timeout_s=3600)

        async def generate(turn: Turn, prompt_ids: list[int]) -> None:
            await client.generate(GenerationRequest(tuple(prompt_ids), SamplingParams.from_wire(_sampling(turn))))

        try:
            return await _drive(generate, episodes, prompt)
        finally:
            await client.close()
    finally:
        router.stop()


def table(results: list[RouterResult]) -> str:
    """Makespan and latencies, with each router's makespan over flexmarl's."""
    ours = next((r for r in results if r.router == "flexmarl"), None)
    columns = [
        Column("router", 26, "<"),
        Column("makespan s", 10, fmt=".1f"),
        Column("p50 s", 8, fmt=".1f"),
        Column("p99 s", 8, fmt=".1f"),
        Column("vs flexmarl", 11, fmt=".2f", suffix="x"),
        Column("requests", 8),
        Column("errors", 6),
    ]
    rows = []
    for r in results:
        ratio = r.makespan_s / ours.makespan_s if ours is not None and ours.makespan_s > 0 else math.nan
        rows.append([r.router, r.makespan_s, r.p50_latency_s, r.p99_latency_s, ratio, r.requests, r.errors])
    lines = render_table(columns, rows)
    lines.append("modelled seconds; vs flexmarl = router makespan / flexmarl makespan (> 1: flexmarl faster)")
    return "\n".join(lines)


async def compare(args: argparse.Namespace, run_dir: Path) -> list[RouterResult]:
    """Every router on a fresh fleet each (no state carried between routers)."""
    profile = devicemodel.PRESETS[args.device].with_changes(token_scale=args.token_scale, time_scale=args.time_scale)
    profile_path = run_dir / "device.json"
    profile_path.write_text(profile.to_json())
    model_dir = run_dir / "model"
    model_dir.mkdir(exist_ok=True)
    episodes = make_turns(args.episodes, args.turns, LONG_TAIL_SHAPES[0], args.token_scale, args.seed)
    prompt = [97 + (i % 26) for i in range(max(1, math.ceil(512 / args.token_scale)))]
    routers = ["flexmarl", *(f"sglang-{policy}" for policy in args.sglang_policies)]
    results = []
    for name in routers:
        fleet = SyntheticFleet.start(
            SyntheticEngineConfig(replicas=args.replicas, model_path=str(model_dir), modelled_device=str(profile_path)),
            run_dir / name,
        )
        try:
            if name == "flexmarl":
                wall_s, latencies, errors = await run_flexmarl(fleet.urls, episodes, prompt, str(model_dir))
            else:
                wall_s, latencies, errors = await run_sglang(
                    fleet.urls, name.removeprefix("sglang-"), episodes, prompt, run_dir
                )
        finally:
            fleet.stop()
        scale = profile.time_scale
        result = RouterResult(
            name,
            wall_s / scale,
            percentile(latencies, 50, nearest_rank=True) / scale,
            percentile(latencies, 99, nearest_rank=True) / scale,
            len(latencies),
            errors,
        )
        log.info("%s", result)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    """Runs the comparison; returns 0 when no request failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--sglang-policies", nargs="*", default=["cache_aware", "round_robin", "power_of_two"])
    parser.add_argument("--device", choices=sorted(devicemodel.PRESETS), default="h100")
    parser.add_argument("--token-scale", type=float, default=32.0)
    parser.add_argument("--time-scale", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.environ.pop(devicemodel.PROFILE_ENV, None)  # the fleet gets its profile by flag
    with tempfile.TemporaryDirectory(prefix="flexmarl-router-") as tmp:
        results = asyncio.run(compare(args, Path(tmp)))
    report = table(results)
    print(report)  # noqa: T201 (a CLI report)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "results": [dataclasses.asdict(r) for r in results],
        "table": report,
    }
    (args.out / "router.json").write_text(json.dumps(payload, indent=2))
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
