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
* The received tensors live in memory the replica keeps between calls, never in the served
  parameters: what SGLang's ``torch.empty`` gets on a GPU from PyTorch's caching allocator,
  which hands the freed block of the previous call back. On the CPU every ``torch.empty`` of a
  bucket maps fresh pages and faults each one in while the broadcast fills it (measured: a third
  of the bare broadcast's time). A tensor that names a parameter of its shape is received into
  that parameter's spare (:class:`ParameterSpares`; one of another dtype, a bf16 wire into fp32
  weights, is cast into the spare as soon as it arrived, while the later tensors are still on the
  wire), and the load swaps the spare in where SGLang's weight loader copies
  (weight_utils.py ``default_weight_loader``: ``param.data.copy_``). The values served after the
  load are the same, and so is every answer; what differs is only the cost: on a GPU that copy
  runs at device-memory bandwidth beside a link 50x slower, on the CPU it costs as much as the
  receive. Anything else (an unknown name, another shape, a parameter named twice in one call)
  is received into a buffer (:class:`ReceiveBuffer`) and copied by the load, as before. Neither
  the spares nor the buffer are the served weights, so a failed receive leaves them whole.
* sglang/srt/managers/scheduler_components/weight_updater.py: an update runs only inside a
  ``begin_weight_update`` / ``end_weight_update`` session; its answers and messages.

The names, dtypes and shapes are zipped as SGLang zips them (the shortest list wins), so a
caller that sends lists of different lengths gets what SGLang would do with them.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
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


class ParameterSpares:
    """A spare of each parameter of the served model, received into and swapped in by the load (module doc).

    A spare has its parameter's dtype and shape and is never served. The load swaps it with the
    parameter's data, so the memory the previous version was served from is the next spare: one
    extra copy of the received parameters is held while the replica is in a group (the receive
    buffer held one bucket). A spare is known by its parameter's first name, so a model loaded
    from disk in between (a new object of the same architecture) receives into the same memory,
    as a GPU's caching allocator would hand it back; dropped with the receive buffer.
    """

    def __init__(self) -> None:
        self._model: weakref.ReferenceType[torch.nn.Module] | None = None
        self._keys: dict[str, str] = {}  # every name of a swappable parameter -> its first name
        self._params: dict[str, torch.nn.Parameter] = {}  # first name -> parameter
        self._spares: dict[str, torch.Tensor] = {}  # first name -> spare

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(spare.numel() * spare.element_size() for spare in self._spares.values())

    def bind(self, model: torch.nn.Module) -> None:
        """Serve ``model``'s parameters (another model keeps only the spares that fit its parameters)."""
        if self._model is not None and self._model() is model:
            return
        named = dict(model.named_parameters(remove_duplicate=False))
        owners: dict[int, set[int]] = {}
        for param in named.values():
            owners.setdefault(param.untyped_storage().data_ptr(), set()).add(id(param))
        first: dict[int, str] = {}
        self._keys, self._params = {}, {}
        for name, param in named.items():
            # A parameter whose memory another parameter object shares (a tie made by sharing
            # storage rather than the object) is loaded by copy: swapping one would untie them.
            if len(owners[param.untyped_storage().data_ptr()]) == 1:
                key = first.setdefault(id(param), name)
                self._keys[name], self._params[key] = key, param
        self._spares = {key: spare for key, spare in self._spares.items() if key in self._params
                        and _same_layout(spare, self._params[key].data)}
        self._model = weakref.ref(model)

    def claim(self, name: str, shape: torch.Size, claimed: set[str]) -> torch.Tensor | None:
        """The spare of the parameter ``name`` when it has ``shape`` and no earlier tensor of the call claimed it."""
        key = self._keys.get(name)
        if key is None or self._params[key].shape != shape or key in claimed:
            return None
        claimed.add(key)
        spare = self._spares.get(key)
        if spare is None:
            spare = self._spares[key] = torch.empty_like(self._params[key].data, memory_format=torch.contiguous_format)
        return spare

    def swap_in(self, name: str) -> None:
        """The parameter serves its spare's values; its previous memory becomes the spare."""
        key = self._keys[name]
        param = self._params[key]
        self._spares[key], param.data = param.data, self._spares[key]

    def drop(self) -> None:
        """Release the spares (a receive may still be writing into one)."""
        self._model, self._keys, self._params, self._spares = None, {}, {}, {}


def _same_layout(spare: torch.Tensor, param: torch.Tensor) -> bool:
    return (spare.shape == param.shape and spare.dtype == param.dtype and spare.device == param.device
            and spare.stride() == param.stride())


@dataclasses.dataclass(frozen=True)
class ReceivedTensor:
    """One received tensor: into its parameter's spare (the load swaps it in), or elsewhere (the load copies it)."""

    name: str
    tensor: torch.Tensor
    in_spare: bool = False


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


def load_named_tensors(model: torch.nn.Module, named: Sequence[ReceivedTensor],
                       spares: ParameterSpares | None = None) -> None:
    """Load each tensor into the model's parameter of that name, in order (SGLang's ``load_weights``).

    One received into its spare is swapped in (``spares``); any other is copied (cast to the
    parameter's dtype). Names are the Hugging Face state-dict names; a tied ``lm_head.weight`` is
    the embedding. A failure leaves the tensors before it loaded, as SGLang's loader does.

    Raises:
        KeyError: A name the model does not have.
        ValueError: A shape that differs from the parameter's.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for received in named:
            name, tensor = received.name, received.tensor
            if received.in_spare and spares is not None:
                spares.swap_in(name)
                continue
            if name not in params:
                raise KeyError(f"no parameter named {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != parameter shape {tuple(param.shape)}")
            param.data.copy_(tensor)


@dataclasses.dataclass(frozen=True)
class ReceiveSlot:
    """Where one tensor of a per-tensor receive lands."""

    name: str
    dtype: torch.dtype
    size: torch.Size
    #: Byte offset in the receive buffer (a multiple of 64); None: received straight into ``spare``.
    offset: int | None
    #: The parameter's spare the tensor ends in (received into it, or cast into it on arrival); None: the buffer.
    spare: torch.Tensor | None = None


def receive_layout(
    update: DistributedUpdate, spare_of: Callable[[str, torch.Size], torch.Tensor | None] = lambda name, size: None,
) -> tuple[list[ReceiveSlot], int, Exception | None]:
    """Where each tensor of a per-tensor receive lands, and the receive buffer bytes they need.

    ``spare_of(name, shape)`` (asked once per tensor, in order) names the parameter spare a tensor
    ends in: one of the spare's dtype is received into it and needs no buffer bytes; any other
    gets its own bytes in the buffer. Returns the slots, the buffer bytes, and what
    ``torch.empty`` refused (an unknown dtype, a negative dimension) with the tensors before it,
    the ones SGLang's loop had posted a broadcast for when it raised.
    """
    layout: list[ReceiveSlot] = []
    nbytes = 0
    for name, dtype_name, shape in zip(update.names, update.dtypes, update.shapes, strict=False):
        try:  # torch.empty's checks, without its memory
            meta = torch.empty(shape, dtype=_torch_dtype(dtype_name), device="meta")
        except Exception as exc:
            return layout, nbytes, exc
        spare = spare_of(name, meta.shape)
        if spare is not None and spare.dtype == meta.dtype:
            layout.append(ReceiveSlot(name, meta.dtype, meta.shape, None, spare))
            continue
        layout.append(ReceiveSlot(name, meta.dtype, meta.shape, nbytes, spare))
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
        self.spares = ParameterSpares()

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
                self.spares.drop()
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

    def receive(self, update: DistributedUpdate, model: torch.nn.Module) -> list[ReceivedTensor]:
        """Receive the update's tensors by broadcast from rank 0 (blocks; raises on any failure)."""
        if update.group_name not in self._groups:
            raise AssertionError(
                f"Group {update.group_name} not in {list(self._groups)}. "
                "Please call `init_weights_update_group` first."
            )
        group = self._groups[update.group_name]
        device = next(model.parameters()).device
        try:
            if update.load_format == "flattened_bucket":
                return [ReceivedTensor(name, tensor) for name, tensor in self._receive_flattened(update, device, group)]
            return self._receive_tensors(update, model, device, group)
        except BaseException:
            self.receive_buffer.drop()  # a receive may still be in flight into it, or into a spare
            self.spares.drop()
            raise

    def _receive_tensors(
        self, update: DistributedUpdate, model: torch.nn.Module, device: torch.device, group: Any
    ) -> list[ReceivedTensor]:
        """SGLang's per-tensor receive: an asynchronous broadcast per tensor, then wait for all.

        Each lands in its parameter's spare or in the buffer (module doc); one cast into a spare
        is cast as soon as its broadcast completed, while the later ones are still on the wire. A
        dtype or shape ``torch.empty`` refuses raises after the broadcasts of the tensors before
        it were posted, as in SGLang's loop.
        """
        self.spares.bind(model)
        claimed: set[str] = set()
        layout, nbytes, refused = receive_layout(update, lambda name, size: self.spares.claim(name, size, claimed))
        flat = self.receive_buffer.take(nbytes, device)
        posted = []
        for slot in layout:
            if slot.offset is None:
                assert slot.spare is not None  # keep: receive_layout places only spares so
                wire = slot.spare
            else:
                wire = flat[slot.offset : slot.offset + slot.size.numel() * slot.dtype.itemsize]
                wire = wire.view(slot.dtype).reshape(slot.size)
            posted.append((slot, wire, dist.broadcast(wire, src=0, group=group, async_op=True)))
        if refused is not None:
            raise refused
        received = []
        for slot, wire, handle in posted:
            if handle is not None:
                handle.wait()
            if slot.spare is not None and wire is not slot.spare:
                slot.spare.copy_(wire)  # the load's cast, into memory that is not served
            received.append(ReceivedTensor(slot.name, wire if slot.spare is None else slot.spare,
                                           in_spare=slot.spare is not None))
        return received

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
        try:
            weights = self.receive(update, model)
        except Exception as exc:  # a broken or missing group, a bad dtype: SGLang's answer for all
            message = f"Failed to receive weights: {exc}"
            logger.error(message)
            return UpdateOutcome(False, message, weights_changed=False)
        try:
            load_named_tensors(model, weights, self.spares)
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
    "ParameterSpares",
    "ReceiveBuffer",
    "ReceiveSlot",
    "ReceivedTensor",
    "SESSION_MISSING",
    "SESSION_OPEN",
    "UPDATE_OK",
    "UpdateOutcome",
    "WeightUpdateGroups",
    "load_named_tensors",
    "receive_layout",
]
