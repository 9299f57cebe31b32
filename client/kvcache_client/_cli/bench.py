"""`kvcache bench`: put, then get, random blocks against a running server, and time each call.

    put phase  calls of `batch` blocks until every one of `blocks` keys is stored once
               (with `seconds`, passes repeat until that long has passed)
    get phase  the same keys, in the same batches, read back and verified by the SDK
    cleanup    the keys are deleted (unless keep)

Payloads are random bytes, one distinct block per position in a batch, reused across batches: the
benchmark holds `batch` blocks in memory, not `blocks`. Keys are random, in a namespace of their own.
Throughput counts the payload bytes that moved (MB/s = 10^6 bytes/s) over the summed duration of the
calls: a get that missed moved nothing, so it adds to `missing` and to the time, not to the bytes.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from kvcache_client.client import KVCacheClient
from kvcache_client.errors import KVCacheError
from kvcache_core.format import encode_block_parts

NAMESPACE_PREFIX = "kvcache-bench-"


class Progress:
    """A one-line progress bar rewritten in place on a terminal; into a file or pipe, one plain line per
    update (no carriage returns or escape codes), at most every LINE_INTERVAL_S; silent when disabled."""

    WIDTH = 30
    INTERVAL_S = 0.1
    LINE_INTERVAL_S = 1.0

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self._stream = stream
        self._enabled = enabled
        self._terminal = enabled and stream.isatty()
        self._last = 0.0
        self._shown = False

    def update(self, label: str, fraction: float, detail: str, *, force: bool = False) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < (self.INTERVAL_S if self._terminal else self.LINE_INTERVAL_S):
            return
        self._last = now
        fraction = min(1.0, max(0.0, fraction))
        if self._terminal:
            filled = round(self.WIDTH * fraction)
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            self._stream.write(f"\r\x1b[2K{label:<4} [{bar}] {detail}")
            self._shown = True
        else:
            self._stream.write(f"{label:<4} {100 * fraction:3.0f}% {detail}\n")
        self._stream.flush()

    def close(self) -> None:
        """Clears the bar's line, so what is printed next starts on a clean line."""
        if self._shown:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()
            self._shown = False


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """The timings of one phase (put or get).

    `blocks` counts the blocks asked for, `missing` those of them a get did not find, and `payload_bytes`
    only the payload of the others (blocks - missing): what actually moved.
    """

    calls: int
    blocks: int
    payload_bytes: int
    seconds: float
    p50_ms: float
    p99_ms: float
    missing: int = 0

    @property
    def mb_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "calls": self.calls,
            "blocks": self.blocks,
            "payload_bytes": self.payload_bytes,
            "seconds": round(self.seconds, 6),
            "mb_s": round(self.mb_s, 3),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "missing": self.missing,
        }


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What to run. `seconds` = 0 means exactly one pass per phase."""

    block_bytes: int
    blocks: int
    batch: int
    seconds: float


def _phase(
    label: str,
    plan: BenchPlan,
    keys: Sequence[bytes],
    call: Callable[[Sequence[bytes]], int],
    progress: Progress,
) -> PhaseResult:
    """Runs `call` (returning the blocks it found missing) over `keys` in batches, timing each call."""
    batches = [keys[i : i + plan.batch] for i in range(0, len(keys), plan.batch)]
    durations: list[float] = []
    blocks = missing = 0
    start = time.monotonic()
    while True:
        for batch in batches:
            t0 = time.perf_counter()
            missing += call(batch)
            durations.append(time.perf_counter() - t0)
            blocks += len(batch)
            elapsed = time.monotonic() - start
            passes = blocks / len(keys)
            fraction = min(elapsed / plan.seconds, 1.0) if plan.seconds else passes
            rate = (blocks - missing) * plan.block_bytes / sum(durations) / 1e6
            done = f"{blocks:,} blocks" if plan.seconds else f"{blocks:,}/{len(keys):,} blocks"
            progress.update(label, fraction, f"{done}  {rate:,.1f} MB/s")
            if elapsed >= plan.seconds and passes >= 1:
                progress.close()
                ordered = sorted(durations)
                return PhaseResult(
                    calls=len(durations),
                    blocks=blocks,
                    payload_bytes=(blocks - missing) * plan.block_bytes,
                    seconds=sum(durations),
                    p50_ms=1000 * percentile(ordered, 50),
                    p99_ms=1000 * percentile(ordered, 99),
                    missing=missing,
                )


def run_bench(
    client: KVCacheClient, plan: BenchPlan, progress: Progress, *, keep: bool
) -> tuple[str, PhaseResult, PhaseResult]:
    """Runs both phases; returns (namespace, put, get). Deletes the keys afterwards unless `keep`."""
    namespace = NAMESPACE_PREFIX + os.urandom(6).hex()
    payloads = [os.urandom(plan.block_bytes) for _ in range(min(plan.batch, plan.blocks))]
    keys = [os.urandom(16) for _ in range(plan.blocks)]

    def put(batch: Sequence[bytes]) -> int:
        # Blocks are bound to their keys (format v2): one header per key, the payloads reused.
        items = [
            (key, encode_block_parts(payload, key=key, dtype="uint8", shape=(plan.block_bytes,)))
            for key, payload in zip(batch, payloads, strict=False)
        ]
        client.put_many(namespace, items)
        return 0

    def get(batch: Sequence[bytes]) -> int:
        return sum(block is None for block in client.get_many(namespace, batch))

    try:
        put_result = _phase("put", plan, keys, put, progress)
        get_result = _phase("get", plan, keys, get, progress)
    finally:
        progress.close()
        if not keep:
            _cleanup(client, namespace, keys)
    return namespace, put_result, get_result


def _cleanup(client: KVCacheClient, namespace: str, keys: Sequence[bytes]) -> None:
    """Deletes the benchmark's keys; a failure here is reported, not raised over the real result or error."""
    step = 4096
    try:
        for i in range(0, len(keys), step):
            client.delete(namespace, keys[i : i + step])
    except KVCacheError as exc:
        print(f"kvcache: bench: could not delete its keys in namespace {namespace}: {exc}", file=sys.stderr)
