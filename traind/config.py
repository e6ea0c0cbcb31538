"""traind settings."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping

from flexmarl import devicemodel
from flexmarl.config import ConfigError, DaemonConfig
from flexmarl.devices import (
    NO_DEVICES,
    device_pool,
    local_index,
    parse_device_list,
    slot_capacity_problem,
    split_device_sets,
)
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
    slot_capacity: str = dataclasses.field(
        default="", metadata=_help(
            "training capacity of each slot relative to one device of the reference kind (the devices it trains "
            "on, or a faster device's speed-up), for orchestratord's placement: one number for every slot or one "
            "per slot, comma-separated (default: the modelled profile's train_devices_per_slot, else 1; with a "
            "modelled device each slot's training takes the time of its capacity in devices, whole numbers)"))
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
        self.slot_capacities()

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

    def slot_capacities(self) -> tuple[float, ...]:
        """Each slot's training capacity (``slot_capacity``; default the modelled devices per slot, else 1).

        Raises:
            ConfigError: not numbers, neither one nor ``slots`` of them, one out of range, or (with a
                modelled device) not a whole number of devices.
        """
        profile = self.device_profile()
        text = self.slot_capacity.strip()
        if not text:
            return (float(profile.train_devices_per_slot) if profile is not None else 1.0,) * self.slots
        try:
            values = tuple(float(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(f"slot_capacity: expected numbers separated by commas, got {self.slot_capacity!r}") \
                from None
        if len(values) not in (1, self.slots):
            raise ConfigError(f"slot_capacity: {len(values)} values for {self.slots} slots (give one or {self.slots})")
        for value in values:
            problem = slot_capacity_problem(value)
            if problem is not None:
                raise ConfigError(f"slot_capacity: {problem}")
            if profile is not None and not value.is_integer():
                raise ConfigError(f"slot_capacity: a modelled slot trains on whole devices, got {value!r}")
        return values * self.slots if len(values) == 1 else values

    def slot_profiles(self) -> tuple[devicemodel.DeviceProfile, ...] | None:
        """Each slot's modelled device (the profile at the slot's capacity in devices), or None (real time)."""
        profile = self.device_profile()
        if profile is None:
            return None
        return tuple(profile.with_changes(train_devices_per_slot=int(c)) for c in self.slot_capacities())

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
