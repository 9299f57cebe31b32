"""The presence index's layout and hash, shared by its writer (the server) and its readers (the SDK).

One file per tenant partition of the RAM tier, in the server's shared-memory directory beside the
block arena (docs/presence.md). Every word is a little-endian uint64, every store a single aligned
8-byte store, so a reader needs no lock: racing a change, it sees the word before or after it.

```
 offset 0        64                                      64 + 64 x buckets
 +---------------+----------------+-----+----------------+------------------+
 | header 8 x u64| bucket 0       | ... | bucket n-1     | overflow: n x u8 |
 +---------------+----------------+-----+----------------+------------------+
   header: MAGIC, VERSION, instance id, FLAGS, n (a power of two), seed, fingerprints, 0
   bucket: 8 fingerprints (one cache line); 0 = an empty slot
   overflow[b] != 0: bucket b was full when a fingerprint was added, so "not in bucket b" is not certain
```

A fingerprint is fingerprint(seed, namespace, key): XXH3-64 of the namespace (as the server scopes it:
"tenant:ns" with auth), a NUL and the key, seeded with the table's random seed; 0 is mapped to 1. The
bucket is its low bits. A reader trusts the table only while its header names the instance id the
server's Info named, FLAG_CLOSED is clear and the server still holds its flock on the file.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = int.from_bytes(b"KVPRES01", "little")
VERSION = 1
HEADER_BYTES = 64
BUCKET_SLOTS = 8
"""Fingerprints per bucket: 8 x 8 bytes, one cache line."""

PRESENCE_PREFIX = "kvcache-presence-"
"""A presence file's name: this + 32 hex digits, in the server's shared-memory directory."""

# Header words (uint64 indexes).
W_MAGIC, W_VERSION, W_INSTANCE, W_FLAGS, W_BUCKETS, W_SEED, W_COUNT = range(7)

FLAG_LOWER_TIERS = 1
"""Tiers below RAM exist: a key absent here may still be stored (ask the server)."""
FLAG_CLOSED = 2
"""The server closed the table (it stopped): trust nothing in it."""

_HEADER = struct.Struct("<8Q")


def table_bytes(buckets: int) -> int:
    """Bytes of a file of `buckets` buckets: the header, the buckets and their overflow flags."""
    return HEADER_BYTES + buckets * BUCKET_SLOTS * 8 + buckets


def buckets_for(blocks: int) -> int:
    """Buckets for a table that should hold `blocks` fingerprints with room to spare: the next power
    of two of blocks / 4 (so at most half full when it holds `blocks`), at least 64."""
    need = max(64, -(-2 * max(blocks, 1) // BUCKET_SLOTS))
    return 1 << (need - 1).bit_length()


def fingerprint(seed: int, namespace: bytes, key: bytes) -> int:
    """The 64-bit fingerprint of (namespace, key) under `seed`; never 0 (0 marks an empty slot)."""
    return xxhash.xxh3_64_intdigest(namespace + b"\x00" + key, seed=seed) or 1


def unpack_header(buf: bytes | memoryview) -> tuple[int, ...]:
    """The header's eight words."""
    return _HEADER.unpack_from(buf, 0)
