"""KVCacheL2Adapter through LMCache's own L2AdapterInterface contract, against a real kvcache server.

Buffers are LMCache's MemoryObjs from its host allocator, keys its ObjectKeys, results its Bitmap
and L2StoreResult; completions are waited for on the adapter's eventfds, as LMCache's store and
prefetch controllers wait for them.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

from kvcache_client import KVCacheClient
from kvcache_connectors.lmcache_l2 import KVCacheL2Adapter, KVCacheL2Config
from kvcache_connectors.lmcache_l2.adapter import LEASE_GRACE_S
from kvcache_connectors.lmcache_l2.keys import KeyMapper, lmcache_namespace, scope_of
from kvcache_connectors.lmcache_l2.lanes import Task
from kvcache_server.launcher import LocalKVCacheServer
from tests.backends import sigstop
from tests.lmcache.harness import (
    CHUNK_BYTES,
    Buffers,
    bits,
    eventually,
    object_keys,
    readable,
    wait_result,
    wait_store,
)

pytestmark = pytest.mark.timeout(60)

SUBMIT_BOUND_S = 0.1
"""A submit_* call only queues: it returns within this however the server behaves (it takes a few
microseconds; the bound leaves room for a loaded CI machine's scheduling)."""


@pytest.fixture
def buffers() -> Iterator[Buffers]:
    b = Buffers()
    yield b
    b.close()


def lookup(adapter: KVCacheL2Adapter, keys: list, timeout_s: float = 10.0) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    return bits(
        wait_result(adapter.query_lookup_and_lock_result, task, adapter.get_lookup_and_lock_event_fd(), timeout_s)
    )


def load(adapter: KVCacheL2Adapter, keys: list, objects: list, timeout_s: float = 10.0) -> list[int]:
    task = adapter.submit_load_task(keys, objects)
    return bits(wait_result(adapter.query_load_result, task, adapter.get_load_event_fd(), timeout_s))


def store(adapter: KVCacheL2Adapter, keys: list, objects: list, timeout_s: float = 10.0):
    return wait_store(adapter, adapter.submit_store_task(keys, objects), timeout_s)


def damage_slot(server, key) -> None:
    """Changes 8 bytes of `key`'s block where it lies in the server's RAM, through the server's own
    writable view of its arena (no client can write it)."""
    ((ns, _, (kv_key,)),) = KeyMapper().group([key])
    ram = server.stack.ram
    (lease,) = ram.lease_many(ns, [kv_key])
    assert lease is not None
    ram.release([lease.id])
    ram.region.view[lease.offset + 4096 : lease.offset + 4104] = b"\xff" * 8


def same_bytes(a: list, b: list) -> bool:
    return all(bytes(x.byte_array) == bytes(y.byte_array) for x, y in zip(a, b, strict=True))


# -- the contract, end to end --------------------------------------------------------------------


@pytest.mark.parametrize("shm", [True, False], ids=["arena-leases", "copies"])
def test_store_lookup_lock_load_unlock_delete_usage(server, make_adapter, buffers, shm: bool) -> None:
    """The whole contract once: store, lookup-and-lock (a bitmap over stored and never-stored keys),
    load into LMCache's buffers byte-identical, unlock (the server's leases end), delete (usage per
    salt back to nothing, the keys misses), with every counter exact. shm=True: the locks are read
    leases on the server's RAM slots; shm=False: copies held in this process."""
    adapter = make_adapter(target=server.target, shm=shm, bulk=False)
    keys = object_keys(4, salt="alice")
    src = buffers.filled([1, 2, 3, 4])
    result = store(adapter, keys, src)
    assert result.is_successful() and result.bytes_transferred() == 4 * CHUNK_BYTES
    usage = adapter.get_usage()
    assert (usage.total_bytes_used, dict(usage.bytes_by_cache_salt)) == (4 * CHUNK_BYTES, {"alice": 4 * CHUNK_BYTES})
    with KVCacheClient(server.target) as probe:
        assert probe.stats().tier("ram").blocks == 4  # the bytes are kvcache's

        never = object_keys(2, first=100, salt="alice")
        assert lookup(adapter, [keys[0], never[0], keys[1], keys[2], keys[3], never[1]]) == [1, 0, 1, 1, 1, 0]
        status = adapter.report_status()
        assert status["locked_keys"] == 4 and status["locked_bytes"] > 4 * CHUNK_BYTES  # blocks: header + payload
        if shm:
            assert probe.stats().arena_leases > 0  # the locked blocks are pinned in the server's RAM

        dst = buffers.empty(4)
        assert load(adapter, keys, dst) == [1, 1, 1, 1]
        assert same_bytes(src, dst)
        adapter.submit_unlock(keys)
        assert adapter.report_status()["locked_keys"] == 0
        assert eventually(lambda: probe.stats().arena_leases == 0)

        adapter.delete(keys)
        assert eventually(lambda: adapter.get_usage().total_bytes_used == 0)
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {}
        assert probe.stats().tier("ram").blocks == 0
        assert lookup(adapter, keys) == [0, 0, 0, 0]
    counters = adapter.counters.snapshot()
    assert {k: v for k, v in counters.items() if v} == {
        "stored_chunks": 4,
        "lookup_hits": 4,
        "lookup_misses": 2 + 4,
        "loaded_chunks": 4,
        "unlocks": 4,
        "deleted_chunks": 4,
        # Same host: the last lookup's keys are gone from the presence index, which answers it on
        # the caller's thread (no LeaseGet).
        **({"lookups_inline": 1} if shm else {}),
    }


def test_retain_ttl_s_makes_every_store_a_retained_put(server, make_adapter, buffers) -> None:
    """A session that stays (issue #26), beneath LMCache: `retain_ttl_s` in the adapter's params
    retains every chunk it stores; without it none is."""
    with KVCacheClient(server.target) as probe:
        plain = make_adapter(target=server.target)
        assert store(plain, object_keys(2, salt="p"), buffers.filled([1, 2])).is_successful()
        assert probe.stats().tier("ram").retained_blocks == 0
        kept = make_adapter(target=server.target, retain_ttl_s="1h")
        assert kept.config.retain_ttl_s == 3600.0
        assert store(kept, object_keys(3, salt="k"), buffers.filled([3, 4, 5])).is_successful()
        assert probe.stats().tier("ram").retained_blocks == 3


def test_a_miss_is_a_miss(server, make_adapter, buffers) -> None:
    """Keys never stored: the lookup's bitmap is all zeros, a load of them sets no bit and leaves
    LMCache's buffers untouched, nothing is locked, and nothing counts as a failure."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(3, first=7)
    assert lookup(adapter, keys) == [0, 0, 0]
    assert adapter.report_status()["locked_keys"] == 0
    dst = buffers.empty(3)
    assert load(adapter, keys, dst) == [0, 0, 0]
    assert all(not any(bytes(obj.byte_array)) for obj in dst)
    adapter.submit_unlock(keys)  # unlocking what is not locked is a no-op
    counters = adapter.counters.snapshot()
    assert (counters["lookup_misses"], counters["load_missing_chunks"], counters["load_failed_tasks"]) == (3, 3, 1)
    assert counters["lookup_failures"] == counters["unlocks"] == 0


def test_a_first_key_the_presence_index_lacks_sends_no_lease_get(server, make_adapter, buffers) -> None:
    """Same host, no tier below RAM: a lookup whose first key the server's presence index lacks
    (docs/presence.md) is all misses without a LeaseGet: with the server's loop busy for 1 s it
    answers at once (before: it waited for the loop)."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=40)
    assert store(adapter, keys, buffers.filled([4, 5])).is_successful()
    assert lookup(adapter, keys) == [1, 1]
    adapter.submit_unlock(keys)
    server.loop.call_soon_threadsafe(time.sleep, 1.0)
    time.sleep(0.05)
    start = time.monotonic()
    assert lookup(adapter, object_keys(3, first=90)) == [0, 0, 0]
    assert time.monotonic() - start < 0.3
    assert adapter.counters.snapshot()["lookups_inline"] == 2  # both lookups: the index answered them


def test_empty_tasks_complete(server, make_adapter) -> None:
    adapter = make_adapter(target=server.target)
    assert store(adapter, [], []).is_successful()
    assert lookup(adapter, []) == []
    assert load(adapter, [], []) == []


def test_models_ranks_groups_and_salts_never_share_bytes(server, make_adapter, buffers) -> None:
    """One chunk hash under five scopes (base, another model, kv_rank, object group, salt): five
    namespaces; what is stored under one is a miss under the others, and each loads its own bytes."""
    adapter = make_adapter(target=server.target)
    scopes = [
        object_keys(1, first=5)[0],
        object_keys(1, first=5, model="org/other")[0],
        object_keys(1, first=5, rank=(2 << 24) | (1 << 16) | (2 << 8) | 1)[0],  # ComputeKVRank(2, 1, 2, 1)
        object_keys(1, first=5, group=1)[0],
        object_keys(1, first=5, salt="bob")[0],
    ]
    assert len({k.chunk_hash for k in scopes}) == 1
    namespaces = {lmcache_namespace(scope_of(k)).name for k in scopes}
    assert len(namespaces) == 5
    mapper = KeyMapper()
    assert len({mapper.group([k])[0][2][0] for k in scopes}) == 5  # the keys differ too

    assert store(adapter, scopes[:1], buffers.filled([11])).is_successful()
    assert lookup(adapter, scopes) == [1, 0, 0, 0, 0]
    adapter.submit_unlock(scopes[:1])
    src = buffers.filled([20, 21, 22, 23, 24])
    assert store(adapter, scopes, src).is_successful()
    dst = buffers.empty(5)
    assert lookup(adapter, scopes) == [1, 1, 1, 1, 1]
    assert load(adapter, scopes, dst) == [1, 1, 1, 1, 1]
    adapter.submit_unlock(scopes)
    assert same_bytes(src, dst)
    # the first store of the base key counted once, its second store added no bytes
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": 4 * CHUNK_BYTES, "bob": CHUNK_BYTES}


def test_namespace_extra_changes_every_namespace() -> None:
    key = object_keys(1)[0]
    assert lmcache_namespace(scope_of(key)).name != lmcache_namespace(scope_of(key), {"dtype": "bfloat16"}).name


def test_eventfds_are_distinct_and_signal_their_own_kind(server, make_adapter, buffers) -> None:
    adapter = make_adapter(target=server.target)
    fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
    assert len(set(fds)) == 3
    assert not any(readable(fd, 0) for fd in fds)
    keys = object_keys(2, first=40)
    task = adapter.submit_store_task(keys, buffers.filled([1, 2]))
    assert readable(fds[0], 10)
    assert not readable(fds[1], 0) and not readable(fds[2], 0)
    assert adapter.pop_completed_store_tasks()[task].is_successful()
    assert adapter.pop_completed_store_tasks() == {}  # each result once
    task = adapter.submit_lookup_and_lock_task(keys, {})
    assert readable(fds[1], 10)
    assert not readable(fds[0], 0) and not readable(fds[2], 0)
    assert bits(adapter.query_lookup_and_lock_result(task)) == [1, 1]
    task = adapter.submit_load_task(keys, buffers.empty(2))
    assert readable(fds[2], 10)
    assert not readable(fds[0], 0) and not readable(fds[1], 0)
    assert bits(adapter.query_load_result(task)) == [1, 1]
    assert adapter.query_load_result(task) is None
    adapter.submit_unlock(keys)


def test_locks_past_max_locked_bytes_are_hits_not_held(server, make_adapter, buffers) -> None:
    """A lookup that would hold more than max_locked_bytes answers its hits without holding them;
    the load reads them again and still copies the stored bytes."""
    adapter = make_adapter(target=server.target, max_locked_bytes=2 * CHUNK_BYTES)
    keys = object_keys(3, first=60)
    src = buffers.filled([6, 7, 8])
    assert store(adapter, keys, src).is_successful()
    assert lookup(adapter, keys) == [1, 1, 1]
    assert eventually(lambda: adapter.report_status()["locks_not_held"] == 3)  # once the leases came back
    status = adapter.report_status()
    assert (status["locked_keys"], status["locked_bytes"], status["locks_not_held"]) == (3, 0, 3)
    dst = buffers.empty(3)
    assert load(adapter, keys, dst) == [1, 1, 1]
    assert same_bytes(src, dst)
    adapter.submit_unlock(keys)
    assert adapter.report_status()["locked_keys"] == 0


def test_a_block_of_another_size_is_a_miss(server, make_adapter, buffers) -> None:
    adapter = make_adapter(target=server.target)
    keys = object_keys(1, first=70)
    assert store(adapter, keys, buffers.filled([1])).is_successful()
    assert lookup(adapter, keys) == [1]
    small = buffers.empty(1, shape=torch.Size([2, 2, 8, 128]))
    assert load(adapter, keys, small) == [0]
    assert not any(bytes(small[0].byte_array))
    adapter.submit_unlock(keys)


def test_an_object_whose_bytes_are_not_its_size_fails_its_store_and_puts_nothing(server, make_adapter, buffers) -> None:
    """An object whose byte_array is not get_size() bytes (a buggy engine buffer): the task fails and
    no chunk of it is put, as when the block encoder refused it (a wrong size is never stored)."""

    class Misfit:  # only what the adapter reads of a MemoryObj on a store
        def __init__(self, obj: object, size: int) -> None:
            self.byte_array, self._size = obj.byte_array, size  # type: ignore[attr-defined]

        def get_size(self) -> int:
            return self._size

    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=90)
    good, other = buffers.filled([3, 4])
    result = store(adapter, keys, [good, Misfit(other, memoryview(other.byte_array).nbytes - 1)])
    assert not result.is_successful()
    assert adapter.counters.snapshot()["store_failed_tasks"] == 1
    assert lookup(adapter, keys) == [0, 0]  # neither chunk: one put per namespace, refused before it


def test_the_load_verifies_its_copy_so_bytes_changed_after_the_lookup_are_a_miss(server, make_adapter, buffers) -> None:
    """The lookup leases without reading the blocks (one round trip); the load checks each copy
    where it landed in LMCache's buffer. A block changed in its slot after the lookup (here by the
    test, through the server's own writable view of its arena: no client can write it) is a miss,
    counted, never loaded: before, the lookup verified the slot and the load copied whatever was
    there by then, and reported it loaded."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=90)
    src = buffers.filled([5, 6])
    assert store(adapter, keys, src).is_successful()
    assert lookup(adapter, keys) == [1, 1]
    damage_slot(server, keys[1])
    dst = buffers.empty(2)
    assert load(adapter, keys, dst) == [1, 0]
    assert bytes(dst[0].byte_array) == bytes(src[0].byte_array)
    assert adapter.counters.snapshot()["corrupt_chunks"] == 1
    adapter.submit_unlock(keys)
    with KVCacheClient(server.target) as probe:
        assert eventually(lambda: probe.stats().arena_leases == 0)


def test_lmcache_builds_it_from_the_plugin_spec(server) -> None:
    """LMCache's own CLI parsing and factory build the adapter from the `--l2-adapter` JSON, as
    `lmcache server` does: cls(adapter_params, l1_memory_desc=...)."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    spec = {
        "type": "plugin",
        "module_path": "kvcache_connectors.lmcache_l2",
        "class_name": "KVCacheL2Adapter",
        "adapter_params": {"target": server.target, "timeout_s": 2.0, "namespace_extra": {"dtype": "bfloat16"}},
    }
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    adapter = create_l2_adapter_from_registry(config.adapters[0], L1MemoryDesc(ptr=0, size=1 << 20, align_bytes=4096))
    try:
        assert isinstance(adapter, KVCacheL2Adapter) and isinstance(adapter, L2AdapterInterface)
        assert adapter.config == KVCacheL2Config(
            target=server.target, timeout_s=2.0, namespace_extra={"dtype": "bfloat16"}
        )
        assert adapter.report_status()["is_healthy"] is True
    finally:
        adapter.close()


@pytest.mark.parametrize(
    "params, message",
    [
        ({}, "target"),
        ({"target": "h:1", "timeout": 1}, "unknown"),
        ({"target": "h:1", "timeout_s": 0}, "timeout_s"),
        ({"target": "h:1", "max_queued_bytes": True}, "max_queued_bytes"),
        ({"target": "h:1", "shm": "yes"}, "shm"),
        ({"target": "h:1", "namespace_extra": {"a": 1}}, "namespace_extra"),
        ({"target": "h:1", "max_capacity_bytes": -1}, "max_capacity_bytes"),
        ({"target": "h:1", "retain_ttl_s": 0}, "retain_ttl_s"),
        ({"target": "h:1", "retain_ttl_s": "a week"}, "retain_ttl_s"),
    ],
)
def test_bad_params_fail_at_start_up(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheL2Adapter(params)


def test_the_token_stays_out_of_repr() -> None:
    assert "s3cret" not in repr(KVCacheL2Config(target="h:1", token="s3cret"))


# -- a server that fails mid-call ----------------------------------------------------------------


def test_a_killed_server_degrades_to_misses_within_the_deadline(make_adapter, buffers) -> None:
    """The server process killed after a store and a lookup-and-lock: the load of the held keys
    still copies their bytes (what the lock holds is in this process, shm=False), a new lookup and a
    load of keys not held are misses, a store fails, each submit returns at once and each result
    comes within its deadline; unlocking the held keys succeeds though the server is gone."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(target=server.target, shm=False, bulk=False, timeout_s=1.0, lookup_timeout_s=0.5)
        keys = object_keys(2, first=80)
        src = buffers.filled([8, 9])
        assert store(adapter, keys, src).is_successful()
        assert lookup(adapter, keys) == [1, 1]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)

        started = time.monotonic()
        task = adapter.submit_load_task(keys, dst := buffers.empty(2))
        assert time.monotonic() - started < SUBMIT_BOUND_S
        assert bits(wait_result(adapter.query_load_result, task, adapter.get_load_event_fd(), 2.0)) == [1, 1]
        assert same_bytes(src, dst)

        others = object_keys(2, first=90)
        started = time.monotonic()
        task = adapter.submit_lookup_and_lock_task(others, {})
        assert time.monotonic() - started < SUBMIT_BOUND_S
        fd = adapter.get_lookup_and_lock_event_fd()
        assert bits(wait_result(adapter.query_lookup_and_lock_result, task, fd, 1.5)) == [0, 0]  # the call failed
        started = time.monotonic()
        load_task = adapter.submit_load_task(others, buffers.empty(2))
        store_task = adapter.submit_store_task(others, buffers.filled([1, 2]))
        assert time.monotonic() - started < SUBMIT_BOUND_S
        # the breaker is open: both complete without a call
        assert bits(wait_result(adapter.query_load_result, load_task, adapter.get_load_event_fd(), 1.0)) == [0, 0]
        assert not wait_store(adapter, store_task, 1.0).is_successful()
        adapter.submit_unlock(keys)
        assert adapter.report_status()["locked_keys"] == 0
        assert eventually(lambda: adapter.report_status()["queued"]["kvcache-l2-control"] == (0, 0))
        counters = adapter.counters.snapshot()
        assert counters["lookup_failures"] == 1
        assert counters["load_missing_chunks"] == 2 and counters["load_failed_tasks"] == 1
        assert counters["store_failed_tasks"] == 1 and counters["stored_chunks"] == 2
        assert counters["breaker_skips"] == 2
        status = adapter.report_status()
        assert (status["breaker"], status["is_healthy"]) == ("open", True)  # degraded to misses, not broken


def test_a_stopped_server_costs_one_deadline_per_cooldown(make_adapter, buffers) -> None:
    """A server SIGSTOPped (it accepts connections, answers nothing), lookups that wait for their
    leases (early_lookups off; the early path has its own test): of 5 lookups queued at once the
    first waits out its 0.5 s deadline and opens the breaker, the other 4 miss without a call; all 5
    answer within 1.5 s, each submit returned at once, and LMCache's thread was never held."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(
            target=server.target, timeout_s=1.0, lookup_timeout_s=0.5, breaker_cooldown_s=60.0, early_lookups=False
        )
        keys = object_keys(1, first=120)
        assert store(adapter, keys, buffers.filled([3])).is_successful()
        sigstop(server.proc.pid)
        try:
            started = time.monotonic()
            tasks = [adapter.submit_lookup_and_lock_task(keys, {}) for _ in range(5)]
            submitted_s = time.monotonic() - started
            fd = adapter.get_lookup_and_lock_event_fd()
            results = [bits(wait_result(adapter.query_lookup_and_lock_result, t, fd, 2.0)) for t in tasks]
            elapsed_s = time.monotonic() - started
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert submitted_s < SUBMIT_BOUND_S
        assert results == [[0]] * 5
        assert 0.5 <= elapsed_s < 1.5  # one 0.5 s deadline, not five
        counters = adapter.counters.snapshot()
        assert (counters["lookup_failures"], counters["breaker_skips"], counters["lookup_misses"]) == (5, 4, 5)
        assert adapter.report_status()["locked_keys"] == 0


def test_queues_are_bounded_by_tasks_and_bytes(make_adapter, buffers) -> None:
    """With the server stopped, a lane holds one running task and at most max_queued_tasks queued,
    and no more than max_queued_bytes of LMCache's buffers; the rest complete at once (failed
    stores, all-miss loads) and are counted."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(
            target=server.target,
            timeout_s=1.0,
            breaker_cooldown_s=60.0,
            max_queued_tasks=2,
            max_queued_bytes=3 * CHUNK_BYTES,
        )
        sigstop(server.proc.pid)
        try:
            first = adapter.submit_store_task(object_keys(1, first=200), buffers.filled([1]))
            assert eventually(lambda: adapter.report_status()["queued"]["kvcache-l2-store"] == (0, 0))  # running
            queued = [adapter.submit_store_task(object_keys(1, first=201 + i), buffers.filled([i])) for i in range(2)]
            refused = adapter.submit_store_task(object_keys(1, first=210), buffers.filled([9]))
            assert not adapter.pop_completed_store_tasks()[refused].is_successful()  # at once, no wait
            running = adapter.submit_load_task(object_keys(2, first=300), buffers.empty(2))
            assert eventually(lambda: adapter.report_status()["queued"]["kvcache-l2-load"] == (0, 0))
            waiting = adapter.submit_load_task(object_keys(2, first=302), buffers.empty(2))
            assert adapter.report_status()["queued"]["kvcache-l2-load"] == (1, 2 * CHUNK_BYTES)
            over = adapter.submit_load_task(object_keys(2, first=304), buffers.empty(2))
            assert bits(adapter.query_load_result(over)) == [0, 0]  # past the byte cap: refused at once
            assert adapter.counters.snapshot()["refused_tasks"] == 2
            fd = adapter.get_load_event_fd()
            loads = [bits(wait_result(adapter.query_load_result, t, fd, 3.0)) for t in (running, waiting)]
            results = [wait_store(adapter, t, 3.0) for t in [first, *queued]]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert [r.is_successful() for r in results] == [False] * 3
        assert loads == [[0, 0], [0, 0]]


def test_close_fails_queued_tasks_and_releases_held_leases(server, make_adapter, buffers) -> None:
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=400)
    assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
    assert lookup(adapter, keys) == [1, 1]
    with KVCacheClient(server.target) as probe:
        assert eventually(lambda: probe.stats().arena_leases > 0)  # the leases behind the early answer
        adapter.close()
        assert probe.stats().arena_leases == 0
    adapter.close()  # twice is harmless


def test_a_lock_outlived_by_its_lease_is_read_again(make_server, make_adapter, buffers) -> None:
    """The server ends a read lease at ram.lease_timeout_s whatever the client does (so a lock
    LMCache never unlocks cannot pin RAM for ever): a load after that does not trust the held view
    (its slot may hold another block by then), reads the key again and still copies its bytes."""
    server = make_server(ram={"capacity_bytes": 64 << 20, "lease_timeout_s": 0.3})
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=500)
    src = buffers.filled([5, 6])
    assert store(adapter, keys, src).is_successful()
    assert lookup(adapter, keys) == [1, 1]
    with KVCacheClient(server.target) as probe:
        assert eventually(lambda: probe.stats().arena_leases > 0)  # the leases behind the early answer
        assert eventually(lambda: probe.stats().arena_leases == 0, 5.0)  # expired on the server
        assert probe.stats().arena_leases_expired > 0
        dst = buffers.empty(2)
        assert load(adapter, keys, dst) == [1, 1]
        assert same_bytes(src, dst)
        assert probe.stats().tier("ram").hits == 2 + 2  # the lookup's reads, then the load's own
        adapter.submit_unlock(keys)
        assert adapter.report_status()["locked_keys"] == 0
        assert eventually(lambda: adapter.report_status()["queued"]["kvcache-l2-control"] == (0, 0))
        assert adapter.counters.snapshot()["releases_failed"] == 0  # releasing expired leases is no error


def test_a_server_killed_mid_call_is_a_miss_within_the_deadline(make_adapter, buffers) -> None:
    """The server stopped, a lookup sent (the call hangs; early_lookups off), then the server killed
    while it waits: the lookup answers all misses no later than its deadline, and nothing stays locked."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(target=server.target, timeout_s=1.0, lookup_timeout_s=1.0, early_lookups=False)
        keys = object_keys(2, first=600)
        assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
        sigstop(server.proc.pid)
        started = time.monotonic()
        task = adapter.submit_lookup_and_lock_task(keys, {})
        time.sleep(0.3)  # the LeaseGet is on the wire
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        fd = adapter.get_lookup_and_lock_event_fd()
        assert bits(wait_result(adapter.query_lookup_and_lock_result, task, fd, 2.0)) == [0, 0]
        assert time.monotonic() - started < 1.0 + 0.5
        assert adapter.report_status()["locked_keys"] == 0
        assert adapter.counters.snapshot()["lookup_failures"] == 1


# -- early lookups: the presence index answers, the leases follow on the lookup lane ---------------


class LaneGate:
    """Holds one of the adapter's lanes (by default the lease lane) with a task that waits for open():
    the leases an early lookup leaves behind wait in its queue, at a moment the test chooses."""

    def __init__(self, adapter: KVCacheL2Adapter, lane: str = "_leases") -> None:
        self.event = threading.Event()
        assert getattr(adapter, lane).submit(Task(run=lambda: self.event.wait(30), drop=self.event.set))

    def open(self) -> None:
        self.event.set()


def test_an_early_lookup_answers_before_its_leases_and_its_load_waits_for_them(server, make_adapter, buffers) -> None:
    """Every key in RAM: the lookup is answered while the lookup lane is held (no call made yet), its
    locks taken; the load submitted then waits for the leases, and once they come copies the leased
    blocks byte-identical: two RAM hits in all (the leases), no second read. Unlock releases them."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=700)
    src = buffers.filled([7, 8])
    assert store(adapter, keys, src).is_successful()
    with KVCacheClient(server.target) as probe:
        hits = probe.stats().tier("ram").hits
        gate = LaneGate(adapter)
        assert lookup(adapter, keys) == [1, 1]
        assert adapter.report_status()["locked_keys"] == 2
        dst = buffers.empty(2)
        task = adapter.submit_load_task(keys, dst)
        assert not readable(adapter.get_load_event_fd(), 0.3)  # waiting for the leases
        assert probe.stats().arena_leases == 0
        gate.open()
        assert bits(wait_result(adapter.query_load_result, task, adapter.get_load_event_fd())) == [1, 1]
        assert same_bytes(src, dst)
        assert probe.stats().tier("ram").hits - hits == 2
        assert probe.stats().arena_leases > 0
        adapter.submit_unlock(keys)
        assert eventually(lambda: probe.stats().arena_leases == 0)
    counters = adapter.counters.snapshot()
    assert (counters["lookups_inline"], counters["leases_lost"], counters["loaded_chunks"]) == (1, 0, 2)


def test_an_early_lookup_unlocked_before_its_leases_asks_none(server, make_adapter, buffers) -> None:
    """Unlocked while its leases wait in the lane: no LEASE is sent, nothing stays pinned."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=720)
    assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
    with KVCacheClient(server.target) as probe:
        leased = probe.stats().inplace_bytes_leased
        gate = LaneGate(adapter)
        assert lookup(adapter, keys) == [1, 1]
        adapter.submit_unlock(keys)
        gate.open()
        assert adapter._leases.idle(5.0)
        assert probe.stats().inplace_bytes_leased == leased and probe.stats().arena_leases == 0
    assert adapter.report_status()["locked_keys"] == 0


def test_an_early_lookup_unlocked_while_its_leases_are_asked_releases_them(make_adapter, buffers) -> None:
    """The server SIGSTOPped with the LEASE on the wire, the locks dropped meanwhile, the server
    resumed: the leases that come back are released at once, none stays pinned."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(target=server.target, lookup_timeout_s=5.0)
        keys = object_keys(2, first=740)
        assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
        sigstop(server.proc.pid)
        try:
            assert lookup(adapter, keys) == [1, 1]
            time.sleep(0.3)  # the LEASE is sent, unanswered
            adapter.submit_unlock(keys)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert adapter._leases.idle(10.0)
        with KVCacheClient(server.target) as probe:
            assert probe.stats().inplace_bytes_leased >= 2 * CHUNK_BYTES
            assert eventually(lambda: probe.stats().arena_leases == 0)
        assert adapter.report_status()["locked_keys"] == 0
        assert adapter.counters.snapshot()["lookup_failures"] == 0


def test_a_hit_deleted_before_its_lease_is_a_counted_miss_never_other_bytes(server, make_adapter, buffers) -> None:
    """Deleted between the early answer and its leases: the leases find nothing (`leases_lost`), the
    load reads the keys again and misses, LMCache's buffers untouched."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=760)
    assert store(adapter, keys, buffers.filled([3, 4])).is_successful()
    gate = LaneGate(adapter)
    assert lookup(adapter, keys) == [1, 1]
    with KVCacheClient(server.target) as probe:
        ((ns, _, kv_keys),) = KeyMapper().group(keys)
        assert probe.delete(ns, kv_keys) == 2
    gate.open()
    dst = buffers.empty(2)
    assert load(adapter, keys, dst) == [0, 0]
    assert all(not any(bytes(obj.byte_array)) for obj in dst)
    adapter.submit_unlock(keys)
    counters = adapter.counters.snapshot()
    assert (counters["leases_lost"], counters["load_missing_chunks"], counters["corrupt_chunks"]) == (2, 2, 0)
    assert adapter.report_status()["locked_keys"] == 0


def test_leases_the_lane_reaches_past_the_lookups_deadline_are_not_asked(server, make_adapter, buffers) -> None:
    """The lane held past the lookup's deadline: its leases are not asked (a lookup failure), the
    load stops waiting for them at that deadline and reads the keys itself, byte-identical."""
    adapter = make_adapter(target=server.target, lookup_timeout_s=0.3)
    keys = object_keys(2, first=780)
    src = buffers.filled([5, 6])
    assert store(adapter, keys, src).is_successful()
    gate = LaneGate(adapter)
    assert lookup(adapter, keys) == [1, 1]
    dst = buffers.empty(2)
    started = time.monotonic()
    assert load(adapter, keys, dst) == [1, 1]
    assert 0.2 < time.monotonic() - started < 0.3 + LEASE_GRACE_S + 1.0
    assert same_bytes(src, dst)
    gate.open()
    assert adapter._leases.idle(5.0)
    adapter.submit_unlock(keys)
    assert adapter.counters.snapshot()["lookup_failures"] == 1
    with KVCacheClient(server.target) as probe:
        assert eventually(lambda: probe.stats().arena_leases == 0)


def test_an_early_lookup_under_a_stopped_server_costs_one_lookup_deadline(make_adapter, buffers) -> None:
    """SIGSTOPped: the presence index still says the blocks are there, so the lookup answers hits at
    once; the load gets misses within the lookup's deadline (the leases' call failed and opened the
    breaker, so the load does not call again), nothing stays locked, and the next lookup, on the
    lane with the breaker open, misses without a call."""
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        adapter = make_adapter(target=server.target, timeout_s=5.0, lookup_timeout_s=0.5, breaker_cooldown_s=60.0)
        keys = object_keys(2, first=800)
        assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
        sigstop(server.proc.pid)
        try:
            started = time.monotonic()
            assert lookup(adapter, keys) == [1, 1]
            dst = buffers.empty(2)
            assert load(adapter, keys, dst) == [0, 0]
            elapsed_s = time.monotonic() - started
            adapter.submit_unlock(keys)
            assert lookup(adapter, keys) == [0, 0]
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert 0.5 <= elapsed_s < 0.5 + LEASE_GRACE_S + 0.5
        assert all(not any(bytes(obj.byte_array)) for obj in dst)
        assert adapter.report_status()["locked_keys"] == 0
        counters = adapter.counters.snapshot()
        assert (counters["lookup_failures"], counters["breaker_skips"]) == (2, 2)  # the load's read, the lookup


def test_a_load_takes_an_older_lookups_held_block_before_a_later_pending_or_empty_one(
    server, make_adapter, buffers
) -> None:
    """Lookup A holds its leases; lookup B of the same keys, early, is pending. A load borrows A's
    held blocks at once (not B's pending hold); and once B's leases found the keys deleted (no
    block), a load still copies A's, which A's leases kept: byte-identical, no miss."""
    adapter = make_adapter(target=server.target, lookup_timeout_s=1.0)
    keys = object_keys(2, first=900)
    src = buffers.filled([1, 2])
    assert store(adapter, keys, src).is_successful()
    assert lookup(adapter, keys) == [1, 1]  # A
    assert adapter._leases.idle(5.0)  # A's leases held
    gate = LaneGate(adapter)
    assert lookup(adapter, keys) == [1, 1]  # B, pending
    dst = buffers.empty(2)
    started = time.monotonic()
    assert load(adapter, keys, dst) == [1, 1]
    assert time.monotonic() - started < 0.5  # not B's deadline (1 s): A's blocks, at once
    assert same_bytes(src, dst)
    with KVCacheClient(server.target) as probe:
        ((ns, _, kv_keys),) = KeyMapper().group(keys)
        assert probe.delete(ns, kv_keys) == 2
    gate.open()
    assert adapter._leases.idle(5.0)
    assert adapter.counters.snapshot()["leases_lost"] == 2  # B's found nothing
    dst = buffers.empty(2)
    assert load(adapter, keys, dst) == [1, 1]  # from A's leases, still pinned
    assert same_bytes(src, dst)
    adapter.submit_unlock(keys)
    adapter.submit_unlock(keys)
    assert adapter.report_status()["locked_keys"] == 0


def test_a_busy_lookup_lane_delays_neither_early_leases_nor_loads(server, make_adapter, buffers) -> None:
    """The lookup lane held (a lookup reading a lower tier, say): an early lookup's leases and its
    load go through their own lanes at once."""
    adapter = make_adapter(target=server.target, lookup_timeout_s=2.0)
    keys = object_keys(2, first=1200)
    src = buffers.filled([1, 2])
    assert store(adapter, keys, src).is_successful()
    gate = LaneGate(adapter, "_lookups")
    try:
        started = time.monotonic()
        assert lookup(adapter, keys) == [1, 1]
        dst = buffers.empty(2)
        assert load(adapter, keys, dst) == [1, 1]
        assert time.monotonic() - started < 1.0
        assert same_bytes(src, dst)
    finally:
        gate.open()
    adapter.submit_unlock(keys)


def test_a_load_waiting_for_late_leases_holds_up_no_load_whose_blocks_are_held(server, make_adapter, buffers) -> None:
    """Load B waits for an early lookup's leases (the lease lane held, as behind a slow LEASE); load C,
    whose lookup's leases are held already, submitted after B, completes at once, byte-identical,
    and B completes once its leases come."""
    adapter = make_adapter(target=server.target, lookup_timeout_s=5.0)
    kb, kc = object_keys(2, first=1300), object_keys(2, first=1310)
    src_b, src_c = buffers.filled([1, 2]), buffers.filled([3, 4])
    assert store(adapter, kb, src_b).is_successful() and store(adapter, kc, src_c).is_successful()
    assert lookup(adapter, kc) == [1, 1]
    assert adapter._leases.idle(5.0)  # C's leases held
    gate = LaneGate(adapter)
    try:
        assert lookup(adapter, kb) == [1, 1]  # B's leases wait behind the gate
        dst_b = buffers.empty(2)
        task_b = adapter.submit_load_task(kb, dst_b)
        started = time.monotonic()
        dst_c = buffers.empty(2)
        assert load(adapter, kc, dst_c) == [1, 1]
        assert time.monotonic() - started < 1.0  # not B's 5 s
        assert same_bytes(src_c, dst_c)
        assert adapter.query_load_result(task_b) is None  # B still waits
    finally:
        gate.open()
    fd = adapter.get_load_event_fd()
    assert bits(wait_result(adapter.query_load_result, task_b, fd)) == [1, 1]
    assert same_bytes(src_b, dst_b)
    adapter.submit_unlock(kb + kc)
    assert adapter.report_status()["locked_keys"] == 0


def test_leases_reached_a_sliver_before_the_deadline_are_not_asked_and_keep_the_breaker_closed(
    server, make_adapter, buffers
) -> None:
    """The lease lane reaches an early lookup's leases 1 ms before its deadline on a healthy server:
    no LEASE with that sliver of time (which would fail and open the breaker for its cooldown); the
    breaker stays closed, the load reads the keys itself, and the next store works."""
    adapter = make_adapter(target=server.target, lookup_timeout_s=0.5, breaker_cooldown_s=30.0)
    keys = object_keys(2, first=940)
    src = buffers.filled([5, 6])
    assert store(adapter, keys, src).is_successful()
    start = threading.Event()

    def busy_until_just_before_the_deadline() -> None:
        start.wait(5)
        deadline = adapter._locks._locks[keys[0]][-1].hold.deadline
        while time.monotonic() < deadline - 0.001:
            time.sleep(0.0002)

    assert adapter._leases.submit(Task(run=busy_until_just_before_the_deadline, drop=start.set))
    assert lookup(adapter, keys) == [1, 1]
    start.set()
    assert adapter._leases.idle(5.0)
    status = adapter.report_status()
    assert (status["breaker"], status["lookup_failures"], status["breaker_skips"]) == ("closed", 1, 0)
    dst = buffers.empty(2)
    assert load(adapter, keys, dst) == [1, 1] and same_bytes(src, dst)
    assert store(adapter, object_keys(1, first=960), buffers.filled([7])).is_successful()
    adapter.submit_unlock(keys)


def test_the_presence_counter_counts_only_the_answers_used(server, make_adapter, buffers) -> None:
    """A hit after a miss goes to the lookup lane: the index's answer was not used, nor counted."""
    adapter = make_adapter(target=server.target)
    keys = object_keys(2, first=980)
    assert store(adapter, [keys[0]], buffers.filled([1])).is_successful()
    presence = adapter._client.presence
    local = presence.counters.local
    assert lookup(adapter, [keys[0], keys[1]]) == [1, 0]  # the lane's
    assert presence.counters.local == local
    assert lookup(adapter, [keys[0]]) == [1]  # the index's
    assert presence.counters.local == local + 1
    adapter.submit_unlock([keys[0], keys[0]])


def test_early_lookups_off_answers_once_the_leases_are_held(server, make_adapter, buffers) -> None:
    adapter = make_adapter(target=server.target, early_lookups=False)
    keys = object_keys(2, first=820)
    assert store(adapter, keys, buffers.filled([1, 2])).is_successful()
    with KVCacheClient(server.target) as probe:
        assert lookup(adapter, keys) == [1, 1]
        assert probe.stats().arena_leases > 0
        adapter.submit_unlock(keys)
    assert adapter.counters.snapshot()["lookups_inline"] == 0


# -- locks="keys": what LMCache's own adapters hold ----------------------------------------------


def test_key_locks_look_up_from_the_presence_index_and_pin_nothing(server, make_adapter, buffers) -> None:
    """locks="keys": the lookup is the stored prefix, answered on the same host from the server's
    presence index (no call), locked in the adapter alone (no lease on the server; the adapter's own
    delete skips a locked key); the load reads the blocks and copies them byte-identical."""
    adapter = make_adapter(target=server.target, locks="keys")
    keys = object_keys(4, first=300)
    src = buffers.filled([1, 2, 3, 4])
    assert store(adapter, keys, src).is_successful()
    never = object_keys(2, first=400)
    presence = adapter._client.presence
    local, rpc = presence.counters.local, presence.counters.rpc
    assert lookup(adapter, keys + never) == [1, 1, 1, 1, 0, 0]
    assert lookup(adapter, keys[:2]) == [1, 1]
    # Both from the index: the prefix, and the first miss certain (no tier below RAM on this server).
    assert (presence.counters.local, presence.counters.rpc) == (local + 2, rpc)
    with KVCacheClient(server.target) as probe:
        assert probe.stats().arena_leases == 0  # nothing pinned
        assert adapter.report_status()["locked_keys"] == 4
        adapter.delete(keys)  # every key locked: nothing deleted
        time.sleep(0.2)
        assert probe.stats().tier("ram").blocks == 4
        dst = buffers.empty(4)
        assert load(adapter, keys, dst) == [1, 1, 1, 1]
        assert same_bytes(src, dst)
        adapter.submit_unlock(keys)
        adapter.submit_unlock(keys[:2])
        assert adapter.report_status()["locked_keys"] == 0
        adapter.delete(keys)
        assert eventually(lambda: probe.stats().tier("ram").blocks == 0)
    # The delete lane counts once the server has answered, which can be after the server shows them gone.
    assert eventually(lambda: adapter.counters.snapshot()["deleted_chunks"] == 4)
    counters = {k: v for k, v in adapter.counters.snapshot().items() if v}
    assert counters == {
        "stored_chunks": 4,
        "lookup_hits": 6,
        "lookup_misses": 2,
        "key_locks": 6,
        "lookups_inline": 2,
        "loaded_chunks": 4,
        "unlocks": 6,
        "deleted_chunks": 4,
    }


def test_key_locks_a_lookup_the_index_answers_is_done_before_submit_returns(
    make_server, make_adapter, buffers, tmp_path
) -> None:
    """Where the presence index answers every key with certainty, the lookup-and-lock is answered on
    the caller's thread: the result and its eventfd are there when submit returns, and no lane task
    runs (a lane thread woken per lookup cost 0.4 ms cold). An answer the index cannot give for
    certain (a miss on a server with a tier below RAM: the key may be there) still goes to the lane and
    asks the server, as does every lookup while the breaker is open."""
    adapter = make_adapter(target=make_server().target, locks="keys")
    keys = object_keys(4, first=700)
    assert store(adapter, keys, buffers.filled([1, 2, 3, 4])).is_successful()
    submitted: list[object] = []
    real_submit = adapter._submit
    adapter._submit = lambda lane, task: submitted.append(lane) or real_submit(lane, task)
    fd = adapter.get_lookup_and_lock_event_fd()
    for asked, expect in ((keys, [1, 1, 1, 1]), (keys[:2] + object_keys(2, first=800), [1, 1, 0, 0])):
        task = adapter.submit_lookup_and_lock_task(asked, {})
        assert select.select([fd], [], [], 0)[0] == [fd]  # signalled already
        assert bits(adapter.query_lookup_and_lock_result(task)) == expect
        os.eventfd_read(fd)
    assert submitted == [] and adapter.counters.snapshot()["lookups_inline"] == 2
    assert adapter.report_status()["locked_keys"] == 4  # keys[:2] twice, keys[2:] once
    adapter.submit_unlock(keys + keys[:2])

    # A tier below RAM: a miss is not certain from the index alone; the lane asks the server.
    lower = make_server(
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": 8 << 20, "region_bytes": 1 << 20}
    )
    other = make_adapter(target=lower.target, locks="keys")
    assert store(other, keys[:2], buffers.filled([5, 6])).is_successful()
    real_other = other._submit
    other._submit = lambda lane, task: submitted.append(lane) or real_other(lane, task)
    assert lookup(other, keys[:2]) == [1, 1]  # certain: inline
    assert submitted == []
    assert lookup(other, keys) == [1, 1, 0, 0]  # the first miss may be on disk: the lane, one Lookup
    assert len(submitted) == 1 and other.counters.snapshot()["lookups_inline"] == 1
    # While the breaker is not closed, nothing is answered inline either.
    with other._breaker_lock:
        other._breaker.failure()
    assert other._lock_locally(keys[:2]) is None


def test_key_locks_a_hit_gone_or_changed_before_its_load_is_a_counted_miss(server, make_adapter, buffers) -> None:
    """A key lock pins nothing: a hit another client deletes before the load, or whose slot changes
    (here through the server's own writable view of its arena), is a load miss, counted, its buffer
    never reported loaded; the other chunks load byte-identical."""
    adapter = make_adapter(target=server.target, locks="keys")
    keys = object_keys(3, first=500)
    src = buffers.filled([7, 8, 9])
    assert store(adapter, keys, src).is_successful()
    assert lookup(adapter, keys) == [1, 1, 1]
    ((ns, _, kv_keys),) = KeyMapper().group(keys)
    with KVCacheClient(server.target) as other:
        assert other.delete(ns, [kv_keys[2]]) == 1
    damage_slot(server, keys[1])
    dst = buffers.empty(3)
    assert load(adapter, keys, dst) == [1, 0, 0]
    assert bytes(dst[0].byte_array) == bytes(src[0].byte_array)
    counters = adapter.counters.snapshot()
    assert (counters["loaded_chunks"], counters["load_missing_chunks"], counters["load_failed_tasks"]) == (1, 2, 1)
    adapter.submit_unlock(keys)
    assert adapter.report_status()["locked_keys"] == 0
