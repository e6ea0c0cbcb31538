"""traind settings."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from flexmarl import devicemodel
from flexmarl.config import ConfigError, DaemonConfig
from flexmarl.devices import NO_DEVICES, device_pool, local_index, parse_device_list, split_device_sets
from flexmarl.errors import InvalidArgument


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class TrainerConfig(DaemonConfig):
    """Settings of traind (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata=_help("orchestratord host:port (default: discovered in etcd)"))
    store_address: str = dataclasses.field(default="", metadata=_help("stored host:port (default: discovered)"))
    slots: int = dataclasses.field(default=1, metadata=_help("training slots (one GPU each, or CPU slots)"))
    gpus: str = dataclasses.field(
        default="", metadata=_help("devices of the slots, one each, in slot order (default: CUDA_VISIBLE_DEVICES, "
                                   "else every GPU; none: assign none); ignored on CPU"))
    work_dir: str = dataclasses.field(default="traind-work", metadata=_help("published weights and states"))
    state_location: str = dataclasses.field(
        default="file", metadata=_help("where committed states go: file (work dir), stored or mem"))
    publish_location: str = dataclasses.field(
        default="file", metadata=_help("where weights are published: file (shared path) or stored"))
    dp_host: str = dataclasses.field(
        default="127.0.0.1", metadata=_help(
            "address other traind processes reach this one at for data-parallel rendezvous "
            "(\"\" = never join a group; only a process with one slot and durable states joins)"))
    modelled_device: str = dataclasses.field(
        default="", metadata=_help("device profile file (flexmarl.devicemodel; benchmarks): training takes the "
                                   "time its accelerator would take; \"\" = real time only"))

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 1 <= self.slots <= 1024:
            raise ConfigError(f"slots: must be in 1..1024, got {self.slots}")
        if self.state_location not in ("file", "stored", "mem"):
            raise ConfigError(f"state_location: must be file, stored or mem, got {self.state_location!r}")
        if self.publish_location not in ("file", "stored"):
            raise ConfigError(f"publish_location: must be file or stored, got {self.publish_location!r}")
        if self.gpus.strip().lower() != NO_DEVICES:
            parse_device_list(self.gpus)
        self.slot_local_ranks()
        self.device_profile()

    def device_profile(self) -> devicemodel.DeviceProfile | None:
        """The profile ``modelled_device`` names, or None (real time only).

        Raises:
            ConfigError: the file cannot be read or is not a device profile.
        """
        if not self.modelled_device:
            return None
        try:
            return devicemodel.load_profile(self.modelled_device)
        except InvalidArgument as error:
            raise ConfigError(f"modelled_device: {error}") from None

    def slot_local_ranks(
        self, env: Mapping[str, str] | None = None, cuda_device_count: Callable[[], int] | None = None,
    ) -> tuple[int, ...] | None:
        """Each slot's device, as its index in this process's CUDA numbering (its ``LOCAL_RANK``).

        Slot ``i`` gets device ``i`` of the pool (``gpus``, else ``CUDA_VISIBLE_DEVICES``, else
        every device; :mod:`flexmarl.devices`). None when training runs on CPU (no CUDA device,
        or DeepSpeed's accelerator is not CUDA) or with ``gpus=none``: nothing is assigned.

        Raises:
            ConfigError: fewer devices than slots, a device this process cannot see, or
                ``gpus`` given where no CUDA device is visible.
        """
        env = os.environ if env is None else env
        if cuda_device_count is None:
            from traind.distributed import cuda_device_count as count_devices

            cuda_device_count = count_devices
        count = cuda_device_count()
        if count == 0:
            if self.gpus.strip() and self.gpus.strip().lower() != NO_DEVICES:
                raise ConfigError(f"gpus: {self.gpus!r} given, but this process sees no CUDA device "
                                  f"(DS_ACCELERATOR={env.get('DS_ACCELERATOR', '')!r})")
            return None
        pool = device_pool(self.gpus, env, lambda: count)
        if not pool:
            return None
        ranks = tuple(local_index(s.ids[0], env) for s in split_device_sets(pool, self.slots, 1, "gpus"))
        beyond = [r for r in ranks if r >= count]
        if beyond:
            raise ConfigError(f"gpus: device index {beyond[0]} is beyond the {count} CUDA devices this process sees")
        return ranks
