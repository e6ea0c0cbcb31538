"""Keeps the engine replicas rolloutd launched alive: relaunch on exit, back off, give up loudly.

Like systemd's ``Restart=on-failure`` with ``StartLimitBurst``/``StartLimitIntervalSec``: a
replica whose process exits is relaunched from the same :class:`~rolloutd.engines.launcher.ReplicaSpec`
on the **same port**, after a back-off that doubles from ``initial_backoff_s`` to
``max_backoff_s``; more than ``max_restarts`` restarts within ``window_s`` and the supervisor
gives up on that replica (an ERROR log line and ``flexmarl_rolloutd_engine_gave_up_total``).

The router needs no notice: it dropped the replica when its requests failed, and its health
probe re-admits it once ``/health`` answers 200 again, reloading the weights of the agent it
serves (:mod:`rolloutd.router`). Attached replicas (``engine_urls``) are someone else's to run
and are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from flexmarl.errors import FlexmarlError
from flexmarl.retry import Backoff
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, kill_leftovers, launch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Supervised:
    replica: EngineReplica
    spec: ReplicaSpec
    name: str
    backoff: Backoff
    restarts: deque[float] = dataclasses.field(default_factory=deque)  # monotonic times of recent restarts
    gave_up: bool = False


class EngineSupervisor:
    """Watches launched replicas and relaunches the ones whose process exited."""

    def __init__(
        self,
        replicas: Sequence[tuple[EngineReplica, ReplicaSpec, str]],
        run_dir: Path,
        *,
        launch_timeout_s: float,
        poll_s: float = 0.5,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_restarts: int = 5,
        window_s: float = 600.0,
        on_restart: Callable[[str], None] | None = None,
        on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        """Supervises ``(replica, the spec it was launched from, its launch name)`` triples.

        Args:
            replicas: Launched replicas; their ``process`` is replaced in place on relaunch, so
                whoever stops them at shutdown stops the current process.
            run_dir: Where the launcher keeps ready files and logs (a relaunch appends to the log).
            launch_timeout_s: How long a relaunched replica may take to become healthy.
            poll_s: How often the processes are checked.
            initial_backoff_s: First wait before a relaunch (doubles after each failed relaunch).
            max_backoff_s: Largest wait.
            max_restarts: Restarts allowed within ``window_s``; one more and the replica is given up.
            window_s: The restart-counting window.
            on_restart: Called with the replica name after each successful relaunch (metrics).
            on_give_up: Called with the replica name when it is given up (metrics).
        """
        self._items = [
            _Supervised(replica, dataclasses.replace(spec, port=_port_of(replica.url) or spec.port), name,
                        Backoff(initial_backoff_s, max_backoff_s))
            for replica, spec, name in replicas if replica.process is not None
        ]
        self._run_dir = run_dir
        self._launch_timeout_s = launch_timeout_s
        self._poll_s = poll_s
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts watching (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="engine supervisor")

    async def stop(self) -> None:
        """Stops watching (before the replicas are stopped, so a stop is not taken for a crash)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def given_up(self) -> list[str]:
        """Names of the replicas the supervisor gave up on."""
        return [item.name for item in self._items if item.gave_up]

    async def _watch(self) -> None:
        while True:
            for item in self._items:
                process = item.replica.process
                if item.gave_up or process is None or process.poll() is None:
                    continue
                await self._relaunch(item, process.returncode)
            await asyncio.sleep(self._poll_s)

    async def _relaunch(self, item: _Supervised, code: int | None) -> None:
        """Relaunches one exited replica, retrying with back-off until it runs or the limit is hit."""
        logger.error("engine %s (%s) exited with %s; relaunching. Last output:\n%s",
                     item.name, item.replica.url, code, item.replica.log_tail(2000))
        if item.replica.process is not None:
            kill_leftovers(item.replica.process)  # e.g. vLLM's engine core, which outlives its server
        item.replica.clear_scratch()
        while True:
            now = time.monotonic()
            while item.restarts and now - item.restarts[0] > self._window_s:
                item.restarts.popleft()
            if len(item.restarts) >= self._max_restarts:
                item.gave_up = True
                logger.error("giving up on engine %s (%s): %d restarts within %.0f s; its requests go to the "
                             "other replicas", item.name, item.replica.url, len(item.restarts), self._window_s)
                if self._on_give_up is not None:
                    self._on_give_up(item.name)
                return
            await item.backoff.sleep()
            item.restarts.append(time.monotonic())
            try:
                fresh = await launch(item.spec, self._run_dir, timeout_s=self._launch_timeout_s, name=item.name,
                                     append_log=True)
            except FlexmarlError as exc:
                logger.error("relaunching engine %s failed: %s", item.name, str(exc).splitlines()[0])
                continue
            item.replica.process = fresh.process
            item.replica.url = fresh.url
            item.replica.scratch_dir = fresh.scratch_dir
            item.backoff.reset()
            logger.warning("engine %s relaunched at %s (pid %s); the router re-admits it on its next health probe",
                           item.name, fresh.url, fresh.pid)
            if self._on_restart is not None:
                self._on_restart(item.name)
            return


def _port_of(url: str) -> int:
    """The port of ``http://host:port`` (0 when it has none)."""
    _, _, port = url.rpartition(":")
    return int(port) if port.isdigit() else 0
