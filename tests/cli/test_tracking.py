"""Experiment trackers and sample dumps (docs/tracking.md): orchestratord's coordinator writes each committed
step to the job's trackers; `flexmarl samples` reads a step's episodes back from stored as text.

Domain-level: a real coordinator (in-memory state) driven through a whole job, a real in-process stored,
the tiny byte-level tokenizer and TensorBoard's own event reader.
"""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import types
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from cli_support import EXAMPLE_JOB
from prometheus_client import CollectorRegistry

from flexmarl.experience import ExperienceRecord, ExperienceState, ExperienceSummary
from flexmarl.ids import StepRef
from flexmarl.jobspec import parse_job_spec
from flexmarl.preflight import preflight_problems
from flexmarl.samples import TokenizerCache, read_step_samples
from flexmarl.store_client import StoreClient
from flexmarl.tiny import build_tiny_tokenizer
from flexmarl.tracking import JobTrackers, StepFigures, StepTracking
from orchestratord.coordinator import JobCoordinator
from orchestratord.metrics import OrchestratorMetrics
from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, SlotEventKind, SwapOutWork
from orchestratord.state import InMemoryStateStore
from tests.stored_support import inprocess_stored

pytestmark = pytest.mark.timeout(120)

AGENTS = ("sender", "receiver")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models' byte-level tokenizer (no model weights: only decoding is needed)."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    return path


def _ids(text: str) -> np.ndarray[Any, np.dtype[np.int32]]:
    """Byte-level token ids of text: the tiny tokenizer's id of a byte is the byte (docs/examples.md)."""
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


def _record(job_id: str, task: str, sample: int, agent: str, *, reward: float) -> ExperienceRecord:
    response = _ids(f"{agent} says {task}.{sample}")
    return ExperienceRecord(
        experience_id=f"{task}/{sample}/{agent}/0", job_id=job_id, agent=agent, task_id=task,
        group_id=f"{task}/{agent}", sample_index=sample, episode_id=f"{task}-{sample}", turn=0, behavior_version=0,
        reward=reward, prompt_token_ids=_ids(f"you are {agent} in {task}"), response_token_ids=response,
        response_logprobs=np.zeros(response.shape[0], dtype=np.float32), group_size=2)


def _spec(tokenizer_dir: Path, tracking: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "tracked", "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
        "agents": [{"name": name, "model": str(tokenizer_dir)} for name in AGENTS],
        "batch": {"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2}, "total_steps": 2,
        "tracking": tracking,
    }


class RecordingStored:
    """The coordinator's stored connection: keeps the marks and serves the job's whole experiences."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.marks: list[str] = []
        self.reads: list[list[str]] = []

    async def store(self) -> RecordingStored:
        return self

    async def reset_store(self) -> None:
        pass

    async def mark(self, job_id: str, agent: str, step_id: str, ids: Iterable[str], state: object) -> int:
        self.marks.append(step_id)
        return 0

    async def finish_job(self, job_id: str, state: str) -> bool:
        return True

    async def read(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        self.reads.append(list(ids))
        out = []
        for experience_id in ids:
            task, sample, agent, _ = experience_id.rsplit("/", 3)
            out.append(_record(job_id, task, int(sample), agent, reward=float(sample)))
        return out


def _drive(planner: Planner, job_id: str) -> None:
    """Healthy rollout and trainer workers until the job ends (every step committed)."""
    job = planner.job(job_id)
    for _ in range(1000):
        if job.state.terminal:
            return
        for lease in planner.lease_rollout_tasks("roll-0", 4):
            versions = {v.agent: v.version for v in lease.agent_versions}
            planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "", [
                ExperienceSummary(f"{lease.task_id}/{sample}/{agent}/0", agent, f"{lease.task_id}/{agent}", sample,
                                  versions[agent], 3 + sample, float(sample), episode_return=10.0 + sample)
                for sample in range(lease.group_size) for agent in AGENTS])
        work = planner.poll_trainer_work("trainer-0", "slot-0")
        if isinstance(work, MicroBatchWork):
            planner.ack_micro_batch(work.lease_id, "trainer-0", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("trainer-0", "slot-0", work.job_id, work.agent, work.step, work.new_version,
                                f"file:///w/{work.agent}/{work.new_version}", "", 0.5, 0.25, 1.5)
        elif isinstance(work, SwapOutWork):
            planner.report_slot_event("trainer-0", "slot-0", work.job_id, work.agent, SlotEventKind.SWAPPED_OUT,
                                      f"stored://state/{work.agent}")
    raise AssertionError(f"job did not finish: {job.snapshot()}")


async def test_every_committed_step_reaches_jsonl_and_tensorboard_with_samples(tokenizer_dir: Path,
                                                                               tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    registry: Any = types.SimpleNamespace(prefix="/test")  # nothing here reaches etcd
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()))
    coordinator.state = InMemoryStateStore()
    stored = RecordingStored("tracked-1")
    coordinator._peers = stored  # type: ignore[assignment]
    spec = _spec(tokenizer_dir, {"trackers": ["jsonl", "tensorboard"], "dir": str(tmp_path), "samples": 3})
    job_id = await coordinator.submit_job(json.dumps(spec), "tracked-1")
    await coordinator.mutate(lambda: _drive(coordinator.planner, job_id))
    while coordinator._background:  # the tracker writes run after the commits are durable
        await asyncio.gather(*list(coordinator._background))
    history = list(coordinator.state._jobs[job_id]["history"].values())  # what `flexmarl history` reads
    await coordinator.stop()

    lines = [json.loads(line) for line in (tmp_path / job_id / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["agent"], r["step"]) for r in lines) == sorted((r["agent"], r["step"]) for r in history)
    assert len(lines) == 2 * len(AGENTS)
    by_step = {(r["agent"], r["step"]): r for r in history}
    for line in lines:
        record = by_step[(line["agent"], line["step"])]
        for figure in ("reward_mean", "loss", "grad_norm", "staleness_mean", "tokens_per_s", "step_seconds"):
            assert line[figure] == pytest.approx(record[figure]), figure
        assert line["loss"] == 0.5 and line["grad_norm"] == 0.25 and line["step_seconds"] == 1.5
        # the trained reward (the experiences' rewards 0, 1) and the reported return (10, 11) under their own names
        assert (record["reward_mean"], record["return_mean"]) == (0.5, 10.5)
        assert (line["reward_mean"], line["return_mean"]) == (0.5, 10.5)
        assert line["response_length"] == pytest.approx(record["response_tokens"] / record["episodes"])

    samples = [json.loads(line) for line in (tmp_path / job_id / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * len(lines)  # tracking.samples per agent and step
    assert all(len(ids) == 3 for ids in stored.reads)
    first = samples[0]
    assert first["response"] == f"{first['agent']} says {first['task_id']}.{first['sample_index']}"
    assert first["prompt"] == f"you are {first['agent']} in {first['task_id']}"
    assert first["reward"] == float(first["sample_index"])

    events = EventAccumulator(str(tmp_path / job_id / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for agent in AGENTS:  # v2 summaries: scalars are rank-0 tensors with the scalars plugin's metadata
        assert [e.step for e in events.Tensors(f"{agent}/reward_mean")] == sorted(
            r["step"] for r in history if r["agent"] == agent)
        assert [float(e.tensor_proto.float_val[0]) for e in events.Tensors(f"{agent}/loss")] == [0.5, 0.5]
        assert [float(e.tensor_proto.float_val[0]) for e in events.Tensors(f"{agent}/return_mean")] == [10.5, 10.5]
        assert [float(e.tensor_proto.float_val[0]) for e in events.Tensors(f"{agent}/reward_mean")] == [0.5, 0.5]
        assert events.SummaryMetadata(f"{agent}/loss").plugin_data.plugin_name == "scalars"
    text = events.Tensors("sender/samples")[0].tensor_proto.string_val[0].decode()
    assert "sender says" in text and "reward" in text


async def test_a_tracker_that_cannot_start_is_switched_off_and_the_job_goes_on(
        tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import flexmarl.tracking as tracking

    def broken(kind: str, job_dir: Path, job_id: str, project: str) -> Any:
        if kind == "mlflow":
            raise ModuleNotFoundError("No module named 'mlflow'")
        return opened(kind, job_dir, job_id, project)

    opened = tracking.open_tracker
    monkeypatch.setattr(tracking, "open_tracker", broken)
    spec = parse_job_spec(_spec(tokenizer_dir, {"trackers": ["mlflow", "jsonl"], "dir": str(tmp_path)}))
    trackers = JobTrackers("job-1", spec)
    record = {"agent": "sender", "step": 0, "reward_mean": 0.5, "episodes": 4, "response_tokens": 10,
              "committed_unix_ms": 7, "weights_uri": "file:///w"}
    with caplog.at_level(logging.ERROR, logger="flexmarl.tracking"):
        trackers.write_step(StepFigures.of_record(record))
        trackers.write_step(StepFigures.of_record({**record, "step": 1}))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["tracker mlflow of job job-1 switched off: writing step 0 of sender failed: "
                      "ModuleNotFoundError: No module named 'mlflow'"]  # once, then off
    lines = (tmp_path / "job-1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"agent": "sender", "step": step, "committed_unix_ms": 7, "reward_mean": 0.5, "episodes": 4.0,
         "response_tokens": 10.0, "response_length": 2.5} for step in (0, 1)]
    trackers.close()


async def test_step_tracking_writes_the_figures_when_samples_cannot_be_read(tokenizer_dir: Path,
                                                                            tmp_path: Path) -> None:
    async def unavailable(job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        raise ConnectionError("stored is restarting")

    tracking = StepTracking(unavailable)
    spec = parse_job_spec(_spec(tokenizer_dir, {"trackers": ["jsonl"], "dir": str(tmp_path), "samples": 2}))
    await tracking.step_committed("job-1", spec, {"agent": "sender", "step": 0, "loss": 1.0}, ["a/0/sender/0"])
    await tracking.close()
    assert json.loads((tmp_path / "job-1" / "metrics.jsonl").read_text())["loss"] == 1.0
    assert not (tmp_path / "job-1" / "samples.jsonl").exists()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StoreClient]:
    """A real stored, in process on port 0."""
    async with inprocess_stored(tmp_path / "stored") as (_, client, _):
        yield client


async def test_samples_of_a_step_are_its_consumed_experiences_decoded(store: StoreClient,
                                                                      tokenizer_dir: Path) -> None:
    records = [_record("job-1", task, sample, agent, reward=0.25 * sample)
               for task in ("t0", "t1") for sample in (0, 1) for agent in AGENTS]
    await store.append(records)
    sender_t0 = [r.experience_id for r in records if r.agent == "sender" and r.task_id == "t0"]
    await store.mark("job-1", "sender", str(StepRef("job-1", "sender", 0)), sender_t0, ExperienceState.CONSUMED)
    tokenizer = TokenizerCache().get(str(tokenizer_dir))

    samples = await read_step_samples(store, "job-1", "sender", 0, 5, tokenizer)
    assert [(s.task_id, s.sample_index, s.reward, s.response) for s in samples] == [
        ("t0", 0, 0.0, "sender says t0.0"), ("t0", 1, 0.25, "sender says t0.1")]
    assert samples[0].prompt == "you are sender in t0" and samples[0].step == 0
    first = next(r for r in records if r.experience_id == sender_t0[0])
    assert samples[0].response_token_ids == tuple(int(t) for t in first.response_token_ids)  # the ids, not only text
    assert samples[0].prompt_token_ids == tuple(int(t) for t in first.prompt_token_ids)
    assert await read_step_samples(store, "job-1", "sender", 0, 1, tokenizer) == samples[:1]
    assert await read_step_samples(store, "job-1", "sender", 1, 5, tokenizer) == []  # not committed


def test_preflight_names_each_unknown_config_key_and_a_missing_tracker_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"user_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from flexmarl.episode import Environment, Task

        class Game(Environment):
            agents = ("sender", "receiver")

            def __init__(self, num_objects, rounds=1):
                self.num_objects = num_objects

            def task(self, index, seed):
                return Task(index=index, seed=seed)

            async def episode(self, ctx, task):
                pass
    """))
    monkeypatch.chdir(tmp_path)
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
    spec["environment"] = {"entrypoint": f"{name}:Game", "config": {"num_object": 2, "round": 3}}
    spec["tracking"] = {"trackers": ["jsonl", "wandb"]}
    monkeypatch.setattr("importlib.util.find_spec", lambda package: None if package == "wandb" else object())
    try:
        assert preflight_problems(parse_job_spec(spec)) == [
            f"environment.config.num_object: not a parameter of '{name}:Game' (it takes num_objects, rounds)",
            f"environment.config.round: not a parameter of '{name}:Game' (it takes num_objects, rounds)",
            f"environment.config: '{name}:Game' needs 'num_objects' (no default)",
            "tracking.trackers[1]: 'wandb' needs the wandb package on orchestratord's host (pip install wandb)",
        ]
        spec["environment"]["config"] = {"num_objects": 2}
        spec["tracking"] = {"trackers": ["jsonl"]}
        assert preflight_problems(parse_job_spec(spec)) == []
    finally:
        import sys

        sys.modules.pop(name, None)
