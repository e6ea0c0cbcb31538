"""Custom torch process groups for weight updates: the trainer (rank 0) and the engines meet in one.

SGLang joins a trainer's weight-update group with ``init_custom_process_group``
(sglang/srt/utils/common.py): a TCP rendezvous at ``master_address:master_port`` whose store is
prefixed with the group's name, then a process group built with torch's own helper (so the
ranks are the group's ranks and no default process group is needed). The embedded engine joins
through :func:`join_group` (the same steps, so its peers cannot tell it from SGLang), and
traind's rank 0 hosts the rendezvous with :func:`host_store` and builds its end with
:func:`create_group`. ``gloo`` on CPU, ``nccl`` on CUDA: the same code.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

#: What SGLang gives the group when the caller sets no timeout (torch's default_pg_timeout).
DEFAULT_TIMEOUT_S = c10d.default_pg_timeout.total_seconds()


def host_store(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
    """Rank 0's rendezvous store, listening on ``host:port`` (0: the OS picks; read ``.port``).

    The store torch's ``tcp://`` rendezvous handler would make for rank 0, so engines that join
    with ``init_method="tcp://host:port"`` (SGLang) find their keys where they look.
    """
    return TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )


def create_group(
    store: Any,
    *,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """Build this rank's end of the group over ``store`` (blocks until every rank joined, or times out).

    Mirrors the second half of SGLang's ``init_custom_process_group``: the store prefixed with
    ``group_name``, torch's ``_new_process_group_helper``, and the rank map that lets
    ``torch.distributed.broadcast(..., group=pg)`` address ranks of this group.

    Raises:
        RuntimeError, ValueError, torch.distributed.DistError: The group could not be formed.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), prefixed, group_name=c10d.GroupName(group_name), timeout=timeout
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def join_group(
    *,
    master_address: str,
    master_port: int,
    backend: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Join the group hosted at ``master_address:master_port`` as ``rank`` (SGLang's engine side).

    Raises:
        RuntimeError, ValueError, torch.distributed.DistError: The rendezvous or the group failed.
    """
    host = f"[{master_address}]" if ":" in master_address else master_address
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    return create_group(
        store, backend=backend, world_size=world_size, rank=rank, group_name=group_name, timeout_s=timeout_s
    )


def destroy_group(pg: Any) -> None:
    """Tear the group down (its connections close, so peers blocked in it fail at once)."""
    dist.destroy_process_group(pg)


__all__ = ["DEFAULT_TIMEOUT_S", "create_group", "destroy_group", "host_store", "join_group"]
