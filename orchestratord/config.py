"""orchestratord settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig(DaemonConfig):
    """Settings of orchestratord (flags, FLEXMARL_* env, or a config file)."""

    store_address: str = dataclasses.field(
        default="", metadata={"help": "stored host:port (default: discovered in etcd)"}
    )
    swap_location: str = dataclasses.field(
        default="stored", metadata={"help": "where slots save states that must move: mem, file or stored"}
    )
    lease_poll_max_ms: int = dataclasses.field(
        default=5000, metadata={"help": "longest long-poll a worker may ask for"}
    )

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 0 < self.lease_poll_max_ms <= 60_000:
            raise ConfigError(f"lease_poll_max_ms: must be in 1..60000, got {self.lease_poll_max_ms}")
        if self.swap_location not in ("mem", "file", "stored"):
            raise ConfigError(f"swap_location: must be mem, file or stored, got {self.swap_location!r}")
