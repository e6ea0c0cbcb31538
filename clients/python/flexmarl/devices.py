"""Device sets: which accelerators each engine replica (rolloutd) and each training slot (traind) gets.

A device is named as ``CUDA_VISIBLE_DEVICES`` names it: an index or a ``GPU-``/``MIG-`` UUID.
A daemon's pool is, in order: its ``gpus`` setting, else its own ``CUDA_VISIBLE_DEVICES``,
else every device of the host (rolloutd counts them with ``nvidia-smi`` without starting CUDA;
traind with torch). ``gpus=none`` turns assignment off: children inherit the daemon's view.
The pool is cut into consecutive, disjoint sets; asking for more devices than the pool holds
is a :class:`~flexmarl.config.ConfigError`, never a silent share of device 0.

A child process (an engine replica) gets ``CUDA_VISIBLE_DEVICES`` = its set, so it numbers
its devices from 0. A training slot runs inside traind's process, whose device numbering is
fixed once CUDA starts, so the slot gets the *local index* of its device in that numbering
(the position in the process's ``CUDA_VISIBLE_DEVICES``) as ``LOCAL_RANK``.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from flexmarl.config import ConfigError

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: ``gpus`` value that disables device assignment.
NO_DEVICES = "none"
#: The largest training capacity a slot may report (traind's ``slot_capacity``, ``PollTrainerWork.capacity``).
MAX_SLOT_CAPACITY = 1024.0


def slot_capacity_problem(capacity: float) -> str | None:
    """Why ``capacity`` is no slot capacity (finite, > 0, at most :data:`MAX_SLOT_CAPACITY`), or None."""
    if not 0.0 < capacity <= MAX_SLOT_CAPACITY:  # NaN fails too
        return f"must be > 0 and <= {MAX_SLOT_CAPACITY:g}, got {capacity!r}"
    return None


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """The devices of one replica or slot, named as ``CUDA_VISIBLE_DEVICES`` names them."""

    ids: tuple[str, ...]

    def __str__(self) -> str:
        return ",".join(self.ids)

    @property
    def cuda_visible_devices(self) -> str:
        """The value of ``CUDA_VISIBLE_DEVICES`` that shows a child exactly this set."""
        return str(self)


def parse_device_list(text: str, what: str = "gpus") -> tuple[str, ...]:
    """Parses ``"0,1,GPU-..."`` into device ids; raises ConfigError on an empty entry or a duplicate."""
    if not text.strip():
        return ()
    ids = tuple(item.strip() for item in text.split(","))
    for item in ids:
        if not item or any(ch.isspace() for ch in item):
            raise ConfigError(f"{what}: {text!r} is not a comma-separated list of device ids")
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"{what}: device {duplicates[0]} is listed twice in {text!r}")
    return ids


def visible_devices(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The process's ``CUDA_VISIBLE_DEVICES`` as ids, or None when unset (every device visible)."""
    if CUDA_VISIBLE_DEVICES not in env:
        return None
    text = env[CUDA_VISIBLE_DEVICES].strip()
    if text in ("", "-1"):  # CUDA's own spellings of "no device"
        return ()
    return parse_device_list(text, CUDA_VISIBLE_DEVICES)


def nvidia_smi_device_count() -> int:
    """Devices ``nvidia-smi -L`` lists (0 without the tool); starts no CUDA context in this process."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return 0
    try:
        listing = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def device_pool(configured: str, env: Mapping[str, str], host_device_count: Callable[[], int]) -> tuple[str, ...]:
    """The devices a daemon hands out (see the module doc); () means "assign none".

    Args:
        configured: the daemon's ``gpus`` setting ("" = not set, ``none`` = assign none).
        env: the daemon's environment.
        host_device_count: counts the host's devices; called only when neither of the others names any.

    Raises:
        ConfigError: ``configured`` is malformed or names a device outside the daemon's
            own ``CUDA_VISIBLE_DEVICES``.
    """
    if configured.strip().lower() == NO_DEVICES:
        return ()
    visible = visible_devices(env)
    ids = parse_device_list(configured)
    if ids:
        if visible is not None:
            outside = [i for i in ids if i not in visible]
            if outside:
                raise ConfigError(f"gpus: device {outside[0]} is not in this daemon's "
                                  f"{CUDA_VISIBLE_DEVICES}={env[CUDA_VISIBLE_DEVICES]!r}")
        return ids
    if visible is not None:
        return visible
    return tuple(str(i) for i in range(host_device_count()))


def split_device_sets(pool: Sequence[str], count: int, per_set: int, what: str) -> list[DeviceSet]:
    """``count`` disjoint consecutive sets of ``per_set`` devices from ``pool``.

    Raises:
        ConfigError: the pool holds fewer than ``count * per_set`` devices.
    """
    needed = count * per_set
    if needed > len(pool):
        raise ConfigError(f"{what}: {count} x {per_set} device(s) needed, but only {len(pool)} available "
                          f"({','.join(pool) or 'none'}); set gpus (or {CUDA_VISIBLE_DEVICES}), "
                          f"or fewer replicas/slots, or gpus=none to assign no devices")
    return [DeviceSet(tuple(pool[i * per_set:(i + 1) * per_set])) for i in range(count)]


def local_index(device_id: str, env: Mapping[str, str]) -> int:
    """Index of a device in this process's CUDA numbering (what ``LOCAL_RANK``/``cuda:N`` mean here).

    Raises:
        ConfigError: the device is not visible to this process, or is named by UUID while
            ``CUDA_VISIBLE_DEVICES`` is unset (the UUID's index is unknown without CUDA).
    """
    visible = visible_devices(env)
    if visible is not None:
        if device_id not in visible:
            raise ConfigError(f"gpus: device {device_id} is not in "
                              f"{CUDA_VISIBLE_DEVICES}={env[CUDA_VISIBLE_DEVICES]!r}")
        return visible.index(device_id)
    if not device_id.isdigit():
        raise ConfigError(f"gpus: device {device_id!r} must be an index when {CUDA_VISIBLE_DEVICES} is unset")
    return int(device_id)
