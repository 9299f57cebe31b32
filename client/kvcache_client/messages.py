"""Building and parsing the gRPC messages of both transports (sync and asyncio), shared by them.

Put messages are packed to about DEFAULT_MESSAGE_BYTES, with blocks over PARTS_ABOVE_BYTES cut into
parts; Get replies are gathered by GetCollector, with blocks that came through a shared-memory
segment resolved to views of it; the server's Info answer decides which of these a client uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvcache_client.errors import KVCacheError
from kvcache_client.results import (
    _TIER_INFO_FIELDS,
    TIER_NAMES,
    Fetched,
    LookupResult,
    PrefetchResult,
    PutResult,
    ServerStats,
    TierInfo,
    TierPutResult,
)
from kvcache_client.shm import FULL_METADATA, MIN_PUT_BYTES, SPACE_ERRNOS, Segment, ShmLink, resolve
from kvcache_client.steps import Do, Steps
from kvcache_core.blockwire import (
    BlockData,
    BlockPart,
    GetItem,
    PutData,
    ShmRange,
    data_len,
    encode_put_request,
    split_block,
)
from kvcache_core.errors import BlockFormatError
from kvcache_core.format import (
    BlockHeader,
    matched,
    parse_header_for_payload,
    payload_hasher,
)
from kvcache_proto import kvcache_pb2 as pb

DEFAULT_MESSAGE_BYTES = 4 << 20
"""Target size of one Put message: small blocks are packed up to it, larger ones go one per message."""

DEFAULT_PART_BYTES = 1 << 20
"""Size of the parts a large block travels in over gRPC (puts: when the server accepts parts)."""

PARTS_ABOVE_BYTES = 4 << 20
"""Blocks larger than this travel in parts, both ways (the server applies the same rule to gets).
Measured here: 16 MiB blocks in 1 MiB messages took about two thirds of the time of one 16 MiB
message for puts, and about half for gets in a long-running client, although the client joins the
parts (one copy); 2 MiB blocks gained nothing."""


_SHM_REF_BYTES = 64
"""What a block sent as a ShmRange adds to a Put message, about."""


def put_messages(
    namespace: str,
    items: Sequence[tuple[bytes, PutData]],
    message_bytes: int = DEFAULT_MESSAGE_BYTES,
    part_bytes: int = 0,
    retain_ttl_s: float = 0.0,
    range_bytes: int = 0,
) -> Iterator[bytes]:
    """Encoded PutRequest messages of about `message_bytes` each (the namespace and retain_ttl_s in the first);
    with `range_bytes`, a message that names this many bytes of ShmRanges takes no more blocks.

    Encoded with blockwire: each block's bytes are copied once, into the message (blocks given as
    ShmRange travel as their few bytes of reference). With `part_bytes`, a block larger than
    PARTS_ABOVE_BYTES travels in parts of `part_bytes`, one message each (Block.more; the server must
    accept parts).
    Messages are built as gRPC asks for them, so building one overlaps sending the one before.
    """
    batch: list[tuple[bytes, PutData]] = []
    size = ranged = 0
    first = True
    for key, data in items:
        n = _SHM_REF_BYTES + len(data.head) if isinstance(data, ShmRange) else data_len(data)
        r = data.block_length if isinstance(data, ShmRange) else 0
        if part_bytes and n > max(part_bytes, PARTS_ABOVE_BYTES) and not isinstance(data, ShmRange | BlockPart):
            if batch:
                yield encode_put_request(namespace if first else "", batch, retain_ttl_s if first else 0.0)
                first, batch, size = False, [], 0
            for i, part in enumerate(split_block(data, part_bytes)):
                yield encode_put_request(
                    namespace if first else "", [(key if i == 0 else b"", part)], retain_ttl_s if first else 0.0
                )
                first = False
            continue
        if batch and (size + n > message_bytes or (range_bytes and ranged >= range_bytes)):
            yield encode_put_request(namespace if first else "", batch, retain_ttl_s if first else 0.0)
            first, batch, size, ranged = False, [], 0, 0
        batch.append((key, data))
        size += n
        ranged += r
    if batch or first:
        yield encode_put_request(namespace if first else "", batch, retain_ttl_s if first else 0.0)


def lookup_result(response: pb.LookupResponse) -> LookupResult:
    return LookupResult(response.prefix_length, tuple(TIER_NAMES.get(t, "unknown") for t in response.tiers))


def prefetch_result(response: pb.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(response.in_ram, response.queued, response.unknown, response.dropped)


def put_result(response: pb.PutResponse) -> PutResult:
    tiers = tuple(TierPutResult(t.name, t.stored, t.queued, t.dropped, t.failed, t.deleted) for t in response.tiers)
    return PutResult(response.stored, response.rejected, response.bytes_received, tiers)


class GetCollector:
    """Gathers streamed GetResponse items into a list indexed like the request's keys."""

    def __init__(self, n: int) -> None:
        self.out: list[Fetched | None] = [None] * n
        self._in_segment: list[tuple[int, ShmRange, str]] = []
        self._parts: tuple[int, list[memoryview | bytes], str] | None = None  # a block arriving in parts

    @property
    def has_parts(self) -> bool:
        """A block sent in parts is being gathered."""
        return self._parts is not None

    def add(self, items: list[GetItem]) -> None:
        for item in items:
            if item.index >= len(self.out):
                raise KVCacheError(f"server sent item index {item.index} for {len(self.out)} keys")
            if self._parts is not None:
                index, chunks, tier = self._parts
                if item.index != index or not item.found or item.shm is not None:
                    raise KVCacheError(f"server interrupted block {index}, sent in parts, with another item")
                chunks.append(item.data)
                if not item.more:  # the last part: one copy joins them
                    self.out[index] = (b"".join(chunks), tier)
                    self._parts = None
                continue
            if item.more:
                if not item.found or item.shm is not None:
                    raise KVCacheError(f"server sent a part of block {item.index} without data")
                self._parts = (item.index, [item.data], TIER_NAMES.get(item.tier, "unknown"))
                continue
            if item.found:
                tier = TIER_NAMES.get(item.tier, "unknown")
                if item.shm is not None:
                    self._in_segment.append((item.index, item.shm, tier))
                else:
                    self.out[item.index] = (item.data, tier)

    @property
    def segment_bytes(self) -> int:
        """Bytes of the blocks the server wrote into the request's segment."""
        return sum(ref.length for _, ref, _ in self._in_segment)

    def resolve(self, segment: Segment | None) -> list[Fetched | None]:
        """The result, with blocks the server wrote into `segment` as views of its mapping."""
        if self._parts is not None:
            raise KVCacheError(f"Get stream ended inside block {self._parts[0]}, sent in parts")
        if not self._in_segment:
            return self.out
        if segment is None:
            raise KVCacheError("server sent a shared-memory range for a request without a segment")
        view = segment.map(max(ref.offset + ref.length for _, ref, _ in self._in_segment))
        for index, ref, tier in self._in_segment:
            if ref.segment != segment.name:
                raise KVCacheError(f"server named segment {ref.segment!r}, not this request's {segment.name!r}")
            try:
                self.out[index] = (resolve(view, ref), tier)
            except ValueError as exc:
                raise KVCacheError(str(exc)) from None
        return self.out


class LandingCollector:
    """GetCollector for get_into without a segment: a block whose key has a sink (a writable byte
    view of its payload's size, by index) is copied part by part straight into the sink, hashed
    under its key as each part lands (its header parsed from the first part, which holds it whole);
    the others are gathered as GetCollector gathers them. The answer is a bulkconn.Received."""

    def __init__(self, keys: Sequence[bytes], sinks: Sequence[memoryview | None]) -> None:
        from kvcache_client.bulkconn import Received

        self.keys, self.sinks = keys, sinks
        self.got = Received()
        self.rest = GetCollector(len(keys))
        # index, tier, header, hasher, sink, bytes filled: the block being copied into its sink
        self._landing: tuple[int, str, BlockHeader, Any, memoryview, int] | None = None
        self._failed: int | None = None  # a block refused midway: its later parts are skipped

    def add(self, items: list[GetItem]) -> None:
        for item in items:
            if item.index >= len(self.keys):
                raise KVCacheError(f"server sent item index {item.index} for {len(self.keys)} keys")
            if self._landing is not None or self._failed is not None:
                self._continue(item)
                continue
            sink = self.sinks[item.index] if item.index < len(self.sinks) else None
            if sink is None or not item.found or item.shm is not None or self.rest.has_parts:
                self.rest.add([item])
                continue
            self._first(item, sink)

    def _first(self, item: GetItem, sink: memoryview) -> None:
        tier = TIER_NAMES.get(item.tier, "unknown")
        data = memoryview(item.data)
        try:
            header = parse_header_for_payload(data, len(sink))
            hasher = payload_hasher(header, self.keys[item.index])
        except BlockFormatError:
            self.rest.add([item])  # not this sink's block (another size, a bad header): as get_many takes it
            return
        self._landing = (item.index, tier, header, hasher, sink, 0)
        self._land(data[header.header_len :], item.more)

    def _continue(self, item: GetItem) -> None:
        index = self._landing[0] if self._landing is not None else self._failed
        if item.index != index or not item.found or item.shm is not None:
            raise KVCacheError(f"server interrupted block {index}, sent in parts, with another item")
        if self._landing is None:
            if not item.more:
                self._failed = None
            return
        self._land(memoryview(item.data), item.more)

    def _land(self, piece: memoryview, more: bool) -> None:
        assert self._landing is not None
        index, tier, header, hasher, sink, filled = self._landing
        if filled + len(piece) > len(sink) or (not more and filled + len(piece) != len(sink)):
            self._refuse(index, tier, "its parts are not its header's length", more)
            return
        sink[filled : filled + len(piece)] = piece
        hasher.update(sink[filled : filled + len(piece)])  # what lies in the sink
        self._landing = (index, tier, header, hasher, sink, filled + len(piece))
        if more:
            return
        self._landing = None
        try:
            matched(header, self.keys[index], hasher.intdigest())
        except BlockFormatError as exc:
            self.got.damaged[index] = (tier, str(exc))
            return
        self.got.landed[index] = tier
        self.got.landed_bytes += header.block_len

    def _refuse(self, index: int, tier: str, why: str, more: bool) -> None:
        self._landing = None
        self.got.damaged[index] = (tier, why)
        self._failed = index if more else None

    def resolve(self) -> Any:
        if self._landing is not None or self._failed is not None:
            raise KVCacheError("Get stream ended inside a block sent in parts")
        for i, fetched in enumerate(self.rest.resolve(None)):
            if fetched is not None:
                self.got.found[i] = fetched
        return self.got


def shm_get_request(
    namespace: str, keys: Sequence[bytes], prefix_only: bool, segment: Segment | None, link: ShmLink
) -> pb.GetRequest:
    request = pb.GetRequest(namespace=namespace, keys=keys, prefix_only=prefix_only, accept_parts=True)
    if segment is not None:
        # The segment is sparse: capacity costs nothing until the server writes.
        request.shm.segment = segment.name
        request.shm.capacity = len(keys) * max(link.max_block_bytes, 1)
    return request


def shm_fallback(exc: grpc.RpcError | OSError, link: ShmLink) -> bool:
    """True when a call through a segment failed in a way that the same call inline avoids: the
    caller redoes it inline (and retires the segment); the fallback is counted on `link`.

    - OSError (this SDK's side): no room in the tmpfs for a put's segment, or a segment that cannot
      be mapped. This call only.
    - RESOURCE_EXHAUSTED with FULL_METADATA: the server had no room in its tmpfs for a get's blocks.
      This call only: a full tmpfs passes, and other calls may fit.
    - FAILED_PRECONDITION: the server cannot find or use segments at all (another host, another
      directory, no shm path); the path is switched off for this client.
    """
    if isinstance(exc, OSError):
        what = "no room" if exc.errno in SPACE_ERRNOS else "cannot use a segment"
        link.fallback(f"{what} in {link.directory} for this call: {exc}")
        return True
    code = exc.code()
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and FULL_METADATA in tuple(exc.trailing_metadata() or ()):
        link.fallback(exc.details() or "no room in the server's shared-memory directory")
        return True
    if code is not grpc.StatusCode.FAILED_PRECONDITION:
        return False
    reason = exc.details() or "the server cannot use shared memory"
    link.fallback(reason)
    link.off(reason)
    return True


def through_segment(link: ShmLink, segment: Segment | None, send: Callable[[Segment | None], Any]) -> Steps[Any]:
    """A call through `segment` (send(segment): a put or get through this client's segment), redone
    inline (send(None)) when it fails in a way the inline call avoids (shm_fallback); without a
    segment, inline at once. The segment is retired unless its call completed: after a deadline or
    a cancellation the server may still be reading or writing it. Both transports drive these steps
    (kvcache_client.steps); `send` is theirs.

    Raises:
        grpc.RpcError, OSError: what the call raised, when it is not a fallback.
    """
    if segment is not None:
        completed = False
        try:
            result = yield Do(lambda: send(segment))
            completed = True
            return result
        except (OSError, grpc.RpcError) as exc:  # OSError: no room in the tmpfs, or a segment that cannot be mapped
            if not shm_fallback(exc, link):
                raise
        finally:
            link.done(segment, completed)  # retired unless the call completed
    return (yield Do(lambda: send(None)))


PROCESS_MESSAGE_BYTES = 64 << 20
"""A put out of this process's memory stops adding blocks to a message once it names this many
bytes: what the server reserves and reads at once (in a few threads), so a large put never needs
all its room at once."""


def through_process(
    link: ShmLink,
    items: Sequence[tuple[bytes, BlockData]],
    send: Callable[[list[tuple[bytes, ShmRange]]], Any],
    otherwise: Callable[[], Any],
) -> Steps[Any]:
    """A same-host put that the server reads out of this process's memory (send(ranges):
    kvcache_client.procmem), or otherwise() (segments, inline) when it is too small, the path is off,
    or the server refuses it in a way another path avoids. Both transports drive these steps.

    Raises:
        grpc.RpcError: what the call raised, when it is not such a refusal.
    """
    refs = link.process.ranges(items) if sum(data_len(d) for _, d in items) >= MIN_PUT_BYTES else None
    if refs is not None:
        try:
            return (yield Do(lambda: send(refs)))
        except grpc.RpcError as exc:
            if not link.process.refused(exc):
                raise
    return (yield Do(otherwise))


def apply_info(link: ShmLink, info: pb.InfoResponse | None) -> int:
    """Takes the server's Info answer (None: the server has no Info call); returns the part size
    for large blocks (0: send them whole)."""
    if info is None:
        link.off("the server has no Info call (it predates the shared-memory path)")
        return 0
    if link.needs_info:
        link.configure(info.shm_dir, info.max_block_bytes)
    link.process.sealing = info.sealed_puts
    return DEFAULT_PART_BYTES if info.block_parts else 0


def server_stats(r: pb.StatsResponse) -> ServerStats:
    return ServerStats(
        version=r.version,
        uptime_s=r.uptime_s,
        put_checksum_failures=r.put_checksum_failures,
        failed_requests=r.failed_requests,
        max_block_bytes=r.max_block_bytes,
        max_keys_per_request=r.max_keys_per_request,
        shm_bytes_received=r.shm_bytes_received,
        shm_bytes_sent=r.shm_bytes_sent,
        inflight_bytes=r.inflight_bytes,
        inflight_peak_bytes=r.inflight_peak_bytes,
        inflight_refused=r.inflight_refused,
        cut_off_calls=r.cut_off_calls,
        bulk_bytes_received=r.bulk_bytes_received,
        bulk_bytes_sent=r.bulk_bytes_sent,
        bulk_connections=r.bulk_connections,
        bulk_errors=r.bulk_errors,
        bulk_cut_off=r.bulk_cut_off,
        inplace_bytes_received=r.inplace_bytes_received,
        inplace_bytes_leased=r.inplace_bytes_leased,
        arena_leases=r.arena_leases,
        arena_reservations=r.arena_reservations,
        arena_leases_expired=r.arena_leases_expired,
        arena_reservations_reclaimed=r.arena_reservations_reclaimed,
        retention_refused=r.retention_refused,
        retention_expired=r.retention_expired,
        prefetch_queued=r.prefetch_queued,
        prefetch_promoted=r.prefetch_promoted,
        prefetch_dropped=r.prefetch_dropped,
        prefetch_failed=r.prefetch_failed,
        tiers=tuple(TierInfo(**{name: getattr(t, name) for name in _TIER_INFO_FIELDS}) for t in r.tiers),
    )


def channel_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
