"""Drives Mooncake Store for bench_peers.py (run by it in Mooncake's own virtual environment).

    unshare -n python bench/peers/mooncake_driver.py CHUNKS CHUNK_MIB

Mooncake's TCP transport listens on all interfaces, so this runs in a network namespace with only
loopback (peers.md): it brings `lo` up, starts mooncake_master, a storage process that contributes
the memory (a separate process: a client that stores in its own segment would only memcpy), and a
client with no segment of its own. Protocol on stdin/stdout: "ready", then one line with the seconds
each "put" or "get" took; "quit" ends it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def store(http: int, rpc: int, segment: int, buffer: int):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", segment, buffer, "tcp", "", f"127.0.0.1:{rpc}")
    if rc != 0:
        raise RuntimeError(f"setup returned {rc}")
    return s


@contextlib.contextmanager
def cluster(segment: int, master_flags: Sequence[str] = ()) -> Iterator[tuple[int, int]]:
    """Brings `lo` up, starts mooncake_master and a storage process contributing `segment` bytes;
    yields the master's (http metadata port, rpc port) for clients, and stops both after."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    http, rpc, metrics = free_port(), free_port(), free_port()
    master_bin = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    master = subprocess.Popen(
        [master_bin, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
         "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", *master_flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    storage = None
    try:
        wait_port(rpc)
        wait_port(http)
        storage = subprocess.Popen(
            [sys.executable, __file__, "--storage", str(http), str(rpc), str(segment)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        if storage.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the storage process did not start")
        yield http, rpc
    finally:
        if storage is not None:
            storage.stdin.close()  # type: ignore[union-attr]
            storage.wait(30)
        master.terminate()
        master.wait(30)


def main() -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    if sys.argv[1] == "--storage":
        s = store(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 64 << 20)
        print("ready", flush=True)
        sys.stdin.read()  # until the driver goes
        s.close()
        return
    chunks, chunk_mib = int(sys.argv[1]), int(sys.argv[2])
    n = chunk_mib << 20
    with cluster(max(4 * GiB, 40 * chunks * n)) as (http, rpc):
        client = store(http, rpc, 0, 2 * chunks * n + (64 << 20))
        values = [os.urandom(n) for _ in range(chunks)]
        round_ = 0
        keys: list[str] = []
        print("ready", flush=True)
        for line in sys.stdin:
            op = line.strip()
            if op == "quit":
                break
            t0 = time.perf_counter()
            if op == "put":
                round_ += 1
                keys = [f"r{round_}-c{i}" for i in range(chunks)]
                rc = client.put_batch(keys, values)
                if rc != 0:
                    raise RuntimeError(f"put_batch returned {rc}")
            else:
                got = client.get_batch(keys)
                if any(len(g) != n for g in got):
                    raise RuntimeError("get_batch missed")
            print(time.perf_counter() - t0, flush=True)
        client.close()


if __name__ == "__main__":
    main()
