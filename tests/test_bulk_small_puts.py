"""Small bulk PUTs (docs/bulk.md, "Inside the server"): received into the session's own memory first,
then slots, copy and commit by the session's own thread on a server of RAM alone (no trip to the event
loop), or budget, slots, copy and commit in one trip to the loop elsewhere. Real servers, the SDK and
raw frames."""

from __future__ import annotations

import time

import grpc
import pytest

from kvcache_client import KVCacheClient, RPCError
from kvcache_core import bulkwire as bw
from tests.backends import wait_for
from tests.test_bulk import (
    Raw,
    _hold,
    _release,
    blocks,
    bulk_server,
    counters,
    loop_commits,
    never_runs_once,
    settled,
    stored,
)

pytestmark = pytest.mark.timeout(60)

KIB = 1 << 10


def put_trips(client: KVCacheClient, names: list[str], items: list[tuple[bytes, bytes]]) -> list[str]:
    """Puts `items` (all stored) and returns the coroutines its PUT sent to the loop (`names`: trips())."""
    names.clear()
    assert client.put_many("n", items).stored == len(items)
    return list(names)


def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the coroutines the bulk sessions run on the event loop, in order."""
    import kvcache_server.bulk.session as session

    real = session.asyncio.run_coroutine_threadsafe
    names: list[str] = []

    def counted(coro, loop):  # type: ignore[no-untyped-def]
        names.append(coro.__name__)
        return real(coro, loop)

    monkeypatch.setattr(session.asyncio, "run_coroutine_threadsafe", counted)
    return names


@pytest.mark.parametrize("where", ["thread", "loop"])
def test_the_trips_a_put_takes_to_the_loop(make_server, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """16 blocks of 16 KiB (the median request of Mooncake's conversation trace) were two trips to
    the event loop (budget and slots, then the commit), each two thread wake-ups; then one; now, on a
    server of RAM alone with no event subscriber, none: the session's thread reserves RAM's slots and
    commits them itself, for any PUT up to _RESERVE_AT_ONCE_BYTES. Where the loop must do it (a tier
    below RAM, a subscriber: `loop`), a staged PUT takes one trip and a larger one two. Over
    _RESERVE_AT_ONCE_BYTES: each block's slot and the commit on the loop. Blocks byte-exact."""
    import kvcache_server.bulk.session as session

    if where == "loop":
        loop_commits(monkeypatch)
    server = bulk_server(make_server)
    sink = server.running.bulk.sink
    small, large = blocks(16, 16 * KIB), blocks(2, session._STAGED_PUT_BYTES // 2 + 4 * KIB)
    larger = blocks(2, session._RESERVE_AT_ONCE_BYTES // 2 + 4 * KIB)
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, 1 << 20))  # the bulk port on
        names = trips(monkeypatch)
        expected = {"thread": ([], []), "loop": (["_commit_staged"], ["_admit", "_then_release"])}[where]
        assert put_trips(client, names, small) == expected[0]
        assert put_trips(client, names, large) == expected[1]
        assert put_trips(client, names, larger) == ["reserve", "reserve", "reserve", "_then_release"]
        got = client.get_many("n", [k for k, _ in small + large + larger])
        assert [bytes(g) for g in got] == [b for _, b in small + large + larger]
    assert (sink.reserved, sink.in_arena, sink.committed, sink.abandoned) == (21, 21, 21, 0)
    settled(server, puts=4, errors=0)


def test_a_small_put_whose_trip_never_runs_holds_nothing(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's part given up before it started (its future comes back cancelled, as a task
    cancelled before its first step): nothing was reserved, nothing is stored, the put fails INTERNAL
    and the server serves the next one."""
    server = bulk_server(make_server)
    loop_commits(monkeypatch)
    dropped = never_runs_once(monkeypatch, "_commit_staged")
    data = blocks(4, 16 * KIB)
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, 1 << 20))
        with pytest.raises(RPCError, match="INTERNAL"):
            client.put_many("n", data)
        assert dropped == ["_commit_staged"]
        sink = server.running.bulk.sink
        assert (sink.reserved, sink.committed) == (1, 1)  # the warm-up's block only
        assert stored(server, "n", [k for k, _ in data]) == 0
        assert client.put_many("n", data).stored == 4
    assert not server.stack.ram._reservations
    settled(server, puts=2, aborted=1)


def test_the_staged_limit_is_exact(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PUT of exactly _STAGED_PUT_BYTES is staged; one byte more takes the two trips (where the loop
    commits: on a server of RAM alone, neither takes one)."""
    import kvcache_server.bulk.session as session

    loop_commits(monkeypatch)
    server = bulk_server(make_server)
    limit = session._STAGED_PUT_BYTES
    header = len(blocks(1, 1024)[0][1]) - 1024  # an encoded block's header, for any payload size here
    at_limit, over = blocks(1, limit - header), blocks(1, limit - header + 1)
    assert len(at_limit[0][1]) == limit and len(over[0][1]) == limit + 1
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, 1 << 20))
        names = trips(monkeypatch)
        assert put_trips(client, names, at_limit) == ["_commit_staged"]
        assert put_trips(client, names, over) == ["_admit", "_then_release"]
        got = client.get_many("n", [at_limit[0][0], over[0][0]])
        assert [bytes(g) for g in got] == [at_limit[0][1], over[0][1]]


def test_a_small_put_into_a_pinned_ram_falls_back_to_buffers(make_server) -> None:
    """Readers lease nearly all of RAM: the staged PUT's slots cannot all be reserved, so its blocks
    go through buffers and the stack's put (as a large PUT's would); what it reports stored is
    byte-exact, nothing is reserved or budgeted after it, the readers' views never changed."""
    server = bulk_server(make_server, ram={"capacity_bytes": 4 << 20})
    sink = server.running.bulk.sink
    first = blocks(3, (1 << 20) + (300 << 10))  # 3.9 of 4 MiB, then leased by readers
    small = blocks(4, 100 * KIB)  # 400 KiB: staged; RAM has about 0.1 MiB free, not all four slots
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        assert client.put_many("n", first).stored == 3
        pinned = server.stack.lease("n", [k for k, _ in first], 60.0)
        assert None not in pinned
        in_arena = sink.in_arena
        result = client.put_many("n", small)
        assert result.stored + result.rejected == 4 and result.stored >= 1
        assert sink.in_arena == in_arena  # no arena slot: buffers
        got = client.get_many("n", [k for k, _ in small])  # the stack's put may evict its own first ones
        assert 1 <= sum(g is not None for g in got) <= result.stored
        assert all(bytes(g) == b for g, (_, b) in zip(got, small, strict=True) if g is not None)
        for lease, (_, block) in zip(pinned, first, strict=True):
            assert bytes(lease.view) == block
        server.stack.ram.release([lease.id for lease in pinned])
    settled(server, errors=0)
    stats = server.stack.ram.arena_stats()
    assert (stats["leases"], stats["reservations"]) == (0, 0)


def test_a_small_put_reaches_a_lower_tier_byte_exact(make_server, redis_server) -> None:
    """With Redis written through below RAM, a staged PUT's blocks are in both; read back from Redis
    alone (RAM's copies deleted), byte-exact."""
    server = bulk_server(
        make_server, redis={"enabled": True, "url": redis_server.url, "write_mode": "through", "timeout_s": 10}
    )
    data = blocks(16, 16 * KIB)
    keys = [k for k, _ in data]
    with KVCacheClient(server.target, shm=False, bulk_connections=1) as client:
        client.put_many("warm", blocks(1, 1 << 20))
        result = client.put_many("n", data)
        assert result.stored == 16 and result.tier("redis").stored == 16
        assert server.stack.ram.delete_many_sync("n", keys) == 16
        got = client.get_many("n", keys)
        assert [bytes(g) for g in got] == [b for _, b in data]
    settled(server, errors=0)


def test_a_small_put_whose_client_goes_mid_block_reserves_nothing(make_server) -> None:
    """Before, a small PUT reserved its budget and every slot before its first byte came, and a
    client gone mid-block left them to be abandoned; now nothing is reserved until every block has
    come and passed its checksum."""
    server = bulk_server(make_server)
    (k1, b1), (k2, b2) = blocks(2, 64 * KIB)
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(k1, len(b1)), (k2, len(b2))]))
    raw.send(bw.FrameType.DATA, b1)
    raw.send(bw.FrameType.DATA, b2[: len(b2) // 2], length=len(b2))
    wait_for(lambda: counters(server)["bytes_received"] == len(b1), 10, "the first block to arrive")
    raw.close()
    settled(server, aborted=1, puts=0)
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.committed, sink.abandoned) == (0, 0, 0)
    assert stored(server, "n", [k1, k2]) == 0


def test_a_damaged_small_block_is_refused_before_anything_is_reserved(make_server) -> None:
    server = bulk_server(make_server)
    (k1, b1), (k2, b2) = blocks(2, 32 * KIB)
    damaged = bytearray(b2)
    damaged[-1] ^= 0x01
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
    assert (sink.reserved, sink.committed, sink.abandoned) == (0, 0, 0)
    assert counters(server)["checksum_failures"] == 1 and stored(server, "n", [k1, k2]) == 0


def test_a_small_put_waits_for_the_budget_on_the_loop_then_is_refused(make_server) -> None:
    """The budget is taken on the loop after the blocks came: with none free, the PUT waits
    admission_wait_s there, is refused RESOURCE_EXHAUSTED holding nothing, and succeeds once room
    is back."""
    server = bulk_server(make_server, limits={"admission_wait_s": 0.3})
    budget = server.running.bulk._budget
    data = blocks(4, 16 * KIB)
    with KVCacheClient(server.target, shm=False, bulk_connections=1, timeout_s=10) as client:
        client.put_many("warm", blocks(1, 1 << 20))
        server.call(_hold(budget, budget.capacity))
        try:
            with pytest.raises(RPCError, match="RESOURCE_EXHAUSTED"):
                client.put_many("n", data)
            assert budget.used == budget.capacity
        finally:
            server.call(_release(budget, budget.capacity))
        assert stored(server, "n", [k for k, _ in data]) == 0
        assert not server.stack.ram._reservations
        assert client.put_many("n", data).stored == 4


def test_a_small_put_given_up_while_its_trip_waits_frees_what_it_holds(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session stops waiting for the loop (its backstop, shortened here) while the trip waits for
    budget: the trip is cancelled there and reserves nothing later, the connection is closed, and the
    budget is back to what the holder took."""
    import kvcache_server.bulk.session as session

    # The session waits admission_wait_s + _LOOP_CALL_S for the loop: 0.2 s here, the budget 2 s.
    monkeypatch.setattr(session, "_LOOP_CALL_S", -1.8)
    server = bulk_server(make_server, limits={"admission_wait_s": 2.0})
    budget = server.running.bulk._budget
    (k1, b1), (k2, b2) = blocks(2, 16 * KIB)
    server.call(_hold(budget, budget.capacity))
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(k1, len(b1)), (k2, len(b2))]))
    raw.send(bw.FrameType.DATA, b1)
    raw.send(bw.FrameType.DATA, b2)
    assert raw.closed()  # the session gave up after 0.2 s
    raw.close()
    # Room comes back well inside the budget's own 2 s wait: a trip still waiting there would now
    # take it, reserve and commit.
    server.call(_release(budget, budget.capacity))
    time.sleep(0.5)
    settled(server, aborted=1, puts=0)
    assert stored(server, "n", [k1, k2]) == 0
    assert not server.stack.ram._reservations
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.committed, sink.abandoned) == (0, 0, 0)
