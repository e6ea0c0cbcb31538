"""The daemons on vLLM: jobs whose rollouts run on a real vLLM 0.32 server that rolloutd launched.

One cluster for the module (etcd, the four daemons, one traind slot, one rolloutd with one vLLM
replica: ``--engine-backend vllm --vllm-python ...``); each test submits its own job. rolloutd
fixes a replica's flags at its first job, so the LoRA test comes last and restarts rolloutd first:
its job launches a replica with LoRA on, and the other jobs run on a plain replica, as a user's
would. The models are untied tiny Qwen2s (``tie=0``): vLLM on CPU does not reload a tied output
head (docs/engines.md).

* A job with two LoRA agents and a full-model agent trains: adapters over an untouched base, the
  full model moves, and vLLM served each adapter version's logprobs (PEFT's forward pass).
* A partial-rollout job (``rollout.partial_rollout``) is interrupted in place (vLLM's ``keep``
  pause, a reload under the frozen requests, ``/resume``), and still trains every step once
  with every experience consumed once and consistent per-token version spans.
* The signaling example (examples/signaling/job.yaml's settings, untied models) learns to a mean
  reward >= 0.9, while its replica's vLLM server is SIGKILLed after the first commit: rolloutd
  kills the rest of its process group (vLLM's engine core) and relaunches it, and nothing is lost
  or duplicated. The logprobs vLLM served in every experience equal a transformers forward pass
  of the version the experience names, so every reload the daemon made served what it named.

In CI (``CI=true``) a missing vLLM fails the tests; elsewhere they skip (tests/rolloutd/vllm_support.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import torch
import yaml
from e2e_support import (
    SIGNALING_JOB,
    E2ECluster,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    rolloutd_log,
    running_cluster,
    weights_dir,
)
from lora_support import MIXED_STEPS, mixed_spec, peft_logprobs
from partial_support import interruptions, partial_spec, span_summaries

from flexmarl.artifacts import checkpoint_tensors
from flexmarl.cli import materialize_models
from flexmarl.cluster import descendant_pids, wait_until
from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord
from flexmarl.registry import Registry
from rolloutd.engines.protocol import GenerationRequest, SamplingParams
from rolloutd.engines.vllm import VLLMClient
from rolloutd.engines.vllm.launch import VLLM_SERVER_MODULE


def _vllm_support() -> ModuleType:
    """tests/rolloutd/vllm_support.py (the test directories are not packages)."""
    path = Path(__file__).resolve().parents[1] / "rolloutd" / "vllm_support.py"
    spec = importlib.util.spec_from_file_location("vllm_support", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Served logprobs (batched, KV-cached fp32 decode) against one fp32 forward pass.
LOGPROB_TOLERANCE = 1e-4
UNTIED_BASE = "tiny://qwen2?seed=1&tie=0"
UNTIED = {"sender": UNTIED_BASE, "receiver": "tiny://qwen2?seed=2&tie=0"}
#: The module's replica: the fast test settings, with room for a whole signaling step's 64 episodes.
MAX_NUM_SEQS = 64


def untied(raw: dict[str, Any], models_dir: Path) -> dict[str, Any]:
    """``raw`` with every agent on its untied model (UNTIED by name), materialised."""
    for agent in raw["agents"]:
        agent["model"] = UNTIED[agent["name"]]
    return materialize_models(raw, models_dir)


@functools.cache
def _model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def forward_logprobs(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """log_softmax of a transformers fp32 forward pass at each response token (what traind computes)."""
    model = _model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return [float(logprobs[i, token]) for i, token in enumerate(response)]


def vllm_rolloutd_args(support: ModuleType) -> list[str]:
    """rolloutd's flags for one launched vLLM replica (the fast test settings); fails in CI without vLLM."""
    python = support.require_vllm_python()
    args = list(support.VLLM_TEST_ARGS)
    args[args.index("--max-num-seqs") + 1] = str(MAX_NUM_SEQS)
    return ["--engine-backend", "vllm", "--vllm-python", python, "--no-engine-deterministic-inference",
            f"--engine-extra-args={shlex.join(args)}"]


def server_pid(rolloutd_pid: int) -> int:
    """The pid of the one vLLM server rolloutd launched."""
    pids = descendant_pids(rolloutd_pid, VLLM_SERVER_MODULE)
    assert len(pids) == 1, f"vLLM servers under rolloutd: {pids}"
    return pids[0]


def group_alive(pgid: int) -> bool:
    """Whether any process of a process group lives (a replica runs in a session, so a group, of its own)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_group_gone(pgid: int, timeout_s: float = 20.0) -> None:
    """Waits until no process of the group lives; SIGKILLs the group and fails the test if one does."""
    try:
        wait_until(lambda: not group_alive(pgid), timeout_s, f"vLLM replica group {pgid} to exit", interval_s=0.1)
    except TimeoutError:
        os.killpg(pgid, signal.SIGKILL)  # a group this test's cluster launched
        pytest.fail(f"vLLM replica group {pgid} outlived the cluster")


def replica_url(rolloutd_pid: int) -> str:
    """The URL of the vLLM server rolloutd launched (its --host and --port)."""
    command = psutil.Process(server_pid(rolloutd_pid)).cmdline()
    return f"http://{command[command.index('--host') + 1]}:{command[command.index('--port') + 1]}"


async def serve_once(url: str, model_dir: Path, version: int, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Loads model_dir on the replica as the router does, then samples 8 tokens of prompt: (ids, logprobs)."""
    async with VLLMClient(url) as client:
        await client.update_weights_from_disk(str(model_dir), weight_version=str(version))
        request = GenerationRequest(tuple(prompt), SamplingParams(max_new_tokens=8, ignore_eos=True, seed=5))
        [result] = await client.generate(request)
    assert result.weight_version == str(version)
    return list(result.output_ids), list(result.output_token_logprobs)




@pytest.fixture(scope="module")
def replica_groups() -> list[int]:
    """The process groups of the module's vLLM servers (a server's pid is its group's id): none outlives the cluster."""
    return []


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path,
                 replica_groups: list[int]) -> Iterator[E2ECluster]:
    """The module's cluster: one traind slot, one rolloutd launching one vLLM replica at its first job."""
    rolloutd_args = vllm_rolloutd_args(_vllm_support())
    with running_cluster(tmp_path_factory.mktemp("vllm"), models_dir, engine_replicas=1, trainer_workers=1,
                         trainer_slots=1, rolloutd_args=rolloutd_args) as e2e:
        try:
            yield e2e
        finally:
            rolloutd = e2e.cluster.daemon("rolloutd-0")
            if rolloutd.alive():
                replica_groups.extend(descendant_pids(rolloutd.pid, VLLM_SERVER_MODULE))
    for pgid in replica_groups:  # rolloutd stopped the live replica; the supervisor killed what a SIGKILL left
        wait_group_gone(pgid)


# ----- refused at submission: what the registered rolloutd's vLLM replicas cannot serve ------------------------
def small_spec(models_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The signaling example, 2 steps of 4 x 4 (never run here: refused)."""
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw.update(total_steps=2, batch={"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}, **overrides)
    return raw


def test_what_the_vllm_replicas_cannot_serve_is_refused_at_submission(vllm_cluster: E2ECluster) -> None:
    """rolloutd publishes its replicas' limits in etcd (flexmarl.engine_limits); SubmitJob checks jobs against them."""
    e2e = vllm_cluster
    records = asyncio.run(registered_rolloutds(e2e))
    assert [r["engine_limits"] for r in records] == [
        {"backend": "vllm", "distributed_weight_sync": False, "reloads_tied_output_head": False}]
    distributed = untied(small_spec(e2e.models_dir, rollout={"weight_sync": "distributed"}), e2e.models_dir)
    with pytest.raises(InvalidArgument) as refused:
        e2e.client.submit(distributed, job_id="vllm-distributed")
    assert str(refused.value).startswith("rollout.weight_sync: 'distributed' is not supported on vllm replicas")
    assert "(rolloutd-0 runs vllm replicas)" in str(refused.value) and "\n" not in str(refused.value)
    tied = materialize_models(small_spec(e2e.models_dir), e2e.models_dir)  # the example's own models are tied
    with pytest.raises(InvalidArgument, match=r"^agents\[sender\]\.model: .* ties its output head to its embedding"):
        e2e.client.submit(tied, job_id="vllm-tied")
    assert not [job for job in e2e.client.list_jobs() if job.job_id in ("vllm-distributed", "vllm-tied")]
    assert not descendant_pids(e2e.cluster.daemon("rolloutd-0").pid, VLLM_SERVER_MODULE), "a refused job launched"


async def registered_rolloutds(e2e: E2ECluster) -> list[dict[str, Any]]:
    """The ``info`` of every rolloutd service record in etcd."""
    registry = Registry(e2e.cluster.etcd_endpoint, e2e.prefix)
    await registry.connect()
    try:
        return [record.info for record in await registry.list_services("rolloutd")]
    finally:
        await registry.close()


# ----- partial rollouts: interrupted in place, resumed, every experience consumed once ------------------------
PARTIAL_STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_partial_rollout_job_is_interrupted_in_place_and_trains_exactly_once(vllm_cluster: E2ECluster) -> None:
    """tests/e2e/test_partial_e2e.py's job on vLLM: at max_staleness 1 step 1's commit lands in batch 2's run.

    The interruption needs batch 2's generations to start before step 1 (training batch 1) commits:
    with 192-token messages step 1 took ~0.4 s and v2 came before batch 2 was sent (a plain reload, no
    interruption); with 384 the training step is longer than vLLM's reload of v1.
    """
    e2e = vllm_cluster
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw["agents"] = [a for a in raw["agents"] if a["name"] == "sender"]
    raw.update(total_steps=PARTIAL_STEPS, batch={"prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8},
               environment={"entrypoint": "long_solo:LongSolo",
                            "config": {"num_objects": 4, "long_message_tokens": 384}})
    spec = partial_spec(untied(raw, e2e.models_dir))
    started = time.monotonic()
    job_id = e2e.client.submit(spec)
    info = e2e.wait_job(job_id, timeout_s=180)
    assert_succeeded(e2e, info, PARTIAL_STEPS)
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    log_paths = [p.log_path for p in e2e.cluster.daemons.values() if p.kind == "rolloutd"]
    interrupted = interruptions(log_paths, job_id)
    assert interrupted.get("sender", 0) >= 1, f"no interruption of the sender: {interrupted}\n{e2e.log_tails()}"
    assert f"interrupted (in_place) to serve {job_id}/sender" in rolloutd_log(e2e)
    summaries = span_summaries({"sender": e2e.manifests(job_id, "sender")}, e2e.cluster.daemon("stored").address,
                               job_id, max_staleness=1)
    sender = summaries["sender"]
    assert sender.experiences == PARTIAL_STEPS * 8
    # vLLM's keep pause froze running generations, which went on under the new weights: two versions in one sample.
    assert sender.multi_span >= 1 and sender.tokens_newer_than_behaviour >= 1, (sender, interrupted)
    print(f"vLLM partial-rollout e2e: {time.monotonic() - started:.1f} s, {interrupted} interruptions, {sender}")


# ----- the signaling example learns, through a SIGKILL of its replica ----------------------------------------
#: examples/signaling/job.yaml reaches a mean reward >= 0.9 at step ~11 through the daemons (docs/examples.md);
#: on vLLM with the untied models at step 10, in each of four runs (docs/engines.md). Its 30 steps cut to 12.
LEARN_STEPS = 12
LEARNED = 0.9


def kill_replica_server(e2e: E2ECluster) -> tuple[int, list[psutil.Process]]:
    """SIGKILLs the vLLM server of rolloutd-0's replica: (its pid, which is its group's id; its engine core)."""
    killed = server_pid(e2e.cluster.daemon("rolloutd-0").pid)
    engine_core = psutil.Process(killed).children(recursive=True)
    assert engine_core, "vLLM's server has no engine-core child: the orphan check would be vacuous"
    assert all(os.getpgid(p.pid) == killed for p in engine_core), "the engine core left the replica's group"
    os.kill(killed, signal.SIGKILL)
    return killed, engine_core


def known_versions(e2e: E2ECluster, job_id: str, agent: dict[str, Any]) -> dict[int, Path]:
    """An agent's versions whose weights are on disk: its launch model (v0) and its retained commits."""
    commits = e2e.commits(job_id, agent["name"])
    published = {s + 1: weights_dir(c["weights_uri"]) for s, c in commits.items()}
    return {0: Path(agent["model"]), **{v: d for v, d in published.items() if d.is_dir()}}


def check_served_logprobs(e2e: E2ECluster, job_id: str, spec: dict[str, Any], checked: set[int]) -> float:
    """The experiences of the ``checked`` versions: their served logprobs equal the forward pass of the
    version each names. Returns the worst difference."""
    worst = 0.0
    steps = int(spec["total_steps"])
    for agent in spec["agents"]:
        name = agent["name"]
        commits = e2e.commits(job_id, name)
        versions = {0: Path(agent["model"]), **{s + 1: weights_dir(c["weights_uri"]) for s, c in commits.items()}}
        records: list[ExperienceRecord] = e2e.stored_experiences(job_id, name)
        served = {r.behavior_version for r in records}
        assert served == set(range(steps)), f"{name}: experiences of versions {served}"
        # Every experience of each checked version: each was served after a reload (the agents share the replica).
        for record in (r for r in records if r.behavior_version in checked):
            prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
            expected = forward_logprobs(versions[record.behavior_version], prompt, response)
            got = record.response_logprobs.tolist()
            worst = max(worst, *(abs(a - b) for a, b in zip(got, expected, strict=True)))
            if got != pytest.approx(expected, abs=LOGPROB_TOLERANCE):
                known = {f"{a['name']} v{v}": d for a in spec["agents"]
                         for v, d in known_versions(e2e, job_id, a).items()}
                matches = [k for k, d in known.items()
                           if got == pytest.approx(forward_logprobs(d, prompt, response), abs=LOGPROB_TOLERANCE)]
                pytest.fail(f"{record.experience_id} ({name} v{record.behavior_version}): served {got}, its forward "
                            f"pass {expected}; the served logprobs are those of {matches or 'no known version'}")
        record = next(r for r in records if r.behavior_version == steps - 1)  # not vacuous: the weights moved
        prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
        assert record.response_logprobs.tolist() != pytest.approx(forward_logprobs(versions[0], prompt, response),
                                                                  abs=1e-3), f"{name}: v{steps - 1} served as v0"
    return worst


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_signaling_example_learns_on_vllm_through_a_sigkilled_replica(vllm_cluster: E2ECluster,
                                                                         replica_groups: list[int]) -> None:
    e2e = vllm_cluster
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw["total_steps"] = LEARN_STEPS
    raw["checkpoint"] = {"keep_last": LEARN_STEPS + 1}  # the weights of the versions checked below
    spec = untied(raw, e2e.models_dir)
    started = time.monotonic()
    job_id = e2e.client.submit(spec)
    e2e.wait_for_commits(job_id, at_least=1, timeout_s=150)
    killed, engine_core = kill_replica_server(e2e)
    replica_groups.append(killed)
    killed_at = time.monotonic() - started

    info = e2e.wait_job(job_id, timeout_s=240)
    job_s = time.monotonic() - started
    assert_succeeded(e2e, info, LEARN_STEPS)
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    log = rolloutd_log(e2e)
    assert "relaunching" in log and "relaunched at" in log, f"no relaunch in rolloutd's log:\n{log[-3000:]}"
    # The supervisor SIGKILLed the rest of the killed server's group (its engine core) before relaunching.
    assert not group_alive(killed), f"the killed replica's group {killed} (engine core {engine_core}) lives on"
    assert server_pid(e2e.cluster.daemon("rolloutd-0").pid) != killed

    rewards: dict[int, dict[str, float]] = {}
    for row in e2e.client.history(job_id):
        rewards.setdefault(row.step, {})[row.agent] = row.reward_mean
    curve = [round(min(rewards[s].values()), 3) for s in sorted(rewards)]
    learned = [s for s in sorted(rewards) if min(rewards[s].values()) >= LEARNED]
    assert learned, f"no step with both agents' mean reward >= {LEARNED}: {curve}"

    # v0 and v1 around the SIGKILL (the relaunched replica starts on its launch weights), a middle one, the last.
    worst = check_served_logprobs(e2e, job_id, spec, {0, 1, LEARN_STEPS // 2, LEARN_STEPS - 1})
    url = replica_url(e2e.cluster.daemon("rolloutd-0").pid)
    for agent in info.agents:  # each final version, loaded on the replica, serves the forward pass's logprobs
        model_dir = weights_dir(agent.weights_uri)
        prompt = list(b"b")
        ids, logprobs = asyncio.run(serve_once(url, model_dir, agent.version, prompt))
        assert logprobs == pytest.approx(forward_logprobs(model_dir, prompt, ids), abs=LOGPROB_TOLERANCE)
    print(f"vLLM signaling e2e: killed at {killed_at:.1f} s, job end at {job_s:.1f} s, "
          f"{time.monotonic() - started:.1f} s in all; reward >= {LEARNED} first at step {learned[0]}, "
          f"min over agents per step {curve}; max |served - forward| logprob {worst:.2e}")


# ----- strict mode: sync and async (max_staleness 0) on vLLM -------------------------------------------------
def experiences_by_id(e2e: E2ECluster, job_id: str, agent: str) -> dict[str, ExperienceRecord]:
    """An agent's experiences keyed by their id without the job id (the same task, sample and turn in two jobs)."""
    return {r.experience_id.removeprefix(job_id + "/"): r for r in e2e.stored_experiences(job_id, agent)}


#: Two shapes: DenseSignaling (two agents, 1-token turns) and LongSolo (one agent, 64-token messages: decode batches).
STRICT_SHAPES = {
    "dense-signaling": ({"entrypoint": "dense_signaling:DenseSignaling", "config": {"num_objects": 4}}, None),
    "long-solo": ({"entrypoint": "long_solo:LongSolo", "config": {"num_objects": 4, "long_message_tokens": 64}},
                  "sender"),
}


@pytest.mark.long
@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", sorted(STRICT_SHAPES))
def test_strict_sync_and_async_on_vllm_train_equal_parameters(vllm_cluster: E2ECluster, shape: str) -> None:
    """The equivalence finding of docs/engines.md: the same tokens, served logprobs and parameters, bit for bit."""
    e2e = vllm_cluster
    environment, only = STRICT_SHAPES[shape]
    raw = small_spec(e2e.models_dir, environment=environment)
    raw["agents"] = [a for a in raw["agents"] if only is None or a["name"] == only]
    spec = untied(raw, e2e.models_dir)
    jobs = {mode: e2e.client.submit(dict(spec, pipeline=pipeline), job_id=f"vllm-strict-{shape}-{mode}")
            for mode, pipeline in (("sync", {"mode": "sync"}), ("async", {"mode": "async", "max_staleness": 0}))}
    infos = {mode: e2e.wait_job(job_id, timeout_s=300) for mode, job_id in jobs.items()}
    for info in infos.values():
        assert_succeeded(e2e, info, int(spec["total_steps"]))
    report = []
    for agent in (a["name"] for a in spec["agents"]):
        sync, async_ = (experiences_by_id(e2e, jobs[mode], agent) for mode in ("sync", "async"))
        assert sync.keys() == async_.keys() and sync, agent
        tokens = [i for i in sync if sync[i].response_token_ids.tolist() != async_[i].response_token_ids.tolist()]
        logprobs = [i for i in sync if sync[i].response_logprobs.tolist() != async_[i].response_logprobs.tolist()]
        final = {mode: checkpoint_tensors(weights_dir(next(a.weights_uri for a in infos[mode].agents
                                                              if a.agent == agent))) for mode in infos}
        unequal = [n for n in final["sync"] if not torch.equal(final["sync"][n], final["async"][n])]
        report.append(f"{agent}: {len(sync)} experiences ({sum(r.response_tokens for r in sync.values())} tokens), "
                      f"{len(tokens)} with other tokens, {len(logprobs)} with other logprobs, {len(unequal)} of "
                      f"{len(final['sync'])} tensors unequal")
        assert not tokens and not logprobs and not unequal, report[-1]
    print(f"vLLM strict sync vs async, {shape}: " + "; ".join(report))


# ----- LoRA agents beside a full-model agent (last: on a replica relaunched with LoRA on) -------------------
LORA_STEPS = MIXED_STEPS


def relaunch_rolloutd(e2e: E2ECluster, replica_groups: list[int]) -> None:
    """Restarts rolloutd-0 if it launched a replica (SIGTERM stops it), so its next job launches a fresh one."""
    rolloutd = e2e.cluster.daemon("rolloutd-0")
    servers = descendant_pids(rolloutd.pid, VLLM_SERVER_MODULE)
    if not servers:
        return
    replica_groups.extend(servers)
    rolloutd.terminate()
    rolloutd.restart()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lora_agents_and_a_full_model_agent_train_on_vllm(vllm_cluster: E2ECluster, replica_groups: list[int]) -> None:
    e2e = vllm_cluster
    relaunch_rolloutd(e2e, replica_groups)  # its next job launches the replica, with this job's LoRA flags
    spec = mixed_spec(e2e.models_dir, UNTIED_BASE, "vllm-lora-mixed")
    base = Path(spec["agents"][0]["model"])
    before = checkpoint_tensors(base)
    started = time.monotonic()
    job_id = e2e.client.submit(spec)
    info = e2e.wait_job(job_id, timeout_s=180)
    assert_succeeded(e2e, info, LORA_STEPS)
    assert_one_commit_per_step(e2e, job_id, spec)
    assert_exactly_once(e2e, job_id, spec)
    after = checkpoint_tensors(base)
    assert all(torch.equal(before[k], after[k]) for k in before), "the base checkpoint changed on disk"

    published = {a.agent: weights_dir(a.weights_uri) for a in info.agents}
    observer = checkpoint_tensors(published["observer"])
    assert any(not torch.equal(observer[k], before[k]) for k in before if k in observer), "observer untrained"
    for agent in ("sender0", "receiver0"):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in published[agent].iterdir()}
        adapter = checkpoint_tensors(published[agent])
        assert any(bool(t.abs().sum() > 0) for n, t in adapter.items() if "lora_B" in n), f"{agent} untrained"
        # vLLM served each adapter version's logprobs (v0: the base alone; v1 an adapter directory).
        commits = e2e.commits(job_id, agent)
        adapters = {0: None, **{step + 1: weights_dir(c["weights_uri"]) for step, c in commits.items()}}
        records = e2e.stored_experiences(job_id, agent)
        versions = {r.behavior_version for r in records}
        assert versions == set(range(LORA_STEPS)), f"{agent}: experiences of versions {versions}"
        for record in records:
            expected = peft_logprobs(base, adapters[record.behavior_version], record)
            got = record.response_logprobs.tolist()
            assert got == pytest.approx(expected, abs=LOGPROB_TOLERANCE), f"{agent} v{record.behavior_version}"
        record = next(r for r in records if r.behavior_version == 1)  # not vacuous: v1's adapter changes them
        base_alone = peft_logprobs(base, None, record)
        assert record.response_logprobs.tolist() != pytest.approx(base_alone, abs=1e-3), f"{agent}: v1 served as v0"
    print(f"vLLM LoRA e2e: {time.monotonic() - started:.1f} s from submission (the replica's start included)")
