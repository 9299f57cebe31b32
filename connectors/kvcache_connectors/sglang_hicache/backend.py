"""KVCacheHiCacheStorage: kvcache as SGLang's HiCache L3 storage (`--hicache-storage-backend dynamic`).

SGLang's HiCacheController builds it through StorageBackendFactory as `cls(storage_config, kwargs)`,
registers its host KV pool (register_mem_pool_host), then calls it from its own threads:

    prefetch thread   batch_exists(keys, extra_info) -> int: pages stored, counted from the first
    prefetch I/O      batch_get_v1(keys, host_indices, extra_info) -> list[bool]: loads pages into
                      the host pool at host_indices (the zero-copy path, "interface_v1": 1)
    backup thread     batch_set_v1(keys, host_indices, extra_info) -> list[bool]: stores pages
                      from the host pool (only on the storage writer: MLA ranks other than the
                      writer hold the same bytes, and SGLang skips their backups itself)
    scheduler         get_stats() -> StorageMetrics, drained (with --enable-cache-report metrics)

plus get / batch_get / set / batch_set / exists, the generic path over flat page tensors that
the controller takes without "interface_v1". Both paths store a page the same way (one kvcache
block per segment, namespace.py), so they read each other's pages.

The controller's rules hold on every data call: it never raises (a raise ends the controller's
thread), a page it could not load or store is False, a lookup that failed is 0 pages. Each call
to the server has a deadline and one attempt; after a failure a breaker keeps the backend off
the server for breaker_cooldown_s (its calls are misses at once), then one call probes it.
Failures are counted (counters()) and logged at most once per log_interval_s per kind.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvcache_client import KVCacheClient, KVCacheError
from kvcache_client.retry import NO_RETRY
from kvcache_connectors.engine_keys import EngineNamespace
from kvcache_connectors.sglang_hicache.config import HiCacheBackendConfig
from kvcache_connectors.sglang_hicache.namespace import segment_engine_keys, sglang_namespace
from kvcache_connectors.sglang_hicache.pages import PageMap
from kvcache_core.breaker import CircuitBreaker

log = logging.getLogger(__name__)

# Errors of a call to the server that make its pages misses: the server's statuses (deadline
# passed, unavailable, refused), a broken socket of the bulk or shm path, and ValueError, which
# the SDK raises for a stored block whose size is not the destination's (get_into).
CALL_ERRORS = (KVCacheError, OSError, ValueError)


class Counters:
    """Names of the backend's counters (counters() returns them, cumulative since start)."""

    LOOKUPS = "lookups"  # batch_exists calls answered by the server
    LOOKUP_FAILURES = "lookup_failures"  # batch_exists calls that failed (0 pages)
    PAGES_FOUND = "pages_found"  # pages batch_exists reported stored
    PAGES_LOADED = "pages_loaded"
    PAGES_MISSING = "pages_missing"  # pages asked for and not loaded (not stored, or the call failed)
    LOAD_FAILURES = "load_failures"  # get calls that failed
    PAGES_STORED = "pages_stored"
    PAGES_NOT_STORED = "pages_not_stored"  # pages of failed or partly refused puts
    STORE_FAILURES = "store_failures"  # put calls that failed
    REPLICA_PAGES_SKIPPED = "replica_pages_skipped"  # MLA pages a non-writer rank was asked to store
    CALLS_SKIPPED = "calls_skipped"  # calls not attempted: the breaker was open
    BAD_REQUESTS = "bad_requests"  # calls refused before any I/O (indices or pages that do not fit)

    ALL = (
        LOOKUPS, LOOKUP_FAILURES, PAGES_FOUND, PAGES_LOADED, PAGES_MISSING, LOAD_FAILURES, PAGES_STORED,
        PAGES_NOT_STORED, STORE_FAILURES, REPLICA_PAGES_SKIPPED, CALLS_SKIPPED, BAD_REQUESTS,
    )  # fmt: skip


class _RateLimitedLog:
    """One warning per kind per interval; the ones in between are counted into the next."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (%d more like it not logged)"
            args = (*args, suppressed)
        log.warning(message, *args)


class KVCacheHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage in a kvcache server. Options: HiCacheBackendConfig (the extra config's keys).

    Raises (constructor):
        ValueError: a missing or invalid option, or a parallel layout this backend does not
            store (decode context parallelism, TP head splitting).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = HiCacheBackendConfig.from_extra_config(storage_config.extra_config)
        if storage_config.dcp_size > 1:
            raise ValueError("the kvcache HiCache backend does not store decode-context-parallel (DCP) pages")
        if storage_config.should_split_heads:
            raise ValueError("the kvcache HiCache backend does not split heads across TP sizes (tp_lcm_size)")
        if not self.config.interface_v1:
            log.warning('kvcache HiCache backend: "interface_v1": 1 is not set; SGLang copies every page once more')
        self.storage_config = storage_config
        self.is_writer = storage_config.is_storage_writer
        self.namespace: EngineNamespace | None = None
        self._ns = ""
        self._pages: PageMap | None = None
        self._log = _RateLimitedLog(self.config.log_interval_s)
        cooldown = self.config.breaker_cooldown_s
        self._breaker = CircuitBreaker(failure_threshold=1, reset_s=cooldown, max_reset_s=cooldown)
        self._lock = threading.Lock()  # the breaker, the counters and the metrics lists
        self._counts = dict.fromkeys(Counters.ALL, 0)
        self._metrics_on = bool(storage_config.enable_storage_metrics)
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_gbps: list[float] = []
        self._client = KVCacheClient(
            self.config.target,
            timeout_s=self.config.timeout_s,
            retry=NO_RETRY,
            shm=self.config.shm,
            bulk=self.config.bulk,
            token=self.config.token,
            presence_index=self.config.presence_index,
        )

    # -- set-up (the controller's thread, before any data call) ------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host KV pool and derives the namespace from it.

        Raises:
            ValueError: the pool's layout is not page-first, or it has no CPU kv_buffer.
        """
        pages = PageMap(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)
        self._pages = pages
        self.namespace = sglang_namespace(
            self.storage_config,
            mem_pool_host,
            segment_bytes=pages.segment_bytes,
            sglang_version=sglang.__version__,
            model_revision=self.config.model_revision,
            extra=self.config.namespace_extra,
        )
        self._ns = self.namespace.name
        log.info(
            "kvcache HiCache backend: server %s, namespace %s (%s, %d segments of %s bytes per page, writer=%s)",
            self.config.target,
            self._ns,
            dict(self.namespace.facts).get("attention"),
            pages.segments,
            list(pages.segment_bytes),
            self.is_writer,
        )

    # -- the zero-copy v1 path ----------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of `keys`, from the first, are stored (every segment of each); 0 on failure."""
        if not keys:
            return 0
        pages = self._pages
        if pages is None or self.namespace is None:
            return self._refused("lookup", "batch_exists before a host pool was registered", 0)
        if not self._allow():
            return 0
        started = time.monotonic()
        try:
            found = self._client.lookup(
                self._ns,
                self.namespace.keys(segment_engine_keys(keys, pages.segments)),
                timeout_s=self.config.lookup_timeout_s,
            ).prefix_length
        except CALL_ERRORS as exc:
            self._failed(Counters.LOOKUP_FAILURES)
            self._log.warning(
                "lookup", "kvcache lookup of %d pages failed after %.2f s (0 pages): %s",
                len(keys), time.monotonic() - started, exc,
            )  # fmt: skip
            return 0
        hit = found // pages.segments
        self._succeeded({Counters.LOOKUPS: 1, Counters.PAGES_FOUND: hit})
        return hit

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Loads pages straight into the host pool at host_indices; True per page loaded whole.

        The load stops at the first missing segment (the controller uses only the leading run of
        loaded pages); a page not loaded may have been partly written, and SGLang frees it.
        """
        misses = [False] * len(keys)
        if not keys:
            return []
        views = self._views("load", keys, host_indices)
        if views is None:
            return misses
        if not self._allow():
            self._count(Counters.PAGES_MISSING, len(keys))
            return misses
        started = time.monotonic()
        try:
            found = self._client.get_into(
                self._ns, self._keys(keys), views, prefix_only=True, timeout_s=self.config.timeout_s
            )
        except CALL_ERRORS as exc:
            self._failed(Counters.LOAD_FAILURES, {Counters.PAGES_MISSING: len(keys)})
            self._log.warning(
                "load", "kvcache load of %d pages failed after %.2f s (misses): %s",
                len(keys), time.monotonic() - started, exc,
            )  # fmt: skip
            return misses
        segments = len(found) // len(keys)
        loaded = [all(found[i * segments : (i + 1) * segments]) for i in range(len(keys))]
        hits = sum(loaded)
        self._succeeded({Counters.PAGES_LOADED: hits, Counters.PAGES_MISSING: len(keys) - hits})
        self._record(self._prefetch_pgs, self._prefetch_gbps, hits, started)
        return loaded

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Stores pages straight from the host pool; True per page stored.

        On an MLA rank that is not the storage writer nothing is sent and every page is True: the
        writer rank stores the same bytes under the same keys (SGLang's controller does not even
        call this there, HiCacheController.backup_skip).
        """
        if not keys:
            return []
        if not self.is_writer:
            self._count(Counters.REPLICA_PAGES_SKIPPED, len(keys))
            return [True] * len(keys)
        failed = [False] * len(keys)
        views = self._views("store", keys, host_indices)
        if views is None:
            return failed
        if not self._allow():
            self._count(Counters.PAGES_NOT_STORED, len(keys))
            return failed
        return self._put(keys, views)

    # -- the generic path (flat page tensors; without "interface_v1") -------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Loads one page into the flat page tensor target_location; it, or None."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Loads pages into flat page tensors (one per key); each tensor loaded whole, or None."""
        misses: list[torch.Tensor | None] = [None] * len(keys)
        if not keys:
            return []
        views = self._flat_views("load", keys, target_locations)
        if views is None:
            return misses
        if not self._allow():
            self._count(Counters.PAGES_MISSING, len(keys))
            return misses
        started = time.monotonic()
        try:
            found = self._client.get_into(
                self._ns, self._keys(keys), views, prefix_only=True, timeout_s=self.config.timeout_s
            )
        except CALL_ERRORS as exc:
            self._failed(Counters.LOAD_FAILURES, {Counters.PAGES_MISSING: len(keys)})
            self._log.warning("load", "kvcache load of %d pages failed (misses): %s", len(keys), exc)
            return misses
        segments = len(found) // len(keys)
        out = [
            target if all(found[i * segments : (i + 1) * segments]) else None
            for i, target in enumerate(target_locations)
        ]
        hits = sum(t is not None for t in out)
        self._succeeded({Counters.PAGES_LOADED: hits, Counters.PAGES_MISSING: len(keys) - hits})
        self._record(self._prefetch_pgs, self._prefetch_gbps, hits, started)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores one flat page tensor."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Stores flat page tensors (one per key); True when every page was stored."""
        if not keys:
            return True
        if not self.is_writer:
            self._count(Counters.REPLICA_PAGES_SKIPPED, len(keys))
            return True
        views = self._flat_views("store", keys, values)
        if views is None or not self._allow():
            self._count(Counters.PAGES_NOT_STORED, len(keys) if views is not None else 0)
            return False
        return all(self._put(keys, views))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest of the interface ------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics of the pages moved since the last call (None without storage metrics)."""
        if not self._metrics_on:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_gbps)
            metrics.backup_bandwidth.extend(self._backup_gbps)
            for kept in (self._prefetch_pgs, self._backup_pgs, self._prefetch_gbps, self._backup_gbps):
                kept.clear()
        return metrics

    def counters(self) -> dict[str, int]:
        """The backend's counters (Counters), cumulative since it started."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Closes the client (the controller calls this on detach)."""
        self._client.close()

    # -- internals ------------------------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        assert self.namespace is not None and self._pages is not None
        return self.namespace.keys(segment_engine_keys(keys, self._pages.segments))

    def _views(self, kind: str, keys: Sequence[str], host_indices: torch.Tensor) -> list[torch.Tensor] | None:
        if self._pages is None or self.namespace is None:
            return self._refused(kind, "a data call before a host pool was registered", None)
        try:
            return self._pages.views(host_indices, len(keys))
        except ValueError as exc:
            return self._refused(kind, f"{len(keys)} pages at host indices that do not fit: {exc}", None)

    def _flat_views(self, kind: str, keys: Sequence[str], pages: Any) -> list[torch.Tensor] | None:
        if self._pages is None or self.namespace is None:
            return self._refused(kind, "a data call before a host pool was registered", None)
        if pages is None or len(pages) != len(keys):
            return self._refused(kind, f"{len(keys)} keys without one flat page each", None)
        try:
            return [segment for page in pages for segment in self._pages.split_flat(page)]
        except (ValueError, AttributeError, RuntimeError) as exc:  # not a tensor, or not one page's bytes
            return self._refused(kind, f"{len(keys)} flat pages that are not pages of the pool: {exc}", None)

    def _put(self, keys: Sequence[str], views: Sequence[torch.Tensor]) -> list[bool]:
        started = time.monotonic()
        try:
            kv_keys = self._keys(keys)
            result = self._client.put_payloads(  # on the same host the server checksums what it reads
                self._ns,
                kv_keys,
                [memoryview(v.numpy()) for v in views],
                timeout_s=self.config.timeout_s,
                retain_ttl_s=self.config.retain_ttl_s,
            )
        except CALL_ERRORS as exc:
            self._failed(Counters.STORE_FAILURES, {Counters.PAGES_NOT_STORED: len(keys)})
            self._log.warning(
                "store", "kvcache store of %d pages failed after %.2f s: %s",
                len(keys), time.monotonic() - started, exc,
            )  # fmt: skip
            return [False] * len(keys)
        if result.stored != len(kv_keys):  # PutResult does not say which: none is trusted
            self._succeeded({Counters.PAGES_NOT_STORED: len(keys)})
            self._log.warning(
                "store", "kvcache stored %d of %d blocks of %d pages (server limits; none counted as stored)",
                result.stored, len(kv_keys), len(keys),
            )  # fmt: skip
            return [False] * len(keys)
        self._succeeded({Counters.PAGES_STORED: len(keys)})
        self._record(self._backup_pgs, self._backup_gbps, len(keys), started)
        return [True] * len(keys)

    def _refused(self, kind: str, message: str, answer: Any) -> Any:
        self._count(Counters.BAD_REQUESTS)
        self._log.warning(f"refused-{kind}", "kvcache HiCache backend: %s", message)
        return answer

    def _record(self, pages_list: list[int], gbps_list: list[float], pages: int, started: float) -> None:
        if not self._metrics_on or not pages or self._pages is None:
            return
        elapsed = max(time.monotonic() - started, 1e-9)
        with self._lock:
            pages_list.append(pages)
            gbps_list.append(pages * self._pages.page_bytes / elapsed / (1 << 30))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _allow(self) -> bool:
        with self._lock:
            allowed = self._breaker.allow()
            if not allowed:
                self._counts[Counters.CALLS_SKIPPED] += 1
        return allowed

    def _succeeded(self, counts: dict[str, int]) -> None:
        with self._lock:
            self._breaker.success()
            for name, n in counts.items():
                self._counts[name] += n

    def _failed(self, name: str, counts: dict[str, int] | None = None) -> None:
        with self._lock:
            opened = self._breaker.failure()
            self._counts[name] += 1
            for other, n in (counts or {}).items():
                self._counts[other] += n
        if opened:
            self._log.warning(
                "breaker", "kvcache HiCache backend: server %s failed; not calling it for %.1f s",
                self.config.target, self.config.breaker_cooldown_s,
            )  # fmt: skip
