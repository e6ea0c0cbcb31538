"""An engine's side of SGLang's weight-update groups: join, receive by broadcast, load, leave.

Mirrors SGLang 0.5.23, never kinder:

* sglang/srt/model_executor/model_runner_components/weight_updater.py ``WeightUpdater``:
  ``init_weights_update_group`` joins the trainer's group as rank ``rank_offset + tp_rank``
  (tp_rank 0 here: one rank per replica) through ``init_custom_process_group`` (mirrored by
  :func:`flexmarl.collective.join_group`, torch's default timeout); a second group of a name
  already in use fails, as torch refuses the name. ``receive_weights_from_distributed``
  allocates each named tensor with its dtype (``getattr(torch, dtype)``) and shape on the
  model's device and receives it by broadcast from rank 0 (``load_format="flattened_bucket"``:
  one uint8 buffer holding them all back to back, sglang/srt/weight_sync/tensor_bucket.py);
  ``load_weights_from_distributed`` loads them into the model at once (a failure leaves the
  model partially updated, and says so); ``destroy_weights_update_group``.
* The received tensors live in a buffer the replica keeps between calls
  (:class:`ReceiveBuffer`), never in the served parameters: what SGLang's ``torch.empty`` gets
  on a GPU from PyTorch's caching allocator, which hands the freed block of the previous call
  back. On the CPU every ``torch.empty`` of a bucket maps fresh pages and faults each one in
  while the broadcast fills it (measured: a third of the bare broadcast's time); the buffer is
  not the weights, so a failed receive still leaves the served weights whole.
* sglang/srt/managers/scheduler_components/weight_updater.py: an update runs only inside a
  ``begin_weight_update`` / ``end_weight_update`` session; its answers and messages.

The names, dtypes and shapes are zipped as SGLang zips them (the shortest list wins), so a
caller that sends lists of different lengths gets what SGLang would do with them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flexmarl import collective
from rolloutd.engines.embedded.interface import DistributedUpdate
from rolloutd.engines.weight_messages import (
    DESTROY_MISSING,
    DESTROY_OK,
    INIT_OK,
    NO_SESSION,
    SESSION_MISSING,
    SESSION_OPEN,
    UPDATE_OK,
)

logger = logging.getLogger(__name__)

#: Byte alignment of each tensor of a per-tensor receive inside the receive buffer.
_ALIGN_BYTES = 64


class ReceiveBuffer:
    """The bytes the tensors of one update are received into, kept for the next update (module doc).

    It grows to the largest update received and is dropped when the replica leaves its last group
    or a receive fails (a receive still in flight may write into it later; the next one gets new memory).
    """

    def __init__(self) -> None:
        self._bytes: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0: none)."""
        return 0 if self._bytes is None else int(self._bytes.numel())

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (at least one byte held), valid until the next call."""
        held = self._bytes
        if held is None or held.numel() < nbytes or held.device != device:
            self._bytes = None  # freed before its successor is allocated
            held = self._bytes = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
        return held[:nbytes]

    def drop(self) -> None:
        """Release the bytes."""
        self._bytes = None


@dataclasses.dataclass(frozen=True)
class UpdateOutcome:
    """What an update did: SGLang's ``(success, message)``, and whether any weight changed."""

    success: bool
    message: str
    weights_changed: bool


def _torch_dtype(name: str) -> torch.dtype:
    """``getattr(torch, dtype)``, as SGLang resolves a dtype string (an unknown name raises)."""
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch.{name} is not a dtype")
    return dtype


def load_named_tensors(model: torch.nn.Module, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy each tensor into the model's parameter of that name (cast to its dtype), in order.

    Names are the Hugging Face state-dict names; a tied ``lm_head.weight`` is the embedding.

    Raises:
        KeyError: A name the model does not have.
        ValueError: A shape that differs from the parameter's.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in named:
            if name not in params:
                raise KeyError(f"no parameter named {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
            param.data.copy_(tensor)


def receive_layout(
    update: DistributedUpdate,
) -> tuple[list[tuple[str, torch.dtype, torch.Size, int]], int, Exception | None]:
    """Where each tensor of a per-tensor receive lies in the receive buffer, and the bytes it needs.

    Returns ``(name, dtype, shape, byte offset)`` per tensor (each at a multiple of 64 bytes), the
    total, and what ``torch.empty`` refused (an unknown dtype, a negative dimension) with the
    tensors before it, the ones SGLang's loop had posted a broadcast for when it raised.
    """
    layout: list[tuple[str, torch.dtype, torch.Size, int]] = []
    nbytes = 0
    for name, dtype_name, shape in zip(update.names, update.dtypes, update.shapes, strict=False):
        try:  # torch.empty's checks, without its memory
            meta = torch.empty(shape, dtype=_torch_dtype(dtype_name), device="meta")
        except Exception as exc:
            return layout, nbytes, exc
        layout.append((name, meta.dtype, meta.shape, nbytes))
        nbytes += -(-meta.numel() * meta.element_size() // _ALIGN_BYTES) * _ALIGN_BYTES
    return layout, nbytes, None


class WeightUpdateGroups:
    """The groups a replica joined and its update session (used by the scheduler thread only)."""

    def __init__(self, tp_rank: int = 0) -> None:
        self.tp_rank = tp_rank
        self._groups: dict[str, Any] = {}
        self._session_open = False
        self._session_loaded = False
        self.receive_buffer = ReceiveBuffer()

    @property
    def group_names(self) -> list[str]:
        """Names of the groups joined."""
        return list(self._groups)

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = collective.DEFAULT_TIMEOUT_S,
    ) -> tuple[bool, str]:
        """Join ``group_name`` as rank ``rank_offset + tp_rank`` (blocks until all ranks joined)."""
        if not group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        rank = rank_offset + self.tp_rank
        logger.info(
            "init custom process group: master_address=%s, master_port=%d, rank_offset=%d, rank=%d, "
            "world_size=%d, group_name=%s, backend=%s",
            master_address, master_port, rank_offset, rank, world_size, group_name, backend,
        )
        try:
            self._groups[group_name] = collective.join_group(
                master_address=master_address,
                master_port=master_port,
                backend=backend,
                world_size=world_size,
                rank=rank,
                group_name=group_name,
                timeout_s=timeout_s,
            )
        except Exception as exc:  # torch raises many types here; SGLang reports them all
            message = f"Failed to initialize custom process group: {exc}."
            logger.error(message)
            return False, message
        return True, INIT_OK

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        """Leave ``group_name``."""
        if group_name not in self._groups:
            return False, DESTROY_MISSING
        try:
            collective.destroy_group(self._groups.pop(group_name))
        except Exception as exc:
            message = f"Failed to destroy custom process group: {exc}."
            logger.error(message)
            return False, message
        finally:
            if not self._groups:
                self.receive_buffer.drop()
        return True, DESTROY_OK

    def close(self) -> None:
        """Leave every group (the engine is stopping)."""
        for name in list(self._groups):
            self.destroy_group(name)

    def begin(self, selector: str) -> tuple[bool, str]:
        """Open the update session (``begin_weight_update``)."""
        if self._session_open:
            return False, SESSION_OPEN
        self._session_open, self._session_loaded = True, False
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        """Close the update session (``end_weight_update``)."""
        if not self._session_open:
            return False, SESSION_MISSING
        self._session_open = False
        return True, "Success"

    def receive(self, update: DistributedUpdate, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """Receive the update's tensors by broadcast from rank 0 (blocks; raises on any failure)."""
        if update.group_name not in self._groups:
            raise AssertionError(
                f"Group {update.group_name} not in {list(self._groups)}. "
                "Please call `init_weights_update_group` first."
            )
        group = self._groups[update.group_name]
        try:
            if update.load_format == "flattened_bucket":
                return self._receive_flattened(update, device, group)
            return self._receive_tensors(update, device, group)
        except BaseException:
            self.receive_buffer.drop()  # a receive may still be in flight into it
            raise

    def _receive_tensors(
        self, update: DistributedUpdate, device: torch.device, group: Any
    ) -> list[tuple[str, torch.Tensor]]:
        """SGLang's per-tensor receive: ``torch.empty`` + an asynchronous broadcast each, then wait for all.

        A dtype or shape ``torch.empty`` refuses raises after the broadcasts of the tensors before it
        were posted, as in SGLang's loop.
        """
        layout, nbytes, refused = receive_layout(update)
        flat = self.receive_buffer.take(nbytes, device)
        weights: list[tuple[str, torch.Tensor]] = []
        handles = []
        for name, dtype, size, start in layout:
            weight = flat[start : start + size.numel() * dtype.itemsize].view(dtype).reshape(size)
            handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
            weights.append((name, weight))
        if refused is not None:
            raise refused
        for handle in handles:
            if handle is not None:
                handle.wait()
        return weights

    def _receive_flattened(
        self, update: DistributedUpdate, device: torch.device, group: Any
    ) -> list[tuple[str, torch.Tensor]]:
        """tensor_bucket.py ``FlattenedTensorBucket.empty`` + one broadcast + ``reconstruct_tensors``."""
        layout: list[tuple[str, torch.dtype, torch.Size, int, int]] = []
        offset = 0
        for name, dtype_name, shape in zip(update.names, update.dtypes, update.shapes, strict=True):
            dtype, size = _torch_dtype(dtype_name), torch.Size(shape)
            if any(dim < 0 for dim in size):
                raise ValueError(f"Negative dimension in received tensor {name}: {size}")
            if offset % dtype.itemsize:
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
            nbytes = size.numel() * dtype.itemsize
            layout.append((name, dtype, size, offset, offset + nbytes))
            offset += nbytes
        if not layout:
            raise ValueError("Cannot create empty tensor bucket")
        flat = self.receive_buffer.take(offset, device)
        dist.broadcast(flat, src=0, group=group)
        return [(name, flat[start:end].view(dtype).reshape(size)) for name, dtype, size, start, end in layout]

    def update(self, model: torch.nn.Module, update: DistributedUpdate) -> UpdateOutcome:
        """Receive and load one update inside the session (scheduler ``update_weights_from_distributed``)."""
        if not self._session_open:
            return UpdateOutcome(False, NO_SESSION, weights_changed=False)
        device = next(model.parameters()).device
        try:
            weights = self.receive(update, device)
        except Exception as exc:  # a broken or missing group, a bad dtype: SGLang's answer for all
            message = f"Failed to receive weights: {exc}"
            logger.error(message)
            return UpdateOutcome(False, message, weights_changed=False)
        try:
            load_named_tensors(model, weights)
        except Exception as exc:
            message = (
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                "partially updated. Please discard the whole weights."
            )
            logger.error(message)
            return UpdateOutcome(False, message, weights_changed=True)
        self._session_loaded = True
        return UpdateOutcome(True, UPDATE_OK, weights_changed=True)


__all__ = [
    "DESTROY_MISSING",
    "DESTROY_OK",
    "INIT_OK",
    "NO_SESSION",
    "ReceiveBuffer",
    "SESSION_MISSING",
    "SESSION_OPEN",
    "UPDATE_OK",
    "UpdateOutcome",
    "WeightUpdateGroups",
    "load_named_tensors",
    "receive_layout",
]
