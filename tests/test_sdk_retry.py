"""The SDK's deadlines and retries, against a real server that is absent, then appears."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest

from kvcache_client import AsyncKVCacheClient, DeadlineExceeded, KVCacheClient, RetryPolicy, Unavailable
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)


def test_unreachable_server_raises_unavailable_after_the_attempts() -> None:
    with KVCacheClient(f"127.0.0.1:{free_port()}", timeout_s=5, retry=FAST) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable) as info:
            client.stats()
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 5


def test_async_unreachable_server_raises_unavailable() -> None:
    async def main() -> None:
        async with AsyncKVCacheClient(f"127.0.0.1:{free_port()}", timeout_s=5, retry=FAST) as client:
            with pytest.raises(Unavailable):
                await client.lookup("ns", [b"k" * 16])

    asyncio.run(main())


def test_retries_reach_a_server_that_comes_up_within_the_deadline(make_server) -> None:
    port = free_port()
    patient = RetryPolicy(max_attempts=50, initial_backoff_s=0.05, max_backoff_s=0.2)
    started: list[ServerThread] = []
    timer = threading.Timer(0.5, lambda: started.append(make_server(server={"port": port})))
    timer.start()
    try:
        with KVCacheClient(f"127.0.0.1:{port}", timeout_s=20, retry=patient) as client:
            assert client.stats().tier("ram").blocks == 0
    finally:
        timer.join()
    assert started


def test_deadline_bounds_all_attempts() -> None:
    # A listening socket that never speaks HTTP/2: the call can only time out.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        retry = RetryPolicy(max_attempts=100, initial_backoff_s=0.01)
        with KVCacheClient(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=0.5, retry=retry) as client:
            start = time.monotonic()
            with pytest.raises((DeadlineExceeded, Unavailable)):
                client.stats()
            assert time.monotonic() - start < 3


def test_retry_policy_backoff_grows_and_caps() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.3, multiplier=2, jitter=0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.3]
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 1)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 3)
    assert not policy.should_retry(grpc.StatusCode.INVALID_ARGUMENT, 1)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def test_the_default_policy_rides_out_a_server_restart_within_the_deadline(make_server) -> None:
    """The default used to give up after 3 attempts (~150 ms) and the channel then waited ~1-2 s more to
    reconnect: a sidecar restart failed every call of a 10 s deadline. Now only the deadline ends a call."""
    port = free_port()
    first: ServerThread = make_server(server={"port": port})
    key = b"r" * 16
    with KVCacheClient(f"127.0.0.1:{port}", timeout_s=20, shm=False) as client:
        assert client.lookup("ns", [key]).prefix_length == 0  # connected
        first.stop()
        with pytest.raises(Unavailable):  # down: a short deadline fails as UNAVAILABLE, not DEADLINE_EXCEEDED
            client.lookup("ns", [key], timeout_s=0.3)
        restarted: list[ServerThread] = []
        timer = threading.Timer(1.5, lambda: restarted.append(make_server(server={"port": port})))
        timer.start()
        try:
            calls = [client.lookup("ns", [key]).prefix_length for _ in range(3)]  # each rides out the restart
        finally:
            timer.join()
        assert calls == [0, 0, 0] and len(restarted) == 1
        assert client.stats().tier("ram").blocks == 0


def test_a_bounded_policy_still_stops_after_its_attempts() -> None:
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 1)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 2)
    assert RetryPolicy().should_retry(grpc.StatusCode.UNAVAILABLE, 10_000)  # until the deadline
    assert not RetryPolicy().should_retry(grpc.StatusCode.INVALID_ARGUMENT, 1)
