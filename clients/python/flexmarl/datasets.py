"""Task datasets: a job's tasks read from files (``environment.dataset``) rather than made in code.

A task file is JSON Lines (``.jsonl``: one JSON object a line), Parquet (``.parquet``) or a
Hugging Face ``datasets`` directory written by ``Dataset.save_to_disk`` (its Arrow stream files,
listed in ``state.json``, read here with pyarrow: the ``datasets`` library is not needed). A row
is a JSON-like dict; ``fields`` names the ones the environment reads, and a row lacking one (or
holding null there) is malformed.

Order: task ``i`` of a job with ``seed`` is row ``order(epoch)[position]`` of the train rows
(a list of train files: their rows concatenated in list order, each file's malformed rows left out),
where ``epoch, position = divmod(i, rows)`` and ``order(epoch)`` is a permutation drawn from
``(seed, epoch)`` alone (file order without ``shuffle``). Every epoch plays every row once, and
since orchestratord numbers tasks ``batch * prompts_per_step + position`` whatever restarts in
between, a resumed job continues the order exactly. Held-out tasks are the eval file's rows in
file order.

Who reads what: ``flexmarl submit`` resolves the paths, records each file's sha256 in the spec
(:func:`pin_dataset`) and refuses a file with a bad row (:func:`dataset_problems`); rolloutd
opens the files when a job's first task arrives (:func:`open_dataset`), refuses a file whose
content changed since submit, skips (counting and logging) rows that are malformed, and hands the
rows to the environment (``Environment.dataset``), whose default ``task`` returns them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import DatasetSpec, JobSpec

log = logging.getLogger("flexmarl.datasets")

Row = Mapping[str, Any]
Split = Literal["train", "eval"]
DatasetFormat = Literal["jsonl", "parquet", "arrow"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
#: The files ``Dataset.save_to_disk`` writes beside its Arrow shards.
HF_STATE = "state.json"
HF_INFO = "dataset_info.json"
HF_DICT = "dataset_dict.json"
#: Bad rows named one by one in a log line; the rest are counted.
NAMED_PROBLEMS = 3


@dataclasses.dataclass(frozen=True)
class RowsRead:
    """What one task file holds: its good rows, one line per malformed row, and its content's sha256."""

    path: str
    rows: tuple[Row, ...]
    #: One entry per skipped row, e.g. ``line 7: no field 'answer'`` (``row N`` for columnar files, 0-based).
    problems: tuple[str, ...]
    sha256: str


def dataset_format(path: Path) -> DatasetFormat:
    """The format of a task file, from its name (a directory: ``save_to_disk``'s ``arrow``).

    Raises:
        InvalidArgument: no such file, or a name of no known format.
    """
    if path.is_dir():
        if (path / HF_STATE).is_file():
            return "arrow"
        if (path / HF_DICT).is_file():
            splits = _json_file(path / HF_DICT).get("splits", [])
            raise InvalidArgument(f"{path}: a DatasetDict directory; name one split's directory "
                                  f"({', '.join(str(path / str(s)) for s in splits) or 'a subdirectory'})")
        raise InvalidArgument(f"{path}: a directory without {HF_STATE} (not a save_to_disk dataset)")
    if not path.exists():
        raise InvalidArgument(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise InvalidArgument(f"{path}: unknown format {suffix or '(no suffix)'!r} (give a .jsonl or .parquet file "
                          "or a save_to_disk directory)")


def read_rows(path: str | Path, fields: Sequence[str] = ()) -> RowsRead:
    """Reads every row of a task file; malformed rows are left out and named in ``problems``.

    Raises:
        InvalidArgument: the file is missing, of no known format, or unreadable as its format
            (one line naming the file).
    """
    where = Path(path)
    kind = dataset_format(where)
    try:
        if kind == "jsonl":
            content = where.read_bytes()
            rows, problems = _jsonl_rows(content, fields)
            digest = hashlib.sha256(content).hexdigest()
        elif kind == "parquet":
            content = where.read_bytes()
            rows, problems = _table_rows(_parquet_table(where, content), fields)
            digest = hashlib.sha256(content).hexdigest()
        else:
            table, digest = _arrow_dataset(where)
            rows, problems = _table_rows(table, fields)
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read: {exc.strerror or exc}") from None
    return RowsRead(str(where), tuple(rows), tuple(problems), digest)


def content_sha256(path: str | Path) -> str:
    """sha256 (hex) of a task file's content; of a save_to_disk directory, its state and its shards in order."""
    where = Path(path)
    if dataset_format(where) == "arrow":
        return _arrow_digest(where, _arrow_shards(where))
    try:
        return hashlib.sha256(where.read_bytes()).hexdigest()
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read: {exc.strerror or exc}") from None


def _missing_field(row: Mapping[str, Any], fields: Sequence[str]) -> str | None:
    for name in fields:
        if row.get(name) is None:
            return name
    return None


def _jsonl_rows(content: bytes, fields: Sequence[str]) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    problems: list[str] = []
    for number, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are no rows
        try:
            row = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {number}: not JSON ({exc})")
            continue
        if not isinstance(row, dict):
            problems.append(f"line {number}: not a JSON object (a {type(row).__name__})")
            continue
        missing = _missing_field(row, fields)
        if missing is not None:
            problems.append(f"line {number}: no field {missing!r}")
            continue
        rows.append(row)
    return rows, problems


def _table_rows(table: Any, fields: Sequence[str]) -> tuple[list[Row], list[str]]:
    columns = set(table.column_names)
    absent = [name for name in fields if name not in columns]
    if absent:  # every row lacks it: one problem for the file, not one per row
        return [], [f"row 0: no field {absent[0]!r} (no such column; it has {sorted(columns)})"]
    rows: list[Row] = []
    problems: list[str] = []
    for number, row in enumerate(table.to_pylist()):
        missing = _missing_field(row, fields)
        if missing is not None:
            problems.append(f"row {number}: no field {missing!r} (null)")
            continue
        rows.append(row)
    return rows, problems


def _parquet_table(path: Path, content: bytes) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(pa.BufferReader(content))
    except (pa.ArrowException, ValueError) as exc:
        raise InvalidArgument(f"{path}: not a readable parquet file: {exc}") from None


def _json_file(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{path}: not a JSON object")
    return value


def _arrow_shards(directory: Path) -> list[Path]:
    """The Arrow shards ``state.json`` lists, in order (plain file names inside the directory only)."""
    state = _json_file(directory / HF_STATE)
    if state.get("_indices_data_files"):
        raise InvalidArgument(f"{directory}: saved with an indices mapping (an old datasets version); save it "
                              "again with a current one")
    listed = state.get("_data_files")
    if not isinstance(listed, list) or not listed:
        raise InvalidArgument(f"{directory / HF_STATE}: lists no _data_files")
    shards = []
    for entry in listed:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or os.path.basename(name) != name:
            raise InvalidArgument(f"{directory / HF_STATE}: _data_files holds {entry!r}, not a file name")
        shards.append(directory / name)
    return shards


def _arrow_digest(directory: Path, shards: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    try:
        for path in (directory / HF_STATE, *shards):
            digest.update(path.name.encode() + b"\0")
            digest.update(path.read_bytes())
    except OSError as exc:
        raise InvalidArgument(f"{directory}: cannot read: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _arrow_dataset(directory: Path) -> tuple[Any, str]:
    """The rows of a save_to_disk directory (one table over its shards) and its digest."""
    import pyarrow as pa

    shards = _arrow_shards(directory)
    digest = hashlib.sha256()
    tables = []
    for path in (directory / HF_STATE, *shards):
        content = path.read_bytes()
        digest.update(path.name.encode() + b"\0")
        digest.update(content)
        if path.name == HF_STATE:
            continue
        try:
            tables.append(_arrow_table(pa, content))
        except (pa.ArrowException, ValueError) as exc:
            raise InvalidArgument(f"{path}: not a readable Arrow file: {exc}") from None
    try:
        table = pa.concat_tables(tables)
    except (pa.ArrowException, ValueError) as exc:
        raise InvalidArgument(f"{directory}: its shards do not share a schema: {exc}") from None
    return table, digest.hexdigest()


def _arrow_table(pa: Any, content: bytes) -> Any:
    """An Arrow IPC stream (what ``save_to_disk`` writes), or an IPC file."""
    try:
        return pa.ipc.open_stream(io.BytesIO(content)).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(pa.BufferReader(content)).read_all()


class TaskDataset:
    """A job's task rows: the train split in a shuffled order per epoch, the eval split in file order.

    ``skipped`` holds, per split, the malformed rows left out (empty when every row was good).
    """

    def __init__(self, train: Sequence[Row], eval_rows: Sequence[Row] | None = None, *, shuffle: bool = True,
                 skipped: Mapping[str, Sequence[str]] | None = None) -> None:
        if not train:
            raise InvalidArgument("a task dataset needs at least one train row")
        self._train = tuple(train)
        self._eval = tuple(eval_rows) if eval_rows is not None else None
        self.shuffle = shuffle
        self.skipped: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in (skipped or {}).items()}
        self._orders: dict[tuple[int, int], tuple[int, ...]] = {}

    @property
    def train_size(self) -> int:
        """Rows of the train split (one epoch)."""
        return len(self._train)

    @property
    def eval_size(self) -> int | None:
        """Rows of the eval split; None without an eval file."""
        return len(self._eval) if self._eval is not None else None

    def epoch_order(self, epoch: int, seed: int) -> tuple[int, ...]:
        """The train rows of ``epoch``, in play order: a permutation drawn from (seed, epoch) alone."""
        if epoch < 0:
            raise InvalidArgument(f"epoch must be >= 0, got {epoch}")
        if not self.shuffle:
            return tuple(range(len(self._train)))
        key = (seed, epoch)
        order = self._orders.get(key)
        if order is None:
            rows = list(range(len(self._train)))
            random.Random(f"flexmarl-dataset/{seed}/{epoch}").shuffle(rows)
            order = tuple(rows)
            if len(self._orders) >= 2:  # tasks move through epochs in order: keep this one and the last
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return order

    def train_row_number(self, index: int, seed: int) -> int:
        """The train row (0-based, among the good rows) task ``index`` of a job with ``seed`` plays."""
        if index < 0:
            raise InvalidArgument(f"task index must be >= 0, got {index}")
        epoch, position = divmod(index, len(self._train))
        return self.epoch_order(epoch, seed)[position]

    def train_row(self, index: int, seed: int) -> Row:
        """The row task ``index`` of a job with ``seed`` plays."""
        return self._train[self.train_row_number(index, seed)]

    def eval_row(self, index: int) -> Row:
        """Held-out task ``index``: the eval file's row ``index`` (file order).

        Raises:
            InvalidArgument: no eval file, or ``index`` past its rows.
        """
        if self._eval is None:
            raise InvalidArgument("the job's dataset has no eval file (environment.dataset.eval)")
        if not 0 <= index < len(self._eval):
            raise InvalidArgument(f"held-out task {index}: the eval file has {len(self._eval)} rows")
        return self._eval[index]


@dataclasses.dataclass(frozen=True)
class TaskFile:
    """One file the spec names: its split, where the spec names it, its path and the sha256 recorded at submit."""

    split: Split
    #: The spec key naming it, for messages: ``environment.dataset.train``, or ``...train[1]`` in a list.
    key: str
    path: str
    recorded_sha256: str


def task_files(spec: DatasetSpec) -> list[TaskFile]:
    """Every file the spec names: the train files, then the eval files, each split in list order."""
    out = []
    splits: tuple[Split, ...] = ("train", "eval")
    for split in splits:
        listed = spec.listed(split)
        for number, (path, recorded) in enumerate(spec.files(split)):
            key = f"environment.dataset.{split}" + (f"[{number}]" if listed else "")
            out.append(TaskFile(split, key, path, recorded))
    return out


def open_dataset(spec: DatasetSpec) -> TaskDataset:
    """Reads a job's task files as rolloutd does: content checked against submit's, malformed rows skipped.

    Each skipped row is counted in ``TaskDataset.skipped`` and logged (never fatal).

    Raises:
        InvalidArgument: a file is missing or unreadable, its content changed since submit (its
            sha256 differs from the spec's), or no train row is left.
    """
    rows: dict[str, list[Row]] = {}
    skipped: dict[str, list[str]] = {}
    for file in task_files(spec):
        read = read_rows(file.path, spec.fields)
        if file.recorded_sha256 and read.sha256 != file.recorded_sha256:
            raise InvalidArgument(f"{file.key}: {file.path} changed since submit (sha256 "
                                  f"{file.recorded_sha256[:12]}... then, {read.sha256[:12]}... now); submit the job "
                                  "again")
        if read.problems:
            named = "; ".join(read.problems[:NAMED_PROBLEMS])
            more = len(read.problems) - NAMED_PROBLEMS
            log.warning("dataset %s: skipped %d malformed rows (%s%s)", file.path, len(read.problems), named,
                        f"; {more} more" if more > 0 else "")
        several = len(spec.files(file.split)) > 1
        rows.setdefault(file.split, []).extend(read.rows)  # a list's files in list order
        skipped.setdefault(file.split, []).extend(f"{file.path}: {p}" if several else p for p in read.problems)
    if not rows["train"]:
        raise InvalidArgument(f"environment.dataset.train: {spec.describe('train')}: no usable rows "
                              f"({len(skipped['train'])} malformed)")
    return TaskDataset(rows["train"], rows["eval"] if "eval" in rows else None, shuffle=spec.shuffle,
                       skipped=skipped)


def pin_dataset(spec: JobSpec, base_dir: str | Path | None = None) -> JobSpec:
    """The spec with its dataset paths absolute and each file's sha256 recorded (what submit sends).

    Relative paths are taken against ``base_dir`` (default: the current directory); a spec with
    no dataset is returned as is.

    Raises:
        InvalidArgument: a file is missing or unreadable, or its sha256 differs from one the spec gives.
    """
    dataset = spec.environment.dataset
    if dataset is None:
        return spec
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    pinned_files: dict[Split, list[tuple[str, str]]] = {}
    for file in task_files(dataset):
        absolute = os.path.abspath(base / file.path)
        try:
            digest = content_sha256(absolute)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{file.key}: {exc}") from None
        if file.recorded_sha256 and file.recorded_sha256 != digest:
            sha_key = file.key.replace(f".{file.split}", f".{file.split}_sha256", 1)
            raise InvalidArgument(f"{sha_key}: {absolute} has sha256 {digest[:12]}..., "
                                  f"the spec records {file.recorded_sha256[:12]}... (the file changed)")
        pinned_files.setdefault(file.split, []).append((absolute, digest))
    update: dict[str, Any] = {}
    for split, files in pinned_files.items():
        listed = dataset.listed(split)
        update[split] = [path for path, _ in files] if listed else files[0][0]
        update[f"{split}_sha256"] = [digest for _, digest in files] if listed else files[0][1]
    pinned = dataset.model_copy(update=update)
    return spec.model_copy(update={"environment": spec.environment.model_copy(update={"dataset": pinned})})


def dataset_problems(spec: JobSpec) -> list[str]:
    """The job's task files as submit checks them: one line per file that rolloutd could not use whole.

    Each line names the field, the file, the first bad row and the field it lacks, e.g.
    ``environment.dataset.train: /data/train.jsonl: line 7: no field 'answer' (2 more bad rows)``.
    Also checks ``epochs`` against the tasks the job needs, and ``evaluation.tasks`` against the eval file's rows.
    """
    dataset = spec.environment.dataset
    if dataset is None:
        return []
    problems = []
    counted = {"train": 0, "eval": 0}
    for file in task_files(dataset):
        try:
            rows = read_rows(file.path, dataset.fields)
        except InvalidArgument as exc:
            problems.append(f"{file.key}: {exc}")
            continue
        if rows.problems:
            more = len(rows.problems) - 1
            problems.append(f"{file.key}: {file.path}: {rows.problems[0]}"
                            + (f" ({more} more bad rows)" if more else ""))
        elif not rows.rows:
            problems.append(f"{file.key}: {file.path}: no rows")
        counted[file.split] += len(rows.rows)
    train_rows, eval_rows = counted["train"], counted["eval"]
    if spec.evaluation is not None and eval_rows and spec.evaluation.tasks > eval_rows:
        problems.append(f"evaluation.tasks: {spec.evaluation.tasks} held-out tasks, but environment.dataset.eval "
                        f"{dataset.describe('eval')} has {eval_rows} rows")
    needed = spec.total_steps * spec.batch.prompts_per_step
    if dataset.epochs is not None and train_rows and needed > dataset.epochs * train_rows:
        problems.append(f"environment.dataset.epochs: {dataset.epochs} passes over {dataset.describe('train')} "
                        f"({train_rows} rows) are {dataset.epochs * train_rows} tasks; total_steps "
                        f"{spec.total_steps} x batch.prompts_per_step {spec.batch.prompts_per_step} needs {needed}")
    return problems
