"""Checks of a partial-rollout job on a local cluster: interruptions happened, spans are consistent.

Shared by tests/e2e/test_partial_e2e.py, benchmarks/partial_learning.py and ``benchmarks.chaos
--partial``. Interruptions are counted from rolloutd's log (rolloutd/router.py logs one line per
replica interrupted, naming the agent key ``<job>/<agent>``); spans are read back from stored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Any

from flexmarl.experience import ExperienceRecord
from flexmarl.store_client import StoreClient

#: rolloutd/router.py's line for a finished interruption: "replica R interrupted (MODE) to serve KEY vN (S s)".
INTERRUPTED = re.compile(r"replica (\S+) interrupted \((\w+)\) to serve (\S+) v(\d+)")
#: rolloutd/router.py's line for an interruption that starts (logged right before /pause_generation).
PAUSING = re.compile(r"replica (\S+) pausing \((\w+)\) to serve (\S+) v(\d+)")


def partial_spec(raw: dict[str, Any], *, max_staleness: int = 1, partial: bool = True) -> dict[str, Any]:
    """``raw`` with ``pipeline.max_staleness`` set and ``rollout.partial_rollout`` on (or off)."""
    spec = dict(raw)
    spec["pipeline"] = {**raw.get("pipeline", {}), "mode": "async", "max_staleness": max_staleness}
    spec["rollout"] = {**raw.get("rollout", {}), "partial_rollout": partial}
    return spec


def interruptions(log_paths: list[Path], job_id: str) -> dict[str, int]:
    """Agent -> replicas interrupted for the job's versions, from rolloutd logs."""
    counts: dict[str, int] = {}
    for path in log_paths:
        if not path.exists():
            continue
        for match in INTERRUPTED.finditer(path.read_text(errors="replace")):
            job, _, agent = match.group(3).rpartition("/")
            if job == job_id:
                counts[agent] = counts.get(agent, 0) + 1
    return counts


@dataclasses.dataclass
class SpanSummary:
    """What the consumed experiences of one agent say about their version spans."""

    experiences: int = 0
    multi_span: int = 0
    max_spans: int = 0
    tokens: int = 0
    tokens_newer_than_behaviour: int = 0


def read_records(store_address: str, job_id: str, ids: list[str]) -> list[ExperienceRecord]:
    """The experiences ``ids`` of the job, read back from stored."""

    async def read() -> list[ExperienceRecord]:
        async with StoreClient(store_address) as store:
            return await store.read(job_id, ids)

    return asyncio.run(read())


def check_spans(records: list[ExperienceRecord], step: int, max_staleness: int, summary: SpanSummary) -> None:
    """Every record of a step's manifest has consistent spans and behaviour versions; adds it to summary.

    A record trained at step ``s`` holds tokens of versions in ``[s - max_staleness, s]`` (version
    ``s + 1`` is this step's own result), its ``behavior_version`` is its oldest token's, its spans
    start at 0 with strictly increasing starts and versions inside the response, and it has one
    behaviour logprob per token.
    """
    for record in records:
        where = f"{record.experience_id} (step {step})"
        spans = [(int(a), int(b)) for a, b in record.response_version_spans.tolist()]
        versions = record.token_versions().tolist()
        assert record.response_logprobs.shape[0] == record.response_tokens, f"{where}: one logprob per token"
        if spans:
            starts = [s for s, _ in spans]
            span_versions = [v for _, v in spans]
            assert starts[0] == 0, f"{where}: spans {spans} do not start at token 0"
            assert all(a < b for a, b in zip(starts, starts[1:], strict=False)), f"{where}: spans {spans}"
            assert all(a < b for a, b in zip(span_versions, span_versions[1:], strict=False)), f"{where}: {spans}"
            assert starts[-1] < record.response_tokens, f"{where}: spans {spans} past {record.response_tokens}"
            assert span_versions[0] == record.behavior_version, f"{where}: behaviour version is not the oldest"
        if versions:
            assert min(versions) == record.behavior_version, f"{where}: behaviour version is not the oldest"
            assert step - max_staleness <= min(versions) and max(versions) <= step, (
                f"{where}: token versions {sorted(set(versions))} outside [{step - max_staleness}, {step}]")
        summary.experiences += 1
        summary.multi_span += len(spans) > 1
        summary.max_spans = max(summary.max_spans, len(spans) or 1)
        summary.tokens += record.response_tokens
        summary.tokens_newer_than_behaviour += sum(v > record.behavior_version for v in versions)


def span_summaries(manifests: dict[str, dict[int, dict[str, Any]]], store_address: str, job_id: str,
                   max_staleness: int) -> dict[str, SpanSummary]:
    """Agent -> SpanSummary over every step's manifest (``manifests``: agent -> step -> manifest JSON)."""
    out: dict[str, SpanSummary] = {}
    for agent, steps in manifests.items():
        summary = out.setdefault(agent, SpanSummary())
        for step, manifest in sorted(steps.items()):
            records = read_records(store_address, job_id, list(manifest["experience_ids"]))
            assert len(records) == len(manifest["experience_ids"]), f"{agent} step {step}: records missing"
            check_spans(records, step, max_staleness, summary)
    return out
