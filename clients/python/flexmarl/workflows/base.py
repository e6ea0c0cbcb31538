"""What every ready-made workflow shares: its config model, prompt templates, rewards per role, tasks, notes.

A workflow is an :class:`~flexmarl.episode.Environment` configured entirely by
``environment.config``, which is declared once, as a pydantic model per workflow
(:class:`WorkflowConfig` and its subclasses, every key documented by an attribute docstring):
the constructor validates the config with it and raises ``ValueError`` with one line naming the
key (``rewards.solver.function: unknown reward 'exact' ...``), the class's signature lists the
model's keys so the preflight refuses a misspelt one before submit, and docs/jobspec.md's
workflow sections are generated from the same models (flexmarl/jobspec_reference.py).

Prompts are Python format strings over a task row's fields (``"Solve: {question}"``; ``{{`` and
``}}`` are literal braces) plus the workflow's own variables (an earlier agent's output, say),
which shadow a row field of the same name. Rewards: ``reward`` (``{function, field, weight}``)
is the team's check of a final answer against a row's field; ``rewards`` overrides it per role.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from flexmarl.episode import ChatMessage, Environment, EpisodeContext, Task
from flexmarl.errors import InvalidArgument
from flexmarl.rewards import BUILTIN_REWARDS, ISOLATED_BUILTINS, RewardRunner, check_reward_name


class _ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class RewardSpec(_ConfigModel):
    """A role's reward: `weight` times `function` of the role's output against the task row's `field`."""

    function: str
    """A built-in reward (`exact_match`, `numeric_match`, `multiple_choice`, `math_equiv`) or a user's
    `module:function`, called as `function(response, reference)` (docs/workflows.md)."""
    field: str = Field("answer", min_length=1)
    """The task row's field holding the reference answer."""
    weight: float = 1.0
    """Multiplies the score (0 or 1 for the built-in rewards)."""

    @pydantic.field_validator("function")
    @classmethod
    def _loadable(cls, value: str) -> str:
        try:
            check_reward_name(value)
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from None
        return value


@dataclasses.dataclass(frozen=True)
class Template:
    """A prompt template: ``text`` with named fields, some of them the workflow's own ``variables``."""

    name: str
    text: str
    variables: frozenset[str]
    #: Where the config sets it, for messages (``prompts.solve``).
    where: str

    @classmethod
    def parse(cls, name: str, text: str, variables: Iterable[str] = (), where: str = "") -> Template:
        """Checks ``text`` (named fields only) and returns the template; ValueError naming ``where``."""
        where = where or f"prompts.{name}"
        if not text:
            raise ValueError(f"{where}: must not be empty")
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (write {{{{ and }}}} for literal braces)") from None
        for _, field, _, _ in parts:
            if field is not None and not field.isidentifier():
                raise ValueError(f"{where}: {{{field}}} is not a field name "
                                 "(name a task field, e.g. {question}; write {{ and }} for literal braces)")
        return cls(name, text, frozenset(variables), where)

    @property
    def fields(self) -> frozenset[str]:
        """Every field the template names."""
        return frozenset(f for _, f, _, _ in string.Formatter().parse(self.text) if f)

    @property
    def row_fields(self) -> frozenset[str]:
        """The task-row fields the template reads (its fields that are not the workflow's variables)."""
        return self.fields - self.variables

    def render(self, row: Mapping[str, Any], **variables: str) -> str:
        """The prompt for ``row``; InvalidArgument naming the field when the row lacks one."""
        missing = sorted(self.row_fields - set(row))
        if missing:
            raise InvalidArgument(f"{self.where}: the task has no field {missing[0]!r} "
                                  f"(it has {', '.join(sorted(row)) or 'none'})")
        return self.text.format_map({**row, **variables})


class WorkflowConfig(_ConfigModel):
    """The `environment.config` keys every workflow takes (docs/workflows.md)."""

    reward: RewardSpec
    """The team's check: `function` of the team's final answer against the row's `field` (what `success`
    notes); also the reward of every role `rewards` does not name."""
    rewards: dict[str, RewardSpec] = Field(default_factory=dict)
    """Role -> its reward, for the roles that differ from `reward` (each workflow's roles: docs/workflows.md)."""
    tasks: list[dict[str, Any]] | None = Field(None, min_length=1)
    """Task rows given here, for a job without `environment.dataset`: task i is a row of a seeded
    shuffle per epoch."""
    eval_tasks: list[dict[str, Any]] | None = Field(None, min_length=1)
    """Held-out task rows given here, for a job without `environment.dataset`: held-out task i is row i."""
    chat: bool = True
    """Send each prompt as one user chat message (the agent's chat template applies); false: the plain text."""
    system: str | None = None
    """A system message before each chat prompt."""
    success_threshold: float = 1.0
    """A score at or above it counts as correct (the team's `success`, a verdict's truth, `role_correct`)."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """The time limit of one reward call in a worker process (`math_equiv`, a user's function): past it the
    worker is killed and the episode fails."""
    reward_workers: int = Field(2, ge=1)
    """Worker processes for `math_equiv` and users' reward functions, at most, per rolloutd job."""

    def roles(self) -> dict[str, tuple[str, ...]]:
        """Role -> the agents playing it, from the config (each workflow's own)."""
        raise NotImplementedError

    def templates(self) -> dict[str, Template]:
        """Prompt name -> its template; ValueError naming the key of a bad one."""
        raise NotImplementedError

    def role_reward(self, role: str) -> RewardSpec:
        """``role``'s reward: its entry in ``rewards``, else ``reward``."""
        return self.rewards.get(role, self.reward)

    def required_fields(self) -> dict[str, str]:
        """Each task-row field the workflow reads -> where the config names it (``prompts.solve``)."""
        fields: dict[str, str] = {}
        for template in self.templates().values():
            for field in sorted(template.row_fields):
                fields.setdefault(field, template.where)
        fields.setdefault(self.reward.field, "reward.field")
        for role, spec in self.rewards.items():
            fields.setdefault(spec.field, f"rewards.{role}.field")
        return fields

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> WorkflowConfig:
        roles = self.roles()
        unknown = sorted(set(self.rewards) - set(roles))
        if unknown:
            raise ValueError(f"rewards.{unknown[0]}: not a role of this workflow (roles: {', '.join(roles)})")
        required = self.required_fields()  # parses the templates: a bad one raises here
        for where, rows in (("tasks", self.tasks), ("eval_tasks", self.eval_tasks)):
            for number, row in enumerate(rows or ()):
                for field, named_by in required.items():
                    if field not in row:
                        raise ValueError(f"{named_by}: names field {field!r}, which {where}[{number}] lacks "
                                         f"(it has {', '.join(sorted(row)) or 'none'})")
        return self


class PromptedConfig(WorkflowConfig):
    """A workflow whose prompts have names and defaults (`prompts`)."""

    #: Prompt name -> (default template, the workflow's variables it may name); each workflow's own.
    PROMPTS: ClassVar[Mapping[str, tuple[str, frozenset[str]]]] = {}

    prompts: dict[str, str] = Field(default_factory=dict)
    """Prompt name -> template over the task row's fields and the workflow's variables (`{question}`;
    `{{`/`}}` are literal braces); a prompt not named keeps its default (docs/workflows.md)."""

    def templates(self) -> dict[str, Template]:
        """Prompt name -> its template (the config's, else the default)."""
        unknown = sorted(set(self.prompts) - set(self.PROMPTS))
        if unknown:
            raise ValueError(f"prompts.{unknown[0]}: not a prompt of this workflow (it has {', '.join(self.PROMPTS)})")
        return {name: Template.parse(name, self.prompts.get(name, default), variables)
                for name, (default, variables) in self.PROMPTS.items()}


def _location(loc: Sequence[int | str]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def config_error(exc: pydantic.ValidationError) -> str:
    """A config's first validation error as one line naming the key (``rewards.solver.function: ...``)."""
    first = exc.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    where = _location(first["loc"])
    if not where or message.startswith(f"{where}"):  # a model-level check names its own key
        return message
    return f"{where}: {message}"


def join_outputs(outputs: Sequence[tuple[str, str]]) -> str:
    """Several agents' outputs as one prompt variable: one ``[name] text`` paragraph each."""
    return "\n\n".join(f"[{name}] {text}" for name, text in outputs)


def _signature(config: type[WorkflowConfig]) -> inspect.Signature:
    """The constructor's signature as the preflight reads it: the config model's keys as keyword parameters."""
    parameters = []
    for name, field in config.model_fields.items():
        default = inspect.Parameter.empty if field.is_required() else field.get_default(call_default_factory=True)
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                            annotation=field.annotation))
    return inspect.Signature(parameters)


class Workflow(Environment):
    """Base of the ready-made workflows: config, prompts, rewards per role, tasks and the team's notes.

    A subclass names its config model (``Config``) and implements :meth:`episode`. Notes each
    episode leaves in ``ctx.notes``: ``success`` (the team's final answer passes ``reward`` at
    ``success_threshold``), ``role_correct`` (role -> the share of that role's scored outputs
    that pass) and ``answer`` (the team's final answer).
    """

    Config: ClassVar[type[WorkflowConfig]] = WorkflowConfig

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        setattr(cls, "__signature__", _signature(cls.Config))  # noqa: B010 - what inspect.signature(cls) reads

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        try:
            self.settings = self.Config.model_validate(config)
        except pydantic.ValidationError as exc:
            raise ValueError(config_error(exc)) from None
        self.roles = self.settings.roles()
        self.agents = tuple(dict.fromkeys(agent for members in self.roles.values() for agent in members))
        self.templates = self.settings.templates()
        self.reward_spec = self.settings.reward
        self.role_rewards = {role: self.settings.role_reward(role) for role in self.roles}
        self.tasks = tuple(self.settings.tasks or ())
        self.eval_tasks = tuple(self.settings.eval_tasks or ())
        self._rewards: RewardRunner | None = None

    @property
    def required_fields(self) -> dict[str, str]:
        """Each task-row field the workflow reads -> where the config names it (``prompts.solve``)."""
        return self.settings.required_fields()

    # --- tasks ---------------------------------------------------------------------------------

    @staticmethod
    def _pick(rows: Sequence[Mapping[str, Any]], index: int, seed: int, stream: str) -> dict[str, Any]:
        """Row ``index`` of an endless sequence of epochs, each a shuffle of ``rows`` seeded by (seed, epoch)."""
        epoch, position = divmod(index, len(rows))
        order = list(range(len(rows)))
        random.Random(f"flexmarl-workflow-{stream}/{seed}/{epoch}").shuffle(order)
        return dict(rows[order[position]])

    def task(self, index: int, seed: int) -> Task:
        """Row ``index`` of the job's ``environment.dataset``, else of the config's ``tasks`` (shuffled per epoch)."""
        if self.dataset is not None or not self.tasks:
            return super().task(index, seed)  # the dataset's row; without one it says what is missing
        return Task(index=index, seed=seed, data=self._pick(self.tasks, index, seed, "tasks"))

    def eval_task(self, index: int, seed: int) -> Task:
        """The dataset's eval row ``index``; without a dataset, row ``index`` of ``eval_tasks``; else the default."""
        if self.dataset is not None or not self.eval_tasks:
            return super().eval_task(index, seed)
        if not 0 <= index < len(self.eval_tasks):
            raise InvalidArgument(f"held-out task {index}: eval_tasks has {len(self.eval_tasks)} rows")
        return Task(index=index, seed=seed, data=dict(self.eval_tasks[index]))

    def held_out_tasks(self) -> int | None:
        """How many distinct held-out tasks there are: the eval file's rows, or ``eval_tasks``'s."""
        if self.dataset is None and self.eval_tasks:
            return len(self.eval_tasks)
        return super().held_out_tasks()

    # --- episode helpers ---------------------------------------------------------------------

    def prompt(self, name: str, row: Mapping[str, Any], **variables: str) -> list[ChatMessage] | str:
        """Template ``name`` rendered for ``row``: one user message (after ``system``), or plain text."""
        text = self.templates[name].render(row, **variables)
        if not self.settings.chat:
            return text
        system = self.settings.system
        messages: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
        return [*messages, {"role": "user", "content": text}]

    async def score(self, role: str, response: str, row: Mapping[str, Any]) -> float:
        """The unweighted score of ``response`` by ``role``'s reward function against its field of ``row``."""
        return await self._score(self.role_rewards[role], response, row)

    async def team_score(self, response: str, row: Mapping[str, Any]) -> float:
        """The unweighted score of a team answer by ``reward``."""
        return await self._score(self.reward_spec, response, row)

    async def _score(self, spec: RewardSpec, response: str, row: Mapping[str, Any]) -> float:
        if spec.field not in row:
            raise InvalidArgument(f"reward: the task has no field {spec.field!r} (it has {', '.join(sorted(row))})")
        if self._rewards is None:
            isolated = {s.function for s in (self.reward_spec, *self.role_rewards.values())
                        if s.function in ISOLATED_BUILTINS or s.function not in BUILTIN_REWARDS}
            self._rewards = RewardRunner(timeout_s=self.settings.reward_timeout_s,
                                         workers=self.settings.reward_workers, preload=tuple(sorted(isolated)))
        return await self._rewards.score(spec.function, response, row[spec.field])

    def passes(self, score: float) -> bool:
        """Whether a score counts as correct (``success_threshold``)."""
        return score >= self.settings.success_threshold

    def reward_role(self, ctx: EpisodeContext, role: str, agent: str, score: float, *, turn: int | None = None) -> None:
        """Gives ``agent`` its role's weight times ``score`` (episode-level, or at its ``turn``)."""
        ctx.reward(agent, self.role_rewards[role].weight * score, turn=turn)

    def note_outcome(self, ctx: EpisodeContext, answer: str, team_score: float,
                     role_correct: Mapping[str, Sequence[bool]]) -> None:
        """Leaves the team's success, the final answer and each role's share of correct outputs in ``ctx.notes``."""
        ctx.notes["success"] = self.passes(team_score)
        ctx.notes["answer"] = answer
        ctx.notes["role_correct"] = {role: sum(flags) / len(flags) for role, flags in role_correct.items() if flags}

    async def aclose(self) -> None:
        """Stops the reward workers."""
        if self._rewards is not None:
            await self._rewards.aclose()
            self._rewards = None
