from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.jobspec import JobSpec, JobSpecCache, load_job_spec, parse_job_spec

from .helpers import spec_dict

GOOD_YAML = """
name: signaling
seed: 0
environment: {entrypoint: "examples.signaling.env:SignalingGame", config: {}}
agents:
  - name: sender
    model: /abs/path/to/hf-checkpoint
    sampling: {temperature: 1.0, top_p: 1.0, top_k: -1, max_new_tokens: 8, stop_token_ids: []}
    optimizer: {name: adamw, lr: 1e-3, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 0.0, grad_clip: 1.0}
    zero_stage: 0
    dtype: fp32
    max_slots: 1
algorithm: {name: grpo, clip_eps: 0.2, kl_coef: 0.0, loss_agg: token-mean, advantage_norm: std}
batch: {prompts_per_step: 8, group_size: 4, micro_batch_size: 8}
total_steps: 20
pipeline: {mode: async, max_staleness: 0}
leases: {rollout_timeout_s: 60, train_timeout_s: 120}
"""


def test_good_spec_from_yaml_text_file_and_json(tmp_path: Path) -> None:
    spec = load_job_spec(GOOD_YAML)
    assert spec.agents[0].optimizer.lr == pytest.approx(1e-3)  # YAML 1.2 float, not the string "1e-3"
    assert spec.batch.episodes_per_step == 32 and spec.batch.groups_per_micro_batch == 2
    path = tmp_path / "job.yaml"
    path.write_text(GOOD_YAML)
    assert load_job_spec(path) == spec and load_job_spec(str(path)) == spec
    text = spec.to_json()
    assert load_job_spec(text) == spec and json.loads(text)["batch"]["group_size"] == 4
    assert spec.to_json() == load_job_spec(text).to_json()  # canonical


def test_defaults_fill_in() -> None:
    spec = parse_job_spec(spec_dict())
    assert spec.pipeline.mode == "async" and spec.agents[0].zero_stage == 0 and spec.agents[0].dtype == "fp32"


def mutate(path: str, value: Any) -> dict[str, Any]:
    data = spec_dict()
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


DELETE = object()


def _field_id(path: str, value: object) -> str:
    """A parameter id that is the same at every collection (pytest-xdist compares them)."""
    return f"{path}=<deleted>" if value is DELETE else f"{path}={value!r}"

BAD_FIELDS = [
    ("batch.micro_batch_size", 5, "batch.micro_batch_size: must be a multiple of batch.group_size (2), got 5"),
    ("batch.micro_batch_size", 10,
     "batch.micro_batch_size: must be <= batch.prompts_per_step * batch.group_size (8), got 10"),
    ("batch.group_size", 1, "batch.group_size: must be >= 2 for algorithm grpo"),
    ("batch.group_size", "4", "batch.group_size: must be an integer, got '4'"),
    ("batch.prompts_per_step", 0, "batch.prompts_per_step: must be >= 1, got 0"),
    ("pipeline.max_staleness", -1, "pipeline.max_staleness: must be >= 0, got -1"),
    ("pipeline.mode", "eager", "pipeline.mode: must be one of 'async', 'sync', 'sequential' or 'static', got 'eager'"),
    ("agents.0.optimizer", {"lr": 0}, "agents[0].optimizer.lr: must be > 0.0, got 0"),
    ("agents.0.zero_stage", 4, "agents[0].zero_stage: must be <= 3, got 4"),
    ("agents.0.dtype", "fp16", "agents[0].dtype: must be one of 'fp32' or 'bf16', got 'fp16'"),
    ("agents.0.name", "Sender", "agents[0].name: must match ^[a-z][a-z0-9_-]{0,31}$, got 'Sender'"),
    ("agents.1.name", "sender", "agents[1].name: duplicate agent name 'sender' (also agents[0])"),
    ("agents.0.model", "", "agents[0].model: must not be empty"),
    ("agents.0.sampling", {"top_k": 0}, "agents[0].sampling.top_k: must be -1 (off) or >= 1, got 0"),
    ("agents.0.sampling", {"top_p": 0.0}, "agents[0].sampling.top_p: must be > 0.0, got 0.0"),
    ("agents.0.optimizer", {"betas": [0.9]}, "agents[0].optimizer.betas: must have at least 2 item(s), got 1"),
    ("agents", [], "agents: must have at least 1 item(s), got 0"),
    ("environment.entrypoint", "examples.env",
     "environment.entrypoint: must have the form 'package.module:attr', got 'examples.env'"),
    ("environment.extra", 1, "environment.extra: unknown field"),
    ("total_steps", DELETE, "total_steps: required field missing"),
    ("total_steps", True, "total_steps: must be an integer, got True"),
    ("algorithm.name", "dpo", "algorithm.name: must be one of 'grpo' or 'ppo', got 'dpo'"),
    ("algorithm.loss_agg", "sum", "algorithm.loss_agg: must be one of 'token-mean' or 'seq-mean', got 'sum'"),
    ("algorithm.proximal_policy", "current",
     "algorithm.proximal_policy: must be one of 'behaviour' or 'trainer', got 'current'"),
    ("algorithm.behaviour_weight_cap", 1.0, "algorithm.behaviour_weight_cap: must be > 1.0, got 1.0"),
    ("leases.rollout_timeout_s", 0, "leases.rollout_timeout_s: must be > 0.0, got 0"),
    ("name", "has space", "name: must match"),
    ("seed", -1, "seed: must be >= 0, got -1"),
    ("unknown_top", 1, "unknown_top: unknown field"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_FIELDS, ids=[_field_id(p, v) for p, v, _ in BAD_FIELDS])
def test_each_bad_field_has_a_precise_message(path: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        parse_job_spec(mutate(path, value))
    lines = str(raised.value).splitlines()
    assert any(line.startswith(message) for line in lines), lines


def test_every_problem_gets_its_own_line() -> None:
    data = spec_dict()
    data["agents"][0]["zero_stage"] = 9
    data["pipeline"]["max_staleness"] = -2
    data["bogus"] = True
    with pytest.raises(InvalidArgument) as raised:
        parse_job_spec(data)
    assert sorted(str(raised.value).splitlines()) == [
        "agents[0].zero_stage: must be <= 3, got 9",
        "bogus: unknown field",
        "pipeline.max_staleness: must be >= 0, got -2",
    ]


def test_ppo_allows_group_size_one() -> None:
    spec = parse_job_spec(spec_dict(algorithm={"name": "ppo"}, batch={"prompts_per_step": 4, "group_size": 1,
                                                                      "micro_batch_size": 2}))
    assert isinstance(spec, JobSpec)


@pytest.mark.parametrize("text", ["a: [", "- 1", "42", ""])
def test_unparsable_or_non_mapping(text: str) -> None:
    with pytest.raises(InvalidArgument, match="job spec"):
        load_job_spec(text)


def test_missing_file_is_read_as_text() -> None:
    with pytest.raises(InvalidArgument):
        load_job_spec("/no/such/file.yaml")
    assert yaml.safe_load(GOOD_YAML)["name"] == "signaling"


def test_spec_cache_fetches_once_per_job_and_checks_the_digest() -> None:
    spec = parse_job_spec(spec_dict())
    fetched: list[str] = []
    served = {"job-a": spec.to_json(), "job-b": spec.to_json().replace('"seed":0', '"seed":7')}

    async def fetch(job_id: str) -> str:
        fetched.append(job_id)
        return served[job_id]

    async def run() -> None:
        cache = JobSpecCache(fetch)
        got = await asyncio.gather(*(cache.get("job-a", spec.digest()) for _ in range(5)))
        assert all(g == spec for g in got) and fetched == ["job-a"]
        with pytest.raises(FailedPrecondition, match="digest"):
            await cache.get("job-b", spec.digest())  # job-b's spec is another one
        with pytest.raises(InvalidArgument, match="no spec digest"):
            await cache.get("job-a", "")
        cache.forget("job-a")
        await cache.get("job-a", spec.digest())
        assert fetched == ["job-a", "job-b", "job-a"]

    asyncio.run(run())


def test_checkpoint_policy_keeps_the_last_versions_every_mth_and_never_the_latest() -> None:
    from flexmarl.jobspec import CheckpointSpec

    default = parse_job_spec(spec_dict()).checkpoint
    assert (default.keep_last, default.keep_every, default.keep_states) == (3, 0, 1)
    assert [v for v in range(11) if default.keeps_weights(v, 10)] == [0, 8, 9, 10]  # v0 is the spec's model
    assert [v for v in range(11) if default.keeps_state(v, 10)] == [10]
    policy = CheckpointSpec(keep_last=1, keep_every=4, keep_states=2)
    assert [v for v in range(11) if policy.keeps_weights(v, 10)] == [0, 4, 8, 10]
    assert [v for v in range(11) if policy.keeps_state(v, 10)] == [4, 8, 9, 10]  # kept-every ones resumable
    assert "every 4th" in policy.describe()
    with pytest.raises(InvalidArgument, match="checkpoint.keep_last"):
        parse_job_spec(spec_dict(checkpoint={"keep_last": 0}))
