"""Metrics, health, KV events and request ids, against real servers."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvcache_client import InvalidRequest, KVCacheClient
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.interceptor import RequestIdFilter
from kvcache_server.tiers.ram import RamTier
from tests.backends import RedisProcess, free_port, wait_for
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "obs"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_by_the_right_amounts(make_server) -> None:
    server: ServerThread = make_server(metrics={"enabled": True, "port": 0})
    port = server.running.metrics_port
    assert port > 0
    keys = [os.urandom(16) for _ in range(5)]
    blocks = [raw_block(k, os.urandom(1000 + i)) for i, k in enumerate(keys)]
    before = scrape(port)
    # Every call an RPC (the presence index would answer the Lookup on this host without one, and the
    # bulk port would carry it as a LOOKUP frame, counted in kvcache_bulk_requests: bulk=False).
    with KVCacheClient(server.target, presence_index=False, bulk=False) as client:
        client.put_many(NS, list(zip(keys, blocks, strict=True)))
        assert client.lookup(NS, [*keys, os.urandom(16), keys[0]]).prefix_length == 5
        got = client.get_many(NS, [*keys, os.urandom(16)])
        assert sum(g is not None for g in got) == 5
        assert client.delete(NS, keys[:2]) == 2
        with pytest.raises(InvalidRequest):
            client.lookup(NS, [b"short"])
    # An aborted call's status reaches the client before the server's interceptor records it.
    wait_for(
        lambda: (
            metric(scrape(port), "kvcache_requests_total", method="Lookup", code="INVALID_ARGUMENT")
            > metric(before, "kvcache_requests_total", method="Lookup", code="INVALID_ARGUMENT")
        ),
        timeout_s=5,
        what="the refused call's metric",
    )
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    for method in ("Put", "Lookup", "Get", "Delete"):
        assert delta("kvcache_requests_total", method=method, code="OK") == 1, method
    assert delta("kvcache_requests_total", method="Lookup", code="INVALID_ARGUMENT") == 1
    assert delta("kvcache_tier_puts_total", tier="ram") == 5
    assert delta("kvcache_tier_hits_total", tier="ram") == 5
    assert delta("kvcache_tier_misses_total", tier="ram") == 1
    assert delta("kvcache_tier_read_bytes_total", tier="ram") == sum(len(b) for b in blocks)
    assert delta("kvcache_tier_written_bytes_total", tier="ram") == sum(len(b) for b in blocks)
    assert metric(after, "kvcache_tier_blocks", tier="ram") == 3
    ram = server.stack.ram.stats()
    assert metric(after, "kvcache_tier_used_bytes", tier="ram") == ram.used_bytes
    assert metric(after, "kvcache_tier_capacity_bytes", tier="ram") == ram.capacity_bytes
    assert delta("kvcache_lookup_hit_chunks_count") == 1 and delta("kvcache_lookup_hit_chunks_sum") == 5
    # Hit ratio per namespace is derivable: hit keys / keys asked.
    assert delta("kvcache_namespace_lookup_keys_total", namespace=NS) == 7
    assert delta("kvcache_namespace_lookup_hit_keys_total", namespace=NS) == 5
    assert delta("kvcache_tier_operation_duration_seconds_count", tier="ram", op="get", ok="true") == 1
    assert delta("kvcache_request_duration_seconds_count", method="Put") == 1
    # The client is on the server's host: its get's hits were read in place from the block arena (the
    # one miss asked Get, through a segment, which sent nothing); its small put went inline.
    assert delta("kvcache_inplace_bytes_total", direction="sent") == sum(len(b) for b in blocks)
    # Every lease of those reads was handed back; nothing is being written in place.
    assert (metric(after, "kvcache_arena_leases"), metric(after, "kvcache_arena_reservations")) == (0, 0)
    assert 0 < metric(after, "kvcache_arena_free_bytes") <= ram.capacity_bytes
    assert delta("kvcache_shm_bytes_total", direction="sent") == 0
    assert delta("kvcache_shm_bytes_total", direction="received") == 0
    # The process's own metrics, and admission's.
    for name in ("process_resident_memory_bytes", "process_open_fds", "process_start_time_seconds"):
        assert metric(after, name) > 0, name
    assert ("process_cpu_seconds_total", ()) in after
    assert metric(after, "kvcache_rpcs_in_flight") == 0


def test_metrics_cover_lower_tiers(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(
        metrics={"enabled": True, "port": 0},
        redis={"enabled": True, "url": redis_server.url, "timeout_s": 3.0, "breaker_failures": 1},
    )
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [keyed(b"x" * 100)])
        redis_server.kill()
        client.put_many(NS, [keyed(b"y" * 100)])
    samples = scrape(server.running.metrics_port)
    assert metric(samples, "kvcache_tier_puts_total", tier="redis") == 1
    assert metric(samples, "kvcache_tier_errors_total", tier="redis") >= 1
    assert metric(samples, "kvcache_tier_breaker_state", tier="redis") == 1
    assert metric(samples, "kvcache_tier_healthy", tier="redis") == 0
    assert metric(samples, "kvcache_tier_operation_duration_seconds_count", tier="redis", op="put", ok="false") >= 1


def health_status(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_health_follows_a_required_tier(make_server, redis_server: RedisProcess) -> None:
    redis = {"enabled": True, "url": redis_server.url, "timeout_s": 0.3, "breaker_failures": 1, "breaker_reset_s": 0.1}
    server: ServerThread = make_server(redis=redis, health={"required_tiers": "redis", "check_interval_s": 0.1})
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    wait_for(lambda: health_status(server.target) == serving, what="SERVING")
    redis_server.kill()  # no traffic: the health probe notices
    wait_for(lambda: health_status(server.target) == not_serving, what="NOT_SERVING")
    with KVCacheClient(server.target) as client:  # still answers from RAM
        assert client.put_many(NS, [keyed(b"z")]).stored == 1
        assert not client.stats().tier("redis").healthy
    redis_server.start()
    wait_for(lambda: health_status(server.target) == serving, what="SERVING again")


def test_optional_tier_down_keeps_serving(make_server) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    server: ServerThread = make_server(
        redis={"enabled": True, "url": dead, "timeout_s": 0.2, "breaker_failures": 1},
        health={"check_interval_s": 0.1},
    )
    wait_for(lambda: not server.stack.healthy("redis"), what="breaker open")
    assert health_status(server.target) == health_pb2.HealthCheckResponse.SERVING


class Watcher:
    """Reads a WatchEvents stream in a thread into a queue."""

    def __init__(self, target: str, namespace: str = "", options: list | None = None) -> None:
        self.channel = grpc.insecure_channel(target, options=options or [])
        self.stream = pb_grpc.KVCacheStub(self.channel).WatchEvents(pb.WatchEventsRequest(namespace=namespace))
        self.events: queue.Queue[pb.KVEvent | grpc.RpcError] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for event in self.stream:
                self.events.put(event)
        except grpc.RpcError as exc:
            self.events.put(exc)

    def take(self, n: int) -> list[tuple[str, str, str, list[bytes]]]:
        out = []
        for _ in range(n):
            e = self.events.get(timeout=10)
            assert not isinstance(e, grpc.RpcError), e
            out.append((pb.KVEvent.Kind.Name(e.kind), pb.Tier.Name(e.tier), e.namespace, list(e.keys)))
        return out

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def test_events_report_exactly_the_stores_and_removals(make_server) -> None:
    cost = RamTier.entry_cost_of(100 + 48)  # a 100-byte payload block's arena slot plus index overhead
    server: ServerThread = make_server(ram={"capacity_bytes": 3 * cost})  # room for three such blocks
    everything = Watcher(server.target).start()
    only_b = Watcher(server.target, namespace="b").start()
    wait_for(lambda: server.stack.events.subscribers == 2, what="subscribers")
    k = [bytes([i]) * 16 for i in range(5)]
    with KVCacheClient(server.target) as client:
        client.put_many("a", [(k[0], raw_block(k[0], b"0" * 100)), (k[1], raw_block(k[1], b"1" * 100))])
        client.delete("a", [k[1], k[4]])  # k[4] was never stored: not reported
        client.put_many("b", [(k[2], raw_block(k[2], b"2" * 100)), (k[3], raw_block(k[3], b"3" * 100))])
        client.put_many("b", [(k[4], raw_block(k[4], b"4" * 100))])  # RAM holds 3: evicts the oldest, k[0] of "a"
    assert everything.take(5) == [
        ("STORED", "TIER_RAM", "a", [k[0], k[1]]),
        ("REMOVED", "TIER_RAM", "a", [k[1]]),
        ("STORED", "TIER_RAM", "b", [k[2], k[3]]),
        ("REMOVED", "TIER_RAM", "a", [k[0]]),
        ("STORED", "TIER_RAM", "b", [k[4]]),
    ]
    assert only_b.take(2) == [("STORED", "TIER_RAM", "b", [k[2], k[3]]), ("STORED", "TIER_RAM", "b", [k[4]])]
    assert everything.events.empty() and only_b.events.empty()
    everything.close()
    only_b.close()


def test_stalled_subscriber_is_dropped_and_never_slows_puts(make_server) -> None:
    server: ServerThread = make_server(events={"buffer_events": 10})
    # A subscriber that never reads; no BDP probing, so the HTTP/2 window stays small and fills up.
    stalled = Watcher(server.target, options=[("grpc.http2.bdp_probe", 0)])
    wait_for(lambda: server.stack.events.subscribers == 1, what="subscriber")
    with KVCacheClient(server.target) as client:
        for _ in range(300):  # each put: one event naming 400 keys (~7 KB on the wire)
            assert client.put_many("s", [keyed(b"") for _ in range(400)]).stored == 400
    wait_for(
        lambda: server.stack.events.subscribers == 0 or next(iter(server.stack.events._subscribers)).overflowed,
        what="overflow",
    )
    stalled.start()  # now read: whatever was in flight, then the status
    while True:
        item = stalled.events.get(timeout=20)
        if isinstance(item, grpc.RpcError):
            break
    assert item.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell more than 10 events behind" in item.details()
    wait_for(lambda: server.stack.events.dropped_subscribers == 1, what="drop counted")
    stalled.close()


def test_too_many_subscribers(make_server) -> None:
    server: ServerThread = make_server(events={"max_subscribers": 1})
    first = Watcher(server.target).start()
    wait_for(lambda: server.stack.events.subscribers == 1, what="subscriber")
    second = Watcher(server.target).start()
    err = second.events.get(timeout=10)
    assert isinstance(err, grpc.RpcError) and err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    first.close()
    second.close()


def test_request_ids_in_metadata_and_json_logs() -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcache_server",
            "--port",
            "0",
            "--log-json",
            "--set",
            "redis.enabled=true",
            "--set",
            f"redis.url={dead_redis}",
            "--set",
            "redis.timeout_s=0.2",
            "--set",
            "health.check_interval_s=60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        target = proc.stdout.readline().split(" on ")[1].split()[0]  # type: ignore[union-attr]
        with grpc.insecure_channel(target) as channel:
            call = pb_grpc.KVCacheStub(channel).Lookup.with_call(
                pb.LookupRequest(namespace=NS, keys=[os.urandom(16)]),
                metadata=(("x-request-id", "req-abc123"),),
                timeout=10,
            )
            _, rpc = call
            assert ("x-request-id", "req-abc123") in tuple(rpc.trailing_metadata())  # unary: with the answer
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=15)
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    failures = [r for r in records if "tier redis failed during lookup" in r["msg"]]
    assert failures and failures[0]["request_id"] == "req-abc123" and failures[0]["level"] == "warning"


@pytest.mark.timeout(60)
def test_a_get_past_its_deadline_logs_one_line(make_server, caplog: pytest.LogCaptureFixture) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 256 << 20}, shm={"enabled": False})
    keys = [os.urandom(16) for _ in range(6)]
    with KVCacheClient(server.target, shm=False) as client:  # 48 MiB: more than any flow-control window
        assert client.put_many(NS, [(k, raw_block(k, os.urandom(8 << 20))) for k in keys]).stored == 6
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())
    rid = "slow-reader-1"
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        call = stub.Get(pb.GetRequest(namespace=NS, keys=keys), timeout=2, metadata=(("x-request-id", rid),))
        assert next(call).items[0].found  # the handler runs; the client reads no further
        assert call.code() is grpc.StatusCode.DEADLINE_EXCEEDED  # the deadline ends the call mid-stream
        # Deadlines of a few ms: each call ends before its handler starts, mid-stream, or (rarely) complete.
        for i in range(10):
            with contextlib.suppress(grpc.RpcError):
                list(
                    stub.Get(
                        pb.GetRequest(namespace=NS, keys=keys),
                        timeout=0.005,
                        metadata=(("x-request-id", f"short-{i}"),),
                    )
                )
    server.stop()  # every handler is over, and gRPC's own handling of the calls with them

    def lines(request: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "request_id", None) == request or request in r.getMessage()]

    assert [(r.levelname, r.name) for r in lines(rid)] == [("INFO", "kvcache_server.interceptor")]
    assert lines(rid)[0].getMessage().startswith(f"Get (request {rid}) ended early: cancelled")
    for i in range(10):  # at most the one line each, never a traceback
        assert [(r.levelname, r.name) for r in lines(f"short-{i}")] in ([], [("INFO", "kvcache_server.interceptor")])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert "Traceback" not in caplog.text


@pytest.mark.timeout(60)
def test_a_failed_call_logs_one_line_with_its_request_id(make_server, caplog: pytest.LogCaptureFixture) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 16 << 20}, shm={"enabled": False})
    caplog.set_level(logging.DEBUG, logger="kvcache_server.interceptor")
    caplog.handler.addFilter(RequestIdFilter())
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        with pytest.raises(grpc.RpcError) as failed:  # a key of the wrong length: the caller's error
            stub.Lookup(pb.LookupRequest(namespace=NS, keys=[b"short"]), metadata=(("x-request-id", "bad-1"),))
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        stub.Lookup(pb.LookupRequest(namespace=NS, keys=[os.urandom(16)]), metadata=(("x-request-id", "good-1"),))
    server.stop()

    def lines(request: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if request in r.getMessage()]

    [bad] = lines("bad-1")
    assert (bad.levelname, bad.name, bad.request_id) == ("INFO", "kvcache_server.interceptor", "bad-1")
    assert "INVALID_ARGUMENT" in bad.getMessage()
    [good] = lines("good-1")  # at DEBUG, one line per call
    assert good.levelname == "DEBUG" and "Lookup (request good-1) OK" in good.getMessage()


def test_the_interceptor_wraps_each_method_once_and_echoes_request_ids(make_server) -> None:
    """Per-call work is only the call's own: a method's handler is wrapped on its first call and the
    wrapped handler reused (no class, closure or handler tuple built per call: a quarter of a
    Lookup's server CPU with the separate send of the request id, bench/bench_small_calls.py);
    unary calls echo the request id in their trailing metadata, streaming ones in their initial."""
    server = make_server()
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        for i in range(5):
            _, call = stub.Lookup.with_call(
                pb.LookupRequest(namespace="ns", keys=[os.urandom(16)]),
                metadata=(("x-request-id", f"lookup-{i}"),),
                timeout=10,
            )
            assert ("x-request-id", f"lookup-{i}") in tuple(call.trailing_metadata())
        stream = stub.Get(pb.GetRequest(namespace="ns", keys=[os.urandom(16)]), metadata=(("x-request-id", "get-1"),))
        with pytest.raises(grpc.RpcError) as refused:  # a unary call its handler aborts carries it too
            stub.Lookup(pb.LookupRequest(namespace="ns", keys=[b"short"]), metadata=(("x-request-id", "bad-1"),))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ("x-request-id", "bad-1") in tuple(refused.value.trailing_metadata())
        assert ("x-request-id", "get-1") in tuple(stream.initial_metadata())  # streaming: at admission
        list(stream)
        key, block = keyed(b"p" * 64)
        request = pb.PutRequest(namespace="ns", blocks=[pb.Block(key=key, data=block)])
        put = stub.Put.future(iter([request]), metadata=(("x-request-id", "put-1"),), timeout=10)
        assert put.result().stored == 1
        assert ("x-request-id", "put-1") in tuple(put.initial_metadata())  # at admission
    interceptor = server.running.interceptor
    assert interceptor is not None
    assert len([k for k in interceptor._wrapped if k[0] == "/kvcache.v1.KVCache/Lookup"]) == 1
