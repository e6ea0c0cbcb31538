"""benchmarks/word_problems_learning.py: its held-out rounds follow the job's ``evaluation`` unless a flag overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.word_problems_learning import eval_settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "word_problems"


def test_the_shipped_jobs_rounds_are_sampled_as_their_evaluation_says() -> None:
    for name, samples in (("job_solver_verifier.yaml", 8), ("job_debate.yaml", 4)):
        spec = yaml.safe_load((EXAMPLES / name).read_text())
        assert eval_settings(spec, None, None) == (10, samples), name
        assert eval_settings(spec, 5, 0) == (5, 0), name  # --eval-samples 0: greedy, one episode a row


def test_a_greedy_or_absent_evaluation_plays_one_argmax_episode_a_row() -> None:
    greedy = {"evaluation": {"every_versions": 3, "samples_per_task": 4, "sampling": "greedy"}}
    assert eval_settings(greedy, None, None) == (3, 0)
    assert eval_settings({}, None, None) == (10, 0)
    with pytest.raises(SystemExit, match="eval-every"):
        eval_settings(greedy, 0, None)
