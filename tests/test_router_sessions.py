"""kvcache-router's sessions (docs/router.md, "Sessions"): real processes, real HTTP.

The fake vLLM workers of tests/test_router_hostile.py (each its own process, recording what it received),
a kvcache server process where a test needs one, and the router. A client's retention hint reaches both
workers' kv_transfer_params (cut to the router's cap), a malformed one is a 400 that reaches no worker;
after a turn the router's Prefetch brings the prompt's blocks that the disk tier held back into RAM,
without any Get; with kvcache down the answer is the same and the failed prefetch is counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples._support import RouterProcess
from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block
from kvcache_core.keys import chunk_keys
from kvcache_router.config import NamespaceSection
from kvcache_server.launcher import LocalKVCacheServer
from tests.test_router_hostile import CHUNK, MODEL, FakeWorker, metric, new_id, openai_error, request, wait_for_metric

pytestmark = pytest.mark.timeout(120)

FIELDS: dict[str, Any] = {"model_id": MODEL, "kv_dtype": "float16", "chunk_tokens": CHUNK, "num_layers": 1}
FIELDS |= {"num_kv_heads": 1, "head_size": 2}
CONFIG_NAMESPACE = [f"--set=namespace.{k}={v}" for k, v in FIELDS.items()] + ["--set=kvcache.namespace_source=config"]
PREFILL_PARAMS = {"remote_engine_id": "prefill-engine", "do_remote_prefill": True}  # what the fake prefill returns


@pytest.fixture(scope="module")
def prefill() -> Iterator[FakeWorker]:
    with FakeWorker("prefill") as worker:
        yield worker


@pytest.fixture(scope="module")
def decode() -> Iterator[FakeWorker]:
    with FakeWorker("decode") as worker:
        yield worker


def test_a_clients_hint_reaches_both_workers_kv_transfer_params(prefill: FakeWorker, decode: FakeWorker) -> None:
    with RouterProcess([prefill.url], [decode.url], "", "--set", "kvcache.max_retain_ttl_s=900") as router:
        system = {"type": "text", "text": "you are terse", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        chat = [{"role": "system", "content": [system]}, {"role": "user", "content": "hi"}]
        cases: list[tuple[str, dict[str, Any], float | None]] = [
            ("/v1/completions", {"prompt": "one two", "kvcache": {"retain_ttl_s": 600}}, 600.0),
            ("/v1/completions", {"prompt": "one two", "kvcache": {"retain_ttl_s": "5m"}}, 300.0),
            ("/v1/completions", {"prompt": "one two", "cache_control": {"type": "ephemeral"}}, 300.0),
            ("/v1/chat/completions", {"messages": chat}, 900.0),  # 1 h, cut to the router's cap
            ("/v1/completions", {"prompt": "one two"}, None),
        ]
        for path, body, ttl in cases:
            rid = new_id()
            status, _, raw = request(f"{router.url}{path}", body, headers={"X-Request-Id": rid})
            assert status == 200, raw
            (prefilled,) = prefill.seen(rid)
            (decoded,) = decode.seen(rid)
            for seen in (prefilled, decoded):
                assert "kvcache" not in seen["body"] and "cache_control" not in seen["body"]
            if ttl is None:
                assert "kv_transfer_params" not in prefilled["body"]
                assert decoded["body"]["kv_transfer_params"] == PREFILL_PARAMS
                continue
            assert prefilled["body"]["kv_transfer_params"] == {"kvcache_retain_ttl_s": ttl}, path
            assert decoded["body"]["kv_transfer_params"] == {**PREFILL_PARAMS, "kvcache_retain_ttl_s": ttl}
            if "messages" in body:
                assert decoded["body"]["messages"] == chat  # the messages go on as they came
    with RouterProcess([], [decode.url], "") as router:  # decode-only: the hint alone
        rid = new_id()
        body = {"prompt": "one two", "kvcache": {"retain_ttl_s": 7200}}
        status, _, _ = request(f"{router.url}/v1/completions", body, headers={"X-Request-Id": rid})
        assert status == 200
        assert decode.seen(rid)[0]["body"]["kv_transfer_params"] == {"kvcache_retain_ttl_s": 3600.0}  # the default cap


def test_a_malformed_hint_is_a_400_that_reaches_no_worker(prefill: FakeWorker, decode: FakeWorker) -> None:
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("/v1/completions", {"prompt": "x", "kvcache": {"retain_ttl_s": -1}}, "kvcache.retain_ttl_s", "positive"),
        ("/v1/completions", {"prompt": "x", "kvcache": {"retain_ttl_s": "forever"}}, "kvcache.retain_ttl_s", "1h"),
        ("/v1/completions", {"prompt": "x", "kvcache": 600}, "kvcache", "object"),
        ("/v1/completions", {"prompt": "x", "kvcache": {"ttl": 600}}, "kvcache", "unknown"),
        ("/v1/completions", {"prompt": "x", "cache_control": {"type": "forever"}}, "cache_control", "ephemeral"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "cache_control": {"type": "ephemeral", "ttl": "1d"}}]},
            "messages[0].cache_control.ttl",
            "1h",
        ),
    ]
    with RouterProcess([prefill.url], [decode.url], "") as router:
        for path, body, param, words in cases:
            rid = new_id()
            status, _, raw = request(f"{router.url}{path}", body, headers={"X-Request-Id": rid})
            assert status == 400, raw
            error = openai_error(raw)
            assert error["code"] == "invalid_retention_hint" and error["param"] == param.split(".ttl")[0], error
            assert param in error["message"] and words in error["message"], error
            assert prefill.seen(rid) == [] and decode.seen(rid) == []


def _disk_server(tmp: Path) -> LocalKVCacheServer:
    """A server whose RAM holds 4 MiB over a 16 MiB disk tier: a flood demotes older blocks to the disk."""
    flags = {"disk.enabled": "true", "disk.dir": str(tmp / "disk"), "disk.capacity_bytes": "16MiB"}
    flags["disk.region_bytes"] = "1MiB"
    sets = [arg for k, v in flags.items() for arg in ("--set", f"{k}={v}")]
    return LocalKVCacheServer("--ram-capacity", "4MiB", "--log-level", "warning", *sets)


def test_after_a_turn_the_prompts_blocks_on_disk_are_back_in_ram_without_a_get(
    prefill: FakeWorker, decode: FakeWorker, tmp_path: Path
) -> None:
    namespace = NamespaceSection(**FIELDS).build()
    prompt = list(range(100, 100 + 3 * CHUNK + 5))  # three full chunks and a tail; the chunks stored
    keys = chunk_keys(prompt, namespace)[:3]
    with _disk_server(tmp_path) as kv:
        client = KVCacheClient(kv.target, timeout_s=10, shm=False)
        try:
            client.put_many(namespace, blocks_of(keys))
            for _ in range(8):  # 6 MiB of other blocks: the prompt's are demoted to the disk tier
                client.put_many("other", blocks_of([os.urandom(16) for _ in range(12)]))
            wait_until(lambda: client.lookup(namespace, keys).tiers == ("disk",) * 3, "the prompt's blocks on disk")
            ram_hits = client.stats().tier("ram").hits
            with RouterProcess([prefill.url], [decode.url], kv.target, *CONFIG_NAMESPACE) as router:  # off: the default
                status, _, raw = request(f"{router.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
                assert status == 200, raw
                time.sleep(1)
                assert client.lookup(namespace, keys).tiers == ("disk",) * 3  # the turn left them where they were
                assert metric(router, "kvcache_router_prefetches_total", outcome="sent") == 0
            flags = [*CONFIG_NAMESPACE, "--set", "kvcache.prefetch_after_turn=true"]
            with RouterProcess([prefill.url], [decode.url], kv.target, *flags) as router:
                status, headers, raw = request(f"{router.url}/v1/completions", {"prompt": prompt, "max_tokens": 1})
                assert status == 200 and headers["X-KVCache-Route"] == "skip", raw
                wait_for_metric(router, 1, "kvcache_router_prefetches_total", outcome="sent")
                wait_until(lambda: client.lookup(namespace, keys).tiers == ("ram",) * 3, "the prompt's blocks in RAM")
                stats = client.stats()
                assert stats.prefetch_queued == 3 and stats.prefetch_promoted == 3
                assert stats.tier("ram").hits == ram_hits  # nobody read them: no Get brought them back
                assert metric(router, "kvcache_router_prefetch_keys_total", answer="queued") == 3
                assert metric(router, "kvcache_router_prefetch_keys_total", answer="unknown") == 1  # the tail
        finally:
            client.close()


def test_with_kvcache_down_the_turn_is_answered_and_the_failed_prefetch_counted(
    prefill: FakeWorker, decode: FakeWorker, tmp_path: Path
) -> None:
    with _disk_server(tmp_path) as kv:
        target = kv.target
    flags = [*CONFIG_NAMESPACE, "--set", "kvcache.prefetch_after_turn=true", "--set", "kvcache.prefetch_timeout_s=1"]
    with RouterProcess([prefill.url], [decode.url], target, *flags) as router:  # the server is gone
        for n in range(3):
            started = time.monotonic()
            status, headers, raw = request(
                f"{router.url}/v1/completions", {"prompt": list(range(1, 40)), "max_tokens": 1}
            )
            assert status == 200, raw
            assert headers["X-KVCache-Lookup"] == "failed"
            assert time.monotonic() - started < 5
            wait_for_metric(router, n + 1, "kvcache_router_prefetches_total", outcome="failed")
        assert router.url  # still serving


def blocks_of(keys: list[bytes]) -> list[tuple[bytes, bytes]]:
    """64 KiB blocks under `keys`."""
    return [(k, encode_block(b"\0" * (64 << 10), dtype="float16", shape=(32 << 10,), key=k)) for k in keys]


def wait_until(check: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: never"
        time.sleep(0.05)
