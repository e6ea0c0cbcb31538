"""flexmarl.blob_wire writes exactly what protobuf writes and reads whatever protobuf reads."""

from __future__ import annotations

import os

import pytest

from flexmarl import blob_wire
from flexmarl.v1 import store_pb2

SIZES = [0, 1, 127, 128, 16_383, 16_384, 1 << 20, (1 << 20) + 3]
INFO = store_pb2.BlobInfo(name="weights/j/a/1", sha256="ab" * 32, size_bytes=5 << 20, created_unix_ms=1_700_000)


@pytest.mark.parametrize("size", SIZES)
def test_put_chunks_are_protobuf_bytes_and_decode_as_views(size: int) -> None:
    data = os.urandom(size)
    encoded = blob_wire.encode_put_chunk(memoryview(data))
    assert encoded == store_pb2.PutBlobRequest(chunk=data).SerializeToString()
    decoded = blob_wire.decode_put_request(encoded)
    assert isinstance(decoded, memoryview) and bytes(decoded) == data
    assert blob_wire.encode_put_request(encoded) is encoded


def test_other_put_messages_go_through_protobuf() -> None:
    header = store_pb2.PutBlobRequest(header=store_pb2.PutBlobHeader(name="n", size_bytes=3))
    decoded = blob_wire.decode_put_request(header.SerializeToString())
    assert isinstance(decoded, store_pb2.PutBlobRequest) and decoded.header.name == "n"
    assert blob_wire.encode_put_request(header) == header.SerializeToString()
    # the chunk field twice (protobuf keeps the last) is not the canonical layout
    twice = blob_wire.encode_put_chunk(b"first") + blob_wire.encode_put_chunk(b"second")
    decoded = blob_wire.decode_put_request(twice)
    assert isinstance(decoded, store_pb2.PutBlobRequest) and decoded.chunk == b"second"
    assert isinstance(blob_wire.decode_put_request(b""), store_pb2.PutBlobRequest)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 1 << 20, 1 << 40])
@pytest.mark.parametrize("info", [None, INFO])
def test_get_chunks_are_protobuf_bytes_and_decode(size: int, offset: int, info: store_pb2.BlobInfo | None) -> None:
    data = os.urandom(size)
    encoded = blob_wire.encode_get_chunk(offset, data, info)
    expected = store_pb2.GetBlobResponse(offset=offset, chunk=data)
    if info is not None:
        expected.info.CopyFrom(info)
    assert encoded == expected.SerializeToString()
    chunk = blob_wire.decode_get_response(encoded)
    assert (chunk.offset, bytes(chunk.data), chunk.info) == (offset, data, info)
    assert blob_wire.encode_get_response(encoded) is encoded


def test_a_get_message_in_another_field_order_goes_through_protobuf() -> None:
    chunk_first = b"\x1a\x03abc" + b"\x10\x05" + b"\x0a" + bytes([INFO.ByteSize()]) + INFO.SerializeToString()
    chunk = blob_wire.decode_get_response(chunk_first)
    assert (chunk.offset, bytes(chunk.data), chunk.info) == (5, b"abc", INFO)
    message = store_pb2.GetBlobResponse(info=INFO, offset=7)
    assert blob_wire.encode_get_response(message) == message.SerializeToString()
