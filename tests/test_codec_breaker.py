"""Pure logic: tier compression codec, circuit breaker, write-behind queue bound."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvcache_client.tensors import tensor_to_block
from kvcache_core.breaker import BreakerState, CircuitBreaker
from kvcache_core.errors import ChecksumMismatch
from kvcache_core.format import BlockFormatError, Compression, parse_header
from kvcache_server.tiers.codec import CompressionMode, decode, encode
from kvcache_server.write_queue import PendingWrite, WriteKind, WriteQueue
from tests.conftest import raw_block

pytestmark = pytest.mark.timeout(60)


KEY = b"c" * 16


def kv_like(dtype: torch.dtype) -> bytes:
    g = torch.Generator().manual_seed(0)
    return tensor_to_block((torch.randn(4, 2, 4, 64, 64, generator=g) * 0.5).to(dtype), KEY)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", list(CompressionMode))
def test_codec_round_trip(dtype: torch.dtype, mode: CompressionMode) -> None:
    block = kv_like(dtype)
    stored = encode(block, mode)
    assert len(stored) <= len(block)
    assert decode(stored, KEY) == block
    with pytest.raises(ChecksumMismatch):  # bound to its key in every stored form
        decode(stored, b"d" * 16)


def test_shuffle_helps_16_bit_kv_and_is_recorded() -> None:
    block = kv_like(torch.bfloat16)
    plain, shuffled = encode(block, CompressionMode.LZ4), encode(block, CompressionMode.SHUFFLE_LZ4)
    assert parse_header(shuffled).compression is Compression.SHUFFLE_LZ4
    assert len(shuffled) < len(block)
    assert len(shuffled) < len(plain) or parse_header(plain).compression is Compression.NONE


def test_incompressible_blocks_are_stored_plain() -> None:
    block = raw_block(KEY, os.urandom(100_000))
    assert encode(block, CompressionMode.LZ4) is block


def test_compressible_block_and_corruption_in_compressed_form() -> None:
    block = raw_block(KEY, bytes(100_000))
    stored = encode(block, CompressionMode.LZ4)
    assert len(stored) < 2000
    bad = bytearray(stored)
    bad[-5] ^= 0xFF
    with pytest.raises(BlockFormatError):
        decode(bytes(bad), KEY)
    with pytest.raises(BlockFormatError):
        decode(stored[:-3], KEY)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_and_closes() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=2, reset_s=1.0, max_reset_s=4.0, clock=clock)
    assert b.allow()
    b.failure()
    assert b.allow() and b.state is BreakerState.CLOSED
    b.failure()
    assert b.state is BreakerState.OPEN and not b.allow() and b.skipped == 1
    clock.now = 1.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()  # the probe failed: open again, back-off doubled
    clock.now = 2.5
    assert not b.allow()
    clock.now = 3.0
    assert b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.opened == 2


def test_write_queue_is_bounded_by_bytes_and_deduplicates() -> None:
    async def main() -> None:
        q = WriteQueue(max_bytes=250)
        w = [PendingWrite("ns", bytes([i]) * 16, bytes(100), WriteKind.PUT) for i in range(3)]
        assert q.offer(w[0]) and q.offer(w[1])
        assert not q.offer(w[2]) and q.bytes == 200  # refused: nothing half-queued
        assert q.offer(PendingWrite("ns", w[0].key, bytes(50), WriteKind.PUT))  # replaces, frees room
        assert len(q) == 2 and q.bytes == 150
        q.discard("ns", [w[1].key])
        assert len(q) == 1
        batch = q.take(10, 1 << 20)
        assert [x.key for x in batch] == [w[0].key] and q.bytes == 0
        q.done()
        await asyncio.wait_for(q.wait_idle(), 1)

    asyncio.run(main())
