"""Prometheus metrics, all of them, in this one module.

Two sources:
- Counters and gauges the server keeps anyway (TierStats: hits, evictions, queue
  depth, breaker state, ...) are read from the stack at scrape time by a custom
  collector, so core code never calls Prometheus.
- Latencies and per-namespace lookup results arrive through the Observer seam
  (kvcache_server.observe), implemented here.

Names follow Prometheus conventions: `kvcache_<what>_total` for counters,
`_bytes` and `_seconds` units, a `tier` label for per-tier series. Served on
their own HTTP port (`[metrics]` in the config). The namespace label is capped
(MAX_NAMESPACE_LABELS distinct values, then "_other") so clients cannot blow up
the series count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcache_server.config import TlsSection
from kvcache_server.events import EventHub
from kvcache_server.stack import TierStack
from kvcache_server.tiers.base import TierStats

MAX_NAMESPACE_LABELS = 256
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_HIT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

# TierStats counters, exported as kvcache_tier_<name>_total{tier} (help text, source field).
_TIER_COUNTERS = {
    "hits": "Blocks found in the tier",
    "misses": "Blocks asked of the tier and not found",
    "puts": "Blocks written to the tier",
    "evictions": "Blocks evicted to make room (RAM)",
    "rejected": "Blocks refused because they could never fit (RAM)",
    "checksum_failures": "Blocks read from the tier that failed verification (deleted there)",
    "errors": "Backend errors and timeouts (each a miss)",
    "skipped": "Calls not attempted because the circuit breaker was open",
    "promotions": "Blocks copied into the tier from a lower tier",
    "demotions": "Blocks written to the tier after RAM evicted them",
    "write_errors": "Queued writes to the tier that failed",
    "queue_dropped": "Writes refused because the write-behind queue was full, or dropped at shutdown",
}
_TIER_BYTES = {
    "bytes_read": "Bytes read from the tier, as stored",
    "bytes_written": "Bytes written to the tier, as stored",
}
_BREAKER = {"closed": 0, "open": 1, "half_open": 2}
assert set(_TIER_COUNTERS) | set(_TIER_BYTES) <= {f.name for f in fields(TierStats)}


class _StatsCollector(Collector):
    def __init__(self, stack: TierStack, events: EventHub, service_counters: Callable[[], dict[str, int]]) -> None:
        self._stack = stack
        self._events = events
        self._service = service_counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._stack.stats()
        for name, help_text in _TIER_COUNTERS.items():
            family = CounterMetricFamily(f"kvcache_tier_{name}", help_text, labels=["tier"])
            for s in stats:
                family.add_metric([s.name], getattr(s, name))
            yield family
        for name, help_text in _TIER_BYTES.items():
            family = CounterMetricFamily(f"kvcache_tier_{name}", help_text, labels=["tier"], unit="bytes")
            for s in stats:
                family.add_metric([s.name], getattr(s, name))
            yield family
        gauges = {
            "kvcache_tier_blocks": ("Blocks held by the tier (RAM)", lambda s: s.blocks),
            "kvcache_tier_used_bytes": ("Bytes accounted against the tier's capacity (RAM)", lambda s: s.used_bytes),
            "kvcache_tier_capacity_bytes": ("The tier's byte cap (RAM)", lambda s: s.capacity_bytes),
            "kvcache_tier_queue_depth": ("Writes waiting in the tier's write-behind queue", lambda s: s.queue_depth),
            "kvcache_tier_queue_bytes": ("Bytes waiting in the tier's write-behind queue", lambda s: s.queue_bytes),
            "kvcache_tier_breaker_state": (
                "Circuit breaker: 0 closed, 1 open, 2 half-open",
                lambda s: _BREAKER[s.breaker],
            ),
            "kvcache_tier_healthy": ("1 when the tier is usable (breaker closed)", lambda s: int(s.healthy)),
        }
        for metric, (help_text, value) in gauges.items():
            family = GaugeMetricFamily(metric, help_text, labels=["tier"])
            for s in stats:
                family.add_metric([s.name], value(s))
            yield family
        service = self._service()
        yield CounterMetricFamily(
            "kvcache_put_checksum_failures",
            "Blocks refused on Put for failing their checksum",
            value=service["put_checksum_failures"],
        )
        family = CounterMetricFamily(
            "kvcache_shm_bytes", "Block bytes moved through shared-memory segments", labels=["direction"]
        )
        family.add_metric(["received"], service["shm_bytes_received"])
        family.add_metric(["sent"], service["shm_bytes_sent"])
        yield family
        yield GaugeMetricFamily(
            "kvcache_event_subscribers", "Connected KV-event subscribers", value=self._events.subscribers
        )
        yield CounterMetricFamily(
            "kvcache_event_subscribers_dropped",
            "KV-event subscribers cut off for falling behind",
            value=self._events.dropped_subscribers,
        )


class Metrics:
    """The Prometheus registry of one server, and the Observer that feeds its histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter("kvcache_requests", "Finished RPCs", ["method", "code"], registry=r)
        self._request_seconds = Histogram(
            "kvcache_request_duration_seconds", "RPC duration", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self._tier_seconds = Histogram(
            "kvcache_tier_operation_duration_seconds",
            "Duration of one batched call to a tier",
            ["tier", "op", "ok"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._lookup_hit_chunks = Histogram(
            "kvcache_lookup_hit_chunks",
            "Length of the stored prefix found by Lookup, in chunks",
            buckets=_HIT_BUCKETS,
            registry=r,
        )
        self._ns_keys = Counter(
            "kvcache_namespace_lookup_keys", "Keys asked by Lookup, per namespace", ["namespace"], registry=r
        )
        self._ns_hits = Counter(
            "kvcache_namespace_lookup_hit_keys",
            "Keys in Lookup's stored prefix, per namespace",
            ["namespace"],
            registry=r,
        )
        self._namespaces: set[str] = set()
        self._lock = threading.Lock()
        self._http: tuple[object, threading.Thread] | None = None

    def attach(self, stack: TierStack, events: EventHub, service_counters: Callable[[], dict[str, int]]) -> None:
        """Exports the stack's and the service's own counters (read at scrape time)."""
        self.registry.register(_StatsCollector(stack, events, service_counters))

    # -- Observer -------------------------------------------------------------------------------

    def tier_op(self, tier: str, op: str, seconds: float, ok: bool) -> None:
        self._tier_seconds.labels(tier, op, "true" if ok else "false").observe(seconds)

    def lookup(self, namespace: str, keys: int, hit_keys: int) -> None:
        self._lookup_hit_chunks.observe(hit_keys)
        label = self._namespace_label(namespace)
        self._ns_keys.labels(label).inc(keys)
        self._ns_hits.labels(label).inc(hit_keys)

    def rpc(self, method: str, code: str, seconds: float) -> None:
        self._requests.labels(method, code).inc()
        self._request_seconds.labels(method).observe(seconds)

    def _namespace_label(self, namespace: str) -> str:
        if namespace in self._namespaces:
            return namespace
        with self._lock:
            if len(self._namespaces) < MAX_NAMESPACE_LABELS:
                self._namespaces.add(namespace)
                return namespace
        return "_other"

    # -- HTTP -----------------------------------------------------------------------------------

    def serve(self, host: str, port: int, tls: TlsSection | None = None) -> int:
        """Starts the /metrics HTTP(S) server in a daemon thread; returns the bound port.

        With TLS configured the metrics port uses the same certificate, and requires client
        certificates when the gRPC port does (mTLS).
        """
        kwargs: dict[str, object] = {}
        if tls is not None and tls.enabled:
            kwargs = {"certfile": tls.cert_file, "keyfile": tls.key_file}
            if tls.client_ca_file:
                kwargs |= {"client_cafile": tls.client_ca_file, "client_auth_required": True}
        server, thread = start_http_server(port, addr=host, registry=self.registry, **kwargs)  # type: ignore[arg-type]
        self._http = (server, thread)
        return int(server.server_port)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            thread.join(5)
            self._http = None
