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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvcache_client import keys as _keys
from kvcache_client.bufpool import DEFAULT_POOL_BYTES, BufferPool
from kvcache_client.bulk import DEFAULT_CONNECTIONS, BulkLink, BulkTransport, bearer_token
from kvcache_client.calls import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TARGET,
    Calls,
    NamespaceLike,
    call_timeout_s,
)
from kvcache_client.connection import TLSConfig, auth_metadata, describe, make_channel
from kvcache_client.copies import check_destinations, copied, land_into, payload_sinks
from kvcache_client.presence import PresenceLink
from kvcache_client.results import PrefetchResult
from kvcache_client.retry import RetryPolicy
from kvcache_client.steps import Steps, run
from kvcache_client.transport import (
    GrpcTransport,
    LookupResult,
    PutResult,
    ServerStats,
    Transport,
)
from kvcache_core.blockwire import BlockData, Buffer
from kvcache_core.format import Layout

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TARGET", "KVCacheClient", "LookupResult", "NamespaceLike", "PutResult",
    "ServerStats",
]  # fmt: skip


class _BlockingIO:
    """The blocking face's I/O for kvcache_client.calls: each operation runs in the calling thread."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def request(self, fn: Callable[[Transport, float], T], timeout_s: float) -> T:
        return fn(self._transport, timeout_s)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def transport(self) -> Transport:
        return self._transport


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
        buffer_pool_bytes: int = DEFAULT_POOL_BYTES,
        transport: Transport | None = None,
        presence_index: bool = True,
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
            buffer_pool_bytes: Cap of the memory get_many's blocks land in when they are copied out of
                the server's arena or received from its bulk port, reused once the caller dropped them
                (kvcache_client.bufpool); 0 gives each block fresh memory.
            transport: Replaces the gRPC transport (tests, other data paths).
            presence_index: Answer lookups of blocks the server's RAM holds from its presence index
                when it shares one with this process (same host and user; docs/presence.md), without
                an RPC; False sends every lookup. `client.presence` says how lookups were answered.

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
        self.bulk: BulkLink | None = None  # the bulk path's state and counters (None with a custom transport)
        self.buffers = BufferPool(buffer_pool_bytes)  # what get_many's copies land in (unused by a custom transport)
        if transport is None:
            self.bulk = BulkLink(
                target,
                token=bearer_token(token),
                tls=tls,
                enabled=bulk,
                connections=bulk_connections,
                buffers=self.buffers,
            )
            grpc_transport = GrpcTransport(
                make_channel(target, tls=tls, max_message_bytes=max_message_bytes),
                metadata=auth_metadata(token),
                shm=shm,
                buffers=self.buffers,
                presence=presence_index,
            )
            transport = BulkTransport(grpc_transport, self.bulk)
        self._transport: Transport = transport
        self._io = _BlockingIO(transport)

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

    def _run(self, steps: Steps[T]) -> T:
        return run(steps, self._io)

    @property
    def presence(self) -> PresenceLink | None:
        """The presence index's state and counters (`.state`, `.counters.local` ...); None with a
        custom transport that has none."""
        return getattr(self._transport, "presence", None)

    @property
    def corrupt_blocks(self) -> int:
        """Blocks that failed their checksum under their key, returned as misses."""
        return self._calls.corrupt_blocks

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
        return self._run(self._calls.lookup(namespace, keys, timeout_s))

    def put_many(
        self,
        namespace: NamespaceLike,
        items: Sequence[tuple[bytes, BlockData]],
        *,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores (key, block) pairs: blocks from format.encode_block, or (header, payload) parts from
        format.encode_block_parts (the payload is then copied once, straight into the message).

        With `retain_ttl_s`, the server keeps the blocks in RAM for that many seconds, evicting them only
        once no unretained block is left (a session's prefix that must outlive a flood; docs/tiers.md,
        "Sessions that stay"): bounded by the server's retention share per tenant (past it the blocks are
        stored unretained, counted in stats().retention_refused) and capped at its retention.max_ttl_s.
        Such puts travel on gRPC (inline or through shm), never on the bulk port, which has no place for it.

        Raises:
            ValueError: `timeout_s` is not positive, or `retain_ttl_s` is not a positive, finite number.
            InvalidRequest: a key is not 16 bytes, or a block is not a valid block (format v2).
            DataCorrupted: a block does not match its checksum under its key.
            ResourceExhausted: a block is over the server's max_block_bytes, or the request over its limits.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, PermissionDenied, ...), as kvcache_client.errors maps it.
        """
        return self._run(self._calls.put_many(namespace, items, timeout_s, retain_ttl_s))

    def put_payloads(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        *,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores each payload's bytes as one flat uint8 block under its key: put_many of
        format.encode_bytes_parts(keys, payloads), what the engines' connectors store (opaque pages).
        Stored byte for byte as put_many would store them; on the server's host, where the server
        reads the payloads out of this process's memory, it also computes their checksums as it
        reads them, so this process makes no pass over the bytes (docs/shm.md, "Checksums computed
        by the server"). Keep each payload alive and unchanged until this returns: it returns only
        once the server can no longer read them (an interrupted call waits for that first).

        Raises:
            ValueError: `timeout_s` is not positive, `retain_ttl_s` not a positive, finite number, or
                not one payload per key.
            BlockFormatError: a key is not 16 bytes.
            TypeError: a payload is not C-contiguous.
            RPCError: as put_many.
        """
        return self._run(self._calls.put_payloads(namespace, keys, payloads, timeout_s, retain_ttl_s))

    def prefetch(
        self, namespace: NamespaceLike, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> PrefetchResult:
        """Asks the server to promote the keys' blocks from its lower tiers (disk, Redis, S3) into RAM
        in the background, before the next turn needs them; answers at once (docs/tiers.md, "Prefetch").

        Raises:
            ValueError: `timeout_s` is not positive.
            InvalidRequest: a key is not 16 bytes, or more keys than the server's prefetch.max_keys.
            PermissionDenied: with auth, the token lacks the read right.
            Unavailable, DeadlineExceeded, RPCError: as lookup.
        """
        return self._run(self._calls.prefetch(namespace, keys, timeout_s))

    def get_many(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
    ) -> list[memoryview | None]:
        """Each key's verified block, or None. With prefix_only, stops at the first miss.

        Blocks are read-only memoryviews of this client's own memory: without a copy, the received
        message or, on the same-host path (docs/shm.md), this client's get segment; or a copy made
        once out of the server's arena (docs/arena.md; leased() reads it without that copy), or a
        receive from the bulk port, into a buffer of the client's pool (kvcache_client.bufpool:
        reused by a later call only once nothing of the caller's reaches it), verified there. Nothing
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
        return self._run(self._calls.get_many(namespace, keys, prefix_only, timeout_s))

    @contextlib.contextmanager
    def leased(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        *,
        prefix_only: bool = False,
        timeout_s: float | None = None,
        verify: bool = True,
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

        verify=False hands leased views out without reading them (for a caller that copies them
        anyway and checks the copy where it landed, kvcache_core.format.verify_copy: one pass over
        the bytes instead of two). Such a view is not to be used as it is; blocks that were not read
        in place (another host, keys RAM lacks) are verified as get_many verifies them either way.

        Raises:
            ValueError: `timeout_s` is not positive.
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        held = self._run(self._calls.lease(namespace, keys, prefix_only, timeout_s, verify))
        try:
            yield held.blocks
        finally:
            self._run(self._calls.unlease(held))

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
        host, where the presence index locates every key, each block is copied straight out of the
        server's arena into its buffer and verified there, the server told in one TOUCH (its answer
        overlapped with the copies, or left to the next request: kvcache_client.local_reads);
        otherwise the bytes come from the arena under a read lease (leased()), verified first; all
        are False (the destinations not to be used) if the copies outlived the leases
        (LeasedBlocks). From a remote server's bulk port each payload is received straight into its
        destination (CPU buffers and tensors) and verified there (docs/bulk.md); elsewhere from what
        get_many receives. A destination of a key not found is untouched; use a destination only
        where this answered True (a block that failed its checksum as it landed, or a call that
        failed midway, may have left bytes in it).

        Raises:
            ValueError: `timeout_s` is not positive, not one destination per key, a destination of the
                wrong size, or a non-contiguous tensor (the leases are released either way).
            TypeError: a destination that is neither a tensor nor a writable buffer.
            RPCError: as get_many.
        """
        check_destinations(keys, destinations)
        timeout_s = call_timeout_s(timeout_s, self._calls.timeout_s)
        deadline = time.monotonic() + timeout_s
        sinks = payload_sinks(destinations)
        if any(sink is not None for sink in sinks):
            got = self._run(self._calls.receive_into(namespace, keys, sinks, prefix_only, timeout_s))
            if got is not None:
                return self._calls.landed(got, keys, destinations)
            timeout_s = max(deadline - time.monotonic(), 1e-6)  # the lease path, within the same deadline
        with self.leased(namespace, keys, prefix_only=prefix_only, timeout_s=timeout_s, verify=False) as blocks:
            found = land_into(blocks, keys, destinations, sinks, self._calls.count_corrupt)
            return copied(blocks, found)

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
        return self._run(self._calls.delete(namespace, keys, timeout_s))

    def stats(self, *, timeout_s: float | None = None) -> ServerStats:
        """The server's counters.

        Raises:
            ValueError: `timeout_s` is not positive.
            PermissionDenied: with auth, the token lacks the admin right.
            Unavailable: the server stayed unreachable (UNAVAILABLE is retried until the deadline).
            DeadlineExceeded: the call did not finish within its deadline.
            RPCError: any other status (Unauthenticated, ...), as kvcache_client.errors maps it.
        """
        return self._run(self._calls.stats(timeout_s))

    def put_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        *,
        layout: Layout = Layout.CANONICAL,
        timeout_s: float | None = None,
        retain_ttl_s: float | None = None,
    ) -> PutResult:
        """Stores one tensor per key; a contiguous CPU tensor's bytes are read in place: on the
        server's host the server reads them out of this process's memory and computes their
        checksums as it reads (as put_payloads), elsewhere they are copied once, into the message.
        Keep each tensor unchanged (no write, no copy into it still running, such as a non_blocking
        copy from a GPU) until this returns: it returns only once the server can no longer read
        them. `retain_ttl_s`: as put_many.

        Raises:
            ValueError: not one tensor per key, a dtype the block format lacks, `timeout_s` not positive,
                or `retain_ttl_s` not a positive, finite number.
            ModuleNotFoundError: torch is not installed.
            RPCError: as put_many (InvalidRequest, ResourceExhausted, Unavailable, DeadlineExceeded, ...).
        """
        return self._run(self._calls.put_tensors(namespace, keys, tensors, layout, timeout_s, retain_ttl_s))

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
        received message, this client's get segment, or the pooled buffer of get_many), so the block's
        memoryview and every tensor of that block change with it, and the bytes no longer match their
        checksum; the server's stored block and other callers' tensors are never affected. To modify,
        take a copy first: `t.clone()`, or copy it into its destination (`dst.copy_(t)`).

        Raises:
            ValueError: `timeout_s` is not positive, or this torch build lacks a block's dtype.
            ModuleNotFoundError: torch is not installed.
            RPCError: as get_many (InvalidRequest, Unavailable, DeadlineExceeded, ...); a miss is None.
        """
        return self._run(self._calls.get_tensors(namespace, keys, prefix_only, timeout_s))

    def close(self) -> None:
        """Closes the channel and removes this client's shared-memory segments; blocks and tensors it
        returned stay valid. Calls after close fail (grpc's ValueError: the channel is closed).

        Raises:
            nothing of its own; closing twice is harmless.
        """
        self._transport.close()
        self.buffers.clear()

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
