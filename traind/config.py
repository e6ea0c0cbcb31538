"""traind settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class TrainerConfig(DaemonConfig):
    """Settings of traind (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata=_help("orchestratord host:port (default: discovered in etcd)"))
    store_address: str = dataclasses.field(default="", metadata=_help("stored host:port (default: discovered)"))
    slots: int = dataclasses.field(default=1, metadata=_help("training slots (one GPU each, or CPU slots)"))
    work_dir: str = dataclasses.field(default="traind-work", metadata=_help("published weights and states"))
    state_location: str = dataclasses.field(
        default="file", metadata=_help("where committed states go: file (work dir), stored or mem"))
    publish_location: str = dataclasses.field(
        default="file", metadata=_help("where weights are published: file (shared path) or stored"))
    dp_host: str = dataclasses.field(
        default="127.0.0.1", metadata=_help(
            "address other traind processes reach this one at for data-parallel rendezvous "
            "(\"\" = never join a group; only a process with one slot and durable states joins)"))

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 1 <= self.slots <= 1024:
            raise ConfigError(f"slots: must be in 1..1024, got {self.slots}")
        if self.state_location not in ("file", "stored", "mem"):
            raise ConfigError(f"state_location: must be file, stored or mem, got {self.state_location!r}")
        if self.publish_location not in ("file", "stored"):
            raise ConfigError(f"publish_location: must be file or stored, got {self.publish_location!r}")
