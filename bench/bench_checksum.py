"""What binding a block to its key costs: the checksum of format v1 against v2's, in one run.

Run from the repository root with the project's virtualenv:

    python bench/bench_checksum.py            # ~15 s
    python bench/bench_checksum.py --json out.json

Version 1 hashed descriptor || payload; version 2 hashes key || descriptor || payload (16 more bytes,
one more concatenation). Both run here on the same payloads, interleaved, with a memcpy of the same
bytes as the floor; a full verify_block (header parse included) is measured too. Reported: GB/s of
payload (median of the timed calls) and v2 / v1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvcache_core.format import DType, Layout, compute_checksum, encode_block, verify_block

SIZES = [("256KiB", 256 << 10), ("4MiB", 4 << 20), ("32MiB", 32 << 20)]


def v1_checksum(dtype: int, layout: int, shape: tuple[int, ...], payload: memoryview) -> int:
    """Version 1's checksum, as docs/format.md described it: no key."""
    h = xxhash.xxh3_64(struct.pack(f"<BBBQ{len(shape)}Q", dtype, layout, len(shape), len(payload), *shape))
    h.update(payload)
    return h.intdigest()


def median_s(fn: Callable[[], object], min_time: float, min_iters: int) -> float:
    fn()  # warm-up
    times: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(times) < min_iters or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_size(name: str, size: int, key: bytes, rounds: int, min_time: float) -> dict[str, float | str]:
    payload = memoryview(os.urandom(size))
    dst = np.empty(size, dtype=np.uint8)
    src = np.frombuffer(payload, dtype=np.uint8)
    block = encode_block(payload, key=key, dtype=DType.UINT8, shape=(size,))
    shape = (size,)
    systems: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, src),
        "v1": lambda: v1_checksum(DType.UINT8, Layout.RAW, shape, payload),
        "v2": lambda: compute_checksum(key, DType.UINT8, Layout.RAW, shape, payload),
        "verify": lambda: verify_block(block, key),
    }
    samples: dict[str, list[float]] = {s: [] for s in systems}
    names = list(systems)
    for r in range(rounds):  # interleaved, rotating order: the machine is noisy
        for s in names[r % len(names) :] + names[: r % len(names)]:
            samples[s].append(median_s(systems[s], min_time, 3))
    gbs = {s: size / statistics.median(t) / 1e9 for s, t in samples.items()}
    return {"block": name, "bytes": size, **{f"{s}_gb_s": v for s, v in gbs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement and round (default 0.3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args()
    key = os.urandom(16)
    rows = []
    print(f"{'block':>8} {'memcpy':>8} {'v1 hash':>8} {'v2 hash':>8} {'v2/v1':>6} {'verify v2':>9}   GB/s of payload")
    for name, size in SIZES:
        row = measure_size(name, size, key, args.rounds, args.min_time)
        rows.append(row)
        g = {k.removesuffix("_gb_s"): v for k, v in row.items() if k.endswith("_gb_s")}
        print(f"{name:>8} {g['memcpy']:8.2f} {g['v1']:8.2f} {g['v2']:8.2f} {g['v2'] / g['v1']:6.3f} {g['verify']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
