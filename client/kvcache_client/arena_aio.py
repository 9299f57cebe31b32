"""The asyncio client's in-place calls through the server's block arena (docs/arena.md): the
counterpart of kvcache_client.arena.InPlaceCalls, whose pure logic (requests, leased views,
fallbacks) it shares.

What asyncio adds is cancellation: a task may stop waiting at any await, and a deadline of a few
milliseconds may pass while the server is still answering. Neither may leave arena space pinned:

- LeaseGet pins slots on the server the moment it answers, and an answer lost to a cancellation or
  a passed deadline names slots nobody would hand back until they expire. So it runs as a task of
  its own, to its own end (the caller's deadline plus a cleanup's): the caller waits for it until
  its deadline, and when it stops waiting first, whatever the answer pinned is released as soon as
  it arrives.
- Releases are tasks of their own too, each with its own short deadline: a caller waits for them
  (so counters are exact once a call returns), but a cancellation of the caller does not stop
  them. close() waits for those still running.
- A leased view is only handed out once its block passed its key-bound checksum (the client
  verifies). Puts do not go through the arena (kvcache_client.arena).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from kvcache_client.arena import (
    _CLEANUP_S,
    ArenaLink,
    _left,
    lease_ids,
)
from kvcache_client.results import Fetched
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")


def deadline_error(what: str) -> grpc.aio.AioRpcError:
    """The DEADLINE_EXCEEDED a call raises when its deadline passed while the server still answered."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"deadline passed before {what} answered (what it pins is handed back when it does)",
    )


class AsyncInPlaceCalls:
    """The in-place RPC sequences of the asyncio transport (kvcache_client.transport.AsyncGrpcTransport)."""

    def __init__(
        self,
        stub: pb_grpc.KVCacheStub,
        metadata: tuple[tuple[str, str], ...],
        link: ArenaLink,
        offload_bytes: int,
    ) -> None:
        self._stub = stub
        self._md = metadata
        self.link = link
        self._offload_bytes = offload_bytes
        self._tasks: set[asyncio.Future[Any]] = set()  # pinning calls and cleanups still running
        self.handed_back = 0
        """LeaseGet answers that came after their caller stopped waiting (cancelled, or past its
        deadline): their leases were released at once."""

    def _track(self, task: asyncio.Future[R]) -> asyncio.Future[R]:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        return self._track(asyncio.ensure_future(coro))

    async def _pinning(
        self,
        call: Callable[[float], Awaitable[R]],
        deadline: float,
        what: str,
        undo: Callable[[R], Coroutine[Any, Any, None]],
    ) -> R:
        """Runs call(timeout) to its end, waiting for it until `deadline`; when the caller stops
        waiting first (cancelled, or the deadline passed), undo(answer) hands back what it pinned.

        Raises:
            grpc.RpcError: the call's status, or DEADLINE_EXCEEDED when the deadline passed first.
        """

        async def run() -> R:
            return await call(_left(deadline) + _CLEANUP_S)

        task = asyncio.ensure_future(run())
        handed = False
        try:
            await asyncio.wait({task}, timeout=_left(deadline))
            if not task.done():
                raise deadline_error(what)
            handed = True
            return task.result()
        finally:
            if not handed:
                self._track(task).add_done_callback(lambda t: self._undo_when_done(t, undo))

    def _undo_when_done(self, task: asyncio.Future[R], undo: Callable[[R], Coroutine[Any, Any, None]]) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # nothing was pinned, or the server frees it (leases expire)
        self.handed_back += 1
        self._spawn(undo(task.result()))

    async def _cleanup(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs a cleanup to its end; a cancellation of the caller does not stop it."""
        await asyncio.shield(self._spawn(coro))

    async def _follow(self, path: str) -> None:
        """Maps a restarted server's new arena (populating it) off the event loop; see ArenaLink.follow."""
        if path != self.link.path:
            await asyncio.to_thread(self.link.follow, path)

    async def lease(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, deadline: float
    ) -> tuple[list[Fetched | None], list[int], float]:
        """Views of the leased blocks RAM holds (None for the others), the lease ids to release, and
        the time.monotonic() by which the leases end at the latest (Leased.expires_at).

        Raises:
            grpc.RpcError: see arena.arena_fallback.
            ArenaMoved: the server's arena cannot be mapped here any more.
        """
        request = pb.LeaseGetRequest(namespace=namespace, keys=keys, prefix_only=prefix_only)
        sent = time.monotonic()
        reply = await self._pinning(
            lambda t: self._stub.LeaseGet(request, timeout=t, metadata=self._md),
            deadline,
            "LeaseGet",
            lambda r: self._release(lease_ids(r)),
        )
        ids = lease_ids(reply)
        try:
            await self._follow(reply.arena_path)
            return self.link.leased_views(reply, len(keys)), ids, sent + reply.expires_in_s if ids else math.inf
        except BaseException:
            await self.release(ids)
            raise

    async def release(self, ids: list[int]) -> None:
        """Ends leases, even when the caller is cancelled meanwhile; a failure only logs (they
        expire on the server)."""
        if ids:
            await self._cleanup(self._release(ids))

    async def _release(self, ids: list[int]) -> None:
        if not ids:
            return
        try:
            await self._stub.LeaseRelease(pb.LeaseReleaseRequest(leases=ids), timeout=_CLEANUP_S, metadata=self._md)
        except grpc.RpcError as exc:
            log.debug("releasing %d leases: %s (they expire on the server)", len(ids), exc.code())

    async def drain(self) -> None:
        """Waits for the pinning calls and cleanups still running (each has its own deadline)."""
        while self._tasks:  # a pinning call's end may spawn its cleanup: until none is left
            await asyncio.wait(set(self._tasks))
