"""The parts of one generation request: seeded samples split into requests, their results joined.

Pure helpers of :class:`rolloutd.router.RolloutRouter`: a seeded ``n > 1`` request becomes one
request per sample (engines seed a request, not its samples), the parts run concurrently on one
replica, an interrupted sample's head and resumed tail are joined, and the engine's
``weight_versions`` become the router's ``(start, version)`` spans.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from flexmarl.episode import GenerationOutput
from flexmarl.errors import Unavailable
from rolloutd.engines.protocol import EngineClient, GenerationRequest, GenerationResult, SamplingParams


def engine_spans(result: GenerationResult) -> tuple[tuple[int, int], ...]:
    """``(start, version)`` spans of a result's tokens from its ``weight_versions``; () when unusable.

    The router names every version it loads by its number, so the spans' versions parse as ints;
    spans that do not (an engine that reports none, or other names) leave the router's own record.
    """
    spans: list[tuple[int, int]] = []
    for span in result.weight_versions:
        if span.end <= span.start:
            continue
        try:
            version = int(span.version)
        except ValueError:
            return ()
        if spans and version == spans[-1][1]:
            continue
        if spans and version < spans[-1][1]:
            return ()
        spans.append((span.start, version))
    if not spans or spans[0][0] != 0:
        return ()
    return tuple(spans)


def joined_output(head: GenerationOutput, tail: GenerationOutput) -> GenerationOutput:
    """A sample interrupted after ``head`` and resumed as ``tail``: tokens, logprobs and spans concatenated."""
    offset = len(head.token_ids)
    spans: list[tuple[int, int]] = list(head.version_spans or ((0, head.version),)) if head.token_ids else []
    for start, version in (tail.version_spans or ((0, tail.version),)) if tail.token_ids else ():
        if not spans or spans[-1][1] != version:
            spans.append((start + offset, version))
    return GenerationOutput(
        token_ids=head.token_ids + tail.token_ids, logprobs=head.logprobs + tail.logprobs,
        finish_reason=tail.finish_reason, version=spans[0][1] if spans else tail.version,
        version_spans=tuple(spans) if len(spans) > 1 else (),
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


def sample_parts(params: SamplingParams) -> list[SamplingParams]:
    """The requests that produce ``params.n`` samples: one per sample when seeded, else one."""
    if params.seed is None or params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=params.seed + index) for index in range(params.n)]


async def run_parts(
    client: EngineClient, input_ids: Sequence[int], parts: Sequence[SamplingParams], top_logprobs_num: int = 0,
    lora_path: str | None = None,
) -> list[list[GenerationResult] | Unavailable]:
    """Sends the parts concurrently; each outcome is its results or the Unavailable it met.

    ``lora_path`` names the adapter loaded on the replica that serves them (None: the model itself).

    Any other error cancels the parts still running and propagates. Every part has ended when
    this returns or raises, so none outlives the replica's read lock.
    """

    async def one(part: SamplingParams) -> list[GenerationResult] | Unavailable:
        try:
            return await client.generate(GenerationRequest(input_ids=tuple(input_ids), sampling=part,
                                                           top_logprobs_num=top_logprobs_num, lora_path=lora_path))
        except Unavailable as exc:
            return exc

    if len(parts) == 1:
        return [await one(parts[0])]
    tasks = [asyncio.ensure_future(one(part)) for part in parts]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
