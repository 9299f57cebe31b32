"""The block arena: one preallocated, pre-faulted region that holds every block of the RAM tier.

Design (docs/arena.md has the diagram and the figures):

- **Region.** One mapping of exactly `ram.capacity_bytes`, made at start-up and never grown,
  shrunk or remapped. With a shared-memory directory it is a file there (tmpfs, named
  "kvcache-arena-" + 32 hex digits, mode 0400 once created) so that same-user clients on the host
  can map it read-only; only the server writes it; without one
  it is a nameless memory file (memfd; anonymous memory where there is none). Either way the
  server can pread() a copy of a block out of it without holding the GIL (Region.read). Every
  page is faulted in at start-up (MADV_POPULATE_WRITE
  where the kernel has it, else one write per page; MADV_HUGEPAGE first where offered): no put
  ever waits for the kernel to find it memory, and RSS is the region from the first second on.
- **Extents.** Blocks live in *slots*: contiguous extents of the region, SLOT_ALIGN-aligned, one
  per block, so that every block is one contiguous, directly usable view. `Extents` is a
  best-fit allocator over the free extents (kept sorted by offset, coalesced on free); the RAM
  tier evicts until a fitting extent exists, so fragmentation costs evictions, never memory.

This module knows nothing of keys, leases or reservations: kvcache_server/tiers/ram.py keeps those
(the index, eviction order and who may use a slot) under one lock.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

from kvcache_core.filelock import hold_record_lock

log = logging.getLogger(__name__)

SLOT_ALIGN = 64
"""Every slot starts at a multiple of this and its size is one (a cache line; O_DIRECT-friendly)."""

ARENA_PREFIX = "kvcache-arena-"
"""An arena file's name: this + 32 hex digits, in the server's shared-memory directory."""

_MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault every page in, writable, in one call (Python 3.11's mmap lacks the name)."""

PAGE = mmap.PAGESIZE
PREFAULT_STEPS = 10
PREFAULT_PROGRESS_INTERVAL_S = 2.0
"""Faulting in logs a progress line at each tenth done once this long has passed since the last line
(an 8 GiB arena under load took 90 s: an operator sees why the server is not ready yet), then one line
with the time taken."""


def align(n: int) -> int:
    """`n` rounded up to a multiple of SLOT_ALIGN."""
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


class RegionClosed(RuntimeError):
    """Region.read after Region.close (a copy that a stopping server started too late)."""


class Region:
    """The arena's memory: a fixed-size mapping, optionally backed by a file that clients can map.

    Attributes:
        path: the file clients map ("" for anonymous memory).
        size: bytes in the region.
        view: a writable memoryview of the whole region.
        prefault: how the pages were faulted in ("populate", "touch" or "none").
    """

    def __init__(self, size: int, directory: str | None = None, *, prefault: bool = True) -> None:
        """Maps (and with `prefault`, faults in) `size` bytes.

        Args:
            size: bytes; rounded up to whole pages.
            directory: an owner-only directory (the shm directory) to create the arena file in;
                None for anonymous memory.
            prefault: fault every page in now.

        Raises:
            OSError: the file cannot be created or its space reserved (ENOSPC on a small tmpfs).
        """
        self.size = (size + PAGE - 1) // PAGE * PAGE
        self.path = ""
        self._fd = -1
        # read()s in worker threads under way: close() waits for them before it closes the
        # descriptor, whose number the kernel would otherwise hand to the next open (a pread then
        # copies another file's bytes as a block's).
        self._readers = 0
        self._readers_done = threading.Condition()
        self._closed = False
        if directory is not None:
            remove_dead_arenas(directory)
            self._fd, self.path, self._map = create_shared_file(directory, ARENA_PREFIX, self.size)
        else:
            # A memfd is not charged against the kernel's overcommit limit when mapped (its pages are
            # allocated as they are touched: a cap the machine cannot hold would SIGBUS later), an
            # anonymous shared mapping is: ask for one first, so such a cap fails here, at start-up.
            mmap.mmap(-1, self.size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS).close()
            self._fd = _memfd(self.size)
            if self._fd >= 0:
                self._map = mmap.mmap(self._fd, self.size, flags=mmap.MAP_SHARED)
            else:
                self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.prefault = self._prefault() if prefault else "none"
        self.view = memoryview(self._map)

    def _prefault(self) -> str:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # shmem honours it only where shmem_enabled allows
        start = last = time.monotonic()
        # In tenths (each a whole number of 2 MiB huge pages, so madvise's start stays aligned).
        step = -(-self.size // PREFAULT_STEPS // (2 << 20)) * (2 << 20) or self.size
        how = "populate"
        for offset in range(0, self.size, step):
            length = min(step, self.size - offset)
            if how == "populate":
                try:
                    self._map.madvise(_MADV_POPULATE_WRITE, offset, length)
                except (OSError, ValueError):
                    how = "touch"
            if how == "touch":
                import numpy as np  # a strided write touches one byte per page at C speed

                np.frombuffer(self._map, dtype=np.uint8, count=length, offset=offset)[::PAGE] = 0
            now = time.monotonic()
            if offset + length < self.size and now - last >= PREFAULT_PROGRESS_INTERVAL_S:
                last = now
                log.info(
                    "arena: faulting in %d MiB: %d%% after %.1fs",
                    self.size >> 20,
                    100 * (offset + length) // self.size,
                    now - start,
                )
        log.info("arena: faulted in %d MiB in %.2fs (%s)", self.size >> 20, time.monotonic() - start, how)
        return how

    def read(self, offset: int, length: int) -> bytes:
        """A copy of `length` bytes at `offset`: pread of the region's file, so that the kernel
        copies while the GIL is free (bytes() of a view holds it for the whole copy, about 0.4 ms per
        2 MiB, and a thread copying blocks out that way kept the event loop waiting up to the
        interpreter's 5 ms switch interval each time; with pread, 0.07 ms: docs/arena.md, "Lookups
        under in-place commits"). Without a file (no memfd), bytes() of the view."""
        with self._readers_done:
            if self._closed:
                raise RegionClosed("the arena is closed (the server is stopping)")
            self._readers += 1
            fd = self._fd
        try:
            if fd >= 0:
                out = os.pread(fd, length, offset)
                if len(out) == length:
                    return out
            return bytes(self.view[offset : offset + length])
        finally:
            with self._readers_done:
                self._readers -= 1
                self._readers_done.notify_all()

    def close(self, wait_s: float = 10.0) -> None:
        """Removes the file (clients' mappings stay valid until they unmap) and unmaps the region.

        Waits (at most `wait_s`) for read()s under way; later ones raise RegionClosed. Views of the
        region still held elsewhere keep the mapping alive until they are dropped."""
        with self._readers_done:
            self._closed = True
            if not self._readers_done.wait_for(lambda: self._readers == 0, timeout=wait_s):
                log.warning("arena: %d reads still running after %.0fs; closing anyway", self._readers, wait_s)
        if self._fd >= 0:
            if self.path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1
        self.view.release()
        with contextlib.suppress(BufferError):  # exported views still alive: the GC unmaps later
            self._map.close()


def _memfd(size: int) -> int:
    """A descriptor of a nameless memory file of `size` bytes (the same shared memory pages as an
    anonymous mapping, plus a descriptor for Region.read), or -1 where memfd_create is missing."""
    try:
        fd = os.memfd_create("kvcache-arena", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return -1
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_dead_arenas(directory: str, prefix: str = ARENA_PREFIX) -> int:
    """Removes arena files whose server died without removing them (a killed server's tmpfs pages).

    A live server holds an exclusive flock on its arena file for its lifetime, so a file whose lock
    can be taken belongs to no live server, whatever its age; clients never hold it (a presence
    reader tries a shared lock to learn whether its server lives, and lets it go at once).
    `prefix`: the files' names (kvcache_core.presence.PRESENCE_PREFIX: the presence tables).
    """
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live server's
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d %s* file(s) of servers that died in %s", removed, prefix, directory)
    return removed


class Extents:
    """A best-fit allocator of SLOT_ALIGN-aligned extents in [0, size). Not thread-safe (the RAM
    tier's lock guards it). O(free extents) per allocation, O(log n) plus a list shift per free.

    Invariants (checked by tests): free extents never overlap nor touch (touching ones coalesce),
    and free_bytes + allocated bytes == size.
    """

    def __init__(self, size: int) -> None:
        self.size = size // SLOT_ALIGN * SLOT_ALIGN
        self._starts: list[int] = [0] if self.size else []  # free extents' offsets, sorted
        self._len: dict[int, int] = {0: self.size} if self.size else {}
        self.free_bytes = self.size

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free extent of align(nbytes) bytes, now allocated; None if none fits."""
        need = align(max(nbytes, 1))
        best, best_len = -1, 0
        for start in self._starts:
            n = self._len[start]
            if n >= need and (best < 0 or n < best_len):
                best, best_len = start, n
                if n == need:
                    break
        if best < 0:
            return None
        i = bisect.bisect_left(self._starts, best)
        del self._starts[i]
        del self._len[best]
        if best_len > need:
            rest = best + need
            self._starts.insert(i, rest)
            self._len[rest] = best_len - need
        self.free_bytes -= need
        return best

    def free(self, offset: int, nbytes: int) -> None:
        """Returns the extent [offset, offset + align(nbytes)) allocated by alloc()."""
        size = align(max(nbytes, 1))
        self.free_bytes += size
        i = bisect.bisect_left(self._starts, offset)
        if i > 0:  # coalesce with the extent before
            prev = self._starts[i - 1]
            if prev + self._len[prev] == offset:
                offset, size = prev, self._len.pop(prev) + size
                del self._starts[i - 1]
                i -= 1
        if i < len(self._starts) and self._starts[i] == offset + size:  # and with the one after
            nxt = self._starts.pop(i)
            size += self._len.pop(nxt)
        self._starts.insert(i, offset)
        self._len[offset] = size

    def take(self, offset: int, nbytes: int) -> list[tuple[int, int]]:
        """Allocates whatever of [offset, offset + align(nbytes)) is free now; returns those pieces
        as (offset, length), by offset (each is given back with free()). The RAM tier holds an evicted
        block's extent this way while its bytes are copied out (kvcache_server/tiers/ram.py)."""
        end = offset + align(max(nbytes, 1))
        taken: list[tuple[int, int]] = []
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self._starts) and self._starts[i] < end:
            start = self._starts[i]
            stop = start + self._len[start]
            lo, hi = max(start, offset), min(stop, end)
            if lo >= hi:
                i += 1
                continue
            del self._starts[i]
            del self._len[start]
            if start < lo:  # the free piece before stays free
                self._starts.insert(i, start)
                self._len[start] = lo - start
                i += 1
            if hi < stop:  # and so does the one after
                self._starts.insert(i, hi)
                self._len[hi] = stop - hi
                i += 1
            self.free_bytes -= hi - lo
            taken.append((lo, hi - lo))
        return taken

    def fits(self, nbytes: int) -> bool:
        need = align(max(nbytes, 1))
        return any(n >= need for n in self._len.values())

    def extents(self) -> list[tuple[int, int]]:
        """The free extents as (offset, length), by offset (for tests and stats)."""
        return [(s, self._len[s]) for s in self._starts]


class Slot:
    """One allocated extent of the arena and who still needs it (the RAM tier's lock guards it)."""

    __slots__ = ("indexed", "length", "offset", "orphan_of", "pins")

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length  # the block's bytes; the extent is align(length)
        self.pins = 0  # live leases, plus 1 while it is a reservation
        self.indexed = False  # an index entry names it
        self.orphan_of: object | None = None  # out of the index but pinned: the partition it is charged to


@dataclass(slots=True, eq=False)
class Lease:
    """A read lease on one block: `view` (read-only, `length` bytes at `offset` of the arena) stays
    unchanged until release() or `expires` (time.monotonic()). Readers verify the block's
    key-bound checksum before use anyway: a lease misused past its time can only become a miss."""

    id: int
    namespace: str
    offset: int
    length: int
    view: memoryview
    expires: float
    _slot: Slot = field(repr=False)


@dataclass(slots=True, eq=False)
class Reservation:
    """A writable slot of `length` bytes at `offset` of the arena, for one block written in place.

    Write the whole block into `buffer`, then commit it under its key (TierStack.put_reserved, which
    calls RamTier.adopt_many) or abandon() it; not committed by `expires`, it is reclaimed."""

    id: int
    namespace: str
    offset: int
    length: int
    buffer: memoryview
    expires: float
    _slot: Slot = field(repr=False)


def create_shared_file(directory: str, prefix: str, size: int) -> tuple[int, str, mmap.mmap]:
    """A new file `prefix` + 32 random hex digits in `directory`, `size` bytes, mapped shared:
    (its descriptor, its path, the mapping). flock'd and record-locked while the descriptor lives (a
    client tells a live server's file from a dead one's by the locks: kvcache_core.filelock), mode
    0400 for every other opener (clients map it read-only; an open for writing fails with EACCES),
    every page allocated now (a full tmpfs is an OSError here, never a SIGBUS later). On an error
    nothing is left behind."""
    path = os.path.join(directory, prefix + secrets.token_hex(16))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this server lives
        hold_record_lock(fd)  # the same, which a reader checks without an exception (kvcache_core.filelock)
        os.fchmod(fd, 0o400)  # this descriptor stays writable
        os.posix_fallocate(fd, 0, size)
        return fd, path, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


_ID_KEY = secrets.token_bytes(32)
_ID_COUNTER = itertools.count(1)


def new_id(*tables: dict[int, object]) -> int:
    """A fresh 63-bit id that a client cannot guess (another's lease or reservation).

    A keyed BLAKE2b of a counter, under a key drawn once per process: unpredictable without the key,
    as a random draw is, but without a `getrandom` call per id. That syscall let go of the GIL, and
    on a busy server the event loop then waited for it back behind worker threads (42% of the loop's
    samples in a promotion-heavy Get were there; bench/bench_disk_tier.py, docs/disk-benchmarks.md).
    """
    while True:
        digest = hashlib.blake2b(next(_ID_COUNTER).to_bytes(8, "little"), key=_ID_KEY, digest_size=8).digest()
        new = (int.from_bytes(digest, "little") >> 1) or 1
        if all(new not in t for t in tables):
            return new
