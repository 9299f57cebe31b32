"""Fair shares between tenants, against real servers: admission caps, subscriber shares, per-subscriber
event sequences, and metrics that name no tenant to an unauthenticated scrape."""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvcache_client import KVCacheClient
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import token_digest
from tests.backends import wait_for
from tests.conftest import ServerThread, raw_block

GLOBAL_LIMIT, TENANT_LIMIT = "server.max_concurrent_rpcs", "server.tenant_max_concurrent_rpcs"
TOKENS = {"acme": "kvc_token_acme_rw", "globex": "kvc_token_globex_rw", "ops": "kvc_token_ops_admin"}


def tokens_file(tmp: Path) -> Path:
    text = ""
    for name, token in TOKENS.items():
        rights = '["admin"]' if name == "ops" else '["read", "write"]'
        text += f'[[tokens]]\nname = "{name}"\ntenant = "{name}"\nsha256 = "{token_digest(token).hex()}"\n'
        text += f"rights = {rights}\n\n"
    path = tmp / "tokens.toml"
    path.write_text(text)
    return path


def md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


class IdlePuts:
    """Put streams that send nothing until released: each holds its call open."""

    def __init__(self, stub: pb_grpc.KVCacheStub, metadata: tuple = ()) -> None:
        self._stub = stub
        self._metadata = metadata
        self._release = threading.Event()
        self.calls: list[grpc.Future] = []

    def _nothing(self) -> Iterator[pb.PutRequest]:
        self._release.wait(60)
        yield from ()

    def open(self, n: int) -> tuple[list[grpc.Future], list[grpc.Future]]:
        """Opens n streams; returns (admitted, refused). A call is admitted once the server sent its
        request id in the initial metadata; a refused one ends with no initial metadata."""
        calls = [self._stub.Put.future(self._nothing(), metadata=self._metadata, timeout=60) for _ in range(n)]
        self.calls += calls
        admitted = [c for c in calls if any(k == "x-request-id" for k, _ in c.initial_metadata() or ())]
        return admitted, [c for c in calls if c not in admitted]

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self._release.set()


def admitted_watch(stub: pb_grpc.KVCacheStub, metadata: tuple = (), namespace: str = ""):
    return stub.WatchEvents(pb.WatchEventsRequest(namespace=namespace), metadata=metadata, timeout=60)


@pytest.mark.timeout(90)
def test_a_greedy_tenant_cannot_take_the_server(make_server, tmp_path: Path) -> None:
    # 8 calls in all: a tenant's default share is a quarter, 2; of 4 subscribers, 1.
    server: ServerThread = make_server(
        server={"max_concurrent_rpcs": 8},
        events={"max_subscribers": 4},
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
    )
    hub = server.stack.events
    greedy_channel, other_channel = grpc.insecure_channel(server.target), grpc.insecure_channel(server.target)
    greedy, other = pb_grpc.KVCacheStub(greedy_channel), pb_grpc.KVCacheStub(other_channel)
    puts = IdlePuts(greedy, md("acme"))
    watches = []
    try:
        # The greedy tenant subscribes, then opens as many idle Put streams as the whole server allows.
        watches.append(admitted_watch(greedy, md("acme")))
        wait_for(lambda: hub.subscribers == 1, what="acme's subscriber")
        admitted, refused = puts.open(8)

        # Everyone else is served: another tenant's Lookup, Put, Get and WatchEvents, health, Info.
        key = os.urandom(16)
        block = raw_block(key, b"globex's block")
        put = pb.PutRequest(namespace="n", blocks=[pb.Block(key=key, data=block)])
        assert other.Put(iter([put]), metadata=md("globex"), timeout=10).stored == 1
        lookup = other.Lookup(pb.LookupRequest(namespace="n", keys=[key]), metadata=md("globex"), timeout=10)
        assert lookup.prefix_length == 1
        got = list(other.Get(pb.GetRequest(namespace="n", keys=[key]), metadata=md("globex"), timeout=10))
        assert [item.data for reply in got for item in reply.items] == [block]
        watches.append(admitted_watch(other, md("globex")))
        wait_for(lambda: hub.subscribers == 2, what="globex's subscriber")
        check = health_pb2_grpc.HealthStub(greedy_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert greedy.Info(pb.InfoRequest(), metadata=md("acme"), timeout=10).max_block_bytes > 0

        # The greedy tenant got its share and no more: its subscription and one Put stream.
        assert (len(admitted), len(refused)) == (1, 7)
        for call in refused:
            assert call.exception().code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert TENANT_LIMIT in call.exception().details() and "'acme'" in call.exception().details()
        code, details = code_of(lambda: greedy.Lookup(pb.LookupRequest(namespace="n", keys=[key]), metadata=md("acme")))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and TENANT_LIMIT in details
        admission = server.running.admission
        assert (admission.active, admission.tenants) == (3, {"acme": 2, "globex": 1})
        assert (hub.tenant_subscribers("acme"), hub.tenant_subscribers("globex")) == (1, 1)
        assert admission.refused == {GLOBAL_LIMIT: 0, TENANT_LIMIT: 8}

        # With a call slot free again, a second subscription is over acme's subscriber share.
        puts.close()
        wait_for(lambda: admission.tenant_active("acme") == 1, what="cancelled Puts released")
        code, details = code_of(lambda: next(admitted_watch(greedy, md("acme"))))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "events.tenant_max_subscribers" in details
    finally:
        puts.close()
        for watch in watches:
            watch.cancel()
    # However the calls ended (cancelled, refused), every count is back to zero.
    wait_for(lambda: admission.active == 0 and hub.subscribers == 0, what="all calls released")
    assert (admission.active, admission.tenants, hub.subscribers) == (0, {}, 0)
    assert (hub.tenant_subscribers("acme"), hub.tenant_subscribers("globex"), hub.refused_subscribers) == (0, 0, 1)
    greedy_channel.close()
    other_channel.close()


@pytest.mark.timeout(60)
def test_health_info_and_reflection_answer_when_the_server_is_full(make_server) -> None:
    server: ServerThread = make_server(server={"max_concurrent_rpcs": 2})  # no auth: the global cap alone
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        puts = IdlePuts(stub)
        try:
            admitted, refused = puts.open(2)
            assert (len(admitted), len(refused)) == (2, 0)
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == serving
            watch.cancel()
            assert stub.Info(pb.InfoRequest(), timeout=10).max_block_bytes > 0
            listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            names = {s.name for s in next(listed).list_services_response.service}
            assert "kvcache.v1.KVCache" in names
            code, details = code_of(lambda: stub.Lookup(pb.LookupRequest(namespace="n", keys=[os.urandom(16)])))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and GLOBAL_LIMIT in details
            admission = server.running.admission
            assert (admission.active, admission.tenants) == (2, {})  # health, Info, reflection not counted
        finally:
            puts.close()
        wait_for(lambda: admission.active == 0, what="cancelled Puts released")
        assert admission.refused == {GLOBAL_LIMIT: 1, TENANT_LIMIT: 0}
        assert stub.Lookup(pb.LookupRequest(namespace="n", keys=[os.urandom(16)]), timeout=10).prefix_length == 0


@pytest.mark.timeout(120)
def test_cancelled_calls_give_their_slots_back(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(
        server={"max_concurrent_rpcs": 8},  # acme's share: 2 calls
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
        shm={"enabled": False},
        ram={"capacity_bytes": 256 << 20},
    )
    admission, hub = server.running.admission, server.stack.events
    keys = [os.urandom(16) for _ in range(4)]
    with KVCacheClient(server.target, token=TOKENS["acme"]) as client:
        assert client.put_many("n", [(k, raw_block(k, os.urandom(4 << 20))) for k in keys]).stored == 4
    get = pb.GetRequest(namespace="n", keys=keys)
    with grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        outcomes: dict[grpc.StatusCode, int] = {}
        for _ in range(20):
            puts = IdlePuts(stub, md("acme"))
            watch = admitted_watch(stub, md("acme"))
            wait_for(lambda: hub.subscribers == 1, what="subscriber")
            admitted, _ = puts.open(1)
            assert len(admitted) == 1  # the whole share is held: a subscription and a Put stream
            watch.cancel()
            puts.close()
            wait_for(lambda: admission.active == 0 and hub.subscribers == 0, what="slots released")
            # A Get cut short by its deadline, on the server or before it began.
            code, _ = code_of(lambda: list(stub.Get(get, metadata=md("acme"), timeout=0.005)))
            outcomes[code] = outcomes.get(code, 0) + 1
            wait_for(lambda: admission.active == 0 and hub.subscribers == 0, what="slots released")
        assert set(outcomes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
        assert sum(outcomes.values()) == 20
        assert (admission.active, admission.tenants, hub.subscribers, hub.tenant_subscribers("acme")) == (0, {}, 0, 0)
        assert admission.refused == {GLOBAL_LIMIT: 0, TENANT_LIMIT: 0}
        # The share is intact: exactly 2 calls again, the third refused.
        puts = IdlePuts(stub, md("acme"))
        try:
            admitted, refused = puts.open(3)
            assert (len(admitted), len(refused)) == (2, 1)
        finally:
            puts.close()
        wait_for(lambda: admission.active == 0, what="slots released")
        assert (admission.active, admission.tenants, admission.refused[TENANT_LIMIT]) == (0, {}, 1)


class Watcher:
    """Reads a WatchEvents stream in a thread."""

    def __init__(self, channel: grpc.Channel, tenant: str, namespace: str = "") -> None:
        self.stream = admitted_watch(pb_grpc.KVCacheStub(channel), md(tenant), namespace)
        self.events: list[pb.KVEvent] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.stream:
                self.events.append(event)
        except grpc.RpcError as exc:
            self.error = exc


@pytest.mark.timeout(90)
def test_every_subscriber_numbers_its_own_events_from_1(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))})
    n = 40
    with grpc.insecure_channel(server.target) as channel:
        acme_all, acme_x, globex_all = (
            Watcher(channel, "acme"),
            Watcher(channel, "acme", "x"),
            Watcher(channel, "globex"),
        )
        wait_for(lambda: server.stack.events.subscribers == 3, what="subscribers")
        written: dict[str, list[tuple[str, bytes]]] = {"acme": [], "globex": []}

        def write(tenant: str, namespaces: tuple[str, ...]) -> None:
            with KVCacheClient(server.target, token=TOKENS[tenant]) as client:
                for _ in range(n):
                    for namespace in namespaces:  # one put of one block: one STORED event
                        key = os.urandom(16)
                        assert client.put_many(namespace, [(key, raw_block(key, b"v"))]).stored == 1
                        written[tenant].append((namespace, key))

        writers = [
            threading.Thread(target=write, args=("acme", ("x", "y"))),
            threading.Thread(target=write, args=("globex", ("x",))),
        ]
        for w in writers:
            w.start()
        for w in writers:
            w.join(60)
        expected = {"acme_all": 2 * n, "acme_x": n, "globex_all": n}
        watchers = {"acme_all": acme_all, "acme_x": acme_x, "globex_all": globex_all}
        wait_for(lambda: all(len(watchers[w].events) >= count for w, count in expected.items()), what="all events")
        for watcher in watchers.values():
            watcher.stream.cancel()
            watcher.thread.join(10)
        for name, watcher in watchers.items():
            assert [e.sequence for e in watcher.events] == list(range(1, expected[name] + 1)), name
        assert [(e.namespace, e.keys[0]) for e in acme_all.events] == written["acme"]
        assert [(e.namespace, e.keys[0]) for e in acme_x.events] == [w for w in written["acme"] if w[0] == "x"]
        assert [(e.namespace, e.keys[0]) for e in globex_all.events] == written["globex"]


def scrape(port: int, token: str | None = None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(request, timeout=10).read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.timeout(60)
def test_an_unauthenticated_scrape_names_no_tenant(make_server, tmp_path: Path) -> None:
    server: ServerThread = make_server(
        metrics={"enabled": True, "port": 0}, auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))}
    )
    port = server.running.metrics_port
    for tenant, asked in (("acme", 3), ("globex", 5)):
        with KVCacheClient(server.target, token=TOKENS[tenant]) as client:
            assert client.lookup(f"{tenant}-model", [os.urandom(16) for _ in range(asked)]).prefix_length == 0
    public = scrape(port)
    for secret in ("acme", "globex", "-model", ":"):
        assert secret not in "\n".join(line for line in public.splitlines() if not line.startswith("#")), secret
    found = samples(public)
    assert found[("kvcache_namespace_lookup_keys_total", (("namespace", "_all"),))] == 8
    assert found[("kvcache_namespace_lookup_hit_keys_total", (("namespace", "_all"),))] == 0
    assert found[("kvcache_rpcs_in_flight", ())] == 0
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_virtual_memory_bytes"):
        assert found[(name, ())] > 0, name
    assert ("process_cpu_seconds_total", ()) in found
    # An admin token sees namespaces as the tiers store them; other tokens are refused.
    full = samples(scrape(port, TOKENS["ops"]))
    assert full[("process_open_fds", ())] > 0
    assert full[("kvcache_namespace_lookup_keys_total", (("namespace", "acme:acme-model"),))] == 3
    assert full[("kvcache_namespace_lookup_keys_total", (("namespace", "globex:globex-model"),))] == 5
    for token, status in ((TOKENS["acme"], 403), ("not-a-token", 401)):
        with pytest.raises(urllib.error.HTTPError) as info:
            scrape(port, token)
        assert info.value.code == status
