"""The bulk port cannot be held by slow or unauthenticated clients (docs/bulk.md#deadlines-and-shares):
per-request deadlines, HELLO's deadline, a cap on unauthenticated connections and per-tenant shares.

Real servers on free ports; the slow clients are raw sockets trickling real frames (and a real TLS
ClientHello) beside a legitimate SDK client that must keep working.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvcache_client import KVCacheClient, ResourceExhausted
from kvcache_core import bulkwire as bw
from kvcache_server.auth import token_digest
from kvcache_server.config import ConfigError, load_config
from tests.backends import make_certs, wait_for
from tests.conftest import ServerThread
from tests.test_bulk import Raw, blocks, bulk_server, counters, settled

pytestmark = pytest.mark.timeout(90)

TOKEN_A, TOKEN_B = "kvc_tenant_a_token", "kvc_tenant_b_token"


def two_tenants(tmp: Path) -> dict:
    """Auth on, tenants "a" and "b", each with one read-write token."""
    path = tmp / "tokens.toml"
    path.write_text(
        "".join(
            f'[[tokens]]\nname = "{tenant}"\ntenant = "{tenant}"\nsha256 = "{token_digest(token).hex()}"\n'
            'rights = ["read", "write"]\n'
            for tenant, token in (("a", TOKEN_A), ("b", TOKEN_B))
        )
    )
    return {"auth": {"enabled": True, "tokens_file": str(path)}}


def within(check: Callable[[], bool], timeout_s: float) -> bool:
    """Whether `check` holds within timeout_s (polled); the caller asserts, with the figures it wants."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()


class Trickler(threading.Thread):
    """A slow client: sends each socket the next byte of its data every `period_s`, until the
    server answers it (it becomes readable: an ERROR, or the close), it fails, or stop()."""

    def __init__(self, feeds: list[tuple[socket.socket, bytes]], period_s: float) -> None:
        super().__init__(daemon=True)
        self._feeds = feeds
        self._period_s = period_s
        self._stopped = threading.Event()
        self.sent = [0] * len(feeds)

    def run(self) -> None:
        active = set(range(len(self._feeds)))
        while active and not self._stopped.wait(self._period_s):
            for i in sorted(active):
                sock, data = self._feeds[i]
                try:
                    answered = select.select([sock], [], [], 0)[0]
                    if answered or self.sent[i] == len(data):
                        active.discard(i)
                        continue
                    sock.send(data[self.sent[i] : self.sent[i] + 1])
                    self.sent[i] += 1
                except (OSError, ValueError):  # reset, or closed by the test
                    active.discard(i)

    def stop(self) -> None:
        self._stopped.set()
        self.join(5)


def cut_offs(server: ServerThread, kind: str) -> int:
    return counters(server).get(f"cut_off_{kind}", 0)


def scrape(server: ServerThread, metric: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.running.metrics_port}/metrics", timeout=5).read()
    values = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if not line.startswith("#"))
    return float(values[metric])


def test_trickled_puts_are_cut_off_and_release_the_budget_for_another_tenant(make_server, tmp_path: Path) -> None:
    """#23: two PUTs announcing 64 MiB each, fed a byte every 0.7 s, held 128 of 160 MiB of the
    in-flight budget for good (the stall timeout is per recv) and another tenant's 40 MiB PUT got
    RESOURCE_EXHAUSTED. The rate rule cuts them once min_rate_grace_s has passed."""
    server = bulk_server(
        make_server,
        **two_tenants(tmp_path),
        limits={"inflight_bytes": 160 << 20, "admission_wait_s": 0.5},
        bulk={"min_rate_grace_s": 2.0},  # stall_timeout_s stays 10 s: each byte arrives well inside it
        metrics={"enabled": True, "port": 0},
    )
    budget = server.running.bulk._budget
    raws = []
    for _ in range(2):
        raw = Raw(server)
        raw.hello(TOKEN_A)
        raw.send(bw.FrameType.PUT, bw.put("n", [(os.urandom(16), 64 << 20)]))
        raw.send(bw.FrameType.DATA, b"", length=64 << 20)
        raws.append(raw)
    wait_for(lambda: budget.peak >= 128 << 20, 10, "both trickled PUTs to reserve their 64 MiB")
    trickler = Trickler([(raw.sock, bytes(1000)) for raw in raws], 0.7)
    trickler.start()
    start = time.monotonic()
    within(lambda: counters(server)["cut_off"] == 2 and budget.used == 0, 15)
    open_s, held = time.monotonic() - start, budget.used
    trickler.stop()
    items = blocks(10, 4 << 20)  # 40 MiB: more than the 32 MiB the trickled PUTs left
    with KVCacheClient(server.target, token=TOKEN_B, timeout_s=20, bulk_connections=1) as other:
        try:
            outcome = f"stored {other.put_many('n', items).stored}"
        except ResourceExhausted as exc:
            outcome = f"RESOURCE_EXHAUSTED: {exc.details}"
        fallbacks = other.bulk.counters.fallbacks
    assert (counters(server)["cut_off"], held, outcome, fallbacks) == (2, 0, "stored 10", 0), f"after {open_s:.1f} s"
    assert cut_offs(server, "rate") == 2 and min(trickler.sent) >= 1
    for raw in raws:
        code, message = raw.error()
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "under bulk.min_rate_bytes_s=1048576" in message and "cut off" in message, message
        assert raw.closed()
        raw.close()
    settled(server, cut_off=2, puts=1)
    assert server.running.bulk.sink.abandoned == 2
    assert scrape(server, "kvcache_bulk_cut_off_total") == 2


def test_a_put_that_keeps_moving_is_cut_at_request_timeout(make_server) -> None:
    """A PUT that moves a little all the time (a KiB every 0.2 s: no stall, no rate rule here) is cut
    when bulk.request_timeout_s has passed, counted over the whole request."""
    server = bulk_server(make_server, bulk={"min_rate_bytes_s": 0, "request_timeout_s": 1.5})
    ((key, block),) = blocks(1, 1 << 20)
    raw = Raw(server)
    raw.hello()
    raw.send(bw.FrameType.PUT, bw.put("n", [(key, len(block))]))
    raw.send(bw.FrameType.DATA, b"", length=len(block))
    stop = threading.Event()

    def feed() -> None:
        for at in range(0, len(block), 1024):
            if stop.wait(0.2) or select.select([raw.sock], [], [], 0)[0]:
                return
            raw.sock.sendall(block[at : at + 1024])

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    start = time.monotonic()
    within(lambda: counters(server)["cut_off"] == 1, 10)
    open_s = time.monotonic() - start
    stop.set()
    feeder.join(5)
    assert (counters(server)["cut_off"], cut_offs(server, "request")) == (1, 1), f"still open after {open_s:.1f} s"
    code, message = raw.error()
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and "bulk.request_timeout_s=1.5 s" in message, message
    raw.close()
    settled(server, cut_off=1, puts=0)
    assert server.running.bulk.sink.abandoned == 1
    assert server.call(server.stack.ram.contains_many("n", [key])) == [False]


def test_a_get_whose_client_reads_slowly_is_cut_off(make_server) -> None:
    """A GET whose client reads, but slowly (16 KiB every 0.1 s, each send well inside
    stall_timeout_s), is cut by the rate rule on the send side: its leases and budget are released."""
    server = bulk_server(make_server, bulk={"min_rate_bytes_s": 4 << 20, "min_rate_grace_s": 1.0})
    items = blocks(6, 8 << 20)
    with KVCacheClient(server.target, timeout_s=20) as client:
        assert client.put_many("n", items).stored == 6
    raw = Raw(server)
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    raw.hello()
    raw.send(bw.FrameType.GET, bw.get("n", [k for k, _ in items], False))
    stop = threading.Event()
    read = [0]

    def slow_reader() -> None:
        raw.sock.settimeout(1.0)
        while not stop.wait(0.1):
            try:
                n = len(raw.sock.recv(16 << 10))
            except TimeoutError:
                continue
            except OSError:
                return
            if n == 0:
                return
            read[0] += n

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    start = time.monotonic()
    within(lambda: counters(server)["cut_off"] == 1, 15)
    open_s, sent = time.monotonic() - start, counters(server)["bytes_sent"]
    stop.set()
    reader.join(5)
    raw.close()
    assert (counters(server)["cut_off"], cut_offs(server, "rate")) == (1, 1), (
        f"still sending after {open_s:.1f} s ({sent} bytes sent, {read[0]} read)"
    )
    assert read[0] > 0 and sent < sum(len(b) for _, b in items)
    settled(server, cut_off=1, gets=0)
    assert server.stack.ram.arena_stats()["leases"] == 0


def client_hello() -> bytes:
    """The first flight of a real TLS client (its ClientHello), made without a socket."""
    context = ssl.create_default_context()
    outgoing = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("transport", ["plaintext", "tls"])
def test_hello_must_arrive_whole_within_hello_timeout(make_server, tmp_path: Path, transport: str) -> None:
    """A HELLO (or, on a TLS port, the TLS handshake before it) sent a byte every 0.3 s is cut at
    bulk.hello_timeout_s, not kept for as long as each byte comes within the stall timeout."""
    extra: dict = {}
    if transport == "tls":
        certs = make_certs(tmp_path)
        extra["tls"] = {"cert_file": str(certs["server.crt"]), "key_file": str(certs["server.key"])}
    server = bulk_server(make_server, bulk={"hello_timeout_s": 1.0, "stall_timeout_s": 30.0}, **extra)
    payload = bw.hello("t" * 100)  # auth is off: the token is ignored, and the HELLO takes 36 s to trickle
    data = client_hello() if transport == "tls" else bw.header(bw.FrameType.HELLO, len(payload)) + payload
    raw = Raw(server)
    trickler = Trickler([(raw.sock, data)], 0.3)
    trickler.start()
    start = time.monotonic()
    within(lambda: counters(server)["cut_off"] == 1, 8)
    open_s = time.monotonic() - start
    trickler.stop()
    assert (counters(server)["cut_off"], cut_offs(server, "hello")) == (1, 1), (
        f"still open after {open_s:.1f} s, {trickler.sent[0]} of {len(data)} bytes sent"
    )
    assert trickler.sent[0] < len(data)
    if transport == "plaintext":
        code, message = raw.error()
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "HELLO took more than bulk.hello_timeout_s=1 s" in message, message
    assert raw.closed()  # a TLS peer just sees the close: it has no session to read an ERROR on
    raw.close()
    settled(server, cut_off=1)
    assert server.running.bulk.admission.unauthenticated == 0


def test_slowloris_hellos_cannot_lock_out_a_legitimate_client(make_server) -> None:
    """#23: 16 sockets sending HELLO a byte every 0.8 s took all 16 max_connections and a legitimate
    client was refused. Connections before their HELLO have their own cap, and when it is full the
    oldest of them is evicted: the legitimate client gets in (hello_timeout_s is long here, so it is
    the cap and the eviction alone that protect it)."""
    server = bulk_server(
        make_server, bulk={"max_connections": 16, "max_unauthenticated_connections": 4, "hello_timeout_s": 30.0}
    )
    payload = bw.hello("")
    hello = bw.header(bw.FrameType.HELLO, len(payload)) + payload
    slow = [Raw(server) for _ in range(16)]
    trickler = Trickler([(raw.sock, hello) for raw in slow], 0.8)
    trickler.start()
    wait_for(
        lambda: counters(server)["accepted"] + counters(server)["refused_connections"] == 16,
        10,
        f"the server to see all 16 slow sockets ({counters(server)})",
    )
    items = blocks(2, 1 << 20)
    with KVCacheClient(server.target, timeout_s=10, bulk_connections=1) as client:
        result = client.put_many("n", items)
        c = client.bulk.counters
        legit = (result.stored, c.fallbacks, client.bulk.state, client.bulk.reason)
        assert legit == (2, 0, "on", ""), f"{counters(server)}"
        assert c.bulk_bytes_sent == sum(len(b) for _, b in items)
        admission = server.running.bulk.admission
        # 12 slow sockets evicted by the 4 after them, one more by the client's connection.
        assert (admission.unauthenticated, admission.authenticated, admission.evicted) == (3, 1, 13)
        assert admission.refused == {"bulk.max_connections": 0, "bulk.tenant_max_connections": 0}
    trickler.stop()
    evicted = 0
    for raw in slow:
        if not select.select([raw.sock], [], [], 0.2)[0]:  # one of the 3 still waiting: closed mid-HELLO below
            continue
        code, message = raw.error()
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, message
        assert "evicted before its HELLO was done: bulk.max_unauthenticated_connections=4" in message
        evicted += 1
    for raw in slow:
        raw.close()
    assert evicted == 13
    settled(server, evicted=13, accepted=17, refused_connections=0, puts=1)
    assert (admission.unauthenticated, admission.authenticated) == (0, 0)


def test_one_tenant_cannot_hold_every_bulk_connection(make_server, tmp_path: Path) -> None:
    """#23: one tenant could hold every bulk connection. With auth, each tenant's authenticated
    connections are capped at its share (a quarter of max_connections by default, as gRPC calls),
    so the other tenant's client still moves its bytes over the bulk port."""
    server = bulk_server(make_server, **two_tenants(tmp_path), bulk={"max_connections": 8})
    greedy, answers = [], []
    for _ in range(8):
        raw = Raw(server)
        raw.send(bw.FrameType.HELLO, bw.hello(TOKEN_A))
        kind, payload = raw.read()
        answers.append(kind.name if kind is bw.FrameType.READY else bw.parse_error(payload)[1])
        greedy.append(raw)
    items = blocks(2, 1 << 20)
    # One connection per client: two lanes of one put may run on one connection or on two.
    with KVCacheClient(server.target, token=TOKEN_B, timeout_s=10, bulk_connections=1) as other:
        assert other.put_many("n", items).stored == 2
        other_fallbacks = other.bulk.counters.fallbacks
        assert (answers.count("READY"), other_fallbacks) == (2, 0), answers
        refusal = (
            "tenant 'a' holds its share of 2 bulk connections (bulk.tenant_max_connections); retry when one closes"
        )
        assert answers[2:] == [refusal] * 6
        assert server.running.bulk.admission.tenants() == {"a": 2, "b": 1}
        # Tenant a's own SDK client is told why, and its bytes take gRPC.
        with KVCacheClient(server.target, token=TOKEN_A, timeout_s=10, bulk_connections=1) as same:
            assert same.put_many("n", items).stored == 2
            assert same.bulk.counters.fallbacks == 1 and "bulk.tenant_max_connections" in same.bulk.reason
    for raw in greedy:
        raw.close()
    settled(server, refused_connections=7, puts=1)  # 6 raw HELLOs and tenant a's SDK connection
    assert server.running.bulk.admission.tenants() == {}


def test_bulk_deadline_and_connection_settings() -> None:
    bulk = load_config(env={}).bulk
    assert (bulk.hello_timeout_s, bulk.min_rate_bytes_s, bulk.min_rate_grace_s, bulk.request_timeout_s) == (
        5.0,
        1 << 20,
        5.0,
        120.0,
    )
    assert (bulk.max_unauthenticated_connections, bulk.tenant_share) == (16, 16)
    assert load_config(env={"KVCACHE_BULK_TENANT_MAX_CONNECTIONS": "3"}).bulk.tenant_share == 3
    for env, message in (
        ({"KVCACHE_BULK_HELLO_TIMEOUT_S": "0"}, r"bulk\.hello_timeout_s must be positive"),
        ({"KVCACHE_BULK_MIN_RATE_GRACE_S": "0"}, r"bulk\.min_rate_grace_s must be positive"),
        ({"KVCACHE_BULK_REQUEST_TIMEOUT_S": "-1"}, r"bulk\.request_timeout_s must be positive"),
        ({"KVCACHE_BULK_MIN_RATE_BYTES_S": "-1"}, r"bulk\.min_rate_bytes_s must not be negative"),
        ({"KVCACHE_BULK_MAX_UNAUTHENTICATED_CONNECTIONS": "0"}, r"max_unauthenticated_connections must be positive"),
        ({"KVCACHE_BULK_TENANT_MAX_CONNECTIONS": "65"}, r"tenant_max_connections must be in \[0, bulk\.max_conn"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(env=env)
