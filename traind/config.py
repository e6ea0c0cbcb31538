"""traind settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig


@dataclasses.dataclass(frozen=True)
class TrainerConfig(DaemonConfig):
    """Settings of traind (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata={"help": "orchestratord host:port (default: discovered in etcd)"}
    )
    store_address: str = dataclasses.field(
        default="", metadata={"help": "stored host:port (default: discovered in etcd)"}
    )
    slots: int = dataclasses.field(default=1, metadata={"help": "training slots (one GPU each, or CPU slots)"})
    work_dir: str = dataclasses.field(default="traind-work", metadata={"help": "local state and checkpoints"})

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 1 <= self.slots <= 1024:
            raise ConfigError(f"slots: must be in 1..1024, got {self.slots}")
