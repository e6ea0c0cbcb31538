"""Warm starts (traind/sft.py): SFT through the agent's trainer, reproducible, and the spec's checks."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.jobspec import parse_job_spec
from flexmarl.preflight import preflight_problems
from traind import sft
from traind.model import AgentTrainer, AgentTrainerConfig

REPO = Path(__file__).resolve().parents[2]


def pairs(seed: int) -> Iterator[tuple[str, Any]]:
    """A tiny warm-start dataset: text pairs and token-id pairs (a module-level entrypoint for the tests)."""
    index = 0
    while True:
        a, b = (seed + index) % 7, index % 5
        yield (f"{a}+{b}=", str(a + b)) if index % 2 else (f"{a}*{b}=", [ord(str(a * b % 10))])
        index += 1


def not_pairs(seed: int) -> list[Any]:
    """A dataset whose items are not (prompt, response) pairs."""
    return [("only a prompt",)] * 100


def few_pairs(seed: int) -> list[tuple[str, str]]:
    """A dataset too short for the warm starts of these tests."""
    return [("1+1=", "2")] * 4


def warm(steps: int = 3, dataset: str = "tests.traind.test_sft:pairs", seed: int = 7) -> sft.WarmStart:
    return sft.WarmStart(agent="solver", dataset=dataset, steps=steps, lr=1e-2, batch_size=12, seed=seed)


def params(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}


def test_examples_encode_text_with_eos_and_take_token_ids_verbatim() -> None:
    items = sft.dataset_examples(warm(steps=1), lambda text: [ord(c) for c in text], eos_token_id=999)
    assert len(items) == 12
    assert items[0] == sft.SftExample(tuple(map(ord, "0*0=")), (ord("0"),))  # token ids: no EOS added
    assert items[1] == sft.SftExample(tuple(map(ord, "1+1=")), (ord("2"), 999))
    packed = sft.pack_examples(items[:2])
    # The mask marks the logits that predict response tokens, nothing of the prompt.
    assert packed.response_mask[0].tolist() == [0, 0, 0, 1, 0]
    assert packed.response_mask[1].tolist() == [0, 0, 0, 1, 1]


def test_bad_datasets_are_invalid_arguments() -> None:
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    with pytest.raises(InvalidArgument, match="cannot load"):
        sft.dataset_examples(warm(dataset="tests.traind.test_sft:missing"), encode, None)
    with pytest.raises(InvalidArgument, match=r"example 0: expected a \(prompt, response\) pair"):
        sft.dataset_examples(warm(steps=1, dataset="tests.traind.test_sft:not_pairs"), encode, None)
    with pytest.raises(InvalidArgument, match="yielded 4 examples; steps \\* batch_size needs 24"):
        sft.dataset_examples(warm(steps=2, dataset="tests.traind.test_sft:few_pairs"), encode, None)


def test_warm_start_lowers_the_loss_is_bit_reproducible_and_stays_at_version_zero(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    config = AgentTrainerConfig(agent="solver", model_path=str(tiny_model_dir), lr=1e-4)
    runs = []
    for _ in range(2):
        trainer = AgentTrainer(config)
        before = params(trainer)
        report = sft.run_warm_start(trainer, warm(steps=3))
        runs.append((trainer, report, params(trainer)))
        assert trainer.version == 0  # RL's version 0, with a fresh optimizer at the agent's lr
        assert not trainer.engine.basic_optimizer.state
        assert trainer.engine.optimizer.param_groups[0]["lr"] == 1e-4
    (first, report, after), (second, report_again, after_again) = runs
    assert report.last_loss < report.first_loss
    assert [s.loss for s in report.steps] == [s.loss for s in report_again.steps]
    assert all(torch.equal(after[k], after_again[k]) for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    # What the publication path writes is the warm-started model.
    published = first.publish(tmp_path / "v0")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(published), dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], after[k]) for k in reloaded)
    first.accumulate_loss(("x",), 1, lambda model: (model(input_ids=torch.tensor([[1, 2]])).logits.sum(), 1))
    first.optimizer_step(1, 1)
    with pytest.raises(FailedPrecondition, match="fresh engine"):
        sft.run_warm_start(first, warm(steps=1))
    for trainer in (first, second):
        trainer.release()


def test_warm_start_is_the_same_with_and_without_exact_accumulation(tiny_model_dir: Path) -> None:
    results = []
    for exact in (True, False):
        trainer = AgentTrainer(AgentTrainerConfig(agent="solver", model_path=str(tiny_model_dir), lr=1e-4,
                                                  exact_accumulation=exact))
        report = sft.run_warm_start(trainer, warm(steps=1))
        results.append((report.steps[0].loss, params(trainer)))
        trainer.release()
    (loss_exact, exact_params), (loss_plain, plain_params) = results
    assert loss_exact == pytest.approx(loss_plain, rel=1e-5)
    assert all(torch.allclose(exact_params[k], plain_params[k], atol=1e-5) for k in exact_params)


def test_a_warm_start_charges_no_modelled_device_time_and_rl_still_does(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    """The warm start is real time; a benchmark's clock starts at RL's first device work, not at SFT's."""
    from flexmarl import devicemodel
    from traind.pacing import ModelledDeviceClock

    profile = devicemodel.H100_SXM.with_changes(token_scale=4.0, time_scale=1e-4, trace_dir=str(tmp_path))
    clock = ModelledDeviceClock(profile, "traind-t-solver")
    trainer = AgentTrainer(AgentTrainerConfig(agent="solver", model_path=str(tiny_model_dir), lr=1e-4), clock)
    try:
        sft.run_warm_start(trainer, warm(steps=2))
        assert trainer.device_clock is clock
        clock.settle()
        assert devicemodel.read_traces(tmp_path) == {}
        trainer.accumulate_loss(("x",), 1, lambda model: (model(input_ids=torch.tensor([[1, 2]])).logits.sum(), 1))
        trainer.optimizer_step(1, 1)
        clock.settle()
        assert [r["kind"] for r in devicemodel.read_traces(tmp_path)["traind-t-solver"]] == ["optimizer"]
        # A failed warm start gives the clock back too.
        fresh = AgentTrainer(AgentTrainerConfig(agent="solver", model_path=str(tiny_model_dir), lr=1e-4), clock)
        try:
            with pytest.raises(InvalidArgument):
                sft.run_warm_start(fresh, warm(steps=2, dataset="tests.traind.test_sft:not_pairs"))
            assert fresh.device_clock is clock
        finally:
            fresh.release()
    finally:
        trainer.release()


def _spec(**warm_start: Any) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "examples" / "arithmetic" / "job.yaml").read_text())
    data = copy.deepcopy(data)
    for agent in data["agents"]:
        agent["model"] = "/nonexistent"
    data["agents"][0]["warm_start"] = {"dataset": "examples.arithmetic.data:solver_examples", "steps": 3,
                                       **warm_start}
    return data


def test_spec_validation_of_warm_starts() -> None:
    spec = parse_job_spec(_spec())
    assert spec.agents[0].warm_start is not None and spec.agents[0].warm_start.steps == 3
    assert sft.WarmStart.of(spec, "solver") == sft.WarmStart("solver", "examples.arithmetic.data:solver_examples", 3,
                                                              1e-3, 32, spec.seed, ())
    with pytest.raises(InvalidArgument, match=r"agents\[0\]\.warm_start\.steps"):
        parse_job_spec(_spec(steps=0))
    with pytest.raises(InvalidArgument, match=r"agents\[0\]\.warm_start\.dataset: .*'package.module:attr'"):
        parse_job_spec(_spec(dataset="no-colon"))
    with pytest.raises(InvalidArgument, match=r"agents\[0\]\.warm_start\.epochs"):
        parse_job_spec(_spec(epochs=2))
    data = _spec()
    data["agents"][0]["max_slots"] = 2
    data["algorithm"]["kl_coef"] = 0.1
    with pytest.raises(InvalidArgument) as excinfo:
        parse_job_spec(data)
    assert "agents[0].warm_start: needs max_slots 1" in str(excinfo.value)
    assert "agents[0].warm_start: needs a KL coefficient of 0" in str(excinfo.value)


def test_preflight_loads_the_warm_start_dataset() -> None:
    assert preflight_problems(parse_job_spec(_spec())) == []
    problems = preflight_problems(parse_job_spec(_spec(dataset="examples.arithmetic.data:nothing_here")))
    assert len(problems) == 1 and problems[0].startswith("agents[0].warm_start.dataset: cannot load")
    problems = preflight_problems(parse_job_spec(_spec(dataset="tests.traind.test_sft:not_pairs")))
    assert problems == ["agents[0].warm_start.dataset: warm-start example 0: expected a (prompt, response) pair, "
                        "got tuple"]


def _warm_signaling_spec_json(tmp_path: Path) -> str:
    """The signaling example with tiny models and a 2-step warm start of its first agent."""
    import json

    from flexmarl.cli import materialize_models

    raw: dict[str, Any] = yaml.safe_load((REPO / "examples" / "signaling" / "job.yaml").read_text())
    raw["agents"][0]["warm_start"] = {"dataset": "tests.traind.test_sft:pairs", "steps": 2, "lr": 1e-2,
                                      "batch_size": 12}
    return json.dumps(materialize_models(raw, tmp_path / "models"))


def _file_worker(work_dir: Path, orchestrator: Any, store: Any) -> Any:
    """A one-slot TrainerWorker over the given fake links, publishing and saving to files under work_dir."""
    from prometheus_client import CollectorRegistry

    from traind.metrics import TrainerMetrics
    from traind.worker import TrainerSettings, TrainerWorker

    settings = TrainerSettings(worker_id="traind-fake", slots=1, work_dir=work_dir, state_location="file",
                               publish_location="file")
    return TrainerWorker(settings, TrainerMetrics(CollectorRegistry()), orchestrator, store)


@pytest.mark.timeout(240)
async def test_the_worker_publishes_the_warm_start_as_version_zero_and_trains_step_zero_on_it(tmp_path: Path) -> None:
    import json

    import numpy as np
    from transformers import AutoModelForCausalLM

    from flexmarl.jobspec import spec_digest
    from traind.work import OptimizerStepWork, WarmStartWork
    from traind.worker import trainer_config

    from .conftest import make_group
    from .test_worker_link import AGENT, JOB, FakeOrchestrator, FakeStore, _micro_batch

    spec_json = _warm_signaling_spec_json(tmp_path)
    digest = spec_digest(spec_json)
    group = make_group(np.random.default_rng(0), "t0", AGENT, 4)
    tokens = sum(r.response_tokens for r in group)
    work_dir = tmp_path / "work"
    v0_state = (work_dir / "states" / JOB / AGENT / "v0").as_uri()
    orchestrator = FakeOrchestrator(spec_json, [
        WarmStartWork(lease_id="lease-warm", job_id=JOB, agent=AGENT, spec_digest=digest),
        _micro_batch(0, group, step=0, step_id="s0", base_version=0, state_uri=v0_state, digest=digest,
                     step_episodes=4),
        OptimizerStepWork(job_id=JOB, agent=AGENT, step=0, step_id="s0", new_version=1, step_response_tokens=tokens,
                          step_episodes=4, num_micro_batches=1, base_version=0, state_uri=v0_state,
                          spec_digest=digest),
    ])
    worker = _file_worker(work_dir, orchestrator, FakeStore(group))
    await worker.start()
    try:
        await orchestrator.until(lambda: len(orchestrator.commits) == 2)
    finally:
        await worker.stop()
    warm_commit, commit = orchestrator.commits
    assert (warm_commit.step, warm_commit.new_version, warm_commit.state_uri) == (0, 0, v0_state)
    assert commit.new_version == 1
    assert not orchestrator.events  # nothing failed
    # The same thing by hand: a fresh engine, the warm start (published as v0), RL step 0 on the same micro-batch.
    spec = parse_job_spec(json.loads(spec_json))
    expected = AgentTrainer(trainer_config(spec, AGENT))
    warm_start = sft.WarmStart.of(spec, AGENT)
    assert warm_start is not None
    sft.run_warm_start(expected, warm_start)
    assert expected.version == 0
    v0 = AutoModelForCausalLM.from_pretrained(warm_commit.weights_uri.removeprefix("file://"),
                                              dtype=torch.float32).state_dict()
    warm = params(expected)
    assert all(torch.equal(v0[k], warm[k]) for k in v0)
    base = AutoModelForCausalLM.from_pretrained(spec.agent(AGENT).model, dtype=torch.float32).state_dict()
    assert any(not torch.equal(base[k], v0[k]) for k in v0)  # v0 is not the base checkpoint
    expected.accumulate(group, micro_batch_index=0)
    expected.optimizer_step(tokens, 4, num_micro_batches=1)
    want = params(expected)
    expected.release()
    published = AutoModelForCausalLM.from_pretrained(commit.weights_uri.removeprefix("file://"),
                                                     dtype=torch.float32).state_dict()
    assert all(torch.equal(published[k], want[k]) for k in published)


@pytest.mark.timeout(240)
async def test_a_warm_start_agent_at_version_zero_needs_its_published_state(tmp_path: Path) -> None:
    """Work at v0 of a warm-start agent without a state_uri would train the base checkpoint: the slot refuses it."""

    import numpy as np

    from flexmarl.jobspec import spec_digest
    from traind.work import SlotEventKind

    from .conftest import make_group
    from .test_worker_link import AGENT, JOB, FakeOrchestrator, FakeStore, _micro_batch

    spec_json = _warm_signaling_spec_json(tmp_path)
    group = make_group(np.random.default_rng(0), "t0", AGENT, 4)
    orchestrator = FakeOrchestrator(spec_json, [
        _micro_batch(0, group, step=0, step_id="s0", base_version=0, state_uri="", digest=spec_digest(spec_json),
                     step_episodes=4)])
    worker = _file_worker(tmp_path / "work", orchestrator, FakeStore(group))
    await worker.start()
    try:
        await orchestrator.until(lambda: len(orchestrator.events) == 1)
    finally:
        await worker.stop()
    (event,) = orchestrator.events
    assert (event.job_id, event.agent, event.kind) == (JOB, AGENT, SlotEventKind.FAILED)
    assert "published warm start" in event.error and not orchestrator.acks
