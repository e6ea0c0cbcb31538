"""Durable job state of orchestratord: what survives an orchestrator restart.

The planner (``orchestratord.planner``) is pure and synchronous: it never does
I/O. Every change that must survive a restart is appended to its outbox as a
:data:`StateChange`; the daemon wiring takes them (``JobPlanner.take_changes``)
and applies them to a :class:`StateStore` with :func:`apply_changes` *before*
answering the RPC that caused them (under the same lock as the planner call),
so nothing another caller can observe is ever ahead of the durable state.

Durable, per job (keys relative to the configured prefix, DESIGN section 7)::

    jobs/<job>/spec                               canonical spec JSON            (create-only)
    jobs/<job>/state                              {"state", "error", "created_s", "updated_s"}
    jobs/<job>/agents/<agent>/version             {"version", "weights_uri", "state_uri", "updated_s"}
                                                  (compare-and-swap on "version"; a swap-out
                                                  rewrites "state_uri" of the same version; a
                                                  warm start fills version 0's "weights_uri")
    jobs/<job>/agents/<agent>/steps/<t>/manifest  the step manifest                (create-only)
    jobs/<job>/agents/<agent>/steps/<t>/commit    the commit record                (create-only)
    jobs/<job>/history/<agent>/<t>                the step's figures for plots (JobHistory)
    jobs/<job>/failure_totals                     failed episodes, given-up tasks of the steps every
                                                  agent committed (orchestratord/failures.py)
    jobs/<job>/history_archive                    :class:`HistoryArchiveIndex`: the pages of history in stored
    jobs/<job>/eval/<round>                       a held-out evaluation round's record (v<version> or d<n>)
    jobs/<job>/eval_open/<round>/...              an open round and its finished tasks (orchestratord/eval_state.py)

What grows with a job's steps is bounded: once every agent committed a page of steps (and stored
confirmed their experiences consumed), orchestratord copies the page's history records into one
stored blob and deletes the page's manifests, commits and history records from etcd
(``orchestratord/history_archive.py``).

Soft state is not persisted: leases in flight (re-issued after a restart),
agent-to-slot bindings (re-derived from the slots' next polls), micro-batch
composition (re-formed from the manifest). Reported experiences live in
stored; the wiring lists them on restart and hands them to
``JobPlanner.recover``.

The etcd implementation (orchestratord/etcd_state.py) maps each method onto the keys above with
one transaction each; :class:`InMemoryStateStore` is the reference semantics
and ``tests/orchestratord/test_state.py`` the contract both must pass.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flexmarl.errors import Aborted, AlreadyExists, InvalidArgument, NotFound
from orchestratord.eval_state import EvalRoundOpened, EvalTaskFinished, EvalTaskResult, OpenEvalRound, open_rounds
from orchestratord.failures import FailureFigures


class JobState(enum.IntEnum):
    """Lifecycle of a job (values equal the proto enum ``JobState``)."""

    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def terminal(self) -> bool:
        """Whether the job has ended."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """The exact membership of step ``step`` of one agent, fixed before its commit.

    ``experience_ids`` is sorted: the manifest depends only on which tasks form
    rollout batch ``step``, never on the order their reports arrived. ``failures``: the step's
    episodes whose reward failed and tasks given up (``orchestratord/failures.py``), final when the
    manifest is fixed; None in a manifest written before they were recorded. Not part of the
    membership: a manifest rebuilt after a restart (without the reasons) equals the stored one.
    """

    job_id: str
    agent: str
    step: int
    experience_ids: tuple[str, ...]
    step_episodes: int
    step_response_tokens: int
    failures: FailureFigures | None = dataclasses.field(default=None, compare=False)

    def to_json(self) -> str:
        """Stable JSON encoding."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StepManifest:
        """Decodes :meth:`to_json`."""
        data = json.loads(text)
        data["experience_ids"] = tuple(data["experience_ids"])
        failures = data.pop("failures", None)
        return cls(**data, failures=FailureFigures.from_record(failures) if failures is not None else None)


@dataclasses.dataclass(frozen=True)
class StepCommit:
    """An optimizer step of one agent that committed: version ``step`` became ``step + 1``."""

    job_id: str
    agent: str
    step: int
    weights_uri: str
    state_uri: str
    slot_id: str
    committed_s: float
    loss: float = 0.0
    grad_norm: float = 0.0
    step_seconds: float = 0.0
    #: The trainer's other per-step figures (``CommitStepRequest.figures``), sorted by name.
    figures: tuple[tuple[str, float], ...] = ()

    @property
    def new_version(self) -> int:
        """The version this commit produced."""
        return self.step + 1

    def to_json(self) -> str:
        """Stable JSON encoding."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StepCommit:
        """Decodes :meth:`to_json`."""
        fields = json.loads(text)
        fields["figures"] = tuple((str(name), float(value)) for name, value in fields.get("figures", ()))
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class AgentVersionRecord:
    """The committed version of one agent and where its weights and full state are."""

    version: int = 0
    weights_uri: str = ""
    state_uri: str = ""
    updated_s: float = 0.0
    #: Version 0's weights where a warm start published them ("": the spec's model), kept past later commits.
    initial_weights_uri: str = ""


@dataclasses.dataclass(frozen=True)
class PersistedJob:
    """Everything durable about one job: the input of ``JobPlanner.restore``."""

    job_id: str
    spec_json: str
    state: JobState
    error: str
    created_s: float
    updated_s: float
    agents: dict[str, AgentVersionRecord]
    manifests: dict[tuple[str, int], StepManifest]
    commits: dict[tuple[str, int], StepCommit]
    #: Committed (agent, step)s whose experiences stored has not yet confirmed consumed.
    pending_marks: frozenset[tuple[str, int]] = frozenset()
    #: The held-out evaluation rounds recorded (``v<version>``, ``d<n>``: :mod:`flexmarl.ids`).
    eval_rounds: frozenset[str] = frozenset()
    #: The rounds open, with their finished tasks (``orchestratord/eval_state.py``), in opening order.
    open_evals: tuple[OpenEvalRound, ...] = ()
    #: Failed episodes and given-up tasks of the steps every agent committed (``orchestratord/failures.py``).
    failure_totals: FailureFigures = FailureFigures()


@dataclasses.dataclass(frozen=True)
class HistoryArchiveIndex:
    """How much of a job's per-step history was moved to stored (``orchestratord/history_archive.py``).

    Steps ``0 .. pages * page_steps - 1`` are archived: their records are read from one stored blob a
    page. Their etcd keys (manifests, commits, history records) are deleted after the index advanced;
    ``cleaned`` pages are known deleted (a crash in between leaves ``cleaned < pages``, finished later).
    """

    page_steps: int
    pages: int = 0
    cleaned: int = 0

    @property
    def archived_steps(self) -> int:
        """Steps below this are read from stored."""
        return self.pages * self.page_steps

    def to_json(self) -> str:
        """Stable JSON encoding."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> HistoryArchiveIndex:
        """Decodes :meth:`to_json`."""
        data = json.loads(text)
        return cls(int(data["page_steps"]), int(data["pages"]), int(data["cleaned"]))


def sort_history(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Step records in commit order (ties: agent, step): the order of a GetJobHistory page."""
    return sorted((dict(r) for r in rows),
                  key=lambda r: (r.get("committed_unix_ms", 0), r.get("agent", ""), r.get("step", 0)))


def sort_evals(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Evaluation rounds: periodic ones (``v<version>``) by version, then on-demand ones by finish."""

    def order(r: Mapping[str, Any]) -> tuple[bool, int]:
        on_demand = str(r.get("round_id", "")).startswith("d")
        return on_demand, int(r.get("finished_unix_ms", 0)) if on_demand else int(r.get("version", 0))

    return sorted((dict(r) for r in records), key=order)


# ---- changes emitted by the planner --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobCreated:
    """A job was accepted."""

    job_id: str
    spec_json: str
    agents: tuple[str, ...]
    created_s: float
    #: Agents that start past version 0 (a job resumed from checkpoints): agent -> its first version.
    initial: tuple[tuple[str, AgentVersionRecord], ...] = ()


@dataclasses.dataclass(frozen=True)
class JobStateChanged:
    """A job moved to another state."""

    job_id: str
    state: JobState
    error: str
    updated_s: float


@dataclasses.dataclass(frozen=True)
class ManifestFixed:
    """A step's membership became final."""

    manifest: StepManifest


@dataclasses.dataclass(frozen=True)
class StepCommitted:
    """An agent's optimizer step committed (its version advanced by one).

    ``manifest`` is the step's membership as the planner held it at the commit: the planner forgets
    old manifests, and a commit whose write waited out an etcd outage is observed (its experiences
    marked consumed, its figures recorded) after later commits may have made it forget this one.
    ``failure_totals``: when this commit was the step's last (every agent has committed it) and the
    step had failures, the job's new totals over the steps every agent committed, written with it.
    """

    commit: StepCommit
    manifest: StepManifest | None = None
    failure_totals: FailureFigures | None = None


@dataclasses.dataclass(frozen=True)
class StateMoved:
    """An agent's training state at its committed ``version`` was saved elsewhere (swap-out)."""

    job_id: str
    agent: str
    version: int
    state_uri: str
    updated_s: float


@dataclasses.dataclass(frozen=True)
class WarmStartPublished:
    """An agent's warm start was published as its version 0 (``agents[].warm_start``)."""

    job_id: str
    agent: str
    weights_uri: str
    state_uri: str
    updated_s: float


@dataclasses.dataclass(frozen=True)
class EvalRecorded:
    """A held-out evaluation round finished: its record (``flexmarl.evaluation.EvalRecord.as_dict``)."""

    job_id: str
    round_id: str
    record: Mapping[str, Any]


StateChange = (JobCreated | JobStateChanged | ManifestFixed | StepCommitted | StateMoved | WarmStartPublished
               | EvalRoundOpened | EvalTaskFinished | EvalRecorded)


# ---- key layout ------------------------------------------------------------------------------------


def job_key(prefix: str, job_id: str, *parts: str) -> str:
    """``<prefix>/jobs/<job>/<parts...>``: the etcd key of a piece of job state."""
    return "/".join([prefix.rstrip("/"), "jobs", job_id, *parts])


def agent_version_key(prefix: str, job_id: str, agent: str) -> str:
    """Key of an agent's committed version record."""
    return job_key(prefix, job_id, "agents", agent, "version")


def manifest_key(prefix: str, job_id: str, agent: str, step: int) -> str:
    """Key of a step manifest."""
    return job_key(prefix, job_id, "agents", agent, "steps", str(step), "manifest")


def commit_key(prefix: str, job_id: str, agent: str, step: int) -> str:
    """Key of a step's commit record."""
    return job_key(prefix, job_id, "agents", agent, "steps", str(step), "commit")


def eval_key(prefix: str, job_id: str, round_id: str) -> str:
    """Key of the record of evaluation round ``round_id``."""
    return job_key(prefix, job_id, "eval", round_id)


def open_eval_key(prefix: str, job_id: str, round_id: str, *parts: str) -> str:
    """Key under an open evaluation round (``round``; ``tasks/<index>``), or its prefix without ``parts``."""
    return job_key(prefix, job_id, "eval_open", round_id, *parts) + ("" if parts else "/")


def history_archive_key(prefix: str, job_id: str) -> str:
    """Key of a job's :class:`HistoryArchiveIndex`."""
    return job_key(prefix, job_id, "history_archive")


def pending_mark_key(prefix: str, job_id: str, agent: str, step: int) -> str:
    """Key that exists while a committed step's experiences are not yet confirmed consumed in stored."""
    return job_key(prefix, job_id, "agents", agent, "steps", str(step), "pending_mark")


def check_warm_start_target(agent: str, record: AgentVersionRecord, weights_uri: str) -> None:
    """Raises Aborted unless ``record`` may take (or already holds) a warm start at ``weights_uri``."""
    if record.version != 0:
        raise Aborted(f"agent {agent!r} is at version {record.version}: a warm start is version 0")
    if record.weights_uri and record.weights_uri != weights_uri:
        raise Aborted(f"agent {agent!r}: version 0 already has weights {record.weights_uri!r}")


# ---- the store -----------------------------------------------------------------------------------------


class StateStore(abc.ABC):
    """Durable job state. Every method is atomic (one etcd transaction in the etcd implementation)."""

    @abc.abstractmethod
    async def create_job(self, job_id: str, spec_json: str, agents: Iterable[str], created_s: float,
                         initial: Mapping[str, AgentVersionRecord] | None = None) -> bool:
        """Creates a job in state RUNNING with every agent at version 0, or at its ``initial`` record.

        Returns:
            True when created, False when the same job with the same spec exists (idempotent resubmit).

        Raises:
            AlreadyExists: the job id exists with a different spec.
        """

    @abc.abstractmethod
    async def set_job_state(self, job_id: str, state: JobState, error: str, updated_s: float) -> None:
        """Records a job's state; raises NotFound for an unknown job."""

    @abc.abstractmethod
    async def put_manifest(self, manifest: StepManifest) -> None:
        """Stores a manifest once; storing the identical manifest again is a no-op.

        Raises:
            AlreadyExists: a different manifest exists for the step (membership is immutable).
        """

    @abc.abstractmethod
    async def commit_step(self, commit: StepCommit, history: Mapping[str, Any] | None = None,
                          failure_totals: FailureFigures | None = None) -> None:
        """Advances the agent's version from ``commit.step`` to ``commit.step + 1`` (compare-and-swap).

        ``history`` (the step's figures for plots) is written in the same atomic write, so a
        crash can never leave a committed step without its record, and so are ``failure_totals``
        (the job's, replacing those stored: :attr:`PersistedJob.failure_totals`) and the step's
        *pending consumption mark* (see :meth:`clear_pending_mark`): marking the step's experiences
        consumed in stored happens after the commit, and is never lost to a crash in between.
        Re-applying the identical commit is a no-op.

        Raises:
            Aborted: the agent's stored version is not ``commit.step`` (a racing writer won).
            NotFound: unknown job or agent.
        """

    @abc.abstractmethod
    async def set_state_uri(self, job_id: str, agent: str, version: int, state_uri: str, updated_s: float) -> None:
        """Records where the state of the agent's committed ``version`` now is (compare-and-swap on version).

        Raises:
            Aborted: the agent's stored version is not ``version``.
            NotFound: unknown job or agent.
        """

    @abc.abstractmethod
    async def publish_warm_start(self, job_id: str, agent: str, weights_uri: str, state_uri: str,
                                 updated_s: float) -> None:
        """Records the agent's warm start as its version 0: weights and state (compare-and-swap).

        Only a record at version 0 without weights (the spec's own model) takes it; recording the
        same weights again is a no-op (a replayed write).

        Raises:
            Aborted: the agent is past version 0, or its version 0 already has other weights.
            NotFound: unknown job or agent.
        """

    @abc.abstractmethod
    async def open_eval(self, job_id: str, opened: OpenEvalRound) -> None:
        """Records an evaluation round as opened (the same again is a no-op; see orchestratord/eval_state.py).

        Raises:
            AlreadyExists: the round is open with other settings.
            NotFound: unknown job.
        """

    @abc.abstractmethod
    async def put_eval_task(self, job_id: str, round_id: str, result: EvalTaskResult) -> None:
        """Records a finished task of open round ``round_id``; nothing for a round not open (its record is in).

        Raises:
            NotFound: unknown job.
        """

    @abc.abstractmethod
    async def put_eval(self, job_id: str, round_id: str, record: Mapping[str, Any]) -> None:
        """Records evaluation round ``round_id`` and drops it from the open rounds (the same again is a no-op).

        Raises:
            NotFound: unknown job.
        """

    @abc.abstractmethod
    async def clear_pending_mark(self, job_id: str, agent: str, step: int) -> None:
        """Stored confirmed the step's experiences consumed: drops its pending mark (idempotent)."""

    @abc.abstractmethod
    async def load_job(self, job_id: str) -> PersistedJob | None:
        """Everything durable about a job, or None (per-step history records excluded)."""

    @abc.abstractmethod
    async def load_history_page(self, job_id: str, agents: Sequence[str], from_step: int,
                                max_steps: int) -> tuple[list[dict[str, Any]], bool]:
        """The history records of steps ``from_step .. from_step + max_steps - 1`` of ``agents`` held here.

        In commit order (:func:`sort_history`), and whether any of them has a record past that range.
        The cost is the page's, not the job's history's. Archived steps are not here (see
        :class:`HistoryArchiveIndex`).
        """

    @abc.abstractmethod
    async def load_evals(self, job_id: str) -> list[dict[str, Any]]:
        """Every recorded evaluation round of a job, in :func:`sort_evals` order."""

    @abc.abstractmethod
    async def load_history_archive(self, job_id: str) -> HistoryArchiveIndex | None:
        """The job's history archive index, or None when nothing was ever archived."""

    @abc.abstractmethod
    async def put_history_archive(self, job_id: str, expected: HistoryArchiveIndex | None,
                                  index: HistoryArchiveIndex) -> None:
        """Replaces the archive index if it is ``expected`` (None: absent); the same index again is a no-op.

        Raises:
            Aborted: the stored index is neither ``expected`` nor ``index``.
            NotFound: unknown job.
        """

    @abc.abstractmethod
    async def delete_steps(self, job_id: str, agents: Sequence[str], from_step: int, to_step: int) -> None:
        """Deletes the manifests, commits and history records of steps ``from_step .. to_step - 1`` (idempotent).

        Only for steps every agent committed whose history is archived: nothing reads them any more.
        """

    @abc.abstractmethod
    async def list_job_ids(self) -> list[str]:
        """Ids of every stored job, sorted."""


class InMemoryStateStore(StateStore):
    """Reference implementation held in a dict (tests, single-process runs)."""

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, Any]] = {}

    def _job(self, job_id: str) -> dict[str, Any]:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id!r} not found")
        return job

    async def create_job(self, job_id: str, spec_json: str, agents: Iterable[str], created_s: float,
                         initial: Mapping[str, AgentVersionRecord] | None = None) -> bool:
        """See :meth:`StateStore.create_job`."""
        existing = self._jobs.get(job_id)
        if existing is not None:
            if existing["spec_json"] != spec_json:
                raise AlreadyExists(f"job {job_id!r} exists with a different spec")
            return False
        self._jobs[job_id] = {
            "spec_json": spec_json,
            "state": JobState.RUNNING,
            "error": "",
            "created_s": created_s,
            "updated_s": created_s,
            "agents": {agent: (initial or {}).get(agent, AgentVersionRecord(updated_s=created_s)) for agent in agents},
            "manifests": {},
            "commits": {},
            "pending_marks": set(),
            "evals": {},
            "open_evals": {},
            "history": {},
            "archive": None,
            "failure_totals": FailureFigures(),
        }
        return True

    async def set_job_state(self, job_id: str, state: JobState, error: str, updated_s: float) -> None:
        """See :meth:`StateStore.set_job_state`."""
        job = self._job(job_id)
        job["state"], job["error"], job["updated_s"] = state, error, updated_s

    async def put_manifest(self, manifest: StepManifest) -> None:
        """See :meth:`StateStore.put_manifest`."""
        job = self._job(manifest.job_id)
        key = (manifest.agent, manifest.step)
        existing = job["manifests"].get(key)
        if existing is not None and existing != manifest:
            raise AlreadyExists(f"step {manifest.step} of agent {manifest.agent!r} already has a different manifest")
        job["manifests"][key] = manifest

    async def commit_step(self, commit: StepCommit, history: Mapping[str, Any] | None = None,
                          failure_totals: FailureFigures | None = None) -> None:
        """See :meth:`StateStore.commit_step`."""
        job = self._job(commit.job_id)
        record = job["agents"].get(commit.agent)
        if record is None:
            raise NotFound(f"agent {commit.agent!r} not found in job {commit.job_id!r}")
        key = (commit.agent, commit.step)
        if job["commits"].get(key) == commit:
            return
        if record.version != commit.step:
            raise Aborted(f"agent {commit.agent!r} is at version {record.version}, cannot commit step {commit.step}")
        job["agents"][commit.agent] = AgentVersionRecord(
            version=commit.new_version,
            weights_uri=commit.weights_uri,
            state_uri=commit.state_uri,
            updated_s=commit.committed_s,
            initial_weights_uri=record.initial_weights_uri,
        )
        job["commits"][key] = commit
        job["pending_marks"].add(key)
        if history is not None:
            job["history"][key] = dict(history)
        if failure_totals is not None:
            job["failure_totals"] = failure_totals
        job["updated_s"] = max(job["updated_s"], commit.committed_s)

    async def set_state_uri(self, job_id: str, agent: str, version: int, state_uri: str, updated_s: float) -> None:
        """See :meth:`StateStore.set_state_uri`."""
        job = self._job(job_id)
        record = job["agents"].get(agent)
        if record is None:
            raise NotFound(f"agent {agent!r} not found in job {job_id!r}")
        if record.version != version:
            raise Aborted(f"agent {agent!r} is at version {record.version}, not {version}")
        job["agents"][agent] = dataclasses.replace(record, state_uri=state_uri, updated_s=updated_s)

    async def publish_warm_start(self, job_id: str, agent: str, weights_uri: str, state_uri: str,
                                 updated_s: float) -> None:
        """See :meth:`StateStore.publish_warm_start`."""
        job = self._job(job_id)
        record = job["agents"].get(agent)
        if record is None:
            raise NotFound(f"agent {agent!r} not found in job {job_id!r}")
        check_warm_start_target(agent, record, weights_uri)
        if record.weights_uri == weights_uri:
            return
        job["agents"][agent] = AgentVersionRecord(0, weights_uri, state_uri, updated_s, initial_weights_uri=weights_uri)
        job["updated_s"] = max(job["updated_s"], updated_s)

    async def open_eval(self, job_id: str, opened: OpenEvalRound) -> None:
        """See :meth:`StateStore.open_eval`."""
        job = self._job(job_id)
        existing = job["open_evals"].get(opened.round_id)
        if existing is None:
            job["open_evals"][opened.round_id] = (opened.to_json(), {})
        elif existing[0] != opened.to_json():
            raise AlreadyExists(f"job {job_id!r}: evaluation round {opened.round_id} is open with other settings")

    async def put_eval_task(self, job_id: str, round_id: str, result: EvalTaskResult) -> None:
        """See :meth:`StateStore.put_eval_task`."""
        opened = self._job(job_id)["open_evals"].get(round_id)
        if opened is not None:
            opened[1][result.index] = result.to_json()

    async def put_eval(self, job_id: str, round_id: str, record: Mapping[str, Any]) -> None:
        """See :meth:`StateStore.put_eval`."""
        job = self._job(job_id)
        job["evals"][round_id] = dict(record)
        job["open_evals"].pop(round_id, None)

    async def clear_pending_mark(self, job_id: str, agent: str, step: int) -> None:
        """See :meth:`StateStore.clear_pending_mark`."""
        job = self._jobs.get(job_id)
        if job is not None:
            job["pending_marks"].discard((agent, step))

    async def load_job(self, job_id: str) -> PersistedJob | None:
        """See :meth:`StateStore.load_job`."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        return PersistedJob(
            job_id=job_id,
            spec_json=job["spec_json"],
            state=job["state"],
            error=job["error"],
            created_s=job["created_s"],
            updated_s=job["updated_s"],
            agents=dict(job["agents"]),
            manifests=dict(job["manifests"]),
            commits=dict(job["commits"]),
            pending_marks=frozenset(job["pending_marks"]),
            eval_rounds=frozenset(job["evals"]),
            open_evals=open_rounds(
                {r: opened for r, (opened, _) in job["open_evals"].items()},
                {r: [EvalTaskResult.from_json(t) for t in tasks.values()]
                 for r, (_, tasks) in job["open_evals"].items()},
                frozenset(job["evals"])),
            failure_totals=job["failure_totals"],
        )

    async def list_job_ids(self) -> list[str]:
        """See :meth:`StateStore.list_job_ids`."""
        return sorted(self._jobs)

    async def load_history_page(self, job_id: str, agents: Sequence[str], from_step: int,
                                max_steps: int) -> tuple[list[dict[str, Any]], bool]:
        """See :meth:`StateStore.load_history_page`."""
        job = self._jobs.get(job_id)
        history: dict[tuple[str, int], dict[str, Any]] = job["history"] if job is not None else {}
        end = from_step + max_steps
        wanted = set(agents)
        rows = [r for (agent, step), r in history.items() if agent in wanted and from_step <= step < end]
        more = any(agent in wanted and step >= end for agent, step in history)
        return sort_history(rows), more

    async def load_evals(self, job_id: str) -> list[dict[str, Any]]:
        """See :meth:`StateStore.load_evals`."""
        job = self._jobs.get(job_id)
        return sort_evals(job["evals"].values()) if job is not None else []

    async def load_history_archive(self, job_id: str) -> HistoryArchiveIndex | None:
        """See :meth:`StateStore.load_history_archive`."""
        job = self._jobs.get(job_id)
        return job["archive"] if job is not None else None

    async def put_history_archive(self, job_id: str, expected: HistoryArchiveIndex | None,
                                  index: HistoryArchiveIndex) -> None:
        """See :meth:`StateStore.put_history_archive`."""
        job = self._job(job_id)
        if job["archive"] not in (expected, index):
            raise Aborted(f"job {job_id!r}: history archive index is {job['archive']}, not {expected}")
        job["archive"] = index

    async def delete_steps(self, job_id: str, agents: Sequence[str], from_step: int, to_step: int) -> None:
        """See :meth:`StateStore.delete_steps`."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        for agent in agents:
            for step in range(from_step, to_step):
                for table in ("manifests", "commits", "history"):
                    job[table].pop((agent, step), None)


async def apply_changes(
    store: StateStore,
    changes: Iterable[StateChange],
    history_of: Callable[[StepCommitted], Mapping[str, Any]] | None = None,
) -> None:
    """Applies a planner's changes in order (call before answering the RPC that produced them).

    ``history_of(commit)`` gives the figures stored atomically with each commit.
    """
    for change in changes:
        if isinstance(change, JobCreated):
            if change.initial:  # a resumed job; a new one is created with the plain call
                await store.create_job(change.job_id, change.spec_json, change.agents, change.created_s,
                                       dict(change.initial))
            else:
                await store.create_job(change.job_id, change.spec_json, change.agents, change.created_s)
        elif isinstance(change, JobStateChanged):
            await store.set_job_state(change.job_id, change.state, change.error, change.updated_s)
        elif isinstance(change, ManifestFixed):
            await store.put_manifest(change.manifest)
        elif isinstance(change, StepCommitted):
            await store.commit_step(change.commit, history_of(change) if history_of is not None else None,
                                    change.failure_totals)
        elif isinstance(change, StateMoved):
            await store.set_state_uri(change.job_id, change.agent, change.version, change.state_uri,
                                      change.updated_s)
        elif isinstance(change, WarmStartPublished):
            await store.publish_warm_start(change.job_id, change.agent, change.weights_uri, change.state_uri,
                                           change.updated_s)
        elif isinstance(change, EvalRoundOpened):
            await store.open_eval(change.job_id, change.opened)
        elif isinstance(change, EvalTaskFinished):
            await store.put_eval_task(change.job_id, change.round_id, change.result)
        elif isinstance(change, EvalRecorded):
            await store.put_eval(change.job_id, change.round_id, change.record)
        else:  # pragma: no cover - exhaustive over StateChange
            raise InvalidArgument(f"unknown state change {change!r}")
