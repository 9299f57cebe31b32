"""Same-host puts whose checksums the server computes (ShmRange.seal, put_payloads; docs/shm.md,
"Checksums computed by the server"): a real server with a segment socket, the real SDK."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import kvcache_client.messages as messages
import kvcache_client.transport as transport
from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.handoff import Handoff
from kvcache_core.blockwire import ShmRange, encode_put_request
from kvcache_core.errors import BlockFormatError
from kvcache_core.format import encode_bytes_parts, parse_header, unsealed_bytes_header
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
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
    """Every range the gRPC transports put, captured on its way to the server."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ranges: list[ShmRange] = []
        for cls in (transport.GrpcTransport, transport.AsyncGrpcTransport):
            original = cls._send_put

            def spy(tr: Any, namespace: str, items: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
                self.ranges += [d for _, d in items if isinstance(d, ShmRange)]
                return _original(tr, namespace, items, *args, **kw)

            monkeypatch.setattr(cls, "_send_put", spy)


def test_put_payloads_on_the_same_host_leaves_the_checksums_to_the_server(
    make_server: Any, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocking and asyncio: every range sent is sealed with a header of checksum 0, the SDK never
    encodes (never hashes) a payload, and what the server stores is byte for byte what put_many of
    encode_bytes_parts stores (a block sealed wrongly would fail get_many's check of its checksum)."""
    server = _server(make_server, place)
    sent = _Sent(monkeypatch)

    def no_encoding(*args: Any) -> Any:
        raise AssertionError("the SDK hashed a payload of a sealed put")

    monkeypatch.setattr(messages, "encode_bytes_parts", no_encoding)
    keys = [os.urandom(16) for _ in range(6)]
    payloads = _payloads(4, 2 << 20, 1) + _payloads(2, 300_000, 2)  # two sizes: two headers
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored == 6
        assert client._transport.shm.process.state == "on"
        got = [bytes(g) for g in client.get_many(NS, keys)]  # type: ignore[arg-type]
    assert got == _expected(keys, payloads)

    async def from_asyncio() -> list[bytes]:
        async with AsyncKVCacheClient(server.target) as c:
            assert (await c.put_payloads("async", akeys, apayloads)).stored == 3
            return [bytes(g) for g in await c.get_many("async", akeys)]  # type: ignore[arg-type]

    akeys = [os.urandom(16) for _ in range(3)]
    apayloads = _payloads(3, 1 << 20, 3)
    assert asyncio.run(from_asyncio()) == _expected(akeys, apayloads)
    assert len(sent.ranges) == 9 and all(r.seal for r in sent.ranges)
    assert {parse_header(r.head, block_len=r.block_length).checksum for r in sent.ranges} == {0}
    s = _stats(server)
    assert (s.put_checksum_failures, s.shm_bytes_received) == (0, sum(len(b) for b in got) + 3 * ((1 << 20) + 48))


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


def _put(server: ServerThread, key: bytes, ref: ShmRange) -> grpc.RpcError | None:
    put = grpc.insecure_channel(server.target).stream_unary(
        "/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString
    )
    try:
        put(iter([encode_put_request(NS, [(key, ref)])]), timeout=10)
    except grpc.RpcError as exc:
        return exc
    return None


def test_the_server_seals_only_what_it_read_from_a_process_with_checksum_zero(make_server: Any, place: Path) -> None:
    """A sealed head with a checksum: INVALID_ARGUMENT; seal on a client's segment file (which the
    client can write while the server reads it): INVALID_ARGUMENT; neither stores anything nor keeps a
    slot. A right one is stored, sealed."""
    server = _server(make_server, place)
    info = pb_grpc.KVCacheStub(grpc.insecure_channel(server.target)).Info(pb.InfoRequest(), timeout=10)
    assert info.sealed_puts
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, "")
    name, _ = handoff.register_process()
    try:
        key = os.urandom(16)
        payload = _payloads(1, 200_000, 5)[0]
        head = unsealed_bytes_header(payload.nbytes)
        marked = head[:32] + struct.pack("<Q", 12345) + head[40:]
        bad = _put(server, key, ShmRange(name, payload.ctypes.data, payload.nbytes, marked, seal=True))
        assert bad is not None and bad.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum 0" in bad.details()
        segment = "kvcache-" + os.urandom(16).hex()
        (place / "shm" / segment).write_bytes(head + payload.tobytes())
        file_range = _put(server, key, ShmRange(segment, 0, len(head) + payload.nbytes, seal=True))
        assert file_range is not None and file_range.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "registered process" in file_range.details()
        assert server.stack.ram.used_bytes == 0
        assert _put(server, key, ShmRange(name, payload.ctypes.data, payload.nbytes, head, seal=True)) is None
    finally:
        handoff.close()
    s = _stats(server)
    assert (s.put_checksum_failures, s.arena_reservations) == (0, 0)
    with KVCacheClient(server.target) as client:
        assert [bytes(g) for g in client.get_many(NS, [key])] == _expected([key], [payload])  # type: ignore[arg-type]


def test_a_sealed_put_ram_cannot_reserve_is_sealed_where_the_server_reads_it(make_server: Any, place: Path) -> None:
    """Blocks whose slots RAM cannot reserve all at once are read into the server's own memory
    instead (put.py, _read_shm_blocks): sealed there, then verified and stored as any block."""
    server = _server(make_server, place, ram_bytes=5 << 20)
    keys = [os.urandom(16) for _ in range(3)]
    payloads = _payloads(3, 2 << 20, 6)
    with KVCacheClient(server.target) as client:
        assert client.put_payloads(NS, keys, payloads).stored >= 1
        got = client.get_many(NS, keys)
        found = [(bytes(g), e) for g, e in zip(got, _expected(keys, payloads), strict=True) if g is not None]
    assert found and all(g == e for g, e in found)
    assert _stats(server).put_checksum_failures == 0
