"""The client's side of the same-host shared-memory data path (docs/shm.md).

When the server runs on the same host and shares its shm directory with this
process (same user; a shared /dev/shm volume between containers), block bytes
skip gRPC: a Put writes the blocks into a fresh *segment* (a file in that
directory, on tmpfs) and sends only where they lie; a Get hands the server a
fresh segment to write the found blocks into, and returns read-only views of
its mapping. Lookups and all control stay on gRPC, with auth as usual.

Segments are reused from a per-client pool (so a call writes into memory that
is already allocated), never by two calls at once, and a segment whose blocks
a get returned is not reused while the caller holds any of them: a returned
block stays valid and unchanged for as long as it is referenced. A segment
whose call did not end normally (deadline, cancellation, any error) is never
reused but retired (removed): the server may still be writing into or reading
from it. The path switches itself on after one Info call finds the server's
directory here, and off (the call is redone inline) when the server answers
that it cannot find a segment: the client is then on another host.

A full tmpfs never kills the client: a put reserves its segment's space
(posix_fallocate) before writing through a mapping, so a full tmpfs is an
OSError, and a get maps only what the server wrote. Either way that call's
bytes go over gRPC and the path stays on; `ShmLink.fallbacks` counts such calls.

Set KVCACHE_SHM=0 in the environment, or pass shm=False to the client, to
keep every byte on gRPC.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvcache_client.procmem import ProcessLink
from kvcache_core.blockwire import BlockData, ShmRange, data_len
from kvcache_core.threads import run_to_end  # noqa: F401  (re-exported for the transports)

if TYPE_CHECKING:
    from kvcache_client.handoff import Handoff

log = logging.getLogger(__name__)

SHM_ENV = "KVCACHE_SHM"
ALIGN = 64
"""Blocks start at multiples of this in a segment (the server uses the same rule for Get)."""

MIN_PUT_BYTES = 64 << 10
"""Puts smaller than this stay inline: the shared-memory path saves nothing on them."""

DEFAULT_POOL_BYTES = 1 << 30
"""Idle segments a client keeps for reuse, in bytes of tmpfs memory."""

FULL_METADATA = ("kvcache-shm", "full")
"""Trailing metadata of the server's RESOURCE_EXHAUSTED for a Get whose blocks its tmpfs had no room
for (the same pair as kvcache_server.shm.FULL_METADATA): that call is redone inline."""

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Creating or growing a segment failed for want of room (this call only), not for want of access."""

_WARN_EVERY_S = 60.0
"""Fallbacks are logged at WARNING at most this often; the others at DEBUG."""

T = TypeVar("T")


class CallEnded(Exception):
    """Raised in a worker thread that stopped early because its call was cancelled."""


def env_allows_shm() -> bool:
    return os.environ.get(SHM_ENV, "").strip().lower() not in {"0", "off", "false", "no"}


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _reserve(fd: int, size: int) -> None:
    """Grows a segment to `size` bytes with every page allocated (on failure it keeps its size).

    Raises:
        OSError: ENOSPC when the tmpfs has no room.
    """
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
    else:  # no tmpfs to fill where there is no posix_fallocate (macOS): a sparse file will do
        os.ftruncate(fd, size)


class Segment:
    """A segment file in the shared directory, owned by this client; close() removes it."""

    def __init__(self, directory: str) -> None:
        self.name = "kvcache-" + secrets.token_hex(16)
        self.pid = os.getpid()  # the process that owns the name (a forked child only inherits fds)
        self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.fd = os.open(
                self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd
            )
        except BaseException:
            os.close(self._dir_fd)
            raise
        self._writable: mmap.mmap | None = None  # this client's mapping for puts
        # Gets: one read-only mapping kept across calls, seen through a numpy array. Every block a
        # get returns is a view of that array, so the array's reference count says whether any is
        # still held (mmap offers no such probe); the mapping is reused, not redone, while it is not.
        self._array: np.ndarray | None = None

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def write_blocks(
        self, items: Sequence[tuple[bytes, BlockData]], stop: threading.Event | None = None
    ) -> list[tuple[bytes, ShmRange]]:
        """Copies the blocks in, one after another (64-byte aligned); returns where each one lies.

        The space is reserved first (posix_fallocate: tmpfs allocates every page), so writing through
        the mapping cannot fault on a full tmpfs (SIGBUS). Every byte below a segment's size is
        allocated: it grows only by this, or by the server's writes.

        Raises:
            OSError: no room for the blocks (ENOSPC: the tmpfs is full) or they cannot be mapped; the
                caller retires the segment and sends the blocks inline.
            CallEnded: `stop` was set (the call was cancelled) before all blocks were copied.
        """
        out: list[tuple[bytes, ShmRange]] = []
        for group in self.writer(items, 0, stop):
            out.extend(group)
        return out

    def writer(
        self, items: Sequence[tuple[bytes, BlockData]], group_bytes: int, stop: threading.Event | None = None
    ) -> Iterator[list[tuple[bytes, ShmRange]]]:
        """Reserves and maps room for all the blocks now (OSError as write_blocks), then copies them
        in group by group as the iterator is advanced, yielding where each group's blocks lie: a put
        can send a group while the next is being copied (group_bytes 0: all in one group)."""
        layout: list[tuple[bytes, int, int]] = []
        end = 0
        for key, data in items:
            n = data_len(data)
            layout.append((key, end, n))
            end = _align(end + n)
        if self._writable is None or len(self._writable) < end:
            if self._writable is not None:
                self._writable.close()
                self._writable = None
            if self.size < end:
                _reserve(self.fd, end)
            self._writable = mmap.mmap(self.fd, self.size)
        return self._copy_in(layout, items, group_bytes, stop)

    def _copy_in(
        self,
        layout: list[tuple[bytes, int, int]],
        items: Sequence[tuple[bytes, BlockData]],
        group_bytes: int,
        stop: threading.Event | None,
    ) -> Iterator[list[tuple[bytes, ShmRange]]]:
        group: list[tuple[bytes, ShmRange]] = []
        size = written = 0
        for (key, start, n), (_, data) in zip(layout, items, strict=True):
            if stop is not None and stop.is_set():
                raise CallEnded(f"stopped before block {written}")
            pos = start
            for part in data if isinstance(data, tuple) else (data,):
                m = len(part)
                self._writable[pos : pos + m] = part  # type: ignore[index]
                pos += m
            group.append((key, ShmRange(self.name, start, n)))
            written += 1
            size += n
            if group_bytes and size >= group_bytes:
                yield group
                group, size = [], 0
        if group or not written:
            yield group

    def map(self, length: int) -> memoryview:
        """A read-only view of the segment's first `length` bytes (fewer if the file is shorter), as
        the server left them. Call only on a segment that is not in use (a fresh one, or one that
        the pool handed out because it was not lent); it is lent while any view of the result is alive.

        Maps only those bytes, which the server wrote (or an earlier call did): no page of the mapping
        is a hole that touching would have to allocate, so a full tmpfs cannot SIGBUS a reader.

        Raises:
            OSError: the segment cannot be mapped.
        """
        size = min(length, self.size)
        if size == 0:
            return memoryview(b"")
        if self._array is None or len(self._array) < size:
            # Later gets into the same segment reuse the mapping while they need no more than it holds.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            # Writable, although blocks are handed out read-only: a caller who writes into a tensor
            # made from a block anyway (torch.frombuffer ignores read-only) changes its own copy and
            # does not crash. The server never writes into a segment while a block of it is held.
            mapping = mmap.mmap(self.fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._array = np.frombuffer(mapping, dtype=np.uint8)  # the old mapping goes with the old array
        return memoryview(self._array[:size]).toreadonly()

    @property
    def lent(self) -> bool:
        """True while any view returned by map() is alive (each one holds a reference to the array)."""
        return self._array is not None and sys.getrefcount(self._array) > 2  # our attribute + the argument

    @property
    def removed(self) -> bool:
        """The file lost its name (the server's sweep of stale segments), or was closed."""
        return self.fd < 0 or os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        """Removes the name and closes the file; blocks returned from map() stay valid. In a forked
        child, only closes its inherited descriptors: the name belongs to the parent."""
        if self.fd < 0:
            return
        if self._writable is not None:
            self._writable.close()
            self._writable = None
        self._array = None  # views still held keep the mapping alive
        try:
            if self.pid == os.getpid():
                os.unlink(self.name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            os.close(self._dir_fd)
            self.fd = -1


class SegmentPool:
    """Segments kept for reuse: a put or get then writes into memory that is already allocated.

    Thread-safe. A segment serves one call at a time; idle segments hold at most `max_bytes`
    together (the least recently used are removed first).

    Fork-safe: a forked child never uses the segments it inherited (parent and child would write
    into the same memory at once, and a get could return another call's block); it starts with
    an empty pool and leaves the parent's files alone.
    """

    def __init__(
        self, directory: str, max_bytes: int = DEFAULT_POOL_BYTES, make: Callable[[], Segment] | None = None
    ) -> None:
        """`make` creates a segment (default: a file in `directory`)."""
        self.directory = directory
        self._make = make or (lambda: Segment(directory))
        self.max_bytes = max_bytes
        self._idle: list[Segment] = []  # least recently used first
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # Idle segments are removed when the pool is collected or the process exits without close().
        self._finalizer = weakref.finalize(self, _close_segments, self._idle)

    def _after_fork(self) -> None:
        if self._pid == os.getpid():
            return
        # In a forked child: the lock may have been held by a thread that does not exist here.
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _close_segments(self._idle)  # closes the inherited descriptors, keeps the parent's files

    def acquire(self) -> Segment:
        self._after_fork()
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):  # most recently used first
                seg = self._idle[i]
                if seg.removed:  # swept by the server: replace it
                    del self._idle[i]
                    seg.close()
                elif not seg.lent:
                    return self._idle.pop(i)
        return self._make()

    def release(self, segment: Segment) -> None:
        self._after_fork()
        if segment.pid != os.getpid():
            segment.close()
            return
        with self._lock:
            self._idle.append(segment)
            total = sum(s.size for s in self._idle)
            while total > self.max_bytes and self._idle:
                oldest = self._idle.pop(0)
                total -= oldest.size
                oldest.close()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._idle)

    def close(self) -> None:
        self._after_fork()
        with self._lock:
            _close_segments(self._idle)


def _close_segments(segments: list[Segment]) -> None:
    for seg in segments:
        seg.close()
    segments.clear()


class ShmLink:
    """Whether this client moves block bytes through shared memory, and its segment pool.

    States: "unknown" until the first put or get asks the server (Info), then "on" or "off".
    `fallbacks` counts the calls that tried a segment and went inline instead (tmpfs full, a
    server that cannot use segments); `last_fallback` says why the latest one did.
    """

    def __init__(self, enabled: bool = True, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.state = "unknown" if enabled and env_allows_shm() else "off"
        self.directory = ""
        self.max_block_bytes = 0
        self.reason = "" if self.state == "unknown" else "disabled by the client"
        self.pool_bytes = pool_bytes
        self.pool: SegmentPool | None = None
        self.fallbacks = 0
        self.last_fallback = ""
        self._warned_at = -_WARN_EVERY_S
        self._lock = threading.Lock()
        self.handoff: Handoff | None = None  # segments are memfds handed over the server's socket (handoff.py)
        # Puts out of this process's own memory, read by the server (kvcache_client.procmem).
        self.process = ProcessLink()
        self._process_handoff: Handoff | None = None  # the socket that registration went over, when ours

    @property
    def needs_info(self) -> bool:
        return self.state == "unknown"

    @property
    def on(self) -> bool:
        return self.state == "on"

    def configure(self, shm_dir: str, max_block_bytes: int) -> None:
        """Takes the server's Info answer: on when its directory is here and usable by this process."""
        self.max_block_bytes = max_block_bytes
        if not shm_dir:
            self.off("the server has no shared-memory path")
            return
        try:
            st = os.stat(shm_dir)
        except OSError:
            self.off(f"{shm_dir} is not visible here (the server is on another host)")
            return
        if not stat.S_ISDIR(st.st_mode) or not os.access(shm_dir, os.W_OK | os.X_OK):
            self.off(f"{shm_dir} is not a directory this process may write to")
            return
        with self._lock:  # two threads' first calls may both have asked Info
            if self.pool is None or self.pool.directory != shm_dir:
                self.pool = SegmentPool(shm_dir, self.pool_bytes)
            self.state, self.directory, self.reason = "on", shm_dir, ""
        log.debug("shared-memory path on: %s", shm_dir)

    def handoff_from(self, socket_path: str, server_uid: int, metadata: Sequence[tuple[str, str]]) -> None:
        from kvcache_client.handoff import HandedSegment, Handoff  # it builds on Segment: imported here

        """Takes the rest of the Info answer: where the directory is not usable by this process
        (another Unix user) but the server has a segment socket, segments are memfds handed over it.
        Off, as before, when the socket cannot be reached, is not the server's, or refuses us."""
        if self.state != "off" or not socket_path or self.reason == "disabled by the client":
            return
        if not hasattr(os, "memfd_create"):
            return
        token = dict(metadata).get("authorization", "").removeprefix("Bearer ")
        handoff = Handoff(socket_path, server_uid, token)
        try:
            with handoff._lock:
                handoff._connected()
        except OSError as exc:
            handoff.close()
            log.debug("segment socket %s not usable: %s", socket_path, exc)
            self.reason = f"{self.reason}; segment socket {socket_path}: {exc}"
            return
        with self._lock:
            self.handoff = handoff
            self.pool = SegmentPool(socket_path, self.pool_bytes, make=lambda: HandedSegment(handoff))
            self.state, self.directory, self.reason = "on", socket_path, ""
        log.debug("shared-memory path on: segments handed over %s", socket_path)

    def process_from(self, socket_path: str, server_uid: int, metadata: Sequence[tuple[str, str]]) -> None:
        """Registers this process with the server for puts out of its own memory, over the segment
        socket (the one segments are handed over, or a connection of its own): on this host only,
        when the shared-memory path is on."""
        if not self.on or not socket_path:
            self.process.off("the shared-memory path is off" if not self.on else "the server has no segment socket")
            return
        handoff = self.handoff or self._process_handoff  # Info asked again: the same connection
        if handoff is None:
            from kvcache_client.handoff import Handoff

            token = dict(metadata).get("authorization", "").removeprefix("Bearer ")
            handoff = self._process_handoff = Handoff(socket_path, server_uid, token)
        self.process.configure(handoff)

    def off(self, reason: str) -> None:
        handoff = self.handoff
        if self.state == "on" and handoff is not None and not handoff.alive(handoff.generation):
            # The server closed the socket (it restarted): its segments are gone, not the path.
            # Segments are handed over a new connection from the next call on.
            log.info("segment socket closed (%s); reconnecting on the next call", reason)
            if self.pool is not None:
                self.pool.close()
            return
        if self.state == "on":
            log.info("shared-memory path off: %s", reason)
        self.state, self.reason = "off", reason
        self.close()

    def put_segment(self, nbytes: int) -> Segment | None:
        """A segment for a put of `nbytes`, or None to send it inline."""
        if nbytes < MIN_PUT_BYTES:
            return None
        return self.get_segment()

    def get_segment(self) -> Segment | None:
        """A segment for one call, or None to move the bytes inline."""
        pool = self.pool
        if not self.on or pool is None:
            return None
        try:
            return pool.acquire()
        except OSError as exc:
            if exc.errno in SPACE_ERRNOS:
                self.fallback(f"cannot create a segment in {self.directory}: {exc}")
            else:
                self.off(f"cannot create a segment in {self.directory}: {exc}")
            return None

    def fallback(self, reason: str) -> None:
        """Counts a call that goes inline instead of through its segment, and logs it in one line."""
        with self._lock:
            self.fallbacks += 1
            self.last_fallback = reason
            now = time.monotonic()
            warn = now - self._warned_at >= _WARN_EVERY_S
            if warn:
                self._warned_at = now
        log.log(
            logging.WARNING if warn else logging.DEBUG,
            "shared memory: %s; this call goes over gRPC (%d such calls so far)",
            reason,
            self.fallbacks,
        )

    def done(self, segment: Segment, completed: bool) -> None:
        """Ends a call's use of its segment: back to the pool if the call completed normally (closed
        instead once the path is off), retired otherwise (deadline, cancellation, any error or
        fallback): removed and closed, never handed to another call, since the server may still be
        writing into or reading from it. Views of it that a caller holds stay valid."""
        pool = self.pool
        if completed and self.on and pool is not None:
            pool.release(segment)
        else:
            segment.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.handoff is not None:
            self.handoff.close()
        self.process.close()
        if self._process_handoff is not None:
            self._process_handoff.close()


def resolve(data: memoryview, ref: ShmRange) -> memoryview:
    """The view of one block in a mapped Get segment.

    Raises:
        ValueError: the range is not inside the mapping.
    """
    if ref.offset + ref.length > len(data):
        raise ValueError(f"server named range [{ref.offset}, {ref.offset + ref.length}) of a {len(data)}-byte segment")
    return data[ref.offset : ref.offset + ref.length]
