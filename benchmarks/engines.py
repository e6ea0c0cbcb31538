"""One workload through three paths to an engine: vLLM's own HTTP route, rolloutd's VLLMClient, the embedded engine.

The same tiny untied Qwen2 (``tiny://qwen2?seed=1&tie=0``, fp32) and the same workload (``--prompts``
prompts of 16 random token ids, ``--new-tokens`` new tokens each with ``ignore_eos``, temperature
1.0, request ``i`` seeded ``i``, the sampled tokens' logprobs returned) go through:

* **(a) vllm-openai**: vLLM's OpenAI-compatible ``POST /v1/completions`` (token-id prompt,
  ``seed``, ``logprobs: 0``, ``return_tokens_as_token_ids``) with plain aiohttp: the engine as its
  own users drive it;
* **(b) rolloutd-vllm**: rolloutd's :class:`~rolloutd.engines.vllm.VLLMClient` (the engine
  protocol rolloutd's router uses: ``/inference/v1/generate``) against the *same* vLLM server;
* **(c) rolloutd-embedded**: :class:`~rolloutd.engines.sglang.client.SGLangClient` against the
  embedded engine (one torch thread, seeds honoured: rolloutd's defaults).

Each runs at fixed client concurrencies (``--concurrency``, default 16 and 64; vLLM launched with
``--max-num-seqs`` the largest), ``--repeats`` times, (a) and (b) interleaved so load from other
work hits both alike, after one warm-up round per path. Reported: tokens/s (median over repeats),
p50/p99 request latency (over every request of every repeat), and (b)/(a) beside its target
(>= 0.9, issue 33), with the load average at the start and the end. ``--quick`` runs a small
workload for tests (no figure in it means anything). vLLM comes from ``$FLEXMARL_VLLM_PYTHON``
or ``.venv-vllm`` (``./dev.sh test``).

    python -m benchmarks.engines            # prints the table, writes benchmarks/results/engines.json
    python -m benchmarks.engines --quick --out /tmp/engines.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.report import Column, percentile, render_table
from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, launch
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.sglang.client import SGLangClient
from rolloutd.engines.vllm import VLLMClient

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engines.json"
PROMPT_TOKENS = 16
TARGET_RATIO = 0.9
#: The tests' fast CPU settings (tests/rolloutd/vllm_support.py) with room for the largest concurrency.
VLLM_ARGS = ("--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", "67108864")

#: One request: its index -> the number of tokens generated.
Send = Callable[[int], Awaitable[int]]


@dataclass(frozen=True)
class Workload:
    """The prompts and how much each generates."""

    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int


@dataclass(frozen=True)
class Row:
    """One path at one concurrency, over every repeat."""

    path: str
    concurrency: int
    requests: int
    tokens: int
    tokens_per_s: float
    tokens_per_s_repeats: tuple[float, ...]
    p50_ms: float
    p99_ms: float


def vllm_python() -> str:
    """vLLM's interpreter: $FLEXMARL_VLLM_PYTHON, else the repo's .venv-vllm."""
    return os.environ.get("FLEXMARL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def make_workload(prompts: int, new_tokens: int) -> Workload:
    """``prompts`` prompts of PROMPT_TOKENS byte-token ids, the same every run."""
    rng = random.Random(0)
    return Workload(tuple(tuple(rng.randrange(32, 127) for _ in range(PROMPT_TOKENS)) for _ in range(prompts)),
                    new_tokens)


async def run_round(send: Send, requests: int, concurrency: int) -> tuple[float, int, list[float]]:
    """Sends requests 0..requests-1 with at most ``concurrency`` in flight: (wall s, tokens, latencies s)."""
    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(index: int) -> int:
        async with slots:
            began = time.perf_counter()
            tokens = await send(index)
            latencies.append(time.perf_counter() - began)
            return tokens

    began = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(requests)))
    return time.perf_counter() - began, sum(tokens), latencies


def openai_sender(session: aiohttp.ClientSession, url: str, model: str, workload: Workload) -> Send:
    """(a): vLLM's /v1/completions, as an OpenAI-API user sends it."""

    async def send(index: int) -> int:
        body = {"model": model, "prompt": list(workload.prompts[index]), "max_tokens": workload.new_tokens,
                "temperature": 1.0, "seed": index, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        async with session.post(f"{url}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            answer = await reply.json()
        [choice] = answer["choices"]
        tokens = len(choice["logprobs"]["token_logprobs"])
        if tokens != workload.new_tokens:
            raise RuntimeError(f"vLLM generated {tokens} tokens, asked {workload.new_tokens}")
        return tokens

    return send


def protocol_sender(client: VLLMClient | SGLangClient, workload: Workload) -> Send:
    """(b) and (c): rolloutd's engine protocol (what its router sends)."""

    async def send(index: int) -> int:
        sampling = SamplingParams(max_new_tokens=workload.new_tokens, ignore_eos=True, seed=index)
        [result] = await client.generate(GenerationRequest(workload.prompts[index], sampling))
        if len(result.output_token_logprobs) != workload.new_tokens:
            raise RuntimeError(f"{len(result.output_token_logprobs)} tokens, asked {workload.new_tokens}")
        return result.completion_tokens

    return send


async def measure(senders: dict[str, Send], workload: Workload, concurrencies: Sequence[int],
                  repeats: int) -> list[Row]:
    """Every path at every concurrency, ``repeats`` times, paths interleaved within a repeat."""
    requests = len(workload.prompts)
    for send in senders.values():  # warm-up: connections, the engines' first batches
        await run_round(send, min(requests, max(concurrencies)), max(concurrencies))
    rows: list[Row] = []
    for concurrency in concurrencies:
        rates: dict[str, list[float]] = {path: [] for path in senders}
        latencies: dict[str, list[float]] = {path: [] for path in senders}
        tokens: dict[str, int] = dict.fromkeys(senders, 0)
        for _ in range(repeats):
            for path, send in senders.items():
                wall_s, generated, seen = await run_round(send, requests, concurrency)
                rates[path].append(generated / wall_s)
                latencies[path] += seen
                tokens[path] += generated
        for path in senders:
            rows.append(Row(path, concurrency, requests * repeats, tokens[path], statistics.median(rates[path]),
                            tuple(rates[path]), 1e3 * percentile(latencies[path], 50),
                            1e3 * percentile(latencies[path], 99)))
    return rows


async def bench(args: argparse.Namespace, work_dir: Path) -> list[Row]:
    """Launches the two engines, measures the three paths, stops the engines."""
    model = build_tiny_checkpoint(work_dir / "model", seed=1, tie_word_embeddings=False)
    workload = make_workload(args.prompts, args.new_tokens)
    vllm_spec = ReplicaSpec("vllm", str(model), seed=0, dtype="float32", vllm_python=args.vllm_python,
                            extra_args=(*VLLM_ARGS, "--max-num-seqs", str(max(args.concurrency))))
    embedded_spec = ReplicaSpec("embedded", str(model), seed=0, deterministic_inference=True)
    replicas: list[EngineReplica] = []
    try:
        replicas.append(await launch(vllm_spec, work_dir / "vllm", timeout_s=300, name="vllm"))
        replicas.append(await launch(embedded_spec, work_dir / "embedded", timeout_s=120, name="embedded"))
        vllm_url, embedded_url = replicas[0].url, replicas[1].url
        timeout = aiohttp.ClientTimeout(total=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session, \
                VLLMClient(vllm_url, max_concurrent_generations=max(args.concurrency)) as vllm_client, \
                SGLangClient(embedded_url) as embedded_client:
            vllm_rows = await measure({"(a) vllm-openai": openai_sender(session, vllm_url, str(model), workload),
                                       "(b) rolloutd-vllm": protocol_sender(vllm_client, workload)},
                                      workload, args.concurrency, args.repeats)
            embedded_rows = await measure({"(c) rolloutd-embedded": protocol_sender(embedded_client, workload)},
                                          workload, args.concurrency, args.repeats)
    finally:
        for replica in replicas:
            replica.stop(grace_s=10)
    return vllm_rows + embedded_rows


def ratios(rows: Sequence[Row]) -> dict[int, float]:
    """(b)/(a) in tokens/s per concurrency."""
    rate = {(row.path[:3], row.concurrency): row.tokens_per_s for row in rows}
    return {c: rate[("(b)", c)] / rate[("(a)", c)] for (p, c) in rate if p == "(a)"}


def render(rows: Sequence[Row], report: dict[str, Any]) -> str:
    """The table, the ratio against its target, and the load."""
    columns = [Column("path", 22, "<"), Column("conc", 4), Column("requests", 8), Column("tokens/s", 9, fmt=".0f"),
               Column("p50 ms", 8, fmt=".0f"), Column("p99 ms", 8, fmt=".0f"), Column("each repeat", 0, "<")]
    lines = render_table(columns, [(r.path, r.concurrency, r.requests, r.tokens_per_s, r.p50_ms, r.p99_ms,
                                    " ".join(f"{x:.0f}" for x in r.tokens_per_s_repeats)) for r in rows], sep="  ")
    for concurrency, ratio in report["ratio_b_over_a"].items():
        verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
        lines.append(f"(b)/(a) at concurrency {concurrency}: {ratio:.2f} (target >= {TARGET_RATIO}: {verdict})")
    start, end = report["load_avg_at_start"], report["load_avg_at_end"]
    lines.append(f"load average (1/5/15 min) at start {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f}, "
                 f"at end {end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f}; {os.cpu_count()} CPUs")
    return "\n".join(lines)


def main() -> None:
    """Parses flags, runs the benchmark, prints the table and writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="requests per round")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="client concurrencies")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per path and concurrency")
    parser.add_argument("--quick", action="store_true", help="8 prompts x 8 tokens, concurrency 4 and 8, 1 repeat")
    parser.add_argument("--vllm-python", default=vllm_python(), help="vLLM's interpreter")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON report")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.concurrency, args.repeats = 8, 8, [4, 8], 1
    if not os.access(args.vllm_python, os.X_OK):
        sys.exit(f"vLLM is not installed at {args.vllm_python} (./dev.sh test installs it into .venv-vllm)")
    load_at_start = os.getloadavg()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flexmarl-engines-bench-") as tmp:
        rows = asyncio.run(bench(args, Path(tmp)))
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.engines", *sys.argv[1:]]),
        "model": "tiny://qwen2?seed=1&tie=0 (fp32)", "prompts": args.prompts, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens, "concurrency": args.concurrency, "repeats": args.repeats,
        "vllm_args": [*VLLM_ARGS, "--max-num-seqs", str(max(args.concurrency))],
        "rows": [asdict(row) for row in rows], "ratio_b_over_a": ratios(rows), "target_ratio": TARGET_RATIO,
        "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg(), "cpus": os.cpu_count(),
        "wall_s": time.monotonic() - began,
    }
    print(render(rows, report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
