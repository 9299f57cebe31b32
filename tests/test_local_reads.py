"""get_into on the same host copies blocks straight out of the arena where the presence index locates
them, verified where they land, and names them in one TOUCH (kvcache_client.local_reads), against
real servers (the in-process ServerThread with its bulk port).

What the code before did: every same-host get_into sent its blocks through the bulk socket (a GET) or
leased them (LEASE and RELEASE frames); the index had no locations and the server no TOUCH frame.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient, PermissionDenied
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
    """The race a lease would have kept out, made certain: key A's location read, then A deleted and
    B (same size) put into A's slot, then A's get_into copies from that stale location. B's bytes do
    not verify under A: the get goes the usual way (A missing: False; A put again elsewhere: its own
    bytes), counted as read_again, never as corruption."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    (a, block_a), (b, block_b) = _items(2)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("ns", [(a, block_a)]).stored == 1
        (stale,) = client.presence.locate("ns", [a])
        client.delete("ns", [a])
        assert client.put_many("ns", [(b, block_b)]).stored == 1
        assert client.presence.locate("ns", [b]) == [stale]  # B took A's slot: the location is B's now
        real = client.presence.locate
        client.presence.locate = lambda ns, keys: [stale] * len(keys)  # type: ignore[method-assign]
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
        dst = [bytearray(16 * KiB), bytearray(16 * KiB), bytearray(16 * KiB - 1)]
        with pytest.raises(ValueError):
            client.get_into("ns", keys, dst)
        assert client.presence.counters.read_in_place == 0 and server.running.bulk.counters.get("touches") == 0


def _tokens(tmp: Path, rights: dict[str, str]) -> str:
    text = "".join(
        f'[[tokens]]\nname = "{name}"\ntenant = "{tenant}"\nsha256 = "{token_digest(name).hex()}"\nrights = {r}\n'
        for name, (tenant, r) in rights.items()
    )
    path = tmp / "tokens.toml"
    path.write_text(text)
    return str(path)


def test_the_touch_needs_the_read_right(make_server, tmp_path: Path) -> None:
    """A token that may write but not read maps the arena (its tenant's, same user) and locates its
    blocks, but its get_into fails PermissionDenied as its GET would: the TOUCH is refused."""
    tokens = _tokens(
        tmp_path, {"kvc_rw_token_of_t": ("t", '["read", "write"]'), "kvc_w_token_of_t": ("t", '["write"]')}
    )
    server: ServerThread = make_server(
        ram={"capacity_bytes": 64 * MiB},
        shm={"dir": str(tmp_path / "shm")},
        auth={"enabled": True, "tokens_file": tokens},
    )
    items = _items(2)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, token="kvc_rw_token_of_t", timeout_s=10) as rw:
        assert rw.put_many("ns", items).stored == 2
        assert rw.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys]) == [True, True]
        assert rw.presence.counters.read_in_place == 2
    with KVCacheClient(server.target, token="kvc_w_token_of_t", timeout_s=10) as writer:
        writer.put_many("ns", _items(1))  # Info asked, the index mapped
        assert writer.presence.locates and len(writer.presence.locate("ns", keys)) == 2
        with pytest.raises(PermissionDenied):
            writer.get_into("ns", keys, [bytearray(16 * KiB) for _ in keys])
        assert writer.presence.counters.read_in_place == 2  # copied, then refused: the call failed
        assert server.running.bulk.counters.get("touches") == 1  # rw's; the writer's was refused


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

    table = PresenceTable(str(tmp_path), 64 * 4, instance_id=7, lower_tiers=False)
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
    located = [link.locate("ns", [k]) for k in crowd]
    assert [unpack_location(w) for (w,) in located[:BUCKET_SLOTS]] == [
        (64 * (i + 1), 1000 + i) for i in range(BUCKET_SLOTS)
    ]
    assert located[BUCKET_SLOTS] == []  # spilled: kept by the server, not in the table
    assert len(link.locate("ns", crowd)) == BUCKET_SLOTS  # the prefix stops at the spilled one
    table.remove("ns", crowd[0])  # its slot takes the spilled key, with its location
    assert link.locate("ns", [crowd[0]]) == []
    assert [unpack_location(w) for w in link.locate("ns", crowd[1:])] == [
        (64 * (i + 1), 1000 + i) for i in range(1, BUCKET_SLOTS + 1)
    ]
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


def test_landing_small_blocks_checks_every_header_byte_but_the_checksum_against_the_last_parsed() -> None:
    """land_jobs' shortcut (a header equal to the last one parsed, all but its checksum, is not
    parsed again) never lets through what parse_header or the checksum would refuse: a changed
    dtype byte, non-zero reserved bytes, another key, a short block. All or nothing, counted."""
    from kvcache_client.local_reads import land_jobs
    from kvcache_client.presence import PresenceCounters
    from kvcache_core.format import encode_bytes_parts

    keys = [os.urandom(16) for _ in range(3)]
    payloads = [os.urandom(4096) for _ in keys]
    blocks = [bytearray(h + bytes(p)) for h, p in encode_bytes_parts(keys, payloads)]

    def run(
        mutate: int | None = None, at: int = 0, key_of_last: bytes | None = None, cut: bool = False, grow: bool = False
    ) -> bool:
        bs = [bytearray(b) for b in blocks]
        if mutate is not None:
            bs[2][at] ^= mutate
        if cut:
            bs[2] = bs[2][:-64]
        if grow:  # a location's length past its block: the header's payload length disagrees with it
            bs[2] += bytes(64)
        ks = [*keys[:2], key_of_last or keys[2]]
        sinks = [memoryview(bytearray(len(p) - (64 if cut and i == 2 else 0))) for i, p in enumerate(payloads)]
        counters = PresenceCounters()
        got = land_jobs([(memoryview(b), k, s) for b, k, s in zip(bs, ks, sinks, strict=True)], counters)
        landed = len(got.landed) == 3
        assert landed or (not got.landed and counters.read_again == 1)
        if landed:
            assert [bytes(s) for s in sinks] == payloads and counters.read_in_place == 3
        return landed

    assert run()
    assert not run(mutate=0x01, at=8)  # the dtype byte (uint8 -> another): the checksum covers it
    assert not run(mutate=0x01, at=12)  # a reserved byte: parse_header refuses it
    assert not run(mutate=0x01, at=50)  # a payload byte
    assert not run(mutate=0x01, at=33)  # a checksum byte
    assert not run(mutate=0x01, at=40)  # the shape's dimension, after the checksum: raw_len disagrees
    assert not run(key_of_last=keys[0])  # another key's block
    assert not run(cut=True)  # a shorter block: parsed in full, its payload_len disagrees
    assert not run(grow=True)  # a longer one, its sink the payload's size: refused, not a ValueError
