"""The arena's trust model (docs/arena.md, "Who may write and read which bytes"), tried as a stalled,
buggy or greedy same-host client would, against real gRPC servers: no client is handed a writable
slot, every pinned byte is on its tenant's account and capped, a huge LeaseGet is bounded, a put
evicts only what makes room, and the blocking SDK hands back every lease whatever its deadline.

Each test names the figure the code before this change showed (issue 22).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvcache_client import DeadlineExceeded, KVCacheClient
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.arena import align
from kvcache_server.auth import token_digest
from kvcache_server.config import RamSection, ShmSection
from kvcache_server.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
TOKENS = {"a": "kvc_trust_tenant_a_token", "b": "kvc_trust_tenant_b_token", "ops": "kvc_trust_ops_token"}


def _known(section: type, **fields: Any) -> dict[str, Any]:
    """The fields the config section has (so the same test runs against the code before the change,
    which lacks the new knobs, and shows its figures there)."""
    return {k: v for k, v in fields.items() if k in section.__dataclass_fields__}  # type: ignore[attr-defined]


def _md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def _tokens(tmp: Path, *, quota_a: str = "0", quota_b: str = "0") -> Path:
    text = ""
    for name, tenant, rights in (
        ("a", "a", '["read", "write"]'),
        ("b", "b", '["read", "write"]'),
        ("ops", "ops", '["admin"]'),
    ):
        text += f'[[tokens]]\nname = "{name}"\ntenant = "{tenant}"\nsha256 = "{token_digest(TOKENS[name]).hex()}"\n'
        text += f"rights = {rights}\n\n"
    text += f'[tenants.a]\nram_quota_bytes = "{quota_a}"\n[tenants.b]\nram_quota_bytes = "{quota_b}"\n'
    path = tmp / "tokens.toml"
    path.write_text(text)
    return path


def _blocks(n: int, size: int, tag: str = "") -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        k = os.urandom(16) if not tag else (tag.encode() + i.to_bytes(4, "big")).ljust(16, b"\0")[:16]
        out.append((k, raw_block(k, os.urandom(size))))
    return out


def _stub(server: ServerThread) -> pb_grpc.KVCacheStub:
    return pb_grpc.KVCacheStub(grpc.insecure_channel(server.target))


def _put_inline(stub: pb_grpc.KVCacheStub, ns: str, items: list[tuple[bytes, bytes]], md: tuple = ()) -> pb.PutResponse:
    request = pb.PutRequest(namespace=ns, blocks=[pb.Block(key=k, data=b) for k, b in items])
    return stub.Put(iter([request]), metadata=md, timeout=30)


def _get(stub: pb_grpc.KVCacheStub, ns: str, keys: list[bytes], md: tuple = ()) -> dict[bytes, bytes]:
    got: dict[bytes, bytes] = {}
    for reply in stub.Get(pb.GetRequest(namespace=ns, keys=keys), metadata=md, timeout=30):
        for item in reply.items:
            if item.found:
                got[keys[item.index]] = item.data
    return got


# -- no client writes the arena ------------------------------------------------------------------


def test_no_client_is_handed_a_writable_slot_and_the_arena_maps_read_only(make_server, tmp_path: Path) -> None:
    """Before: ArenaReserve handed any same-host client a writable slot; one stalled past
    ram.lease_timeout_s wrote into a slot already reused for another key (a raw Get of B returned
    A's block). Now there is no such slot to write: both RPCs refuse, and the mapping is read-only."""
    server = make_server(ram={"capacity_bytes": 16 * MiB, "lease_timeout_s": 0.2}, shm={"dir": str(tmp_path / "shm")})
    stub = _stub(server)
    for call, request in (
        (stub.ArenaReserve, pb.ArenaReserveRequest(namespace="n", lengths=[MiB])),
        (
            stub.ArenaCommit,
            pb.ArenaCommitRequest(namespace="n", items=[pb.ArenaCommitItem(key=b"k" * 16, reservation=1)]),
        ),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=5)
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "withdrawn" in info.value.details()
    assert server.stack.ram.arena_stats()["reservations"] == 0
    path = stub.Info(pb.InfoRequest(), timeout=5).arena_path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400  # an open for writing fails for its (non-root) owner
    items = _blocks(4, 256 << 10)
    with KVCacheClient(server.target) as client:
        assert client.put_many("n", items).stored == 4
        with client.leased("n", [k for k, _ in items]) as views:
            for view, (_, block) in zip(views, items, strict=True):
                assert bytes(view) == block
                with pytest.raises(TypeError):
                    view[0:1] = b"x"  # type: ignore[index]
        assert client._transport.arena.state == "on"
        mapping = client._transport.arena._readonly
        assert mapping is not None and mapping.readonly
    stats = server.stack.ram.arena_stats()
    assert (stats["reservations"], stats["leases"]) == (0, 0)


def _stoppable_writer(target: str, seed: int, rounds: int, out: Any) -> None:
    """Puts its own 1 MiB blocks through the SDK, over and over; reports what it stored."""
    rng = random.Random(seed)
    stored: dict[bytes, bytes] = {}
    with KVCacheClient(target, timeout_s=60) as client:
        for r in range(rounds):
            items = []
            for i in range(4):
                k = (b"W" + seed.to_bytes(2, "big") + r.to_bytes(4, "big") + bytes([i])).ljust(16, b"w")
                items.append((k, raw_block(k, rng.randbytes(MiB))))
            if client.put_many("shared", items).stored == 4:
                stored.update(items)
    out.put(list(stored.items())[-12:])


def test_a_writer_stopped_mid_put_past_every_timeout_changes_no_other_block(make_server, tmp_path: Path) -> None:
    """A writer process SIGSTOPped at random moments for 3x ram.lease_timeout_s while others put and
    read: every byte the others read is what they stored, every key Lookup reports is served
    byte-identical, and nothing stays reserved. Before: its late copy landed in another key's slot."""
    server = make_server(ram={"capacity_bytes": 48 * MiB, "lease_timeout_s": 0.2}, shm={"dir": str(tmp_path / "shm")})
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    writer = ctx.Process(target=_stoppable_writer, args=(server.target, 7, 60, out))
    writer.start()
    rng = random.Random(1)
    mine: dict[bytes, bytes] = {}
    wrong = compared = 0
    try:
        with KVCacheClient(server.target, timeout_s=30) as client:
            for round_ in range(30):
                if round_ % 3 == 0 and writer.is_alive():
                    time.sleep(rng.uniform(0, 0.05))  # somewhere inside one of its puts
                    os.kill(writer.pid, signal.SIGSTOP)
                items = _blocks(2, MiB)
                if client.put_many("shared", items).stored == 2:
                    mine.update(items)
                keys = list(mine)[-12:]
                for k, got in zip(keys, client.get_many("shared", keys), strict=True):
                    if got is not None:
                        compared += 1
                        wrong += bytes(got) != mine[k]
                if round_ % 3 == 0 and writer.is_alive():
                    time.sleep(0.6)  # 3x the lease time-out, stopped
                    os.kill(writer.pid, signal.SIGCONT)
    finally:
        if writer.is_alive():
            os.kill(writer.pid, signal.SIGCONT)
    theirs = dict(out.get(timeout=120))  # before join: the child cannot exit with its queue unread
    writer.join(30)
    assert writer.exitcode == 0
    assert compared > 0 and wrong == 0
    stub = _stub(server)
    expected = {**mine, **theirs}
    keys = list(expected)
    served = _get(stub, "shared", keys)
    assert served and all(served[k] == expected[k] for k in served)  # every key served is exact
    stats = server.stack.ram.arena_stats()
    assert (stats["reservations"], stats["leases"]) == (0, 0)
    assert server.stack.ram.stats().checksum_failures == 0


# -- every pinned byte is on an account ----------------------------------------------------------


def test_leases_of_deleted_blocks_stay_on_their_tenants_account(make_server, tmp_path: Path) -> None:
    """Tenant a (24 MiB quota) puts 20 MiB, leases it and deletes it, six rounds, never releasing:
    before, 62 MiB of the 64 MiB arena stayed pinned off every account, tenant b lost all 9 of its
    blocks and b's next Put answered stored=0. Now a's pins count against a's quota."""
    server = make_server(
        ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 120},
        shm=_known(ShmSection, dir=str(tmp_path / "shm"), share_arena_across_tenants=True),
        auth={"enabled": True, "tokens_file": str(_tokens(tmp_path, quota_a="24MiB", quota_b="24MiB"))},
    )
    stub = _stub(server)
    theirs = _blocks(9, MiB - 4096)
    assert _put_inline(stub, "n", theirs, _md("b")).stored == 9
    leased = 0
    for _ in range(6):
        mine = _blocks(20, MiB - 4096)
        _put_inline(stub, "n", mine, _md("a"))
        reply = stub.LeaseGet(
            pb.LeaseGetRequest(namespace="n", keys=[k for k, _ in mine]), metadata=_md("a"), timeout=10
        )
        leased += sum(1 for s in reply.leases if s.id)
        stub.Delete(pb.DeleteRequest(namespace="n", keys=[k for k, _ in mine]), metadata=_md("a"), timeout=10)
    ram = server.stack.ram
    print("a's leases granted:", leased, "a held:", ram.tenant_used_bytes("a"), "b held:", ram.tenant_used_bytes("b"))
    assert ram.tenant_used_bytes("a") <= 24 * MiB  # its pins are on its account, within its share
    assert _get(stub, "n", [k for k, _ in theirs], _md("b")) == dict(theirs)  # b kept all 9
    extra = _blocks(1, MiB - 4096)
    assert _put_inline(stub, "n", extra, _md("b")).stored == 1
    assert ram.used_bytes <= ram.capacity_bytes


def test_a_tenant_without_a_quota_pins_at_most_its_share() -> None:
    """Before: a quota-less tenant reserved 63 x 1 MiB of a 64 MiB arena and the other kept 0 of 8
    blocks. Now its reservations and leases together stop at ram.pin_share of the capacity."""
    cost = align(MiB) + ENTRY_OVERHEAD_BYTES
    tier = RamTier(capacity_bytes=64 * cost, prefault=False)  # ram.pin_share: 0.5
    theirs = [(os.urandom(16), os.urandom(MiB)) for _ in range(8)]
    assert tier.put_many_sync("b:n", theirs) == [True] * 8
    made = []
    while (res := tier.reserve("a:n", MiB)) is not None:
        made.append(res)
        assert len(made) <= 64
    assert len(made) == 32  # 0.5 x 64 blocks' worth
    assert tier.get_many_sync("b:n", [k for k, _ in theirs]) == [b for _, b in theirs]
    # Its leases share the same cap: with 32 reservations open, none of its blocks can be leased.
    tier.abandon([r.id for r in made[:4]])
    own = [(os.urandom(16), os.urandom(MiB)) for _ in range(8)]
    assert tier.put_many_sync("a:n", own) == [True] * 8
    leases = tier.lease_many("a:n", [k for k, _ in own])
    assert sum(lease is not None for lease in leases) == 4 and getattr(tier, "leases_refused", None) == 4
    assert tier.get_many_sync("b:n", [k for k, _ in theirs]) == [b for _, b in theirs]


def test_a_lease_get_of_65536_keys_is_bounded_and_others_are_served(make_server, tmp_path: Path) -> None:
    """Before: one LeaseGet of 65,536 copies of one key held ~500,000 leases and stalled other
    tenants' Lookups for 12-25 s. Now a key named twice shares one lease, a call leases at most
    ram.max_keys_per_lease keys, and a tenant holds at most ram.max_leases_per_tenant."""
    server = make_server(
        ram=_known(RamSection, capacity_bytes=64 * MiB, max_keys_per_lease=1000, max_leases_per_tenant=1500),
        shm=_known(ShmSection, dir=str(tmp_path / "shm"), share_arena_across_tenants=True),
        auth={"enabled": True, "tokens_file": str(_tokens(tmp_path))},
    )
    stub = _stub(server)
    one = _blocks(1, 100)
    many = _blocks(3000, 100)
    assert _put_inline(stub, "n", one + many, _md("a")).stored == 3001
    theirs = _blocks(4, 100)
    assert _put_inline(stub, "n", theirs, _md("b")).stored == 4
    latencies: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def lookups() -> None:
        other = _stub(server)
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                reply = other.Lookup(
                    pb.LookupRequest(namespace="n", keys=[k for k, _ in theirs]), metadata=_md("b"), timeout=30
                )
            except grpc.RpcError as exc:
                failures.append(str(exc.code()))
                continue
            latencies.append(time.perf_counter() - t0)
            if reply.prefix_length != 4:
                failures.append(f"prefix {reply.prefix_length}")

    watcher = threading.Thread(target=lookups)
    watcher.start()
    try:
        copies = stub.LeaseGet(
            pb.LeaseGetRequest(namespace="n", keys=[one[0][0]] * 65536), metadata=_md("a"), timeout=60
        )
        assert len({s.id for s in copies.leases}) == 1  # one lease, named 65,536 times
        assert server.stack.ram.arena_stats()["leases"] == 1
        first = stub.LeaseGet(
            pb.LeaseGetRequest(namespace="n", keys=[k for k, _ in many]), metadata=_md("a"), timeout=60
        )
        assert sum(1 for s in first.leases if s.id) == 1000  # the per-call cap
        second = stub.LeaseGet(
            pb.LeaseGetRequest(namespace="n", keys=[k for k, _ in many[1000:2000]]), metadata=_md("a"), timeout=60
        )
        assert sum(1 for s in second.leases if s.id) == 499  # 1 + 1000 + 499 = the tenant's cap of 1500
        assert server.stack.ram.arena_stats()["leases"] == 1500
    finally:
        stop.set()
        watcher.join(60)
    latencies.sort()
    print(f"b's Lookups during a's LeaseGets: {len(latencies)}, max {latencies[-1] * 1e3:.1f} ms")
    assert latencies and not failures  # b was served throughout, each Lookup exact
    released = stub.LeaseRelease(
        pb.LeaseReleaseRequest(leases=[s.id for s in [*copies.leases[:1], *first.leases, *second.leases] if s.id]),
        metadata=_md("a"),
        timeout=30,
    )
    assert released.released == 1500 and server.stack.ram.arena_stats()["leases"] == 0


# -- eviction that makes room, or evicts nothing -------------------------------------------------


def test_a_put_that_cannot_get_a_contiguous_slot_evicts_nothing() -> None:
    """64 x 1 MiB blocks, every 4th leased, then one 8 MiB put: before, 64 evictions, 0 blocks left
    (the leased ones unindexed too) and the put refused anyway. Now: refused, nothing evicted."""
    cost = align(MiB) + ENTRY_OVERHEAD_BYTES
    tier = RamTier(capacity_bytes=64 * cost, prefault=False)  # no auth: pins bounded by the arena
    stored = [(os.urandom(16), os.urandom(MiB)) for _ in range(64)]
    assert tier.put_many_sync("n", stored) == [True] * 64
    held = tier.lease_many("n", [k for k, _ in stored[::4]])
    assert all(held)
    assert tier.put_many_sync("n", [(os.urandom(16), os.urandom(8 * MiB))]) == [False]
    assert (tier.stats().evictions, tier.stats().blocks) == (0, 64)
    assert tier.get_many_sync("n", [k for k, _ in stored]) == [b for _, b in stored]
    # Release the leases of one 8-block run: the put now evicts exactly the blocks of that window.
    tier.release([lease.id for lease in held[4:6] if lease])
    big = (os.urandom(16), os.urandom(8 * MiB))
    assert tier.put_many_sync("n", [big]) == [True]
    assert tier.stats().evictions <= 9  # the window (8 slots of 1 MiB + the block's alignment)
    assert tier.get_many_sync("n", [big[0]]) == [big[1]]


def test_a_refused_re_put_keeps_the_block_that_was_there() -> None:
    cost = align(64 << 10) + ENTRY_OVERHEAD_BYTES
    tier = RamTier(capacity_bytes=8 * cost, prefault=False)
    old = [(os.urandom(16), os.urandom(64 << 10)) for _ in range(8)]
    assert tier.put_many_sync("n", old) == [True] * 8
    leases = tier.lease_many("n", [k for k, _ in old[1:]])
    assert all(leases)
    key, block = old[0]
    assert tier.put_many_sync("n", [(key, os.urandom(4 * (64 << 10)))]) == [False]  # no room for it
    assert tier.get_many_sync("n", [key]) == [block]  # the old block is still served
    assert tier.stats().evictions == 0


# -- the blocking SDK hands back what the server granted ------------------------------------------


def test_the_blocking_sdk_hands_back_every_lease_whatever_its_deadline(make_server, tmp_path: Path) -> None:
    """300 leased(), 300 get_into() and 300 put_many() calls with 0.2-4 ms deadlines: before, 288
    leases and 13 reservations stayed open after every call had returned (until
    ram.lease_timeout_s). Now none do, and the late answers' leases were released, not expired."""
    server = make_server(ram={"capacity_bytes": 64 * MiB, "lease_timeout_s": 60}, shm={"dir": str(tmp_path / "shm")})
    items = _blocks(32, 128 << 10)
    keys = [k for k, _ in items]
    rng = random.Random(3)
    with KVCacheClient(server.target, timeout_s=30) as client:
        assert client.put_many("n", items).stored == 32
        buffers = [bytearray(128 << 10) for _ in keys]
        expired = 0
        for _ in range(300):
            try:
                with client.leased("n", keys, timeout_s=rng.uniform(0.0002, 0.004)) as views:
                    assert all(v is not None for v in views)
            except DeadlineExceeded:
                expired += 1
            try:
                client.get_into("n", keys, buffers, timeout_s=rng.uniform(0.0002, 0.004))
            except DeadlineExceeded:
                expired += 1
            try:
                client.put_many("p", _blocks(4, 256 << 10), timeout_s=rng.uniform(0.0002, 0.004))
            except DeadlineExceeded:
                expired += 1
        deadline = time.monotonic() + 20  # late answers arrive and are released (each within 5 s)
        while server.stack.ram.arena_stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        stats = server.stack.ram.arena_stats()
        late = getattr(client._transport.inner._inplace, "handed_back", None)
        print("deadline exceeded:", expired, "handed back late:", late, "open:", stats["leases"], stats["reservations"])
        assert (stats["leases"], stats["reservations"]) == (0, 0)
        assert stats["leases_expired"] == 0  # released, not left to expire
        assert expired > 0
        with client.leased("n", keys) as views:  # and the path still works
            assert [bytes(v) for v in views] == [b for _, b in items]


# -- tenants of one Unix user ---------------------------------------------------------------------


def test_several_tenants_do_not_share_one_arena_unless_told(make_server, tmp_path: Path, caplog) -> None:
    """One arena file holds every tenant's blocks and any process of the server's user can map it
    whole: with several tenants the server does not hand it out (same-host clients get their own
    blocks through their own segments) and says so at start-up."""
    tokens = str(_tokens(tmp_path))
    with caplog.at_level("WARNING"):
        server = make_server(shm={"dir": str(tmp_path / "shm")}, auth={"enabled": True, "tokens_file": tokens})
    assert _stub(server).Info(pb.InfoRequest(), metadata=_md("a"), timeout=5).arena_path == ""
    assert any("block arena not shared: auth has 3 tenants" in r.getMessage() for r in caplog.records)
    items = _blocks(2, 256 << 10)
    with KVCacheClient(server.target, token=TOKENS["a"]) as client:
        assert client.put_many("n", items).stored == 2
        assert [bytes(b) for b in client.get_many("n", [k for k, _ in items])] == [b for _, b in items]
        assert client._transport.arena.state == "off" and client._transport.shm.state == "on"
    with KVCacheClient(server.target, token=TOKENS["b"]) as other:
        assert other.get_many("n", [k for k, _ in items]) == [None, None]  # scoped: a's blocks are not b's
    caplog.clear()
    with caplog.at_level("WARNING"):
        shared = make_server(
            shm=_known(ShmSection, dir=str(tmp_path / "shm2"), share_arena_across_tenants=True),
            auth={"enabled": True, "tokens_file": tokens},
        )
    assert _stub(shared).Info(pb.InfoRequest(), metadata=_md("a"), timeout=5).arena_path != ""
    assert any("block arena shared by 3 tenants" in r.getMessage() for r in caplog.records)


def test_a_restarted_server_of_another_capacity_is_followed(make_server, tmp_path: Path) -> None:
    """Before: a client whose server restarted with another capacity turned the in-place path off
    for good. Now it maps the new arena at the new file's size."""
    shm = str(tmp_path / "shm")
    first = make_server(ram={"capacity_bytes": 16 * MiB}, shm={"dir": shm})
    items = _blocks(2, 256 << 10)
    with KVCacheClient(first.target, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        with client.leased("n", [k for k, _ in items]) as views:
            assert all(views)
        assert client._transport.arena.size == 16 * MiB
        link = client._transport.arena
        second = make_server(ram={"capacity_bytes": 24 * MiB}, shm={"dir": shm})
        info = _stub(second).Info(pb.InfoRequest(), timeout=5)
        link.follow(info.arena_path)
        assert (link.state, link.size) == ("on", 24 * MiB)
        mapping = link._readonly
        assert mapping is not None and len(mapping) == 24 * MiB


# -- nothing on the event loop copies block bytes ------------------------------------------------


def test_large_commits_and_promotions_copy_off_the_event_loop(make_server, redis_server, tmp_path: Path) -> None:
    """Before: a commit of 32 x 2 MiB with a write-behind tier below held the loop 177 ms median
    (copies into and out of slots on it). Now the copies of every RAM write of 256 KiB or more (puts,
    promotions) and the copies for the tiers below run in worker threads; the loop only indexes.
    Lookups meanwhile are timed and printed (figures, not thresholds)."""
    server = make_server(
        ram={"capacity_bytes": 48 * MiB},
        redis={"enabled": True, "url": redis_server.url, "write_mode": "behind"},
        shm={"dir": str(tmp_path / "shm")},
    )
    ram = server.stack.ram
    loop_thread = server._thread.ident
    calls: list[tuple[str, int, bool]] = []  # (method, bytes, on the loop)
    for name in ("put_many_sync", "stage_many"):
        original = getattr(ram, name)

        def traced(namespace: str, items: Any, _original: Any = original, _name: str = name) -> list[bool]:
            size = sum(len(d) if isinstance(d, bytes | memoryview) else d.length for _, d in items)
            calls.append((_name, size, threading.get_ident() == loop_thread))
            return _original(namespace, items)

        setattr(ram, name, traced)
    stop = threading.Event()
    latencies: list[float] = []

    def lookups() -> None:
        stub = _stub(server)
        key = os.urandom(16)
        while not stop.is_set():
            t0 = time.perf_counter()
            stub.Lookup(pb.LookupRequest(namespace="n", keys=[key]), timeout=30)
            latencies.append(time.perf_counter() - t0)

    watcher = threading.Thread(target=lookups)
    watcher.start()
    try:
        with KVCacheClient(server.target, timeout_s=60) as same_host, KVCacheClient(server.target, shm=False) as remote:
            for _ in range(3):
                assert same_host.put_many("n", _blocks(8, 2 * MiB)).stored == 8  # segment -> slots (adopt)
                assert remote.put_many("n", _blocks(8, 2 * MiB)).stored == 8  # inline gRPC (put_many_sync)
            old = _blocks(4, MiB)
            assert remote.put_many("n", old).stored == 4
            server.call(server.stack.wait_idle())
            ram.delete_many_sync("n", [k for k, _ in old])  # gone from RAM, still in Redis
            assert [bytes(b) for b in remote.get_many("n", [k for k, _ in old])] == [b for _, b in old]  # promoted
    finally:
        stop.set()
        watcher.join(30)
    large = [c for c in calls if c[1] >= 256 << 10]
    print("RAM writes >= 256 KiB:", len(large), "on the loop:", sum(c[2] for c in large))
    latencies.sort()
    if latencies:
        p99 = latencies[int(len(latencies) * 0.99) - 1 if len(latencies) > 1 else 0]
        p50 = latencies[len(latencies) // 2]
        print(f"1-key Lookups meanwhile: {len(latencies)}, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
    # Large writes are staged (copied into their slots) in worker threads, then adopted on the loop
    # (dictionary work, no copy); no large put_many_sync, which copies where it runs, is left.
    assert {c[0] for c in large} == {"stage_many"}
    assert not [c for c in large if c[2]]  # none of them on the event loop


# -- restarts in a tmpfs sized as the docs say ----------------------------------------------------

_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000

# As root in a child: a private mount namespace with a tmpfs of argv[2] at argv[1]; a server, a client
# process that maps its arena and keeps reading; the server restarted (a new one, same directory)
# while that client still maps the old arena.
_RESTART_DRIVER = f"""
import ctypes, json, os, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
mnt = sys.argv[1].encode()
if (libc.unshare({_CLONE_NEWNS}) != 0
        or libc.mount(b"none", b"/", None, {_MS_REC | _MS_PRIVATE}, None) != 0
        or libc.mount(b"tmpfs", mnt, b"tmpfs", 0, ("size=" + sys.argv[2]).encode()) != 0):
    print("NO-NAMESPACE " + os.strerror(ctypes.get_errno()))
    sys.exit(3)
from tests.conftest import ServerThread
settings = {{"shm": {{"dir": sys.argv[1] + "/shm"}}, "ram": {{"capacity_bytes": 16 << 20, "prefault": True}}}}
first = ServerThread(settings)
client = subprocess.Popen([sys.executable, "-c", sys.argv[3], first.target], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert client.stdout.readline().strip() == "mapped"
port = first.target.rsplit(":", 1)[1]
first.stop()
settings["server"] = {{"port": int(port)}}
second = ServerThread(settings)
shared = bool(second.stack.ram.region.path)
client.stdin.write("go\\n"); client.stdin.flush()
out = client.stdout.readline().strip()
client.wait(60)
second.stop()
print(json.dumps({{"shared": shared, "client": out, "rc": client.returncode}}))
"""

_RESTART_CLIENT = """
import json, os, sys, time
from kvcache_client import KVCacheClient
from tests.conftest import raw_block
target = sys.argv[1]
items = []
for _ in range(4):
    k = os.urandom(16)
    items.append((k, raw_block(k, os.urandom(1 << 20))))
with KVCacheClient(target, timeout_s=10) as client:
    assert client.put_many("r", items).stored == 4
    with client.leased("r", [k for k, _ in items]) as views:
        assert all(views)
    old = client._transport.arena._readonly  # the old arena stays mapped while the server restarts
    print("mapped", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 20
    while True:
        try:
            stored = client.put_many("r", items).stored
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with client.leased("r", [k for k, _ in items]) as views:
        same = [v is not None and bytes(v) == b for v, (_, b) in zip(views, items)]
    link = client._transport.arena
    print(json.dumps({"stored": stored, "same": same, "arena": link.state, "old_mapped": len(old)}), flush=True)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("size", "shares"), [("40m", True), ("24m", False)])
def test_a_restart_while_clients_map_the_old_arena(tmp_path: Path, size: str, shares: bool) -> None:
    """docs/deployment.md: size the tmpfs for two arenas plus segments. With 16 MiB arenas, 40 MiB
    (2 x 16 + 8) lets the restarted server share its new arena while a client still maps the old one,
    and the client follows it; 24 MiB (one arena + 8) does not (what the issue saw), and the client
    keeps working over segments. Needs root (a private mount namespace)."""
    if os.geteuid() != 0 and not os.environ.get("CI"):  # under CI it runs (and fails) rather than skip
        pytest.skip("needs root to mount a tmpfs in a private mount namespace")
    import json
    import subprocess
    import sys

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _RESTART_DRIVER, str(mnt), size, _RESTART_CLIENT],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=repo,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    client = json.loads(result["client"])
    print(result)
    assert result["shared"] is shares and result["rc"] == 0
    assert client["stored"] == 4 and client["same"] == [True] * 4  # served exactly, either way
    assert client["arena"] == ("on" if shares else "off")


def test_a_prefix_lease_get_naming_a_key_twice_keeps_the_lease_it_answers(make_server, tmp_path: Path) -> None:
    """A key named twice shares one lease; prefix_only releases what lies past the first miss, but
    never the lease an answered position still names (its slot would be reusable under the reader)."""
    server = make_server(ram={"capacity_bytes": 16 * MiB}, shm={"dir": str(tmp_path / "shm")})
    stub = _stub(server)
    ((a, block),) = _blocks(1, 4096)
    assert _put_inline(stub, "n", [(a, block)]).stored == 1
    missing = os.urandom(16)
    reply = stub.LeaseGet(pb.LeaseGetRequest(namespace="n", keys=[a, missing, a], prefix_only=True), timeout=10)
    assert [bool(s.id) for s in reply.leases] == [True, False]
    assert server.stack.ram.arena_stats()["leases"] == 1  # still pinned for the reader
    assert stub.LeaseRelease(pb.LeaseReleaseRequest(leases=[reply.leases[0].id]), timeout=10).released == 1
    assert server.stack.ram.arena_stats()["leases"] == 0


def test_a_delete_during_a_large_put_wins() -> None:
    """Large RAM writes are copied in a worker thread (TierStack._to_ram, for puts and promotions
    alike); a Delete that runs meanwhile must still win (the put's blocks are not indexed after it),
    as when everything ran on the loop. A review found the first version of the off-loop copy
    indexing them after the Delete had returned: 50 of 50 (now 0)."""
    import asyncio

    from kvcache_server.stack import TierStack

    async def run() -> int:
        stack = TierStack(256 * MiB, prefault=False)
        await stack.start()
        back = 0
        try:
            for i in range(50):
                key = bytes([i]) * 16
                put = asyncio.create_task(stack.put("n", [(key, raw_block(key, bytes(8 * MiB)))]))
                await asyncio.sleep(0)  # the put is copying in its thread
                await stack.delete("n", [key])
                await put
                back += stack.ram.contains_many_sync("n", [key])[0]
            assert stack.ram.arena_stats()["reservations"] == 0  # what the Delete fenced off was freed
        finally:
            await stack.close()
        return back

    assert asyncio.run(run()) == 0
