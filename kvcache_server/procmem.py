"""Reading a same-host client's blocks straight out of its own memory: the same-host put at one copy.

A client of the server's own Unix user registers its process over the segment socket
(kvcache_server/handoff.py, message "P"); the server learns the process from the socket itself
(SO_PEERCRED and a pidfd), never from the client's word, and checks that the kernel lets it read
that process (the ptrace access check /proc/<pid>/mem applies, which process_vm_readv applies too).
A Put may then name ranges of that process's memory (ShmRange.offset is an address): the server
copies each block with `process_vm_readv` straight into the arena slot it reserved, and verifies it
there, where the client cannot write. The client copies nothing; nothing is shared that it could
change after the check.

What a client can do to this path, and what it cannot:
- name an address it does not have, or free the memory mid-call: EFAULT, its call fails
  (INVALID_ARGUMENT); change the bytes mid-call: the checksum, verified in the slot, refuses the
  block (DATA_LOSS), or, for a block the server seals (ShmRange.seal_before_ns: it computes the
  checksum), the bytes as read are stored, what any put of changing bytes may store; never after
  the client's call may have returned (docs/shm.md, "Checksums computed by the server"). Never a
  crash of the server (no mapping of the client's memory is ever made; the kernel copies, and a
  fault is an error code).
- name another process: it cannot; a registration's process is the socket peer's, bound to the name
  the server hands back, which only that connection's tenant may use.
- exit and have its pid reused: the pidfd taken when it connected says it exited (checked after
  every block is read), so a block read from another process's memory is never stored.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import queue
import select
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import grpc

from kvcache_server.shm import ShmError

STAGE_CALLS = 1
"""Puts of one registered process that may read out of it at once; more wait, holding no arena room."""

READ_THREADS = 2
"""Threads of one registered process's own, that its reads run in (a put's lanes; made as needed)."""


class ProcessReads:
    """Where one registered process's reads run: threads of its own, never the server's shared
    pool, and one call reading at a time. A client can make a read of its memory wait as long as it
    likes (a userfaultfd it never answers, a file of a FUSE mount it serves): that stalls its own
    puts, which wait holding no arena room, and nobody else's; its stuck threads are daemons, so
    they never hold up the server's exit."""

    def __init__(self, same_clock: bool = True) -> None:
        self.executor = DaemonThreads(READ_THREADS, "kvcache-process-read")
        self.same_clock = same_clock  # its CLOCK_MONOTONIC is the server's: it may seal (same_clock())
        self._stage: asyncio.Semaphore | None = None  # made on the event loop, at its first use
        # The same for a bulk session's PUT_MEM (a session thread): held before it reserves arena room
        # until its reads end. Apart from `stage`: a process holds at most STAGE_CALLS of each.
        self.thread_stage = threading.BoundedSemaphore(STAGE_CALLS)

    @property
    def stage(self) -> asyncio.Semaphore:
        """Held by a put from before it reserves arena room until its reads end (event loop only)."""
        if self._stage is None:
            self._stage = asyncio.Semaphore(STAGE_CALLS)
        return self._stage

    def close(self) -> None:
        """No new reads (submitting one raises RuntimeError: the call fails FAILED_PRECONDITION);
        reads already queued or running end on their own."""
        self.executor.shutdown(wait=False)


def same_clock(pid: int) -> bool:
    """Whether process `pid` reads the server's CLOCK_MONOTONIC: the same time namespace (Linux 5.6+),
    or a kernel without them. A sealed put's deadline (ShmRange.seal_before_ns) is in the client's
    clock; another namespace's may run ahead of the server's. False when it cannot be told."""
    try:
        mine = os.stat("/proc/self/ns/time").st_ino
    except FileNotFoundError:
        return True  # no time namespaces on this kernel: one clock
    except OSError:
        return False
    try:
        return os.stat(f"/proc/{pid}/ns/time").st_ino == mine
    except OSError:
        return False


class DaemonThreads(Executor):
    """A thread pool of at most `threads` daemon threads, made as work comes (ThreadPoolExecutor's
    threads are joined when the interpreter exits: one stuck in a read of a client's memory would
    keep the server from exiting)."""

    def __init__(self, threads: int, name: str) -> None:
        self._max = threads
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """Shut down: submit() raises (a registered process's threads, its registration dropped)."""
        return self._closed

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if kwargs:
            raise TypeError("DaemonThreads.submit takes positional arguments only")
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queue.put((future, fn, args))
            if self._idle == 0 and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}_{self._threads}", daemon=True).start()
            else:
                self._idle = max(0, self._idle - 1)
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)
            with self._lock:
                if self._closed:
                    return
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)  # after the work already queued


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _readv.restype = ctypes.c_ssize_t

AVAILABLE = _readv is not None and hasattr(os, "pidfd_open")
"""Whether this platform can read another process's memory this way (Linux, glibc)."""

T = TypeVar("T")

SO_PEERPIDFD = 77
"""Linux 6.5+: a pidfd of the socket's peer, taken when it connected (no pid-reuse window)."""


def peer_pidfd(sock: socket.socket) -> int:
    """A pidfd of the process that connected a Unix socket (SO_PEERPIDFD: taken by the kernel at
    connect(), so it never names another process that got the pid since). No fallback to
    pidfd_open(SO_PEERCRED's pid): between that process's exit and the call, the pid may have become
    another's, whose memory the server would then read for this client.

    Raises:
        OSError: the kernel has no SO_PEERPIDFD (before Linux 6.5), or it cannot give one (the peer
            exited, or lives in a pid namespace this process cannot see).
    """
    return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)


def exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has exited (a pidfd is readable from then on)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def check_readable(pid: int) -> None:
    """Whether this process may read `pid`'s memory: the kernel's ptrace access check, made by
    opening /proc/<pid>/mem (read nothing).

    Raises:
        OSError: it may not (EACCES/EPERM: another user, Yama's ptrace_scope, a non-dumpable
            process), or the process is gone (ENOENT/ESRCH).
    """
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)


def open_peer(sock: socket.socket, pid: int) -> int:
    """The pidfd of the process that connected `sock` (its SO_PEERCRED pid is `pid`), once checked
    that this process may read its memory and that it has not exited (else the pid may already be
    another process's). The caller owns the pidfd.

    Raises:
        OSError: why not, worded for the client (no SO_PEERPIDFD, the ptrace access check, an exit).
    """
    try:
        pidfd = peer_pidfd(sock)
    except OSError as exc:
        raise OSError(
            exc.errno, f"the socket's peer cannot be named safely (SO_PEERPIDFD, Linux 6.5+): {exc}"
        ) from None
    try:
        check_readable(pid)
        if exited(pidfd):
            raise OSError(errno.ESRCH, "the process exited")
    except OSError as exc:
        os.close(pidfd)
        raise OSError(exc.errno, f"the server may not read this process: {exc}") from None
    return pidfd


def read_process_into(pid: int, pidfd: int, name: str, address: int, buffer: memoryview) -> None:
    """Copies len(buffer) bytes at `address` of process `pid` into `buffer` (blocking; ctypes drops
    the GIL), then checks that the process is still the one registered (its pidfd: not exited), so
    every byte came from it before anything looks at them (not even a header's magic, which an error
    message would quote): a pid is reused only after its process exited.

    Raises:
        ShmError: INVALID_ARGUMENT when the range is not readable memory of the process (EFAULT);
            FAILED_PRECONDITION when the process exited or may no longer be read (the client then
            sends the bytes another way).
    """
    ProcessCopy(pid, pidfd, name, address, buffer).read(0, len(buffer))


class ProcessCopy:
    """One block's copy out of a registered process's memory into `buffer` (an arena slot), in
    pieces: the ctypes set-up made once per block, not per piece (each piece is a process_vm_readv
    that drops the GIL; a put's lanes share one GIL, so what they do holding it is kept small)."""

    def __init__(self, pid: int, pidfd: int, name: str, address: int, buffer: memoryview) -> None:
        """Raises ShmError (INVALID_ARGUMENT) when [address, address + len(buffer)) is no address range."""
        length = len(buffer)
        if address < 0 or address + length > 1 << 64:
            raise ShmError(
                grpc.StatusCode.INVALID_ARGUMENT, f"address range {address:#x}+{length} of {name} is not valid"
            )
        self._pid, self._pidfd, self._name, self._address, self._length = pid, pidfd, name, address, length
        self._buffer = buffer  # kept: the kernel writes through a raw pointer into it
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if length else 0
        self._local, self._remote = _Iovec(), _Iovec()
        self._local_ref, self._remote_ref = ctypes.byref(self._local), ctypes.byref(self._remote)
        self._started = False

    def read(self, start: int, end: int) -> None:
        """Copies bytes [start, end) of the range into the same bytes of the buffer (a block's pieces,
        in order). The pidfd says whether the process has exited: before the first read (a
        registration whose process is already gone reads nothing), after the first (a caller parses
        the header from it) and after the one that reaches the buffer's end (before the checksum's
        verdict): a piece read in between from a process that got the pid is never used, since its
        block fails that last check; and an exit found wipes what the buffer received, so no byte of
        a process that took the pid stays in the slot (clients of a shared arena map it read-only).

        Raises:
            ValueError: [start, end) is not inside the buffer (nothing is read: the kernel would write
                past it, into a neighbouring slot).
            ShmError: as read_process_into; FAILED_PRECONDITION whenever the process has exited by
                the time a read fails (its pid may be another's: the bytes are not its).
        """
        if not 0 <= start <= end <= self._length:
            raise ValueError(f"bytes [{start}, {end}) of a {self._length}-byte buffer")
        first = not self._started
        if first:
            self._started = True
            if exited(self._pidfd):
                raise ShmError(grpc.StatusCode.FAILED_PRECONDITION, f"{self._name}: the client process exited")
        local, remote = self._local, self._remote
        done = start
        while done < end:
            local.iov_base, local.iov_len = self._base + done, end - done
            remote.iov_base, remote.iov_len = self._address + done, end - done
            n = _readv(self._pid, self._local_ref, 1, self._remote_ref, 1, 0)  # type: ignore[misc]
            if n <= 0:
                err = ctypes.get_errno() if n < 0 else errno.EFAULT
                if exited(self._pidfd):
                    self._exited(done)
                if err == errno.EFAULT:
                    raise ShmError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{self._name}: [{self._address + done:#x}, {self._address + end:#x}) is not readable "
                        "memory of the client",
                    )
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self._name}: the client process cannot be read ({os.strerror(err)}): send the bytes another way",
                )
            done += n
        if (first or end == self._length) and exited(self._pidfd):
            self._exited(end)

    def _exited(self, upto: int) -> None:
        """Wipes the buffer's first `upto` bytes (all a block's reads may have written, in order) and
        raises ShmError FAILED_PRECONDITION: the process exited."""
        if upto:
            ctypes.memset(self._base, 0, upto)
        raise ShmError(grpc.StatusCode.FAILED_PRECONDITION, f"{self._name}: the client process exited")
