"""Many clients at once, sync threads and asyncio tasks together; every byte checked; the cap holds."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading

import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_core.format import BlockParts, decode_block, encode_block_parts
from tests.backends import rss_bytes
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(180)


def content(key: bytes, size: int) -> bytes:
    """Deterministic payload for a key, so any reader can check what it got."""
    seed = hashlib.sha256(key).digest()
    return (seed * (size // 32 + 1))[:size]


def check(key: bytes, block: bytes | None, errors: list[str]) -> None:
    if block is None:
        return
    payload = bytes(decode_block(block, verify=False)[1])
    if payload != content(key, len(payload)):
        errors.append(f"wrong bytes for {key.hex()}")


def test_many_clients_every_byte_checked(make_server) -> None:
    capacity = 24 << 20
    server: ServerThread = make_server(ram={"capacity_bytes": capacity})
    errors: list[str] = []
    keyspace = [os.urandom(16) for _ in range(300)]
    sizes = {k: random.Random(k).choice([1 << 10, 16 << 10, 256 << 10]) for k in keyspace}

    def sync_worker(seed: int) -> None:
        rng = random.Random(seed)
        with KVCacheClient(server.target, timeout_s=30) as client:
            for _ in range(30):
                batch = rng.sample(keyspace, 8)
                client.put_many("c", [(k, raw_block(k, content(k, sizes[k]))) for k in batch])
                got = client.get_many("c", rng.sample(keyspace, 16))
                for k, b in zip(batch, client.get_many("c", batch), strict=True):
                    check(k, b, errors)
                del got
                prefix = client.lookup("c", batch).prefix_length
                if not 0 <= prefix <= len(batch):
                    errors.append("bad prefix")

    async def async_worker(client: AsyncKVCacheClient, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            batch = rng.sample(keyspace, 8)
            await client.put_many("c", [(k, raw_block(k, content(k, sizes[k]))) for k in batch])
            for k, b in zip(batch, await client.get_many("c", batch), strict=True):
                check(k, b, errors)

    async def async_side() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=30) as client:
            await asyncio.gather(*(async_worker(client, 100 + i) for i in range(6)))

    threads = [threading.Thread(target=sync_worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    asyncio.run(async_side())
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    with KVCacheClient(server.target) as client:
        ram = client.stats().tier("ram")
        assert ram.used_bytes <= capacity
        # Whatever survived is intact.
        for k, b in zip(keyspace, client.get_many("c", keyspace), strict=True):
            check(k, b, errors)
    assert not errors


def test_write_flood_larger_than_the_cap_holds_it() -> None:
    """A separate server process with a 64 MiB cap takes a 768 MiB flood: the cap and its RSS hold."""
    capacity = 64 << 20
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcache_server",
            "--port",
            "0",
            "--ram-capacity",
            str(capacity),
            "--max-block-bytes",
            "8MiB",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        target = line.split(" on ")[1].split()[0]
        payload = os.urandom(4 << 20)
        payloads = [memoryview(payload)[:n] for n in (1 << 20, 2 << 20, 4 << 20)]

        def block(key: bytes) -> BlockParts:  # bound to its key (format v2); the payloads are shared
            chosen = random.choice(payloads)
            return encode_block_parts(chosen, key=key, dtype="uint8", shape=(len(chosen),))

        with KVCacheClient(target, timeout_s=60) as client:
            client.put_many("warm", [(bytes(16), raw_block(bytes(16), payload[: 1 << 20]))])
            rss_start = rss_bytes(proc.pid)
            sent = 0
            peak_rss = rss_start
            last_keys: list[bytes] = []
            while sent < (768 << 20):
                items = [(k, block(k)) for k in (os.urandom(16) for _ in range(8))]
                client.put_many("flood", items)
                sent += sum(len(h) + len(p) for _, (h, p) in items)
                last_keys = [k for k, _ in items]
                used = client.stats().tier("ram").used_bytes
                assert used <= capacity
                peak_rss = max(peak_rss, rss_bytes(proc.pid))
            ram = client.stats().tier("ram")
            assert ram.evictions > 0 and ram.used_bytes <= capacity
            # The newest blocks are there and intact.
            assert all(b is not None for b in client.get_many("flood", last_keys))
        # RSS grows by the cap plus gRPC buffers and allocator slack, not by the flood.
        assert peak_rss - rss_start < capacity + (160 << 20), (peak_rss - rss_start) >> 20
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
