"""One KV block as a cold tier stores it: a header that names exactly what the bytes are, the
block's bytes in their stored format (what `KVCacheStore.gather_bytes` returns: every layer's
parts, scales included), and a checksum over both.

A value is used only when everything in its header equals what the reader expects (model
fingerprint, KV format, block size, namespace, the block's chained hash, its parent's hash and its
tokens) and the checksum holds; anything else (another model's file, a torn write, a flipped bit, a
key collision) is a `ColdBlockError`, which the tier treats as a miss and removes.

Layout (little-endian): magic "KVSB", version u16, header length u32, header (msgspec msgpack of
`BlockIdentity` plus the payload length), payload, xxh3-64 of everything before it (u64).
"""

from __future__ import annotations

import struct
import msgspec
import xxhash

MAGIC = b"KVSB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")       # magic, version, header length
_CHECKSUM = struct.Struct("<Q")


class ColdBlockError(ValueError):
    """A stored value that is not the block the reader asked for, or not intact."""


class BlockIdentity(msgspec.Struct, frozen=True, array_like=True):
    """Everything a stored block must match to be used (the header of its value)."""
    model_fingerprint: str
    kv_format: str
    block_size: int
    namespace: str
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[BlockIdentity, int])      # (identity, payload length)


def encode_block(identity: BlockIdentity, payload: bytes | memoryview) -> bytes:
    header = _encoder.encode((identity, len(payload)))
    body = b"".join((_PREFIX.pack(MAGIC, VERSION, len(header)), header, payload))
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def read_identity(data: bytes | memoryview) -> tuple[BlockIdentity, int]:
    """The header of a stored value (its identity and payload length), without checking the
    payload: enough to rebuild a disk tier's index at start."""
    if len(data) < _PREFIX.size:
        raise ColdBlockError("shorter than its header")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ColdBlockError("not a kvserve block")
    if version != VERSION:
        raise ColdBlockError(f"block format version {version}, this build reads {VERSION}")
    end = _PREFIX.size + header_len
    if len(data) < end:
        raise ColdBlockError("truncated header")
    try:
        return _decoder.decode(bytes(data[_PREFIX.size:end]))
    except msgspec.DecodeError as exc:
        raise ColdBlockError(f"unreadable header: {exc}") from None


def header_nbytes(data: bytes | memoryview) -> int:
    """How many leading bytes of a value `read_identity` needs (prefix + header)."""
    return _PREFIX.size + _PREFIX.unpack_from(data)[2]


def decode_block(data: bytes | memoryview, expected: BlockIdentity, payload_nbytes: int) -> memoryview:
    """The payload of `data` if it is exactly the block `expected` names, `payload_nbytes` long and
    intact; else ColdBlockError saying what differs."""
    identity, stored_nbytes = read_identity(data)
    if identity != expected:
        differs = [name for name in BlockIdentity.__struct_fields__
                   if getattr(identity, name) != getattr(expected, name)]
        raise ColdBlockError(f"another block ({', '.join(differs)} differ)")
    if stored_nbytes != payload_nbytes:
        raise ColdBlockError(f"payload of {stored_nbytes} bytes, expected {payload_nbytes}")
    start = header_nbytes(data)
    end = start + payload_nbytes
    if len(data) != end + _CHECKSUM.size:
        raise ColdBlockError(f"{len(data)} bytes, expected {end + _CHECKSUM.size} (torn or padded)")
    view = memoryview(data)
    (checksum,) = _CHECKSUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != checksum:
        raise ColdBlockError("checksum mismatch")
    return view[start:end]
