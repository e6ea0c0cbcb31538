"""What every ready-made workflow shares: prompt templates, rewards per role, tasks, team notes.

A workflow is an :class:`~flexmarl.episode.Environment` configured entirely by
``environment.config``; its subclasses (solver_verifier.py, debate.py, chain.py, mixture.py)
declare their keys as keyword parameters, so the preflight refuses a misspelt key before submit,
and check the values here, raising ``ValueError`` with one line that names the key
(``rewards.solver.function: unknown reward 'exact' ...``), which the preflight reports.

Prompts are Python format strings over a task row's fields (``"Solve: {question}"``; ``{{`` and
``}}`` are literal braces) plus the workflow's own variables (an earlier agent's output, say),
which shadow a row field of the same name. Rewards: ``reward`` (``{function, field, weight}``)
is the team's check of a final answer against a row's field; ``rewards`` overrides it per role.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pydantic

from flexmarl.episode import ChatMessage, Environment, EpisodeContext, Task
from flexmarl.errors import InvalidArgument
from flexmarl.rewards import BUILTIN_REWARDS, ISOLATED_BUILTINS, RewardRunner, check_reward_name


class RewardSpec(pydantic.BaseModel):
    """A role's reward: ``weight`` times ``function`` of its output against the row's ``field``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    #: A built-in reward (flexmarl/rewards.py) or a user's ``module:function``.
    function: str
    #: The task row's field holding the reference answer.
    field: str = "answer"
    weight: float = 1.0


def _one_line(where: str, exc: pydantic.ValidationError) -> str:
    first = exc.errors()[0]
    location = ".".join(str(part) for part in (where, *first["loc"]))
    return f"{location}: {first['msg']}"


def parse_reward(where: str, value: Any) -> RewardSpec:
    """``value`` as a :class:`RewardSpec` with a loadable function; ValueError naming ``where`` otherwise."""
    try:
        spec = RewardSpec.model_validate(value)
    except pydantic.ValidationError as exc:
        raise ValueError(_one_line(where, exc)) from None
    try:
        check_reward_name(spec.function)
    except InvalidArgument as exc:
        raise ValueError(f"{where}.function: {exc}") from None
    return spec


@dataclasses.dataclass(frozen=True)
class Template:
    """A prompt template: ``text`` with named fields, some of them the workflow's own ``variables``."""

    name: str
    text: str
    variables: frozenset[str]
    #: Where the config sets it, for messages (``prompts.solve``).
    where: str

    @classmethod
    def parse(cls, name: str, text: Any, variables: Iterable[str] = (), where: str = "") -> Template:
        """Checks ``text`` (named fields only) and returns the template; ValueError naming ``where``."""
        where = where or f"prompts.{name}"
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: must be a non-empty string, got {text!r}")
        try:
            parts = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (write {{{{ and }}}} for literal braces)") from None
        for _, field, _, _ in parts:
            if field is None:
                continue
            if not field.isidentifier():
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


def _rows(where: str, value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ValueError(f"{where}: must be a non-empty list of rows (mappings of field -> value)")
    for number, row in enumerate(value):
        if not isinstance(row, Mapping) or not all(isinstance(k, str) for k in row):
            raise ValueError(f"{where}[{number}]: must be a mapping of field -> value, got {row!r}")
    return tuple(dict(row) for row in value)


def join_outputs(outputs: Sequence[tuple[str, str]]) -> str:
    """Several agents' outputs as one prompt variable: one ``[name] text`` paragraph each."""
    return "\n\n".join(f"[{name}] {text}" for name, text in outputs)


class Workflow(Environment):
    """Base of the ready-made workflows: prompts, rewards per role, tasks and the team's notes.

    Subclasses set ``self.agents`` (from their config), call :meth:`_setup_common` in their
    constructor and implement :meth:`episode`. Notes each episode leaves in ``ctx.notes``:
    ``success`` (the team's final answer passes ``reward`` at ``success_threshold``),
    ``role_correct`` (role -> the share of that role's scored outputs that pass) and ``answer``
    (the team's final answer).
    """

    #: Role name -> the agents playing it; set by each subclass's constructor.
    roles: Mapping[str, tuple[str, ...]] = {}
    #: Prompt name -> (default template, the workflow variables it may name).
    PROMPTS: Mapping[str, tuple[str, frozenset[str]]] = {}

    def _setup_common(self, *, roles: Mapping[str, Sequence[str]], prompts: Mapping[str, Any] | None,
                      reward: Any, rewards: Mapping[str, Any] | None, tasks: Any, eval_tasks: Any,
                      chat: bool, system: str | None, success_threshold: float, reward_timeout_s: float,
                      reward_workers: int) -> None:
        self.roles = {role: tuple(agents) for role, agents in roles.items()}
        agents = [agent for members in self.roles.values() for agent in members]
        for agent in agents:
            if not isinstance(agent, str) or not agent:
                raise ValueError(f"agent names must be non-empty strings, got {agent!r}")
        self.agents = tuple(dict.fromkeys(agents))
        if prompts is not None and not isinstance(prompts, Mapping):
            raise ValueError("prompts: must be a mapping of prompt name -> template")
        unknown = sorted(set(prompts or {}) - set(self.PROMPTS))
        if unknown:
            raise ValueError(f"prompts.{unknown[0]}: not a prompt of this workflow (it has {', '.join(self.PROMPTS)})")
        self.templates = {
            name: Template.parse(name, (prompts or {}).get(name, default), variables, self.prompt_location(name))
            for name, (default, variables) in self.PROMPTS.items()
        }
        self.reward_spec = parse_reward("reward", reward)
        if rewards is not None and not isinstance(rewards, Mapping):
            raise ValueError("rewards: must be a mapping of role -> {function, field, weight}")
        unknown = sorted(set(rewards or {}) - set(self.roles))
        if unknown:
            raise ValueError(f"rewards.{unknown[0]}: not a role of this workflow (roles: {', '.join(self.roles)})")
        self.role_rewards = {role: parse_reward(f"rewards.{role}", (rewards or {})[role]) if role in (rewards or {})
                             else self.reward_spec for role in self.roles}
        if not isinstance(chat, bool):
            raise ValueError("chat: must be true or false")
        if system is not None and not isinstance(system, str):
            raise ValueError("system: must be a string")
        self.chat, self.system = chat, system
        self.success_threshold = float(success_threshold)
        if not reward_timeout_s > 0 or int(reward_workers) < 1:
            raise ValueError("reward_timeout_s must be > 0 and reward_workers >= 1")
        self.reward_timeout_s, self.reward_workers = float(reward_timeout_s), int(reward_workers)
        self.tasks = _rows("tasks", tasks)
        self.eval_tasks = _rows("eval_tasks", eval_tasks)
        for where, rows in (("tasks", self.tasks), ("eval_tasks", self.eval_tasks)):
            self._check_rows(where, rows)
        self._rewards: RewardRunner | None = None

    def prompt_location(self, name: str) -> str:
        """Where the config sets prompt ``name``, for messages."""
        return f"prompts.{name}"

    @property
    def required_fields(self) -> dict[str, str]:
        """Each task-row field the workflow reads -> where the config names it (``prompts.solver``)."""
        fields: dict[str, str] = {}
        for template in self.templates.values():
            for field in sorted(template.row_fields):
                fields.setdefault(field, template.where)
        fields.setdefault(self.reward_spec.field, "reward.field")
        for role, spec in self.role_rewards.items():
            fields.setdefault(spec.field, f"rewards.{role}.field")
        return fields

    def _check_rows(self, where: str, rows: Sequence[Mapping[str, Any]]) -> None:
        for number, row in enumerate(rows):
            for field, named_by in self.required_fields.items():
                if field not in row:
                    raise ValueError(f"{named_by}: names field {field!r}, which {where}[{number}] lacks "
                                     f"(it has {', '.join(sorted(row)) or 'none'})")

    # --- tasks ---------------------------------------------------------------------------------

    @staticmethod
    def _pick(rows: Sequence[Mapping[str, Any]], index: int, seed: int, stream: str) -> dict[str, Any]:
        """Row ``index`` of an endless sequence of epochs, each a shuffle of ``rows`` seeded by (seed, epoch)."""
        epoch, position = divmod(index, len(rows))
        order = list(range(len(rows)))
        random.Random(f"flexmarl-workflow-{stream}/{seed}/{epoch}").shuffle(order)
        return dict(rows[order[position]])

    def task(self, index: int, seed: int) -> Task:
        """Row ``index`` of the config's ``tasks`` (a seeded shuffle per epoch)."""
        if not self.tasks:
            raise InvalidArgument("the workflow has no tasks: set environment.config.tasks")
        return Task(index=index, seed=seed, data=self._pick(self.tasks, index, seed, "tasks"))

    def eval_task(self, index: int, seed: int) -> Task:
        """Row ``index`` of ``eval_tasks`` when given, else the default held-out draw."""
        if not self.eval_tasks:
            return super().eval_task(index, seed)
        return Task(index=index, seed=seed, data=self._pick(self.eval_tasks, index, seed, "eval"))

    # --- episode helpers ---------------------------------------------------------------------

    def prompt(self, name: str, row: Mapping[str, Any], **variables: str) -> list[ChatMessage] | str:
        """Template ``name`` rendered for ``row``: one user message (after ``system``), or plain text."""
        text = self.templates[name].render(row, **variables)
        if not self.chat:
            return text
        messages: list[ChatMessage] = [{"role": "system", "content": self.system}] if self.system else []
        return [*messages, {"role": "user", "content": text}]

    async def score(self, role: str, response: str, row: Mapping[str, Any]) -> float:
        """The unweighted score of ``response`` by ``role``'s reward function against its field of ``row``."""
        spec = self.role_rewards[role] if role in self.role_rewards else self.reward_spec
        return await self._score(spec, response, row)

    async def team_score(self, response: str, row: Mapping[str, Any]) -> float:
        """The unweighted score of a team answer by ``reward``."""
        return await self._score(self.reward_spec, response, row)

    async def _score(self, spec: RewardSpec, response: str, row: Mapping[str, Any]) -> float:
        if spec.field not in row:
            raise InvalidArgument(f"reward: the task has no field {spec.field!r} (it has {', '.join(sorted(row))})")
        if self._rewards is None:
            isolated = {s.function for s in (self.reward_spec, *self.role_rewards.values())
                        if s.function in ISOLATED_BUILTINS or s.function not in BUILTIN_REWARDS}
            self._rewards = RewardRunner(timeout_s=self.reward_timeout_s, workers=self.reward_workers,
                                         preload=tuple(sorted(isolated)))
        return await self._rewards.score(spec.function, response, row[spec.field])

    def passes(self, score: float) -> bool:
        """Whether a score counts as correct (``success_threshold``)."""
        return score >= self.success_threshold

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

