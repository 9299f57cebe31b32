"""The server's side of the same-host shared-memory data path (docs/shm.md).

A client on the same host creates a *segment* (a file in the server's shm directory, on tmpfs) and names
byte ranges of it in Put and Get instead of sending block bytes through gRPC. The server only ever `pread`s
and `pwrite`s segment files, never maps them, so a client that truncates or deletes its segment mid-call
causes an error for that call, never a SIGBUS in the server.

Who owns a descriptor: a handler opens a segment once per call and closes it when the call ends, after every
worker thread of the call has returned; a worker thread works on its own duplicate of the descriptor and
closes it itself, and stops at the next block once its call is cancelled. So no write can land, through a
descriptor number reused by a later open, in another call's segment, and no write happens after the call
that named the segment has ended.

Who can use it: the directory is created owner-only (0700), so only processes of the server's own user can
create, list or open segments in it. A remote client cannot create a segment, and cannot learn another
client's segment name (128 random bits, in a directory it cannot list). The server refuses names that are
not "kvcache-" + 32 hex digits (no paths), files that are not regular files owned by its user, and symlinks.

Just over the project's ~500-line guideline: the directory, the reads and writes of segments and the worker
threads that own duplicates of their descriptors stay together, since the ownership rule above spans them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvcache_core.blockwire import ShmRange
from kvcache_core.threads import run_to_end
from kvcache_server.refusal import Refused

log = logging.getLogger(__name__)

SEGMENT_NAME = re.compile(r"kvcache-[0-9a-f]{32}")
"""What a segment's file name must look like."""

ALIGN = 64
"""Blocks the server writes into a Get segment start at multiples of this."""

FULL_METADATA = ("kvcache-shm", "full")
"""Trailing metadata of the RESOURCE_EXHAUSTED a Get answers when the tmpfs has no room for its
blocks: the client redoes that call inline and keeps the path on (the SDK checks for it)."""

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""A write into a segment that failed for want of room (this call only), not for want of access."""

OFFLOAD_BYTES = 256 << 10
"""Segment reads and writes at least this large run in a worker thread, off the event loop."""

T = TypeVar("T")


def default_dir() -> str:
    """/dev/shm/kvcache-<uid>: tmpfs, one directory per user."""
    return f"/dev/shm/kvcache-{os.geteuid()}"


def align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class ShmError(Refused):
    """A segment reference that cannot be honoured; `code` is the gRPC status to answer."""


class CallEnded(Exception):
    """Raised in a worker thread that stopped early because its call was cancelled."""


class ShmDirectory:
    """The owner-only directory that holds segments; opened once at start-up."""

    def __init__(self, path: Path, dir_fd: int) -> None:
        self.path = path
        self._dir_fd = dir_fd
        self._uid = os.geteuid()
        self._lock = threading.Lock()  # close() against a sweep in a worker thread taking its duplicate

    @classmethod
    def open(cls, path: str) -> ShmDirectory:
        """Creates `path` (mode 0700) if missing and checks it is a directory that only this user can use.

        Raises:
            OSError: the directory cannot be created, or is a symlink, not a directory, not owned by
                this user, or open to group or others.
        """
        p = Path(path).absolute()
        with contextlib.suppress(FileExistsError):
            p.mkdir(mode=0o700, parents=False)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, f"{p} is not a directory (symlinks are refused)")
        if st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{p} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise OSError(errno.EPERM, f"{p} has mode {stat.S_IMODE(st.st_mode):o}; it must be 0700")
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return cls(p, fd)

    def close(self) -> None:
        with self._lock:
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1

    def open_segment(self, name: str, *, writable: bool) -> tuple[int, int]:
        """Opens a client's segment; returns (fd, size). The caller closes the fd.

        Raises:
            ShmError: INVALID_ARGUMENT (bad name), FAILED_PRECONDITION (no such segment here: the
                client is on another host or sees another directory; or not a regular file of this
                user: a symlink, a directory, another user's file). On FAILED_PRECONDITION the SDK
                repeats the call inline.
        """
        if not SEGMENT_NAME.fullmatch(name):
            raise ShmError(
                grpc.StatusCode.INVALID_ARGUMENT, f"shm segment {name[:80]!r} is not 'kvcache-' + 32 hex digits"
            )
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(name, flags, dir_fd=self._dir_fd)
        except FileNotFoundError:
            raise ShmError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"shm segment {name} not found in {self.path}: the client does not share this server's "
                "shared-memory directory (another host?); send the bytes inline",
            ) from None
        except OSError as exc:  # ELOOP: a symlink; EACCES, EISDIR, ...
            raise ShmError(
                grpc.StatusCode.FAILED_PRECONDITION, f"shm segment {name} cannot be used: {exc.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self._uid:
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shm segment {name} is not a regular file owned by the server's user (uid {self._uid}); "
                    "client and server must run as the same user",
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def sweep(self, older_than_s: float) -> int:
        """Removes segments not modified for `older_than_s` (left behind by clients that died mid-call).

        Runs in a worker thread, on its own duplicate of the directory's descriptor: a close() meanwhile
        (server stop) cannot make it list or unlink in whatever directory reuses the number."""
        with self._lock:
            if self._dir_fd < 0:
                return 0
            dir_fd = os.dup(self._dir_fd)
        try:
            removed = self._sweep(dir_fd, time.time() - older_than_s)
        finally:
            os.close(dir_fd)
        if removed:
            log.info("removed %d stale shm segment(s) from %s", removed, self.path)
        return removed

    def _sweep(self, dir_fd: int, cutoff: float) -> int:
        removed = 0
        try:
            names = os.listdir(dir_fd)
        except OSError as exc:
            log.warning("cannot list shm directory %s: %s", self.path, exc)
            return 0
        for name in names:
            if not SEGMENT_NAME.fullmatch(name):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if st.st_mtime < cutoff:
                    os.unlink(name, dir_fd=dir_fd)
                    removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove stale shm segment %s: %s", name, exc)
        return removed


def read_range(fd: int, size: int, name: str, offset: int, length: int) -> bytes:
    """Reads [offset, offset + length) of a segment of `size` bytes (blocking; os.pread drops the GIL).

    Raises:
        ShmError: INVALID_ARGUMENT when the range is not inside the segment (also when the
            segment shrank while being read).
    """
    if offset + length > size:
        raise ShmError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shm range [{offset}, {offset + length}) runs past the end of segment {name} ({size} bytes)",
        )
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"shm segment {name} shrank while being read")
    return data


def read_range_into(fd: int, size: int, name: str, offset: int, buffer: memoryview) -> None:
    """Reads len(buffer) bytes at `offset` of a segment straight into `buffer` (an arena slot;
    blocking, os.preadv drops the GIL): the kernel's copy is the only one.

    Raises:
        ShmError: INVALID_ARGUMENT when the range is not inside the segment, or it shrank meanwhile.
    """
    length = len(buffer)
    if offset + length > size:
        raise ShmError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"shm range [{offset}, {offset + length}) runs past the end of segment {name} ({size} bytes)",
        )
    done = 0
    while done < length:
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n <= 0:
            raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"shm segment {name} shrank while being read")
        done += n


Fill = Callable[[int, int], None]
"""fill(start, end): reads bytes [start, end) of a block's range into its destination's [start, end)."""


# A segment "size" below zero: the segment is a registered client process (kvcache_server.procmem),
# its descriptor a pidfd and -size its pid; a range's offset is then an address in that process.


_ProcessCopy: Any = None


def _process_copy() -> Any:
    """procmem.ProcessCopy, imported at the first use (procmem builds on ShmError), not per block."""
    global _ProcessCopy
    if _ProcessCopy is None:
        from kvcache_server.procmem import ProcessCopy

        _ProcessCopy = ProcessCopy
    return _ProcessCopy


def _filler(where: int, fd: int, size: int, ref: ShmRange, buffer: memoryview) -> Fill:
    """fill(start, end) for one block: bytes [start, end) of the block (ref.head, then the range) into
    buffer[start:end]. `size` < 0: the range is in the memory of the client process -size (fd its pidfd)."""
    head = ref.head
    copy = None
    if size < 0:
        try:
            copy = _process_copy()(-size, fd, ref.segment, ref.offset, buffer[len(head) :])
        except ShmError as exc:
            raise ShmError(exc.code, f"block {where}: {exc.message}") from None

    def fill(start: int, end: int) -> None:
        try:
            if start < len(head):
                upto = min(end, len(head))
                buffer[start:upto] = head[start:upto]
                start = upto
            if start >= end:
                return
            if copy is not None:  # it checks the process after its first piece and its last
                copy.read(start - len(head), end - len(head))
            else:
                read_range_into(fd, size, ref.segment, ref.offset + start - len(head), buffer[start:end])
        except ShmError as exc:
            raise ShmError(exc.code, f"block {where}: {exc.message}") from None
        except OSError as exc:
            raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: reading shm segment: {exc}") from None

    return fill


def read_ranges_into(
    reads: Sequence[tuple[int, int, int, ShmRange, memoryview]],
    check: Callable[[int, memoryview, Fill], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Reads (block index, fd, segment size, range, destination) in order, each into its destination.
    With `check`, check(block index, destination, fill) reads each block itself, through fill, so
    that it can verify each piece right after it landed (in cache), not in a second pass.

    Raises:
        ShmError: as read_range_into, naming the block.
        CallEnded: `stop` was set (the call was cancelled) before all blocks were read.
        Whatever `check` raises.
    """
    for where, fd, size, ref, buffer in reads:
        if stop is not None and stop.is_set():
            raise CallEnded(f"stopped before block {where}")

        fill = _filler(where, fd, size, ref, buffer)
        if check is None:
            fill(0, len(buffer))
        else:
            check(where, buffer, fill)


async def read_ranges_into_slots_in_thread(
    reads: Sequence[tuple[int, int, int, ShmRange, memoryview]],
    check: Callable[[int, memoryview, Fill], None] | None = None,
    executor: Executor | None = None,
    first: Callable[[], None] | None = None,
) -> None:
    """read_ranges_into in a worker thread that owns duplicates of the segments' descriptors and is
    waited for before a cancellation propagates (see _run_to_end): no write into a destination
    outlives the call. `first()` runs in that thread before it reads (it must not raise).

    Raises:
        ShmError: as read_ranges_into.
    """
    own = _duplicates([fd for _, fd, _, _, _ in reads])
    mine = [(where, own[fd], size, ref, buffer) for where, fd, size, ref, buffer in reads]
    await _run_to_end(read_ranges_into, (mine, check), list(own.values()), executor, first)


LANE_BYTES = 4 << 20
"""A message's reads into slots run in several worker threads at once ("lanes", up to one per core
and at most MAX_LANES) when each lane gets at least this many bytes: one thread's copy and checksum
leave the other cores idle while the client waits."""

MAX_LANES = 4


def lanes_for(reads: Sequence[tuple[int, int, int, ShmRange, memoryview]]) -> int:
    """How many lanes a message's reads get (1: one thread)."""
    total = sum(len(r[4]) for r in reads)
    return max(1, min(len(os.sched_getaffinity(0)), MAX_LANES, len(reads), total // LANE_BYTES))


async def read_ranges_into_slots_in_lanes(
    reads: Sequence[tuple[int, int, int, ShmRange, memoryview]],
    check: Callable[[int, memoryview, Fill], None] | None = None,
    executor: Executor | None = None,
) -> None:
    """read_ranges_into_slots_in_thread over `lanes_for(reads)` worker threads at once, each taking a
    run of consecutive blocks of about equal bytes. Every lane is waited for, however any of them
    ends (an error, a cancellation), before this returns or raises: no write into a slot outlives it.

    Raises:
        ShmError, or whatever `check` raises: the first lane's (in block order) that failed.
    """
    lanes = lanes_for(reads)
    if lanes <= 1:
        await read_ranges_into_slots_in_thread(reads, check, executor)
        return
    lead, *rest = _lane_groups(reads, lanes)
    held = _HeldUntilReleased(executor) if executor is not None else None

    async def leading() -> None:
        try:
            await read_ranges_into_slots_in_thread(lead, check, executor, held.release if held else None)
        finally:  # never started, or cancelled first: the other lanes go (and end) as they would have
            if held is not None:
                held.release()

    # The other lanes' tasks first: gather starts its tasks in order, each submitting its work (held)
    # before its first await, so all of it is held by the time the first lane's thread releases it.
    *others, first = await asyncio.gather(
        *(read_ranges_into_slots_in_thread(g, check, held or executor) for g in rest),
        leading(),
        return_exceptions=True,
    )
    for result in (first, *others):
        if isinstance(result, BaseException):
            raise result


def _lane_groups(
    reads: Sequence[tuple[int, int, int, ShmRange, memoryview]], lanes: int
) -> list[list[tuple[int, int, int, ShmRange, memoryview]]]:
    """`reads` in `lanes` runs of consecutive blocks of about equal bytes (the empty ones left out)."""
    total = sum(len(r[4]) for r in reads)
    if lanes <= 1 or total == 0:  # blocks of no bytes are refused by the check, as any
        return [list(reads)]
    groups: list[list[tuple[int, int, int, ShmRange, memoryview]]] = [[] for _ in range(lanes)]
    done = 0
    for r in reads:
        groups[min(lanes - 1, done * lanes // total)].append(r)
        done += len(r[4])
    return [g for g in groups if g]


def read_ranges_into_slots_here(
    reads: Sequence[tuple[int, int, int, ShmRange, memoryview]],
    check: Callable[[int, memoryview, Fill], None],
    executor: Executor,
) -> None:
    """read_ranges_into_slots_in_lanes for a caller in a thread that may block (a bulk session's): the
    first lane in this thread, through the caller's descriptors, the others on `executor`, each owning
    duplicates of its descriptors. Every lane is waited for, however any of them ends, before this
    returns or raises (a lane that failed stops the others before their next block): no write into a
    slot outlives it.

    Raises:
        ShmError (FAILED_PRECONDITION where the executor is shut down: the client process's
        registration ended), or whatever `check` raises: the first lane's (in block order) that failed.
    """
    lead, *rest = _lane_groups(reads, lanes_for(reads))
    stop = threading.Event()
    started: list[Future[None]] = []
    failure: BaseException | None = None
    try:
        for group in rest:
            own = _duplicates([fd for _, fd, _, _, _ in group])
            mine = [(where, own[fd], size, ref, buffer) for where, fd, size, ref, buffer in group]
            try:
                started.append(executor.submit(_read_and_close, mine, check, stop, list(own.values())))
            except RuntimeError:  # shut down: the registration was dropped
                for fd in own.values():
                    os.close(fd)
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION, "the client process's registration ended during the call"
                ) from None
        read_ranges_into(lead, check, stop)
    except BaseException as exc:
        failure = exc
        stop.set()
    for lane in started:  # waited for, whatever happened: each writes into slots until it ends
        try:
            lane.result()
        except BaseException as exc:
            if failure is None:
                failure = exc
                stop.set()
    if failure is not None:
        raise failure


def _read_and_close(
    reads: list[tuple[int, int, int, ShmRange, memoryview]],
    check: Callable[[int, memoryview, Fill], None],
    stop: threading.Event,
    fds: list[int],
) -> None:
    try:
        read_ranges_into(reads, check, stop)
    finally:
        for fd in fds:
            os.close(fd)


class _HeldUntilReleased(Executor):
    """Lanes 1.. of a put: their work is handed to `executor` only once release() is called, from the
    first lane's thread as it starts (read_ranges_into_slots_in_lanes). Woken by the event loop, one
    after the other, the lane threads of a put after an idle gap were often queued on the loop's CPU
    while the other one slept, and the second lane started a scheduler tick (3-4 ms here) late; woken
    by the first lane, already running, it started 0.35-0.45 ms after. 4 x 32 MiB same-host puts 50 ms
    apart, p50, two alternating pairs: 29.21 / 29.44 -> 25.80 / 27.02 ms; back to back, and 16 x 2 MiB,
    the same within the noise (docs/shm.md).

    What submit() returns is completed as the work handed on is (its result or exception); work that
    cannot be handed on (the executor shut down) fails with that RuntimeError, as a submit would."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._held: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] | None = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if kwargs:
            raise TypeError("submit takes positional arguments only here")
        outer: Future[T] = Future()
        with self._lock:
            if self._held is not None:
                self._held.append((outer, fn, args))
                return outer
        self._hand_on(outer, fn, args)
        return outer

    def release(self) -> None:
        """Hands on what is held, and anything submitted later at once. Never raises."""
        with self._lock:
            held, self._held = self._held or [], None
        for outer, fn, args in held:
            self._hand_on(outer, fn, args)

    def _hand_on(self, outer: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not outer.set_running_or_notify_cancel():
            return
        try:
            inner = self._executor.submit(fn, *args)
        except BaseException as exc:  # RuntimeError: shut down; the lane fails as its own submit would
            outer.set_exception(exc)
            return
        inner.add_done_callback(functools.partial(_complete, outer))


def _complete(outer: Future[Any], inner: Future[Any]) -> None:
    if inner.cancelled():  # nobody cancels the executor's futures; were one, its lane did not run
        outer.set_exception(RuntimeError("the lane's work was cancelled before it ran"))
    elif (exc := inner.exception()) is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(inner.result())


def write_range(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Writes a block into a client's Get segment (blocking).

    Raises:
        OSError: the write failed or was short (tmpfs full: ENOSPC); the caller fails the call, and the
            client redoes it inline.
    """
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write to shm segment")
        view, offset = view[n:], offset + n


def read_ranges(
    reads: Sequence[tuple[int, int, int, ShmRange]],
    stop: threading.Event | None = None,
    seal: Callable[[int, memoryview], None] | None = None,
) -> list[bytes | memoryview]:
    """Reads (block index, fd, segment size, range) in order (blocking; one worker-thread hop for all).
    A sealed range (ShmRange.seal) is handed to seal(block index, its bytes) once read, in the same
    thread: its checksum written into its header there (a sealed range without `seal` is refused).

    Raises:
        ShmError: as read_range, naming the block.
        CallEnded: `stop` was set (the call was cancelled) before all blocks were read.
    """
    out: list[bytes] = []
    for where, fd, size, ref in reads:
        if stop is not None and stop.is_set():
            raise CallEnded(f"stopped before block {where}")
        if size >= 0 and not ref.head:
            try:
                out.append(read_range(fd, size, ref.segment, ref.offset, ref.length))
            except ShmError as exc:
                raise ShmError(exc.code, f"block {where}: {exc.message}") from None
            except OSError as exc:
                raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: reading shm segment: {exc}") from None
            continue
        whole = memoryview(bytearray(ref.block_length))  # a head, or a client's memory: into a buffer of its own
        _filler(where, fd, size, ref, whole)(0, len(whole))
        if ref.seal:
            if seal is None:
                raise ShmError(grpc.StatusCode.INVALID_ARGUMENT, f"block {where}: a sealed range where none is taken")
            seal(where, whole)
        out.append(whole.toreadonly())
    return out


def write_ranges(
    fd: int, writes: Sequence[tuple[bytes | memoryview, int]], stop: threading.Event | None = None
) -> None:
    """Writes (block, offset) pairs into a Get segment (blocking).

    Raises:
        OSError: as write_range.
        CallEnded: `stop` was set (the call was cancelled) before all blocks were written.
    """
    for data, offset in writes:
        if stop is not None and stop.is_set():
            raise CallEnded(f"stopped before the block at offset {offset}")
        write_range(fd, data, offset)


def _duplicates(fds: Sequence[int]) -> dict[int, int]:
    """The caller's fd -> a duplicate of it, for a worker thread to own (and close); all or none."""
    own: dict[int, int] = {}
    try:
        for fd in fds:
            if fd not in own:
                own[fd] = os.dup(fd)
    except BaseException:
        for dup in own.values():
            os.close(dup)
        raise
    return own


async def read_ranges_in_thread(
    reads: Sequence[tuple[int, int, int, ShmRange]],
    executor: Executor | None = None,
    seal: Callable[[int, memoryview], None] | None = None,
) -> list[bytes | memoryview]:
    """read_ranges in a worker thread that owns duplicates of the segments' descriptors (see _run_to_end).

    Raises:
        ShmError: as read_ranges.
    """
    own = _duplicates([fd for _, fd, _, _ in reads])
    mine = [(where, own[fd], size, ref) for where, fd, size, ref in reads]
    return await _run_to_end(functools.partial(read_ranges, seal=seal), (mine,), list(own.values()), executor)


async def write_ranges_in_thread(fd: int, writes: Sequence[tuple[bytes | memoryview, int]]) -> None:
    """write_ranges in a worker thread that owns a duplicate of `fd` (see _run_to_end).

    Raises:
        OSError: as write_ranges.
    """
    dup = os.dup(fd)
    await _run_to_end(write_ranges, (dup, writes), [dup])


async def _run_to_end(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    fds: list[int],
    executor: Executor | None = None,
    first: Callable[[], None] | None = None,
) -> T:
    """fn(*args, stop=event) in a worker thread that closes `fds` (its own descriptors) when fn returns
    (with `first()` called in that thread before fn: it must not raise).

    If the awaiting task is cancelled (the client's deadline, a cancelled call, server stop), the event
    is set, so fn stops before its next block, and the thread is still waited for before
    CancelledError propagates: the handler cannot end, nor close its descriptors, while its thread
    may still read or write the client's segment.
    """
    ran = False

    def work(stop: threading.Event) -> T:
        nonlocal ran
        ran = True
        try:
            if first is not None:
                first()
            return fn(*args, stop=stop)
        finally:
            for fd in fds:
                os.close(fd)

    try:
        return await run_to_end(work, executor)
    except BaseException as exc:
        if not ran:  # the thread never started (the executor is shut down): the descriptors are still ours
            for fd in fds:
                os.close(fd)
            if executor is not None and isinstance(exc, RuntimeError):  # a client process's, dropped
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION, "the client process's registration ended during the call"
                ) from None
        raise
