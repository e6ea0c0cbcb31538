"""Resume from checkpoint manifests: which versions, which specs are refused, and the job created at them.

The manifests are real files in a directory (a ``file://`` resume source, as traind writes them);
the stored:// source and the whole path through the daemons are in tests/e2e/test_resume.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flexmarl.checkpoints import CheckpointManifest, ResumeSource, manifest_blob_name, manifest_path
from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec, spec_digest
from flexmarl.store_client import StoreClient
from orchestratord.planner import Planner, PlannerOptions
from orchestratord.resume import plan_resume
from orchestratord.state import InMemoryStateStore, apply_changes
from tests.stored_support import inprocess_stored

from .helpers import FakeClock, experiences_for, make_spec

SIGNATURE = {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2, "vocab_size": 259}


def _write(work_dir: Path, spec: JobSpec, agent: str, version: int, state_scheme: str = "file") -> None:
    state = f"file:///ckpt/states/src/{agent}/v{version}" if state_scheme == "file" else f"mem://w/src/{agent}"
    manifest = CheckpointManifest(
        job_id="src", agent=agent, version=version, weights_uri=f"file:///ckpt/weights/src/{agent}/v{version}",
        state_uri=state, spec_digest=spec_digest(spec.to_json()), spec_json=spec.to_json(),
        model_signature=SIGNATURE)
    path = manifest_path(work_dir, "src", agent, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest.to_json())


async def _no_store() -> StoreClient:
    raise AssertionError("a file:// source never needs stored")


def _plan(work_dir: Path, spec: JobSpec | None) -> dict[str, int]:
    source = "file://" + str(work_dir / "checkpoints" / "src")
    plan = asyncio.run(plan_resume(source, spec, _no_store))
    return {agent: m.version for agent, m in plan.checkpoints.items()}


def test_the_newest_version_every_agent_retains_is_chosen(tmp_path: Path) -> None:
    spec = make_spec(total_steps=5)
    for agent, versions in (("sender", (2, 3, 4)), ("receiver", (2, 3))):
        for v in versions:
            _write(tmp_path, spec, agent, v)
    assert _plan(tmp_path, None) == {"sender": 3, "receiver": 3}
    (manifest_path(tmp_path, "src", "receiver", 3)).unlink()
    (manifest_path(tmp_path, "src", "receiver", 2)).unlink()
    _write(tmp_path, spec, "receiver", 1)  # no common version left: each agent's newest
    assert _plan(tmp_path, None) == {"sender": 4, "receiver": 1}


def test_incompatible_sources_and_specs_are_refused_in_one_line(tmp_path: Path) -> None:
    spec = make_spec(total_steps=3)
    for agent in ("sender", "receiver"):
        _write(tmp_path, spec, agent, 2)
    model = tmp_path / "other-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**SIGNATURE, "hidden_size": 512}))
    same_shapes = tmp_path / "same-shapes"
    same_shapes.mkdir()
    (same_shapes / "config.json").write_text(json.dumps(SIGNATURE))
    cases = [
        (make_spec(agents=[{"name": "sender", "model": "/models/tiny"}]), "agents differ"),
        (make_spec(agents=[{"name": "sender", "model": str(model)}, {"name": "receiver", "model": "/models/tiny"}]),
         "model shapes differ from the checkpoint's \\(hidden_size\\)"),
        (make_spec(agents=[{"name": "sender", "model": "/nowhere"}, {"name": "receiver", "model": "/models/tiny"}]),
         "not readable here"),
        (make_spec(total_steps=2), "nothing left to train"),
    ]
    for bad, words in cases:
        with pytest.raises(InvalidArgument, match=words) as refused:
            _plan(tmp_path, bad)
        assert "\n" not in str(refused.value)
    renamed = make_spec(agents=[{"name": "sender", "model": str(same_shapes)}, {"name": "receiver",
                                                                                "model": "/models/tiny"}])
    assert _plan(tmp_path, renamed) == {"sender": 2, "receiver": 2}  # another path, the same shapes
    with pytest.raises(InvalidArgument, match="no such directory"):
        _plan(tmp_path / "gone", None)
    (manifest_path(tmp_path, "src", "sender", 2)).write_text("{}")
    with pytest.raises(InvalidArgument, match="not a checkpoint manifest"):
        _plan(tmp_path, None)
    _write(tmp_path, spec, "sender", 2, state_scheme="mem")
    with pytest.raises(InvalidArgument, match="not durable"):
        _plan(tmp_path, None)


async def test_a_stored_source_is_read_from_its_manifest_blobs(tmp_path: Path) -> None:
    async with inprocess_stored(tmp_path / "data") as (_, client, _):
        spec = make_spec(total_steps=4)
        for agent in ("sender", "receiver"):
            for version in (1, 2):
                _write(tmp_path, spec, agent, version)
                text = manifest_path(tmp_path, "src", agent, version).read_bytes()
                await client.put_blob_bytes(manifest_blob_name("src", agent, version), text, job_id="src")
        await client.put_blob_bytes(manifest_blob_name("src-2", "sender", 9), b"{}", job_id="src-2")  # another job

        async def store() -> StoreClient:
            return client

        plan = await plan_resume("src", None, store)  # a bare job id: its checkpoints in stored
        assert {a: m.version for a, m in plan.checkpoints.items()} == {"sender": 2, "receiver": 2}
        with pytest.raises(InvalidArgument, match="no retained checkpoint"):
            await plan_resume("stored://checkpoints/gone", None, store)


def test_resume_source_forms() -> None:
    assert ResumeSource.parse("job-1") == ResumeSource("stored", "job-1", "checkpoints/job-1/")
    assert str(ResumeSource.parse("stored://checkpoints/job-1")) == "stored://checkpoints/job-1"
    assert ResumeSource.parse("file:///w/checkpoints/job-1") == ResumeSource("file", "job-1", "/w/checkpoints/job-1")
    for bad in ("stored://weights/job-1", "file://relative", "s3://b/k", "a/b"):
        with pytest.raises(InvalidArgument):
            ResumeSource.parse(bad)


def test_a_job_created_at_initial_versions_starts_at_their_batch_and_commits_on(tmp_path: Path) -> None:
    _write(tmp_path, make_spec(), "sender", 2)
    _write(tmp_path, make_spec(), "receiver", 2)
    plan = asyncio.run(plan_resume("file://" + str(tmp_path / "checkpoints" / "src"), None, _no_store))
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e0"))
    job = planner.submit_job("resumed", plan.spec, plan.initial_versions())
    assert [(v.agent, v.version) for v in job.versions()] == [("sender", 2), ("receiver", 2)]
    leases = planner.lease_rollout_tasks("roll-0", 8)
    assert {lease.batch_index for lease in leases} == {2}  # batch 2 = step 2: the source's next
    assert all(v.version == 2 and v.weights_uri.endswith("/v2") for lease in leases for v in lease.agent_versions)
    store = InMemoryStateStore()
    asyncio.run(apply_changes(store, planner.take_changes()))
    persisted = asyncio.run(store.load_job("resumed"))
    assert persisted is not None
    assert {a: (r.version, r.state_uri) for a, r in persisted.agents.items()} == {
        a: (2, f"file:///ckpt/states/src/{a}/v2") for a in ("sender", "receiver")}
    for lease in leases:
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                    experiences_for(lease, ("sender", "receiver")))
    work = planner.poll_trainer_work("train-0", "train-0/slot0", [])
    assert work is not None and work.step == 2 and work.state_uri == f"file:///ckpt/states/src/{work.agent}/v2"
