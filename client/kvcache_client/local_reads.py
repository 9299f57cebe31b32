"""Same-host get_into without moving a byte through the server: copies straight out of the arena.

A server whose presence index has FLAG_LOCATIONS (kvcache_core.presence) says, beside each block's
fingerprint, where the block lies in the arena that this client maps read-only (docs/arena.md: same
host, same user, its tenant). When it locates every key of a get_into, the blocks are copied straight
out of the arena into their destinations, each verified where it landed under the key it was asked
for, and the server is told which were read in one TOUCH frame on the bulk port (the read right
checked, a RAM hit and most recently used each, as a Get of them would count them): one round trip
of a few bytes, overlapped with the copies (for a client without a token, only the first TOUCH of a
namespace on a connection: BulkConnection.touch_may_go_unanswered), and no block bytes through a
socket, a lease or the server's CPU.

Nothing is leased, so a slot may be evicted and reused, or be being written, while it is copied. Two
checks decide whether a copy is kept. The index's seqlock (kvcache_core.presence): each key's bucket
version is read before its location and again after every copy; unchanged, the entry stayed indexed
at that location throughout, so its slot was not freed, let alone reused; this is what binds a copy
to its namespace, which a block's checksum does not cover (another namespace's block of the same key
in a reused slot would verify). And each block verifies under its key where it landed (its checksum
covers the key, its descriptor and its payload). If either fails, the whole get goes the usual way
(counted in PresenceLink.counters.read_again, not as corruption: nothing was damaged). A key deleted
before the call is absent from the index, so it is not read here; one deleted while the call copies
it is read again the usual way (its bucket changed). A TOUCH the server refuses (no read right,
the tenant over its rate: with a token, every TOUCH is waited for) fails the call with its status,
and what was copied into the destinations is zeroed first. The
server offers locations only where the arena is one tenant's: another tenant's block of the same
key could verify in a reused slot (stack_config).

The usual path instead: another host or user, a server without locations (older), an index in doubt
(PresenceLink._trusted: stopped, restarted), no bulk port for the TOUCH, a key the index does not
locate (not in RAM, a full bucket's spilled key, a bucket being changed), a destination without a
byte view (a GPU tensor), a block whose payload is not its destination's size (the usual path's
ValueError; nothing is copied here first).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvcache_client.arena import ArenaLink
from kvcache_client.bulkconn import Received
from kvcache_client.inplace_core import ArenaMoved
from kvcache_client.presence import Located, PresenceLink
from kvcache_core.format import FIXED_HEADER_BYTES, BlockFormatError, Compression, parse_header, payload_seed
from kvcache_core.landing import copy_hashed, each, land
from kvcache_core.presence import unpack_location


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a block's header says that its copy needs: where its payload starts, how long it is, and
    its checksum with what the hash takes before the payload (key + seed)."""

    header_len: int
    payload_len: int
    seed: bytes
    checksum: int


Job = tuple[memoryview, bytes, memoryview, Parsed]
"""(the block's bytes in the arena, its key, its destination's byte view, its header)."""


@dataclass(slots=True)
class Plan:
    """A get_into to read in place: a job per key, and what locate() read (PresenceLink.unchanged)."""

    jobs: list[Job]
    located: Located


SMALL_BYTES = 1 << 20
"""Jobs of less than this in all are copied and hashed one by one here; more go to
kvcache_core.landing (pieces, a few threads), whose set-up costs more than a few small blocks do."""


def plan(
    presence: PresenceLink,
    arena: ArenaLink,
    arena_path: str,
    namespace: str,
    keys: Sequence[bytes],
    sinks: Sequence[memoryview | None],
) -> Plan | None:
    """The copies of a get_into, when the index locates every key inside the arena and each block's
    header is sound, uncompressed and says its payload is its sink's size (a byte view); else None (the
    usual path then takes the whole get, with its own rules for sizes, misses and destinations
    without a byte view: a ValueError for a sink of another size before anything is written). Only
    while `arena` maps `arena_path`, the arena of the Info answer that named the index's table."""
    located = _located(presence, arena, arena_path, namespace, keys) if len(sinks) == len(keys) else None
    if located is None:
        return None
    headers = _Headers()
    jobs: list[Job] = []
    for key, sink, word in zip(keys, sinks, located.words, strict=True):
        offset, length = unpack_location(word)
        if sink is None:
            return None
        try:
            block = arena.view(offset, length)
        except (ValueError, ArenaMoved):  # a location past the arena (a torn read of it), or unmapped
            return None
        parsed = headers.parse(block)
        if parsed is None or parsed.payload_len != len(sink):
            return None
        jobs.append((block, key, sink, parsed))
    return Plan(jobs, located)


def _located(
    presence: PresenceLink, arena: ArenaLink, arena_path: str, namespace: str, keys: Sequence[bytes]
) -> Located | None:
    """Every key's location (and its bucket's version), while `arena` maps `arena_path`; else None."""
    if not arena.on or arena.path != arena_path:
        return None
    located = presence.locate(namespace, keys)
    return located if len(located.words) == len(keys) else None


def land_plan(plan: Plan, presence: PresenceLink) -> Received:
    """Every job's payload copied into its sink and verified there under its key, then the index's
    buckets found unchanged since locate() (every entry stayed indexed at its location throughout:
    the copies are those (namespace, key)s' blocks): all `landed`, by index. Else none (a slot
    reused or being written meanwhile, counted in read_again): the caller takes the usual path for
    the whole get, and the sinks may hold what was copied."""
    jobs = plan.jobs
    if sum(len(block) for block, _, _, _ in jobs) < SMALL_BYTES:
        ok = all(_copied(*job) for job in jobs)
    else:
        try:
            ok = all(why is None for why in land([(block, key, sink) for block, key, sink, _ in jobs]))
        except ValueError:  # a header rewritten since it was parsed: its size changed
            ok = False
    if not (ok and presence.unchanged(plan.located)):
        return Received()
    return Received(landed=dict.fromkeys(range(len(jobs)), "ram"), landed_bytes=sum(len(j[0]) for j in jobs))


@dataclass(slots=True)
class BlocksPlan:
    """A get_many to read in place: a job per key (its payload's sink is the part of its buffer after
    the header), each whole block's buffer, and what locate() read."""

    jobs: list[Job]
    buffers: list[np.ndarray]
    located: Located


def plan_blocks(
    presence: PresenceLink,
    arena: ArenaLink,
    arena_path: str,
    namespace: str,
    keys: Sequence[bytes],
    take: Callable[[int], np.ndarray],
) -> BlocksPlan | None:
    """get_many's copies, where the index locates every key inside the arena and each block's header
    is sound and uncompressed; else None (the usual path takes the whole get). Each block goes whole
    into a buffer take(its length) (the client's pool): its header is copied there first and parsed
    from that copy, so the header handed out is the one its payload is verified under. Only while
    `arena` maps `arena_path`, as plan()."""
    located = _located(presence, arena, arena_path, namespace, keys)
    if located is None:
        return None
    headers = _Headers()
    jobs: list[Job] = []
    buffers: list[np.ndarray] = []
    for key, word in zip(keys, located.words, strict=True):
        offset, length = unpack_location(word)
        try:
            block = arena.view(offset, length)
        except (ValueError, ArenaMoved):  # a location past the arena (a torn read of it), or unmapped
            return None
        first = headers.parse(block)  # how long its header is
        if first is None:
            return None
        out = take(length)
        copy = memoryview(out)
        copy[: first.header_len] = block[: first.header_len]
        parsed = headers.parse(copy)  # what the caller gets; the arena's header may change meanwhile
        if parsed is None or parsed.header_len != first.header_len or parsed.header_len + parsed.payload_len != length:
            return None
        jobs.append((block, key, copy[parsed.header_len :], parsed))
        buffers.append(out)
    return BlocksPlan(jobs, buffers, located)


def land_blocks(plan: BlocksPlan, presence: PresenceLink) -> list[memoryview] | None:
    """Every block of `plan` in its buffer, its payload verified there under its key (in pieces, a
    few blocks at a time on the landing threads when large), then the index's buckets found unchanged
    since locate(): each buffer read-only, by index. Else None (a slot reused or being written
    meanwhile, counted in read_again by the caller): the usual path then takes the whole get."""
    jobs = plan.jobs
    sizes = [len(block) for block, _, _, _ in jobs]
    if sum(sizes) < SMALL_BYTES:
        ok = all(_copied(*job) for job in jobs)
    else:
        ok = all(each(lambda job: _copied_in_pieces(*job), jobs, sizes))
    if not (ok and presence.unchanged(plan.located)):
        return None
    return [memoryview(out).toreadonly() for out in plan.buffers]


def _copied_in_pieces(block: memoryview, key: bytes, sink: memoryview, parsed: Parsed) -> bool:
    """_copied of a large block: in pieces, each hashed right after it landed (while it is in cache),
    numpy's copy and xxh3 both without the GIL (landing.copy_hashed)."""
    src = np.frombuffer(block, np.uint8, parsed.payload_len, parsed.header_len)
    return copy_hashed(src, np.frombuffer(sink, np.uint8), xxhash.xxh3_64(key + parsed.seed)) == parsed.checksum


def _copied(block: memoryview, key: bytes, sink: memoryview, parsed: Parsed) -> bool:
    """`block`'s payload copied into `sink`, True if it verifies there under `key`."""
    sink[:] = block[parsed.header_len : parsed.header_len + parsed.payload_len]
    hasher = xxhash.xxh3_64(key + parsed.seed)
    hasher.update(sink)
    return hasher.intdigest() == parsed.checksum


_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = FIXED_HEADER_BYTES - _CHECKSUM.size
"""The checksum is the fixed header's last field; a block's shape dimensions follow it."""


class _Headers:
    """parse_header for a get's blocks. Their headers (one model's blocks: one shape) usually differ
    only in their checksums, so each is compared byte for byte, all but its checksum, with the last
    one parse_header validated, and parsed in full only where it differs: 4.8 of a 16 KiB block's
    5.6 us of copying and verifying here were parsing, seeding the hash and matching."""

    __slots__ = ("_dims", "_fixed", "_last")

    def __init__(self) -> None:
        self._fixed = self._dims = b""
        self._last: tuple[int, Parsed] | None = None  # (block length, its header)

    def parse(self, block: memoryview) -> Parsed | None:
        """`block`'s header, or None if it is not a sound uncompressed block's."""
        last = self._last
        try:
            if (
                last is not None
                and len(block) == last[0]
                and block[:_CHECKSUM_AT] == self._fixed
                and block[FIXED_HEADER_BYTES : last[1].header_len] == self._dims
            ):
                (checksum,) = _CHECKSUM.unpack_from(block, _CHECKSUM_AT)
                return Parsed(last[1].header_len, last[1].payload_len, last[1].seed, checksum)
            header = parse_header(block)
        except BlockFormatError:
            return None
        if header.compression is not Compression.NONE:
            return None
        parsed = Parsed(header.header_len, header.payload_len, payload_seed(header), header.checksum)
        self._fixed, self._dims = bytes(block[:_CHECKSUM_AT]), bytes(block[FIXED_HEADER_BYTES : header.header_len])
        self._last = (len(block), parsed)
        return parsed
