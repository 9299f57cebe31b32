"""The client's side of in-place transfers through the server's block arena (docs/shm.md, docs/arena.md).

When the server shares its arena (Info.arena_path: a file in its shared-memory directory) and this
process may map it (same host, same user), block bytes never travel at all:

- **put**: not through the arena. The SDK writes the blocks into a segment of its own (kvcache_client.
  shm) and the server reads them from there straight into slots it reserves, verifies and commits
  them: no client is ever handed a writable slot (one stalled past its reservation's time-out would
  write into a slot reused for another key).
- **get**: LeaseGet answers, for each key the server's RAM holds, where its block lies under a
  read lease (the slot is not reused until LeaseRelease or the lease's time-out). The SDK verifies
  the key-bound checksum before anything uses the bytes, then reads them in place
  (KVCacheClient.leased), copies them once into the caller's destination (get_into) or into memory
  of its own (get_many), and releases. Keys RAM does not hold are fetched with Get.

The arena is mapped read-only (the file is 0400: an open for writing fails), so nothing this client
does can change a block in it. A restarted server has a new arena file, possibly of another size;
every answer names its arena, and the SDK maps the new one, at its own size, when it changes. When the arena
cannot be used for a get (another host or user, an older server, a server that does not share it) the
get goes the other way (per-call segments, then inline gRPC), counted in `ArenaLink.fallbacks`.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvcache_client.results import Fetched
from kvcache_core.format import payload_view
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MIN_PUT_BYTES = 64 << 10
"""Puts smaller than this stay inline: an extra round trip costs more than it saves."""


class ArenaLink:
    """Whether this client moves block bytes in place through the server's arena, and its mappings.

    States: "unknown" until the first Info, then "on" or "off". Thread-safe.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.state = "unknown" if enabled else "off"
        self.reason = "" if enabled else "disabled by the client"
        self.path = ""
        self.size = 0
        self.max_keys = 0
        self.max_block_bytes = 0
        self.fallbacks = 0
        self.last_fallback = ""
        self._readonly: memoryview | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @property
    def on(self) -> bool:
        if self._pid != os.getpid():  # a forked child maps the arena itself, if it uses it
            self._pid, self._readonly = os.getpid(), None
            if self.state == "on":
                self._map(self.path, self.size)
        return self.state == "on"

    def configure(self, path: str, size: int, max_keys: int, max_block_bytes: int) -> None:
        """Takes the server's Info answer: on when the arena file is here and this process's to map."""
        self.max_keys, self.max_block_bytes = max_keys, max_block_bytes
        if self.state == "off":
            return
        if not path:
            self.off("the server does not share its block arena")
            return
        self._map(path, size)

    def _map(self, path: str, size: int | None) -> None:
        """Maps the arena read-only; `size` None takes the file's own (a restarted server's may differ)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            self.off(f"cannot open the server's arena {path} ({exc.strerror}): another host or user")
            return
        try:
            st = os.fstat(fd)
            size = st.st_size if size is None else size
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size or not size:
                self.off(f"{path} is not a {size}-byte regular file of this user")
                return
            # Populated now, once: no call of this client page-faults on the arena afterwards.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            readonly = memoryview(mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ))
        except OSError as exc:
            self.off(f"cannot map the server's arena {path}: {exc}")
            return
        finally:
            os.close(fd)  # the mappings keep the memory; the server keeps the file
        with self._lock:
            self._readonly = readonly
            self.state, self.path, self.size, self.reason = "on", path, size, ""
        log.debug("in-place path on: %s (%d bytes)", path, size)

    def follow(self, path: str, size: int | None = None) -> None:
        """Maps the arena an answer names, when the server has a new one (it restarted).

        Raises:
            ArenaMoved: the new arena cannot be mapped here (the call goes another way).
        """
        if path == self.path:
            return
        self._map(path, size)
        if self.state != "on":
            raise ArenaMoved(f"the server's arena moved to {path} and cannot be mapped: {self.reason}")

    def off(self, reason: str) -> None:
        if self.state == "on":
            log.info("in-place path off: %s", reason)
        with self._lock:
            self.state, self.reason = "off", reason
            self._readonly = None  # views handed out keep their mapping

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks += 1
            self.last_fallback = reason
        log.debug("in-place path: %s; this call goes another way (%d such calls)", reason, self.fallbacks)

    def leased_views(self, reply: pb.LeaseGetResponse, n: int) -> list[Fetched | None]:
        """Per key of a LeaseGet, the read-only view of its leased block, or None (RAM lacks it).

        Raises:
            ArenaMoved: the arena the answer names cannot be mapped here.
            ValueError: a lease is not inside the arena.
        """
        self.follow(reply.arena_path)
        out: list[Fetched | None] = [None] * n
        for i, s in enumerate(reply.leases):
            if s.id:
                out[i] = (self.view(s.offset, s.length), "ram")
        return out

    def view(self, offset: int, length: int) -> memoryview:
        """The read-only view of a leased block.

        Raises:
            ValueError: the range is not inside the arena.
        """
        mapping = self._readonly
        if mapping is None:
            raise ArenaMoved("the arena is no longer mapped")
        if offset + length > len(mapping):
            raise ValueError(f"lease [{offset}, {offset + length}) runs past the {len(mapping)}-byte arena")
        return mapping[offset : offset + length]


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


class LeasedBlocks(list):  # type: ignore[type-arg]  # list[memoryview | None]
    """What KVCacheClient.leased() hands out: each key's verified block or None, and `expires_at`.

    `expires_at` (time.monotonic(); inf when no block is a leased view) bounds how long the views
    are this call's blocks: the server may reuse an expired lease's slot. A copy out of them that
    ended before it read exactly the bytes that were verified; check `time.monotonic() <
    blocks.expires_at` after copying, and drop the copy otherwise (leases last ram.lease_timeout_s,
    30 s by default: only a stalled reader gets there).
    """

    expires_at: float = math.inf

    def expired(self) -> bool:
        """Whether the leases may have ended: a copy made from the views is then not to be trusted."""
        return time.monotonic() >= self.expires_at


class DeadlineBeforeAnswer(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """DEADLINE_EXCEEDED raised by the SDK itself: the caller's deadline passed while a call that
    pins server memory was still answering (what the answer pins is handed back when it comes)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"deadline passed before {what} answered")
        self._what = what

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"deadline passed before {self._what} answered (what it pins is handed back when it does)"

    def initial_metadata(self) -> tuple:
        return ()

    def trailing_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: object) -> bool:
        return False


class ArenaMoved(Exception):
    """The arena an answer named cannot be used here; the call goes another way."""


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


def lease_ids(reply: pb.LeaseGetResponse) -> list[int]:
    return [s.id for s in reply.leases if s.id]


def not_leased(out: Sequence[Fetched | None], prefix_only: bool) -> list[int]:
    """The positions a get fetches the ordinary way after its LeaseGet: the keys RAM lacks (with
    prefix_only, everything from the first of them on, since the server cut its answer there)."""
    missing = [i for i, f in enumerate(out) if f is None]
    if prefix_only and missing:
        return list(range(missing[0], len(out)))
    return missing


def copied_out(leased: Leased) -> list[Fetched | None]:
    """A lease's blocks in this process's own memory (leased views copied once), to release after."""
    return [
        (copy_out(f[0]), f[1]) if f is not None and in_place else f
        for f, in_place in zip(leased.blocks, leased.in_place, strict=True)
    ]


class InPlaceCalls:
    """The in-place RPC sequences of the blocking transport (kvcache_client.transport.GrpcTransport)."""

    def __init__(self, stub: pb_grpc.KVCacheStub, metadata: tuple[tuple[str, str], ...], link: ArenaLink) -> None:
        self._stub = stub
        self._md = metadata
        self.link = link
        self.handed_back = 0  # LeaseGet answers that came after their caller stopped waiting, released
        self._count_lock = threading.Lock()
        self._releasing: set[grpc.Future] = set()

    def lease(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, deadline: float
    ) -> tuple[list[Fetched | None], list[int], float]:
        """Views of the leased blocks RAM holds (None for the others), the lease ids to release, and
        the time.monotonic() by which the leases end at the latest (Leased.expires_at).

        Raises:
            grpc.RpcError: see arena_fallback.
            ArenaMoved: the server's arena cannot be mapped here any more.
        """
        sent = time.monotonic()
        reply = self._pinning_lease(
            pb.LeaseGetRequest(namespace=namespace, keys=keys, prefix_only=prefix_only), deadline
        )
        ids = lease_ids(reply)
        try:
            return self.link.leased_views(reply, len(keys)), ids, sent + reply.expires_in_s if ids else math.inf
        except BaseException:
            self.release(ids)
            raise

    def _pinning_lease(self, request: pb.LeaseGetRequest, deadline: float) -> pb.LeaseGetResponse:
        """LeaseGet run to its own end (the caller's deadline plus a cleanup's), waited for until the
        caller's deadline: when that passes first, the leases its answer grants are released as soon
        as it arrives (counted in `handed_back`), so no deadline, however short, leaves slots pinned.

        Raises:
            grpc.RpcError: the call's status, or DEADLINE_EXCEEDED when the deadline passed first.
        """
        future = self._stub.LeaseGet.future(request, timeout=_left(deadline) + _CLEANUP_S, metadata=self._md)
        try:
            return future.result(timeout=_left(deadline))
        except grpc.FutureTimeoutError:
            self._later(future)
            raise DeadlineBeforeAnswer("LeaseGet") from None
        except BaseException:  # KeyboardInterrupt and the like: the answer may still come
            if not future.done():
                self._later(future)
            raise

    def _later(self, future: grpc.Future) -> None:
        with self._count_lock:  # kept until it ends: gRPC cancels a call whose future is collected
            self._releasing.add(future)
        future.add_done_callback(self._release_late)

    def _release_late(self, future: grpc.Future) -> None:
        """Runs in a gRPC thread once a LeaseGet its caller stopped waiting for has ended."""
        self._released(future)
        if future.cancelled() or future.exception() is not None:
            return  # nothing was granted
        ids = lease_ids(future.result())
        if not ids:
            return
        # Non-blocking: a callback thread must not wait on another call. The future is kept until it
        # ends (gRPC cancels a call whose future is garbage-collected).
        release = self._stub.LeaseRelease.future(
            pb.LeaseReleaseRequest(leases=ids), timeout=_CLEANUP_S, metadata=self._md
        )
        with self._count_lock:
            self.handed_back += 1
            self._releasing.add(release)
        release.add_done_callback(self._released)

    def _released(self, future: grpc.Future) -> None:
        with self._count_lock:
            self._releasing.discard(future)

    def release(self, ids: list[int]) -> None:
        """Ends leases; a failure only logs (they expire on the server)."""
        if not ids:
            return
        try:
            self._stub.LeaseRelease(pb.LeaseReleaseRequest(leases=ids), timeout=_CLEANUP_S, metadata=self._md)
        except grpc.RpcError as exc:
            log.debug("releasing %d leases: %s (they expire on the server)", len(ids), exc.code())


_CLEANUP_S = 5.0
"""Deadline of a release: cleanup after the caller's call, whatever its deadline was."""


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def copy_out(view: memoryview) -> memoryview:
    """A read-only copy of a leased block in this process's own memory (valid after the release)."""
    out = np.empty(len(view), dtype=np.uint8)
    out[:] = np.frombuffer(view, dtype=np.uint8)
    return memoryview(out).toreadonly()


def copy_payload_into(block: memoryview, destination: object) -> None:
    """Copies a verified block's payload once into `destination`: a torch tensor (any device; a
    pinned host tensor or a GPU tensor takes the bytes in one copy) or a writable buffer (bytearray,
    numpy array, memoryview), whose size in bytes must be the payload's.

    Raises:
        ValueError: the destination's size is not the payload's, or a tensor is not contiguous.
        TypeError: the destination is neither a tensor nor a writable buffer.
    """
    payload = payload_view(block)  # blocks are served uncompressed: the payload is the raw bytes
    if type(destination).__module__.partition(".")[0] == "torch":  # torch only when given a tensor
        _copy_into_tensor(payload, destination)
        return
    try:
        target = memoryview(destination).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"cannot copy a block into {type(destination).__name__}") from None
    if target.readonly:
        raise TypeError("the destination buffer is read-only")
    if len(target) != len(payload):
        raise ValueError(f"destination holds {len(target)} bytes, the block's payload is {len(payload)}")
    target[:] = payload


def _copy_into_tensor(payload: memoryview, destination: object) -> None:
    import warnings

    import torch

    if not isinstance(destination, torch.Tensor):
        raise TypeError(f"cannot copy a block into {type(destination).__name__}")
    if not destination.is_contiguous():
        raise ValueError("a destination tensor must be contiguous")
    nbytes = destination.numel() * destination.element_size()
    if nbytes != len(payload):
        raise ValueError(f"destination holds {nbytes} bytes, the block's payload is {len(payload)}")
    if nbytes:
        with warnings.catch_warnings():  # read-only source: torch warns; it is only read here
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(payload, dtype=torch.uint8)
        destination.view(-1).view(torch.uint8).copy_(source)
