"""get_into on the same host copies blocks straight out of the arena where the presence index locates
them, verified where they land, and names them in one TOUCH (kvcache_client.local_reads), against
real servers (the in-process ServerThread with its bulk port).

What the code before did: every same-host get_into sent its blocks through the bulk socket (a GET) or
leased them (LEASE and RELEASE frames); the index had no locations and the server no TOUCH frame.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient, PermissionDenied
from kvcache_core import bulkwire as bw
from kvcache_core.format import payload_view
from kvcache_core.presence import (
    FLAG_LOCATIONS,
    W_FLAGS,
    pack_location,
    unpack_header,
    unpack_location,
)
from kvcache_server.auth import token_digest
from kvcache_server.presence import PresenceTable
from kvcache_server.refusal import Refused
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
KiB = 1 << 10


def _items(n: int, size: int = 16 * KiB) -> list[tuple[bytes, bytes]]:
    return [(k, raw_block(k, os.urandom(size))) for k in (os.urandom(16) for _ in range(n))]


def _frames(server: ServerThread) -> tuple[int, int, int]:
    c = server.running.bulk.counters
    return c.get("gets"), c.get("leases"), c.get("touches")


def _ram(client: KVCacheClient):  # type: ignore[no-untyped-def]
    return next(t for t in client.stats().tiers if t.name == "ram")


def test_get_into_copies_located_blocks_out_of_the_arena_and_touches_them(make_server) -> None:
    """One TOUCH frame, no GET and no LEASE; the bytes exact; each block a RAM hit; both faces."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(8)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", items).stored == 8
        client.lookup("ns", keys)  # Info asked, the index mapped
        hits, before = _ram(client).hits, _frames(server)
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True] * 8
        assert [bytes(d) for d in dst] == [bytes(payload_view(b)) for _, b in items]
        assert _frames(server) == (before[0], before[1], before[2] + 1)
        assert _ram(client).hits == hits + 8
        assert client.presence.counters.read_in_place == 8 and client.presence.counters.read_again == 0
        assert client.stats().inplace_bytes_leased == sum(len(b) for _, b in items)
        many = _items(40)  # more keys than are located one by one: numpy's path
        assert client.put_many("ns", many).stored == 40
        dst = [bytearray(16 * KiB) for _ in many]
        assert client.get_into("ns", [k for k, _ in many], dst) == [True] * 40
        assert [bytes(d) for d in dst] == [bytes(payload_view(b)) for _, b in many]
        assert client.presence.counters.read_in_place == 48

    async def run() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as aclient:
            await aclient.lookup("ns", keys)
            before = _frames(server)
            dst = [np.zeros(16 * KiB, np.uint8) for _ in keys]
            assert await aclient.get_into("ns", keys, dst, prefix_only=True) == [True] * 8
            assert [d.tobytes() for d in dst] == [bytes(payload_view(b)) for _, b in items]
            assert _frames(server) == (before[0], before[1], before[2] + 1)
            assert aclient.presence.counters.read_in_place == 8

    asyncio.run(run())


def test_a_block_read_in_place_counts_as_used_and_outlives_unread_ones(make_server) -> None:
    """RAM of 20 blocks holding 20: one read in place, then 10 more put. The 10 least recently used
    go, the block read among the survivors (a read nobody told the server of would have left it the
    oldest: the first evicted)."""
    probe = _items(1)[0][1]
    server: ServerThread = make_server(ram={"capacity_bytes": 20 * _entry_cost(probe)})
    first = _items(20)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", first).stored == 20
        read = first[0][0]
        assert client.get_into("ns", [read], [bytearray(16 * KiB)]) == [True]
        assert client.presence.counters.read_in_place == 1
        assert client.put_many("ns", _items(10)).stored == 10
        present = [client.lookup("ns", [k]).prefix_length for k, _ in first]
        assert present[0] == 1 and present[1:11] == [0] * 10 and present[11:] == [1] * 9


def _entry_cost(block: bytes) -> int:
    from kvcache_server.tiers.ram import RamTier

    return RamTier.entry_cost_of(len(block))


def test_a_stale_location_is_never_wrong_bytes_and_the_server_answers_instead(make_server) -> None:
    """The race a lease would have kept out, made certain: key A's location read (with its bucket's
    version), then A deleted and B (same size) put into A's slot, then A's get_into copies from what
    it read. B's bytes do not verify under A, and A's bucket changed: the get goes the usual way (A
    missing: False; A put again elsewhere: its own bytes), counted as read_again, never as corruption."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    (a, block_a), (b, block_b) = _items(2)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", [(a, block_a)]).stored == 1
        stale = client.presence.locate("ns", [a])
        client.delete("ns", [a])
        assert client.put_many("ns", [(b, block_b)]).stored == 1
        assert client.presence.locate("ns", [b]).words == stale.words  # B took A's slot
        real = client.presence.locate
        client.presence.locate = lambda ns, keys: stale  # type: ignore[method-assign]
        try:
            dst = [bytearray(16 * KiB)]
            assert client.get_into("ns", [a], dst) == [False]
            assert client.presence.counters.read_again == 1
            assert client.put_many("ns", [(a, block_a)]).stored == 1
            dst = [bytearray(16 * KiB)]
            assert client.get_into("ns", [a], dst) == [True]
            assert bytes(dst[0]) == bytes(payload_view(block_a))
            assert client.presence.counters.read_again == 2 and client.presence.counters.read_in_place == 0
        finally:
            client.presence.locate = real  # type: ignore[method-assign]
        assert client.corrupt_blocks == 0
        dst = [bytearray(16 * KiB), bytearray(16 * KiB)]
        assert client.get_into("ns", [a, b], dst) == [True, True]
        assert [bytes(d) for d in dst] == [bytes(payload_view(block_a)), bytes(payload_view(block_b))]
        assert client.presence.counters.read_in_place == 2


def test_another_namespaces_block_of_the_same_key_in_the_slot_is_never_returned(make_server) -> None:
    """A block's checksum binds it to its key, not to its namespace: (ns "a", K) located, then
    deleted, and (ns "b", K) with other bytes put into the same slot, verifies under K. The bucket's
    version (the index's seqlock) changed meanwhile, so the copy is not used: get_into("a", K) is a
    miss, not b's bytes (before the versions it returned b's bytes as a's)."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    key = os.urandom(16)
    block_a, block_b = raw_block(key, os.urandom(16 * KiB)), raw_block(key, os.urandom(16 * KiB))
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("a", [(key, block_a)]).stored == 1
        stale = client.presence.locate("a", [key])
        client.delete("a", [key])
        assert client.put_many("b", [(key, block_b)]).stored == 1
        assert client.presence.locate("b", [key]).words == stale.words  # b's block in a's old slot
        real = client.presence.locate
        client.presence.locate = lambda ns, keys: stale  # type: ignore[method-assign]
        try:
            dst = [bytearray(16 * KiB)]
            assert client.get_into("a", [key], dst) == [False]
            assert client.presence.counters.read_again == 1 and client.presence.counters.read_in_place == 0
        finally:
            client.presence.locate = real  # type: ignore[method-assign]
        dst = [bytearray(16 * KiB)]
        assert client.get_into("b", [key], dst) == [True] and bytes(dst[0]) == bytes(payload_view(block_b))


def test_keys_not_all_located_or_destinations_of_another_size_take_the_usual_path(make_server) -> None:
    """A key RAM lacks, or a destination of the wrong size: no read in place at all (so no destination
    is written before the usual path's ValueError, and a prefix stops where the server says)."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(3)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", items[:2]).stored == 2
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst, prefix_only=True) == [True, True, False]
        assert client.presence.counters.read_in_place == 0
        client.put_many("ns", items[2:])
        # 1 byte short; 8 bytes over (what a header of one more dimension measures: the block's own
        # header decides, not the difference of sizes). Nothing is read in place (no TOUCH, no copy):
        # the usual path's ValueError, as before.
        for wrong in (16 * KiB - 1, 16 * KiB + 8):
            dst = [bytearray(16 * KiB), bytearray(wrong), bytearray(16 * KiB)]
            with pytest.raises(ValueError):
                client.get_into("ns", keys, dst)
        assert client.presence.counters.read_in_place == 0 and client.presence.counters.read_again == 0
        assert server.running.bulk.counters.get("touches") == 0


def _tokens(tmp: Path, rights: dict[str, str]) -> str:
    text = "".join(
        f'[[tokens]]\nname = "{name}"\ntenant = "{tenant}"\nsha256 = "{token_digest(name).hex()}"\nrights = {r}\n'
        for name, (tenant, r) in rights.items()
    )
    path = tmp / "tokens.toml"
    path.write_text(text)
    return str(path)


def _secured(make_server, tmp_path: Path, rights: dict[str, tuple[str, str]]) -> ServerThread:  # type: ignore[no-untyped-def]
    """A server with auth on, these tokens (name: (tenant, rights)), and its own shm directory."""
    tokens = _tokens(tmp_path, rights)
    return make_server(
        ram={"capacity_bytes": 64 * MiB},
        shm={"dir": str(tmp_path / "shm")},
        auth={"enabled": True, "tokens_file": tokens},
    )


@pytest.mark.parametrize("read", ["get_into", "get_many"])
def test_the_touch_needs_the_read_right(make_server, tmp_path: Path, read: str) -> None:
    """A token that may write but not read maps the arena (its tenant's, same user) and locates its
    blocks, but its get_into (or get_many) fails PermissionDenied as its GET would: the TOUCH is
    refused, and nothing copied is handed over."""
    server = _secured(
        make_server, tmp_path, {"kvc_rw_token_of_t": ("t", '["read", "write"]'), "kvc_w_token_of_t": ("t", '["write"]')}
    )
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token="kvc_rw_token_of_t", timeout_s=10) as rw:
        assert rw.put_many("ns", items).stored == 2
        if read == "get_into":
            assert rw.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        else:
            assert rw.get_many("ns", keys) == [b for _, b in items]
        assert rw.presence.counters.read_in_place == 2
    with KVCacheClient(server.target, token="kvc_w_token_of_t", timeout_s=10) as writer:
        writer.put_many("ns", _items(1))  # Info asked, the index mapped
        assert writer.presence.locates and len(writer.presence.locate("ns", keys).words) == 2
        dst = [bytearray(b"\xff" * (16 * KiB)) for _ in keys]
        with pytest.raises(PermissionDenied):
            writer.get_into("ns", keys, dst) if read == "get_into" else writer.get_many("ns", keys)
        if read == "get_into":
            assert all(d == bytes(16 * KiB) for d in dst)  # what was copied is wiped, not handed over
        assert writer.presence.counters.read_in_place == 0
        assert server.running.bulk.counters.get("touches") == 1  # rw's; the writer's was refused


def _touch_gate(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[], None] | None = None
) -> tuple[list, threading.Event]:
    """Session._touch patched: the next `armed[0]` TOUCHes (armed by the test, counted down by the
    server, since a client no longer waits for the answer) each wait (up to 60 s) for the event
    before the server handles them (then `then()` runs in the session's thread in place of the
    handling, when given: a refusal)."""
    from kvcache_server.bulk.session import Session

    touch, armed, release = Session._touch, [0], threading.Event()

    def gated(self: Session, length: int, deadline: object) -> None:
        if armed[0]:
            armed[0] -= 1
            release.wait(60)
            if then is not None:
                self._control(bw.FrameType.TOUCH, length, deadline)  # type: ignore[arg-type]
                then()
        touch(self, length, deadline)  # type: ignore[arg-type]

    monkeypatch.setattr(Session, "_touch", gated)
    return armed, release


def _in_thread(call: Callable[[], object], join_s: float = 20) -> list:
    """call() in a thread joined for at most `join_s`: [its result], or [] while it still waits."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(join_s)
    return out


def test_a_touch_of_a_namespace_answered_before_does_not_wait_for_its_answer(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first get_into of a namespace on a connection waits for its TOUCHED (a refusal fails that
    call); later ones leave the answer to the connection's next request: with the server holding the
    second TOUCH unanswered, the get_into returns its exact bytes; the next request reads the answer
    first, and every TOUCH is counted, exactly. The code before waited for each answer (the second
    get_into hung until the server answered)."""
    armed, release = _touch_gate(monkeypatch)
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(4)
    keys = [k for k, _ in items]
    want = [bytes(payload_view(b)) for _, b in items]
    with KVCacheClient(server.target, timeout_s=30) as client:
        assert client.put_many("ns", items).stored == 4
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True] * 4
        hits = _ram(client).hits
        armed[0] = 1
        dst = [bytearray(16 * KiB) for _ in keys]
        assert _in_thread(lambda: client.get_into("ns", keys, dst)) == [[True] * 4], "waited for TOUCHED"
        assert [bytes(d) for d in dst] == want
        assert server.running.bulk.counters.get("touches") == 1  # the second one is held in the server
        release.set()
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True] * 4  # its TOUCH after the held one's answer
        assert [bytes(d) for d in dst] == want
        assert client.put_many("ns", _items(1)).stored == 1  # a request on the connection: the answer read
        assert server.running.bulk.counters.get("touches") == 3
        assert _ram(client).hits == hits + 8
        assert client.presence.counters.read_in_place == 12 and client.bulk.counters.reconnects == 0


def test_the_asyncio_face_does_not_wait_for_a_touch_answered_before_either(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncKVCacheClient: the same rule, through its worker thread. The second get_into ends while
    the server holds its TOUCH; the counts are exact once the next request on the connection ran."""
    armed, release = _touch_gate(monkeypatch)
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(3)
    keys = [k for k, _ in items]
    want = [bytes(payload_view(b)) for _, b in items]

    async def run() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=30) as client:
            assert (await client.put_many("ns", items)).stored == 3
            dst = [np.zeros(16 * KiB, np.uint8) for _ in keys]
            assert await client.get_into("ns", keys, dst) == [True] * 3
            armed[0] = 1
            dst = [np.zeros(16 * KiB, np.uint8) for _ in keys]
            assert await asyncio.wait_for(client.get_into("ns", keys, dst), 20) == [True] * 3
            assert [d.tobytes() for d in dst] == want
            assert server.running.bulk.counters.get("touches") == 1
            release.set()
            assert (await client.put_many("ns", _items(1))).stored == 1  # reads the held TOUCH's answer first
            assert server.running.bulk.counters.get("touches") == 2
            assert client.presence.counters.read_in_place == 6

    asyncio.run(run())


def test_a_late_refusal_of_a_touch_ends_the_connection_and_the_next_call_reconnects(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that refuses a TOUCH it answered before on the same connection (it never does: the
    read right stays the token's) ends that connection. The get_into that sent it has its bytes (the
    client maps the arena: the answer decides counting, not access); the next call reads the
    refusal first, drops the connection, and runs whole on a new one."""

    def refuse() -> None:
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, "test: no read right any more")

    armed, release = _touch_gate(monkeypatch, then=refuse)
    release.set()
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(2)
    keys = [k for k, _ in items]
    want = [bytes(payload_view(b)) for _, b in items]
    with KVCacheClient(server.target, timeout_s=30) as client:
        assert client.put_many("ns", items).stored == 2
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        armed[0] = 1
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True, True] and [bytes(d) for d in dst] == want
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True, True] and [bytes(d) for d in dst] == want
        assert client.bulk.counters.reconnects == 1
        assert server.running.bulk.counters.get("touches") == 2  # the first and the last
        assert client.presence.counters.read_in_place == 6 and client.presence.counters.read_again == 0


def test_touches_go_unanswered_back_to_back_and_never_on_a_connection_the_server_closed(make_server) -> None:
    """Five get_intos on one connection: the first TOUCH waited for, the four after it not (each
    reads the one before's answer first), every one counted. Then the server closes the idle
    connection (bulk.idle_timeout_s) between get_intos, three times: each TOUCH is waited for, so
    each goes to a new connection and is counted (sent unanswered on the closed one, every other
    one was lost). A client closed with an answer unread reads it first: no connection reset (the
    server's `aborted`)."""
    import time

    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB}, bulk={"idle_timeout_s": 0.3})
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=30) as client:
        assert client.put_many("ns", items).stored == 2
        for _ in range(5):
            assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert client.bulk.counters.touches_unanswered == 4
        assert client.put_many("ns", _items(1)).stored == 1  # reads the last answer
        assert server.running.bulk.counters.get("touches") == 5
        for i in range(3):
            time.sleep(0.8)  # the server closes the connection, idle
            assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
            assert server.running.bulk.counters.get("touches") == 6 + i
        assert client.bulk.counters.touches_unanswered == 4
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert client.bulk.counters.touches_unanswered == 5
    admission = server.running.bulk.admission
    end = time.monotonic() + 10  # the server's connection threads see the client's closes
    while admission.authenticated + admission.unauthenticated and time.monotonic() < end:
        time.sleep(0.01)
    assert admission.authenticated + admission.unauthenticated == 0
    assert server.running.bulk.counters.get("aborted") == 0


def test_a_copy_that_fails_after_an_unanswered_touch_still_reads_its_answer_before_the_close(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copies fail (here a RuntimeError) after a TOUCH left unanswered was sent: the call raises
    it, the connection is closed, and its close reads the answer owed first: no reset seen by the
    server (its `aborted`), the TOUCH counted; the next call runs on a new connection."""
    import time

    import kvcache_client.bulk as bulk_module

    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(2)
    keys = [k for k, _ in items]
    land = bulk_module.land_plan
    with KVCacheClient(server.target, timeout_s=30) as client:
        assert client.put_many("ns", items).stored == 2
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]

        def broken(*args: object) -> object:
            raise RuntimeError("test: the copies failed")

        monkeypatch.setattr(bulk_module, "land_plan", broken)
        with pytest.raises(RuntimeError):
            client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys])
        assert client.bulk.counters.touches_unanswered == 1
        monkeypatch.setattr(bulk_module, "land_plan", land)
        admission = server.running.bulk.admission
        end = time.monotonic() + 10
        while admission.authenticated + admission.unauthenticated and time.monotonic() < end:
            time.sleep(0.01)  # the closed connection's thread ends
        assert server.running.bulk.counters.get("aborted") == 0
        assert server.running.bulk.counters.get("touches") == 2
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert server.running.bulk.counters.get("touches") == 3


def test_a_client_with_a_token_waits_for_every_touch(
    make_server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With auth on, a TOUCH checks the token's read right and its tenant's rate, either of which a
    later TOUCH may fail (the rate): a client with a token waits for each answer, so a refusal is
    its own call's status (a tenant over its rate gets RESOURCE_EXHAUSTED where it went over, not
    one call later)."""
    armed, release = _touch_gate(monkeypatch)
    server = _secured(make_server, tmp_path, {"kvc_rw_token_of_t": ("t", '["read", "write"]')})
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token="kvc_rw_token_of_t", timeout_s=30) as client:
        assert client.put_many("ns", items).stored == 2
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        armed[0] = 1
        gated = _in_thread(lambda: client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]), 2)
        assert gated == []  # waits for its TOUCH's answer
        release.set()  # the TOUCH answered: the call returns
        # The gated TOUCH is counted when its session thread runs again, which may come after the
        # gets below were answered on other connections: wait for the gated call's answer first.
        deadline = time.monotonic() + 10
        while not gated and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gated == [[True, True]]
        for _ in range(3):
            assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert client.bulk.counters.touches_unanswered == 0
        # One TOUCH per get read in place; a get whose copy did not hold (counted in read_again, on a
        # loaded machine) took the usual path, which sends none.
        assert server.running.bulk.counters.get("touches") == 5 - client.presence.counters.read_again


def test_a_slow_touch_answer_fails_the_next_request_by_its_deadline_and_nothing_else(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds a TOUCH left unanswered past the next request's deadline: that request fails
    DEADLINE_EXCEEDED, as it would waiting for its own answer, not as a refused TOUCH (no reconnect,
    the idle pool kept); the calls after it run as usual."""
    from kvcache_client import DeadlineExceeded

    armed, release = _touch_gate(monkeypatch)
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=1) as client:
        assert client.put_many("ns", items).stored == 2
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        armed[0] = 1
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        with pytest.raises(DeadlineExceeded):
            client.put_many("ns", _items(1))
        release.set()
        assert client.bulk.counters.reconnects == 0
        assert client.put_many("ns", _items(1)).stored == 1
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]


def test_an_arena_shared_by_tenants_has_no_locations(make_server, tmp_path: Path) -> None:
    """Tenants that share one arena (shm.share_arena_across_tenants) get indexes without locations:
    a slot reused by another tenant's block of the same key would verify under it."""
    tokens = _tokens(tmp_path, {"kvc_token_of_a": ("a", '["read", "write"]'), "kvc_token_of_b": ("b", '["read"]')})
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 * MiB},
        shm={"dir": str(tmp_path / "shm"), "share_arena_across_tenants": True},
        auth={"enabled": True, "tokens_file": tokens},
    )
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token="kvc_token_of_a", timeout_s=10) as a:
        assert a.put_many("ns", items).stored == 2
        assert a.presence.state == "on" and not a.presence.locates
        with open(a.presence.path, "rb") as f:
            assert not unpack_header(f.read(64))[W_FLAGS] & FLAG_LOCATIONS
        assert a.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert a.presence.counters.read_in_place == 0


def test_the_table_keeps_each_fingerprints_location_through_spills(tmp_path: Path) -> None:
    """The writer alone: a location is written with its fingerprint; a full bucket's spilled key is
    not in the table while it waits (a reader asks the server), and brings its location along when a
    freed slot takes it."""
    from kvcache_client.presence import PresenceLink
    from kvcache_core.presence import BUCKET_SLOTS, fingerprint

    table = PresenceTable(str(tmp_path), 64 * 4, instance_id=7, lower_tiers=False, locations=True)
    link = PresenceLink()
    link.configure(table.path, 7)
    assert link.locates
    mask = table.buckets - 1
    crowd: list[bytes] = []
    while len(crowd) < BUCKET_SLOTS + 1:  # nine keys of bucket 0
        k = os.urandom(16)
        if fingerprint(table._seed, b"ns", k) & mask == 0:
            crowd.append(k)
    for i, k in enumerate(crowd):
        table.add("ns", k, pack_location(64 * (i + 1), 1000 + i))
    located = [link.locate("ns", [k]).words for k in crowd]
    assert [unpack_location(w) for (w,) in located[:BUCKET_SLOTS]] == [
        (64 * (i + 1), 1000 + i) for i in range(BUCKET_SLOTS)
    ]
    assert located[BUCKET_SLOTS] == []  # spilled: kept by the server, not in the table
    before = link.locate("ns", crowd)
    assert len(before.words) == BUCKET_SLOTS and link.unchanged(before)  # the prefix stops at the spilled one
    table.remove("ns", crowd[0])  # its slot takes the spilled key, with its location
    assert not link.unchanged(before)  # the bucket changed: what was located may have moved
    assert link.locate("ns", [crowd[0]]).words == []
    after = link.locate("ns", crowd[1:])
    assert [unpack_location(w) for w in after.words] == [(64 * (i + 1), 1000 + i) for i in range(1, BUCKET_SLOTS + 1)]
    assert link.unchanged(after)
    table.close()


def test_touch_frames_count_only_the_callers_own_blocks_and_refuse_bad_input(make_server) -> None:
    """Raw TOUCH frames: keys RAM holds are counted read (a hit each), others not; an empty or
    malformed TOUCH is INVALID_ARGUMENT and the connection closed; the server goes on. The wire
    encoding round-trips."""
    from kvcache_core import bulkwire as bw
    from tests.test_bulk_lease import Raw

    keys = [os.urandom(16) for _ in range(3)]
    assert bw.parse_touch(bw.touch("ns", keys)) == ("ns", keys)
    assert bw.parse_touched(bw.touched(5)) == 5
    for bad in (bw.touch("ns", keys)[:-1], bw.touch("ns", keys) + b"x", b"\x00"):
        with pytest.raises(bw.FrameError):
            bw.parse_touch(bad)
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    items = _items(2)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        hits = _ram(client).hits
        raw = Raw(server.running.bulk.port)
        try:
            raw.send(bw.FrameType.TOUCH, bw.touch("n", [items[0][0], os.urandom(16), items[1][0]]))
            kind, payload = raw.read()
            assert kind is bw.FrameType.TOUCHED and bw.parse_touched(payload) == 3
            assert _ram(client).hits == hits + 2  # the key RAM lacks is not a hit
            raw.send(bw.FrameType.TOUCH, bw.touch("other", [items[0][0]]))
            assert raw.read()[0] is bw.FrameType.TOUCHED and _ram(client).hits == hits + 2  # another namespace's
            raw.send(bw.FrameType.TOUCH, bw.touch("n", []))
            code, message = raw.error()
            assert code.name == "INVALID_ARGUMENT" and "keys" in message
        finally:
            raw.close()
        raw = Raw(server.running.bulk.port)
        try:
            raw.send(bw.FrameType.TOUCH, bw.touch("n", keys)[:-3])
            code, message = raw.error()
            assert code.name == "INVALID_ARGUMENT" and "TOUCH" in message
        finally:
            raw.close()
        assert server.running.bulk.counters.get("touches") == 2
        assert client.get_into("n", [items[0][0]], [bytearray(16 * KiB)]) == [True]  # the server goes on


def test_the_header_shortcut_checks_every_byte_but_the_checksum_against_the_last_parsed() -> None:
    """local_reads' shortcut (a header equal to the last one parsed, all but its checksum, is not
    parsed again) never lets through what parse_header, the size or the checksum would refuse: a
    changed dtype byte, non-zero reserved bytes, a shape dimension, another key, a block shorter or
    longer than its header says."""
    from kvcache_client.local_reads import _copied, _Headers
    from kvcache_core.format import encode_bytes_parts

    keys = [os.urandom(16) for _ in range(3)]
    payloads = [os.urandom(4096) for _ in keys]
    blocks = [bytes(h + bytes(p)) for h, p in encode_bytes_parts(keys, payloads)]

    def lands(mutate: int | None = None, at: int = 0, key: bytes | None = None, cut: int = 0, grow: int = 0) -> bool:
        headers = _Headers()
        for block, k, payload in zip(blocks[:2], keys[:2], payloads[:2], strict=True):  # parsed: the memo
            parsed = headers.parse(memoryview(block))
            sink = memoryview(bytearray(4096))
            assert parsed is not None and _copied(memoryview(block), k, sink, parsed) and bytes(sink) == payload
        last = bytearray(blocks[2])
        if mutate is not None:
            last[at] ^= mutate
        last = last[: len(last) - cut] + bytes(grow)
        parsed = headers.parse(memoryview(bytes(last)))
        if parsed is None or parsed.payload_len != 4096:
            return False
        sink = memoryview(bytearray(4096))
        ok = _copied(memoryview(bytes(last)), key or keys[2], sink, parsed)
        assert not ok or bytes(sink) == payloads[2]
        return ok

    assert lands()
    assert not lands(mutate=0x01, at=8)  # the dtype byte (uint8 -> another): the checksum covers it
    assert not lands(mutate=0x01, at=12)  # a reserved byte: parse_header refuses it
    assert not lands(mutate=0x01, at=50)  # a payload byte
    assert not lands(mutate=0x01, at=33)  # a checksum byte
    assert not lands(mutate=0x01, at=40)  # the shape's dimension, after the checksum: raw_len disagrees
    assert not lands(key=keys[0])  # another key's block
    assert not lands(cut=64)  # a shorter block: parsed in full, its payload_len disagrees
    assert not lands(grow=64)  # a longer one (a location's length past its block): refused, not a ValueError


@pytest.mark.parametrize("read", ["get_into", "get_many"])
def test_reads_in_place_racing_a_writer_that_swaps_namespaces_never_return_the_other_block(
    make_server, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """A writer thread deletes and puts one key in two namespaces with different bytes as fast as it
    can (each put takes the slot the delete freed), while this thread get_into's (or get_many's: the
    whole block, header included) it from namespace "a" for two seconds, each block's header read out
    of the arena 1 ms after its location (the race window made wide): every block found is a's,
    exactly. Bounded in time; the counts add up. With the version check removed, b's bytes came back
    as a's within the two seconds, both ways."""
    import threading
    import time

    import kvcache_client.local_reads as local_reads

    parse = local_reads._Headers.parse

    def late(self: object, block: memoryview) -> object:
        time.sleep(0.001)
        return parse(self, block)  # type: ignore[arg-type]

    monkeypatch.setattr(local_reads._Headers, "parse", late)

    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    key = os.urandom(16)
    block_a, block_b = raw_block(key, os.urandom(16 * KiB)), raw_block(key, os.urandom(16 * KiB))
    want = bytes(payload_view(block_a)) if read == "get_into" else block_a
    stop = threading.Event()
    swaps = [0]

    def writer() -> None:
        with KVCacheClient(server.target, timeout_s=10) as w:
            w.bulk.read_in_place = False
            while not stop.is_set():
                w.put_many("a", [(key, block_a)])
                w.delete("a", [key])
                w.put_many("b", [(key, block_b)])
                w.delete("b", [key])
                swaps[0] += 1

    thread = threading.Thread(target=writer, daemon=True)
    with KVCacheClient(server.target, timeout_s=10) as client:
        client.put_many("a", [(key, block_a)])
        thread.start()
        found = calls = 0
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            if read == "get_into":
                dst = [bytearray(16 * KiB)]
                got = bytes(dst[0]) if client.get_into("a", [key], dst) == [True] else None
            else:
                (block,) = client.get_many("a", [key])
                got = None if block is None else bytes(block)
            if got is not None:
                assert got == want
                found += 1
            calls += 1
        stop.set()
        thread.join(10)
        c = client.presence.counters
        assert not thread.is_alive() and swaps[0] > 10 and calls > 10
        assert client.corrupt_blocks == 0 and c.read_in_place <= found <= calls and c.read_again > 0


def test_no_reads_in_place_off_x86_or_with_another_arena_mapped(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index's seqlock relies on x86-64 keeping stores and loads in order: elsewhere the server
    offers no locations. And a client whose arena mapping is not the one its Info named (it followed
    a restarted server's arena) does not pair the two: the usual path, the bytes exact either way."""
    items = _items(2)
    keys = [k for k, _ in items]
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", items).stored == 2
        client.lookup("ns", keys)
        monkeypatch.setattr(client._transport.inner.arena, "path", "/dev/shm/another-arena")
        dst = [bytearray(16 * KiB) for _ in keys]
        assert client.get_into("ns", keys, dst) == [True, True]
        assert [bytes(d) for d in dst] == [bytes(payload_view(b)) for _, b in items]
        assert client.presence.counters.read_in_place == 0
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    other: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    with KVCacheClient(other.target, timeout_s=10) as client:
        assert client.put_many("ns", items).stored == 2
        assert client.presence.state == "on" and not client.presence.locates
        assert client.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert client.presence.counters.read_in_place == 0
