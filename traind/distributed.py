"""Process-group setup for traind: one call before building engines.

DeepSpeed chooses the backend from the accelerator (gloo or ccl on CPU, NCCL
on CUDA); nothing here names a backend. A single process with no launcher
environment gets a world of one on a free loopback port.

Devices: DeepSpeed takes a process's device from ``LOCAL_RANK`` (``DeepSpeedEngine``
reads it when built and calls ``get_accelerator().set_device``; ``init_distributed``
binds an NCCL group of several ranks to ``cuda:LOCAL_RANK``). A slot's work therefore runs
under :func:`on_device`, which sets both for the slot's device: CUDA's current device is
per thread, and the worker's calls run on pool threads.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Callable
from typing import TypeVar

import deepspeed
import deepspeed.comm as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")


def cuda_device_count() -> int:
    """CUDA devices this process trains on: 0 unless DeepSpeed's accelerator is CUDA."""
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        return 0
    return int(torch.cuda.device_count())


def on_device(local_rank: int | None, fn: Callable[..., T], *args: object) -> T:
    """Runs ``fn(*args)`` with ``LOCAL_RANK`` and this thread's CUDA device set to ``local_rank``.

    ``None`` (training on CPU, or no device assigned) changes nothing.
    """
    if local_rank is not None:
        os.environ["LOCAL_RANK"] = str(local_rank)
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
    return fn(*args)


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_distributed(rank: int | None = None, world_size: int | None = None) -> None:
    """Initialises DeepSpeed's process group once per process.

    With ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment
    (torchrun, or a parent that set them) those are used; otherwise this process
    becomes a world of one on a free loopback port.

    Args:
        rank: overrides ``RANK`` when given.
        world_size: overrides ``WORLD_SIZE`` when given.
    """
    if dist.is_initialized():
        # DeepSpeed asserts LOCAL_RANK on every engine it builds, not only at the first rendezvous, and
        # something may have removed it since the group was made (a test's monkeypatch did, in CI).
        os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
        return
    if rank is not None:
        os.environ["RANK"] = str(rank)
    if world_size is not None:
        os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_loopback_port())
    logger.info(
        "initialising process group rank=%s world=%s at %s:%s",
        os.environ["RANK"],
        os.environ["WORLD_SIZE"],
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False)


def shutdown_distributed() -> None:
    """Destroys the process group so that the process can initialise a new one (DESIGN §5)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def reserve_port(host: str) -> int:
    """A TCP port on ``host`` that was free a moment ago, for this process's data-parallel rendezvous.

    The port is not held open: the TCP store of a group this process leads binds it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def join_group(rank: int, world_size: int, master_address: str, timeout_s: float, local_rank: int = 0) -> None:
    """Leaves the current process group and joins (or, as rank 0, hosts) a new one.

    ``master_address`` is rank 0's ``host:port``. Every collective of the new group,
    and the rendezvous itself, fails after ``timeout_s`` instead of hanging when a
    member is gone. ``local_rank`` is the index of the process's (one) training device:
    DeepSpeed binds the NCCL group to it.
    """
    host, _, port = master_address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"master_address must be host:port, got {master_address!r}")
    shutdown_distributed()
    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank), "MASTER_ADDR": host,
         "MASTER_PORT": port}
    )
    logger.info("joining process group rank=%d world=%d at %s", rank, world_size, master_address)
    deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False, timeout=datetime.timedelta(seconds=timeout_s))


def become_standalone(local_rank: int = 0) -> None:
    """Leaves the current process group and makes this process a world of one again (on device ``local_rank``)."""
    shutdown_distributed()
    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_loopback_port()),
        }
    )
    ensure_distributed()
