"""Deadlines of a bulk connection's stretches: its HELLO, and each request as a whole.

A timeout per recv or send bounds nothing: a peer that trickles one byte just inside it keeps a
request open for as long as it likes, and with it what the request holds (its in-flight budget
reservation, its arena slots, a connection). A Deadline bounds one stretch as a whole, and every
socket operation of the stretch waits at most what is left of it:

- stall: no operation waits longer than `stall_s` for a byte to move (bulk.stall_timeout_s);
- rate: after `grace_s`, the stretch must have moved `min_rate_bytes_s` per second on average
  (bulk.min_rate_bytes_s, bulk.min_rate_grace_s): by the time it has waited `w` seconds on its
  peer it must have moved `(w - grace_s) * min_rate_bytes_s` bytes;
- total: it waits at most `limit_s` on its peer in all (bulk.request_timeout_s, or
  bulk.hello_timeout_s for a HELLO).

Only time spent blocked in the stretch's own socket operations counts: the server's waits between
them (the in-flight budget, the tier stack, checksums) are not the peer's to pay for. A peer that
moves bytes fast earns time (a request that went fast may finish slowly), never more than `limit_s`.

Whatever ends a stretch raises Cut, naming the setting whose deadline passed.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence

from kvcache_core import bulkwire as bw

STALL = "bulk.stall_timeout_s"
RATE = "bulk.min_rate_bytes_s"
REQUEST = "bulk.request_timeout_s"
HELLO = "bulk.hello_timeout_s"

_IOV_MAX = 512
_TLS_CHUNK = 256 << 10
"""A TLS write sends its whole buffer under one timeout: sent in pieces, each waits at most what is left."""


class Cut(Exception):
    """A stretch's deadline passed: the connection is cut off.

    Attributes:
        limit: the setting whose deadline passed (STALL, RATE, REQUEST or HELLO).
        mid_send: the cut came while the server was sending, so a frame of ours may have been cut
            in the middle and no ERROR frame can follow it (the peer would read its bytes as the
            rest of a block): the connection is just closed.
    """

    def __init__(self, message: str, limit: str, *, mid_send: bool = False) -> None:
        super().__init__(message)
        self.limit = limit
        self.mid_send = mid_send


class Deadline:
    """What one stretch of a connection (a HELLO, a request) may take of its peer; not thread-safe."""

    def __init__(
        self,
        what: str,
        *,
        limit_s: float,
        limit_name: str,
        stall_s: float,
        min_rate_bytes_s: int = 0,
        grace_s: float = 0.0,
        waited_s: float = 0.0,
    ) -> None:
        """
        Args:
            what: names the stretch in messages ("the PUT", "HELLO").
            limit_s: the most it may wait on its peer in all; `limit_name` is that setting's name.
            stall_s: the most one operation may wait.
            min_rate_bytes_s: the average rate due once `grace_s` has passed (0: none).
            waited_s: time already spent (a HELLO's clock starts at accept, its TLS handshake counted).
        """
        self.what = what
        self.limit_s = limit_s
        self.limit_name = limit_name
        self.stall_s = stall_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.grace_s = grace_s
        self.waited_s = waited_s
        self.moved = 0

    def _wait(self, doing: str, sending: bool) -> tuple[float, str]:
        """How long the next operation may wait, and the limit that bounds it; Cut when none is left."""
        bounds = [(self.stall_s, STALL), (self.limit_s - self.waited_s, self.limit_name)]
        if self.min_rate_bytes_s:
            bounds.append((self.grace_s + self.moved / self.min_rate_bytes_s - self.waited_s, RATE))
        left, limit = min(bounds)
        if left <= 0:
            raise self._cut(limit, doing, sending)
        return left, limit

    def _cut(self, limit: str, doing: str, sending: bool) -> Cut:
        if limit == STALL:
            message = f"no bytes {doing} for {self.stall_s:g} s ({STALL})"
        elif limit == RATE:
            message = (
                f"{self.what} moved {self.moved} bytes in {self.waited_s:.1f} s, under {RATE}={self.min_rate_bytes_s} "
                f"(after bulk.min_rate_grace_s={self.grace_s:g})"
            )
        else:
            message = f"{self.what} took more than {limit}={self.limit_s:g} s"
        return Cut(message, limit, mid_send=sending)

    def recv_into(self, sock: socket.socket, view: memoryview, what: str) -> None:
        """Fills `view` from `sock` (recv_into, no copy) within the deadline.

        Raises:
            Cut: a deadline passed.
            bw.PeerClosed: the stream ended first (`clean` when before the first byte).
        """
        got, n = 0, len(view)
        doing = f"of {what}"
        while got < n:
            left, limit = self._wait(doing, False)
            sock.settimeout(left)
            start = time.monotonic()
            try:
                r: int | None = sock.recv_into(view[got:], n - got)
            except TimeoutError:
                r = None
            self.waited_s += time.monotonic() - start
            if r is None:
                raise self._cut(limit, doing, False)
            if r == 0:
                raise bw.PeerClosed(f"connection closed after {got} of {n} bytes of {what}", clean=got == 0)
            got += r
            self.moved += r

    def recv_some(self, sock: socket.socket, view: memoryview, what: str) -> int:
        """One recv_into `view` within the deadline: how many bytes came (at least 1).

        Raises:
            Cut: a deadline passed.
            bw.PeerClosed: the stream ended (not `clean`: the caller wanted bytes of `what`).
        """
        doing = f"of {what}"
        left, limit = self._wait(doing, False)
        sock.settimeout(left)
        start = time.monotonic()
        try:
            r = sock.recv_into(view)
        except TimeoutError:
            self.waited_s += time.monotonic() - start
            raise self._cut(limit, doing, False) from None
        self.waited_s += time.monotonic() - start
        if r == 0:
            raise bw.PeerClosed(f"connection closed before {what} was complete")
        self.moved += r
        return r

    def send(self, sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
        """Sends every buffer in order within the deadline: sendmsg of many at once (no join), TLS
        writes in pieces.

        Raises:
            Cut: a deadline passed (`mid_send`).
        """
        pending = [bw.as_bytes_view(b) for b in buffers if len(b)]
        tls = isinstance(sock, ssl.SSLSocket)
        doing = "read by the client"
        while pending:
            left, limit = self._wait(doing, True)
            sock.settimeout(left)
            start = time.monotonic()
            try:
                sent: int | None = sock.send(pending[0][:_TLS_CHUNK]) if tls else sock.sendmsg(pending[:_IOV_MAX])
            except TimeoutError:
                sent = None
            self.waited_s += time.monotonic() - start
            if sent is None:
                raise self._cut(limit, doing, True)
            self.moved += sent
            bw.drop_sent(pending, sent)
