"""The trainer's extra per-step figures (CommitStepRequest.figures): checked, kept with the commit, in the history."""

from __future__ import annotations

import math

import pytest

from flexmarl.client import StepRecord
from flexmarl.errors import InvalidArgument
from orchestratord import serde
from orchestratord.coordinator import HISTORY_FIELDS, MAX_STEP_FIGURES, step_figures
from orchestratord.state import StepCommit
from traind.serde import commit_request
from traind.work import StepCommit as TrainerCommit


def test_figures_are_checked_by_name_value_and_count() -> None:
    assert step_figures({"kl": 0.25, "clip_fraction": 0.0}) == {"kl": 0.25, "clip_fraction": 0.0}
    for bad in ({"KL": 1.0}, {"loss": 1.0}, {"a" * 33: 1.0}, {"kl": math.nan}, {"kl": math.inf}):
        with pytest.raises(InvalidArgument, match="figures"):
            step_figures(bad)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_STEP_FIGURES}"):
        step_figures({f"f{i}": 0.0 for i in range(MAX_STEP_FIGURES + 1)})
    assert "reward_mean" in HISTORY_FIELDS


def test_figures_travel_from_the_trainer_to_the_history_record() -> None:
    request = commit_request("trainer-0", TrainerCommit(
        slot_id="s0", job_id="j", agent="a", step=3, new_version=4, weights_uri="file:///w", state_uri="",
        loss=0.5, grad_norm=1.0, step_seconds=2.0, figures={"kl": 0.01, "ratio_mean": 1.0}))
    figures = step_figures(request.figures)
    commit = StepCommit("j", "a", 3, "file:///w", "", "s0", 9.0, 0.5, 1.0, 2.0, tuple(sorted(figures.items())))
    assert StepCommit.from_json(commit.to_json()) == commit
    old = StepCommit("j", "a", 3, "file:///w", "", "s0", 9.0)  # a commit written before figures existed
    assert StepCommit.from_json(old.to_json().replace(',"figures":[]', "")) == old
    row = {"agent": "a", "step": 3, "version": 4, "loss": 0.5, "weights_uri": "file:///w", **dict(commit.figures)}
    record = StepRecord.from_proto(serde.step_record(row))
    assert (record.loss, record.figures) == (0.5, {"kl": 0.01, "ratio_mean": 1.0})
