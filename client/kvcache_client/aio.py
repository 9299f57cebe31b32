"""AsyncKVCacheClient: the asyncio SDK, the same API as KVCacheClient with `await`.

It may be built anywhere (module level, outside any loop); its grpc.aio channel is made on first use,
inside the running loop, and the client then belongs to that loop: a use from another loop raises
RuntimeError. Deadlines, retries and errors are KVCacheClient's (see its docstrings).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvcache_client import keys as _keys
from kvcache_client.bufpool import DEFAULT_POOL_BYTES, BufferPool
from kvcache_client.bulk import DEFAULT_CONNECTIONS, AsyncBulkTransport, BulkLink, bearer_token
from kvcache_client.calls import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    Calls,
    NamespaceLike,
    call_timeout_s,
)
from kvcache_client.connection import TLSConfig, aio_channel_factory, auth_metadata, describe
from kvcache_client.copies import block_bytes, check_destinations, copied, land_into, payload_sinks
from kvcache_client.presence import PresenceLink
from kvcache_client.results import PrefetchResult
from kvcache_client.retry import RetryPolicy
from kvcache_client.shm import run_to_end
from kvcache_client.steps import Steps, arun
from kvcache_client.transport import (
    OFFLOAD_BYTES,
    AsyncGrpcTransport,
    AsyncTransport,
    LookupResult,
    PutResult,
    ServerStats,
)
from kvcache_core.blockwire import BlockData, Buffer
from kvcache_core.format import Layout

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class _AsyncIO:
    """The asyncio face's I/O for kvcache_client.calls: each operation is awaited, on the transport
    bound to the running loop."""

    def __init__(self, bound: Callable[[], AsyncTransport]) -> None:
        self._bound = bound

    async def request(self, fn: Callable[[AsyncTransport, float], Awaitable[T]], timeout_s: float) -> T:
        return await fn(self._bound(), timeout_s)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def transport(self) -> AsyncTransport:
        return self._bound()


class AsyncKVCacheClient:
    """An asyncio client of one kvcache server, bound to the event loop it is first used in.

    Each call's Raises section says what it can raise. In short: ValueError for bad arguments (nothing
    is sent); RuntimeError for a use from another event loop; the server's statuses as
    kvcache_client.errors types (RPCError subclasses); Unavailable once UNAVAILABLE was retried until
    the deadline; DeadlineExceeded when the deadline passed. A miss is never an exception.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        tls: TLSConfig | bool = False,
        shm: bool = True,
        bulk: bool = True,
        bulk_connections: int = DEFAULT_CONNECTIONS,
        buffer_pool_bytes: int = DEFAULT_POOL_BYTES,
        transport: AsyncTransport | None = None,
        presence_index: bool = True,
    ) -> None:
        """See KVCacheClient.__init__. Needs no event loop: the grpc.aio channel is made on first use.

        Raises:
            ValueError: `timeout_s` is not positive, `buffer_pool_bytes` is negative, or `tls` names
                a cert_file without key_file.
            OSError: a file of `tls` cannot be read.
        """
        self._calls = Calls(timeout_s, retry)
        self.target = target
        self._described = describe(
            target, tls=tls, shm=shm, bulk=bulk, custom=transport is not None, timeout_s=timeout_s
        )
        self._transport: AsyncTransport | None = transport
        self._loop: asyncio.AbstractEventLoop | None = None  # set on first use
        self._closed = False
        self.bulk: BulkLink | None = None  # the bulk path's state and counters (None with a custom transport)
        buffers = self.buffers = BufferPool(buffer_pool_bytes)  # as KVCacheClient's
        if transport is None:
            channel = aio_channel_factory(target, tls=tls, max_message_bytes=max_message_bytes)
            metadata = auth_metadata(token)
            link = self.bulk = BulkLink(
                target, token=bearer_token(token), tls=tls, enabled=bulk, connections=bulk_connections, buffers=buffers
            )
            self._make_transport: Callable[[], AsyncTransport] = lambda: AsyncBulkTransport(
                AsyncGrpcTransport(channel(), metadata=metadata, shm=shm, buffers=buffers, presence=presence_index),
                link,
            )
        self._io = _AsyncIO(self._bound)

    def __repr__(self) -> str:
        return f"AsyncKVCacheClient({self._described})"

    @classmethod
    def connect(cls, target: str = DEFAULT_TARGET, **kwargs: object) -> AsyncKVCacheClient:
        """Same as the constructor; reads better at call sites.

        Raises:
            ValueError, OSError: as the constructor.
        """
        return cls(target, **kwargs)  # type: ignore[arg-type]

    def _bound(self) -> AsyncTransport:
        """The transport, made on the first use in the running loop, which the client is then bound to."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncKVCacheClient is bound to the event loop it was first used in;"
                " make one client per event loop"
            )
        if self._closed:
            raise ValueError("this AsyncKVCacheClient is closed")
        if self._transport is None:
            self._transport = self._make_transport()
        return self._transport

    async def _run(self, steps: Steps[T]) -> T:
        return await arun(steps, self._io)

    @property
    def presence(self) -> PresenceLink | None:
        """As KVCacheClient.presence (None until the first call made the transport)."""
        return getattr(self._transport, "presence", None)

    @property
    def corrupt_blocks(self) -> int:
        """Blocks that failed their checksum under their key, returned as misses."""
        return self._calls.corrupt_blocks

    @staticmethod
    def chunk_keys(
        tokens: Sequence[int] | np.ndarray, namespace: _keys.Namespace, *, include_partial: bool = True
    ) -> list[bytes]:
        """Chunk keys of a prompt (kvcache_core.keys.chunk_keys); local, nothing is sent.

        Raises:
            ValueError: a token id is not an unsigned 32-bit integer.
        """
        return _keys.chunk_keys(tokens, namespace, include_partial=include_partial)

    async def lookup(
        self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> LookupResult:
        """The longest stored prefix of `keys`, in one round trip (as KVCacheClient.lookup).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.lookup (InvalidRequest, Unavailable, DeadlineExceeded, ...).
            Nothing stored is not an error: prefix_length is then 0.
        """
        return await self._run(self._calls.lookup(namespace, keys, timeout_s))

    async def put_many(
        self,
        namespace: NamespaceLike,
        items: Sequence[tuple[bytes, BlockData]],
        *,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores (key, block) pairs: encoded blocks, or (header, payload) parts (as KVCacheClient.put_many,
        `retain_ttl_s` included).

        Raises:
            ValueError: `timeout_s` is not positive, or `retain_ttl_s` not a positive, finite number.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.put_many (InvalidRequest, DataCorrupted, ResourceExhausted,
                Unavailable, DeadlineExceeded, ...).
        """
        return await self._run(self._calls.put_many(namespace, items, timeout_s, retain_ttl_s))

    async def put_payloads(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        *,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores each payload as one flat uint8 block under its key (as KVCacheClient.put_payloads),
        encoded in a worker thread when large. The server never computes these checksums for this
        face (a cancelled task returns at once, while the server may still read the payloads).

        Raises:
            ValueError: `timeout_s` is not positive, or as KVCacheClient.put_payloads.
            BlockFormatError, TypeError: as KVCacheClient.put_payloads.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.put_many (InvalidRequest, ResourceExhausted, Unavailable,
                DeadlineExceeded, ...).
        """
        return await self._run(self._calls.put_payloads(namespace, keys, payloads, timeout_s, retain_ttl_s))

    async def prefetch(
        self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> PrefetchResult:
        """Asks the server to promote the keys' blocks into RAM in the background (as KVCacheClient.prefetch).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.prefetch (InvalidRequest, PermissionDenied, Unavailable, DeadlineExceeded, ...).
        """
        return await self._run(self._calls.prefetch(namespace, keys, timeout_s))

    async def get_many(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[memoryview | None]:
        """Each key's verified block, or None. With prefix_only, stops at the first miss.

        As KVCacheClient.get_many: read-only memoryviews of this client's own memory.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.get_many (InvalidRequest, ResourceExhausted, Unavailable,
                DeadlineExceeded, ...).
            A missing block, or one that fails its checksum (counted in corrupt_blocks), is None, not an error.
        """
        return await self._run(self._calls.get_many(namespace, keys, prefix_only, timeout_s))

    @contextlib.asynccontextmanager
    async def leased(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
        verify: bool = True,
    ) -> AsyncIterator[list[memoryview | None]]:
        """Each key's verified block, read in place where it can be, for the `async with` block only.

            async with client.leased(ns, keys) as blocks:
                for block in blocks: ...   # read-only views; use them inside the block

        As KVCacheClient.leased: on the same host as the server the blocks its RAM holds are views
        of its arena under read leases (no byte copied; each block's key-bound checksum verified
        before it is handed out), released when the block ends, also when it ends by an exception
        or a cancellation (the release runs to its end with its own deadline). A call cancelled or
        past its deadline before the block starts leaves no lease behind either. Elsewhere, and for
        keys RAM lacks, the blocks are as get_many returns them. verify=False: as KVCacheClient.leased.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        held = await self._run(self._calls.lease(namespace, keys, prefix_only, timeout_s, verify))
        try:
            yield held.blocks
        finally:
            await self._run(self._calls.unlease(held))

    async def get_into(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        destinations: Sequence[object],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Copies each key's verified block payload once into its destination; True where found.

        As KVCacheClient.get_into (torch tensors on any device, or writable buffers of exactly the
        payload's size; on the same host straight from the server's arena, copied where the presence
        index locates every key and under read leases otherwise; from a
        remote server's bulk port received straight into CPU destinations). Large copies and those
        receives run in a worker thread; a cancelled call waits for it before the leases are released
        and before it returns, so nothing writes into a destination after the call.

        Raises:
            ValueError: `timeout_s` is not positive, not one destination per key, a destination of the
                wrong size, or a non-contiguous tensor (the leases are released either way).
            TypeError: a destination that is neither a tensor nor a writable buffer.
            RuntimeError, RPCError: as get_many.
        """
        check_destinations(keys, destinations)
        timeout_s = call_timeout_s(timeout_s, self._calls.timeout_s)
        deadline = time.monotonic() + timeout_s
        sinks = payload_sinks(destinations)
        if any(sink is not None for sink in sinks):
            got = await self._run(self._calls.receive_into(namespace, keys, sinks, prefix_only, timeout_s))
            if got is not None:
                if sum(len(d) for d, _ in got.found.values()) >= OFFLOAD_BYTES:
                    return await run_to_end(lambda _: self._calls.landed(got, keys, destinations))
                return self._calls.landed(got, keys, destinations)
            timeout_s = max(deadline - time.monotonic(), 1e-6)  # the lease path, within the same deadline
        async with self.leased(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s, verify=False) as blocks:
            corrupt = self._calls.count_corrupt
            if block_bytes(blocks) >= OFFLOAD_BYTES:
                found = await run_to_end(lambda _: land_into(blocks, keys, destinations, sinks, corrupt))
            else:
                found = land_into(blocks, keys, destinations, sinks, corrupt)
            return copied(blocks, found)

    async def delete(self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Removes keys from every tier; returns how many were stored (as KVCacheClient.delete).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.delete (InvalidRequest, Unavailable, DeadlineExceeded, ...).
            A key that is not stored is not an error: it is not counted.
        """
        return await self._run(self._calls.delete(namespace, keys, timeout_s))

    async def stats(self, *, timeout_s: float | None = None) -> ServerStats:
        """The server's counters (as KVCacheClient.stats).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as KVCacheClient.stats (PermissionDenied, Unavailable, DeadlineExceeded, ...).
        """
        return await self._run(self._calls.stats(timeout_s))

    async def put_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        *,
        layout: Layout = Layout.CANONICAL,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores one tensor per key (as KVCacheClient.put_tensors, checksummed by this process,
        in a worker thread when large). Keep each tensor unchanged until this returns.
        `retain_ttl_s`: as put_many.

        Raises:
            ValueError: not one tensor per key, a dtype the block format lacks, `timeout_s` not positive,
                or `retain_ttl_s` not a positive, finite number.
            ModuleNotFoundError: torch is not installed.
            RuntimeError, RPCError: as put_many (InvalidRequest, ResourceExhausted, Unavailable, ...).
        """
        return await self._run(self._calls.put_tensors(namespace, keys, tensors, layout, timeout_s, retain_ttl_s))

    async def get_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[torch.Tensor | None]:
        """One CPU tensor per key, or None; each tensor views the received bytes without a copy.

        Read-only by contract, though torch does not refuse a write: see KVCacheClient.get_tensors
        for what a write changes, and take `t.clone()` to modify.

        Raises:
            ValueError: `timeout_s` is not positive, or this torch build lacks a block's dtype.
            ModuleNotFoundError: torch is not installed.
            RuntimeError, RPCError: as get_many (InvalidRequest, Unavailable, ...); a miss is None.
        """
        return await self._run(self._calls.get_tensors(namespace, keys, prefix_only, timeout_s))

    async def close(self) -> None:
        """Closes the channel (if a call made one) and removes this client's shared-memory segments;
        blocks and tensors it returned stay valid. Calls after close raise ValueError.

        Raises:
            RuntimeError: the client is bound to another event loop (close it from its own loop).
        """
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            self._bound()  # raises the other-loop error
        self._closed = True
        if self._transport is not None:
            await self._transport.close()
        self.buffers.clear()

    async def __aenter__(self) -> AsyncKVCacheClient:
        self._bound()  # the channel, in this loop
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
