"""Time to reward as a product reading: ``flexmarl.reward_time`` and ``flexmarl time-to-reward``.

The curves are pure functions of a job's step records and evaluation rounds (checked directly); the command reads
them over gRPC from an orchestrator that answers with fixed histories (two jobs: one reaches the target in half
the time after its first step) and prints each job's time to the target and its speedup over the first.
"""

from __future__ import annotations

import dataclasses
import json
import math
from concurrent import futures
from typing import Any

import grpc
import pytest

from flexmarl import cli
from flexmarl.client import StepRecord
from flexmarl.evaluation import EvalAgentScores, EvalRecord, EvalScores
from flexmarl.reward_time import (
    final_reward,
    first_reaching,
    heldout_curve,
    published_seconds,
    team_pinned_rounds,
    training_curve,
)
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SUBMITTED_MS = 1_000_000


def record(agent: str, step: int, ret: float | None, at_s: float, reward: float = 0.0) -> StepRecord:
    return StepRecord(agent=agent, step=step, version=step + 1, reward_mean=reward, loss=0.0, grad_norm=0.0,
                      step_seconds=1.0, tokens_per_s=1.0, staleness_mean=0.0, episodes=4, response_tokens=8,
                      committed_unix_ms=SUBMITTED_MS + int(at_s * 1000), weights_uri="", return_mean=ret)


def scores(value: float) -> EvalScores:
    return EvalScores(reward_mean=value, success=value, pass_at_k=value, episodes=8)


def round_at(version: int, value: float, seen: dict[str, tuple[int, ...]], round_id: str = "") -> EvalRecord:
    agents = tuple(EvalAgentScores(agent, version, versions, scores(value)) for agent, versions in seen.items())
    return EvalRecord(version=version, tasks=8, samples_per_task=1, failed_tasks=0, sampling="greedy",
                      team=scores(value), agents=agents, team_success_from_env=False,
                      round_id=round_id or f"v{version}")


def since_submit(unix_s: float) -> float:
    return unix_s - SUBMITTED_MS / 1000


def test_the_training_curve_counts_steps_every_agent_committed_at_the_last_commit() -> None:
    history = [record("a", 0, 0.2, 10.0), record("b", 0, 0.4, 12.0), record("a", 1, 0.6, 20.0),
               record("b", 1, None, 21.0, reward=0.8),  # no recorded return: its trained reward
               record("a", 2, 1.0, 30.0)]  # b has not committed step 2: not a point yet
    curve = training_curve(history, 2, since_submit, window=2)
    assert [(p.step, p.seconds, p.reward) for p in curve] == [(0, 12.0, pytest.approx(0.3)), (1, 21.0, 0.7)]
    assert math.isnan(curve[0].window_reward) and curve[1].window_reward == pytest.approx(0.5)
    assert first_reaching(curve, 0.5) is curve[1] and first_reaching(curve, 0.6) is None
    assert first_reaching(curve, math.nan) is None and final_reward(curve) == pytest.approx(0.5)
    assert [p.reward for p in training_curve(history, 2, since_submit, 1, value=lambda r: r.reward_mean)] == [0.0, 0.4]


def test_a_held_out_round_is_placed_at_its_newest_versions_publish() -> None:
    history = [record(agent, step, 0.0, 10.0 * (step + 1) + offset)
               for step in range(4) for agent, offset in (("a", 0.0), ("b", 1.0))]
    published = published_seconds(history, since_submit)
    assert published[("a", 0)] == 0.0 and published[("b", 2)] == 21.0
    rounds = [round_at(2, 0.75, {"a": (2, 3), "b": (2,)}),  # a's version 3 played in it: placed at its publish
              round_at(0, 0.25, {"a": (0,), "b": (0,)}),
              round_at(2, 1.0, {"a": (2,), "b": (2,)}, round_id="d1")]  # on demand: not on the periodic curve
    curve = heldout_curve(rounds, published, "success", window=2)
    assert [(p.version, p.seconds, p.value) for p in curve] == [(0, 0.0, 0.25), (2, 30.0, 0.75)]
    assert curve[1].window_reward == pytest.approx(0.5)
    [pinned] = heldout_curve(rounds, published, "success", window=1, pinned=True)
    assert (pinned.version, pinned.seconds, pinned.window_reward) == (2, 21.0, 1.0)
    with pytest.raises(ValueError, match="not the team version 2 pinned"):
        heldout_curve([round_at(2, 1.0, {"a": (2, 3)}, round_id="d2")], published, pinned=True)
    with pytest.raises(ValueError, match="never published"):
        heldout_curve([round_at(9, 1.0, {"a": (9,)})], published)
    with pytest.raises(ValueError, match="metric must be one of"):
        heldout_curve(rounds, published, "accuracy")


def test_pinned_rounds_are_one_team_version_each_the_latest_per_version_and_played_alike() -> None:
    pinned = [round_at(4, 0.5, {"a": (4,), "b": (4,)}, "d1"), round_at(4, 0.6, {"a": (4,), "b": (4,)}, "d10"),
              round_at(2, 0.1, {"a": (2,), "b": (2,)}, "d2"), round_at(0, 0.0, {"a": (0,), "b": (0,)}, "v0")]
    mixed = [round_at(2, 0.3, {"a": (2,), "b": (4,)}, "d3"), round_at(6, 0.3, {"a": (6, 7), "b": (6,)}, "d4")]
    kept, skipped = team_pinned_rounds(pinned + mixed)
    # the periodic v0 is no on-demand round; d10 was asked after d2 and d1 (by number, not by name)
    assert [(r.round_id, r.team.success) for r in kept] == [("d2", 0.1), ("d10", 0.6)] and skipped == 2
    other = dataclasses.replace(round_at(8, 1.0, {"a": (8,), "b": (8,)}, "d11"), sampling="policy")
    with pytest.raises(ValueError, match="played differently"):
        team_pinned_rounds([*pinned, other])


def _job(job_id: str, step_s: float) -> tuple[orchestrator_pb2.JobStatus, list[orchestrator_pb2.StepRecord]]:
    """Two agents whose reward climbs 0.1 a step from 0.1, a step every ``step_s`` after a 30 s start."""
    status = orchestrator_pb2.JobStatus(job_id=job_id, name=f"name-{job_id}", created_unix_ms=SUBMITTED_MS,
                                        state=orchestrator_pb2.JOB_STATE_SUCCEEDED,
                                        agents=[orchestrator_pb2.AgentProgress(agent="a"),
                                                orchestrator_pb2.AgentProgress(agent="b")])
    steps = [orchestrator_pb2.StepRecord(agent=agent, step=step, version=step + 1, reward_mean=0.0,
                                         return_mean=min(0.1 * (step + 1), 1.0),
                                         committed_unix_ms=SUBMITTED_MS + int(1000 * (30 + step_s * step)))
             for step in range(12) for agent in ("a", "b")]
    return status, steps


class TwoJobs(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self) -> None:
        self.jobs = {"sync": _job("sync", 20.0), "async": _job("async", 10.0)}
        self.evals = [orchestrator_pb2.EvalRecord(
            version=v, round_id=f"v{v}", team=orchestrator_pb2.EvalScores(success=v / 10, episodes=8),
            agents=[orchestrator_pb2.EvalAgentScores(agent=a, version=v, versions_seen=[v]) for a in "ab"])
            for v in (0, 4, 8, 12)]
        # on-demand rounds: d1, d2, d3 pin both agents (d3 repeats version 8: the latest counts); d4 mixes versions
        for n, (versions, value) in enumerate([((4, 4), 0.2), ((8, 8), 0.9), ((8, 8), 1.0), ((8, 4), 1.0)], 1):
            self.evals.append(orchestrator_pb2.EvalRecord(
                version=min(versions), round_id=f"d{n}", team=orchestrator_pb2.EvalScores(success=value, episodes=8),
                agents=[orchestrator_pb2.EvalAgentScores(agent=a, version=v, versions_seen=[v])
                        for a, v in zip("ab", versions, strict=True)]))

    def GetJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job_id}")
        return self.jobs[request.job_id][0]

    def GetJobHistory(self, request: Any, context: Any) -> Any:  # noqa: N802
        return orchestrator_pb2.JobHistory(job_id=request.job_id, steps=self.jobs[request.job_id][1], evals=self.evals)


@pytest.fixture
def address() -> Any:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(TwoJobs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_the_command_gives_each_jobs_time_to_the_target_and_its_speedup(
        address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["time-to-reward", "sync", "async", "--target", "0.5", "--json", "--address", address]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target"] == 0.5 and "moving mean of 5 steps" in out["reading"]
    sync, fast = out["jobs"]
    # the 5-step mean of 0.1, 0.2, ... first reaches 0.5 at step 6 (0.3..0.7)
    assert (sync["reached_at"], sync["since_submit_s"], sync["after_step0_s"]) == (6, 150.0, 120.0)
    assert (fast["reached_at"], fast["since_submit_s"], fast["after_step0_s"]) == (6, 90.0, 60.0)
    assert (sync["speedup"], fast["speedup"]) == (1.0, 2.0) and sync["final"] == pytest.approx(0.94)  # 0.8 .. 1, 1

    # no target given: the first job's final moving mean - 0.02; a table on a terminal-less stdout
    assert cli.main(["time-to-reward", "sync", "async", "--address", address]) == 0
    text = capsys.readouterr().out
    assert "target 0.920" in text and "2.00x" in text

    # held out: periodic rounds at versions 0, 4, 8, 12, placed at each version's publish (version v: step v - 1)
    assert cli.main(["time-to-reward", "sync", "async", "--eval", "--target", "0.6", "--json",
                     "--address", address]) == 0
    sync, fast = json.loads(capsys.readouterr().out)["jobs"]
    assert sync["reached_at"] == 8 and sync["since_submit_s"] == 30 + 20 * 7 and fast["since_submit_s"] == 30 + 10 * 7
    assert sync["after_step0_s"] == 140 and fast["speedup"] == 2.0

    # pinned: the on-demand rounds with every agent at one version; 0.95 first at version 8 (d3, not d2)
    assert cli.main(["time-to-reward", "sync", "--pinned", "--window", "1", "--target", "0.95", "--json",
                     "--address", address]) == 0
    [sync] = json.loads(capsys.readouterr().out)["jobs"]
    assert (sync["points"], sync["reached_at"], sync["since_submit_s"], sync["rounds_left_out"]) == (2, 8, 170.0, 1)
    assert cli.main(["time-to-reward", "sync", "--pinned", "--address", address]) == 0  # the table says it on stderr
    assert "job sync: 1 on-demand rounds left out" in capsys.readouterr().err
    assert cli.main(["time-to-reward", "sync", "--pinned", "--eval", "--address", address]) == cli.EXIT_USAGE
    assert "two readings" in capsys.readouterr().err


def test_bad_arguments_and_unknown_jobs_are_one_line_each(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["time-to-reward", "sync", "--window", "-1", "--address", address]) == cli.EXIT_USAGE
    assert "--window must be >= 0" in capsys.readouterr().err
    assert cli.main(["time-to-reward", "sync", "--target", "nan", "--address", address]) == cli.EXIT_USAGE
    assert cli.main(["time-to-reward", "sync", "nope", "--address", address]) == cli.EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no job nope" in err[-1]
