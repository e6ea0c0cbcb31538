"""Experiment trackers: each committed step of a job, per agent, to jsonl, TensorBoard, wandb or MLflow.

A job names its trackers in ``tracking:`` (:class:`flexmarl.jobspec.TrackingSpec`). orchestratord
writes them when a step's commit is durable (:class:`StepTracking`, called from its coordinator),
so every committed step is written once, whether or not a client watches, under
``<tracking.dir>/<job id>/`` on orchestratord's host::

    metrics.jsonl    one line per committed step: {"agent", "step", "committed_unix_ms", <figures>}
    samples.jsonl    one line per dumped sample (tracking.samples per agent and step)
    tensorboard/     event files: scalars "<agent>/<figure>", text "<agent>/samples"
    wandb/           an offline run (``wandb sync`` uploads it), id = the job id
    mlruns/          an MLflow file store: experiment tracking.project, run named after the job

The figures are whatever the step's history record holds (the one ``flexmarl history`` shows:
reward_mean, loss, grad_norm, staleness_mean, tokens_per_s, step_seconds, episodes,
response_tokens, version), plus ``response_length`` (mean response tokens per episode); each is
logged as ``<agent>/<figure>`` at the agent's step. A held-out evaluation round (``evaluation:``,
docs/evaluation.md) is logged at its version as ``<agent>/eval_reward_mean``, ``<agent>/eval_success``
and ``<agent>/eval_pass_at_k`` for each agent and ``team/eval_*`` for the team (no agent may be
called ``team`` in a job with evaluation). tensorboard, wandb and mlflow are optional
packages imported when a job first writes to them; ``flexmarl submit`` checks they are installed
(:func:`missing_packages`), and in orchestratord a tracker that cannot be created or written is
logged and switched off for that job, never raised: a tracker never fails a job or the daemon.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexmarl.evaluation import EvalRecord, EvalScores
from flexmarl.experience import ExperienceRecord
from flexmarl.jobspec import TEAM, TRACKER_PACKAGES, JobSpec, TrackingSpec
from flexmarl.samples import Sample, TokenizerCache, decode_samples, pick

log = logging.getLogger(__name__)

#: History record fields that are not figures of the step.
_NOT_FIGURES = frozenset({"agent", "step", "committed_unix_ms", "weights_uri"})


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """One agent's committed step as numbers, from orchestratord's history record of it."""

    agent: str
    step: int
    committed_unix_ms: int
    values: Mapping[str, float]

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> StepFigures:
        """Every numeric field of a history record, plus ``response_length`` (response tokens per episode)."""
        values = {key: float(value) for key, value in sorted(record.items())
                  if key not in _NOT_FIGURES and isinstance(value, (int, float)) and not isinstance(value, bool)}
        episodes = values.get("episodes", 0.0)
        if episodes > 0 and "response_tokens" in values:
            values["response_length"] = values["response_tokens"] / episodes
        return cls(str(record["agent"]), int(record["step"]), int(record.get("committed_unix_ms", 0)), values)


def eval_figures(record: EvalRecord) -> list[StepFigures]:
    """An evaluation round as figures at its version: one set per agent and one for the team (``team``)."""

    def values(scores: EvalScores) -> dict[str, float]:
        return {"eval_reward_mean": scores.reward_mean, "eval_success": scores.success,
                "eval_pass_at_k": scores.pass_at_k}

    rows = [StepFigures(a.agent, record.version, record.finished_unix_ms, values(a.scores)) for a in record.agents]
    roles = {f"eval_role_correct_{role}": share for role, share in record.role_correct.items()}
    return [*rows, StepFigures(TEAM, record.version, record.finished_unix_ms, {**values(record.team), **roles})]


def missing_packages(spec: TrackingSpec) -> list[str]:
    """One line per tracker of the spec whose package this interpreter lacks; [] when all import."""
    problems = []
    for index, kind in enumerate(spec.trackers):
        package = TRACKER_PACKAGES.get(kind)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(f"tracking.trackers[{index}]: {kind!r} needs the {package} package on orchestratord's "
                            f"host (pip install {package})")
    return problems


class Tracker(abc.ABC):
    """One tracker of one job; created when the job's first committed step is written."""

    @abc.abstractmethod
    def write_step(self, figures: StepFigures) -> None:
        """Writes one committed step."""

    @abc.abstractmethod
    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """Writes the dumped samples of one committed step."""

    def close(self) -> None:  # noqa: B027 - most trackers have nothing to close
        """Flushes and closes."""


class JsonlTracker(Tracker):
    """``metrics.jsonl`` and ``samples.jsonl``, appended (a restarted orchestratord goes on in the same files)."""

    def __init__(self, job_dir: Path) -> None:
        job_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = job_dir / "metrics.jsonl"
        self.samples_path = job_dir / "samples.jsonl"

    @staticmethod
    def _append(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
        with path.open("a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)

    def write_step(self, figures: StepFigures) -> None:
        """Appends one line."""
        self._append(self.metrics_path, [{"agent": figures.agent, "step": figures.step,
                                          "committed_unix_ms": figures.committed_unix_ms, **figures.values}])

    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """Appends one line per sample."""
        self._append(self.samples_path, [s.as_dict() for s in samples])


def _samples_markdown(samples: Sequence[Sample]) -> str:
    blocks = [f"**task {s.task_id} episode {s.sample_index} turn {s.turn}**, reward {s.reward:.3f}\n\n"
              f"prompt:\n\n    {s.prompt.replace(chr(10), chr(10) + '    ')}\n\n"
              f"response:\n\n    {s.response.replace(chr(10), chr(10) + '    ')}" for s in samples]
    return "\n\n---\n\n".join(blocks)


class TensorBoardTracker(Tracker):
    """Event files under ``tensorboard/``, written with the tensorboard package's own event writer.

    Scalars and text are TensorBoard's v2 summaries (what ``tf.summary`` and torch's
    ``SummaryWriter`` write too); no TensorFlow or torch import.
    """

    def __init__(self, job_dir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event = Event
        self._scalar_pb = scalar_pb
        self._text_pb = text_pb
        self._writer = EventFileWriter(str(job_dir / "tensorboard"))

    def _add(self, step: int, summary: Any) -> None:
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def write_step(self, figures: StepFigures) -> None:
        """One scalar per figure, at the agent's step."""
        for name, value in figures.values.items():
            self._add(figures.step, self._scalar_pb(f"{figures.agent}/{name}", value))
        self._writer.flush()

    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """One text summary (markdown) of the step's samples."""
        self._add(step, self._text_pb(f"{agent}/samples", _samples_markdown(samples)))
        self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file."""
        self._writer.close()


def _run_id(job_id: str) -> str:
    """A wandb run id from a job id (wandb ids: letters, digits, ``-`` and ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:128]


class WandbTracker(Tracker):
    """An offline wandb run under ``wandb/`` (``wandb sync`` uploads it later); each agent has its own step axis."""

    def __init__(self, job_dir: Path, job_id: str, project: str) -> None:
        import wandb

        directory = job_dir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(mode="offline", dir=str(job_dir), project=project, name=job_id, id=_run_id(job_id),
                               resume="allow", reinit="create_new")
        self._agents: set[str] = set()

    def _axis(self, agent: str) -> None:
        if agent not in self._agents:
            self._agents.add(agent)
            self._run.define_metric(f"{agent}/step")
            self._run.define_metric(f"{agent}/*", step_metric=f"{agent}/step")

    def write_step(self, figures: StepFigures) -> None:
        """One log call: every figure and the agent's step."""
        self._axis(figures.agent)
        self._run.log({f"{figures.agent}/step": figures.step,
                       **{f"{figures.agent}/{name}": value for name, value in figures.values.items()}})

    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """A table of the step's samples."""
        self._axis(agent)
        columns = ["step", "task_id", "sample_index", "turn", "reward", "prompt", "response"]
        table = self._wandb.Table(columns=columns, data=[[s.step, s.task_id, s.sample_index, s.turn, s.reward,
                                                          s.prompt, s.response] for s in samples])
        self._run.log({f"{agent}/step": step, f"{agent}/samples": table})

    def close(self) -> None:
        """Finishes the run (written to disk)."""
        self._run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in a file store under ``mlruns/``; one run per job (found again by its tag after a restart)."""

    def __init__(self, job_dir: Path, job_id: str, experiment: str) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        store = job_dir / "mlruns"
        store.mkdir(parents=True, exist_ok=True)
        self._metric = Metric
        self._client = MlflowClient(tracking_uri=store.resolve().as_uri())
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        runs = self._client.search_runs([experiment_id], filter_string=f"tags.flexmarl_job_id = '{job_id}'")
        self._run_id = runs[0].info.run_id if runs else self._client.create_run(
            experiment_id, run_name=job_id, tags={"flexmarl_job_id": job_id}).info.run_id

    def write_step(self, figures: StepFigures) -> None:
        """One batch of metrics at the agent's step."""
        metrics = [self._metric(f"{figures.agent}/{name}", value, figures.committed_unix_ms, figures.step)
                   for name, value in figures.values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """A JSON artifact ``samples/<agent>/step-<N>.json``."""
        self._client.log_text(self._run_id, json.dumps([s.as_dict() for s in samples], indent=2),
                              f"samples/{agent}/step-{step:06d}.json")

    def close(self) -> None:
        """Ends the run."""
        self._client.set_terminated(self._run_id)


def open_tracker(kind: str, job_dir: Path, job_id: str, project: str) -> Tracker:
    """The tracker of one kind for one job (importing its package now)."""
    if kind == "jsonl":
        return JsonlTracker(job_dir)
    if kind == "tensorboard":
        return TensorBoardTracker(job_dir)
    if kind == "wandb":
        return WandbTracker(job_dir, job_id, project)
    if kind == "mlflow":
        return MlflowTracker(job_dir, job_id, project)
    raise ValueError(f"unknown tracker {kind!r}")


class JobTrackers:
    """The trackers of one job. Never raises: a tracker that fails is logged and switched off for the job."""

    def __init__(self, job_id: str, spec: JobSpec) -> None:
        self.job_id = job_id
        self.job_dir = Path(spec.tracking.dir) / job_id
        self._trackers: dict[str, Tracker] = {}
        self._off: set[str] = set()
        self._kinds = list(spec.tracking.trackers)
        self._project = spec.tracking.project or spec.name

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for kind in self._kinds:
            if kind in self._off:
                continue
            try:
                tracker = self._trackers.get(kind)
                if tracker is None:
                    tracker = self._trackers[kind] = open_tracker(kind, self.job_dir, self.job_id, self._project)
                call(tracker)
            except Exception as exc:  # an optional package, a full disk, a tracker bug: never the job's failure
                self._off.add(kind)
                log.error("tracker %s of job %s switched off: %s failed: %s: %s", kind, self.job_id, what,
                          type(exc).__name__, exc)

    def write_step(self, figures: StepFigures) -> None:
        """Writes a committed step to every tracker."""
        self._each(f"writing step {figures.step} of {figures.agent}", lambda t: t.write_step(figures))

    def write_samples(self, agent: str, step: int, samples: Sequence[Sample]) -> None:
        """Writes a step's samples to every tracker."""
        if samples:
            self._each(f"writing samples of step {step} of {agent}", lambda t: t.write_samples(agent, step, samples))

    def close(self) -> None:
        """Closes every tracker opened."""
        for kind, tracker in self._trackers.items():
            try:
                tracker.close()
            except Exception as exc:
                log.warning("closing tracker %s of job %s: %s", kind, self.job_id, exc)
        self._trackers.clear()


ReadExperiences = Callable[[str, Sequence[str]], Awaitable[list[ExperienceRecord]]]


class StepTracking:
    """orchestratord's side: writes each committed step of each tracked job, off the event loop, in commit order.

    Files are written on one worker thread; reading a step's samples from stored (``read``) runs
    on the event loop. Steps of one job are written in the order :meth:`step_committed` is
    called (one lock per job, taken in call order).
    """

    def __init__(self, read: ReadExperiences) -> None:
        self._read = read
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracking")
        self._jobs: dict[str, JobTrackers] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tokenizers = TokenizerCache()

    async def _in_pool(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def step_committed(self, job_id: str, spec: JobSpec, record: Mapping[str, Any],
                             experience_ids: Sequence[str]) -> None:
        """Writes one committed step (its history record) and, with ``tracking.samples``, its samples."""
        if not spec.tracking.trackers:
            return
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            trackers = self._jobs.get(job_id)
            if trackers is None:
                trackers = self._jobs[job_id] = JobTrackers(job_id, spec)
            figures = StepFigures.of_record(record)
            await self._in_pool(lambda: trackers.write_step(figures))
            ids = pick(experience_ids, spec.tracking.samples)
            if not ids:
                return
            try:
                records = await self._read(job_id, ids)
                model = spec.agent(figures.agent).model
                samples = await self._in_pool(
                    lambda: decode_samples(records, figures.step, self._tokenizers.get(model)))
            except Exception as exc:  # stored away, a tokenizer missing on this host: the figures are written
                log.warning("no samples of step %d of %s/%s: %s", figures.step, job_id, figures.agent, exc)
                return
            await self._in_pool(lambda: trackers.write_samples(figures.agent, figures.step, samples))

    async def eval_recorded(self, job_id: str, spec: JobSpec, record: Mapping[str, Any]) -> None:
        """Writes one evaluation round's figures (at its version), in order with the job's steps."""
        if not spec.tracking.trackers:
            return
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            trackers = self._jobs.get(job_id)
            if trackers is None:
                trackers = self._jobs[job_id] = JobTrackers(job_id, spec)
            for figures in eval_figures(EvalRecord.from_dict(record)):
                await self._in_pool(lambda figures=figures: trackers.write_step(figures))  # type: ignore[misc]

    async def job_ended(self, job_id: str) -> None:
        """Closes a job's trackers once its pending writes are done."""
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            trackers = self._jobs.pop(job_id, None)
            if trackers is not None:
                await self._in_pool(trackers.close)
        self._locks.pop(job_id, None)

    async def close(self) -> None:
        """Closes every job's trackers and the worker thread."""
        for job_id in list(self._jobs):
            with contextlib.suppress(Exception):
                await self.job_ended(job_id)
        self._pool.shutdown(wait=True)
