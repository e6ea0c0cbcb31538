"""Experience store: durable, idempotent appends; queries; state transitions; GC.

Every method blocks (SQLite); the servicer runs them in worker threads. Methods take
and return dataclasses (:class:`ExperienceRecord`, :class:`ExperienceRef`, ...),
never protos.

Integrity: each row carries the sha256 of its immutable content (ids, numbers,
reward and the packed arrays), computed at append time. A retried append is
recognised by that digest (a duplicate, not an error); a different record under an
existing id is ALREADY_EXISTS; a read recomputes the digest and answers DATA_LOSS
rather than serve a row that does not match what was acknowledged.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import sqlite3
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from flexmarl.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from flexmarl.experience import (
    LOGPROB_DTYPE,
    SPAN_DTYPE,
    TOKEN_DTYPE,
    ExperienceRecord,
    ExperienceState,
    check_version_spans,
)
from flexmarl.ids import AGENT_NAME_PATTERN, JOB_ID_PATTERN, ExperienceKey, GroupRef, is_job_id
from flexmarl.store_client import ExperienceRef, ExperienceStats
from stored.database import Database, JobQuotas, check_quota

log = logging.getLogger(__name__)

AGENT_RE = re.compile(AGENT_NAME_PATTERN)
# Task and step ids are made by orchestratord; they may contain '/', ':' and '.'.
TASK_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,255}")
STEP_ID_RE = TASK_ID_RE
EPISODE_ID_RE = re.compile(r"[A-Za-z0-9._:/-]{0,256}")
# SQLite's default limit on host parameters is 32766; stay far below it.
_IN_BATCH = 500
# Retentions are capped here (about 31,700 years): older than anything, and the cutoff fits SQLite int64.
_MAX_RETENTION_S = 1e12
_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class ExperienceLimits:
    """Explicit bounds on what one request may carry or return.

    Attributes:
        max_record_bytes: packed payload (prompt + response + logprobs) of one record.
        max_append_records: records in one append request.
        max_read_ids: ids in one read request.
        max_query_results: refs one query returns (also the default when limit is 0).
        read_batch_bytes: payload bytes per streamed read message (at least one record).
    """

    max_record_bytes: int = 16 << 20
    max_append_records: int = 16384
    max_read_ids: int = 65536
    max_query_results: int = 100_000
    read_batch_bytes: int = 4 << 20


@dataclass(frozen=True)
class AppendResult:
    """Outcome of one append: new rows and retried (identical) ones."""

    appended: int
    duplicates: int
    appended_bytes: int


@dataclass(frozen=True)
class GarbageCollected:
    """Rows and payload bytes that garbage collection deleted, and the jobs it left alone."""

    deleted_rows: int
    deleted_bytes: int
    skipped_running_jobs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperienceQuery:
    """A filter over one (job, agent) partition."""

    job_id: str
    agent: str
    state: ExperienceState | None = None
    min_behavior_version: int = 0
    max_behavior_version: int = -1
    complete_groups_only: bool = False
    step_id: str = ""
    limit: int = 0
    group_id: str = ""


@dataclass(frozen=True)
class _PackedRecord:
    record: ExperienceRecord
    prompt: bytes
    response: bytes
    logprobs: bytes
    spans: bytes
    digest: bytes

    @property
    def payload_bytes(self) -> int:
        return len(self.prompt) + len(self.response) + len(self.logprobs) + len(self.spans)


def validate_job_id(job_id: str) -> None:
    """Raises InvalidArgument unless job_id is a well-formed job id."""
    if not is_job_id(job_id):
        raise InvalidArgument(f"bad job_id {job_id!r}: expected {JOB_ID_PATTERN}")


def validate_agent(agent: str) -> None:
    """Raises InvalidArgument unless agent is a well-formed agent name."""
    if not AGENT_RE.fullmatch(agent):
        raise InvalidArgument(f"bad agent {agent!r}: expected [a-z][a-z0-9_-]{{0,31}}")


def validate_step_id(step_id: str) -> None:
    """Raises InvalidArgument unless step_id is a well-formed step id."""
    if not STEP_ID_RE.fullmatch(step_id):
        raise InvalidArgument(f"bad step_id {step_id!r}")


def content_digest(
    record: ExperienceRecord, prompt: bytes, response: bytes, logprobs: bytes, spans: bytes = b""
) -> bytes:
    """sha256 over every immutable field of a record (not state, step or times).

    The version spans of an interrupted response, a re-tokenized message count and the episode
    return are hashed only when there are any, so the digest of every record without them is
    what it was before they existed.
    """
    h = hashlib.sha256()
    for text in (
        record.experience_id, record.job_id, record.agent, record.task_id, record.group_id, record.episode_id
    ):
        encoded = text.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    h.update(
        struct.pack(
            "<QQqdQQQQ", record.sample_index, record.turn, record.behavior_version, record.reward,
            record.group_size, len(prompt), len(response), len(logprobs),
        )
    )
    h.update(prompt)
    h.update(response)
    h.update(logprobs)
    if spans:
        h.update(struct.pack("<Q", len(spans)))
        h.update(spans)
    if record.retokenized_messages:
        h.update(b"retokenized")
        h.update(struct.pack("<Q", record.retokenized_messages))
    if record.episode_return is not None:
        h.update(b"episode_return")
        h.update(struct.pack("<d", record.episode_return))
    return h.digest()


def _pack(array: npt.NDArray[Any], dtype: np.dtype[Any], what: str, exp_id: str) -> bytes:
    if array.ndim != 1:
        raise InvalidArgument(f"experience {exp_id!r}: {what} must be 1-D, got shape {array.shape}")
    if array.dtype != dtype:
        if dtype.kind == "i" and array.dtype.kind in "iu":
            if array.size and (int(array.min()) < -(1 << 31) or int(array.max()) >= (1 << 31)):
                raise InvalidArgument(f"experience {exp_id!r}: {what} does not fit int32")
        elif not (dtype.kind == "f" and array.dtype.kind == "f"):
            raise InvalidArgument(f"experience {exp_id!r}: {what} has dtype {array.dtype}, expected {dtype}")
    return np.ascontiguousarray(array, dtype=dtype).tobytes()


def validate_record(record: ExperienceRecord, limits: ExperienceLimits) -> _PackedRecord:
    """Checks one record for append and packs its arrays; raises InvalidArgument/ResourceExhausted."""
    exp_id = record.experience_id
    validate_job_id(record.job_id)
    validate_agent(record.agent)
    if not TASK_ID_RE.fullmatch(record.task_id):
        raise InvalidArgument(f"experience {exp_id!r}: bad task_id {record.task_id!r}")
    if not EPISODE_ID_RE.fullmatch(record.episode_id):
        raise InvalidArgument(f"experience {exp_id!r}: bad episode_id {record.episode_id!r}")
    if record.group_size < 1:
        raise InvalidArgument(f"experience {exp_id!r}: group_size must be >= 1, got {record.group_size}")
    if not 0 <= record.sample_index < record.group_size:
        raise InvalidArgument(
            f"experience {exp_id!r}: sample_index {record.sample_index} not in [0, {record.group_size})"
        )
    if not 0 <= record.turn < (1 << 31):
        raise InvalidArgument(f"experience {exp_id!r}: bad turn {record.turn}")
    if not 0 <= record.behavior_version <= _INT64_MAX:
        raise InvalidArgument(f"experience {exp_id!r}: behavior_version must be >= 0")
    if not 0 <= record.retokenized_messages < (1 << 31):
        raise InvalidArgument(f"experience {exp_id!r}: bad retokenized_messages {record.retokenized_messages}")
    expected_id = str(ExperienceKey(record.task_id, record.sample_index, record.agent, record.turn))
    if exp_id != expected_id:
        raise InvalidArgument(f"bad experience_id {exp_id!r}: expected {expected_id!r} (task/sample/agent/turn)")
    expected_group = str(GroupRef(record.task_id, record.agent))
    if record.group_id != expected_group:
        raise InvalidArgument(f"experience {exp_id!r}: bad group_id {record.group_id!r}, expected {expected_group!r}")
    if not math.isfinite(record.reward):
        raise InvalidArgument(f"experience {exp_id!r}: reward must be finite, got {record.reward}")
    if record.episode_return is not None and not math.isfinite(record.episode_return):
        raise InvalidArgument(f"experience {exp_id!r}: episode_return must be finite, got {record.episode_return}")
    if record.state != ExperienceState.READY or record.step_id:
        raise InvalidArgument(f"experience {exp_id!r}: appended experiences must be READY with no step_id")
    prompt = _pack(record.prompt_token_ids, TOKEN_DTYPE, "prompt_token_ids", exp_id)
    response = _pack(record.response_token_ids, TOKEN_DTYPE, "response_token_ids", exp_id)
    logprobs = _pack(record.response_logprobs, LOGPROB_DTYPE, "response_logprobs", exp_id)
    if len(logprobs) // LOGPROB_DTYPE.itemsize != len(response) // TOKEN_DTYPE.itemsize:
        raise InvalidArgument(
            f"experience {exp_id!r}: {len(logprobs) // 4} logprobs for {len(response) // 4} response tokens"
        )
    spans = check_version_spans(
        np.asarray(record.response_version_spans).reshape(-1), record.behavior_version,
        len(response) // TOKEN_DTYPE.itemsize, f"experience {exp_id!r}",
    )
    packed_spans = np.ascontiguousarray(spans, dtype=SPAN_DTYPE).tobytes() if spans.size else b""
    packed = _PackedRecord(record, prompt, response, logprobs, packed_spans,
                           content_digest(record, prompt, response, logprobs, packed_spans))
    if packed.payload_bytes > limits.max_record_bytes:
        raise ResourceExhausted(
            f"experience {exp_id!r}: {packed.payload_bytes} payload bytes > limit {limits.max_record_bytes}"
        )
    return packed


def _chunks(items: Sequence[str], size: int = _IN_BATCH) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


def _bump_stats(
    conn: sqlite3.Connection, job_id: str, agent: str, state: int, rows: int, payload_bytes: int
) -> None:
    conn.execute(
        "INSERT INTO partition_stats (job_id, agent, state, rows, bytes) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (job_id, agent, state) DO UPDATE SET rows = rows + excluded.rows, "
        "bytes = bytes + excluded.bytes",
        (job_id, agent, state, rows, payload_bytes),
    )
    conn.execute(
        "DELETE FROM partition_stats WHERE job_id = ? AND agent = ? AND state = ? AND rows = 0",
        (job_id, agent, state),
    )


_RECORD_COLUMNS = (
    "experience_id, job_id, agent, task_id, group_id, sample_index, episode_id, turn, behavior_version, "
    "reward, group_size, state, step_id, created_unix_ms, prompt_token_ids, response_token_ids, "
    "response_logprobs, content_sha256, response_version_spans, retokenized_messages, episode_return"
)
_REF_COLUMNS = (
    "seq, experience_id, group_id, task_id, sample_index, behavior_version, response_tokens, prompt_tokens, "
    "reward, state, step_id, group_size, episode_return"
)


def _row_to_record(row: tuple[Any, ...]) -> ExperienceRecord:
    (exp_id, job_id, agent, task_id, group, sample, episode, turn, version, reward, group_size, state, step_id,
     created, prompt, response, logprobs, digest, spans, retokenized, episode_return) = row
    try:
        version_spans = check_version_spans(
            np.frombuffer(spans, dtype=SPAN_DTYPE), int(version), len(response) // TOKEN_DTYPE.itemsize,
            f"experience {exp_id!r}",
        )
    except InvalidArgument as exc:
        log.error("experience %r of job %r has malformed version spans: %s", exp_id, job_id, exc)
        raise DataLoss(f"experience {exp_id!r} of job {job_id!r} is corrupt (version spans)") from exc
    record = ExperienceRecord(
        experience_id=str(exp_id),
        job_id=str(job_id),
        agent=str(agent),
        task_id=str(task_id),
        group_id=str(group),
        sample_index=int(sample),
        episode_id=str(episode),
        turn=int(turn),
        behavior_version=int(version),
        reward=float(reward),
        prompt_token_ids=np.frombuffer(prompt, dtype=TOKEN_DTYPE),
        response_token_ids=np.frombuffer(response, dtype=TOKEN_DTYPE),
        response_logprobs=np.frombuffer(logprobs, dtype=LOGPROB_DTYPE),
        group_size=int(group_size),
        state=ExperienceState(int(state)),
        step_id=str(step_id),
        created_unix_ms=int(created),
        response_version_spans=version_spans,
        retokenized_messages=int(retokenized),
        episode_return=None if episode_return is None else float(episode_return),
    )
    actual = content_digest(record, prompt, response, logprobs, bytes(spans))
    if actual != digest:
        log.error("experience %r of job %r fails its content digest", exp_id, job_id)
        raise DataLoss(f"experience {exp_id!r} of job {job_id!r} is corrupt (content digest mismatch)")
    return record


def _row_to_ref(row: tuple[Any, ...]) -> ExperienceRef:
    (_seq, exp_id, group, task_id, sample, version, response_tokens, prompt_tokens, reward, state, step_id,
     _group_size, episode_return) = row
    return ExperienceRef(
        experience_id=str(exp_id),
        group_id=str(group),
        task_id=str(task_id),
        sample_index=int(sample),
        behavior_version=int(version),
        response_tokens=int(response_tokens),
        prompt_tokens=int(prompt_tokens),
        reward=float(reward),
        state=ExperienceState(int(state)),
        step_id=str(step_id),
        episode_return=None if episode_return is None else float(episode_return),
    )


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class ExperienceStore:
    """Experiences of every job, partitioned by (job_id, agent), in one SQLite database."""

    def __init__(
        self,
        db: Database,
        *,
        limits: ExperienceLimits | None = None,
        quotas: JobQuotas | None = None,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        self._db = db
        self.limits = limits or ExperienceLimits()
        self._quotas = quotas or JobQuotas()
        self._clock_ms = clock_ms

    # ---- append -------------------------------------------------------------------

    def append(self, records: Sequence[ExperienceRecord]) -> AppendResult:
        """Stores records in one transaction, durable when this returns.

        Idempotent on (job_id, experience_id): a record already stored with the same
        content counts as a duplicate. All or nothing: any bad record fails the batch.

        Raises:
            InvalidArgument: a malformed record, or an empty batch.
            ResourceExhausted: too many records, a record too large, or a job over quota.
            AlreadyExists: an id already stored (or repeated in the batch) with other content.
        """
        if not records:
            raise InvalidArgument("append: no experiences")
        if len(records) > self.limits.max_append_records:
            raise ResourceExhausted(
                f"append: {len(records)} experiences > limit {self.limits.max_append_records} per request"
            )
        fresh: dict[tuple[str, str], _PackedRecord] = {}
        duplicates = 0
        for record in records:
            packed = validate_record(record, self.limits)
            key = (record.job_id, record.experience_id)
            seen = fresh.get(key)
            if seen is None:
                fresh[key] = packed
            elif seen.digest == packed.digest:
                duplicates += 1
            else:
                raise AlreadyExists(f"experience {record.experience_id!r} appears twice with different content")
        now_ms = self._clock_ms()
        with self._db.write() as conn:
            by_job: dict[str, list[_PackedRecord]] = {}
            for (job_id, _), packed in fresh.items():
                by_job.setdefault(job_id, []).append(packed)
            new_rows: list[_PackedRecord] = []
            for job_id, packs in by_job.items():
                stored = self._existing_digests(conn, job_id, [p.record.experience_id for p in packs])
                for packed in packs:
                    digest = stored.get(packed.record.experience_id)
                    if digest is None:
                        new_rows.append(packed)
                    elif digest == packed.digest:
                        duplicates += 1
                    else:
                        raise AlreadyExists(
                            f"experience {packed.record.experience_id!r} of job {job_id!r} is already stored "
                            "with different content"
                        )
            for job_id in by_job:
                adding = sum(p.payload_bytes for p in new_rows if p.record.job_id == job_id)
                check_quota(conn, self._quotas, job_id, adding)
            self._insert(conn, new_rows, now_ms)
        return AppendResult(
            appended=len(new_rows), duplicates=duplicates, appended_bytes=sum(p.payload_bytes for p in new_rows)
        )

    @staticmethod
    def _existing_digests(conn: sqlite3.Connection, job_id: str, ids: Sequence[str]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for chunk in _chunks(ids):
            rows = conn.execute(
                f"SELECT experience_id, content_sha256 FROM experiences WHERE job_id = ? "
                f"AND experience_id IN ({_placeholders(len(chunk))})",
                (job_id, *chunk),
            )
            out.update({str(exp_id): bytes(digest) for exp_id, digest in rows})
        return out

    @staticmethod
    def _insert(conn: sqlite3.Connection, rows: Sequence[_PackedRecord], now_ms: int) -> None:
        conn.executemany(
            "INSERT INTO experiences (experience_id, job_id, agent, task_id, group_id, sample_index, episode_id, "
            "turn, behavior_version, reward, group_size, state, step_id, created_unix_ms, state_unix_ms, "
            "prompt_tokens, response_tokens, payload_bytes, prompt_token_ids, response_token_ids, "
            "response_logprobs, content_sha256, response_version_spans, retokenized_messages, episode_return) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    p.record.experience_id, p.record.job_id, p.record.agent, p.record.task_id, p.record.group_id,
                    p.record.sample_index, p.record.episode_id, p.record.turn, p.record.behavior_version,
                    p.record.reward, p.record.group_size, int(ExperienceState.READY), now_ms, now_ms,
                    len(p.prompt) // 4, len(p.response) // 4, p.payload_bytes, p.prompt, p.response,
                    p.logprobs, p.digest, p.spans, p.record.retokenized_messages, p.record.episode_return,
                )
                for p in rows
            ],
        )
        totals: dict[tuple[str, str], list[int]] = {}
        for p in rows:
            entry = totals.setdefault((p.record.job_id, p.record.agent), [0, 0])
            entry[0] += 1
            entry[1] += p.payload_bytes
        for (job_id, agent), (count, payload) in totals.items():
            conn.execute("INSERT OR IGNORE INTO jobs (job_id, created_unix_ms) VALUES (?, ?)", (job_id, now_ms))
            _bump_stats(conn, job_id, agent, int(ExperienceState.READY), count, payload)

    # ---- read ---------------------------------------------------------------------

    def _require_job(self, conn: sqlite3.Connection, job_id: str) -> None:
        validate_job_id(job_id)
        if conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is None:
            raise NotFound(f"unknown job {job_id!r}: no experience was ever stored for it")

    def plan_read(self, job_id: str, ids: Sequence[str]) -> list[list[str]]:
        """Checks that every id exists and splits them into batches of bounded payload.

        The batches keep the order of ``ids``; each holds at most ``read_batch_bytes``
        of payload, or one record when a record alone is larger.

        Raises:
            NotFound: an unknown job or ids that are not stored.
            InvalidArgument / ResourceExhausted: no ids, or too many.
        """
        if not ids:
            raise InvalidArgument("read: no experience ids")
        if len(ids) > self.limits.max_read_ids:
            raise ResourceExhausted(f"read: {len(ids)} ids > limit {self.limits.max_read_ids} per request")
        sizes: dict[str, int] = {}
        with self._db.read() as conn:
            self._require_job(conn, job_id)
            unique = list(dict.fromkeys(ids))
            for chunk in _chunks(unique):
                rows = conn.execute(
                    f"SELECT experience_id, payload_bytes FROM experiences WHERE job_id = ? "
                    f"AND experience_id IN ({_placeholders(len(chunk))})",
                    (job_id, *chunk),
                )
                sizes.update({str(exp_id): int(size) for exp_id, size in rows})
        missing = [exp_id for exp_id in unique if exp_id not in sizes]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            raise NotFound(f"job {job_id!r}: {len(missing)} experience(s) not found: {shown}")
        batches: list[list[str]] = [[]]
        batch_bytes = 0
        for exp_id in ids:
            size = sizes[exp_id]
            if batches[-1] and (batch_bytes + size > self.limits.read_batch_bytes or len(batches[-1]) >= _IN_BATCH):
                batches.append([])
                batch_bytes = 0
            batches[-1].append(exp_id)
            batch_bytes += size
        return batches

    def read_batch(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Reads records in the order of ids (at most 500 distinct), verifying each digest.

        Raises:
            NotFound: an id is not stored (for example collected since it was planned).
            DataLoss: a stored row fails its content digest.
        """
        unique = list(dict.fromkeys(ids))
        if len(unique) > _IN_BATCH:
            raise InvalidArgument(f"read_batch: {len(unique)} ids > {_IN_BATCH}")
        with self._db.read() as conn:
            rows = conn.execute(
                f"SELECT {_RECORD_COLUMNS} FROM experiences WHERE job_id = ? "
                f"AND experience_id IN ({_placeholders(len(unique))})",
                (job_id, *unique),
            ).fetchall()
        found = {str(row[0]): row for row in rows}
        missing = [exp_id for exp_id in unique if exp_id not in found]
        if missing:
            raise NotFound(f"job {job_id!r}: experience {missing[0]!r} not found")
        records = {exp_id: _row_to_record(row) for exp_id, row in found.items()}
        return [records[exp_id] for exp_id in ids]

    def read(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Reads every id (in order) at once; for tests and small reads."""
        return [r for batch in self.plan_read(job_id, ids) for r in self.read_batch(job_id, batch)]

    # ---- query --------------------------------------------------------------------

    def query(self, q: ExperienceQuery) -> list[ExperienceRef]:
        """Lists refs (no arrays) of one (job, agent) partition in arrival order.

        With ``complete_groups_only`` only groups whose matching members cover all
        ``group_size`` sample indices are returned, whole: groups in order of first
        arrival, and the limit never splits a group (the first complete group is
        returned even when it alone exceeds the limit). An unknown job has no
        experiences: the answer is empty, since callers poll before the first append.
        """
        validate_job_id(q.job_id)
        validate_agent(q.agent)
        if q.step_id:
            validate_step_id(q.step_id)
        if q.min_behavior_version < 0:
            raise InvalidArgument(f"min_behavior_version must be >= 0, got {q.min_behavior_version}")
        if q.limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {q.limit}")
        limit = min(q.limit or self.limits.max_query_results, self.limits.max_query_results)
        where = ["job_id = ?", "agent = ?", "behavior_version >= ?"]
        params: list[object] = [q.job_id, q.agent, q.min_behavior_version]
        if q.state is not None:
            where.append("state = ?")
            params.append(int(q.state))
        if q.max_behavior_version >= 0:
            where.append("behavior_version <= ?")
            params.append(q.max_behavior_version)
        if q.step_id:
            where.append("step_id = ?")
            params.append(q.step_id)
        if q.group_id:
            if len(q.group_id) > 1024:
                raise InvalidArgument("group_id: longer than 1024 characters")
            where.append("group_id = ?")
            params.append(q.group_id)
        sql = f"SELECT {_REF_COLUMNS} FROM experiences WHERE {' AND '.join(where)} ORDER BY seq"
        with self._db.read() as conn:
            if not q.complete_groups_only:
                return [_row_to_ref(row) for row in conn.execute(f"{sql} LIMIT ?", (*params, limit))]
            return self._complete_groups(conn.execute(sql, params), limit)

    @staticmethod
    def _complete_groups(rows: Iterator[tuple[Any, ...]], limit: int) -> list[ExperienceRef]:
        groups: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            groups.setdefault(str(row[2]), []).append(row)
        out: list[ExperienceRef] = []
        for members in groups.values():
            group_size = max(int(m[11]) for m in members)
            if len({int(m[4]) for m in members}) < group_size:
                continue
            if out and len(out) + len(members) > limit:
                break
            out.extend(_row_to_ref(m) for m in members)
        return out

    # ---- state transitions --------------------------------------------------------

    def mark(self, job_id: str, agent: str, step_id: str, ids: Sequence[str], state: ExperienceState) -> int:
        """Moves experiences to a state for a step, all or nothing; returns how many changed.

        LEASED: from READY, or already LEASED to this step (unchanged).
        CONSUMED: from READY or LEASED to this step; already CONSUMED by this step is unchanged.
        READY (release): from LEASED to this step; already READY is unchanged.

        Raises:
            NotFound: an unknown job or id (or an id of another agent).
            FailedPrecondition: an experience held by another step, or a consumed one released.
        """
        validate_job_id(job_id)
        validate_agent(agent)
        validate_step_id(step_id)
        if not ids:
            raise InvalidArgument("mark: no experience ids")
        if len(ids) > self.limits.max_read_ids:
            raise ResourceExhausted(f"mark: {len(ids)} ids > limit {self.limits.max_read_ids} per request")
        target = ExperienceState(state)
        unique = list(dict.fromkeys(ids))
        now_ms = self._clock_ms()
        with self._db.write() as conn:
            self._require_job(conn, job_id)
            current: dict[str, tuple[int, str, int]] = {}
            for chunk in _chunks(unique):
                rows = conn.execute(
                    f"SELECT experience_id, state, step_id, payload_bytes FROM experiences WHERE job_id = ? "
                    f"AND agent = ? AND experience_id IN ({_placeholders(len(chunk))})",
                    (job_id, agent, *chunk),
                )
                current.update({str(e): (int(s), str(st), int(b)) for e, s, st, b in rows})
            missing = [exp_id for exp_id in unique if exp_id not in current]
            if missing:
                raise NotFound(
                    f"job {job_id!r} agent {agent!r}: {len(missing)} experience(s) not found: {missing[0]!r}"
                )
            changes = [
                (exp_id, old_state, size)
                for exp_id, (old_state, old_step, size) in current.items()
                if _transition(exp_id, ExperienceState(old_state), old_step, target, step_id)
            ]
            new_step = "" if target == ExperienceState.READY else step_id
            conn.executemany(
                "UPDATE experiences SET state = ?, step_id = ?, state_unix_ms = ? WHERE job_id = ? "
                "AND experience_id = ?",
                [(int(target), new_step, now_ms, job_id, exp_id) for exp_id, _, _ in changes],
            )
            moved: dict[int, list[int]] = {}
            for _, old_state, size in changes:
                entry = moved.setdefault(old_state, [0, 0])
                entry[0] += 1
                entry[1] += size
            for old_state, (count, size) in moved.items():
                _bump_stats(conn, job_id, agent, old_state, -count, -size)
                _bump_stats(conn, job_id, agent, int(target), count, size)
        return len(changes)

    # ---- stats and GC -------------------------------------------------------------

    def stats(self, job_id: str = "") -> list[ExperienceStats]:
        """Rows and payload bytes per (job, agent, state); all jobs when job_id is empty."""
        with self._db.read() as conn:
            if job_id:
                self._require_job(conn, job_id)
                rows = conn.execute(
                    "SELECT job_id, agent, state, rows, bytes FROM partition_stats WHERE job_id = ? "
                    "ORDER BY job_id, agent, state",
                    (job_id,),
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT job_id, agent, state, rows, bytes FROM partition_stats ORDER BY job_id, agent, state"
                ).fetchall()
        return [
            ExperienceStats(job_id=j, agent=a, state=ExperienceState(s), rows=int(r), bytes=int(b))
            for j, a, s, r, b in rows
        ]

    def finish_job(self, job_id: str, state: str) -> bool:
        """Records that a job ended; returns False when it already was (idempotent)."""
        validate_job_id(job_id)
        if not state or len(state) > 32:
            raise InvalidArgument("state: must be a final job state's name (1..32 characters)")
        with self._db.write() as conn:
            cursor = conn.execute(
                "INSERT OR IGNORE INTO finished_jobs (job_id, state, finished_unix_ms) VALUES (?, ?, ?)",
                (job_id, state, self._clock_ms()))
            return cursor.rowcount == 1

    def finished(self, job_id: str) -> bool:
        """Whether orchestratord reported the job ended (:meth:`finish_job`)."""
        with self._db.read() as conn:
            return conn.execute("SELECT 1 FROM finished_jobs WHERE job_id = ?", (job_id,)).fetchone() is not None

    def collect_garbage(self, job_id: str, retention_s: float, *, finished_only: bool = True) -> GarbageCollected:
        """Deletes CONSUMED experiences consumed at least retention_s ago ("" = every job).

        Args:
            job_id: One job, or "" for every job.
            retention_s: Minimum age of a consumption to delete.
            finished_only: Touch only jobs :meth:`finish_job` recorded (what an RPC asks for);
                False is the daemon's own retention policy (background GC), which may trim the
                consumed history of running jobs too.

        Raises:
            InvalidArgument: a negative or non-finite retention.
            NotFound: an unknown job.
            FailedPrecondition: ``finished_only`` and the one named job has not finished.
        """
        if not math.isfinite(retention_s) or retention_s < 0:
            raise InvalidArgument(f"retention_s must be finite and >= 0, got {retention_s}")
        # A retention longer than the clock's age keeps everything (and must not overflow SQLite's int64).
        cutoff_ms = self._clock_ms() - int(min(retention_s, _MAX_RETENTION_S) * 1000)
        consumed = int(ExperienceState.CONSUMED)
        with self._db.write() as conn:
            finished = {str(j) for (j,) in conn.execute("SELECT job_id FROM finished_jobs")}
            if job_id:
                self._require_job(conn, job_id)
                if finished_only and job_id not in finished:
                    raise FailedPrecondition(
                        f"job {job_id!r} has not finished (orchestratord has not called FinishJob): "
                        "its experiences are not garbage-collected on request")
                jobs = [job_id]
            else:
                jobs = [str(j) for (j,) in conn.execute("SELECT job_id FROM jobs")]
            skipped = tuple(j for j in jobs if finished_only and j not in finished)
            jobs = [j for j in jobs if j not in skipped]
            deleted_rows = deleted_bytes = 0
            for job in jobs:
                per_agent = conn.execute(
                    "SELECT agent, COUNT(*), COALESCE(SUM(payload_bytes), 0) FROM experiences "
                    "WHERE job_id = ? AND state = ? AND state_unix_ms <= ? GROUP BY agent",
                    (job, consumed, cutoff_ms),
                ).fetchall()
                if not per_agent:
                    continue
                conn.execute(
                    "DELETE FROM experiences WHERE job_id = ? AND state = ? AND state_unix_ms <= ?",
                    (job, consumed, cutoff_ms),
                )
                for agent, count, size in per_agent:
                    _bump_stats(conn, job, str(agent), consumed, -int(count), -int(size))
                    deleted_rows += int(count)
                    deleted_bytes += int(size)
        if deleted_rows:
            with self._db.locked_writer() as conn:
                conn.execute("PRAGMA incremental_vacuum")
            log.info("GC of job %r: deleted %d experiences (%d bytes)", job_id or "*", deleted_rows, deleted_bytes)
        return GarbageCollected(deleted_rows=deleted_rows, deleted_bytes=deleted_bytes, skipped_running_jobs=skipped)


def _transition(
    exp_id: str, old: ExperienceState, old_step: str, target: ExperienceState, step_id: str
) -> bool:
    """True when the row must change; raises FailedPrecondition on an illegal move."""
    same_step = old_step == step_id
    if target == ExperienceState.LEASED:
        if old == ExperienceState.READY:
            return True
        if old == ExperienceState.LEASED and same_step:
            return False
    elif target == ExperienceState.CONSUMED:
        if old == ExperienceState.READY or (old == ExperienceState.LEASED and same_step):
            return True
        if old == ExperienceState.CONSUMED and same_step:
            return False
    else:
        if old == ExperienceState.READY:
            return False
        if old == ExperienceState.LEASED and same_step:
            return True
    held = f"{old.name} by step {old_step!r}" if old_step else old.name
    raise FailedPrecondition(f"experience {exp_id!r} is {held}: cannot mark it {target.name} for step {step_id!r}")
