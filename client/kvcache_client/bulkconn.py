"""The bulk path's connections (docs/bulk.md): one framed TCP/TLS stream, and a pool of them.

BulkConnection speaks the frames of kvcache_core.bulkwire for one request at a time: sendmsg straight from
the caller's buffers, recv_into straight into one buffer per block (kvcache_client.bufpool's), the
call's deadline on every socket operation. BulkPool lends connections to calls and runs a call's
stripes in parallel; kvcache_client.bulk decides when to use them.

(Over 500 lines: one bulk connection's frames, each request a method sharing its read-ahead
and its socket; the pool and the counters are beside it.)
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
import numpy as np

from kvcache_client.bufpool import BufferPool
from kvcache_client.errors import DeadlineExceeded, ResourceExhausted, RPCError, error_for
from kvcache_client.results import TIER_NAMES, Fetched
from kvcache_core import bulkwire as bw
from kvcache_core.blockwire import BlockData, ShmRange, data_len
from kvcache_core.format import FIXED_HEADER_BYTES, MAX_NDIM, BlockFormatError, parse_header, verify_payload_in_pieces

T = TypeVar("T")


class BulkUnreachable(Exception):
    """The bulk stream failed (refused, reset, closed, garbled): the call may go over gRPC instead."""


@dataclass(slots=True)
class BulkCounters:
    """Which path moved this client's block bytes (block bytes only, no framing), its bulk Lookups, and its
    TOUCHes left unanswered."""

    bulk_bytes_sent: int = 0
    bulk_bytes_received: int = 0
    bulk_bytes_landed: int = 0  # of those, blocks whose payloads were received straight into get_into's destinations
    grpc_bytes_sent: int = 0  # the gRPC transport's, its same-host shared-memory path included
    grpc_bytes_received: int = 0
    fallbacks: int = 0  # calls that tried the bulk path and went over gRPC
    reconnects: int = 0  # pooled connections found closed and replaced within a call
    bulk_lookups: int = 0  # Lookups answered over the bulk port (LOOKUP frames)
    touches_unanswered: int = 0  # TOUCHes whose answers were left to the connection's next request
    put_mem_bytes: int = 0  # same-host puts the server read out of this process's memory on the bulk port (PUT_MEM)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


_READ_AHEAD = 256 * 1024
"""Bytes one receive may take ahead of the frame being read (per connection)."""

_CLOSE_READ_S = 0.02
"""How long close() waits for TOUCH answers still owed before it closes anyway (they come within a
millisecond or so; a server slower than that sees a reset, nothing else)."""


class BulkConnection:
    """One bulk connection, after HELLO/READY. Not thread-safe: the pool lends it to one call."""

    def __init__(self, sock: socket.socket, ready: bw.Ready) -> None:
        self.sock = sock
        self.ready = ready
        self._header = bytearray(bw.HEADER_BYTES)
        # Read-ahead: small frames (headers, small blocks) come out of one recv of many; a block
        # larger than half of it is received straight into its own buffer (bar what was read ahead).
        self._ahead = bytearray(_READ_AHEAD)
        self._ahead_view = memoryview(self._ahead)
        self._start = self._end = 0
        self.handed_off = False  # taken over mid-request, for good: BulkPool.run neither closes nor keeps it
        # TOUCHes whose answers are read before this connection's next request (touch_unanswered),
        # the namespaces a TOUCH of was answered TOUCHED here, and whether a later one may go
        # unanswered at all: only without a token (open()), where the server checks no right and no
        # rate in a TOUCH, only what the SDK checked before sending it (a well-formed namespace and keys).
        self._touches_unread = 0
        self._touched: set[str] = set()
        self.tokenless = False
        self._late = False  # an answer owed did not come by a request's deadline: close() reads no more

    @classmethod
    def open(
        cls, address: tuple[str, int], tls: ssl.SSLContext | None, server_name: str, token: str, deadline: float
    ) -> BulkConnection:
        """Connects, handshakes TLS, sends HELLO and reads READY.

        Raises:
            BulkUnreachable: no connection, TLS or framing failure.
            RPCError: the server refused the HELLO (Unauthenticated, ...); a full server (its
                max_connections) is BulkUnreachable: the call takes gRPC.
            DeadlineExceeded: the deadline passed.
        """
        try:
            sock = socket.create_connection(address, timeout=_remaining(deadline))
        except TimeoutError:
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed connecting to bulk") from None
        except OSError as exc:
            raise BulkUnreachable(f"cannot connect to bulk {address[0]}:{address[1]}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name)
            conn = cls(sock, bw.Ready(1 << 20, 0, 0))
            conn.tokenless = not token
            payload = bw.hello(token)
            conn.send([bw.header(bw.FrameType.HELLO, len(payload)), payload], deadline)
            kind, reply = conn.read_control(deadline)
            if kind is not bw.FrameType.READY:
                raise BulkUnreachable(f"bulk server answered HELLO with {kind.name}")
            conn.ready = bw.parse_ready(reply)
            return conn
        except ResourceExhausted as exc:  # every connection the server serves is taken: gRPC has room
            sock.close()
            raise BulkUnreachable(f"bulk port full: {exc.details}") from None
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        try:
            if self._touches_unread and not self._late:  # a socket closed with bytes unread resets its connection
                with contextlib.suppress(RPCError, BulkUnreachable, OSError):
                    self._read_unanswered(time.monotonic() + _CLOSE_READ_S)
        finally:
            self.sock.close()

    def send(self, buffers: list[bytes | memoryview], deadline: float) -> None:
        if self._touches_unread:
            self._read_unanswered(deadline)
        self.sock.settimeout(_remaining(deadline))
        try:
            bw.send_buffers(self.sock, buffers)
        except TimeoutError:
            raise _deadline("sending") from None
        except (BrokenPipeError, ConnectionResetError):
            # The server may have refused the request and closed: its ERROR frame says why.
            self.read_control(deadline)
            raise BulkUnreachable("bulk connection closed while sending") from None
        except OSError as exc:
            raise BulkUnreachable(f"bulk send failed: {exc}") from None

    def recv(self, view: memoryview, what: str, deadline: float) -> None:
        """Fills `view`: first from what was read ahead, then from the socket (into the read-ahead
        buffer and copied, for less than half of it; straight into `view` otherwise)."""
        n = len(view)
        have = self._end - self._start
        if have:
            k = min(have, n)
            view[:k] = self._ahead_view[self._start : self._start + k]
            self._start += k
            if k == n:
                return
            view, n = view[k:], n - k
        self._start = self._end = 0
        if n * 2 > len(self._ahead):
            try:
                self.sock.settimeout(_remaining(deadline))
                bw.recv_exact(self.sock, view, what)
            except TimeoutError:
                raise _deadline(f"receiving {what}") from None
            except OSError as exc:  # PeerClosed included
                raise BulkUnreachable(f"bulk receive failed: {exc}") from None
            return
        self._read_ahead(n, what, deadline)
        view[:] = self._ahead_view[:n]
        self._start = n

    def _read_ahead(self, n: int, what: str, deadline: float) -> None:
        """Receives into the read-ahead until it holds `n` bytes from _start (as many more as come)."""
        try:
            while self._end - self._start < n:
                self.sock.settimeout(_remaining(deadline))
                got = self.sock.recv_into(self._ahead_view[self._end :])
                if got == 0:
                    raise bw.PeerClosed(f"connection closed after {self._end - self._start} of {n} bytes of {what}")
                self._end += got
        except TimeoutError:
            raise _deadline(f"receiving {what}") from None
        except OSError as exc:  # PeerClosed included
            raise BulkUnreachable(f"bulk receive failed: {exc}") from None

    def _buffered(self, n: int, what: str, deadline: float) -> memoryview | None:
        """The next `n` bytes as a view of the read-ahead (valid until the next receive), received
        into it first when they are not all there; None, with nothing consumed, when they would not
        fit behind what it holds (then recv() takes them). A small frame's parts are then read
        without a call and a copy each: a GET of 16 KiB blocks spent most of its SDK time there."""
        have = self._end - self._start
        if not have:
            self._start = self._end = 0
        if self._start + n > len(self._ahead):
            return None
        self._read_ahead(n, what, deadline)
        view = self._ahead_view[self._start : self._start + n]
        self._start += n
        return view

    def read_header(self, deadline: float) -> tuple[bw.FrameType, int]:
        raw = self._buffered(bw.HEADER_BYTES, "a frame header", deadline)
        if raw is None:
            raw = memoryview(self._header)
            self.recv(raw, "a frame header", deadline)
        try:
            kind, length = bw.parse_header(raw, self.ready.max_frame_bytes)
        except bw.FrameError as exc:
            raise BulkUnreachable(f"bulk server sent garbage: {exc}") from None
        if kind is bw.FrameType.ERROR:
            payload = bytearray(min(length, 1 << 16))
            self.recv(memoryview(payload), "an ERROR frame", deadline)
            code, message = bw.parse_error(bytes(payload))
            raise error_for(_status(code), message)
        return kind, length

    def read_control(self, deadline: float, limit: int = 1 << 20) -> tuple[bw.FrameType, bytes]:
        kind, length = self.read_header(deadline)
        if length > limit:
            raise BulkUnreachable(f"bulk {kind.name} frame of {length} bytes is not a control frame")
        payload = bytearray(length)
        self.recv(memoryview(payload), f"a {kind.name} frame", deadline)
        return kind, bytes(payload)

    # -- requests ------------------------------------------------------------------------------

    def put(self, namespace: str, items: Sequence[tuple[bytes, BlockData]], deadline: float) -> bw.PutDone:
        sizes = [data_len(d) for _, d in items]
        payload = bw.put(namespace, [(key, n) for (key, _), n in zip(items, sizes, strict=True)])
        buffers: list[bytes | memoryview] = [bw.header(bw.FrameType.PUT, len(payload)), payload]
        for (_, data), n in zip(items, sizes, strict=True):
            buffers.append(bw.header(bw.FrameType.DATA, n))
            buffers.extend(data if isinstance(data, tuple) else (data,))  # type: ignore[arg-type]
        self.send(buffers, deadline)
        return self._answer(bw.FrameType.PUT_DONE, bw.parse_put_done, "PUT", deadline)

    def put_mem(
        self, namespace: str, process: str, refs: Sequence[tuple[bytes, ShmRange]], deadline: float
    ) -> bw.PutDone:
        """A PUT_MEM: blocks the server reads out of this process's memory (`process` its registration's
        name; each ShmRange an address, a length, a head, and seal_before_ns for a sealed one)."""
        self.send_put_mem(namespace, process, refs, deadline)
        return self.read_put_done(deadline)

    def send_put_mem(
        self, namespace: str, process: str, refs: Sequence[tuple[bytes, ShmRange]], deadline: float
    ) -> None:
        """Sends a PUT_MEM (see put_mem); its answer is read_put_done's, in the order they were sent."""
        blocks = [(key, ref.offset, ref.length, ref.seal_before_ns, ref.head) for key, ref in refs]
        payload = bw.put_mem(namespace, process, blocks)
        self.send([bw.header(bw.FrameType.PUT_MEM, len(payload)), payload], deadline)

    def read_put_done(self, deadline: float) -> bw.PutDone:
        """A PUT_MEM's answer (an ERROR raises its status; the server then closes the connection and
        handles none of the frames sent after it)."""
        return self._answer(bw.FrameType.PUT_DONE, bw.parse_put_done, "PUT_MEM", deadline)

    def _answer(
        self, kind: bw.FrameType, parse: Callable[[bytes], T], what: str, deadline: float, limit: int = 1 << 20
    ) -> T:
        """The request's answer frame, which must be of `kind`, parsed (garbage: BulkUnreachable)."""
        got, reply = self.read_control(deadline, limit)
        if got is not kind:
            raise BulkUnreachable(f"bulk server answered {what} with {got.name}")
        try:
            return parse(reply)
        except bw.FrameError as exc:
            raise BulkUnreachable(str(exc)) from None

    def send_lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, deadline: float) -> None:
        """Sends a LEASE; its answer is read_leased's."""
        payload = bw.lease(namespace, keys, prefix_only)
        self.send([bw.header(bw.FrameType.LEASE, len(payload)), payload], deadline)

    def read_leased(self, deadline: float) -> tuple[float, str, list[tuple[int, int, int]]]:
        """A LEASE's answer: (expires_in_s, arena path, (lease id, offset, length) per key, all 0 for a miss)."""
        limit = max(1 << 20, (1 << 16) + bw.SLOT.size * max(1, self.ready.max_keys_per_request))
        return self._answer(bw.FrameType.LEASED, bw.parse_leased, "LEASE", deadline, limit)

    def release(self, ids: Sequence[int], deadline: float) -> int:
        """Ends leases (RELEASE, then its answer): how many were live."""
        payload = bw.release(ids)
        self.send([bw.header(bw.FrameType.RELEASE, len(payload)), payload], deadline)
        return self._answer(bw.FrameType.RELEASED, bw.parse_released, "RELEASE", deadline)

    def lookup(self, namespace: str, keys: Sequence[bytes], deadline: float) -> list[int]:
        """A LOOKUP: the tier kind (kvcache.v1.Tier) of each key of the stored prefix. The time left
        to `deadline` travels with it: the server waits for lower tiers no longer than its share of it."""
        timeout_ms = max(1, int(_remaining(deadline) * 1000))
        payload = bw.lookup(namespace, keys, timeout_ms)
        self.send([bw.header(bw.FrameType.LOOKUP, len(payload)), payload], deadline)
        limit = max(1 << 20, 4 + len(keys))
        return self._answer(bw.FrameType.LOOKED_UP, bw.parse_looked_up, "LOOKUP", deadline, limit)

    def send_touch(self, namespace: str, keys: Sequence[bytes], deadline: float) -> None:
        """Sends a TOUCH (blocks this client reads straight out of the server's arena, counted there as
        read: kvcache_client.local_reads); its answer is read_touched's."""
        payload = bw.touch(namespace, keys)
        self.send([bw.header(bw.FrameType.TOUCH, len(payload)), payload], deadline)

    def read_touched(self, namespace: str, deadline: float) -> int:
        """A TOUCH's answer: how many keys it named. A refusal (the read right) is raised as its status."""
        count = self._answer(bw.FrameType.TOUCHED, bw.parse_touched, "TOUCH", deadline)
        self._touched.add(namespace)
        return count

    def touch_may_go_unanswered(self, namespace: str, deadline: float) -> bool:
        """Whether the next TOUCH of `namespace` may have its answer read later (touch_unanswered): a
        connection without a token (no right, no rate to check: nothing the SDK did not check) on
        which one was answered TOUCHED already, still open, with nothing unread once the answers
        still owed are read (here). A connection the server closed (idle_timeout_s) or that has
        bytes waiting is not one: its TOUCH is waited for, so that a closed one fails and the call
        goes to a new connection, as before."""
        if not (self.tokenless and namespace in self._touched):
            return False
        if self._touches_unread:
            self._read_unanswered(deadline)
        if self._end > self._start:
            return False
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        if not hasattr(select, "poll"):  # not Linux: every answer is waited for
            return False
        poll = select.poll()
        poll.register(self.sock, select.POLLIN | getattr(select, "POLLRDHUP", 0))
        try:
            return not poll.poll(0)
        except OSError:
            return False

    def touch_unanswered(self, counters: BulkCounters) -> None:
        """The TOUCH just sent has its answer read before this connection's next request (send), not
        now: a get_into read in place then costs no round trip of its own."""
        self._touches_unread += 1
        counters.add("touches_unanswered", 1)

    def _read_unanswered(self, deadline: float) -> None:
        """The TOUCHED answers still unread. Anything else (an ERROR frame: the server changed its mind
        about a right it granted on this connection, which it does not do) ends the connection."""
        while self._touches_unread:
            try:
                self._answer(bw.FrameType.TOUCHED, bw.parse_touched, "TOUCH", deadline)
            except DeadlineExceeded:  # the server is slow: this request's deadline, as its own answer's
                self._late = True
                raise
            except RPCError as exc:
                raise BulkUnreachable(f"bulk server refused a TOUCH it had answered before: {exc.details}") from None
            self._touches_unread -= 1

    def get(
        self,
        namespace: str,
        keys: Sequence[bytes],
        prefix_only: bool,
        deadline: float,
        buffers: BufferPool | None = None,
    ) -> dict[int, Fetched]:
        """The blocks the server found, by index into `keys`, each received straight into a buffer
        of `buffers` (fresh memory without one); unverified: the caller verifies them there."""
        return self.get_into(namespace, keys, prefix_only, deadline, buffers).found

    def get_into(
        self,
        namespace: str,
        keys: Sequence[bytes],
        prefix_only: bool,
        deadline: float,
        buffers: BufferPool | None = None,
        sinks: Sequence[memoryview | None] = (),
    ) -> Received:
        """As get; a block whose key has a sink (a writable byte view of exactly its payload's size,
        by index into `keys`) has its header received apart and its payload straight into the sink,
        each piece hashed under the key as it lands (kvcache_core.format.verify_payload_in_pieces):
        one copy, verified where it lies. Blocks of another size, or without a sink, as get."""
        payload = bw.get(namespace, keys, prefix_only)
        self.send([bw.header(bw.FrameType.GET, len(payload)), payload], deadline)
        got = Received()
        item = bytearray(bw.GET_ITEM.size)
        while True:
            kind, length = self.read_header(deadline)
            if kind is bw.FrameType.GET_DONE:
                payload = bytearray(length)
                self.recv(memoryview(payload), "GET_DONE", deadline)
                if bw.parse_get_done(bytes(payload)) != got.count:
                    raise BulkUnreachable("bulk GET_DONE disagrees with the blocks received")
                return got
            if kind is not bw.FrameType.GET_ITEM or length < bw.GET_ITEM.size:
                raise BulkUnreachable(f"bulk server sent {kind.name} ({length} bytes) within a GET")
            raw = self._buffered(bw.GET_ITEM.size, "a GET_ITEM header", deadline)
            if raw is None:
                raw = memoryview(item)
                self.recv(raw, "a GET_ITEM header", deadline)
            index, tier = bw.GET_ITEM.unpack(raw)
            if index >= len(keys) or got.has(index):
                raise BulkUnreachable(f"bulk server sent block {index} of a GET of {len(keys)} keys")
            size = length - bw.GET_ITEM.size
            tier_name = TIER_NAMES.get(tier, "unknown")
            sink = sinks[index] if index < len(sinks) else None
            if sink is not None and size - len(sink) in HEADER_LENS:
                self._land(keys[index], index, tier_name, size, sink, got, deadline)
                continue
            # written once, whole, by the receive: never read uninitialised
            block = memoryview(np.empty(size, np.uint8) if buffers is None else buffers.take(size))
            self.recv(block, f"block {index}", deadline)
            got.found[index] = (block.toreadonly(), tier_name)

    def _land(
        self, key: bytes, index: int, tier: str, size: int, sink: memoryview, got: Received, deadline: float
    ) -> None:
        """Block `index` (`size` bytes on the wire): its header apart, its payload into `sink`,
        verified piece by piece. A header that fails makes it a damaged block and leaves the sink
        untouched; a checksum that fails, a damaged block whose sink holds what arrived. The stream
        stays in step either way."""
        if size * 2 <= len(self._ahead):  # small: the whole frame out of the read-ahead, one copy
            whole = self._buffered(size, f"block {index}", deadline)
            if whole is not None:
                if _header_len(whole) != size - len(sink):  # not its sink's size: received as get does
                    block = memoryview(np.empty(size, np.uint8))
                    block[:] = whole
                    got.found[index] = (block.toreadonly(), tier)
                    return
                self._land_whole(key, index, tier, whole, sink, got)
                return
        head = memoryview(bytearray(size - len(sink)))
        self.recv(head, f"block {index}'s header", deadline)
        if _header_len(head) != len(head):  # its payload is not its sink's size: received as get does
            block = memoryview(np.empty(size, np.uint8))
            block[: len(head)] = head
            self.recv(block[len(head) :], f"block {index}", deadline)
            got.found[index] = (block.toreadonly(), tier)
            return
        try:
            header = parse_header(head, block_len=size)
        except BlockFormatError as exc:
            self._skip(len(sink), f"block {index}", deadline)  # read past it (the sink untouched)
            got.damaged[index] = (tier, str(exc))
            return
        filled = 0

        def fill(start: int, end: int) -> None:
            nonlocal filled
            self.recv(sink[start:end], f"block {index}", deadline)
            filled = end

        try:
            verify_payload_in_pieces(header, key, sink, fill, _LAND_PIECE)
        except BlockFormatError as exc:  # a checksum that failed; or refused before a byte was read
            # (another payload length, a compressed block): the rest is read past, the sink untouched
            self._skip(len(sink) - filled, f"block {index}", deadline)
            got.damaged[index] = (tier, str(exc))
            return
        got.landed[index] = tier
        got.landed_bytes += size

    def _skip(self, n: int, what: str, deadline: float) -> None:
        """Reads `n` bytes of the stream and drops them (through a buffer of at most 1 MiB)."""
        if n <= 0:
            return
        scratch = memoryview(np.empty(min(n, _LAND_PIECE), np.uint8))
        while n:
            k = min(n, len(scratch))
            self.recv(scratch[:k], what, deadline)
            n -= k

    @staticmethod
    def _land_whole(key: bytes, index: int, tier: str, whole: memoryview, sink: memoryview, got: Received) -> None:
        """_land of a block received whole (`whole`, its frame's bytes after GET_ITEM): the same
        outcomes, its payload copied into `sink` and verified there."""
        size = len(whole)
        try:
            header = parse_header(whole[: size - len(sink)], block_len=size)
        except BlockFormatError as exc:
            got.damaged[index] = (tier, str(exc))
            return
        sink[:] = whole[size - len(sink) :]
        try:
            verify_payload_in_pieces(header, key, sink, _landed, _LAND_PIECE)
        except BlockFormatError as exc:
            got.damaged[index] = (tier, str(exc))
            return
        got.landed[index] = tier
        got.landed_bytes += size


def _header_len(block: memoryview) -> int:
    """The header length a block's first bytes announce (kvcache_core.format: a u16 at offset 6); -1
    when too short. Whether a block's payload is its sink's size is this, not a guess from sizes: a
    sink 8 bytes over a block's payload is what a header of one more dimension would leave."""
    return int.from_bytes(block[6:8], "little") if len(block) >= 8 else -1


def _landed(start: int, end: int) -> None:
    """verify_payload_in_pieces' fill for a payload already copied whole."""


_LAND_PIECE = 1 << 20
"""Bytes received into a sink, then hashed, at a time: 16 x 2 MiB get_into 1.41-2.08 GB/s against
1.25-1.57 in pieces of 256 KiB (one recv call and one hash update per piece; same run, this VM)."""

HEADER_LENS = frozenset(FIXED_HEADER_BYTES + 8 * ndim for ndim in range(MAX_NDIM + 1))
"""What a block's header may measure: a GET_ITEM whose length over its sink's is none of these is
not that sink's block (another size: received as get receives it, and refused by the copy); one
whose is, is that sink's block if its header says that length (_header_len)."""


@dataclass(slots=True)
class Received:
    """A GET's blocks: `found` received into buffers (unverified), `landed` received into their sinks
    and verified there (their tier), `damaged` received into their sinks and refused (tier, why)."""

    found: dict[int, Fetched] = field(default_factory=dict)
    landed: dict[int, str] = field(default_factory=dict)
    damaged: dict[int, tuple[str, str]] = field(default_factory=dict)
    landed_bytes: int = 0  # of `landed`, headers included

    @property
    def count(self) -> int:
        return len(self.found) + len(self.landed) + len(self.damaged)

    def has(self, index: int) -> bool:
        return index in self.found or index in self.landed or index in self.damaged

    def shifted(self, by: int) -> Received:
        """The same blocks, their indexes `by` further on (a lane's, in the whole call's keys)."""
        return Received(
            {by + i: f for i, f in self.found.items()},
            {by + i: t for i, t in self.landed.items()},
            {by + i: d for i, d in self.damaged.items()},
            self.landed_bytes,
        )


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _deadline("waiting")
    return left


def _deadline(doing: str) -> DeadlineExceeded:
    return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed {doing} on the bulk path")


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


class BulkPool:
    """Connections to one bulk listener, lent to one call at a time; several run in parallel."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        token: str,
        tls: ssl.SSLContext | None,
        server_name: str,
        connections: int,
        counters: BulkCounters,
    ) -> None:
        self.address = address
        self._token = token
        self._tls = tls
        self._server_name = server_name
        self.connections = connections
        self._counters = counters
        self._idle: list[BulkConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="kvcache-bulk")

    def run(self, op: Callable[[BulkConnection], T], deadline: float) -> T:
        """Runs `op` on a pooled (or new) connection; one whose server went away is replaced once.

        A connection that failed in any way is closed, never returned to the pool.
        """
        for attempt in (0, 1):
            with self._lock:
                conn = self._idle.pop() if self._idle and attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = BulkConnection.open(self.address, self._tls, self._server_name, self._token, deadline)
            try:
                result = op(conn)
            except BulkUnreachable:
                conn.close()
                if reused and attempt == 0:  # the server closed it (a restart?): so it did the others
                    self._counters.add("reconnects", 1)
                    self._drop_idle()
                    continue
                raise
            except BaseException:
                if not conn.handed_off:  # else `op` gave it to whoever ends its request
                    conn.close()
                raise
            self.keep(conn)
            return result
        raise AssertionError("unreachable")

    def keep(self, conn: BulkConnection) -> None:
        """Takes back a connection that is between requests (closed if the pool is full or closed)."""
        with self._lock:
            keep = not self._closed and len(self._idle) < self.connections
            if keep:
                self._idle.append(conn)
        if not keep:  # more callers at once than `connections`: the extra ones are not kept
            conn.close()

    def parallel(self, ops: list[Callable[[BulkConnection], T]], deadline: float) -> list[T]:
        """Runs each op on its own connection, at once; raises the first failure (after all ended)."""
        if len(ops) == 1:
            return [self.run(ops[0], deadline)]
        try:
            futures = [self._executor.submit(self.run, op, deadline) for op in ops]
        except RuntimeError:  # closed by a concurrent reconfiguration: this call takes gRPC
            raise BulkUnreachable("the bulk pool was replaced") from None
        try:
            errors = [f.exception() for f in futures]
        except BaseException:  # an interrupt: the other lanes end (by the deadline) before this call does
            wait(futures)
            raise
        for exc in errors:
            if exc is not None and not isinstance(exc, BulkUnreachable):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
        return [f.result() for f in futures]

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_idle()
        self._executor.shutdown(wait=False)


def stripes(sizes: Sequence[int], n: int, request_bytes: int) -> list[list[list[int]]]:
    """Item indices per connection (at most n), each as requests of about request_bytes at most:
    items go to the least loaded connection, largest first, so connections carry similar bytes."""
    n = max(1, min(n, len(sizes)))
    loads = [0] * n
    lanes: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lane = loads.index(min(loads))
        lanes[lane].append(i)
        loads[lane] += sizes[i]
    out: list[list[list[int]]] = []
    for lane in lanes:
        requests: list[list[int]] = []
        size = 0
        for i in sorted(lane):
            if requests and size + sizes[i] <= request_bytes:
                requests[-1].append(i)
                size += sizes[i]
            else:
                requests.append([i])
                size = sizes[i]
        if requests:
            out.append(requests)
    return out
