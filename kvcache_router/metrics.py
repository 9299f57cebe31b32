"""The router's Prometheus metrics, in one registry of its own (served on GET /metrics; docs/router.md).

The request path reports a finished request once, as a `RequestReport`; workers report their state;
nothing else in the router touches prometheus_client.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUTES = ("prefill", "skip", "short", "decode-only")  # the routes of a completion that reached a worker
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class RequestReport:
    """What the router did with one request: in its response headers, its log line and the metrics.

    Attributes:
        request_id: The X-Request-Id (the client's, or one made here).
        endpoint: "completions" or "chat"; "tokenize", "detokenize", "version" or "ping" (proxied).
        route: "none" (refused before routing), "prefill" (prefill worker, then decode), "skip" (the
            stored prefix leaves at most the last chunk to compute: straight to decode), "short" (a
            prompt of at most one chunk, none of it stored: straight to decode), "decode-only" (no
            prefill worker could take it), "proxy" (one of vLLM's small endpoints, to a decode worker).
        prompt_tokens: Tokens of the prompt, when the tokenizer answered.
        cached_tokens: Prompt tokens kvcache held before the request, when the lookup answered.
        lookup: "ok", "failed" (tokenize or lookup failed: counted as nothing stored) or "off".
        prefill_worker: The prefill worker that answered, "" if none did.
        prefill_attempts: Prefill workers tried.
        decode_worker: The decode worker that answered, "" if none did.
        status: The HTTP status returned to the client.
        error: Why the request failed or fell back, "" if it did not.
    """

    request_id: str
    endpoint: str
    route: str = "none"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    lookup: str = "off"
    prefill_worker: str = ""
    prefill_attempts: int = 0
    decode_worker: str = ""
    status: int = 200
    error: str = ""

    def headers(self) -> dict[str, str]:
        """The X-KVCache-* response headers."""
        out = {
            "X-Request-Id": self.request_id,
            "X-KVCache-Route": self.route,
            "X-KVCache-Lookup": self.lookup,
            "X-KVCache-Prefill-Attempts": str(self.prefill_attempts),
        }
        if self.route in ROUTES:
            out["X-KVCache-Prefill-Skipped"] = "false" if self.route == "prefill" else "true"
        if self.prompt_tokens is not None:
            out["X-KVCache-Prompt-Tokens"] = str(self.prompt_tokens)
        if self.cached_tokens is not None:
            out["X-KVCache-Cached-Tokens"] = str(self.cached_tokens)
        if self.prefill_worker:
            out["X-KVCache-Prefill-Worker"] = self.prefill_worker
        if self.decode_worker:
            out["X-KVCache-Decode-Worker"] = self.decode_worker
        return out

    def fields(self, *, ttft_s: float | None, total_s: float) -> dict[str, str | int | float | None]:
        """The request's facts as a structured log record's fields (request_id is the record's own)."""
        return {
            "endpoint": self.endpoint,
            "status": self.status,
            "route": self.route,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "lookup": self.lookup,
            "prefill_worker": self.prefill_worker or None,
            "prefill_attempts": self.prefill_attempts,
            "decode_worker": self.decode_worker or None,
            "ttft_s": round(ttft_s, 6) if ttft_s is not None else None,
            "total_s": round(total_s, 6),
            "error": self.error or None,
        }


class RouterMetrics:
    """Counters, gauges and histograms of one router."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvcache_router_requests",
            "Requests answered, by endpoint, route and status",
            ["endpoint", "route", "code"],
            registry=r,
        )
        self.prefill_skipped = Counter(
            "kvcache_router_prefill_skipped",
            "Requests sent straight to decode because kvcache held the prompt but its last chunk",
            registry=r,
        )
        self.short_prompts = Counter(
            "kvcache_router_short_prompts",
            "Requests sent straight to decode because the prompt is at most one chunk (too short to prefill)",
            registry=r,
        )
        self.decode_only = Counter(
            "kvcache_router_decode_only",
            "Requests the decode worker computed whole because no prefill worker could take them",
            registry=r,
        )
        self.bodies_in_flight = Gauge(
            "kvcache_router_bodies_in_flight",
            "Request bodies held before a request slot: being read, or read and waiting for a slot",
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvcache_router_client_disconnects",
            "Clients that went away before their answer was whole, by endpoint and stage (body, answer)",
            ["endpoint", "stage"],
            registry=r,
        )
        self.client_kv_params_dropped = Counter(
            "kvcache_router_client_kv_transfer_params_dropped",
            "Requests whose own kv_transfer_params were dropped (http.allow_client_kv_transfer_params)",
            registry=r,
        )
        self.prefetches = Counter(
            "kvcache_router_prefetches",
            "Prefetches after a turn, by outcome: sent, failed (kvcache down, late or refused), dropped "
            "(kvcache.max_concurrent_prefetches running), skipped (no namespace known yet)",
            ["outcome"],
            registry=r,
        )
        self.prefetch_keys = Counter(
            "kvcache_router_prefetch_keys",
            "Blocks named by the prefetches sent, by the server's answer: in_ram, queued, unknown, dropped",
            ["answer"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvcache_router_prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.cached_tokens = Counter(
            "kvcache_router_cached_tokens", "Prompt tokens kvcache held when their request arrived", registry=r
        )
        self.lookup_failures = Counter(
            "kvcache_router_lookup_failures",
            "Requests whose tokenize or kvcache lookup failed (routed as uncached)",
            ["stage"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "kvcache_router_prefill_retries", "Prefill calls retried on another prefill worker", registry=r
        )
        self.upstream_failures = Counter(
            "kvcache_router_upstream_failures",
            "Failed calls to workers, by role, worker and reason",
            ["role", "worker", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "kvcache_router_worker_ejections",
            "Times a worker was taken out of rotation",
            ["role", "worker"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvcache_router_worker_healthy", "1 while a worker is in rotation", ["role", "worker"], registry=r
        )
        self.outstanding = Gauge(
            "kvcache_router_worker_outstanding",
            "Requests a worker is serving for this router",
            ["role", "worker"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvcache_router_ttft_seconds",
            "Request arrival to the decode worker's first response byte, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "kvcache_router_prefill_seconds",
            "Duration of successful prefill calls",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lookup_seconds = Histogram(
            "kvcache_router_lookup_seconds",
            "Duration of tokenize + kvcache lookup",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def finished(self, report: RequestReport) -> None:
        """Counts one answered request."""
        self.requests.labels(report.endpoint, report.route, str(report.status)).inc()
        if report.status >= 400:
            return
        if report.route == "skip":
            self.prefill_skipped.inc()
        elif report.route == "short":
            self.short_prompts.inc()
        elif report.route == "decode-only":
            self.decode_only.inc()
        if report.prompt_tokens is not None:
            self.prompt_tokens.inc(report.prompt_tokens)
        if report.cached_tokens is not None:
            self.cached_tokens.inc(report.cached_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
