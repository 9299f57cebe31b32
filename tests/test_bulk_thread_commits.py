"""Bulk PUTs committed by the session's own thread (TierStack.commits_off_loop, docs/bulk.md "Inside the
server"): on a server of RAM alone with no event subscriber, a PUT of at most _RESERVE_AT_ONCE_BYTES has
its RAM slots reserved, written and indexed by the connection's thread, with no trip to the event loop
and back. Real in-process servers, the SDK and raw frames.

What the code before did: every bulk PUT went to the event loop once (staged) or twice (budget and
slots, then the commit): a put of one 16 KiB block took 0.65 ms p50 on this 2-core VM, 0.31 ms now
(two servers side by side, puts alternating between them: docs/bulk.md).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvcache_client import KVCacheClient
from kvcache_core import bulkwire as bw
from tests.backends import wait_for
from tests.test_bulk import Raw, blocks, bulk_server, settled, stored
from tests.test_bulk_small_puts import put_trips, trips

pytestmark = pytest.mark.timeout(60)

KIB = 1 << 10
MIB = 1 << 20


def hold_the_loop(server, seconds: float) -> threading.Event:  # type: ignore[no-untyped-def]
    """A callback that sleeps `seconds` on the server's event loop (as a slow handler would), once it
    has started; the event is set when the loop is free again."""
    held, freed = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        time.sleep(seconds)
        freed.set()

    server.loop.call_soon_threadsafe(hold)
    assert held.wait(5)
    return freed


@pytest.mark.parametrize(("count", "size"), [(8, 16 * KIB), (3, MIB)], ids=["staged", "reserved-at-once"])
def test_a_put_is_answered_while_the_event_loop_is_held(make_server, count: int, size: int) -> None:
    """The event loop is stuck (a callback sleeping on it, as a slow handler would): a bulk PUT is
    stored and answered meanwhile, byte-exact. On the code before, the PUT waited for the loop."""
    server = bulk_server(make_server)
    data = blocks(count, size)
    with KVCacheClient(server.target, shm=False, bulk_connections=1, timeout_s=20) as client:
        client.put_many("warm", blocks(1, MIB))  # Info asked, the bulk port on
        freed = hold_the_loop(server, 1.5)
        assert client.put_many("n", data).stored == count
        assert not freed.is_set(), "the PUT was answered only after the loop was free again"
        assert freed.wait(5)
        got = client.get_many("n", [k for k, _ in data])
        assert [bytes(g) for g in got] == [b for _, b in data]
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.in_arena, sink.committed, sink.abandoned) == (count + 1, count + 1, count + 1, 0)
    settled(server, puts=2, errors=0)
    assert not server.stack.ram._reservations


@pytest.mark.parametrize("first", ["put", "delete"])
def test_a_delete_racing_a_commit_in_the_sessions_thread(
    make_server, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """Deletes stay deleted. The session's thread asks the delete fence and indexes the block in one
    hold of the RAM tier's lock; a Delete fences its keys before it removes them from RAM, under that
    lock. The fence's answer is held here (inside that hold) while a Delete of the key starts:
    `put`: answered before the Delete fenced the key, so the block is indexed, and the Delete, which
    waits for the lock, removes it (it reports 1 deleted); `delete`: answered after, so the block is
    not indexed (the PUT reports it rejected). Either way the key is absent once both returned. A check
    apart from the indexing (the naive way) would leave the block stored after the Delete returned."""
    server = bulk_server(make_server)
    fence = server.stack._fence
    real = fence.running
    ((key, block),) = blocks(1, 16 * KIB)
    asked, go = threading.Event(), threading.Event()

    def running(namespace: str, k: bytes) -> bool:
        answer = real(namespace, k) if first == "put" else None
        if k == key:
            asked.set()
            assert go.wait(10)
        return real(namespace, k) if answer is None else answer

    monkeypatch.setattr(fence, "running", running)
    results: dict[str, object] = {}
    with (
        KVCacheClient(server.target, shm=False, bulk_connections=1, timeout_s=20) as putter,
        KVCacheClient(server.target, shm=False, timeout_s=20) as deleter,
    ):
        putter.put_many("warm", blocks(1, MIB))
        deleter.stats()  # its channel up before the race
        put = threading.Thread(target=lambda: results.update(put=putter.put_many("n", [(key, block)])))
        put.start()
        assert asked.wait(10), "the PUT never asked the fence from its thread"
        delete = threading.Thread(target=lambda: results.update(deleted=deleter.delete("n", [key])))
        delete.start()
        wait_for(lambda: any(k == key for _, k in fence._running), 10, "the Delete to fence the key")
        go.set()
        put.join(10)
        delete.join(10)
        assert not put.is_alive() and not delete.is_alive()
        outcome = results["put"]
        if first == "put":
            assert (outcome.stored, results["deleted"]) == (1, 1)  # type: ignore[attr-defined]
        else:
            assert (outcome.stored, outcome.rejected, results["deleted"]) == (0, 1, 0)  # type: ignore[attr-defined]
            assert outcome.tier("ram").deleted == 1  # type: ignore[attr-defined]
        assert putter.get_many("n", [key]) == [None]
    assert stored(server, "n", [key]) == 0
    assert not server.stack.ram._reservations and not fence._running


def test_an_event_subscriber_keeps_the_commit_on_the_loop(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Events are published in order on the loop: while a subscriber listens, a PUT is committed
    there (one trip) and its STORED event names its keys; once it left, the same PUT takes none."""
    server = bulk_server(make_server)

    async def subscribe():  # type: ignore[no-untyped-def]
        return server.stack.events.subscribe("n")

    async def unsubscribe(sub) -> None:  # type: ignore[no-untyped-def]
        server.stack.events.unsubscribe(sub)

    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, MIB))
        names = trips(monkeypatch)
        sub = server.call(subscribe())
        data = blocks(4, 16 * KIB)
        assert put_trips(client, names, data) == ["_commit_staged"]
        events = server.call(sub.next_batch())
        assert [set(e.keys) for _, e in events] == [{k for k, _ in data}]
        server.call(unsubscribe(sub))
        assert put_trips(client, names, blocks(4, 16 * KIB)) == []


def test_puts_into_a_full_ram_evict_from_the_sessions_thread(make_server) -> None:
    """RAM of 1 MiB, 16 KiB blocks put 8 at a time: each PUT's slots are made by evicting the least
    recently used blocks from the session's thread; every PUT is stored, the last ones are byte-exact,
    the first ones are gone, the RAM tier counts every eviction, and nothing stays reserved."""
    server = bulk_server(make_server, ram={"capacity_bytes": MIB})
    batches = [blocks(8, 16 * KIB) for _ in range(12)]
    warm = blocks(1, 16 * KIB)
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", warm)
        for batch in batches:
            assert client.put_many("n", batch).stored == 8
        held = stored(server, "n", [k for batch in batches for k, _ in batch])
        held += stored(server, "warm", [warm[0][0]])
        assert 0 < held < 97
        last = batches[-1]
        assert [bytes(g) for g in client.get_many("n", [k for k, _ in last])] == [b for _, b in last]
        assert stored(server, "n", [k for k, _ in batches[0]]) == 0
        ram = next(t for t in client.stats().tiers if t.name == "ram")
        assert ram.evictions == 97 - held
    assert not server.stack.ram._reservations


def test_a_damaged_block_in_a_put_reserved_in_its_thread_frees_every_slot(make_server) -> None:
    """A PUT over _STAGED_PUT_BYTES: its slots are reserved by the session's thread before its blocks
    come. Its second block fails its checksum: DATA_LOSS, the connection closed, both slots abandoned,
    nothing stored."""
    server = bulk_server(make_server)
    (k1, b1), (k2, b2) = blocks(2, 600 * KIB)
    damaged = bytearray(b2)
    damaged[len(damaged) // 2] ^= 0x01
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(k1, len(b1)), (k2, len(b2))]))
    raw.send(bw.FrameType.DATA, b1)
    raw.send(bw.FrameType.DATA, bytes(damaged))
    code, message = raw.error()
    assert code is grpc.StatusCode.DATA_LOSS and "block 1" in message, message
    assert raw.closed()
    settled(server, errors=1, puts=0)
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.in_arena, sink.committed, sink.abandoned) == (2, 2, 0, 2)
    assert stored(server, "n", [k1, k2]) == 0
    assert not server.stack.ram._reservations


def test_a_subscriber_that_comes_after_the_slots_were_reserved_gets_the_commit_on_the_loop(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber arrives between the session thread's reservation and its commit: the commit goes
    to the loop with the same slots (one trip), and the subscriber's STORED event names the keys; no
    STORED is ever published from a session thread (it could follow the REMOVED of what it names)."""
    from kvcache_server.stack import TierStack

    server = bulk_server(make_server)
    stack = server.stack
    subs: list[object] = []
    real = TierStack.reserve_in_thread

    async def subscribe():  # type: ignore[no-untyped-def]
        return stack.events.subscribe("n")

    def reserve_then_subscribe(self, namespace, sizes):  # type: ignore[no-untyped-def]
        made = real(self, namespace, sizes)
        if namespace == "n" and not subs:
            subs.append(server.call(subscribe()))
        return made

    monkeypatch.setattr(TierStack, "reserve_in_thread", reserve_then_subscribe)
    data = blocks(4, 16 * KIB)
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, MIB))
        names = trips(monkeypatch)
        assert put_trips(client, names, data) == ["subscribe", "_then_release"]  # the test's, then the commit
        events = server.call(subs[0].next_batch())  # type: ignore[attr-defined]
        assert [set(e.keys) for _, e in events] == [{k for k, _ in data}]
        assert [bytes(g) for g in client.get_many("n", [k for k, _ in data])] == [b for _, b in data]
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.committed, sink.abandoned) == (5, 5, 0)
    assert not stack.ram._reservations


@pytest.mark.parametrize("where", ["thread", "loop"])
def test_a_reservation_refused_in_the_thread_is_counted_once(
    make_server, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Readers lease most of RAM: the session thread's reservation is refused, the loop's is refused
    too and the PUT goes through buffers. The RAM tier counts one refusal, as where the loop alone
    tries (the thread's try counted a second before)."""
    from tests.test_bulk import loop_commits

    if where == "loop":
        loop_commits(monkeypatch)
    server = bulk_server(make_server, ram={"capacity_bytes": 2 * MIB})
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        held = blocks(24, 64 * KIB)
        client.put_many("h", held)
        leases = server.stack.ram.lease_many("h", [k for k, _ in held], 60.0)
        assert None not in leases
        before = next(t for t in client.stats().tiers if t.name == "ram").rejected
        assert client.put_many("n", blocks(8, 64 * KIB)).stored >= 1
        after = next(t for t in client.stats().tiers if t.name == "ram").rejected
        assert after - before == 1
        server.stack.ram.release([lease.id for lease in leases])
    assert not server.stack.ram._reservations


def test_two_connections_putting_the_same_keys_while_a_third_deletes_them(make_server) -> None:
    """Puts of overlapping keys (repeated within a PUT too) into 1 MiB of RAM from two connections,
    Deletes of them from a third: no error, nothing left reserved, the sink balanced, and the RAM
    tier's byte count exactly the cost of what it indexes."""
    import random

    server = bulk_server(make_server, ram={"capacity_bytes": MIB})
    pool = blocks(16, 16 * KIB)
    stop = threading.Event()
    errors: list[BaseException] = []
    rng = random.Random(7)

    def putter(seed: int) -> None:
        r = random.Random(seed)
        try:
            with KVCacheClient(server.target, shm=False, bulk_connections=1, timeout_s=20) as c:
                for _ in range(150):
                    items = r.choices(pool, k=r.choice([1, 4, 12, 40]))
                    result = c.put_many("n", items)
                    assert result.stored + result.rejected == len(items)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def deleter() -> None:
        with KVCacheClient(server.target, shm=False, timeout_s=20) as c:
            while not stop.is_set():
                c.delete("n", [k for k, _ in rng.sample(pool, 4)])

    putters = [threading.Thread(target=putter, args=(seed,)) for seed in (1, 2)]
    deleting = threading.Thread(target=deleter)
    for t in [*putters, deleting]:
        t.start()
    for t in putters:
        t.join(60)
    stop.set()
    deleting.join(10)
    assert not errors, errors
    ram, sink = server.stack.ram, server.running.bulk.sink
    assert not ram._reservations and sink.reserved == sink.committed + sink.abandoned
    with ram._lock:
        assert ram._used == sum(ram.entry_cost_of(slot.length) for slot in ram._blocks.values())
        assert ram._reserved == 0
