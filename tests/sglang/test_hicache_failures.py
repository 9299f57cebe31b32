"""A kvcache server that stops answering or dies: the backend's calls are misses within their deadlines, never raises.

The server is a child process (LocalKVCacheServer) so it can be SIGSTOPped and SIGKILLed. The
backend is built as SGLang builds it (harness.load_backend), with short deadlines and a breaker
cooldown longer than the test, so every count below is exact.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvcache_connectors.sglang_hicache import Counters, KVCacheHiCacheStorage
from kvcache_server.launcher import LocalKVCacheServer
from tests.backends import sigstop
from tests.sglang.harness import extra_config_json, fill_random, load_backend, mha_host_pool, page_keys, storage_config

pytestmark = pytest.mark.timeout(90)

LOOKUP_TIMEOUT_S = 0.5
TIMEOUT_S = 1.0
# A get holds arena leases and releases them after the copies: two calls, each with the deadline.
GET_BOUND_S = 2 * TIMEOUT_S + 1.0
SLACK_S = 1.0


@pytest.fixture
def child_server() -> Iterator[LocalKVCacheServer]:
    server = LocalKVCacheServer("--ram-capacity", "64MiB")
    server.start()
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def make_backend(target: str) -> KVCacheHiCacheStorage:
    """A backend whose every call goes to the server: with the presence index (docs/presence.md) a
    stopped server's pages would be found without asking it, and these tests time the server's calls."""
    pool = mha_host_pool()
    fill_random(pool, 11)
    cli = extra_config_json(
        target,
        timeout_s=TIMEOUT_S,
        lookup_timeout_s=LOOKUP_TIMEOUT_S,
        breaker_cooldown_s=600,
        log_interval_s=600,
        presence_index=False,
    )
    return load_backend(storage_config(cli, is_mla=False), pool)


def pages(first: int, n: int) -> torch.Tensor:
    return torch.arange(first * 4, (first + n) * 4, dtype=torch.int64)


def timed(fn, *args):
    started = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - started


def test_stopped_server_calls_are_misses_within_the_deadline(child_server: LocalKVCacheServer) -> None:
    backend = make_backend(child_server.target)
    keys = page_keys("stopped", 3)
    assert backend.batch_set_v1(keys, pages(0, 3)) == [True] * 3  # connected, shm/bulk negotiated
    assert backend.batch_exists(keys) == 3
    sigstop(child_server.proc.pid)
    try:
        hit, took = timed(backend.batch_exists, keys)
        assert hit == 0
        assert LOOKUP_TIMEOUT_S * 0.8 <= took < LOOKUP_TIMEOUT_S + SLACK_S
        # The breaker is open now: every call is a miss at once, nothing is sent.
        loaded, took_get = timed(backend.batch_get_v1, keys, pages(5, 3))
        stored, took_set = timed(backend.batch_set_v1, page_keys("more", 2), pages(8, 2))
        assert loaded == [False] * 3 and stored == [False] * 2
        assert took_get < 0.2 and took_set < 0.2
        assert backend.batch_exists(keys) == 0
        counts = backend.counters()
        assert counts[Counters.LOOKUP_FAILURES] == 1
        assert counts[Counters.CALLS_SKIPPED] == 3
        assert counts[Counters.PAGES_MISSING] == 3
        assert counts[Counters.PAGES_NOT_STORED] == 2
        assert counts[Counters.LOOKUPS] == 1  # only the one before SIGSTOP
    finally:
        os.kill(child_server.proc.pid, signal.SIGCONT)
    backend.close()


@pytest.mark.parametrize("call", ["get", "set"])
def test_stopped_server_data_call_fails_within_its_deadline(child_server: LocalKVCacheServer, call: str) -> None:
    backend = make_backend(child_server.target)
    keys = page_keys(f"stopped-{call}", 4)
    assert backend.batch_set_v1(keys, pages(0, 4)) == [True] * 4
    sigstop(child_server.proc.pid)
    try:
        if call == "get":
            result, took = timed(backend.batch_get_v1, keys, pages(6, 4))
            assert took < GET_BOUND_S + SLACK_S
            assert backend.counters()[Counters.LOAD_FAILURES] == 1
            assert backend.counters()[Counters.PAGES_MISSING] == 4
        else:
            result, took = timed(backend.batch_set_v1, page_keys("new", 4), pages(6, 4))
            assert took < TIMEOUT_S + SLACK_S
            assert backend.counters()[Counters.STORE_FAILURES] == 1
            assert backend.counters()[Counters.PAGES_NOT_STORED] == 4
        assert result == [False] * 4
        assert took >= TIMEOUT_S * 0.8  # it waited for the server, up to the deadline
    finally:
        os.kill(child_server.proc.pid, signal.SIGCONT)
    backend.close()


def test_server_killed_mid_call_is_a_miss_before_the_deadline(child_server: LocalKVCacheServer) -> None:
    backend = make_backend(child_server.target)
    keys = page_keys("killed", 4)
    assert backend.batch_set_v1(keys, pages(0, 4)) == [True] * 4
    sigstop(child_server.proc.pid)  # the next call stays in flight
    results: list[object] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            results.append(timed(backend.batch_get_v1, keys, pages(6, 4)))
        except BaseException as exc:  # the test fails on any raise
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(0.2)
    child_server.proc.kill()  # dies mid-call
    child_server.proc.wait(10)
    thread.join(GET_BOUND_S + SLACK_S)
    assert not thread.is_alive() and not errors
    (loaded, took) = results[0]
    assert loaded == [False] * 4 and took < GET_BOUND_S + SLACK_S
    # Dead server: misses and zero, fast (the breaker is open), never an exception.
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, pages(0, 4)) == [False] * 4
    assert backend.get(keys[0], backend.mem_pool_host.get_dummy_flat_data_page()) is None
    assert backend.batch_set(keys[:1], [backend.mem_pool_host.get_data_page(0)]) is False
    counts = backend.counters()
    assert counts[Counters.LOAD_FAILURES] == 1
    assert counts[Counters.CALLS_SKIPPED] == 4
    backend.close()


def test_dead_server_from_the_start_never_raises() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{sock.getsockname()[1]}"
    backend = make_backend(target)  # building it does not connect
    keys = page_keys("dead", 2)
    hit, took = timed(backend.batch_exists, keys)
    assert hit == 0 and took < LOOKUP_TIMEOUT_S + SLACK_S
    assert backend.batch_set_v1(keys, pages(0, 2)) == [False, False]
    assert backend.batch_get_v1(keys, pages(2, 2)) == [False, False]
    counts = backend.counters()
    assert counts[Counters.LOOKUP_FAILURES] == 1 and counts[Counters.CALLS_SKIPPED] == 2
    backend.close()
