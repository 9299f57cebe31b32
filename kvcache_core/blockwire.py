"""Hand-written protobuf codec for the two messages that carry block bytes: PutRequest and GetResponse.

Why: the generated protobuf classes copy a block three times on each side
(into the message's arena, into the serialised string, and out again when the
field is read), which capped the SDK at about half of what bare gRPC moves.
This codec writes and reads exactly the same wire format as the generated code
(kvcache.v1, proto/kvcache/v1/kvcache.proto), so any client or server built
from the .proto interoperates, but it copies block bytes once when encoding
and not at all when decoding a GetResponse (blocks are memoryviews into the
received message).

    PutRequest  { string namespace = 1; repeated Block blocks = 2; double retain_ttl_s = 3; }
    Block       { bytes key = 1; bytes data = 2; ShmRange shm = 3; bool more = 4; uint64 total_length = 5; }
    ShmRange    { string segment = 1; uint64 offset = 2; uint64 length = 3; uint64 seal_before_ns = 5; }
    GetResponse { repeated GetItem items = 1; }
    GetItem     { uint32 index = 1; bool found = 2; bytes data = 3; Tier tier = 4; ShmRange shm = 5;
                  bool more = 6; }

Wire format: a field is a varint tag (field_number << 3 | wire_type) then its value; wire type 0
is a varint, 1 a fixed 64-bit value, 2 a length-delimited byte string or nested message, 3 and 4
start and end a group, 5 a fixed 32-bit value. The encoders omit fields at their default value,
as proto3 serialisers do.

The decoders accept exactly what the generated code (python protobuf, upb backend) accepts and
produce the same values; tests/test_blockwire_differential.py checks this against kvcache_pb2.
The rules, found by feeding crafted bytes to kvcache_pb2.*.FromString:

- Varints are at most 10 bytes (an 11th byte is an error); their value is taken modulo 2**64
  (bits a 10th byte carries above bit 63 are dropped). Non-minimal encodings are fine.
- A tag is a varint of at most 5 bytes and at most 2**32 - 1, so field numbers above 2**29 - 1
  are refused. Field number 0 is refused in a message but allowed inside a group. Wire types 6
  and 7 are refused everywhere.
- A length is a varint of at most 5 bytes and may not run past the end of the enclosing message.
- Unknown fields of every wire type are skipped; so is a known field sent with another wire type
  (e.g. `blocks` as a varint, `tier` as a packed length-delimited run: no field here is repeated
  scalar, so no packed encoding applies). Only known string fields are checked as UTF-8.
- A group (wire type 3) is skipped up to the end-group (wire type 4) with the same field number;
  a mismatched end-group, an end-group outside a group, or a group left open at the end of its
  message is refused. Groups and sub-messages nest at most 100 deep (the top-level message is
  depth 0; a Block or GetItem is 1, its ShmRange 2).
- A scalar or bytes field seen twice keeps the last value. A sub-message field seen twice
  (Block.shm, GetItem.shm) is parsed into the same message, as if its occurrences were
  concatenated: fields in a later occurrence overwrite, others stay. `shm` present but empty is
  still present. Repeated `blocks` and `items` add one element per occurrence.
- uint32 `index` keeps the low 32 bits; `tier` (an open enum, int32) the low 32 bits as a signed
  value, unknown values kept; bool is value != 0 over all 64 bits; uint64 fields the value.
- `string` fields (namespace, segment) must be valid UTF-8 as Python's strict codec defines it
  (no surrogates, overlong forms or code points above U+10FFFF); an invalid occurrence is an
  error even if a later one would replace it.
- Truncated input anywhere (tag, varint, fixed value, length, group) is refused; the empty
  message is valid.

Decoding only decodes. A Block that sets `shm` together with data, more or total_length is
parsed as a MixedBlock; check_put_message (validation) makes one with data alone a ShmRange with
that data as its `head`, and refuses one with more or total_length; decode_put_request (what the
server registers) does both.

Longer than the project's ~500-line module guideline: one codec whose decoder must match protobuf's rules
exactly (the docstring lists them); the rules and the code that follows them are kept together.
"""

from __future__ import annotations

import struct
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


_MASK64 = (1 << 64) - 1
_MAX_DEPTH = 100  # how deep groups and sub-messages may nest (the top-level message is depth 0)


def _read_varint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` (at most 10 bytes, taken modulo 2**64) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift == 70:
            raise WireError("varint longer than 10 bytes")


def _read_tag(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The tag at `pos`: a varint of at most 5 bytes and 32 bits."""
    tag, stop = _read_varint(buf, pos, end)
    if stop - pos > 5 or tag > 0xFFFFFFFF:
        raise WireError("tag longer than 5 bytes or 32 bits")
    return tag, stop


def _read_length(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
    """The length prefix at `pos` (a varint of at most 5 bytes) and the position after it; the
    bytes it announces must lie before `end`."""
    length, stop = _read_varint(buf, pos, end)
    if stop - pos > 5:
        raise WireError("length prefix longer than 5 bytes")
    if length > end - stop:
        raise WireError("length-delimited field runs past the end of its message")
    return length, stop


def _skip(buf: Buffer, pos: int, end: int, tag: int, depth: int) -> int:
    """Skips the value of a field nobody reads (unknown, or known but sent with another wire
    type) whose tag ends at `pos`, in a message or group at `depth`; returns the position after it."""
    wire_type = tag & 7
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 2:
        length, pos = _read_length(buf, pos, end)
        return pos + length
    if wire_type == 1 or wire_type == 5:
        size = 8 if wire_type == 1 else 4
        if end - pos < size:
            raise WireError("truncated fixed-size field")
        return pos + size
    if wire_type == 3:
        return _skip_group(buf, pos, end, tag >> 3, depth + 1)
    if wire_type == 4:
        raise WireError("end-group outside a group")
    raise WireError(f"invalid wire type {wire_type}")


def _skip_field(buf: Buffer, pos: int, end: int, tag: int, depth: int) -> int:
    """_skip for a field of a message (not of a group), where field number 0 is refused."""
    if tag < 8:
        raise WireError("field number 0")
    return _skip(buf, pos, end, tag, depth)


def _skip_group(buf: Buffer, pos: int, end: int, number: int, depth: int) -> int:
    """Skips a group's fields (field number 0 allowed) up to its end-group; returns the position after it."""
    if depth > _MAX_DEPTH:
        raise WireError("groups nested too deeply")
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_tag(buf, pos, end)
        if tag & 7 == 4:
            if tag >> 3 != number:
                raise WireError("end-group does not match its group")
            return pos
        pos = _skip(buf, pos, end, tag, depth)
    raise WireError("group not closed before the end of its message")


def _buffers(data: Buffer) -> tuple[Buffer, memoryview]:
    """`data` to index (a bytes object indexes fastest) and a flat byte view of it to slice without copying."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return (data if type(data) is bytes else view), view


# -- ShmRange ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShmRange:
    """A block's place in a shared-memory segment (a file in the server's shm directory, a memfd
    handed over its socket) or, for a segment that names a client process registered there, in that
    process's memory (`offset` is then an address).

    `head`, in a PutRequest only: the block's first bytes, sent inline (Block.data beside Block.shm),
    followed by the range: the block is head + range (a header built apart from its payload).
    `seal_before_ns`, in a PutRequest only, nonzero: the server computes the block's checksum from
    what it read and writes it into the header, whose checksum field is 0, and stores it only if it
    read it before this CLOCK_MONOTONIC time (docs/shm.md, "Checksums computed by the server")."""

    segment: str
    offset: int
    length: int
    head: bytes = b""
    seal_before_ns: int = 0

    @property
    def seal(self) -> bool:
        """Whether the server is to compute the block's checksum (seal_before_ns is set)."""
        return self.seal_before_ns != 0

    @property
    def block_length(self) -> int:
        """The block's bytes: the head's and the range's."""
        return len(self.head) + self.length

    def encode(self) -> bytes:
        seg = self.segment.encode("utf-8")
        return b"".join(
            (
                b"\x0a" + _varint(len(seg)) + seg if seg else b"",
                b"\x10" + _varint(self.offset) if self.offset else b"",
                b"\x18" + _varint(self.length) if self.length else b"",
                b"\x28" + _varint(self.seal_before_ns) if self.seal_before_ns else b"",
            )
        )


def _decode_shm_range(buf: Buffer, pos: int, end: int, into: ShmRange | None, depth: int) -> ShmRange:
    """Parses one occurrence of a ShmRange field; a later occurrence merges into the earlier (`into`)."""
    segment, offset, length, seal_before_ns = ("", 0, 0, 0)
    if into is not None:
        segment, offset, length, seal_before_ns = into.segment, into.offset, into.length, into.seal_before_ns
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_tag(buf, pos, end)
        if tag == 0x0A:
            n, pos = _read_length(buf, pos, end)
            segment = str(buf[pos : pos + n], "utf-8")
            pos += n
        elif tag == 0x10:
            offset, pos = _read_varint(buf, pos, end)
        elif tag == 0x18:
            length, pos = _read_varint(buf, pos, end)
        elif tag == 0x28:
            seal_before_ns, pos = _read_varint(buf, pos, end)
        else:
            pos = _skip_field(buf, pos, end, tag, depth)
    return ShmRange(segment, offset, length, seal_before_ns=seal_before_ns)


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
    if type(data) is tuple:  # (header, payload): the commonest, first
        return sum(map(len, data))
    if isinstance(data, ShmRange):
        return data.block_length
    if isinstance(data, BlockPart):
        data = data.data
    return sum(map(len, data)) if isinstance(data, tuple) else len(data)


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


def encode_put_request(namespace: str, blocks: Sequence[tuple[bytes, PutData]], retain_ttl_s: float = 0.0) -> bytes:
    """Serialises a PutRequest; each block's bytes (or parts) are copied once, into the result."""
    parts: list[Buffer] = []
    if namespace:
        ns = namespace.encode("utf-8")
        parts += (b"\x0a", _varint(len(ns)), ns)
    if retain_ttl_s:
        parts += (b"\x19", struct.pack("<d", retain_ttl_s))
    for key, data in blocks:
        if isinstance(data, ShmRange):
            ref = data.encode()
            head = b"\x12" + _varint(len(data.head)) + data.head if data.head else b""  # Block.data: the head
            inner = (b"\x0a" + _varint(len(key)) + key if key else b"") + head + b"\x1a" + _varint(len(ref)) + ref
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


@dataclass(frozen=True, slots=True)
class MixedBlock:
    """A Block that sets `shm` together with data, more or total_length. Protobuf decodes it, so
    parse_put_request does; check_put_message makes one with data alone a ShmRange with a head, and
    refuses one with more or total_length (not a valid Put block)."""

    data: Buffer
    shm: ShmRange
    more: bool
    total_length: int


@dataclass(slots=True)
class PutMessage:
    """A decoded PutRequest. `error` is set (and the rest empty) when the bytes did not parse.

    A block's data is bytes, or a read-only memoryview into the message when the block is at
    least half of it (see _decode_block); `block_cost` gives the bytes either one keeps alive.
    Only parse_put_request leaves MixedBlock values in `blocks`.
    """

    namespace: str = ""
    blocks: list[tuple[bytes, Buffer | ShmRange | BlockPart | MixedBlock]] = field(default_factory=list)
    error: str = ""
    over_limit: bool = False  # with `error`: the message holds more blocks than the caller allowed
    retain_ttl_s: float = 0.0  # PutRequest.retain_ttl_s (a double), unchecked


def decode_put_request(data: Buffer, max_blocks: int | None = None) -> PutMessage:
    """Parses and checks a PutRequest (parse_put_request, then check_put_message). Never raises:
    a malformed or invalid message comes back with `error` set, so the server can answer
    INVALID_ARGUMENT instead of failing in gRPC's deserializer (RESOURCE_EXHAUSTED when
    `over_limit`: more than `max_blocks` blocks)."""
    return check_put_message(parse_put_request(data, max_blocks))


def check_put_message(msg: PutMessage) -> PutMessage:
    """`msg` with each block that sets shm and data (and neither more nor total_length) turned into a
    ShmRange whose `head` is that data (the block's first bytes, then the range); or a PutMessage with
    `error` set if a block sets shm together with more or total_length (decodable, not a valid Put)."""
    for i, (key, data) in enumerate(msg.blocks):
        if type(data) is MixedBlock:
            if data.more or data.total_length:
                return PutMessage(error="malformed PutRequest: Block sets shm with more or total_length")
            shm = data.shm
            msg.blocks[i] = (key, ShmRange(shm.segment, shm.offset, shm.length, bytes(data.data), shm.seal_before_ns))
    return msg


def parse_put_request(data: Buffer, max_blocks: int | None = None) -> PutMessage:
    """Decodes a PutRequest exactly as the generated code would (see the module docstring), without
    validating it. Never raises: bytes protobuf refuses come back with `error` set.

    With `max_blocks`, parsing stops as soon as the message turns out to hold more blocks than that
    (`error` set, `over_limit` true): a small message of millions of empty blocks costs no more
    than the limit allows, however large it is.
    """
    limit = -1 if max_blocks is None else max_blocks
    buf, view = _buffers(data)
    end = len(view)
    msg = PutMessage()
    blocks = msg.blocks
    pos = 0
    try:
        while pos < end:
            tag = buf[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = _read_tag(buf, pos, end)
            if tag == 0x12:  # blocks
                n, pos = _read_length(buf, pos, end)
                if len(blocks) == limit:
                    return PutMessage(error=f"PutRequest holds more than {limit} blocks", over_limit=True)
                blocks.append(_decode_block(buf, view, pos, pos + n))
                pos += n
            elif tag == 0x0A:  # namespace
                n, pos = _read_length(buf, pos, end)
                msg.namespace = str(buf[pos : pos + n], "utf-8")
                pos += n
            elif tag == 0x19:  # retain_ttl_s, a double (fixed 64 bits, little-endian)
                if pos + 8 > end:
                    raise WireError("truncated fixed-size field")
                (msg.retain_ttl_s,) = struct.unpack_from("<d", buf, pos)
                pos += 8
            else:
                pos = _skip_field(buf, pos, end, tag, 0)
    except (WireError, UnicodeDecodeError) as exc:
        return PutMessage(error=f"malformed PutRequest: {exc}")
    return msg


def _decode_block(
    buf: Buffer, view: memoryview, pos: int, end: int
) -> tuple[bytes, Buffer | ShmRange | BlockPart | MixedBlock]:
    key: bytes = b""
    data: Buffer = b""
    shm: ShmRange | None = None
    more = False
    total_length = 0
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_tag(buf, pos, end)
        if tag == 0x12:  # data
            n, pos = _read_length(buf, pos, end)
            # A block that is most of its message (a large block travels alone) is kept as a view:
            # no copy, and pinning the message costs only its few framing bytes. Smaller blocks are
            # copied out so that a kept block never pins its neighbours.
            data = view[pos : pos + n] if 2 * n >= len(view) else bytes(buf[pos : pos + n])
            pos += n
        elif tag == 0x0A:  # key
            n, pos = _read_length(buf, pos, end)
            key = bytes(buf[pos : pos + n])
            pos += n
        elif tag == 0x1A:  # shm
            n, pos = _read_length(buf, pos, end)
            shm = _decode_shm_range(buf, pos, pos + n, shm, 2)
            pos += n
        elif tag == 0x20:  # more
            value, pos = _read_varint(buf, pos, end)
            more = value != 0
        elif tag == 0x28:  # total_length
            total_length, pos = _read_varint(buf, pos, end)
        else:
            pos = _skip_field(buf, pos, end, tag, 1)
    if shm is not None:
        if len(data) or more or total_length:
            return key, MixedBlock(data, shm, more, total_length)
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


def decode_get_response(data: Buffer) -> list[GetItem]:
    """Parses a GetResponse exactly as the generated code would (see the module docstring); items'
    data are memoryviews into `data`.

    Raises:
        WireError: the bytes are not a GetResponse (protobuf would refuse them).
    """
    buf, view = _buffers(data)
    end = len(view)
    items: list[GetItem] = []
    pos = 0
    try:
        while pos < end:
            tag = buf[pos]
            if tag < 0x80:
                pos += 1
            else:
                tag, pos = _read_tag(buf, pos, end)
            if tag == 0x0A:  # items
                n, pos = _read_length(buf, pos, end)
                items.append(_decode_get_item(buf, view, pos, pos + n))
                pos += n
            else:
                pos = _skip_field(buf, pos, end, tag, 0)
    except UnicodeDecodeError as exc:
        raise WireError(f"malformed GetResponse: {exc}") from None
    return items


def _decode_get_item(buf: Buffer, view: memoryview, pos: int, end: int) -> GetItem:
    index = tier = 0
    found = more = False
    data: memoryview | bytes = b""
    shm: ShmRange | None = None
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _read_tag(buf, pos, end)
        if tag == 0x1A:  # data
            n, pos = _read_length(buf, pos, end)
            data = view[pos : pos + n]
            pos += n
        elif tag == 0x08:  # index: uint32
            value, pos = _read_varint(buf, pos, end)
            index = value & 0xFFFFFFFF
        elif tag == 0x10:  # found
            value, pos = _read_varint(buf, pos, end)
            found = value != 0
        elif tag == 0x20:  # tier: an open enum, int32
            value, pos = _read_varint(buf, pos, end)
            value &= 0xFFFFFFFF
            tier = value - ((value & 0x80000000) << 1)
        elif tag == 0x2A:  # shm
            n, pos = _read_length(buf, pos, end)
            shm = _decode_shm_range(buf, pos, pos + n, shm, 2)
            pos += n
        elif tag == 0x30:  # more
            value, pos = _read_varint(buf, pos, end)
            more = value != 0
        else:
            pos = _skip_field(buf, pos, end, tag, 1)
    return GetItem(index, found, data, tier, shm, more)
