"""KVCacheL2Adapter: kvcache below LMCache's L1, as an L2 adapter of LMCache's MP server (0.5.x).

LMCache's store controller and prefetch controller call the adapter from their own threads and
poll its three eventfds; every method here returns at once. The calls to the server run on six
lanes (kvcache_connectors.lmcache_l2.lanes), each a thread with a bounded queue:

    store     submit_store_task: one put_payloads per namespace of LMCache's buffers
    lookup    submit_lookup_and_lock_task: one leased(verify=False) per namespace; the hits stay
              held (locked). On the server's host, where its presence index answers, the answer
              comes first, on LMCache's thread, and the leases right behind it (early_lookups)
    load      submit_load_task: copies from the held blocks into LMCache's buffers, each copy
              verified where it landed; keys not held (or whose leases ran out) are read again with
              leased() and copied (get_into would refuse the whole call for one buffer of the wrong
              size; here that key alone misses)
    lease     the leases an early lookup takes right behind its answer (see _answer_early)
    waiting   loads of keys whose only locks wait for such leases (moved off the load lane)
    control   submit_unlock's releases and delete

A lock is a read lease: on the server's host (its block arena shared, docs/arena.md) the blocks of
a lookup stay views of the server's RAM slots, which the server does not reuse until the lease is
released or expires (ram.lease_timeout_s). The lookup does not read them: the load copies each one
into LMCache's buffer and checks the key-bound checksum there (kvcache_core.landing, on a few threads), so
the bytes are read once, where LMCache will use them, and the lookup costs one round trip.
Elsewhere the locked blocks are copies in this process, verified as they arrived. Either way what a
load reports loaded was verified against its key-bound checksum after its last copy. Unlock drops
one lock per key; the last lock on a lookup's blocks releases its leases on the control lane. A
release that fails only logs: the server ends the lease at its time-out anyway, so unlock always
succeeds eventually, as LMCache requires.

Failures degrade: a failed or timed-out call makes a lookup's or load's keys misses and a store
fail, counted in `counters`; after one, a breaker stops calling the server for breaker_cooldown_s
(tasks then complete at once), so a hung server costs one deadline per cooldown.

Past the project's ~500-line module guideline (about 730): one class per LMCache interface,
whose methods all share the lanes, the lock table, the breaker and the counters (the early lookups'
leases as much as the lane's); keys, locks, lanes and counters are modules of their own, and a split
of the class would pass that shared state between modules instead.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

from kvcache_client import KVCacheClient, KVCacheError
from kvcache_client.retry import NO_RETRY
from kvcache_connectors.lmcache_l2.config import KVCacheL2Config
from kvcache_connectors.lmcache_l2.counters import Counters
from kvcache_connectors.lmcache_l2.keys import KeyMapper
from kvcache_connectors.lmcache_l2.lanes import Lane, Task
from kvcache_connectors.lmcache_l2.locks import Hold, LockTable
from kvcache_core.breaker import BreakerState, CircuitBreaker
from kvcache_core.errors import BlockFormatError
from kvcache_core.format import payload_view
from kvcache_core.landing import land

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger(__name__)

# Errors of a call to the server that make a task fail or miss: the server's statuses, an
# unreachable server past the deadline, a broken socket of the bulk or shared-memory path.
CALL_ERRORS = (KVCacheError, OSError)


INLINE_LOOKUP_KEYS = 128
"""The most keys a lookup-and-lock with locks="keys" answers on LMCache's thread from the presence
index (about 2 µs a key warm, so at most ~0.3 ms; several times that right after a store); more go
to the lookup lane."""


LEASE_MIN_S = 0.05
"""The least time left of an early lookup's deadline its leases are asked with (or half the lookup's
deadline where that is less); with less, they are not asked."""

LEASE_GRACE_S = 0.25
"""How long past an early lookup's deadline a load waits for the lease lane to report its leases'
call: the call has ended by then, so the load knows whether the breaker opened."""


class ServerSkipped(Exception):
    """A call not attempted: the server failed recently and the breaker is open."""


@dataclass(slots=True)
class _State:
    """Results waiting for LMCache's controllers, and the usage's sizes; guarded by KVCacheL2Adapter._lock."""

    stores: dict[L2TaskId, L2StoreResult] = field(default_factory=dict)
    lookups: dict[L2TaskId, Bitmap] = field(default_factory=dict)
    loads: dict[L2TaskId, Bitmap] = field(default_factory=dict)
    sizes: dict[Any, int] = field(default_factory=dict)  # ObjectKey -> bytes this adapter stored (usage)


class KVCacheL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter storing chunks in kvcache. Options: KVCacheL2Config (`adapter_params`)."""

    def __init__(self, params: Mapping[str, Any] | KVCacheL2Config, l1_memory_desc: L1MemoryDesc | None = None) -> None:
        """Built by LMCache's plugin factory as cls(adapter_params, l1_memory_desc=...).

        Args:
            params: LMCache's `adapter_params` (or a KVCacheL2Config).
            l1_memory_desc: LMCache's L1 arena; unused (buffers are copied, never registered).

        Raises:
            ValueError: an unknown or invalid option (KVCacheL2Config.from_params).
        """
        config = params if isinstance(params, KVCacheL2Config) else KVCacheL2Config.from_params(params)
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self.config = config
        self.counters = Counters()
        self._keys = KeyMapper(config.namespace_extra)
        self._client = KVCacheClient(
            config.target,
            timeout_s=config.timeout_s,
            retry=NO_RETRY,
            shm=config.shm,
            bulk=config.bulk,
            token=config.token,
        )
        cooldown = config.breaker_cooldown_s
        self._breaker = CircuitBreaker(failure_threshold=1, reset_s=cooldown, max_reset_s=cooldown)
        self._breaker_lock = threading.Lock()
        # Three distinct eventfds (the interface's requirement: LMCache maps fds to adapters).
        self._store_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lookup_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._load_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._state = _State()
        self._locks = LockTable(config.max_locked_bytes)
        self._task_ids = itertools.count()
        self._closed = False
        tasks, nbytes = config.max_queued_tasks, config.max_queued_bytes
        self._stores = Lane("kvcache-l2-store", max_tasks=tasks, max_bytes=nbytes)
        self._lookups = Lane("kvcache-l2-lookup", max_tasks=tasks, max_bytes=nbytes)
        self._loads = Lane("kvcache-l2-load", max_tasks=tasks, max_bytes=nbytes)
        self._control = Lane("kvcache-l2-control", max_tasks=tasks, max_bytes=nbytes)
        # The leases behind early lookups: a lane of their own, so a lookup the lookup lane is still
        # working on (a lower tier, a slow Lookup) never delays them, nor the loads that wait for them.
        self._leases = Lane("kvcache-l2-lease", max_tasks=tasks, max_bytes=nbytes)
        # Loads that wait for such leases: behind each other, never in front of the other loads.
        self._waiting_loads = Lane("kvcache-l2-load-waiting", max_tasks=tasks, max_bytes=nbytes)
        log.info("kvcache L2 adapter: server %s (%s)", config.target, self._client)

    # -- event fds ------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_fd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_fd

    def get_load_event_fd(self) -> int:
        return self._load_fd

    # -- store ----------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Queues a put of `objects` under `keys` (LMCache keeps the buffers valid until it completes).

        Raises:
            ValueError: not one object per key.
        """
        if len(keys) != len(objects):
            raise ValueError(f"submit_store_task: {len(keys)} keys for {len(objects)} objects")
        task_id = next(self._task_ids)
        keys, objects = list(keys), list(objects)
        sizes = [obj.get_size() for obj in objects]

        def publish(ok: bool, stored: list[int]) -> None:
            new_keys, new_sizes, transferred = [], [], 0
            with self._lock:
                for i in stored:
                    first = keys[i] not in self._state.sizes
                    if first:
                        self._state.sizes[keys[i]] = sizes[i]
                        transferred += sizes[i]
                    new_keys.append(keys[i])
                    new_sizes.append(sizes[i] if first else 0)
                self._state.stores[task_id] = L2StoreResult(ok, transferred)
            self.counters.add("stored_chunks", len(stored))
            if not ok:
                self.counters.add("store_failed_tasks")
            if new_keys:
                self._notify_keys_stored(new_keys, new_sizes)
            self._signal(self._store_fd)

        def run() -> None:
            stored: list[int] = []
            ok = False
            try:
                for ns, positions, kv_keys in self._keys.group(keys):
                    payloads = [memoryview(objects[i].byte_array) for i in positions]
                    for i, payload in zip(positions, payloads, strict=True):
                        if payload.nbytes != sizes[i]:  # the object's own size: a mismatch is no put
                            raise BlockFormatError(f"chunk {i}: {payload.nbytes} bytes for {sizes[i]}")
                    # one flat uint8 block per chunk; on the same host the server checksums what it reads
                    result = self._guarded(
                        lambda ns=ns, kv_keys=kv_keys, payloads=payloads, ttl=self.config.retain_ttl_s: (
                            self._client.put_payloads(ns, kv_keys, payloads, retain_ttl_s=ttl)
                        )
                    )
                    if result.stored == len(kv_keys):
                        stored.extend(positions)
                    else:
                        log.warning("kvcache stored %d of %d chunks (task %d)", result.stored, len(kv_keys), task_id)
                ok = len(stored) == len(keys)
            except (*CALL_ERRORS, ServerSkipped) as exc:
                log.warning("kvcache store of %d chunks failed (task %d): %s", len(keys), task_id, exc)
            finally:  # always a result, even on a bug (the lane logs it)
                publish(ok, stored)

        self._submit(self._stores, Task(run=run, drop=lambda: publish(False, []), nbytes=sum(sizes)))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._state.stores = self._state.stores, {}
        return done

    # -- lookup and lock ------------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        """Queues a lookup of `keys`; each hit stays locked until submit_unlock drops it.

        `group_layout_descs` is LMCache's advisory hint; unused (sizes are checked at load).
        """
        task_id = next(self._task_ids)
        keys = list(keys)

        def publish(bitmap: Bitmap) -> None:
            with self._lock:
                self._state.lookups[task_id] = bitmap
            self._signal(self._lookup_fd)

        local = self._lock_locally(keys)
        if local is not None:  # answered here: no lane thread to wake, no call
            publish(local)
            return task_id
        early = self._answer_early(keys)
        if early is not None:  # answered here, the leases behind it queued after the answer is out
            bitmap, pending = early
            publish(bitmap)
            if pending:
                self._lease_behind_later(pending)
            return task_id

        def run() -> None:
            bitmap = Bitmap(len(keys))
            try:
                for ns, positions, kv_keys in self._keys.group(keys):
                    try:
                        self._lock_group(ns, [keys[i] for i in positions], positions, kv_keys, bitmap)
                    except (*CALL_ERRORS, ServerSkipped) as exc:  # this namespace's keys miss, locks kept
                        self.counters.add("lookup_failures")
                        log.warning("kvcache lookup of %d chunks failed (misses): %s", len(positions), exc)
            finally:
                hits = bitmap.popcount()
                self.counters.add("lookup_hits", hits)
                self.counters.add("lookup_misses", len(keys) - hits)
                publish(bitmap)

        self._submit(self._lookups, Task(run=run, drop=lambda: publish(Bitmap(len(keys)))))
        return task_id

    def _lock_locally(self, keys: list[ObjectKey]) -> Bitmap | None:
        """locks="keys": the lookup answered on the caller's thread from the presence index (see
        _located), never a call or a wait, so LMCache's loop is not held; a lane thread woken for it
        cost more than the answer (0.4 ms cold against 0.13 warm). None where the lane must ask:
        nothing is locked or counted then."""
        answers = self._located(keys, locks="keys")
        if answers is None:
            return None
        self._answered_locally(len(answers))
        bitmap = Bitmap(len(keys))
        for _, positions, _, found in answers:
            self._lock_found([keys[i] for i in positions], positions, found, bitmap)
        self._count_inline(bitmap.popcount(), len(keys))
        return bitmap

    def _located(self, keys: list[ObjectKey], *, locks: str) -> list[tuple[str, list[int], list[bytes], int]] | None:
        """Each namespace's group of `keys` with its stored prefix as the server's presence index
        (docs/presence.md) answers it, with certainty, on the caller's thread: reads of shared
        memory, about 2 µs a key (up to INLINE_LOOKUP_KEYS). None where the lane must ask (another
        lock mode, no index, an uncertain answer, many keys, the breaker not closed, closed)."""
        presence = getattr(self._client, "presence", None)
        if self.config.locks != locks or presence is None or len(keys) > INLINE_LOOKUP_KEYS or self._closed:
            return None
        with self._breaker_lock:
            if self._breaker.state is not BreakerState.CLOSED:
                return None
        answers = []
        try:
            for ns, positions, kv_keys in self._keys.group(keys):
                local = presence.prefix(ns, kv_keys)  # None while the index is not to be trusted
                if local is None or not local[1]:
                    return None
                answers.append((ns, positions, kv_keys, local[0]))
        except Exception:  # the index remapped under the read (its Info on a lane thread): the lane asks
            log.debug("kvcache L2 adapter: the presence index could not answer inline", exc_info=True)
            return None
        return answers

    def _count_inline(self, hits: int, n: int) -> None:
        """Counts a lookup of `n` keys answered on the caller's thread, `hits` of them hits."""
        self.counters.add("lookups_inline")
        self.counters.add("lookup_hits", hits)
        self.counters.add("lookup_misses", n - hits)

    def _answered_locally(self, groups: int) -> None:
        """Counts the presence index's answers used, as the client's own lookup counts one it gave."""
        presence = getattr(self._client, "presence", None)
        if presence is not None:
            presence.counters.local += groups

    def _answer_early(self, keys: list[ObjectKey]) -> tuple[Bitmap, list[tuple[str, list[bytes], Hold]]] | None:
        """locks="leases" with early_lookups: the lookup answered on the caller's thread from the
        presence index where it finds each namespace's keys all there (or the first in no tier),
        each hit locked at once on a pending hold (LockTable.lock_ahead), and the hits' leases taken
        right behind on the lease lane; a load waits for them. A hit evicted in between (one LEASE
        round trip) comes back without a block (`leases_lost`): its load reads it again, a miss if
        it is gone. Returns the answer and the pending holds to lease (_lease_behind_later); None
        where the lane must answer (see _located)."""
        if not self.config.early_lookups:
            return None
        answers = self._located(keys, locks="leases")
        # Each group all hits or none (its first key in no tier, as the lane answers it too); a hit
        # after a miss (a sliding window's chunks) is the lane's, which leases every key.
        if answers is None or any(0 < found < len(kv_keys) for _, _, kv_keys, found in answers):
            return None
        self._answered_locally(len(answers))
        pending: list[tuple[str, list[bytes], Hold]] = []
        deadline = time.monotonic() + self.config.lookup_timeout_s  # the leases', as the lane's lookup's
        # Each group found is all hits (found == its length) or none, as checked above.
        if len(answers) == 1:  # one namespace (the usual case): its positions are 0..n-1, in order
            ((ns, _, kv_keys, found),) = answers
            if found:
                pending.append((ns, kv_keys, self._locks.lock_ahead(keys, kv_keys, deadline)))
            bitmap, hits = Bitmap(len(keys), found), found  # the first `found` bits set at once
        else:
            bitmap, at = Bitmap(len(keys)), []
            for ns, positions, kv_keys, found in answers:
                if found:
                    hold = self._locks.lock_ahead([keys[i] for i in positions], kv_keys, deadline)
                    pending.append((ns, kv_keys, hold))
                    at += positions
            bitmap.batched_set(at)
            hits = len(at)
        self._count_inline(hits, len(keys))
        return bitmap, pending

    def _lease_behind_later(self, pending: list[tuple[str, list[bytes], Hold]]) -> None:
        def abandon() -> None:
            for _, _, hold in pending:
                self._locks.abandon(hold)

        self._submit(self._leases, Task(run=lambda: self._lease_behind(pending), drop=abandon))

    def _lease_behind(self, pending: list[tuple[str, list[bytes], Hold]]) -> None:
        """The leases of an early lookup's hits (lease lane), each namespace's handed to its pending
        hold; a hold no longer locked (unlocked, closed) asks nothing."""
        for ns, kv_keys, hold in pending:
            try:
                if self._locks.wanted(hold):
                    self._lease_hold(ns, kv_keys, hold)
            except (*CALL_ERRORS, ServerSkipped) as exc:  # the loads read these keys again (misses if it is down)
                self.counters.add("lookup_failures")
                log.warning("kvcache leases of %d chunks looked up failed: %s", len(kv_keys), exc)
            finally:
                self._locks.abandon(hold)  # settled or not, no load waits for it any longer

    def _lease_hold(self, ns: str, kv_keys: list[bytes], hold: Hold) -> None:
        timeout_s = hold.deadline - time.monotonic()
        if timeout_s < min(LEASE_MIN_S, self.config.lookup_timeout_s / 2):
            # The lane reached them at (or too near) the lookup's deadline: not asked, so a call given
            # a sliver of time does not fail and open the breaker on a healthy server; the loads read again.
            raise KVCacheError(f"the lookup's deadline passed before its {len(kv_keys)} leases were asked")
        stack, blocks = self._leased(ns, kv_keys, timeout_s)
        self.counters.add("leases_lost", sum(block is None for block in blocks))
        if not self._locks.settle(hold, stack, blocks):
            self._close_leases(stack)
            if self._locks.wanted(hold):  # past max_locked_bytes: hits stay hits, loads read them again
                self.counters.add("locks_not_held", sum(block is not None for block in blocks))

    def _leased(
        self, ns: str, kv_keys: list[bytes], timeout_s: float
    ) -> tuple[contextlib.ExitStack, list[memoryview | None]]:
        """The keys' blocks under read leases (verify=False: a load verifies what it copies), through
        the breaker, entered on a stack of their own that ends them; nothing held on a failure."""
        stack = contextlib.ExitStack()
        try:
            blocks = self._guarded(
                lambda: stack.enter_context(self._client.leased(ns, kv_keys, timeout_s=timeout_s, verify=False))
            )
        except BaseException:
            stack.close()
            raise
        return stack, blocks

    def _lock_found(self, keys: list[ObjectKey], positions: list[int], found: int, bitmap: Bitmap) -> None:
        """locks="keys": a lock on each of the first `found` of a group's keys (the stored prefix), its
        bit (the key's position in the task) set."""
        self._locks.lock_keys(keys[:found])
        for i in positions[:found]:
            bitmap.set(i)
        self.counters.add("key_locks", found)

    def _lock_group(
        self, ns: str, keys: list[ObjectKey], positions: list[int], kv_keys: list[bytes], bitmap: Bitmap
    ) -> None:
        """Leases one namespace's keys and takes a lock on each hit (lookup lane). Where the server's
        presence index (docs/presence.md) says the first key is in no tier, nothing is asked: LMCache
        takes the hits up to the first miss, and that group's would end at once. With locks="keys",
        the hits are the stored prefix of the group's keys (a Lookup), each locked here alone."""
        timeout_s = self.config.lookup_timeout_s
        if self.config.locks == "keys":  # a Lookup (the presence index's, where it answers) and key locks
            found = self._guarded(lambda: self._client.lookup(ns, kv_keys, timeout_s=timeout_s)).prefix_length
            self._lock_found(keys, positions, found, bitmap)
            return
        presence = getattr(self._client, "presence", None)
        if presence is not None and presence.prefix(ns, kv_keys[:1]) == (0, True):
            self.counters.add("lookups_local")
            return
        stack, blocks = self._leased(ns, kv_keys, timeout_s)
        # Leased views of the server's arena not read yet, or copies in this process: a load verifies
        # what it copies either way.
        hits, held = self._locks.lock(keys, stack, blocks, kv_keys)
        for j, block in enumerate(blocks):
            if block is not None:
                bitmap.set(positions[j])
        if not held:  # nothing found, or past max_locked_bytes: hits stay hits, loads read them again
            stack.close()
            self.counters.add("locks_not_held", hits)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._state.lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Drops one lock per key (a key without one is ignored); the last lock on a lookup's blocks
        releases their leases on the control lane. Never fails: a release the server does not get
        ends at the lease's time-out."""
        dropped, done = self._locks.unlock(keys)
        self.counters.add("unlocks", dropped)
        for hold in done:
            self._queue_release(hold)

    def _queue_release(self, hold: Hold) -> None:
        # Releases bypass the lane's caps: each one frees what a lookup pinned, and refusing it would
        # keep the server's slots until their time-out.
        self._control.submit(Task(run=lambda: self._release(hold), drop=hold.stack.close), force=True)

    def _release(self, hold: Hold) -> None:
        self._close_leases(hold.stack)

    def _close_leases(self, stack: contextlib.ExitStack) -> None:
        try:
            stack.close()
        except CALL_ERRORS as exc:  # the server expires the leases on its own
            self.counters.add("releases_failed")
            log.debug("kvcache lease release failed (the server expires them): %s", exc)

    # -- load -----------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Queues copies of `keys`' blocks into `objects` (LMCache's buffers, valid until it completes).

        Raises:
            ValueError: not one object per key.
        """
        if len(keys) != len(objects):
            raise ValueError(f"submit_load_task: {len(keys)} keys for {len(objects)} objects")
        task_id = next(self._task_ids)
        keys, objects = list(keys), list(objects)

        def publish(bitmap: Bitmap) -> None:
            loaded = bitmap.popcount()
            self.counters.add("loaded_chunks", loaded)
            if loaded < len(keys):
                self.counters.add("load_missing_chunks", len(keys) - loaded)
                self.counters.add("load_failed_tasks")
            accessed = [k for i, k in enumerate(keys) if bitmap.test(i)]
            with self._lock:
                self._state.loads[task_id] = bitmap
            if accessed:
                self._notify_keys_accessed(accessed)
            self._signal(self._load_fd)

        nbytes = sum(obj.get_size() for obj in objects)
        moved: list[bool] = []

        def run() -> None:
            if not moved and self._locks.waits(keys):
                # Leases an early lookup left behind are still on their way: this load waits for them
                # on a lane of its own, not in front of the loads whose blocks are held already.
                moved.append(True)
                self._submit(self._waiting_loads, Task(run=run, drop=drop, nbytes=nbytes))
                return
            bitmap = Bitmap(len(keys))
            try:
                again = self._load_held(keys, objects, bitmap)
                if not again:
                    return
                for ns, positions, kv_keys in self._keys.group([keys[i] for i in again]):
                    wanted = [again[p] for p in positions]
                    try:
                        self._load_fetched(ns, kv_keys, [objects[i] for i in wanted], wanted, bitmap)
                    except (*CALL_ERRORS, ServerSkipped) as exc:
                        log.warning("kvcache load of %d chunks failed (misses): %s", len(wanted), exc)
            finally:
                publish(bitmap)

        def drop() -> None:
            publish(Bitmap(len(keys)))

        self._submit(self._loads, Task(run=run, drop=drop, nbytes=nbytes))
        return task_id

    def _load_held(self, keys: list[ObjectKey], objects: list[MemoryObj], bitmap: Bitmap) -> list[int]:
        """Copies each key's held block into its buffer, all at once (kvcache_core.landing: on a few
        threads, each copy verified where it landed); returns the positions to read again (no held
        block, or leases that ran out during the copy). A wrong size or a block that fails is a miss
        (reading it again gives the same bytes)."""
        again: list[int] = []
        borrowed: list[tuple[int, Hold]] = []  # every borrow is given back, whatever happens
        jobs: list[tuple[memoryview, bytes, memoryview]] = []
        at: list[tuple[int, Hold]] = []
        try:
            for i, key in enumerate(keys):
                got = self._locks.borrow(key)  # referenced while copying: an unlock meanwhile cannot release it
                if got is None:
                    again.append(i)
                    continue
                held, index = got
                borrowed.append((i, held))
                if not held.wait(LEASE_GRACE_S):  # its leases came too late: read it again
                    again.append(i)
                    continue
                block = held.blocks[index]
                if block is None or held.expired():
                    again.append(i)
                    continue
                target = _target(block, objects[i])
                if target is not None:
                    jobs.append((block, held.kv_keys[index], target))
                    at.append((i, held))
            for (i, held), why in zip(at, land(jobs), strict=True):
                if held.expired():  # the copy outlived the leases: the slot may hold another block
                    again.append(i)
                elif why is None:
                    bitmap.set(i)
                else:  # damaged, or another key's block: a miss
                    self.counters.add("corrupt_chunks")
                    log.error("kvcache block of %s failed verification after its copy, a miss: %s", keys[i], why)
        finally:
            for _, held in borrowed:
                if self._locks.give_back(held):
                    self._queue_release(held)
        return sorted(again)

    def _load_fetched(
        self, ns: str, kv_keys: list[bytes], objects: list[MemoryObj], positions: list[int], bitmap: Bitmap
    ) -> None:
        """Reads one namespace's keys and copies each found block into its buffer, verified where it
        landed (load lane)."""
        with contextlib.ExitStack() as stack:
            blocks = self._guarded(lambda: stack.enter_context(self._client.leased(ns, kv_keys, verify=False)))
            jobs: list[tuple[memoryview, bytes, memoryview]] = []
            at: list[int] = []
            for block, kv_key, obj, i in zip(blocks, kv_keys, objects, positions, strict=True):
                target = _target(block, obj) if block is not None else None
                if target is not None:
                    jobs.append((block, kv_key, target))
                    at.append(i)
            landed = land(jobs)
            if getattr(blocks, "expired", lambda: False)():
                log.warning("kvcache load outlived its leases; %d chunks treated as misses", len(at))
                return
            for i, why in zip(at, landed, strict=True):
                if why is None:
                    bitmap.set(i)
                else:
                    self.counters.add("corrupt_chunks")
                    log.error("kvcache block failed verification after its copy, a miss: %s", why)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._state.loads.pop(task_id, None)

    # -- delete, usage, status, close ------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Queues a delete of the keys not locked now; the usage drops once the server answers."""
        deletable = [k for k in keys if not self._locks.is_locked(k)]
        if not deletable:
            return

        def run() -> None:
            removed = []
            for ns, positions, kv_keys in self._keys.group(deletable):
                try:
                    self._guarded(lambda ns=ns, kv_keys=kv_keys: self._client.delete(ns, kv_keys))
                except (*CALL_ERRORS, ServerSkipped) as exc:
                    self.counters.add("delete_failures")
                    log.warning("kvcache delete of %d chunks failed: %s", len(positions), exc)
                    continue
                removed.extend(deletable[i] for i in positions)
            with self._lock:
                sizes = {k: self._state.sizes.pop(k) for k in removed if k in self._state.sizes}
            self.counters.add("deleted_chunks", len(sizes))
            if sizes:
                self._notify_keys_deleted(list(sizes), list(sizes.values()))

        if not self._submit(self._control, Task(run=run, drop=lambda: None)):
            self.counters.add("delete_failures")

    def report_status(self) -> dict[str, Any]:
        """The counters and state. `is_healthy` is False only once closed: LMCache folds it into its
        own health, and an unreachable kvcache is a degraded L2 (misses), not a broken LMCache; the
        `breaker` field says whether the server is being called ("closed") or skipped ("open")."""
        usage = self.get_usage()
        with self._breaker_lock:
            breaker = self._breaker.state.name.lower()
        locked_keys, locked_bytes = self._locks.usage()
        return {
            "is_healthy": not self._closed,
            "type": "kvcache",
            "target": self.config.target,
            "breaker": breaker,
            "locked_keys": locked_keys,
            "locked_bytes": locked_bytes,
            "queued": {lane.name: lane.queued() for lane in self._lanes()},
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
            **self.counters.snapshot(),
        }

    def close(self) -> None:
        """Fails the queued tasks, waits for the running ones (each bounded by its deadline), releases
        every lease still held, closes the client and the eventfds. Closing twice is harmless.

        A release waits at most 5 s for the server (the SDK's cleanup deadline): against a stopped
        server, close takes that long per lookup whose locks LMCache still held.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        wait_s = max(self.config.timeout_s, self.config.lookup_timeout_s) + 1.0
        for lane in (self._stores, self._lookups, self._leases, self._loads, self._waiting_loads):
            if not lane.close(wait_s):
                log.warning("kvcache L2 adapter: a %s task still runs at close", lane.name)
        for hold in self._locks.drain():
            self._queue_release(hold)
        self._control.idle(wait_s + 5.0)
        self._control.close(wait_s)
        self._client.close()
        with self._lock:
            for fd in (self._store_fd, self._lookup_fd, self._load_fd):
                os.close(fd)

    # -- helpers --------------------------------------------------------------------------------

    def _lanes(self) -> tuple[Lane, ...]:
        return (self._stores, self._lookups, self._leases, self._loads, self._waiting_loads, self._control)

    def _submit(self, lane: Lane, task: Task) -> bool:
        if not self._closed and lane.submit(task):
            return True
        self.counters.add("refused_tasks")
        log.warning("kvcache L2 adapter: %s queue full or closed; the task completes at once", lane.name)
        task.drop()
        return False

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """Runs one call to the server through the breaker (one attempt; its deadline is the client's).

        Raises:
            ServerSkipped: the breaker is open.
            KVCacheError, OSError: the call failed (the breaker opens).
        """
        with self._breaker_lock:
            allowed = self._breaker.allow()
        if not allowed:
            self.counters.add("breaker_skips")
            raise ServerSkipped(f"server {self.config.target} failed recently (breaker open)")
        try:
            result = call()
        except CALL_ERRORS:
            with self._breaker_lock:
                opened = self._breaker.failure()
            if opened:
                log.warning(
                    "kvcache L2 adapter: server %s failed; not calling it for %.1f s",
                    self.config.target,
                    self.config.breaker_cooldown_s,
                )
            raise
        with self._breaker_lock:
            self._breaker.success()
        return result

    def _signal(self, fd: int) -> None:
        with self._lock:  # close() closes the fds under it: never a write to a reused fd number
            if not self._closed:
                os.eventfd_write(fd, 1)


def _target(block: memoryview, obj: MemoryObj) -> memoryview | None:
    """LMCache's buffer as the byte view a block's payload lands in; None (a miss, logged) when its
    size is not the payload's or the header cannot be read."""
    try:
        payload = payload_view(block)
    except BlockFormatError as exc:
        log.error("kvcache block with a malformed header, a miss: %s", exc)
        return None
    target = memoryview(obj.byte_array).cast("B")
    if len(target) != len(payload):
        log.warning("kvcache block of %d bytes for a %d-byte LMCache buffer: a miss", len(payload), len(target))
        return None
    return target
