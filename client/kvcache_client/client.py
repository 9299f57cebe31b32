"""KVCacheClient: the blocking SDK. AsyncKVCacheClient (aio.py) mirrors it method for method.

    from kvcache_client import KVCacheClient, Namespace

    ns = Namespace(model_id="my-model", kv_dtype="bfloat16", chunk_tokens=256,
                   num_layers=32, num_kv_heads=8, head_size=128)
    with KVCacheClient("127.0.0.1:51051") as client:
        keys = client.chunk_keys(prompt_token_ids, ns)
        hit = client.lookup(ns, keys).prefix_length
        tensors = client.get_tensors(ns, keys[:hit])

Every call has a deadline (`timeout_s`, per call or the client's default when
None; it must be positive) that covers all its attempts; statuses in the retry
policy are retried with backoff inside it. Every block received is verified
against its checksum; a block that fails is returned as a miss and counted in
`corrupt_blocks`.

Errors: the server's statuses arrive as the types of kvcache_client.errors
(InvalidRequest, DataCorrupted, ResourceExhausted, Unauthenticated,
PermissionDenied, DeadlineExceeded, Unavailable, all RPCError and KVCacheError);
bad arguments raise ValueError before anything is sent. A miss is never an
exception: lookup returns a shorter prefix, get_many None.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np

from kvcache_client import keys as _keys
from kvcache_client.arena import LeasedBlocks, copy_payload_into
from kvcache_client.bulk import DEFAULT_CONNECTIONS, BulkLink, BulkTransport, bearer_token
from kvcache_client.connection import TLSConfig, auth_metadata, describe, make_channel
from kvcache_client.errors import BlockFormatError, DeadlineExceeded, RPCError, from_rpc_error
from kvcache_client.retry import RetryPolicy
from kvcache_client.transport import (
    Fetched,
    GrpcTransport,
    LookupResult,
    PutResult,
    ServerStats,
    Transport,
)
from kvcache_core.blockwire import BlockData
from kvcache_core.format import Layout, verify_block

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_TARGET = "127.0.0.1:51051"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

T = TypeVar("T")
NamespaceLike = _keys.Namespace | str

__all__ = ["DEFAULT_TARGET", "KVCacheClient", "LookupResult", "PutResult", "ServerStats"]


def call_timeout_s(timeout_s: float | None, default_s: float) -> float:
    """A call's deadline in seconds: `timeout_s`, or `default_s` (the client's) when it is None.

    Raises:
        ValueError: `timeout_s` is not positive (0 means neither "no deadline" nor "the default").
    """
    if timeout_s is None:
        return default_s
    if not timeout_s > 0:  # NaN included
        raise ValueError(f"timeout_s must be positive, or None for the client's default; got {timeout_s!r}")
    return timeout_s


def namespace_name(namespace: NamespaceLike) -> str:
    """The server-side namespace string: a Namespace's fingerprint hex, or a str as given."""
    return namespace.name if isinstance(namespace, _keys.Namespace) else namespace


def verified(
    fetched: list[Fetched | None], keys: Sequence[bytes], on_corrupt: Callable[[], None]
) -> list[memoryview | None]:
    """Blocks that pass their checksum under the key they were asked for; the rest become misses
    (a damaged block, or another key's block: format v2 binds each block to its key)."""
    out: list[memoryview | None] = []
    for key, item in zip(keys, fetched, strict=True):
        if item is None:
            out.append(None)
            continue
        data, tier = item
        try:
            verify_block(data, key)
        except BlockFormatError as exc:
            log.error("block %s from tier %s failed verification, treating as a miss: %s", key.hex(), tier, exc)
            on_corrupt()
            out.append(None)
            continue
        out.append(memoryview(data))
    return out


class KVCacheClient:
    """A blocking client of one kvcache server. Thread-safe; share one per process.

    Each call's Raises section says what it can raise. In short: ValueError for bad arguments (nothing
    is sent); the server's statuses as kvcache_client.errors types (RPCError subclasses); Unavailable
    once UNAVAILABLE was retried until the deadline; DeadlineExceeded when the deadline passed. A miss
    is never an exception.
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
        transport: Transport | None = None,
    ) -> None:
        """Connects lazily to `target` ("host:port").

        Args:
            target: The server address.
            timeout_s: Default deadline of each call, all retries included.
            retry: Retry policy; the default retries UNAVAILABLE with backoff until the deadline.
            max_message_bytes: gRPC message limit of this client (bounds one block).
            token: API token; defaults to the KVCACHE_TOKEN environment variable.
            tls: True (verify against the system roots) or a TLSConfig; False for plaintext.
            shm: Move block bytes through shared memory when the server is on this host and shares
                its shm directory (docs/shm.md); False keeps them on gRPC (as KVCACHE_SHM=0 does).
            bulk: Move the block bytes of large puts and gets over the server's bulk port when Info
                advertises one and shm is not in use (docs/bulk.md); False (or KVCACHE_BULK=0) keeps
                them on gRPC. `client.bulk.counters` says which path moved them.
            bulk_connections: Connections to the bulk port; a call's blocks are striped across them.
            transport: Replaces the gRPC transport (tests, other data paths).

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
        self.bulk: BulkLink | None = None  # the bulk path's state and counters (None with a custom transport)
        if transport is None:
            self.bulk = BulkLink(target, token=bearer_token(token), tls=tls, enabled=bulk, connections=bulk_connections)
            grpc_transport = GrpcTransport(
                make_channel(target, tls=tls, max_message_bytes=max_message_bytes),
                metadata=auth_metadata(token),
                shm=shm,
            )
            transport = BulkTransport(grpc_transport, self.bulk)
        self._transport: Transport = transport
        self.corrupt_blocks = 0

    def __repr__(self) -> str:
        return f"KVCacheClient({self._described})"

    @classmethod
    def connect(cls, target: str = DEFAULT_TARGET, **kwargs: object) -> KVCacheClient:
        """Same as the constructor; reads better at call sites.

        Raises:
            ValueError, OSError: as the constructor.
        """
        return cls(target, **kwargs)  # type: ignore[arg-type]

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, timeout_s: float, fn: Callable[[float], T]) -> T:
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
                return fn(remaining)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not self._retry.should_retry(err.code, attempts):
                    raise err from None
                last = err
                sleep_s = min(self._retry.backoff_s(attempts), max(0.0, deadline - time.monotonic()))
                log.debug("%s; retrying in %.3fs (attempt %d)", err, sleep_s, attempts)
                time.sleep(sleep_s)

    def _count_corrupt(self) -> None:
        self.corrupt_blocks += 1

    # -- API -----------------------------------------------------------------------------------

    @staticmethod
    def chunk_keys(
        tokens: Sequence[int] | np.ndarray, namespace: _keys.Namespace, *, include_partial: bool = True
    ) -> list[bytes]:
        """Chunk keys of a prompt (kvcache_core.keys.chunk_keys); local, nothing is sent.

        Raises:
            ValueError: a token id is not an unsigned 32-bit integer.
        """
        return _keys.chunk_keys(tokens, namespace, include_partial=include_partial)

    def lookup(
        self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> LookupResult:
        """The longest stored prefix of `keys`, in one round trip.

        Raises:
            ValueError: `timeout_s` is not positive.
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
        return self._call(timeout_s, lambda t: self._transport.lookup(ns, keys, t))

    def put_many(
        self, namespace: NamespaceLike, items: Sequence[tuple[bytes, BlockData]], *, timeout_s: float | None = None
    ) -> PutResult:
        """Stores (key, block) pairs: blocks from format.encode_block, or (header, payload) parts from
        format.encode_block_parts (the payload is then copied once, straight into the message).

        Raises:
            ValueError: `timeout_s` is not positive.
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
        return self._call(timeout_s, lambda t: self._transport.put(ns, items, t))

    def get_many(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[memoryview | None]:
        """Each key's verified block, or None. With prefix_only, stops at the first miss.

        Blocks are read-only memoryviews, without a copy, of this client's own receive buffers: the
        received message, or on the same-host path (docs/shm.md) this client's get segment. Nothing
        else sees those bytes: the server's stored copy is never changed through them. Use bytearray(block)
        or a clone of get_tensors' tensor for bytes to modify (see get_tensors).

        Raises:
            ValueError: `timeout_s` is not positive.
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
        fetched = self._call(timeout_s, lambda t: self._transport.get(ns, keys, prefix_only, t))
        return verified(fetched, keys, self._count_corrupt)

    @contextlib.contextmanager
    def leased(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> Iterator[list[memoryview | None]]:
        """Each key's verified block, read in place where it can be, for the `with` block only.

            with client.leased(ns, keys) as blocks:
                for block in blocks: ...   # read-only views; use them inside the block

        On the same host as the server (its block arena shared, docs/arena.md) the blocks its RAM
        holds are views of that arena under read leases: no byte is copied, and the server does not
        reuse their slots until the `with` block ends and the leases are released (or they expire,
        after the server's ram.lease_timeout_s). Each block's key-bound checksum is verified before
        it is handed out. Elsewhere, and for keys RAM lacks, the blocks are as get_many returns them.
        The views are released when the block ends (a later use raises ValueError), unless
        something still holds a buffer of them: copy what must outlive the block. The list's
        `expires_at` (LeasedBlocks) says until when the views hold these blocks at the latest: a
        copy finished before it is exact.

        Raises:
            ValueError: `timeout_s` is not positive.
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        timeout_s = call_timeout_s(timeout_s, self._timeout_s)
        if not keys:
            yield LeasedBlocks()
            return
        ns = namespace_name(namespace)
        lease = getattr(self._transport, "lease", None)
        if lease is None:  # a transport without in-place reads
            yield LeasedBlocks(self.get_many(ns, keys, prefix_only=prefix_only, timeout_s=timeout_s))
            return
        got = self._call(timeout_s, lambda t: lease(ns, keys, prefix_only, t))
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
            self._transport.release(got.ids)

    def get_into(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        destinations: Sequence[object],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[bool]:
        """Copies each key's verified block payload once into its destination; True where found.

        A destination is a torch tensor (a pinned host tensor, a GPU tensor: one copy each) or a
        writable buffer (bytearray, numpy array), of exactly the payload's size in bytes. On the same
        host the bytes come straight from the server's arena under a read lease (leased()), verified
        first; elsewhere from what get_many receives. A destination of a key not found is untouched;
        all are False (the destinations not to be used) if the copies outlived the leases (LeasedBlocks).

        Raises:
            ValueError: `timeout_s` is not positive, not one destination per key, a destination of the
                wrong size, or a non-contiguous tensor (the leases are released either way).
            TypeError: a destination that is neither a tensor nor a writable buffer.
            RPCError: as get_many.
        """
        if len(destinations) != len(keys):
            raise ValueError(f"{len(destinations)} destinations for {len(keys)} keys")
        found: list[bool] = []
        with self.leased(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s) as blocks:
            for block, destination in zip(blocks, destinations, strict=True):
                if block is not None:
                    copy_payload_into(block, destination)
                found.append(block is not None)
            if blocks.expired():  # the copies outlived the leases: not trusted
                log.warning("get_into outlived its arena leases; %d blocks treated as misses", sum(found))
                return [False] * len(found)
        return found

    def delete(self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        """Removes keys from every tier; returns how many were stored.

        Raises:
            ValueError: `timeout_s` is not positive.
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
        return self._call(timeout_s, lambda t: self._transport.delete(ns, keys, t))

    def stats(self, *, timeout_s: float | None = None) -> ServerStats:
        """The server's counters.

        Raises:
            ValueError: `timeout_s` is not positive.
            PermissionDenied: with auth, the token lacks the admin right.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, ...), as kvcache_client.errors maps it.
        """
        return self._call(call_timeout_s(timeout_s, self._timeout_s), self._transport.stats)

    def put_tensors(
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
            RPCError: as put_many (InvalidRequest, ResourceExhausted, Unavailable, DeadlineExceeded, ...).
        """
        from kvcache_client.tensors import tensor_block_parts

        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        items = [(k, tensor_block_parts(t, k, layout)) for k, t in zip(keys, tensors, strict=True)]
        return self.put_many(namespace, items, timeout_s=timeout_s)

    def get_tensors(
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
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        from kvcache_client.tensors import block_to_tensor

        blocks = self.get_many(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s)
        return [None if b is None else block_to_tensor(b, verify=False) for b in blocks]

    def close(self) -> None:
        """Closes the channel and removes this client's shared-memory segments; blocks and tensors it
        returned stay valid. Calls after close fail (grpc's ValueError: the channel is closed).

        Raises:
            nothing of its own; closing twice is harmless.
        """
        self._transport.close()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
