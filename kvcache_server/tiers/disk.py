"""The disk tier: blocks in region files on a local file system (NVMe), between RAM and Redis/S3.

Layout and crash rules: kvcache_server.tiers.disk_layout (append-only records in fixed-size region
files). Why this layout (measured; docs/tiers.md "Disk tier"): a file per block costs a create, a
rename and an inode per block (here 0.4 ms per 4 KiB write, 16x an append), and a preallocated
file with an extent allocator needs a journal to rebuild its index; appends to regions cost two
syscalls per batch (group commit), and the index is rebuilt by reading the record headers only.

Who calls what, from which thread:
    The stack calls the async methods on the event loop. Index lookups (contains_many, known) run
    there, under self._lock, with no I/O. Reads run in `io_threads` reader threads, writes in
    `write_threads` writer threads: each writer thread owns one *active* region and appends to it
    alone. Deletes mark records in a reader thread. Nothing touches the disk on the event loop.

Capacity: capacity_bytes // region_bytes regions, each a file of at most region_bytes, so the
byte cap holds for the files whatever is written. When a writer needs a new region and none is
unused, the least recently used sealed region (read or written last the longest ago) is evicted
whole: its blocks leave the index, it gets a new epoch and is written again from its start. LRU
by region, not by block: a region that holds one hot block keeps its cold ones with it; blocks hit
here are also promoted to RAM, so what is hot lives there.

Page-cache writes: a new region file is preallocated whole (posix_fallocate) while the file system
has room to spare, so appends do not allocate blocks page by page (_preallocate: measured on ext4,
+36% and no more 0.3 GB/s stalls for 1 MiB appends).

Reads into place: read_into_many preads a record's header and block with one preadv, the block
straight into a buffer the caller gives (the stack: the RAM arena slot a promotion goes into), and
runs the caller's check (the block's checksum) in the reader thread while the block is in cache:
no fresh memory per block, one copy disk -> slot. get_many (a new bytes per block) stays for gets
that do not promote and for compressed tiers.

Reads race evictions safely without a lock around the I/O (a seqlock): a reader notes the
region's epoch with the index entry, preads, then checks the epoch again; an eviction bumps it
(under the lock) before anything is written into the region, so a changed epoch means the bytes
may be of the new records and the read is a miss.

Failures: an I/O error (EIO, a vanished or truncated file) on a read makes that key a miss and
drops it from the index (counted in errors); a full file system (ENOSPC) seals the region being
written where it ended, stops taking never-used regions for FULL_BACKOFF_S (evicting instead),
and refuses the write (counted in rejected and errors); meanwhile regions are reused within the
bytes their files already have. The tier never raises for one bad block;
it raises TierError only when a whole batch failed on I/O errors, so the stack's breaker opens
for a dead disk.

Longer than the project's ~500-line module guideline: the index, the regions' LRU, the writers' runs and
the readers' seqlock share one lock and one set of invariants (an entry names a live record of its
region's current epoch); the byte layout and the scan, which need none of that, are disk_layout.py.

Memory: the index holds, per block, one 20-byte bytes key (namespace id + key) and one int
(region, offset, length) in a dict, plus one reference in its region's key list:
INDEX_BYTES_PER_BLOCK, measured by tests/test_disk_tier.py in a server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvcache_core.threads import in_pool
from kvcache_server.tiers import disk_layout as layout
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats

log = logging.getLogger(__name__)

INDEX_BYTES_PER_BLOCK = 200
"""What the index costs in RAM per block held on disk, at most (measured ~150 with a million blocks)."""

FULL_BACKOFF_S = 30.0
"""After ENOSPC, how long the tier evicts regions instead of creating files it has not made yet."""

PREALLOCATE_ROOM = 4
"""A new region file is preallocated only while the file system has room for this many of them."""

_RUN_RECORDS = 256
"""Records one pwritev appends at most (well within IOV_MAX, 1024: a record takes up to 3 buffers)."""

Check = Callable[[memoryview, bytes], Exception | None]
"""read_into_many's check of a block where it landed, (buffer, key) -> why it is not valid, or None."""

_NO_HEAD = bytearray()  # what _read_into_one gets for a key not found (never read into)
_LAYOUT_FILE = "layout"
_LOCK_FILE = "lock"


@dataclass(eq=False, slots=True)
class _Region:
    id: int
    path: str
    epoch: int = 0
    fd: int = -1
    frontier: int = layout.REGION_HEADER_BYTES  # where the next record goes
    limit: int = 0  # where this region ends (region_bytes, or less once the disk was full)
    keys: list[bytes] = field(default_factory=list)  # index keys written in this epoch
    live_bytes: int = 0  # spans of its records still in the index
    active: bool = False  # a writer thread appends to it


class DiskTier(Tier):
    """Blocks in append-only region files in one directory."""

    name = "disk"
    kind = TierKind.DISK

    def __init__(
        self,
        directory: str,
        *,
        capacity_bytes: int,
        region_bytes: int = 64 << 20,
        io_threads: int = 8,
        write_threads: int = 2,
        on_evict: Callable[[str, list[bytes]], None] | None = None,
    ) -> None:
        """Opens (creating it if needed) the tier in `directory` and rebuilds the index from its regions.

        Args:
            directory: A directory on a local file system, used by this server alone (locked).
            capacity_bytes: The byte cap of all region files together.
            region_bytes: Size of one region (the unit of eviction); a block whose record does not fit
                in one is refused.
            io_threads: Reader threads (and deletes).
            write_threads: Writer threads, each appending to a region of its own.
            on_evict: Called on the event loop with (namespace, keys) the tier evicted.

        Raises:
            ValueError: capacity_bytes holds fewer than write_threads + 1 regions.
            OSError: the directory cannot be made or is locked by another process.
        """
        regions = capacity_bytes // region_bytes
        if region_bytes < 1 << 20 or region_bytes >= 1 << 32 or regions < write_threads + 1:
            raise ValueError(
                "disk: region_bytes must be in [1 MiB, 4 GiB) and capacity_bytes hold at least "
                f"write_threads + 1 = {write_threads + 1} regions (holds {regions})"
            )
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise OSError(errno.EBUSY, f"disk tier directory {directory} is in use by another process") from None
        self._region_bytes = region_bytes
        self._capacity = regions * region_bytes
        self._on_evict = on_evict
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._index: dict[bytes, int] = {}  # ns id (4 bytes) + key -> region << 64 | offset << 32 | length
        self._ns_ids: dict[str, bytes] = {}
        self._ns_names: list[str] = []
        self._regions = [_Region(i, str(self._dir / f"r{i:06d}.kvd"), limit=region_bytes) for i in range(regions)]
        self._unused: list[int] = []  # region ids without a file yet (popped from the end)
        self._lru: OrderedDict[int, None] = OrderedDict()  # sealed regions, least recently used first
        self._next_epoch = 1
        self._full_until = 0.0
        self._io_failed = False  # the last read or write failed with an OSError (ENOSPC aside)
        self._local = threading.local()  # a writer thread's active region
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvcache-disk-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="kvcache-disk-write")
        self._io_threads = io_threads
        self._stats = TierStats(name=self.name, kind=self.kind, capacity_bytes=self._capacity)
        self.rebuild_s = 0.0
        self._rebuild()

    # -- the index ------------------------------------------------------------------------------

    def _ns_id(self, namespace: str) -> bytes:
        ns = self._ns_ids.get(namespace)
        if ns is None:
            ns = len(self._ns_names).to_bytes(4, "little")
            self._ns_ids[namespace] = ns
            self._ns_names.append(namespace)
        return ns

    def _entry(self, namespace: str, key: bytes) -> bytes | None:
        ns = self._ns_ids.get(namespace)
        return None if ns is None else ns + key

    def _drop(self, entry: bytes, span: int, region: _Region) -> None:
        """Removes an index entry of `region` (under the lock)."""
        del self._index[entry]
        region.live_bytes -= span

    def _span_of(self, entry: bytes, length: int) -> int:
        return layout.record_span(len(self._ns_names[int.from_bytes(entry[:4], "little")].encode()), length)

    # -- start-up -------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Rebuilds the index from the region files; region files of another layout are removed."""
        start = time.perf_counter()
        marker = self._dir / _LAYOUT_FILE
        expected = f"kvcache disk tier 1\nregion_bytes {self._region_bytes}\n"
        if marker.exists() and marker.read_text() != expected:
            log.warning("disk tier %s: written with another layout or region size; starting empty", self._dir)
            for path in self._dir.glob("r*.kvd"):
                path.unlink()
        marker.write_text(expected)
        for path in self._dir.glob("r*.kvd"):
            stem = path.stem[1:]
            if not stem.isdigit() or int(stem) >= len(self._regions):
                path.unlink()  # beyond capacity_bytes (it was lowered): its blocks are gone
        sealed: list[_Region] = []
        prefixes: dict[bytes, bytes] = {}  # namespace as stored -> its index prefix
        for region in self._regions:
            if not os.path.exists(region.path):
                self._unused.append(region.id)
                continue
            region.fd = os.open(region.path, os.O_RDWR)
            epoch, records, end = layout.scan_region(region.path, self._region_bytes)
            region.epoch = epoch or 0
            region.frontier = end
            self._next_epoch = max(self._next_epoch, region.epoch + 1)
            keys, live_bytes = region.keys, 0
            for offset, live, length, key, namespace, span in records:
                if not live:
                    continue
                prefix = prefixes.get(namespace)
                if prefix is None:
                    prefix = prefixes[namespace] = self._ns_id(namespace.decode())
                entry = prefix + key
                old = self._index.get(entry)
                if old is not None:  # written again before an eviction's reuse of this region reached its header
                    other = self._regions[old >> 64]
                    if other.epoch >= region.epoch:
                        continue
                    self._drop(entry, span, other)
                self._index[entry] = region.id << 64 | offset << 32 | length
                keys.append(entry)
                live_bytes += span
            region.live_bytes += live_bytes
            sealed.append(region)
        for region in sorted(sealed, key=lambda r: r.epoch):  # oldest first: access times are not kept
            self._lru[region.id] = None
        self._unused.reverse()
        self.rebuild_s = time.perf_counter() - start
        if self._index:
            log.info(
                "disk tier %s: %d blocks in %d regions indexed in %.2fs",
                self._dir,
                len(self._index),
                len(sealed),
                self.rebuild_s,
            )

    # -- writing (writer threads) ---------------------------------------------------------------

    def _region_for(self, span: int) -> _Region | None:
        """This writer thread's active region with room for `span` bytes, or None (no region to be had)."""
        region: _Region | None = getattr(self._local, "region", None)
        if region is not None and region.frontier + span <= region.limit:
            return region
        for _ in range(len(self._regions)):  # with the disk full, a region may have less room than `span`
            with self._lock:
                if region is not None:
                    region.active = False
                    self._lru[region.id] = None
                    self._local.region = None
                region, evicted = self._take_region()
            if evicted:
                self._evicted(evicted)
            if region is None:
                return None
            try:
                if region.fd < 0 or os.fstat(region.fd).st_nlink == 0:  # never made, or removed behind our back
                    if region.fd >= 0:
                        os.close(region.fd)
                    region.fd = -1
                    region.fd = os.open(region.path, os.O_RDWR | os.O_CREAT, 0o600)
                    _preallocate(region.fd, region.limit)
                _pwrite_all(region.fd, layout.pack_region_header(region.epoch, self._region_bytes), 0)
            except OSError as exc:
                self._write_failed(region, exc)
                return None
            self._local.region = region
            if region.frontier + span <= region.limit:
                return region
        return None

    def _take_region(self) -> tuple[_Region | None, list[tuple[str, bytes]]]:
        """A region to write, fresh or evicted (under the lock), and the (namespace, key) it evicted."""
        evicted: list[tuple[str, bytes]] = []
        if self._unused and time.monotonic() >= self._full_until:
            region = self._regions[self._unused.pop()]
        elif self._lru:
            region = self._regions[self._lru.popitem(last=False)[0]]
            for entry in region.keys:
                where = self._index.get(entry)
                if where is not None and where >> 64 == region.id:
                    del self._index[entry]
                    evicted.append((self._ns_names[int.from_bytes(entry[:4], "little")], entry[4:]))
            self._stats.evictions += len(evicted)
        else:
            return None, evicted
        region.epoch = self._next_epoch  # first: readers of its old records now miss
        self._next_epoch += 1
        region.keys = []
        region.live_bytes = 0
        region.frontier = layout.REGION_HEADER_BYTES
        region.limit = self._region_bytes
        if time.monotonic() < self._full_until and region.fd >= 0:
            # The disk is full: write this region within the bytes its file has (in place, no new space).
            region.limit = max(layout.REGION_HEADER_BYTES, min(self._region_bytes, os.fstat(region.fd).st_size & ~7))
        region.active = True
        return region, evicted

    def _evicted(self, evicted: list[tuple[str, bytes]]) -> None:
        if self._on_evict is None or self._loop is None:
            return
        by_ns: dict[str, list[bytes]] = {}
        for namespace, key in evicted:
            by_ns.setdefault(namespace, []).append(key)
        for namespace, keys in by_ns.items():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown): nobody to tell
                self._loop.call_soon_threadsafe(self._on_evict, namespace, keys)

    def _write_failed(self, region: _Region, exc: OSError) -> None:
        """Seals `region` where it ends after a failed write; a full disk also pauses new region files."""
        with self._lock:
            self._stats.errors += 1
            self._io_failed = exc.errno != errno.ENOSPC
            if exc.errno == errno.ENOSPC:
                self._full_until = time.monotonic() + FULL_BACKOFF_S
            region.limit = region.frontier
            if region.active:  # last in line: with the disk full, regions reused in place are what work
                region.active = False
                self._lru[region.id] = None
            if getattr(self._local, "region", None) is region:
                self._local.region = None
        log.warning("disk tier: write to %s failed (%s); region sealed at %d bytes", region.path, exc, region.frontier)

    def _put_blocking(self, namespace: str, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        ns = namespace.encode()
        out = [False] * len(items)
        with self._lock:
            prefix = self._ns_id(namespace)
        todo = []
        for i, (key, block) in enumerate(items):
            if prefix + key in self._index:
                out[i] = True  # content-addressed: the same bytes are there
            elif layout.record_span(len(ns), len(block)) > self._region_bytes - layout.REGION_HEADER_BYTES:
                with self._lock:
                    self._stats.rejected += 1
            else:
                todo.append(i)
        while todo:
            region = self._region_for(layout.record_span(len(ns), len(items[todo[0]][1])))
            if region is None:
                with self._lock:
                    self._stats.rejected += len(todo)
                break
            run, end = [], region.frontier
            for i in todo:  # the items that fit in this region, in order
                span = layout.record_span(len(ns), len(items[i][1]))
                if end + span > region.limit or len(run) >= _RUN_RECORDS:
                    break
                run.append(i)
                end += span
            todo = todo[len(run) :]
            if not self._append(region, ns, prefix, [items[i] for i in run]):
                with self._lock:
                    self._stats.rejected += len(run)
                continue
            for i in run:
                out[i] = True
        return out

    def _append(self, region: _Region, ns: bytes, prefix: bytes, run: list[tuple[bytes, bytes | memoryview]]) -> bool:
        """Appends records to this writer thread's region; False when the write failed (the region is sealed).

        Group commit: one pwritev of all the records with the first one's magic zeroed, then one 4-byte
        pwrite of that magic. Until it lands, the scan stops at the first record and sees none of them;
        once it has, every record of the run is in the page cache whole (disk_layout: a valid header
        implies its block).
        """
        offset = region.frontier
        buffers: list[bytes | memoryview] = []
        spans = []
        for key, block in run:
            header = layout.pack_record_header(region.epoch, ns, key, len(block))
            buffers += [header if buffers else bytes(4) + header[4:], block]
            pad = layout.aligned(len(block)) - len(block)
            if pad:
                buffers.append(bytes(pad))
            spans.append(len(header) + len(block) + pad)
        try:
            _pwritev_all(region.fd, buffers, offset)
            _pwrite_all(region.fd, layout.RECORD_MAGIC, offset)
        except OSError as exc:
            self._write_failed(region, exc)
            return False
        with self._lock:
            at = offset
            for (key, block), span in zip(run, spans, strict=True):
                entry = prefix + key
                old = self._index.get(entry)  # another thread's put of the same key, meanwhile
                if old is not None:
                    self._regions[old >> 64].live_bytes -= span
                self._index[entry] = region.id << 64 | at << 32 | len(block)
                region.keys.append(entry)
                at += span
            region.live_bytes += at - offset
            region.frontier = at
            self._stats.puts += len(run)
        return True

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        self._loop = asyncio.get_running_loop()
        # Waited to its end even when the stack's timeout cancels the call (RedisTier.put_many).
        return await in_pool(self._writers, self._put_blocking, namespace, items)

    # -- reading (reader threads) ---------------------------------------------------------------

    def _locate(self, entry: bytes) -> tuple[int, _Region, int, int] | None:
        """(where, its region, the region's epoch now, the record header's length) of an index entry,
        or None; marks the region used (LRU). The seqlock's first half: the caller reads, then checks
        that region.epoch is still the epoch returned here."""
        with self._lock:
            where = self._index.get(entry)
            if where is None:
                return None
            region = self._regions[where >> 64]
            epoch = region.epoch
            if region.id in self._lru:
                self._lru.move_to_end(region.id)
        nslen = len(self._ns_names[int.from_bytes(entry[:4], "little")].encode())
        return where, region, epoch, layout.header_len(nslen)

    def _checked(
        self, entry: bytes, where: int, region: _Region, epoch: int, head: bytes | bytearray, got: int
    ) -> bool:
        """The seqlock's second half and the record's own checks, after a read of `got` bytes (header
        and block) of the record at `where`: True when they are the record the index names."""
        if region.epoch != epoch:
            return False  # evicted while read: the bytes may be of its new records
        header = layout.parse_record_header(head)
        if header is not None and not header.live and header.key == entry[4:]:
            return False  # deleted while read
        length = where & 0xFFFFFFFF
        if header is None or header.key != entry[4:] or header.length != length or got != len(head) + length:
            self._forget(entry, where, region)  # truncated, overwritten or vanished behind our back
            with self._lock:
                self._stats.errors += 1
            return False
        return True

    def _read_one(self, entry: bytes | None) -> bytes | OSError | None:
        found = None if entry is None else self._locate(entry)
        if found is None:
            return None
        assert entry is not None
        where, region, epoch, hlen = found
        offset, length = (where >> 32) & 0xFFFFFFFF, where & 0xFFFFFFFF
        try:
            head = os.pread(region.fd, hlen, offset)
            block = os.pread(region.fd, length, offset + hlen)
        except OSError as exc:
            if region.epoch != epoch:
                return None
            self._forget(entry, where, region)
            return exc
        return block if self._checked(entry, where, region, epoch, head, len(head) + len(block)) else None

    def _locate_many(self, entries: list[bytes | None]) -> list[tuple[int, _Region, int] | None]:
        """_locate for a reader thread's whole part of a batch under one hold of the lock, (where,
        region, epoch) each: a lock round per block cost ~3% of a promotion of 1 MiB blocks."""
        out: list[tuple[int, _Region, int] | None] = []
        index, regions, lru = self._index, self._regions, self._lru
        with self._lock:
            for entry in entries:
                where = None if entry is None else index.get(entry)
                if where is None:
                    out.append(None)
                    continue
                region = regions[where >> 64]
                out.append((where, region, region.epoch))
                if region.id in lru:
                    lru.move_to_end(region.id)
        return out

    def _read_into_one(
        self,
        entry: bytes | None,
        found: tuple[int, _Region, int] | None,
        dest: memoryview,
        head: bytearray,
        check: Check | None,
    ) -> bool | Exception:
        """Reads the record of `entry`, located at `found` (_locate_many), with one preadv: its header
        into `head` (a buffer of its thread's part, reused: exactly the header's length), its block
        straight into `dest` (which must be exactly the block's length). False: not held, evicted,
        deleted or overwritten meanwhile, or torn; `dest` then holds bytes of no use."""
        if found is None:
            return False
        assert entry is not None
        where, region, epoch = found
        if len(dest) != where & 0xFFFFFFFF:
            return False  # the key was written again (another length) since the caller sized `dest`
        try:
            got = os.preadv(region.fd, [head, dest], (where >> 32) & 0xFFFFFFFF)
        except OSError as exc:
            if region.epoch != epoch:
                return False
            self._forget(entry, where, region)
            return exc
        if not self._checked(entry, where, region, epoch, head, got):
            return False
        if check is not None:  # here, while the block is in this core's cache, not in a second pass
            failed = check(dest, entry[4:])
            if failed is not None:
                return failed
        return True

    def _forget(self, entry: bytes, where: int, region: _Region) -> None:
        with self._lock:
            if self._index.get(entry) == where:
                self._drop(entry, self._span_of(entry, where & 0xFFFFFFFF), region)

    def _read_blocking(self, entries: list[bytes | None]) -> list[bytes | OSError | None]:
        return [self._read_one(e) for e in entries]

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | None]:
        entries = [self._entry(namespace, k) for k in keys]
        wanted = [e for e in entries if e is not None and e in self._index]
        out: list[bytes | None] = [None] * len(keys)
        if wanted:
            loop = asyncio.get_running_loop()
            step = max(1, -(-len(entries) // self._io_threads))  # spread a batch over the readers
            parts = await asyncio.gather(
                *(
                    loop.run_in_executor(self._readers, self._read_blocking, entries[i : i + step])
                    for i in range(0, len(entries), step)
                )
            )
            read = [r for part in parts for r in part]
            failures = [r for r in read if isinstance(r, OSError)]
            if failures:
                with self._lock:
                    self._stats.errors += len(failures)
                    self._io_failed = True
                if len(failures) == len(wanted):
                    raise TierError(f"disk tier {self._dir}: {failures[0]}")
            out = [r if isinstance(r, bytes) else None for r in read]
        with self._lock:
            hits = sum(b is not None for b in out)
            self._stats.hits += hits
            self._stats.misses += len(keys) - hits
        return out

    def lengths(self, namespace: str, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's block length from the index (no I/O: call it on the event loop), None where the
        tier does not hold it: what a caller sizes the destinations of read_into_many by."""
        ns = self._ns_ids.get(namespace)
        if ns is None:
            return [None] * len(keys)
        index = self._index
        out: list[int | None] = []
        for key in keys:
            where = index.get(ns + key)
            out.append(None if where is None else where & 0xFFFFFFFF)
        return out

    def _read_into_blocking(
        self, items: list[tuple[bytes | None, memoryview]], check: Check | None
    ) -> list[bool | Exception]:
        heads: dict[int, bytearray] = {}  # by header length (one per namespace length): reused
        out: list[bool | Exception] = []
        for (entry, dest), found in zip(items, self._locate_many([e for e, _ in items]), strict=True):
            head = _NO_HEAD
            if found is not None:
                assert entry is not None
                hlen = layout.header_len(len(self._ns_names[int.from_bytes(entry[:4], "little")].encode()))
                head = heads.get(hlen) or heads.setdefault(hlen, bytearray(hlen))
            out.append(self._read_into_one(entry, found, dest, head, check))
        return out

    async def read_into_many(
        self, namespace: str, items: Sequence[tuple[bytes, memoryview]], check: Check | None = None
    ) -> list[bool | Exception]:
        """Reads each key's block straight into the writable buffer given with it (sized by lengths()),
        in the reader threads: no memory of the tier's own per block (the stack passes the RAM arena
        slots its promotions go into, so a disk hit costs one copy, disk -> slot).

        True where the buffer now holds the block the index names, its record header, key binding and
        region epoch (the seqlock) checked after the read; False: a miss (not held, evicted, deleted
        or rewritten while read, torn), and the buffer's bytes are of no use. With `check`, called as
        check(buffer, key) in the reader thread right after each read that passed those checks (the
        block still in that core's cache): what it returns instead of None (the stack: why the block
        fails its checksum) is that key's result, counted as a miss here.

        Awaited to its end even when the caller is cancelled (a timeout): no thread writes into a
        buffer after this returns or raises, so the caller may free it then.

        Raises:
            TierError: every block held failed on an I/O error.
        """
        entries = [(self._entry(namespace, k), dest) for k, dest in items]
        wanted = sum(e is not None and e in self._index for e, _ in entries)
        read: list[bool | Exception] = [False] * len(items)
        if wanted:
            step = max(1, -(-len(entries) // self._io_threads))
            parts = await _all_to_end(
                [
                    asyncio.get_running_loop().run_in_executor(
                        self._readers, self._read_into_blocking, entries[i : i + step], check
                    )
                    for i in range(0, len(entries), step)
                ]
            )
            read = [r for part in parts for r in part]
        failures = [r for r in read if isinstance(r, OSError)]
        with self._lock:
            hits = sum(r is True for r in read)
            self._stats.hits += hits
            self._stats.misses += len(items) - hits
            if failures:
                self._stats.errors += len(failures)
                self._io_failed = True
        if failures and len(failures) == wanted:
            raise TierError(f"disk tier {self._dir}: {failures[0]}")
        return [False if isinstance(r, OSError) else r for r in read]

    def holds(self, namespace: str, key: bytes) -> bool:
        """Whether the index holds `key` (no I/O, no lock: one dict lookup, safe from any thread; the
        RAM tier asks it under its own lock for each victim it evicts, RamTier held_below)."""
        ns = self._ns_ids.get(namespace)
        return ns is not None and ns + key in self._index

    def known(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        ns = self._ns_ids.get(namespace)
        if ns is None:
            return [False] * len(keys)
        index = self._index
        return [ns + k in index for k in keys]

    async def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """From the index; while the last I/O failed, only once a read of the disk works again (so the
        stack's breaker, whose probes call this, stays open for a dead disk)."""
        if self._io_failed:
            await asyncio.get_running_loop().run_in_executor(self._readers, self._check_io)
        return self.known(namespace, keys)

    def _check_io(self) -> None:
        try:
            for region in self._regions:
                if region.fd >= 0:
                    os.pread(region.fd, layout.REGION_HEADER_BYTES, 0)
            os.listdir(self._dir)
        except OSError as exc:
            raise TierError(f"disk tier {self._dir}: {exc}") from exc
        self._io_failed = False

    # -- deleting -------------------------------------------------------------------------------

    def _delete_blocking(self, entries: list[bytes | None]) -> list[bool]:
        out = []
        for entry in entries:
            with self._lock:  # held across the mark: no eviction can reuse the region meanwhile
                where = self._index.get(entry) if entry is not None else None
                if where is None:
                    out.append(False)
                    continue
                assert entry is not None
                region = self._regions[where >> 64]
                self._drop(entry, self._span_of(entry, where & 0xFFFFFFFF), region)
                try:
                    os.pwrite(region.fd, layout.DELETED_MAGIC, (where >> 32) & 0xFFFFFFFF)
                except OSError as exc:  # gone from the index: not served; may come back after a restart
                    self._stats.errors += 1
                    log.warning("disk tier: marking a deleted block in %s failed: %s", region.path, exc)
                out.append(True)
        return out

    async def delete_present(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        entries = [self._entry(namespace, k) for k in keys]
        if not any(e is not None and e in self._index for e in entries):
            return [False] * len(keys)
        return await in_pool(self._readers, self._delete_blocking, entries)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(await self.delete_present(namespace, keys))

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(
                name=s.name,
                kind=s.kind,
                used_bytes=sum(r.live_bytes for r in self._regions),
                capacity_bytes=self._capacity,
                blocks=len(self._index),
                hits=s.hits,
                misses=s.misses,
                puts=s.puts,
                evictions=s.evictions,
                rejected=s.rejected,
                errors=s.errors,
            )

    def disk_bytes(self) -> int:
        """Bytes the region files take (their sizes), at most capacity_bytes."""
        total = 0
        for region in self._regions:
            try:
                total += os.stat(region.path).st_size
            except OSError:
                continue
        return total

    async def close(self) -> None:
        # In a thread: the pools' threads end first (a write still running must not find its descriptor
        # closed, or reused by another file), without holding the event loop meanwhile.
        await asyncio.to_thread(self._close_blocking)

    def _close_blocking(self) -> None:
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for region in self._regions:
            if region.fd >= 0:
                os.close(region.fd)
                region.fd = -1
        os.close(self._lock_fd)


async def _all_to_end(futures: list[asyncio.Future[list[bool | Exception]]]) -> list[list[bool | Exception]]:
    """The results of executor futures, in order; if the awaiting task is cancelled, waits for every one
    of them to end first (their threads write into the caller's buffers), then lets it propagate."""
    try:
        return await asyncio.shield(asyncio.gather(*futures))
    except asyncio.CancelledError:
        while not all(f.done() for f in futures):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(futures)
        for f in futures:
            if not f.cancelled():
                f.exception()  # retrieved: the caller is cancelled whatever the threads ended with
        raise


def _preallocate(fd: int, nbytes: int) -> None:
    """Allocates a new region file's blocks up front (posix_fallocate), so that its appends into the
    page cache do not allocate blocks page by page (ext4's delayed allocation): measured, a pwritev of
    256 blocks of 1 MiB into a new file ran at 3.34 GB/s (0.31-3.96 over 7 rounds), into a
    preallocated one at 4.55 GB/s (4.04-5.24) (docs/disk-benchmarks.md). Only while the file system
    has room for PREALLOCATE_ROOM such files: near full, or where it cannot, the file is left empty
    and written as before, so a disk that fills is met by the writes themselves (ENOSPC), as the
    tier's full-disk rules expect (regions reused within the bytes their files hold)."""
    try:
        room = os.fstatvfs(fd)
        if room.f_bavail * room.f_frsize < PREALLOCATE_ROOM * nbytes:
            return
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.ftruncate(fd, 0)  # a new file: nothing of it to keep; what a failed fallocate took goes back


def _pwritev_all(fd: int, buffers: list[bytes | memoryview], offset: int) -> None:
    """pwritev until all of `buffers` is written (a short write goes on where it stopped)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite until all of `data` is written; a short write that makes no progress is ENOSPC."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        view, offset = view[n:], offset + n
