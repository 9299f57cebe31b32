"""Segments handed over the server's Unix socket: the same-host path of a client of another Unix user
(docs/shm.md "Clients of another user"; the server's side is kvcache_server/handoff.py)."""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import threading
import weakref

from kvcache_client.shm import Segment


class Handoff:
    """This client's connection to the server's segment socket (Info.shm_socket; the server's
    kvcache_server/handoff.py has the protocol): the same-host path for a client of another Unix
    user, which cannot create files in the server's owner-only directory. Its segments are memfds
    whose descriptors it hands to the server; nothing names them in any file system.

    Thread-safe; fork-safe (a forked child connects again rather than speak on its parent's socket).
    `generation` changes when the connection is replaced: segments handed over an older one are gone
    from the server (it drops a connection's segments when the connection closes)."""

    TIMEOUT_S = 2.0

    def __init__(self, path: str, server_uid: int, token: str) -> None:
        self.path = path
        self.server_uid = server_uid
        self._token = token
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pid = os.getpid()
        self.generation = 0
        # A fork while another thread holds the lock would leave it held in the child: a new one there.
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _relock(me))

    def _connected(self) -> socket.socket:
        """The live connection, connected (and HELLO said) first if needed. Called under the lock.

        Raises:
            OSError: no server listens there, its peer is not the server's uid, or it refused the token.
        """
        if self._pid != os.getpid():  # forked: the socket is the parent's
            if self._sock is not None:
                self._sock.close()  # our copy only: the parent's connection stays open
            self._sock, self._pid = None, os.getpid()
            self.generation += 1
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.TIMEOUT_S)
            sock.connect(self.path)
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != self.server_uid:
                # Whoever bound this path first is not the server: never hand it our memory.
                raise OSError(errno.EPERM, f"{self.path} is held by uid {uid}, not the server's ({self.server_uid})")
            sock.send(b"H" + self._token.encode("utf-8"))
            _answer(sock.recv(4096), "HELLO")
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.generation += 1
        return sock

    def add(self, fd: int) -> tuple[str, int]:
        """Hands `fd` to the server; returns its name there and the connection's generation.

        Raises:
            OSError: the server refused it (a cap; the reason in the message) or cannot be reached.
        """
        with self._lock:
            sock = self._connected()
            try:
                socket.send_fds(sock, [b"A"], [fd])
                return _answer(sock.recv(4096), "segment").decode("ascii"), self.generation
            except (OSError, ValueError):
                self._drop_connection()
                raise

    def register_process(self) -> tuple[str, int]:
        """Registers this process for puts out of its own memory (kvcache_client.procmem); returns
        its name there and the connection's generation.

        Raises:
            OSError: the server refused (it may not read this process; the reason in the message) or
                cannot be reached.
        """
        with self._lock:
            sock = self._connected()
            try:
                sock.send(b"P")
                reply = sock.recv(4096)
            except OSError:
                self._drop_connection()
                raise
            return _answer(reply, "process").decode("ascii"), self.generation  # a refusal keeps the connection

    def server_pid(self) -> int:
        """The server's pid as the socket's peer credentials say (connecting first if needed).

        Raises:
            OSError: as register_process.
        """
        with self._lock:
            sock = self._connected()
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return int(pid)

    def drop(self, name: str, generation: int) -> None:
        """Tells the server to let `name` go (best effort: a closed connection drops them all)."""
        with self._lock:
            if self._sock is None or generation != self.generation or self._pid != os.getpid():
                return
            try:
                self._sock.send(b"D" + name.encode("ascii"))
            except OSError:
                self._drop_connection()

    def alive(self, generation: int) -> bool:
        """Whether segments of `generation` are still known to the server (their connection is open)."""
        with self._lock:
            if self._sock is None or generation != self.generation or self._pid != os.getpid():
                return False
            try:
                # A poll, not a recv: the socket has a timeout, which a recv would wait out.
                readable, _, _ = select.select([self._sock], [], [], 0)
                if readable and self._sock.recv(1, socket.MSG_PEEK) == b"":
                    self._drop_connection()  # the server closed it (it stopped or restarted)
                    return False
            except OSError:
                self._drop_connection()
                return False
            return True

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                self._drop_connection()


def _relock(ref: weakref.ref[Handoff]) -> None:
    handoff = ref()
    if handoff is not None:
        handoff._lock = threading.Lock()


def _answer(reply: bytes, what: str) -> bytes:
    if reply[:1] == b"K":
        return reply[1:]
    if not reply:
        raise OSError(errno.ECONNRESET, f"the segment socket closed during {what}")
    raise OSError(errno.EPERM, f"the segment socket refused {what}: {reply[1:].decode('utf-8', 'replace')}")


class HandedSegment(Segment):
    """A segment that is a memfd handed to the server over its socket (Handoff), not a file."""

    def __init__(self, handoff: Handoff) -> None:
        self.pid = os.getpid()
        self._dir_fd = -1
        self.fd = os.memfd_create("kvcache-segment", os.MFD_CLOEXEC)
        try:
            self.name, self._generation = handoff.add(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        self._handoff = handoff
        self._writable = None
        self._array = None

    @property
    def removed(self) -> bool:
        return self.fd < 0 or not self._handoff.alive(self._generation)

    def close(self) -> None:
        if self.fd < 0:
            return
        if self._writable is not None:
            self._writable.close()
            self._writable = None
        self._array = None
        try:
            if self.pid == os.getpid():
                self._handoff.drop(self.name, self._generation)
        finally:
            os.close(self.fd)
            self.fd = -1
