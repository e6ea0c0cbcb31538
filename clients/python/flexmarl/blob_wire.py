"""Codecs of the blob chunk messages of flexmarl.v1.Store that skip protobuf's copies of the bytes.

``PutBlobRequest{chunk}`` and ``GetBlobResponse{info, offset, chunk}`` carry a megabyte each.
protobuf's Python runtime copies a bytes field when it parses a message, on every read of the
field, and again on construction and serialization; those copies hold the GIL, so they stall
the event loop that also drives gRPC. Profiling ``benchmarks/stored.py`` showed them to be the
bottleneck of blob transfer. These codecs write and read exactly the protobuf wire format (so
any client or server of the service interoperates with them): the canonical layout (fields in
number order, each at most once, as protobuf itself serializes them) is handled here with one
copy or none, anything else falls back to protobuf's parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmarl.v1 import store_pb2

#: Tags (field number << 3 | wire type): PutBlobRequest.chunk = 2, bytes.
_PUT_CHUNK_TAG = 0x12
#: GetBlobResponse: info = 1 (message), offset = 2 (varint), chunk = 3 (bytes).
_GET_INFO_TAG, _GET_OFFSET_TAG, _GET_CHUNK_TAG = 0x0A, 0x10, 0x1A


@dataclass(frozen=True)
class BlobChunk:
    """One GetBlob message: the chunk's offset and bytes, the blob's info on the first message."""

    offset: int
    data: bytes | memoryview
    info: store_pb2.BlobInfo | None = None


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at pos and the position after it; ValueError when truncated or over 64 bits."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def encode_put_chunk(data: bytes | memoryview) -> bytes:
    """The wire bytes of ``PutBlobRequest(chunk=data)`` (one copy of data)."""
    return b"".join((bytes((_PUT_CHUNK_TAG,)), _varint(len(data)), data))


def encode_put_request(request: store_pb2.PutBlobRequest | bytes) -> bytes:
    """Request serializer of PutBlob: chunks come pre-encoded by :func:`encode_put_chunk`."""
    return request if isinstance(request, bytes) else request.SerializeToString()


def decode_put_request(data: bytes) -> store_pb2.PutBlobRequest | memoryview:
    """Request deserializer of PutBlob: a chunk message as a view of its bytes, anything else parsed."""
    if data[:1] == bytes((_PUT_CHUNK_TAG,)):
        try:
            length, pos = _read_varint(data, 1)
        except ValueError:
            pass
        else:
            if pos + length == len(data):
                return memoryview(data)[pos:]
    return store_pb2.PutBlobRequest.FromString(data)


def encode_get_chunk(offset: int, data: bytes | memoryview, info: store_pb2.BlobInfo | None = None) -> bytes:
    """The wire bytes of ``GetBlobResponse(info=info, offset=offset, chunk=data)``, as protobuf writes them."""
    parts: list[bytes | memoryview] = []
    if info is not None:
        encoded = info.SerializeToString()
        parts += (bytes((_GET_INFO_TAG,)), _varint(len(encoded)), encoded)
    if offset:
        parts += (bytes((_GET_OFFSET_TAG,)), _varint(offset))
    if len(data):
        parts += (bytes((_GET_CHUNK_TAG,)), _varint(len(data)), data)
    return b"".join(parts)


def encode_get_response(message: store_pb2.GetBlobResponse | bytes) -> bytes:
    """Response serializer of GetBlob: chunks come pre-encoded by :func:`encode_get_chunk`."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def decode_get_response(data: bytes) -> BlobChunk:
    """Response deserializer of GetBlob: the chunk as a view of the message's bytes."""
    try:
        return _decode_get_canonical(data)
    except ValueError:
        message = store_pb2.GetBlobResponse.FromString(data)
        return BlobChunk(message.offset, message.chunk, message.info if message.HasField("info") else None)


def _decode_get_canonical(data: bytes) -> BlobChunk:
    """Fields in number order, each at most once; ValueError for any other layout."""
    offset, chunk, info = 0, memoryview(b""), None
    pos, last_tag = 0, 0
    while pos < len(data):
        tag = data[pos]
        if tag <= last_tag or tag not in (_GET_INFO_TAG, _GET_OFFSET_TAG, _GET_CHUNK_TAG):
            raise ValueError("not the canonical layout")
        last_tag = tag
        if tag == _GET_OFFSET_TAG:
            offset, pos = _read_varint(data, pos + 1)
            continue
        length, pos = _read_varint(data, pos + 1)
        if pos + length > len(data):
            raise ValueError("truncated field")
        if tag == _GET_INFO_TAG:
            info = store_pb2.BlobInfo.FromString(data[pos : pos + length])
        else:
            chunk = memoryview(data)[pos : pos + length]
        pos += length
    return BlobChunk(offset, chunk, info)
