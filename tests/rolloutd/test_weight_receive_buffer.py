"""The memory weights live and are received in, and rank 0's wire tensors (no network).

The transfers themselves run through real engines in ``test_weight_sync.py``; here the parts
that decide where the bytes go: the embedded engine's parameters after a load, its receive
buffer and per-tensor layout, and rank 0's lazy conversion to the wire dtype.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from flexmarl.tiny import build_tiny_checkpoint
from rolloutd.engines.embedded.interface import DistributedUpdate
from rolloutd.engines.embedded.model import load_model
from rolloutd.engines.embedded.weight_receiver import ReceiveBuffer, receive_layout
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
    assert [(name, dtype, tuple(size), start) for name, dtype, size, start in layout] == [
        ("a", torch.float32, (3,), 0), ("b", torch.bfloat16, (5, 3), 64), ("c", torch.int8, (), 128),
        ("d", torch.float32, (2, 2), 192)]
    assert nbytes == 256
    flat = ReceiveBuffer().take(nbytes, CPU)
    views = [flat[start : start + size.numel() * dtype.itemsize].view(dtype).reshape(size)
             for _, dtype, size, start in layout]
    for view in views:
        view.fill_(1)
    assert [float(v.sum()) for v in views] == [3.0, 15.0, 1.0, 4.0]  # no two views share a byte

    # What torch.empty refuses, in SGLang's order: the tensors before it were already posted.
    for dtypes, shapes, error in ((("float32", "float33"), ((2,), (2,)), AttributeError),
                                  (("float32", "float32"), ((2,), (-1,)), RuntimeError)):
        layout, _, refused = receive_layout(DistributedUpdate(names=("a", "b"), dtypes=dtypes, shapes=shapes))
        assert [name for name, *_ in layout] == ["a"] and isinstance(refused, error)
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
