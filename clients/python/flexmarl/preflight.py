"""Checks of a job before it is sent: what the daemons would otherwise find only at run time.

:mod:`flexmarl.jobspec` validates a spec on its own; this module checks it against the
user's code. It loads ``environment.entrypoint`` with ``environment.config`` through the
loader rolloutd uses (:func:`flexmarl.episode.load_environment`) and compares the
environment's agents with the job's. Each problem is one line that names the field, e.g.
``environment.entrypoint: cannot load 'mygame.env:Game': No module named 'mygame'``.

The import happens in this process, the way the daemons of ``flexmarl up`` do it: with this
process's ``PYTHONPATH`` and the current directory on ``sys.path`` (``python -m`` puts it
there for the daemons, which inherit ``flexmarl up``'s environment and directory). A cluster
whose hosts have modules this machine lacks is submitted to with the check skipped
(``flexmarl submit --no-preflight``).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from flexmarl.entrypoints import loaded_digest, source_digest
from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec

if TYPE_CHECKING:
    from flexmarl.episode import Environment


@contextlib.contextmanager
def _current_dir_importable() -> Iterator[None]:
    """The current directory first on sys.path for the block, as ``python -m`` has it for the daemons."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def _load_problem(entrypoint: str, exc: BaseException) -> str:
    """The one-line problem of an environment that did not load, on the field that caused it."""
    cause = exc.__cause__
    if isinstance(exc, InvalidArgument):
        if isinstance(cause, (ImportError, AttributeError)):
            return f"environment.entrypoint: cannot load {entrypoint!r}: {cause}"
        if isinstance(cause, (TypeError, ValueError)):
            return f"environment.config: {exc}"
        if cause is None or isinstance(cause, InvalidArgument):
            return f"environment.entrypoint: {exc}"
        exc = cause  # what the user's module or constructor raised (SyntaxError, RuntimeError, ...)
    return f"environment.entrypoint: loading {entrypoint!r} raised {type(exc).__name__}: {exc}"


def _agent_problems(spec: JobSpec, env_agents: tuple[str, ...]) -> list[str]:
    entrypoint = spec.environment.entrypoint
    problems = []
    missing = [name for name in env_agents if name not in spec.agent_names]
    if missing:
        problems.append(f"agents: environment {entrypoint!r} plays agents {list(env_agents)}; "
                        f"the job has none named {missing}")
    for index, name in enumerate(spec.agent_names):
        if name not in env_agents:
            problems.append(f"agents[{index}].name: {name!r} is not an agent of environment {entrypoint!r} "
                            f"(it plays {list(env_agents)})")
    return problems


def _resolve(entrypoint: str) -> Any:
    """The object ``module:attr`` names, or None when it does not import (load_environment then says why)."""
    module_name, _, attr = entrypoint.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception:
        return None
    return target


def config_problems(entrypoint: str, target: Any, config: Mapping[str, Any]) -> list[str]:
    """``environment.config`` against the constructor's signature: one line per unknown or missing key.

    [] when the signature cannot be read (a C extension) or takes ``**kwargs`` (any key may be fine).
    """
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    by_keyword = [p for p in parameters
                  if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    names = [p.name for p in by_keyword]
    takes = f"it takes {', '.join(names)}" if names else "it takes no config"
    problems = [f"environment.config.{key}: not a parameter of {entrypoint!r} ({takes})"
                for key in config if key not in names]
    problems += [f"environment.config: {entrypoint!r} needs {p.name!r} (no default)" for p in by_keyword
                 if p.default is inspect.Parameter.empty and p.name not in config]
    return problems


def preflight_problems(spec: JobSpec) -> list[str]:
    """What would fail the job at run time, one line per problem naming the field; [] when none.

    Checks ``environment.config``'s keys against the environment's constructor, loads the
    environment (importing the user's module and running its constructor with
    ``environment.config``) and checks that its agents are exactly the job's agents; reads the
    task files of ``environment.dataset`` whole (:func:`flexmarl.datasets.dataset_problems`); loads each
    agent's ``warm_start.dataset`` and checks the pairs traind will train on; and that
    the packages of the job's trackers (``tracking.trackers``) import here.
    """
    from flexmarl.datasets import dataset_problems
    from flexmarl.episode import load_environment
    from flexmarl.tracking import missing_packages

    trackers = missing_packages(spec.tracking)
    entrypoint = spec.environment.entrypoint
    with _current_dir_importable():
        target = _resolve(entrypoint)
        if isinstance(target, type):
            problems = config_problems(entrypoint, target, spec.environment.config)
            if problems:
                return problems + trackers
        try:
            env = load_environment(entrypoint, spec.environment.config)
        except Exception as exc:  # user code may raise anything; it becomes one line
            return [_load_problem(entrypoint, exc), *trackers, *dataset_problems(spec)]
        stale = _stale_module_problems(entrypoint)
        warm_starts = _warm_start_problems(spec)
    return (stale + _agent_problems(spec, tuple(env.agents)) + _task_source_problems(spec, env)
            + dataset_problems(spec) + _workflow_field_problems(spec, env) + warm_starts + trackers)


def _workflow_field_problems(spec: JobSpec, env: Environment) -> list[str]:
    """The task fields a ready-made workflow reads (its prompts, its rewards) against the job's task source.

    One line per field that rows of ``environment.dataset``'s files lack, naming the config key
    that reads it, the file and the first row (a row of ``environment.config.tasks`` is checked
    when the workflow is built). A file that does not read is :func:`dataset_problems`'s to report.
    """
    from flexmarl.datasets import read_rows, task_files
    from flexmarl.workflows import Workflow

    dataset = spec.environment.dataset
    if not isinstance(env, Workflow):
        return []
    if dataset is None:
        return [] if env.tasks else [f"environment.dataset: workflow {spec.environment.entrypoint!r} has no tasks: "
                                     "give environment.dataset (or rows in environment.config.tasks)"]
    if env.tasks or env.eval_tasks:
        return ["environment.config.tasks: the job reads its tasks from environment.dataset; give one task source"]
    problems = []
    for path in (file.path for file in task_files(dataset)):
        try:
            rows = read_rows(path).rows
        except InvalidArgument:
            continue
        for field, named_by in env.required_fields.items():
            lacking = [number for number, row in enumerate(rows) if row.get(field) is None]
            if len(lacking) == len(rows) and rows:
                problems.append(f"environment.config.{named_by}: names field {field!r}, which the rows of {path} "
                                f"lack (they have {', '.join(sorted(rows[0]))})")
            elif lacking:
                problems.append(f"environment.config.{named_by}: names field {field!r}, which {len(lacking)} rows "
                                f"of {path} lack (the first: row {lacking[0]}, counting from 0)")
    return problems


def _task_source_problems(spec: JobSpec, env: Environment) -> list[str]:
    """An environment that makes no tasks of its own needs the job's ``environment.dataset``."""
    from flexmarl.episode import Environment

    if spec.environment.dataset is None and type(env).task is Environment.task:
        return [f"environment.dataset: {spec.environment.entrypoint!r} does not override task(index, seed), so "
                "its tasks come from a dataset: give environment.dataset"]
    return []


def _stale_module_problems(entrypoint: str) -> list[str]:
    """A module this process imported before its file was edited: the check ran code the cluster will not."""
    module = entrypoint.partition(":")[0]
    loaded, on_disk = loaded_digest(module), source_digest(module)
    if loaded and on_disk and loaded != on_disk:
        return [f"environment.entrypoint: {module} was edited after this process imported it; the check ran the "
                "old code (start a new Python process to check and submit the edited one)"]
    return []


def stamped(spec: JobSpec) -> JobSpec:
    """``spec`` with ``environment.code_digest`` set to the entrypoint module's source as checked here.

    rolloutd compares it with the module it runs (:func:`flexmarl.entrypoints.loaded_digest`)
    and refuses the job when a rolloutd imported the module before it was edited.
    """
    digest = source_digest(spec.environment.entrypoint.partition(":")[0])
    return spec.model_copy(update={"environment": spec.environment.model_copy(update={"code_digest": digest})})


def _warm_start_problems(spec: JobSpec) -> list[str]:
    """Each agent's ``warm_start.dataset`` loads and yields the (prompt, response) pairs traind needs."""
    from flexmarl.warm_start_data import as_pair, first_items

    problems = []
    for index, agent in enumerate(spec.agents):
        warm = agent.warm_start
        if warm is None:
            continue
        try:
            items = first_items(warm.dataset, spec.seed, warm.steps * warm.batch_size, warm.config)
            for number, item in enumerate(items):
                as_pair(item, number)
        except InvalidArgument as exc:
            problems.append(f"agents[{index}].warm_start.dataset: {exc}")
    return problems


def check_job(spec: JobSpec) -> JobSpec:
    """The spec :func:`stamped` with the checked code; InvalidArgument with one line per problem found."""
    problems = preflight_problems(spec)
    if problems:
        raise InvalidArgument("\n".join(problems))
    return stamped(spec)  # the entrypoint's module is imported now: its file is known without sys.path
