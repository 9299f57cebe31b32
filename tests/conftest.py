"""Shared fixtures: a real kvcache server on a free port, run in a background thread."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcache_core.format import encode_block
from kvcache_server.app import RunningServer, create_server
from kvcache_server.config import load_config
from tests.backends import S3_ENV, RedisProcess, S3Process

# boto3's standard credential chain reads these; moto accepts any credentials.
for _name, _value in S3_ENV.items():
    os.environ.setdefault(_name, _value)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, vLLM: about 600,000 objects) is frozen out of the cyclic GC.

    A full collection of that heap stops every thread of the process for about 0.4 s on the CI
    machine, servers run in threads included: a test whose client has vLLM's 0.5 s deadline then
    fails whenever one falls inside it. Long-lived objects are what freezing is for (vLLM freezes
    its own heap after start-up the same way)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap() -> Iterator[None]:
    """Modules imported and caches filled by a test module are frozen too once it is done, so the
    collector's full passes stay short for the whole suite (garbage cycles are collected first)."""
    yield
    gc.collect()
    gc.freeze()


class ServerThread:
    """A kvcache server on its own event loop in a daemon thread (port 0)."""

    def __init__(self, overrides: dict[str, dict[str, Any]]) -> None:
        # Arenas are not pre-faulted in tests (a 1 GiB default would take a second per server);
        # tests/test_arena.py pre-faults its own and checks RSS.
        merged = {"server": {"host": "127.0.0.1", "port": 0, "shutdown_grace_s": 0.5}, "ram": {"prefault": False}}
        for section, values in overrides.items():
            merged.setdefault(section, {}).update(values)
        self.config = load_config(env={}, overrides=merged)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvcache-server", daemon=True)
        self._thread.start()
        self.running: RunningServer = self.call(create_server(self.config))

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Runs a coroutine on the server's loop and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def target(self) -> str:
        return self.running.target

    @property
    def stack(self):
        return self.running.stack

    def stop(self) -> None:
        if self.loop.is_closed():  # stopped already (a test that restarts a server)
            return
        self.call(self.running.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerThread]]:
    """Factory: make_server(ram={"capacity_bytes": ...}, limits={...}) -> a started ServerThread."""
    started: list[ServerThread] = []

    def factory(**overrides: dict[str, Any]) -> ServerThread:
        server = ServerThread(overrides)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def segment_puts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-host puts through the client's segments, as before puts read out of its own memory
    (kvcache_client.procmem): for tests of the segment path itself."""
    monkeypatch.setenv("KVCACHE_PROCESS_PUTS", "0")


@pytest.fixture
def server(make_server: Callable[..., ServerThread]) -> ServerThread:
    return make_server(ram={"capacity_bytes": 256 << 20})


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    yield proc
    proc.stop()


@pytest.fixture
def s3_server() -> Iterator[S3Process]:
    proc = S3Process()
    yield proc
    proc.stop()


def raw_block(key: bytes, payload: bytes) -> bytes:
    """A valid opaque block holding `payload`, bound to `key` (format v2: valid only under that key)."""
    return encode_block(payload, key=key, dtype="uint8", shape=(len(payload),))


def keyed(payload: bytes) -> tuple[bytes, bytes]:
    """A random key and the valid opaque block of `payload` under it."""
    key = os.urandom(16)
    return key, raw_block(key, payload)
