"""The block format: round trips for every dtype, and every way a header can be wrong."""

from __future__ import annotations

import itertools
import json
import os
import struct
from pathlib import Path

import pytest
import torch

from kvcache_client.errors import BlockFormatError, ChecksumMismatch, UnknownFormatVersion
from kvcache_client.tensors import block_to_tensor, tensor_to_block
from kvcache_core.format import (
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    Compression,
    DType,
    Layout,
    compute_checksum,
    decode_block,
    encode_block,
    parse_header,
    verify_block,
    verify_block_in_pieces,
)

pytestmark = pytest.mark.timeout(60)

KEY = bytes(range(16))

DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype in (torch.uint8, torch.int8):
        return torch.randint(-100 if dtype == torch.int8 else 0, 100, shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((2, 2, 4, 16, 8), Layout.CANONICAL),
        ((2, 2, 4, 3, 8), Layout.CANONICAL),
        ((3, 5, 64), Layout.MLA),
        ((7,), Layout.RAW),
        ((0, 2, 1, 1, 1), Layout.CANONICAL),
    ],
)
def test_tensor_round_trip_is_bitwise(dtype: torch.dtype, shape: tuple[int, ...], layout: Layout) -> None:
    t = sample(dtype, shape)
    block = tensor_to_block(t, KEY, layout)
    header = verify_block(block, KEY)
    assert header.dtype is DType.from_name(str(dtype))
    assert header.layout is layout and header.shape == shape and header.compression is Compression.NONE
    assert header.raw_len == t.numel() * t.element_size() == len(block) - header.header_len
    back = block_to_tensor(block, KEY)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # bitwise, NaNs included


def test_non_contiguous_tensor_is_encoded_in_logical_order() -> None:
    t = torch.arange(2 * 2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 2, 5, 4, 3).transpose(2, 4)
    assert not t.is_contiguous()
    assert torch.equal(block_to_tensor(tensor_to_block(t, KEY), KEY), t)


def test_payload_view_does_not_copy() -> None:
    block = encode_block(b"abcdefgh", key=KEY, dtype="uint8", shape=(8,))
    header, payload = decode_block(block, KEY)
    assert payload.obj is block and bytes(payload) == b"abcdefgh" and header.header_len == 48


def test_header_is_little_endian_and_documented_size() -> None:
    block = encode_block(bytes(12), key=KEY, dtype="float32", shape=(3,))
    assert block[:4] == b"KVCB"
    assert struct.unpack_from("<HH", block, 4) == (2, FIXED_HEADER_BYTES + 8)
    assert struct.unpack_from("<QQ", block, 16) == (12, 12)
    assert struct.unpack_from("<Q", block, 40) == (3,)


def corrupt(block: bytes, offset: int, value: int | None = None) -> bytes:
    b = bytearray(block)
    b[offset] = (b[offset] ^ 0x01) if value is None else value
    return bytes(b)


BLOCK = encode_block(bytes(range(64)), key=KEY, dtype="float16", shape=(2, 16), layout=Layout.RAW)


@pytest.mark.parametrize(
    ("data", "error", "fragment"),
    [
        (BLOCK[:10], BlockFormatError, "shorter than the 40-byte header"),
        (b"XXXX" + BLOCK[4:], BlockFormatError, "bad magic"),
        (corrupt(BLOCK, 4, 3), UnknownFormatVersion, "unknown block format version 3"),
        (corrupt(BLOCK, 4, 1), UnknownFormatVersion, "version 1 is refused: its checksum does not cover the key"),
        (corrupt(BLOCK, 6, 41), BlockFormatError, "header_len"),
        (corrupt(BLOCK, 8, 99), BlockFormatError, "unknown code"),
        (corrupt(BLOCK, 9, 9), BlockFormatError, "unknown code"),
        (corrupt(BLOCK, 10, 7), BlockFormatError, "unknown code"),
        (corrupt(BLOCK, 11, 9), BlockFormatError, "ndim 9 exceeds"),
        (corrupt(BLOCK, 12, 1), BlockFormatError, "reserved"),
        (BLOCK[:-2], BlockFormatError, "payload bytes"),
        (corrupt(BLOCK, 24, 66), BlockFormatError, "raw_len"),
        (corrupt(BLOCK, 48, 3), BlockFormatError, "does not match shape"),
        (corrupt(BLOCK, 9, 1), BlockFormatError, "canonical layout needs"),
        (corrupt(BLOCK, 9, 2), BlockFormatError, "MLA layout needs"),
        (corrupt(BLOCK, len(BLOCK) - 1), ChecksumMismatch, "checksum mismatch"),
        (corrupt(BLOCK, 32), ChecksumMismatch, "checksum mismatch"),
        (corrupt(BLOCK, 8, 3), ChecksumMismatch, "checksum mismatch"),  # float16 misread as bfloat16
    ],
)
def test_bad_blocks_are_refused(data: bytes, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        verify_block(data, KEY)
    assert fragment in str(info.value)


def test_shape_flip_that_keeps_sizes_consistent_is_caught_by_the_checksum() -> None:
    block = encode_block(bytes(64), key=KEY, dtype="uint8", shape=(4, 16))
    swapped = block[:40] + struct.pack("<QQ", 16, 4) + block[56:]
    parse_header(swapped)  # structurally fine
    with pytest.raises(ChecksumMismatch):
        verify_block(swapped, KEY)


def test_compressed_blocks_must_be_decompressed_before_verifying() -> None:
    block = corrupt(BLOCK, 10, Compression.LZ4)
    with pytest.raises(BlockFormatError, match="compressed"):
        verify_block(block, KEY)


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(BlockFormatError, match="does not hold shape"):
        encode_block(bytes(10), key=KEY, dtype="float32", shape=(3,))
    with pytest.raises(BlockFormatError, match="at most 8"):
        encode_block(bytes(1), key=KEY, dtype="uint8", shape=(1,) * 9)
    with pytest.raises(ValueError, match="unsupported dtype"):
        encode_block(bytes(1), key=KEY, dtype="complex64", shape=(1,))


# -- version 2: a block is bound to its key -------------------------------------------------------

EXAMPLE_KEY = bytes(range(16))
EXAMPLE_PAYLOAD = bytes.fromhex("003c00c000380042")  # float16 [[1.0, -2.0], [0.5, 3.0]]
EXAMPLE_CHECKSUM = 0xDA2E41ED30E99E1C
EXAMPLE_BLOCK = bytes.fromhex(
    "4b564342020038000200000200000000"
    "08000000000000000800000000000000"
    "1c9ee930ed412eda0200000000000000"
    "0200000000000000003c00c000380042"
)


def test_the_worked_example_of_docs_format_md() -> None:
    """The bytes docs/format.md gives, byte for byte, so another language can check itself against them."""
    import xxhash

    block = encode_block(EXAMPLE_PAYLOAD, key=EXAMPLE_KEY, dtype="float16", shape=(2, 2))
    assert block == EXAMPLE_BLOCK
    descriptor = bytes.fromhex("020002080000000000000002000000000000000200000000000000")
    assert xxhash.xxh3_64_intdigest(EXAMPLE_KEY + descriptor + EXAMPLE_PAYLOAD) == EXAMPLE_CHECKSUM
    assert compute_checksum(EXAMPLE_KEY, DType.FLOAT16, Layout.RAW, (2, 2), EXAMPLE_PAYLOAD) == EXAMPLE_CHECKSUM
    doc = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    for i in range(0, len(EXAMPLE_BLOCK), 16):
        assert EXAMPLE_BLOCK[i : i + 16].hex(" ") in doc
    assert f"{EXAMPLE_CHECKSUM:016x}" in doc


def test_a_block_verifies_only_under_its_own_key() -> None:
    other = bytes(16)
    with pytest.raises(ChecksumMismatch, match="belongs to another key"):
        verify_block(EXAMPLE_BLOCK, other)
    with pytest.raises(ChecksumMismatch):
        decode_block(EXAMPLE_BLOCK, EXAMPLE_KEY[:-1] + b"\x00")  # one bit of the key differs
    with pytest.raises(BlockFormatError, match="16 bytes"):
        verify_block(EXAMPLE_BLOCK, b"short")
    with pytest.raises(TypeError, match="needs the block's key"):
        decode_block(EXAMPLE_BLOCK)
    header, payload = decode_block(EXAMPLE_BLOCK, verify=False)  # structure only, for bytes verified already
    assert header.checksum == EXAMPLE_CHECKSUM and bytes(payload) == EXAMPLE_PAYLOAD


def test_version_1_blocks_are_refused_even_when_their_old_checksum_holds() -> None:
    """A v1 block's checksum did not cover the key: nothing can tell which key it was made for."""
    import xxhash

    descriptor = struct.pack("<BBBQQQ", DType.FLOAT16, Layout.RAW, 2, 8, 2, 2)
    v1_checksum = xxhash.xxh3_64_intdigest(descriptor + EXAMPLE_PAYLOAD)
    header = struct.pack("<4sHHBBBBIQQQQQ", b"KVCB", 1, 56, DType.FLOAT16, 0, 0, 2, 0, 8, 8, v1_checksum, 2, 2)
    v1 = header + EXAMPLE_PAYLOAD
    for key in (EXAMPLE_KEY, bytes(16)):
        with pytest.raises(UnknownFormatVersion, match="version 1 is refused"):
            verify_block(v1, key)
    with pytest.raises(UnknownFormatVersion):
        parse_header(v1)


def test_blocks_match_the_independent_reference_vectors() -> None:
    """tests/vectors/gen_blocks.py implements docs/format.md from the text alone; both must agree byte for byte."""
    vectors = json.loads((Path(__file__).resolve().parent / "vectors" / "blocks.json").read_text())
    assert vectors["format_version"] == FORMAT_VERSION == 2
    for v in vectors["vectors"]:
        key, payload, want = bytes.fromhex(v["key"]), bytes.fromhex(v["payload"]), bytes.fromhex(v["block"])
        got = encode_block(payload, key=key, dtype=DType(v["dtype"]), shape=v["shape"], layout=Layout(v["layout"]))
        assert got == want, v["name"]
        header, view = decode_block(want, key)
        assert bytes(view) == payload and list(header.shape) == v["shape"]
        with pytest.raises(ChecksumMismatch):
            verify_block(want, bytes(b ^ 0x80 for b in key))


def _filled_from(source: bytes, dest: bytearray, calls: list[tuple[int, int]]):
    def fill(start: int, end: int) -> None:
        calls.append((start, end))
        dest[start:end] = source[start:end]

    return fill


@pytest.mark.parametrize("payload_len", [0, 1, 100, 4096, 3 * 4096, 3 * 4096 + 7])
def test_verify_in_pieces_accepts_what_verify_block_accepts_and_fills_every_byte_once(payload_len: int) -> None:
    """Pieces of 4 KiB (the first at least a header's worst case): the whole block lands, each byte
    once and in order, and the header is what verify_block returns."""
    block = encode_block(os.urandom(payload_len), key=KEY, dtype="uint8", shape=(payload_len,))
    dest, calls = bytearray(len(block)), []
    header = verify_block_in_pieces(memoryview(dest), KEY, _filled_from(block, dest, calls), piece_bytes=4096)
    assert header == verify_block(block, KEY) and bytes(dest) == block
    assert calls[0][0] == 0 and calls[-1][1] == len(block)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(calls))


def test_verify_in_pieces_refuses_a_flipped_byte_in_any_piece_another_key_and_a_bad_header() -> None:
    payload = os.urandom(5 * 1024)
    block = encode_block(payload, key=KEY, dtype="uint8", shape=(len(payload),))
    for at in range(FIXED_HEADER_BYTES + 8, len(block), 997):  # the header's checksum field and the payload
        bad = bytearray(block)
        bad[at] ^= 0x01
        dest = bytearray(len(bad))
        with pytest.raises(ChecksumMismatch):
            verify_block_in_pieces(memoryview(dest), KEY, _filled_from(bytes(bad), dest, []), piece_bytes=1024)
    dest = bytearray(len(block))
    with pytest.raises(ChecksumMismatch, match="another key"):
        verify_block_in_pieces(memoryview(dest), bytes(16), _filled_from(block, dest, []), piece_bytes=1024)
    garbage, calls = b"NOPE" + block[4:], []
    dest = bytearray(len(garbage))
    with pytest.raises(BlockFormatError):
        verify_block_in_pieces(memoryview(dest), KEY, _filled_from(garbage, dest, calls), piece_bytes=1024)
    assert calls == [(0, 1024)]  # a bad header stops the reading at the first piece


def test_verify_in_pieces_hashes_what_landed_not_what_the_source_holds_later() -> None:
    """The bytes verified are those in the destination as each piece lands: a source changed after a
    piece was copied (a client writing its segment again) does not change what was verified."""
    payload = os.urandom(8 * 1024)
    block = bytearray(encode_block(payload, key=KEY, dtype="uint8", shape=(len(payload),)))
    dest = bytearray(len(block))

    def fill(start: int, end: int) -> None:
        dest[start:end] = block[start:end]
        block[start:end] = bytes(end - start)  # the source rewritten right after the copy

    verify_block_in_pieces(memoryview(dest), KEY, fill, piece_bytes=1024)
    assert verify_block(bytes(dest), KEY).payload_len == len(payload)


def test_encode_bytes_parts_is_encode_block_parts_of_each_uint8_payload() -> None:
    """The connectors' batch encoder: the same header and payload view as encode_block_parts with
    dtype uint8 and shape (nbytes,), for every buffer kind (LMCache's ctypes views, 2-D and non-byte formats, flat)
    and size (the descriptor is made once per size); a non-contiguous buffer is a TypeError."""
    import ctypes

    import numpy as np

    from kvcache_core.format import encode_block_parts, encode_bytes_parts

    payloads: list[bytes | bytearray | memoryview] = []
    for n in (0, 1, 17, 4096, 4096, 384 << 10):
        raw = os.urandom(n)
        payloads += [raw, bytearray(raw), memoryview(np.frombuffer(raw, np.uint8)), memoryview(raw)[: n // 2]]
        payloads.append(memoryview((ctypes.c_ubyte * n).from_buffer_copy(raw)))  # LMCache's byte_array ('<B')
    raw = os.urandom(4096)
    payloads.append(memoryview(np.frombuffer(raw, np.uint8).reshape(64, 64)))  # 2-D: its bytes, flat
    payloads.append(memoryview(np.frombuffer(raw, np.float16)))  # another format: its bytes, flat
    keys = [os.urandom(16) for _ in payloads]
    got = encode_bytes_parts(keys, payloads)
    pairs = zip(keys, payloads, strict=True)
    want = [encode_block_parts(p, key=k, dtype=DType.UINT8, shape=(memoryview(p).nbytes,)) for k, p in pairs]
    assert [(bytes(h), bytes(v)) for h, v in got] == [(bytes(h), bytes(v)) for h, v in want]
    for key, (header, view) in zip(keys, got, strict=True):
        verify_block(bytes(header) + bytes(view), key)
    with pytest.raises(BlockFormatError):
        encode_bytes_parts([b"short"], [b"abc"])
    with pytest.raises(ValueError):
        encode_bytes_parts(keys[:1], [])
    with pytest.raises(TypeError):  # not C-contiguous
        encode_bytes_parts(keys[:1], [memoryview(np.frombuffer(raw, np.uint8)[::2])])
