"""Durable job state in etcd: the StateStore that survives an orchestratord restart.

Key layout under the registry prefix (DESIGN §7)::

    jobs/<job>/spec                                 the canonical spec JSON
    jobs/<job>/meta                                 {state, error, created_s, updated_s of the last
                                                     state change; load_job adds the last commit's time}
    jobs/<job>/agents/<agent>/version               {version, weights_uri, state_uri, updated_s}
    jobs/<job>/agents/<agent>/steps/<n>/manifest    the step's fixed membership
    jobs/<job>/agents/<agent>/steps/<n>/commit      the step's commit record
    jobs/<job>/history/<agent>/<n>                  per-step figures for plots (JobHistory), n 8 digits
    jobs/<job>/history_archive                      the pages of history moved to stored (HistoryArchiveIndex)
    jobs/<job>/failure_totals                       failed episodes, given-up tasks of the steps every agent
                                                     committed (orchestratord/failures.py)
    jobs/<job>/eval/<round>                         held-out evaluation rounds (JobHistory.evals)
    jobs/<job>/eval_open/<round>/round              an open round as opened (orchestratord/eval_state.py)
    jobs/<job>/eval_open/<round>/tasks/<index>      its finished tasks' episodes

Every write that can race is a transaction that compares the value it read.

Every method is retried while etcd is unreachable (an etcd restart): each one re-reads what it
compares, and a write whose reply was lost is found on the retry (an identical manifest, commit or
spec counts as done), so a retry never applies a change twice. Without the retry, a commit that
met an etcd restart was lost from etcd while the planner had already applied it in memory, and
every later commit of that agent failed its version check: the job stalled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from flexmarl.errors import Aborted, AlreadyExists, NotFound
from flexmarl.registry import ETCD_ERRORS, Registry, prefix_range_end
from flexmarl.retry import RetryPolicy, retry
from orchestratord.eval_state import EvalTaskResult, OpenEvalRound, open_rounds
from orchestratord.failures import FailureFigures
from orchestratord.state import (
    AgentVersionRecord,
    HistoryArchiveIndex,
    JobState,
    PersistedJob,
    StateStore,
    StepCommit,
    StepManifest,
    agent_version_key,
    check_warm_start_target,
    commit_key,
    eval_key,
    history_archive_key,
    job_key,
    manifest_key,
    open_eval_key,
    pending_mark_key,
    sort_evals,
    sort_history,
)

_CAS_RETRIES = 5
#: Deletions per transaction (etcd's --max-txn-ops is 128 by default).
_DELETES_PER_TXN = 100
#: How long a state operation waits for etcd to come back before its RPC fails.
ETCD_RETRY_S = 60.0
ETCD_RETRY = RetryPolicy(initial_s=0.05, max_s=1.0, deadline_s=ETCD_RETRY_S)

log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")


def _retrying(method: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """Retries ``method`` on etcd connection errors for up to ETCD_RETRY_S (see the module docstring)."""

    def log_retry(exc: BaseException, attempt: int, delay_s: float) -> None:
        log.warning("etcd unavailable in %s (%s); retrying", method.__name__, type(exc).__name__)

    @functools.wraps(method)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await retry(functools.partial(method, *args, **kwargs), retryable=_etcd_unreachable,
                           policy=ETCD_RETRY, on_retry=log_retry)

    return wrapper


def _etcd_unreachable(exc: BaseException) -> bool:
    return isinstance(exc, ETCD_ERRORS)


def _dump(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class EtcdStateStore(StateStore):
    """StateStore on etcd through the shared registry connection."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._prefix = registry.prefix

    def _key(self, job_id: str, *parts: str) -> str:
        return job_key(self._prefix, job_id, *parts)

    @_retrying
    async def create_job(self, job_id: str, spec_json: str, agents: Iterable[str], created_s: float,
                         initial: Mapping[str, AgentVersionRecord] | None = None) -> bool:
        """See :meth:`StateStore.create_job`."""
        spec_key = self._key(job_id, "spec")
        puts = {
            spec_key: spec_json.encode(),
            self._key(job_id, "meta"): _dump(
                {"state": int(JobState.RUNNING), "error": "", "created_s": created_s, "updated_s": created_s}
            ),
        }
        for agent in agents:
            puts[agent_version_key(self._prefix, job_id, agent)] = _dump(
                dataclasses.asdict((initial or {}).get(agent, AgentVersionRecord(updated_s=created_s)))
            )
        if await self._registry.transact({spec_key: None}, puts):
            return True
        existing = await self._registry.get(spec_key)
        if existing is not None and existing.decode() == spec_json:
            return False
        raise AlreadyExists(f"job {job_id!r} exists with a different spec")

    @_retrying
    async def set_job_state(self, job_id: str, state: JobState, error: str, updated_s: float) -> None:
        """See :meth:`StateStore.set_job_state`."""
        key = self._key(job_id, "meta")
        for _ in range(_CAS_RETRIES):
            raw = await self._registry.get(key)
            if raw is None:
                raise NotFound(f"job {job_id!r} not found")
            meta = json.loads(raw)
            meta.update(state=int(state), error=error, updated_s=max(float(meta["updated_s"]), updated_s))
            if await self._registry.transact({key: raw}, {key: _dump(meta)}):
                return
        raise Aborted(f"job {job_id!r}: concurrent state updates")

    @_retrying
    async def put_manifest(self, manifest: StepManifest) -> None:
        """See :meth:`StateStore.put_manifest`."""
        key = manifest_key(self._prefix, manifest.job_id, manifest.agent, manifest.step)
        value = manifest.to_json().encode()
        if await self._registry.transact({key: None}, {key: value}):
            return
        existing = await self._registry.get(key)
        if existing is not None and StepManifest.from_json(existing.decode()) == manifest:
            return
        raise AlreadyExists(f"step {manifest.step} of agent {manifest.agent!r} already has a different manifest")

    async def _agent_record(self, job_id: str, agent: str) -> tuple[str, bytes, AgentVersionRecord]:
        key = agent_version_key(self._prefix, job_id, agent)
        raw = await self._registry.get(key)
        if raw is None:
            raise NotFound(f"agent {agent!r} of job {job_id!r} not found")
        return key, raw, AgentVersionRecord(**json.loads(raw))

    @_retrying
    async def commit_step(self, commit: StepCommit, history: Mapping[str, Any] | None = None,
                          failure_totals: FailureFigures | None = None) -> None:
        """See :meth:`StateStore.commit_step`."""
        ckey = commit_key(self._prefix, commit.job_id, commit.agent, commit.step)
        for _ in range(_CAS_RETRIES):
            existing = await self._registry.get(ckey)
            if existing is not None and StepCommit.from_json(existing.decode()) == commit:
                return
            vkey, raw, record = await self._agent_record(commit.job_id, commit.agent)
            if record.version != commit.step:
                raise Aborted(
                    f"agent {commit.agent!r} is at version {record.version}, cannot commit step {commit.step}"
                )
            new_record = AgentVersionRecord(commit.new_version, commit.weights_uri, commit.state_uri,
                                            commit.committed_s, initial_weights_uri=record.initial_weights_uri)
            puts = {vkey: _dump(dataclasses.asdict(new_record)), ckey: commit.to_json().encode(),
                    pending_mark_key(self._prefix, commit.job_id, commit.agent, commit.step): b"1"}
            if history is not None:
                puts[self._history_key(commit.job_id, commit.agent, commit.step)] = _dump(dict(history))
            if failure_totals is not None:
                puts[self._key(commit.job_id, "failure_totals")] = failure_totals.to_json().encode()
            if await self._registry.transact({vkey: raw, ckey: None}, puts):
                return
        raise Aborted(f"agent {commit.agent!r}: concurrent commits of step {commit.step}")

    @_retrying
    async def set_state_uri(self, job_id: str, agent: str, version: int, state_uri: str, updated_s: float) -> None:
        """See :meth:`StateStore.set_state_uri`."""
        for _ in range(_CAS_RETRIES):
            key, raw, record = await self._agent_record(job_id, agent)
            if record.version != version:
                raise Aborted(f"agent {agent!r} is at version {record.version}, not {version}")
            new_record = dataclasses.replace(record, state_uri=state_uri, updated_s=updated_s)
            if await self._registry.transact({key: raw}, {key: _dump(dataclasses.asdict(new_record))}):
                return
        raise Aborted(f"agent {agent!r}: concurrent state moves")

    @_retrying
    async def publish_warm_start(self, job_id: str, agent: str, weights_uri: str, state_uri: str,
                                 updated_s: float) -> None:
        """See :meth:`StateStore.publish_warm_start`."""
        for _ in range(_CAS_RETRIES):
            key, raw, record = await self._agent_record(job_id, agent)
            check_warm_start_target(agent, record, weights_uri)
            if record.weights_uri == weights_uri:
                return
            new_record = AgentVersionRecord(0, weights_uri, state_uri, updated_s, initial_weights_uri=weights_uri)
            if await self._registry.transact({key: raw}, {key: _dump(dataclasses.asdict(new_record))}):
                return
        raise Aborted(f"agent {agent!r}: concurrent warm-start writes")

    def _history_key(self, job_id: str, agent: str, step: int) -> str:
        return self._key(job_id, "history", agent, f"{step:08d}")

    @_retrying
    async def load_history_page(self, job_id: str, agents: Sequence[str], from_step: int,
                                max_steps: int) -> tuple[list[dict[str, Any]], bool]:
        """The records of steps ``from_step .. from_step + max_steps - 1`` of ``agents``, by commit time.

        Also whether any of them has a record past that range. One bounded range read per agent
        (its keys are in step order), so the cost is the page's, not the job's history's.
        """
        rows: list[dict[str, Any]] = []
        more = False
        end = from_step + max_steps
        for agent in agents:
            prefix = self._key(job_id, "history", agent) + "/"
            values, _ = await self._registry.get_prefix(
                prefix, start=self._history_key(job_id, agent, from_step), limit=max_steps + 1)
            for key, value in values.items():
                if int(key[len(prefix):]) < end:
                    rows.append(json.loads(value))
                else:
                    more = True
        return sort_history(rows), more

    @_retrying
    async def open_eval(self, job_id: str, opened: OpenEvalRound) -> None:
        """See :meth:`StateStore.open_eval`."""
        if await self._registry.get(self._key(job_id, "spec")) is None:
            raise NotFound(f"job {job_id!r} not found")
        key = open_eval_key(self._prefix, job_id, opened.round_id, "round")
        value = opened.to_json().encode()
        if await self._registry.transact({key: None}, {key: value}) or await self._registry.get(key) == value:
            return
        raise AlreadyExists(f"job {job_id!r}: evaluation round {opened.round_id} is open with other settings")

    @_retrying
    async def put_eval_task(self, job_id: str, round_id: str, result: EvalTaskResult) -> None:
        """See :meth:`StateStore.put_eval_task`."""
        if await self._registry.get(self._key(job_id, "spec")) is None:
            raise NotFound(f"job {job_id!r} not found")
        round_key = open_eval_key(self._prefix, job_id, round_id, "round")
        for _ in range(_CAS_RETRIES):
            opened = await self._registry.get(round_key)
            if opened is None:
                return  # recorded already (a replayed write): nothing is open to add to
            # Only while the round stays open: a task key never outlives its round's.
            task_key = open_eval_key(self._prefix, job_id, round_id, "tasks", f"{result.index:08d}")
            if await self._registry.transact({round_key: opened}, {task_key: result.to_json().encode()}):
                return
        raise Aborted(f"job {job_id!r}: evaluation round {round_id} changed while a task was recorded")

    @_retrying
    async def put_eval(self, job_id: str, round_id: str, record: Mapping[str, Any]) -> None:
        """See :meth:`StateStore.put_eval`.

        The record first, then the open round's keys (a range: a round may have more tasks than a
        transaction may hold operations); keys a crash left in between are ignored on load.
        """
        if await self._registry.get(self._key(job_id, "spec")) is None:
            raise NotFound(f"job {job_id!r} not found")
        await self._registry.put(eval_key(self._prefix, job_id, round_id), _dump(dict(record)))
        prefix = open_eval_key(self._prefix, job_id, round_id)
        await self._registry.delete_many([], [(prefix, prefix_range_end(prefix))])

    async def _open_evals(self, job_id: str, recorded: frozenset[str]) -> tuple[OpenEvalRound, ...]:
        root = self._key(job_id, "eval_open") + "/"
        values, _ = await self._registry.get_prefix(root)
        definitions: dict[str, bytes] = {}
        results: dict[str, list[EvalTaskResult]] = {}
        for key, value in values.items():
            round_id, _, rest = key[len(root):].partition("/")
            if rest == "round":
                definitions[round_id] = value
            elif rest.startswith("tasks/"):
                results.setdefault(round_id, []).append(EvalTaskResult.from_json(value))
        return open_rounds(definitions, results, recorded)

    @_retrying
    async def load_evals(self, job_id: str) -> list[dict[str, Any]]:
        """Every recorded evaluation round of a job: periodic ones by version, then on-demand ones by finish."""
        values, _ = await self._registry.get_prefix(self._key(job_id, "eval") + "/")
        return sort_evals(json.loads(v) for v in values.values())

    @_retrying
    async def load_history_archive(self, job_id: str) -> HistoryArchiveIndex | None:
        """See :meth:`StateStore.load_history_archive`."""
        raw = await self._registry.get(history_archive_key(self._prefix, job_id))
        return None if raw is None else HistoryArchiveIndex.from_json(raw)

    @_retrying
    async def put_history_archive(self, job_id: str, expected: HistoryArchiveIndex | None,
                                  index: HistoryArchiveIndex) -> None:
        """See :meth:`StateStore.put_history_archive`."""
        key = history_archive_key(self._prefix, job_id)
        value = index.to_json().encode()
        if await self._registry.get(self._key(job_id, "spec")) is None:
            raise NotFound(f"job {job_id!r} not found")
        if await self._registry.transact({key: None if expected is None else expected.to_json().encode()},
                                         {key: value}):
            return
        raw = await self._registry.get(key)
        if raw == value:
            return  # a write whose reply was lost
        raise Aborted(f"job {job_id!r}: history archive index is {raw!r}, not {expected}")

    @_retrying
    async def delete_steps(self, job_id: str, agents: Sequence[str], from_step: int, to_step: int) -> None:
        """See :meth:`StateStore.delete_steps`.

        History keys are zero-padded, so each agent's are one range; manifest and commit keys are
        not (``steps/10/`` sorts between ``steps/1/`` and ``steps/2/``), so they go key by key.
        """
        if to_step <= from_step:
            return
        ranges = [(self._history_key(job_id, agent, from_step), self._history_key(job_id, agent, to_step))
                  for agent in agents]
        keys = [key_of(self._prefix, job_id, agent, step) for agent in agents for step in range(from_step, to_step)
                for key_of in (manifest_key, commit_key)]
        await self._registry.delete_many([], ranges)
        for start in range(0, len(keys), _DELETES_PER_TXN):
            await self._registry.delete_many(keys[start:start + _DELETES_PER_TXN])

    @_retrying
    async def load_job(self, job_id: str) -> PersistedJob | None:
        """See :meth:`StateStore.load_job`."""
        # Not the job's history records: a restart needs none of them (GetJobHistory reads them by page).
        spec = await self._registry.get(self._key(job_id, "spec"))
        meta_raw = await self._registry.get(self._key(job_id, "meta"))
        if spec is None or meta_raw is None:
            return None
        failure_totals = await self._registry.get(self._key(job_id, "failure_totals"))
        values, _ = await self._registry.get_prefix(self._key(job_id, "agents") + "/")
        meta = json.loads(meta_raw)
        agents: dict[str, AgentVersionRecord] = {}
        manifests: dict[tuple[str, int], StepManifest] = {}
        commits: dict[tuple[str, int], StepCommit] = {}
        pending: set[tuple[str, int]] = set()
        agents_prefix = self._key(job_id, "agents") + "/"
        eval_prefix = self._key(job_id, "eval") + "/"
        evals = {key[len(eval_prefix):] for key in await self._registry.list_keys(eval_prefix)}
        for key, value in values.items():
            if not key.startswith(agents_prefix):
                continue
            parts = key[len(agents_prefix):].split("/")
            if len(parts) == 2 and parts[1] == "version":
                agents[parts[0]] = AgentVersionRecord(**json.loads(value))
            elif len(parts) == 4 and parts[1] == "steps" and parts[3] == "manifest":
                manifests[(parts[0], int(parts[2]))] = StepManifest.from_json(value.decode())
            elif len(parts) == 4 and parts[1] == "steps" and parts[3] == "commit":
                commits[(parts[0], int(parts[2]))] = StepCommit.from_json(value.decode())
            elif len(parts) == 4 and parts[1] == "steps" and parts[3] == "pending_mark":
                pending.add((parts[0], int(parts[2])))
        return PersistedJob(
            job_id=job_id,
            spec_json=spec.decode(),
            state=JobState(int(meta["state"])),
            error=str(meta["error"]),
            created_s=float(meta["created_s"]),
            # A commit touches the job without rewriting meta (no contention with state changes).
            updated_s=max([float(meta["updated_s"]), *(commit.committed_s for commit in commits.values())]),
            agents=agents,
            manifests=manifests,
            commits=commits,
            pending_marks=frozenset(pending),
            eval_rounds=frozenset(evals),
            open_evals=await self._open_evals(job_id, frozenset(evals)),
            failure_totals=FailureFigures.from_json(failure_totals) if failure_totals is not None else FailureFigures(),
        )

    @_retrying
    async def clear_pending_mark(self, job_id: str, agent: str, step: int) -> None:
        """See :meth:`StateStore.clear_pending_mark`."""
        await self._registry.delete(pending_mark_key(self._prefix, job_id, agent, step))

    @_retrying
    async def list_job_ids(self) -> list[str]:
        """See :meth:`StateStore.list_job_ids`."""
        # One keys-only read of one key per job, then a jump past that job's keys: the cost is set by
        # the number of jobs, not by their history (reading the whole jobs prefix in one response
        # outgrew gRPC's receive limit after a few hundred steps, and orchestratord could not start).
        root = job_key(self._prefix, "").rstrip("/") + "/"
        ids: list[str] = []
        start = ""
        while keys := await self._registry.list_keys(root, start=start, limit=1):
            job_id = keys[0][len(root):].split("/", 1)[0]
            if await self._registry.get(self._key(job_id, "spec")) is not None:
                ids.append(job_id)
            start = prefix_range_end(f"{root}{job_id}/")
        return ids
