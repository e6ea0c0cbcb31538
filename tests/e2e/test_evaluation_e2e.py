"""Held-out evaluation through the daemons: rounds at versions beside training, never trained on."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from e2e_support import E2ECluster, assert_succeeded

from flexmarl import cli
from flexmarl.cluster import wait_until
from flexmarl.errors import InvalidArgument
from flexmarl.ids import ExperienceKey, TaskRef

EVAL_TASKS = 3


@pytest.mark.timeout(240)
def test_held_out_rounds_record_the_start_and_each_version_and_are_never_trained_on(
        shared_cluster: E2ECluster, tmp_path: Path) -> None:
    e2e = shared_cluster
    spec = e2e.spec(environment={"entrypoint": "held_out_signaling:HeldOutSignaling", "config": {"num_objects": 4}},
                    evaluation={"every_versions": 2, "tasks": EVAL_TASKS, "before_training": True},
                    tracking={"trackers": ["jsonl"], "dir": str(tmp_path / "tracking")},
                    batch={"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4})
    job_id = e2e.client.submit(spec)
    info = e2e.wait_job(job_id)
    assert_succeeded(e2e, info, spec["total_steps"])

    records = e2e.client.evaluations(job_id)
    # before_training (0) and the final version (2, also a multiple of every_versions).
    assert [(r.round_id, r.version) for r in records] == [("v0", 0), ("v2", 2)]
    start = records[0]
    assert {a.agent: (a.version, a.versions_seen) for a in start.agents} == {"sender": (0, (0,)),
                                                                           "receiver": (0, (0,))}
    for record in records:
        assert (record.tasks, record.samples_per_task, record.failed_tasks, record.sampling) == (
            EVAL_TASKS, 1, 0, "greedy")
        for agent in record.agents:
            assert agent.version >= record.version and min(agent.versions_seen) >= agent.version
        # By hand (held_out_signaling.py): tasks 0, 1, 2; the sender succeeds on 0 and 2, the receiver's 0.5
        # never reaches the threshold 1.0, the team (its note) on task 0 only.
        sender, receiver = record.scores_of("sender"), record.scores_of("receiver")
        assert (sender.reward_mean, sender.success, sender.pass_at_k, sender.episodes) == (2 / 3, 2 / 3, 2 / 3, 3)
        assert (receiver.reward_mean, receiver.success) == (0.5, 0.0)
        assert record.team.success == pytest.approx(1 / 3) and record.team_success_from_env
        assert record.team.reward_mean == pytest.approx((0.75 + 0.25 + 0.75) / 3)
        assert record.role_correct == {"solver": pytest.approx(2 / 3)}

    # Never trained on: no manifest and no stored experience belongs to an eval task.
    for agent in ("sender", "receiver"):
        for manifest in e2e.manifests(job_id, agent).values():
            for eid in manifest["experience_ids"]:
                TaskRef.parse(ExperienceKey.parse(eid).task_id)
        for ref in e2e.stored_refs(job_id, agent):
            TaskRef.parse(ExperienceKey.parse(ref.experience_id).task_id)

    # The CLI's history and the trackers show the rounds.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["history", job_id, "--eval", "--csv", "--etcd", e2e.cluster.etcd_endpoint,
                         "--etcd-prefix", e2e.prefix]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("round,version,scope,") and len(lines) == 1 + 2 * 3  # 2 rounds x (2 agents + team)
    assert any(line.startswith("v2,2,team,") for line in lines)
    metrics = tmp_path / "tracking" / job_id / "metrics.jsonl"

    def team_rows() -> list[dict[str, float]]:
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        return [row for row in rows if row["agent"] == "team"]

    wait_until(lambda: len(team_rows()) == 2, 30, "the team's evaluation figures in metrics.jsonl")
    assert [row["step"] for row in team_rows()] == [0, 2]
    # On demand, after the end: version 1 of the sender (kept: checkpoint.keep_last 3), the receiver's last.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["eval", job_id, "--agent-versions", "sender=1", "--tasks", "2", "--csv", "--timeout", "120",
                         "--etcd", e2e.cluster.etcd_endpoint, "--etcd-prefix", e2e.prefix]) == 0
    rows = {line.split(",")[2]: line.split(",") for line in out.getvalue().splitlines()[1:]}
    assert rows["sender"][:5] == ["d1", "1", "sender", "1", "1"]  # round, version, scope, asked, seen
    assert rows["receiver"][3:5] == ["2", "2"]
    assert float(rows["sender"][6]) == 0.5 and float(rows["team"][6]) == 0.5  # success on task 0 of 0, 1
    # On demand over a task file's rows: both rows say held_out 1 (odd: no sender success, no team success).
    task_file = tmp_path / "held_out.jsonl"
    task_file.write_text("".join(json.dumps({"candidates": "abcd", "target": t, "held_out": 1}) + "\n"
                                 for t in (0, 3)))
    record = e2e.client.wait_evaluation(job_id, e2e.client.evaluate(job_id, dataset=task_file), timeout_s=120)
    assert (record.round_id, record.tasks, record.eval_file) == ("d2", 2, str(task_file))
    assert (record.scores_of("sender").success, record.team.success, record.scores_of("receiver").reward_mean) == (
        0.0, 0.0, 0.5)
    assert [a.versions_seen for a in record.agents] == [(2,), (2,)]
    assert [r.round_id for r in e2e.client.evaluations(job_id) if r.on_demand] == ["d1", "d2"]
    # A curve of pinned rounds over the kept versions (keep_last 3 of 2 steps: all of them), through the CLI
    assert e2e.client.kept_team_versions(job_id) == [0, 1, 2]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["eval", job_id, "--versions", "kept", "--tasks", "1", "--csv", "--timeout", "120",
                         "--etcd", e2e.cluster.etcd_endpoint, "--etcd-prefix", e2e.prefix]) == 0
    rows = [line.split(",") for line in out.getvalue().splitlines()[1:]]
    # per round: sender, receiver, team; each agent asked and played exactly the round's version
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows if r[2] != "team"] == [
        (f"d{3 + v}", str(v), agent, str(v), str(v)) for v in (0, 1, 2) for agent in ("sender", "receiver")]
    # A round's own sampling, whatever the job's evaluation says (greedy, 1), and what is refused at the boundary
    for bad in ({"sampling": "hot"}, {"samples_per_task": 2000}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            e2e.client.evaluate(job_id, tasks=1, **bad)  # type: ignore[arg-type]
    record = e2e.client.wait_evaluation(job_id, e2e.client.evaluate(job_id, tasks=1, sampling="policy",
                                                                    samples_per_task=2), timeout_s=120)
    assert (record.round_id, record.sampling, record.samples_per_task, record.team.episodes) == ("d6", "policy", 2, 2)

    png = tmp_path / "plot.png"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["plot", job_id, "--out", str(png), "--etcd", e2e.cluster.etcd_endpoint,
                         "--etcd-prefix", e2e.prefix]) == 0
    assert png.stat().st_size > 0


@pytest.mark.timeout(240)
def test_an_on_demand_round_open_at_an_orchestratord_restart_finishes_without_replaying_a_finished_task(
        shared_cluster: E2ECluster, tmp_path: Path) -> None:
    e2e = shared_cluster
    spec = e2e.spec(environment={"entrypoint": "gated_held_out:GatedHeldOut",
                                 "config": {"num_objects": 4, "gate_dir": str(tmp_path)}},
                    batch={"prompts_per_step": 2, "group_size": 2, "micro_batch_size": 4}, total_steps=1)
    job_id = e2e.client.submit(spec)
    assert_succeeded(e2e, e2e.wait_job(job_id), 1)
    round_id = e2e.client.evaluate(job_id, tasks=4)
    # Task 0 finishes (durable before its report's reply); tasks 1-3 wait for the gate.
    wait_until(lambda: e2e.etcd_prefix_values(f"jobs/{job_id}/eval_open/{round_id}/tasks/"), 60,
               "eval task 0 recorded as finished")
    assert (tmp_path / "played").read_text().split() == ["0"]

    orchestratord = e2e.cluster.daemon("orchestratord")
    orchestratord.kill()
    orchestratord.restart()
    e2e.cluster.write_cluster_file()
    e2e.reconnect()
    (tmp_path / "open").touch()
    record = e2e.client.wait_evaluation(job_id, round_id, timeout_s=120)
    assert (record.round_id, record.tasks, record.failed_tasks, record.team.episodes) == (round_id, 4, 0, 4)
    assert record.team.success == pytest.approx(1 / 4)  # task 0's episode (the team's only success) kept
    played = (tmp_path / "played").read_text().split()
    assert played.count("0") == 1 and {"1", "2", "3"} <= set(played), played
    assert not e2e.etcd_prefix_values(f"jobs/{job_id}/eval_open/")
