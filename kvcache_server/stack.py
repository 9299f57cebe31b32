"""The tier stack: RAM first, then lower tiers (Redis, S3), behind one seam for the RPC layer.

The gRPC service calls only this class; tiers know nothing of gRPC or of each
other. Order is fastest first:

    get     RAM ──miss──> Redis ──miss──> S3          a hit below is verified, then
                                                       promoted up (if configured)
    put     RAM, then each lower tier: synchronously (write-through) or through
            its bounded write-behind queue (write-behind)
    evict   a block evicted from RAM is queued for the first lower tier, which
            writes it unless it already holds it (demotion, if configured)
    lookup  at most one round trip per tier, only for keys the tiers above lack

Failures: a lower tier that raises TierError or exceeds its timeout is a miss
for that call, counted; its circuit breaker stops calling it after repeated
failures and probes it again after a back-off, so a dead backend does not add
its timeout to every request. Every tier call runs as a task of its own and
reports its outcome to the breaker when it ends (at the latest after the tier's
timeout_s), even if its caller stopped waiting: an RPC cancelled at its
deadline, or a Lookup that stopped waiting when its caller's deadline came near
(a miss for that Lookup). So a hung backend opens its breaker whatever the callers' deadlines.

The event loop only schedules: compression, decompression and checksum
verification of blocks run in each lower tier's small thread pool (codec
threads) unless the batch is too small to be worth the hop (_INLINE_WORK_BYTES).

Integrity: the RAM tier holds blocks verified on entry by the service, in this
process. A block read from any lower tier is decoded (decompressed) and its
checksum verified before it is served or promoted; a block that fails is
deleted from that tier, counted, and treated as a miss.

Deletes stay deleted: puts, gets (which may promote) and write-behind batches
open an operation on the DeleteFence (write_queue.py) and check it right before
each write lands; a Delete fences its keys off while it runs, drops their queued
writes, and waits (bounded by each tier's timeout_s) for lower-tier writes of
its keys that were already in flight before deleting there; a write that
outlived that wait and lands after the Delete returned is deleted again when
it ends (_landed). So no write or promotion that began before a Delete returned
stays after it (docs/tiers.md says where this weakens).

Longer than the project's ~500-line module guideline: the breaker-guarded tier calls, the delete fence's
landings and the read/write/demotion paths check each other's invariants (what lands, what a Delete waits
for) with no await in between; split across modules they would have to share private state. A split along
reads/writes belongs with the block-arena rework (issue 14), which replaces much of this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kvcache_core.breaker import BreakerState, CircuitBreaker
from kvcache_core.format import BlockFormatError, Compression, parse_header, verify_block
from kvcache_core.threads import in_pool
from kvcache_server.events import EventHub, EventKind
from kvcache_server.observe import NullObserver, Observer
from kvcache_server.tiers import codec
from kvcache_server.tiers.base import Tier, TierError, TierKind, TierStats
from kvcache_server.tiers.disk import DiskTier
from kvcache_server.tiers.ram import (
    DEFAULT_MAX_LEASE_KEYS,
    DEFAULT_MAX_LEASES,
    DEFAULT_PIN_SHARE,
    Evicted,
    Lease,
    RamTier,
    Reservation,
)
from kvcache_server.tiers.retention import RetentionLimits
from kvcache_server.write_queue import DeleteFence, PendingWrite, WriteKind, WriteQueue

log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")

_BATCH_ITEMS = 64
_BATCH_BYTES = 32 << 20

_INLINE_WORK_BYTES = 256 << 10
"""Codec work of a batch below this runs on the event loop (about 1 ms here; a thread hop costs ~0.1 ms).
Compressing or decompressing counts every byte; verifying an uncompressed block counts 1/16 of its
bytes (XXH3 is that much faster than LZ4), so blocks up to 4 MiB are verified inline. Larger batches
go to the tier's codec threads in groups of about this much work."""

_MAX_ORPHANS = 64
"""Per lower tier: calls still running that no caller waits for any more. A tier with this many is
stuck; further calls are not started (a miss, counted in errors) until some of them end."""


def codec_threads(configured: int) -> int:
    """The codec pool size of a lower tier: `configured`, or for 0 about half the CPUs (1 to 4)."""
    return configured if configured > 0 else max(1, min(4, (os.cpu_count() or 2) // 2))


def _map(fn: Callable[[T], U], items: Sequence[T]) -> list[U]:
    return [fn(x) for x in items]


def _decode_one(read: tuple[bytes | memoryview, bytes]) -> bytes | memoryview | BlockFormatError:
    stored, key = read
    try:
        return codec.decode(stored, key)
    except BlockFormatError as exc:
        return exc


def _verify_slot(view: memoryview, key: bytes) -> BlockFormatError | None:
    """Why the block read into an arena slot is not the valid block of `key`, or None (run by the disk
    tier's reader thread right after the read: DiskTier.read_into_many's check)."""
    try:
        verify_block(view, key)
    except BlockFormatError as exc:
        return exc
    return None


def _decode_cost(stored: bytes | memoryview) -> int:
    """The work of decoding a stored block, in _INLINE_WORK_BYTES units (see there)."""
    try:
        compressed = parse_header(stored).compression is not Compression.NONE
    except BlockFormatError:
        return 0  # fails at once, on the loop
    return len(stored) if compressed else len(stored) // 16


@dataclass(frozen=True, slots=True)
class PinLimits:
    """What one tenant may pin in the RAM tier's arena (RamTier's arguments of the same names)."""

    pin_share: float = DEFAULT_PIN_SHARE
    max_leases_per_tenant: int = DEFAULT_MAX_LEASES
    max_keys_per_lease: int = DEFAULT_MAX_LEASE_KEYS


class WriteMode(enum.StrEnum):
    THROUGH = "through"  # the put waits for this tier
    BEHIND = "behind"  # the put returns; a background task writes from a bounded queue


class QueueFull(enum.StrEnum):
    DROP = "drop"  # refuse the write-behind (counted); the block stays in the tiers above
    SYNC = "sync"  # write it synchronously instead (the put waits)


@dataclass(frozen=True, slots=True)
class LowerTierPolicy:
    """How the stack uses one lower tier."""

    write_mode: WriteMode = WriteMode.THROUGH
    compression: codec.CompressionMode = codec.CompressionMode.NONE
    promote: bool = True  # copy hits from this tier into the tiers above it
    timeout_s: float = 2.0  # per call, on top of the client's own socket timeouts
    lookup_timeout_s: float = 0.0  # > 0: a Lookup waits at most this long for the tier (besides its deadline)
    codec_threads: int = 0  # compression and verification threads for this tier's blocks; 0: from the CPUs
    queue_max_bytes: int = 256 << 20
    queue_full: QueueFull = QueueFull.DROP
    breaker_failures: int = 3
    breaker_reset_s: float = 2.0


@dataclass(slots=True)
class _Counters:
    errors: int = 0
    timeouts: int = 0  # calls past timeout_s, Lookups that stopped waiting, calls refused while stuck
    lookup_late_hits: int = 0  # keys found here by a Lookup call that answered after its Lookup stopped waiting
    checksum_failures: int = 0
    promotions: int = 0  # blocks copied into this tier from a lower one
    demotions: int = 0  # blocks written here after RAM evicted them
    write_errors: int = 0  # write-behind / demotion writes that failed
    late_deletes: int = 0  # keys deleted again after a write that outlived its timeout landed past a Delete
    bytes_written: int = 0  # as stored (after compression)
    bytes_read: int = 0


@dataclass(eq=False, slots=True)
class _Landing:
    """A write to a lower tier that passed the delete fence and has not finished yet."""

    namespace: str
    keys: frozenset[bytes]
    done: asyncio.Future[None]
    late: set[bytes] = field(default_factory=set)  # keys a Delete stopped waiting for (deleted again on landing)


@dataclass(eq=False, slots=True)
class _Call:
    """One call to a lower tier, run as a task of its own (see TierStack._start)."""

    op: str
    task: asyncio.Task[object] | None = None
    counted: bool = False  # already counted in errors/timeouts (a Lookup stopped waiting)
    reported: bool = False  # its timeout already reached the breaker (the call still runs: a write in a thread)
    orphaned: bool = False  # no caller waits for it any more


@dataclass(slots=True)
class _Lower:
    tier: Tier
    policy: LowerTierPolicy
    breaker: CircuitBreaker
    queue: WriteQueue
    codec: ThreadPoolExecutor  # compression, decompression, verification of this tier's blocks
    counters: _Counters = field(default_factory=_Counters)
    worker: asyncio.Task[None] | None = None
    landings: set[_Landing] = field(default_factory=set)  # writes in flight, for Deletes to wait on
    calls: set[_Call] = field(default_factory=set)  # tier calls in flight
    orphans: int = 0  # of those, calls no caller waits for any more


@dataclass(slots=True)
class TierPut:
    """What one tier took of one put's blocks: stored + queued + dropped + failed + deleted = blocks.

    Matches kvcache.v1.TierPutResult on the wire.
    """

    name: str
    kind: TierKind
    stored: int = 0  # RAM took them; written (write-through, or synchronously when the queue was full)
    queued: int = 0  # write-behind: queued for the background writer
    dropped: int = 0  # write-behind: refused, the queue was full (queue_full = "drop")
    failed: int = 0  # not taken: too large for RAM; a lower tier failed, timed out or was skipped
    deleted: int = 0  # not written: a Delete of the key ran during the put

    def count(self, written: Sequence[bool | None]) -> None:
        """Adds the outcome of a write (_write's per-item answer)."""
        for ok in written:
            if ok is None:
                self.deleted += 1
            elif ok:
                self.stored += 1
            else:
                self.failed += 1

    def add(self, other: TierPut) -> None:
        """Adds another put's counts of the same tier (the service sums a stream's messages)."""
        self.stored += other.stored
        self.queued += other.queued
        self.dropped += other.dropped
        self.failed += other.failed
        self.deleted += other.deleted


@dataclass(slots=True)
class PutOutcome:
    """What a put did: per item, whether some tier stored or queued it; per tier (RAM first), its counts."""

    kept: list[bool]
    tiers: list[TierPut]


@dataclass(slots=True)
class Found:
    """A block served by the stack and the tier it came from.

    A RAM hit is a read-only view of its arena slot under `lease`: the slot does not change until
    the caller hands the lease back (TierStack.release) or it expires after SERVE_LEASE_S."""

    data: bytes | memoryview
    tier: TierKind
    lease: Lease | None = None


RAM_OFF_LOOP_BYTES = 256 << 10
"""RAM tier writes that copy at least this many bytes (their blocks into their slots, and what they
evict copied out for demotion) copy in a worker thread, so that no put holds the event loop; below
it a thread hop costs more than the copy (about 20 us). One exception: a small bulk PUT's blocks
(at most 512 KiB, kvcache_server.bulk.session._STAGED_PUT_BYTES) are copied into their slots on the
loop, where the copy (about 40 us) replaces a trip to the loop from the session's thread."""

SERVE_LEASE_S = 600.0
"""How long the leases of a Get's RAM hits live at most: a handler releases them as soon as the
reply naming them is sent (or when it ends, whatever way), so this only bounds a bug."""


class TierStack:
    """The RAM tier and the lower tiers in order, fastest first."""

    def __init__(
        self,
        ram_capacity_bytes: int,
        lower: Sequence[tuple[Tier, LowerTierPolicy]] = (),
        *,
        demote_on_evict: bool = True,
        events: EventHub | None = None,
        observer: Observer | None = None,
        ram_quota_of: Callable[[str], int] | None = None,
        arena_dir: str | None = None,
        prefault: bool = True,
        pins: PinLimits | None = None,
        retention: RetentionLimits | None = None,
    ) -> None:
        self.events = events or EventHub()
        pins = pins or PinLimits()
        self._observer = observer or NullObserver()
        first = lower[0][0] if lower else None
        self._ram = RamTier(
            ram_capacity_bytes,
            on_evict=self._on_ram_evict,
            copy_evicted=demote_on_evict and bool(lower),  # only demotions need an evicted block's bytes
            # A victim the disk holds already (promoted from it, or demoted before) would be dropped by
            # the demotion check of _write_batch: it is not copied out at all (1 MiB memcpy per victim
            # saved; promotions into a full RAM ran 0.9 GB/s with the copies, docs/disk-benchmarks.md).
            held_below=first.holds if isinstance(first, DiskTier) else None,
            quota_of=ram_quota_of,
            arena_dir=arena_dir,
            prefault=prefault,
            pin_share=pins.pin_share,
            max_leases_per_tenant=pins.max_leases_per_tenant,
            max_keys_per_lease=pins.max_keys_per_lease,
            retention=retention,
        )
        self._ram_counters = _Counters()
        self._lower = [
            _Lower(
                tier,
                policy,
                CircuitBreaker(policy.breaker_failures, policy.breaker_reset_s),
                WriteQueue(policy.queue_max_bytes),
                ThreadPoolExecutor(
                    codec_threads(policy.codec_threads), thread_name_prefix=f"kvcache-{tier.name}-codec"
                ),
            )
            for tier, policy in lower
        ]
        self._demote = demote_on_evict and bool(self._lower)
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._loop_thread = 0
        self._late_deletes: set[asyncio.Task[None]] = set()  # deletes redone after a late write
        self._fence = DeleteFence()

    @property
    def observer(self) -> Observer:
        """Where the stack's timings go (the service's and the bulk port's Lookups report there too)."""
        return self._observer

    @property
    def ram(self) -> RamTier:
        return self._ram

    @property
    def fence(self) -> DeleteFence:
        """The delete fence (read-only use: which deletes run, how many tombstones are held)."""
        return self._fence

    @property
    def tiers(self) -> list[Tier]:
        return [self._ram, *(lo.tier for lo in self._lower)]

    async def start(self) -> None:
        """Starts one write-behind worker per lower tier. Call on the server's event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        for lower in self._lower:
            lower.worker = asyncio.create_task(self._drain_forever(lower), name=f"kvcache-writes-{lower.tier.name}")

    # -- calling a lower tier -----------------------------------------------------------------

    def _start(self, lower: _Lower, op: str, fn: Callable[..., Awaitable[object]], *args: object) -> _Call | None:
        """Starts fn(*args) against a lower tier as a task of its own; None when it is not started.

        Not started: the breaker is open (counted in skipped), or the tier has _MAX_ORPHANS calls
        running that nobody waits for (counted in timeouts). Synchronous, so a caller can register
        what the call will land before anything else runs.
        """
        if lower.orphans >= _MAX_ORPHANS:
            lower.counters.timeouts += 1
            return None
        if not lower.breaker.allow():
            return None
        call = _Call(op)
        call.task = asyncio.get_running_loop().create_task(
            self._run(lower, call, fn, args), name=f"kvcache-{lower.tier.name}-{op}"
        )
        lower.calls.add(call)
        call.task.add_done_callback(lambda _: self._ended(lower, call))
        return call

    async def _run(self, lower: _Lower, call: _Call, fn: Callable[..., Awaitable[T]], args: tuple) -> T | None:
        """The task of one tier call: fn(*args) within the tier's timeout_s. Reports the outcome to the
        breaker when it ends, whether or not a caller still waits; None when it failed."""
        name = lower.tier.name
        start = time.perf_counter()
        # A write in a thread outlives the timeout (the tier waits for it, so that Deletes can): its
        # timeout reaches the breaker at the deadline all the same.
        overdue = asyncio.get_running_loop().call_later(lower.policy.timeout_s, self._overdue, lower, call, start)
        try:
            async with asyncio.timeout(lower.policy.timeout_s):
                result = await fn(*args)
        except TimeoutError:
            if not call.reported:
                self._failed(lower, call, start, timed_out=True)
            log.warning(
                "tier %s timed out during %s after %.2fs; treating as miss", name, call.op, lower.policy.timeout_s
            )
            return None
        except TierError as exc:
            self._failed(lower, call, start, timed_out=False)
            log.warning("tier %s failed during %s; treating as miss: %s", name, call.op, exc)
            return None
        except Exception:  # a bug in a tier is a failure too: a breaker probe must always report back
            self._failed(lower, call, start, timed_out=False)
            log.exception("tier %s raised during %s; treating as miss", name, call.op)
            return None
        finally:
            overdue.cancel()
        self._observer.tier_op(name, call.op, time.perf_counter() - start, True)
        lower.breaker.success()
        return result

    def _overdue(self, lower: _Lower, call: _Call, start: float) -> None:
        if call.task is not None and not call.task.done() and not call.reported:
            call.reported = True
            self._failed(lower, call, start, timed_out=True)

    def _failed(self, lower: _Lower, call: _Call, start: float, *, timed_out: bool) -> None:
        self._observer.tier_op(lower.tier.name, call.op, time.perf_counter() - start, False)
        if not call.counted:  # a Lookup that stopped waiting counted it already
            call.counted = True
            if timed_out:
                lower.counters.timeouts += 1
            else:
                lower.counters.errors += 1
        lower.breaker.failure()

    @staticmethod
    def _ended(lower: _Lower, call: _Call) -> None:
        lower.calls.discard(call)
        if call.orphaned:
            lower.orphans -= 1

    @staticmethod
    def _orphan(lower: _Lower, call: _Call) -> None:
        assert call.task is not None
        if not call.orphaned and not call.task.done():
            call.orphaned = True
            lower.orphans += 1

    async def _wait(self, lower: _Lower, call: _Call, wait_s: float | None = None) -> object | None:
        """The started call's result, None when it failed.

        A caller cancelled meanwhile leaves the call running (shielded) until it ends or times out,
        so its outcome still reaches the breaker. With `wait_s`, a call that has not ended by then
        is a miss for this caller, counted in timeouts, and likewise goes on without it.
        """
        task = call.task
        assert task is not None
        try:
            if wait_s is None:
                return await asyncio.shield(task)
            await asyncio.wait((task,), timeout=wait_s)
        except asyncio.CancelledError:
            self._orphan(lower, call)
            raise
        if task.done():
            return task.result()
        self._orphan(lower, call)
        call.counted = True
        lower.counters.timeouts += 1
        log.warning("tier %s did not answer %s within %.2fs; treating as miss", lower.tier.name, call.op, wait_s)
        return None

    async def _call(
        self, lower: _Lower, op: str, fn: Callable[..., Awaitable[T]], *args: object, wait_s: float | None = None
    ) -> T | None:
        """Runs fn(*args) against a lower tier (_start, _wait); None when it failed, was skipped or late."""
        call = self._start(lower, op, fn, *args)
        if call is None:
            return None
        return await self._wait(lower, call, wait_s)  # type: ignore[return-value]

    def _ram_op(self, op: str, start: float) -> None:
        self._observer.tier_op(self._ram.name, op, time.perf_counter() - start, True)

    # -- CPU work off the event loop ----------------------------------------------------------

    async def _offload(self, lower: _Lower, fn: Callable[[T], U], items: Sequence[T], costs: Sequence[int]) -> list[U]:
        """fn over items: on the event loop when their total cost is below _INLINE_WORK_BYTES, else in
        the tier's codec threads, in groups of about that much work (a big batch uses every thread).

        Pure computation: if the caller is cancelled, groups not yet started are dropped and running
        ones finish unseen; whatever the results were for, the caller does it on the event loop.
        """
        if sum(costs) < _INLINE_WORK_BYTES:
            return [fn(x) for x in items]
        groups: list[list[T]] = [[]]
        work = 0
        for item, cost in zip(items, costs, strict=True):
            if work >= _INLINE_WORK_BYTES:
                groups.append([])
                work = 0
            groups[-1].append(item)
            work += cost
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(lower.codec, _map, fn, g) for g in groups))
        return [out for part in parts for out in part]

    async def _encode(self, lower: _Lower, blocks: Sequence[bytes]) -> list[bytes]:
        """The stored form of each block in this tier (compressed, if the tier compresses)."""
        mode = lower.policy.compression
        if mode is codec.CompressionMode.NONE:
            return list(blocks)
        return await self._offload(lower, lambda b: codec.encode(b, mode), blocks, [len(b) for b in blocks])

    async def _decode(
        self, lower: _Lower, read: Sequence[tuple[bytes | memoryview, bytes]]
    ) -> list[bytes | memoryview | BlockFormatError]:
        """Each (stored, key) read from this tier as its verified, uncompressed block, or why it is not one."""
        return await self._offload(lower, _decode_one, read, [_decode_cost(stored) for stored, _ in read])

    # -- writing to a lower tier --------------------------------------------------------------

    async def _write(
        self,
        lower: _Lower,
        namespace: str,
        items: Sequence[tuple[bytes, bytes]],
        what: str,
        epoch: int,
        until: Sequence[float] | None = None,
    ) -> list[bool | None]:
        """Writes the items that no Delete fenced off since the caller's fence `epoch`.

        Returns, per item: True written; False not written (the tier failed, timed out, was
        skipped by its breaker, or refused the item); None fenced off by a Delete (not sent).
        Compression comes first (off the event loop when large); then, with no await in between,
        the fence check, the start of the tier call and its registration as a landing, which
        Deletes wait for until the call ends, even if this caller is cancelled meanwhile. `until`: per
        item, the deadline it is retained to in the tier (Tier.put_retained; 0.0: plain).
        """
        out: list[bool | None] = [None] * len(items)
        if all(self._fence.blocked(epoch, namespace, key) for key, _ in items):
            return out
        encoded = await self._encode(lower, [block for _, block in items])
        live = [i for i, (key, _) in enumerate(items) if not self._fence.blocked(epoch, namespace, key)]
        if not live:
            return out
        batch = [(items[i][0], encoded[i]) for i in live]
        deadlines = [until[i] for i in live] if until is not None and any(until) else None
        call = self._start(lower, what, self._land, lower, namespace, batch, deadlines)
        if call is None:
            for i in live:
                out[i] = False
            return out
        assert call.task is not None
        landing = _Landing(namespace, frozenset(k for k, _ in batch), asyncio.get_running_loop().create_future())
        lower.landings.add(landing)
        call.task.add_done_callback(lambda _: self._landed(lower, landing))
        # The put waits at most timeout_s; the write may go on in its thread, tracked by its landing.
        done = await self._wait(lower, call, lower.policy.timeout_s)
        written = [False] * len(live) if done is None else done
        for i, ok in zip(live, written, strict=True):  # type: ignore[call-overload]
            out[i] = ok
        return out

    async def _land(
        self, lower: _Lower, namespace: str, batch: list[tuple[bytes, bytes]], until: list[float] | None
    ) -> list[bool]:
        """The tier call of a write (run by _run): stores the batch (retained until `until` where given),
        then counts and publishes what it stored."""
        if until is None:
            written = await lower.tier.put_many(namespace, batch)
        else:
            written = await lower.tier.put_retained(namespace, batch, until)
        stored = [(k, b) for (k, b), ok in zip(batch, written, strict=True) if ok]
        lower.counters.bytes_written += sum(len(b) for _, b in stored)
        self.events.publish(EventKind.STORED, lower.tier.kind, namespace, [k for k, _ in stored])
        return written

    def _landed(self, lower: _Lower, landing: _Landing) -> None:
        """A write's call ended (its thread too). If a Delete of its keys stopped waiting for it (after
        timeout_s) and deleted them, the write may have landed after that: delete them there again, so
        the Delete stays done."""
        lower.landings.discard(landing)
        if not landing.done.done():
            landing.done.set_result(None)
        if not landing.late:
            return
        task = asyncio.get_running_loop().create_task(
            self._delete_late(lower, landing.namespace, sorted(landing.late)),
            name=f"kvcache-{lower.tier.name}-redelete",
        )
        self._late_deletes.add(task)
        task.add_done_callback(self._late_deletes.discard)

    async def _delete_late(self, lower: _Lower, namespace: str, keys: list[bytes]) -> None:
        """Deletes again, past the breaker (the tier just answered), keys a late write brought back."""
        log.warning(
            "tier %s: a write of %d key(s) ended after their Delete had gone on; deleting them there again",
            lower.tier.name,
            len(keys),
        )
        try:
            async with asyncio.timeout(lower.policy.timeout_s):
                removed = await lower.tier.delete_present(namespace, keys)
            lower.counters.late_deletes += len(keys)
            # The late write published STORED when it landed; subscribers learn it is gone again.
            gone = [k for k, was in zip(keys, removed, strict=True) if was]
            self.events.publish(EventKind.REMOVED, lower.tier.kind, namespace, gone)
        except (TimeoutError, TierError) as exc:
            log.warning(
                "tier %s: deleting %d key(s) again failed (%s); they may be served again",
                lower.tier.name,
                len(keys),
                exc,
            )

    async def _settle(self, lower: _Lower, namespace: str, keys: frozenset[bytes]) -> None:
        """Waits, at most the tier's timeout_s, for its in-flight writes that hold any of `keys`."""
        landings = [w for w in lower.landings if w.namespace == namespace and not w.keys.isdisjoint(keys)]
        if not landings:
            return
        _, pending = await asyncio.wait([w.done for w in landings], timeout=lower.policy.timeout_s)
        if pending:
            for w in landings:
                if w.done in pending:
                    w.late |= w.keys & keys  # deleted again when the write ends (_landed)
            log.warning(
                "delete: %d writes to tier %s still in flight after %.1fs; deleting anyway (again when they land)",
                len(pending),
                lower.tier.name,
                lower.policy.timeout_s,
            )

    # -- reads ---------------------------------------------------------------------------------

    async def lookup(self, namespace: str, keys: Sequence[bytes], *, answer_by: float | None = None) -> list[TierKind]:
        """The tier of each key in the longest stored prefix.

        At most one call per lower tier, for the keys the tiers above lack, in order. Each is
        awaited until `answer_by` (the event loop's clock: when the caller's deadline leaves just
        enough time for the answer to reach it), at most the tier's timeout_s and, when set, its
        lookup_timeout_s. A tier that has not answered by then is a miss for this Lookup (counted
        in timeouts); its call goes on, reports to the breaker, and counts the keys it found in
        lookup_late_hits: the hits a deadline cost. While a tier's breaker is closed, what it knows
        without a backend call (S3's presence index, which late answers fill too) is used first.
        The last tier may stop asking after its first absent key: the prefix ends there.
        """
        where = await self._where(namespace, keys, answer_by, prefix=True)
        prefix: list[TierKind] = []
        for kind in where:
            if kind is None:
                break
            prefix.append(kind)
        return prefix

    def lookup_from_ram(self, namespace: str, keys: Sequence[bytes]) -> list[TierKind] | None:
        """lookup()'s answer when RAM alone decides it (RAM holds every key, or there is no tier below
        RAM), else None: then call lookup(). Thread-safe, no I/O: a bulk session's thread answers such
        a Lookup without a hop to the event loop."""
        start = time.perf_counter()
        present = self._ram.contains_many_sync(namespace, keys)
        if self._lower and not all(present):
            return None
        self._ram_op("lookup", start)
        n = next((i for i, p in enumerate(present) if not p), len(keys))
        return [TierKind.RAM] * n

    async def locate(
        self, namespace: str, keys: Sequence[bytes], *, answer_by: float | None = None
    ) -> list[TierKind | None]:
        """The highest tier holding each key (None: no tier answered present), every key asked, as
        lookup asks (the same deadlines, breakers and late-hit counts), not only a prefix (Prefetch)."""
        return await self._where(namespace, keys, answer_by, prefix=False)

    async def _where(
        self, namespace: str, keys: Sequence[bytes], answer_by: float | None, *, prefix: bool
    ) -> list[TierKind | None]:
        start = time.perf_counter()
        present = self._ram.contains_many_sync(namespace, keys)
        self._ram_op("lookup", start)
        where: list[TierKind | None] = [TierKind.RAM if p else None for p in present]
        loop = asyncio.get_running_loop()
        for depth, lower in enumerate(self._lower):
            gap = next((i for i, w in enumerate(where) if w is None), len(keys)) if prefix else 0
            # Keys before the first gap are answered; ask this tier about the unresolved rest.
            ask = [i for i in range(gap, len(keys)) if where[i] is None]
            if not ask:
                break
            if lower.breaker.state is BreakerState.CLOSED:
                known = lower.tier.known(namespace, [keys[i] for i in ask])
                for i, hit in zip(ask, known, strict=True):
                    if hit:
                        where[i] = lower.tier.kind
                ask = [i for i, hit in zip(ask, known, strict=True) if not hit]
                if not ask:
                    continue
            last = prefix and depth == len(self._lower) - 1
            contains = lower.tier.contains_prefix if last else lower.tier.contains_many
            wait_s = lower.policy.timeout_s
            if lower.policy.lookup_timeout_s > 0:
                wait_s = min(wait_s, lower.policy.lookup_timeout_s)
            if answer_by is not None:
                wait_s = max(0.0, min(wait_s, answer_by - loop.time()))
            call = self._start(lower, "lookup", contains, namespace, [keys[i] for i in ask])
            if call is None:
                continue
            found = await self._wait(lower, call, wait_s)
            if found is None and call.task is not None and not call.task.done():
                call.task.add_done_callback(lambda task, lower=lower: self._late_lookup(lower, task))
            for i, hit in zip(ask, found or [False] * len(ask), strict=True):  # type: ignore[call-overload]
                if hit:
                    where[i] = lower.tier.kind
        return where

    @staticmethod
    def _late_lookup(lower: _Lower, task: asyncio.Task[object]) -> None:
        """A Lookup's call to `lower` that answered after the Lookup stopped waiting: its hits were lost."""
        if not task.cancelled() and task.exception() is None and isinstance(found := task.result(), list):
            lower.counters.lookup_late_hits += sum(1 for hit in found if hit)

    def lease(self, namespace: str, keys: Sequence[bytes], ttl_s: float) -> list[Lease | None]:
        """Read leases on the blocks RAM holds, for in-place gets (kvcache_server.pipeline.inplace,
        and the bulk path's LEASE frames from a session's thread: thread-safe).

        Misses are not counted: the client asks get() for them next, which counts them."""
        start = time.perf_counter()
        leases = self._ram.lease_many(namespace, keys, ttl_s, count_misses=False)
        self._ram_op("lease", start)
        read = sum(lease.length for lease in leases if lease is not None)
        self._ram_counters.bytes_read += read  # one add, no call between its read and its write:
        return leases  # the bulk path's LEASE calls this from its session thread

    def get_all_from_ram(self, namespace: str, keys: Sequence[bytes]) -> list[Found | None] | None:
        """get()'s answer when RAM holds every key (under the server's own leases: release() them
        once sent), else None with nothing changed: then call get(). Thread-safe and never on the
        event loop's side: a bulk session's thread answers a Get of RAM hits with no hop to the
        loop and back (two thread wake-ups, most of a small Get's cost)."""
        start = time.perf_counter()
        leases = self._ram.lease_all(namespace, keys, SERVE_LEASE_S)
        if leases is None:
            return None
        self._ram_op("get", start)
        read = sum(lease.length for lease in leases)
        self._ram_counters.bytes_read += read  # one add, no call between its read and its write
        return [Found(lease.view, TierKind.RAM, lease) for lease in leases]

    def touch_ram(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Blocks a same-host client read straight out of the arena, counted as RAM hits and used
        (RamTier.touch_many); returns their bytes. Thread-safe, no I/O: a bulk session's TOUCH."""
        start = time.perf_counter()
        read = self._ram.touch_many(namespace, keys)
        self._ram_op("get", start)
        self._ram_counters.bytes_read += read  # one add, no call between its read and its write
        return read

    def release(self, found: Iterable[Found | None]) -> None:
        """Hands back the leases of RAM hits that get() returned (each at most once)."""
        ids = [f.lease.id for f in found if f is not None and f.lease is not None]
        if ids:
            self._ram.release(ids)

    async def get(self, namespace: str, keys: Sequence[bytes], *, promote: bool | None = None) -> list[Found | None]:
        """Each key's block from the fastest tier holding a valid copy; lower hits are promoted
        (where the tier's `promote` says so; `promote` True or False overrides it: Prefetch).

        RAM hits come under read leases: hand them back with release() once their bytes are sent.

        A Delete that runs while this get reads a lower tier does not change what it returns
        (the copy it read), but stops the promotion of those keys.
        """
        epoch = self._fence.begin()
        try:
            return await self._get(namespace, keys, epoch, promote)
        finally:
            self._fence.end(epoch)

    async def _get(
        self, namespace: str, keys: Sequence[bytes], epoch: int, promote: bool | None = None
    ) -> list[Found | None]:
        out: list[Found | None] = [None] * len(keys)
        start = time.perf_counter()
        # The server's own leases, one per position, released as each reply is sent: bounded by the
        # Get's window, not by the tenant's caps on the leases handed to clients.
        for i, lease in enumerate(self._ram.lease_many(namespace, keys, SERVE_LEASE_S, capped=False)):
            if lease is not None:
                out[i] = Found(lease.view, TierKind.RAM, lease)
                self._ram_counters.bytes_read += lease.length
        missing = [i for i, f in enumerate(out) if f is None]
        self._ram_op("get", start)
        try:
            await self._get_lower(namespace, keys, epoch, out, missing, promote)
        except BaseException:  # cancelled (a deadline, a failover cut) or failed: nobody can release them
            self.release(out)
            raise
        return out

    async def _get_lower(
        self,
        namespace: str,
        keys: Sequence[bytes],
        epoch: int,
        out: list[Found | None],
        missing: list[int],
        promote: bool | None = None,
    ) -> None:
        """Fills `out` at the `missing` indexes from the lower tiers, fastest first."""
        for depth, lower in enumerate(self._lower):
            if not missing:
                break
            passed: list[int] = []  # missed by the read into RAM: on to the next tier
            if depth == 0 and self._reads_into_ram(lower, promote):
                missing, passed = await self._get_into_ram(lower, namespace, keys, epoch, out, missing)
                if not missing:
                    missing = passed
                    continue
            stored = await self._call(lower, "get", lower.tier.get_many, namespace, [keys[i] for i in missing])
            if stored is None:
                missing = sorted(missing + passed)
                continue
            read = [(i, data) for i, data in zip(missing, stored, strict=True) if data is not None]
            lower.counters.bytes_read += sum(len(data) for _, data in read)
            # Decompressed and verified off the event loop when large; what follows runs on it again.
            blocks = await self._decode(lower, [(data, keys[i]) for i, data in read])
            decoded = {i: block for (i, _), block in zip(read, blocks, strict=True)}
            still: list[int] = []
            corrupt: list[bytes] = []
            hits: list[tuple[bytes, bytes]] = []
            for i in missing:
                block = decoded.get(i)
                if block is None:
                    still.append(i)
                    continue
                if isinstance(block, BlockFormatError):
                    lower.counters.checksum_failures += 1
                    log.error(
                        "tier %s returned a corrupt block %s/%s, deleting it: %s",
                        lower.tier.name,
                        namespace,
                        keys[i].hex(),
                        block,
                    )
                    corrupt.append(keys[i])
                    still.append(i)
                    continue
                out[i] = Found(block, lower.tier.kind)
                hits.append((keys[i], block))
            if (
                corrupt
                and await self._call(lower, "delete_corrupt", lower.tier.delete_many, namespace, corrupt) is not None
            ):
                self.events.publish(EventKind.REMOVED, lower.tier.kind, namespace, corrupt)
            if hits and (lower.policy.promote if promote is None else promote):
                await self._promote(depth, namespace, hits, epoch)
            missing = sorted(still + passed)

    def _reads_into_ram(self, lower: _Lower, promote: bool | None) -> bool:
        """Whether this get's hits in `lower` are read straight into RAM arena slots (_get_into_ram):
        a tier that can (the disk tier), storing blocks as they are (no compression), whose hits are
        promoted, with the stack started (the loop runs the copies off it)."""
        return (
            isinstance(lower.tier, DiskTier)
            and lower.policy.compression is codec.CompressionMode.NONE
            and (lower.policy.promote if promote is None else promote)
            and self._loop is not None
        )

    async def _get_into_ram(
        self,
        lower: _Lower,
        namespace: str,
        keys: Sequence[bytes],
        epoch: int,
        out: list[Found | None],
        missing: list[int],
    ) -> tuple[list[int], list[int]]:
        """Promotion by reading into place: for the `missing` keys the disk tier holds, RAM slots are
        reserved first (what that evicts copied out for demotion, as a put's), the tier preads each
        block straight into its slot (one copy, disk -> slot, no fresh memory), the block is verified
        there (checksum under its key, in the reader thread right after its read), and the slots are indexed and leased
        to this get (Found with tier DISK and a lease: release() hands it back). Returns (the indexes
        left for the tier's plain path: no room in RAM, at most a quarter of it reserved at once; the
        indexes this path missed, for the next tier: not held, evicted or rewritten while read, torn,
        failed checksum (counted, and the block deleted there), or the call failed).

        Keys a Delete fenced off meanwhile are served from the copy read (as the plain path does),
        not promoted. No slot is freed while a reader thread may still write into it: the tier call
        is awaited to its end, and if this caller is cancelled first the slots are freed when it ends.
        """
        tier = lower.tier
        assert isinstance(tier, DiskTier)
        quarter = self._ram.capacity_bytes // 4  # staged slots are pinned until adopted, as _to_ram's
        chunks: list[list[tuple[int, int]]] = [[]]
        absent: list[int] = []  # not held there
        rest: list[int] = []
        size = 0
        for i, n in zip(missing, tier.lengths(namespace, [keys[i] for i in missing]), strict=True):
            if n is None:
                absent.append(i)
            elif n > quarter:
                rest.append(i)
            else:
                if chunks[-1] and size + n > quarter:
                    chunks.append([])
                    size = 0
                chunks[-1].append((i, n))
                size += n
        if not chunks[0]:
            return missing, []
        passed: list[int] = []
        for n, chunk in enumerate(chunks):
            left, missed = await self._read_into_slots(
                lower, namespace, keys, epoch, out, chunk, absent if n == 0 else []
            )
            rest += left
            passed += missed
        return sorted(rest), sorted(passed)

    async def _read_into_slots(
        self,
        lower: _Lower,
        namespace: str,
        keys: Sequence[bytes],
        epoch: int,
        out: list[Found | None],
        want: list[tuple[int, int]],
        absent: list[int],
    ) -> tuple[list[int], list[int]]:
        """_get_into_ram for one batch of (index, length) that fits in a quarter of RAM; `absent`
        (keys the tier does not hold) go along to be counted as its misses. Returns (indexes for
        the plain path, indexes missed)."""
        tier = lower.tier
        assert isinstance(tier, DiskTier)
        staged, evicted = self._ram.reserve_slots(namespace, [(keys[i], n) for i, n in want])
        ids = [r.id for r in staged if r is not None]
        try:
            await self._copy_out(evicted)
        except BaseException:  # cancelled (its thread has ended) or failed: nobody will write them
            self._ram.abandon(ids)
            raise
        finally:
            self._ram.settle(evicted)
        slots = [(i, res) for (i, _), res in zip(want, staged, strict=True) if res is not None]
        rest = [i for (i, _), res in zip(want, staged, strict=True) if res is None]
        if not slots:
            return rest + absent, []
        # The absent keys go along with an empty buffer: counted as the tier's misses, never read.
        asked = [(keys[i], res.buffer) for i, res in slots] + [(keys[i], memoryview(bytearray())) for i in absent]
        call = self._start(lower, "get", tier.read_into_many, namespace, asked, _verify_slot)
        if call is None:
            self._ram.abandon(ids)
            return rest, absent + [i for i, _ in slots]
        assert call.task is not None
        try:
            read = await self._wait(lower, call)
        except BaseException:
            call.task.add_done_callback(lambda _: self._ram.abandon(ids))  # its threads write into them until then
            raise
        try:
            landed = [(i, res, ok) for (i, res), ok in zip(slots, read or [], strict=False) if ok is not False]
            lower.counters.bytes_read += sum(res.length for _, res, _ in landed)
            good: list[tuple[int, Reservation]] = []
            corrupt: list[bytes] = []
            for i, res, ok in landed:
                if ok is not True:
                    lower.counters.checksum_failures += 1
                    log.error(
                        "tier %s returned a corrupt block %s/%s, deleting it: %s",
                        tier.name,
                        namespace,
                        keys[i].hex(),
                        ok,
                    )
                    corrupt.append(keys[i])
                elif self._fence.blocked(epoch, namespace, keys[i]):
                    out[i] = Found(bytes(res.buffer), tier.kind)  # what it read; a Delete stops the promotion
                else:
                    good.append((i, res))
            leases = self._ram.adopt_leased(namespace, [(keys[i], res) for i, res in good], SERVE_LEASE_S)
            promoted = []
            for (i, res), lease in zip(good, leases, strict=True):
                if lease is None:
                    out[i] = Found(bytes(res.buffer), tier.kind)
                else:
                    out[i] = Found(lease.view, tier.kind, lease)
                    promoted.append(keys[i])
            self._ram_counters.promotions += len(promoted)
            self.events.publish(EventKind.STORED, TierKind.RAM, namespace, promoted)
            if corrupt and await self._call(lower, "delete_corrupt", tier.delete_many, namespace, corrupt) is not None:
                self.events.publish(EventKind.REMOVED, tier.kind, namespace, corrupt)
        finally:
            self._ram.abandon(ids)  # those not adopted (adopted ones are no longer open reservations)
        return rest, absent + [i for i, _ in slots if out[i] is None]

    async def _promote(self, depth: int, namespace: str, hits: list[tuple[bytes, bytes]], epoch: int) -> None:
        """Copies blocks found at lower tier `depth` into RAM and into the lower tiers above it,
        except those a Delete fenced off since the read began (fence `epoch`)."""
        hits = [(k, b) for k, b in hits if not self._fence.blocked(epoch, namespace, k)]
        if not hits:
            return
        kept = await self._to_ram(namespace, hits, epoch)
        self._ram_counters.promotions += sum(kept)
        self.events.publish(
            EventKind.STORED, TierKind.RAM, namespace, [k for (k, _), ok in zip(hits, kept, strict=True) if ok]
        )
        hits = [(k, b) for k, b in hits if not self._fence.blocked(epoch, namespace, k)]  # a Delete meanwhile
        for upper in self._lower[:depth]:
            for key, block in hits:
                if upper.queue.offer(PendingWrite(namespace, key, block, WriteKind.PROMOTION)):
                    upper.counters.promotions += 1
                else:
                    upper.queue.dropped += 1

    # -- writes --------------------------------------------------------------------------------

    async def put(
        self, namespace: str, items: Sequence[tuple[bytes, bytes]], *, retain_ttl_s: float = 0.0
    ) -> PutOutcome:
        """Stores verified blocks in RAM, then in each lower tier by its write mode; with
        `retain_ttl_s` (or the configured default TTL) what RAM holds of them is retained (_retain).

        Returns, per item, whether some tier stored it or has it queued, and per tier (RAM
        first, then the lower tiers in order) how many of the items it took and how.
        """
        epoch = self._fence.begin()
        try:
            return await self._put(namespace, items, epoch, retain_ttl_s=retain_ttl_s)
        finally:
            self._fence.end(epoch)

    def _retain(self, namespace: str, items: Sequence[tuple[bytes, object]], retain_ttl_s: float) -> float:
        """Retains the put's blocks that RAM has just indexed (kvcache_server.tiers.retention), on the
        loop right after RAM took them and before the lower tiers are written, so that no wait of the
        put lets a flood evict them unretained; the RAM path itself is the same with or without it.
        Returns the deadline (time.monotonic) the lower tiers retain the put's blocks to, 0.0 for none:
        the same TTL, capped as for RAM (tiers/disk_retention.py)."""
        ttl_s = self._ram.retention_ttl(retain_ttl_s)
        if ttl_s <= 0:
            return 0.0
        if items:
            self._ram.retain_many(namespace, [key for key, _ in items], ttl_s)
        return time.monotonic() + ttl_s

    async def reserve_many(self, namespace: str, sizes: Sequence[int]) -> list[Reservation] | None:
        """Writable arena slots for blocks that a server thread writes in place (an in-place put),
        within the tenant's pin cap; None, with none kept, when RAM cannot make room for them all.

        What making room evicts is copied out for demotion in a worker thread when large (never on
        the event loop by the MiB), and only then are the slots handed out: one may lie where a
        victim's bytes were. A caller cancelled meanwhile waits for that thread before the slots are
        freed, so nothing is written over bytes still being copied."""
        made, evicted = self._ram.reserve_many(namespace, sizes)
        try:
            await self._copy_out(evicted)
        except BaseException:  # cancelled (the thread has ended) or failed: nobody will write them
            self._ram.abandon([r.id for r in made if r is not None])
            raise
        finally:
            self._ram.settle(evicted)
        slots = [r for r in made if r is not None]
        if len(slots) < len(sizes):
            self._ram.abandon([r.id for r in slots])
            return None
        return slots

    @staticmethod
    async def _copy_out(evicted: Evicted, fill: Callable[[], None] | None = None, fill_bytes: int = 0) -> None:
        """evicted.copy(), then `fill` (the call's copies into its slots, `fill_bytes` of them): in a
        worker thread when they copy RAM_OFF_LOOP_BYTES or more, awaited to its end even when the
        caller is cancelled (then the caller frees its slots: nothing reads or writes them any more)."""

        def copy() -> None:
            evicted.copy()
            if fill is not None:
                fill()

        if evicted.copy_bytes + fill_bytes < RAM_OFF_LOOP_BYTES:
            copy()
        else:
            await in_pool(None, copy)

    async def put_reserved(
        self, namespace: str, items: Sequence[tuple[bytes, Reservation]], *, retain_ttl_s: float = 0.0
    ) -> PutOutcome:
        """Stores blocks written in place into reserved arena slots (verified by the caller): RAM
        indexes each slot under its key without a copy; lower tiers get a copy of its bytes (the slot
        may be evicted and reused before a write-behind queue drains). Reservations of keys a Delete
        fenced off, or that RAM does not take, are freed."""
        epoch = self._fence.begin()
        try:
            nbytes = sum(res.length for _, res in items)
            if self._lower and nbytes >= RAM_OFF_LOOP_BYTES:  # the copies for lower tiers, off the loop
                read = self._ram.region.read  # pread: the GIL free while the kernel copies
                copies = await in_pool(None, lambda: [read(res.offset, res.length) for _, res in items])
                blocks: list[tuple[bytes, bytes | memoryview]] = [
                    (k, c) for (k, _), c in zip(items, copies, strict=True)
                ]
            else:
                blocks = [(key, bytes(res.buffer) if self._lower else res.buffer) for key, res in items]
            return await self._put(namespace, blocks, epoch, reserved=items, retain_ttl_s=retain_ttl_s)
        finally:
            self._fence.end(epoch)

    @property
    def commits_off_loop(self) -> bool:
        """Whether a put may be reserved and committed from a thread other than the event loop's
        (reserve_in_thread, commit_in_thread): RAM alone (no tier below to write or demote to) and no
        event subscriber (events are published in order on the loop)."""
        return self._loop is not None and not self._lower and not self.events.subscribers and not self._closing

    def reserve_in_thread(self, namespace: str, sizes: Sequence[int]) -> list[Reservation] | None:
        """reserve_many from a bulk session's thread, without a trip to the event loop and back (two
        thread wake-ups, a sixth of a small put's time on this 2-core VM): writable slots, within the
        tenant's pin cap; None, with nothing held, where commits_off_loop says the loop must do it or
        RAM cannot make room for them all now. What making room evicts is dropped (with no tier
        below, nothing is copied out for demotion). The slots go to commit_in_thread, or are
        abandoned (RamTier.abandon) by whoever gave up on them."""
        if not self.commits_off_loop:
            return None
        made, evicted = self._ram.reserve_many(namespace, sizes, count_refusal=False)  # the loop's try counts it
        slots = [r for r in made if r is not None]
        try:
            self._ram.settle(evicted)  # no copy to wait for: nothing is demoted without a tier below
        except BaseException:
            self._ram.abandon([r.id for r in slots])
            raise
        if len(slots) < len(sizes):
            self._ram.abandon([r.id for r in slots])
            return None
        return slots

    def commit_in_thread(self, namespace: str, items: Sequence[tuple[bytes, Reservation]]) -> PutOutcome | None:
        """put_reserved of slots that reserve_in_thread gave, from the thread that wrote and verified
        them: RAM indexes each under its key, without a copy, and retains it in the same hold of the RAM
        tier's lock (retention's default TTL); every reservation it does not index is freed, however
        this ends. None, with nothing indexed or freed, where an event subscriber came since the slots
        were reserved: the caller commits them on the loop (put_reserved), which publishes in order.

        Deletes stay deleted (DeleteFence): a Delete fences its keys off before it removes them from
        RAM, under the RAM tier's lock; here the fence is asked under that lock too, in the same hold
        as the indexing (RamTier.adopt_many's `fenced`). So either the Delete fenced the key before it
        was asked (not indexed: counted as deleted) or its removal comes after the indexing and removes
        what was indexed. The put begins where it is committed, as put_reserved's does. No STORED event
        is published from here: a subscription that lands while this runs may miss this put's (as if
        it had come a moment later), and none is ever published after the REMOVED of what it names."""
        if self.events.subscribers:
            return None
        start = time.perf_counter()
        running = self._fence.running
        fenced_keys: list[bytes] = []

        def fenced(ns: str, key: bytes) -> bool:
            if running(ns, key):
                fenced_keys.append(key)
                return True
            return False

        try:
            retain_s = self._ram.retention_ttl(0.0)
            stored = self._ram.adopt_many(namespace, items, fenced=fenced, retain_ttl_s=retain_s)
        finally:
            self._ram.abandon([res.id for _, res in items])  # those indexed are not open any more
        self._ram_op("put", start)
        written = sum(res.length for (_, res), ok in zip(items, stored, strict=True) if ok)
        self._ram_counters.bytes_written += written  # one add: no call between its read and its write
        ram = TierPut(self._ram.name, TierKind.RAM, stored=sum(stored))
        ram.deleted = len(fenced_keys)
        ram.failed = len(items) - ram.stored - ram.deleted
        return PutOutcome(stored, [ram])

    async def _put(
        self,
        namespace: str,
        items: Sequence[tuple[bytes, bytes | memoryview]],
        epoch: int,
        reserved: Sequence[tuple[bytes, Reservation]] | None = None,
        retain_ttl_s: float = 0.0,
    ) -> PutOutcome:
        start = time.perf_counter()
        kept = [False] * len(items)
        live = [i for i, (key, _) in enumerate(items) if not self._fence.blocked(epoch, namespace, key)]
        if reserved is None:
            stored = await self._to_ram(namespace, [items[i] for i in live], epoch)
        else:  # adopting copies nothing (what it replaces is not copied): on the loop, with the fence
            stored = self._ram.adopt_many(namespace, [reserved[i] for i in live])
            fenced = set(range(len(reserved))) - set(live)
            self._ram.abandon([reserved[i][1].id for i in sorted(fenced)])
        for i, ok in zip(live, stored, strict=True):
            kept[i] = ok
        self._ram_op("put", start)
        in_ram = [items[i] for i in live if kept[i]]
        until = self._retain(namespace, in_ram, retain_ttl_s)
        written = sum(len(b) for _, b in in_ram)
        self._ram_counters.bytes_written += written  # one add: no call between its read and its write
        self.events.publish(EventKind.STORED, TierKind.RAM, namespace, [k for k, _ in in_ram])
        ram = TierPut(self._ram.name, TierKind.RAM, stored=len(in_ram))
        ram.failed, ram.deleted = len(live) - len(in_ram), len(items) - len(live)
        tiers = [ram]
        for lower in self._lower:
            took = TierPut(lower.tier.name, lower.tier.kind)
            tiers.append(took)
            if lower.policy.write_mode is WriteMode.THROUGH:
                written = await self._write(lower, namespace, items, "put", epoch, [until] * len(items))
                took.count(written)
                kept = [k or bool(w) for k, w in zip(kept, written, strict=True)]
                continue
            overflow: list[int] = []
            for i, (key, block) in enumerate(items):
                if self._fence.blocked(epoch, namespace, key):
                    took.deleted += 1
                elif lower.queue.offer(PendingWrite(namespace, key, block, WriteKind.PUT, until)):
                    took.queued += 1
                    kept[i] = True
                else:
                    overflow.append(i)
            if overflow and lower.policy.queue_full is QueueFull.SYNC:
                written = await self._write(
                    lower, namespace, [items[i] for i in overflow], "put_overflow", epoch, [until] * len(overflow)
                )
                took.count(written)
                for i, ok in zip(overflow, written, strict=True):
                    kept[i] = kept[i] or bool(ok)
            elif overflow:
                lower.queue.dropped += len(overflow)
                took.dropped += len(overflow)
        return PutOutcome(kept, tiers)

    async def _to_ram(
        self, namespace: str, items: Sequence[tuple[bytes, bytes | memoryview]], epoch: int
    ) -> list[bool]:
        """Stores blocks in RAM (put_many_sync's effect). Large ones are copied into their reserved
        slots in a worker thread, and so are the copies for demotion of what a small one evicts when
        they are large (_stage_and_adopt), so nothing on the event loop copies block bytes by the MiB;
        they are indexed back on the loop, after the fence is checked again: a Delete that ran while
        they were being copied wins (their slots are freed), exactly as when all of it ran on the loop."""
        if self._loop is None:
            return self._ram.put_many_sync(namespace, items)
        if sum(len(b) for _, b in items) < RAM_OFF_LOOP_BYTES:
            # One by one, as put_many_sync: a later block may evict an earlier one of the same put.
            return [ok for item in items for ok in await self._stage_and_adopt(namespace, [item], epoch, small=True)]
        # In batches of at most a quarter of the tier: staged slots are pinned until adopted, and a
        # put larger than RAM must still keep its newest blocks (later batches evict earlier ones).
        out: list[bool] = []
        batch: list[tuple[bytes, bytes | memoryview]] = []
        size = 0
        for item in items:
            if batch and size + len(item[1]) > self._ram.capacity_bytes // 4:
                out += await self._stage_and_adopt(namespace, batch, epoch)
                batch, size = [], 0
            batch.append(item)
            size += len(item[1])
        return out + await self._stage_and_adopt(namespace, batch, epoch)

    async def _stage_and_adopt(
        self, namespace: str, items: Sequence[tuple[bytes, bytes | memoryview]], epoch: int, *, small: bool = False
    ) -> list[bool]:
        """Copies the blocks into slots, then indexes those no Delete fenced off meanwhile. Large: all
        of it in a worker thread (stage_many). Small: the slots reserved on the loop, and the copies
        (the blocks', and what reserving evicted, copied out for demotion) on it only when they come
        to less than RAM_OFF_LOOP_BYTES: a put of a few KiB may evict a block of MiBs."""
        staged: list[Reservation | None] = []
        try:
            if small:
                staged, evicted = self._ram.reserve_slots(namespace, [(key, len(block)) for key, block in items])
                try:
                    await self._copy_out(evicted, lambda: RamTier.fill(staged, items), sum(len(b) for _, b in items))
                finally:
                    self._ram.settle(evicted)
            else:
                await in_pool(None, lambda: staged.extend(self._ram.stage_many(namespace, items)))
        except BaseException:  # cancelled (the thread has ended) or failed: what it staged is freed
            self._ram.abandon([r.id for r in staged if r is not None])
            raise
        out = [False] * len(items)
        commit: list[tuple[int, Reservation]] = []
        for i, ((key, _), res) in enumerate(zip(items, staged, strict=True)):
            if res is None:
                continue
            if self._fence.blocked(epoch, namespace, key):
                self._ram.abandon([res.id])
            else:
                commit.append((i, res))
        for (i, _), ok in zip(
            commit, self._ram.adopt_many(namespace, [(items[i][0], r) for i, r in commit]), strict=True
        ):
            out[i] = ok
        return out

    def _on_ram_evict(self, namespace: str, key: bytes, block: bytes, retained_until: float = 0.0) -> None:
        """A RAM victim: published, and demoted to the first lower tier (if configured), retained there
        for what was left of its RAM retention (`retained_until`, the RAM tier's clock)."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            # An eviction in a worker thread (a large put, a bulk session's reserve_in_thread): events
            # and write queues live on the loop; nothing to do there without a subscriber or a demotion.
            if self._demote or self.events.subscribers:
                self._loop.call_soon_threadsafe(self._on_ram_evict, namespace, key, block, retained_until)
            return
        self.events.publish(EventKind.REMOVED, TierKind.RAM, namespace, [key])
        if not self._demote or self._closing or self._fence.running(namespace, key):
            return
        lower = self._lower[0]
        if not block:  # not copied: the disk holds it already (held_below); it keeps the retention
            if retained_until > 0 and isinstance(lower.tier, DiskTier):
                lower.tier.retain(namespace, [key], retained_until)
            return
        if not lower.queue.offer(PendingWrite(namespace, key, block, WriteKind.DEMOTION, retained_until)):
            lower.queue.dropped += 1

    async def _drain_forever(self, lower: _Lower) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await lower.queue.wait_ready()
            batch = lower.queue.take(_BATCH_ITEMS, _BATCH_BYTES)
            if not batch:
                continue
            # Taken: a Delete can no longer discard these writes, so they go through the fence.
            epoch = self._fence.begin()
            try:
                await self._write_batch(lower, batch, epoch)
            finally:
                self._fence.end(epoch)
                lower.queue.done()
            # The batch holds the last references to its blocks (copies of up to MiB each): freed here,
            # glibc hands each back to the kernel (madvise, munmap) on the event loop, about 4% of its
            # time under same-host puts with write-behind. Freed in a worker thread, and waited for, so
            # that the bytes freed are still bounded by the queue's cap and one batch.
            await loop.run_in_executor(lower.codec, batch.clear)

    async def _write_batch(self, lower: _Lower, batch: list[PendingWrite], epoch: int) -> None:
        by_ns: dict[str, list[PendingWrite]] = {}
        for w in batch:
            by_ns.setdefault(w.namespace, []).append(w)
        for namespace, writes in by_ns.items():
            demotions = [w for w in writes if w.kind is WriteKind.DEMOTION]
            if demotions:
                keys = [w.key for w in demotions]
                held = await self._call(lower, "demotion_check", lower.tier.contains_many, namespace, keys)
                skip = {w.key for w, h in zip(demotions, held or [], strict=False) if h}
                writes = [w for w in writes if w.key not in skip]
                kept = [w for w in demotions if w.key in skip and w.retain_until > 0]
                if kept and isinstance(lower.tier, DiskTier):  # held already: the record keeps the retention
                    for w in kept:
                        lower.tier.retain(namespace, [w.key], w.retain_until)
            if not writes:
                continue
            until = [w.retain_until for w in writes]
            written = await self._write(
                lower, namespace, [(w.key, w.block) for w in writes], "write_behind", epoch, until
            )
            demoted = [w.kind is WriteKind.DEMOTION and ok is True for w, ok in zip(writes, written, strict=True)]
            lower.counters.demotions += sum(demoted)
            lower.counters.write_errors += sum(ok is False for ok in written)

    async def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Removes keys from every tier (and their pending writes); returns the most any tier removed.

        While it runs, no write or promotion lands these keys anywhere; before deleting in a lower
        tier it waits (at most that tier's timeout_s) for writes of them already in flight there;
        after it returns, operations that began before it still do not land them (DeleteFence).
        """
        keys = list(keys)
        self._fence.deleting(namespace, keys)
        try:
            held = [k for k, here in zip(keys, self._ram.contains_many_sync(namespace, keys), strict=True) if here]
            deleted = self._ram.delete_many_sync(namespace, held)
            self.events.publish(EventKind.REMOVED, TierKind.RAM, namespace, held)
            for lower in self._lower:
                lower.queue.discard(namespace, keys)
            fenced = frozenset(keys)
            for lower in self._lower:
                await self._settle(lower, namespace, fenced)
                removed = await self._call(lower, "delete", lower.tier.delete_present, namespace, keys)
                if removed is not None:  # REMOVED names only the keys this tier held
                    deleted = max(deleted, sum(removed))
                    gone = [k for k, was in zip(keys, removed, strict=True) if was]
                    self.events.publish(EventKind.REMOVED, lower.tier.kind, namespace, gone)
            return deleted
        finally:
            self._fence.deleted(namespace, keys)

    async def wait_idle(self) -> None:
        """Waits until every write-behind queue is empty and its writer has no batch in flight."""
        for lower in self._lower:
            await lower.queue.wait_idle()

    async def probe(self) -> None:
        """Calls each lower tier whose breaker allows it, so health follows a backend even without traffic."""
        for lower in self._lower:
            await self._call(lower, "probe", lower.tier.contains_many, "_probe", [bytes(16)])

    def healthy(self, tier_name: str) -> bool:
        """Whether a lower tier is usable (its circuit breaker is closed)."""
        for lower in self._lower:
            if lower.tier.name == tier_name:
                return lower.breaker.state is BreakerState.CLOSED
        raise KeyError(tier_name)

    # -- lifecycle and stats -------------------------------------------------------------------

    async def close(self, drain_deadline_s: float = 10.0) -> int:
        """Drains write-behind queues within the deadline, then closes tiers; returns writes dropped."""
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_deadline_s
        dropped = 0
        for lower in self._lower:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lower.queue.wait_idle(), max(0.0, deadline - loop.time()))
            if lower.worker is not None:
                lower.worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lower.worker
            pending = lower.queue.abandon()
            if pending:
                log.warning(
                    "shutdown: dropped %d queued writes to tier %s (drain deadline %.1fs)",
                    pending,
                    lower.tier.name,
                    drain_deadline_s,
                )
            dropped += pending
        for lower in self._lower:  # tier calls still running (each bounded by timeout_s): stop them
            calls = [c.task for c in lower.calls if c.task is not None]
            for task in calls:
                task.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            lower.codec.shutdown(wait=False, cancel_futures=True)
        if self._late_deletes:  # deletes redone after late writes: before the tiers close
            await asyncio.wait(set(self._late_deletes), timeout=max(0.0, deadline - loop.time()))
        for tier in self.tiers:
            try:
                await tier.close()
            except TierError as exc:
                log.warning("closing tier %s: %s", tier.name, exc)
        return dropped

    def stats(self) -> list[TierStats]:
        ram = self._ram.stats()
        ram.promotions = self._ram_counters.promotions
        ram.bytes_read, ram.bytes_written = self._ram_counters.bytes_read, self._ram_counters.bytes_written
        out = [ram]
        for lower in self._lower:
            s = lower.tier.stats()
            c = lower.counters
            s.errors += c.errors + c.timeouts
            s.checksum_failures += c.checksum_failures
            s.promotions, s.demotions, s.write_errors = c.promotions, c.demotions, c.write_errors
            s.queue_depth, s.queue_bytes, s.queue_dropped = len(lower.queue), lower.queue.bytes, lower.queue.dropped
            s.breaker = lower.breaker.state.name.lower()
            s.skipped = lower.breaker.skipped
            s.bytes_written, s.bytes_read = c.bytes_written, c.bytes_read
            s.lookup_late_hits = c.lookup_late_hits
            s.healthy = lower.breaker.state is BreakerState.CLOSED
            out.append(s)
        return out
