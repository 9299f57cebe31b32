"""The router's pure decisions: when prefill is skipped, which worker is chosen, what the headers say."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from kvcache_client import AsyncKVCacheClient
from kvcache_core.format import encode_block
from kvcache_core.keys import Namespace, chunk_keys
from kvcache_router.metrics import RequestReport, RouterMetrics
from kvcache_router.prefix import Coverage, PrefixOracle
from kvcache_router.tokens import given_tokens, needs_tokenizer
from kvcache_router.workers import WorkerPool
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("chunks", "stored", "skip"),
    [
        (1, 0, True),  # a prompt of one chunk or less: the decode worker computes it
        (2, 0, False),
        (2, 1, True),  # all but the last chunk
        (4, 2, False),
        (4, 3, True),
        (4, 4, True),  # the whole prompt (its partial tail too)
    ],
)
def test_prefill_is_skipped_when_at_most_the_last_chunk_is_missing(chunks: int, stored: int, skip: bool) -> None:
    assert Coverage(chunks, stored, 0).skip_prefill is skip


def test_coverage_counts_stored_tokens_through_the_servers_lookup(server: ServerThread) -> None:
    """The oracle's keys are the connectors' keys: what a connector stored, the router finds."""
    ns = Namespace(model_id="m", kv_dtype="float16", chunk_tokens=4, num_layers=1, num_kv_heads=1, head_size=2)
    tokens = list(range(10))  # chunks of 4, 4, 2
    keys = chunk_keys(tokens, ns)

    async def run() -> list[Coverage | None]:
        client = AsyncKVCacheClient(server.target, timeout_s=5)
        oracle = PrefixOracle(client, lookup_timeout_s=2)
        oracle.namespace = ns
        try:
            blocks = [(k, encode_block(b"\0" * 16, dtype="float16", shape=(8,), key=k)) for k in keys[:2]]
            await client.put_many(ns, blocks)
            return [
                await oracle.coverage(tokens),
                await oracle.coverage(tokens[:7]),  # a different second chunk: only the first is shared
                await oracle.coverage(tokens, cache_salt="other"),
            ]
        finally:
            await client.close()

    whole, shorter, salted = asyncio.run(run())
    assert whole == Coverage(chunks=3, stored_chunks=2, cached_tokens=8) and whole.skip_prefill
    assert shorter == Coverage(chunks=2, stored_chunks=1, cached_tokens=4) and shorter.skip_prefill
    assert salted == Coverage(chunks=3, stored_chunks=0, cached_tokens=0) and not salted.skip_prefill


def test_coverage_without_an_answer_is_none() -> None:
    async def run() -> Coverage | None:
        client = AsyncKVCacheClient("127.0.0.1:1", timeout_s=0.5)
        oracle = PrefixOracle(client, lookup_timeout_s=0.5)
        oracle.namespace = Namespace(
            model_id="m", kv_dtype="float16", chunk_tokens=4, num_layers=1, num_kv_heads=1, head_size=2
        )
        try:
            return await oracle.coverage([1, 2, 3])
        finally:
            await client.close()

    assert asyncio.run(run()) is None


def test_least_outstanding_then_turns() -> None:
    pool = WorkerPool("decode", ["http://a", "http://b", "http://c"], RouterMetrics(), health_failures=2)
    a, b, c = pool.workers
    for w in pool.workers:
        w.healthy = True
    assert {pool.pick().url for _ in range(6)} == {"http://a", "http://b", "http://c"}  # ties take turns
    with pool.serving(a), pool.serving(b):
        assert pool.pick() is c
        with pool.serving(c), pool.serving(c):
            assert pool.pick() in (a, b)
            assert pool.pick(exclude=[a, b]) is c
    assert (a.outstanding, b.outstanding, c.outstanding) == (0, 0, 0)
    c.healthy = False
    assert pool.pick(exclude=[a, b]) is None


def test_a_failed_connection_ejects_at_once_a_timeout_does_not() -> None:
    metrics = RouterMetrics()
    pool = WorkerPool("prefill", ["http://a"], metrics, health_failures=3)
    (a,) = pool.workers
    a.healthy = True
    pool.failed(a, "timeout", eject=False)
    assert a.healthy
    pool.failed(a, "connect", eject=True)
    assert not a.healthy and pool.pick() is None
    assert metrics.ejections.labels("prefill", "http://a")._value.get() == 1


def test_prompts_given_as_token_ids() -> None:
    assert given_tokens({"prompt": [1, 2, 3]}, chat=False) == [1, 2, 3]
    assert given_tokens({"prompt": [1, -2]}, chat=False) is None
    assert given_tokens({"prompt": [1, True]}, chat=False) is None
    assert given_tokens({"prompt": ["a", "b"]}, chat=False) is None
    assert not needs_tokenizer({"prompt": ["a", "b"]}, chat=False)  # a batch: not looked up
    assert needs_tokenizer({"prompt": "a"}, chat=False) and needs_tokenizer({"messages": []}, chat=True)


def test_report_headers() -> None:
    report = RequestReport("r1", "chat", route="skip", prompt_tokens=40, cached_tokens=32, lookup="ok")
    report.decode_worker = "http://d"
    assert report.headers() == {
        "X-Request-Id": "r1",
        "X-KVCache-Route": "skip",
        "X-KVCache-Prefill-Skipped": "true",
        "X-KVCache-Lookup": "ok",
        "X-KVCache-Prefill-Attempts": "0",
        "X-KVCache-Prompt-Tokens": "40",
        "X-KVCache-Cached-Tokens": "32",
        "X-KVCache-Decode-Worker": "http://d",
    }
    assert "X-KVCache-Prefill-Skipped" not in RequestReport("r2", "completions").headers()
    assert RequestReport("r3", "completions", route="short").headers()["X-KVCache-Prefill-Skipped"] == "true"
    assert "X-KVCache-Prefill-Skipped" not in RequestReport("r4", "tokenize", route="proxy").headers()


@pytest.mark.parametrize(
    ("chunks", "stored", "short"),
    [(0, 0, True), (1, 0, True), (1, 1, False), (2, 1, False), (2, 0, False)],
)
def test_a_prompt_is_too_short_only_when_nothing_of_it_is_stored(chunks: int, stored: int, short: bool) -> None:
    assert Coverage(chunks, stored, 0).too_short is short


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("req-1.a:b_C-9", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("x y", False),
        ("x=1", False),
        ('x"', False),
        ("caf\u00e9", False),  # letters beyond ASCII
    ],
)
def test_request_ids_are_kept_only_when_short_and_plain(given: str, kept: bool) -> None:
    from kvcache_router.intake import request_id

    got = request_id(given)
    assert (got == given) is kept
    if not kept:
        assert re.fullmatch(r"[0-9a-f]{32}", got)
    assert re.fullmatch(r"[0-9a-f]{32}", request_id(None))


def test_json_bodies_are_objects_of_bounded_depth_and_size() -> None:
    from kvcache_router.errors import RouterError
    from kvcache_router.intake import parse_json_object

    def parse(data: bytes, depth: int = 4, containers: int = 100) -> dict:
        return parse_json_object(data, max_depth=depth, max_containers=containers)

    def code(data: bytes, depth: int = 4, containers: int = 100) -> str | int | None:
        with pytest.raises(RouterError) as caught:
            parse(data, depth, containers)
        assert caught.value.status == 400
        return caught.value.code

    assert parse(b'{"a": [[{"b": 1}]]}') == {"a": [[{"b": 1}]]}  # depth 4: the limit
    assert code(b'{"a": [[{"b": []}]]}') == "json_too_deep"
    assert code(b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}") == "json_too_deep"  # past the decoder's own
    assert parse(b'{"a": "[[[[[[[[[["}', depth=2, containers=2) == {"a": "[[[[[[[[[["}  # brackets in a string
    assert code(b"[1]") == "invalid_json" and code(b'{"a": ') == "invalid_json" and code(b"\xff") == "invalid_json"
    assert code(b'{"n": ' + b"1" * 5000 + b"}") == "invalid_json"  # past Python's integer digit limit
    wide = b'{"a": [' + b",".join([b"{}"] * 99) + b"]}"  # 101 containers: the body, the list, 99 objects
    assert code(wide) == "json_too_large"
    assert len(parse(wide, containers=101)["a"]) == 99
    assert len(parse(b'{"a": [' + b",".join([b"1"] * 10_000) + b"]}")["a"]) == 10_000  # scalars: not containers


def test_worker_errors_keep_only_a_well_formed_openai_error() -> None:
    from kvcache_router.errors import worker_error

    def body(status: int, data: bytes) -> dict:
        return json.loads(worker_error("decode", status, data).response().body)["error"]  # type: ignore[arg-type]

    openai = {"message": "bad", "type": "BadRequestError", "param": "prompt", "code": "invalid_prompt"}
    assert body(400, json.dumps({"error": {**openai, "trace": "/opt/x.py"}}).encode()) == openai
    flat = {"object": "error", "message": "m", "type": "BadRequestError", "param": None, "code": 400}
    assert body(400, json.dumps(flat).encode()) == {
        "message": "m",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    own = {"message": "the decode worker refused the request (HTTP 404)", "type": "invalid_request_error"}
    assert body(404, b"<html>/srv/app</html>") == {**own, "param": None, "code": "upstream_error"}
    assert body(400, b'{"error": "a string"}')["code"] == "upstream_error"
    assert body(400, b'{"error": {"message": 3}}')["code"] == "upstream_error"
    odd = {"error": {"message": "m", "type": 1, "param": ["p"], "code": True}}
    assert body(400, json.dumps(odd).encode()) == {
        "message": "m",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    # A 5xx never keeps the worker's words, well-formed or not.
    assert body(500, json.dumps({"error": openai}).encode()) == {
        "message": "the decode worker failed (HTTP 500)",
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }
    assert worker_error("decode", 400, b"").reason == "upstream_rejected"
    assert worker_error("decode", 503, b"").reason == "upstream_error"


def test_a_worker_that_closed_a_kept_alive_connection_gets_onesecond_chance() -> None:
    from aiohttp import ClientConnectorError, ServerDisconnectedError

    from kvcache_router.workers import note_stale, second_chance

    pool = WorkerPool("decode", ["http://a"], RouterMetrics(), health_failures=2)
    (a,) = pool.workers
    a.healthy = True
    tried, stale = [a], []
    note_stale(ServerDisconnectedError(), a, tried, stale)
    assert second_chance(stale) is a and second_chance(stale) is None  # once
    tried.append(a)
    note_stale(ServerDisconnectedError(), a, tried, stale)  # the second time in one request: the worker's fault
    assert stale == []
    refused = ClientConnectorError.__new__(ClientConnectorError)
    note_stale(refused, a, [a], stale)
    assert stale == []
    note_stale(ServerDisconnectedError(), a, [a], stale)
    a.healthy = False  # ejected meanwhile (its health checks): no second chance
    assert second_chance(stale) is None
