"""Several kvcache servers behind one client: the node's own server first, the others when it is down.

    from kvcache_client.targets import fleet_client

    # This node's sidecar first; two other nodes' servers if it does not answer.
    client = fleet_client(["127.0.0.1:51051", "10.0.0.6:51051", "10.0.0.7:51051"])

When it helps: servers that share their lower tiers (a Redis Cluster, S3: docs/deployment.md) serve
each other's blocks, so while the own server restarts or is overloaded, another one answers with the
same KV (from the shared tiers: slower than the own RAM tier, faster than recomputing). With a single
sidecar and nothing shared there is nothing to fail over to: use one target.

How it fails over: each call goes to the first target in the given order that is not cooling down.
A call that fails with UNAVAILABLE (refused, reset, the server stopping), or with DEADLINE_EXCEEDED while
the call's own deadline has time left (an attempt cut short, below), marks that target down for
`cooldown_s` and is sent to the next one within the same deadline. Any other status is the server's
answer and is raised as it is. When every target is cooling down they are all tried again in order, so a
fleet that comes back is found at once, and a call goes back to the own server as soon as its cooldown
has passed and it answers. Every kvcache call is idempotent (blocks are content addressed), so sending a
Put again to another server is safe. `Stats` describes whichever server answered.

Per-attempt deadlines: a server that is up but does not answer (stopped, swapping, wedged) refuses
nothing; only a deadline finds it. So every attempt but the last gets at most `attempt_timeout_s`
(DEFAULT_ATTEMPT_TIMEOUT_S, 5 s) and at most an equal share of what is left of the call's deadline
among the targets still to try (this one included); the last gets all that is left. With two targets,
a silent own server costs a 30 s transfer 5 s, a 5 s call 2.5 s and a 0.5 s Lookup 0.25 s, then the
other answers; it is tried first again once its cooldown is over (one such attempt per `cooldown_s`
while it stays silent). The price: a call that a healthy own server takes longer than its share for
(a large write-through Put to a slow tier) is sent again to the next server, and the own one cools
down. `attempt_timeout_s=None` gives every attempt all that is left of the deadline (a silent server
then fails the call; only a refusing one is failed over).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from kvcache_client.aio import AsyncKVCacheClient
from kvcache_client.arena import Leased
from kvcache_client.bufpool import BufferPool
from kvcache_client.bulk import AsyncBulkTransport, BulkLink, BulkTransport, bearer_token
from kvcache_client.client import DEFAULT_MAX_MESSAGE_BYTES, KVCacheClient
from kvcache_client.connection import TLSConfig, aio_channel_factory, auth_metadata, make_channel
from kvcache_client.errors import RPCError
from kvcache_client.results import Fetched, LookupResult, PrefetchResult, PutResult, ServerStats
from kvcache_client.retry import RetryPolicy
from kvcache_client.transport import AsyncGrpcTransport, AsyncTransport, GrpcTransport, Transport
from kvcache_core.blockwire import BlockData

T = TypeVar("T")

__all__ = [
    "DEFAULT_ATTEMPT_TIMEOUT_S",
    "AsyncFailoverTransport",
    "FailoverTransport",
    "async_fleet_client",
    "fleet_client",
    "split_targets",
]

DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
"""The most of a call's deadline one target gets while others remain: a sixth of a transfer's deadline
(the vLLM connector's 30 s), and well above what a healthy server takes for a call (its own admission
wait, limits.admission_wait_s, is 1 s); a busy 2-core test machine took 2 to 4 s for a first 6 MiB
write-through Put, which a 2 s bound sent to the other server."""


def split_targets(targets: str | Sequence[str]) -> list[str]:
    """ "a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"] (order kept, blanks dropped).

    Raises:
        ValueError: no target, or one named twice.
    """
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t.strip()]
    if not out:
        raise ValueError("no server target given")
    if len(set(out)) != len(out):
        raise ValueError(f"a server target is named twice in {out}")
    return out


def _code(exc: BaseException) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)
    return code() if callable(code) else code


class _Rotation:
    """Which target to try next, and which are cooling down after a failure. Thread-safe."""

    def __init__(self, names: Sequence[str], cooldown_s: float, attempt_timeout_s: float | None) -> None:
        if cooldown_s < 0:
            raise ValueError("cooldown_s must be >= 0")
        if attempt_timeout_s is not None and not attempt_timeout_s > 0:
            raise ValueError("attempt_timeout_s must be positive, or None for the call's whole deadline")
        self.names = list(names)
        self._cooldown_s = cooldown_s
        self._attempt_s = attempt_timeout_s
        self._down_until = [0.0] * len(names)
        self._lock = threading.Lock()
        self.failovers = 0
        """Attempts that moved on to the next target."""
        self.last_target = self.names[0]
        """The target that answered the latest call."""

    def order(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            up = [i for i, t in enumerate(self._down_until) if t <= now]
            down = sorted((i for i, t in enumerate(self._down_until) if t > now), key=lambda i: self._down_until[i])
        return up + down

    def attempt_s(self, remaining_s: float, left: int) -> float:
        """The deadline of an attempt with `left` targets still to try, itself included (module docstring)."""
        if left <= 1 or self._attempt_s is None:
            return remaining_s
        return min(remaining_s / left, self._attempt_s)

    def failed_over(self, index: int, exc: BaseException, deadline: float) -> bool:
        """Whether `exc` from target `index` sends the call on to the next target (and marks it down)."""
        code = _code(exc)
        if code is grpc.StatusCode.UNAVAILABLE or (
            code is grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() < deadline
        ):
            with self._lock:
                self._down_until[index] = time.monotonic() + self._cooldown_s
                self.failovers += 1
            return True
        return False

    def answered(self, index: int) -> None:
        with self._lock:
            self._down_until[index] = 0.0
            self.last_target = self.names[index]


class FailoverTransport:
    """A Transport over several servers' transports, first one first (see the module's docstring)."""

    def __init__(
        self,
        transports: Sequence[Transport],
        names: Sequence[str],
        *,
        cooldown_s: float = 2.0,
        attempt_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S,
    ) -> None:
        """
        Args:
            transports: One per server, in the order of preference (the node's own server first).
            names: The servers' targets, for logs and `last_target`.
            cooldown_s: How long a server that failed is tried only after the others.
            attempt_timeout_s: At most this much of a call's deadline, and at most an equal share of what
                is left among the targets still to try, goes to one server before the next is tried (the
                last one gets what is left); None: the whole deadline (a hung server is then not failed
                over within the call, only a refusing one).

        Raises:
            ValueError: no transport, names that do not match, or a bad cooldown or attempt timeout.
        """
        if not transports or len(transports) != len(names):
            raise ValueError("FailoverTransport needs one name per transport, and at least one")
        self._transports = list(transports)
        self.rotation = _Rotation(names, cooldown_s, attempt_timeout_s)
        self._lock = threading.Lock()
        self._lease_owner: dict[int, Transport] = {}  # open lease id -> the transport to release it through

    def _each(self, timeout_s: float, fn: Callable[[Transport, float], T]) -> T:
        deadline = time.monotonic() + timeout_s
        order = self.rotation.order()
        for n, i in enumerate(order):
            remaining = deadline - time.monotonic()
            left = 1 if remaining <= 0 else len(order) - n
            try:
                result = fn(self._transports[i], self.rotation.attempt_s(max(remaining, 0.001), left))
            except (grpc.RpcError, RPCError) as exc:
                if left == 1 or not self.rotation.failed_over(i, exc, deadline):
                    raise
                continue
            self.rotation.answered(i)
            return result
        raise AssertionError("unreachable: the last target raises or returns")

    def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return self._each(timeout_s, lambda t, s: t.lookup(namespace, keys, s))

    def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        if retain_ttl_s:
            return self._each(timeout_s, lambda t, s: t.put(namespace, items, s, retain_ttl_s=retain_ttl_s))  # type: ignore[call-arg]
        return self._each(timeout_s, lambda t, s: t.put(namespace, items, s))

    def get(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> list[Fetched | None]:
        return self._each(timeout_s, lambda t, s: t.get(namespace, keys, prefix_only, s))

    def lease(self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float) -> Leased:
        """In-place reads (KVCacheClient.leased) from whichever server answers: its arena where this
        host shares it, else a get; release() hands the leases back to that server."""

        def one(t: Transport, s: float) -> tuple[Leased, Transport]:
            lease = getattr(t, "lease", None)
            return (
                Leased(t.get(namespace, keys, prefix_only, s))
                if lease is None
                else lease(namespace, keys, prefix_only, s)
            ), t

        leased, owner = self._each(timeout_s, one)
        with self._lock:
            self._lease_owner.update(dict.fromkeys(leased.ids, owner))
        return leased

    def release(self, ids: list[int]) -> None:
        by_owner: dict[int, tuple[Transport, list[int]]] = {}
        with self._lock:
            for lease_id in ids:
                owner = self._lease_owner.pop(lease_id, None)
                if owner is not None:
                    by_owner.setdefault(id(owner), (owner, []))[1].append(lease_id)
        for owner, owned in by_owner.values():
            owner.release(owned)  # type: ignore[attr-defined]

    def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return self._each(timeout_s, lambda t, s: t.delete(namespace, keys, s))

    def stats(self, timeout_s: float) -> ServerStats:
        return self._each(timeout_s, lambda t, s: t.stats(s))

    def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        return self._each(timeout_s, lambda t, s: t.prefetch(namespace, keys, s))  # type: ignore[attr-defined]

    def close(self) -> None:
        for t in self._transports:
            t.close()


class AsyncFailoverTransport:
    """FailoverTransport for AsyncKVCacheClient; each server's transport is made on first use, in the loop."""

    def __init__(
        self,
        factories: Sequence[Callable[[], AsyncTransport]],
        names: Sequence[str],
        *,
        cooldown_s: float = 2.0,
        attempt_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S,
    ) -> None:
        """See FailoverTransport; `factories` make the servers' transports (grpc.aio channels bind to the
        loop running when they are made)."""
        if not factories or len(factories) != len(names):
            raise ValueError("AsyncFailoverTransport needs one name per transport factory, and at least one")
        self._factories = list(factories)
        self._transports: list[AsyncTransport | None] = [None] * len(factories)
        self.rotation = _Rotation(names, cooldown_s, attempt_timeout_s)

    def _transport(self, i: int) -> AsyncTransport:
        t = self._transports[i]
        if t is None:
            t = self._transports[i] = self._factories[i]()
        return t

    async def _each(self, timeout_s: float, fn: Callable[[AsyncTransport, float], Awaitable[T]]) -> T:
        deadline = time.monotonic() + timeout_s
        order = self.rotation.order()
        for n, i in enumerate(order):
            remaining = deadline - time.monotonic()
            left = 1 if remaining <= 0 else len(order) - n
            try:
                result = await fn(self._transport(i), self.rotation.attempt_s(max(remaining, 0.001), left))
            except (grpc.RpcError, RPCError) as exc:
                if left == 1 or not self.rotation.failed_over(i, exc, deadline):
                    raise
                continue
            self.rotation.answered(i)
            return result
        raise AssertionError("unreachable: the last target raises or returns")

    async def lookup(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> LookupResult:
        return await self._each(timeout_s, lambda t, s: t.lookup(namespace, keys, s))

    async def put(
        self, namespace: str, items: Sequence[tuple[bytes, BlockData]], timeout_s: float, *, retain_ttl_s: float = 0.0
    ) -> PutResult:
        if retain_ttl_s:
            return await self._each(timeout_s, lambda t, s: t.put(namespace, items, s, retain_ttl_s=retain_ttl_s))  # type: ignore[call-arg]
        return await self._each(timeout_s, lambda t, s: t.put(namespace, items, s))

    async def get(
        self, namespace: str, keys: Sequence[bytes], prefix_only: bool, timeout_s: float
    ) -> list[Fetched | None]:
        return await self._each(timeout_s, lambda t, s: t.get(namespace, keys, prefix_only, s))

    async def delete(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> int:
        return await self._each(timeout_s, lambda t, s: t.delete(namespace, keys, s))

    async def stats(self, timeout_s: float) -> ServerStats:
        return await self._each(timeout_s, lambda t, s: t.stats(s))

    async def prefetch(self, namespace: str, keys: Sequence[bytes], timeout_s: float) -> PrefetchResult:
        return await self._each(timeout_s, lambda t, s: t.prefetch(namespace, keys, s))  # type: ignore[attr-defined]

    async def close(self) -> None:
        made = [t for t in self._transports if t is not None]
        await asyncio.gather(*(t.close() for t in made))


def target_transports(
    names: Sequence[str],
    *,
    token: str | None,
    tls: TLSConfig | bool,
    shm: bool,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    channel_options: Sequence[tuple[str, int | str]] = (),
) -> list[Transport]:
    """One blocking transport per server target, in order: block bytes through its arena on this
    host, over its bulk port elsewhere (docs/bulk.md), else gRPC."""
    metadata = auth_metadata(token)
    buffers = BufferPool()  # one cap for all targets' gets (kvcache_client.bufpool)
    return [
        BulkTransport(
            GrpcTransport(
                make_channel(t, tls=tls, max_message_bytes=max_message_bytes, extra_options=channel_options),
                metadata=metadata,
                shm=shm,
                buffers=buffers,
            ),
            BulkLink(t, token=bearer_token(token), tls=tls, buffers=buffers),
        )
        for t in names
    ]


def fleet_client(
    targets: str | Sequence[str],
    *,
    timeout_s: float = 30.0,
    retry: RetryPolicy | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: str | None = None,
    tls: TLSConfig | bool = False,
    shm: bool = True,
    cooldown_s: float = 2.0,
    attempt_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S,
) -> KVCacheClient:
    """A KVCacheClient that fails over between `targets`, the first (the node's own server) first.

    Arguments are KVCacheClient's and FailoverTransport's. Shared memory is used with whichever target
    is on this host and shares its shm directory (docs/shm.md), gRPC with the others.

    Raises:
        ValueError: no target, one named twice, or a bad argument (as KVCacheClient's).
        OSError: a file of `tls` cannot be read.
    """
    names = split_targets(targets)
    transports = target_transports(names, token=token, tls=tls, shm=shm, max_message_bytes=max_message_bytes)
    transport = FailoverTransport(transports, names, cooldown_s=cooldown_s, attempt_timeout_s=attempt_timeout_s)
    return KVCacheClient(",".join(names), timeout_s=timeout_s, retry=retry, transport=transport)


def async_fleet_client(
    targets: str | Sequence[str],
    *,
    timeout_s: float = 30.0,
    retry: RetryPolicy | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    token: str | None = None,
    tls: TLSConfig | bool = False,
    shm: bool = True,
    cooldown_s: float = 2.0,
    attempt_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S,
) -> AsyncKVCacheClient:
    """fleet_client's AsyncKVCacheClient; like it, it needs no running event loop to be made.

    Raises:
        ValueError, OSError: as fleet_client.
    """
    names = split_targets(targets)
    metadata = auth_metadata(token)
    buffers = BufferPool()  # one cap for all targets' gets, as fleet_client's

    def factory(target: str) -> Callable[[], AsyncTransport]:
        channel = aio_channel_factory(target, tls=tls, max_message_bytes=max_message_bytes)
        return lambda: AsyncBulkTransport(
            AsyncGrpcTransport(channel(), metadata=metadata, shm=shm, buffers=buffers),
            BulkLink(target, token=bearer_token(token), tls=tls, buffers=buffers),
        )

    transport = AsyncFailoverTransport(
        [factory(t) for t in names], names, cooldown_s=cooldown_s, attempt_timeout_s=attempt_timeout_s
    )
    return AsyncKVCacheClient(",".join(names), timeout_s=timeout_s, retry=retry, transport=transport)
