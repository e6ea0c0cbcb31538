"""The daemons on vLLM: the small signaling job with rolloutd's one engine replica a real vLLM 0.32 server.

rolloutd launches the replica itself (``--engine-backend vllm --vllm-python ...``) on the job's
first model and swaps the two agents' weights on it with vLLM's ``reload_weights`` as their
turns come. The models are untied tiny Qwen2s (``tie=0``): vLLM on CPU does not reload a tied
output head (docs/engines.md). Checks: the job succeeds with one commit per step and every
experience consumed once; the logprobs vLLM served (recorded in every experience) equal a
transformers forward pass of the weights the experience names (its agent's behaviour version: the
launch model or a published checkpoint), so every reload the daemon made served what it named;
after the job, each agent's final version loaded on the replica serves the forward pass's logprobs.
A second test SIGKILLs the replica's server mid-job: rolloutd's supervisor kills what is left of
its process group (vLLM's engine core) and relaunches it, and the job still ends with every step
committed once and every experience consumed once.

In CI (``CI=true``) a missing vLLM fails the test; elsewhere it skips (tests/rolloutd/vllm_support.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import shlex
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import torch
import yaml
from e2e_support import (
    DENSE_ENV,
    SIGNALING_JOB,
    assert_exactly_once,
    assert_one_commit_per_step,
    assert_succeeded,
    rolloutd_log,
    running_cluster,
    weights_dir,
)

from flexmarl.cli import materialize_models
from flexmarl.cluster import descendant_pids, wait_until
from flexmarl.experience import ExperienceRecord
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


STEPS = 2
#: Served logprobs (batched, KV-cached fp32 decode) against one fp32 forward pass.
LOGPROB_TOLERANCE = 1e-4
UNTIED = {"sender": "tiny://qwen2?seed=1&tie=0", "receiver": "tiny://qwen2?seed=2&tie=0"}


def vllm_spec(models_dir: Path, steps: int = STEPS) -> dict[str, Any]:
    """e2e_support.small_signaling_spec with untied models (the same job otherwise)."""
    raw: dict[str, Any] = yaml.safe_load(SIGNALING_JOB.read_text())
    raw["total_steps"] = steps
    raw["batch"] = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}
    raw["environment"] = {"entrypoint": DENSE_ENV, "config": {"num_objects": 4}}
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
    return ["--engine-backend", "vllm", "--vllm-python", python, "--no-engine-deterministic-inference",
            f"--engine-extra-args={shlex.join(support.VLLM_TEST_ARGS)}"]


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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_signaling_job_on_a_vllm_replica(tmp_path: Path) -> None:
    rolloutd_args = vllm_rolloutd_args(_vllm_support())
    models_dir = tmp_path / "models"
    spec = vllm_spec(models_dir)
    started = time.monotonic()
    with running_cluster(tmp_path / "run", models_dir, engine_replicas=1, trainer_workers=1, trainer_slots=1,
                         rolloutd_args=rolloutd_args) as e2e:
        job_id = e2e.client.submit(spec)
        info = e2e.wait_job(job_id, timeout_s=180)
        job_s = time.monotonic() - started
        assert_succeeded(e2e, info, STEPS)
        assert_one_commit_per_step(e2e, job_id, spec)
        assert_exactly_once(e2e, job_id, spec)

        worst = 0.0
        finals: dict[str, tuple[Path, int]] = {}
        for agent in spec["agents"]:
            name = agent["name"]
            commits = e2e.commits(job_id, name)
            versions = {0: Path(agent["model"]), **{s + 1: weights_dir(c["weights_uri"]) for s, c in commits.items()}}
            finals[name] = (versions[STEPS], STEPS)
            records: list[ExperienceRecord] = e2e.stored_experiences(job_id, name)
            served = {r.behavior_version for r in records}
            assert served == set(range(STEPS)), f"{name}: experiences of versions {served}"
            for record in records:  # every one: each was served after some reload (the agents share the replica)
                prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
                expected = forward_logprobs(versions[record.behavior_version], prompt, response)
                got = record.response_logprobs.tolist()
                worst = max(worst, *(abs(a - b) for a, b in zip(got, expected, strict=True)))
                assert got == pytest.approx(expected, abs=LOGPROB_TOLERANCE), f"{name} v{record.behavior_version}"
            record = next(r for r in records if r.behavior_version == 1)
            prompt, response = record.prompt_token_ids.tolist(), record.response_token_ids.tolist()
            before = forward_logprobs(versions[0], prompt, response)
            assert record.response_logprobs.tolist() != pytest.approx(before, abs=1e-3), f"{name}: v1 served as v0"

        url = replica_url(e2e.cluster.daemon("rolloutd-0").pid)
        for name, (model_dir, version) in finals.items():
            prompt = list(b"obj:abcd msg:")
            ids, logprobs = asyncio.run(serve_once(url, model_dir, version, prompt))
            expected = forward_logprobs(model_dir, prompt, ids)
            worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, expected, strict=True)))
            assert logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE), f"{name}: final v{version}"
    print(f"vLLM e2e: cluster start to job end {job_s:.1f} s, {time.monotonic() - started:.1f} s in all; "
          f"max |served - forward| logprob {worst:.2e}")


KILLED_STEPS = 4


def wait_group_gone(pgid: int, timeout_s: float = 20.0) -> None:
    """Waits until no process of the group lives; SIGKILLs the group and fails the test if one does."""
    try:
        wait_until(lambda: not group_alive(pgid), timeout_s, f"vLLM replica group {pgid} to exit", interval_s=0.1)
    except TimeoutError:
        os.killpg(pgid, signal.SIGKILL)  # a group this test's cluster launched
        pytest.fail(f"vLLM replica group {pgid} outlived the cluster")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_vllm_replica_sigkilled_mid_job_is_relaunched_and_nothing_is_lost(tmp_path: Path) -> None:
    rolloutd_args = vllm_rolloutd_args(_vllm_support())
    models_dir = tmp_path / "models"
    spec = vllm_spec(models_dir, KILLED_STEPS)
    groups: list[int] = []  # every replica server's pid, which is its process group's id
    started = time.monotonic()
    try:
        with running_cluster(tmp_path / "run", models_dir, engine_replicas=1, trainer_workers=1, trainer_slots=1,
                             rolloutd_args=rolloutd_args) as e2e:
            rolloutd_pid = e2e.cluster.daemon("rolloutd-0").pid
            job_id = e2e.client.submit(spec)
            e2e.wait_for_commits(job_id, at_least=1, timeout_s=150)
            killed = server_pid(rolloutd_pid)
            groups.append(killed)
            engine_core = psutil.Process(killed).children(recursive=True)
            assert engine_core, "vLLM's server has no engine-core child: the orphan check would be vacuous"
            assert all(os.getpgid(p.pid) == killed for p in engine_core), "the engine core left the replica's group"
            os.kill(killed, signal.SIGKILL)
            killed_at = time.monotonic() - started

            info = e2e.wait_job(job_id, timeout_s=180)
            job_s = time.monotonic() - started
            assert_succeeded(e2e, info, KILLED_STEPS)
            assert_one_commit_per_step(e2e, job_id, spec)
            assert_exactly_once(e2e, job_id, spec)
            log = rolloutd_log(e2e)
            assert "relaunching" in log and "relaunched at" in log, f"no relaunch in rolloutd's log:\n{log[-3000:]}"
            # The supervisor SIGKILLed the rest of the killed server's group (its engine core) before relaunching.
            assert not group_alive(killed), f"the killed replica's group {killed} (engine core {engine_core}) lives on"
            relaunched = server_pid(rolloutd_pid)
            assert relaunched != killed
            groups.append(relaunched)
    finally:
        for pgid in groups:  # nothing of this test's vLLM replicas outlives it (rolloutd stops the live one)
            wait_group_gone(pgid)
    print(f"vLLM replica SIGKILL e2e: killed at {killed_at:.1f} s, cluster start to job end {job_s:.1f} s, "
          f"{time.monotonic() - started:.1f} s in all")
