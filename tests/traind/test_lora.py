"""LoRA agents: only the adapter trains, the shared base stays bit-identical, swaps move the adapter alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.jobspec import parse_job_spec
from traind.locations import MemoryStateStore, open_location
from traind.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraBaseCache, LoraSettings
from traind.model import AgentTrainer, AgentTrainerConfig
from traind.swap import swap_in, swap_out
from traind.worker import trainer_config as spec_trainer_config

from .conftest import make_groups
from .test_swap import optimizer_state
from .test_trainer import step_sizes, trainer_config

SETTINGS = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"))


def lora_config(model_dir: Path, agent: str, *, kl_coef: float = 0.0,
                settings: LoraSettings = SETTINGS) -> AgentTrainerConfig:
    return AgentTrainerConfig(**{**trainer_config(model_dir, agent=agent, kl_coef=kl_coef).__dict__,
                                 "lr": 1e-2, "lora": settings})


def train_steps(trainer: AgentTrainer, first_seed: int, steps: int) -> None:
    """One group of four per step (small: these tests build several engines)."""
    for step in range(steps):
        groups = make_groups(seed=first_seed + step, tasks=1, group_size=4, agent=trainer.config.agent)
        trainer.accumulate(groups[0])
        trainer.optimizer_step(*step_sizes(groups))


def adapter_params(trainer: AgentTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_base_stays_bit_identical_while_the_adapter_trains(tiny_model_dir: Path) -> None:
    cache = LoraBaseCache()
    pristine = base_state(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    trainer = AgentTrainer(lora_config(tiny_model_dir, "a", kl_coef=0.1), lora_bases=cache)
    before = adapter_params(trainer)
    assert before and all("lora_" in n for n in before)
    exact = trainer._exact_sum
    assert exact is not None and len(exact.params) == len(before)  # exact accumulation over the adapter only
    groups = make_groups(seed=3, tasks=1, group_size=4, agent="a")
    trainer.accumulate(groups[0])
    first = trainer.optimizer_step(*step_sizes(groups))
    assert first.kl == 0.0  # B starts at zero: v0 is the base, the KL reference (adapter disabled)
    train_steps(trainer, first_seed=10, steps=1)
    after = adapter_params(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    optimizer = trainer.engine.basic_optimizer
    assert len(optimizer.state) == len(before)  # Adam moments for the adapter alone
    trainer.release()
    held = cache.key
    assert held is not None and held[0] == str(tiny_model_dir)
    base = cache.acquire(str(tiny_model_dir), torch.float32)
    assert not any("lora_" in name for name, _ in base.named_modules())
    got = base_state(base)
    assert got.keys() == pristine.keys()
    assert all(torch.equal(got[k], pristine[k]) for k in pristine)
    assert cache.loads == 1


def test_swapping_adapter_agents_on_one_base_is_bit_transparent(tiny_model_dir: Path) -> None:
    """A: 1 step, out; B in (same base), 1 step, out; A back in, 1 step == A trained 2 steps unswapped."""
    config_a = lora_config(tiny_model_dir, "a")
    config_b = lora_config(tiny_model_dir, "b", settings=LoraSettings(rank=2, alpha=4, dropout=0.1,
                                                                      target_modules=("o_proj",)))
    unswapped = AgentTrainer(config_a)
    train_steps(unswapped, first_seed=100, steps=2)
    want_params, want_opt = adapter_params(unswapped), optimizer_state(unswapped)
    unswapped.release()

    cache = LoraBaseCache()
    memory = MemoryStateStore()
    location = open_location("mem://job/a", memory=memory)
    agent_a = AgentTrainer(config_a, lora_bases=cache)
    train_steps(agent_a, first_seed=100, steps=1)
    out_stats = swap_out(agent_a, location)
    base = cache.acquire(str(tiny_model_dir), torch.float32)  # back in the cache, its adapter detached
    base_bytes = sum(t.numel() * t.element_size() for t in base_state(base).values())
    cache.give_back(base)
    assert 0 < out_stats.bytes_moved < base_bytes / 3  # adapter + optimizer state, not the base
    agent_b = AgentTrainer(config_b, lora_bases=cache)
    train_steps(agent_b, first_seed=500, steps=1)
    agent_b.release()
    agent_a, in_stats = swap_in(config_a, location, lora_bases=cache)
    assert in_stats.bytes_moved == out_stats.bytes_moved
    assert agent_a.version == 1
    train_steps(agent_a, first_seed=101, steps=1)
    got = adapter_params(agent_a)
    assert got.keys() == want_params.keys()
    assert all(torch.equal(got[n], want_params[n]) for n in want_params)
    for got_moment, want_moment in zip(optimizer_state(agent_a), want_opt, strict=True):
        assert torch.equal(got_moment, want_moment)
    agent_a.release()
    assert cache.loads == 1  # one base read for three engines of two agents


def test_published_adapter_loads_with_peft_and_merges(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    from flexmarl.adapters import merge_adapter
    from flexmarl.checkpoints import model_signature, read_model_signature

    trainer = AgentTrainer(lora_config(tiny_model_dir, "a"))
    train_steps(trainer, first_seed=7, steps=1)
    out = trainer.publish(tmp_path / "v1")
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("model*.safetensors"))  # the adapter only, never the base
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], sorted(config["target_modules"])) == (4, ["q_proj", "v_proj"])
    assert model_signature(trainer.engine.module.config.to_dict()) == read_model_signature(str(tiny_model_dir))
    ids = torch.randint(1, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    module = trainer.engine.module
    module.eval()
    with torch.no_grad():
        want = module(input_ids=ids).logits
    trainer.release()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), out)
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
    merged_dir = export_through_the_cli(tiny_model_dir, out, tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert (merged_dir / "tokenizer_config.json").exists()
    with pytest.raises(InvalidArgument, match="already exists"):
        merge_adapter(out, tiny_model_dir, merged_dir)


def test_an_lm_head_adapter_of_the_tied_base_publishes_its_halves_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    """examples/signaling_lora adapts lm_head, which the tiny base ties to its embeddings: the tie and the base
    survive the adapter, and what is published is the adapter, not the tied embedding PEFT would save beside it."""
    from safetensors import safe_open

    cache = LoraBaseCache()
    pristine = base_state(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=("lm_head",))
    trainer = AgentTrainer(lora_config(tiny_model_dir, "a", settings=settings), lora_bases=cache)
    before = adapter_params(trainer)
    train_steps(trainer, first_seed=20, steps=1)
    assert any(not torch.equal(before[n], p) for n, p in adapter_params(trainer).items())
    out = trainer.publish(tmp_path / "v1")
    with safe_open(str(out / ADAPTER_WEIGHTS), "pt") as published:
        assert set(published.keys()) == {"base_model.model.lm_head.lora_A.weight",
                                         "base_model.model.lm_head.lora_B.weight"}
    trainer.release()
    base = cache.acquire(str(tiny_model_dir), torch.float32)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    got = base_state(base)
    assert got.keys() == pristine.keys() and all(torch.equal(got[k], pristine[k]) for k in pristine)


def export_through_the_cli(base: Path, adapter: Path, tmp_path: Path) -> Path:
    """`flexmarl export` against an orchestratord (a real gRPC server answering GetJob/GetJobHistory) of one version."""
    from concurrent import futures

    import grpc

    from flexmarl import cli
    from flexmarl.artifacts import file_uri
    from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

    spec_json = parse_job_spec(_spec([{"name": "a", "base": str(base), "lora": LORA}])).to_json()

    class Orchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
        def GetJob(self, request: Any, context: Any) -> Any:  # noqa: N802
            status = orchestrator_pb2.JobStatus(job_id=request.job_id, name="lora", spec_json=spec_json,
                                                state=orchestrator_pb2.JOB_STATE_SUCCEEDED)
            status.agents.add(agent="a", step=1, version=1)
            return status

        def GetJobHistory(self, request: Any, context: Any) -> Any:  # noqa: N802
            return orchestrator_pb2.JobHistory(steps=[orchestrator_pb2.StepRecord(
                agent="a", step=0, version=1, weights_uri=file_uri(adapter))])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(Orchestrator(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        common = ["lora-1", "--agent", "a", "--address", address]
        assert cli.main(["export", *common, "--out", str(tmp_path / "copy")]) == 0  # as published
        assert (tmp_path / "copy" / ADAPTER_WEIGHTS).is_file()
        assert cli.main(["export", *common, "--version", "0", "--merge", "--out", str(tmp_path / "v0")]) == 2
        assert cli.main(["export", *common, "--merge", "--out", str(tmp_path / "merged")]) == 0  # the latest
    finally:
        server.stop(0)
    return tmp_path / "merged"


def test_a_state_of_another_agent_shape_is_refused(tiny_model_dir: Path) -> None:
    cache = LoraBaseCache()
    location = open_location("mem://job/a", memory=MemoryStateStore())
    swap_out(AgentTrainer(lora_config(tiny_model_dir, "a"), lora_bases=cache), location)
    other = lora_config(tiny_model_dir, "a", settings=LoraSettings(rank=4, alpha=8, dropout=0.0,
                                                                   target_modules=("o_proj",)))
    with pytest.raises(FailedPrecondition, match="adapter"):
        swap_in(other, location, lora_bases=cache)
    base = cache.acquire(str(tiny_model_dir), torch.float32)  # given back by the failed swap-in, adapter out
    assert not any("lora_" in name for name, _ in base.named_modules())


def _spec(agents: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": "lora", "environment": {"entrypoint": "examples.signaling.env:SignalingEnv"}, "agents": agents,
            "batch": {"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 2}, "total_steps": 2, **extra}


LORA = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}


def test_job_spec_lora_agents_share_a_base_and_mixes_are_checked() -> None:
    spec = parse_job_spec(_spec([{"name": "a", "base": "/m", "lora": LORA},
                                 {"name": "b", "model": "/m", "lora": {**LORA, "alpha": 32, "dropout": 0.05}},
                                 {"name": "c", "model": "/m"}]))
    assert [a.model for a in spec.agents] == ["/m", "/m", "/m"]
    lora = spec.agent("b").lora
    assert lora is not None and (lora.rank, lora.alpha, lora.dropout) == (8, 32, 0.05)
    assert spec.agent("c").lora is None
    config = spec_trainer_config(spec, "a")
    assert config.lora == LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=("q_proj", "v_proj"))
    assert spec_trainer_config(spec, "c").lora is None
    assert parse_job_spec(json.loads(spec.to_json())) == spec

    def problems(agents: list[dict[str, Any]], **extra: Any) -> str:
        with pytest.raises(InvalidArgument) as info:
            parse_job_spec(_spec(agents, **extra))
        return str(info.value)

    assert "not both" in problems([{"name": "a", "base": "/m", "model": "/m", "lora": LORA}])
    assert "give lora too" in problems([{"name": "a", "base": "/m"}])
    assert "agents[0].zero_stage: a LoRA agent trains with ZeRO 0" in problems(
        [{"name": "a", "model": "/m", "lora": LORA, "zero_stage": 3}])
    assert "agents[0].max_slots" in problems([{"name": "a", "model": "/m", "lora": LORA, "max_slots": 2}])
    text = problems([{"name": "a", "model": "/m", "lora": LORA}, {"name": "b", "model": "/m", "lora": LORA,
                                                                  "dtype": "bf16"}])
    assert "agents[1].dtype: LoRA agents over base '/m' share it" in text
    assert "weight_sync" in problems([{"name": "a", "model": "/m", "lora": LORA}],
                                     rollout={"weight_sync": "distributed"})
    assert "agents[0].lora.rank: must be <= 1024" in problems([{"name": "a", "model": "/m",
                                                                "lora": {**LORA, "rank": 4096}}])
    assert "agents[0].lora.rank: must be >= 1" in problems([{"name": "a", "model": "/m", "lora": {**LORA, "rank": 0}}])
    assert "lora.dropout" in problems([{"name": "a", "model": "/m", "lora": {**LORA, "dropout": 1.0}}])
    assert "lora.target_modules: must have at least 1" in problems(
        [{"name": "a", "model": "/m", "lora": {"rank": 8, "target_modules": []}}])
    assert "twice" in problems([{"name": "a", "model": "/m", "lora": {"rank": 8, "target_modules": ["q", "q"]}}])
    # A full-model agent on the same model in another dtype is fine: it trains its own copy.
    parse_job_spec(_spec([{"name": "a", "model": "/m", "lora": LORA}, {"name": "b", "model": "/m", "dtype": "bf16"}]))


def test_resume_keeps_the_adapter_shape() -> None:
    from flexmarl.checkpoints import CheckpointManifest, ResumeSource, check_resumable

    source_spec = parse_job_spec(_spec([{"name": "a", "model": "/m", "lora": LORA}]))
    manifest = CheckpointManifest(job_id="lora-1", agent="a", version=1, weights_uri="", state_uri="",
                                  spec_digest=source_spec.digest(), spec_json=source_spec.to_json(),
                                  model_signature={})
    source = ResumeSource.parse("lora-1")
    check_resumable(source, {"a": manifest}, source_spec)
    for changed in ({**LORA, "rank": 16}, None):
        agent = {"name": "a", "model": "/m"} if changed is None else {"name": "a", "model": "/m", "lora": changed}
        with pytest.raises(InvalidArgument, match="LoRA adapter differs"):
            check_resumable(source, {"a": manifest}, parse_job_spec(_spec([agent])))


@pytest.mark.timeout(240)
async def test_two_lora_agents_take_turns_on_one_slot_over_one_base(tmp_path: Path) -> None:
    """The worker: sender steps, receiver (same base) steps, sender again from its state; the base is read once."""
    import numpy as np
    import yaml
    from prometheus_client import CollectorRegistry

    from flexmarl.checkpoints import manifest_path
    from flexmarl.cli import materialize_models
    from flexmarl.jobspec import spec_digest
    from traind.metrics import TrainerMetrics
    from traind.work import MicroBatchWork, OptimizerStepWork
    from traind.worker import TrainerSettings, TrainerWorker

    from .conftest import make_group
    from .test_worker_link import JOB, REPO_ROOT, FakeOrchestrator, FakeStore

    raw: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "signaling" / "job.yaml").read_text())
    for agent in raw["agents"]:
        agent["model"] = "tiny://qwen2?seed=1"
        agent["lora"] = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    raw["batch"] = {"prompts_per_step": 1, "group_size": 4, "micro_batch_size": 4}
    spec_json = json.dumps(materialize_models(raw, tmp_path / "models"))
    digest = spec_digest(spec_json)
    rng = np.random.default_rng(0)
    groups = {(agent, step): make_group(rng, f"t{step}", agent, 4) for agent in ("sender", "receiver")
              for step in (0, 1)}

    def step_work(agent: str, step: int, state_uri: str) -> list[Any]:
        group = groups[(agent, step)]
        return [MicroBatchWork(lease_id=f"{agent}-{step}", job_id=JOB, agent=agent, step=step, step_id=f"{agent}{step}",
                               micro_batch_index=0, experience_ids=tuple(r.experience_id for r in group),
                               base_version=step, state_uri=state_uri, step_episodes=4, spec_digest=digest),
                OptimizerStepWork(job_id=JOB, agent=agent, step=step, step_id=f"{agent}{step}", new_version=step + 1,
                                  step_response_tokens=sum(r.response_tokens for r in group), step_episodes=4,
                                  num_micro_batches=1, base_version=step, state_uri=state_uri, spec_digest=digest)]

    orchestrator = FakeOrchestrator(spec_json, [*step_work("sender", 0, ""), *step_work("receiver", 0, "")])
    settings = TrainerSettings(worker_id="traind-lora", slots=1, work_dir=tmp_path / "work", state_location="file",
                               publish_location="file")
    worker = TrainerWorker(settings, TrainerMetrics(CollectorRegistry()),
                           orchestrator, FakeStore([r for g in groups.values() for r in g]))
    await worker.start()
    try:
        await orchestrator.until(lambda: len(orchestrator.commits) == 2)
        sender = orchestrator.commits[0]
        for item in step_work("sender", 1, sender.state_uri):
            orchestrator.script.put_nowait(item)
        await orchestrator.until(lambda: len(orchestrator.commits) == 3)
        assert [(c.agent, c.new_version) for c in orchestrator.commits] == [("sender", 1), ("receiver", 1),
                                                                            ("sender", 2)]
        assert not orchestrator.events  # no slot failed
        for commit in orchestrator.commits:
            weights = Path(commit.weights_uri.removeprefix("file://"))
            assert (weights / ADAPTER_CONFIG).is_file() and not list(weights.glob("model*.safetensors"))
        # Each agent's newest version is resumable (the default policy keeps one state per agent).
        assert manifest_path(settings.work_dir, JOB, "sender", 2).is_file()
        assert manifest_path(settings.work_dir, JOB, "receiver", 1).is_file()
        assert worker.slots[0].lora_bases.loads == 1  # three engines, two agents, one base read
    finally:
        await worker.stop()
