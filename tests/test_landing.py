"""kvcache_core.landing: payloads copied into their destinations and verified where they landed."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

from kvcache_core import landing
from kvcache_core.format import encode_block

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


def block(size: int, key: bytes | None = None) -> tuple[bytes, memoryview]:
    key = key or os.urandom(16)
    return key, memoryview(encode_block(os.urandom(size), key=key, dtype="uint8", shape=(size,)))


@pytest.mark.parametrize("threads", [1, 2])
def test_every_outcome_on_one_thread_and_on_several(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verified payloads land exactly; a damaged payload lands and is refused; a damaged header leaves
    its destination untouched; another key's block is refused; a zero-length payload is verified."""
    monkeypatch.setattr(landing, "THREADS", threads)
    monkeypatch.setattr(landing, "PARALLEL_BYTES", 1)
    items = [block(3 * MiB), block(MiB + 17), block(2 * MiB), block(MiB), block(0), block(4096)]
    damaged_payload = bytearray(items[2][1])
    damaged_payload[-1] ^= 1
    damaged_header = bytearray(items[3][1])
    damaged_header[0] ^= 1
    blocks = [b for _, b in items]
    blocks[2], blocks[3] = memoryview(damaged_payload), memoryview(damaged_header)
    keys = [k for k, _ in items]
    keys[5] = os.urandom(16)  # asked under another key
    sizes = [3 * MiB, MiB + 17, 2 * MiB, MiB, 0, 4096]
    targets = [bytearray(b"\xcd" * n) for n in sizes]
    out = landing.land([(b, k, memoryview(t)) for b, k, t in zip(blocks, keys, targets, strict=True)])
    assert [why is None for why in out] == [True, True, False, False, True, False]
    assert "checksum mismatch" in out[2] and "magic" in out[3] and "checksum mismatch" in out[5]  # type: ignore[operator]
    assert bytes(targets[0]) == bytes(items[0][1][-sizes[0] :]) and bytes(targets[1]) == bytes(items[1][1][-sizes[1] :])
    assert bytes(targets[2]) == bytes(damaged_payload[-sizes[2] :])  # what landed, refused
    assert targets[3] == b"\xcd" * MiB  # its header failed: untouched


def test_a_destination_of_another_size_copies_nothing() -> None:
    (k1, b1), (k2, b2) = block(MiB), block(MiB)
    first, second = bytearray(MiB), bytearray(MiB - 1)
    with pytest.raises(ValueError, match="destination holds"):
        landing.land([(b1, k1, memoryview(first)), (b2, k2, memoryview(second))])
    assert first == bytes(MiB)


def test_large_batches_are_shared_among_threads_and_end_before_the_call_does() -> None:
    items = [block(4 * MiB) for _ in range(4)]
    targets = [np.zeros(4 * MiB, np.uint8) for _ in items]
    out = landing.land([(b, k, memoryview(t)) for (k, b), t in zip(items, targets, strict=True)])
    assert out == [None] * 4
    assert all(t.tobytes() == bytes(b[-4 * MiB :]) for (_, b), t in zip(items, targets, strict=True))


def two_shares(monkeypatch: pytest.MonkeyPatch) -> tuple[list[landing.Job], Callable[..., str | None]]:
    """Two blocks of 4 MiB landing on two threads (one share each), and the real _land_one."""
    monkeypatch.setattr(landing, "THREADS", 2)
    jobs = [(b, k, memoryview(bytearray(4 * MiB))) for k, b in (block(4 * MiB) for _ in range(2))]
    return jobs, landing._land_one


def test_a_failing_share_raises_only_once_every_thread_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """What one thread raises comes out of land() only after the other threads' copies ended: a
    caller that goes on (releases its leases, reuses its buffers) never races a copy still running."""
    import threading
    import time

    jobs, real = two_shares(monkeypatch)
    ended: list[str] = []

    def slow_or_failing(job, header):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("this share fails at once")
        time.sleep(0.3)
        result = real(job, header)
        ended.append("other share")
        return result

    monkeypatch.setattr(landing, "_land_one", slow_or_failing)
    with pytest.raises(RuntimeError, match="fails at once"):
        landing.land(jobs)
    assert ended == ["other share"]


def test_get_into_keeps_its_size_and_damage_rules(make_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """get_into through the landing path: a sound block for a destination of another size raises
    ValueError before any destination is written; a damaged block is a miss whatever its size."""
    from kvcache_client import KVCacheClient

    server = make_server(ram={"capacity_bytes": 64 * MiB}, shm={"dir": str(tmp_path / "shm")})
    items = [block(3 * MiB) for _ in range(3)]
    keys = [k for k, _ in items]
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(k, bytes(b)) for k, b in items])
        dst = [bytearray(3 * MiB), bytearray(3 * MiB), bytearray(3 * MiB - 1)]
        with pytest.raises(ValueError, match="destination holds"):
            client.get_into("ns", keys, dst)
        assert dst[0] == bytes(3 * MiB) and dst[1] == bytes(3 * MiB)  # nothing written before the refusal
        ram = server.stack.ram
        (lease,) = ram.lease_many("ns", [keys[2]])
        assert lease is not None
        ram.release([lease.id])
        ram.region.view[lease.offset + lease.length - 8 : lease.offset + lease.length] = b"\x00" * 8
        assert client.get_into("ns", keys, dst) == [True, True, False]  # damaged: a miss, not ValueError
        assert client.corrupt_blocks == 1 and bytes(dst[0]) == bytes(items[0][1][-3 * MiB :])
        assert client.stats().arena_leases == 0


def test_an_interrupt_while_waiting_for_the_other_threads_is_raised_only_once_they_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler raising in the calling thread while it waits for the other threads' copies
    (KeyboardInterrupt in practice) comes out of land() only after those copies ended: the caller then
    releases its leases and may reuse its buffers. (On the first version the wait was cut short: the
    interrupt came out while the other thread still wrote.)"""
    import signal
    import threading
    import time

    class Interrupt(BaseException):
        pass

    def interrupt(signum, frame):  # type: ignore[no-untyped-def]
        raise Interrupt

    jobs, real = two_shares(monkeypatch)
    ended: list[str] = []

    def other_share_slow(job, header):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
            ended.append("other share")
        return real(job, header)

    monkeypatch.setattr(landing, "_land_one", other_share_slow)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.15)  # while this thread waits for the other share
        with pytest.raises(Interrupt):
            landing.land(jobs)
        assert ended == ["other share"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
