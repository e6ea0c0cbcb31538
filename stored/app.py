"""The stored daemon: opens the database and blob directory, serves Store, runs GC."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc.aio
from prometheus_client import CollectorRegistry

from flexmarl.daemon import DaemonApp, DaemonContext
from stored.blobs import BlobStore
from stored.config import StoredConfig
from stored.database import DB_FILE, Database
from stored.experiences import ExperienceStore
from stored.metrics import StoredMetrics
from stored.servicer import SERVICE_NAME, StoreServicer, add_to_server

log = logging.getLogger(__name__)


class StoredApp(DaemonApp):
    """Experience and blob store behind the Store service."""

    service_names = (SERVICE_NAME,)

    def __init__(self, config: StoredConfig, metrics_registry: CollectorRegistry) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir).resolve()
        self._executor = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="stored-io")
        self.metrics = StoredMetrics(metrics_registry)
        self.servicer = StoreServicer(self.metrics, self._executor)
        self.db: Database | None = None
        self._opened_blobs: BlobStore | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self._stopped = False

    def _open(self) -> tuple[ExperienceStore, BlobStore]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.data_dir / DB_FILE, synchronous=self.config.sqlite_synchronous)
        quotas = self.config.quotas()
        experiences = ExperienceStore(self.db, limits=self.config.experience_limits(), quotas=quotas)
        blobs = BlobStore(self.db, self.data_dir / "blobs", limits=self.config.blob_limits(), quotas=quotas)
        blobs.recover()
        return experiences, blobs

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Store service (it answers UNAVAILABLE until start() opened the stores)."""
        add_to_server(self.servicer, server)

    async def start(self) -> None:
        """Opens the database (recovering blobs left by a crash) and starts the GC loop."""
        loop = asyncio.get_running_loop()
        self.experiences, self.blobs = await loop.run_in_executor(self._executor, self._open)
        self._opened_blobs = self.blobs
        self.metrics.watch_contents(self.experiences, self.blobs)
        self.servicer.attach(self.experiences, self.blobs)
        if self.config.gc_interval_s > 0:
            self._gc_task = asyncio.create_task(self._gc_loop(), name="stored-gc")
        log.info("stored data in %s", self.data_dir)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._executor, functools.partial(
                        self.experiences.collect_garbage, "", self.config.gc_retention_s, finished_only=False)
                )
            except Exception:
                log.exception("background garbage collection failed")
                continue
            self.servicer.record_gc(result.deleted_rows, result.deleted_bytes)

    async def stop(self) -> None:
        """Stops GC, waits for in-flight I/O and closes the database; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        if self._opened_blobs is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._opened_blobs.close)
        if self.db is not None:
            self.db.close()
        log.info("stored closed %s", self.data_dir)

    def registration_info(self) -> dict[str, Any]:
        """Published in etcd: where the data lives."""
        return {"data_dir": str(self.data_dir)}


def build_app(config: StoredConfig, context: DaemonContext) -> StoredApp:
    """Builds the daemon's app from its config and runtime context."""
    return StoredApp(config, context.metrics)
