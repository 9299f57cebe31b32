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
  (KVCacheClient.leased) or copies them once into the caller's destination (get_into), and
  releases; get_many copies them once into memory of its own (a buffer of kvcache_client.bufpool),
  releases, and verifies them there, where they lie after the copy. Keys RAM does not hold are
  fetched with Get.

The arena is mapped read-only (the file is 0400: an open for writing fails), so nothing this client
does can change a block in it. A restarted server has a new arena file, possibly of another size;
every answer names its arena, and the SDK maps the new one, at its own size, when it changes. When the arena
cannot be used for a get (another host or user, an older server, a server that does not share it) the
get goes the other way (per-call segments, then inline gRPC), counted in `ArenaLink.fallbacks`.

This module holds the mapping (ArenaLink), what a caller is handed (LeasedBlocks, copy_payload_into)
and the blocking face of the in-place reads (InPlaceCalls); their steps (requests, answers,
fallbacks, lease hand-back) are kvcache_client.inplace_core's, shared with the asyncio face
(kvcache_client.arena_aio).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import grpc

from kvcache_client import inplace_core as core
from kvcache_client.bufpool import BufferPool
from kvcache_client.bulkconn import BulkConnection, BulkPool, BulkUnreachable
from kvcache_client.inplace_core import ArenaMoved, DeadlineBeforeAnswer, LeaseBook, Leased
from kvcache_client.results import Fetched
from kvcache_client.steps import run
from kvcache_core.format import payload_view
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

__all__ = [
    "MIN_PUT_BYTES", "ArenaLink", "ArenaMoved", "InPlaceCalls", "Leased", "LeasedBlocks", "copy_payload_into",
]  # fmt: skip

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


class InPlaceCalls:
    """The blocking face of the in-place reads (kvcache_client.inplace_core has the steps, written
    once for both clients), behind kvcache_client.transport.GrpcTransport. Thread-safe.

    Its I/O: LeaseGet as a grpc future waited for until the caller's deadline; a LeaseGet its caller
    stopped waiting for is abandoned to `book`, which hands its leases back from a gRPC callback
    thread with a non-blocking LeaseRelease. Other releases are futures kept by `book` too, which
    the caller waits for (counters are exact once a call returns) but an interrupt of the caller
    does not stop.
    """

    def __init__(
        self,
        stub: pb_grpc.KVCacheStub,
        metadata: tuple[tuple[str, str], ...],
        link: ArenaLink,
        fetch: Callable[[str, Sequence[bytes], bool, float], list[Fetched | None]],
        buffers: BufferPool,
    ) -> None:
        self._stub = stub
        self._md = metadata
        self.link = link
        self._fetch = fetch
        self.buffers = buffers  # where get copies leased blocks out to
        self.book = LeaseBook()
        # The bulk port's pool where LEASE and RELEASE go (kvcache_client.bulk.BulkTransport sets
        # it): one socket round trip each, not a gRPC call (about 1 ms in Python); None: gRPC.
        self.bulk: Callable[[float], BulkPool | None] | None = None
        self.bulk_down: Callable[[str], None] = lambda reason: None

    @property
    def handed_back(self) -> int:
        """LeaseGet answers that came after their caller stopped waiting, whose leases were released."""
        return self.book.handed_back

    def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """inplace_core.lease: release(leased.ids) once the views are no longer used."""
        return run(core.lease(self.link, namespace, keys, prefix_only, timeout_s), self)

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        """inplace_core.get: blocks in this client's own memory, the leases already handed back."""
        return run(core.get(self.link, namespace, keys, prefix_only, timeout_s), self)

    def release(self, ids: list[int]) -> None:
        """Ends leases; a failure only logs (they expire on the server)."""
        self.hand_back(ids)

    # -- inplace_core.InPlaceIO, blocking ------------------------------------------------------------

    def lease_get(self, request: pb.LeaseGetRequest, deadline: float) -> pb.LeaseGetResponse:
        pool = self.bulk(core.left(deadline)) if self.bulk is not None else None
        if pool is not None:
            with core.bulk_answered("LEASE", self.bulk_down):  # the port failed: on to LeaseGet
                return self._lease_over_bulk(pool, request, deadline)
        future = self._stub.LeaseGet.future(request, timeout=core.pinning_timeout_s(deadline), metadata=self._md)
        taken = False
        try:
            answer: pb.LeaseGetResponse = future.result(timeout=core.left(deadline))
            taken = True
            return answer
        except grpc.FutureTimeoutError:
            raise DeadlineBeforeAnswer("LeaseGet") from None
        finally:
            if not taken:  # the deadline, KeyboardInterrupt and the like: the answer may still come
                self.book.abandon(future, self._hand_back_later)

    def _lease_over_bulk(self, pool: BulkPool, request: pb.LeaseGetRequest, deadline: float) -> pb.LeaseGetResponse:
        """LeaseGet as a LEASE frame. A caller that stops waiting for the answer (its deadline, an
        interrupt) hands the connection to a thread of its own, which reads the answer when it
        comes (CLEANUP_S at most), ends what it leased, and closes the connection."""

        def leased(conn: BulkConnection) -> tuple[float, str, list[tuple[int, int, int]]]:
            conn.send_lease(request.namespace, list(request.keys), request.prefix_only, deadline)
            try:
                return conn.read_leased(deadline)
            except BulkUnreachable:
                raise
            except BaseException:
                conn.handed_off = True
                self._rescue(pool, conn)
                raise

        return lease_response(*pool.run(leased, deadline))

    def _rescue(self, pool: BulkPool, conn: BulkConnection) -> None:
        done: Future[None] = Future()
        self.book.keep(done)

        def settle() -> None:
            try:
                _, _, slots = conn.read_leased(time.monotonic() + core.CLEANUP_S)
                ids = sorted({i for i, _, n in slots if n})
                if ids:
                    self.book.count_handed_back()
                    conn.release(ids, time.monotonic() + core.CLEANUP_S)
            except BaseException as exc:  # any failure: the leases expire on the server
                log.debug("a LEASE nobody waits for: %s (its leases expire on the server)", exc)
            finally:
                conn.close()  # not back to the pool: the caller's BulkPool.run may still look at it
                done.set_result(None)

        threading.Thread(target=settle, name="kvcache-lease-settle", daemon=True).start()

    def _hand_back_later(self, ids: list[int]) -> None:
        """Runs in a gRPC thread once an abandoned LeaseGet ended: must not wait on another call."""
        request = pb.LeaseReleaseRequest(leases=ids)
        try:
            self.book.keep(self._stub.LeaseRelease.future(request, timeout=core.CLEANUP_S, metadata=self._md))
        except ValueError:  # the channel was closed meanwhile (close() from another thread)
            log.debug("handing back %d leases: the channel is closed (they expire on the server)", len(ids))

    def drain(self, timeout_s: float = 2 * core.CLEANUP_S) -> None:
        """Waits for the abandoned calls and releases still running (each has its own deadline)."""
        if not self.book.wait_idle(timeout_s):
            log.debug("in-place calls still running after %.1fs: their leases expire on the server", timeout_s)

    def follow(self, path: str) -> None:
        self.link.follow(path)

    def hand_back(self, ids: list[int]) -> None:
        run(core.releasing(ids), self)

    def send_release(self, request: pb.LeaseReleaseRequest) -> pb.LeaseReleaseResponse:
        pool = self.bulk(core.CLEANUP_S) if self.bulk is not None else None
        if pool is not None:
            # A RELEASE frame, answered: sent whole, it ends the leases even if its caller stops
            # waiting (the connection is then closed; the server reads what was sent first).
            deadline = time.monotonic() + core.CLEANUP_S
            ids = list(request.leases)
            with core.bulk_answered("RELEASE", self.bulk_down):
                return pb.LeaseReleaseResponse(released=pool.run(lambda conn: conn.release(ids, deadline), deadline))
        # A call of its own, kept by the book: a caller interrupted while it waits (KeyboardInterrupt)
        # stops waiting, not the release (the asyncio face shields its release task alike).
        future = self._stub.LeaseRelease.future(request, timeout=core.CLEANUP_S, metadata=self._md)
        self.book.keep(future)
        response: pb.LeaseReleaseResponse = future.result()
        return response

    def fetch(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        return self._fetch(namespace, keys, prefix_only, timeout_s)

    def copy_out(self, leased: Leased) -> list[Fetched | None]:
        return core.copied_out(leased, self.buffers)


def lease_response(expires_in_s: float, path: str, slots: list[tuple[int, int, int]]) -> pb.LeaseGetResponse:
    """A LEASED frame's answer (BulkConnection.read_leased) as the LeaseGet answer it stands for."""
    return pb.LeaseGetResponse(
        leases=[pb.ArenaSlot(id=i, offset=o, length=n) for i, o, n in slots],
        expires_in_s=expires_in_s,
        arena_path=path,
    )


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
