"""Prometheus metrics of stored, registered into the daemon's own registry."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flexmarl.metrics import LATENCY_BUCKETS_S
from stored.blobs import BlobStore
from stored.experiences import ExperienceStore

log = logging.getLogger(__name__)


class _StoreContentsCollector(Collector):
    """Rows/bytes per (job, agent, state) and blob totals, read from the database on scrape.

    The numbers come from the per-partition counters kept in the same transactions as
    the rows, so a scrape costs one small query, never a table scan.
    """

    def __init__(self, experiences: ExperienceStore, blobs: BlobStore) -> None:
        self._experiences = experiences
        self._blobs = blobs

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        rows = GaugeMetricFamily(
            "flexmarl_stored_experience_rows", "Experiences held, by job, agent and state.",
            labels=["job", "agent", "state"],
        )
        size = GaugeMetricFamily(
            "flexmarl_stored_experience_bytes", "Packed payload bytes of experiences held, by job, agent and state.",
            labels=["job", "agent", "state"],
        )
        blob_count = GaugeMetricFamily("flexmarl_stored_blobs", "Distinct blob contents held.")
        blob_bytes = GaugeMetricFamily("flexmarl_stored_blob_bytes", "Bytes of blob contents held.")
        try:
            for s in self._experiences.stats():
                labels = [s.job_id, s.agent, s.state.name.lower()]
                rows.add_metric(labels, s.rows)
                size.add_metric(labels, s.bytes)
            count, total = self._blobs.totals()
            blob_count.add_metric([], count)
            blob_bytes.add_metric([], total)
        except Exception:  # a scrape during shutdown must not raise into the HTTP server
            log.debug("metrics scrape could not read the database", exc_info=True)
        yield from (rows, size, blob_count, blob_bytes)


class StoredMetrics:
    """Counters and histograms updated by the servicer and the GC loop."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.append_seconds = Histogram(
            "flexmarl_stored_append_seconds", "Time to make one append request durable.",
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.read_seconds = Histogram(
            "flexmarl_stored_read_seconds", "Time to read one batch of experiences from the database.",
            buckets=LATENCY_BUCKETS_S, registry=registry,
        )
        self.appended = Counter(
            "flexmarl_stored_appended_experiences_total", "Experiences stored (duplicates excluded).",
            registry=registry,
        )
        self.duplicates = Counter(
            "flexmarl_stored_duplicate_experiences_total", "Retried appends of already stored experiences.",
            registry=registry,
        )
        self.appended_bytes = Counter(
            "flexmarl_stored_appended_bytes_total", "Payload bytes of stored experiences.", registry=registry
        )
        self.read = Counter("flexmarl_stored_read_experiences_total", "Experiences read.", registry=registry)
        self.read_bytes = Counter(
            "flexmarl_stored_read_bytes_total", "Payload bytes of experiences read.", registry=registry
        )
        self.blob_bytes_in = Counter(
            "flexmarl_stored_blob_in_bytes_total", "Blob bytes received by uploads.", registry=registry
        )
        self.blob_bytes_out = Counter(
            "flexmarl_stored_blob_out_bytes_total", "Blob bytes sent by downloads.", registry=registry
        )
        self.gc_runs = Counter("flexmarl_stored_gc_runs_total", "Garbage collections run.", registry=registry)
        self.gc_rows = Counter(
            "flexmarl_stored_gc_deleted_rows_total", "Experiences deleted by garbage collection.", registry=registry
        )
        self.gc_bytes = Counter(
            "flexmarl_stored_gc_deleted_bytes_total", "Payload bytes deleted by garbage collection.",
            registry=registry,
        )
        self._registry = registry

    def watch_contents(self, experiences: ExperienceStore, blobs: BlobStore) -> None:
        """Exports the stores' contents (rows and bytes per partition, blob totals)."""
        self._registry.register(_StoreContentsCollector(experiences, blobs))
