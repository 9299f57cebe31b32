"""In-place reads through the server's block arena, written once for both clients (docs/arena.md).

The blocking face (kvcache_client.arena.InPlaceCalls, behind GrpcTransport) and the asyncio face
(kvcache_client.arena_aio.AsyncInPlaceCalls, behind AsyncGrpcTransport) both drive the steps here
(kvcache_client.steps): what to send, what an answer means, which keys were leased and which come
the ordinary way, when to fall back, how much of the deadline is left, and which leases to hand
back. A face only does the I/O each operation names:

    operation           blocking face                        asyncio face
    LeaseGet            grpc future, waited for until the    task, waited for until the deadline
                        deadline
    Follow              maps a restarted server's arena      the same, in a worker thread
    Release             LeaseRelease, blocking               LeaseRelease as a task of its own,
                                                             shielded from the caller's cancellation
    Fetch               the transport's Get                  the transport's Get, awaited
    CopyOut             copies leased views out              the same, in a worker thread when large

The invariant both keep, through one LeaseBook each: every lease the server grants is handed back,
however the call ends. A LeaseGet pins slots the moment it answers, so a caller that stops waiting
first (its deadline passed, it was cancelled, KeyboardInterrupt) leaves the call running to its own
end (the caller's deadline plus CLEANUP_S), kept by the book, and the leases its answer names are
released as soon as it comes (counted in LeaseBook.handed_back). Everything a call holds once an
answer was handed to it is released on every way out of the steps (`except BaseException`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np

from kvcache_client.bulkconn import BulkUnreachable
from kvcache_client.errors import DeadlineExceeded, RPCError
from kvcache_client.results import Fetched
from kvcache_client.steps import Steps
from kvcache_core.landing import each
from kvcache_proto import kvcache_pb2 as pb

if TYPE_CHECKING:
    from kvcache_client.arena import ArenaLink
    from kvcache_client.bufpool import BufferPool

log = logging.getLogger(__name__)

CLEANUP_S = 5.0
"""Deadline of a release, and what a pinning call runs past its caller's deadline: cleanup after
the caller's call, whatever its deadline was."""


def left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()), at least 1 ms: a call past it still gets sent
    with a deadline gRPC accepts, and fails DEADLINE_EXCEEDED on its own."""
    return max(0.001, deadline - time.monotonic())


# -- what the steps hold and hand out ---------------------------------------------------------------


@dataclass(slots=True)
class Leased:
    """A get whose RAM hits may be views of the server's arena under leases.

    Attributes:
        blocks: per key, (block, tier) or None: unverified, as received.
        ids: the leases to release once the views are no longer used.
        in_place: per key, whether its block is a leased view of the arena (else this client's own memory).
        expires_at: time.monotonic() by which the leases end on the server at the latest (counted
            from before the request was sent, so never later than the server's own expiry); the
            views are this call's blocks only before then. inf without leases.
    """

    blocks: list[Fetched | None]
    ids: list[int] = field(default_factory=list)
    in_place: list[bool] = field(default_factory=list)
    expires_at: float = math.inf

    def __post_init__(self) -> None:
        if not self.in_place:
            self.in_place = [False] * len(self.blocks)


class ArenaMoved(Exception):
    """The arena an answer named cannot be used here; the call goes another way."""


class SDKStatus(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """A status the SDK raises as gRPC would have (the steps handle both alike)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


class DeadlineBeforeAnswer(SDKStatus):
    """DEADLINE_EXCEEDED raised by the SDK itself (both faces): the caller's deadline passed while a
    call that pins server memory was still answering (what the answer pins is handed back when it comes)."""

    def __init__(self, what: str) -> None:
        super().__init__(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"deadline passed before {what} answered (what it pins is handed back when it does)",
        )


class BulkRefusal(SDKStatus):
    """A LEASE or RELEASE on the bulk port answered with an ERROR frame: the status LeaseGet or
    LeaseRelease would have answered, raised as theirs (the request is not asked again on gRPC)."""


@contextlib.contextmanager
def bulk_answered(what: str, down: Callable[[str], None]) -> Iterator[None]:
    """Around a LEASE or RELEASE on the bulk port (both faces): a port that failed (BulkUnreachable)
    is reported to `down` and swallowed, so that the caller goes on to the gRPC call; the deadline
    passing is DeadlineBeforeAnswer(what); an ERROR frame is raised as the gRPC call's status would be.
    """
    try:
        yield
    except BulkUnreachable as exc:
        down(str(exc))
    except DeadlineExceeded:
        raise DeadlineBeforeAnswer(what) from None
    except RPCError as exc:  # refused (the arena, rights, a rate): as LeaseGet's or LeaseRelease's status
        raise BulkRefusal(exc.code, exc.details) from None


# -- answers and decisions -------------------------------------------------------------------------


def lease_ids(reply: pb.LeaseGetResponse) -> list[int]:
    return [s.id for s in reply.leases if s.id]


def not_leased(out: Sequence[Fetched | None], prefix_only: bool) -> list[int]:
    """The positions a get fetches the ordinary way after its LeaseGet: the keys RAM lacks (with
    prefix_only, everything from the first of them on, since the server cut its answer there)."""
    missing = [i for i, f in enumerate(out) if f is None]
    if prefix_only and missing:
        return list(range(missing[0], len(out)))
    return missing


def arena_fallback(exc: grpc.RpcError | ArenaMoved, link: ArenaLink) -> bool:
    """True when a LeaseGet failed in a way the ordinary path avoids (the caller redoes the get
    that way; counted on `link`):

    - RESOURCE_EXHAUSTED: the server cannot lease now. This call only.
    - FAILED_PRECONDITION: the arena is not shared; off.
    - UNIMPLEMENTED: a server that predates the arena; off.
    - ArenaMoved: a restarted server's arena cannot be mapped; off.
    """
    if isinstance(exc, ArenaMoved):
        link.fallback(str(exc))
        link.off(str(exc))
        return True
    code = exc.code()
    if code not in {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }:
        return False
    reason = exc.details() or str(code)
    link.fallback(reason)
    if code is grpc.StatusCode.UNIMPLEMENTED or "not shared" in reason:
        link.off(reason)
    return True


def copy_out(view: memoryview, buffers: BufferPool) -> memoryview:
    """A read-only copy of a leased block in this process's own memory (valid after the release):
    one copy into a buffer of `buffers` (warm when an earlier call's was dropped). The caller
    verifies it there, after the copy: what the arena held before it is not what is handed out."""
    out = buffers.take(len(view))
    np.copyto(out, np.frombuffer(view, dtype=np.uint8))
    return memoryview(out).toreadonly()


def copied_out(leased: Leased, buffers: BufferPool) -> list[Fetched | None]:
    """A lease's blocks in this process's own memory (leased views copied once, several at once on
    a few threads when large: kvcache_core.landing.each), to release after."""
    out = list(leased.blocks)
    views = [i for i, (f, in_place) in enumerate(zip(out, leased.in_place, strict=True)) if f is not None and in_place]
    sizes = [len(out[i][0]) for i in views]  # type: ignore[index]
    copies = each(lambda i: copy_out(out[i][0], buffers), views, sizes)  # type: ignore[index]
    for i, copy in zip(views, copies, strict=True):
        out[i] = (copy, out[i][1])  # type: ignore[index]
    return out


def in_place_bytes(leased: Leased) -> int:
    """Bytes of the leased views CopyOut copies (the asyncio face copies many in a worker thread)."""
    return sum(len(f[0]) for f, p in zip(leased.blocks, leased.in_place, strict=True) if f is not None and p)


# -- the account of what the server granted --------------------------------------------------------


class Pending(Protocol):
    """A call still running: a grpc.Future or an asyncio.Future (the same names for what is asked here)."""

    def add_done_callback(self, fn: Callable[[Any], object], /) -> Any: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def result(self) -> Any: ...


class LeaseBook:
    """One face's account of the leases granted to calls nobody waits for any more. Thread-safe: the
    blocking face settles in gRPC's callback threads.

    A LeaseGet whose answer was not handed to its caller is `abandon`ed here: kept until it ends
    (gRPC cancels a call whose future is collected; asyncio keeps only weak references to tasks),
    then its answer's leases go to the face's non-blocking `hand_back` (counted in `handed_back`).
    The hand-backs, and the asyncio face's releases, are kept until they end as well (`keep`), so
    `pending` says what is still in flight (AsyncInPlaceCalls.drain waits for it).
    """

    def __init__(self) -> None:
        self.handed_back = 0
        """LeaseGet answers that came after their caller stopped waiting, whose leases were released at once."""
        self._pending: set[Pending] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    @property
    def pending(self) -> set[Pending]:
        with self._lock:
            return set(self._pending)

    def keep(self, call: Pending) -> None:
        """Keeps `call` until it ends."""
        with self._lock:
            self._pending.add(call)
        call.add_done_callback(self._done)

    def abandon(self, call: Pending, hand_back: Callable[[list[int]], object]) -> None:
        """`call`, a LeaseGet whose answer its caller will not take, hands back what it grants
        (`hand_back(ids)`, which must not block: it may run in a gRPC callback thread, and keeps
        the call it starts here, before the LeaseGet leaves `pending`)."""
        with self._lock:
            self._pending.add(call)

        def settle(ended: Pending) -> None:
            try:
                granted = not ended.cancelled() and ended.exception() is None  # else nothing was, or it expires
                ids = lease_ids(ended.result()) if granted else []
                if ids:
                    with self._lock:
                        self.handed_back += 1
                    hand_back(ids)
            finally:
                self._done(ended)

        call.add_done_callback(settle)

    def count_handed_back(self) -> None:
        """One more answer nobody waited for whose leases are being handed back."""
        with self._lock:
            self.handed_back += 1

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until nothing is pending (the blocking face's close), at most `timeout_s`; whether it got there."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout_s)

    def _done(self, call: Pending) -> None:
        with self._lock:
            self._pending.discard(call)
            if not self._pending:
                self._idle.notify_all()


# -- the operations a face performs ----------------------------------------------------------------


class InPlaceIO(Protocol):
    """What a face does for the steps; the asyncio face's methods are coroutine functions."""

    def lease_get(self, request: pb.LeaseGetRequest, deadline: float) -> Any:
        """The answer, waited for until `deadline` (then DeadlineBeforeAnswer); an answer not
        handed over (deadline, cancellation, interrupt) is abandoned to the face's LeaseBook."""

    def follow(self, path: str) -> Any:
        """ArenaLink.follow: maps the arena an answer names when it moved (raises ArenaMoved)."""

    def hand_back(self, ids: list[int]) -> Any:
        """Runs `releasing(ids)` to its end (on the asyncio face whatever becomes of the caller)."""

    def send_release(self, request: pb.LeaseReleaseRequest) -> Any:
        """LeaseRelease with the deadline CLEANUP_S."""

    def fetch(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Any:
        """The ordinary get (segments, then inline gRPC)."""

    def copy_out(self, leased: Leased) -> Any:
        """copied_out(leased, the face's buffer pool)."""


@dataclass(frozen=True, slots=True)
class LeaseGet:
    request: pb.LeaseGetRequest
    deadline: float

    def perform(self, io: InPlaceIO) -> Any:
        return io.lease_get(self.request, self.deadline)


@dataclass(frozen=True, slots=True)
class Follow:
    path: str

    def perform(self, io: InPlaceIO) -> Any:
        return io.follow(self.path)


@dataclass(frozen=True, slots=True)
class Release:
    ids: list[int]

    def perform(self, io: InPlaceIO) -> Any:
        return io.hand_back(self.ids)


@dataclass(frozen=True, slots=True)
class SendRelease:
    request: pb.LeaseReleaseRequest

    def perform(self, io: InPlaceIO) -> Any:
        return io.send_release(self.request)


@dataclass(frozen=True, slots=True)
class Fetch:
    namespace: str
    keys: Sequence[bytes]
    prefix_only: bool
    timeout_s: float

    def perform(self, io: InPlaceIO) -> Any:
        return io.fetch(self.namespace, self.keys, self.prefix_only, self.timeout_s)


@dataclass(frozen=True, slots=True)
class CopyOut:
    leased: Leased

    def perform(self, io: InPlaceIO) -> Any:
        return io.copy_out(self.leased)


# -- the steps -------------------------------------------------------------------------------------


def lease_views(
    link: ArenaLink, namespace: str, keys: Sequence[bytes], prefix_only: bool, deadline: float
) -> Steps[tuple[list[Fetched | None], list[int], float]]:
    """Views of the leased blocks RAM holds (None for the others), the lease ids to release, and
    the time.monotonic() by which the leases end at the latest (Leased.expires_at).

    Raises:
        grpc.RpcError: see arena_fallback; DEADLINE_EXCEEDED when the deadline passed before the answer.
        ArenaMoved: the server's arena cannot be mapped here any more.
    """
    request = pb.LeaseGetRequest(namespace=namespace, keys=keys, prefix_only=prefix_only)
    sent = time.monotonic()
    reply: pb.LeaseGetResponse = yield LeaseGet(request, deadline)
    ids = lease_ids(reply)
    try:
        yield Follow(reply.arena_path)
        views = link.leased_views(reply, len(keys))
    except BaseException:
        yield Release(ids)
        raise
    return views, ids, sent + reply.expires_in_s if ids else math.inf


def lease(link: ArenaLink, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Steps[Leased]:
    """A get whose RAM hits are leased views of the server's arena when it is shared with this
    process; the keys RAM lacks (or all, where the arena cannot be used: counted on `link`) come
    the ordinary way, within what is left of the deadline. The leases are the caller's to hand
    back (`releasing(leased.ids)`) once the views are no longer used; on any other way out they
    are handed back here.

    Raises:
        grpc.RpcError: the LeaseGet's or the ordinary get's status (DEADLINE_EXCEEDED included).
    """
    deadline = time.monotonic() + timeout_s
    if not link.on:
        return Leased((yield Fetch(namespace, keys, prefix_only, left(deadline))))
    try:
        out, ids, expires_at = yield from lease_views(link, namespace, keys, prefix_only, deadline)
    except (grpc.RpcError, ArenaMoved) as exc:
        if not arena_fallback(exc, link):
            raise
        return Leased((yield Fetch(namespace, keys, prefix_only, left(deadline))))
    in_place = [f is not None for f in out]
    try:
        missing = not_leased(out, prefix_only)
        if missing:
            rest = yield Fetch(namespace, [keys[i] for i in missing], prefix_only, left(deadline))
            for i, f in zip(missing, rest, strict=True):
                out[i] = f
    except BaseException:
        yield Release(ids)
        raise
    return Leased(out, ids, in_place, expires_at)


def get(
    link: ArenaLink, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
) -> Steps[list[Fetched | None]]:
    """Blocks in this client's own memory: `lease`, the leased views copied out once, the leases
    handed back (also when the copy fails or the caller is cancelled while it runs)."""
    leased = yield from lease(link, namespace, keys, prefix_only, timeout_s)
    try:
        blocks: list[Fetched | None] = yield CopyOut(leased)
    except BaseException:
        yield Release(leased.ids)
        raise
    yield Release(leased.ids)
    return blocks


def releasing(ids: list[int]) -> Steps[None]:
    """Ends leases; a failure only logs (they expire on the server)."""
    if not ids:
        return
    try:
        yield SendRelease(pb.LeaseReleaseRequest(leases=ids))
    except grpc.RpcError as exc:
        log.debug("releasing %d leases: %s (they expire on the server)", len(ids), exc.code())


def pinning_timeout_s(deadline: float) -> float:
    """The gRPC deadline of a call that pins server memory: the caller's plus a cleanup's, so that
    it ends on its own after its caller stopped waiting, and its answer can be handed back."""
    return left(deadline) + CLEANUP_S
