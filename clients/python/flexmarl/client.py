"""The FlexMARL SDK: submit, watch and manage jobs on a cluster.

``AsyncClient`` is the asyncio API; ``Client`` is the same API for plain scripts.
Both find orchestratord through etcd (``etcd_endpoints``) or take its address.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import shutil
import tempfile
import threading
from collections.abc import AsyncGenerator, Awaitable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from flexmarl.config import ConfigError
from flexmarl.errors import FlexmarlError, InvalidArgument, NotFound, Unavailable, error_for_rpc
from flexmarl.evaluation import EvalAgentScores, EvalRecord, EvalScores
from flexmarl.jobspec import JobSpec, load_job_spec, parse_job_spec
from flexmarl.registry import PLAINTEXT_ETCD, EtcdSecurity, Registry
from flexmarl.retry import Backoff
from flexmarl.samples import Sample
from flexmarl.security import TransportSecurity, open_channel
from flexmarl.server import channel_options
from flexmarl.v1 import orchestrator_pb2, orchestrator_pb2_grpc

T = TypeVar("T")

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


#: Steps per GetJobHistory page that :meth:`AsyncClient.history` asks for (a long job's history never
#: has to fit one message).
HISTORY_PAGE_STEPS = 500

class JobState(enum.Enum):
    """Lifecycle of a job."""

    PENDING = orchestrator_pb2.JOB_STATE_PENDING
    RUNNING = orchestrator_pb2.JOB_STATE_RUNNING
    SUCCEEDED = orchestrator_pb2.JOB_STATE_SUCCEEDED
    FAILED = orchestrator_pb2.JOB_STATE_FAILED
    CANCELLED = orchestrator_pb2.JOB_STATE_CANCELLED

    @property
    def finished(self) -> bool:
        """True for the terminal states."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclasses.dataclass(frozen=True)
class AgentProgress:
    """Training progress of one agent."""

    agent: str
    step: int
    version: int
    total_steps: int
    #: Mean trained reward of the last step: each turn's return after shaping and discounting, over its experiences.
    reward_mean: float
    tokens_per_s: float
    staleness_mean: float
    weights_uri: str
    slot_id: str
    step_seconds: float
    #: Mean unshaped episode return of the last step, over its episodes: the reported reward.
    return_mean: float = 0.0
    #: Version 0's weights where the agent's warm start published them ("": the spec's model).
    initial_weights_uri: str = ""


def _version_zero(info: JobInfo, agent: str, model: str) -> str:
    """Version 0's weights: the agent's published warm start, else the spec's model."""
    return next((a.initial_weights_uri for a in info.agents if a.agent == agent and a.initial_weights_uri), model)


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A snapshot of a job."""

    job_id: str
    name: str
    state: JobState
    agents: tuple[AgentProgress, ...]
    error: str
    created_unix_ms: int
    updated_unix_ms: int
    tasks_done: int
    tasks_total: int
    spec_json: str
    #: Episodes dropped as their reward failed (raised, timed out) and tasks given up as too few of their
    #: episodes were left, over the whole job (an orchestratord restart keeps them); the latest such reason.
    #: ``tasks_done`` does not count the given-up tasks.
    episodes_failed: int = 0
    tasks_given_up: int = 0
    last_episode_failure: str = ""

    @classmethod
    def from_proto(cls, msg: orchestrator_pb2.JobStatus) -> JobInfo:
        """Decodes a JobStatus message."""
        return cls(
            job_id=msg.job_id,
            name=msg.name,
            state=JobState(msg.state) if msg.state else JobState.PENDING,
            agents=tuple(
                AgentProgress(
                    agent=a.agent, step=a.step, version=a.version, total_steps=a.total_steps,
                    reward_mean=a.reward_mean, tokens_per_s=a.tokens_per_s, staleness_mean=a.staleness_mean,
                    weights_uri=a.weights_uri, slot_id=a.slot_id, step_seconds=a.step_seconds,
                    return_mean=a.return_mean, initial_weights_uri=a.initial_weights_uri,
                )
                for a in msg.agents
            ),
            error=msg.error,
            created_unix_ms=msg.created_unix_ms,
            updated_unix_ms=msg.updated_unix_ms,
            tasks_done=msg.tasks_done,
            tasks_total=msg.tasks_total,
            spec_json=msg.spec_json,
            episodes_failed=msg.episodes_failed,
            tasks_given_up=msg.tasks_given_up,
            last_episode_failure=msg.last_episode_failure,
        )


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One committed optimizer step of one agent."""

    agent: str
    step: int
    version: int
    #: Mean trained reward over the step's experiences (each turn's return after shaping and discounting).
    reward_mean: float
    loss: float
    grad_norm: float
    step_seconds: float
    tokens_per_s: float
    staleness_mean: float
    episodes: int
    response_tokens: int
    committed_unix_ms: int
    weights_uri: str
    #: The trainer's other figures of the step (``kl``, ``clip_fraction``, ``ratio_mean``), by name.
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Mean unshaped episode return over the step's episodes: the reported reward (None: a record written
    #: before orchestratord recorded it).
    return_mean: float | None = None
    #: The step's episodes dropped as their reward failed and its tasks given up (None: a record written
    #: before orchestratord recorded them); its first and last such failure, each at most 300 characters.
    episodes_failed: int | None = None
    tasks_given_up: int | None = None
    first_failure: str = ""
    last_failure: str = ""

    @classmethod
    def from_proto(cls, msg: orchestrator_pb2.StepRecord) -> StepRecord:
        """Decodes a StepRecord message (a field a record written before it existed lacks: None)."""
        optional = ("return_mean", "episodes_failed", "tasks_given_up")
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)
                      if f.name not in ("figures", *optional)},
                   figures=dict(msg.figures),
                   return_mean=msg.return_mean if msg.HasField("return_mean") else None,
                   episodes_failed=msg.episodes_failed if msg.HasField("episodes_failed") else None,
                   tasks_given_up=msg.tasks_given_up if msg.HasField("tasks_given_up") else None)


def eval_record_of(msg: orchestrator_pb2.EvalRecord) -> EvalRecord:
    """Decodes an EvalRecord message (a held-out evaluation round)."""

    def scores(s: orchestrator_pb2.EvalScores) -> EvalScores:
        return EvalScores(s.reward_mean, s.success, s.pass_at_k, s.episodes)

    return EvalRecord(
        version=msg.version, tasks=msg.tasks, samples_per_task=msg.samples_per_task, failed_tasks=msg.failed_tasks,
        sampling=msg.sampling, team=scores(msg.team),
        agents=tuple(EvalAgentScores(a.agent, a.version, tuple(a.versions_seen), scores(a.scores)) for a in msg.agents),
        team_success_from_env=msg.team_success_from_env, finished_unix_ms=msg.finished_unix_ms,
        round_id=msg.round_id, eval_file=msg.eval_file, role_correct=dict(msg.role_correct))


def to_spec(spec: JobSpec | Mapping[str, Any] | str | Path) -> JobSpec:
    """Accepts a JobSpec, a mapping, YAML/JSON text or a file path; raises InvalidArgument."""
    if isinstance(spec, JobSpec):
        return spec
    if isinstance(spec, Mapping):
        return parse_job_spec(spec)
    return load_job_spec(spec)


def _retryable(exc: grpc.RpcError) -> bool:
    """Whether a failed call may succeed on another try (the server went away)."""
    code = exc.code() if hasattr(exc, "code") else None
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def _error_from_rpc(exc: grpc.RpcError) -> FlexmarlError:
    """Maps a failed RPC back onto the domain error of its status code."""
    mapped = error_for_rpc(exc)
    if mapped is not None:
        return mapped
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    error = FlexmarlError(f"{code.name}: {details}")
    error.code = code
    return error


async def _call(awaitable: Awaitable[T]) -> T:
    """Awaits one unary RPC, raising the domain error of a failed status."""
    try:
        return await awaitable
    except grpc.RpcError as exc:
        raise _error_from_rpc(exc) from None


async def discover(kind: str, etcd_endpoints: str, prefix: str = "/flexmarl", timeout_s: float = 5.0,
                   etcd_security: EtcdSecurity = PLAINTEXT_ETCD) -> str:
    """The address of a registered daemon of kind; raises Unavailable when there is none."""
    registry = Registry(etcd_endpoints, prefix, connect_timeout_s=timeout_s, security=etcd_security)
    await registry.connect()
    try:
        return await registry.first_address(kind)
    finally:
        await registry.close()


async def discover_orchestrator(etcd_endpoints: str, prefix: str = "/flexmarl", timeout_s: float = 5.0,
                                etcd_security: EtcdSecurity = PLAINTEXT_ETCD) -> str:
    """The address of a registered orchestratord; raises Unavailable when there is none."""
    return await discover("orchestratord", etcd_endpoints, prefix, timeout_s, etcd_security)


def client_security(
    *, tls_ca: str = "", tls_cert: str = "", tls_key: str = "", token: str = "", token_file: str = ""
) -> TransportSecurity:
    """The SDK's TLS/token settings from paths; raises InvalidArgument when a file is unusable."""
    if (tls_cert or tls_key) and not tls_ca:
        raise InvalidArgument("client: tls_cert/tls_key need tls_ca (the CA that signed the server)")
    try:
        return TransportSecurity.from_files(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token,
                                            token_file=token_file)
    except ConfigError as exc:
        raise InvalidArgument(f"client: {exc}") from None


@dataclasses.dataclass(frozen=True)
class VersionInfo:
    """One version of one agent: the step that made it and whether the job still keeps its weights."""

    agent: str
    version: int
    #: The step whose commit produced it (-1 for version 0, the spec's model).
    step: int
    #: The step's mean trained reward (shaped, discounted turn returns); 0.0 for version 0.
    reward_mean: float
    weights_uri: str
    #: False once the job's checkpoint policy pruned the weights (checkpoint.keep_last/keep_every).
    retained: bool
    #: The step's mean unshaped episode return, the reported reward (None: version 0, or not recorded).
    return_mean: float | None = None


class AsyncClient:
    """asyncio client of orchestratord's public job API.

    ``tls_ca`` turns on TLS (the server must present a certificate it signed); ``tls_cert`` and
    ``tls_key`` add a client certificate (mutual TLS); ``token`` or ``token_file`` sends
    ``authorization: Bearer <token>`` on every call. ``etcd_security`` (``EtcdSecurity.from_files``)
    is how discovery reaches an etcd that serves TLS or has auth enabled.
    """

    def __init__(
        self,
        address: str = "",
        *,
        etcd_endpoints: str = "",
        etcd_prefix: str = "/flexmarl",
        timeout_s: float = 30.0,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        token: str = "",
        token_file: str = "",
        etcd_security: EtcdSecurity = PLAINTEXT_ETCD,
    ) -> None:
        if not address and not etcd_endpoints:
            raise InvalidArgument("client: give an orchestratord address or etcd endpoints")
        self._security = client_security(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token,
                                         token_file=token_file)
        self._address = address
        self._etcd_endpoints = etcd_endpoints
        self._etcd_prefix = etcd_prefix
        self._etcd_security = etcd_security
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: orchestrator_pb2_grpc.OrchestratorStub | None = None

    async def _connect(self) -> orchestrator_pb2_grpc.OrchestratorStub:
        if self._stub is None:
            if not self._address:
                self._address = await discover_orchestrator(self._etcd_endpoints, self._etcd_prefix,
                                                            etcd_security=self._etcd_security)
            self._channel = open_channel(self._address, self._security, channel_options(_MAX_MESSAGE_BYTES))
            self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        return self._stub

    @property
    def address(self) -> str:
        """The address of orchestratord (known after the first call when discovered)."""
        return self._address

    async def close(self) -> None:
        """Closes the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: JobSpec | Mapping[str, Any] | str | Path, job_id: str = "", *,
                     preflight: bool = True, resume_from: str = "") -> str:
        """Validates and submits a job; returns its id.

        With ``preflight`` (the default) the job's environment is imported here first and its
        agents checked against the spec (:func:`flexmarl.preflight.check_job`), so a typo in
        ``environment.entrypoint`` fails now with one line naming the field, not on rolloutd;
        the job then carries the digest of the environment's source as checked
        (``environment.code_digest``), and a rolloutd running other code refuses it.
        The task files of ``environment.dataset`` are read here whatever ``preflight`` says: their
        paths become absolute (relative to the current directory, or to the job file ``spec``
        names) and each file's sha256 is recorded in the spec (:func:`flexmarl.datasets.pin_dataset`).
        With ``resume_from`` the job continues an earlier job's retained checkpoints (see
        :meth:`resume`); ``spec`` must then have the same agents and model shapes.
        """
        from flexmarl.datasets import pin_dataset

        # Task files: absolute paths and their content's sha256, so rolloutd refuses a file changed since now.
        valid = await asyncio.to_thread(pin_dataset, to_spec(spec))
        if preflight:
            from flexmarl.preflight import check_job

            valid = await asyncio.to_thread(check_job, valid)
        stub = await self._connect()
        reply = await _call(stub.SubmitJob(
                orchestrator_pb2.SubmitJobRequest(spec_json=valid.to_json(), job_id=job_id, resume_from=resume_from),
                timeout=self._timeout_s))
        return str(reply.job_id)

    async def resume(self, source: str, spec: JobSpec | Mapping[str, Any] | str | Path | None = None,
                     job_id: str = "") -> str:
        """Starts a job from the last retained checkpoint of each agent of an earlier job; returns its id.

        ``source`` names the earlier job's checkpoint manifests (:mod:`flexmarl.checkpoints`):
        ``stored://checkpoints/<job>`` or the bare ``<job>`` (in this cluster's stored), or
        ``file:///<traind work dir>/checkpoints/<job>``. Nothing of the earlier job's etcd is read,
        so its cluster may be gone. The new job (a new id) starts at each checkpoint's version,
        weights, optimizer state and RNG, so its first step is the earlier job's next one.
        ``spec`` defaults to the earlier job's; a given one must keep its agents and model
        shapes (e.g. raise ``total_steps``). Raises InvalidArgument before anything is created.
        """
        if spec is not None:
            return await self.submit(spec, job_id, resume_from=source)
        stub = await self._connect()
        reply = await _call(stub.SubmitJob(
            orchestrator_pb2.SubmitJobRequest(job_id=job_id, resume_from=source), timeout=self._timeout_s))
        return str(reply.job_id)

    async def status(self, job_id: str) -> JobInfo:
        """The current snapshot of a job."""
        stub = await self._connect()
        reply = await _call(stub.GetJob(orchestrator_pb2.GetJobRequest(job_id=job_id), timeout=self._timeout_s))
        return JobInfo.from_proto(reply)

    async def list_jobs(self, states: tuple[JobState, ...] = ()) -> list[JobInfo]:
        """Every job, optionally filtered by state."""
        stub = await self._connect()
        request = orchestrator_pb2.ListJobsRequest(states=[s.value for s in states])
        reply = await _call(stub.ListJobs(request, timeout=self._timeout_s))
        return [JobInfo.from_proto(j) for j in reply.jobs]

    async def cancel(self, job_id: str) -> JobInfo:
        """Cancels a job (idempotent on a finished job)."""
        stub = await self._connect()
        reply = await _call(stub.CancelJob(orchestrator_pb2.CancelJobRequest(job_id=job_id), timeout=self._timeout_s))
        return JobInfo.from_proto(reply)

    async def agents(self, job_id: str) -> tuple[AgentProgress, ...]:
        """The agents of a job with their progress."""
        return (await self.status(job_id)).agents

    async def history(self, job_id: str, page_steps: int = HISTORY_PAGE_STEPS) -> list[StepRecord]:
        """Every committed step of every agent, in commit order, read ``page_steps`` steps per call."""
        stub = await self._connect()
        records: list[StepRecord] = []
        from_step = 0
        while True:
            reply = await _call(stub.GetJobHistory(orchestrator_pb2.GetJobHistoryRequest(
                job_id=job_id, from_step=from_step, max_steps=page_steps), timeout=self._timeout_s))
            records.extend(StepRecord.from_proto(r) for r in reply.steps)
            if not reply.more:
                break
            from_step = reply.next_from_step
        # Pages are by step: an agent's later step may have committed before another's earlier one.
        return sorted(records, key=lambda r: (r.committed_unix_ms, r.agent, r.step))

    async def evaluations(self, job_id: str) -> list[EvalRecord]:
        """Every recorded held-out evaluation round of a job (``evaluation:``), by version."""
        stub = await self._connect()
        reply = await _call(stub.GetJobHistory(orchestrator_pb2.GetJobHistoryRequest(job_id=job_id, max_steps=1),
                                               timeout=self._timeout_s))
        return [eval_record_of(r) for r in reply.evals]

    async def evaluate(self, job_id: str, agent_versions: Mapping[str, int] | None = None, tasks: int = 0,
                       dataset: str | Path = "", sampling: str = "", samples_per_task: int = 0) -> str:
        """Opens an on-demand held-out evaluation round on kept versions; returns its round id (``d<n>``).

        ``agent_versions``: agent -> version (an agent not named: its committed version); ``tasks`` 0:
        the job's ``evaluation.tasks``. ``dataset``: a task file (JSONL, Parquet, a ``save_to_disk``
        directory) on a filesystem every rolloutd host sees, whose rows are the held-out tasks (in file
        order; ``tasks`` 0: every row); it is read here first and refused, naming the row and field, when
        a row lacks a field of the job's ``environment.dataset.fields``. ``sampling`` (``greedy`` or
        ``policy``) and ``samples_per_task`` (episodes per task, pass@k over them): this round's, whatever the
        job's ``evaluation`` says ("" and 0: the job's, or greedy and 1 without the section). The job must be
        running or succeeded; its record joins :meth:`evaluations` when done (:meth:`wait_evaluation`).

        Raises:
            InvalidArgument: a bad task file, more ``tasks`` than it has rows, or a bad sampling setting.
        """
        eval_file, eval_sha256 = "", ""
        if dataset:
            eval_file, eval_sha256, rows = await self._eval_file(job_id, Path(dataset))
            if tasks > rows:
                raise InvalidArgument(f"tasks: {tasks} held-out tasks, but {eval_file} has {rows} rows")
            tasks = tasks or rows
        stub = await self._connect()
        reply = await _call(stub.EvaluateJob(orchestrator_pb2.EvaluateJobRequest(
            job_id=job_id, agent_versions=dict(agent_versions or {}), tasks=tasks, eval_file=eval_file,
            eval_sha256=eval_sha256, sampling=sampling, samples_per_task=samples_per_task), timeout=self._timeout_s))
        return str(reply.round_id)

    async def _eval_file(self, job_id: str, path: Path) -> tuple[str, str, int]:
        """(absolute path, content sha256, rows) of an evaluation task file, checked against the job's fields."""
        from flexmarl.datasets import read_rows

        spec = parse_job_spec(json.loads((await self.status(job_id)).spec_json))
        fields = spec.environment.dataset.fields if spec.environment.dataset is not None else ()
        read = await asyncio.to_thread(read_rows, path.resolve(), fields)
        if read.problems:
            more = len(read.problems) - 1
            raise InvalidArgument(f"dataset: {read.path}: {read.problems[0]}" + (f" ({more} more bad rows)"
                                                                                 if more else ""))
        if not read.rows:
            raise InvalidArgument(f"dataset: {read.path}: no rows")
        return read.path, read.sha256, len(read.rows)

    async def wait_evaluation(self, job_id: str, round_id: str, timeout_s: float = 600.0,
                              interval_s: float = 0.5) -> EvalRecord:
        """Waits for an evaluation round's record; raises TimeoutError after ``timeout_s``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            found = [r for r in await self.evaluations(job_id) if r.round_id == round_id]
            if found:
                return found[0]
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError(f"evaluation {round_id} of job {job_id} not recorded within {timeout_s:g} s")
            await asyncio.sleep(interval_s)

    async def evaluate_versions(self, job_id: str, versions: Sequence[int], tasks: int = 0, dataset: str | Path = "",
                                timeout_s: float = 600.0, sampling: str = "",
                                samples_per_task: int = 0) -> list[EvalRecord]:
        """A held-out curve over kept versions: one on-demand round per team version, every agent pinned to it.

        Each round asks every agent its own version ``v`` (``flexmarl eval --version v``) and is waited for before the
        next opens (orchestratord runs one on-demand round per job at a time); ``tasks``, ``dataset``, ``sampling``
        and ``samples_per_task`` as :meth:`evaluate`, ``timeout_s`` per round. Unlike the periodic rounds of a
        job's ``evaluation:``, which under async may play newer versions than they opened at, each record measures
        exactly one team version (``versions_seen``). :meth:`kept_team_versions` lists the versions this can ask for.

        Raises:
            InvalidArgument / FailedPrecondition: a version not kept (orchestratord's refusal names the policy).
            TimeoutError: a round not recorded within ``timeout_s``.
        """
        agents = [a.agent for a in (await self.status(job_id)).agents]
        records = []
        for version in versions:
            round_id = await self.evaluate(job_id, dict.fromkeys(agents, version), tasks, dataset, sampling,
                                           samples_per_task)
            records.append(await self.wait_evaluation(job_id, round_id, timeout_s))
        return records

    async def kept_team_versions(self, job_id: str) -> list[int]:
        """The versions whose weights every agent of the job still keeps, ascending.

        Version 0, the latest, and what ``checkpoint.keep_last`` / ``keep_every`` retain: what
        :meth:`evaluate_versions` can pin.
        """
        kept: dict[str, set[int]] = {}
        for info in await self.versions(job_id):
            if info.retained:
                kept.setdefault(info.agent, set()).add(info.version)
        return sorted(set.intersection(*kept.values())) if kept else []

    async def versions(self, job_id: str) -> list[VersionInfo]:
        """Every version of every agent, with what the policy retains.

        Version 0 is the spec's model, or the agent's warm start once published.
        """
        info = await self.status(job_id)
        spec = parse_job_spec(json.loads(info.spec_json))  # JSON text from orchestratord, never a path
        history = await self.history(job_id)
        latest = {a.agent: a.version for a in info.agents}
        out = [VersionInfo(a.name, 0, -1, 0.0, _version_zero(info, a.name, a.model), True) for a in spec.agents]
        for r in sorted(history, key=lambda r: (spec.agent_names.index(r.agent), r.version)):
            retained = spec.checkpoint.keeps_weights(r.version, latest.get(r.agent, r.version))
            out.append(VersionInfo(r.agent, r.version, r.step, r.reward_mean, r.weights_uri, retained,
                                   r.return_mean))
        return sorted(out, key=lambda v: (spec.agent_names.index(v.agent), v.version))

    async def weights_uri(self, job_id: str, agent: str, version: int) -> str:
        """Where the weights of one agent version are (version 0: the spec's model, or its warm start once published).

        Raises:
            NotFound: no such agent or version, or the job's checkpoint policy pruned it (the
                message says which, and what the policy keeps).
        """
        if version < 0:
            raise InvalidArgument(f"version: must be >= 0, got {version}")
        info = await self.status(job_id)
        if agent not in {a.agent for a in info.agents}:
            raise NotFound(f"job {job_id} has no agent {agent!r}")
        spec = parse_job_spec(json.loads(info.spec_json))
        if version == 0:
            return _version_zero(info, agent, spec.agent(agent).model)
        latest = next(a.version for a in info.agents if a.agent == agent)
        for record in await self.history(job_id):
            if record.agent == agent and record.version == version:
                if not spec.checkpoint.keeps_weights(version, latest):
                    raise NotFound(f"job {job_id}: version {version} of {agent!r} was pruned by the checkpoint "
                                   f"policy ({spec.checkpoint.describe()}; latest is v{latest})")
                return record.weights_uri
        raise NotFound(f"job {job_id}: agent {agent!r} has no committed version {version}")

    async def download_weights(self, job_id: str, agent: str, version: int, dest: str | Path) -> Path:
        """Copies the HF checkpoint dir of one agent version into dest (created; must not exist)."""
        target = Path(dest)
        if target.exists():
            raise InvalidArgument(f"{target}: already exists")
        return await self.download_uri(await self.weights_uri(job_id, agent, version), target)

    async def download_uri(self, uri: str, dest: str | Path) -> Path:
        """Copies the checkpoint dir a weights URI names (``stored://``, ``file://`` or a path) into dest (new)."""
        from flexmarl.artifacts import resolve_dir
        from flexmarl.store_client import StoreClient

        target = Path(dest)
        if target.exists():
            raise InvalidArgument(f"{target}: already exists")
        store: StoreClient | None = None
        if uri.startswith("stored://"):
            if not self._etcd_endpoints:
                raise InvalidArgument("downloading from stored needs etcd endpoints to discover it")
            address = await discover("stored", self._etcd_endpoints, self._etcd_prefix,
                                     etcd_security=self._etcd_security)
            store = StoreClient(address, security=self._security)
        try:
            with tempfile.TemporaryDirectory(prefix="flexmarl-download-") as tmp:
                source = await resolve_dir(uri, Path(tmp), store)
                await asyncio.to_thread(shutil.copytree, source, target)
        finally:
            if store is not None:
                await store.close()
        return target

    async def samples(self, job_id: str, agent: str, step: int | None = None, count: int = 4) -> list[Sample]:
        """The first ``count`` episodes of an agent's committed step as text (default: its latest step).

        Reads the token ids from stored (found through etcd) and decodes them with the agent's
        tokenizer, which must load on this host (:mod:`flexmarl.samples`).

        Raises:
            NotFound: no such agent, or it has not committed that step.
        """
        from flexmarl.samples import TokenizerCache, read_step_samples
        from flexmarl.store_client import StoreClient

        info = await self.status(job_id)
        spec = parse_job_spec(json.loads(info.spec_json))  # JSON text from orchestratord, never a path
        if agent not in spec.agent_names:
            raise NotFound(f"job {job_id} has no agent {agent!r} (agents: {', '.join(spec.agent_names)})")
        steps = sorted(r.step for r in await self.history(job_id) if r.agent == agent)
        if not steps:
            raise NotFound(f"job {job_id}: agent {agent!r} has committed no step yet")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise NotFound(f"job {job_id}: agent {agent!r} has no committed step {step} "
                           f"(steps {steps[0]}..{steps[-1]})")
        if not self._etcd_endpoints:
            raise InvalidArgument("reading samples from stored needs etcd endpoints to discover it")
        tokenizer = await asyncio.to_thread(TokenizerCache().get, spec.agent(agent).model)
        address = await discover("stored", self._etcd_endpoints, self._etcd_prefix, etcd_security=self._etcd_security)
        async with StoreClient(address, security=self._security) as store:
            return await read_step_samples(store, job_id, agent, step, count, tokenizer)

    async def watch(self, job_id: str, reconnect_s: float = 60.0) -> AsyncGenerator[JobInfo, None]:
        """Yields a snapshot on every change until the job finishes.

        When orchestratord goes away (restart, failover), the stream is re-opened, through
        discovery again when the client found it in etcd, for up to ``reconnect_s``.
        """
        lost_since: float | None = None
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial_s=0.5, max_s=0.5)  # a restarted orchestratord is back within seconds
        while True:
            try:
                stub = await self._connect()
            except Unavailable:
                lost_since = loop.time() if lost_since is None else lost_since
                if loop.time() - lost_since > reconnect_s:
                    raise
                await backoff.sleep()
                continue
            call = stub.WatchJob(orchestrator_pb2.WatchJobRequest(job_id=job_id))
            try:
                async for msg in call:
                    lost_since = None
                    backoff.reset()
                    info = JobInfo.from_proto(msg)
                    yield info
                    if info.state.finished:
                        return
                return
            except grpc.RpcError as exc:
                if not _retryable(exc):
                    raise _error_from_rpc(exc) from None
                now = loop.time()
                lost_since = now if lost_since is None else lost_since
                if now - lost_since > reconnect_s:
                    raise _error_from_rpc(exc) from None
                await self._reconnect()
                await backoff.sleep()
            finally:
                call.cancel()

    async def _reconnect(self) -> None:
        """Drops the channel; the next call connects again (re-discovering when configured to)."""
        await self.close()
        if self._etcd_endpoints:
            self._address = ""

    async def wait(self, job_id: str, timeout_s: float | None = None) -> JobInfo:
        """Waits until the job finishes; returns its final snapshot."""

        async def last() -> JobInfo:
            info: JobInfo | None = None
            async for snapshot in self.watch(job_id):
                info = snapshot
            if info is None:
                raise NotFound(f"job {job_id}: watch ended without a status")
            return info

        return await asyncio.wait_for(last(), timeout_s)


_R = TypeVar("_R")


async def _next(stream: AsyncGenerator[_R, None]) -> _R:
    return await stream.__anext__()


_LOOP_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every sync :class:`Client` of the process runs its calls on.

    It runs forever on a daemon thread and is never closed: grpc.aio's completion-queue poller
    posts events to the loop a channel was used on, and a per-client loop closed after its last
    call made grpc print "Event loop is closed" tracebacks at exit. It also lets a sync client
    work where another event loop is running (a notebook, an async framework).
    """
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="flexmarl-client-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


class Client:
    """The synchronous SDK: the same calls as :class:`AsyncClient` on a private event loop."""

    def __init__(
        self,
        address: str = "",
        *,
        etcd_endpoints: str = "",
        etcd_prefix: str = "/flexmarl",
        timeout_s: float = 30.0,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        token: str = "",
        token_file: str = "",
        etcd_security: EtcdSecurity = PLAINTEXT_ETCD,
    ) -> None:
        self._async = AsyncClient(address, etcd_endpoints=etcd_endpoints, etcd_prefix=etcd_prefix,
                                  timeout_s=timeout_s, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                  token=token, token_file=token_file, etcd_security=etcd_security)
        self._loop = _background_loop()
        self._closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channel (idempotent)."""
        if not self._closed:
            self._closed = True
            self._run(self._async.close())

    def _run(self, coro: Coroutine[Any, Any, _R]) -> _R:
        """Runs ``coro`` on the shared client loop; Ctrl-C cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    @property
    def address(self) -> str:
        """The address of orchestratord."""
        return self._async.address

    def submit(self, spec: JobSpec | Mapping[str, Any] | str | Path, job_id: str = "", *,
               preflight: bool = True, resume_from: str = "") -> str:
        """Validates and submits a job; returns its id (see :meth:`AsyncClient.submit`)."""
        return self._run(self._async.submit(spec, job_id, preflight=preflight, resume_from=resume_from))

    def resume(self, source: str, spec: JobSpec | Mapping[str, Any] | str | Path | None = None,
               job_id: str = "") -> str:
        """Starts a job from an earlier job's retained checkpoints; returns its id (see :meth:`AsyncClient.resume`)."""
        return self._run(self._async.resume(source, spec, job_id))

    def status(self, job_id: str) -> JobInfo:
        """The current snapshot of a job."""
        return self._run(self._async.status(job_id))

    def list_jobs(self, states: tuple[JobState, ...] = ()) -> list[JobInfo]:
        """Every job, optionally filtered by state."""
        return self._run(self._async.list_jobs(states))

    def cancel(self, job_id: str) -> JobInfo:
        """Cancels a job."""
        return self._run(self._async.cancel(job_id))

    def agents(self, job_id: str) -> tuple[AgentProgress, ...]:
        """The agents of a job with their progress."""
        return self._run(self._async.agents(job_id))

    def history(self, job_id: str, page_steps: int = HISTORY_PAGE_STEPS) -> list[StepRecord]:
        """Every committed step of every agent, in commit order (see :meth:`AsyncClient.history`)."""
        return self._run(self._async.history(job_id, page_steps))

    def evaluations(self, job_id: str) -> list[EvalRecord]:
        """Every recorded held-out evaluation round of a job, by version (see AsyncClient.evaluations)."""
        return self._run(self._async.evaluations(job_id))

    def evaluate(self, job_id: str, agent_versions: Mapping[str, int] | None = None, tasks: int = 0,
                 dataset: str | Path = "", sampling: str = "", samples_per_task: int = 0) -> str:
        """Opens an on-demand evaluation round on kept versions; returns its round id (see AsyncClient.evaluate)."""
        return self._run(self._async.evaluate(job_id, agent_versions, tasks, dataset, sampling, samples_per_task))

    def wait_evaluation(self, job_id: str, round_id: str, timeout_s: float = 600.0) -> EvalRecord:
        """Waits for an evaluation round's record (see AsyncClient.wait_evaluation)."""
        return self._run(self._async.wait_evaluation(job_id, round_id, timeout_s))

    def evaluate_versions(self, job_id: str, versions: Sequence[int], tasks: int = 0, dataset: str | Path = "",
                          timeout_s: float = 600.0, sampling: str = "", samples_per_task: int = 0) -> list[EvalRecord]:
        """One pinned on-demand round per team version, one after the other (see AsyncClient.evaluate_versions)."""
        return self._run(self._async.evaluate_versions(job_id, versions, tasks, dataset, timeout_s, sampling,
                                                       samples_per_task))

    def kept_team_versions(self, job_id: str) -> list[int]:
        """The versions every agent still keeps (see AsyncClient.kept_team_versions)."""
        return self._run(self._async.kept_team_versions(job_id))

    def versions(self, job_id: str) -> list[VersionInfo]:
        """Every version of every agent, with what the checkpoint policy retains (see AsyncClient.versions)."""
        return self._run(self._async.versions(job_id))

    def download_weights(self, job_id: str, agent: str, version: int, dest: str | Path) -> Path:
        """Copies the HF checkpoint dir of one agent version into dest."""
        return self._run(self._async.download_weights(job_id, agent, version, dest))

    def download_uri(self, uri: str, dest: str | Path) -> Path:
        """Copies the checkpoint dir a weights URI names into dest (see AsyncClient.download_uri)."""
        return self._run(self._async.download_uri(uri, dest))

    def samples(self, job_id: str, agent: str, step: int | None = None, count: int = 4) -> list[Sample]:
        """See :meth:`AsyncClient.samples`."""
        return self._run(self._async.samples(job_id, agent, step, count))

    def watch(self, job_id: str, reconnect_s: float = 60.0) -> Iterator[JobInfo]:
        """Yields a snapshot on every change until the job finishes (see AsyncClient.watch)."""
        stream = self._async.watch(job_id, reconnect_s)
        try:
            while True:
                try:
                    yield self._run(_next(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._run(stream.aclose())

    def wait(self, job_id: str, timeout_s: float | None = None) -> JobInfo:
        """Waits until the job finishes; returns its final snapshot."""
        return self._run(self._async.wait(job_id, timeout_s))
