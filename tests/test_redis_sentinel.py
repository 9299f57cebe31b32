"""The Redis tier behind Redis Sentinel: a real master, its replica and a sentinel; the master is killed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient
from kvcache_server.config import ConfigError, load_config
from tests.backends import RedisProcess, SentinelProcess, wait_for
from tests.conftest import ServerThread, keyed

pytestmark = pytest.mark.timeout(90)

NS = "sentinel"


def test_sentinel_config_goes_together_and_excludes_a_cluster() -> None:
    c = load_config(env={}, overrides={"redis": {"sentinel_master": "m", "sentinel_nodes": "s1:26379, s2:26380"}})
    assert c.redis.sentinels() == [("s1", 26379), ("s2", 26380)]
    for values, message in [
        ({"sentinel_master": "m"}, "go together"),
        ({"sentinel_nodes": "s1:26379"}, "go together"),
        ({"sentinel_master": "m", "sentinel_nodes": "s1:26379", "cluster": "true"}, "exclude each other"),
        ({"sentinel_master": "m", "sentinel_nodes": "s1"}, "'s1' is not host:port"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(env={}, overrides={"redis": values})


def test_a_killed_master_is_followed_to_the_promoted_replica(tmp_path: Path) -> None:
    """Blocks stored through the master are served from the replica the sentinel promotes; while it fails
    over, reads are misses (counted, never wrong bytes), and new puts land on the new master."""
    master = RedisProcess("--repl-diskless-sync-delay", "0")
    replica = RedisProcess("--replicaof", "127.0.0.1", str(master.port))
    sentinel = SentinelProcess(tmp_path, master)
    server = None
    try:
        settings = {"enabled": True, "url": "redis://127.0.0.1:1/0", "sentinel_master": sentinel.name}
        settings |= {"sentinel_nodes": f"127.0.0.1:{sentinel.port}", "promote": False, "timeout_s": 2.0}
        server = ServerThread({"redis": {**settings, "breaker_failures": 1000}})
        items = [keyed(os.urandom(4096)) for _ in range(40)]
        blocks = dict(items)
        keys = [k for k, _ in items]
        with KVCacheClient(server.target, timeout_s=20, shm=False) as client:
            assert client.put_many(NS, items).tier("redis").stored == 40
            wait_for(lambda: replica.client().dbsize() == 40, what="replication")
            wrong, missed, served = [0], [0], [0]
            stop = threading.Event()

            def load() -> None:
                while not stop.is_set():
                    for k, got in zip(keys, client.get_many(NS, keys), strict=True):
                        if got is None:
                            missed[0] += 1
                        elif bytes(got) != blocks[k]:
                            wrong[0] += 1
                        else:
                            served[0] += 1

            reader = threading.Thread(target=load, daemon=True)
            reader.start()
            time.sleep(0.3)
            master.kill()
            wait_for(lambda: sentinel.master_port() == replica.port, timeout_s=30, what="the sentinel's failover")
            wait_for(lambda: None not in client.get_many(NS, keys), timeout_s=15, what="reads from the new master")
            stop.set()
            reader.join(30)
            stats = next(t for t in server.stack.stats() if t.name == "redis")
            assert wrong[0] == 0 and served[0] > 0
            assert missed[0] == 0 or stats.errors > 0  # misses while it failed over: each call counted
            assert [bytes(b) for b in client.get_many(NS, keys)] == [b for _, b in items]
            fresh = keyed(os.urandom(1024))
            # Puts land on the new master once the sentinel reports it up (it may not for a moment).
            wait_for(lambda: client.put_many(NS, [fresh]).tier("redis").stored == 1, what="a put to the new master")
            assert replica.client().get(f"kvcache/{NS}/{fresh[0].hex()}") == fresh[1]
    finally:
        if server is not None:
            server.stop()
        sentinel.stop()
        replica.stop()
        master.stop()
