"""Head-block keys of head-sharded namespaces (docs/keys.md, "Head-sharded namespaces"), recomputed
from the spec with xxhash alone, and the documented example."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvcache_core.keys import HEADS_LAYOUT_VERSION, Namespace, chunk_keys, head_block_key

pytestmark = pytest.mark.timeout(10)

KEY = bytes.fromhex("82a825cc8a8cef6b9227e27359fc5d7f")


def test_the_documented_example() -> None:
    assert head_block_key(KEY, 2, 2, 8).hex() == "4b298d5d09da89536d57ee6592bfa734"


def test_a_block_of_all_heads_is_the_chunk_under_its_own_key() -> None:
    assert head_block_key(KEY, 0, 8, 8) == KEY


def test_every_head_range_has_its_own_key_and_none_is_a_chunk_key() -> None:
    ranges = [(first, n) for n in (1, 2, 4) for first in range(0, 8, n)]
    keys = {head_block_key(KEY, first, n, 8) for first, n in ranges}
    assert len(keys) == len(ranges) and KEY not in keys
    for first, n in ranges:
        spec = xxhash.xxh3_128_digest(b"kvcache.heads.v1\x00" + KEY + struct.pack("<II", first, n))
        assert head_block_key(KEY, first, n, 8) == spec


def test_version_2_namespaces_never_share_keys_with_version_1() -> None:
    fields = {"model_id": "m", "kv_dtype": "bfloat16", "chunk_tokens": 4, "num_layers": 2, "head_size": 8}
    v1 = Namespace(**fields, num_kv_heads=8)
    v2 = Namespace(**fields, num_kv_heads=8, layout_version=HEADS_LAYOUT_VERSION)
    assert set(chunk_keys(range(10), v1)).isdisjoint(chunk_keys(range(10), v2))


@pytest.mark.parametrize(("first", "n", "total"), [(-1, 1, 8), (0, 0, 8), (7, 2, 8), (0, 9, 8)])
def test_a_head_range_outside_the_heads_is_refused(first: int, n: int, total: int) -> None:
    with pytest.raises(ValueError, match="head range"):
        head_block_key(KEY, first, n, total)
    with pytest.raises(ValueError, match="16 bytes"):
        head_block_key(KEY[:8], 0, 1, 8)
