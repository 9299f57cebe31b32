"""Same-host get_into without moving a byte through the server: copies straight out of the arena.

A server whose presence index has FLAG_LOCATIONS (kvcache_core.presence) says, beside each block's
fingerprint, where the block lies in the arena that this client maps read-only (docs/arena.md: same
host, same user, its tenant). When it locates every key of a get_into, the blocks are copied straight
out of the arena into their destinations, each verified where it landed under the key it was asked
for, and the server is told which were read in one TOUCH frame on the bulk port (the read right
checked, a RAM hit and most recently used each, as a Get of them would count them): one round trip
of a few bytes, overlapped with the copies, and no block bytes through a socket, a lease or the
server's CPU.

Nothing is leased, so a slot may be evicted and reused, or be being written, while it is copied. That
is why a location is only a hint and the copy is the thing checked: a block verifies under its key,
whose checksum covers the key, its descriptor and its payload, or it is not used (a reused slot holds
another key's block, or a torn mix; the chance that such bytes pass a 64-bit check is 2^-64). If one
does not verify, the whole get goes the usual way (counted in PresenceLink.counters.read_again, not
as corruption: nothing was damaged). A key deleted before the call is absent from the index, so it
is not read here; one deleted while the call copies it may be returned, as a Get that began before
the Delete may return it. The server offers locations only where the arena is one tenant's: another
tenant's block of the same key could verify in a reused slot (stack_config).

The usual path instead: another host or user, a server without locations (older), an index in doubt
(PresenceLink._trusted: stopped, restarted), no bulk port for the TOUCH, a key the index does not
locate (not in RAM, a full bucket), a destination without a byte view (a GPU tensor), a block of
another size than its destination (whose ValueError the usual path raises before writing anything).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kvcache_client.arena import ArenaLink
from kvcache_client.bulkconn import HEADER_LENS, Received
from kvcache_client.inplace_core import ArenaMoved
from kvcache_client.presence import PresenceCounters, PresenceLink
from kvcache_core.format import FIXED_HEADER_BYTES, BlockFormatError, Compression, parse_header, payload_seed
from kvcache_core.landing import land
from kvcache_core.presence import unpack_location

Job = tuple[memoryview, bytes, memoryview]
"""(the block's bytes in the arena, its key, its destination's byte view)."""

SMALL_BYTES = 1 << 20
"""Jobs of less than this in all are copied and hashed one by one here; more go to
kvcache_core.landing (pieces, a few threads), whose set-up costs more than a few small blocks do."""


def located_jobs(
    presence: PresenceLink, arena: ArenaLink, namespace: str, keys: Sequence[bytes], sinks: Sequence[memoryview | None]
) -> list[Job]:
    """A copy for each key, when the index locates every one of them inside the arena and each one's
    block fits its sink (a byte view of the payload's size); else [] (the usual path then takes the
    whole get, with its own rules for sizes, misses and destinations without a byte view)."""
    if not arena.on or len(sinks) != len(keys):
        return []
    located = presence.locate(namespace, keys)
    if len(located) != len(keys):
        return []
    jobs: list[Job] = []
    for key, sink, word in zip(keys, sinks, located, strict=True):
        offset, length = unpack_location(word)
        if sink is None or length - len(sink) not in HEADER_LENS:
            return []
        try:
            jobs.append((arena.view(offset, length), key, sink))
        except (ValueError, ArenaMoved):  # a location past the arena (a torn read of it), or unmapped
            return []
    return jobs


def land_jobs(jobs: Sequence[Job], counters: PresenceCounters) -> Received:
    """Every job's payload copied into its sink and verified there under its key: all `landed` (by
    index), or, if one does not verify (a slot reused or being written meanwhile), none: the caller
    takes the usual path for the whole get (the sinks may hold what was copied)."""
    if sum(len(block) for block, _, _ in jobs) < SMALL_BYTES:
        headers = _Headers()
        ok = all(headers.landed(*job) for job in jobs)
    else:
        try:
            ok = all(why is None for why in land(jobs))
        except ValueError:  # a header rewritten between the size check and the copy: its size changed
            ok = False
    if not ok:
        counters.read_again += 1
        return Received()
    counters.read_in_place += len(jobs)
    return Received(landed=dict.fromkeys(range(len(jobs)), "ram"), landed_bytes=sum(len(b) for b, _, _ in jobs))


_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = FIXED_HEADER_BYTES - _CHECKSUM.size
"""The checksum is the fixed header's last field; a block's shape dimensions follow it."""


class _Headers:
    """A get's small blocks copied and verified one by one. Their headers (one model's blocks: one
    shape) usually differ only in their checksums, so each is compared byte for byte, all but its
    checksum, with the last one parse_header validated, and parsed in full only where it differs:
    4.8 of a 16 KiB block's 5.6 us here were parsing, seeding the hash and matching."""

    __slots__ = ("_dims", "_fixed", "_header_len", "_length", "_payload_len", "_seed")

    def __init__(self) -> None:
        self._fixed = self._dims = self._seed = b""
        self._length = self._header_len = self._payload_len = -1

    def landed(self, block: memoryview, key: bytes, sink: memoryview) -> bool:
        """`block`'s payload copied into `sink`, True if it verifies there under `key`."""
        try:
            if (
                len(block) == self._length
                and block[:_CHECKSUM_AT] == self._fixed
                and (block[FIXED_HEADER_BYTES : self._header_len] == self._dims)
            ):
                (checksum,) = _CHECKSUM.unpack_from(block, _CHECKSUM_AT)
            else:
                header = parse_header(block)
                if header.compression is not Compression.NONE:
                    return False
                self._fixed, self._dims = (
                    bytes(block[:_CHECKSUM_AT]),
                    bytes(block[FIXED_HEADER_BYTES : header.header_len]),
                )
                self._length, self._header_len, self._payload_len = len(block), header.header_len, header.payload_len
                self._seed, checksum = payload_seed(header), header.checksum
        except BlockFormatError:
            return False
        if self._payload_len != len(sink):
            return False
        sink[:] = block[self._header_len :]
        hasher = xxhash.xxh3_64(key + self._seed)
        hasher.update(sink)
        return hasher.intdigest() == checksum
