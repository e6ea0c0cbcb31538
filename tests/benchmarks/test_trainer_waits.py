"""benchmarks.trainer_waits: a trainer step split into busy, waiting for its micro-batches and the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import trainer_waits as tw


def rec(kind: str, start_s: float, end_s: float) -> dict[str, object]:
    return {"kind": kind, "start_s": start_s, "end_s": end_s, "modelled_s": 4 * (end_s - start_s)}


def test_a_step_is_busy_waiting_for_its_micro_batches_or_otherwise_idle() -> None:
    work = [rec("train", 1.0, 3.0), rec("train", 5.0, 6.0), rec("optimizer", 6.0, 7.0)]
    # micro-batch 0 was written at 0.5 (0.5 s after the last commit), micro-batch 1 at 4.5 (1.5 s after the
    # first one's work ended); it still started only at 5.0 and the commit came at 8.0: 2 s of other
    split = tw.split_step(0.0, 8.0, work, [0.5, 4.5])
    assert (split.span_s, split.busy_s, split.wait_data_s, split.other_s) == pytest.approx((8.0, 4.0, 2.0, 2.0))
    # data already there: no waiting, the gaps are other
    assert tw.split_step(0.0, 8.0, work, [0.0, 0.0]).wait_data_s == 0.0
    with pytest.raises(ValueError, match="2 micro-batches trained, 1 ready"):
        tw.split_step(0.0, 8.0, work, [0.5])


def test_steps_are_cut_at_optimizer_steps_and_micro_batches_complete_in_write_order() -> None:
    records = [rec("train", 4.0, 5.0), rec("train", 0.0, 1.0), rec("optimizer", 1.0, 2.0), rec("optimizer", 5.0, 6.0)]
    assert [[r["start_s"] for r in step] for step in tw.steps_of(records)] == [[0.0, 1.0], [4.0, 5.0]]
    assert tw.micro_batch_ready([3.0, 1.0, 2.0, 4.0], 2) == [2.0, 4.0]
    with pytest.raises(ValueError, match="3 experiences"):
        tw.micro_batch_ready([1.0, 2.0, 3.0], 2)


def test_a_directory_that_is_not_a_kept_run_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "device.json").write_text("{}")
    (tmp_path / "traces").mkdir()  # benchmarks.run --keep: no history.json
    with pytest.raises(SystemExit) as exit_info:
        tw.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path}: not a kept time_to_reward run directory (no history.json)" in capsys.readouterr().err
