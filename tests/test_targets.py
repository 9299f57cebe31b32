"""SDK multi-target failover (kvcache_client.targets): real servers sharing a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from kvcache_client import KVCacheClient
from kvcache_client.errors import InvalidRequest, Unavailable
from kvcache_client.results import TierInfo
from kvcache_client.retry import RetryPolicy
from kvcache_client.targets import async_fleet_client, fleet_client, split_targets
from tests.backends import KVServerProcess, RedisProcess, free_port, sigstop
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(60)

NS = "targets"
ONCE = RetryPolicy(max_attempts=1)


def pair(make_server: Callable[..., ServerThread], redis: RedisProcess, **first: dict) -> tuple[ServerThread, ...]:
    shared = {"redis": {"enabled": True, "url": redis.url}}
    return make_server(**shared, **first), make_server(**shared)


def test_split_targets() -> None:
    assert split_targets(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert split_targets(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError, match="no server target"):
        split_targets(" , ")
    with pytest.raises(ValueError, match="named twice"):
        split_targets("a:1,a:1")


def test_the_own_server_first_then_another_sharing_its_tiers(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    own, other = pair(make_server, redis_server)
    items = [keyed(os.urandom(4096)) for _ in range(6)]
    keys = [k for k, _ in items]
    with fleet_client([own.target, other.target], timeout_s=10, retry=ONCE, shm=False) as client:
        transport = client._transport
        assert client.put_many(NS, items).stored == 6
        assert transport.rotation.last_target == own.target and transport.rotation.failovers == 0
        own.stop()  # the node's own server goes away: the next call is answered by the other
        assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in items]
        assert transport.rotation.last_target == other.target and transport.rotation.failovers == 1
        assert client.lookup(NS, keys).prefix_length == 6  # cooling down: straight to the other
        assert transport.rotation.failovers == 1


def test_fleet_reads_go_in_place_or_over_bulk_and_leases_go_back_to_their_server(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    """A fleet client reads in place from a server whose arena this host shares, over the bulk port
    from one whose it does not, and hands each lease back to the server that granted it (before,
    leased() through failover fell back to a copying get and fleet clients never used bulk)."""
    own, other = pair(make_server, redis_server)
    items = [keyed(os.urandom(2 << 20)) for _ in range(3)]
    keys = [k for k, _ in items]
    with fleet_client([own.target, other.target], timeout_s=10, retry=ONCE) as client:
        assert client.put_many(NS, items).stored == 3
        with client.leased(NS, keys) as got:
            assert [bytes(g) for g in got] == [b for _, b in items]
            assert own.stack.ram.arena_stats()["leases"] == 3  # views of own's arena, leased there
        assert own.stack.ram.arena_stats()["leases"] == 0
        assert client.stats().inplace_bytes_leased == sum(len(b) for _, b in items)
    with fleet_client([own.target, other.target], timeout_s=10, retry=ONCE, shm=False) as client:
        own.stop()  # off the servers' host (shm=False): the other answers, over its bulk port
        with client.leased(NS, keys) as got:
            assert [bytes(g) for g in got] == [b for _, b in items]  # from the shared Redis tier
        assert client._transport.rotation.last_target == other.target
        bulk = client._transport._transports[1].link.counters
        assert bulk.bulk_bytes_received == sum(len(b) for _, b in items)
        assert other.stack.ram.arena_stats()["leases"] == 0


def test_a_refused_first_target_fails_over_and_an_answer_does_not(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    strict, other = pair(make_server, redis_server, limits={"max_keys_per_request": 4})
    dead = f"127.0.0.1:{free_port()}"
    with fleet_client([dead, other.target], timeout_s=10, retry=ONCE, shm=False) as client:
        assert client.lookup(NS, [bytes(16)]).prefix_length == 0
        assert client._transport.rotation.failovers == 1
    with fleet_client([strict.target, other.target], timeout_s=10, retry=ONCE, shm=False) as client:
        with pytest.raises(InvalidRequest):  # the server's answer: not sent to another server
            client.lookup(NS, [os.urandom(16) for _ in range(5)])
        assert client._transport.rotation.failovers == 0
    refused = fleet_client([dead, f"127.0.0.1:{free_port()}"], timeout_s=3, retry=ONCE, shm=False)
    with refused, pytest.raises(Unavailable):  # every target refused: the last one's error
        refused.lookup(NS, [bytes(16)])


def test_a_hung_server_is_left_after_attempt_timeout_s(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    """A listener that accepts TCP and never speaks HTTP/2: the attempt is cut and the next target answers."""
    _, other = pair(make_server, redis_server)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        target = f"127.0.0.1:{hung.getsockname()[1]}"
        with fleet_client([target, other.target], timeout_s=10, retry=ONCE, shm=False, attempt_timeout_s=0.5) as client:
            assert client.lookup(NS, [bytes(16)]).prefix_length == 0
            assert client._transport.rotation.failovers == 1
            assert client._transport.rotation.last_target == other.target


def test_the_async_client_fails_over_the_same_way(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    own, other = pair(make_server, redis_server)
    items = [keyed(os.urandom(2048)) for _ in range(4)]
    keys = [k for k, _ in items]
    client = async_fleet_client([own.target, other.target], timeout_s=10, retry=ONCE, shm=False)

    async def run() -> None:
        async with client:
            assert (await client.put_many(NS, items)).stored == 4
            own.stop()
            assert [bytes(b) for b in await client.get_many(NS, keys)] == [b for _, b in items]
            assert client._transport.rotation.failovers == 1

    asyncio.run(run())


def test_the_vllm_connector_takes_several_targets(
    make_server: Callable[..., ServerThread], redis_server: RedisProcess
) -> None:
    from kvcache_connectors.vllm.config import KVCacheConnectorConfig
    from kvcache_connectors.vllm.connector import connect

    _, other = pair(make_server, redis_server)
    dead = f"127.0.0.1:{free_port()}"
    config = KVCacheConnectorConfig.from_extra_config({"target": f"{dead}, {other.target}"}, block_size=16)
    with connect(config) as client:
        assert client.lookup(NS, [bytes(16)]).prefix_length == 0
        assert client._transport.rotation.names == [dead, other.target]
        assert client._transport.rotation.last_target == other.target


# -- a server that is up but silent (SIGSTOP): real server processes -----------------------------

DEADLINE_S = 10.0
COOLDOWN_S = 1.0


@pytest.fixture
def own_and_other() -> Iterator[tuple[KVServerProcess, KVServerProcess]]:
    """Two RAM-only kvcache-server processes; the first is the fleet client's own."""
    settings = ("ram.capacity_bytes=64MiB", "ram.prefault=false")
    own = KVServerProcess(*settings)
    try:
        other = KVServerProcess(*settings)
    except BaseException:
        own.stop()
        raise
    yield own, other
    for proc in (own, other):
        proc.proc.send_signal(signal.SIGCONT)
        proc.stop()


def ram_of(target: str) -> TierInfo:
    with KVCacheClient(target, timeout_s=10, retry=ONCE) as direct:
        return direct.stats().tier("ram")


def test_a_silent_own_server_costs_a_share_of_the_deadline_and_is_used_again_once_it_answers(
    own_and_other: tuple[KVServerProcess, KVServerProcess],
) -> None:
    """Found in issue 23: with the preferred server stopped (up, accepting, not answering), each Get used
    its whole deadline and failed. Now an attempt gets at most attempt_timeout_s (5 s) and half the
    deadline, the other server answers, and the client is back on its own server once it answers.
    Which server served is read from each server's own RAM counters."""
    own, other = own_and_other
    items = [keyed(os.urandom(8192)) for _ in range(4)]
    keys = [k for k, _ in items]
    absent = os.urandom(16)  # never stored: a Get of it is one RAM miss on whichever server serves it
    for target in (own.target, other.target):  # both hold the blocks (as servers sharing tiers would)
        with KVCacheClient(target, timeout_s=10, retry=ONCE) as direct:
            assert direct.put_many(NS, items).stored == 4
    with fleet_client([own.target, other.target], timeout_s=DEADLINE_S, retry=ONCE, cooldown_s=COOLDOWN_S) as fleet:
        rotation = fleet._transport.rotation
        assert [bytes(b) for b in fleet.get_many(NS, keys)] == [b for _, b in items]
        assert rotation.last_target == own.target and rotation.failovers == 0
        before = ram_of(other.target)

        sigstop(own.proc.pid)
        took = []
        for n in range(4):
            if n == 3:
                time.sleep(COOLDOWN_S + 0.1)  # own's cooldown over: it is tried first again, still silent
            start = time.monotonic()
            assert [bytes(b) for b in fleet.get_many(NS, keys)] == [b for _, b in items]
            took.append(time.monotonic() - start)
            assert rotation.last_target == other.target
        # Calls 1 and 4 waited out one attempt on own (min(5 s, 10 s / 2)); 2 and 3 went straight to other.
        assert rotation.failovers == 2
        assert max(took) < 0.8 * DEADLINE_S, took  # not the whole deadline: 3 s of slack over the 5 s attempt
        during = ram_of(other.target)
        assert during.hits == before.hits + 4 * 4  # every call of the stop was served by the other

        own.proc.send_signal(signal.SIGCONT)
        time.sleep(COOLDOWN_S + 0.1)  # the last failover's cooldown
        own_before = ram_of(own.target)  # misses: the Gets own answered late (hits) do not move them
        for _ in range(3):
            got = fleet.get_many(NS, [*keys, absent])
            assert [bytes(b) for b in got[:4]] == [b for _, b in items] and got[4] is None
            assert rotation.last_target == own.target
        assert rotation.failovers == 2
        assert ram_of(own.target).misses == own_before.misses + 3  # own served all three
        after = ram_of(other.target)
        assert (after.hits, after.misses) == (during.hits, during.misses)  # and the other none


def test_the_async_fleet_client_leaves_a_silent_own_server_the_same_way(
    own_and_other: tuple[KVServerProcess, KVServerProcess],
) -> None:
    own, other = own_and_other
    key, block = keyed(os.urandom(8192))
    for target in (own.target, other.target):
        with KVCacheClient(target, timeout_s=10, retry=ONCE) as direct:
            assert direct.put_many(NS, [(key, block)]).stored == 1
    client = async_fleet_client([own.target, other.target], timeout_s=DEADLINE_S, retry=ONCE, cooldown_s=COOLDOWN_S)
    before = ram_of(other.target)

    async def run() -> float:
        async with client:
            assert [bytes(b) for b in await client.get_many(NS, [key])] == [block]
            assert client._transport.rotation.last_target == own.target
            sigstop(own.proc.pid)
            start = time.monotonic()
            assert [bytes(b) for b in await client.get_many(NS, [key])] == [block]
            took = time.monotonic() - start
            assert client._transport.rotation.last_target == other.target
            own.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(COOLDOWN_S + 0.1)
            assert [bytes(b) for b in await client.get_many(NS, [key])] == [block]
            assert client._transport.rotation.last_target == own.target
            assert client._transport.rotation.failovers == 1
            return took

    took = asyncio.run(run())
    assert took < 0.8 * DEADLINE_S
    assert ram_of(other.target).hits == before.hits + 1  # the one Get of the stop, and only it
