"""A job resumed from the checkpoints of an earlier one: read its manifests, pick the versions, check the spec.

Reads only the self-describing manifests (:mod:`flexmarl.checkpoints`) from stored or a path,
never etcd: the earlier job's cluster may be gone. The resumed job gets a new id and starts
with each agent at the chosen checkpoint (weights and full state of the earlier job), so its
first step is the earlier job's next one. Sampling seeds do not depend on the job id
(``rolloutd.job_backend.request_seed``), and task ids only prefix it, so in strict mode
(``max_staleness: 0``) that step trains exactly what the earlier job would have.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from flexmarl.checkpoints import (
    CheckpointManifest,
    ResumeSource,
    check_resumable,
    parse_manifests,
    resume_point,
)
from flexmarl.errors import FlexmarlError, InvalidArgument
from flexmarl.jobspec import JobSpec
from flexmarl.store_client import StoreClient
from orchestratord.planner import is_durable_state
from orchestratord.state import AgentVersionRecord


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a resumed job starts from."""

    source: ResumeSource
    spec: JobSpec
    checkpoints: dict[str, CheckpointManifest]

    def initial_versions(self) -> dict[str, AgentVersionRecord]:
        """Each agent's first record in the new job (the checkpoint's version, weights and state)."""
        return {agent: AgentVersionRecord(m.version, m.weights_uri, m.state_uri)
                for agent, m in self.checkpoints.items()}

    def describe(self) -> str:
        """For the log: where each agent continues from."""
        return ", ".join(f"{a} v{m.version}" for a, m in sorted(self.checkpoints.items()))


async def read_manifests(source: ResumeSource, store: Callable[[], Awaitable[StoreClient]]) -> list[CheckpointManifest]:
    """Every manifest of the source (stored blobs or files under a directory).

    Raises:
        InvalidArgument: the source is unreadable or holds something that is not a manifest.
    """
    if source.kind == "file":
        return parse_manifests(await asyncio.to_thread(source.read_files))
    try:
        client = await store()
        blobs = await client.list_blobs(source.location)
        files = [(f"stored://{b.name}", (await client.get_blob_bytes(b.name)).decode()) for b in blobs
                 if b.name.endswith(".json")]
    except FlexmarlError as exc:
        raise InvalidArgument(f"resume source {source}: cannot read it from stored: {exc}") from None
    return parse_manifests(files)


async def plan_resume(resume_from: str, spec: JobSpec | None,
                      store: Callable[[], Awaitable[StoreClient]]) -> ResumePlan:
    """The checkpoints a resumed job starts from, checked against its spec (the earlier job's when None).

    Raises:
        InvalidArgument: one line, before anything is created: a bad source, no checkpoint,
            another set of agents, other model shapes, no step left, a state no node can read.
    """
    source = ResumeSource.parse(resume_from)
    point = resume_point(source, await read_manifests(source, store))
    if spec is not None:
        chosen = spec
    else:  # the earlier job's spec: nothing checked its environment code now, so nothing is compared
        earlier = next(iter(point.values())).spec()
        chosen = earlier.model_copy(update={"environment": earlier.environment.model_copy(
            update={"code_digest": ""})})
    check_resumable(source, point, chosen)
    for agent, manifest in point.items():
        if not is_durable_state(manifest.state_uri):
            raise InvalidArgument(f"resume source {source}: agent {agent}: state {manifest.state_uri!r} is not "
                                  f"durable (file:// or stored://)")
    return ResumePlan(source, chosen, point)
