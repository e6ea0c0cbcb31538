"""The memory weights live and are received in, and rank 0's wire tensors (no network).

The transfers themselves run through real engines in ``test_weight_sync.py``; here the parts
that decide where the bytes go: the embedded engine's parameters after a load, its receive
buffer, parameter spares and per-tensor layout, and rank 0's lazy conversion to the wire dtype.
The broadcast is replaced by one that writes known values (or fails) where the receive posted it.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.embedded import weight_receiver
from rolloutd.engines.embedded.interface import DistributedUpdate
from rolloutd.engines.embedded.model import load_model
from rolloutd.engines.embedded.weight_receiver import (
    ParameterSpares,
    ReceiveBuffer,
    WeightUpdateGroups,
    receive_layout,
)
from traind.weight_sync import wire_tensors

CPU = torch.device("cpu")


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process that map files under path (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if str(path) in line:
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_loaded_weights_live_in_the_engines_memory_not_in_the_checkpoints_file_mapping(tmp_path: Path) -> None:
    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    model = load_model(str(checkpoint), "v0").model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is kept
    ranges = _mapped_ranges(checkpoint)
    for name, param in model.named_parameters():
        assert not any(start <= param.data_ptr() < end for start, end in ranges), name


def test_the_receive_buffer_is_kept_between_updates_grows_and_is_dropped() -> None:
    buffer = ReceiveBuffer()
    first = buffer.take(1000, CPU)
    assert buffer.take(600, CPU).data_ptr() == first.data_ptr()  # a smaller update reuses the bytes
    grown = buffer.take(5000, CPU)
    assert grown.numel() == 5000 and buffer.nbytes == 5000
    buffer.drop()
    assert buffer.nbytes == 0


def test_each_tensor_gets_its_own_aligned_bytes_and_a_refused_one_keeps_those_before_it() -> None:
    update = DistributedUpdate(names=("a", "b", "c", "d"), dtypes=("float32", "bfloat16", "int8", "float32"),
                               shapes=((3,), (5, 3), (), (2, 2)))
    layout, nbytes, refused = receive_layout(update)
    assert refused is None
    assert [(slot.name, slot.dtype, tuple(slot.size), slot.offset) for slot in layout] == [
        ("a", torch.float32, (3,), 0), ("b", torch.bfloat16, (5, 3), 64), ("c", torch.int8, (), 128),
        ("d", torch.float32, (2, 2), 192)]
    assert nbytes == 256
    flat = ReceiveBuffer().take(nbytes, CPU)
    views = [flat[slot.offset : slot.offset + slot.size.numel() * slot.dtype.itemsize].view(slot.dtype).reshape(
        slot.size) for slot in layout if slot.offset is not None]
    for view in views:
        view.fill_(1)
    assert [float(v.sum()) for v in views] == [3.0, 15.0, 1.0, 4.0]  # no two views share a byte

    # What torch.empty refuses, in SGLang's order: the tensors before it were already posted.
    for dtypes, shapes, error in ((("float32", "float33"), ((2,), (2,)), AttributeError),
                                  (("float32", "float32"), ((2,), (-1,)), RuntimeError)):
        layout, _, refused = receive_layout(DistributedUpdate(names=("a", "b"), dtypes=dtypes, shapes=shapes))
        assert [slot.name for slot in layout] == ["a"] and isinstance(refused, error)
    with pytest.raises(RuntimeError, match="negative dimension"):
        torch.empty((-1,))  # the message the engine answers is torch's own


def test_rank0_converts_each_tensor_only_when_its_broadcast_is_posted() -> None:
    params = {"w": torch.arange(4, dtype=torch.float32), "v": torch.ones(2, 3).t()}  # v is not contiguous
    tensors = wire_tensors(params, [("w", "bfloat16"), ("v", "float32"), ("missing", "float32")])
    assert isinstance(tensors, types.GeneratorType)
    w = next(tensors)
    assert w.dtype == torch.bfloat16 and w.tolist() == [0.0, 1.0, 2.0, 3.0]
    v = next(tensors)
    assert v.is_contiguous() and v.shape == (3, 2)
    with pytest.raises(KeyError):  # an unknown name fails when it is reached, inside the broadcast
        next(tensors)
    same = next(wire_tensors(params, [("w", "float32")]))
    assert same.data_ptr() == params["w"].data_ptr()  # already the wire dtype: sent without a copy


class _Broadcasts:
    """Stands in for ``torch.distributed.broadcast`` from rank 0: fills each posted tensor with the values
    rank 0 would send (from ``sent``, in order), or fails at the ``fail_at``-th post."""

    def __init__(self, sent: list[torch.Tensor], fail_at: int = -1) -> None:
        self.sent, self.fail_at, self.posted = sent, fail_at, 0

    def __call__(self, tensor: torch.Tensor, *, src: int, group: object, async_op: bool) -> None:
        assert src == 0 and async_op
        if self.posted == self.fail_at:
            raise RuntimeError("Connection closed by peer")
        tensor.copy_(self.sent[self.posted])
        self.posted += 1


def _groups(monkeypatch: pytest.MonkeyPatch, broadcasts: _Broadcasts) -> WeightUpdateGroups:
    groups = WeightUpdateGroups()
    groups._groups["g"] = object()  # joined (the fake broadcast never touches the group)
    monkeypatch.setattr(weight_receiver.dist, "broadcast", broadcasts)
    groups.begin("all")
    return groups


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("spares") / "ckpt")


def test_a_received_version_is_swapped_in_and_the_served_memory_becomes_the_next_spare(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_checkpoint), "v0").model
    named = dict(model.named_parameters())
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    new = [torch.full_like(named[n], 0.5) for n in names]
    served = [named[n].data_ptr() for n in names]
    groups = _groups(monkeypatch, _Broadcasts(new))
    update = DistributedUpdate(names=tuple(names), dtypes=("float32", "float32"),
                               shapes=tuple(tuple(t.shape) for t in new), group_name="g")
    outcome = groups.update(model, update)
    assert outcome.success and outcome.weights_changed
    for name, values, old_ptr in zip(names, new, served, strict=True):
        assert torch.equal(named[name], values)
        assert named[name].data_ptr() != old_ptr  # swapped in, not copied
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie is kept
    assert torch.equal(model.lm_head.weight, new[0])
    assert groups.receive_buffer.nbytes <= 1  # nothing went through the buffer
    # The next version is received into the memory the previous one was served from.
    newer = [torch.full_like(t, 2.0) for t in new]
    monkeypatch.setattr(weight_receiver.dist, "broadcast", _Broadcasts(newer))
    assert groups.update(model, update).success
    assert [named[n].data_ptr() for n in names] == served
    assert torch.equal(named["model.norm.weight"], newer[1])


def test_a_bf16_wire_is_cast_into_the_spare_and_what_fits_no_spare_is_copied_in_order(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_checkpoint), "v0").model
    norm = model.model.norm.weight
    first, second = torch.full_like(norm, 1.5, dtype=torch.bfloat16), torch.full_like(norm, 3.0)
    # The same parameter twice (the second lands in the buffer and is copied after the swap: it wins,
    # as SGLang's load in order), then a name the model lacks: the load fails there, the earlier ones loaded.
    groups = _groups(monkeypatch, _Broadcasts([first, second, torch.zeros(2)]))
    update = DistributedUpdate(names=("model.norm.weight", "model.norm.weight", "missing"),
                               dtypes=("bfloat16", "float32", "float32"),
                               shapes=(tuple(norm.shape), tuple(norm.shape), (2,)), group_name="g")
    outcome = groups.update(model, update)
    assert not outcome.success and outcome.weights_changed
    assert "Failed to update parameter online" in outcome.message and "partially updated" in outcome.message
    assert norm.dtype == torch.float32 and torch.equal(norm, second)
    monkeypatch.setattr(weight_receiver.dist, "broadcast", _Broadcasts([first]))
    assert groups.update(model, DistributedUpdate(names=("model.norm.weight",), dtypes=("bfloat16",),
                                                  shapes=(tuple(norm.shape),), group_name="g")).success
    assert norm.dtype == torch.float32 and torch.equal(norm, first.float())


def test_a_failed_receive_leaves_the_served_weights_whole_and_drops_what_it_received_into(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_checkpoint), "v0").model
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    pointers = {name: param.data_ptr() for name, param in model.named_parameters()}
    names = list(before)[:3]
    sent = [torch.full_like(before[n], 7.0) for n in names]
    groups = _groups(monkeypatch, _Broadcasts(sent, fail_at=2))  # two tensors arrive, the third fails
    update = DistributedUpdate(names=tuple(names), dtypes=("float32",) * 3,
                               shapes=tuple(tuple(t.shape) for t in sent), group_name="g")
    outcome = groups.update(model, update)
    assert not outcome.success and not outcome.weights_changed
    assert outcome.message.startswith("Failed to receive weights: Connection closed by peer")
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name] and torch.equal(param, before[name]), name
    assert groups.spares.nbytes == 0 and groups.receive_buffer.nbytes == 0  # a late write lands in nothing served


def test_spares_follow_the_served_model_and_never_untie_a_shared_storage() -> None:
    spares = ParameterSpares()
    model = torch.nn.Linear(2, 3)
    spares.bind(model)
    claimed: set[int] = set()
    spare = spares.claim("weight", torch.Size((3, 2)), claimed)
    assert spare is not None and spare.data_ptr() != model.weight.data_ptr()
    assert spares.claim("weight", torch.Size((3, 2)), claimed) is None  # once per call
    assert spares.claim("bias", torch.Size((2,)), set()) is None  # another shape
    assert spares.claim("missing", torch.Size((3,)), set()) is None
    spares.bind(model)
    assert spares.nbytes == 3 * 2 * 4  # the same model keeps its spares
    reloaded = torch.nn.Linear(2, 3)  # a disk reload: a new model of the same shapes receives into the same memory
    spares.bind(reloaded)
    assert spares.claim("weight", torch.Size((3, 2)), set()) is spare
    spares.bind(torch.nn.Linear(2, 4))
    assert spares.nbytes == 0  # another shape: the spare goes
    shared = torch.nn.Linear(2, 2)
    shared.bias = torch.nn.Parameter(shared.weight.data[1])  # a second parameter object on the same memory
    spares.bind(shared)
    assert spares.claim("weight", torch.Size((2, 2)), set()) is None  # loaded by copy: the two stay one memory
    assert spares.claim("bias", torch.Size((2,)), set()) is None
