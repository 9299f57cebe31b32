"""Prometheus metrics, all of them, in this one module.

Two sources:
- Counters and gauges the server keeps anyway (TierStats: hits, evictions, queue
  depth, breaker state, ...) are read from the stack at scrape time by a custom
  collector, so core code never calls Prometheus.
- Latencies and per-namespace lookup results arrive through the Observer seam
  (kvcache_server.observe), implemented here.

Names follow Prometheus conventions: `kvcache_<what>_total` for counters,
`_bytes` and `_seconds` units, a `tier` label for per-tier series. Served on
their own HTTP port (`[metrics]` in the config), with the process's own metrics
(`process_resident_memory_bytes`, `process_open_fds`, `process_cpu_seconds_total`, ...).
The namespace label is capped (MAX_NAMESPACE_LABELS distinct values, then
"_other") so clients cannot blow up the series count.

With auth on, namespaces are tenant-scoped ("<tenant>:<namespace>"): a scrape
without credentials sees the per-namespace series summed into one,
namespace="_all", so the port names no tenant and shows no tenant's traffic.
A scrape presenting a token with the admin right (`Authorization: Bearer ...`)
sees them per namespace.
"""

from __future__ import annotations

import platform
import socket
import socketserver
import ssl
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcache_server import __version__
from kvcache_server.admission import Admission
from kvcache_server.auth import Right, TokenStore
from kvcache_server.config import TlsSection
from kvcache_server.events import EventHub
from kvcache_server.stack import TierStack
from kvcache_server.tiers.base import TierStats

# No `*_created` series next to every counter and histogram: one timestamp per series that nothing here
# queries (process_start_time_seconds says when counting began). Process-wide, as prometheus_client has it.
disable_created_metrics()

MAX_NAMESPACE_LABELS = 256
ALL_NAMESPACES = "_all"
"""The namespace label of the summed series shown to scrapes without an admin token (auth on)."""
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_HIT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# TierStats counters, exported as kvcache_tier_<name>_total{tier} (help text, source field).
_TIER_COUNTERS = {
    "hits": "Blocks found in the tier",
    "misses": "Blocks asked of the tier and not found",
    "puts": "Blocks written to the tier",
    "evictions": "Blocks evicted to make room (RAM, disk)",
    "rejected": "Blocks refused because they could never fit (RAM, disk)",
    "checksum_failures": "Blocks read from the tier that failed verification (deleted there)",
    "errors": "Backend errors and timeouts (each a miss)",
    "skipped": "Calls not attempted because the circuit breaker was open",
    "promotions": "Blocks copied into the tier from a lower tier",
    "demotions": "Blocks written to the tier after RAM evicted them",
    "write_errors": "Queued writes to the tier that failed",
    "queue_dropped": "Writes refused because the write-behind queue was full, or dropped at shutdown",
    "lookup_late_hits": "Keys a Lookup's call to the tier found after that Lookup had answered without them",
    "retention_refused": "Blocks stored unretained: their tenant's or the tier's retained share was full (disk)",
    "retention_expired": "Retentions that ran out, the block plain again (disk)",
    "retention_copied": "Retained records copied forward out of an evicted region (disk)",
    "retention_dropped": "Retained records lost with their evicted region: unreadable, invalid or no room (disk)",
}
# TierStats byte counters, exported as kvcache_tier_<name>_bytes_total{tier} (metric name, help text).
_TIER_BYTES = {
    "bytes_read": ("read", "Bytes read from the tier, as stored"),
    "bytes_written": ("written", "Bytes written to the tier, as stored"),
}
_BREAKER = {"closed": 0, "open": 1, "half_open": 2}
assert set(_TIER_COUNTERS) | set(_TIER_BYTES) <= {f.name for f in fields(TierStats)}


_CLUSTER_COUNTERS = {
    "node_failures": "Redis Cluster nodes that failed a batch (then read from their replicas, skipped a moment)",
    "replica_reads": "Batches of a failed master's keys read from one of its replicas",
    "refreshes": "Slot-map refreshes after a redirection or a failed master",
    "round_trips": "Pipelines sent to Redis Cluster nodes",
}


def _cluster_families(stack: TierStack) -> Iterator[CounterMetricFamily]:
    """The Redis Cluster tier's own counters (docs/tiers.md), when the stack has one."""
    module = sys.modules.get("kvcache_server.tiers.redis_cluster")  # imported only with [redis] cluster
    tiers = [t for t in stack.tiers if module is not None and isinstance(t, module.RedisClusterTier)]
    for name, help_text in _CLUSTER_COUNTERS.items():
        family = CounterMetricFamily(f"kvcache_redis_cluster_{name}", help_text, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.name], getattr(tier, name))
        yield family


class _StatsCollector(Collector):
    def __init__(
        self,
        stack: TierStack,
        events: EventHub,
        service_counters: Callable[[], dict[str, int]],
        admission: Admission | None,
    ) -> None:
        self._stack = stack
        self._events = events
        self._service = service_counters
        self._admission = admission

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stack.stats()
        for name, help_text in _TIER_COUNTERS.items():
            family = CounterMetricFamily(f"kvcache_tier_{name}", help_text, labels=["tier"])
            for s in stats:
                family.add_metric([s.name], getattr(s, name))
            yield family
        for name, (metric, help_text) in _TIER_BYTES.items():
            family = CounterMetricFamily(f"kvcache_tier_{metric}", help_text, labels=["tier"], unit="bytes")
            for s in stats:
                family.add_metric([s.name], getattr(s, name))
            yield family
        gauges = {
            "kvcache_tier_blocks": ("Blocks held by the tier (RAM, disk)", lambda s: s.blocks),
            "kvcache_tier_used_bytes": ("Bytes counted against the tier's cap (RAM, disk)", lambda s: s.used_bytes),
            "kvcache_tier_capacity_bytes": ("The tier's byte cap (RAM, disk)", lambda s: s.capacity_bytes),
            "kvcache_tier_queue_depth": ("Writes waiting in the tier's write-behind queue", lambda s: s.queue_depth),
            "kvcache_tier_queue_bytes": ("Bytes waiting in the tier's write-behind queue", lambda s: s.queue_bytes),
            "kvcache_tier_breaker_state": (
                "Circuit breaker: 0 closed, 1 open, 2 half-open",
                lambda s: _BREAKER[s.breaker],
            ),
            "kvcache_tier_healthy": ("1 when the tier is usable (breaker closed)", lambda s: int(s.healthy)),
            "kvcache_tier_retained_blocks": ("Blocks held under retention (RAM, disk)", lambda s: s.retained_blocks),
            "kvcache_tier_retained_bytes": (
                "Bytes of blocks held under retention (RAM, disk)",
                lambda s: s.retained_bytes,
            ),
        }
        for metric, (help_text, value) in gauges.items():
            family = GaugeMetricFamily(metric, help_text, labels=["tier"])
            for s in stats:
                family.add_metric([s.name], value(s))
            yield family
        yield from _cluster_families(self._stack)
        service = self._service()
        yield CounterMetricFamily(
            "kvcache_put_checksum_failures",
            "Blocks refused on Put for failing their checksum",
            value=service["put_checksum_failures"],
        )
        yield CounterMetricFamily(
            "kvcache_sealed_blocks",
            "Blocks of same-host Puts whose checksums the server computed as it read them (docs/shm.md)",
            value=service["sealed_blocks"],
        )
        yield CounterMetricFamily(
            "kvcache_sealed_too_late",
            "Puts ended ABORTED because a sealed block was read after its client's seal_before_ns",
            value=service["sealed_too_late"],
        )
        family = CounterMetricFamily(
            "kvcache_shm_bytes", "Block bytes moved through shared-memory segments", labels=["direction"]
        )
        family.add_metric(["received"], service["shm_bytes_received"])
        family.add_metric(["sent"], service["shm_bytes_sent"])
        yield family
        family = CounterMetricFamily(
            "kvcache_bulk_bytes", "Block bytes moved on the bulk path (docs/bulk.md)", labels=["direction"]
        )
        family.add_metric(["received"], service["bulk_bytes_received"])
        family.add_metric(["sent"], service["bulk_bytes_sent"])
        yield family
        yield GaugeMetricFamily(
            "kvcache_bulk_connections", "Bulk connections open now", value=service["bulk_connections"]
        )
        yield CounterMetricFamily(
            "kvcache_bulk_errors", "Bulk requests answered with an ERROR frame", value=service["bulk_errors"]
        )
        family = CounterMetricFamily(
            "kvcache_bulk_requests",
            "Bulk requests answered, by frame: put, get, lookup, and a same-host client's lease, release and "
            "touch (blocks it read straight out of the arena)",
            labels=["kind"],
        )
        for kind, label in (
            ("puts", "put"), ("gets", "get"), ("leases", "lease"), ("releases", "release"), ("lookups", "lookup"),
            ("touches", "touch"),
        ):  # fmt: skip
            family.add_metric([label], service[f"bulk_{kind}"])
        yield family
        yield CounterMetricFamily(
            "kvcache_bulk_cut_off",
            "Bulk connections cut off by a deadline: bulk.hello_timeout_s, stall_timeout_s, min_rate_bytes_s "
            "or request_timeout_s",
            value=service["bulk_cut_off"],
        )
        family = CounterMetricFamily(
            "kvcache_inplace_bytes",
            "Block bytes moved in place through the block arena (committed from reservations, leased out)",
            labels=["direction"],
        )
        family.add_metric(["received"], service["inplace_bytes_received"])
        family.add_metric(["sent"], service["inplace_bytes_leased"])
        yield family
        # The block arena (docs/arena.md): what leases and reservations pin, and those that ran out of time.
        yield GaugeMetricFamily("kvcache_arena_free_bytes", "Arena bytes in no slot", value=service["arena_free_bytes"])
        yield GaugeMetricFamily("kvcache_arena_leases", "Read leases open now", value=service["arena_leases"])
        yield GaugeMetricFamily(
            "kvcache_arena_reservations",
            "Reservations open now (blocks being written in place)",
            value=service["arena_reservations"],
        )
        yield CounterMetricFamily(
            "kvcache_arena_leases_expired",
            "Read leases that ended by time-out, not release",
            value=service["arena_leases_expired"],
        )
        yield CounterMetricFamily(
            "kvcache_arena_reservations_reclaimed",
            "Reservations reclaimed by time-out, neither committed nor abandoned",
            value=service["arena_reservations_reclaimed"],
        )
        yield GaugeMetricFamily(
            "kvcache_inflight_bytes",
            "Bytes held for calls in flight, against limits.inflight_bytes",
            value=service["inflight_bytes"],
        )
        yield GaugeMetricFamily(
            "kvcache_inflight_peak_bytes",
            "The most bytes held for calls in flight at once",
            value=service["inflight_peak_bytes"],
        )
        yield CounterMetricFamily(
            "kvcache_inflight_refused",
            "Calls refused because the in-flight budget had no room within limits.admission_wait_s",
            value=service["inflight_refused"],
        )
        yield CounterMetricFamily(
            "kvcache_cut_off_calls",
            "Put streams gone quiet and Gets whose client stopped reading, ended by the server",
            value=service["cut_off_calls"],
        )
        # Sessions that stay and Prefetch (docs/tiers.md).
        yield CounterMetricFamily(
            "kvcache_retention_refused",
            "Blocks put with retain_ttl_s but stored unretained: their tenant's (or the tier's) share was full",
            value=service["retention_refused"],
        )
        yield CounterMetricFamily(
            "kvcache_retention_expired",
            "Retentions that ran out of time (the block stays, evictable again)",
            value=service["retention_expired"],
        )
        family = CounterMetricFamily(
            "kvcache_prefetch_keys",
            "Prefetch keys: queued for promotion, promoted into RAM, dropped (queue full), failed (not brought)",
            labels=["outcome"],
        )
        for outcome in ("queued", "promoted", "dropped", "failed"):
            family.add_metric([outcome], service[f"prefetch_{outcome}"])
        yield family
        yield GaugeMetricFamily(
            "kvcache_event_subscribers", "Connected KV-event subscribers", value=self._events.subscribers
        )
        yield CounterMetricFamily(
            "kvcache_event_subscribers_dropped",
            "KV-event subscribers cut off for falling behind",
            value=self._events.dropped_subscribers,
        )
        yield CounterMetricFamily(
            "kvcache_event_subscribers_refused",
            "KV-event subscriptions refused: the server's or the tenant's subscriber limit",
            value=self._events.refused_subscribers,
        )
        if self._admission is not None:
            yield GaugeMetricFamily(
                "kvcache_rpcs_in_flight", "KVCache calls admitted and running", value=self._admission.active
            )
            family = CounterMetricFamily(
                "kvcache_rpcs_refused", "KVCache calls refused for capacity, by the limit they hit", labels=["limit"]
            )
            for limit, count in self._admission.refused.items():
                family.add_metric([limit], count)
            yield family


class _NamespaceCollector(Collector):
    """Lookup keys and hit keys per namespace, or summed over all of them (`aggregate`)."""

    def __init__(self, counts: dict[str, list[int]], lock: threading.Lock, *, aggregate: bool) -> None:
        self._counts = counts
        self._lock = lock
        self._aggregate = aggregate

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            rows = [(namespace, keys, hits) for namespace, (keys, hits) in self._counts.items()]
        if self._aggregate:
            rows = [(ALL_NAMESPACES, sum(r[1] for r in rows), sum(r[2] for r in rows))]
        keys = CounterMetricFamily(
            "kvcache_namespace_lookup_keys", "Keys asked by Lookup, per namespace", labels=["namespace"]
        )
        hits = CounterMetricFamily(
            "kvcache_namespace_lookup_hit_keys", "Keys in Lookup's stored prefix, per namespace", labels=["namespace"]
        )
        for namespace, asked, hit in rows:
            keys.add_metric([namespace], asked)
            hits.add_metric([namespace], hit)
        yield keys
        yield hits


class Metrics:
    """The Prometheus registries of one server (the full view, and the view for scrapes without an admin
    token), and the Observer that feeds their histograms and counters."""

    def __init__(self, tokens: TokenStore | None = None) -> None:
        """
        Args:
            tokens: The server's tokens with auth on: namespace labels are then shown only to scrapes
                presenting an admin token. None (auth off): every scrape sees everything.
        """
        self._tokens = tokens
        self.registry = CollectorRegistry(auto_describe=True)
        self.public_registry = self.registry if tokens is None else CollectorRegistry(auto_describe=True)
        self._requests = Counter("kvcache_requests", "Finished RPCs", ["method", "code"], registry=None)
        self._request_seconds = Histogram(
            "kvcache_request_duration_seconds", "RPC duration", ["method"], buckets=_LATENCY_BUCKETS, registry=None
        )
        self._tier_seconds = Histogram(
            "kvcache_tier_operation_duration_seconds",
            "Duration of one batched call to a tier",
            ["tier", "op", "ok"],
            buckets=_LATENCY_BUCKETS,
            registry=None,
        )
        self._lookup_hit_chunks = Histogram(
            "kvcache_lookup_hit_chunks",
            "Length of the stored prefix found by Lookup, in chunks",
            buckets=_HIT_BUCKETS,
            registry=None,
        )
        self._lock = threading.Lock()
        self._ns_counts: dict[str, list[int]] = {}  # namespace label -> [keys asked, hit keys]
        # Resident memory, virtual memory, open and max fds, CPU seconds, start time (Linux /proc).
        process = ProcessCollector(registry=None)
        build = Info("kvcache_build", "The server's version and Python, as labels (value 1)", registry=None)
        build.info({"version": __version__, "python": platform.python_version()})
        collectors = (
            self._requests,
            self._request_seconds,
            self._tier_seconds,
            self._lookup_hit_chunks,
            process,
            build,
        )
        for collector in collectors:
            self._register(collector)
        self.registry.register(_NamespaceCollector(self._ns_counts, self._lock, aggregate=False))
        if self.public_registry is not self.registry:
            self.public_registry.register(_NamespaceCollector(self._ns_counts, self._lock, aggregate=True))
        self._full_app = make_wsgi_app(self.registry)
        self._public_app = make_wsgi_app(self.public_registry)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def _register(self, collector: Collector) -> None:
        """Registers a collector in both views."""
        self.registry.register(collector)
        if self.public_registry is not self.registry:
            self.public_registry.register(collector)

    def attach(
        self,
        stack: TierStack,
        events: EventHub,
        service_counters: Callable[[], dict[str, int]],
        admission: Admission | None = None,
    ) -> None:
        """Exports the stack's, the service's and admission's own counters (read at scrape time)."""
        self._register(_StatsCollector(stack, events, service_counters, admission))

    # -- Observer -------------------------------------------------------------------------------

    def tier_op(self, tier: str, op: str, seconds: float, ok: bool) -> None:
        self._tier_seconds.labels(tier, op, "true" if ok else "false").observe(seconds)

    def lookup(self, namespace: str, keys: int, hit_keys: int) -> None:
        self._lookup_hit_chunks.observe(hit_keys)
        with self._lock:
            counts = self._ns_counts.get(namespace)
            if counts is None:
                label = namespace if len(self._ns_counts) < MAX_NAMESPACE_LABELS else "_other"
                counts = self._ns_counts.setdefault(label, [0, 0])
            counts[0] += keys
            counts[1] += hit_keys

    def rpc(self, method: str, code: str, seconds: float) -> None:
        self._requests.labels(method, code).inc()
        self._request_seconds.labels(method).observe(seconds)

    # -- HTTP -----------------------------------------------------------------------------------

    def serve(self, host: str, port: int, tls: TlsSection | None = None) -> int:
        """Starts the /metrics HTTP(S) server in a daemon thread; returns the bound port.

        With TLS configured the metrics port uses the same certificate, and requires client
        certificates when the gRPC port does (mTLS).
        """
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        server = make_server(host, port, self._app, server_class, handler_class=_QuietHandler)
        if tls is not None and tls.enabled:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert_file, tls.key_file)
            if tls.client_ca_file:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(cafile=tls.client_ca_file)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, name="kvcache-metrics", daemon=True)
        thread.start()
        self._http = (server, thread)
        return int(server.server_port)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI app: the full view with auth off or for an admin token, the public view without a token."""
        if self._tokens is None:
            return self._full_app(environ, start_response)
        header = environ.get("HTTP_AUTHORIZATION")
        if header is None:
            return self._public_app(environ, start_response)
        scheme, _, token = header.partition(" ")
        principal = self._tokens.authenticate(token.strip()) if scheme.lower() == "bearer" else None
        if principal is None:
            return _refuse(start_response, "401 Unauthorized", "invalid token; scrape without one for the public view")
        if Right.ADMIN not in principal.rights:
            return _refuse(start_response, "403 Forbidden", f"token {principal.name!r} lacks the 'admin' right")
        return self._full_app(environ, start_response)

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._http = None


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, none left behind at exit."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _refuse(start_response: Callable[..., Any], status: str, message: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")])
    return [message.encode() + b"\n"]
