"""orchestratord settings."""

from __future__ import annotations

import dataclasses

from flexmarl.config import ConfigError, DaemonConfig
from orchestratord.planner import PlannerOptions


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig(DaemonConfig):
    """Settings of orchestratord (flags, FLEXMARL_* env, or a config file)."""

    store_address: str = dataclasses.field(
        default="", metadata={"help": "stored host:port (default: discovered in etcd)"}
    )
    swap_location: str = dataclasses.field(
        default=PlannerOptions.swap_location,
        metadata={"help": "where slots save states that must move: mem, file or stored"},
    )
    lease_poll_max_ms: int = dataclasses.field(
        default=5000, metadata={"help": "longest long-poll a worker may ask for"}
    )
    history_page_steps: int = dataclasses.field(
        default=500, metadata={"help": "steps per page of per-step history moved from etcd to stored once "
                                       "every agent is a page past it (a job's first archive fixes it)"}
    )
    capacity_aware_binding: bool = dataclasses.field(
        default=PlannerOptions.capacity_aware_binding,
        metadata={"help": "place agents that train more on trainer slots of more capacity (the slots' "
                          "reported capacity; off: every slot alike, the ablation)"},
    )
    binding_version_lead: int = dataclasses.field(
        default=PlannerOptions.binding_version_lead,
        metadata={"help": "at its step boundary a trainer slot's agent gives the slot up to a waiting agent "
                          "of its job this many versions behind it (0: only when it runs out of work or "
                          "the other starves)"}
    )
    binding_max_wait_s: float = dataclasses.field(
        default=PlannerOptions.max_wait_s,
        metadata={"help": "an agent that has waited this many seconds for a trainer slot is starving: it "
                          "takes a bound agent's slot at that agent's step boundary"}
    )
    binding_aging_per_s: float = dataclasses.field(
        default=PlannerOptions.aging_per_s,
        metadata={"help": "a waiting agent's binding priority grows by this much (in ready micro-batches)"
                          " per second it waits"}
    )
    etcd_defrag_check_s: float = dataclasses.field(
        default=300.0, metadata={"help": "how often to check etcd's db for space to defragment (0: never)"}
    )
    etcd_defrag_min_free_mib: float = dataclasses.field(
        default=64.0, metadata={"help": "defragment a member when at least this much of its db file is free "
                                        "and it is at least half the file"}
    )
    etcd_defrag_min_interval_s: float = dataclasses.field(
        default=3600.0, metadata={"help": "at most one defragmentation of a member in this long"}
    )

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 0 < self.lease_poll_max_ms <= 60_000:
            raise ConfigError(f"lease_poll_max_ms: must be in 1..60000, got {self.lease_poll_max_ms}")
        if not 1 <= self.history_page_steps <= 100_000:
            raise ConfigError(f"history_page_steps: must be in 1..100000, got {self.history_page_steps}")
        if not 0 <= self.binding_version_lead <= 1_000_000:
            raise ConfigError(f"binding_version_lead: must be in 0..1000000, got {self.binding_version_lead}")
        if not 0 < self.binding_max_wait_s <= 86_400:
            raise ConfigError(f"binding_max_wait_s: must be in (0, 86400], got {self.binding_max_wait_s}")
        if not 0 <= self.binding_aging_per_s <= 1e6:
            raise ConfigError(f"binding_aging_per_s: must be in 0..1e6, got {self.binding_aging_per_s}")
        for name in ("etcd_defrag_check_s", "etcd_defrag_min_free_mib", "etcd_defrag_min_interval_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.swap_location not in ("mem", "file", "stored"):
            raise ConfigError(f"swap_location: must be mem, file or stored, got {self.swap_location!r}")
