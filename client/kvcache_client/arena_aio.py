"""The asyncio face of the in-place reads through the server's block arena (docs/arena.md): the
counterpart of kvcache_client.arena.InPlaceCalls; both drive the same steps
(kvcache_client.inplace_core), and only their I/O differs.

What asyncio adds is cancellation: a task may stop waiting at any await, and a deadline of a few
milliseconds may pass while the server is still answering. Neither may leave arena space pinned:

- LeaseGet pins slots on the server the moment it answers, and an answer lost to a cancellation or
  a passed deadline names slots nobody would hand back until they expire. So it runs as a task of
  its own, to its own end (the caller's deadline plus a cleanup's): the caller waits for it until
  its deadline, and when it stops waiting first, the task is abandoned to the face's LeaseBook,
  which releases whatever the answer pinned as soon as it arrives.
- Releases are tasks of their own too, each with its own short deadline: a caller waits for them
  (so counters are exact once a call returns), but a cancellation of the caller does not stop
  them. close() waits for those still running (drain).
- Mapping a restarted server's arena, and copying many leased bytes out, run in worker threads.
- Where the server has a bulk port (kvcache_client.bulk.AsyncBulkTransport sets `bulk`), LeaseGet
  and LeaseRelease are LEASE and RELEASE frames, their socket work in a worker thread that waits
  for the answer to the pinning call's own end (the caller's deadline plus a cleanup's), as the
  gRPC call's task does: abandoned, the book releases what its answer leased.
- A leased view is only handed out once its block passed its key-bound checksum (the client
  verifies). Puts do not go through the arena (kvcache_client.arena).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvcache_client import inplace_core as core
from kvcache_client.arena import ArenaLink, lease_response
from kvcache_client.bufpool import BufferPool
from kvcache_client.bulkconn import BulkConnection, BulkPool
from kvcache_client.inplace_core import DeadlineBeforeAnswer, LeaseBook, Leased
from kvcache_client.results import Fetched
from kvcache_client.shm import run_to_end
from kvcache_client.steps import arun
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

T = TypeVar("T")

_LEASE_THREADS = 8
"""Worker threads for the bulk port's LEASE and RELEASE exchanges of one asyncio client: more calls
at once wait for one (their deadlines run meanwhile)."""


class AsyncInPlaceCalls:
    """The in-place reads of the asyncio transport (kvcache_client.transport.AsyncGrpcTransport)."""

    def __init__(
        self,
        stub: pb_grpc.KVCacheStub,
        metadata: tuple[tuple[str, str], ...],
        link: ArenaLink,
        fetch: Callable[[str, Sequence[bytes], bool, float], Awaitable[list[Fetched | None]]],
        offload_bytes: int,
        buffers: BufferPool,
    ) -> None:
        self._stub = stub
        self._md = metadata
        self.link = link
        self._fetch = fetch
        self._offload_bytes = offload_bytes
        self.buffers = buffers  # where get copies leased blocks out to
        self.book = LeaseBook()  # also keeps the releases still running, for drain()
        # The bulk port's pool where LEASE and RELEASE go (kvcache_client.bulk.AsyncBulkTransport
        # sets it): one socket round trip each in a worker thread, not a gRPC call; None: gRPC.
        self.bulk: Callable[[float], Awaitable[BulkPool | None]] | None = None
        self.bulk_down: Callable[[str], None] = lambda reason: None
        # Threads of their own for LEASE and RELEASE: a LEASE nobody waits for keeps its thread up to
        # its caller's deadline plus CLEANUP_S (a hung server), which must not take the event loop's
        # default executor from the process's other to_thread work (bulk gets to other servers).
        self._threads: ThreadPoolExecutor | None = None

    @property
    def handed_back(self) -> int:
        """LeaseGet answers that came after their caller stopped waiting (cancelled, or past its
        deadline), whose leases were released at once."""
        return self.book.handed_back

    async def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """inplace_core.lease: release(leased.ids) once the views are no longer used. A call
        cancelled or past its deadline leaves no lease behind."""
        return await arun(core.lease(self.link, namespace, keys, prefix_only, timeout_s), self)

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        """inplace_core.get: blocks in this client's own memory, the leases already handed back."""
        return await arun(core.get(self.link, namespace, keys, prefix_only, timeout_s), self)

    async def release(self, ids: list[int]) -> None:
        """Ends leases, even when the caller is cancelled meanwhile; a failure only logs (they
        expire on the server)."""
        await self.hand_back(ids)

    async def drain(self) -> None:
        """Waits for the pinning calls and cleanups still running (each has its own deadline)."""
        while pending := self.book.pending:  # a pinning call's end may start its hand-back: until none is left
            await asyncio.wait(pending)  # type: ignore[type-var]
        if self._threads is not None:
            self._threads.shutdown(wait=False)  # idle now; a later call starts new ones
            self._threads = None

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self.book.keep(task)
        return task

    # -- inplace_core.InPlaceIO, asyncio -----------------------------------------------------------

    async def _bulk_pool(self, timeout_s: float) -> BulkPool | None:
        return await self.bulk(timeout_s) if self.bulk is not None else None

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=_LEASE_THREADS, thread_name_prefix="kvcache-aio-lease")
        return asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def lease_get(self, request: pb.LeaseGetRequest, deadline: float) -> pb.LeaseGetResponse:
        pool = await self._bulk_pool(core.left(deadline))
        via = ["LeaseGet" if pool is None else "LEASE"]  # what the caller stopped waiting for, if it does

        async def call() -> pb.LeaseGetResponse:
            if pool is not None:
                end = time.monotonic() + core.pinning_timeout_s(deadline)  # the task runs to its own end

                def leased(conn: BulkConnection) -> tuple[float, str, list[tuple[int, int, int]]]:
                    conn.send_lease(request.namespace, list(request.keys), request.prefix_only, end)
                    return conn.read_leased(end)

                with core.bulk_answered("LEASE", self.bulk_down):  # the port failed: on to LeaseGet
                    return lease_response(*await self._in_thread(pool.run, leased, end))
                via[0] = "LeaseGet"
            answer: pb.LeaseGetResponse = await self._stub.LeaseGet(
                request, timeout=core.pinning_timeout_s(deadline), metadata=self._md
            )
            return answer

        task = asyncio.ensure_future(call())
        taken = False
        try:
            await asyncio.wait({task}, timeout=core.left(deadline))
            if not task.done():
                raise DeadlineBeforeAnswer(via[0])
            taken = True
            return task.result()
        finally:
            if not taken:  # the deadline, or the caller was cancelled: the answer may still come
                self.book.abandon(task, lambda ids: self._spawn(arun(core.releasing(ids), self)))

    async def follow(self, path: str) -> None:
        if path != self.link.path:  # mapping (populating) a new arena: off the event loop
            await asyncio.to_thread(self.link.follow, path)

    async def hand_back(self, ids: list[int]) -> None:
        if ids:
            await asyncio.shield(self._spawn(arun(core.releasing(ids), self)))

    async def send_release(self, request: pb.LeaseReleaseRequest) -> pb.LeaseReleaseResponse:
        pool = await self._bulk_pool(core.CLEANUP_S)
        if pool is not None:
            end = time.monotonic() + core.CLEANUP_S
            ids = list(request.leases)
            with core.bulk_answered("RELEASE", self.bulk_down):
                released = await self._in_thread(pool.run, lambda conn: conn.release(ids, end), end)
                return pb.LeaseReleaseResponse(released=released)
        response: pb.LeaseReleaseResponse = await self._stub.LeaseRelease(
            request, timeout=core.CLEANUP_S, metadata=self._md
        )
        return response

    async def fetch(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        return await self._fetch(namespace, keys, prefix_only, timeout_s)

    async def copy_out(self, leased: Leased) -> list[Fetched | None]:
        if core.in_place_bytes(leased) >= self._offload_bytes:  # waited for even when cancelled
            return await run_to_end(lambda _: core.copied_out(leased, self.buffers))
        return core.copied_out(leased, self.buffers)
