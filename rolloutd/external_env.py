"""An environment whose episodes are played by an external agent program through the OpenAI gateway.

A job runs an unmodified program written against the ``openai`` package by naming this class as
its environment; no job-spec schema change is involved::

    environment:
      entrypoint: "rolloutd.external_env:ExternalAgents"
      config:
        agents: [planner, solver, critic]          # the job's agents the program calls (model=<agent>)
        program: "examples.openai_agents.agents:run" # a Python callable (base_url, api_key, task)
        # or: command: ["python", "my_agents.py"]    # a command line, given the URLs as env vars
        tasks: "examples.openai_agents.agents:make_task"  # (index, seed) -> JSON-like task data
        tool_call_parser: qwen25                    # or {agent: parser}: tool calls parsed out of answers
        episode_timeout_s: 600
        gateway: {host: 127.0.0.1, port: 0, advertise_host: "", token_file: ""}

Each episode opens a :class:`~rolloutd.gateway.server.Session` on the environment's
:class:`~rolloutd.gateway.server.Gateway` (started with the first episode, in the episode's event loop),
runs the program against it and closes the session when the program returns; the program's
calls become the episode's turns. ``task`` is a plain dict ``{"index", "seed", "sample_index",
"agents", "data"}``. Rewards: the program posts them (``POST <session>/reward``) or a Python
program returns ``{agent: reward}``. A program that raises, exits non-zero or outlives
``episode_timeout_s`` fails the episode (and so its task's group, as for native environments).

* A Python callable may be async (awaited in rolloutd's loop) or sync (run in a thread of its
  own, never in a shared pool: the first calls of a group's episodes wait for one another, see
  :class:`rolloutd.runner.FirstTurnCoalescer`, so a bounded pool could deadlock).
* A command gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``FLEXMARL_BASE_URL`` (the session root),
  ``FLEXMARL_REWARD_URL`` and ``FLEXMARL_TASK`` (the task as JSON) in its environment; it is
  killed when the episode is cancelled or times out.

The cluster token (when rolloutd has one) is read from ``gateway.token_file``, else from the
file named by ``FLEXMARL_AUTH_TOKEN_FILE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexmarl.entrypoints import load_entrypoint
from flexmarl.episode import Environment, EpisodeContext, Task
from flexmarl.errors import InvalidArgument
from flexmarl.security import read_token
from rolloutd.gateway.server import Gateway, GatewayConfig, Session

logger = logging.getLogger(__name__)

__all__ = ["ExternalAgents", "ProgramFailed", "load_callable"]

_STDERR_TAIL_BYTES = 4000


class ProgramFailed(RuntimeError):
    """The agent program failed (non-zero exit, a bad return value, or a timeout)."""


def load_callable(target: str, what: str) -> Callable[..., Any]:
    """Imports ``module:attr`` and checks it is callable."""
    value = load_entrypoint(target, what)
    if not callable(value):
        raise InvalidArgument(f"{what} {target!r} is not callable")
    return value  # type: ignore[no-any-return]


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


async def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # delivered to the episode
            outcome: tuple[Callable[[Any], None], Any] = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(deliver, *outcome)

    threading.Thread(target=target, name=f"agent program {getattr(fn, '__name__', fn)}", daemon=True).start()
    return await future


class ExternalAgents(Environment):
    """Episodes played by an external OpenAI-client program (see the module docstring for the config)."""

    def __init__(self, *, agents: Sequence[str] | None = None, program: str | Callable[..., Any] | None = None,
                 command: str | Sequence[str] | None = None, tasks: str | None = None,
                 episode_timeout_s: float = 600.0, gateway: Mapping[str, Any] | None = None,
                 tool_call_parser: str | Mapping[str, str] | None = None) -> None:
        super().__init__(agents=agents, program=program, command=command, tasks=tasks,
                         episode_timeout_s=episode_timeout_s, gateway=gateway, tool_call_parser=tool_call_parser)
        if not isinstance(agents, list | tuple) or not agents or not all(isinstance(a, str) and a for a in agents):
            raise ValueError("config 'agents' must be a non-empty list of agent names")
        self.agents = tuple(agents)
        if (program is None) == (command is None):
            raise ValueError("config needs exactly one of 'program' (module:attr) and 'command'")
        # A callable itself is accepted from Python (tests, notebooks); job specs name one as 'module:attr'.
        self._program = load_callable(program, "agent program") if isinstance(program, str) else program
        if program is not None and not callable(self._program):
            raise ValueError("config 'program' must be a 'module:attr' string (or a callable)")
        self._command: list[str] | None = None
        if command is not None:
            argv = shlex.split(command) if isinstance(command, str) else command
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("config 'command' must be a command line or a non-empty list of strings")
            self._command = argv
        self._tasks = load_callable(tasks, "task factory") if isinstance(tasks, str) else None
        if tasks is not None and not isinstance(tasks, str):
            raise ValueError("config 'tasks' must be a 'module:attr' string")
        timeout = episode_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError("config 'episode_timeout_s' must be a positive number")
        self.episode_timeout_s = float(timeout)
        self.gateway_config = self._gateway_config(gateway or {}, self._tool_call_parsers(tool_call_parser))
        self.gateway: Gateway | None = None
        self._gateway_lock: asyncio.Lock | None = None
        self._gateway_loop: asyncio.AbstractEventLoop | None = None

    def _tool_call_parsers(self, raw: Any) -> dict[str, str]:
        """``tool_call_parser``: one parser name for every agent, or ``{agent: name}``."""
        if raw is None:
            return {}
        if isinstance(raw, str):
            return dict.fromkeys(self.agents, raw)
        if not isinstance(raw, Mapping) or not all(isinstance(v, str) for v in raw.values()):
            raise ValueError("config 'tool_call_parser' must be a parser name or {agent: parser name}")
        unknown = sorted(set(raw) - set(self.agents))
        if unknown:
            raise ValueError(f"config 'tool_call_parser' names unknown agents {unknown}")
        return dict(raw)

    @staticmethod
    def _gateway_config(raw: Any, tool_call_parsers: Mapping[str, str]) -> GatewayConfig:
        if not isinstance(raw, Mapping):
            raise ValueError("config 'gateway' must be a mapping")
        unknown = set(raw) - {"host", "port", "advertise_host", "token_file"}
        if unknown:
            raise ValueError(f"unknown gateway settings {sorted(unknown)}")
        token_file = str(raw.get("token_file") or os.environ.get("FLEXMARL_AUTH_TOKEN_FILE", ""))
        try:
            return GatewayConfig(host=str(raw.get("host", "127.0.0.1")), port=int(raw.get("port", 0)),
                                 advertise_host=str(raw.get("advertise_host", "")),
                                 cluster_token=read_token(token_file) if token_file else "",
                                 tool_call_parsers=dict(tool_call_parsers))
        except InvalidArgument as exc:
            raise ValueError(str(exc)) from exc

    def task(self, index: int, seed: int) -> Task:
        """The task factory's data for (index, seed), or no data without a factory."""
        if self._tasks is None:
            return Task(index=index, seed=seed)
        data = self._tasks(index, seed)
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"task factory returned {type(data).__name__}, not a mapping")
        return Task(index=index, seed=seed, data=dict(data))

    async def _gateway(self) -> Gateway:
        loop = asyncio.get_running_loop()
        if self._gateway_loop is not loop or self._gateway_lock is None:
            # Episodes run in another event loop than the gateway's (a caller that uses asyncio.run
            # per batch): that server died with its loop, so this loop gets its own, and the old
            # one's listening socket is closed here (its loop can no longer run its stop()).
            if self.gateway is not None:
                self.gateway.abandon()
            self.gateway, self._gateway_loop = None, loop
            self._gateway_lock = asyncio.Lock()
        async with self._gateway_lock:
            if self.gateway is None:
                gateway = Gateway(self.gateway_config)
                await gateway.start()
                self.gateway = gateway
            return self.gateway

    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Opens a session, runs the program against it, closes the session."""
        gateway = await self._gateway()
        session = gateway.open_session(ctx)
        payload = {"index": task.index, "seed": task.seed, "sample_index": ctx.sample_index,
                   "agents": list(self.agents), "data": dict(task.data)}
        try:
            async with asyncio.timeout(self.episode_timeout_s):
                if self._program is not None:
                    rewards = await self._run_callable(self._program, gateway, session, payload)
                    self._apply_rewards(ctx, rewards)
                elif self._command is not None:
                    await self._run_command(self._command, gateway, session, payload)
        except TimeoutError as exc:
            raise ProgramFailed(f"the agent program ran past episode_timeout_s={self.episode_timeout_s}") from exc
        finally:
            await gateway.close_session(session)

    @staticmethod
    async def _run_callable(fn: Callable[..., Any], gateway: Gateway, session: Session,
                            payload: dict[str, Any]) -> Any:
        args = (gateway.base_url(session), gateway.api_key(session), payload)
        result = await fn(*args) if _is_async(fn) else await _in_own_thread(fn, *args)
        if inspect.isawaitable(result):  # a plain function that returns a coroutine (a lambda, a wrapper)
            result = await result
        return result

    @staticmethod
    def _apply_rewards(ctx: EpisodeContext, rewards: Any) -> None:
        if rewards is None:
            return
        if not isinstance(rewards, Mapping):
            raise ProgramFailed(f"the agent program returned {type(rewards).__name__}; expected None or "
                                "{agent: reward}")
        for agent, value in rewards.items():
            ctx.reward(agent, value)

    @staticmethod
    async def _run_command(argv: list[str], gateway: Gateway, session: Session, payload: dict[str, Any]) -> None:
        root = gateway.base_url(session).removesuffix("/v1")
        env = {**os.environ, "OPENAI_BASE_URL": gateway.base_url(session), "OPENAI_API_KEY": gateway.api_key(session),
               "FLEXMARL_BASE_URL": root, "FLEXMARL_REWARD_URL": f"{root}/reward",
               "FLEXMARL_TASK": json.dumps(payload)}
        process = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                       stdout=asyncio.subprocess.DEVNULL,
                                                       stderr=asyncio.subprocess.PIPE)
        try:
            _, stderr = await process.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        if process.returncode != 0:
            tail = stderr[-_STDERR_TAIL_BYTES:].decode(errors="replace")
            raise ProgramFailed(f"agent command {argv[0]!r} exited with {process.returncode}: {tail}")

    async def aclose(self) -> None:
        """Stops the gateway (every open session ends)."""
        if self.gateway is not None:
            gateway, self.gateway = self.gateway, None
            await gateway.stop()
