"""The same-host put at one copy: the server reads a put's blocks straight out of this process's memory.

A client on the server's host registers its own process over the server's segment socket
(kvcache_server/procmem.py has the server's side and what it checks); a put then names each block's
bytes by address (ShmRange.offset) instead of copying them into a segment, and the server copies them
with `process_vm_readv` straight into the arena slots it reserved, verifying them there. The client
copies nothing. Where the server may not read this process (another user, Yama's ptrace_scope of 2 or
3, a container that hides the pid), the registration is refused and puts go through segments as before.

Under Yama's ptrace_scope 1 (Ubuntu's default: only a process's ancestors may read it), registering
names the server's process as one that may (prctl PR_SET_PTRACER): it already holds every block this
client stores, and a client that does not want that passes shm=False.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import numpy as np

from kvcache_core.blockwire import BlockData, Buffer, ShmRange
from kvcache_core.format import unsealed_bytes_header

if TYPE_CHECKING:
    from kvcache_client.handoff import Handoff

log = logging.getLogger(__name__)

ENV = "KVCACHE_PROCESS_PUTS"
"""Set to 0 (or off, false, no) and puts go through segments, as before this path: the process is
never registered (nor, under Yama, named as one the server may read)."""

MAX_HEAD_BYTES = 4096
"""A block given in parts is named as its last part's range with the parts before it sent inline
(ShmRange.head: a header); more than this before the payload and the put goes through a segment."""

_PR_SET_PTRACER = 0x59616D61
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


class ProcessLink:
    """Whether this process is registered with the server for puts out of its own memory.

    States: "unknown" until the first call that takes the server's Info, then "on" or "off" (`reason`
    says why). Thread-safe; fork-safe: a forked child registers itself (its parent's registration
    names the parent's memory)."""

    def __init__(self) -> None:
        self.state = "unknown"
        self.reason = ""
        self._lock = threading.Lock()
        self._registering = threading.Lock()  # one registration at a time (threads' first calls)
        self._handoff: Handoff | None = None
        self._name = ""
        self._generation = -1
        self._pid = -1
        self.sealing = False  # the server's Info says sealed_puts: sealed_ranges may be used

    def configure(self, handoff: Handoff | None) -> None:
        """Takes the connection to the server's segment socket (None: there is none) and registers."""
        if os.environ.get(ENV, "").strip().lower() in {"0", "off", "false", "no"}:
            self.off(f"disabled by {ENV}")
            return
        if handoff is None or not _platform_ok():
            self.off("the server has no segment socket" if handoff is None else "not available on this platform")
            return
        self._handoff = handoff
        self._register()

    def off(self, reason: str) -> None:
        if self.state == "on":
            log.info("puts out of this process's memory off: %s", reason)
        self.state, self.reason = "off", reason

    def _register(self) -> bool:
        handoff = self._handoff
        if handoff is None:
            return False
        with self._registering:
            if self.state == "on" and self._pid == os.getpid() and handoff.alive(self._generation):
                return True  # another thread did it meanwhile
            return self._register_now(handoff)

    def _register_now(self, handoff: Handoff) -> bool:
        try:
            _let_server_read(handoff)
            name, generation = handoff.register_process()
        except OSError as exc:
            log.debug("process registration refused: %s", exc)
            self.off(f"the server may not read this process: {exc}")
            return False
        with self._lock:
            self._name, self._generation, self._pid = name, generation, os.getpid()
            self.state, self.reason = "on", ""
        return True

    def stale(self) -> bool:
        """Whether the next name() must register again (a fork, or the server closed the connection:
        it restarted); a poll of the socket, no wait. The asyncio transport then registers in a thread."""
        handoff = self._handoff
        if self.state != "on" or handoff is None:
            return False
        return self._pid != os.getpid() or not handoff.alive(self._generation)

    def name(self) -> str | None:
        """This process's registered name, registered again after a fork or a server restart; None
        when the path is off."""
        if self.state != "on" or self._handoff is None:
            return None
        stale = self._pid != os.getpid() or not self._handoff.alive(self._generation)
        return None if stale and not self._register() else self._name

    def ranges(self, items: Sequence[tuple[bytes, BlockData]]) -> list[tuple[bytes, ShmRange]] | None:
        """The blocks as ranges of this process's memory (parts before the last sent inline as the
        head), or None when they go another way: the path is off, or a block is not one contiguous
        buffer after a small head. The buffers must stay alive and unchanged until the put returns
        (as for any put: the server verifies what it read, so a change fails that block's put)."""
        name = self.name()
        if name is None:
            return None
        out: list[tuple[bytes, ShmRange]] = []
        for key, data in items:
            parts = data if isinstance(data, tuple) else (data,)
            if not parts or not len(parts[-1]):
                return None
            head = b"".join(bytes(p) for p in parts[:-1]) if len(parts) > 1 else b""
            if len(head) > MAX_HEAD_BYTES:
                return None
            try:
                tail = np.frombuffer(parts[-1], dtype=np.uint8)  # type: ignore[call-overload]
            except (ValueError, TypeError, BufferError):  # not contiguous, or not a buffer numpy takes
                return None
            out.append((key, ShmRange(name, int(tail.ctypes.data), tail.nbytes, head)))
        return out

    def sealed_ranges(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        seal_before_ns: int,
        headers: Sequence[bytes] | None = None,
    ) -> tuple[list[tuple[bytes, ShmRange]], list[np.ndarray]] | None:
        """The payloads as blocks whose checksums the server computes as it reads them
        (ShmRange.seal_before_ns; each head a header with checksum 0: `headers`' own, else
        format.encode_bytes_parts's, one flat uint8 block per payload): no pass over the bytes
        here. Also the arrays that hold each payload's buffer exported (keep them until the put
        returns: a bytearray cannot be resized or freed meanwhile). None when the server does not
        seal, the path is off, or a payload is not one contiguous buffer. As for ranges(), the
        buffers stay alive and unchanged until the put returns."""
        if not self.sealing:
            return None
        name = self.name()
        if name is None:
            return None
        out: list[tuple[bytes, ShmRange]] = []
        held: list[np.ndarray] = []
        flat: dict[int, bytes] = {}
        for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
            try:
                tail = np.frombuffer(payload, dtype=np.uint8)  # type: ignore[call-overload]
            except (ValueError, TypeError, BufferError):  # not contiguous, or not a buffer numpy takes
                return None
            n = tail.nbytes
            if not n:
                return None
            if headers is not None:
                head = headers[i]
                if len(head) > MAX_HEAD_BYTES:
                    return None
            elif (head := flat.get(n)) is None:
                head = flat[n] = unsealed_bytes_header(n)
            held.append(tail)
            out.append((key, ShmRange(name, int(tail.ctypes.data), n, head, seal_before_ns)))
        return out, held

    def refused(self, exc: BaseException) -> bool:
        """Whether a put through this path failed in a way a put through a segment avoids (the server
        cannot read this process now, or no longer knows its name): the path goes off, the caller
        redoes the put another way. Never for a fault of the put itself (a bad block)."""
        if isinstance(exc, grpc.RpcError) and exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
            handoff = self._handoff
            if handoff is not None and not handoff.alive(self._generation):
                return True  # the server restarted: registered again on the next call
            self.off(f"the server could not read this process: {exc.details()}")
            return True
        return False

    def close(self) -> None:
        self._handoff = None
        self.state = "off" if self.state == "on" else self.state


def _platform_ok() -> bool:
    return os.uname().sysname == "Linux"


def _let_server_read(handoff: Handoff) -> None:
    """Under Yama's ptrace_scope 1, names the server's process (the socket's peer) as one that may
    read this one; nothing elsewhere."""
    try:
        with open(_YAMA) as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope != "1":
        return
    pid = handoff.server_pid()
    if pid > 0:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        with contextlib.suppress(Exception):
            libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
