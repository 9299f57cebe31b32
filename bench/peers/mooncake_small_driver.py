"""Drives Mooncake Store for bench_small_trace.py: batch exists, get and put of many small values.

    unshare -n python bench/peers/mooncake_small_driver.py SEGMENT_BYTES VALUE_BYTES BUFFER_BYTES [MASTER_FLAG...]

In Mooncake's own virtual environment, inside a network namespace with only loopback (peers.md), as
mooncake_driver.py: mooncake_master, a storage process contributing SEGMENT_BYTES (its global
segment, the store's whole capacity), and a client with no segment of its own (BUFFER_BYTES of local
buffer, the landing space of its gets). Keys are the bench's 16-byte keys in hex; every put stores
VALUE_BYTES of the same random bytes. Line protocol on stdin, one answer line each on stdout, the
seconds timed here around Mooncake's call only (the pipe is not in them):

    exists K...   ->  "P SECONDS"   batch_is_exist; P = how many leading keys exist
    get K...      ->  "G SECONDS"   get_batch; G = how many leading values came back whole
    put K...      ->  "RC SECONDS"  put_batch; RC its return code (0: stored)
    count K...    ->  "N"           how many of the keys exist (untimed: blocks held at the end)
    quit

"ready" is printed once the client is set up.
"""

from __future__ import annotations

import os
import sys
import time

from mooncake_driver import cluster, store


def leading(flags: list[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def main() -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    segment, value_bytes, buffer = (int(a) for a in sys.argv[1:4])
    value = os.urandom(value_bytes)
    with cluster(segment, sys.argv[4:]) as (http, rpc):
        client = store(http, rpc, 0, buffer)
        print("ready", flush=True)
        for line in sys.stdin:
            op, *keys = line.split()
            if op == "quit":
                break
            if op == "count":
                print(sum(1 for e in client.batch_is_exist(keys) if e == 1), flush=True)
                continue
            t0 = time.perf_counter()
            if op == "exists":
                out = leading([e == 1 for e in client.batch_is_exist(keys)])
            elif op == "get":
                out = leading([len(v) == value_bytes for v in client.get_batch(keys)])
            elif op == "put":
                out = client.put_batch(keys, [value] * len(keys))
            else:
                raise RuntimeError(f"unknown op {op!r}")
            print(out, time.perf_counter() - t0, flush=True)
        client.close()


if __name__ == "__main__":
    main()
