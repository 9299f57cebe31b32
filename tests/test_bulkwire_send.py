"""kvcache_core.bulkwire's send bookkeeping and blockwire.data_len: pure logic, checked against
the obvious reference at every split point."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcache_core.blockwire import BlockPart, ShmRange, data_len
from kvcache_core.bulkwire import as_bytes_view, drop_sent

pytestmark = pytest.mark.timeout(60)


def _reference(buffers: list[bytes], sent: int) -> list[bytes]:
    rest = b"".join(buffers)[sent:]
    out, at = [], 0
    for b in buffers:  # the same cuts as the buffers', the first shortened
        end = at + len(b)
        if end > sent:
            out.append(b[max(0, sent - at) :])
        at = end
    assert b"".join(out) == rest
    return out


def test_drop_sent_leaves_exactly_the_unsent_bytes_at_every_split_point() -> None:
    rng = random.Random(7)
    for _ in range(40):
        buffers = [rng.randbytes(rng.randint(1, 9)) for _ in range(rng.randint(1, 12))]
        total = sum(map(len, buffers))
        for sent in range(total + 1):
            pending = [as_bytes_view(b) for b in buffers]
            drop_sent(pending, sent)
            assert [bytes(v) for v in pending] == _reference(buffers, sent), (buffers, sent)


def test_drop_sent_of_nothing_changes_nothing() -> None:
    pending = [memoryview(b"ab"), memoryview(b"c")]
    drop_sent(pending, 0)
    assert [bytes(v) for v in pending] == [b"ab", b"c"]
    empty: list[memoryview] = []
    drop_sent(empty, 0)
    assert empty == []


def test_data_len_counts_bytes_of_every_kind_of_block_data() -> None:
    payload = np.arange(10, dtype=np.uint8)
    assert data_len(b"x" * 7) == 7
    assert data_len((b"h" * 3, memoryview(payload))) == 13
    assert data_len((b"h", b"ij", memoryview(payload))) == 13
    assert data_len(BlockPart((b"ab", b"cde"), True, 9)) == 5
    assert data_len(BlockPart(b"abcd", False)) == 4
    assert data_len(ShmRange("seg", 4096, 100)) == 100
    assert data_len(ShmRange("seg", 4096, 100, head=b"h" * 20)) == 120
