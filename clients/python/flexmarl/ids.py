"""Every id that crosses a daemon boundary, built and parsed in one place.

The strings are a persisted contract (etcd keys, stored rows, lease ids held by
workers), so each ``__str__`` below writes exactly what earlier releases wrote:

====================  ==========================================  ======================
ref                   wire format                                 built by
====================  ==========================================  ======================
job id                ``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``         SDK / orchestratord
:class:`TaskRef`      ``<job>/b<batch>/t<position>``              planner (admission)
:class:`EvalTaskRef`  ``<job>/e<round>/t<index>``                 planner (evaluation)
:class:`GroupRef`     ``<task>/<agent>``                          rolloutd
experience id         ``<task>/<sample>/<agent>/<turn>``          rolloutd
:class:`StepRef`      ``<job>/<agent>/step<step>``                orchestratord -> stored
attempt step id       ``<job>/<agent>/s<step>[/e<epoch>]/a<k>``   planner -> traind
micro-batch subject   ``<agent>/<step>/<attempt>/<index>``        planner (leases)
lease id              ``<job>/<epoch>-<kind>-<n>``                planner (leases)
====================  ==========================================  ======================

Group and experience ids take the task id as an opaque string: stored and the
SDK accept experiences of any task id, not only the planner's. Parsers check
the structure and the job-id rule; agent names are checked where they enter
(the job spec, stored's append), not again here.
"""

from __future__ import annotations

import dataclasses
import re

from flexmarl.errors import InvalidArgument

JOB_ID_MAX_LENGTH = 64
JOB_ID_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{JOB_ID_MAX_LENGTH - 1}}}"
AGENT_NAME_PATTERN = r"[a-z][a-z0-9_-]{0,31}"

_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
_NUMBER = r"(0|[1-9][0-9]*)"  # canonical, so that str(parse(text)) == text
_TASK_RE = re.compile(rf"([^/]+)/b{_NUMBER}/t{_NUMBER}", re.ASCII)
_EVAL_TASK_RE = re.compile(rf"([^/]+)/e([vd]{_NUMBER})/t{_NUMBER}", re.ASCII)
_EVAL_ROUND_RE = re.compile(rf"[vd]{_NUMBER}", re.ASCII)
_STEP_RE = re.compile(rf"([^/]+)/([^/]+)/step{_NUMBER}", re.ASCII)
_ATTEMPT_RE = re.compile(rf"([^/]+)/([^/]+)/s{_NUMBER}(?:/e([^/]+))?/a{_NUMBER}", re.ASCII)
_MICRO_BATCH_RE = re.compile(rf"([^/]+)/{_NUMBER}/{_NUMBER}/{_NUMBER}", re.ASCII)
_EXPERIENCE_RE = re.compile(rf"(.+)/{_NUMBER}/([^/]+)/{_NUMBER}", re.ASCII)


def is_job_id(job_id: str) -> bool:
    """Whether ``job_id`` is a well-formed job id (it names etcd keys and prefixes task ids)."""
    return _JOB_ID_RE.fullmatch(job_id) is not None


def validate_job_id(job_id: str) -> None:
    """Raises InvalidArgument unless ``job_id`` is a well-formed job id."""
    if not is_job_id(job_id):
        raise InvalidArgument(f"job_id: must match {JOB_ID_PATTERN}, got {job_id!r}")


def _job(job_id: str, what: str, text: str) -> str:
    if not is_job_id(job_id):
        raise InvalidArgument(f"bad {what} {text!r}: bad job id {job_id!r}")
    return job_id


@dataclasses.dataclass(frozen=True, order=True)
class TaskRef:
    """A rollout task of a job: position ``position`` of rollout batch ``batch``."""

    job_id: str
    batch: int
    position: int

    def __str__(self) -> str:
        return f"{self.job_id}/b{self.batch}/t{self.position}"

    @classmethod
    def parse(cls, text: str) -> TaskRef:
        """``<job>/b<batch>/t<position>`` -> TaskRef; raises InvalidArgument otherwise."""
        match = _TASK_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad task id {text!r}: expected <job>/b<batch>/t<position>")
        return cls(_job(match[1], "task id", text), int(match[2]), int(match[3]))

    @classmethod
    def of_job(cls, job_id: str, text: str) -> TaskRef | None:
        """The task ``text`` names when it is a task of ``job_id``, else None."""
        try:
            ref = cls.parse(text)
        except InvalidArgument:
            return None
        return ref if ref.job_id == job_id else None


def periodic_round(version: int) -> str:
    """The id of the evaluation round of the team's version ``version``: ``v<version>``."""
    return f"v{version}"


def on_demand_round(number: int) -> str:
    """The id of a job's ``number``-th on-demand evaluation round (``flexmarl eval``): ``d<number>``."""
    return f"d{number}"


def is_eval_round(round_id: str) -> bool:
    """Whether ``round_id`` is a round id (:func:`periodic_round` or :func:`on_demand_round`)."""
    return _EVAL_ROUND_RE.fullmatch(round_id) is not None


@dataclasses.dataclass(frozen=True, order=True)
class EvalTaskRef:
    """A held-out evaluation task: task ``index`` of evaluation round ``round_id`` (``v<version>`` or ``d<n>``).

    Never a :class:`TaskRef`: nothing an evaluation plays is stored as an experience or trained on.
    """

    job_id: str
    round_id: str
    index: int

    def __str__(self) -> str:
        return f"{self.job_id}/e{self.round_id}/t{self.index}"

    @classmethod
    def parse(cls, text: str) -> EvalTaskRef:
        """``<job>/e<round>/t<index>`` -> EvalTaskRef; raises InvalidArgument otherwise."""
        match = _EVAL_TASK_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad eval task id {text!r}: expected <job>/e<v|d><number>/t<index>")
        return cls(_job(match[1], "eval task id", text), match[2], int(match[4]))

    @property
    def on_demand(self) -> bool:
        """Whether the round was asked for (``flexmarl eval``) rather than opened at a version."""
        return self.round_id.startswith("d")


@dataclasses.dataclass(frozen=True, order=True)
class GroupRef:
    """The GRPO group of one agent's experiences of one task (any task id)."""

    task_id: str
    agent: str

    def __str__(self) -> str:
        return f"{self.task_id}/{self.agent}"

    @classmethod
    def parse(cls, text: str) -> GroupRef:
        """``<task>/<agent>`` -> GroupRef; raises InvalidArgument otherwise."""
        task_id, sep, agent = text.rpartition("/")
        if not sep or not task_id or not agent:
            raise InvalidArgument(f"bad group id {text!r}: expected <task>/<agent>")
        return cls(task_id, agent)


@dataclasses.dataclass(frozen=True, order=True)
class ExperienceKey:
    """One (episode, agent turn): what an experience id names (stored's rows are keyed by it)."""

    task_id: str
    sample_index: int
    agent: str
    turn: int

    def __str__(self) -> str:
        return f"{self.task_id}/{self.sample_index}/{self.agent}/{self.turn}"

    @classmethod
    def parse(cls, text: str) -> ExperienceKey:
        """``<task>/<sample>/<agent>/<turn>`` -> ExperienceKey; raises InvalidArgument otherwise."""
        match = _EXPERIENCE_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad experience id {text!r}: expected <task>/<sample>/<agent>/<turn>")
        return cls(match[1], int(match[2]), match[3], int(match[4]))

    @property
    def group(self) -> GroupRef:
        """The group the experience belongs to."""
        return GroupRef(self.task_id, self.agent)


@dataclasses.dataclass(frozen=True, order=True)
class StepRef:
    """An optimizer step of an agent, across attempts: what stored marks consumed experiences with."""

    job_id: str
    agent: str
    step: int

    def __str__(self) -> str:
        return f"{self.job_id}/{self.agent}/step{self.step}"

    @classmethod
    def parse(cls, text: str) -> StepRef:
        """``<job>/<agent>/step<step>`` -> StepRef; raises InvalidArgument otherwise."""
        match = _STEP_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad step id {text!r}: expected <job>/<agent>/step<step>")
        return cls(_job(match[1], "step id", text), match[2], int(match[3]))


@dataclasses.dataclass(frozen=True, order=True)
class StepAttemptRef:
    """One attempt at one optimizer step, as traind sees it.

    ``epoch`` names the orchestrator process: after a restart, the restored planner has forgotten
    which micro-batches a slot already accumulated and issues them all again, so its step ids
    must differ from the dead process's, or the slot would add a micro-batch's gradient twice.
    """

    job_id: str
    agent: str
    step: int
    attempt: int
    epoch: str = ""

    def __str__(self) -> str:
        epoch = f"/e{self.epoch}" if self.epoch else ""
        return f"{self.job_id}/{self.agent}/s{self.step}{epoch}/a{self.attempt}"

    @classmethod
    def parse(cls, text: str) -> StepAttemptRef:
        """``<job>/<agent>/s<step>[/e<epoch>]/a<attempt>`` -> StepAttemptRef; raises InvalidArgument."""
        match = _ATTEMPT_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad step attempt id {text!r}: expected <job>/<agent>/s<step>[/e<epoch>]/a<k>")
        return cls(_job(match[1], "step attempt id", text), match[2],
                   int(match[3]), int(match[5]), match[4] or "")

    @property
    def step_ref(self) -> StepRef:
        """The step this is an attempt at."""
        return StepRef(self.job_id, self.agent, self.step)


@dataclasses.dataclass(frozen=True, order=True)
class MicroBatchRef:
    """A micro-batch of one attempt at a step of an agent (the subject of its lease; the job is the lease's)."""

    agent: str
    step: int
    attempt: int
    index: int

    def __str__(self) -> str:
        return f"{self.agent}/{self.step}/{self.attempt}/{self.index}"

    @classmethod
    def parse(cls, text: str) -> MicroBatchRef:
        """``<agent>/<step>/<attempt>/<index>`` -> MicroBatchRef; raises InvalidArgument otherwise."""
        match = _MICRO_BATCH_RE.fullmatch(text)
        if match is None:
            raise InvalidArgument(f"bad micro-batch subject {text!r}: expected <agent>/<step>/<attempt>/<index>")
        return cls(match[1], int(match[2]), int(match[3]), int(match[4]))


def lease_id_prefix(job_id: str, epoch: str) -> str:
    """What every lease id of a job starts with: ``<job>/<epoch>-`` (the lease table appends ``<kind>-<n>``)."""
    return f"{job_id}/{epoch}-"


def job_id_of_lease(lease_id: str) -> str:
    """The job a lease id belongs to (see :func:`lease_id_prefix`)."""
    return lease_id.split("/", 1)[0]
