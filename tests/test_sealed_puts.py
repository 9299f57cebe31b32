"""Same-host puts whose checksums the server computes (ShmRange.seal, put_payloads; docs/shm.md,
"Checksums computed by the server"): a real server with a segment socket, the real SDK."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import kvcache_client.sealing as sealing
import kvcache_client.transport as transport
from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.errors import KVCacheError
from kvcache_client.handoff import Handoff
from kvcache_core.blockwire import ShmRange, encode_put_request
from kvcache_core.errors import BlockFormatError
from kvcache_core.format import encode_block_parts, encode_bytes_parts, parse_header, seal_parts, unsealed_bytes_header
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server import procmem
from kvcache_server.pipeline import put as put_stage
from kvcache_server.pipeline import verify
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(120)

NS = "ns"


@pytest.fixture
def place() -> Iterator[Path]:
    """A short directory for the server's shm directory and segment socket (Unix socket paths are short)."""
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _server(make_server: Any, place: Path, ram_bytes: int = 256 << 20) -> ServerThread:
    return make_server(  # type: ignore[no-any-return]
        ram={"capacity_bytes": ram_bytes}, shm={"dir": str(place / "shm"), "socket_path": str(place / "seg.sock")}
    )


def _stats(server: ServerThread) -> pb.StatsResponse:
    return pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Stats(pb.StatsRequest(), timeout=10)


def _payloads(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _expected(keys: list[bytes], payloads: list[np.ndarray]) -> list[bytes]:
    """What put_many of encode_bytes_parts stores: the client's own checksums."""
    return [h + bytes(p) for h, p in encode_bytes_parts(keys, payloads)]


class _Sent:
    """Every range the gRPC transports put, captured on its way to the server. The blocking clients of
    these tests have no bulk port (bulk=False): with one, a same-host put out of this process's memory
    is a PUT_MEM frame instead of a gRPC Put (tests/test_bulk_put_mem.py), sealed the same way."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: list[ShmRange] = []
        for cls in (transport.GrpcTransport, transport.AsyncGrpcTransport):
            original = cls._send_put

            def spy(tr: Any, namespace: str, items: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
                self.ranges += [d for _, d in items if isinstance(d, ShmRange)]
                return _original(tr, namespace, items, *args, **kw)

            monkeypatch.setattr(cls, "_send_put", spy)


def _counters(server: ServerThread) -> dict[str, int]:
    return server.running.service.counters()  # type: ignore[no-any-return]


def test_put_payloads_on_the_same_host_leaves_the_checksums_to_the_server(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every range the blocking face sends is sealed with a header of checksum 0, the SDK never
    encodes (never hashes) a payload, and what the server stores is byte for byte what put_many of
    encode_bytes_parts stores (a block sealed wrongly would fail get_many's check of its checksum).
    The asyncio face never seals (a cancelled task returns before the server's reads end): its
    ranges carry the SDK's checksums, and the blocks are the same."""
    server = _server(make_server, place)
    sent = _Sent(monkeypatch)
    encode = sealing.encode_bytes_parts

    def no_encoding(*args: Any) -> Any:
        raise AssertionError("the SDK hashed a payload of a sealed put")

    monkeypatch.setattr(sealing, "encode_bytes_parts", no_encoding)
    keys = [os.urandom(16) for _ in range(6)]
    payloads = _payloads(4, 2 << 20, 1) + _payloads(2, 300_000, 2)  # two sizes: two headers
    with KVCacheClient(server.target, bulk=False) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 6
        assert client._transport.shm.process.state == "on"
        got = [bytes(g) for g in client.get_many(NS, keys)]  # type: ignore[arg-type]
    assert got == _expected(keys, payloads)
    assert len(sent.ranges) == 6 and all(r.seal for r in sent.ranges)
    assert {parse_header(r.head, block_len=r.block_length).checksum for r in sent.ranges} == {0}
    assert _counters(server)["sealed_blocks"] == 6
    monkeypatch.setattr(sealing, "encode_bytes_parts", encode)

    async def from_asyncio() -> list[bytes]:
        async with AsyncKVCacheClient(server.target, bulk=False) as c:
            assert (await c.put_payloads("async", akeys, apayloads)).stored == 3
            return [bytes(g) for g in await c.get_many("async", akeys)]  # type: ignore[arg-type]

    akeys = [os.urandom(16) for _ in range(3)]
    apayloads = _payloads(3, 1 << 20, 3)
    assert asyncio.run(from_asyncio()) == _expected(akeys, apayloads)
    assert len(sent.ranges) == 9 and not any(r.seal for r in sent.ranges[6:])
    s = _stats(server)
    assert (s.put_checksum_failures, _counters(server)["sealed_blocks"]) == (0, 6)


def test_a_server_without_sealed_puts_gets_the_clients_checksums(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Info without sealed_puts (a server from before them): the ranges are not sealed, their
    heads carry the checksums the SDK computed, and the blocks are the same."""
    server = _server(make_server, place)
    sent = _Sent(monkeypatch)
    original = transport.apply_info

    def older(link: Any, info: pb.InfoResponse | None) -> int:
        if info is not None:
            info = pb.InfoResponse.FromString(info.SerializeToString())
            info.sealed_puts = False
        return original(link, info)

    monkeypatch.setattr(transport, "apply_info", older)
    keys = [os.urandom(16) for _ in range(4)]
    payloads = _payloads(4, 1 << 20, 4)
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 4
        got = [bytes(g) for g in client.get_many(NS, keys)]  # type: ignore[arg-type]
    assert got == _expected(keys, payloads)
    assert len(sent.ranges) == 4 and not any(r.seal for r in sent.ranges)
    sent_sums = [parse_header(r.head, block_len=r.block_length).checksum for r in sent.ranges]
    assert sent_sums == [parse_header(b).checksum for b in got]


def test_put_payloads_refuses_what_put_many_would_before_any_path(make_server: Any, place: Path) -> None:
    server = _server(make_server, place)
    with KVCacheClient(server.target) as client:
        with pytest.raises(ValueError, match="2 keys for 1 payloads"):
            client.put_payloads(NS, [os.urandom(16)] * 2, [b"x"])
        with pytest.raises(BlockFormatError):
            client.put_payloads(NS, [b"short"], [bytes(1 << 20)])
        with pytest.raises(TypeError):  # not C-contiguous: no range, and encoding refuses it too
            client.put_payloads(NS, [os.urandom(16)], [np.zeros((1024, 2048), np.uint8)[:, ::2]])
    assert server.stack.ram.used_bytes == 0


def _put(server: ServerThread, blocks: list[tuple[bytes, Any]]) -> grpc.RpcError | None:
    put = grpc.insecure_channel(server.target).stream_unary(
        "/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString
    )
    try:
        put(iter([encode_put_request(NS, blocks)]), timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


LATER = 1 << 62  # a seal_before_ns decades away


def test_the_server_seals_only_what_it_read_in_time_from_a_process_with_checksum_zero(
    make_server: Any, place: Path
) -> None:
    """A sealed head with a checksum, or none inline: INVALID_ARGUMENT before anything is reserved;
    seal on a client's segment file (which the client can write while the server reads it):
    INVALID_ARGUMENT; a block read at or after its seal_before_ns: ABORTED. None of them stores
    anything or keeps a slot. A right one is stored, sealed."""
    server = _server(make_server, place)
    info = pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Info(pb.InfoRequest(), timeout=10)
    assert info.sealed_puts
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, "")
    name, _ = handoff.register_process()
    try:
        key = os.urandom(16)
        payload = _payloads(1, 200_000, 5)[0]
        block = np.concatenate([np.frombuffer(unsealed_bytes_header(payload.nbytes), np.uint8), payload])
        head = unsealed_bytes_header(payload.nbytes)
        marked = head[:32] + struct.pack("<Q", 12345) + head[40:]
        bad = _put(server, [(key, ShmRange(name, payload.ctypes.data, payload.nbytes, marked, LATER))])
        assert bad is not None and bad.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum 0" in bad.details()
        no_head = _put(server, [(key, ShmRange(name, block.ctypes.data, block.nbytes, b"", LATER))])
        assert no_head is not None and no_head.code() is grpc.StatusCode.INVALID_ARGUMENT
        segment = "kvcache-" + os.urandom(16).hex()
        (place / "shm" / segment).write_bytes(payload.tobytes())
        file_range = _put(server, [(key, ShmRange(segment, 0, payload.nbytes, head, LATER))])
        assert file_range is not None and file_range.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "registered process" in file_range.details()
        late = _put(server, [(key, ShmRange(name, payload.ctypes.data, payload.nbytes, head, time.monotonic_ns()))])
        assert late is not None and late.code() is grpc.StatusCode.ABORTED, late
        assert _counters(server)["sealed_too_late"] == 1
        assert _put(server, [(key, ShmRange(name, payload.ctypes.data, payload.nbytes, head, LATER))]) is None
    finally:
        handoff.close()
    ram = server.stack.ram
    assert ram.used_bytes == ram.entry_cost_of(len(head) + payload.nbytes)  # the good block alone
    s = _stats(server)
    assert (s.put_checksum_failures, s.arena_reservations) == (0, 0)
    assert _counters(server)["sealed_blocks"] == 1
    with KVCacheClient(server.target) as client:
        assert [bytes(g) for g in client.get_many(NS, [key])] == _expected([key], [payload])  # type: ignore[arg-type]


def test_sealed_blocks_read_into_the_servers_memory_are_sealed_there(make_server: Any, place: Path) -> None:
    """Blocks the server reads into memory of its own instead of arena slots (a message that also
    carries an inline block; RAM that cannot reserve every slot at once) are sealed in the reading
    thread, then verified and stored as any block; a late one there is ABORTED too."""
    server = _server(make_server, place, ram_bytes=5 << 20)
    info = pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Info(pb.InfoRequest(), timeout=10)
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, "")
    name, _ = handoff.register_process()
    try:
        keys = [os.urandom(16) for _ in range(3)]
        payloads = _payloads(3, 700_000, 7)
        inline = _expected(keys[:1], payloads[:1])[0]
        refs = [
            (k, ShmRange(name, p.ctypes.data, p.nbytes, unsealed_bytes_header(p.nbytes), LATER))
            for k, p in zip(keys[1:], payloads[1:], strict=True)
        ]
        assert _put(server, [(keys[0], inline), *refs]) is None  # mixed: read into memory
        assert _counters(server)["sealed_blocks"] == 2
        late = [(k, ShmRange(r.segment, r.offset, r.length, r.head, 1)) for k, r in refs]
        other = os.urandom(16)
        gone = _put(server, [(other, _expected([other], payloads[:1])[0]), *late])
        assert gone is not None and gone.code() is grpc.StatusCode.ABORTED
    finally:
        handoff.close()
    with KVCacheClient(server.target) as client:
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
        assert client.lookup(NS, [other]).prefix_length == 0
        big = [os.urandom(16) for _ in range(3)]
        big_payloads = _payloads(3, 2 << 20, 8)  # more than RAM reserves at once
        assert client.put_payloads(NS, big, big_payloads).stored >= 1
        got = client.get_many(NS, big)
        found = [(bytes(g), e) for g, e in zip(got, _expected(big, big_payloads), strict=True) if g is not None]
    assert found and all(g == e for g, e in found)
    assert _counters(server)["sealed_blocks"] == 5 and _stats(server).put_checksum_failures == 0


def test_a_sealed_put_the_server_cannot_take_is_put_again_checksummed_by_the_sdk(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window too short for the server's reads (ABORTED or the call's deadline), and a server that
    takes checksum 0 for a checksum (one without sealing behind an Info that said otherwise:
    DATA_LOSS, and sealing goes off): the SDK puts the same blocks again, checksummed by itself,
    and what is stored is the same."""
    server = _server(make_server, place)
    sent = _Sent(monkeypatch)
    monkeypatch.setattr(sealing, "SEAL_MIN_WINDOW_S", 0.0)
    monkeypatch.setattr(sealing, "SEAL_WINDOW_BYTES_PER_S", 1e15)  # a window of microseconds
    keys = [os.urandom(16) for _ in range(4)]
    payloads = _payloads(4, 1 << 20, 9)
    with KVCacheClient(server.target, bulk=False) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 4
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
        assert [r.seal for r in sent.ranges] == [True] * 4 + [False] * 4
        assert client._transport.shm.process.sealing
    monkeypatch.undo()
    sent = _Sent(monkeypatch)

    def unsealing(*args: Any, seal: bool = False, **kw: Any) -> None:
        verify.check_block_for_put(*args, **kw)  # as a server that never heard of seal_before_ns

    monkeypatch.setattr(put_stage, "check_block_for_put", unsealing)
    keys = [os.urandom(16) for _ in range(4)]
    with KVCacheClient(server.target, bulk=False) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 4
        assert not client._transport.shm.process.sealing
        assert client.put_payloads(NS, keys[:2], payloads[:2]).stored == 2  # not sealed again
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
    assert [r.seal for r in sent.ranges] == [True] * 4 + [False] * 6
    assert _stats(server).put_checksum_failures == 1


def test_a_sealed_put_interrupted_in_the_client_returns_only_once_the_server_may_store_nothing_of_it(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt inside a sealed put: the server may still be reading the payloads, so the
    SDK raises it only once their seal_before_ns has passed (after it the server stores nothing
    it read): the caller cannot reuse a buffer the server then seals."""
    server = _server(make_server, place)
    seen: list[int] = []

    def interrupted(tr: Any, namespace: str, items: Any, *args: Any, **kw: Any) -> Any:
        seen.extend(d.seal_before_ns for _, d in items if isinstance(d, ShmRange))
        raise KeyboardInterrupt

    with KVCacheClient(server.target, bulk=False) as client:
        client.lookup(NS, [os.urandom(16)])  # Info taken, the process registered
        monkeypatch.setattr(transport.GrpcTransport, "_send_put", interrupted)
        with pytest.raises(KeyboardInterrupt):
            client.put_payloads(NS, [os.urandom(16)], _payloads(1, 1 << 20, 10))
        done = time.monotonic_ns()
    assert len(seen) == 1 and done >= seen[0]


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection lost (raised by the client side)"


def test_a_sealed_put_gRPC_ended_on_the_client_side_waits_out_the_servers_reads_before_any_retry(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UNAVAILABLE (or CANCELLED) can be the client's view while the server's handler still reads:
    each attempt's seal_before_ns passes before the SDK retries, and before it raises at last, so no
    earlier attempt's reads can meet a buffer the caller already has back."""
    server = _server(make_server, place)
    attempts: list[tuple[int, int]] = []  # (seal_before_ns, when the attempt was made)

    def lost(tr: Any, namespace: str, items: Any, *args: Any, **kw: Any) -> Any:
        attempts.extend((d.seal_before_ns, time.monotonic_ns()) for _, d in items if isinstance(d, ShmRange))
        raise _Unavailable()

    with KVCacheClient(server.target, bulk=False) as client:
        client.lookup(NS, [os.urandom(16)])
        monkeypatch.setattr(transport.GrpcTransport, "_send_put", lost)
        with pytest.raises(KVCacheError):
            client.put_payloads(NS, [os.urandom(16)], _payloads(1, 1 << 20, 11), timeout_s=2.5)
        done = time.monotonic_ns()
    assert len(attempts) >= 2
    for (before, _), (_, next_made) in itertools.pairwise(attempts):
        assert next_made >= before
    assert done >= attempts[-1][0]


def test_waiting_out_a_window_holds_a_second_interrupt_until_it_is_over() -> None:
    """wait_out keeps waiting through an exception raised by a signal handler meanwhile (a second
    Ctrl-C), and raises it once the window is over."""
    sealed = sealing.Sealed([], [], time.monotonic_ns() + 300_000_000, 0.3)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            sealing.wait_out(sealed)
        assert time.monotonic_ns() >= sealed.before_ns
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def test_a_client_in_another_time_namespace_never_seals(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its seal_before_ns would be in another clock: the server answers ABORTED to its sealed puts and
    the SDK stores the same blocks checksummed by itself."""
    assert procmem.same_clock(os.getpid())
    monkeypatch.setattr(procmem, "same_clock", lambda pid: False)
    server = _server(make_server, place)
    sent = _Sent(monkeypatch)
    keys = [os.urandom(16) for _ in range(2)]
    payloads = _payloads(2, 1 << 20, 12)
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 2
        assert [bytes(g) for g in client.get_many(NS, keys)] == _expected(keys, payloads)  # type: ignore[arg-type]
    assert [r.seal for r in sent.ranges] == [True] * 2 + [False] * 2
    assert _counters(server)["sealed_blocks"] == 0


def test_put_tensors_on_the_same_host_is_sealed_by_the_server_and_stores_what_it_stored_before(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """put_tensors sends each tensor's own header (dtype, shape, layout) with checksum 0 and the
    server seals it; the asyncio face seals the same headers in the SDK (format.seal_parts). Either
    way the block is byte for byte tensor_block_parts's, and get_tensors returns the tensors."""
    torch = pytest.importorskip("torch")
    from kvcache_client.tensors import tensor_block_parts

    server = _server(make_server, place)
    sent = _Sent(monkeypatch)
    generator = torch.Generator().manual_seed(13)
    tensors = [
        torch.randn(2, 2, 8, 64, 128, generator=generator, dtype=torch.float32).to(torch.bfloat16),
        torch.randn(4, 2, 4, 64, 64, generator=generator),
        torch.randint(0, 100, (1, 2, 2, 300, 128), generator=generator, dtype=torch.uint8),
    ]
    keys = [os.urandom(16) for _ in tensors]
    expected = [b"".join(bytes(p) for p in tensor_block_parts(t, k)) for k, t in zip(keys, tensors, strict=True)]
    with KVCacheClient(server.target, bulk=False) as client:
        assert client.put_tensors(NS, keys, tensors).stored == 3
        assert [bytes(g) for g in client.get_many(NS, keys)] == expected  # type: ignore[arg-type]
        back = client.get_tensors(NS, keys)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))  # type: ignore[arg-type]
    assert len(sent.ranges) == 3 and all(r.seal for r in sent.ranges)
    assert _counters(server)["sealed_blocks"] == 3

    async def from_asyncio() -> list[bytes]:
        async with AsyncKVCacheClient(server.target, bulk=False) as c:
            assert (await c.put_tensors("async", keys, tensors)).stored == 3
            return [bytes(g) for g in await c.get_many("async", keys)]  # type: ignore[arg-type]

    assert asyncio.run(from_asyncio()) == expected
    assert not any(r.seal for r in sent.ranges[3:]) and _counters(server)["sealed_blocks"] == 3


def test_seal_parts_makes_the_header_encode_block_parts_makes_with_its_checksum() -> None:
    """format.seal_parts of a header without a checksum is the header with it, for any payload buffer
    and dtype; it refuses a header that has one, a payload of another length, and a short key."""
    key = os.urandom(16)
    for payload, dtype, shape in (
        (np.arange(4096, dtype=np.float32), "float32", (4096,)),
        (np.zeros((3, 5), np.float16), "float16", (15,)),
        (b"", "uint8", (0,)),
    ):
        view = memoryview(payload).cast("B") if isinstance(payload, np.ndarray) else payload
        sealed, _ = encode_block_parts(view, key=key, dtype=dtype, shape=shape)
        bare, _ = encode_block_parts(view, key=key, dtype=dtype, shape=shape, checksum=False)
        assert parse_header(bare, block_len=len(bare) + len(view)).checksum == 0
        for given in (bytes(view), bytearray(view), memoryview(bytes(view))):
            assert seal_parts(key, bare, given) == sealed
    with pytest.raises(BlockFormatError, match="checksum 0"):
        seal_parts(key, sealed, b"")
    with pytest.raises(BlockFormatError):
        seal_parts(key, encode_block_parts(b"abc", key=key, dtype="uint8", shape=(3,), checksum=False)[0], b"ab")
    with pytest.raises(BlockFormatError):
        seal_parts(b"short", encode_block_parts(b"abc", key=key, dtype="uint8", shape=(3,), checksum=False)[0], b"abc")
