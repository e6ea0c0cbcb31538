"""Task datasets (flexmarl.datasets): the three file formats, the order per epoch, submit's checks and
pinning, rolloutd's refusal of a changed file, and the episode API's default task() / eval_task().

The parquet and save_to_disk files are written here with pyarrow, the way pandas and Hugging Face
``datasets`` write them (save_to_disk: Arrow IPC stream shards listed in state.json)."""

from __future__ import annotations

import json
import logging
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from examples.word_problems import make_data
from flexmarl.cli import main
from flexmarl.client import Client
from flexmarl.datasets import (
    TaskDataset,
    content_sha256,
    dataset_problems,
    open_dataset,
    pin_dataset,
    read_rows,
)
from flexmarl.episode import Environment, EpisodeContext, Task, held_out_seed, load_environment
from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import DatasetSpec, JobSpec, load_job_spec, parse_job_spec
from flexmarl.preflight import preflight_problems
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.timeout(60)

ROWS = [{"question": f"{i}+1=", "answer": i + 1, "tags": ["t", str(i)]} for i in range(7)]


class RowEnv(Environment):
    """An environment with no task code: its tasks are the job's dataset rows."""

    agents = ("sender", "receiver")

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        raise NotImplementedError  # never played here


def write_jsonl(path: Path, rows: list[Any], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(line + "\n" for line in extra_lines))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_save_to_disk(directory: Path, rows: list[dict[str, Any]], shards: int = 2) -> Path:
    """A directory as ``Dataset.save_to_disk`` leaves it: stream shards, state.json, dataset_info.json."""
    directory.mkdir()
    table = pa.Table.from_pylist(rows)
    per_shard = -(-len(rows) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * per_shard, per_shard))
    (directory / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "abc", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
    (directory / "dataset_info.json").write_text(json.dumps({"features": {}, "citation": ""}))
    return directory


def job(dataset: dict[str, Any] | None, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "rows", "seed": 5, "total_steps": 2,
        "environment": {"entrypoint": f"{__name__}:RowEnv"},
        "agents": [{"name": "sender", "model": "/m"}, {"name": "receiver", "model": "/m"}],
        "batch": {"prompts_per_step": 3, "group_size": 2, "micro_batch_size": 2},
    }
    if dataset is not None:
        spec["environment"]["dataset"] = dataset
    spec.update(overrides)
    return spec


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk"])
def test_each_format_reads_the_same_rows(tmp_path: Path, kind: str) -> None:
    path = {"jsonl": lambda: write_jsonl(tmp_path / "t.jsonl", ROWS),
            "parquet": lambda: write_parquet(tmp_path / "t.parquet", ROWS),
            "save_to_disk": lambda: write_save_to_disk(tmp_path / "t", ROWS)}[kind]()
    read = read_rows(path, ["question", "answer"])
    assert list(read.rows) == ROWS and read.problems == ()
    assert read.sha256 == content_sha256(path) and len(read.sha256) == 64


def test_a_dataset_dict_directory_names_its_splits(tmp_path: Path) -> None:
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(InvalidArgument, match=r"DatasetDict directory; name one split's directory .*dd/train"):
        read_rows(tmp_path / "dd")


def test_malformed_rows_are_skipped_and_named(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:2], extra_lines=("", "{oops", "[1, 2]", '{"question": "q"}',
                                                                     '{"question": "q", "answer": null}'))
    read = read_rows(path, ["question", "answer"])
    assert list(read.rows) == ROWS[:2]
    assert [p.split(":")[0] for p in read.problems] == ["line 4", "line 5", "line 6", "line 7"]
    assert read.problems[2] == "line 6: no field 'answer'"
    columnar = read_rows(write_parquet(tmp_path / "t.parquet", [*ROWS[:2], {"question": "q", "answer": None}]),
                         ["answer"])
    assert columnar.problems == ("row 2: no field 'answer' (null)",) and len(columnar.rows) == 2


# ---------------------------------------------------------------- order


def test_each_epoch_plays_every_row_once_in_an_order_fixed_by_the_seed() -> None:
    rows = [{"n": i} for i in range(7)]
    dataset = TaskDataset(rows)
    for seed in (0, 5):
        for epoch in range(3):
            played = [dataset.train_row(epoch * 7 + p, seed)["n"] for p in range(7)]
            assert sorted(played) == list(range(7))
    first = [dataset.train_row(i, 5)["n"] for i in range(21)]
    assert first == [TaskDataset(rows).train_row(i, 5)["n"] for i in range(21)]  # a fresh process: same order
    assert first[:7] != first[7:14] or first[7:14] != first[14:]  # epochs are reshuffled
    assert first != [dataset.train_row(i, 6)["n"] for i in range(21)]  # another seed, another order
    assert [TaskDataset(rows, shuffle=False).train_row(i, 5)["n"] for i in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    # Task i's row depends on i alone: asked out of order (a resumed job, re-issued tasks), the same rows.
    assert [dataset.train_row(i, 5)["n"] for i in reversed(range(21))] == first[::-1]


def test_held_out_rows_are_the_eval_file_in_order() -> None:
    dataset = TaskDataset([{"n": 0}], [{"e": 0}, {"e": 1}])
    assert [dataset.eval_row(i)["e"] for i in range(2)] == [0, 1] and dataset.eval_size == 2
    with pytest.raises(InvalidArgument, match="held-out task 2: the eval file has 2 rows"):
        dataset.eval_row(2)


# ---------------------------------------------------------------- submit and rolloutd


def test_job_file_paths_are_relative_to_the_job_file_and_submit_pins_their_content(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", ROWS)
    write_parquet(data / "eval.parquet", ROWS[:3])
    job_file = tmp_path / "jobs" / "job.json"
    job_file.parent.mkdir()
    job_file.write_text(json.dumps(job({"train": "../data/train.jsonl", "eval": str(data / "eval.parquet"),
                                        "fields": ["question"]})))
    spec = load_job_spec(job_file)
    assert spec.environment.dataset is not None and spec.environment.dataset.train == str(data / "train.jsonl")
    pinned = pin_dataset(spec)
    dataset = pinned.environment.dataset
    assert dataset is not None
    assert (dataset.train_sha256, dataset.eval_sha256) == (content_sha256(data / "train.jsonl"),
                                                           content_sha256(data / "eval.parquet"))
    assert pin_dataset(pinned) == pinned  # pinned again (a resubmitted spec): the same
    relative = pin_dataset(parse_job_spec(job({"train": "train.jsonl"})), base_dir=data)
    assert relative.environment.dataset is not None
    assert relative.environment.dataset.train == str(data / "train.jsonl")

    opened = open_dataset(dataset)
    assert (opened.train_size, opened.eval_size) == (7, 3)
    write_jsonl(data / "train.jsonl", ROWS[::-1])  # changed since submit
    with pytest.raises(InvalidArgument) as changed:
        open_dataset(dataset)
    assert str(changed.value).startswith(f"environment.dataset.train: {data / 'train.jsonl'} changed since submit")
    with pytest.raises(InvalidArgument, match="train_sha256: .* the spec records"):
        pin_dataset(pinned)


def test_a_list_of_files_is_concatenated_in_list_order_then_shuffled_and_each_file_is_pinned(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    first = write_jsonl(tmp_path / "data" / "a.jsonl", ROWS[:3])
    second = write_parquet(tmp_path / "data" / "b.parquet", ROWS[3:])
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job({"train": ["data/a.jsonl", "data/b.parquet"], "eval": ["data/a.jsonl"],
                                        "fields": ["question"]})))
    spec = pin_dataset(load_job_spec(job_file))
    dataset = spec.environment.dataset
    assert dataset is not None and dataset.train == [str(first), str(second)] and dataset.eval == [str(first)]
    assert dataset.train_sha256 == [content_sha256(first), content_sha256(second)]
    assert dataset.eval_sha256 == [content_sha256(first)]
    assert pin_dataset(spec) == spec  # pinned again (a resubmitted spec): the same
    opened = open_dataset(dataset)
    assert (opened.train_size, opened.eval_size) == (7, 3)
    one_file = TaskDataset(ROWS)  # the same rows in one file, in the list's order: the same task order
    assert [opened.train_row(i, seed=5) for i in range(14)] == [one_file.train_row(i, seed=5) for i in range(14)]
    assert [open_dataset(dataset.model_copy(update={"shuffle": False})).train_row(i, 5) for i in range(7)] == ROWS
    single = pin_dataset(parse_job_spec(job({"train": str(first)}))).environment.dataset
    assert single is not None and (single.train, single.train_sha256) == (str(first), content_sha256(first))

    write_parquet(second, ROWS[3:][::-1])  # the list's second file changed since submit
    with pytest.raises(InvalidArgument) as changed:
        open_dataset(dataset)
    assert str(changed.value).startswith(f"environment.dataset.train[1]: {second} changed since submit")
    with pytest.raises(InvalidArgument, match=r"^environment\.dataset\.train_sha256\[1\]: .* the spec records"):
        pin_dataset(spec)


def test_submit_names_the_file_of_a_list_that_is_missing_or_holds_a_bad_row(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    missing = tmp_path / "nope.jsonl"
    assert _one_line(job({"train": [str(good), str(missing)]})) == (
        f"environment.dataset.train[1]: {missing}: no such file")
    with pytest.raises(InvalidArgument, match=rf"^environment\.dataset\.train\[1\]: {missing}: no such file$"):
        pin_dataset(parse_job_spec(job({"train": [str(good), str(missing)]})))
    bad = write_jsonl(tmp_path / "bad.jsonl", ROWS, extra_lines=('{"question": "q"}',))
    assert _one_line(job({"train": [str(good), str(bad)], "fields": ["question", "answer"]})) == (
        f"environment.dataset.train[1]: {bad}: line 8: no field 'answer'")
    assert _one_line(job({"train": [str(good)], "eval": [str(good), str(bad)], "fields": ["answer"]})) == (
        f"environment.dataset.eval[1]: {bad}: line 8: no field 'answer'")
    two = write_jsonl(tmp_path / "two.jsonl", ROWS[:2])
    assert _one_line(job({"train": [str(two), str(two)], "epochs": 1})) == (  # rows counted over the list
        f"environment.dataset.epochs: 1 passes over {two}, {two} (2 files) (4 rows) are 4 tasks; total_steps 2 x "
        "batch.prompts_per_step 3 needs 6")
    for dataset, error in (({"train": [str(good), str(two)], "train_sha256": [content_sha256(good)]},
                            "environment.dataset: train_sha256: 1 sha256s for the 2 files of train"),
                           ({"train": [str(good)], "train_sha256": content_sha256(good)},
                            "environment.dataset: train_sha256: one sha256 per file of train: a list of 1"),
                           ({"train": []}, "environment.dataset.train: must have at least 1 item(s), got 0"),
                           ({"train": [str(good), ""]}, "environment.dataset.train[1]: must not be empty"),
                           ({"train": 3}, "environment.dataset.train: must be a file path or a list of file paths, "
                                          "got 3")):
        with pytest.raises(InvalidArgument) as refused:
            parse_job_spec(job(dataset))
        assert str(refused.value) == error


def test_rolloutd_skips_and_counts_malformed_rows_of_an_unchecked_file(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ROWS, extra_lines=('{"question": "q"}',) * 5)
    spec = DatasetSpec(train=str(path), fields=["answer"])
    with caplog.at_level(logging.WARNING, logger="flexmarl.datasets"):
        dataset = open_dataset(spec)
    assert dataset.train_size == 7 and len(dataset.skipped["train"]) == 5
    assert f"dataset {path}: skipped 5 malformed rows (line 8: no field 'answer'" in caplog.text
    assert "; 2 more)" in caplog.text


def _one_line(spec: dict[str, Any]) -> str:
    problems = dataset_problems(parse_job_spec(spec))
    assert len(problems) == 1, problems
    return problems[0]


def test_submit_refuses_bad_files_with_one_line_naming_the_file_row_and_field(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    assert _one_line(job({"train": str(missing)})) == f"environment.dataset.train: {missing}: no such file"
    bad = write_jsonl(tmp_path / "bad.jsonl", ROWS, extra_lines=('{"question": "q"}', '{"answer": 1}'))
    assert _one_line(job({"train": str(bad), "fields": ["question", "answer"]})) == (
        f"environment.dataset.train: {bad}: line 8: no field 'answer' (1 more bad rows)")
    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n")
    assert _one_line(job({"train": str(csv)})) == (
        f"environment.dataset.train: {csv}: unknown format '.csv' (give a .jsonl or .parquet file or a "
        "save_to_disk directory)")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    assert _one_line(job({"train": str(broken)})).startswith(
        f"environment.dataset.train: {broken}: not a readable parquet file: ")
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    no_column = write_parquet(tmp_path / "e.parquet", [{"question": "q"}])
    assert _one_line(job({"train": str(good), "eval": str(no_column), "fields": ["answer"]})).startswith(
        f"environment.dataset.eval: {no_column}: row 0: no field 'answer' (no such column")
    # 2 steps x 3 prompts = 6 tasks; one pass over 7 rows is enough, over 2 rows is not.
    assert dataset_problems(parse_job_spec(job({"train": str(good), "epochs": 1}))) == []
    held_out = write_jsonl(tmp_path / "held_out.jsonl", ROWS[:3])
    assert _one_line(job({"train": str(good), "eval": str(held_out)}, evaluation={"tasks": 4})) == (
        f"evaluation.tasks: 4 held-out tasks, but environment.dataset.eval {held_out} has 3 rows")
    two = write_jsonl(tmp_path / "two.jsonl", ROWS[:2])
    assert _one_line(job({"train": str(two), "epochs": 2})) == (
        f"environment.dataset.epochs: 2 passes over {two} (2 rows) are 4 tasks; total_steps 2 x "
        "batch.prompts_per_step 3 needs 6")


def test_preflight_checks_the_files_and_that_someone_makes_the_tasks(tmp_path: Path) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    assert preflight_problems(parse_job_spec(job({"train": str(bad), "fields": ["answer"]}))) == [
        f"environment.dataset.train: {bad}: line 1: no field 'answer'"]
    assert preflight_problems(parse_job_spec(job(None))) == [
        f"environment.dataset: '{__name__}:RowEnv' does not override task(index, seed), so its tasks come from "
        "a dataset: give environment.dataset"]


# ---------------------------------------------------------------- the episode API


def test_an_environment_over_a_dataset_needs_no_task_code(tmp_path: Path) -> None:
    spec: JobSpec = pin_dataset(parse_job_spec(job({"train": str(write_jsonl(tmp_path / "t.jsonl", ROWS)),
                                                    "eval": str(write_jsonl(tmp_path / "e.jsonl", ROWS[:2]))})))
    assert spec.environment.dataset is not None
    dataset = open_dataset(spec.environment.dataset)
    env = load_environment(f"{__name__}:RowEnv", {}, dataset)
    assert env.dataset is dataset
    task = env.task(9, spec.seed)
    assert task == Task(9, 5, dataset.train_row(9, 5)) and task.data in ROWS
    assert env.eval_task(1, spec.seed) == Task(1, 5, ROWS[1]) and env.held_out_tasks() == 2

    without_eval = TaskDataset(ROWS)
    env = load_environment(f"{__name__}:RowEnv", {}, without_eval)
    # No eval file: the default held-out stream, i.e. train rows in the held-out seed's order.
    assert env.eval_task(3, 5).data == without_eval.train_row(3, held_out_seed(5)) and env.held_out_tasks() is None

    bare = load_environment(f"{__name__}:RowEnv")
    with pytest.raises(InvalidArgument, match="RowEnv has no tasks: override task"):
        bare.task(0, 0)


def test_the_word_problem_files_are_what_make_data_writes_and_split_as_documented() -> None:
    assert make_data.main(["--check"]) == 0
    train = read_rows(make_data.TRAIN_PATH, ["question", "answer", "choices", "label"])
    held_out = read_rows(make_data.EVAL_PATH, ["question", "answer", "choices", "label", "held_out"])
    assert (len(train.rows), len(held_out.rows)) == (make_data.TRAIN_ROWS, make_data.EVAL_ROWS)
    assert train.problems == held_out.problems == ()
    facts = {r["expression"] for r in train.rows}
    assert not {r["question"] for r in train.rows} & {r["question"] for r in held_out.rows}  # no eval row is in train
    new_facts = {r["expression"] for r in held_out.rows if r["held_out"] == "fact"}
    assert len(new_facts) == make_data.HELD_OUT_FACTS and not new_facts & facts
    assert all("+".join(reversed(fact.split("+"))) in facts for fact in new_facts)  # the commuted sum is in train
    assert {r["expression"] for r in held_out.rows if r["held_out"] == "wording"} <= facts
    for row in (*train.rows, *held_out.rows):
        assert len(row["question"]) <= 64 and isinstance(row["answer"], int) and 0 <= row["answer"] <= 9
        assert row["choices"]["ABCD".index(row["label"])] == row["answer"] and len(set(row["choices"])) == 4


def test_flexmarl_submit_refuses_a_bad_row_in_one_line_before_reaching_a_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXMARL_ORCHESTRATOR", raising=False)
    monkeypatch.delenv("FLEXMARL_ETCD_ENDPOINTS", raising=False)
    (tmp_path / "jobs").mkdir()
    write_jsonl(tmp_path / "jobs" / "train.jsonl", [ROWS[0], {"question": "q"}])
    job_file = tmp_path / "jobs" / "job.json"
    job_file.write_text(json.dumps(job({"train": "train.jsonl", "fields": ["question", "answer"]})))
    assert main(["submit", str(job_file), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"flexmarl submit: {job_file}: environment.dataset.train: "
                                       f"{tmp_path / 'jobs' / 'train.jsonl'}: line 2: no field 'answer'\n")
    write_jsonl(tmp_path / "jobs" / "more.jsonl", ROWS)  # a list of files: the bad one named by its place
    job_file.write_text(json.dumps(job({"train": ["more.jsonl", "train.jsonl"], "fields": ["question", "answer"]})))
    assert main(["submit", str(job_file), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"flexmarl submit: {job_file}: environment.dataset.train[1]: "
                                       f"{tmp_path / 'jobs' / 'train.jsonl'}: line 2: no field 'answer'\n")


class RecordingOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Accepts every job and keeps the spec JSON it was sent."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def SubmitJob(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.submitted.append(request.spec_json)
        return orchestrator_pb2.SubmitJobResponse(job_id="rows-1")


def test_the_sdk_sends_absolute_paths_and_the_files_sha256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    servicer = RecordingOrchestrator()  # type: ignore[abstract]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(address=f"127.0.0.1:{port}") as client:
            assert client.submit(job({"train": "train.jsonl"}), preflight=False) == "rows-1"
    finally:
        server.stop(0)
    sent = json.loads(servicer.submitted[0])["environment"]["dataset"]
    assert sent["train"] == str(tmp_path / "train.jsonl")
    assert sent["train_sha256"] == content_sha256(tmp_path / "train.jsonl")
