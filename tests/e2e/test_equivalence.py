"""DESIGN §3 equivalence: with max_staleness 0 the async pipeline trains what sync mode trains, bit for bit.

Small jobs on the session cluster (one traind slot shared by every agent, one engine replica):
both examples, one-token, multi-token and multi-turn episodes, one and several groups per
micro-batch with a remainder, ``seq-mean`` with KL and entropy terms. Every job runs twice, in
``sync`` and in ``async`` with ``max_staleness: 0``; each pair must end with **equal**
parameters (``torch.equal`` on every tensor). CI runs one seed per shape;
``python -m benchmarks.equivalence`` runs the whole matrix (three seeds of each shape, and the
two-slot cluster) and prints the max |diff| of every pair.

Why they can be equal: both runs train on the same set of GRPO groups from the same parameters,
and traind sums group gradients exactly (``traind/accumulation.py``), so arrival order,
micro-batch cut and data-parallel split cannot change a bit. An fp32 arrival-order sum is not
enough: Adam turns rounding noise on a ~0 gradient into a step of about the learning rate.
The two-slot and data-parallel cases are in test_data_parallel_binding.py (a cluster of two slots).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from e2e_support import REPO_ROOT, E2ECluster, assert_succeeded, small_signaling_spec, weights_dir

from flexmarl.artifacts import checkpoint_tensors
from flexmarl.cli import materialize_models

STEPS = 2
WORKFLOW_JOB = REPO_ROOT / "examples" / "workflow" / "job.yaml"


def workflow_spec(models_dir: Path, seed: int, **overrides: Any) -> dict[str, Any]:
    """The workflow example (3 agents, multi-token turns), shrunk: 3 tasks x 2 episodes, 2 groups per micro-batch."""
    raw: dict[str, Any] = yaml.safe_load(WORKFLOW_JOB.read_text())
    raw["seed"] = seed
    raw["total_steps"] = STEPS
    raw["environment"]["config"] = {"max_operand": 9, "planner_tokens": 2, "solver_tokens": 6, "verifier_tokens": 1}
    for agent in raw["agents"]:
        agent["sampling"]["max_new_tokens"] = raw["environment"]["config"][f"{agent['name']}_tokens"]
        agent["max_slots"] = 1
    # 3 tasks, 2 groups per micro-batch: a micro-batch of 2 groups and one of the remaining group.
    raw["batch"] = {"prompts_per_step": 3, "group_size": 2, "micro_batch_size": 4}
    raw["leases"] = {"rollout_timeout_s": 120, "train_timeout_s": 300}
    raw.update(overrides)
    return materialize_models(raw, models_dir)


def dialogue_spec(models_dir: Path, seed: int) -> dict[str, Any]:
    """Two rounds per episode (two multi-token turns per agent), one group per micro-batch, seq-mean + KL + entropy."""
    dialogue = small_signaling_spec(models_dir, seed=seed, total_steps=STEPS)
    dialogue["environment"] = {"entrypoint": "dense_dialogue:DenseDialogue", "config": {"num_objects": 4}}
    dialogue["batch"] = {"prompts_per_step": 3, "group_size": 2, "micro_batch_size": 2}  # one group each
    dialogue["algorithm"] = {**dialogue["algorithm"], "loss_agg": "seq-mean", "kl_coef": 0.05, "entropy_coef": 0.01}
    for agent in dialogue["agents"]:
        agent["sampling"]["max_new_tokens"] = 3
    return dialogue


def cases(models_dir: Path, seeds: tuple[int, ...] = (0,)) -> dict[str, dict[str, Any]]:
    """The one-slot matrix: each shape at each seed."""
    out: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        out[f"signaling-s{seed}"] = small_signaling_spec(models_dir, seed=seed, total_steps=STEPS)
        out[f"dialogue-s{seed}"] = dialogue_spec(models_dir, seed)
        out[f"workflow-s{seed}"] = workflow_spec(models_dir, seed)
    return out


def run_pair(e2e: E2ECluster, name: str, spec: dict[str, Any]) -> tuple[dict[str, dict[str, torch.Tensor]], ...]:
    """The job in sync mode, then in async with max_staleness 0: the final parameters of each."""
    e2e.client.submit(dict(spec, pipeline={"mode": "sync"}), job_id=f"eq-{name}-sync")
    sync = _final(e2e, f"eq-{name}-sync")
    e2e.client.submit(copy.deepcopy(dict(spec, pipeline={"mode": "async", "max_staleness": 0})),
                      job_id=f"eq-{name}-async")
    return sync, _final(e2e, f"eq-{name}-async")


def _final(e2e: E2ECluster, job_id: str) -> dict[str, dict[str, torch.Tensor]]:
    info = e2e.wait_job(job_id, timeout_s=240)
    assert_succeeded(e2e, info, STEPS)
    return {agent.agent: checkpoint_tensors(weights_dir(agent.weights_uri)) for agent in info.agents}


def assert_equal_and_trained(name: str, sync: dict[str, dict[str, torch.Tensor]],
                             async_: dict[str, dict[str, torch.Tensor]], spec: dict[str, Any]) -> None:
    """Every tensor of every agent equal in both runs, and the training moved some parameter of each agent."""
    assert sync.keys() == async_.keys() == {a["name"] for a in spec["agents"]}, name
    for agent, expected in sync.items():
        initial = checkpoint_tensors(Path(next(a["model"] for a in spec["agents"] if a["name"] == agent)))
        actual = async_[agent]
        assert expected.keys() == actual.keys(), f"{name}/{agent}"
        unequal = {t: float((actual[t] - expected[t]).abs().max()) for t in expected
                   if not torch.equal(actual[t], expected[t])}
        assert not unequal, f"{name}/{agent}: sync and async differ (max |diff| per tensor): {unequal}"
        # Not vacuous: the training changed the parameters being compared (lm_head may be tied).
        assert any(not torch.equal(expected[t], initial[t]) for t in expected if t in initial), \
            f"{name}/{agent}: {STEPS} steps left every parameter at its initial value"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["signaling-s0", "dialogue-s0", "workflow-s0"])
def test_async_with_zero_staleness_trains_bit_for_bit_what_sync_trains(shared_cluster: E2ECluster, name: str) -> None:
    spec = cases(shared_cluster.models_dir)[name]
    sync, async_ = run_pair(shared_cluster, name, spec)
    assert_equal_and_trained(name, sync, async_, spec)
    shared_cluster.wait_finished_in_store(f"eq-{name}-sync")  # GC on request may now reclaim its rows
