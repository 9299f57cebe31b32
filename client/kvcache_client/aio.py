"""AsyncKVCacheClient: the asyncio SDK, the same API as KVCacheClient with `await`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np

from kvcache_client import keys as _keys
from kvcache_client.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    NamespaceLike,
    namespace_name,
    verified,
)
from kvcache_client.connection import TLSConfig, auth_metadata, make_aio_channel
from kvcache_client.errors import DeadlineExceeded, RPCError, from_rpc_error
from kvcache_client.retry import RetryPolicy
from kvcache_client.transport import (
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
    """An asyncio client of one kvcache server. Use it from one event loop."""

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
        transport: AsyncTransport | None = None,
    ) -> None:
        """See KVCacheClient.__init__; the channel is a grpc.aio channel."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.target = target
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._transport: AsyncTransport = transport or AsyncGrpcTransport(
            make_aio_channel(target, tls=tls, max_message_bytes=max_message_bytes),
            metadata=auth_metadata(token),
            shm=shm,
        )
        self.corrupt_blocks = 0

    @classmethod
    def connect(cls, target: str = DEFAULT_TARGET, **kwargs: object) -> AsyncKVCacheClient:
        """Same as the constructor; reads better at call sites."""
        return cls(target, **kwargs)  # type: ignore[arg-type]

    async def _call(self, timeout_s: float | None, fn: Callable[[float], Awaitable[T]]) -> T:
        deadline = time.monotonic() + (timeout_s or self._timeout_s)
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
                return await fn(remaining)
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
        """Chunk keys of a prompt (kvcache_core.keys.chunk_keys)."""
        return _keys.chunk_keys(tokens, namespace, include_partial=include_partial)

    async def lookup(
        self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> LookupResult:
        """The longest stored prefix of `keys`, in one round trip."""
        if not keys:
            return LookupResult(0)
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda t: self._transport.lookup(ns, keys, t))

    async def put_many(
        self, namespace: NamespaceLike, items: Sequence[tuple[bytes, BlockData]], *, timeout_s: float | None = None
    ) -> PutResult:
        """Stores (key, block) pairs: blocks from format.encode_block, or (header, payload) parts from
        format.encode_block_parts (the payload is then copied once, straight into the message)."""
        if not items:
            return PutResult(0, 0, 0)
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda t: self._transport.put(ns, items, t))

    async def get_many(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[memoryview | None]:
        """Each key's verified block, or None. With prefix_only, stops at the first miss.

        Blocks are read-only memoryviews into the received messages: no copy is made on the way in.
        """
        if not keys:
            return []
        ns = namespace_name(namespace)
        fetched = await self._call(timeout_s, lambda t: self._transport.get(ns, keys, prefix_only, t))
        return verified(fetched, keys, self._count_corrupt)

    async def delete(self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Removes keys from every tier; returns how many were stored."""
        if not keys:
            return 0
        ns = namespace_name(namespace)
        return await self._call(timeout_s, lambda t: self._transport.delete(ns, keys, t))

    async def stats(self, *, timeout_s: float | None = None) -> ServerStats:
        """The server's counters."""
        return await self._call(timeout_s, self._transport.stats)

    async def put_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        *,
        layout: Layout = Layout.CANONICAL,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Stores one tensor per key; a contiguous CPU tensor's bytes are copied once, into the message."""
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
        """One CPU tensor per key, or None; each tensor views the received bytes without a copy."""
        from kvcache_client.tensors import block_to_tensor

        blocks = await self.get_many(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s)
        return [None if b is None else block_to_tensor(b, verify=False) for b in blocks]

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
