"""The router's request path: OpenAI-compatible endpoints in front of prefill and decode workers.

Per /v1/completions or /v1/chat/completions request (docs/router.md):

    its id, body, JSON and request slot (intake.py)     -> 413 / 408 / 400 / 503 before any worker is asked
    check the model, drop a client's kv_transfer_params -> 404 for an unknown model
    tokenize it on a decode worker (POST /tokenize)     -> 400 when the prompt leaves no room in the context
    Lookup its chunk keys in kvcache (prefix.py)        -> skip prefill when all but the last chunk are stored
    else: a prefill worker, max_tokens 1 (prefill.py)   -> retried on another one; none left: decode only
    the original request (+ the prefill's kv_transfer_params) to a decode worker, its answer streamed
    back byte for byte, with X-KVCache-* headers saying what was done
    a client's retention hint (sessions.py)              -> 400 when malformed; else in both calls'
                                                            kv_transfer_params
    the answer written whole: a Prefetch of the prompt's blocks in the background (sessions.py), when
    kvcache.prefetch_after_turn is on

vLLM's small endpoints (/tokenize, /detokenize, /version, /ping) go through the same intake to a
decode worker, their answers relayed the same way.

Every upstream call has a deadline ([workers] *_timeout_s); a worker that cannot be reached is
ejected (workers.py). Errors are OpenAI-style bodies, {"error": {"message", "type", "param", "code"}};
a worker's error answer keeps its status, its body rebuilt without the worker's internals (errors.py).

Past the project's ~500-line module guideline: this is the one request path above, kept in one reading
order; the pieces with a job of their own live beside it (intake.py, prefix.py, prefill.py,
sessions.py, workers.py, tokens.py, errors.py, logs.py, metrics.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvcache_core.keys import Namespace
from kvcache_router.config import RouterConfig
from kvcache_router.errors import RouterError, openai_errors, worker_error
from kvcache_router.intake import ClientGone, Intake, IntakeLimits, request_id
from kvcache_router.logs import request_extra
from kvcache_router.metrics import RequestReport, RouterMetrics
from kvcache_router.prefill import LOGGED_ERROR_CHARS, PrefillStage, read_capped
from kvcache_router.prefix import PrefixOracle
from kvcache_router.sessions import TurnPrefetcher, retention_hint, with_retention
from kvcache_router.tokens import given_tokens, needs_tokenizer, tokenize
from kvcache_router.workers import Worker, WorkerPool, failure_reason, note_stale, second_chance

log = logging.getLogger(__name__)

_ERROR_MAX_ANSWER_BYTES = 64 << 10  # a worker's error answer, read to be rebuilt; a larger one is not an error body
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_FORWARDED_HEADERS = ("Authorization",)  # a worker's API key (vLLM --api-key) is the client's to give
# vLLM's small endpoints that clients call, proxied to a decode worker: whether each takes a JSON body.
_PROXIED = {"tokenize": True, "detokenize": True, "version": False, "ping": False}


class Router:
    """The aiohttp application and the state it shares: worker pools, the kvcache oracle, metrics.

    Args:
        config: The validated configuration.
        oracle: Lookups in kvcache; None when no kvcache target is configured.
        namespace: The workers' namespace when configured ([namespace]); else read from a worker.
    """

    def __init__(self, config: RouterConfig, oracle: PrefixOracle | None, namespace: Namespace | None) -> None:
        self.config = config
        w, h = config.workers, config.http
        self.metrics = RouterMetrics()
        self.prefill = WorkerPool("prefill", w.prefill, self.metrics, health_failures=w.health_failures)
        self.decode = WorkerPool("decode", w.decode, self.metrics, health_failures=w.health_failures)
        self.oracle = oracle
        if oracle is not None:
            oracle.namespace = namespace
        self.models: set[str] = set()
        limits = IntakeLimits(
            max_body_bytes=h.max_body_bytes,
            body_timeout_s=h.body_timeout_s,
            max_json_depth=h.max_json_depth,
            max_json_containers=h.max_json_containers,
            max_concurrent_bodies=h.max_concurrent_bodies,
            max_concurrent_requests=h.max_concurrent_requests,
            queue_timeout_s=h.queue_timeout_s,
        )
        self.intake = Intake(limits, self.metrics)
        prefill_timeout = aiohttp.ClientTimeout(total=w.prefill_timeout_s, sock_connect=w.connect_timeout_s)
        self.prefill_stage = PrefillStage(
            self.prefill, self.metrics, attempts=w.prefill_attempts, timeout=prefill_timeout
        )
        k = config.kvcache
        self.prefetcher = (
            TurnPrefetcher(
                oracle,
                self.metrics,
                timeout_s=k.prefetch_timeout_s,
                max_keys=k.prefetch_max_keys,
                max_in_flight=k.max_concurrent_prefetches,
            )
            if oracle is not None and k.prefetch_after_turn
            else None
        )
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._namespace_missing_logged = False

    # -- life cycle ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/tokenize", self.proxied)
        app.router.add_post("/detokenize", self.proxied)
        app.router.add_get("/version", self.proxied)
        app.router.add_route("GET", "/ping", self.proxied)
        app.router.add_route("POST", "/ping", self.proxied)  # vLLM answers both (SageMaker's health check)
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
        if self.prefetcher is not None:
            await self.prefetcher.close()
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
            log.warning("the model list from %s failed: %s", worker.url, exc)
            return RouterError(502, "the decode worker's model list failed", code="upstream_error").response()

    async def proxied(self, request: web.Request) -> web.StreamResponse:
        """/tokenize, /detokenize, /version, /ping: on a decode worker (docs/router.md says why that role)."""
        return await self._admit(request, request.path.lstrip("/"))

    # -- completions --------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "chat")

    async def _admit(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        proxied = endpoint in _PROXIED
        rid = request_id(request.headers.get("X-Request-Id"))
        report = RequestReport(rid, endpoint, route="proxy" if proxied else "none")
        start = time.monotonic()
        json_body = _PROXIED.get(endpoint, True)
        try:
            async with self.intake.admit(request, json_body=json_body) as body:
                if proxied:
                    return await self._proxy(request, body if json_body else None, report, start)
                return await self._route(request, self._checked(body), report, start)
        except RouterError as exc:
            return self._done(report, start, exc)
        except ClientGone:
            report.status, report.error = 499, "client_disconnected"  # nginx's code for it; nobody gets it
            self.metrics.client_disconnects.labels(endpoint, "body").inc()
            self._log(report, start, None)
            return web.Response(status=499)

    def _checked(self, body: dict[str, Any]) -> dict[str, Any]:
        """A completion's body, its model checked, a client's kv_transfer_params dropped (unless allowed)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RouterError(400, "model must be a string", code="invalid_model", param="model")
        if model is not None and self.models and model not in self.models:
            raise RouterError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        if "kv_transfer_params" in body and not self.config.http.allow_client_kv_transfer_params:
            # The P/D hand-off is the router's to compute: a client's could point a decode worker at any
            # engine's blocks. Dropped, not refused: clients written for a plain vLLM still work.
            self.metrics.client_kv_params_dropped.inc()
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        return body

    def _done(self, report: RequestReport, start: float, error: RouterError) -> web.Response:
        report.status, report.error = error.status, error.reason
        self._log(report, start, None)
        return error.response(report)

    def _log(self, report: RequestReport, start: float, ttft_s: float | None) -> None:
        self.metrics.finished(report)
        total_s = time.monotonic() - start
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
            total_s,
            f" error={report.error}" if report.error else "",
            extra=request_extra(report.request_id, report.fields(ttft_s=ttft_s, total_s=total_s)),
        )

    def _upstream_headers(self, request: web.Request, report: RequestReport) -> dict[str, str]:
        upstream = {"X-Request-Id": report.request_id}
        upstream.update({h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers})
        return upstream

    async def _route(
        self, request: web.Request, body: dict[str, Any], report: RequestReport, start: float
    ) -> web.StreamResponse:
        chat = report.endpoint == "chat"
        upstream = self._upstream_headers(request, report)
        try:
            body, retain_ttl_s = retention_hint(body, max_ttl_s=self.config.kvcache.max_retain_ttl_s)
            if retain_ttl_s is not None:  # the prefill's call carries it too
                body = {**body, "kv_transfer_params": with_retention(body.get("kv_transfer_params"), retain_ttl_s)}
            kv_params, tokens = await self._prepare(body, report, upstream, chat=chat)
        except RouterError as exc:
            return self._done(report, start, exc)
        if kv_params is not None:
            body = {**body, "kv_transfer_params": with_retention(kv_params, retain_ttl_s)}
        turn_done = None
        if self.prefetcher is not None and tokens:
            salt = body.get("cache_salt")
            turn_done = functools.partial(self.prefetcher.after_turn, tokens, salt if isinstance(salt, str) else "")
        w = self.config.workers
        timeout = aiohttp.ClientTimeout(
            total=w.decode_timeout_s, sock_connect=w.connect_timeout_s, sock_read=w.decode_read_timeout_s
        )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return await self._on_decode_worker(request, "POST", path, body, report, upstream, start, timeout, turn_done)

    async def _proxy(
        self, request: web.Request, body: dict[str, Any] | None, report: RequestReport, start: float
    ) -> web.StreamResponse:
        w = self.config.workers
        total_s = w.tokenize_timeout_s if body is not None else w.health_timeout_s
        timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=w.connect_timeout_s)
        method, path = ("POST" if body is not None else "GET"), f"/{report.endpoint}"
        upstream = self._upstream_headers(request, report)
        return await self._on_decode_worker(request, method, path, body, report, upstream, start, timeout)

    async def _prepare(
        self, body: dict[str, Any], report: RequestReport, upstream: dict[str, str], *, chat: bool
    ) -> tuple[dict[str, Any] | None, list[int] | None]:
        """Everything before decode: tokenize, look up, prefill. Returns the kv_transfer_params to pass
        on, and the prompt's token ids when the tokenizer gave them."""
        tokens = await self._tokens_and_coverage(body, report, upstream, chat=chat)
        if report.route in ("skip", "short"):
            return None, tokens
        return await self.prefill_stage.run(self.session, body, report, upstream), tokens

    async def _tokens_and_coverage(
        self, body: dict[str, Any], report: RequestReport, upstream: dict[str, str], *, chat: bool
    ) -> list[int] | None:
        """Tokenizes the prompt and looks it up; sets the report's tokens, cached tokens and route.
        Returns the prompt's token ids (None without a kvcache server or a tokenizer's answer)."""
        report.route = "prefill"
        if self.oracle is None:
            return None
        started = time.monotonic()
        report.lookup = "failed"
        answer = await self._tokenize(body, upstream, chat=chat)
        if answer is None:
            self.metrics.lookup_failures.labels("tokenize").inc()
            return None
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
            return tokens
        report.lookup = "ok"
        report.cached_tokens = coverage.cached_tokens
        if coverage.skip_prefill:
            report.route = "short" if coverage.too_short else "skip"
        return tokens

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
            log.warning("tokenize on %s failed: %s", worker.url, exc, extra=request_extra(upstream["X-Request-Id"]))
            (self.decode if worker.role == "decode" else self.prefill).failed(worker, "connect", eject=True)
            return None

    async def _on_decode_worker(
        self,
        request: web.Request,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        report: RequestReport,
        upstream: dict[str, str],
        start: float,
        timeout: aiohttp.ClientTimeout,
        turn_done: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """The call on a decode worker; its answer streamed back (an error rebuilt), the report in the headers;
        `turn_done` called once a successful answer was written whole."""
        rid, extra = report.request_id, request_extra(report.request_id)
        tried: list[Worker] = []
        stale: list[Worker] = []
        while True:
            worker = self.decode.pick(exclude=tried) or second_chance(stale)
            if worker is None:
                message = "no decode worker answered" if tried else "no decode worker is available"
                return self._done(report, start, RouterError(503, message, code="no_worker"))
            tried.append(worker)
            try:
                with self.decode.serving(worker):
                    url = f"{worker.url}{path}"
                    async with self.session.request(method, url, json=body, headers=upstream, timeout=timeout) as resp:
                        report.decode_worker = worker.url
                        if resp.status >= 400:
                            return await self._decode_refused(resp, worker, report, start)
                        return await self._relay(request, resp, worker, report, start, turn_done)
            except aiohttp.ClientConnectionError as exc:
                # Nothing reached the client: the same worker (a stale connection) or another may take it.
                log.warning("%s: decode on %s failed: %s", rid, worker.url, exc, extra=extra)
                note_stale(exc, worker, tried, stale)
                self.decode.failed(worker, failure_reason(exc), eject=isinstance(exc, aiohttp.ClientConnectorError))
            except TimeoutError:
                self.decode.failed(worker, "timeout", eject=False)
                error = RouterError(504, "the decode worker did not answer within its deadline", code="timeout")
                return self._done(report, start, error)
            except aiohttp.ClientError as exc:
                log.warning("%s: decode on %s failed: %s", rid, worker.url, exc, extra=extra)
                self.decode.failed(worker, "error", eject=False)
                error = RouterError(502, "the decode worker failed", code="upstream_error")
                return self._done(report, start, error)

    async def _decode_refused(
        self, resp: aiohttp.ClientResponse, worker: Worker, report: RequestReport, start: float
    ) -> web.Response:
        """A decode worker's error answer, rebuilt (errors.worker_error); a 5xx counts as its failure."""
        try:
            data = await read_capped(resp, _ERROR_MAX_ANSWER_BYTES)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            data = b""  # too large or broken: not a well-formed error either
        if resp.status >= 500:
            log.warning(
                "%s: decode on %s answered %d: %r",
                report.request_id,
                worker.url,
                resp.status,
                data[:LOGGED_ERROR_CHARS],
                extra=request_extra(report.request_id),
            )
            self.decode.failed(worker, f"status_{resp.status}", eject=False)
        return self._done(report, start, worker_error("decode", resp.status, data))

    async def _relay(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        worker: Worker,
        report: RequestReport,
        start: float,
        turn_done: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """The worker's answer as it comes. A worker that breaks it off is the worker's failure ("cut"); a
        client that goes away is the client's (client_disconnects), and leaving the upstream call closes it."""
        ttft_s = time.monotonic() - start
        report.status = resp.status
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.update(report.headers())
        out = web.StreamResponse(status=resp.status, headers=headers)
        try:
            await out.prepare(request)
            if report.route != "proxy":
                self.metrics.ttft.labels(report.route).observe(ttft_s)
            broke = await _pipe(resp, out)
            if broke is not None:
                # Cut mid-answer: the status is sent; end an event stream with an error event, as vLLM does.
                report.error = f"decode answer cut: {type(broke).__name__}"
                self.decode.failed(worker, "cut", eject=False)
                if resp.content_type == "text/event-stream":
                    error = RouterError(500, report.error, code="upstream_error")
                    event = {"error": {"message": report.error, "type": error.kind, "param": None, "code": error.code}}
                    await out.write(f"data: {json.dumps(event)}\n\n".encode())
            await out.write_eof()
            if broke is None and turn_done is not None:
                turn_done()  # after the answer's last byte: nothing of it waits for this
        except ConnectionError:  # a write to the client failed: it went away
            report.error = "client_disconnected"
            self.metrics.client_disconnects.labels(report.endpoint, "answer").inc()
        self._log(report, start, ttft_s)
        return out


async def _pipe(resp: aiohttp.ClientResponse, out: web.StreamResponse) -> Exception | None:
    """Copies the worker's answer to the client. Returns why the worker's side broke off, None when it ended.

    Raises:
        ConnectionError: a write to the client failed (aiohttp's ClientConnectionResetError is one).
    """
    while True:
        try:
            piece = await resp.content.readany()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:  # only the read: the worker's side
            return exc
        if not piece:
            return None
        await out.write(piece)
