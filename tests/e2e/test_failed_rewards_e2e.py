"""A reward that raises on some rows and times out on others, through the daemons: the job trains on.

One step of a two-agent ``mixture`` workflow over three rows (3 tasks x 3 episodes), scored by
failing_rewards:by_row: every episode of the ``raise`` row and of the ``hang`` row fails (both
tasks are given up), one episode of the ``once`` row fails (its other two train). The job
succeeds; the 7 failed episodes are counted with their reasons (status, the step's history record and
manifest, metrics, logs) and none of them is stored or trained. Its held-out round gives the ``raise`` row's eval
task up at once and records the other.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from e2e_support import E2ECluster, assert_succeeded, metric_sum, rolloutd_log

from flexmarl import cli
from flexmarl.cli import materialize_models

REWARD = "failing_rewards:by_row"


def mixture_spec(models_dir: Path, marker: Path) -> dict[str, Any]:
    """A proposer and an aggregator (the shared cluster's tiny model shape), 1 step of 3 tasks x 3 episodes."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 2, "stop_token_ids": []}
    rows = [{"question": "1+1", "answer": "raise"}, {"question": "2+2", "answer": "hang"},
            {"question": "3+3", "answer": f"once:{marker}"}]
    raw = {
        "name": "failing-rewards", "seed": 0, "total_steps": 1,
        "environment": {"entrypoint": "flexmarl.workflows:Mixture", "config": {
            "proposers": ["proposer"], "chat": False, "tasks": rows, "reward_timeout_s": 1.0,
            "eval_tasks": [rows[0], {"question": "4+4", "answer": "8"}],
            "reward": {"function": REWARD, "field": "answer"},
            "prompts": {"propose": "{question}=", "aggregate": "{question} {proposals}="}}},
        "agents": [{"name": "proposer", "model": "tiny://qwen2?seed=1", "sampling": sampling},
                   {"name": "aggregator", "model": "tiny://qwen2?seed=2", "sampling": sampling}],
        "algorithm": {"name": "grpo"},
        "batch": {"prompts_per_step": 3, "group_size": 3, "micro_batch_size": 6},
        "pipeline": {"mode": "async", "max_staleness": 0},
        "evaluation": {"every_versions": 1, "tasks": 2, "before_training": False},
        "leases": {"rollout_timeout_s": 120, "train_timeout_s": 300},
    }
    return materialize_models(raw, models_dir)


def counts(e2e: E2ECluster) -> tuple[float, float, float]:
    """orchestratord's failed episodes, given-up training and eval task reports so far (the session cluster's)."""
    text = e2e.metrics_text("orchestratord")

    def given_up(kind: str) -> float:
        return metric_sum(text, "flexmarl_orchestratord_rollout_tasks_reported_total",
                          lambda series: 'outcome="given_up"' in series and f'kind="{kind}"' in series)

    return metric_sum(text, "flexmarl_orchestratord_episodes_failed_total"), given_up("train"), given_up("eval")


def cli_output(e2e: E2ECluster, *args: str) -> str:
    """What ``flexmarl ARGS`` prints, run in this process against the cluster."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "--etcd", e2e.cluster.etcd_endpoint, "--etcd-prefix", e2e.prefix]) == 0
    return out.getvalue()


@pytest.mark.timeout(180)
def test_episodes_whose_reward_raises_or_times_out_are_dropped_and_the_job_succeeds(
        shared_cluster: E2ECluster, tmp_path: Path) -> None:
    e2e = shared_cluster
    before = counts(e2e)
    job_id = e2e.client.submit(mixture_spec(e2e.models_dir, tmp_path / "once"))
    info = e2e.wait_job(job_id)
    assert_succeeded(e2e, info, 1)
    assert (info.episodes_failed, info.tasks_given_up) == (7, 2), info
    assert f"reward '{REWARD}'" in info.last_episode_failure
    # Given up: the raise and hang rows' training tasks, and the raise row's eval task (counted apart).
    assert tuple(after - earlier for after, earlier in zip(counts(e2e), before, strict=True)) == (7, 2, 1)
    status = cli_output(e2e, "status", job_id)
    assert "succeeded  tasks 1/3 (2 given up)" in status and "failed rewards: 7 episodes dropped, 2 tasks" in status
    log = rolloutd_log(e2e)
    assert f"reward '{REWARD}' raised RuntimeError: this row's reference cannot be read" in log
    assert f"reward '{REWARD}' timed out after 1 s" in log
    assert f"reward '{REWARD}' raised RuntimeError: the first call of this row fails" in log
    # Only the once row's task trained, on its two episodes that scored; nothing failed was stored.
    for agent in ("proposer", "aggregator"):
        stored = e2e.stored_experiences(job_id, agent)
        (task,) = {r.task_id for r in stored}
        assert len({r.sample_index for r in stored}) == 2 and all(r.group_size == 3 for r in stored)
        manifest = e2e.manifests(job_id, agent)[0]
        assert sorted(manifest["experience_ids"]) == sorted(r.experience_id for r in stored)
        assert manifest["step_episodes"] == 2
        assert (manifest["failures"]["episodes_failed"], manifest["failures"]["tasks_given_up"]) == (7, 2)
    # The step's history record (each agent's) carries its failures, bounded: counts, the first and last reason.
    for row in e2e.client.history(job_id):
        assert (row.episodes, row.episodes_failed, row.tasks_given_up) == (2, 7, 2), row
        assert f"reward '{REWARD}'" in row.first_failure and " given up: " in row.last_failure, row
    csv_rows = cli_output(e2e, "history", job_id, "--csv").splitlines()
    assert csv_rows[0].split(",")[13:17] == ["episodes_failed", "tasks_given_up", "first_failure", "last_failure"]
    assert all(line.split(",")[13:15] == ["7", "2"] for line in csv_rows[1:]) and len(csv_rows) == 3
    # The held-out round after the step: the raise row's eval task is given up at its first attempt.
    (record,) = e2e.client.evaluations(job_id)
    assert (record.tasks, record.failed_tasks) == (2, 1), record
