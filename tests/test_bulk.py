"""The bulk path (docs/bulk.md): real servers on free ports, the SDK and raw sockets speaking the frames."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvcache_client import (
    AsyncKVCacheClient,
    DeadlineExceeded,
    KVCacheClient,
    PermissionDenied,
    RPCError,
    TLSConfig,
)
from kvcache_client.bulkconn import BulkConnection, BulkUnreachable, stripes
from kvcache_core import bulkwire as bw
from kvcache_core.format import payload_view
from kvcache_server.auth import token_digest
from kvcache_server.config import ConfigError, load_config
from kvcache_server.launcher import ChildServer
from tests.backends import free_port, make_certs, wait_for
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(60)

RW, RO = "kvc_bulk_rw_token", "kvc_bulk_read_only"
NO_SHM = {"shm": {"enabled": False}}  # the same-host path would be preferred; these tests are about bulk


def bulk_server(make_server, **extra) -> ServerThread:
    config = {"ram": {"capacity_bytes": 512 << 20}, **NO_SHM}
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values}
    return make_server(**config)


def blocks(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [keyed(os.urandom(size)) for _ in range(n)]


def auth_config(tmp: Path) -> dict:
    path = tmp / "tokens.toml"
    text = ""
    for name, token, rights in (("rw", RW, '["read", "write"]'), ("ro", RO, '["read"]')):
        text += (
            f'[[tokens]]\nname = "{name}"\ntenant = "t"\nsha256 = "{token_digest(token).hex()}"\nrights = {rights}\n'
        )
    path.write_text(text)
    return {"auth": {"enabled": True, "tokens_file": str(path)}}


# -- raw frames --------------------------------------------------------------------------------


class Raw:
    """A bulk client made of a plain socket, to send what the SDK never would."""

    def __init__(self, server: ServerThread, *, tls: ssl.SSLContext | None = None) -> None:
        sock = socket.create_connection(("127.0.0.1", server.running.bulk.port), timeout=10)
        self.sock = tls.wrap_socket(sock, server_hostname="127.0.0.1") if tls else sock

    def send(self, kind: bw.FrameType, payload: bytes = b"", length: int | None = None) -> None:
        self.sock.sendall(bw.header(kind, len(payload) if length is None else length) + payload)

    def hello(self, token: str = "") -> None:
        self.send(bw.FrameType.HELLO, bw.hello(token))
        kind, payload = self.read()
        assert kind is bw.FrameType.READY, (kind, payload)

    def read(self) -> tuple[bw.FrameType, bytes]:
        head = bytearray(bw.HEADER_BYTES)
        bw.recv_exact(self.sock, memoryview(head), "header")
        kind, length = bw.parse_header(head, 1 << 30)
        payload = bytearray(length)
        bw.recv_exact(self.sock, memoryview(payload), "payload")
        return kind, bytes(payload)

    def error(self) -> tuple[grpc.StatusCode, str]:
        kind, payload = self.read()
        assert kind is bw.FrameType.ERROR, kind
        code, message = bw.parse_error(payload)
        status = next(s for s in grpc.StatusCode if s.value[0] == code)
        return status, message

    def closed(self) -> bool:
        """The server closed the connection (after its ERROR frame)."""
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def counters(server: ServerThread) -> dict[str, int]:
    return server.running.bulk.counters.snapshot()


def settled(server: ServerThread, **expected: int) -> None:
    """Waits (bounded) until the server's bulk counters, its budget and sink reach the expected values."""
    bulk = server.running.bulk

    def check() -> bool:
        c = counters(server)
        return all(c[k] == v for k, v in expected.items()) and c["connections"] == 0

    wait_for(check, 10, f"bulk counters {expected}, got {counters(server)}")
    wait_for(lambda: server.call(_budget_used(server)) == 0, 5, "the in-flight budget to be released")
    assert bulk.sink.reserved == bulk.sink.committed + bulk.sink.abandoned


async def _budget_used(server: ServerThread) -> int:
    return server.running.bulk._budget.used


def stored(server: ServerThread, namespace: str, keys: list[bytes]) -> int:
    return sum(server.call(server.stack.ram.contains_many(namespace, keys)))


# -- tests -------------------------------------------------------------------------------------


def test_round_trip_over_bulk_is_byte_exact_and_counted(make_server) -> None:
    server = bulk_server(make_server)
    items = blocks(4, 3 << 20) + blocks(3, 100)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        info_port = server.running.bulk.port
        result = client.put_many("n", items)
        assert (result.stored, result.rejected, result.tier("ram").stored) == (7, 0, 7)
        got = client.get_many("n", [*keys, os.urandom(16)])
        assert [bytes(g) for g in got[:-1]] == [b for _, b in items] and got[-1] is None
        assert client.get_many("n", [keys[0], os.urandom(16), keys[1]], prefix_only=True)[1:] == [None, None]
        c = client.bulk.counters
        nbytes = sum(len(b) for _, b in items)
        assert client.bulk.state == "on" and client.bulk.pool.address == ("127.0.0.1", info_port)
        assert (c.bulk_bytes_sent, c.grpc_bytes_sent, c.fallbacks) == (nbytes, 0, 0)
        assert c.bulk_bytes_received == nbytes + len(items[0][1])
        stats = client.stats()
        assert (stats.bulk_bytes_received, stats.bulk_bytes_sent) == (nbytes, c.bulk_bytes_received)
        assert client.corrupt_blocks == 0
    assert stored(server, "n", keys) == 7


def test_async_client_round_trip_over_bulk(make_server) -> None:
    server = bulk_server(make_server)
    items = blocks(3, 2 << 20)

    async def main() -> list[bytes | None]:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as client:
            assert (await client.put_many("n", items)).stored == 3
            got = await client.get_many("n", [k for k, _ in items])
            assert (
                client.bulk.counters.bulk_bytes_sent
                == client.bulk.counters.bulk_bytes_received
                == 6 * (1 << 20) + 3 * (len(items[0][1]) - (2 << 20))
            )
            return [None if g is None else bytes(g) for g in got]

    assert asyncio.run(main()) == [b for _, b in items]
    assert counters(server)["bytes_received"] == sum(len(b) for _, b in items)


def test_small_puts_take_the_bulk_port_unless_min_bytes_keeps_them_on_grpc(make_server) -> None:
    """A put of two 1 KB blocks is one bulk PUT (faster than a gRPC Put at every size); with the
    client's bulk.min_bytes above its size it is a gRPC Put and no bulk connection is opened."""
    server = bulk_server(make_server)
    items = blocks(2, 1000)
    with KVCacheClient(server.target) as client:
        assert client.put_many("n", items).stored == 2
        nbytes = sum(len(b) for _, b in items)
        assert (client.bulk.counters.bulk_bytes_sent, client.bulk.counters.grpc_bytes_sent) == (nbytes, 0)
    assert (counters(server)["accepted"], counters(server)["puts"]) == (1, 1)
    with KVCacheClient(server.target, bulk=True) as client:
        client.bulk.min_bytes = 1 << 20
        assert client.put_many("n", blocks(2, 1000)).stored == 2
        assert client.bulk.counters.grpc_bytes_sent > 0 and client.bulk.counters.bulk_bytes_sent == 0
    assert (counters(server)["accepted"], counters(server)["puts"]) == (1, 1)


def test_a_get_spreads_over_connections_only_where_its_blocks_are_large(make_server) -> None:
    """A get's size is known only once answered: the first get of 8 keys goes over both connections
    (two GET requests); after it, gets of small blocks are one GET request on one connection, and once
    large blocks have been seen (8 x 1 MiB: 8 MiB, one lane per 4 MiB) a get is two again, until a get
    of small blocks has been answered. Every byte is compared."""
    server = bulk_server(make_server)
    small, large = blocks(8, 16 << 10), blocks(8, 1 << 20)
    with KVCacheClient(server.target) as client:
        assert client.put_many("n", small + large).stored == 16

        def gets(items: list[tuple[bytes, bytes]]) -> int:
            before = counters(server)["gets"]
            got = client.get_many("n", [k for k, _ in items])
            assert [bytes(b) for b in got] == [b for _, b in items]
            return counters(server)["gets"] - before

        assert gets(small) == 2  # no block seen yet: one lane per connection
        assert [gets(small) for _ in range(3)] == [1, 1, 1]
        assert gets(large[:1]) == 1  # one key: one lane
        assert gets(large) == 2
        assert [gets(small), gets(small)] == [2, 1]  # the last get's block size stands for the next one's
        assert client.bulk.counters.grpc_bytes_received == 0


def test_auth_same_tokens_and_rights_as_grpc(make_server, tmp_path: Path) -> None:
    server = bulk_server(make_server, **auth_config(tmp_path))
    for token, code in (
        ("", "missing credentials: send the API token in the HELLO frame"),
        ("kvc_wrong", "invalid token"),
    ):
        raw = Raw(server)
        raw.send(bw.FrameType.HELLO, bw.hello(token))
        assert raw.error() == (grpc.StatusCode.UNAUTHENTICATED, code)
        assert raw.closed()
        raw.close()
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, token=RO) as reader:
        with pytest.raises(PermissionDenied, match="lacks the 'write' right for Put"):
            reader.put_many("n", items)
        assert reader.bulk.counters.fallbacks == 0  # refused by the server, not a reason to try gRPC
    with KVCacheClient(server.target, token=RW) as writer:
        assert writer.put_many("n", items).stored == 2
        assert writer.bulk.counters.bulk_bytes_sent == sum(len(b) for _, b in items)
    with KVCacheClient(server.target, token=RO) as reader:
        assert [bytes(g) for g in reader.get_many("n", [k for k, _ in items])] == [b for _, b in items]
        assert reader.bulk.counters.bulk_bytes_received > 0
    assert stored(server, "t:n", [k for k, _ in items]) == 2  # scoped by the tenant, as on gRPC
    settled(server, errors=3)  # two HELLOs, and the reader's put (2 MiB: one connection, not striped)


def test_tls_with_the_grpc_certificate(make_server, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = {"cert_file": str(certs["server.crt"]), "key_file": str(certs["server.key"])}
    server = bulk_server(make_server, tls=tls)
    items = blocks(3, 1 << 20)
    with KVCacheClient(server.target, tls=TLSConfig(ca_file=str(certs["ca.crt"])), timeout_s=10) as client:
        assert client.put_many("n", items).stored == 3
        assert [bytes(g) for g in client.get_many("n", [k for k, _ in items])] == [b for _, b in items]
        assert client.bulk.counters.bulk_bytes_sent == client.bulk.counters.bulk_bytes_received > 0
        assert server.running.bulk.tls
    # A plaintext peer on the TLS port gets nothing; a client trusting another CA does not connect.
    raw = Raw(server)
    raw.send(bw.FrameType.HELLO, bw.hello(""))
    assert raw.closed()
    raw.close()
    rogue = ssl.create_default_context(cafile=str(certs["rogue-ca.crt"]))
    with pytest.raises(ssl.SSLCertVerificationError):
        Raw(server, tls=rogue)
    settled(server, aborted=2)


def test_client_gone_mid_frame_commits_nothing_and_releases_everything(make_server) -> None:
    server = bulk_server(make_server)
    (k1, b1), (k2, b2) = blocks(2, 1 << 20)
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(k1, len(b1)), (k2, len(b2))]))
    raw.send(bw.FrameType.DATA, b1)  # the first block whole
    raw.send(bw.FrameType.DATA, b2[: len(b2) // 2], length=len(b2))  # half of the second, then gone
    wait_for(lambda: counters(server)["bytes_received"] == len(b1), 10, "the first block to arrive")
    raw.close()
    settled(server, aborted=1, puts=0)
    sink = server.running.bulk.sink
    assert (sink.reserved, sink.committed, sink.abandoned) == (2, 0, 2)
    assert stored(server, "n", [k1, k2]) == 0  # not even the complete first block
    with KVCacheClient(server.target) as client:  # the server keeps serving
        assert client.put_many("n", [(k1, b1), (k2, b2)]).stored == 2
    assert (sink.reserved, sink.committed, sink.abandoned) == (4, 2, 2)


def test_blocks_verified_piece_by_piece_refuse_damage_in_any_piece_and_a_bad_header_at_once(make_server) -> None:
    """Blocks are hashed piece by piece (256 KiB) as they are received: a 4 MiB block with one byte
    flipped in a middle piece is refused DATA_LOSS once it has come; a block whose header does not
    parse is refused INVALID_ARGUMENT when its first piece has come, the other 3.75 MiB never sent
    (the request's deadline is 120 s: the refusal is not a deadline). Nothing stored, each
    connection closed; the server keeps serving."""
    server = bulk_server(make_server)
    ((key, block),) = blocks(1, 4 << 20)
    damaged = bytearray(block)
    damaged[(3 << 20) + 5] ^= 0x01
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(key, len(block))]))
    raw.send(bw.FrameType.DATA, bytes(damaged))
    code, message = raw.error()
    assert code is grpc.StatusCode.DATA_LOSS and "block 0" in message, message
    raw.close()
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(key, len(block))]))
    raw.sock.sendall(bw.header(bw.FrameType.DATA, len(block)) + b"NOPE" + block[4 : 256 << 10])
    code, message = raw.error()
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "malformed block" in message, message
    raw.close()
    settled(server, errors=2, puts=0)
    assert counters(server)["checksum_failures"] == 1 and stored(server, "n", [key]) == 0
    with KVCacheClient(server.target) as client:
        assert client.put_many("n", [(key, block)]).stored == 1
        assert bytes(client.get_many("n", [key])[0]) == block


@pytest.mark.parametrize(
    "lie",
    ["data_shorter", "data_longer", "over_max_frame", "put_count", "checksum", "not_data", "bad_magic"],
)
def test_a_frame_that_lies_closes_the_connection_and_loses_nothing(make_server, lie: str) -> None:
    server = bulk_server(make_server, bulk={"max_frame_bytes": (64 << 20) + (2 << 20)})
    (k1, b1), (k2, b2) = blocks(2, 256 << 10)
    raw = Raw(server)
    raw.hello()
    announce = bw.put("n", [(k1, len(b1)), (k2, len(b2))])
    expected = grpc.StatusCode.INVALID_ARGUMENT
    if lie == "put_count":
        raw.send(bw.FrameType.PUT, announce[:-1])  # one byte short of its entries
    elif lie == "over_max_frame":
        raw.send(bw.FrameType.PUT, announce)
        raw.send(bw.FrameType.DATA, b"", length=1 << 40)
        expected = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif lie == "bad_magic":
        raw.sock.sendall(b"HTTP" + bytes(12))
    else:
        raw.send(bw.FrameType.PUT, announce)
        raw.send(bw.FrameType.DATA, b1)
        if lie == "data_shorter":
            raw.send(bw.FrameType.DATA, b2[:-1])
        elif lie == "data_longer":
            raw.send(bw.FrameType.DATA, b2 + b"x")
        elif lie == "not_data":
            raw.send(bw.FrameType.GET, bw.get("n", [k2], False))
        else:
            raw.send(bw.FrameType.DATA, b2[:-1] + bytes([b2[-1] ^ 1]))
            expected = grpc.StatusCode.DATA_LOSS
    code, message = raw.error()
    assert code is expected, message
    assert raw.closed()
    raw.close()
    settled(server, errors=1, puts=0)
    assert server.running.bulk.sink.committed == 0 and stored(server, "n", [k1, k2]) == 0
    assert counters(server)["checksum_failures"] == (lie == "checksum")
    with KVCacheClient(server.target) as client:
        assert client.put_many("n", [(k1, b1), (k2, b2)]).stored == 2


def test_a_client_that_never_reads_is_cut_off(make_server) -> None:
    server = bulk_server(make_server, bulk={"stall_timeout_s": 0.5})
    items = blocks(6, 8 << 20)  # far more than the sockets' buffers hold
    with KVCacheClient(server.target, timeout_s=20) as client:
        client.put_many("n", items)
    raw = Raw(server)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    raw.hello()
    raw.send(bw.FrameType.GET, bw.get("n", [k for k, _ in items], False))
    start = time.monotonic()
    wait_for(lambda: counters(server)["cut_off"] == 1, 15, "the stalled GET to be cut off")
    assert time.monotonic() - start < 10
    assert counters(server)["bytes_sent"] < sum(len(b) for _, b in items)
    settled(server, cut_off=1, gets=0)
    raw.close()


def test_server_restart_the_sdk_reconnects(make_server) -> None:
    grpc_port, bulk_port = free_port(), free_port()
    ports = {"server": {"port": grpc_port}, "bulk": {"port": bulk_port}}
    first = bulk_server(make_server, **ports)
    items = blocks(2, 1 << 20)
    keys = [k for k, _ in items]
    with KVCacheClient(first.target, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        first.stop()
        second = bulk_server(make_server, **ports)
        assert client.put_many("n", items).stored == 2  # the pooled connection is dead: replaced in the call
        assert [bytes(g) for g in client.get_many("n", keys)] == [b for _, b in items]
        c = client.bulk.counters
        assert c.reconnects >= 1 and c.fallbacks == 0 and c.grpc_bytes_sent == 0
        assert c.bulk_bytes_sent == 2 * sum(len(b) for _, b in items)
    assert stored(second, "n", keys) == 2


def test_fallback_to_grpc_when_the_bulk_port_is_unreachable_then_back(make_server) -> None:
    grpc_port, bulk_port = free_port(), free_port()
    first = bulk_server(make_server, server={"port": grpc_port}, bulk={"port": bulk_port})
    items = blocks(2, 1 << 20)
    nbytes = sum(len(b) for _, b in items)
    with KVCacheClient(first.target, timeout_s=10) as client:
        client.bulk.retry_after_s = 0.2
        assert client.put_many("n", items).stored == 2  # bulk
        first.stop()
        # The server comes back without a bulk port reachable where Info said, then with a new one.
        second = bulk_server(make_server, server={"port": grpc_port})
        assert second.running.bulk.port != bulk_port
        assert client.put_many("n", items).stored == 2  # bulk refused: over gRPC
        c = client.bulk.counters
        assert (c.fallbacks, c.grpc_bytes_sent, client.bulk.state) == (1, nbytes, "down")
        assert "cannot connect" in client.bulk.reason
        assert [bytes(g) for g in client.get_many("n", [k for k, _ in items])] == [b for _, b in items]
        assert c.grpc_bytes_received == nbytes  # still down: gRPC
        time.sleep(0.3)
        assert client.put_many("n", items).stored == 2  # Info asked again: the new port
        assert client.bulk.state == "on" and client.bulk.pool.address[1] == second.running.bulk.port
        assert c.bulk_bytes_sent == 2 * nbytes
    assert counters(second)["bytes_received"] == nbytes


def test_bulk_off_in_the_client_or_the_server(make_server, monkeypatch) -> None:
    server = bulk_server(make_server)
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, bulk=False) as client:
        client.put_many("n", items)
        assert (client.bulk.state, client.bulk.counters.bulk_bytes_sent) == ("off", 0)
    monkeypatch.setenv("KVCACHE_BULK", "0")
    with KVCacheClient(server.target) as client:
        client.put_many("n", items)
        assert client.bulk.counters.grpc_bytes_sent > 0 and client.bulk.counters.bulk_bytes_sent == 0
    monkeypatch.delenv("KVCACHE_BULK")
    plain = bulk_server(make_server, bulk={"enabled": False})
    with KVCacheClient(plain.target) as client:
        client.put_many("n", items)
        assert client.bulk.state == "off" and client.bulk.reason == "the server has no bulk port"
    assert counters(server)["accepted"] == 0


def test_the_deadline_covers_the_bulk_call(make_server) -> None:
    server = bulk_server(make_server, limits={"admission_wait_s": 30.0})
    budget = server.running.bulk._budget
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, timeout_s=10) as client:
        client.put_many("n", blocks(1, 1 << 20))  # bulk on
        server.call(_hold(budget, budget.capacity))  # the server waits for room: the client must not
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.put_many("n", items, timeout_s=0.5)
        assert time.monotonic() - start < 3
        server.call(_release(budget, budget.capacity))
        assert client.put_many("n", items).stored == 2


async def _hold(budget, n: int) -> None:
    await budget.reserve(n, "test")


async def _release(budget, n: int) -> None:
    budget.release(n)


def test_stripes_spread_bytes_and_bound_requests() -> None:
    lanes = stripes([10, 10, 10, 10], 2, 64)
    assert sorted(sum(len(r) for r in lane) for lane in lanes) == [2, 2]
    assert stripes([5, 100, 5], 4, 8) == [[[1]], [[0]], [[2]]]
    assert stripes([4, 4, 4], 1, 8) == [[[0, 1], [2]]]
    assert sorted(i for lane in stripes(list(range(1, 50)), 3, 40) for r in lane for i in r) == list(range(49))


def test_frames_round_trip() -> None:
    keys = [os.urandom(16) for _ in range(3)]
    assert bw.parse_put(bw.put("ns", [(k, 7) for k in keys])) == ("ns", [(k, 7) for k in keys])
    assert bw.parse_get(bw.get("ns", keys, True)) == ("ns", True, keys)
    done = bw.PutDone(2, 1, 99, ((1, 2, 0, 0, 1, 0),))
    assert bw.parse_put_done(bw.put_done(done)) == done
    with pytest.raises(bw.FrameError, match="exceeds the limit"):
        bw.parse_header(bw.header(bw.FrameType.DATA, 11), 10)
    with pytest.raises(bw.FrameError, match="unknown frame type"):
        bw.parse_header(bw.MAGIC + bytes([0x7F]) + bytes(11), 10)


def test_connections_over_the_cap_are_refused_and_the_sdk_falls_back(make_server) -> None:
    server = bulk_server(make_server, bulk={"max_connections": 1})
    held = Raw(server)
    held.hello()  # the one connection the server serves
    over = Raw(server)
    code, message = over.error()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "max_connections=1" in message
    assert over.closed()
    over.close()
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, bulk_connections=1) as client:
        assert client.put_many("n", items).stored == 2  # over gRPC: the bulk port is full
        assert client.bulk.counters.fallbacks == 1 and client.bulk.state == "down"
    held.close()
    settled(server, refused_connections=2, accepted=1)


def test_a_put_that_goes_quiet_mid_block_is_cut_off(make_server) -> None:
    server = bulk_server(make_server, bulk={"stall_timeout_s": 0.5})
    ((key, block),) = blocks(1, 1 << 20)
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(key, len(block))]))
    raw.send(bw.FrameType.DATA, block[:1000], length=len(block))  # then nothing, connection left open
    code, message = raw.error()
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and "bulk.stall_timeout_s" in message
    assert raw.closed()
    raw.close()
    settled(server, cut_off=1, puts=0)
    assert server.running.bulk.sink.abandoned == 1 and stored(server, "n", [key]) == 0


def test_metrics_and_stats_count_the_bulk_path(make_server) -> None:
    server = bulk_server(make_server, metrics={"enabled": True, "port": 0})
    items = blocks(2, 1 << 20)
    nbytes = sum(len(b) for _, b in items)
    with KVCacheClient(server.target) as client:
        client.put_many("n", items)
        client.get_many("n", [k for k, _ in items])
    raw = Raw(server)
    raw.sock.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not a bulk frame: an ERROR and a close
    assert raw.error()[0] is grpc.StatusCode.INVALID_ARGUMENT
    raw.close()
    settled(server, errors=1)
    url = f"http://127.0.0.1:{server.running.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvcache_bulk"))
    assert float(metrics['kvcache_bulk_bytes_total{direction="received"}']) == nbytes
    assert float(metrics['kvcache_bulk_bytes_total{direction="sent"}']) == nbytes
    assert float(metrics["kvcache_bulk_errors_total"]) == 1 and float(metrics["kvcache_bulk_connections"]) == 0


def test_concurrent_callers_share_the_pool_and_get_exactly_their_bytes(make_server) -> None:
    server = bulk_server(make_server)
    per_thread = [blocks(3, (1 << 20) + i * 4096) for i in range(4)]
    errors: list[BaseException] = []
    with KVCacheClient(server.target, timeout_s=20, bulk_connections=3) as client:

        def work(items: list[tuple[bytes, bytes]]) -> None:
            try:
                for _ in range(3):
                    assert client.put_many("n", items).stored == 3
                    got = client.get_many("n", [k for k, _ in items])
                    assert [bytes(g) for g in got] == [b for _, b in items]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(items,)) for items in per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        nbytes = 3 * sum(len(b) for items in per_thread for _, b in items)
        c = client.bulk.counters
        assert (c.bulk_bytes_sent, c.bulk_bytes_received, c.grpc_bytes_sent, c.fallbacks) == (nbytes, nbytes, 0, 0)
    assert counters(server)["bytes_received"] == counters(server)["bytes_sent"] == nbytes
    settled(server, errors=0)


def test_bulk_config_follows_the_block_limit() -> None:
    config = load_config(env={}, overrides={"limits": {"max_block_bytes": "128MiB", "inflight_bytes": "512MiB"}})
    assert config.bulk.frame_limit(config.limits.max_block_bytes) == (129 << 20)
    with pytest.raises(ConfigError, match=r"bulk\.max_frame_bytes must hold one largest block"):
        load_config(env={}, overrides={"bulk": {"max_frame_bytes": "1MiB"}})
    with pytest.raises(ConfigError, match=r"bulk\.stall_timeout_s must be positive"):
        load_config(env={"KVCACHE_BULK_STALL_TIMEOUT_S": "0"})


def test_a_bulk_get_from_redis_holds_one_window_per_connection(make_server, redis_server) -> None:
    server = bulk_server(
        make_server,
        ram={"capacity_bytes": 16 << 20},
        limits={"max_block_bytes": 4 << 20, "get_window_bytes": 8 << 20, "inflight_bytes": 64 << 20},
        redis={"enabled": True, "url": redis_server.url, "write_mode": "through", "timeout_s": 10},
    )
    items = blocks(12, (4 << 20) - 4096)  # 48 MiB: RAM keeps the newest few, Redis all of them
    keys = [k for k, _ in items]
    budget = server.running.bulk._budget
    with KVCacheClient(server.target, timeout_s=30, bulk_connections=1) as client:
        for i in range(0, 12, 3):
            assert client.put_many("n", items[i : i + 3]).tier("redis").stored == 3
        assert stored(server, "n", keys) < 12

        async def reset_peak() -> None:
            budget.peak = budget.used

        server.call(reset_peak())
        got = client.get_many("n", keys)
        assert [bytes(g) for g in got] == [b for _, b in items]
        assert client.bulk.counters.grpc_bytes_received == 0
    assert 0 < budget.peak <= 8 << 20  # one window (two 4 MiB blocks), never the 48 MiB the GET asked for
    settled(server, errors=0)


def test_async_client_falls_back_and_honours_its_deadline(make_server) -> None:
    server = bulk_server(make_server, limits={"admission_wait_s": 30.0})
    budget = server.running.bulk._budget
    items = blocks(2, 1 << 20)

    async def main() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as client:
            assert (await client.put_many("n", items)).stored == 2  # bulk on
            server.call(_hold(budget, budget.capacity))
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await client.put_many("n", items, timeout_s=0.5)
            assert time.monotonic() - start < 3
            server.call(_release(budget, budget.capacity))
            server.call(server.running.bulk.stop())  # the bulk port goes away: gRPC from now on
            assert (await client.put_many("n", items)).stored == 2
            c = client.bulk.counters
            assert (c.fallbacks, c.grpc_bytes_sent) == (1, sum(len(b) for _, b in items))

    asyncio.run(main())


def test_mtls_needs_a_client_certificate_from_the_ca(make_server, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = {
        "cert_file": str(certs["server.crt"]),
        "key_file": str(certs["server.key"]),
        "client_ca_file": str(certs["ca.crt"]),
    }
    server = bulk_server(make_server, tls=tls)
    ca = str(certs["ca.crt"])
    good = TLSConfig(ca_file=ca, cert_file=str(certs["client.crt"]), key_file=str(certs["client.key"]))
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, tls=good, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        assert client.bulk.counters.bulk_bytes_sent == sum(len(b) for _, b in items)
    for cert in (None, "rogue-client"):  # no client certificate, or one from another CA
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(str(certs[f"{cert}.crt"]), str(certs[f"{cert}.key"]))
        with pytest.raises((ssl.SSLError, OSError)):
            raw = Raw(server, tls=context)  # TLS 1.3: the refusal may arrive with the first read
            raw.send(bw.FrameType.HELLO, bw.hello(""))
            raw.read()
    settled(server, aborted=2, puts=1)  # the put (2 MiB: one connection, not striped)


def test_idle_connections_are_closed_and_the_sdk_replaces_them(make_server) -> None:
    server = bulk_server(make_server, bulk={"idle_timeout_s": 0.3})
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, bulk_connections=1) as client:
        assert client.put_many("n", items).stored == 2
        wait_for(lambda: counters(server)["connections"] == 0, 5, "the idle connection to be closed")
        assert client.put_many("n", items).stored == 2
        c = client.bulk.counters
        assert (c.reconnects, c.fallbacks, c.grpc_bytes_sent) == (1, 0, 0)
    settled(server, accepted=2, errors=0, aborted=0)


def test_a_killed_and_restarted_server_process(tmp_path: Path) -> None:
    """A real `python -m kvcache_server`, configured from the environment, SIGKILLed mid-session."""
    grpc_port, bulk_port = free_port(), free_port()
    argv = [sys.executable, "-m", "kvcache_server", "--port", str(grpc_port), "--log-level", "warning"]
    env = {**os.environ, "KVCACHE_BULK_PORT": str(bulk_port), "KVCACHE_SHM_ENABLED": "0"}
    repo = str(Path(__file__).resolve().parent.parent)

    def start() -> ChildServer:
        child = ChildServer("kvcache-server", argv, env=env, cwd=repo)
        assert child.launch(rf"bulk 127\.0\.0\.1:{bulk_port}\b") is not None
        return child

    items = blocks(3, 1 << 20)
    first = start()
    try:
        with KVCacheClient(f"127.0.0.1:{grpc_port}", timeout_s=15) as client:
            assert client.put_many("n", items).stored == 3
            first.proc.kill()
            first.proc.wait(10)
            second = start()
            try:
                assert client.put_many("n", items).stored == 3  # the pooled connections died with it
                got = client.get_many("n", [k for k, _ in items])
                assert [bytes(g) for g in got] == [b for _, b in items]
                c = client.bulk.counters
                assert c.reconnects >= 1 and (c.fallbacks, c.grpc_bytes_sent, c.grpc_bytes_received) == (0, 0, 0)
                assert client.stats().bulk_bytes_received == sum(len(b) for _, b in items)
            finally:
                second.stop()
    finally:
        first.stop()


@pytest.mark.parametrize(
    "lie", ["index_out_of_range", "duplicate_index", "done_miscounts", "over_max_frame", "garbage"]
)
def test_the_sdk_refuses_a_server_that_lies(lie: str) -> None:
    """The client side of the framing, against a peer on a real socket pair that answers a GET wrongly."""
    ours, theirs = socket.socketpair()
    keys = [os.urandom(16), os.urandom(16)]
    block = b"x" * 100
    item = bw.header(bw.FrameType.GET_ITEM, bw.GET_ITEM.size + len(block)) + bw.GET_ITEM.pack(0, 1) + block
    answers = {
        "index_out_of_range": bw.header(bw.FrameType.GET_ITEM, 8 + 4) + bw.GET_ITEM.pack(2, 1) + b"abcd",
        "duplicate_index": item + item,
        "done_miscounts": item + bw.header(bw.FrameType.GET_DONE, 4) + bw.get_done(2),
        "over_max_frame": bw.header(bw.FrameType.GET_ITEM, 1 << 30),
        "garbage": b"HTTP/1.1 400 Bad Request\r\n\r\n",
    }

    def serve() -> None:
        head = bytearray(bw.HEADER_BYTES)
        bw.recv_exact(theirs, memoryview(head), "GET header")
        _, length = bw.parse_header(head, 1 << 20)
        bw.recv_exact(theirs, memoryview(bytearray(length)), "GET")
        theirs.sendall(answers[lie])

    thread = threading.Thread(target=serve)
    thread.start()
    conn = BulkConnection(ours, bw.Ready(1 << 20, 1 << 20, 1024))
    with pytest.raises(BulkUnreachable):
        conn.get("n", keys, False, time.monotonic() + 5)
    thread.join(5)
    ours.close()
    theirs.close()


def test_bulk_gets_hand_back_their_arena_leases(make_server) -> None:
    """A bulk GET's RAM hits are arena slots under read leases: each window's are released once
    sent, so a flood of new blocks can evict and reuse those slots (before, they stayed pinned for
    the stack's SERVE_LEASE_S and the flood's puts found no room)."""
    server = bulk_server(make_server, ram={"capacity_bytes": 32 << 20})
    old = blocks(8, 2 << 20)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("n", old).stored == 8
        for _ in range(30):
            got = client.get_many("n", [k for k, _ in old])
            assert [bytes(g) for g in got] == [b for _, b in old]
        assert client.bulk.counters.bulk_bytes_received == 30 * sum(len(b) for _, b in old)  # all over bulk
        # Released by the session's thread once a window is sent: by the time the client has read it,
        # or a moment later on a loaded machine.
        wait_for(lambda: server.stack.ram.arena_stats()["leases"] == 0, 10, "the GETs' leases released")
        new = blocks(16, 2 << 20)  # 32 MiB: every old block's slot is needed
        assert client.put_many("n", new[:8]).stored == 8
        assert client.put_many("n", new[8:]).stored == 8
        assert client.stats().arena_leases == 0


def test_bulk_puts_land_straight_in_arena_slots_and_fall_back_to_buffers_when_full(make_server) -> None:
    """Each block is received into the RAM tier's arena slot it is stored in; where RAM has no room
    for a reservation (readers lease most of the arena), that block goes to a buffer and the stack's
    put (which may evict the PUT's own first blocks to make room: RAM is a cache), and the answer and
    the sink's counts say exactly what happened; no reservation or lease is left behind."""
    server = bulk_server(make_server, ram={"capacity_bytes": 16 << 20})
    sink = server.running.bulk.sink
    # One connection: its blocks are reserved in order (two would race for the last free MiBs).
    with KVCacheClient(server.target, timeout_s=10, bulk_connections=1) as client:
        first = blocks(4, 3 << 20)
        assert client.put_many("n", first).stored == 4
        assert (sink.reserved, sink.in_arena, sink.committed) == (4, 4, 4)
        pinned = server.stack.lease("n", [k for k, _ in first], 60.0)  # 12 MiB of 16 held by readers
        assert None not in pinned
        second = blocks(3, 1 << 20) + blocks(1, 3 << 20)  # the first 3 fit beside them, the last does not
        result = client.put_many("n", second)
        assert (sink.reserved, sink.in_arena, sink.committed, sink.abandoned) == (8, 7, 8, 0)
        assert result.stored + result.rejected == 4 and result.tier("ram").stored == result.stored
        got = client.get_many("n", [k for k, _ in second])
        found = [(g, b) for g, (_, b) in zip(got, second, strict=True) if g is not None]
        assert all(bytes(g) == b for g, b in found)
        assert got[3] is not None  # the buffered block: RAM made room for it
        for lease, (_, block) in zip(pinned, first, strict=True):  # the readers' views never changed
            assert bytes(lease.view) == block
        server.stack.ram.release([lease.id for lease in pinned])
    stats = server.stack.ram.arena_stats()
    assert (stats["leases"], stats["reservations"]) == (0, 0)


def test_leased_and_get_into_use_the_bulk_port_off_the_servers_host(make_server) -> None:
    """leased() and get_into() (what the connectors read with) go in place on the server's host and
    over the bulk port elsewhere; before, off the host they fell back to a plain gRPC Get."""
    server = bulk_server(make_server)
    items = blocks(2, 4 << 20)
    keys = [k for k, _ in items]
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        with client.leased("n", keys) as got:
            assert [bytes(g) for g in got] == [b for _, b in items]
        nbytes = sum(len(b) for _, b in items)
        assert (client.bulk.counters.bulk_bytes_received, client.bulk.counters.grpc_bytes_received) == (nbytes, 0)
        destinations = [bytearray(len(payload_view(b))) for _, b in items]
        assert client.get_into("n", keys, destinations) == [True, True]
        assert [bytes(d) for d in destinations] == [bytes(payload_view(b)) for _, b in items]
        assert client.bulk.counters.bulk_bytes_received == 2 * nbytes


def test_bulk_is_reconsidered_when_shared_memory_turns_off(make_server) -> None:
    """A server whose shm directory exists on this host turns shared memory on, so bulk off; when
    shared memory then turns off (the directory was not the server's: its first segment call fails),
    the bulk path is asked for again instead of staying off for the client's life."""
    server = bulk_server(make_server, shm={"enabled": True, "share_arena": False})
    items = blocks(2, 2 << 20)
    with KVCacheClient(server.target, timeout_s=10) as client:
        assert client.put_many("n", items).stored == 2
        assert client._transport.shm.on and client.bulk.state == "off"
        client._transport.shm.off("not this server's directory (simulated)")
        got = client.get_many("n", [k for k, _ in items])
        assert [bytes(g) for g in got] == [b for _, b in items]
        assert client.bulk.state == "on"
        assert client.bulk.counters.bulk_bytes_received == sum(len(b) for _, b in items)


def never_runs_once(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """The first coroutine called `name` that a bulk session sends to the event loop never runs: it
    is closed and its future comes back cancelled, as a task cancelled before its first step. The
    list names the coroutines dropped."""
    from concurrent.futures import Future

    import kvcache_server.bulk.session as session

    real = session.asyncio.run_coroutine_threadsafe
    dropped: list[str] = []

    def never_runs(coro, loop):  # type: ignore[no-untyped-def]
        if coro.__name__ == name and not dropped:
            dropped.append(coro.__name__)
            coro.close()
            future: Future = Future()
            future.cancel()
            return future
        return real(coro, loop)

    monkeypatch.setattr(session.asyncio, "run_coroutine_threadsafe", never_runs)
    return dropped


def loop_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bulk PUT committed on the event loop, as on a stack with a tier below RAM or an event
    subscriber (TierStack.commits_off_loop): for tests of the loop's side of a commit."""
    from kvcache_server.stack import TierStack

    monkeypatch.setattr(TierStack, "commits_off_loop", property(lambda self: False))


def test_a_commit_the_loop_never_starts_frees_its_slots(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PUT whose commit is given up on before the event loop ran it (here: its future comes back
    cancelled, as a task cancelled before its first step) abandons the arena slots it received into:
    reservations never expire, and on the old code they stayed open for good. The put fails INTERNAL."""
    import kvcache_server.bulk.session as session

    server = bulk_server(make_server)
    loop_commits(monkeypatch)
    dropped = never_runs_once(monkeypatch, "_then_release")
    data = blocks(4, session._STAGED_PUT_BYTES // 2)  # over it: its blocks land in their slots
    client = KVCacheClient(server.target, shm=False, bulk_connections=1)
    with client, pytest.raises(RPCError, match="INTERNAL"):
        client.put_many("ns", data)
    assert dropped == ["_then_release"]
    ram = server.stack.ram
    wait_for(lambda: not ram._reservations, timeout_s=5, what="the given-up commit's slots freed")
