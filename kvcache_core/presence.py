"""The presence index's layout and hash, shared by its writer (the server) and its readers (the SDK).

One file per tenant partition of the RAM tier, in the server's shared-memory directory beside the
block arena (docs/presence.md). Every word is a little-endian uint64, every store a single aligned
8-byte store, so a reader needs no lock: racing a change, it sees the word before or after it.

```
 offset 0        64                                   64 + 64 x n      locations_at(n)       versions_at(n)
 +---------------+-------------+-----+-------------+----------------+-----+-----------------+---------------+
 | header 8 x u64| bucket 0    | ... | bucket n-1  | overflow n x u8| pad | locations 8n u64| versions n u64|
 +---------------+-------------+-----+-------------+----------------+-----+-----------------+---------------+
   header: MAGIC, VERSION, instance id, FLAGS, n (a power of two), seed, fingerprints, 0
   bucket: 8 fingerprints (one cache line); 0 = an empty slot
   overflow[b] != 0: bucket b was full when a fingerprint was added, so "not in bucket b" is not certain
   locations[8b + j] (with FLAG_LOCATIONS): where the block of bucket b's slot j lies in the arena,
           pack_location(offset, length); 0 = not known
   versions[b] (with FLAG_LOCATIONS): bucket b's change count, odd while the server changes the bucket
```

Every change to a bucket's slots is made between two increments of its version (a seqlock), so a
reader (kvcache_client.local_reads) that reads a bucket's version, then the fingerprint and its
location, copies the block and reads the version again, and finds it even and unchanged, knows the
entry was indexed at that location the whole time: its slot cannot have been freed and reused (the
RAM tier drops an entry from the index, and so from this table, before it frees its slot). That
binds the copy to the (namespace, key) the fingerprint names, which the block's checksum (key-bound,
not namespace-bound) alone does not; the checksum is still verified where the block landed. A reader
of a table without FLAG_LOCATIONS (an older server) ignores both regions, as an older reader ignores
the flag. The orders of stores and loads this relies on are x86-64's (stores, and loads, are not
reordered with their own kind).

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
FLAG_LOCATIONS = 4
"""The table has a location word per slot and a version per bucket (this server also answers the bulk
port's TOUCH frame)."""

LOCATION_LENGTH_BITS = 30
"""A location word: the block's arena offset in 64-byte units above these bits, its length in bytes below."""
MAX_LOCATED_BYTES = (1 << LOCATION_LENGTH_BITS) - 1
MAX_LOCATED_OFFSET = (1 << (64 - LOCATION_LENGTH_BITS)) * 64 - 64

_HEADER = struct.Struct("<8Q")


def table_bytes(buckets: int) -> int:
    """Bytes of a file of `buckets` buckets: the header, the buckets and their overflow flags."""
    return HEADER_BYTES + buckets * BUCKET_SLOTS * 8 + buckets


def locations_at(buckets: int) -> int:
    """Byte offset of the locations region: after the overflow flags, 8-byte aligned."""
    return -(-table_bytes(buckets) // 8) * 8


def versions_at(buckets: int) -> int:
    """Byte offset of the buckets' versions: after the locations."""
    return locations_at(buckets) + buckets * BUCKET_SLOTS * 8


def file_bytes(buckets: int) -> int:
    """Bytes of a file with a location word per slot and a version per bucket."""
    return versions_at(buckets) + buckets * 8


def pack_location(offset: int, length: int) -> int:
    """The location word of a block at arena `offset` (a multiple of 64) of `length` bytes; 0 (not known)
    when it does not fit a word (an arena over 1 TiB, a block of 1 GiB or more)."""
    if offset % 64 or offset > MAX_LOCATED_OFFSET or not 0 < length <= MAX_LOCATED_BYTES:
        return 0
    return (offset // 64) << LOCATION_LENGTH_BITS | length


def unpack_location(word: int) -> tuple[int, int]:
    """(offset, length) of a location word; (0, 0) for 0."""
    return (word >> LOCATION_LENGTH_BITS) * 64, word & MAX_LOCATED_BYTES


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
