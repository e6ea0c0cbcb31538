"""Which versions of LoRA agents one replica holds, loaded as adapters over the base it serves.

A LoRA agent's committed weights are a PEFT adapter directory (traind publishes one per version).
A replica that serves the agent's base loads version ``k`` with ``/load_lora_adapter`` under the
name ``<agent>@v<k>`` (:class:`AdapterVersion`) and routes each request with ``lora_path`` set to
that name, so a version switch needs no drain: requests already running on ``v<k>`` finish on it
while new ones use ``v<k+1>``, loaded beside it. An older version is unloaded once no request of
this rolloutd uses it (the engine's own unload then waits for nothing; SGLang's registry would
wait for stragglers all the same, sglang/srt/lora/lora_registry.py ``wait_for_unload``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from flexmarl.errors import InvalidArgument
from rolloutd.engines.protocol import EngineClient

logger = logging.getLogger(__name__)

_VERSION_MARK = "@v"


@dataclasses.dataclass(frozen=True, order=True)
class AdapterVersion:
    """Version ``version`` of LoRA agent ``agent``: the adapter name ``<agent>@v<version>`` on an engine."""

    agent: str
    version: int

    def __str__(self) -> str:
        return f"{self.agent}{_VERSION_MARK}{self.version}"

    @classmethod
    def parse(cls, name: str) -> AdapterVersion:
        """The adapter version a name stands for.

        Raises:
            InvalidArgument: ``name`` is not ``<agent>@v<non-negative int>``.
        """
        agent, mark, version = name.rpartition(_VERSION_MARK)
        if not (agent and mark and version.isdigit()):
            raise InvalidArgument(f"{name!r} is not an adapter version name (<agent>@v<k>)")
        return cls(agent, int(version))


class LoraResidency:
    """The adapter versions one replica holds for LoRA agents, and the requests using each.

    :meth:`use` is what a request runs in: it loads the version if the replica lacks it (one
    load per name at a time; concurrent requests wait for it), counts the request, and yields
    the name to send as ``lora_path``; when the last request of an older version ends, that
    version is unloaded.
    """

    def __init__(self, client: EngineClient, resolve_weights: Callable[[str], Awaitable[str]]) -> None:
        """Tracks adapters on the replica behind ``client``; ``resolve_weights`` maps a URI to a directory."""
        self._client = client
        self._resolve = resolve_weights
        self._loaded: dict[str, set[int]] = collections.defaultdict(set)
        self._loads: dict[AdapterVersion, asyncio.Future[None]] = {}
        self._users: collections.Counter[AdapterVersion] = collections.Counter()
        self._unloading: set[AdapterVersion] = set()
        self.loads = 0
        self.unloads = 0

    def loaded_versions(self, agent: str) -> tuple[int, ...]:
        """The versions of ``agent`` loaded on the replica, oldest first."""
        return tuple(sorted(self._loaded.get(agent, ())))

    def agents(self) -> tuple[str, ...]:
        """The agents with a version loaded on the replica, sorted."""
        return tuple(sorted(agent for agent, versions in self._loaded.items() if versions))

    def users(self, adapter: AdapterVersion) -> int:
        """Requests of this rolloutd now using ``adapter``."""
        return self._users[adapter]

    async def _ensure(self, adapter: AdapterVersion, uri: str) -> None:
        """Load ``adapter`` unless loaded; concurrent callers share one load."""
        if adapter.version in self._loaded.get(adapter.agent, ()):
            return  # (being unloaded: the engine reloads it for the request, as SGLang does)
        pending = self._loads.get(adapter)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loads[adapter] = pending
            try:
                path = await self._resolve(uri)
                await self._client.load_lora_adapter(str(adapter), path)
                self._loaded[adapter.agent].add(adapter.version)
                self.loads += 1
                logger.info("loaded %s from %s", adapter, path)
                pending.set_result(None)
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # retrieved here; waiters re-raise it
                raise
            finally:
                del self._loads[adapter]
            return
        await asyncio.shield(pending)

    @contextlib.asynccontextmanager
    async def use(self, agent: str, version: int, uri: str) -> AsyncIterator[str]:
        """Within the block, the replica holds ``agent`` v``version`` (weights at ``uri``); yields its name."""
        adapter = AdapterVersion(agent, version)
        await self._ensure(adapter, uri)
        self._users[adapter] += 1
        try:
            yield str(adapter)
        finally:
            self._users[adapter] -= 1
            if self._users[adapter] <= 0:
                del self._users[adapter]
            await self._collect(agent)

    async def _collect(self, agent: str) -> None:
        """Unload every version of ``agent`` older than its newest that no request uses."""
        versions = self._loaded.get(agent, set())
        if not versions:
            return
        newest = max(versions)
        for version in sorted(versions):
            adapter = AdapterVersion(agent, version)
            if version >= newest or self._users[adapter] > 0 or adapter in self._unloading:
                continue
            self._unloading.add(adapter)
            try:
                await self._client.unload_lora_adapter(str(adapter))
                versions.discard(version)
                self.unloads += 1
                logger.info("unloaded %s (v%d is served)", adapter, newest)
            finally:
                self._unloading.discard(adapter)

    async def release_agent(self, agent: str) -> None:
        """Unload every version of ``agent`` no request uses (the agent left the replica)."""
        for version in sorted(self._loaded.get(agent, set())):
            adapter = AdapterVersion(agent, version)
            if self._users[adapter] == 0 and adapter not in self._unloading:
                await self._client.unload_lora_adapter(str(adapter))
                self._loaded[agent].discard(version)
                self.unloads += 1
