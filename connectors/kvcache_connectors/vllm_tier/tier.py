"""KVCacheTier: kvcache as a secondary tier below vLLM's own CPU tier (vLLM 0.33 offloading tiering).

vLLM's OffloadingConnector keeps chunks in its primary CPU buffer and cascades them to secondary
tiers (vllm/v1/kv_offload/tiering/base.py). This tier moves whole chunks (rows of that buffer)
between it and a kvcache server, through the SDK's transports: in place through the server's
block arena on the same host, over the bulk port elsewhere. Every method runs in the scheduler
process under the tiering manager's lock and returns at once; the calls to the server run on
three threads of this tier:

    lookups   vLLM's AsyncLookupManager thread: one batch per request and step, one Lookup per
              KV-cache group (sliding-window groups: per key past the first miss, since their
              early chunks may be out of the window and never stored)
    loads     one job per submit_load: Get into the promoted primary rows (get_into)
    stores    one job per submit_store: Put of the cascaded primary rows

A job always reports a JobResult: found keys are its successful_keys, a missing or corrupt
block or a failed call fails the rest, and those keys' cached lookup verdicts turn to misses
(so vLLM does not promote them again). Bytes are never half-trusted: a row a failed load wrote
into is released as not written, and every block is checked against its key-bound checksum.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache_client import KVCacheClient, KVCacheError
from kvcache_client.retry import NO_RETRY
from kvcache_connectors.engine_keys import EngineNamespace
from kvcache_connectors.vllm.transfers import Job, JobThread
from kvcache_connectors.vllm_tier.config import KVCacheTierConfig
from kvcache_connectors.vllm_tier.namespace import vllm_namespace
from kvcache_core.breaker import CircuitBreaker
from kvcache_core.errors import BlockFormatError

log = logging.getLogger(__name__)

# Errors of a call to the server that make a job fail (or a lookup miss): the server's statuses,
# an unreachable server past the deadline, a broken socket of the bulk path.
CALL_ERRORS = (KVCacheError, OSError)


class ServerSkipped(Exception):
    """A job not attempted: the server failed recently and the breaker is open."""


class TierMetrics:
    """Counter names this tier emits through get_stats (declared by build_metric_definitions)."""

    LOOKUP_FAILURES = "vllm:kv_offload_kvcache_lookup_failures"
    LOAD_MISSING_CHUNKS = "vllm:kv_offload_kvcache_load_missing_chunks"
    LOAD_FAILED_JOBS = "vllm:kv_offload_kvcache_load_failed_jobs"
    STORE_FAILED_JOBS = "vllm:kv_offload_kvcache_store_failed_jobs"
    STORED_CHUNKS = "vllm:kv_offload_kvcache_stored_chunks"
    LOADED_CHUNKS = "vllm:kv_offload_kvcache_loaded_chunks"

    DOCS: ClassVar[dict[str, str]] = {
        LOOKUP_FAILURES: "Batched kvcache lookups that failed or timed out (their chunks were misses).",
        LOAD_MISSING_CHUNKS: "Chunks a kvcache load did not find (evicted since the lookup, or corrupt).",
        LOAD_FAILED_JOBS: "kvcache load jobs that did not load every chunk (a failed call or a missing chunk).",
        STORE_FAILED_JOBS: "kvcache store jobs that failed (a failed call, or a block the server refused).",
        STORED_CHUNKS: "Chunks stored in kvcache.",
        LOADED_CHUNKS: "Chunks loaded from kvcache into the CPU tier.",
    }


@dataclass(frozen=True)
class KVCacheTierInfo(ConfigInfo):
    """The tier's static facts on vllm:kv_offload_config_info."""

    kvcache_target: str
    kvcache_namespace: str


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup front end; batch_lookup runs on its thread, one request's keys at a time."""

    def __init__(self, tier: KVCacheTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.lookup_batch(keys, req_context)


class KVCacheTier(SecondaryTierManager):
    """Stores vLLM's offload chunks in kvcache. Options: KVCacheTierConfig (the tier entry's keys)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    # A shared remote store (RAM, then Redis, then S3) is none of vLLM's named sources; its enum's
    # fallback says exactly that. Set here so base class does not derive DISK from the medium.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        """Built by vLLM's SecondaryTierFactory from the tier entry; `options` are its other keys.

        Raises:
            ValueError: an unknown or invalid option (KVCacheTierConfig.from_options).
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = KVCacheTierConfig.from_options(options)
        self.locality = Locality(self.config.locality) if self.config.locality is not None else None
        self.namespace: EngineNamespace = vllm_namespace(
            offloading_spec,
            chunk_bytes=self.block_size_bytes,
            model_revision=self.config.model_revision,
            extra=self.config.namespace_extra,
        )
        self._ns = self.namespace.name
        self._rows = primary_kv_view.cast("B")  # chunk c is bytes [c * row, (c + 1) * row)
        self._sliding_groups = frozenset(
            g.group_id for g in offloading_spec.config.groups if g.sliding_window_size_in_chunks is not None
        )
        self._events: list[OffloadingEvent] | None = None
        if self.config.enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self._events = []
            else:
                log.warning("enable_kv_events is set on the kvcache tier but vLLM's KV cache events are off")

        # One attempt per call and a breaker, as the connector's: a dead server costs one timeout per
        # cooldown, not one per job (with retries, 64 queued jobs waited out 5 s each at shutdown).
        cooldown = self.config.breaker_cooldown_s
        self._breaker = CircuitBreaker(failure_threshold=1, reset_s=cooldown, max_reset_s=cooldown)
        self._breaker_lock = threading.Lock()
        self._client = KVCacheClient(
            self.config.target,
            timeout_s=self.config.timeout_s,
            retry=NO_RETRY,
            shm=self.config.shm,
            bulk=self.config.bulk,
            token=self.config.token,
        )
        self._loads = JobThread("kvcache-tier-load", self.config.max_queued_jobs)
        self._stores = JobThread("kvcache-tier-store", self.config.max_queued_jobs)
        # Written by the job threads, taken by the scheduler thread (get_finished_jobs, get_stats).
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._counts: dict[str, int] = {}
        # Scheduler-thread state: jobs submitted and not yet returned, and their keys.
        self._pending: dict[JobId, tuple[bool, list[OffloadKey]]] = {}
        self._lookups = _Lookups(self)
        log.info("kvcache tier: server %s, namespace %s", self.config.target, self._ns)

    # -- lookups ---------------------------------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def lookup_batch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> list[bool]:
        """Whether each key is stored (lookup thread): one Lookup per group, in prefix order.

        Keys of a group are sorted by the token position vLLM records for them, so the server's
        longest-stored-prefix answer is the keys' answer for full-attention groups (their loads
        stop at the first miss anyway). A failed call makes every key of the batch a miss.
        """
        kv_keys = self.namespace.keys(keys)
        by_group: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_group.setdefault(get_offload_group_idx(key), []).append(i)
        hits = [False] * len(keys)
        if not self._allow():
            self._count(TierMetrics.LOOKUP_FAILURES)
            return hits
        try:
            for group, indices in by_group.items():
                order = sorted(indices, key=lambda i: _position(req_context, keys[i], i))
                prefix = self._client.lookup(
                    self._ns, [kv_keys[i] for i in order], timeout_s=self.config.lookup_timeout_s
                ).prefix_length
                for i in order[:prefix]:
                    hits[i] = True
                if group in self._sliding_groups:
                    for i in order[prefix + 1 :]:  # the first miss is a miss; the rest one by one
                        found = self._client.lookup(self._ns, [kv_keys[i]], timeout_s=self.config.lookup_timeout_s)
                        hits[i] = found.prefix_length == 1
        except CALL_ERRORS as exc:
            self._failed()
            log.warning("kvcache lookup of %d chunks failed (misses): %s", len(keys), exc)
            self._count(TierMetrics.LOOKUP_FAILURES)
            return [False] * len(keys)
        self._succeeded()
        return hits

    # -- the breaker (lookup and job threads) ------------------------------------------------------

    def _allow(self) -> bool:
        with self._breaker_lock:
            return self._breaker.allow()

    def _succeeded(self) -> None:
        with self._breaker_lock:
            self._breaker.success()

    def _failed(self) -> None:
        with self._breaker_lock:
            opened = self._breaker.failure()
        if opened:
            cooldown = self._breaker.cooldown_s
            log.warning("kvcache tier: server %s failed; not calling it for %.1f s", self.config.target, cooldown)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    # -- jobs ------------------------------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._pending[job_id] = (False, keys)

        def run() -> None:
            started = time.monotonic()
            ok = False
            try:
                if not self._allow():
                    raise ServerSkipped(f"server {self.config.target} failed recently (breaker open)")
                kv_keys = self.namespace.keys(keys)
                payloads = [self._row(r) for r in rows]
                for payload in payloads:
                    if len(payload) != self.block_size_bytes:
                        raise BlockFormatError(f"a row of {len(payload)} bytes for blocks of {self.block_size_bytes}")
                try:
                    result = self._client.put_payloads(  # on the same host the server checksums what it reads
                        self._ns,
                        kv_keys,
                        payloads,
                        timeout_s=self._job_timeout_s(len(kv_keys) * self.block_size_bytes),
                        retain_ttl_s=self.config.retain_ttl_s,
                    )
                except CALL_ERRORS:
                    self._failed()
                    raise
                self._succeeded()
                ok = result.stored == len(kv_keys)
                if not ok:
                    log.warning("kvcache stored %d of %d chunks (job %d)", result.stored, len(kv_keys), job_id)
            except (*CALL_ERRORS, ServerSkipped) as exc:
                log.warning("kvcache store of %d chunks failed (job %d): %s", len(keys), job_id, exc)
            finally:  # always a result, even on a bug (re-raised after, JobThread logs it)
                self._count(TierMetrics.STORED_CHUNKS if ok else TierMetrics.STORE_FAILED_JOBS, len(keys) if ok else 1)
                self._finish(JobResult(job_id, ok, None, time.monotonic() - started, len(keys) * self.block_size_bytes))

        self._submit(self._stores, job_id, run)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._pending[job_id] = (True, keys)

        def run() -> None:
            started = time.monotonic()
            found = [False] * len(keys)
            try:
                if not self._allow():
                    raise ServerSkipped(f"server {self.config.target} failed recently (breaker open)")
                try:
                    found = self._client.get_into(
                        self._ns,
                        self.namespace.keys(keys),
                        [self._row(r) for r in rows],
                        timeout_s=self._job_timeout_s(len(keys) * self.block_size_bytes),
                    )
                except CALL_ERRORS:
                    self._failed()
                    raise
                self._succeeded()
            except (*CALL_ERRORS, ServerSkipped) as exc:
                log.warning("kvcache load of %d chunks failed (job %d): %s", len(keys), job_id, exc)
            finally:
                loaded = [k for k, hit in zip(keys, found, strict=True) if hit]
                ok = len(loaded) == len(keys)
                self._count(TierMetrics.LOADED_CHUNKS, len(loaded))
                if not ok:
                    self._count(TierMetrics.LOAD_FAILED_JOBS)
                    self._count(TierMetrics.LOAD_MISSING_CHUNKS, len(keys) - len(loaded))
                self._finish(
                    JobResult(
                        job_id,
                        ok,
                        None if ok or not loaded else tuple(loaded),
                        time.monotonic() - started,
                        len(loaded) * self.block_size_bytes,
                    )
                )

        self._submit(self._loads, job_id, run)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        for result in finished:
            is_load, keys = self._pending.pop(result.job_id)
            if is_load and not result.success:
                # Keys it did not load are misses from now on, so vLLM does not promote them again.
                loaded = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in loaded])
            elif not is_load and result.success and self._events is not None:
                self._events.append(
                    OffloadingEvent(keys=keys, medium=self.medium, removed=False, locality=self.locality)
                )
        return finished

    @override
    def has_pending_work(self) -> bool:
        return bool(self._pending)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    @override
    def drain_jobs(self) -> None:
        """Waits for every queued and running job (each is bounded by timeout_s); never aborts one."""
        for name, jobs in (("load", self._loads), ("store", self._stores)):
            while not jobs.idle(10.0):
                log.warning("kvcache tier: still waiting for %s jobs to finish", name)

    @override
    def shutdown(self) -> None:
        """Fails the queued jobs, waits for the running ones, stops the lookup thread, closes the client."""
        self._loads.close()
        self._stores.close()
        self.drain_jobs()
        self._lookups.shutdown()
        self._client.close()
        # No job uses the rows any more: let vLLM unmap its CPU region (an exported view kept it mapped).
        self._rows.release()

    # -- metrics ---------------------------------------------------------------------------------

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc) for name, doc in TierMetrics.DOCS.items()}

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for name, value in counts.items():
            stats.increase_counter(name, value)
        return stats

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return KVCacheTierInfo.config_info_keys()

    @override
    def config_info(self) -> ConfigInfoMapping:
        return KVCacheTierInfo(kvcache_target=self.config.target, kvcache_namespace=self._ns).as_config_info()

    # -- helpers ---------------------------------------------------------------------------------

    def _job_timeout_s(self, nbytes: int) -> float:
        """A job's deadline: timeout_s, plus its bytes at the slowest rate it is given time for."""
        return self.config.timeout_s + nbytes / self.config.min_rate_bytes_s

    def _row(self, chunk_id: int) -> memoryview:
        start = chunk_id * self.block_size_bytes
        return self._rows[start : start + self.block_size_bytes]

    def _submit(self, jobs: JobThread, job_id: JobId, run: Callable[[], None]) -> None:
        def drop() -> None:  # queued but never run (the tier shut down): a failure, still reported
            self._finish(JobResult(job_id, False))

        if not jobs.submit(Job(run=run, drop=drop)):
            log.warning("kvcache tier: job queue full or closed, job %d fails", job_id)
            drop()

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._finished.append(result)

    def _count(self, name: str, value: int = 1) -> None:
        if value:
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + value


def _position(req_context: ReqContext, key: OffloadKey, index: int) -> tuple[int, int]:
    position = req_context.get_offload_key_position(key)
    return (position if position is not None else 1 << 62, index)
