"""Shared helpers of the benchmarks: subprocess servers that always get cleaned up, and a timing loop."""

from __future__ import annotations

import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvcache_server.launcher import ChildServer

MB = 1e6  # throughput units are decimal: MB/s = 10^6 bytes/s, GB/s = 10^9 bytes/s
GB = 1e9
MiB = 1 << 20
KiB = 1 << 10


def free_port() -> int:
    """A TCP port that was free a moment ago (small race, fine for a benchmark)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess(ChildServer):
    """A server in a child process (kvcache_server.launcher.ChildServer) whose port comes from its first line."""

    def start(self, port_pattern: str | None, timeout_s: float = 30.0) -> int | None:
        """Starts the child; with `port_pattern` (a regex with one group), returns the port parsed from
        its first stdout line."""
        match = self.launch(port_pattern, timeout_s)
        return int(match.group(1)) if match else None

    def __enter__(self) -> ServerProcess:
        return self


def exit_on_sigterm() -> None:
    """Turns SIGTERM into SystemExit so `finally` blocks (and the servers' cleanup) run."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


@dataclass
class Measurement:
    """One timed operation: throughput over `nbytes` per call, median over the iterations."""

    system: str
    workload: str
    op: str
    nbytes: int
    iters: int
    times_s: list[float] = field(repr=False)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def mb_s(self) -> float:
        return self.nbytes / self.median_s / MB

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.median_s / GB

    def add(self, other: Measurement) -> None:
        """Pools another round's calls of the same system, workload and operation into this one."""
        self.times_s.extend(other.times_s)
        self.iters = len(self.times_s)

    def spread(self) -> tuple[float, float]:
        """(min, max) throughput in MB/s over the iterations."""
        return self.nbytes / max(self.times_s) / MB, self.nbytes / min(self.times_s) / MB

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        lo, hi = self.spread()
        d.update(median_s=self.median_s, mb_s=self.mb_s, gb_s=self.gb_s, min_mb_s=lo, max_mb_s=hi)
        return d


@dataclass(frozen=True)
class TimingPlan:
    """Each measurement: `warmup` untimed calls, then calls until both `min_time_s` and `min_iters`
    are reached (or `max_iters`, or `max_time_s` once `min_iters` is reached)."""

    min_time_s: float = 1.5
    min_iters: int = 5
    max_iters: int = 500
    max_time_s: float = 6.0
    warmup: int = 1

    def per_round(self, rounds: int) -> TimingPlan:
        """The share of one of `rounds` interleaved rounds (each round warms up again)."""
        return TimingPlan(
            min_time_s=self.min_time_s / rounds,
            min_iters=max(1, math.ceil(self.min_iters / rounds)),
            max_iters=max(1, math.ceil(self.max_iters / rounds)),
            max_time_s=self.max_time_s / rounds,
            warmup=self.warmup,
        )


def measure(
    system: str, workload: str, op: str, nbytes: int, fn: Callable[[], object], plan: TimingPlan
) -> Measurement:
    for _ in range(plan.warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        n = len(times)
        if n >= plan.max_iters:
            break
        if n >= plan.min_iters and (elapsed >= plan.min_time_s or elapsed >= plan.max_time_s):
            break
    return Measurement(system, workload, op, nbytes, len(times), times)


def memcpy_gb_s(nbytes: int = 16 * MiB, min_time_s: float = 0.5) -> float:
    """Median GB/s of copying `nbytes` between two bytearrays (slice assignment, one memcpy)."""
    src = bytearray(os.urandom(nbytes))
    dst = bytearray(nbytes)
    dst[:] = src  # warm up (page faults)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(times) < 5:
        t0 = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / GB


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]


def redis_versions(redis_server: str) -> tuple[str, str]:
    """(`redis-server --version` output or why it is unavailable, redis-py's parser: hiredis or pure-python)."""
    try:
        server = subprocess.run([redis_server, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        server = f"unavailable: {exc}"
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "pure-python"
    return server, parser
