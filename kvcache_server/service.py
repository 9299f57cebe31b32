"""The kvcache.v1.KVCache gRPC service: request validation and status codes, nothing else.

Each handler checks what the client sent, answers a precise status for what is wrong (see
proto/kvcache/v1/kvcache.proto), and hands valid work to its pipeline, one module per direction,
whose stages a reader can follow (kvcache_server.pipeline):

    Put      pipeline.put      receive -> assemble -> verify -> commit
    Get      pipeline.get      locate -> lease -> send
    Arena*   pipeline.inplace  (same host) reserve -> the client writes -> verify in place -> commit
    Lease*   pipeline.inplace  (same host) lease -> the client verifies and reads in place -> release
    Prefetch kvcache_server.prefetch  locate -> queue -> (background) get with promotion

Work per call is bounded (docs/limits.md): what a call holds in flight counts against one
MemoryBudget (kvcache_server.budget) before it is allocated or as soon as it exists; a Put
message is decoded no further than the stream's block limit allows, large ones off the event
loop, and large blocks are verified off it too; a Get fetches from lower tiers window by window
and sends each window before fetching the next; a Put stream that goes quiet, or a Get whose
client stops reading, is cut off with DEADLINE_EXCEEDED and what it held is released. Blocks are
copied into the RAM tier's arena on commit (docs/arena.md); Get replies view leased arena slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc

from kvcache_core.keys import KEY_BYTES
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import current_principal
from kvcache_server.budget import Holding, MemoryBudget
from kvcache_server.bulk import BulkListener
from kvcache_server.config import LimitsSection
from kvcache_server.events import SubscriberOverflow, TooManySubscribers
from kvcache_server.handoff import PREFIX as HANDED_PREFIX
from kvcache_server.handoff import PROCESS_PREFIX, HandoffListener
from kvcache_server.observe import NullObserver, Observer
from kvcache_server.pipeline import Counters
from kvcache_server.pipeline.get import BlockSizes, GetStages
from kvcache_server.pipeline.inplace import InPlaceRPCs
from kvcache_server.pipeline.put import PutStages
from kvcache_server.prefetch import Prefetcher, PrefetchLimits
from kvcache_server.procmem import ProcessReads
from kvcache_server.shm import (
    ShmDirectory,
    ShmError,
)
from kvcache_server.stack import TierStack
from kvcache_server.tiers.base import TierStats

log = logging.getLogger(__name__)

MAX_NAMESPACE_BYTES = 128
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCache"].full_name
# TierStats travels field by field under the same names; `kind` is `tier` on the wire.
_TIER_STATS_FIELDS = [f for f in dataclasses.fields(TierStats) if f.name != "kind"]


_CUT_OFF_GRACE_S = 1.0
"""How long a cut-off call waits for its status to be sent before it ends without waiting."""

_BULK_STATS = ("bulk_bytes_received", "bulk_bytes_sent", "bulk_connections", "bulk_errors", "bulk_cut_off")


class KVCacheService(InPlaceRPCs, PutStages, GetStages, pb_grpc.KVCacheServicer):
    """Validates requests and hands them to the pipelines: kvcache_server.pipeline.put (Put),
    .get (Get), .inplace (ArenaReserve/ArenaCommit, LeaseGet/LeaseRelease)."""

    def __init__(
        self,
        stack: TierStack,
        limits: LimitsSection,
        *,
        version: str,
        observer: Observer | None = None,
        shm: ShmDirectory | None = None,
        lease_timeout_s: float = 30.0,
        prefetch: PrefetchLimits | None = None,
    ) -> None:
        self._stack = stack
        self.lease_timeout_s = lease_timeout_s
        self.inplace_bytes_received = 0  # blocks committed from arena reservations
        self.inplace_bytes_leased = 0  # blocks read in place under leases
        self._shm = shm
        self._observer = observer or NullObserver()
        self._limits = limits
        self._version = version
        self._started = time.monotonic()
        self._counters = Counters()
        self.budget = MemoryBudget(
            limits.inflight_bytes,
            limits.admission_wait_s,
            call_share=limits.inflight_call_share_bytes,
            call_cap=limits.inflight_call_bytes,
            tenant_cap=limits.inflight_tenant_bytes,
        )
        self.block_sizes = BlockSizes()  # namespace -> largest block seen (Get windows, here and bulk)
        self.cut_off = 0  # Put streams gone quiet and Gets not read, ended by the server
        self.bulk: BulkListener | None = None  # the bulk path, advertised in Info (set by the app)
        self.handoff: HandoffListener | None = None  # the segment socket, advertised in Info (set by the app)
        # Prefetch's queue and workers (their tasks started by the app: start_prefetch)
        self.prefetcher = Prefetcher(stack, prefetch or PrefetchLimits(), self.budget, self.block_sizes)

    def counters(self) -> dict[str, int]:
        """Service-level counters, for metrics."""
        return {
            "failed_requests": self._failed_requests(),
            "put_checksum_failures": self._counters.put_checksum_failures,
            "sealed_blocks": self._counters.sealed_blocks,
            "sealed_too_late": self._counters.sealed_too_late,
            "shm_bytes_received": self._counters.shm_bytes_received,
            "shm_bytes_sent": self._counters.shm_bytes_sent,
            "inplace_bytes_received": self.inplace_bytes_received,
            "inplace_bytes_leased": self._bytes_leased(),
            "inflight_bytes": self.budget.used,
            "inflight_peak_bytes": self.budget.peak,
            "inflight_refused": self.budget.refused,
            "cut_off_calls": self.cut_off,
            **{f"arena_{name}": n for name, n in self._stack.ram.arena_stats().items()},
            **dict.fromkeys(_BULK_STATS, 0),
            **self._bulk_stats(),
            **dict.fromkeys(
                ("bulk_puts", "bulk_gets", "bulk_leases", "bulk_releases", "bulk_lookups", "bulk_touches"), 0
            ),
            **self._bulk_requests(),
            **self._retention_prefetch_stats(),
        }

    def _retention_prefetch_stats(self) -> dict[str, int]:
        """The server-wide retention and prefetch counters (Stats and metrics)."""
        retention = self._stack.ram.retention_stats()
        prefetch = self.prefetcher.counters.snapshot()
        return {
            "retention_refused": retention["refused"],
            "retention_expired": retention["expired"],
            **{f"prefetch_{name}": n for name, n in prefetch.items()},
        }

    # -- validation ---------------------------------------------------------------------------

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
        self._counters.failed_requests += 1
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    @staticmethod
    def _tenant() -> str | None:
        """The caller's tenant (its share of the in-flight budget), None without auth."""
        principal = current_principal.get()
        return principal.tenant if principal is not None else None

    async def _cut_off(self, context: grpc.aio.ServicerContext, why: str, held: Holding | None = None) -> NoReturn:
        """Ends a call whose peer went quiet (DEADLINE_EXCEEDED), releasing what it held first.

        The status travels behind the replies the client has not read, so sending it can wait
        for as long as the client does: after _CUT_OFF_GRACE_S the handler stops waiting for it
        and ends (gRPC then cancels the stream), so a client that reads nothing holds no task.
        """
        self.cut_off += 1
        if held is not None:
            held.release_all()
        self._counters.failed_requests += 1
        try:
            async with asyncio.timeout(_CUT_OFF_GRACE_S):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{why}: the call is cut off")
        except TimeoutError:
            raise asyncio.CancelledError(f"cut off: {why}") from None
        raise AssertionError("unreachable: context.abort raises")

    async def _namespace(self, context: grpc.aio.ServicerContext, namespace: str) -> str:
        """The validated namespace, scoped by the caller's tenant: "<tenant>:<namespace>" with auth on.

        Every tier stores the scoped name, so tenants with identical namespaces and keys never
        meet: another tenant's blocks are not hidden, they are looked for in another place.
        """
        if not namespace:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "namespace is required")
        if (
            len(namespace) > MAX_NAMESPACE_BYTES
            or not namespace.isascii()
            or not namespace.isprintable()
            or " " in namespace
            or ":" in namespace
        ):
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"namespace must be 1..{MAX_NAMESPACE_BYTES} printable ASCII characters without spaces or ':'",
            )
        principal = current_principal.get()
        scoped = f"{principal.tenant}:{namespace}" if principal is not None else namespace
        # One shared str per namespace (interned strings are freed with their last reference):
        # index entries then point at one object instead of one copy per request.
        return sys.intern(scoped)

    async def _keys(self, context: grpc.aio.ServicerContext, keys: Sequence[bytes]) -> list[bytes]:
        if not keys:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "keys must not be empty")
        if len(keys) > self._limits.max_keys_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys exceed max_keys_per_request={self._limits.max_keys_per_request}",
            )
        out = list(keys)
        for i, key in enumerate(out):
            if len(key) != KEY_BYTES:
                await self._abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"keys[{i}] is {len(key)} bytes; a chunk key is {KEY_BYTES} bytes",
                )
        return out

    # -- RPCs ---------------------------------------------------------------------------------

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        # Lower tiers are awaited for a share of what the caller's deadline leaves (the rest is for
        # the answer's way back), never for a fixed time that discards hits the caller could use.
        remaining = context.time_remaining()
        answer_by = None
        if remaining is not None:
            answer_by = asyncio.get_running_loop().time() + remaining * self._limits.lookup_deadline_share
        tiers = await self._stack.lookup(namespace, keys, answer_by=answer_by)
        self._observer.lookup(namespace, len(keys), len(tiers))
        return pb.LookupResponse(prefix_length=len(tiers), tiers=[int(t) for t in tiers])

    async def Put(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.PutResponse:
        segments: dict[str, tuple[int, int]] = {}  # open shm segments: name -> (fd, size)
        try:
            with self.budget.holding(self._tenant(), capped=True) as held:
                return await self._put(request_iterator, context, segments, held)
        finally:
            # No worker thread still reads through these: _read_shm_blocks waits for its thread even
            # when the call is cancelled (and the thread reads through its own duplicates).
            for fd, _ in segments.values():
                os.close(fd)

    def _process_reads(self, name: str) -> ProcessReads | None:
        """A registered client process's read threads (kvcache_server.procmem), by its name."""
        return self.handoff.registry.reads(name) if self.handoff is not None else None

    def _open_segment(self, name: str, *, writable: bool) -> tuple[int, int]:
        if name.startswith((HANDED_PREFIX, PROCESS_PREFIX)):  # handed over the segment socket (handoff.py)
            if self.handoff is None:
                raise ShmError(
                    grpc.StatusCode.FAILED_PRECONDITION, "this server has no segment socket (Info.shm_socket is empty)"
                )
            return self.handoff.registry.open(name, self._tenant(), writable=writable)
        if self._shm is None:
            raise ShmError(
                grpc.StatusCode.FAILED_PRECONDITION, "this server has no shared-memory path (Info.shm_dir is empty)"
            )
        return self._shm.open_segment(name, writable=writable)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> None:
        """Streams the found blocks with context.write, so that a client that stops reading is noticed:
        a reply not taken within get_stall_timeout_s cuts the call off."""
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        segment: tuple[int, int] | None = None
        if request.HasField("shm"):
            try:
                segment = self._open_segment(request.shm.segment, writable=True)
            except ShmError as exc:
                await self._abort(context, exc.code, exc.message)
        await self._serve_get(context, namespace, keys, request, segment)

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        namespace = await self._namespace(context, request.namespace)
        keys = await self._keys(context, request.keys)
        return pb.DeleteResponse(deleted=await self._stack.delete(namespace, keys))

    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.PrefetchResponse:
        """Queues promotions into RAM of the keys a lower tier holds (kvcache_server.prefetch); answers at once."""
        namespace = await self._namespace(context, request.namespace)
        cap = self.prefetcher.limits.max_keys
        if len(request.keys) > cap:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.keys)} keys exceed prefetch.max_keys={cap}"
            )
        keys = await self._keys(context, request.keys)
        remaining = context.time_remaining()
        answer_by = None
        if remaining is not None:  # presence is asked as a Lookup asks it: within a share of the deadline
            answer_by = asyncio.get_running_loop().time() + remaining * self._limits.lookup_deadline_share
        answer = await self.prefetcher.submit(namespace, keys, self._tenant(), answer_by)
        return pb.PrefetchResponse(
            in_ram=answer.in_ram, queued=answer.queued, unknown=answer.unknown, dropped=answer.dropped
        )

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEvent]:
        hub = self._stack.events
        namespace = await self._namespace(context, request.namespace) if request.namespace else ""
        principal = current_principal.get()
        scope = f"{principal.tenant}:" if principal is not None else ""
        try:
            sub = hub.subscribe(namespace, prefix=scope, tenant=principal.tenant if principal is not None else None)
        except TooManySubscribers as exc:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            while True:
                try:
                    batch = await sub.next_batch()
                except SubscriberOverflow as exc:
                    await self._abort(
                        context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}: dropped; reconnect and resync"
                    )
                for sequence, event in batch:  # numbered per subscriber: 1, 2, 3, ... without gaps
                    yield pb.KVEvent(
                        sequence=sequence,
                        timestamp_s=event.timestamp_s,
                        kind=int(event.kind),
                        tier=int(event.tier),
                        namespace=event.namespace.removeprefix(scope),
                        keys=event.keys,
                        server_id=hub.server_id,
                    )
        finally:
            hub.unsubscribe(sub)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        arena = self._stack.ram.arena_stats()
        tiers = [
            pb.TierStats(tier=int(s.kind), **{f.name: getattr(s, f.name) for f in _TIER_STATS_FIELDS})
            for s in self._stack.stats()
        ]
        return pb.StatsResponse(
            version=self._version,
            uptime_s=time.monotonic() - self._started,
            tiers=tiers,
            put_checksum_failures=self._counters.put_checksum_failures,
            failed_requests=self._failed_requests(),
            max_block_bytes=self._limits.max_block_bytes,
            max_keys_per_request=self._limits.max_keys_per_request,
            shm_bytes_received=self._counters.shm_bytes_received,
            shm_bytes_sent=self._counters.shm_bytes_sent,
            inflight_bytes=self.budget.used,
            inflight_peak_bytes=self.budget.peak,
            inflight_refused=self.budget.refused,
            cut_off_calls=self.cut_off,
            **self._bulk_stats(),
            inplace_bytes_received=self.inplace_bytes_received,
            inplace_bytes_leased=self._bytes_leased(),
            arena_leases=arena["leases"],
            arena_reservations=arena["reservations"],
            arena_leases_expired=arena["leases_expired"],
            arena_reservations_reclaimed=arena["reservations_reclaimed"],
            **self._retention_prefetch_stats(),
        )

    def _failed_requests(self) -> int:
        """Requests answered with a non-OK status: gRPC calls, and bulk requests answered with an ERROR frame."""
        bulk = self.bulk.counters.get("errors") if self.bulk is not None else 0
        return self._counters.failed_requests + bulk

    def _bytes_leased(self) -> int:
        """Blocks read in place: under LeaseGet's leases and the bulk port's LEASE frames', and those a
        same-host client copied straight out of the arena and then named in a TOUCH frame."""
        bulk = 0
        if self.bulk is not None:
            bulk = self.bulk.counters.get("bytes_leased") + self.bulk.counters.get("bytes_touched")
        return self.inplace_bytes_leased + bulk

    def _bulk_stats(self) -> dict[str, int]:
        if self.bulk is None:
            return {}
        c = self.bulk.counters.snapshot()
        return {
            "bulk_bytes_received": c["bytes_received"],
            "bulk_bytes_sent": c["bytes_sent"],
            "bulk_connections": c["connections"],
            "bulk_errors": c["errors"],
            "bulk_cut_off": c["cut_off"],
        }

    def _bulk_requests(self) -> dict[str, int]:
        """Bulk requests answered, by frame (metrics only: Stats has no fields for them)."""
        if self.bulk is None:
            return {}
        c = self.bulk.counters.snapshot()
        return {f"bulk_{kind}": c[kind] for kind in ("puts", "gets", "leases", "releases", "lookups", "touches")}

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        principal = current_principal.get()  # the caller's tenant: only its own presence index is named
        return pb.InfoResponse(
            version=self._version,
            max_block_bytes=self._limits.max_block_bytes,
            max_keys_per_request=self._limits.max_keys_per_request,
            shm_dir=str(self._shm.path) if self._shm is not None else "",
            block_parts=True,
            bulk_port=self.bulk.port if self.bulk is not None else 0,
            bulk_host=self.bulk.advertised_host if self.bulk is not None else "",
            bulk_tls=self.bulk is not None and self.bulk.tls,
            arena_path=self._stack.ram.region.path,
            arena_bytes=self._stack.ram.region.size if self._stack.ram.region.path else 0,
            shm_socket=self.handoff.path if self.handoff is not None else "",
            server_uid=os.geteuid(),
            presence_path=self._stack.ram.presence_path(principal.tenant if principal is not None else ""),
            instance_id=self._stack.ram.instance_id,
            sealed_puts=self.handoff is not None,
            bulk_put_mem=self.bulk is not None and self.handoff is not None,
        )
