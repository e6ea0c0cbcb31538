"""rolloutd settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class RolloutConfig(DaemonConfig):
    """Settings of rolloutd (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata=_help("orchestratord host:port (default: discovered in etcd)"))
    store_address: str = dataclasses.field(default="", metadata=_help("stored host:port (default: discovered)"))
    max_tasks: int = dataclasses.field(default=8, metadata=_help("rollout tasks run concurrently"))
    work_dir: str = dataclasses.field(default="rolloutd-work", metadata=_help("engine logs and weight cache"))
    engine_backend: str = dataclasses.field(
        default="embedded", metadata=_help("replicas to launch: embedded (CPU) or sglang (GPU hosts)"))
    engine_replicas: int = dataclasses.field(default=2, metadata=_help("replicas to launch"))
    engine_urls: str = dataclasses.field(
        default="", metadata=_help("comma-separated http://host:port of running replicas (no launch)"))
    engine_threads: int = dataclasses.field(default=1, metadata=_help("torch threads per embedded replica"))

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 1 <= self.max_tasks <= 4096:
            raise ConfigError(f"max_tasks: must be in 1..4096, got {self.max_tasks}")
        if self.engine_backend not in ("embedded", "sglang"):
            raise ConfigError(f"engine_backend: must be embedded or sglang, got {self.engine_backend!r}")
        if not 1 <= self.engine_replicas <= 1024:
            raise ConfigError(f"engine_replicas: must be in 1..1024, got {self.engine_replicas}")
        if not 1 <= self.engine_threads <= 256:
            raise ConfigError(f"engine_threads: must be in 1..256, got {self.engine_threads}")
        for url in filter(None, (u.strip() for u in self.engine_urls.split(","))):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine_urls: {url!r} is not http(s)://host:port")
