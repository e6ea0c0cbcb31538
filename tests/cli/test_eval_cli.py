"""`flexmarl eval` and `flexmarl history --eval` without a cluster: usage errors, and the rows they print."""

from __future__ import annotations

import contextlib
import io

import pytest

from flexmarl import cli
from flexmarl.evaluation import EVAL_ROW_FIELDS, EvalAgentScores, EvalRecord, EvalScores, eval_rows

pytestmark = pytest.mark.timeout(60)


def test_eval_refuses_both_version_flags_before_reaching_a_cluster() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["eval", "job-1", "--version", "1", "--agent-versions", "a=1", "--etcd", "127.0.0.1:1"])
    assert code == cli.EXIT_USAGE and "--version or --agent-versions" in err.getvalue()
    with contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(["eval", "job-1", "--tasks", "-1", "--etcd", "127.0.0.1:1"]) == cli.EXIT_USAGE
    # --versions (a curve of pinned rounds) excludes the one-round flags and takes 'kept' or version numbers
    for bad, said in ((["--versions", "0,2", "--version", "1"], "--versions, or --version"),
                      (["--versions", "0,2", "--agent-versions", "a=1"], "--versions, or --version"),
                      (["--versions", "0,two"], "expected 'kept' or versions like 0,4,8, got '0,two'"),
                      (["--versions", "kept,4"], "expected 'kept' or versions")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert cli.main(["eval", "job-1", *bad, "--etcd", "127.0.0.1:1"]) == cli.EXIT_USAGE
        assert said in err.getvalue()
    # a round's own sampling: greedy or policy, 0..1024 episodes per task
    for bad, said in ((["--samples", "1025"], "--samples 0..1024, got 0 and 1025"),
                      (["--samples", "-2"], "--samples 0..1024"),
                      (["--sampling", "hot"], "invalid choice: 'hot'")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = cli.main(["eval", "job-1", *bad, "--etcd", "127.0.0.1:1"])
            except SystemExit as exc:  # argparse's own refusal of a choice
                code = exc.code  # type: ignore[assignment]
        assert code == cli.EXIT_USAGE and said in err.getvalue()


def test_eval_rows_list_each_agent_then_the_team_periodic_rounds_first() -> None:
    def record(round_id: str, version: int, success: float) -> EvalRecord:
        scores = EvalScores(0.5, success, success, 4)
        return EvalRecord(version, 4, 1, 0, "greedy", scores, (EvalAgentScores("a", version, (version, version + 1),
                                                                               scores),), False, 0, round_id)

    rows = eval_rows([record("d1", 1, 0.25), record("v2", 2, 1.0), record("v0", 0, 0.0)])
    assert [(r["round"], r["scope"]) for r in rows] == [("v0", "a"), ("v0", "team"), ("v2", "a"), ("v2", "team"),
                                                        ("d1", "a"), ("d1", "team")]
    assert rows[2]["versions_seen"] == "2 3" and rows[3]["versions_seen"] == "2 3"
    assert set(rows[0]) == set(EVAL_ROW_FIELDS)


def test_eval_names_the_held_out_tasks_it_played() -> None:
    import dataclasses
    import json

    from tests.orchestratord.helpers import spec_dict

    scores = EvalScores(0.5, 0.5, 0.5, 2)
    record = EvalRecord(1, 2, 1, 0, "greedy", scores, (), True, 0, "d1")
    generated = json.dumps(spec_dict())
    entrypoint = json.loads(generated)["environment"]["entrypoint"]
    assert cli.held_out_source(record, generated) == (
        f"2 held-out tasks: {entrypoint} eval_task(0..1) (generated, held-out seed stream)")
    assert cli.held_out_source(dataclasses.replace(record, eval_file="/d/more.jsonl"), generated) == (
        "2 held-out tasks: rows 0..1 of /d/more.jsonl (--dataset)")
    split = json.dumps(spec_dict(environment={"entrypoint": entrypoint,
                                              "dataset": {"train": "/d/train.jsonl", "eval": "/d/eval.jsonl"}}))
    assert cli.held_out_source(record, split) == (
        "2 held-out tasks: rows 0..1 of /d/eval.jsonl (environment.dataset.eval)")
    train_only = json.dumps(spec_dict(environment={"entrypoint": entrypoint, "dataset": {"train": "/d/train.jsonl"}}))
    assert "rows of /d/train.jsonl (environment.dataset.train in a held-out order" in cli.held_out_source(
        record, train_only)
