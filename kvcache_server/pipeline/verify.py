"""Put stage "verify": what makes a block acceptable, whatever path its bytes took.

A block is stored only when its key is a chunk key, its length is within max_block_bytes, it parses
as format v2 and its key-bound checksum matches *the key it is stored under* (a block made for
another key fails), and it is uncompressed (clients send raw blocks; tiers compress). The gRPC Put,
the shared-memory segments and the in-place arena commit all call verify_block_for_put.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from kvcache_core.errors import ChecksumMismatch, UnknownFormatVersion
from kvcache_core.format import BlockFormatError, Compression, verify_block, verify_block_in_pieces
from kvcache_core.keys import KEY_BYTES
from kvcache_server.refusal import Refused

VERIFY_OFF_LOOP_BYTES = 1 << 20
"""Blocks at least this large are verified in a worker thread (XXH3 releases the GIL)."""


class BlockRefused(Refused):
    """A block that may not be stored; `checksum` says whether it failed its checksum (counted)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, checksum: bool = False) -> None:
        super().__init__(code, message)
        self.checksum = checksum


async def verify_block_for_put(index: int, key: bytes, data: bytes | memoryview, max_block_bytes: int) -> None:
    """Checks one block before it is committed under `key`.

    Large blocks are verified off the event loop; the thread only reads `data`, which the caller
    keeps alive (and, for an arena slot, reserved) until this returns.

    Raises:
        BlockRefused: as check_block_for_put.
    """
    if len(data) >= VERIFY_OFF_LOOP_BYTES and len(key) == KEY_BYTES and len(data) <= max_block_bytes:
        await asyncio.to_thread(check_block_for_put, index, key, data, max_block_bytes)
    else:
        check_block_for_put(index, key, data, max_block_bytes)


SLOT_PIECE_BYTES = 2 << 20
"""A same-host put's block is read into its slot (process_vm_readv, pread) and hashed this much at a
time. Each read and each hash lets go of the GIL and takes it back, and a put's lanes share one GIL:
with 256 KiB pieces a 16 x 2 MiB put spent 5.6-6.9 ms in each of its two lanes, with 2 MiB pieces
4.7-5.6 (five alternating runs; a piece still lies in the core's 2 MiB L2, or the L3, when it is hashed)."""


def check_block_for_put(
    index: int,
    key: bytes,
    data: bytes | memoryview,
    max_block_bytes: int,
    fill: Callable[[int, int], None] | None = None,
    piece_bytes: int = SLOT_PIECE_BYTES,
    *,
    seal: bool = False,
) -> None:
    """verify_block_for_put's checks, here and now (blocking: for a caller already in a worker thread).
    With `fill`, `data` is an empty slot that fill(start, end) reads the block into, piece by piece
    (`piece_bytes` at a time), each piece verified as it lands (format.verify_block_in_pieces); the
    key and size are checked first. With `seal` (and `fill`) the block's header carries checksum 0
    and the checksum of what landed is written into it instead of checked (ShmRange.seal: a range
    of a registered client's memory, read where no client can write).

    Raises:
        BlockRefused: INVALID_ARGUMENT (bad key, malformed block, unknown version, compressed),
            RESOURCE_EXHAUSTED (over max_block_bytes), DATA_LOSS (checksum; `checksum` is True).
    """
    where = f"block {index}"
    if len(key) != KEY_BYTES:
        raise BlockRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: key is {len(key)} bytes, expected {KEY_BYTES}")
    if len(data) > max_block_bytes:
        raise BlockRefused(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{where}: {len(data)} bytes exceed max_block_bytes={max_block_bytes}"
        )
    try:
        if fill is None:
            if seal:
                raise ValueError("seal needs fill: a block is sealed as it is read into its slot")
            header = verify_block(data, key)
        else:
            header = verify_block_in_pieces(memoryview(data), key, fill, piece_bytes, seal=seal)
    except ChecksumMismatch as exc:
        raise BlockRefused(grpc.StatusCode.DATA_LOSS, f"{where}: {exc}", checksum=True) from None
    except UnknownFormatVersion as exc:
        raise BlockRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}") from None
    except BlockFormatError as exc:
        raise BlockRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed block: {exc}") from None
    if header.compression is not Compression.NONE:
        raise BlockRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: clients must send uncompressed blocks")
