"""benchmarks.reward_heldout and the held-out reading of benchmarks.time_to_reward: evaluation rounds as a curve
(placement, window, on-demand rounds left out), its targets, speedups and verdicts, and a kept run's rounds read
again. Pure: no cluster (the long signaling test in test_time_to_reward.py runs the rounds through the daemons)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from benchmarks import reward_heldout as rh
from benchmarks import reward_runs as rr
from benchmarks import time_to_reward as ttr
from flexmarl import devicemodel
from flexmarl.client import StepRecord
from flexmarl.evaluation import EvalAgentScores, EvalRecord, EvalScores
from flexmarl.jobspec import parse_job_spec

pytestmark = pytest.mark.timeout(60)


def scores(success: float, reward: float = 0.0, episodes: int = 16) -> EvalScores:
    return EvalScores(reward_mean=reward, success=success, pass_at_k=success, episodes=episodes)


def round_at(version: int, success: float, seen: dict[str, tuple[int, ...]] | None = None, round_id: str = "",
             reward: float = 0.0) -> EvalRecord:
    seen = seen or {"a": (version,), "b": (version,)}
    agents = tuple(EvalAgentScores(agent, version, versions, scores(success)) for agent, versions in seen.items())
    return EvalRecord(version=version, tasks=16, samples_per_task=1, failed_tasks=0, sampling="greedy",
                      team=scores(success, reward), agents=agents, team_success_from_env=False,
                      round_id=round_id or f"v{version}")


def published(step_s: float, versions: int, lag_s: float = 0.5) -> dict[tuple[str, int], float]:
    """Agent a publishes version v at v * step_s - lag_s, b at v * step_s; version 0 at 0."""
    out = {("a", 0): 0.0, ("b", 0): 0.0}
    for v in range(1, versions + 1):
        out[("a", v)] = v * step_s - lag_s
        out[("b", v)] = v * step_s
    return out


def test_a_round_is_placed_at_the_newest_version_that_played_in_it_and_read_on_a_two_round_mean() -> None:
    records = [
        round_at(4, 0.6, {"a": (4, 5), "b": (4,)}),  # a's engines moved on to 5 while the round played
        round_at(0, 0.2),
        round_at(2, 0.5),
        round_at(3, 0.99, round_id="d0"),  # on demand: the asker's versions, not the run's
    ]
    curve = rh.eval_curve(records, published(10.0, 6), "success")
    assert [p.version for p in curve] == [0, 2, 4]
    # round v4 is placed at a's version 5 (49.5 s), not at the team's version 4 (40 s): never before its weights
    assert [p.modelled_s for p in curve] == [0.0, 20.0, 49.5]
    assert [p.value for p in curve] == [0.2, 0.5, 0.6]
    assert math.isnan(curve[0].window_reward)
    assert curve[1].window_reward == pytest.approx(0.35) and curve[2].window_reward == pytest.approx(0.55)
    assert curve[0].episodes == 16
    # the graded metric: the team's mean reward
    assert [p.value for p in rh.eval_curve([round_at(0, 0.0, reward=0.4)], published(1.0, 1), "reward_mean")] == [0.4]


def test_a_round_of_a_version_never_published_or_an_unknown_metric_is_refused() -> None:
    with pytest.raises(ValueError, match="metric must be one of"):
        rh.eval_curve([], {}, "pass@k")
    with pytest.raises(ValueError, match="round v7: agent 'a' played version 7, never published"):
        rh.eval_curve([round_at(7, 0.5)], published(1.0, 6), "success")
    assert rh.eval_curve([], {}, "success") == []


def run_with_rounds(config: str, values: list[float], round_s: float, seed: int = 0) -> rr.RewardRun:
    """A run whose step 0 commits at 10 modelled s and whose rounds (every 2 versions) come every round_s."""
    curve = [rr.CurvePoint(step, 10.0 + round_s / 2 * step, 0.5, 0.5) for step in range(2 * len(values))]
    run = rr.RewardRun("arithmetic", config, seed, "SUCCEEDED", len(curve), curve, bound_s=1.0, bound_by="train",
                       overrun_s=0.0, wall_s=100.0, start_wall_s=0.0, steady_overrun_s=0.0, steady_wall_s=90.0)
    points: list[rh.EvalPoint] = []
    for index, value in enumerate(values):
        window = (points[-1].value + value) / 2 if points else math.nan
        points.append(rh.EvalPoint(10.0 + round_s * index, 2 * index, value, window, 128))
    run.eval_curve, run.eval_metric = points, "success"
    return run


def test_the_held_out_reading_has_its_own_targets_speedups_and_verdicts() -> None:
    values = [0.3, 0.5, 0.7, 0.8, 0.8, 0.8]
    sync = run_with_rounds("sync", values, 100.0)
    sequential = run_with_rounds("sequential", values, 150.0)
    fast = run_with_rounds("flexmarl-partial-eta4-decoupled", values, 25.0)
    runs = [sync, sequential, fast]
    rr.set_targets(runs, {"arithmetic": None})
    assert fast.eval_target == pytest.approx(0.78)  # sync's last two rounds' mean - 0.02
    # 2-round means 0.4, 0.6, 0.75, 0.8: first >= 0.78 at the fifth round (index 4), 4 rounds after step 0's commit
    assert sync.after_step0("heldout") == pytest.approx(400.0) and fast.after_step0("heldout") == pytest.approx(100.0)
    assert rr.speedup(runs, fast, "sync", "heldout") == pytest.approx(4.0)
    assert rr.speedup(runs, fast, "sequential", "heldout") == pytest.approx(6.0)
    [line] = rr.verdicts(runs, "heldout")
    assert line.startswith("arithmetic (held-out evaluation): best FlexMARL configuration "
                           "flexmarl-partial-eta4-decoupled")
    assert ">= 3x sooner than sync on every seed: met (4.00x)" in line
    assert ">= 5x sooner than sequential on every seed: met (6.00x)" in line
    assert "final >= sync's - 0.02: met (0.800 vs 0.800)" in line
    table = ttr.table(runs)
    assert "held-out evaluation: each round's" in table and "4.00x" in table and "6 periodic" in table
    # a run without rounds among runs with them: not measured; no run with rounds: no held-out line at all
    bare = run_with_rounds("flexmarl", values, 20.0)
    bare.eval_curve = []
    assert rr.verdicts([*runs, bare], "heldout") == [
        "arithmetic (held-out evaluation): not measured (no evaluation rounds: flexmarl s0)"]
    for run in runs:
        run.eval_curve = []
    assert rr.verdicts(runs, "heldout") == []
    assert "held-out evaluation:" not in ttr.table(runs)


def test_the_benchmark_gives_a_job_its_evaluation_rounds_and_none_without_eval_every(tmp_path: Path) -> None:
    job = ttr.example_job(ttr.WORKLOADS["arithmetic"], "sync", 0, 3, tmp_path)
    assert ttr.with_evaluation(job, 0, 128) is job and "evaluation" not in job
    spec = parse_job_spec(ttr.with_evaluation(job, 2, 64))
    assert spec.evaluation is not None
    assert (spec.evaluation.every_versions, spec.evaluation.tasks, spec.evaluation.sampling,
            spec.evaluation.before_training) == (2, 64, "greedy", True)
    # the long-tail reward is graded (the share of even tokens): its rounds are read on the team's mean reward
    assert ttr.WORKLOADS["long-tail"].eval_metric == "reward_mean"
    assert ttr.WORKLOADS["signaling"].eval_metric == ttr.WORKLOADS["arithmetic"].eval_metric == "success"
    with pytest.raises(SystemExit):
        ttr.main(["--eval-every", "-1", "--reanalyse", str(tmp_path)])
    # --eval-after: the job keeps every K-th version for the pinned rounds, and has no periodic ones
    assert ttr.with_kept_versions(job, 0) is job
    kept = parse_job_spec(ttr.with_kept_versions({**job, "checkpoint": {"keep_last": 5}}, 4))
    assert (kept.checkpoint.keep_every, kept.checkpoint.keep_last, kept.evaluation) == (4, 5, None)
    # sampled rounds (a reward greedy decoding saturates early): the agents' own sampling, k episodes per task
    sampled = parse_job_spec(ttr.with_evaluation(job, 2, 16, "policy", 4)).evaluation
    assert sampled is not None and (sampled.sampling, sampled.samples_per_task) == ("policy", 4)
    records = [round_at(0, 0.5), dataclasses.replace(round_at(2, 0.5, round_id="d1"), sampling="policy",
                                                     samples_per_task=4)]
    assert (ttr.sampling_of(records, pinned=True), ttr.sampling_of(records, pinned=False)) == ("policy x4", "greedy")
    for bad in (["--eval-after", "-2"], ["--eval-after", "2", "--eval-every", "2"], ["--eval-samples", "0"],
                ["--eval-sampling", "hot"]):
        with pytest.raises(SystemExit):
            ttr.main([*bad, "--reanalyse", str(tmp_path)])


def test_pinned_rounds_one_per_kept_team_version_each_read_at_that_version() -> None:
    history = [StepRecord(agent=agent, step=v - 1, version=v, reward_mean=0.5, loss=0.0, grad_norm=0.0,
                          step_seconds=0.0, tokens_per_s=0.0, staleness_mean=0.0, episodes=8, response_tokens=8,
                          committed_unix_ms=0, weights_uri="")
               for agent, last in (("a", 7), ("b", 6)) for v in range(1, last + 1)]
    # the team's final version is the lowest agent's last (b's 6); 0 and the final always
    assert rh.team_versions_every(history, 2) == [0, 2, 4, 6]
    assert rh.team_versions_every(history, 4) == [0, 4, 6]
    assert rh.team_versions_every([], 3) == [0]
    with pytest.raises(ValueError, match="every must be >= 1"):
        rh.team_versions_every(history, 0)

    # Client.evaluate_versions' records: every agent asked and played the round's version
    records = [round_at(v, v / 10, round_id=f"d{i}") for i, v in enumerate((0, 2, 4, 6))]
    # a periodic round among them (the run's own) is not the pinned reading; the pinned one skips it and vice versa
    records.append(round_at(2, 0.99, {"a": (2, 3), "b": (2,)}))
    curve = rh.eval_curve(records, published(10.0, 7), "success", pinned=True)
    # each point at its version's publish by the later agent (b, v * 10 s), never a newer version's
    assert [(p.version, p.modelled_s, p.value) for p in curve] == [(0, 0.0, 0.0), (2, 20.0, 0.2), (4, 40.0, 0.4),
                                                                    (6, 60.0, 0.6)]
    assert [p.version for p in rh.eval_curve(records, published(10.0, 7), "success")] == [2]
    # a pinned round that played another version, or asked agents different versions, is not one team version
    played_newer = round_at(4, 0.5, {"a": (4, 5), "b": (4,)}, round_id="d9")
    asked_apart = dataclasses.replace(played_newer, agents=(
        EvalAgentScores("a", 5, (5,), scores(0.5)), EvalAgentScores("b", 4, (4,), scores(0.5))))
    for record, asked in ((played_newer, 4), (asked_apart, 5)):
        with pytest.raises(ValueError, match=f"round d9: agent 'a' asked version {asked}, played"):
            rh.eval_curve([record], published(10.0, 7), "success", pinned=True)


def test_a_kept_runs_rounds_are_read_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "signaling-sync-s0"
    (run_dir / "traces").mkdir(parents=True)
    profile = devicemodel.H100_SXM.with_changes(token_scale=128.0, time_scale=0.5, train_devices_per_slot=1)
    (run_dir / "device.json").write_text(profile.to_json())
    # version v is published at step v - 1's commit: a at 1000 + 2 v - 0.5 wall s, b at 1000 + 2 v
    records = [StepRecord(agent=agent, step=step, version=step + 1, reward_mean=0.5, loss=0.0, grad_norm=0.0,
                          step_seconds=0.0, tokens_per_s=0.0, staleness_mean=0.0, episodes=8, response_tokens=8,
                          committed_unix_ms=int((1000.0 + 2.0 * (step + 1) - lag) * 1000), weights_uri="")
               for step in range(7) for agent, lag in (("a", 0.5), ("b", 0.0))]
    (run_dir / "history.json").write_text(json.dumps([dataclasses.asdict(r) for r in records]))
    # the second record is a pinned round's generation after the last commit (1014 s): not the run's time
    (run_dir / "traces" / "engine-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "generate", "start_s": 1000.0, "end_s": 1001.0, "modelled_s": 2.0, "overrun_s": 0.0},
        {"kind": "generate", "start_s": 1020.0, "end_s": 1030.0, "modelled_s": 2.0, "overrun_s": 9.0})))
    (run_dir / "run.json").write_text(json.dumps({"workload": "signaling", "config": "sync", "seed": 0,
                                                  "state": "SUCCEEDED", "agents": 2, "submitted_s": 990.0,
                                                  "replicas": 2, "slots": 2}))
    [before] = ttr.reanalyse([tmp_path])  # a run kept before the held-out reading: none
    assert before.eval_curve == [] and before.eval_metric == "" and before.overrun_s == 0.0
    rounds = [round_at(0, 0.25), round_at(2, 0.85), round_at(4, 1.0), round_at(6, 1.0)]
    (run_dir / "evaluations.json").write_text(json.dumps([r.as_dict() for r in rounds]))
    [run] = ttr.reanalyse([tmp_path])
    rr.set_targets([run], {"signaling": 0.9})
    assert [p.modelled_s for p in run.eval_curve] == pytest.approx([0.0, 4.0 / 0.5, 8.0 / 0.5, 12.0 / 0.5])
    assert run.eval_metric == "success" and run.eval_target == 0.9
    assert run.time_to("heldout") == pytest.approx(16.0)  # the round at v4: (0.85 + 1.0) / 2 >= 0.9
    out = tmp_path / "out"
    assert ttr.main(["--reanalyse", str(tmp_path), "--out", str(out), "--stem", "kept"]) == 0
    [row] = json.loads((out / "kept.json").read_text())["runs"]
    assert [p["version"] for p in row["eval_curve"]] == [0, 2, 4, 6] and row["eval_final"] == 1.0
    assert (out / "kept-signaling.png").stat().st_size > 0
    # kept by --eval-after: the pinned rounds are the reading, the periodic ones are not
    pinned = [round_at(v, s, round_id=f"d{i}") for i, (v, s) in enumerate(((0, 0.5), (2, 0.95), (4, 0.95)))]
    (run_dir / "evaluations.json").write_text(json.dumps([r.as_dict() for r in rounds + pinned]))
    meta = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**meta, "eval_pinned": True}))
    [run] = ttr.reanalyse([tmp_path])
    rr.set_targets([run], {"signaling": 0.9})
    assert run.eval_pinned and [(p.version, p.value) for p in run.eval_curve] == [(0, 0.5), (2, 0.95), (4, 0.95)]
    assert run.time_to("heldout") == pytest.approx(16.0) and "3 pinned" in ttr.table([run])
