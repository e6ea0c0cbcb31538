"""The word-problem workflow examples through the daemons, in a short form.

examples/word_problems/job_solver_verifier.yaml and job_debate.yaml, submitted together to the
session's cluster with 1 step of 2 tasks x 2 episodes and one held-out round of 2 tasks, without
the examples' warm starts: the full path (submit's preflight over the dataset, rolloutd playing each
workflow over the file's rows with its rewards, traind's GRPO step per agent, the held-out round
reading the workflow's notes), not learning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import REPO_ROOT, E2ECluster, assert_succeeded

from flexmarl.cli import materialize_models
from flexmarl.jobspec import resolve_dataset_paths

EXAMPLES = REPO_ROOT / "examples" / "word_problems"


def short_form(job: Path, models_dir: Path) -> dict[str, Any]:
    """The example job with 1 step of 2 tasks x 2 episodes, without its warm starts.

    Its tiny models keep the examples' default shape: the session cluster's engine replica was
    launched for the first job it served and refuses weights of another shape (a shrunk model
    failed here when another test's job had come first).
    """
    spec: dict[str, Any] = resolve_dataset_paths(yaml.safe_load(job.read_text()), job.parent)
    spec["total_steps"] = 1
    spec["batch"] = {"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4}
    spec["evaluation"] = {**spec["evaluation"], "tasks": 2, "before_training": False}  # one round, at the end
    for agent in spec["agents"]:  # no warm start: the CI form stays as short as before it had one
        agent.pop("warm_start", None)  # (its data functions: tests/rolloutd/test_workflows.py)
    return materialize_models(spec, models_dir)


@pytest.mark.timeout(180)
def test_the_word_problem_workflows_train_through_the_daemons(shared_cluster: E2ECluster) -> None:
    e2e = shared_cluster
    specs = {name: short_form(EXAMPLES / f"job_{name}.yaml", e2e.models_dir) for name in ("solver_verifier", "debate")}
    jobs = {name: e2e.client.submit(spec) for name, spec in specs.items()}
    for job_id in jobs.values():
        assert_succeeded(e2e, e2e.wait_job(job_id), 1)
    questions = {json.loads(line)["question"] for line in (EXAMPLES / "train.jsonl").read_text().splitlines()}
    for name, job_id in jobs.items():
        for agent in (a["name"] for a in specs[name]["agents"]):
            records = e2e.stored_experiences(job_id, agent)
            assert len({r.task_id for r in records}) == 2 and {r.sample_index for r in records} == {0, 1}
            # numeric_match scores 0 or 1 (a verifier's first verdict also earns its later one's: 2).
            assert {r.reward for r in records} <= {0.0, 1.0, 2.0}, (name, agent)
            prompts = {bytes(r.prompt_token_ids[r.prompt_token_ids < 256].astype("uint8")).decode() for r in records}
            assert all(any(p.startswith(q) for q in questions) for p in prompts), prompts  # rows of the file
    roles = {"solver_verifier": {"solver", "verifier"}, "debate": {"debater", "judge"}}
    for name, job_id in jobs.items():
        (record,) = e2e.client.evaluations(job_id)  # the final version's held-out round: the workflow's notes
        assert record.tasks == 2 and record.team_success_from_env, record
        assert set(record.role_correct) == roles[name] and all(0 <= v <= 1 for v in record.role_correct.values())
