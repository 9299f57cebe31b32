"""One bulk connection, in its own thread: HELLO, then PUT, GET, LEASE, RELEASE, LOOKUP, TOUCH and PUT_MEM
requests until the peer closes. (Over 500 lines: one connection's protocol, each request a method sharing
the session's deadline, auth and error plumbing; splitting it would pass that state around. PUT_MEM, which
needs the process registrations and the seal rules besides, is the mixin kvcache_server.bulk.put_mem.)

The thread does the socket work (recv_into into sink slots, or for a PUT of at most _STAGED_PUT_BYTES
into the session's own memory; sendmsg from stored blocks; checksum verification: all release the GIL);
everything that belongs to the server's event loop (the in-flight MemoryBudget, the tier stack's lower
tiers) is called there with run_coroutine_threadsafe.
What RAM alone answers (a GET window of RAM hits, LEASE, RELEASE, a LOOKUP that RAM decides) runs
here under the RAM tier's lock, without that hop.

Rules (docs/bulk.md): every error is answered with one ERROR frame (a gRPC status code and a
message), after which the server stops sending, reads and discards what the client still sends
for a moment (so the client reads the ERROR instead of a reset), and closes. A put commits only
after every block it announced has arrived and passed its key-bound checksum; any failure before
that abandons its slots and releases its budget: nothing of it is visible.

Deadlines (kvcache_server.bulk.deadline): a connection's HELLO must be complete within
bulk.hello_timeout_s of its accept; each request, from the first byte of its header to its last
frame, must move its bytes at bulk.min_rate_bytes_s and within bulk.request_timeout_s, and no
socket operation waits longer than bulk.stall_timeout_s; a peer too slow is cut off and what its
request held released. A connection that sends no request for bulk.idle_timeout_s is closed.
Its place among the connections (kvcache_server.bulk.admission) is taken at accept, moved to its
tenant's at HELLO, and given back by the listener when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from kvcache_core import bulkwire as bw
from kvcache_core.errors import ChecksumMismatch, UnknownFormatVersion
from kvcache_core.format import BlockFormatError, verify_block_in_pieces
from kvcache_server.auth import Authenticator, AuthError, Principal
from kvcache_server.budget import Holding, MemoryBudget
from kvcache_server.config import BulkSection, LimitsSection
from kvcache_server.handoff import HandoffRegistry
from kvcache_server.pipeline import Counters
from kvcache_server.pipeline.get import BlockSizes, locate_window
from kvcache_server.pipeline.inplace import leading_leases, releasing_tenant
from kvcache_server.refusal import Refused
from kvcache_server.stack import Found, PutOutcome, TierStack
from kvcache_server.tiers.base import TierKind

from .admission import ConnectionAdmission
from .deadline import HELLO, RATE, REQUEST, STALL, Cut, Deadline
from .put_mem import PutMemRequests
from .sink import BlockSink, Slot

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_NAMESPACE_BYTES = 128  # as the gRPC service (kvcache_server.service)
_MAX_WINDOW_KEYS = 1024
_BATCH_FRAMES = 128  # GET_ITEM frames per send: two buffers each, within sendmsg's IOV_MAX of 512
_BATCH_BYTES = 1 << 20
_RESERVE_AT_ONCE_BYTES = 4 << 20
"""A PUT of at most this much reserves its budget and every slot in one trip to the event loop."""
_STAGED_PUT_BYTES = 512 << 10
"""A PUT of at most this much is received into the session's own memory first, then reserved, copied into its
slots and committed in one trip to the event loop instead of two (Session._put_staged): the trip saved (two
thread wake-ups, 90-170 us here) costs more than the copy it adds on the loop (about 40 us for 512 KiB, in
cache). This is the one block copy on the loop above stack.RAM_OFF_LOOP_BYTES, on purpose."""
_LOOP_CALL_S = 120.0
"""Longest wait, beyond limits.admission_wait_s, for the event loop's part of a request (budget, stack
put or get): a backstop only; the budget waits at most admission_wait_s, the tiers have their own timeouts."""
_DRAIN_S = 2.0
_CUT_DRAIN_S = 0.5
"""A peer cut off for being slow is drained briefly: long enough that it reads the ERROR rather than a
reset, not long enough to hold its connection's place much longer."""
_DRAIN_BYTES = 1 << 16
_READ_AHEAD = 64 << 10
"""Bytes one receive may take beyond the frame being read: a small request (its header and its payload,
or several pipelined requests) arrives in one system call, and so one wake-up and one wait for the GIL,
not one per frame part. Larger reads (a PUT's blocks) go straight into where they land."""
_CUT_COUNTERS = {STALL: "cut_off_stall", RATE: "cut_off_rate", REQUEST: "cut_off_request", HELLO: "cut_off_hello"}


async def _then_release(coro: Coroutine[Any, Any, T], held: Holding, started: list[bool]) -> T:
    """coro's result, and `held`'s budget released on the loop as it ends (one wake-up of the loop
    fewer than releasing it from the session's thread afterwards). `started` is set as it starts."""
    started.append(True)
    try:
        return await coro
    finally:
        held.release_all()


def _unless_started(started: list[bool], commit: Coroutine[Any, Any, Any], slots: list[Slot], abandon: Any) -> None:
    """On the loop, after a commit was given up on: if it never started (cancelled before its first
    step), its slots are abandoned here (reservations never expire) and its coroutine closed."""
    if started:
        return
    commit.close()
    for slot in slots:
        abandon(slot)


class BulkCounters:
    """What the bulk path did, for Stats and tests (thread-safe)."""

    FIELDS = (
        "accepted",
        "connections",
        "puts",
        "gets",
        "leases",  # LEASE frames answered (same-host in-place reads)
        "bytes_leased",  # the blocks they leased (a key named twice once)
        "releases",  # RELEASE frames answered
        "lookups",  # LOOKUP frames answered
        "lookups_on_loop",  # of them, those RAM alone could not answer (the lower tiers were asked)
        "touches",  # TOUCH frames answered (blocks a same-host client read straight out of the arena)
        "bytes_touched",  # the blocks of them RAM held
        "bytes_received",
        "bytes_sent",
        "errors",
        "aborted",
        "cut_off",  # connections cut off by a deadline, of any of these kinds:
        "cut_off_hello",
        "cut_off_stall",
        "cut_off_rate",
        "cut_off_request",
        "refused_connections",  # at accept or at HELLO (kvcache_server.bulk.admission says by which limit)
        "evicted",  # unauthenticated connections evicted for newer ones (their sessions count as aborted)
        "checksum_failures",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass(slots=True)
class Shared:
    """What every session of one listener uses."""

    loop: asyncio.AbstractEventLoop
    stack: TierStack
    sink: BlockSink
    budget: MemoryBudget
    limits: LimitsSection
    bulk: BulkSection
    authenticator: Authenticator | None
    counters: BulkCounters
    admission: ConnectionAdmission[threading.Thread]
    block_sizes: BlockSizes
    lease_timeout_s: float = 30.0  # ram.lease_timeout_s: how long a LEASE's leases last
    registry: HandoffRegistry | None = None  # the segment socket's registrations (PUT_MEM), once it is open
    put_counters: Counters | None = None  # the gRPC Put's counters, which PUT_MEM moves as a Put of ranges does
    service: Any = None  # the KVCacheService: its inplace_bytes_received, which PUT_MEM's commits add to


class _Batch:
    """GET_ITEM frames waiting for one send: at most _BATCH_FRAMES blocks or _BATCH_BYTES of them."""

    __slots__ = ("block_bytes", "buffers", "frames")

    def __init__(self) -> None:
        self.buffers: list[bytes | memoryview] = []
        self.block_bytes = 0
        self.frames = 0

    def add(self, index: int, hit: Found) -> None:
        n = len(hit.data)
        head = bw.header(bw.FrameType.GET_ITEM, bw.GET_ITEM.size + n) + bw.GET_ITEM.pack(index, int(hit.tier))
        self.buffers += (head, hit.data)
        self.block_bytes += n
        self.frames += 1

    def full(self) -> bool:
        return self.frames >= _BATCH_FRAMES or self.block_bytes >= _BATCH_BYTES

    def clear(self) -> None:
        self.buffers = []
        self.block_bytes = self.frames = 0


class Session(PutMemRequests):
    """Serves one accepted connection until it ends; `run` never raises.

    Attributes:
        authenticated: its HELLO passed and it holds an authenticated place (of `tenant`'s, with
            auth) in `Shared.admission`; until then, its unauthenticated one (under `place`).
    """

    def __init__(
        self, sock: socket.socket, peer: str, shared: Shared, accepted_at: float, place: threading.Thread
    ) -> None:
        self.sock = sock
        self.peer = peer
        self._s = shared
        self._accepted_at = accepted_at
        self._place = place
        self.authenticated = False
        self.tenant: str | None = None
        self._principal: Principal | None = None
        self._metadata: dict[str, str] = {}
        self._header = bytearray(bw.HEADER_BYTES)
        self._ahead = bytearray(_READ_AHEAD)  # bytes received, not yet read: [_start, _end)
        self._ahead_view = memoryview(self._ahead)
        self._start = self._end = 0
        self._control_limit = bw.control_limit(shared.limits.max_keys_per_request)
        self._max_frame = shared.bulk.frame_limit(shared.limits.max_block_bytes)

    # -- plumbing ------------------------------------------------------------------------------

    def _on_loop(self, coro: Coroutine[Any, Any, T], undo: Callable[[T], object] | None = None) -> T:
        """coro's result, run on the loop; given up after admission_wait_s (+ a margin). With `undo`, a
        result that arrives after that is undone (a slot reserved just too late is abandoned)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._s.loop)
        try:
            return future.result(self._s.limits.admission_wait_s + _LOOP_CALL_S)
        except TimeoutError:
            future.cancel()  # a budget reservation still waiting must not be taken after we gave up
            if undo is not None:
                future.add_done_callback(
                    lambda f: undo(f.result()) if not f.cancelled() and f.exception() is None else None
                )
            raise

    def _recv(self, view: memoryview, what: str, deadline: Deadline) -> None:
        """Fills `view`: first from what was read ahead, then from the socket (through the read-ahead
        buffer when it is small, straight into `view` otherwise), within `deadline`."""
        n = len(view)
        have = self._end - self._start
        if have:
            k = min(have, n)
            view[:k] = self._ahead_view[self._start : self._start + k]
            self._start += k
            deadline.moved += k
            if k == n:
                return
            view, n = view[k:], n - k
        self._start = self._end = 0
        if n * 2 > _READ_AHEAD:
            deadline.recv_into(self.sock, view, what)
            return
        while self._end < n:
            self._end += deadline.recv_some(self.sock, self._ahead_view[self._end :], what)
        view[:] = self._ahead_view[:n]
        self._start = n
        deadline.moved -= self._end - n  # counted once they are read

    def _release(self, held: Holding) -> None:
        self._s.loop.call_soon_threadsafe(held.release_all)

    def _next_request(self) -> tuple[bw.FrameType, int, Deadline] | None:
        """The next request's first frame header, and the request's deadline; None when the peer
        closed between requests or sent nothing for idle_timeout_s. The idle wait ends with the
        header's first byte: from there on the request's deadline runs."""
        bulk = self._s.bulk
        head = memoryview(self._header)
        if self._start == self._end:  # nothing read ahead: wait for the next request's first bytes
            self._start = self._end = 0
            self.sock.settimeout(bulk.idle_timeout_s)
            try:
                got = self.sock.recv_into(self._ahead_view)
            except TimeoutError:
                log.debug("bulk %s: idle for %g s, closed", self.peer, bulk.idle_timeout_s)
                return None
            if got == 0:
                return None
            self._end = got
        head[0] = self._ahead[self._start]
        self._start += 1
        deadline = Deadline(
            "the request",
            limit_s=bulk.request_timeout_s,
            limit_name=REQUEST,
            stall_s=bulk.stall_timeout_s,
            min_rate_bytes_s=bulk.min_rate_bytes_s,
            grace_s=bulk.min_rate_grace_s,
        )
        deadline.moved = 1
        try:
            self._recv(head[1:], "a frame header", deadline)
        except bw.PeerClosed as exc:  # gone mid-header: never a clean close
            raise bw.PeerClosed(str(exc)) from None
        kind, length = bw.parse_header(self._header, self._max_frame)
        deadline.what = f"the {kind.name}"
        return kind, length, deadline

    def _frame(self, deadline: Deadline) -> tuple[bw.FrameType, int]:
        """The header of the next frame within a request."""
        self._recv(memoryview(self._header), "a frame header", deadline)
        return bw.parse_header(self._header, self._max_frame)

    def _control(self, kind: bw.FrameType, length: int, deadline: Deadline) -> bytes:
        if length > self._control_limit:
            raise bw.FrameError(
                f"{kind.name} frame of {length} bytes exceeds {self._control_limit}", "RESOURCE_EXHAUSTED"
            )
        buf = bytearray(length)
        self._recv(memoryview(buf), f"the {kind.name} frame", deadline)
        return bytes(buf)

    def _authorize(self, method: str) -> None:
        auth = self._s.authenticator
        if auth is None:
            return
        try:
            auth.check(method, self._metadata)
        except AuthError as exc:
            raise Refused(grpc.StatusCode[exc.code_name], str(exc)) from None

    def _namespace(self, namespace: str) -> str:
        if (
            not namespace
            or len(namespace) > MAX_NAMESPACE_BYTES
            or not namespace.isascii()
            or not namespace.isprintable()
            or " " in namespace
            or ":" in namespace
        ):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"namespace must be 1..{MAX_NAMESPACE_BYTES} printable ASCII characters without spaces or ':'",
            )
        p = self._principal
        return sys.intern(f"{p.tenant}:{namespace}" if p is not None else namespace)

    # -- the connection ------------------------------------------------------------------------

    def run(self) -> None:
        counters = self._s.counters
        try:
            self._hello()
            while (request := self._next_request()) is not None:
                kind, length, deadline = request
                if kind is bw.FrameType.PUT:
                    self._put(length, deadline)
                elif kind is bw.FrameType.GET:
                    self._get(length, deadline)
                elif kind is bw.FrameType.LEASE:
                    self._lease(length, deadline)
                elif kind is bw.FrameType.RELEASE:
                    self._release_leases(length, deadline)
                elif kind is bw.FrameType.LOOKUP:
                    self._lookup(length, deadline)
                elif kind is bw.FrameType.TOUCH:
                    self._touch(length, deadline)
                elif kind is bw.FrameType.PUT_MEM:
                    self._put_mem(length, deadline)
                else:
                    raise bw.FrameError(f"unexpected {kind.name} frame where a request must start")
        except Refused as exc:
            self._fail(exc.code, exc.message)
        except bw.FrameError as exc:
            self._fail(grpc.StatusCode[exc.code_name], str(exc))
        except Cut as exc:
            counters.add("cut_off")
            counters.add(_CUT_COUNTERS[exc.limit])
            log.warning("bulk %s: %s; cut off", self.peer, exc)
            if not exc.mid_send:
                self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"{exc}: the connection is cut off", drain_s=_CUT_DRAIN_S)
        except (bw.PeerClosed, OSError) as exc:  # gone mid-frame, reset, TLS failure
            counters.add("aborted")
            log.info("bulk %s: connection lost: %s", self.peer, exc)
        except Exception:
            counters.add("aborted")
            log.exception("bulk %s: unexpected failure", self.peer)
            self._fail(grpc.StatusCode.INTERNAL, "internal error on the bulk path", drain_s=0)
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()

    def _fail(self, code: grpc.StatusCode, message: str, *, drain_s: float = _DRAIN_S) -> None:
        """Answers one ERROR frame, then lets the client finish sending (for up to `drain_s`) before closing."""
        self._s.counters.add("errors")
        log.info("bulk %s: %s: %s", self.peer, code.name, message)
        payload = bw.error(code.value[0], message)
        try:
            self.sock.settimeout(1.0)
            bw.send_buffers(self.sock, [bw.header(bw.FrameType.ERROR, len(payload)), payload])
            if drain_s <= 0:
                return
            with contextlib.suppress(OSError, ValueError):  # ValueError: TLS sockets have no half-close
                self.sock.shutdown(socket.SHUT_WR)
            scratch = memoryview(bytearray(_DRAIN_BYTES))
            end = time.monotonic() + drain_s
            while (left := end - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if self.sock.recv_into(scratch) == 0:
                    break
        except OSError:
            pass

    def _hello(self) -> None:
        """HELLO, complete within hello_timeout_s of the accept (a TLS handshake included), then READY;
        the connection then holds an authenticated place, or is refused."""
        bulk = self._s.bulk
        deadline = Deadline(
            "HELLO",
            limit_s=bulk.hello_timeout_s,
            limit_name=HELLO,
            stall_s=bulk.stall_timeout_s,
            waited_s=time.monotonic() - self._accepted_at,
        )
        kind, length = self._frame(deadline)
        if kind is not bw.FrameType.HELLO:
            raise bw.FrameError(f"the first frame must be HELLO, not {kind.name}")
        if length > 4 + 0xFFFF:
            raise bw.FrameError("HELLO frame too long", "RESOURCE_EXHAUSTED")
        version, token = bw.parse_hello(self._control(kind, length, deadline))
        if version != bw.VERSION:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"bulk protocol version {version}; this server speaks 1")
        auth = self._s.authenticator
        if auth is not None:
            if not token.strip():
                raise Refused(
                    grpc.StatusCode.UNAUTHENTICATED, "missing credentials: send the API token in the HELLO frame"
                )
            self._metadata = {"authorization": f"Bearer {token}"}
            try:
                self._principal = auth.check("Info", self._metadata)
            except AuthError as exc:
                raise Refused(grpc.StatusCode[exc.code_name], str(exc)) from None
        tenant = self._principal.tenant if self._principal is not None else None
        refusal = self._s.admission.authenticate(self._place, tenant)
        if refusal is not None:
            self._s.counters.add("refused_connections")
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        self.authenticated, self.tenant = True, tenant
        limits = self._s.limits
        payload = bw.ready(bw.Ready(self._max_frame, limits.max_block_bytes, limits.max_keys_per_request))
        deadline.send(self.sock, [bw.header(bw.FrameType.READY, len(payload)), payload])

    # -- PUT -----------------------------------------------------------------------------------

    def _put(self, length: int, deadline: Deadline) -> None:
        namespace, entries = bw.parse_put(self._control(bw.FrameType.PUT, length, deadline))
        self._authorize("Put")
        scoped = self._namespace(namespace)
        total = self._put_sizes([n for _, n in entries])
        held = self._s.budget.holding(self.tenant)
        if total <= _STAGED_PUT_BYTES:  # small: received first, then one trip to the loop
            self._put_staged(scoped, entries, total, held, deadline)
            return
        slots: list[Slot] = []
        committed: bool | None = False
        started: list[bool] = []  # set by the commit on the loop as it starts
        sink = self._s.sink
        sizes = [n for _, n in entries]
        in_thread = False  # reserved and committed by this thread (RAM alone: TierStack.commits_off_loop)
        try:
            if (
                total <= _RESERVE_AT_ONCE_BYTES
                and held.would_fit(total)
                and (made := sink.reserve_in_thread(scoped, sizes)) is not None
            ):
                slots, in_thread = made, True
            elif total <= _RESERVE_AT_ONCE_BYTES:  # small: budget and every slot in one trip to the loop
                slots = self._on_loop(self._admit(held, scoped, sizes, total), undo=self._abandon_all)
            else:  # large: each slot just before its block arrives (memory only for bytes on their way)
                self._on_loop(held.reserve(total, "bulk PUT"))  # before a byte of it is allocated
            for i, n in enumerate(sizes):
                kind, got = self._frame(deadline)
                if kind is not bw.FrameType.DATA:
                    raise bw.FrameError(f"block {i}: expected a DATA frame, got {kind.name}")
                if got != n:
                    raise bw.FrameError(f"block {i}: DATA frame of {got} bytes for a block announced as {n} bytes")
                if len(slots) == i:
                    slots.append(self._on_loop(sink.reserve(scoped, n), undo=sink.abandon))
                slot = slots[i]
                # Verified piece by piece as it lands (in cache), not in a second pass; a refusal ends
                # the request there, and the connection (Session.run, _fail).
                self._recv_verified(i, entries[i][0], slot.view, deadline)
                self._s.counters.add("bytes_received", n)
            blocks = list(zip((k for k, _ in entries), slots, strict=True))
            if in_thread:
                committed = None  # from here the commit owns the slots, and cleans up after itself
                outcome = self._commit_here(scoped, blocks, held)
                committed = True
            else:
                commit = sink.commit(scoped, blocks)
                committed = None  # from here the commit owns the slots (it frees what it does not keep), ended or not
                outcome = self._on_loop(_then_release(commit, held, started))
                committed = True
            self._s.block_sizes.saw(scoped, max(n for _, n in entries))
        finally:
            if committed is False:
                for slot in slots:
                    sink.abandon(slot)
            elif committed is None and not in_thread:  # given up on: a commit the loop never started owns nothing
                self._s.loop.call_soon_threadsafe(_unless_started, started, commit, slots, sink.abandon)
            if committed is not True and not in_thread:  # else released on the loop, or nothing was reserved
                self._release(held)
        self._s.counters.add("puts")
        self._put_done(outcome, len(entries), total, deadline)

    def _put_sizes(self, sizes: list[int]) -> int:
        """A PUT's (or PUT_MEM's) blocks, checked against the limits; their total.

        Raises:
            Refused: INVALID_ARGUMENT (no block), RESOURCE_EXHAUSTED (too many, too large).
        """
        limits = self._s.limits
        if not sizes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "PUT carried no blocks")
        if len(sizes) > limits.max_put_stream_blocks:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(sizes)} blocks exceed max_put_stream_blocks={limits.max_put_stream_blocks}; split it",
            )
        for i, n in enumerate(sizes):
            if n > limits.max_block_bytes:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"block {i}: {n} bytes exceed max_block_bytes={limits.max_block_bytes}",
                )
        total = sum(sizes)
        if total > limits.max_put_stream_bytes:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"PUT of {total} bytes exceeds max_put_stream_bytes={limits.max_put_stream_bytes}; split it",
            )
        return total

    def _put_staged(
        self, namespace: str, entries: list[tuple[bytes, int]], total: int, held: Holding, deadline: Deadline
    ) -> None:
        """A small PUT in one trip to the event loop instead of two: its blocks are received into this
        session's own memory (at most _STAGED_PUT_BYTES, no client maps it), each verified piece by
        piece as it lands, and only then do the budget, the slots, the copy into them and the commit
        run on the loop, in one coroutine (_commit_staged). A refusal or a lost client before that
        trip has reserved nothing; whatever the trip reserved it frees however it ends."""
        staged = memoryview(np.empty(total, np.uint8))  # uninitialised: every byte is received once
        views: list[memoryview] = []
        at = 0
        for i, (key, n) in enumerate(entries):
            kind, got = self._frame(deadline)
            if kind is not bw.FrameType.DATA:
                raise bw.FrameError(f"block {i}: expected a DATA frame, got {kind.name}")
            if got != n:
                raise bw.FrameError(f"block {i}: DATA frame of {got} bytes for a block announced as {n} bytes")
            view = staged[at : at + n]
            self._recv_verified(i, key, view, deadline)
            self._s.counters.add("bytes_received", n)
            views.append(view)
            at += n
        keys = [k for k, _ in entries]
        sink = self._s.sink
        slots = sink.reserve_in_thread(namespace, [n for _, n in entries]) if held.would_fit(total) else None
        if slots is None:  # on the loop: budget, slots, the copy into them and the commit, in one trip
            outcome = self._on_loop(self._commit_staged(held, namespace, keys, views, total))
        else:  # RAM alone: reserved, written and committed in this thread, no trip to the loop and back
            try:
                for slot, view in zip(slots, views, strict=True):
                    slot.view[:] = view
            except BaseException:
                for slot in slots:
                    sink.abandon(slot)
                raise
            outcome = self._commit_here(namespace, list(zip(keys, slots, strict=True)), held)
        self._s.block_sizes.saw(namespace, max(n for _, n in entries))
        self._s.counters.add("puts")
        self._put_done(outcome, len(entries), total, deadline)

    def _commit_here(self, namespace: str, blocks: list[tuple[bytes, Slot]], held: Holding) -> PutOutcome:
        """Slots that reserve_in_thread gave, committed in this thread (commit_in_thread), or on the
        loop where an event subscriber came meanwhile (events are published in order there). Owns the
        slots from its call: whatever it does not commit it frees, however it ends."""
        sink = self._s.sink
        outcome = sink.commit_in_thread(namespace, blocks)
        if outcome is not None:
            return outcome
        started: list[bool] = []
        commit = sink.commit(namespace, blocks)
        try:
            return self._on_loop(_then_release(commit, held, started))
        except BaseException:  # given up on: a commit the loop never started owns nothing
            slots = [slot for _, slot in blocks]
            self._s.loop.call_soon_threadsafe(_unless_started, started, commit, slots, sink.abandon)
            raise

    async def _commit_staged(
        self, held: Holding, namespace: str, keys: list[bytes], views: list[memoryview], total: int
    ) -> PutOutcome:
        """_put_staged's part on the loop. Cancelled (the session gave up waiting), it frees its slots
        (or the commit, once started, frees what it does not keep) and its budget."""
        sink = self._s.sink
        try:
            await held.reserve(total, "bulk PUT")
            slots = await sink.reserve_many(namespace, [len(v) for v in views])
            owned = True
            try:
                for slot, view in zip(slots, views, strict=True):
                    slot.view[:] = view
                owned = False  # the commit owns the slots from its first step (it frees what it does not keep)
                return await sink.commit(namespace, list(zip(keys, slots, strict=True)))
            finally:
                if owned:
                    for slot in slots:
                        sink.abandon(slot)
        finally:
            held.release_all()

    def _put_done(self, outcome: PutOutcome, blocks: int, total: int, deadline: Deadline) -> None:
        stored = sum(outcome.kept)
        tiers = tuple((int(t.kind), t.stored, t.queued, t.dropped, t.failed, t.deleted) for t in outcome.tiers)
        payload = bw.put_done(bw.PutDone(stored, blocks - stored, total, tiers))
        deadline.send(self.sock, [bw.header(bw.FrameType.PUT_DONE, len(payload)), payload])

    async def _admit(self, held: Holding, namespace: str, sizes: list[int], total: int) -> list[Slot]:
        await held.reserve(total, "bulk PUT")
        return await self._s.sink.reserve_many(namespace, sizes)

    def _abandon_all(self, slots: list[Slot]) -> None:
        for slot in slots:
            self._s.sink.abandon(slot)

    def _recv_verified(self, index: int, key: bytes, view: memoryview, deadline: Deadline) -> None:
        """Receives block `index` into `view`, each piece checked against the block's checksum right
        after it landed (format.verify_block_in_pieces; uncompressed only: a compressed block is a
        BlockFormatError).

        Raises:
            Refused: DATA_LOSS (checksum) or INVALID_ARGUMENT (malformed), the rest of the block unread.
        """
        where = f"block {index}"
        try:
            verify_block_in_pieces(view, key, lambda start, end: self._recv(view[start:end], where, deadline))
        except ChecksumMismatch as exc:
            self._s.counters.add("checksum_failures")
            raise Refused(grpc.StatusCode.DATA_LOSS, f"{where}: {exc}") from None
        except UnknownFormatVersion as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {exc}") from None
        except BlockFormatError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: malformed block: {exc}") from None

    # -- GET -----------------------------------------------------------------------------------

    def _get(self, length: int, deadline: Deadline) -> None:
        namespace, prefix_only, keys = bw.parse_get(self._control(bw.FrameType.GET, length, deadline))
        self._authorize("Get")
        scoped = self._namespace(namespace)
        self._check_keys(keys)
        held = self._s.budget.holding(self.tenant, capped=True)
        sent, on_loop = 0, False
        done_sent = False
        try:
            start = 0
            while start < len(keys):
                end = min(len(keys), start + _MAX_WINDOW_KEYS)
                quick = self._s.stack.get_all_from_ram(scoped, keys[start:end])  # RAM hits: no loop hop
                if quick is not None:
                    found = quick
                else:
                    on_loop = True
                    end, found = self._on_loop(self._window(held, scoped, keys, start))
                try:
                    batch = _Batch()
                    for i, hit in enumerate(found, start):
                        if hit is None:
                            if prefix_only:
                                end = len(keys)
                                break
                            continue
                        batch.add(i, hit)
                        sent += 1
                        if batch.full():
                            self._send_batch(batch, deadline)
                    if end >= len(keys):  # the last window: GET_DONE goes out with its blocks
                        self._s.counters.add("gets")  # before the answer: a caller that has it sees it counted
                        payload = bw.get_done(sent)
                        batch.buffers += (bw.header(bw.FrameType.GET_DONE, len(payload)), payload)
                        done_sent = True
                    self._send_batch(batch, deadline)
                finally:
                    # RAM hits are views of arena slots under read leases: sent (or failed), they
                    # are handed back at once, so their slots can be evicted and reused again.
                    self._s.stack.release(found)
                start = end
        finally:
            if on_loop:  # only the loop's windows reserve (a wake-up of the loop otherwise wasted)
                self._release(held)
        if not done_sent:
            self._s.counters.add("gets")
            payload = bw.get_done(sent)
            deadline.send(self.sock, [bw.header(bw.FrameType.GET_DONE, len(payload)), payload])

    def _check_keys(self, keys: list[bytes]) -> None:
        limits = self._s.limits
        if not keys:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "keys must not be empty")
        if len(keys) > limits.max_keys_per_request:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys exceed max_keys_per_request={limits.max_keys_per_request}",
            )

    # -- LEASE and RELEASE: the in-place reads of a same-host client, one round trip each ----------

    def _lease(self, length: int, deadline: Deadline) -> None:
        """LeaseGet over this connection (pipeline.inplace has the rules): ends the leases it names
        first (the client's releases ride on its next request), then leases the keys RAM holds.
        Entirely in this thread (the RAM tier's lock), never a hop to the event loop."""
        namespace, prefix_only, keys, ends = bw.parse_lease(self._control(bw.FrameType.LEASE, length, deadline))
        self._authorize("LeaseGet")
        scoped = self._namespace(namespace)
        self._check_keys(keys)
        ram = self._s.stack.ram
        if not ram.region.path:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this server's block arena is not shared (Info.arena_path is empty); use GET",
            )
        if ends:
            ram.release(ends, releasing_tenant(self._principal))
        leases = self._s.stack.lease(scoped, keys, self._s.lease_timeout_s)
        if prefix_only:
            leases = leading_leases(ram, leases)
        slots = [(lease.id, lease.offset, lease.length) if lease else (0, 0, 0) for lease in leases]
        payload = bw.leased(self._s.lease_timeout_s, ram.region.path, slots)
        self._s.counters.add("leases")
        self._s.counters.add("bytes_leased", sum({lease.id: lease.length for lease in leases if lease}.values()))
        deadline.send(self.sock, [bw.header(bw.FrameType.LEASED, len(payload)), payload])

    def _release_leases(self, length: int, deadline: Deadline) -> None:
        ids = bw.parse_release(self._control(bw.FrameType.RELEASE, length, deadline))
        self._authorize("LeaseRelease")
        released = self._s.stack.ram.release(ids, releasing_tenant(self._principal)) if ids else 0
        self._s.counters.add("releases")
        payload = bw.released(released)
        deadline.send(self.sock, [bw.header(bw.FrameType.RELEASED, len(payload)), payload])

    # -- LOOKUP: the service's Lookup, one socket round trip -------------------------------------

    def _lookup(self, length: int, deadline: Deadline) -> None:
        """Lookup over this connection, with its rules (the read right, tenant scoping, key limits):
        in this thread when RAM alone decides the answer (RAM holds every key, or no tier is below
        it), else on the event loop, where the lower tiers are asked within the caller's time left
        (limits.lookup_deadline_share of it, as the gRPC Lookup)."""
        received = time.monotonic()
        namespace, timeout_ms, keys = bw.parse_lookup(self._control(bw.FrameType.LOOKUP, length, deadline))
        self._authorize("Lookup")
        scoped = self._namespace(namespace)
        self._check_keys(keys)
        stack = self._s.stack
        tiers = stack.lookup_from_ram(scoped, keys)
        if tiers is None:
            left_s = timeout_ms / 1000 - (time.monotonic() - received) if timeout_ms else None
            tiers = self._on_loop(self._lookup_lower(scoped, keys, left_s))
            self._s.counters.add("lookups_on_loop")
        stack.observer.lookup(scoped, len(keys), len(tiers))
        self._s.counters.add("lookups")
        payload = bw.looked_up([int(t) for t in tiers])
        deadline.send(self.sock, [bw.header(bw.FrameType.LOOKED_UP, len(payload)), payload])

    def _touch(self, length: int, deadline: Deadline) -> None:
        """Blocks a same-host client read straight out of the arena (kvcache_client.local_reads),
        with the read right, counted as a Get of RAM hits is: a hit each, most recently used (so
        what is read locally is not evicted first). Entirely in this thread (the RAM tier's lock)."""
        namespace, keys = bw.parse_touch(self._control(bw.FrameType.TOUCH, length, deadline))
        self._authorize("Get")
        scoped = self._namespace(namespace)
        self._check_keys(keys)
        held = self._s.stack.touch_ram(scoped, keys)
        self._s.counters.add("touches")
        self._s.counters.add("bytes_touched", held)
        payload = bw.touched(len(keys))
        deadline.send(self.sock, [bw.header(bw.FrameType.TOUCHED, len(payload)), payload])

    async def _lookup_lower(self, namespace: str, keys: list[bytes], left_s: float | None) -> list[TierKind]:
        answer_by = None
        if left_s is not None:
            answer_by = self._s.loop.time() + max(0.0, left_s) * self._s.limits.lookup_deadline_share
        return await self._s.stack.lookup(namespace, keys, answer_by=answer_by)

    def _send_batch(self, batch: _Batch, deadline: Deadline) -> None:
        """One sendmsg for many blocks' frames (small blocks: one system call and one wake-up of the
        client for many, not one each)."""
        if batch.buffers:
            deadline.send(self.sock, batch.buffers)
            self._s.counters.add("bytes_sent", batch.block_bytes)
        batch.clear()

    async def _window(
        self, held: Holding, namespace: str, keys: list[bytes], start: int
    ) -> tuple[int, list[Found | None]]:
        """One window of a GET, on the event loop: every key RAM holds (no copy), and lower-tier keys up
        to about limits.get_window_bytes, reserved at the namespace's known block size (as gRPC's)."""
        held.release_all()  # the previous window has been sent
        sizes, window_bytes = self._s.block_sizes, self._s.limits.get_window_bytes
        end, found = await locate_window(
            self._s.stack, held, namespace, keys, start, sizes.get(namespace), window_bytes, "bulk GET"
        )
        lower = [len(f.data) for f in found if f is not None and f.tier is not TierKind.RAM]
        if lower:
            sizes.saw(namespace, max(lower))
        return end, found
