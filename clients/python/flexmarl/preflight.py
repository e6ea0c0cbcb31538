"""Checks of a job before it is sent: what the daemons would otherwise find only at run time.

:mod:`flexmarl.jobspec` validates a spec on its own; this module checks it against the
user's code. It loads ``environment.entrypoint`` with ``environment.config`` through the
loader rolloutd uses (:func:`rolloutd.episode.load_environment`) and compares the
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
import os
import sys
from collections.abc import Iterator

from flexmarl.errors import InvalidArgument
from flexmarl.jobspec import JobSpec


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


def preflight_problems(spec: JobSpec) -> list[str]:
    """What would fail the job at run time, one line per problem naming the field; [] when none.

    Loads the environment (importing the user's module and running its constructor with
    ``environment.config``) and checks that its agents are exactly the job's agents.
    """
    from rolloutd.episode import load_environment

    entrypoint = spec.environment.entrypoint
    try:
        with _current_dir_importable():
            env = load_environment(entrypoint, spec.environment.config)
    except Exception as exc:  # user code may raise anything; it becomes one line
        return [_load_problem(entrypoint, exc)]
    return _agent_problems(spec, tuple(env.agents))


def check_job(spec: JobSpec) -> None:
    """Raises InvalidArgument with one line per :func:`preflight_problems` problem."""
    problems = preflight_problems(spec)
    if problems:
        raise InvalidArgument("\n".join(problems))
