"""The router's request path: OpenAI-compatible endpoints in front of prefill and decode workers.

Per /v1/completions or /v1/chat/completions request (docs/router.md):

    read the body (at most http.max_body_bytes)        -> 413 / 400 on a bad body, 404 for an unknown model
    tokenize it on a decode worker (POST /tokenize)     -> 400 when the prompt leaves no room in the context
    Lookup its chunk keys in kvcache (prefix.py)        -> skip prefill when all but the last chunk are stored
    else: a prefill worker, max_tokens 1                -> retried on another one; none left: decode only
    the original request (+ the prefill's kv_transfer_params) to a decode worker, its answer streamed
    back byte for byte, with X-KVCache-* headers saying what was done

Every upstream call has a deadline ([workers] *_timeout_s); a worker that cannot be reached is
ejected (workers.py). Errors are OpenAI-style bodies, {"error": {"message", "type", "param", "code"}};
a worker's own 4xx answer reaches the client unchanged.

At the project's ~500-line module guideline: this is the one request path above, kept in one reading
order; the pieces with a job of their own live beside it (prefix.py, workers.py, tokens.py,
errors.py, metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvcache_core.keys import Namespace
from kvcache_router.config import RouterConfig
from kvcache_router.errors import RouterError, UpstreamAnswer, openai_errors
from kvcache_router.metrics import RequestReport, RouterMetrics
from kvcache_router.prefix import PrefixOracle
from kvcache_router.tokens import given_tokens, needs_tokenizer, tokenize
from kvcache_router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

_PREFILL_MAX_ANSWER_BYTES = 4 << 20  # a one-token answer; anything larger is not one
_RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx: the worker's trouble, not the request's
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_FORWARDED_HEADERS = ("Authorization",)  # a worker's API key (vLLM --api-key) is the client's to give


class Router:
    """The aiohttp application and the state it shares: worker pools, the kvcache oracle, metrics.

    Args:
        config: The validated configuration.
        oracle: Lookups in kvcache; None when no kvcache target is configured.
        namespace: The workers' namespace when configured ([namespace]); else read from a worker.
    """

    def __init__(self, config: RouterConfig, oracle: PrefixOracle | None, namespace: Namespace | None) -> None:
        self.config = config
        w = config.workers
        self.metrics = RouterMetrics()
        self.prefill = WorkerPool("prefill", w.prefill, self.metrics, health_failures=w.health_failures)
        self.decode = WorkerPool("decode", w.decode, self.metrics, health_failures=w.health_failures)
        self.oracle = oracle
        if oracle is not None:
            oracle.namespace = namespace
        self.models: set[str] = set()
        self._slots = asyncio.Semaphore(config.http.max_concurrent_requests)
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._namespace_missing_logged = False

    # -- life cycle ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router's app has not started")
        return self._session

    async def _start(self, _: web.Application) -> None:
        # No connection limit of the session's own: http.max_concurrent_requests bounds the calls.
        # Bodies are relayed as they come: no decompression here, and none asked of the workers.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False, headers={"Accept-Encoding": "identity"}
        )
        await self.check_workers()
        self._health_task = asyncio.create_task(self._health_loop(), name="health-checks")

    async def _stop(self, _: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.oracle is not None:
            await self.oracle.client.close()

    async def check_workers(self) -> None:
        """One round of health checks, then what the workers serve (models, the namespace)."""
        w = self.config.workers
        await asyncio.gather(
            self.prefill.check(self.session, w.health_timeout_s), self.decode.check(self.session, w.health_timeout_s)
        )
        await self._learn_models()
        if self.oracle is not None and self.oracle.namespace is None:
            await self._learn_namespace()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.workers.health_interval_s)
            await self.check_workers()

    async def _get_json(self, worker: Worker, path: str) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.config.workers.health_timeout_s)
        async with self.session.get(f"{worker.url}{path}", timeout=timeout) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            return await resp.json(content_type=None)

    async def _learn_models(self) -> None:
        async def models_of(worker: Worker) -> list[str]:
            try:
                return [card["id"] for card in (await self._get_json(worker, "/v1/models"))["data"]]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                log.debug("no model list from %s: %s", worker.url, exc)
                return []

        lists = await asyncio.gather(*(models_of(w) for w in (*self.decode.healthy(), *self.prefill.healthy())))
        models = {name for names in lists for name in names}
        if models:  # none answered: keep what was known
            self.models = models

    async def _learn_namespace(self) -> None:
        assert self.oracle is not None
        for worker in self.decode.healthy():
            try:
                self.oracle.namespace = Namespace(**(await self._get_json(worker, "/kvcache/namespace")))
            except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
                # Once at warning level: a vLLM worker never has it, and the checks run every few seconds.
                level = logging.DEBUG if self._namespace_missing_logged else logging.WARNING
                self._namespace_missing_logged = True
                log.log(level, "no kvcache namespace from %s (set [namespace] for vLLM workers): %s", worker.url, exc)
                continue
            log.info("kvcache namespace %s from %s", self.oracle.namespace.name, worker.url)
            return

    # -- small endpoints ----------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        """200 while a decode worker is in rotation (prefill workers are optional: decode-only fallback)."""
        state = {
            role: {w.url: {"healthy": w.healthy, "outstanding": w.outstanding} for w in pool.workers}
            for role, pool in (("prefill", self.prefill), ("decode", self.decode))
        }
        ok = bool(self.decode.healthy())
        return web.json_response({"status": "ok" if ok else "unavailable", "workers": state}, status=200 if ok else 503)

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def list_models(self, _: web.Request) -> web.Response:
        worker = self.decode.pick()
        if worker is None:
            return RouterError(503, "no decode worker is available", code="no_worker").response()
        try:
            return web.json_response(await self._get_json(worker, "/v1/models"))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return RouterError(502, f"the model list failed: {exc}", code="upstream_error").response()

    # -- completions --------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "chat")

    async def _admit(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        report = RequestReport(request.headers.get("X-Request-Id") or uuid.uuid4().hex, endpoint)
        start = time.monotonic()
        try:
            async with asyncio.timeout(self.config.http.queue_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            return self._done(report, start, RouterError(503, "the router is at capacity", code="overloaded"))
        try:
            return await self._route(request, report, start)
        finally:
            self._slots.release()

    def _done(self, report: RequestReport, start: float, outcome: RouterError | UpstreamAnswer) -> web.Response:
        report.status = outcome.status
        if isinstance(outcome, RouterError):
            report.error = outcome.code
            response = outcome.response(report)
        else:
            report.error = "upstream_rejected"
            response = web.Response(
                body=outcome.body,
                status=outcome.status,
                headers={"Content-Type": outcome.content_type, **report.headers()},
            )
        self._log(report, start, None)
        return response

    def _log(self, report: RequestReport, start: float, ttft_s: float | None) -> None:
        self.metrics.finished(report)
        log.info(
            "%s %s %d route=%s prompt_tokens=%s cached_tokens=%s lookup=%s prefill=%s attempts=%d decode=%s "
            "ttft_s=%s total_s=%.3f%s",
            report.request_id,
            report.endpoint,
            report.status,
            report.route,
            report.prompt_tokens,
            report.cached_tokens,
            report.lookup,
            report.prefill_worker or "-",
            report.prefill_attempts,
            report.decode_worker or "-",
            f"{ttft_s:.3f}" if ttft_s is not None else "-",
            time.monotonic() - start,
            f" error={report.error}" if report.error else "",
        )

    async def _route(self, request: web.Request, report: RequestReport, start: float) -> web.StreamResponse:
        chat = report.endpoint == "chat"
        upstream = {"X-Request-Id": report.request_id}
        upstream.update({h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers})
        try:
            body = await self._read_body(request)
            kv_params = await self._prepare(body, report, upstream, chat=chat)
        except (RouterError, UpstreamAnswer) as exc:
            return self._done(report, start, exc)
        if kv_params is not None:
            body = {**body, "kv_transfer_params": kv_params}
        return await self._decode(request, body, report, upstream, start)

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        cap = self.config.http.max_body_bytes
        too_large = RouterError(413, f"the request body exceeds {cap} bytes", code="request_too_large")
        if request.content_length is not None and request.content_length > cap:
            raise too_large
        data = bytearray()
        async for piece in request.content.iter_chunked(1 << 16):
            data += piece
            if len(data) > cap:
                raise too_large
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RouterError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RouterError(400, "the body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RouterError(400, "model must be a string", code="invalid_model", param="model")
        if model is not None and self.models and model not in self.models:
            raise RouterError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return body

    async def _prepare(
        self, body: dict[str, Any], report: RequestReport, upstream: dict[str, str], *, chat: bool
    ) -> dict[str, Any] | None:
        """Everything before decode: tokenize, look up, prefill. Returns the kv_transfer_params to pass on."""
        await self._tokens_and_coverage(body, report, upstream, chat=chat)
        if report.route == "skip":
            return None
        return await self._prefill(body, report, upstream)

    async def _tokens_and_coverage(
        self, body: dict[str, Any], report: RequestReport, upstream: dict[str, str], *, chat: bool
    ) -> None:
        """Tokenizes the prompt and looks it up; sets the report's tokens, cached tokens and route."""
        report.route = "prefill"
        if self.oracle is None:
            return
        started = time.monotonic()
        report.lookup = "failed"
        answer = await self._tokenize(body, upstream, chat=chat)
        if answer is None:
            self.metrics.lookup_failures.labels("tokenize").inc()
            return
        tokens, max_model_len = answer
        report.prompt_tokens = len(tokens)
        requested = body.get("max_completion_tokens") if chat else None
        requested = requested if requested is not None else body.get("max_tokens")
        requested = requested if isinstance(requested, int) and not isinstance(requested, bool) else 1
        if max_model_len and len(tokens) + max(requested, 1) > max_model_len:
            raise RouterError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(tokens) + max(requested, 1)} tokens ({len(tokens)} in the prompt, {max(requested, 1)} "
                "in the completion). Please reduce the length of the prompt or the completion.",
                code="context_length_exceeded",
                param="messages" if chat else "prompt",
            )
        salt = body.get("cache_salt")
        coverage = await self.oracle.coverage(tokens, cache_salt=salt if isinstance(salt, str) else "")
        self.metrics.lookup_seconds.observe(time.monotonic() - started)
        if coverage is None:
            self.metrics.lookup_failures.labels("lookup").inc()
            return
        report.lookup = "ok"
        report.cached_tokens = coverage.cached_tokens
        if coverage.skip_prefill:
            report.route = "skip"

    async def _tokenize(
        self, body: dict[str, Any], upstream: dict[str, str], *, chat: bool
    ) -> tuple[list[int], int] | None:
        """The prompt's token ids and context length (tokens.py); None when there are none."""
        given = given_tokens(body, chat=chat)
        if given is not None or not needs_tokenizer(body, chat=chat):
            return (given, 0) if given is not None else None
        worker = self.decode.pick() or self.prefill.pick()
        if worker is None:
            return None
        w = self.config.workers
        timeout = aiohttp.ClientTimeout(total=w.tokenize_timeout_s, sock_connect=w.connect_timeout_s)
        try:
            return await tokenize(self.session, worker.url, body, chat=chat, headers=upstream, timeout=timeout)
        except aiohttp.ClientConnectionError as exc:
            log.warning("tokenize on %s failed: %s", worker.url, exc)
            (self.decode if worker.role == "decode" else self.prefill).failed(worker, "connect", eject=True)
            return None

    async def _prefill(
        self, body: dict[str, Any], report: RequestReport, upstream: dict[str, str]
    ) -> dict[str, Any] | None:
        """The prompt on a prefill worker, max_tokens 1; another worker on failure; decode-only when none is left."""
        w = self.config.workers
        query = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        query.update(max_tokens=1, stream=False, n=1)
        if "max_completion_tokens" in query:
            query["max_completion_tokens"] = 1
        path = "/v1/chat/completions" if report.endpoint == "chat" else "/v1/completions"
        timeout = aiohttp.ClientTimeout(total=w.prefill_timeout_s, sock_connect=w.connect_timeout_s)
        tried: list[Worker] = []
        stale: list[Worker] = []
        while len(tried) < w.prefill_attempts:
            worker = self.prefill.pick(exclude=tried) or _second_chance(stale)
            if worker is None:
                break
            if tried:
                self.metrics.prefill_retries.inc()
            tried.append(worker)
            report.prefill_attempts = len(tried)
            started = time.monotonic()
            try:
                with self.prefill.serving(worker):
                    url = f"{worker.url}{path}"
                    async with self.session.post(url, json=query, headers=upstream, timeout=timeout) as resp:
                        data = await _read_capped(resp, _PREFILL_MAX_ANSWER_BYTES)
                        status, content_type = resp.status, resp.content_type
            except aiohttp.ClientConnectionError as exc:
                log.warning("%s: prefill on %s failed: %s", report.request_id, worker.url, exc)
                _note_stale(exc, worker, tried, stale)
                self.prefill.failed(worker, _reason(exc), eject=isinstance(exc, aiohttp.ClientConnectorError))
                continue
            except ValueError as exc:
                log.warning("%s: prefill on %s: %s", report.request_id, worker.url, exc)
                self.prefill.failed(worker, "oversized", eject=False)
                continue
            except TimeoutError:
                log.warning(
                    "%s: prefill on %s timed out after %.1fs", report.request_id, worker.url, w.prefill_timeout_s
                )
                self.prefill.failed(worker, "timeout", eject=False)
                continue
            if status == 200:
                self.metrics.prefill_seconds.observe(time.monotonic() - started)
                report.prefill_worker = worker.url
                try:
                    params = json.loads(data).get("kv_transfer_params")
                except (ValueError, AttributeError):
                    params = None
                return params if isinstance(params, dict) else None
            if 400 <= status < 500 and status not in _RETRYABLE_STATUS:
                raise UpstreamAnswer(status, data, content_type)
            log.warning("%s: prefill on %s answered %d", report.request_id, worker.url, status)
            self.prefill.failed(worker, f"status_{status}", eject=False)
        report.route = "decode-only"
        report.error = "no prefill worker answered" if tried else "no prefill worker available"
        log.warning("%s: %s; the decode worker computes the prompt", report.request_id, report.error)
        return None

    async def _decode(
        self, request: web.Request, body: dict[str, Any], report: RequestReport, upstream: dict[str, str], start: float
    ) -> web.StreamResponse:
        """The request on a decode worker; its answer streamed back unchanged, the report in the headers."""
        w = self.config.workers
        timeout = aiohttp.ClientTimeout(
            total=w.decode_timeout_s, sock_connect=w.connect_timeout_s, sock_read=w.decode_read_timeout_s
        )
        path = "/v1/chat/completions" if report.endpoint == "chat" else "/v1/completions"
        tried: list[Worker] = []
        stale: list[Worker] = []
        while True:
            worker = self.decode.pick(exclude=tried) or _second_chance(stale)
            if worker is None:
                message = "no decode worker answered" if tried else "no decode worker is available"
                return self._done(report, start, RouterError(503, message, code="no_worker"))
            tried.append(worker)
            try:
                with self.decode.serving(worker):
                    url = f"{worker.url}{path}"
                    async with self.session.post(url, json=body, headers=upstream, timeout=timeout) as resp:
                        report.decode_worker = worker.url
                        return await self._relay(request, resp, worker, report, start)
            except aiohttp.ClientConnectionError as exc:
                # Nothing reached the client: the same worker (a stale connection) or another may take it.
                log.warning("%s: decode on %s failed: %s", report.request_id, worker.url, exc)
                _note_stale(exc, worker, tried, stale)
                self.decode.failed(worker, _reason(exc), eject=isinstance(exc, aiohttp.ClientConnectorError))
            except TimeoutError:
                self.decode.failed(worker, "timeout", eject=False)
                error = RouterError(
                    504, f"the decode worker sent nothing for {w.decode_read_timeout_s}s", code="timeout"
                )
                return self._done(report, start, error)
            except aiohttp.ClientError as exc:
                self.decode.failed(worker, "error", eject=False)
                return self._done(
                    report, start, RouterError(502, f"the decode worker failed: {exc}", code="upstream_error")
                )

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, worker: Worker, report: RequestReport, start: float
    ) -> web.StreamResponse:
        ttft_s = time.monotonic() - start
        report.status = resp.status
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.update(report.headers())
        out = web.StreamResponse(status=resp.status, headers=headers)
        await out.prepare(request)
        self.metrics.ttft.labels(report.route).observe(ttft_s)
        try:
            try:
                async for piece in resp.content.iter_any():
                    await out.write(piece)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Cut mid-answer: the status is sent; end an event stream with an error event, as vLLM does.
                report.error = f"decode answer cut: {type(exc).__name__}"
                self.decode.failed(worker, "cut", eject=False)
                if resp.content_type == "text/event-stream":
                    event = {
                        "error": {
                            "message": report.error,
                            "type": "server_error",
                            "param": None,
                            "code": "upstream_error",
                        }
                    }
                    await out.write(f"data: {json.dumps(event)}\n\n".encode())
            await out.write_eof()
        except ConnectionError:  # the client went away: leaving the upstream call closes it too
            report.error = "the client disconnected"
        self._log(report, start, ttft_s)
        return out


def _note_stale(exc: aiohttp.ClientConnectionError, worker: Worker, tried: list[Worker], stale: list[Worker]) -> None:
    """Keeps `worker` for one more try when no other is left, if it closed the connection before answering
    for the first time in this request. That is how a kept-alive connection looks when the worker closed
    it just as the request went out (uvicorn, vLLM's server, closes idle ones after 5 s); a second time,
    or a refused or reset connection, is the worker's trouble.
    """
    if isinstance(exc, aiohttp.ServerDisconnectedError) and tried.count(worker) == 1:
        stale.append(worker)


def _second_chance(stale: list[Worker]) -> Worker | None:
    """A worker kept by _note_stale that is still in rotation, taken once."""
    while stale:
        worker = stale.pop(0)
        if worker.healthy:
            return worker
    return None


def _reason(exc: aiohttp.ClientConnectionError) -> str:
    """The metrics' name for a connection failure: refused (down), or closed or reset mid-call (dying)."""
    return "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnect"


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or ValueError past `cap` bytes."""
    data = bytearray()
    async for piece in resp.content.iter_any():
        data += piece
        if len(data) > cap:
            raise ValueError(f"the answer exceeds {cap} bytes")
    return bytes(data)
