"""What KVCacheClient and AsyncKVCacheClient do, written once (httpx's shape: one implementation,
a blocking and an asyncio face).

Each call is a generator of steps (kvcache_client.steps): its arguments checked (a bad one raises
ValueError before anything is sent), its deadline and the retries inside it (`retrying`), what it
asks of the transport, and its answer checked (every block verified under its key). A face drives
the steps with its own I/O object, which does three things: run one request on the transport (a
call in this thread, or an await), sleep between retries (time.sleep or asyncio.sleep), and hand
over its transport (the asyncio face binds it to the running loop first). Everything else is here,
so the two clients cannot drift apart; what stays in a face is `with` against `async with`, and
where the asyncio face moves large copies off the event loop.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kvcache_client import keys as _keys
from kvcache_client.arena import LeasedBlocks
from kvcache_client.copies import copy_into, verified
from kvcache_client.errors import DeadlineExceeded, RPCError, from_rpc_error
from kvcache_client.inplace_core import Leased
from kvcache_client.presence import PresenceLink
from kvcache_client.results import LookupResult, PrefetchResult, PutResult, ServerStats
from kvcache_client.retry import RetryPolicy
from kvcache_client.sealing import payload_items
from kvcache_client.steps import Steps
from kvcache_core.blockwire import BlockData, Buffer
from kvcache_core.format import Layout, check_key

if TYPE_CHECKING:
    import torch

    from kvcache_client.bulkconn import Received

log = logging.getLogger(__name__)

DEFAULT_TARGET = "127.0.0.1:51051"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30

NamespaceLike = _keys.Namespace | str


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


def retain_ttl(retain_ttl_s: float | None) -> float:
    """PutRequest.retain_ttl_s for a put's `retain_ttl_s` keyword: 0.0 for None (no retention).

    Raises:
        ValueError: `retain_ttl_s` is not a positive, finite number of seconds.
    """
    if retain_ttl_s is None:
        return 0.0
    if not (math.isfinite(retain_ttl_s) and retain_ttl_s > 0):
        raise ValueError(f"retain_ttl_s must be a positive, finite number of seconds, or None; got {retain_ttl_s!r}")
    return float(retain_ttl_s)


def namespace_name(namespace: NamespaceLike) -> str:
    """The server-side namespace string: a Namespace's fingerprint hex, or a str as given."""
    return namespace.name if isinstance(namespace, _keys.Namespace) else namespace


# -- the operations a face performs --------------------------------------------------------------------


class ClientIO(Protocol):
    """What a face does for the steps; the asyncio face's methods are coroutine functions."""

    def request(self, fn: Callable[[Any, float], Any], timeout_s: float) -> Any:
        """fn(transport, timeout_s): its answer (awaited on the asyncio face)."""

    def sleep(self, seconds: float) -> Any:
        """Waits between retries."""

    def transport(self) -> Any:
        """The transport (the asyncio face's, bound to the running loop)."""


@dataclass(frozen=True, slots=True)
class Request:
    fn: Callable[[Any, float], Any]
    timeout_s: float

    def perform(self, io: ClientIO) -> Any:
        return io.request(self.fn, self.timeout_s)


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float

    def perform(self, io: ClientIO) -> Any:
        return io.sleep(self.seconds)


@dataclass(frozen=True, slots=True)
class GetTransport:
    def perform(self, io: ClientIO) -> Any:
        return io.transport()


def _release(ids: list[int]) -> Request:
    """The transport's release of leases (no deadline of the call's: it has its own)."""
    return Request(lambda transport, _: transport.release(ids), math.inf)


@dataclass(slots=True)
class Held:
    """What leased() hands out (`blocks`) and what it gives back when its block ends (`leased`: None
    when nothing was leased)."""

    blocks: LeasedBlocks
    leased: Leased | None = None


# -- the calls ---------------------------------------------------------------------------------------


class Calls:
    """The calls of one client, whichever its face: its default deadline, its retry policy, and
    the blocks that failed verification (`corrupt_blocks`)."""

    def __init__(self, timeout_s: float, retry: RetryPolicy | None) -> None:
        """Raises:
        ValueError: `timeout_s` is not positive.
        """
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.corrupt_blocks = 0

    def count_corrupt(self) -> None:
        self.corrupt_blocks += 1

    def retrying(self, timeout_s: float, fn: Callable[[Any, float], Any]) -> Steps[Any]:
        """fn(transport, remaining_s) until it answers, within one deadline `timeout_s` from now:
        statuses the retry policy names are retried after its backoff.

        Raises:
            RPCError: the status that was not retried (a kvcache_client.errors type), or the last one
                retried when the deadline ended the retries; DeadlineExceeded when it passed first.
        """
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
                return (yield Request(fn, remaining))
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not self.retry.should_retry(err.code, attempts):
                    raise err from None
                last = err
            sleep_s = min(self.retry.backoff_s(attempts), max(0.0, deadline - time.monotonic()))
            log.debug("%s; retrying in %.3fs (attempt %d)", last, sleep_s, attempts)
            yield Sleep(sleep_s)

    def lookup(self, namespace: NamespaceLike, keys: Sequence[bytes], timeout_s: float | None) -> Steps[LookupResult]:
        """The longest stored prefix: from the presence index where it answers (kvcache_client.
        presence), else by RPC, only for the keys from the first one the index lacks."""
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        if not keys:
            return LookupResult(0)
        ns = namespace_name(namespace)
        deadline = time.monotonic() + timeout_s
        link: PresenceLink | None = getattr((yield GetTransport()), "presence", None)
        start = 0
        if link is not None:
            if link.wants_info:  # first use, or its server restarted: one Info maps its index
                try:
                    yield Request(lambda tr, t: tr.info(t, refresh=link.state == "stale"), timeout_s)
                except grpc.RpcError as exc:  # the Lookup below meets the same status and reports it
                    log.debug("presence index: Info failed (%s); looking up by RPC", exc.code())
            local = link.prefix(ns, keys)  # None while off or not to be trusted
            if local is not None:
                found, whole = local
                if whole:
                    link.counters.local += 1
                    return LookupResult(found, ("ram",) * found)
                start = found
            if start:
                link.counters.partial += 1
            else:
                link.counters.rpc += 1
        rest = keys[start:] if start else keys
        remaining = max(deadline - time.monotonic(), 1e-3)
        result: LookupResult = yield from self.retrying(remaining, lambda tr, t: tr.lookup(ns, rest, t))
        if start:
            return LookupResult(start + result.prefix_length, ("ram",) * start + result.tiers)
        return result

    def put_many(
        self,
        namespace: NamespaceLike,
        items: Sequence[tuple[bytes, BlockData]],
        timeout_s: float | None,
        retain_ttl_s: float | None = None,
    ) -> Steps[PutResult]:
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        ttl_s = retain_ttl(retain_ttl_s)
        if not items:
            return PutResult(0, 0, 0)
        ns = namespace_name(namespace)

        def put(tr: Any, t: float) -> PutResult:
            if ttl_s:  # only transports that carry the hint take it (a custom one without it fails loudly)
                return tr.put(ns, items, t, retain_ttl_s=ttl_s)  # type: ignore[no-any-return]
            return tr.put(ns, items, t)  # type: ignore[no-any-return]

        result: PutResult = yield from self.retrying(timeout_s, put)
        return result

    def put_payloads(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        payloads: Sequence[Buffer],
        timeout_s: float | None,
        retain_ttl_s: float | None = None,
        headers: Sequence[bytes] | None = None,
    ) -> Steps[PutResult]:
        """Each payload one block under its key: flat uint8 (format.encode_bytes_parts), or under its
        own header of `headers` (checksum 0, format.encode_block_parts(checksum=False)); checksummed
        by the server where it seals (same host, blocking face), else here."""
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        ttl_s = retain_ttl(retain_ttl_s)
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys for {len(payloads)} payloads")
        if headers is not None and len(headers) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(headers)} headers")
        for key in keys:  # what encode_bytes_parts checks, before any path is chosen
            check_key(key)
        if not keys:
            return PutResult(0, 0, 0)
        ns = namespace_name(namespace)

        def put(tr: Any, t: float) -> PutResult:
            put_payloads = getattr(tr, "put_payloads", None)
            if put_payloads is None:  # a transport of the caller's own: the blocks encoded here
                items = payload_items(keys, payloads, headers)
                return tr.put(ns, items, t, retain_ttl_s=ttl_s) if ttl_s else tr.put(ns, items, t)  # type: ignore[no-any-return]
            if headers is not None:
                return put_payloads(ns, keys, payloads, t, retain_ttl_s=ttl_s, headers=headers)  # type: ignore[no-any-return]
            return put_payloads(ns, keys, payloads, t, retain_ttl_s=ttl_s)  # type: ignore[no-any-return]

        result: PutResult = yield from self.retrying(timeout_s, put)
        return result

    def prefetch(
        self, namespace: NamespaceLike, keys: Sequence[bytes], timeout_s: float | None
    ) -> Steps[PrefetchResult]:
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        if not keys:
            return PrefetchResult(0, 0, 0)
        ns = namespace_name(namespace)
        result: PrefetchResult = yield from self.retrying(timeout_s, lambda tr, t: tr.prefetch(ns, keys, t))
        return result

    def get_many(
        self, namespace: NamespaceLike, keys: Sequence[bytes], prefix_only: bool, timeout_s: float | None
    ) -> Steps[list[memoryview | None]]:
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        if not keys:
            return []
        ns = namespace_name(namespace)
        transport = yield GetTransport()
        if hasattr(transport, "blocks_in_place"):  # same host, every key located: one pass, verified
            deadline = time.monotonic() + timeout_s
            blocks: list[memoryview] | None = yield from self.retrying(
                timeout_s, lambda tr, t: tr.blocks_in_place(ns, keys, t) if hasattr(tr, "blocks_in_place") else None
            )
            if blocks is not None:
                return list(blocks)
            timeout_s = max(deadline - time.monotonic(), 1e-6)  # the usual path, within the same deadline
        fetched = yield from self.retrying(timeout_s, lambda tr, t: tr.get(ns, keys, prefix_only, t))
        return verified(fetched, keys, self.count_corrupt)

    def receive_into(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        sinks: Sequence[memoryview | None],
        prefix_only: bool,
        timeout_s: float,
    ) -> Steps[Received | None]:
        """get_into's one-copy path where the transport has one (BulkTransport.receive_into: a
        client the server's arena is not shared with, over the bulk port); None elsewhere."""
        transport = yield GetTransport()
        if not keys or not hasattr(transport, "receive_into"):
            return None
        ns = namespace_name(namespace)
        got: Received | None = yield from self.retrying(
            timeout_s, lambda tr, t: tr.receive_into(ns, keys, sinks, prefix_only, t)
        )
        return got

    def landed(self, got: Received, keys: Sequence[bytes], destinations: Sequence[object]) -> list[bool]:
        """get_into's answer from receive_into: payloads that landed in their destinations were
        verified there; damaged ones are misses (counted); blocks received elsewhere (no sink, or not
        the destination's size) are verified and copied as by the lease path.

        Raises:
            ValueError, TypeError: see copy_payload_into.
        """
        for index, (tier, why) in got.damaged.items():
            log.error("block %s from tier %s failed verification, treating as a miss: %s", keys[index].hex(), tier, why)
            self.count_corrupt()
        rest = [got.found.get(i) for i in range(len(keys))]
        checked = verified(rest, keys, self.count_corrupt)
        copy_into(checked, destinations)
        return [i in got.landed or checked[i] is not None for i in range(len(keys))]

    def lease(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        prefix_only: bool,
        timeout_s: float | None,
        verify: bool = True,
    ) -> Steps[Held]:
        """leased()'s start: each key's verified block (with verify=False, leased views are left for
        the caller to verify where it copies them), read in place where the transport can."""
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        if not keys:
            return Held(LeasedBlocks())
        ns = namespace_name(namespace)
        transport = yield GetTransport()
        if not hasattr(transport, "lease"):  # a transport without in-place reads
            return Held(LeasedBlocks((yield from self.get_many(ns, keys, prefix_only, timeout_s))))
        got: Leased = yield from self.retrying(timeout_s, lambda tr, t: tr.lease(ns, keys, prefix_only, t))
        try:
            # verify=False: leased views are left to the caller; copies this client received are checked.
            views = [i < len(got.in_place) and got.in_place[i] and not verify for i in range(len(got.blocks))]
            rest = [None if v else b for b, v in zip(got.blocks, views, strict=True)]
            checked = verified(rest, keys, self.count_corrupt)
            blocks = LeasedBlocks(
                memoryview(b[0]) if v and b is not None else c
                for b, v, c in zip(got.blocks, views, checked, strict=True)
            )
            blocks.expires_at = got.expires_at
        except BaseException:
            yield _release(got.ids)
            raise
        return Held(blocks, got)

    @staticmethod
    def unlease(held: Held) -> Steps[None]:
        """leased()'s end, however its block ended: the views released (unless something still holds
        a buffer of them: they stay readable), then the leases (the transport's release runs to its
        end, on the asyncio face whatever becomes of the caller)."""
        got = held.leased
        if got is None:
            return
        for block, in_place in zip(held.blocks, got.in_place, strict=False):
            if block is not None and in_place:
                with contextlib.suppress(BufferError):
                    block.release()
        yield _release(got.ids)

    def delete(self, namespace: NamespaceLike, keys: Sequence[bytes], timeout_s: float | None) -> Steps[int]:
        timeout_s = call_timeout_s(timeout_s, self.timeout_s)
        if not keys:
            return 0
        ns = namespace_name(namespace)
        deleted: int = yield from self.retrying(timeout_s, lambda tr, t: tr.delete(ns, keys, t))
        return deleted

    def stats(self, timeout_s: float | None) -> Steps[ServerStats]:
        stats: ServerStats = yield from self.retrying(
            call_timeout_s(timeout_s, self.timeout_s), lambda tr, t: tr.stats(t)
        )
        return stats

    def put_tensors(
        self,
        namespace: NamespaceLike,
        keys: Sequence[bytes],
        tensors: Sequence[torch.Tensor],
        layout: Layout,
        timeout_s: float | None,
        retain_ttl_s: float | None = None,
    ) -> Steps[PutResult]:
        from kvcache_client.tensors import tensor_block_parts

        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        retain_ttl(retain_ttl_s)  # checked before any tensor is encoded
        # Headers without checksums: the server seals them where it can (same host), else put_payloads here.
        parts = [tensor_block_parts(t, k, layout, checksum=False) for k, t in zip(keys, tensors, strict=True)]
        headers, payloads = [h for h, _ in parts], [p for _, p in parts]
        return (yield from self.put_payloads(namespace, keys, payloads, timeout_s, retain_ttl_s, headers))

    def get_tensors(
        self, namespace: NamespaceLike, keys: Sequence[bytes], prefix_only: bool, timeout_s: float | None
    ) -> Steps[list[torch.Tensor | None]]:
        from kvcache_client.tensors import block_to_tensor

        blocks = yield from self.get_many(namespace, keys, prefix_only, timeout_s)
        return [None if b is None else block_to_tensor(b, verify=False) for b in blocks]
