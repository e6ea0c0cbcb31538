"""A dataset job's task order continues exactly across an orchestratord restart.

Task i plays row ``order(i // rows)[i % rows]`` of the train file (flexmarl.datasets), and
orchestratord numbers tasks ``batch * prompts_per_step + position`` from its etcd state after a
restart, so the order resumes where it stopped. Here a 2-step job over a 5-row file (8 tasks:
1.6 epochs) on the session cluster has orchestratord restarted after its first step; then the
steps' manifests must hold tasks 0..7 once each, and every stored sender prompt must be the
question of the row its task index maps to, before the restart and after it (a malformed row,
submitted without the preflight, is skipped and counted). A file changed after submit fails its
job on rolloutd with the file named.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from e2e_support import E2ECluster, assert_succeeded, metric_sum

from flexmarl.client import JobState
from flexmarl.datasets import TaskDataset, pin_dataset
from flexmarl.ids import ExperienceKey, TaskRef
from flexmarl.jobspec import parse_job_spec
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

STEPS = 2
PROMPTS = 4
ROWS = [{"question": f"q{n}: {n}+{n}=", "answer": 2 * n} for n in range(5)]
SEED = 11
WAIT_S = 300.0


def _task_index(experience_id: str) -> int:
    task = TaskRef.parse(ExperienceKey.parse(experience_id).task_id)
    return task.batch * PROMPTS + task.position


def _skipped_rows(e2e: E2ECluster) -> float:
    return metric_sum(e2e.metrics_text("rolloutd-0"), "flexmarl_rolloutd_dataset_rows_skipped_total")


@pytest.mark.timeout(600)
def test_the_dataset_order_resumes_exactly_after_an_orchestratord_restart(shared_cluster: E2ECluster,
                                                                            tmp_path: Path) -> None:
    e2e = shared_cluster
    train = tmp_path / "train.jsonl"
    # A malformed row (no question) after the second: submitted without the preflight, which would refuse it,
    # rolloutd skips and counts it, and the order is over the 5 good rows.
    lines = [json.dumps(row) for row in ROWS]
    train.write_text("\n".join([*lines[:2], json.dumps({"answer": 0}), *lines[2:]]) + "\n")
    spec = e2e.spec(seed=SEED, total_steps=STEPS,
                    environment={"entrypoint": "dataset_rows:DatasetRows",
                                 "dataset": {"train": str(train), "fields": ["question"]}})
    spec["batch"] = {"prompts_per_step": PROMPTS, "group_size": 2, "micro_batch_size": 4}
    skipped_before = _skipped_rows(e2e)
    job_id = e2e.client.submit(spec, job_id="dataset-resume", preflight=False)

    e2e.wait_for_commits(job_id, at_least=2)  # step 0 of both agents
    orchestratord = e2e.cluster.daemon("orchestratord")
    at_restart = e2e.client.status(job_id)
    assert not at_restart.state.finished and min(a.version for a in at_restart.agents) < STEPS
    orchestratord.terminate()
    orchestratord.restart()
    e2e.cluster.write_cluster_file()
    e2e.reconnect()
    assert_succeeded(e2e, e2e.wait_job(job_id, timeout_s=WAIT_S), STEPS)
    assert _skipped_rows(e2e) - skipped_before == 1

    order = TaskDataset(ROWS)
    for agent in ("sender", "receiver"):
        manifests = e2e.manifests(job_id, agent)
        by_step = {step: sorted({_task_index(i) for i in m["experience_ids"]}) for step, m in manifests.items()}
        assert by_step == {step: list(range(step * PROMPTS, (step + 1) * PROMPTS)) for step in range(STEPS)}
    played: dict[int, str] = {}
    for experience in e2e.stored_experiences(job_id, "sender"):
        index = _task_index(experience.experience_id)
        prompt = bytes(int(t) for t in experience.prompt_token_ids if t < 256).decode()
        assert prompt == order.train_row(index, SEED)["question"], f"task {index} played another row"
        played[index] = prompt
    assert sorted(played) == list(range(STEPS * PROMPTS))
    assert sorted(played[p] for p in range(5)) == sorted(r["question"] for r in ROWS)  # epoch 0: each row once


@pytest.mark.timeout(300)
def test_rolloutd_refuses_a_dataset_changed_since_submit(shared_cluster: E2ECluster, tmp_path: Path) -> None:
    e2e = shared_cluster
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    spec = e2e.spec(seed=SEED, total_steps=1,
                    environment={"entrypoint": "dataset_rows:DatasetRows", "dataset": {"train": str(train)}})
    pinned = pin_dataset(parse_job_spec(spec))  # what submit sends: the file's sha256 now
    train.write_text(json.dumps(ROWS[0]) + "\n")  # then the file changes
    # Sent as recorded (the SDK's submit would pin the new content), so the change meets rolloutd.
    with grpc.insecure_channel(e2e.cluster.daemon("orchestratord").address) as channel:
        reply = orchestrator_pb2_grpc.OrchestratorStub(channel).SubmitJob(
            orchestrator_pb2.SubmitJobRequest(spec_json=pinned.to_json(), job_id="dataset-changed"), timeout=30)
    info = e2e.wait_job(reply.job_id, timeout_s=120)
    assert info.state is JobState.FAILED
    assert f"environment.dataset.train: {train} changed since submit" in info.error, info.error
