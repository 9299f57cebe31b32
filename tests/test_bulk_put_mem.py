"""Same-host puts out of the client's own memory as PUT_MEM frames on the bulk port (docs/bulk.md): the
server reads each block out of the registered client process (process_vm_readv) into its arena slot,
verified or sealed there, as for a gRPC Put of the same ranges, without a gRPC call. Real in-process
servers with their segment socket, the SDK and raw frames.

What the code before did: every same-host put of 1 MiB or more out of the client's memory was a gRPC
Put (0.68 ms from the client's call to the server's handler, 0.35 ms from its end back, on this VM).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvcache_client import KVCacheClient, sealing, transport
from kvcache_client.bulkconn import BulkConnection, BulkUnreachable
from kvcache_client.errors import DataCorrupted
from kvcache_client.handoff import Handoff
from kvcache_core import bulkwire as bw
from kvcache_core.format import encode_bytes_parts, unsealed_bytes_header
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, keyed, raw_block
from tests.test_bulk import Raw
from tests.test_bulk_thread_commits import hold_the_loop

pytestmark = pytest.mark.timeout(120)

NS = "ns"
MIB = 1 << 20


@pytest.fixture
def place() -> Iterator[Path]:
    """A short directory for the server's shm directory and segment socket (Unix socket paths are short)."""
    d = Path(tempfile.mkdtemp(prefix="kvm-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _server(make_server: Any, place: Path, **extra: dict[str, Any]) -> ServerThread:
    config: dict[str, dict[str, Any]] = {
        "ram": {"capacity_bytes": 256 << 20},
        "shm": {"dir": str(place / "shm"), "socket_path": str(place / "seg.sock")},
    }
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values}
    return make_server(**config)  # type: ignore[no-any-return]


def _payloads(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _expected(keys: list[bytes], payloads: list[np.ndarray]) -> list[bytes]:
    return [h + bytes(p) for h, p in encode_bytes_parts(keys, payloads)]


def _stats(server: ServerThread) -> pb.StatsResponse:
    return pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Stats(pb.StatsRequest(), timeout=10)


def _no_grpc_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = transport.GrpcTransport._send_put

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return original(*args, **kw)

    monkeypatch.setattr(transport.GrpcTransport, "_send_put", spy)
    return calls


def test_same_host_puts_out_of_the_clients_memory_are_put_mem_frames(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_payloads (sealed: the server computes the checksums) and put_many of encoded blocks (the
    SDK's checksums, verified where they land): no gRPC Put, byte for byte what put_many stores, and
    the server counts them as a gRPC Put of the same ranges (shm bytes received, sealed blocks)."""
    server = _server(make_server, place)
    grpc_puts = _no_grpc_puts(monkeypatch)
    keys = [os.urandom(16) for _ in range(6)]
    payloads = _payloads(4, 2 * MIB, 1) + _payloads(2, 300_000, 2)
    items = [keyed(os.urandom(MIB)) for _ in range(3)]
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 6
        assert client.put_many(NS, items).stored == 3
        got = [bytes(g) for g in client.get_many(NS, keys + [k for k, _ in items])]  # type: ignore[arg-type]
        sent = client.bulk.counters.put_mem_bytes
    assert got == _expected(keys, payloads) + [b for _, b in items]
    assert grpc_puts == []
    total = sum(len(b) for b in _expected(keys, payloads)) + sum(len(b) for _, b in items)
    assert sent == total
    counters = server.running.service.counters()
    assert (counters["sealed_blocks"], counters["shm_bytes_received"]) == (6, total)
    assert server.running.bulk.counters.get("puts") == 2
    assert _stats(server).put_checksum_failures == 0
    assert not server.stack.ram._reservations


def test_a_put_mem_is_answered_while_the_event_loop_is_held(make_server: Any, place: Path) -> None:
    """On a server of RAM alone, a PUT_MEM's slots are reserved and committed by the session's thread:
    answered while a callback holds the event loop (a gRPC Put would wait for it)."""
    server = _server(make_server, place)
    keys = [os.urandom(16) for _ in range(4)]
    payloads = _payloads(4, MIB, 3)
    with KVCacheClient(server.target, timeout_s=20) as client:
        client.put_payloads("warm", [os.urandom(16)], _payloads(1, MIB, 4))  # Info, registration, connection
        freed = hold_the_loop(server, 1.5)
        assert client.put_payloads(NS, keys, payloads).stored == 4
        assert not freed.is_set(), "the PUT_MEM was answered only after the loop was free again"
        assert freed.wait(5)
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]


def _registered(server: ServerThread, place: Path) -> tuple[Handoff, str]:
    info = pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Info(pb.InfoRequest(), timeout=10)
    assert info.bulk_put_mem
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, "")
    name, _ = handoff.register_process()
    return handoff, name


def _raw_put_mem(server: ServerThread, name: str, blocks: list[tuple[bytes, int, int, int, bytes]]) -> Any:
    """One PUT_MEM on a fresh raw connection: its PUT_DONE, or (status, message) of its ERROR."""
    raw = Raw(server)
    try:
        raw.hello()
        raw.send(bw.FrameType.PUT_MEM, bw.put_mem(NS, name, blocks))
        kind, payload = raw.read()
        if kind is bw.FrameType.PUT_DONE:
            return bw.parse_put_done(payload)
        assert kind is bw.FrameType.ERROR, kind
        code, message = bw.parse_error(payload)
        return next(s for s in grpc.StatusCode if s.value[0] == code), message
    finally:
        raw.close()


def test_what_a_put_mem_may_not_name_is_refused_and_stores_nothing(make_server: Any, place: Path) -> None:
    """A name no registration of this tenant has: FAILED_PRECONDITION; memory the client does not
    have: INVALID_ARGUMENT; a block made for another key: DATA_LOSS (counted); a sealed block whose
    header carries a checksum: INVALID_ARGUMENT; a sealed block whose seal_before_ns has passed:
    ABORTED (counted). Nothing of them is stored, nothing stays reserved; a good one is stored."""
    server = _server(make_server, place)
    handoff, name = _registered(server, place)
    try:
        k = os.urandom(16)
        good = np.frombuffer(raw_block(k, os.urandom(100_000)), dtype=np.uint8)
        head, body = good[:64].tobytes(), good[64:]
        other = np.frombuffer(raw_block(os.urandom(16), os.urandom(100_000)), dtype=np.uint8)
        payload = np.frombuffer(os.urandom(200_000), dtype=np.uint8)
        sealed_head = unsealed_bytes_header(payload.nbytes)
        future = time.monotonic_ns() + 10**10
        cases = [
            (
                "kvcache-pid-" + "0" * 32,
                [(k, good.ctypes.data, good.nbytes, 0, b"")],
                grpc.StatusCode.FAILED_PRECONDITION,
            ),
            (name, [(k, 4096, 100_000, 0, b"")], grpc.StatusCode.INVALID_ARGUMENT),
            (name, [(k, other.ctypes.data, other.nbytes, 0, b"")], grpc.StatusCode.DATA_LOSS),
            (name, [(k, body.ctypes.data, body.nbytes, future, head)], grpc.StatusCode.INVALID_ARGUMENT),
            (name, [(k, payload.ctypes.data, payload.nbytes, 1, sealed_head)], grpc.StatusCode.ABORTED),
        ]
        for process, blocks, code in cases:
            got = _raw_put_mem(server, process, blocks)
            assert isinstance(got, tuple) and got[0] is code, (code, got)
            assert not server.stack.ram.contains_many_sync(NS, [k])[0]
        done = _raw_put_mem(server, name, [(k, body.ctypes.data, body.nbytes, 0, head)])
        assert (done.stored, done.rejected) == (1, 0)
    finally:
        handoff.close()
    counters = server.running.service.counters()
    assert (counters["put_checksum_failures"], counters["sealed_too_late"]) == (1, 1)
    # Read out of the client: the refused block (as the gRPC Put counts it) and the stored one.
    assert counters["shm_bytes_received"] == other.nbytes + good.nbytes
    assert server.running.service.block_sizes.get(NS) == good.nbytes
    assert server.stack.ram.used_bytes == server.stack.ram.entry_cost_of(good.nbytes)
    assert not server.stack.ram._reservations


def test_a_sealed_put_mem_the_server_cannot_take_is_put_again_checksummed_by_the_sdk(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window too short for the server's reads: ABORTED, and the SDK puts the same blocks again
    through gRPC, checksummed by itself (a fallback counted); what is stored is the same."""
    server = _server(make_server, place)
    monkeypatch.setattr(sealing, "SEAL_MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(sealing, "SEAL_WINDOW_BYTES_PER_S", 1e15)  # a window of microseconds
    keys = [os.urandom(16) for _ in range(4)]
    payloads = _payloads(4, MIB, 9)
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 4
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
        assert client.bulk.counters.fallbacks == 1  # refused by the server (ABORTED) or its deadline first


@pytest.mark.parametrize("how", ["lost", "interrupted"])
def test_a_sealed_put_mem_cut_off_in_the_client_returns_only_once_the_server_may_store_nothing(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The connection lost after the PUT_MEM went out (the server may still be reading), or an
    interrupt in this process meanwhile: the SDK falls back (lost) or raises (interrupted) only once
    the blocks' seal_before_ns has passed, after which the server stores nothing it read."""
    server = _server(make_server, place)
    seen: list[int] = []
    send, read = BulkConnection.send_put_mem, BulkConnection.read_put_done

    def sent(conn: BulkConnection, namespace: str, process: str, refs: Any, deadline: float) -> None:
        if not seen:
            seen.extend(ref.seal_before_ns for _, ref in refs)
        send(conn, namespace, process, refs, deadline)

    def cut(conn: BulkConnection, deadline: float) -> Any:  # after the frame went out: the server may read
        if len(seen) == 1:
            seen.append(0)
            raise BulkUnreachable("lost") if how == "lost" else KeyboardInterrupt
        return read(conn, deadline)

    keys = [os.urandom(16)]
    payloads = _payloads(1, MIB, 10)
    with KVCacheClient(server.target) as client:
        client.lookup(NS, [os.urandom(16)])  # Info taken, the process registered
        monkeypatch.setattr(BulkConnection, "send_put_mem", sent)
        monkeypatch.setattr(BulkConnection, "read_put_done", cut)
        if how == "lost":
            assert client.put_payloads(NS, keys, payloads).stored == 1
        else:
            with pytest.raises(KeyboardInterrupt):
                client.put_payloads(NS, keys, payloads)
        done = time.monotonic_ns()
        assert seen and seen[0] > 0 and done >= seen[0]
        if how == "lost":
            assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
            assert client.bulk.counters.fallbacks == 1


def test_with_no_room_for_slots_a_put_mem_goes_through_grpc(make_server: Any, place: Path) -> None:
    """Readers lease most of RAM: the PUT_MEM is refused ABORTED having read nothing, and
    the SDK puts the blocks through gRPC, which reads them into memory first; what is stored is exact."""
    server = _server(make_server, place, ram={"capacity_bytes": 8 * MIB})
    held = [keyed(os.urandom(MIB)) for _ in range(6)]
    keys = [os.urandom(16) for _ in range(2)]
    payloads = _payloads(2, MIB, 12)
    with KVCacheClient(server.target) as client:
        assert client.put_many("h", held).stored == 6
        leases = server.stack.ram.lease_many("h", [k for k, _ in held], 60.0)
        assert None not in leases
        result = client.put_payloads(NS, keys, payloads)
        assert result.stored >= 1 and client.bulk.counters.fallbacks == 1
        got = client.get_many(NS, keys)
        assert all(bytes(g) == e for g, e in zip(got, _expected(keys, payloads), strict=True) if g is not None)
        server.stack.ram.release([lease.id for lease in leases])
    assert not server.stack.ram._reservations


def test_a_put_mem_on_a_server_with_a_tier_below_commits_on_the_loop(
    make_server: Any, place: Path, redis_server: Any
) -> None:
    """Redis written through below RAM: the PUT_MEM's slots are reserved and committed on the event
    loop (the stack writes the tier below), and the blocks are in both, byte-exact from Redis alone."""
    server = _server(
        make_server, place, redis={"enabled": True, "url": redis_server.url, "write_mode": "through", "timeout_s": 10}
    )
    keys = [os.urandom(16) for _ in range(3)]
    payloads = _payloads(3, MIB, 13)
    with KVCacheClient(server.target) as client:
        result = client.put_payloads(NS, keys, payloads)
        assert result.stored == 3 and result.tier("redis").stored == 3
        assert client.bulk.counters.put_mem_bytes > 0
        assert server.stack.ram.delete_many_sync(NS, keys) == 3
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]


def test_blocks_of_no_bytes_and_a_seal_deadline_far_away_are_answered_as_the_grpc_put_answers(
    make_server: Any, place: Path
) -> None:
    """A PUT_MEM of blocks of no bytes: INVALID_ARGUMENT, as the gRPC Put (it was INTERNAL, a division
    by zero in the lanes' split). A sealed one whose seal_before_ns is the largest u64, while another
    put of the process holds its read stage: ABORTED after bulk.request_timeout_s, never a wait of
    years nor an overflow (INTERNAL)."""
    server = _server(make_server, place, bulk={"request_timeout_s": 0.5})
    handoff, name = _registered(server, place)
    try:
        k = os.urandom(16)
        got = _raw_put_mem(server, name, [(k, 4096, 0, 0, b""), (os.urandom(16), 4096, 0, 0, b"")])
        assert isinstance(got, tuple) and got[0] is grpc.StatusCode.INVALID_ARGUMENT, got
        payload = np.frombuffer(os.urandom(200_000), dtype=np.uint8)
        stage = server.running.service.handoff.registry.reads(name).thread_stage
        assert stage.acquire(timeout=5)
        try:
            start = time.monotonic()
            blocks = [(k, payload.ctypes.data, payload.nbytes, (1 << 64) - 1, unsealed_bytes_header(payload.nbytes))]
            got = _raw_put_mem(server, name, blocks)
            assert isinstance(got, tuple) and got[0] is grpc.StatusCode.ABORTED, got
            assert time.monotonic() - start < 5
        finally:
            stage.release()
    finally:
        handoff.close()
    assert not server.stack.ram._reservations


def test_a_block_put_mem_refuses_for_its_checksum_is_not_put_again(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_many of a block made for another key, out of this process's memory: DataCorrupted, one
    checksum failure counted, and no gRPC Put of it after the PUT_MEM (DATA_LOSS is the put's own
    outcome where the SDK computed the checksums; only a sealed put goes again, checksummed)."""
    server = _server(make_server, place)
    grpc_puts = _no_grpc_puts(monkeypatch)
    key, other = os.urandom(16), os.urandom(16)
    head, body = encode_bytes_parts([other], [os.urandom(2 * MIB)])[0]
    with KVCacheClient(server.target) as client, pytest.raises(DataCorrupted):
        client.put_many(NS, [(key, (head, body))])
    assert grpc_puts == []
    assert server.running.service.counters()["put_checksum_failures"] == 1


def test_a_registration_whose_threads_were_shut_down_is_not_read_by_a_put_mem(make_server: Any, place: Path) -> None:
    """The registration's read threads shut down (what dropping it does) after its name was looked
    up: FAILED_PRECONDITION and nothing stored, as the gRPC Put answers (one lane read it before)."""
    server = _server(make_server, place)
    handoff, name = _registered(server, place)
    try:
        server.running.service.handoff.registry.reads(name).executor.shutdown()
        k = os.urandom(16)
        good = np.frombuffer(raw_block(k, os.urandom(100_000)), dtype=np.uint8)
        got = _raw_put_mem(server, name, [(k, good.ctypes.data, good.nbytes, 0, b"")])
        assert isinstance(got, tuple) and got[0] is grpc.StatusCode.FAILED_PRECONDITION, got
        assert not server.stack.ram.contains_many_sync(NS, [k])[0]
    finally:
        handoff.close()
    assert not server.stack.ram._reservations


def test_put_mem_frames_take_blocks_until_they_name_128_mib() -> None:
    """4 x 32 MiB (each with its head) is one frame of four blocks, read in two lanes; one block a
    frame (the first grouping, which stopped short of 64 MiB) read one lane at a time: 50 ms p50
    against 30 through gRPC on this VM; two frames of two blocks, 25.4 ms against 23.0 for one."""
    from kvcache_client.bulk import put_mem_frames
    from kvcache_core.blockwire import ShmRange

    def refs(n: int, size: int) -> list[tuple[bytes, ShmRange]]:
        return [(bytes(16), ShmRange("p", 4096 * i, size, b"h" * 56)) for i in range(n)]

    assert [len(f) for f in put_mem_frames(refs(4, 32 * MIB))] == [4]
    assert [len(f) for f in put_mem_frames(refs(8, 32 * MIB))] == [4, 4]
    assert [len(f) for f in put_mem_frames(refs(16, 2 * MIB))] == [16]
    assert [len(f) for f in put_mem_frames(refs(3, 64 * MIB))] == [2, 1]
    assert [len(f) for f in put_mem_frames(refs(65, 2 * MIB))] == [64, 1]


def test_a_puts_frames_go_one_at_a_time_and_a_refused_one_ends_them(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames of 1 MiB here (PUT_MEM_FRAME_BYTES patched): a put of three is three PUT_MEM frames, all
    stored, no gRPC Put. Then the server refuses the second frame of the next put (ABORTED): the third
    is never sent (a put that fails leaves at most one frame the server may still be reading), and the
    SDK puts the whole put again through gRPC; every byte exact."""
    from kvcache_client import bulk
    from kvcache_server.bulk.put_mem import PutMemRequests
    from kvcache_server.refusal import Refused

    server = _server(make_server, place)
    monkeypatch.setattr(bulk, "PUT_MEM_FRAME_BYTES", 1 << 20)
    handled: list[int] = []
    refuse_at: list[int] = []
    real = PutMemRequests._put_mem

    def counted(self: Any, length: int, deadline: Any) -> None:
        handled.append(1)
        if refuse_at and len(handled) == refuse_at[0]:
            self._control(bw.FrameType.PUT_MEM, length, deadline)
            raise Refused(grpc.StatusCode.ABORTED, "refused for the test")
        real(self, length, deadline)

    monkeypatch.setattr(PutMemRequests, "_put_mem", counted)
    sends: list[int] = []
    send = BulkConnection.send_put_mem

    def sent(conn: BulkConnection, *args: Any) -> None:
        sends.append(1)
        send(conn, *args)

    monkeypatch.setattr(BulkConnection, "send_put_mem", sent)
    grpc_puts = _no_grpc_puts(monkeypatch)
    keys = [os.urandom(16) for _ in range(3)]
    payloads = _payloads(3, MIB, 21)
    with KVCacheClient(server.target) as client:
        client.lookup(NS, [os.urandom(16)])  # Info taken, the process registered
        assert client.put_payloads(NS, keys, payloads).stored == 3
        assert len(sends) == 3 and len(handled) == 3 and not grpc_puts
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
        more = [os.urandom(16) for _ in range(3)]
        again = _payloads(3, MIB, 22)
        refuse_at.append(len(handled) + 2)
        assert client.put_payloads(NS, more, again).stored == 3
        assert len(sends) == 5 and len(handled) == 5 and grpc_puts  # the third frame never sent
        assert client.bulk.counters.fallbacks == 1
        assert [bytes(g) for g in client.get_many(NS, more)] == _expected(more, again)  # type: ignore[arg-type]


def test_many_small_blocks_go_in_frames_the_server_takes(make_server: Any, place: Path) -> None:
    """A put of 7,000 blocks of 4 KiB to a server whose control frames may hold 591,370 bytes (64 keys
    a request): each block's entry and head take 92 bytes, so one frame of them all (644,000 bytes)
    was refused RESOURCE_EXHAUSTED and the put failed (found in review of frames of 128 MiB); now the
    SDK cuts its frames at the server's limit: every block stored through PUT_MEM, none through gRPC."""
    server = _server(make_server, place, limits={"max_keys_per_request": 64})
    keys = [os.urandom(16) for _ in range(7000)]
    payloads = list(_payloads(1, 7000 * 4096, 23)[0].reshape(7000, 4096))
    with KVCacheClient(server.target, timeout_s=60) as client:
        client.lookup(NS, [os.urandom(16)])  # Info taken, the process registered
        assert client.put_payloads(NS, keys, payloads).stored == 7000
        assert client.bulk.counters.put_mem_bytes == 7000 * (4096 + 48) and client.bulk.counters.fallbacks == 0
        got = client.get_many(NS, keys[:5] + keys[-5:])
        assert [bytes(g) for g in got] == _expected(keys[:5] + keys[-5:], payloads[:5] + payloads[-5:])  # type: ignore[arg-type]


def test_a_put_mem_whose_client_closed_during_the_reads_stores_nothing(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection lost while the server reads an unsealed PUT_MEM: the SDK closes it, puts the
    blocks through gRPC and returns, and its caller may reuse the memory. The server, whose reads may
    have overlapped that, commits nothing read so (ABORTED, no answer to give). The reads are held here
    until the client's socket is closed; on the code before, the PUT_MEM was committed after it."""
    from kvcache_server.bulk import put_mem as server_put_mem
    from kvcache_server.stack import TierStack

    server = _server(make_server, place)
    read_done, closed = threading.Event(), threading.Event()
    reads = server_put_mem.read_ranges_into_slots_here

    def held(*args: Any) -> None:
        reads(*args)
        read_done.set()
        closed.wait(10)

    monkeypatch.setattr(server_put_mem, "read_ranges_into_slots_here", held)
    commits: list[int] = []
    commit = TierStack.commit_in_thread

    def counted(stack: TierStack, *args: Any) -> Any:
        commits.append(1)
        return commit(stack, *args)

    monkeypatch.setattr(TierStack, "commit_in_thread", counted)
    read, close = BulkConnection.read_put_done, BulkConnection.close

    def lost(conn: BulkConnection, deadline: float) -> Any:
        if not read_done.is_set():
            assert read_done.wait(10)
            raise BulkUnreachable("lost")
        return read(conn, deadline)

    def closing(conn: BulkConnection) -> None:
        close(conn)
        closed.set()

    monkeypatch.setattr(BulkConnection, "read_put_done", lost)
    monkeypatch.setattr(BulkConnection, "close", closing)
    items = [keyed(os.urandom(2 * MIB)) for _ in range(2)]
    with KVCacheClient(server.target) as client:
        client.lookup(NS, [os.urandom(16)])  # Info taken, the process registered
        assert client.put_many(NS, items).stored == 2  # through gRPC, after the PUT_MEM was lost
        assert client.bulk.counters.fallbacks == 1
        end = time.monotonic() + 10
        while server.running.bulk.counters.get("errors") < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert server.running.bulk.counters.get("errors") == 1 and commits == []
        assert [bytes(g) for g in client.get_many(NS, [k for k, _ in items])] == [b for _, b in items]  # type: ignore[arg-type]
