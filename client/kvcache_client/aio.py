"""AsyncKVCacheClient: the asyncio SDK, the same API as KVCacheClient with `await`.

It may be built anywhere (module level, outside any loop); its grpc.aio channel is made on first use,
inside the running loop, and the client then belongs to that loop: a use from another loop raises
RuntimeError. Deadlines, retries and errors are KVCacheClient's (see its docstrings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np

from kvcache_client import keys as _keys
from kvcache_client.arena import Leased, LeasedBlocks, copy_payload_into
from kvcache_client.bulk import DEFAULT_CONNECTIONS, AsyncBulkTransport, BulkLink, bearer_token
from kvcache_client.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    NamespaceLike,
    call_timeout_s,
    namespace_name,
    verified,
)
from kvcache_client.connection import TLSConfig, aio_channel_factory, auth_metadata, describe
from kvcache_client.errors import DeadlineExceeded, RPCError, from_rpc_error
from kvcache_client.retry import RetryPolicy
from kvcache_client.shm import CallEnded, run_to_end
from kvcache_client.transport import (
    OFFLOAD_BYTES,
    AsyncGrpcTransport,
    AsyncTransport,
    LookupResult,
    PutResult,
    ServerStats,
)
from kvcache_core.blockwire import BlockData
from kvcache_core.format import Layout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        transport: AsyncTransport | None = None,
    ) -> None:
        """See KVCacheClient.__init__. Needs no event loop: the grpc.aio channel is made on first use.

        Raises:
            ValueError: `timeout_s` is not positive, or `tls` names a cert_file without key_file.
            OSError: a file of `tls` cannot be read.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.target = target
        self._timeout_s = timeout_s
        self._described = describe(
            target, tls=tls, shm=shm, bulk=bulk, custom=transport is not None, timeout_s=timeout_s
        )
        self._retry = retry or RetryPolicy()
        self._transport: AsyncTransport | None = transport
        self._loop: asyncio.AbstractEventLoop | None = None  # set on first use
        self._closed = False
        self.bulk: BulkLink | None = None  # the bulk path's state and counters (None with a custom transport)
        if transport is None:
            channel = aio_channel_factory(target, tls=tls, max_message_bytes=max_message_bytes)
            metadata = auth_metadata(token)
            link = self.bulk = BulkLink(
                target, token=bearer_token(token), tls=tls, enabled=bulk, connections=bulk_connections
            )
            self._make_transport: Callable[[], AsyncTransport] = lambda: AsyncBulkTransport(
                AsyncGrpcTransport(channel(), metadata=metadata, shm=shm), link
            )
        self.corrupt_blocks = 0

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

    async def _call(self, timeout_s: float, fn: Callable[[AsyncTransport, float], Awaitable[T]]) -> T:
        transport = self._bound()
        deadline = time.monotonic() + timeout_s
        attempts = 0
        last: RPCError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last is not None:  # the deadline ended the retries: say what kept failing
                    raise last
                raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the call finished")
            attempts += 1
            try:
                return await fn(transport, remaining)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not self._retry.should_retry(err.code, attempts):
                    raise err from None
                last = err
                sleep_s = min(self._retry.backoff_s(attempts), max(0.0, deadline - time.monotonic()))
                log.debug("%s; retrying in %.3fs (attempt %d)", err, sleep_s, attempts)
                await asyncio.sleep(sleep_s)

    def _count_corrupt(self) -> None:
        self.corrupt_blocks += 1

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
        """The longest stored prefix of `keys`, in one round trip.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            InvalidRequest: a key is not 16 bytes, or too many keys for the server's limit.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, PermissionDenied, ...), as kvcache_client.errors maps it.
            Nothing stored is not an error: prefix_length is then 0.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not keys:
            return LookupResult(0)
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda tr, t: tr.lookup(ns, keys, t))

    async def put_many(
        self, namespace: NamespaceLike, items: Sequence[tuple[bytes, BlockData]], *, timeout_s: float | None = None
    ) -> PutResult:
        """Stores (key, block) pairs: blocks from format.encode_block, or (header, payload) parts from
        format.encode_block_parts (the payload is then copied once, straight into the message).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            InvalidRequest: a key is not 16 bytes, or a block is not a valid block (format v2).
            DataCorrupted: a block does not match its checksum under its key.
            ResourceExhausted: a block is over the server's max_block_bytes, or the request over its limits.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, PermissionDenied, ...), as kvcache_client.errors maps it.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not items:
            return PutResult(0, 0, 0)
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda tr, t: tr.put(ns, items, t))

    async def get_many(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[memoryview | None]:
        """Each key's verified block, or None. With prefix_only, stops at the first miss.

        Blocks are read-only memoryviews of this client's own memory: the received message, on the
        same-host path (docs/shm.md) this client's get segment, or a copy made once out of the
        server's arena (docs/arena.md; leased() reads it without that copy). Nothing
        else sees those bytes: the server's stored copy is never changed through them. Use bytearray(block)
        or a clone of get_tensors' tensor for bytes to modify (see get_tensors).

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            InvalidRequest: a key is not 16 bytes, or too many keys for the server's limit.
            ResourceExhausted: the answer would be over a message or request limit.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, PermissionDenied, ...), as kvcache_client.errors maps it.
            A missing block, or one that fails its checksum (counted in corrupt_blocks), is None, not an error.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not keys:
            return []
        ns = namespace_name(namespace)
        fetched = await self._call(timeout_s, lambda tr, t: tr.get(ns, keys, prefix_only, t))
        return verified(fetched, keys, self._count_corrupt)

    @contextlib.asynccontextmanager
    async def leased(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> AsyncIterator[list[memoryview | None]]:
        """Each key's verified block, read in place where it can be, for the `async with` block only.

            async with client.leased(ns, keys) as blocks:
                for block in blocks: ...   # read-only views; use them inside the block

        As KVCacheClient.leased: on the same host as the server the blocks its RAM holds are views
        of its arena under read leases (no byte copied; each block's key-bound checksum verified
        before it is handed out), released when the block ends, also when it ends by an exception
        or a cancellation (the release runs to its end with its own deadline). A call cancelled or
        past its deadline before the block starts leaves no lease behind either. Elsewhere, and for
        keys RAM lacks, the blocks are as get_many returns them.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not keys:
            yield LeasedBlocks()
            return
        ns = namespace_name(namespace)
        transport = self._bound()
        if not hasattr(transport, "lease"):  # a transport without in-place reads
            yield LeasedBlocks(await self.get_many(ns, keys, prefix_only=prefix_only, timeout_s=timeout_s))
            return
        lease: Callable[..., Awaitable[Leased]] = transport.lease  # type: ignore[attr-defined]
        got = await self._call(timeout_s, lambda _tr, t: lease(ns, keys, prefix_only, t))
        blocks = LeasedBlocks()
        try:
            blocks.extend(verified(got.blocks, keys, self._count_corrupt))
            blocks.expires_at = got.expires_at
            yield blocks
        finally:
            for block, in_place in zip(blocks, got.in_place, strict=False):
                if block is not None and in_place:
                    with contextlib.suppress(BufferError):  # something still views it: it stays readable
                        block.release()
            await transport.release(got.ids)  # type: ignore[attr-defined]

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
        payload's size; on the same host straight from the server's arena under read leases). Large
        copies run in a worker thread; a cancelled call waits for it before the leases are released.

        Raises:
            ValueError: `timeout_s` is not positive, not one destination per key, a destination of the
                wrong size, or a non-contiguous tensor (the leases are released either way).
            TypeError: a destination that is neither a tensor nor a writable buffer.
            RuntimeError, RPCError: as get_many.
        """
        if len(destinations) != len(keys):
            raise ValueError(f"{len(destinations)} destinations for {len(keys)} keys")
        async with self.leased(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s) as blocks:

            def copy(stop: threading.Event | None) -> None:
                for block, destination in zip(blocks, destinations, strict=True):
                    if stop is not None and stop.is_set():
                        raise CallEnded("stopped before every block was copied")
                    if block is not None:
                        copy_payload_into(block, destination)

            if sum(len(b) for b in blocks if b is not None) >= OFFLOAD_BYTES:
                await run_to_end(copy)
            else:
                copy(None)
            if blocks.expired():  # the copies outlived the leases: not trusted
                log.warning("get_into outlived its arena leases; its blocks are treated as misses")
                return [False] * len(blocks)
            return [block is not None for block in blocks]

    async def delete(self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Removes keys from every tier; returns how many were stored.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            InvalidRequest: a key is not 16 bytes, or too many keys for the server's limit.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, PermissionDenied, ...), as kvcache_client.errors maps it.
            A key that is not stored is not an error: it is not counted.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not keys:
            return 0
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda tr, t: tr.delete(ns, keys, t))

    async def stats(self, *, timeout_s: float | None = None) -> ServerStats:
        """The server's counters.

        Raises:
            ValueError: `timeout_s` is not positive.
            RuntimeError: the client is bound to another event loop.
            PermissionDenied: with auth, the token lacks the admin right.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, ...), as kvcache_client.errors maps it.
        """
        return await self._call(call_timeout_s(timeout_s, self._timeout_s), lambda tr, t: tr.stats(t))

    async def put_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        *,
        layout: Layout = Layout.CANONICAL,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Stores one tensor per key; a contiguous CPU tensor's bytes are copied once, into the message.

        Raises:
            ValueError: not one tensor per key, a dtype the block format lacks, or `timeout_s` not positive.
            ModuleNotFoundError: torch is not installed.
            RuntimeError, RPCError: as put_many (InvalidRequest, ResourceExhausted, Unavailable, ...).
        """
        from kvcache_client.tensors import tensor_block_parts

        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        items = [(k, tensor_block_parts(t, k, layout)) for k, t in zip(keys, tensors, strict=True)]
        return await self.put_many(namespace, items, timeout_s=timeout_s)

    async def get_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[torch.Tensor | None]:
        """One CPU tensor per key, or None; each tensor views the received bytes without a copy.

        The tensors are read-only by contract, but torch has no read-only tensors: a write (`add_`,
        `copy_`, `t[...] = x`) is not refused. It changes this client's receive buffer in place (the
        received message, or this client's get segment on the same-host path), so the block's
        memoryview and every tensor of that block change with it, and the bytes no longer match their
        checksum; the server's stored block and other callers' tensors are never affected. To modify,
        take a copy first: `t.clone()`, or copy it into its destination (`dst.copy_(t)`).

        Raises:
            ValueError: `timeout_s` is not positive, or this torch build lacks a block's dtype.
            ModuleNotFoundError: torch is not installed.
            RuntimeError, RPCError: as get_many (InvalidRequest, Unavailable, ...); a miss is None.
        """
        from kvcache_client.tensors import block_to_tensor

        blocks = await self.get_many(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s)
        return [None if b is None else block_to_tensor(b, verify=False) for b in blocks]

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

    async def __aenter__(self) -> AsyncKVCacheClient:
        self._bound()  # the channel, in this loop
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
