"""The prefill stage: the prompt on a prefill worker with max_tokens 1, for its KV and its hand-off.

Receives the request's body, its report and the upstream headers; hands on the prefill's
kv_transfer_params (None when it had none, or when no prefill worker answered: the request then
goes decode-only, and the report says so). A connection that fails or breaks, a timeout, a 5xx,
408 or 429 tries another prefill worker, up to workers.prefill_attempts in all; a 4xx is the
request's fault and goes back to the client, rebuilt (errors.worker_error).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp

from kvcache_router.errors import worker_error
from kvcache_router.logs import request_extra
from kvcache_router.metrics import RequestReport, RouterMetrics
from kvcache_router.workers import Worker, WorkerPool, failure_reason, note_stale, second_chance

log = logging.getLogger(__name__)

PREFILL_MAX_ANSWER_BYTES = 4 << 20  # a one-token answer; anything larger is not one
LOGGED_ERROR_CHARS = 1000  # of a worker's error body, in the router's log (where a traceback belongs)
_RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx: the worker's trouble, not the request's


class PrefillStage:
    """Runs prompts on the prefill workers.

    Args:
        pool: The prefill workers.
        metrics: Where retries and durations are counted.
        attempts: Prefill workers tried per request (workers.prefill_attempts).
        timeout: One prefill call's deadlines.
    """

    def __init__(
        self, pool: WorkerPool, metrics: RouterMetrics, *, attempts: int, timeout: aiohttp.ClientTimeout
    ) -> None:
        self.pool = pool
        self._metrics = metrics
        self._attempts = attempts
        self._timeout = timeout

    async def run(
        self, session: aiohttp.ClientSession, body: dict[str, Any], report: RequestReport, upstream: dict[str, str]
    ) -> dict[str, Any] | None:
        """The prompt of `body` prefilled; returns its kv_transfer_params.

        Raises:
            WorkerError: a prefill worker refused the request (a 4xx but 408 and 429).
        """
        rid, extra = report.request_id, request_extra(report.request_id)
        query = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        query.update(max_tokens=1, stream=False, n=1)
        if "max_completion_tokens" in query:
            query["max_completion_tokens"] = 1
        path = "/v1/chat/completions" if report.endpoint == "chat" else "/v1/completions"
        tried: list[Worker] = []
        stale: list[Worker] = []
        while len(tried) < self._attempts:
            worker = self.pool.pick(exclude=tried) or second_chance(stale)
            if worker is None:
                break
            if tried:
                self._metrics.prefill_retries.inc()
            tried.append(worker)
            report.prefill_attempts = len(tried)
            started = time.monotonic()
            try:
                with self.pool.serving(worker):
                    url = f"{worker.url}{path}"
                    async with session.post(url, json=query, headers=upstream, timeout=self._timeout) as resp:
                        data = await read_capped(resp, PREFILL_MAX_ANSWER_BYTES)
                        status = resp.status
            except aiohttp.ClientConnectionError as exc:
                log.warning("%s: prefill on %s failed: %s", rid, worker.url, exc, extra=extra)
                note_stale(exc, worker, tried, stale)
                self.pool.failed(worker, failure_reason(exc), eject=isinstance(exc, aiohttp.ClientConnectorError))
                continue
            except ValueError as exc:
                log.warning("%s: prefill on %s: %s", rid, worker.url, exc, extra=extra)
                self.pool.failed(worker, "oversized", eject=False)
                continue
            except TimeoutError:
                log.warning(
                    "%s: prefill on %s timed out after %.1fs", rid, worker.url, self._timeout.total, extra=extra
                )
                self.pool.failed(worker, "timeout", eject=False)
                continue
            if status == 200:
                self._metrics.prefill_seconds.observe(time.monotonic() - started)
                report.prefill_worker = worker.url
                try:
                    params = json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    params = None
                return params if isinstance(params, dict) else None
            if 400 <= status < 500 and status not in _RETRYABLE_STATUS:
                raise worker_error("prefill", status, data)
            log.warning(
                "%s: prefill on %s answered %d: %r", rid, worker.url, status, data[:LOGGED_ERROR_CHARS], extra=extra
            )
            self.pool.failed(worker, f"status_{status}", eject=False)
        report.route = "decode-only"
        report.error = "no prefill worker answered" if tried else "no prefill worker available"
        log.warning("%s: %s; the decode worker computes the prompt", rid, report.error, extra=extra)
        return None


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or ValueError past `cap` bytes."""
    data = bytearray()
    async for piece in resp.content.iter_any():
        data += piece
        if len(data) > cap:
            raise ValueError(f"the answer exceeds {cap} bytes")
    return bytes(data)
