"""The block format, version 2: a small versioned header followed by the payload, bound to its key.

Specified byte by byte in docs/format.md. All integers little-endian.

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic         b"KVCB"
         4     2  version       u16, 2
         6     2  header_len    u16, 40 + 8 * ndim (bytes before the payload)
         8     1  dtype         u8, a DType code
         9     1  layout        u8, a Layout code
        10     1  compression   u8, a Compression code
        11     1  ndim          u8, 0..8
        12     4  reserved      zero
        16     8  payload_len   u64, bytes after the header (as stored)
        24     8  raw_len       u64, payload bytes before compression
        32     8  checksum      u64, XXH3-64 (seed 0) of key || descriptor || raw payload
        40   8*n  shape         u64 each
    header_len    payload       payload_len bytes

    key        = the 16-byte chunk key the block is stored under
    descriptor = u8 dtype || u8 layout || u8 ndim || u64 raw_len || shape

The checksum covers the key the block was made for, what the payload means
(dtype, layout, shape) and its uncompressed bytes: a block is valid only under
its own key (a block that lands under another key, by a race, a tier bug or a
hand copy, fails verification instead of being served as another prompt's KV),
it survives a tier recompressing it, and it catches a flipped shape as well as
a flipped payload bit. Verifying therefore needs the key: every reader knows the
key it asked for. Version 1 blocks (checksum without the key) are refused, never
served: nothing can tell which key they were made for. This module never imports torch.

Longer than the project's ~500-line module guideline: every reader and writer of the layout above
(encoding, parsing, verifying whole or piece by piece, sealing a header the server checksums) stays
beside the table, so that a change to the layout is seen with everything that reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvcache_core.errors import BlockFormatError, ChecksumMismatch, UnknownFormatVersion
from kvcache_core.keys import KEY_BYTES

MAGIC = b"KVCB"
FORMAT_VERSION = 2
LEGACY_VERSION = 1
"""Blocks of version 1 had a checksum that did not cover the key; they are refused (docs/format.md)."""
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHHBBBBIQQQ")
FIXED_HEADER_BYTES = _FIXED.size  # 40


class DType(enum.IntEnum):
    """Element types a block may hold; the name is torch's dtype name."""

    UINT8 = 0  # opaque bytes
    INT8 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT32 = 4
    FLOAT8_E4M3FN = 5
    FLOAT8_E5M2 = 6
    FLOAT64 = 7

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def from_name(cls, name: str) -> DType:
        """ "bfloat16" or "torch.bfloat16" -> DType.BFLOAT16."""
        key = name.removeprefix("torch.").upper()
        try:
            return cls[key]
        except KeyError:
            raise ValueError(f"unsupported dtype {name!r}; supported: {[d.name.lower() for d in cls]}") from None


_ITEMSIZE = {
    DType.UINT8: 1,
    DType.INT8: 1,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT8_E4M3FN: 1,
    DType.FLOAT8_E5M2: 1,
    DType.FLOAT64: 8,
}


class Layout(enum.IntEnum):
    """How the payload's dimensions are to be read."""

    RAW = 0  # no claim: any shape
    CANONICAL = 1  # [num_layers, 2 (K, V), num_kv_heads, chunk_tokens, head_size]
    MLA = 2  # [num_layers, chunk_tokens, head_size]


class Compression(enum.IntEnum):
    """Payload encodings. Clients send NONE; tiers may store others."""

    NONE = 0
    LZ4 = 1
    SHUFFLE_LZ4 = 2  # byte-shuffle by itemsize, then LZ4


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed block header."""

    dtype: DType
    layout: Layout
    compression: Compression
    shape: tuple[int, ...]
    payload_len: int
    raw_len: int
    checksum: int
    version: int = FORMAT_VERSION

    @property
    def header_len(self) -> int:
        return FIXED_HEADER_BYTES + 8 * len(self.shape)

    @property
    def block_len(self) -> int:
        return self.header_len + self.payload_len

    def pack(self) -> bytes:
        return _FIXED.pack(
            MAGIC,
            self.version,
            self.header_len,
            self.dtype,
            self.layout,
            self.compression,
            len(self.shape),
            0,
            self.payload_len,
            self.raw_len,
            self.checksum,
        ) + struct.pack(f"<{len(self.shape)}Q", *self.shape)


_DTYPES: dict[int, DType] = {d.value: d for d in DType}
_LAYOUTS: dict[int, Layout] = {x.value: x for x in Layout}
_COMPRESSIONS: dict[int, Compression] = {c.value: c for c in Compression}


def _descriptor(dtype: int, layout: int, shape: Sequence[int], raw_len: int) -> bytes:
    return struct.pack(f"<BBBQ{len(shape)}Q", dtype, layout, len(shape), raw_len, *shape)


def check_key(key: bytes) -> bytes:
    """`key` as bytes, if it is a block key (16 bytes).

    Raises:
        BlockFormatError: it is not.
    """
    if not isinstance(key, bytes | bytearray | memoryview) or len(key) != KEY_BYTES:
        raise BlockFormatError(f"a block's key is {KEY_BYTES} bytes, got {key!r:.60}")
    return bytes(key)


def compute_checksum(key: bytes, dtype: int, layout: int, shape: Sequence[int], raw_payload: memoryview | bytes) -> int:
    """XXH3-64 (seed 0) of key || descriptor || raw payload (no copy of the payload).

    Raises:
        BlockFormatError: `key` is not 16 bytes.
    """
    h = xxhash.xxh3_64(check_key(key) + _descriptor(dtype, layout, shape, len(raw_payload)))
    h.update(raw_payload)
    return h.intdigest()


def _check_shape(layout: Layout, shape: Sequence[int]) -> None:
    if len(shape) > MAX_NDIM:
        raise BlockFormatError(f"shape has {len(shape)} dimensions, at most {MAX_NDIM} allowed")
    if shape and min(shape) < 0:
        raise BlockFormatError(f"negative dimension in shape {tuple(shape)}")
    if layout is Layout.CANONICAL and (len(shape) != 5 or shape[1] != 2):
        raise BlockFormatError(
            f"canonical layout needs shape [layers, 2, kv_heads, tokens, head_size], got {tuple(shape)}"
        )
    if layout is Layout.MLA and len(shape) != 3:
        raise BlockFormatError(f"MLA layout needs shape [layers, tokens, head_size], got {tuple(shape)}")


BlockParts = tuple[bytes, "bytes | memoryview"]
"""A block not yet joined: (header, payload view). Sent as is, its payload is copied once, into the message."""


def encode_block_parts(
    payload: bytes | bytearray | memoryview,
    *,
    key: bytes,
    dtype: DType | str,
    shape: Sequence[int],
    layout: Layout = Layout.RAW,
    checksum: bool = True,
) -> BlockParts:
    """The header of a block for `payload` under `key`, and the payload itself, without copying it.

    `KVCacheClient.put_many` takes parts as well as whole blocks: the payload is then
    copied once, straight into the gRPC message. Keep `payload` unchanged until the put returns.
    The block is valid only when stored under `key` (its checksum covers it). With checksum=False
    the header's checksum field is 0, for a put the server seals (seal_parts computes it here).

    Raises:
        BlockFormatError: `key` is not 16 bytes, the shape and dtype disagree with the
            payload length, or the shape does not fit the layout.
    """
    dt = DType.from_name(dtype) if isinstance(dtype, str) else DType(dtype)
    layout = Layout(layout)
    shape = tuple(int(d) for d in shape)
    _check_shape(layout, shape)
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    raw_len = len(view)
    if math.prod(shape) * dt.itemsize != raw_len:
        raise BlockFormatError(f"payload of {raw_len} bytes does not hold shape {shape} of {dt.name.lower()}")
    header = BlockHeader(
        dtype=dt,
        layout=layout,
        compression=Compression.NONE,
        shape=shape,
        payload_len=raw_len,
        raw_len=raw_len,
        checksum=compute_checksum(key, dt, layout, shape, view) if checksum else 0,
    )
    if not checksum:
        check_key(key)
    return header.pack(), view


def encode_bytes_parts(keys: Sequence[bytes], payloads: Sequence[bytes | bytearray | memoryview]) -> list[BlockParts]:
    """[encode_block_parts(p, key=k, dtype=DType.UINT8, shape=(memoryview(p).nbytes,)) for k, p in ...],
    byte for byte: each payload's bytes as one flat uint8 block, whatever its buffer's format or
    dimensions, for the engines' opaque chunks (LMCache's objects, SGLang's page segments, vLLM's
    offload blocks): the descriptor made once per payload size and the header packed in one call, not
    a BlockHeader per block (a store of 128 SGLang MHA segments of 384 KiB spent 3.3 ms encoding, 2.4
    this way). No size is checked against anything: a caller that expects a size checks it. Keep each
    payload unchanged until its put returns.

    Raises:
        ValueError: not one payload per key.
        TypeError: a payload is not C-contiguous.
        BlockFormatError: a key is not 16 bytes.
    """
    if len(keys) != len(payloads):
        raise ValueError(f"{len(keys)} keys for {len(payloads)} payloads")
    descriptors: dict[int, bytes] = {}
    out: list[BlockParts] = []
    for key, payload in zip(keys, payloads, strict=True):
        view = payload if isinstance(payload, bytes) else memoryview(payload).cast("B")
        n = len(view)
        descriptor = descriptors.get(n)
        if descriptor is None:
            descriptor = descriptors[n] = _descriptor(DType.UINT8, Layout.RAW, (n,), n)
        h = xxhash.xxh3_64(check_key(key) + descriptor)
        h.update(view)
        header = _FIXED.pack(
            MAGIC, FORMAT_VERSION, _RAW_1D_HEADER_BYTES, DType.UINT8, Layout.RAW, Compression.NONE, 1, 0, n, n,
            h.intdigest(),
        ) + _DIM.pack(n)  # fmt: skip
        out.append((header, view))
    return out


_RAW_1D_HEADER_BYTES = FIXED_HEADER_BYTES + 8
_DIM = struct.Struct("<Q")


def encode_block(
    payload: bytes | bytearray | memoryview,
    *,
    key: bytes,
    dtype: DType | str,
    shape: Sequence[int],
    layout: Layout = Layout.RAW,
) -> bytes:
    """Builds the block of `payload` under `key` (header + payload) as one bytes object; the payload is copied once.

    Raises:
        BlockFormatError: see encode_block_parts.
    """
    return b"".join(encode_block_parts(payload, key=key, dtype=dtype, shape=shape, layout=layout))


def parse_header(data: bytes | memoryview, block_len: int | None = None) -> BlockHeader:
    """Parses and structurally validates a block's header (not its checksum). `data` is the whole
    block, or with `block_len` (the whole block's length) at least its header.

    Raises:
        UnknownFormatVersion: the version is not FORMAT_VERSION (version 1 included: its
            checksum does not cover the key, so it is never accepted).
        BlockFormatError: anything else malformed, including a payload length
            that disagrees with len(data).
    """
    if len(data) < FIXED_HEADER_BYTES:
        raise BlockFormatError(f"block of {len(data)} bytes is shorter than the {FIXED_HEADER_BYTES}-byte header")
    (magic, version, header_len, dtype, layout, compression, ndim, reserved, payload_len, raw_len, checksum) = (
        _FIXED.unpack_from(data, 0)
    )
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version == LEGACY_VERSION:
        raise UnknownFormatVersion(
            f"block format version {LEGACY_VERSION} is refused: its checksum does not cover the key, so it cannot "
            f"be told apart from another key's block (re-encode it as version {FORMAT_VERSION}; docs/format.md)"
        )
    if version != FORMAT_VERSION:
        raise UnknownFormatVersion(f"unknown block format version {version} (this build knows {FORMAT_VERSION})")
    if ndim > MAX_NDIM:
        raise BlockFormatError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if header_len != FIXED_HEADER_BYTES + 8 * ndim:
        raise BlockFormatError(f"header_len {header_len} does not match ndim {ndim}")
    if reserved != 0:
        raise BlockFormatError("reserved header bytes are not zero")
    if len(data) < header_len:
        raise BlockFormatError(f"block of {len(data)} bytes is shorter than its {header_len}-byte header")
    dt, lay, comp = _DTYPES.get(dtype), _LAYOUTS.get(layout), _COMPRESSIONS.get(compression)
    if dt is None or lay is None or comp is None:  # dicts, not Enum(code): a header per block read
        raise BlockFormatError(f"unknown code in header: dtype {dtype}, layout {layout}, compression {compression}")
    shape = struct.unpack_from(f"<{ndim}Q", data, FIXED_HEADER_BYTES)
    _check_shape(lay, shape)
    block_len = len(data) if block_len is None else block_len
    if payload_len != block_len - header_len:
        raise BlockFormatError(f"header says {payload_len} payload bytes, block carries {block_len - header_len}")
    if math.prod(shape) * dt.itemsize != raw_len:
        raise BlockFormatError(f"raw_len {raw_len} does not match shape {shape} of {dt.name.lower()}")
    if comp is Compression.NONE and payload_len != raw_len:
        raise BlockFormatError(f"uncompressed block with payload_len {payload_len} != raw_len {raw_len}")
    return BlockHeader(
        dtype=dt,
        layout=lay,
        compression=comp,
        shape=tuple(shape),
        payload_len=payload_len,
        raw_len=raw_len,
        checksum=checksum,
        version=version,
    )


def verify_block(data: bytes | memoryview, key: bytes) -> BlockHeader:
    """Parses the header and checks the checksum of an uncompressed block against `key`, the key
    it is stored under (or was asked for).

    Raises:
        BlockFormatError, UnknownFormatVersion: see parse_header; also for a
            compressed block (decompress it first), or a key that is not 16 bytes.
        ChecksumMismatch: the block does not match its checksum under `key`: its bytes
            are damaged, or it is another key's block.
    """
    header = parse_header(data)
    return _check_payload(header, key, memoryview(data)[header.header_len :], "the block is damaged")


def verify_block_in_pieces(
    data: memoryview,
    key: bytes,
    fill: Callable[[int, int], None],
    piece_bytes: int = 256 << 10,
    *,
    seal: bool = False,
) -> BlockHeader:
    """verify_block of a block that fill(start, end) writes into data[start:end], piece by piece in
    order: each piece is hashed right after it landed, while it is in the core's cache, instead of a
    second pass over the whole block from memory (a 32 MiB block read out of a segment and verified:
    2.6 GB/s against 2.2). The header is parsed from the first piece, so a malformed one stops the
    reading there. What is hashed is what lies in `data`, after each piece was written.

    With `seal`, the block's header carries checksum 0 and the checksum computed here is written
    into it (`data` is writable): seal_block, fused with the copy.

    Raises:
        as verify_block (with `seal`, BlockFormatError for a header whose checksum is not 0), and
        whatever `fill` raises.
    """
    first = min(len(data), max(piece_bytes, FIXED_HEADER_BYTES + 8 * MAX_NDIM))
    fill(0, first)
    header = parse_header(data)
    if seal:
        _check_unsealed(header)
    h = _payload_hasher(header, key)
    h.update(data[header.header_len : first])
    for start in range(first, len(data), piece_bytes):
        end = min(len(data), start + piece_bytes)
        fill(start, end)
        h.update(data[start:end])
    if seal:
        return _sealed(data, header, h.intdigest())
    return _matched(header, key, h.intdigest(), "the block is damaged")


CHECKSUM_AT = 32
"""Where a header's checksum field lies (the table above)."""


def unsealed_bytes_header(n: int) -> bytes:
    """The header encode_bytes_parts gives a payload of `n` bytes (one flat uint8 block), with its
    checksum field 0: the head of a put whose checksum the server computes (ShmRange.seal)."""
    return _FIXED.pack(
        MAGIC, FORMAT_VERSION, _RAW_1D_HEADER_BYTES, DType.UINT8, Layout.RAW, Compression.NONE, 1, 0, n, n, 0
    ) + _DIM.pack(n)  # fmt: skip


def seal_block(data: bytearray | memoryview, key: bytes) -> BlockHeader:
    """Computes the checksum under `key` of a whole block whose header carries checksum 0 and writes
    it into the header, in place: the server's side of a put the client left unsealed, for bytes
    that already lie where no client can change them.

    Raises:
        BlockFormatError, UnknownFormatVersion: as parse_header; a compressed block, a key that is
            not 16 bytes, or a header whose checksum field is not 0.
    """
    view = memoryview(data)
    header = parse_header(view)
    _check_unsealed(header)
    h = _payload_hasher(header, key)
    h.update(view[header.header_len :])
    return _sealed(view, header, h.intdigest())


def seal_parts(key: bytes, header: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """`header` (checksum field 0, as encode_block_parts(checksum=False) makes it) with its block's
    checksum under `key` written in: the parts of a block the server did not seal, sealed here.

    Raises:
        BlockFormatError: as seal_block, or a payload of another length than the header's.
        TypeError: the payload is not C-contiguous.
    """
    view = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    parsed = parse_header(header, block_len=len(header) + len(view))
    _check_unsealed(parsed)
    h = _payload_hasher(parsed, key)
    h.update(view)
    out = bytearray(header)
    struct.pack_into("<Q", out, CHECKSUM_AT, h.intdigest())
    return bytes(out)


def _check_unsealed(header: BlockHeader) -> None:
    if header.checksum:
        raise BlockFormatError("a block the server is to seal must carry checksum 0 in its header")


def _sealed(data: memoryview, header: BlockHeader, checksum: int) -> BlockHeader:
    struct.pack_into("<Q", data, CHECKSUM_AT, checksum)
    return dataclasses.replace(header, checksum=checksum)


def verify_payload_in_pieces(
    header: BlockHeader, key: bytes, payload: memoryview, fill: Callable[[int, int], None], piece_bytes: int = 256 << 10
) -> BlockHeader:
    """verify_block_in_pieces for a payload that lands apart from its header (already parsed, e.g.
    by parse_header with block_len): fill(start, end) writes payload[start:end], piece by piece in
    order, each piece hashed right after it landed. What is hashed is what lies in `payload`.

    Raises:
        BlockFormatError: `payload` is not the header's payload length, or the block is compressed.
        ChecksumMismatch: as verify_block; whatever `fill` raises.
    """
    if len(payload) != header.payload_len:
        raise BlockFormatError(f"a payload of {len(payload)} bytes for a header of {header.payload_len}")
    h = _payload_hasher(header, key)
    for start in range(0, len(payload), piece_bytes):
        end = min(len(payload), start + piece_bytes)
        fill(start, end)
        h.update(payload[start:end])
    return _matched(header, key, h.intdigest(), "the block is damaged")


def parse_header_for_payload(data: bytes | memoryview, payload_len: int) -> BlockHeader:
    """parse_header of a block whose payload is `payload_len` bytes, from `data` holding at least its
    header (the first part of a block sent in parts, read before the rest has come).

    Raises:
        as parse_header.
    """
    if len(data) < FIXED_HEADER_BYTES:
        raise BlockFormatError(f"{len(data)} bytes are shorter than the {FIXED_HEADER_BYTES}-byte header")
    header_len = struct.unpack_from("<H", data, 6)[0]
    return parse_header(data, block_len=header_len + payload_len)


def payload_seed(header: BlockHeader) -> bytes:
    """What a block's checksum hashes between its key and its payload (its dtype, layout, shape and
    raw length): the checksum is XXH3-64 of key + payload_seed(header) + payload."""
    return _descriptor(header.dtype, header.layout, header.shape, header.payload_len)


def payload_hasher(header: BlockHeader, key: bytes) -> xxhash.xxh3_64:
    """The hash a block's checksum is, seeded for its key and descriptor, to feed its payload to
    (in pieces, as they arrive); then matched(header, key, hasher.intdigest())."""
    return _payload_hasher(header, key)


def matched(header: BlockHeader, key: bytes, actual: int) -> BlockHeader:
    """`header`, if `actual` is its checksum under `key`.

    Raises:
        ChecksumMismatch: it is not (the block is damaged, or another key's).
    """
    return _matched(header, key, actual, "the block is damaged")


def _payload_hasher(header: BlockHeader, key: bytes) -> xxhash.xxh3_64:
    """compute_checksum's hash, seeded with key || descriptor, for the payload to be fed to it."""
    if header.compression is not Compression.NONE:
        raise BlockFormatError(f"block is compressed ({header.compression.name}); decompress before verifying")
    return xxhash.xxh3_64(check_key(key) + _descriptor(header.dtype, header.layout, header.shape, header.payload_len))


def _check_payload(header: BlockHeader, key: bytes, payload: memoryview, damaged: str) -> BlockHeader:
    """verify_block's and verify_copy's check of `payload` against `header`'s checksum under `key`."""
    h = _payload_hasher(header, key)
    h.update(payload)
    return _matched(header, key, h.intdigest(), damaged)


def _matched(header: BlockHeader, key: bytes, actual: int, damaged: str) -> BlockHeader:
    """`header`, if `actual` is its checksum; else ChecksumMismatch saying what may be `damaged`."""
    if actual != header.checksum:
        raise ChecksumMismatch(
            f"checksum mismatch under key {bytes(key).hex()}: header {header.checksum:016x}, computed {actual:016x} "
            f"({damaged} or belongs to another key)"
        )
    return header


def verify_copy(block: bytes | memoryview, key: bytes, payload: bytes | bytearray | memoryview) -> BlockHeader:
    """Checks a copy of a block's payload (`payload`, wherever it was copied to) against the
    checksum in `block`'s header under `key`: for a caller that copies first and verifies the bytes
    where they landed, the only place whose verification says what the caller will use
    (KVCacheClient.leased(verify=False)).

    Raises:
        BlockFormatError: as verify_block, or `payload` is not the header's payload length.
        ChecksumMismatch: the copy does not match: the block (or the copy) is damaged, or it is
            another key's block.
    """
    header = parse_header(block)
    view = memoryview(payload).cast("B")
    if len(view) != header.payload_len:
        raise BlockFormatError(f"a copy of {len(view)} bytes of a {header.payload_len}-byte payload")
    return _check_payload(header, key, view, "the copy is damaged, or the block is,")


def payload_view(data: bytes | memoryview, header: BlockHeader | None = None) -> memoryview:
    """The payload of a block as a memoryview into `data` (no copy)."""
    header = header or parse_header(data)
    return memoryview(data)[header.header_len :]


def decode_block(
    data: bytes | memoryview, key: bytes | None = None, *, verify: bool = True
) -> tuple[BlockHeader, memoryview]:
    """Splits a block into its header and a zero-copy view of its payload.

    Args:
        data: The whole block.
        key: The key the block is stored under; required when verifying.
        verify: Check the checksum under `key` (an uncompressed block only). Leave it on
            unless the bytes were verified already.

    Raises:
        BlockFormatError, UnknownFormatVersion, ChecksumMismatch: see verify_block.
        TypeError: verify is on and no key was given.
    """
    if verify and key is None:
        raise TypeError("decode_block needs the block's key to verify it (or verify=False for bytes verified already)")
    header = verify_block(data, key) if verify else parse_header(data)  # type: ignore[arg-type]
    return header, memoryview(data)[header.header_len :]
