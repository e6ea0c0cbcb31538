"""Configuration of stored: data directory, explicit size limits, quotas and GC."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig
from stored.blobs import BlobLimits
from stored.database import SYNCHRONOUS_MODES, JobQuotas
from stored.experiences import ExperienceLimits

# Room for a message's fields around its payload.
_MESSAGE_OVERHEAD_BYTES = 64 << 10


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class StoredConfig(DaemonConfig):
    """Settings of the stored daemon (on top of those every daemon shares)."""

    data_dir: str = dataclasses.field(default="stored-data", metadata=_help("where the database and blobs live"))
    sqlite_synchronous: str = dataclasses.field(
        default="FULL", metadata=_help("SQLite synchronous mode under WAL: FULL (fsync per commit), NORMAL, EXTRA")
    )
    io_threads: int = dataclasses.field(default=8, metadata=_help("threads for SQLite and file I/O"))
    max_record_bytes: int = dataclasses.field(
        default=16 << 20, metadata=_help("largest packed payload (prompt+response+logprobs) of one experience")
    )
    max_append_records: int = dataclasses.field(default=16384, metadata=_help("experiences per append request"))
    max_read_ids: int = dataclasses.field(default=65536, metadata=_help("ids per read or mark request"))
    max_query_results: int = dataclasses.field(default=100_000, metadata=_help("refs one query returns at most"))
    read_batch_bytes: int = dataclasses.field(
        default=4 << 20, metadata=_help("payload bytes per streamed read message")
    )
    max_blob_bytes: int = dataclasses.field(default=64 << 30, metadata=_help("largest blob"))
    max_blob_chunk_bytes: int = dataclasses.field(
        default=4 << 20, metadata=_help("largest chunk of a blob upload (one message)")
    )
    blob_chunk_bytes: int = dataclasses.field(
        default=1 << 20, metadata=_help("verified segment size of stored blobs and download chunks")
    )
    job_quota_bytes: int = dataclasses.field(
        default=0, metadata=_help("bytes (experiences + named blobs) one job may hold; 0 = unlimited")
    )
    job_quota_overrides: str = dataclasses.field(
        default="", metadata=_help("per-job quotas, 'job-a=1000000,job-b=0' (0 = unlimited)")
    )
    gc_interval_s: float = dataclasses.field(
        default=60.0, metadata=_help("seconds between background GC runs; 0 disables them")
    )
    gc_retention_s: float = dataclasses.field(
        default=3600.0, metadata=_help("background GC deletes experiences consumed longer ago than this")
    )

    def validate(self) -> None:
        """Raises ConfigError when a limit is out of range or does not fit a gRPC message."""
        super().validate()
        if not self.data_dir:
            raise ConfigError("data_dir: must not be empty")
        if self.sqlite_synchronous.upper() not in SYNCHRONOUS_MODES:
            raise ConfigError(
                f"sqlite_synchronous: one of {', '.join(SYNCHRONOUS_MODES)}, got {self.sqlite_synchronous!r}"
            )
        for name in ("io_threads", "max_record_bytes", "max_append_records", "max_read_ids", "max_query_results",
                     "read_batch_bytes", "max_blob_bytes", "max_blob_chunk_bytes", "blob_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        room = self.max_message_bytes - _MESSAGE_OVERHEAD_BYTES
        for name in ("max_record_bytes", "read_batch_bytes", "max_blob_chunk_bytes", "blob_chunk_bytes"):
            if getattr(self, name) > room:
                raise ConfigError(
                    f"{name}: {getattr(self, name)} does not fit max_message_bytes {self.max_message_bytes} "
                    f"(minus {_MESSAGE_OVERHEAD_BYTES} bytes of overhead)"
                )
        if self.job_quota_bytes < 0:
            raise ConfigError(f"job_quota_bytes: must be >= 0, got {self.job_quota_bytes}")
        try:
            JobQuotas.parse_overrides(self.job_quota_overrides)
        except ValueError as exc:
            raise ConfigError(f"job_quota_overrides: {exc}") from None
        if self.gc_interval_s < 0 or self.gc_retention_s < 0:
            raise ConfigError("gc_interval_s and gc_retention_s must be >= 0")

    def experience_limits(self) -> ExperienceLimits:
        """The experience store's limits."""
        return ExperienceLimits(
            max_record_bytes=self.max_record_bytes,
            max_append_records=self.max_append_records,
            max_read_ids=self.max_read_ids,
            max_query_results=self.max_query_results,
            read_batch_bytes=self.read_batch_bytes,
        )

    def blob_limits(self) -> BlobLimits:
        """The blob store's limits."""
        return BlobLimits(
            max_blob_bytes=self.max_blob_bytes,
            max_put_chunk_bytes=self.max_blob_chunk_bytes,
            chunk_bytes=self.blob_chunk_bytes,
        )

    def quotas(self) -> JobQuotas:
        """Per-job byte quotas."""
        return JobQuotas(
            default_bytes=self.job_quota_bytes,
            overrides_bytes=JobQuotas.parse_overrides(self.job_quota_overrides),
        )
