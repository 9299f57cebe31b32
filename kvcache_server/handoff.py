"""Segments handed over a Unix socket: the same-host path for clients of another Unix user; and
the registration of any same-host client's process for Puts read out of its memory (procmem.py).

The shm directory is owner-only (0700): only processes of the server's own user can create
segments in it. A client of another user (another uid in a sidecar, a second tenant that must not
share a user with the first) instead creates its segments as anonymous memory files
(`memfd_create`) and hands their descriptors to the server over a Unix socket (SCM_RIGHTS). No path
names such a segment, so no other process of any user can open it (a process of the client's own
user could, through /proc, as it could read the client's memory anyway); the server uses it exactly
as a directory segment: `pread` for puts, `pwrite` for gets, never a mapping, so a client that
shrinks it mid-call makes that call fail, never the server crash.

    client                                   server (one thread, selectors)
    connect(SOCK_SEQPACKET)  ───────────────► accept; SO_PEERCRED (uid, pid); caps per uid and total
    "H" + token              ───────────────► authenticate (auth on) -> tenant
                             ◄─────────────── "K"  |  "E" + reason (then closed)
    "A" + SCM_RIGHTS(memfd)  ───────────────► a regular shmem file opened read-write? -> a name
                             ◄─────────────── "K" + "kvcache-fd-" + 32 hex  |  "E" + reason
    "P"                      ───────────────► the peer's own process (its pidfd), readable by the server?
                             ◄─────────────── "K" + "kvcache-pid-" + 32 hex  |  "E" + reason (connection kept)
    "D" + name               ───────────────► the name and its descriptor dropped (no answer)
    close                    ───────────────► every segment of the connection dropped

A handed segment's name is bound to the tenant whose token said HELLO: a call of another tenant
naming it is answered as for a segment that does not exist. The client checks that the socket's
peer is the server's uid (Info.server_uid), so a process that took the socket's path first cannot
be handed a client's memory. What one connection may hand over is capped (segments per
connection), and so are connections (in all, and per uid: half of them), and so is what all of them
hold in descriptors (a quarter of the process's RLIMIT_NOFILE, half of that per uid): no user can
take every slot, nor leave the server without descriptors for gRPC. A connection that has not said
HELLO within `hello_timeout_s` is closed.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import logging
import os
import resource
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvcache_server import procmem
from kvcache_server.shm import ShmError

log = logging.getLogger(__name__)

PREFIX = "kvcache-fd-"
"""Handed segments are named this + 32 hex digits (directory segments: "kvcache-" + 32)."""

PROCESS_PREFIX = "kvcache-pid-"
"""Registered client processes (kvcache_server.procmem) are named this + 32 hex digits."""

MAX_PROCESSES_PER_UID = 32
"""Registered processes of one Unix user at once: each may hold procmem.READ_THREADS threads in reads
it stalls, so one user's stalls are bounded whatever else it does."""

MAX_MESSAGE = 4096
"""No message of the protocol is longer (a HELLO's token included)."""

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


@dataclass(slots=True)
class _Handed:
    fd: int  # a memfd, or a registered process's pidfd
    tenant: str | None
    uid: int
    conn: int
    pid: int = 0  # a registered process's pid; 0 for a memfd
    reads: procmem.ProcessReads | None = None  # a registered process's own read threads


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    uid: int
    pid: int
    opened: float
    tenant: str | None = None
    hello: bool = False
    names: set[str] = field(default_factory=set)


class HandoffRegistry:
    """Handed segments by name; thread-safe (the listener's thread adds, handlers open)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, _Handed] = {}

    def add(self, fd: int, tenant: str | None, uid: int, conn: int) -> str:
        name = PREFIX + secrets.token_hex(16)
        with self._lock:
            self._by_name[name] = _Handed(fd, tenant, uid, conn)
        return name

    def add_process(self, pidfd: int, pid: int, tenant: str | None, uid: int, conn: int) -> str:
        """Registers a client process whose memory Puts may name (kvcache_server.procmem); takes `pidfd`."""
        name = PROCESS_PREFIX + secrets.token_hex(16)
        with self._lock:
            self._by_name[name] = _Handed(pidfd, tenant, uid, conn, pid, procmem.ProcessReads(procmem.same_clock(pid)))
        return name

    def reads(self, name: str) -> procmem.ProcessReads | None:
        """A registered process's read threads (None: not a registered process, or dropped)."""
        with self._lock:
            handed = self._by_name.get(name)
        return None if handed is None else handed.reads

    def drop(self, name: str, conn: int) -> bool:
        """Drops `name` if connection `conn` handed it over; closes its descriptor."""
        with self._lock:
            handed = self._by_name.get(name)
            if handed is None or handed.conn != conn:
                return False
            del self._by_name[name]
        _release(handed)
        return True

    def open(self, name: str, tenant: str | None, *, writable: bool) -> tuple[int, int]:
        """A duplicate of the segment's descriptor (the caller closes it) and its size; for a
        registered process, a duplicate of its pidfd and minus its pid (kvcache_server.shm._filler).

        Raises:
            ShmError: FAILED_PRECONDITION when no segment of this tenant has that name (dropped,
                its client gone, another tenant's, never handed over): the same answer for all, so a
                tenant learns nothing about another's names.
        """
        with self._lock:
            handed = self._by_name.get(name)
            if handed is None or handed.tenant != tenant:
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shm segment {name} is not one this client handed over (its connection to the "
                    "segment socket closed, or the server restarted): send the bytes inline",
                )
            if handed.pid and writable:  # Gets write into segments, never into a process
                raise ShmError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{name} names a client process, not a segment a Get can write"
                )
            fd = os.dup(handed.fd)
            if handed.pid:
                return fd, -handed.pid
        try:
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        del writable  # every handed segment was checked to be open read-write
        return fd, size

    def count(self) -> int:
        with self._lock:
            return len(self._by_name)

    def close(self) -> None:
        with self._lock:
            handed, self._by_name = list(self._by_name.values()), {}
        for h in handed:
            _release(h)


def _release(handed: _Handed) -> None:
    if handed.reads is not None:
        handed.reads.close()
    os.close(handed.fd)


def check_segment_fd(fd: int) -> None:
    """Accepts only what a pread/pwrite cannot stall on and a client cannot swap: a regular file
    of shared memory (memfd or tmpfs: F_GET_SEALS answers only for those), open read-write.

    Raises:
        ValueError: why the descriptor is refused.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise ValueError("not open read-write")
    try:
        fcntl.fcntl(fd, _F_GET_SEALS)
    except OSError:
        raise ValueError("not shared memory (memfd_create)") from None


class HandoffListener:
    """The Unix socket that takes segments from same-host clients of any user (module docstring)."""

    def __init__(
        self,
        path: str,
        registry: HandoffRegistry,
        authenticate: Callable[[str], str | None] | None,
        *,
        mode: int = 0o666,
        max_connections: int = 1024,
        max_segments_per_connection: int = 64,
        hello_timeout_s: float = 5.0,
        max_descriptors: int = 0,
    ) -> None:
        """`authenticate(token)` is the token's tenant or None (refused); None: auth is off.
        `max_descriptors`: connections plus segments held at once (0: a quarter of RLIMIT_NOFILE)."""
        self.path = path
        self.registry = registry
        self._authenticate = authenticate
        self._mode = mode
        self._max_connections = max_connections
        self._max_per_uid = max(1, max_connections // 2)
        self._max_segments = max_segments_per_connection
        self._hello_timeout_s = hello_timeout_s
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._max_fds = max_descriptors or max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 4)
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}  # by socket fd
        self._listener: socket.socket | None = None
        self._wake_r = self._wake_w = -1  # a pipe that wakes the thread to stop (made by start)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.refused = 0  # connections and segments refused (caps, bad token, bad descriptor)

    def start(self) -> None:
        """Binds the socket (mode `mode`) and starts the thread.

        Raises:
            OSError: the path cannot be bound: too long, held by a running server, or owned by another
                user (never removed: it may be another server's).
        """
        if len(os.fsencode(self.path)) >= 108:
            raise OSError(errno.ENAMETOOLONG, f"{self.path} is too long for a Unix socket (107 bytes at most)")
        _clear_stale(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, self._mode)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="kvcache-handoff", daemon=True)
        self._thread.start()
        log.info("segment socket for same-host clients of other users at %s", self.path)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stop(self) -> None:
        """Stops the thread, closes every connection (their segments dropped) and removes the path.
        Idempotent: a second call closes nothing (a descriptor number closed twice could be another
        object's by then)."""
        if self._stopping:
            return
        self._stopping = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for conn in list(self._conns.values()):
            self._close(conn)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(self.path)
            self._listener.close()
            self._listener = None
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self.registry.close()

    def _run(self) -> None:
        while not self._stopping:
            timeout = self._next_hello_deadline()
            for key, _ in self._sel.select(timeout):
                if key.data == "wake":
                    return
                if key.data is None:
                    self._accept()
                else:
                    self._serve(key.data)
            self._expire_hellos()

    def _next_hello_deadline(self) -> float | None:
        waiting = [c.opened for c in self._conns.values() if not c.hello]
        if not waiting:
            return None
        return max(0.0, min(waiting) + self._hello_timeout_s - time.monotonic())

    def _expire_hellos(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if not c.hello and now - c.opened >= self._hello_timeout_s]:
            self.refused += 1
            self._close(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: this connection only
            log.warning("segment socket: accept failed: %s", exc)
            return
        sock.setblocking(False)
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        same_uid = sum(1 for c in self._conns.values() if c.uid == uid)
        if len(self._conns) >= self._max_connections or same_uid >= self._max_per_uid or not self._descriptor_room(uid):
            self.refused += 1
            _send(sock, b"Etoo many connections to the segment socket; this client uses gRPC")
            sock.close()
            return
        conn = _Conn(sock, uid, pid, time.monotonic())
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _serve(self, conn: _Conn) -> None:
        try:
            data, fds = _recv(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        try:
            if not data:  # the client closed it
                self._close(conn)
                return
            kind, body = data[:1], data[1:]
            if not conn.hello:
                if kind != b"H" or fds:
                    self._refuse(conn, b"Ethe first message must be HELLO")
                    return
                self._hello(conn, body)
            elif kind == b"A" and len(fds) == 1:
                self._add(conn, fds.pop())
            elif kind == b"P" and not fds:
                self._register_process(conn)
            elif kind == b"D" and not fds:
                self.registry.drop(body.decode("ascii", "replace"), id(conn))
                conn.names.discard(body.decode("ascii", "replace"))
            else:
                self._refuse(conn, b"Ean unknown message")
        finally:
            for fd in fds:
                os.close(fd)

    def _hello(self, conn: _Conn, body: bytes) -> None:
        tenant = None
        if self._authenticate is not None:
            tenant = self._authenticate(body.decode("utf-8", "replace"))
            if tenant is None:
                self._refuse(conn, b"Ethe token is not valid")
                return
        conn.tenant, conn.hello = tenant, True
        _send(conn.sock, b"K")

    def _descriptor_room(self, uid: int) -> bool:
        """Whether one more descriptor may be held: in all, and for this uid (half)."""
        held = len(self._conns) + sum(len(c.names) for c in self._conns.values())
        mine = sum(1 + len(c.names) for c in self._conns.values() if c.uid == uid)
        return held < self._max_fds and mine < max(1, self._max_fds // 2)

    def _add(self, conn: _Conn, fd: int) -> None:
        if len(conn.names) >= self._max_segments or not self._descriptor_room(conn.uid):
            self.refused += 1
            os.close(fd)
            _send(conn.sock, b"Ethis connection holds as many segments as it may")
            return
        try:
            check_segment_fd(fd)
        except (ValueError, OSError) as exc:
            self.refused += 1
            os.close(fd)
            _send(conn.sock, b"Esegment refused: " + str(exc).encode())
            return
        name = self.registry.add(fd, conn.tenant, conn.uid, id(conn))
        conn.names.add(name)
        if not _send(conn.sock, b"K" + name.encode("ascii")):
            self._close(conn)

    def _register_process(self, conn: _Conn) -> None:
        """Registers the connection's own process (the socket's peer: never a pid the client names)
        for Puts that name its memory; answers its name, or why not (the client then copies into
        segments as before). One registration per connection, counted as one of its segments."""
        if not procmem.AVAILABLE:
            _send(conn.sock, b"Ethis server cannot read client processes")
            return
        mine = [n for n in conn.names if n.startswith(PROCESS_PREFIX)]
        if mine:  # one per connection: the same answer again
            _send(conn.sock, b"K" + mine[0].encode("ascii"))
            return
        uid_processes = sum(
            1 for c in self._conns.values() if c.uid == conn.uid for n in c.names if n.startswith(PROCESS_PREFIX)
        )
        if (
            len(conn.names) >= self._max_segments
            or uid_processes >= MAX_PROCESSES_PER_UID
            or not self._descriptor_room(conn.uid)
        ):
            self.refused += 1
            _send(conn.sock, b"Ethis connection or user holds as many registrations as it may")
            return
        try:
            pidfd = procmem.open_peer(conn.sock, conn.pid)
        except OSError as exc:
            _send(conn.sock, b"E" + str(exc).encode())
            return
        name = self.registry.add_process(pidfd, conn.pid, conn.tenant, conn.uid, id(conn))
        conn.names.add(name)
        if not _send(conn.sock, b"K" + name.encode("ascii")):
            self._close(conn)

    def _refuse(self, conn: _Conn, why: bytes) -> None:
        self.refused += 1
        _send(conn.sock, why)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        for name in conn.names:
            self.registry.drop(name, id(conn))
        conn.names.clear()
        conn.sock.close()


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (at most 4 taken; the kernel closes the rest)."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _send(sock: socket.socket, data: bytes) -> bool:
    """A short answer; False when the client cannot take it (its buffer full: it stopped reading)."""
    try:
        sock.send(data[:MAX_MESSAGE])
        return True
    except OSError:
        return False


def _clear_stale(path: str) -> None:
    """Removes a socket this user left at `path` with nobody listening (a killed server).

    Raises:
        OSError: the path is held by a listening server, owned by another user, or not a socket.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
    if st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is owned by uid {st.st_uid}, not by this server's user")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{path} is the segment socket of a running server")
