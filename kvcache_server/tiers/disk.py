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
here are also promoted to RAM, so what is hot lives there. Retained records (a put's retain_ttl_s,
within the tenant's share; tiers/disk_retention.py) are copied forward into the region that reuses
theirs, by the writer thread that takes it, before its plain blocks are dropped (_region_for).

Page-cache writes: a new region file is preallocated whole (posix_fallocate) while the file system
has room to spare, so appends do not allocate blocks page by page (_preallocate: measured on ext4,
+36% and no more 0.3 GB/s stalls for 1 MiB appends).

Reads into place: read_into_many preads a record's header and block with one preadv, the block
straight into a buffer the caller gives (the stack: the RAM arena slot a promotion goes into), and
runs the caller's check (the block's checksum) in the reader thread while the block is in cache:
no fresh memory per block, one copy disk -> slot. get_many stays for gets that do not promote and
for compressed tiers: it reads blocks of 256 KiB and more into buffers it refills once nothing
references them (tiers/reuse.py; fresh pages cost ~220 faults per MiB), smaller ones into new bytes.

Reads race evictions safely without a lock around the I/O (a seqlock): a reader notes the
region's epoch with the index entry, preads, then checks the epoch again; an eviction bumps it
(under the lock) before anything is written into the region, so a changed epoch means the bytes
may be of the new records and the read is a miss.

Failures: an I/O error (EIO, a vanished or truncated file) on a read makes that key a miss and
drops it from the index (counted in errors); a full file system or quota (FULL_ERRNOS) seals the
region being written where it ended, stops taking never-used regions for FULL_BACKOFF_S (evicting
instead), and refuses the write (counted in rejected and errors); meanwhile regions are reused
within the bytes their files already have. Another failed write (EACCES, EROFS) seals its region
and refuses the write, counted, and leaves reads alone. The tier never raises for one bad block;
it raises TierError only when a whole batch of reads failed on I/O errors, or a batch of writes
wrote nothing on a dead device (DEAD_ERRNOS), so the stack's breaker opens for a dead disk.

Longer than the project's ~500-line module guideline: the index, the regions' LRU, the writers' runs,
the readers' seqlock and the copying forward of retained records share one lock and one set of
invariants (an entry names a live record of its region's current epoch, or is in _moving while copied
forward); the byte layout and the scan, which need none of that, are disk_layout.py, the retention
accounts disk_retention.py.

Memory: the index holds, per block, one 20-byte bytes key (namespace id + key) and one int
(region, offset, length) in a dict, plus one reference in its region's key list:
INDEX_BYTES_PER_BLOCK, measured by tests/test_disk_tier.py in a server process. Besides it, get_many's
reused read buffers: at most read_buffers_bytes, grown only as reads that do not promote need them.
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
from kvcache_server.tiers.disk_retention import DiskRetention, Moved
from kvcache_server.tiers.retention import RetentionLimits
from kvcache_server.tiers.reuse import ReusePool

log = logging.getLogger(__name__)

INDEX_BYTES_PER_BLOCK = 200
"""What the index costs in RAM per block held on disk, at most (measured ~150 with a million blocks)."""

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A write that failed with one of these found the file system (or the user's quota) full."""

DEAD_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV})
"""A write that failed with one of these found the device gone: a batch that wrote nothing for it is a
TierError (the breaker opens). Others (EACCES, EROFS: the directory or the file system made
unwritable) refuse that write, counted, and leave what the tier holds readable."""

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
        read_buffers_bytes: int = 256 << 20,
        on_evict: Callable[[str, list[bytes]], None] | None = None,
        retention: RetentionLimits | None = None,
        verify: Check | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Opens (creating it if needed) the tier in `directory` and rebuilds the index from its regions.

        Args:
            directory: A directory on a local file system, used by this server alone (locked).
            capacity_bytes: The byte cap of all region files together.
            region_bytes: Size of one region (the unit of eviction); a block whose record does not fit
                in one is refused.
            io_threads: Reader threads (and deletes).
            write_threads: Writer threads, each appending to a region of its own.
            read_buffers_bytes: The cap of the buffers get_many reads blocks of 256 KiB and more into,
                reused once nothing references them (tiers/reuse.py); 0: a new bytes per block.
            on_evict: Called on the event loop with (namespace, keys) the tier evicted.
            retention: The shares of capacity_bytes that retained records may take, per tenant and in
                all (the [retention] section; tiers/disk_retention.py). Default: RetentionLimits().
            verify: Checks a retained block read for copying forward, as verify(block, key) -> why it
                is not valid or None (the stack's check of a stored block); None: its header only.
            clock: The monotonic clock retention deadlines are read against.

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
        self._io_failed = False  # the last read failed with an OSError, or a write with one of DEAD_ERRNOS
        self._local = threading.local()  # a writer thread's active region
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvcache-disk-read")
        self._writers = ThreadPoolExecutor(write_threads, thread_name_prefix="kvcache-disk-write")
        self._io_threads = io_threads
        self._buffers = ReusePool(read_buffers_bytes)
        self._stats = TierStats(name=self.name, kind=self.kind, capacity_bytes=self._capacity)
        self._retention = DiskRetention(retention or RetentionLimits(), self._capacity)
        self._moving: set[bytes] = set()  # retained entries out of the index while copied forward
        self._verify = verify
        self._clock = clock
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
        """Removes an index entry of `region` (under the lock); its retention, if any, ends."""
        del self._index[entry]
        region.live_bytes -= span
        self._retention.drop(entry)

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
                region, retained = self._pick_region()
            if region is None:
                return None
            moved: list[Moved] = []
            if retained is not None:  # an evicted region: its live retained records are read first
                read = self._read_retained(region, retained)
                with self._lock:
                    evicted, moved = self._reuse(region, read)
                if evicted:
                    self._evicted(evicted)
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
                self._lose_moved(moved)
                return None
            self._local.region = region
            if moved:
                self._copy_forward(region, moved)
            if region.frontier + span <= region.limit:
                return region
        return None

    def _pick_region(self) -> tuple[_Region | None, list[tuple[bytes, int]] | None]:
        """A region to write (under the lock): a never-used one, made ready (None second), or the least
        recently used sealed one, out of the LRU (so no other writer takes it) but not yet evicted,
        with the (entry, where) of its live retained records (maybe none), for _reuse to evict."""
        if self._unused and time.monotonic() >= self._full_until:
            region = self._regions[self._unused.pop()]
            self._reset(region)
            return region, None
        if not self._lru:
            return None, None
        region = self._regions[self._lru.popitem(last=False)[0]]
        region.active = True
        self._retention.decay(self._clock())  # expired retention: plain, evicted with its region
        retained = []
        if len(self._retention):
            for entry in region.keys:
                where = self._index.get(entry)
                if where is not None and where >> 64 == region.id and entry in self._retention:
                    retained.append((entry, where))
        return region, retained

    def _read_retained(self, region: _Region, retained: list[tuple[bytes, int]]) -> list[tuple[Moved, int]]:
        """Reads and verifies the retained records of a region about to be evicted (in this writer
        thread, without the lock: the region is out of the LRU, so nobody else reuses it meanwhile).
        Bounded by the retained bytes of that one region; what fails is left out (dropped, counted)."""
        out: list[tuple[Moved, int]] = []
        for entry, where in retained:
            ns = self._ns_names[int.from_bytes(entry[:4], "little")].encode()
            length = where & 0xFFFFFFFF
            head, block = bytearray(layout.header_len(len(ns))), bytearray(length)
            try:
                got = os.preadv(region.fd, [head, block], (where >> 32) & 0xFFFFFFFF)
            except OSError:
                continue
            header = layout.parse_record_header(head)
            if (
                header is None
                or not header.live  # deleted since it was located
                or header.epoch != region.epoch
                or header.key != entry[4:]
                or header.length != length
                or got != len(head) + length
            ):
                continue
            if self._verify is not None and self._verify(memoryview(block), entry[4:]) is not None:
                continue
            out.append((Moved(entry, ns, block), where))
        return out

    def _reuse(self, region: _Region, read: list[tuple[Moved, int]]) -> tuple[list[tuple[str, bytes]], list[Moved]]:
        """Evicts a region taken by _pick_region (under the lock): its blocks leave the index, except
        the retained records read from it that are still where they were read (not deleted or written
        again meanwhile), which wait in self._moving to be appended to it again. Returns the
        (namespace, key) evicted and the records to copy forward."""
        keep = {m.entry: where for m, where in read}
        evicted: list[tuple[str, bytes]] = []
        for entry in region.keys:
            where = self._index.get(entry)
            if where is None or where >> 64 != region.id:
                continue
            del self._index[entry]
            if keep.get(entry) == where and entry in self._retention:
                self._moving.add(entry)
                continue
            if self._retention.drop(entry):
                self._retention.dropped += 1  # retained, but unreadable or failing verification
            evicted.append((self._ns_names[int.from_bytes(entry[:4], "little")], entry[4:]))
        self._stats.evictions += len(evicted)
        moved = [m for m, _ in read if m.entry in self._moving]
        self._reset(region)
        return evicted, moved

    def _reset(self, region: _Region) -> None:
        """Starts a region's new epoch (under the lock), empty, as this writer's to append to."""
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

    def _copy_forward(self, region: _Region, moved: list[Moved]) -> None:
        """Appends the retained records of the region's last epoch to its new one (this writer's
        active region) and indexes them again; what does not fit or fails to write is dropped, counted."""
        done = 0
        while done < len(moved):
            run: list[Moved] = []
            end = region.frontier
            for m in moved[done : done + _RUN_RECORDS]:
                span = layout.record_span(len(m.namespace), len(m.block))
                if end + span > region.limit:
                    break
                run.append(m)
                end += span
            if not run:
                break
            offset = region.frontier
            spans = self._write_run(region, [(m.namespace, m.entry[4:], m.block) for m in run])
            if spans is None:
                break
            done += len(run)
            deleted = []
            with self._lock:
                at = offset
                for m, span in zip(run, spans, strict=True):
                    if m.entry not in self._moving:
                        deleted.append(at)  # deleted while it moved: marked so, for a restart
                    elif m.entry in self._index:  # written again by a put meanwhile: that record stays
                        self._moving.discard(m.entry)
                    else:
                        self._moving.discard(m.entry)
                        self._index[m.entry] = region.id << 64 | at << 32 | len(m.block)
                        region.keys.append(m.entry)
                        region.live_bytes += span
                        self._retention.copied += 1
                    at += span
                region.frontier = at
            for at in deleted:  # the region is this thread's active one: nobody reuses it meanwhile
                with contextlib.suppress(OSError):
                    os.pwrite(region.fd, layout.DELETED_MAGIC, at)
        self._lose_moved(moved[done:])

    def _lose_moved(self, moved: list[Moved]) -> None:
        """Retained records that could not be copied forward: gone with their region, counted."""
        if not moved:
            return
        lost: list[tuple[str, bytes]] = []
        with self._lock:
            for m in moved:
                if m.entry in self._moving:
                    self._moving.discard(m.entry)
                    self._retention.drop(m.entry)
                    self._retention.dropped += 1
                    lost.append((self._ns_names[int.from_bytes(m.entry[:4], "little")], m.entry[4:]))
            self._stats.evictions += len(lost)
        self._evicted(lost)

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
        """Seals `region` where it ends after a failed write; a full disk (or quota) also pauses new
        region files; a dead device makes probes read the disk before answering (_check_io)."""
        with self._lock:
            self._stats.errors += 1
            if exc.errno in DEAD_ERRNOS:
                self._io_failed = True
                self._local.dead = exc
            if exc.errno in FULL_ERRNOS:
                self._full_until = time.monotonic() + FULL_BACKOFF_S
                self._local.full = exc
            region.limit = region.frontier
            if region.active:  # last in line: with the disk full, regions reused in place are what work
                region.active = False
                self._lru[region.id] = None
            if getattr(self._local, "region", None) is region:
                self._local.region = None
        log.warning("disk tier: write to %s failed (%s); region sealed at %d bytes", region.path, exc, region.frontier)

    def _put_blocking(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        until: Sequence[float] | None = None,
    ) -> list[bool]:
        ns = namespace.encode()
        out = [False] * len(items)
        with self._lock:
            prefix = self._ns_id(namespace)
        self._local.dead = self._local.full = None
        todo = []
        for i, (key, block) in enumerate(items):
            if prefix + key in self._index:
                out[i] = True  # content-addressed: the same bytes are there
                if until is not None and until[i] > 0:
                    self.retain(namespace, [key], until[i])
            elif layout.record_span(len(ns), len(block)) > self._region_bytes - layout.REGION_HEADER_BYTES:
                with self._lock:
                    self._stats.rejected += 1
            else:
                todo.append(i)
        attempted = list(todo)
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
            deadlines = [until[i] for i in run] if until else None
            if not self._append(region, ns, prefix, [items[i] for i in run], deadlines):
                with self._lock:
                    self._stats.rejected += len(run)
                continue
            for i in run:
                out[i] = True
        dead: OSError | None = self._local.dead
        if dead is not None and self._local.full is None and attempted and not any(out[i] for i in attempted):
            # Nothing written, the device gone (not a full disk, not a refused file: those leave what
            # the tier holds readable): a failure of the call, so the stack's breaker opens as for
            # reads, instead of the promotions of other tiers' hits writing to a dead disk each time.
            raise TierError(f"disk tier {self._dir}: {dead}")
        return out

    def _append(
        self,
        region: _Region,
        ns: bytes,
        prefix: bytes,
        run: list[tuple[bytes, bytes | memoryview]],
        until: list[float] | None = None,
    ) -> bool:
        """Appends records of one namespace to this writer thread's region and indexes them, retained
        until `until` (per record, 0.0: plain) where given; False when the write failed (the region is
        sealed)."""
        offset = region.frontier
        spans = self._write_run(region, [(ns, key, block) for key, block in run])
        if spans is None:
            return False
        with self._lock:
            now = self._clock() if until else 0.0
            if until:
                self._retention.decay(now)
            at = offset
            for i, ((key, block), span) in enumerate(zip(run, spans, strict=True)):
                entry = prefix + key
                old = self._index.get(entry)  # another thread's put of the same key, meanwhile
                if old is not None:
                    self._regions[old >> 64].live_bytes -= span
                self._index[entry] = region.id << 64 | at << 32 | len(block)
                region.keys.append(entry)
                if until and until[i] > 0:
                    self._retention.grant(entry, self._ns_names[int.from_bytes(prefix, "little")], span, until[i], now)
                at += span
            region.live_bytes += at - offset
            region.frontier = at
            self._stats.puts += len(run)
        return True

    def _write_run(
        self, region: _Region, run: list[tuple[bytes, bytes, bytes | memoryview | bytearray]]
    ) -> list[int] | None:
        """Writes (namespace, key, block) records at the region's frontier; their spans, or None when
        the write failed (the region is sealed). Does not index them.

        Group commit: one pwritev of all the records with the first one's magic zeroed, then one 4-byte
        pwrite of that magic. Until it lands, the scan stops at the first record and sees none of them;
        once it has, every record of the run is in the page cache whole (disk_layout: a valid header
        implies its block).
        """
        offset = region.frontier
        buffers: list[bytes | memoryview | bytearray] = []
        spans = []
        for ns, key, block in run:
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
            return None
        return spans

    async def put_many(self, namespace: str, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        self._loop = asyncio.get_running_loop()
        # Waited to its end even when the stack's timeout cancels the call (RedisTier.put_many).
        return await in_pool(self._writers, self._put_blocking, namespace, items)

    async def put_retained(
        self, namespace: str, items: Sequence[tuple[bytes, bytes]], until: Sequence[float]
    ) -> list[bool]:
        """put_many, each block retained until its deadline in `until` (monotonic; 0.0: plain), within
        the tenant's and the tier's retained share (past it: stored plain, counted in refused)."""
        self._loop = asyncio.get_running_loop()
        return await in_pool(self._writers, self._put_blocking, namespace, items, until)

    def retain(self, namespace: str, keys: Sequence[bytes], until: float) -> int:
        """Retains the records of `keys` the index holds until `until` (or renews them to then), with no
        I/O (from any thread): the stack calls it for a retained RAM victim the disk holds already.
        Returns how many are retained; one past its share stays plain (counted in refused)."""
        ns = self._ns_ids.get(namespace)
        if ns is None:
            return 0
        retained = 0
        with self._lock:
            now = self._clock()
            self._retention.decay(now)
            for key in keys:
                where = self._index.get(ns + key)
                if where is not None and self._retention.grant(
                    ns + key, namespace, self._span_of(ns + key, where & 0xFFFFFFFF), until, now
                ):
                    retained += 1
        return retained

    def retained(self, namespace: str, key: bytes) -> bool:
        """Whether the record of `key` is retained now."""
        entry = self._entry(namespace, key)
        with self._lock:
            return entry is not None and entry in self._retention

    def retention_stats(self) -> dict[str, int]:
        """Retained records and their bytes now; grants refused for a full share; retentions that ran
        out; retained records copied forward out of an evicted region, and dropped with it."""
        with self._lock:
            self._retention.decay(self._clock())
            return self._retention.stats()

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
            if len(self._retention):
                self._retention.touched(entry, self._clock())  # a hit renews its retention
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

    def _read_one(self, entry: bytes | None) -> bytes | memoryview | OSError | None:
        found = None if entry is None else self._locate(entry)
        if found is None:
            return None
        assert entry is not None
        where, region, epoch, hlen = found
        offset, length = (where >> 32) & 0xFFFFFFFF, where & 0xFFFFFFFF
        buf = self._buffers.take(length)  # memory already faulted in, that nothing else references
        try:
            if buf is None:
                head = os.pread(region.fd, hlen, offset)
                block: bytes | memoryview = os.pread(region.fd, length, offset + hlen)
                got = len(head) + len(block)
            else:
                head = bytearray(hlen)
                got = os.preadv(region.fd, [head, buf], offset)
                block = memoryview(buf).toreadonly()
        except OSError as exc:
            if region.epoch != epoch:
                return None
            self._forget(entry, where, region)
            return exc
        return block if self._checked(entry, where, region, epoch, head, got) else None

    def _locate_many(self, entries: list[bytes | None]) -> list[tuple[int, _Region, int] | None]:
        """_locate for a reader thread's whole part of a batch under one hold of the lock, (where,
        region, epoch) each: a lock round per block cost ~3% of a promotion of 1 MiB blocks."""
        out: list[tuple[int, _Region, int] | None] = []
        index, regions, lru, retention = self._index, self._regions, self._lru, self._retention
        with self._lock:
            now = self._clock() if len(retention) else 0.0
            for entry in entries:
                where = None if entry is None else index.get(entry)
                if where is None:
                    out.append(None)
                    continue
                region = regions[where >> 64]
                out.append((where, region, region.epoch))
                if region.id in lru:
                    lru.move_to_end(region.id)
                if now:
                    retention.touched(entry, now)  # a hit renews its retention (one dict lookup)
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

    def _read_blocking(self, entries: list[bytes | None]) -> list[bytes | memoryview | OSError | None]:
        return [self._read_one(e) for e in entries]

    async def get_many(self, namespace: str, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Each key's stored block, or None. Blocks of reuse.DEFAULT_MIN_BYTES and more come as
        read-only memoryviews of buffers this tier refills once nothing references them any more
        (tiers/reuse.py): hold the view as long as the bytes are needed, as with a bytes. Smaller
        blocks, and any block read while every pooled buffer is in use at the cap (or with the pool
        off), come as bytes."""
        entries = [self._entry(namespace, k) for k in keys]
        wanted = [e for e in entries if e is not None and e in self._index]
        out: list[bytes | memoryview | None] = [None] * len(keys)
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
            out = [r if isinstance(r, (bytes, memoryview)) else None for r in read]
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
        out: list[bool] = []
        for entry in entries:
            with self._lock:  # held across the mark: no eviction can reuse the region meanwhile
                where = self._index.get(entry) if entry is not None else None
                if where is None:
                    moving = entry is not None and entry in self._moving
                    if moving:  # being copied forward: not indexed again when its copy lands
                        assert entry is not None
                        self._moving.discard(entry)
                        self._retention.drop(entry)
                    out.append(moving)
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
        if not any(e is not None and (e in self._index or e in self._moving) for e in entries):
            return [False] * len(keys)
        return await in_pool(self._readers, self._delete_blocking, entries)

    async def delete_many(self, namespace: str, keys: Sequence[bytes]) -> int:
        return sum(await self.delete_present(namespace, keys))

    # -- stats and lifecycle --------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            r = self._retention
            r.decay(self._clock())
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
                retained_blocks=len(r),
                retained_bytes=r.retained_bytes,
                retention_refused=r.refused,
                retention_expired=r.expired,
                retention_copied=r.copied,
                retention_dropped=r.dropped,
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
