"""kvcache-router against hostile and clumsy clients (issue #23): real processes, real sockets.

Two fake vLLM workers (this file run as a program: `python -m tests.test_router_hostile --role decode`,
an aiohttp server answering vLLM's endpoints, recording what it received and failing on demand), a
kvcache server where a test needs lookups, and the router, each its own process on a free loopback
port. Clients are raw sockets where the test must control the bytes (trickled bodies, hang-ups),
urllib elsewhere.

A word `fail-<role>-<kind>` in a prompt makes the worker of that role fail that way (a 500 with a
traceback, a 400 in OpenAI's or vLLM's error shape, a 400 in HTML); `slow-decode-stream` makes the
decode worker stream 400 events 20 ms apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples._support import KVCacheServerProcess, RouterProcess
from kvcache_server.launcher import ChildServer

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 16
MODEL = "fake-model"
TRACEBACK = (
    'Traceback (most recent call last):\n  File "/opt/vllm/vllm/engine/async_llm.py", line 312, in generate\n'
    "    raise EngineDeadError(secret_internal_state)\nvllm.v1.engine.exceptions.EngineDeadError: /srv/models/x\n"
)


# -- the fake vLLM worker (this file as a program) ---------------------------------------------------------


def _fake_worker_app(role: str) -> Any:
    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> dict[str, Any]:
        body = await request.json() if request.can_read_body else None
        seen.append(
            {
                "path": request.path,
                "request_id": request.headers.get("X-Request-Id"),
                "authorization": request.headers.get("Authorization"),
                "body": body,
            }
        )
        return body if isinstance(body, dict) else {}

    def failure(body: dict[str, Any]) -> web.Response | None:
        text = json.dumps(body.get("prompt", body.get("messages", "")))
        if f"fail-{role}-500" in text:
            return web.Response(status=500, text=TRACEBACK, content_type="text/plain")
        if f"fail-{role}-400openai" in text:
            error = {"message": "bad prompt", "type": "BadRequestError", "param": "prompt", "code": 400}
            return web.json_response({"error": {**error, "trace": TRACEBACK}}, status=400)
        if f"fail-{role}-400vllm" in text:  # vLLM's own ErrorResponse shape (object: error)
            error = {"object": "error", "message": "flat bad", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response(error, status=400)
        if f"fail-{role}-400html" in text:
            return web.Response(status=400, text=f"<html><pre>{TRACEBACK}</pre></html>", content_type="text/html")
        return None

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await record(request)
        if (refused := failure(body)) is not None:
            return refused
        params = {"remote_engine_id": f"{role}-engine", "do_remote_prefill": True} if role == "prefill" else None
        choice = {"index": 0, "text": " ok", "finish_reason": "length"}
        if not body.get("stream"):
            return web.json_response(
                {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}
                | ({"kv_transfer_params": params} if params else {})
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        slow = "slow-decode-stream" in json.dumps(body.get("prompt", "")) and role == "decode"
        for _ in range(400 if slow else 3):
            await out.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if slow:
                await asyncio.sleep(0.02)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def tokenize(request: web.Request) -> web.Response:
        body = await record(request)
        if (refused := failure(body)) is not None:
            return refused
        text = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", []))
        tokens = [int(w) if w.isdigit() else 7 for w in str(text).split()]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None})

    async def detokenize(request: web.Request) -> web.Response:
        body = await record(request)
        return web.json_response({"prompt": " ".join(str(t) for t in body.get("tokens", []))})

    async def version(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"version": f"0.0.0+fake-{role}"})

    async def ping(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=200)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def seen_requests(_: web.Request) -> web.Response:
        return web.json_response(seen)

    app = web.Application(client_max_size=64 << 20)  # vLLM takes large bodies; aiohttp stops at 1 MiB
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_route("*", "/ping", ping)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/_seen", seen_requests)
    return app


def _serve_fake_worker(role: str) -> None:
    from aiohttp import web

    async def run() -> None:
        runner = web.AppRunner(_fake_worker_app(role), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"fake-vllm {role} serving on {host}:{port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


class FakeWorker(ChildServer):
    """A fake vLLM worker of `role` in a child process; a context manager."""

    def __init__(self, role: str) -> None:
        argv = [sys.executable, "-m", "tests.test_router_hostile", "--role", role]
        super().__init__(f"fake-vllm-{role}", argv, cwd=str(ROOT))
        self.url = ""

    def __enter__(self) -> FakeWorker:
        match = self.launch(re.compile(r" serving on (\S+):(\d+)$"), 30)
        assert match is not None
        self.url = f"http://{match.group(1)}:{match.group(2)}"
        return self

    def seen(self, request_id: str) -> list[dict[str, Any]]:
        """What this worker received under `request_id`."""
        with urllib.request.urlopen(f"{self.url}/_seen", timeout=10) as resp:
            return [r for r in json.loads(resp.read()) if r["request_id"] == request_id]


@pytest.fixture(scope="module")
def prefill() -> Iterator[FakeWorker]:
    with FakeWorker("prefill") as worker:
        yield worker


@pytest.fixture(scope="module")
def decode() -> Iterator[FakeWorker]:
    with FakeWorker("decode") as worker:
        yield worker


# -- HTTP --------------------------------------------------------------------------------------------------


def request(
    url: str,
    body: bytes | dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30,
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def metric(router: RouterProcess, name: str, **labels: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    _, _, text = request(f"{router.url}/metrics")
    for line in text.decode().splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m and m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) == labels:
            return float(m.group(3))
    return 0.0


def wait_for_metric(router: RouterProcess, value: float, name: str, **labels: str) -> None:
    deadline = time.monotonic() + 20
    while (got := metric(router, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, never became {value}"
        time.sleep(0.05)


def open_body(router: RouterProcess, declared: int, sent: bytes, path: str = "/v1/completions") -> socket.socket:
    """A request whose headers announce `declared` body bytes, of which only `sent` are sent."""
    host, port = router.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    s.sendall(head.encode() + sent)
    return s


def read_answer(s: socket.socket, timeout_s: float) -> tuple[int, bytes]:
    """The status and raw bytes of the one answer on `s` (read until the server closes or the body is whole)."""
    s.settimeout(timeout_s)
    raw = b""
    while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _content_length(raw):
        piece = s.recv(65536)
        if not piece:
            break
        raw += piece
    return int(raw.split(b" ", 2)[1]), raw


def _content_length(raw: bytes) -> int:
    m = re.search(rb"(?i)content-length: (\d+)", raw)
    return int(m.group(1)) if m else 1 << 30


def openai_error(raw: bytes) -> dict[str, Any]:
    """The `error` of an OpenAI error body, checked for its shape: exactly message, type, param, code."""
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def new_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


# -- 1. bodies: read under a deadline, outside the request slots ------------------------------------------


def test_slow_bodies_take_no_request_slot_and_get_408_at_the_deadline(prefill: FakeWorker, decode: FakeWorker) -> None:
    """8 clients stall their bodies with 8 request slots: others are still served; the 8 get 408 after
    http.body_timeout_s (10 s by default). Before: the 8 took every slot, a normal request got 503 after
    queue_timeout_s, and a stalled body was never answered."""
    bound = ("--set", "http.max_concurrent_requests=8", "--set", "http.queue_timeout_s=2")
    with RouterProcess([prefill.url], [decode.url], "", *bound) as router:
        opened = time.monotonic()
        stalled = [open_body(router, 1000, b'{"prompt": "') for _ in range(8)]
        try:
            for _ in range(2):
                sent = time.monotonic()
                status, _, raw = request(f"{router.url}/v1/completions", {"prompt": "one two", "max_tokens": 2})
                assert status == 200, f"{status} after {time.monotonic() - sent:.1f}s: {raw[:200]!r}"
                wait_for_metric(router, 8, "kvcache_router_bodies_in_flight")
            answers = [read_answer(s, 30) for s in stalled]
            waited = time.monotonic() - opened
        finally:
            for s in stalled:
                s.close()
        assert [status for status, _ in answers] == [408] * 8
        error = openai_error(answers[0][1].split(b"\r\n\r\n", 1)[1])
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
        assert 9.5 <= waited < 25, waited  # the deadline, with generous slack on a shared machine
        assert metric(router, "kvcache_router_requests_total", endpoint="completions", route="none", code="408") == 8
        wait_for_metric(router, 0, "kvcache_router_bodies_in_flight")


@pytest.mark.timeout(60)
def test_a_trickled_body_is_cut_at_its_deadline_not_per_read(prefill: FakeWorker, decode: FakeWorker) -> None:
    """A byte every 0.2 s never stalls a read for long, yet the body as a whole must arrive in time."""
    with RouterProcess([prefill.url], [decode.url], "", "--set", "http.body_timeout_s=1") as router:
        s = open_body(router, 1000, b"{")
        started = time.monotonic()
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    s.sendall(b" ")
                except OSError:
                    return

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        try:
            status, raw = read_answer(s, 20)
        finally:
            stop.set()
            feeder.join(5)
            s.close()
        assert status == 408 and b"Connection: close" in raw, raw
        assert time.monotonic() - started < 10


def test_bodies_read_at_once_are_bounded(prefill: FakeWorker, decode: FakeWorker) -> None:
    """http.max_concurrent_bodies bounds the bodies held before a request slot (memory); a request that
    finds no room within queue_timeout_s gets 503 overloaded, and room comes back with the stalled bodies."""
    limits = ("--set", "http.max_concurrent_bodies=2", "--set", "http.queue_timeout_s=1")
    with RouterProcess([prefill.url], [decode.url], "", *limits) as router:
        stalled = [open_body(router, 100, b"{") for _ in range(2)]
        try:
            wait_for_metric(router, 2, "kvcache_router_bodies_in_flight")
            status, _, raw = request(f"{router.url}/v1/completions", {"prompt": "one", "max_tokens": 1})
            assert status == 503 and openai_error(raw)["code"] == "overloaded", raw
        finally:
            for s in stalled:
                s.close()
        wait_for_metric(router, 0, "kvcache_router_bodies_in_flight")
        assert metric(router, "kvcache_router_client_disconnects_total", endpoint="completions", stage="body") == 2
        status, _, _ = request(f"{router.url}/v1/completions", {"prompt": "one", "max_tokens": 1})
        assert status == 200


# -- 2. JSON depth -----------------------------------------------------------------------------------------


def test_deep_or_huge_json_is_a_400_not_a_500(prefill: FakeWorker, decode: FakeWorker) -> None:
    with RouterProcess([prefill.url], [decode.url], "") as router:
        url = f"{router.url}/v1/completions"
        very_deep = b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, _, raw = request(url, very_deep)
        assert status == 400 and openai_error(raw)["code"] == "json_too_deep", raw[:300]
        # Just past http.max_json_depth (64: the object itself is level 1), and just within it.
        status, _, raw = request(url, b'{"prompt": "a", "x": ' + b"[" * 64 + b"]" * 64 + b"}")
        assert status == 400 and openai_error(raw)["code"] == "json_too_deep", raw[:300]
        rid = new_id()
        status, _, raw = request(
            url, b'{"prompt": "a", "x": ' + b"[" * 63 + b"]" * 63 + b"}", headers={"X-Request-Id": rid}
        )
        assert status == 200, raw
        assert len(decode.seen(rid)) == 1
        # More than http.max_json_containers (100,000) objects and arrays: 3 MiB that parse into ~70 MiB.
        status, _, raw = request(url, b'{"prompt": "a", "x": [' + b",".join([b"{}"] * 1_000_000) + b"]}")
        assert status == 400 and openai_error(raw)["code"] == "json_too_large", raw[:300]
        rid = new_id()
        many = b'{"prompt": "a", "x": [' + b",".join([b"[]"] * 99_000) + b"]}"  # within it
        status, _, raw = request(url, many, headers={"X-Request-Id": rid})
        assert status == 200 and len(decode.seen(rid)[0]["body"]["x"]) == 99_000, raw[:300]
        status, _, raw = request(url, b'{"prompt": "a", "n": ' + b"9" * 5000 + b"}")  # past int's digit limit
        assert status == 400 and openai_error(raw)["code"] == "invalid_json"
        assert metric(router, "kvcache_router_requests_total", endpoint="completions", route="none", code="500") == 0
        assert request(f"{router.url}/health")[0] == 200


def test_malformed_http_is_one_warning_line_not_a_traceback(decode: FakeWorker) -> None:
    """aiohttp refuses a bad chunk size itself (400) and logs it: one line, the client's bytes escaped."""
    with RouterProcess([], [decode.url], "", "--log-level", "info") as router:
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\nFORGED line\r\n"
            )
            assert read_answer(s, 10)[0] == 400
        deadline = time.monotonic() + 10
        while "malformed HTTP" not in (log := router.stderr_tail(1 << 20)) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "Traceback" not in log and "ERROR" not in log, log
    (line,) = [line for line in log.splitlines() if "aiohttp.server" in line]
    assert " WARNING aiohttp.server: malformed HTTP from a client, answered 400: " in line, log
    assert not any(line.startswith("FORGED") for line in log.splitlines()), log


# -- 3. X-Request-Id ---------------------------------------------------------------------------------------


def test_request_id_is_checked_and_logged_as_a_field(prefill: FakeWorker, decode: FakeWorker) -> None:
    """A forged id (spaces, a fake key=value tail, 129 characters) is replaced by one made up, everywhere: the
    answer, the workers' calls, the log. The JSON log record carries the request's facts as fields."""
    with RouterProcess([prefill.url], [decode.url], "", "--log-level", "info", "--log-json") as router:
        url = f"{router.url}/v1/completions"
        forged = "x completions 200 route=skip prompt_tokens=1 cached_tokens=1 lookup=ok"
        ids = []
        for given in (forged, "a" * 129, 'q"}, {"level": "critical'):
            status, headers, _ = request(url, {"prompt": "one two"}, headers={"X-Request-Id": given})
            assert status == 200
            assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), headers["X-Request-Id"]
            ids.append(headers["X-Request-Id"])
            assert [r["path"] for r in decode.seen(headers["X-Request-Id"])] == ["/v1/completions"]
            assert [r["path"] for r in prefill.seen(headers["X-Request-Id"])] == ["/v1/completions"]
        good = "req-1.a:b_C-9"
        status, headers, _ = request(url, {"prompt": "one two"}, headers={"X-Request-Id": good})
        assert status == 200 and headers["X-Request-Id"] == good and len(decode.seen(good)) == 1
        ids.append(good)

        deadline = time.monotonic() + 10
        while True:
            records = [json.loads(line) for line in router.stderr_tail(1 << 20).splitlines() if line.startswith("{")]
            done = [r for r in records if r.get("endpoint") == "completions" and r.get("status") is not None]
            if len(done) == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    log = router.stderr_tail(1 << 20)
    assert "route=skip prompt_tokens=1" not in log and "a" * 129 not in log and "critical" not in log
    assert [r["request_id"] for r in done] == ids
    for record in done:
        assert record["status"] == 200 and record["route"] == "prefill" and record["lookup"] == "off"
        assert record["prefill_worker"] == prefill.url and record["decode_worker"] == decode.url
        assert record["prefill_attempts"] == 1 and isinstance(record["total_s"], float)
        assert record["level"] == "info" and record["msg"].startswith(f"{record['request_id']} completions 200 ")


# -- 4. kv_transfer_params ---------------------------------------------------------------------------------


def test_client_kv_transfer_params_never_reach_the_workers(prefill: FakeWorker, decode: FakeWorker) -> None:
    forged = {"do_remote_prefill": True, "remote_host": "10.6.6.6", "remote_block_ids": [1, 2, 3]}
    with RouterProcess([prefill.url], [decode.url], "") as router:
        rid = new_id()
        body = {"prompt": "one two", "kv_transfer_params": forged}
        status, _, raw = request(f"{router.url}/v1/completions", body, headers={"X-Request-Id": rid})
        assert status == 200, raw
        (prefilled,) = prefill.seen(rid)
        assert "kv_transfer_params" not in prefilled["body"]
        (decoded,) = decode.seen(rid)
        assert decoded["body"]["kv_transfer_params"] == {
            "remote_engine_id": "prefill-engine",
            "do_remote_prefill": True,
        }
        assert metric(router, "kvcache_router_client_kv_transfer_params_dropped_total") == 1
    with RouterProcess([], [decode.url], "") as router:  # decode-only: nothing of the router's to replace them
        rid = new_id()
        status, _, _ = request(f"{router.url}/v1/completions", body, headers={"X-Request-Id": rid})
        assert status == 200 and "kv_transfer_params" not in decode.seen(rid)[0]["body"]


def test_client_kv_transfer_params_pass_when_allowed(decode: FakeWorker) -> None:
    allow = ("--set", "http.allow_client_kv_transfer_params=true")
    with RouterProcess([], [decode.url], "", *allow) as router:
        rid = new_id()
        body = {"prompt": "one two", "kv_transfer_params": {"do_remote_prefill": True}}
        status, _, _ = request(f"{router.url}/v1/completions", body, headers={"X-Request-Id": rid})
        assert status == 200 and decode.seen(rid)[0]["body"]["kv_transfer_params"] == {"do_remote_prefill": True}
        assert metric(router, "kvcache_router_client_kv_transfer_params_dropped_total") == 0


# -- 5. workers' error bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_500_is_reduced_to_an_openai_error(decode: FakeWorker, stream: bool) -> None:
    with RouterProcess([], [decode.url], "") as router:
        body = {"prompt": "fail-decode-500", "stream": stream}
        status, headers, raw = request(f"{router.url}/v1/completions", body)
        assert status == 500 and headers["Content-Type"].startswith("application/json")
        error = openai_error(raw)
        assert error["type"] == "server_error" and error["code"] == "upstream_error"
        assert b"Traceback" not in raw and b"/opt/" not in raw and b"/srv/" not in raw and b"127.0.0.1" not in raw
        assert headers["X-KVCache-Decode-Worker"] == decode.url
        assert (
            metric(
                router, "kvcache_router_upstream_failures_total", role="decode", worker=decode.url, reason="status_500"
            )
            == 1
        )


def test_a_workers_400_keeps_only_a_well_formed_openai_error(prefill: FakeWorker, decode: FakeWorker) -> None:
    with RouterProcess([prefill.url], [decode.url], "") as router:
        url = f"{router.url}/v1/completions"
        # OpenAI's shape: kept, its four fields only (the worker's extra "trace" is dropped).
        status, _, raw = request(url, {"prompt": "fail-decode-400openai"})
        assert status == 400 and openai_error(raw) == {
            "message": "bad prompt",
            "type": "BadRequestError",
            "param": "prompt",
            "code": 400,
        }
        assert b"Traceback" not in raw
        # vLLM's flat ErrorResponse: the same four fields, in OpenAI's shape.
        status, _, raw = request(url, {"prompt": "fail-decode-400vllm"})
        assert status == 400 and openai_error(raw) == {
            "message": "flat bad",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        # Anything else (HTML with a traceback), from the prefill worker this time: the status, a message of ours.
        status, _, raw = request(url, {"prompt": "fail-prefill-400html"})
        error = openai_error(raw)
        assert status == 400 and error["code"] == "upstream_error" and error["type"] == "invalid_request_error"
        assert b"Traceback" not in raw and b"/opt/" not in raw and b"html" not in raw


# -- 6. a client that hangs up -----------------------------------------------------------------------------


def test_a_client_hang_up_mid_stream_is_not_the_decode_workers_failure(prefill: FakeWorker, decode: FakeWorker) -> None:
    with RouterProcess([prefill.url], [decode.url], "") as router:
        body = json.dumps({"prompt": "slow-decode-stream", "stream": True}).encode()
        s = open_body(router, len(body), body)
        with s:
            received = b""
            while b"data: " not in received:  # the stream has started
                piece = s.recv(65536)
                assert piece, received
                received += piece
        wait_for_metric(router, 0, "kvcache_router_worker_outstanding", role="decode", worker=decode.url)
        cut = metric(router, "kvcache_router_upstream_failures_total", role="decode", worker=decode.url, reason="cut")
        assert cut == 0
        wait_for_metric(router, 1, "kvcache_router_client_disconnects_total", endpoint="completions", stage="answer")
        assert metric(router, "kvcache_router_requests_total", endpoint="completions", route="prefill", code="200") == 1


# -- 7. route=skip only for a stored prefix ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_short_prompts_are_not_counted_as_cache_skips(prefill: FakeWorker, decode: FakeWorker) -> None:
    from kvcache_client import KVCacheClient
    from kvcache_core.format import encode_block
    from kvcache_core.keys import chunk_keys
    from kvcache_router.config import NamespaceSection

    fields = {"model_id": MODEL, "kv_dtype": "float16", "chunk_tokens": CHUNK, "num_layers": 1}
    fields |= {"num_kv_heads": 1, "head_size": 2}
    namespace = NamespaceSection(**fields).build()  # type: ignore[arg-type]
    flags = [f"--set=namespace.{k}={v}" for k, v in fields.items()] + ["--set=kvcache.namespace_source=config"]
    with (
        KVCacheServerProcess(ram_capacity="64MiB") as kv,
        RouterProcess([prefill.url], [decode.url], kv.target, *flags) as router,
    ):
        stored = list(range(100, 100 + 2 * CHUNK + 8))  # three chunks, the first two stored
        client = KVCacheClient(kv.target, timeout_s=10)
        try:
            keys = chunk_keys(stored, namespace)[:2]
            client.put_many(
                namespace, [(k, encode_block(b"\0" * 16, dtype="float16", shape=(8,), key=k)) for k in keys]
            )
        finally:
            client.close()
        url = f"{router.url}/v1/completions"

        status, headers, _ = request(url, {"prompt": list(range(1, 6)), "max_tokens": 1})  # one partial chunk
        assert status == 200 and headers["X-KVCache-Route"] == "short", headers
        assert headers["X-KVCache-Prefill-Skipped"] == "true" and headers["X-KVCache-Cached-Tokens"] == "0"
        assert metric(router, "kvcache_router_prefill_skipped_total") == 0
        assert metric(router, "kvcache_router_short_prompts_total") == 1

        status, headers, _ = request(url, {"prompt": stored, "max_tokens": 1})
        assert status == 200 and headers["X-KVCache-Route"] == "skip"
        assert headers["X-KVCache-Cached-Tokens"] == str(2 * CHUNK)
        assert metric(router, "kvcache_router_prefill_skipped_total") == 1

        status, headers, _ = request(url, {"prompt": list(range(500, 500 + 2 * CHUNK + 1)), "max_tokens": 1})
        assert status == 200 and headers["X-KVCache-Route"] == "prefill"
        for route in ("short", "skip", "prefill"):
            assert metric(router, "kvcache_router_requests_total", endpoint="completions", route=route, code="200") == 1
        assert metric(router, "kvcache_router_short_prompts_total") == 1
        assert metric(router, "kvcache_router_prefill_skipped_total") == 1


# -- 8. vLLM's small endpoints -----------------------------------------------------------------------------


def test_vllms_small_endpoints_are_answered_by_a_decode_worker(prefill: FakeWorker, decode: FakeWorker) -> None:
    with RouterProcess([prefill.url], [decode.url], "") as router:
        auth = {"Authorization": "Bearer sesame"}
        rid = new_id()
        status, headers, raw = request(
            f"{router.url}/tokenize", {"model": MODEL, "prompt": "4 5 6"}, headers={"X-Request-Id": rid, **auth}
        )
        assert status == 200 and json.loads(raw)["tokens"] == [4, 5, 6], raw
        assert headers["X-Request-Id"] == rid and headers["X-KVCache-Decode-Worker"] == decode.url
        assert [(r["path"], r["authorization"]) for r in decode.seen(rid)] == [("/tokenize", "Bearer sesame")]
        rid = new_id()
        status, _, raw = request(f"{router.url}/detokenize", {"tokens": [4, 5]}, headers={"X-Request-Id": rid})
        assert status == 200 and json.loads(raw) == {"prompt": "4 5"} and len(decode.seen(rid)) == 1
        rid = new_id()
        status, _, raw = request(f"{router.url}/version", headers={"X-Request-Id": rid})
        assert status == 200 and json.loads(raw) == {"version": "0.0.0+fake-decode"} and len(decode.seen(rid)) == 1
        for method in ("GET", "POST"):
            rid = new_id()
            req = urllib.request.Request(f"{router.url}/ping", method=method, headers={"X-Request-Id": rid})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
            assert [r["path"] for r in decode.seen(rid)] == ["/ping"]
        assert prefill.seen(rid) == []
        # The same guards as completions: a worker's 500 reduced, a nested body refused before any worker.
        status, _, raw = request(f"{router.url}/tokenize", {"prompt": "fail-decode-500"})
        assert status == 500 and b"Traceback" not in raw and openai_error(raw)["code"] == "upstream_error"
        status, _, raw = request(f"{router.url}/tokenize", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}")
        assert status == 400 and openai_error(raw)["code"] == "json_too_deep"
        assert metric(router, "kvcache_router_requests_total", endpoint="tokenize", route="proxy", code="200") == 1


def test_small_endpoints_without_a_decode_worker_are_a_503(prefill: FakeWorker) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with RouterProcess([prefill.url], [dead], "") as router:
        for path in ("/version", "/ping"):
            rid = new_id()
            status, _, raw = request(f"{router.url}{path}", headers={"X-Request-Id": rid})
            assert status == 503 and openai_error(raw)["code"] == "no_worker"
            assert prefill.seen(rid) == []  # prefill workers are not asked


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a fake vLLM worker for tests/test_router_hostile.py")
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    _serve_fake_worker(parser.parse_args().role)
