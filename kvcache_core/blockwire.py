"""Hand-written protobuf codec for the two messages that carry block bytes: PutRequest and GetResponse.

Why: the generated protobuf classes copy a block three times on each side
(into the message's arena, into the serialised string, and out again when the
field is read), which capped the SDK at about half of what bare gRPC moves.
This codec writes and reads exactly the same wire format as the generated code
(kvcache.v1, proto/kvcache/v1/kvcache.proto), so any client or server built
from the .proto interoperates, but it copies block bytes once when encoding
and not at all when decoding a GetResponse (blocks are memoryviews into the
received message).

Wire format reminders (protobuf encoding): a field is a varint tag
(field_number << 3 | wire_type) then its value; wire type 0 is a varint, 2 a
length-delimited byte string or nested message, 1 and 5 fixed 64/32-bit.
Unknown fields are skipped, as the generated code does; fields at their
default value are omitted, as proto3 serialisers do.

    PutRequest  { string namespace = 1; repeated Block blocks = 2; }
    Block       { bytes key = 1; bytes data = 2; ShmRange shm = 3; bool more = 4; uint64 total_length = 5; }
    ShmRange    { string segment = 1; uint64 offset = 2; uint64 length = 3; }
    GetResponse { repeated GetItem items = 1; }
    GetItem     { uint32 index = 1; bool found = 2; bytes data = 3; Tier tier = 4; ShmRange shm = 5;
                  bool more = 6; }
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache_core.errors import WireError

Buffer = bytes | bytearray | memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise WireError("varint longer than 10 bytes")


def _fields(buf: memoryview, pos: int, end: int):
    """Yields (field number, wire type, value): an int for varints/fixed, (start, stop) for byte strings."""
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire_type == 0:
            value, pos = _read_varint(buf, pos, end)
            yield number, 0, value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise WireError("length-delimited field runs past the end")
            yield number, 2, (pos, pos + length)
            pos += length
        elif wire_type == 1:
            if end - pos < 8:
                raise WireError("truncated fixed64")
            yield number, 1, int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
        elif wire_type == 5:
            if end - pos < 4:
                raise WireError("truncated fixed32")
            yield number, 5, int.from_bytes(buf[pos : pos + 4], "little")
            pos += 4
        else:
            raise WireError(f"unsupported wire type {wire_type}")


def _expect(wire_type: int, wanted: int, what: str) -> None:
    if wire_type != wanted:
        raise WireError(f"{what} has wire type {wire_type}, expected {wanted}")


# -- ShmRange ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmRange:
    """A block's place in a shared-memory segment (a file in the server's shm directory)."""

    segment: str
    offset: int
    length: int

    def encode(self) -> bytes:
        seg = self.segment.encode("utf-8")
        return b"".join(
            (
                b"\x0a" + _varint(len(seg)) + seg if seg else b"",
                b"\x10" + _varint(self.offset) if self.offset else b"",
                b"\x18" + _varint(self.length) if self.length else b"",
            )
        )


def _decode_shm_range(buf: memoryview, pos: int, end: int) -> ShmRange:
    segment, offset, length = "", 0, 0
    for number, wire_type, value in _fields(buf, pos, end):
        if number == 1:
            _expect(wire_type, 2, "ShmRange.segment")
            segment = bytes(buf[value[0] : value[1]]).decode("utf-8")
        elif number == 2:
            _expect(wire_type, 0, "ShmRange.offset")
            offset = value
        elif number == 3:
            _expect(wire_type, 0, "ShmRange.length")
            length = value
    return ShmRange(segment, offset, length)


# -- PutRequest ------------------------------------------------------------------------------------


BlockData = Buffer | tuple[Buffer, ...]
"""A block as one buffer, or as parts to be concatenated (e.g. header and payload view)."""


@dataclass(frozen=True, slots=True)
class BlockPart:
    """One part of a block sent in parts (Block.more and Block.total_length); see the .proto."""

    data: BlockData
    more: bool
    total_length: int = 0


PutData = BlockData | ShmRange | BlockPart
"""What a PutRequest block carries: the bytes, where they lie in a shared-memory segment, or a part."""


def data_len(data: PutData) -> int:
    """The bytes a Block carries (for a ShmRange, the length of its range; for a part, its bytes)."""
    if isinstance(data, ShmRange):
        return data.length
    if isinstance(data, BlockPart):
        data = data.data
    return sum(len(p) for p in data) if isinstance(data, tuple) else len(data)


def split_block(data: BlockData, part_bytes: int) -> list[BlockPart]:
    """A block as parts of at most `part_bytes` (views, no copy): every part but the last has
    more=True, and the first carries the total length."""
    pieces = data if isinstance(data, tuple) else (data,)
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total = sum(len(v) for v in views)
    parts: list[BlockPart] = []
    current: list[memoryview] = []
    size = 0
    for v in views:
        while len(v):
            take = min(part_bytes - size, len(v))
            current.append(v[:take])
            v = v[take:]
            size += take
            if size == part_bytes:
                parts.append(BlockPart(tuple(current), True))
                current, size = [], 0
    if current:
        parts.append(BlockPart(tuple(current), True))
    if not parts:
        return [BlockPart(b"", False, 0)]
    parts[0] = BlockPart(parts[0].data, True, total)
    parts[-1] = BlockPart(parts[-1].data, False, parts[-1].total_length)
    if len(parts) == 1:  # a block that fits one part is not sent in parts
        return [BlockPart(parts[0].data, False, 0)]
    return parts


def encode_put_request(namespace: str, blocks: Sequence[tuple[bytes, PutData]]) -> bytes:
    """Serialises a PutRequest; each block's bytes (or parts) are copied once, into the result."""
    parts: list[Buffer] = []
    if namespace:
        ns = namespace.encode("utf-8")
        parts += (b"\x0a", _varint(len(ns)), ns)
    for key, data in blocks:
        if isinstance(data, ShmRange):
            ref = data.encode()
            inner = (b"\x0a" + _varint(len(key)) + key if key else b"") + b"\x1a" + _varint(len(ref)) + ref
            parts += (b"\x12", _varint(len(inner)), inner)
            continue
        tail = b""
        if isinstance(data, BlockPart):
            tail = (b"\x20\x01" if data.more else b"") + (
                b"\x28" + _varint(data.total_length) if data.total_length else b""
            )
            data = data.data
        n = data_len(data)
        inner = (b"\x0a" + _varint(len(key)) + key if key else b"") + (b"\x12" + _varint(n) if n else b"")
        parts += (b"\x12", _varint(len(inner) + n + len(tail)), inner)
        if isinstance(data, tuple):
            parts += data
        elif n:
            parts.append(data)
        if tail:
            parts.append(tail)
    return b"".join(parts)


@dataclass(slots=True)
class PutMessage:
    """A decoded PutRequest. `error` is set (and the rest empty) when the bytes did not parse.

    A block's data is bytes, or a read-only memoryview into the message when the block is at
    least half of it (see _decode_block); `block_cost` gives the bytes either one keeps alive.
    """

    namespace: str = ""
    blocks: list[tuple[bytes, Buffer | ShmRange | BlockPart]] = field(default_factory=list)
    error: str = ""


def decode_put_request(data: bytes) -> PutMessage:
    """Parses a PutRequest. Never raises: a malformed message comes back with `error` set,
    so the server can answer INVALID_ARGUMENT instead of failing in gRPC's deserializer."""
    buf = memoryview(data)
    msg = PutMessage()
    try:
        for number, wire_type, value in _fields(buf, 0, len(buf)):
            if number == 1:
                _expect(wire_type, 2, "PutRequest.namespace")
                start, stop = value
                msg.namespace = bytes(buf[start:stop]).decode("utf-8")
            elif number == 2:
                _expect(wire_type, 2, "PutRequest.blocks")
                msg.blocks.append(_decode_block(buf, *value))
    except (WireError, UnicodeDecodeError) as exc:
        return PutMessage(error=f"malformed PutRequest: {exc}")
    return msg


def _decode_block(buf: memoryview, pos: int, end: int) -> tuple[bytes, Buffer | ShmRange | BlockPart]:
    key: bytes = b""
    data: Buffer = b""
    shm: ShmRange | None = None
    more = False
    total_length = 0
    for number, wire_type, value in _fields(buf, pos, end):
        if number == 1:
            _expect(wire_type, 2, "Block.key")
            key = bytes(buf[value[0] : value[1]])
        elif number == 2:
            _expect(wire_type, 2, "Block.data")
            start, stop = value
            # A block that is most of its message (a large block travels alone) is kept as a view:
            # no copy, and pinning the message costs only its few framing bytes. Smaller blocks are
            # copied out so that a kept block never pins its neighbours.
            data = buf[start:stop] if 2 * (stop - start) >= len(buf) else bytes(buf[start:stop])
        elif number == 3:
            _expect(wire_type, 2, "Block.shm")
            shm = _decode_shm_range(buf, *value)
        elif number == 4:
            _expect(wire_type, 0, "Block.more")
            more = bool(value)
        elif number == 5:
            _expect(wire_type, 0, "Block.total_length")
            total_length = value
    if shm is not None:
        if len(data) or more or total_length:
            raise WireError("Block sets shm with data, more or total_length")
        return key, shm
    if more or total_length:
        return key, BlockPart(data, more, total_length)
    return key, data


def block_cost(data: Buffer) -> int:
    """Bytes a block keeps alive: its length, or for a view the whole buffer it views."""
    if isinstance(data, memoryview):
        return len(data.obj)  # type: ignore[arg-type]
    return len(data)


# -- GetResponse -----------------------------------------------------------------------------------


@dataclass(slots=True)
class GetItem:
    """One decoded GetResponse item; `data` is a view into the received message (no copy), or
    empty with `shm` set when the block was written into the request's shared-memory segment."""

    index: int
    found: bool
    data: memoryview | bytes
    tier: int
    shm: ShmRange | None = None
    more: bool = False


@dataclass(frozen=True, slots=True)
class GetPart:
    """Data of a GetItem that holds one part of a block (GetItem.more)."""

    data: Buffer
    more: bool


def encode_get_response(items: Sequence[tuple[int, bool, Buffer | ShmRange | GetPart, int]]) -> bytes:
    """Serialises a GetResponse from (index, found, data or ShmRange or GetPart, tier); block bytes
    are copied once."""
    parts: list[Buffer] = []
    for index, found, data, tier in items:
        more = False
        if isinstance(data, GetPart):
            data, more = data.data, data.more
        if isinstance(data, ShmRange):
            ref = data.encode()
            body = b"".join(
                (
                    b"\x08" + _varint(index) if index else b"",
                    b"\x10\x01" if found else b"",
                    b"\x20" + _varint(tier) if tier else b"",
                    b"\x2a" + _varint(len(ref)) + ref,
                )
            )
            parts += (b"\x0a", _varint(len(body)), body)
            continue
        n = len(data)
        head = b"".join(
            (
                b"\x08" + _varint(index) if index else b"",
                b"\x10\x01" if found else b"",
            )
        )
        tail = (b"\x20" + _varint(tier) if tier else b"") + (b"\x30\x01" if more else b"")
        data_head = b"\x1a" + _varint(n) if n else b""
        parts += (b"\x0a", _varint(len(head) + len(data_head) + n + len(tail)), head, data_head)
        if n:
            parts.append(data)
        parts.append(tail)
    return b"".join(parts)


def decode_get_response(data: bytes) -> list[GetItem]:
    """Parses a GetResponse; items' data are memoryviews into `data`.

    Raises:
        WireError: the bytes are not a GetResponse.
    """
    buf = memoryview(data)
    items: list[GetItem] = []
    for number, wire_type, value in _fields(buf, 0, len(buf)):
        if number != 1:
            continue
        _expect(wire_type, 2, "GetResponse.items")
        item = GetItem(0, False, b"", 0)
        for n, wt, v in _fields(buf, *value):
            if n == 1:
                _expect(wt, 0, "GetItem.index")
                item.index = v
            elif n == 2:
                _expect(wt, 0, "GetItem.found")
                item.found = bool(v)
            elif n == 3:
                _expect(wt, 2, "GetItem.data")
                item.data = buf[v[0] : v[1]]
            elif n == 4:
                _expect(wt, 0, "GetItem.tier")
                item.tier = v
            elif n == 5:
                _expect(wt, 2, "GetItem.shm")
                item.shm = _decode_shm_range(buf, *v)
            elif n == 6:
                _expect(wt, 0, "GetItem.more")
                item.more = bool(v)
        items.append(item)
    return items
