"""A job's per-step history beyond its last pages moves from etcd to stored, so etcd stays bounded.

Every committed agent-step leaves a manifest, a commit record and a history record in etcd
(:mod:`orchestratord.state`). Once every agent committed every step of a page of ``page_steps``
steps, one more page after it, and stored confirmed the page's experiences consumed (no pending mark
left), the page is *archived*:

1. its history records (all agents) are written to stored as one JSON blob,
   :func:`history_page_blob_name` (idempotent: the same name and content on a retry);
2. the job's :class:`~orchestratord.state.HistoryArchiveIndex` in etcd advances past the page
   (compare-and-swap): from here on GetJobHistory reads the page from stored;
3. the page's manifests, commits and history records are deleted from etcd, and the index records
   the page cleaned (a crash before that leaves it to the next pass).

Nothing else reads the deleted keys: a restart needs the manifests of steps some agent has not
committed and of steps with a pending mark (both kept), the planner keeps the last commits in memory
(``KEPT_COMMITTED_STEPS``), and which experiences a step consumed stays in stored (each experience's
state and step id). So etcd holds at most about two pages of steps per job, whatever the job's
length. Old state (history only in etcd, no index) reads as it is and is archived page by page.

GetJobHistory's pages are cut by step, not by archive page: :meth:`HistoryArchive.page` reads the
archived part from stored (a few decoded pages are cached) and the rest from etcd, and retries when
an archive pass moved the boundary during the read.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from flexmarl.errors import FlexmarlError, Unavailable
from flexmarl.experience import ExperienceState
from flexmarl.ids import StepRef
from flexmarl.store_client import ExperienceRef
from orchestratord.state import HistoryArchiveIndex, StateStore, sort_history

log = logging.getLogger(__name__)

#: Steps per archived page (orchestratord's ``--history-page-steps``).
DEFAULT_PAGE_STEPS = 500
#: Decoded archived pages kept for repeated reads (a client paging through old history).
CACHED_PAGES = 4
_READ_ATTEMPTS = 5


def history_page_blob_name(job_id: str, page: int) -> str:
    """The stored blob of page ``page`` of a job's archived history (steps ``page * page_steps ...``)."""
    return f"history/{job_id}/{page:08d}.json"


def consumed_steps(refs: Iterable[ExperienceRef]) -> dict[str, int]:
    """Experience id -> the step stored says consumed it, for the consumed ones among ``refs``.

    A restart's recovery needs it where a step's manifests were archived away: under ``step_fill:
    completion`` it tells which step a task went to (``JobPlanner.recover``).
    """
    out: dict[str, int] = {}
    for ref in refs:
        if ref.state is ExperienceState.CONSUMED and ref.step_id:
            try:
                out[ref.experience_id] = StepRef.parse(ref.step_id).step
            except FlexmarlError:
                continue
    return out


class HistoryBlobs(Protocol):
    """The part of stored's client the archive uses (``flexmarl.store_client.StoreClient``)."""

    async def put_blob_bytes(self, name: str, data: bytes, *, job_id: str = "") -> Any:
        """Stores ``data`` under ``name``."""

    async def get_blob_bytes(self, name: str) -> bytes:
        """Reads a whole blob."""


class HistoryArchive:
    """Moves the history of old pages to stored and reads history across stored and etcd."""

    def __init__(self, state: StateStore, blobs: Callable[[], Awaitable[HistoryBlobs]],
                 page_steps: int = DEFAULT_PAGE_STEPS) -> None:
        if page_steps < 1:
            raise ValueError(f"page_steps must be >= 1, got {page_steps}")
        self._state = state
        self._blobs = blobs
        self._page_steps = page_steps
        #: job -> its index as etcd holds it (None: never archived); loaded on first use.
        self._persisted: dict[str, HistoryArchiveIndex | None] = {}
        #: job -> committed (agent, step)s whose experiences stored has not confirmed consumed.
        self._pending: dict[str, set[tuple[str, int]]] = collections.defaultdict(set)
        self._pass_lock = asyncio.Lock()  # one archive pass at a time, over all jobs
        self._pages: collections.OrderedDict[tuple[str, int], list[dict[str, Any]]] = collections.OrderedDict()

    # ---- what may be archived ----------------------------------------------------------------------

    def mark_pending(self, job_id: str, agent: str, step: int) -> None:
        """A committed step's experiences are being marked consumed: its page must wait."""
        self._pending[job_id].add((agent, step))

    def mark_cleared(self, job_id: str, agent: str, step: int) -> None:
        """Stored confirmed the step's experiences consumed and its pending mark is gone from etcd."""
        pending = self._pending.get(job_id)
        if pending is not None:
            pending.discard((agent, step))
            if not pending:
                del self._pending[job_id]

    def forget(self, job_id: str) -> None:
        """Drops what is held about a job (it is no longer served)."""
        self._persisted.pop(job_id, None)
        self._pending.pop(job_id, None)
        for key in [key for key in self._pages if key[0] == job_id]:
            del self._pages[key]

    async def index(self, job_id: str) -> HistoryArchiveIndex:
        """The job's archive index (nothing archived yet: pages of the configured size)."""
        if job_id not in self._persisted:
            self._persisted[job_id] = await self._state.load_history_archive(job_id)
        return self._persisted[job_id] or HistoryArchiveIndex(self._page_steps)

    def due(self, job_id: str, min_version: int) -> bool:
        """Whether an archive pass may have work (cheap; no I/O): every agent is two pages past a page."""
        if job_id not in self._persisted:
            return True
        index = self._persisted[job_id] or HistoryArchiveIndex(self._page_steps)
        return index.cleaned < index.pages or (index.pages + 2) * index.page_steps <= min_version

    def _archivable(self, job_id: str, index: HistoryArchiveIndex, min_version: int) -> bool:
        start, end = index.archived_steps, index.archived_steps + index.page_steps
        if end + index.page_steps > min_version:
            return False
        return not any(start <= step < end for _, step in self._pending.get(job_id, ()))

    async def archive(self, job_id: str, agents: Sequence[str], min_version: int) -> int:
        """Archives every page of the job that is due (see the module docstring); returns how many."""
        async with self._pass_lock:
            index = await self.index(job_id)
            step_count = index.page_steps
            if index.cleaned < index.pages:  # a pass that stopped between the index and the deletion
                await self._state.delete_steps(job_id, agents, index.cleaned * step_count, index.archived_steps)
                index = await self._advance(job_id, dataclasses.replace(index, cleaned=index.pages))
            archived = 0
            while self._archivable(job_id, index, min_version):
                page, start = index.pages, index.archived_steps
                rows, _ = await self._state.load_history_page(job_id, agents, start, step_count)
                document = {"job_id": job_id, "page": page, "page_steps": step_count, "records": rows}
                blobs = await self._blobs()
                await blobs.put_blob_bytes(history_page_blob_name(job_id, page),
                                           json.dumps(document, sort_keys=True, separators=(",", ":")).encode(),
                                           job_id=job_id)
                # Readers go to stored for the page from here on, before any of its keys is deleted.
                index = await self._advance(job_id, dataclasses.replace(index, pages=page + 1))
                await self._state.delete_steps(job_id, agents, start, start + step_count)
                index = await self._advance(job_id, dataclasses.replace(index, cleaned=page + 1))
                archived += 1
                log.info("job %s: archived history steps %d..%d to stored (%d records)",
                         job_id, start, start + step_count - 1, len(rows))
            return archived

    async def _advance(self, job_id: str, index: HistoryArchiveIndex) -> HistoryArchiveIndex:
        await self._state.put_history_archive(job_id, self._persisted.get(job_id), index)
        self._persisted[job_id] = index
        return index

    # ---- reading ----------------------------------------------------------------------------------------

    async def page(self, job_id: str, agents: Sequence[str], from_step: int,
                   max_steps: int) -> tuple[list[dict[str, Any]], bool]:
        """The records of steps ``from_step .. from_step + max_steps - 1`` (commit order) and whether more follow.

        The same contract as :meth:`StateStore.load_history_page`, over archived and live steps.
        """
        for _ in range(_READ_ATTEMPTS):
            index = await self.index(job_id)
            rows, more = await self._read(job_id, agents, from_step, from_step + max_steps, index)
            if (await self.index(job_id)).pages == index.pages:
                return sort_history(rows), more
            # An archive pass moved the boundary meanwhile (and may have deleted what was read as live).
        raise Unavailable(f"history of job {job_id!r}: archiving kept moving during the read; try again")

    async def _read(self, job_id: str, agents: Sequence[str], from_step: int, end: int,
                    index: HistoryArchiveIndex) -> tuple[list[dict[str, Any]], bool]:
        boundary = index.archived_steps
        rows: list[dict[str, Any]] = []
        wanted = set(agents)
        if from_step < boundary:
            for page in range(from_step // index.page_steps, (min(end, boundary) - 1) // index.page_steps + 1):
                rows += [r for r in await self._archived_page(job_id, page)
                         if r.get("agent") in wanted and from_step <= int(r.get("step", -1)) < end]
        if end < boundary:
            return rows, True  # archived pages are whole: steps past the range exist
        live_from = max(from_step, boundary)
        live, more = await self._state.load_history_page(job_id, agents, live_from, end - live_from)
        return rows + live, more

    async def _archived_page(self, job_id: str, page: int) -> list[dict[str, Any]]:
        key = (job_id, page)
        cached = self._pages.get(key)
        if cached is not None:
            self._pages.move_to_end(key)
            return cached
        name = history_page_blob_name(job_id, page)
        try:
            blobs = await self._blobs()
            document = json.loads(await blobs.get_blob_bytes(name))
        except Exception as exc:
            raise Unavailable(f"history of job {job_id!r}: archived page {name} unreadable from stored: {exc}") from exc
        records: list[dict[str, Any]] = list(document["records"])
        self._pages[key] = records
        while len(self._pages) > CACHED_PAGES:
            self._pages.popitem(last=False)
        return records
