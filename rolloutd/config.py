"""rolloutd settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig


@dataclasses.dataclass(frozen=True)
class RolloutConfig(DaemonConfig):
    """Settings of rolloutd (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata={"help": "orchestratord host:port (default: discovered in etcd)"}
    )
    store_address: str = dataclasses.field(
        default="", metadata={"help": "stored host:port (default: discovered in etcd)"}
    )
    max_tasks: int = dataclasses.field(default=4, metadata={"help": "rollout tasks run concurrently"})

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 1 <= self.max_tasks <= 4096:
            raise ConfigError(f"max_tasks: must be in 1..4096, got {self.max_tasks}")
