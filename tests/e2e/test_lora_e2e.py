"""LoRA agents end to end: two adapters of one tiny base and one full-model agent in one job.

One cluster of its own (its replica starts with the job's LoRA flags; rolloutd fixes an engine's
flags at its first job, so the session cluster's replica, launched for full models, cannot serve
adapters): one traind slot, one engine replica that the base's pool and the full-model agent take
turns on. The mixed job runs to completion, its base stays bit-identical on disk, its versions are
PEFT adapter directories, and the logprobs the replica served with each adapter version (recorded
in the experiences) equal a PEFT forward pass with that adapter. Then the same LoRA job in sync and
in strict async mode ends with equal adapters, bit for bit.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from e2e_support import E2ECluster, assert_succeeded, running_cluster, weights_dir
from lora_support import MIXED_STEPS, mixed_spec, peft_logprobs

from flexmarl.artifacts import checkpoint_tensors

BASE = "tiny://qwen2?seed=1"
STEPS = MIXED_STEPS


@pytest.fixture(scope="module")
def lora_cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[E2ECluster]:
    with running_cluster(tmp_path_factory.mktemp("lora"), models_dir, trainer_workers=1, trainer_slots=1,
                         engine_replicas=1) as e2e:
        yield e2e


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def _final(e2e: E2ECluster, job_id: str) -> dict[str, dict[str, torch.Tensor]]:
    info = e2e.wait_job(job_id)
    assert_succeeded(e2e, info, STEPS)
    return {a.agent: checkpoint_tensors(weights_dir(a.weights_uri)) for a in info.agents}


@pytest.mark.timeout(500)
def test_a_mixed_job_trains_adapters_over_an_untouched_base_and_async_equals_sync(lora_cluster: E2ECluster) -> None:
    e2e = lora_cluster
    spec = mixed_spec(e2e.models_dir, BASE, "lora-mixed")
    base = Path(spec["agents"][0]["model"])
    before = _digest(base)
    job_id = e2e.client.submit(copy.deepcopy(spec), job_id="lora-mixed")  # strict async (max_staleness 0)
    info = e2e.wait_job(job_id)
    assert_succeeded(e2e, info, STEPS)
    assert _digest(base) == before, "the base checkpoint changed on disk"

    published = {a.agent: weights_dir(a.weights_uri) for a in info.agents}
    for agent in ("sender0", "receiver0"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(_digest(published[agent])), agent
    observer = checkpoint_tensors(published["observer"])
    initial = checkpoint_tensors(base)
    assert any(not torch.equal(observer[k], initial[k]) for k in initial if k in observer), "observer untrained"

    # Served logprobs equal PEFT's forward with the adapter version that served them (v0: the base alone).
    for agent in ("sender0", "receiver0"):
        commits = e2e.commits(job_id, agent)
        adapters = {0: None, **{step + 1: weights_dir(c["weights_uri"]) for step, c in commits.items()}}
        records = e2e.stored_experiences(job_id, agent)
        versions = {r.behavior_version for r in records}
        assert versions >= {0, 1}, f"{agent}: experiences only of versions {versions}"
        for version in sorted(versions):
            record = next(r for r in records if r.behavior_version == version)
            expected = peft_logprobs(base, adapters[version], record)
            assert record.response_logprobs.tolist() == pytest.approx(expected, abs=1e-4), f"{agent} v{version}"
            if version > 0:  # not vacuous: the adapter changes what the base alone would give
                base_alone = peft_logprobs(base, None, record)
                assert max(abs(x - y) for x, y in zip(expected, base_alone, strict=True)) > 1e-3, agent

    # A pinned on-demand round on kept versions: an older adapter, a LoRA agent's v0 (the base alone), the full model.
    asked = {"sender0": 1, "receiver0": 0, "observer": 2}
    record = e2e.client.wait_evaluation(job_id, e2e.client.evaluate(job_id, agent_versions=asked, tasks=2),
                                        timeout_s=120)
    assert record.on_demand and record.tasks == 2 and not record.failed_tasks, record
    assert {a.agent: (a.version, a.versions_seen) for a in record.agents} == {
        agent: (version, (version,)) for agent, version in asked.items()}
    after = {a.agent: (a.version, a.weights_uri) for a in e2e.client.status(job_id).agents}
    assert after == {a.agent: (a.version, a.weights_uri) for a in info.agents}  # the round moved no agent's version

    # The same job in sync mode trains the same adapters and the same full model, bit for bit.
    async_ = {a.agent: checkpoint_tensors(published[a.agent]) for a in info.agents}
    e2e.client.submit(dict(spec, pipeline={"mode": "sync"}), job_id="lora-mixed-sync")
    sync = _final(e2e, "lora-mixed-sync")
    assert sync.keys() == async_.keys() == {"sender0", "receiver0", "observer"}
    for agent, expected in sync.items():
        assert expected.keys() == async_[agent].keys(), agent
        unequal = [t for t in expected if not torch.equal(expected[t], async_[agent][t])]
        assert not unequal, f"{agent}: sync and async differ in {unequal}"
    for agent in ("sender0", "receiver0"):  # not vacuous: the adapters trained (PEFT starts B at 0)
        assert any(bool(t.abs().sum() > 0) for n, t in sync[agent].items() if "lora_B" in n), agent
