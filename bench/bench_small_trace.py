"""Small calls on a real trace: Mooncake's conversation trace through kvcache and Mooncake Store in one run.

    python bench/bench_small_trace.py                       # the first 3,000 requests, 16 KiB blocks, 2 passes
    python bench/bench_small_trace.py --requests 200 --block-kib 64   # smoke run (~1 minute)
    python bench/bench_small_trace.py --get get_many --passes 4 --json out.json

What it measures (issue 25's small-call benchmark). The first --requests requests of the committed
trace (bench/traces/conversation_trace.jsonl.xz, Mooncake's FAST'25 conversation trace; another with
--trace), in trace order, one client, one call at a time, each request as an engine's connector does
it, keyed as bench_capacity.py and bench_trace_replay.py key it (one chained 16-byte key per hash
id: one key, one prefix; their load_trace and chain_keys):

    Lookup    of all the request's keys; p = the longest present prefix
              (kvcache: client.lookup; Mooncake: batch_is_exist, its leading 1s);
    fetch     keys[:p] when p > 0; g = the leading blocks that came back
              (kvcache: get_into, prefix_only, into warm destinations, verified by the SDK under the key's
              checksum, or get_many with --get; Mooncake: get_batch, a value counted when of full length);
    put       keys[g:], --block-kib of payload each (kvcache: put_many of format.encode_bytes_parts, the
              batch encoder the engines' connectors call, the encoding inside the timed call; Mooncake:
              put_batch of raw values).

Systems (each replays the whole trace from an empty store, then is stopped):

    kvcache, same host     a kvcache server child (RAM only), KVCacheClient(shm=True): the block arena in
                           place and the presence index answering Lookups from shared memory;
    kvcache, remote        the same server, KVCacheClient(shm=False): every call over gRPC, as a client on
                           another host would (the bulk port only for large calls);
    Mooncake over TCP      bench/peers/mooncake_small_driver.py in Mooncake's own virtual environment
                           (--peers-dir, default /tmp/peers: mc/bin/python, peers.md), under `unshare -n` with
                           only loopback: mooncake_master, a storage process holding the global segment, and
                           a client with no segment of its own, over the TCP transport; the driver times each
                           call itself, so the pipe to it is not in its figures. Skipped with a message
                           where it cannot run.

Sizing: both hold the same number of blocks, C = round(--ram-share (10%) x D), D the distinct keys of
those requests (the working set):
    kvcache    ram.capacity_bytes = C x RamTier.entry_cost_of(encoded block) (64-aligned block + the RAM
               tier's per-entry overhead), and ram.presence_block_bytes = the encoded block, so the
               presence index is sized for these blocks;
    Mooncake   its global segment = C x --block-kib (the values are the payloads, no header), eviction at
               its defaults (evicts 5% of objects above a 90% high watermark, never objects under a lease:
               10 s after a read); the blocks each system held at the end are printed beside the figures.

Reported per system and pass: hit ratio (blocks fetched / blocks asked), Lookup p50/p99, fetch p50/p99
(requests that fetched), put p50, blocks per second (blocks asked / the time in the three calls,
summed over the replay) and the load average; then medians over the passes and kvcache / Mooncake for
each figure. The systems run one after another, in the reverse order on every other pass. Figures
only: the issue's four targets are printed as met or missed, not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _common import KiB, ServerProcess, exit_on_sigterm
from bench_capacity import TRACE
from bench_tiers import percentile, render_table, start_kvcaches
from bench_trace_replay import BLOCK_TOKENS, chain_keys, leading, load_trace

from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block, encode_bytes_parts
from kvcache_core.keys import Namespace
from kvcache_server.tiers.ram import RamTier

PEER_DIR = Path(__file__).resolve().parent / "peers"
KV_SHM = "kvcache, same host (shm, presence index)"
KV_REMOTE = "kvcache, remote client (shm=False)"
MOONCAKE = "Mooncake Store over TCP"
CALL_TIMEOUT_S = 30.0
MOONCAKE_MIN_SEGMENT = 16 << 20  # 0.3.13: a storage process with a smaller global segment does not start (9 MiB)


@dataclass
class Run:
    """One system's replay of the trace."""

    name: str
    blocks: int = 0  # asked
    fetched: int = 0
    lookup_s: list[float] = field(default_factory=list)
    fetch_s: list[float] = field(default_factory=list)
    put_s: list[float] = field(default_factory=list)
    short: int = 0  # blocks a Lookup reported that the fetch did not return
    put_failed: int = 0  # puts (kvcache: blocks rejected; Mooncake: put_batch calls not 0)
    held: int = 0  # blocks stored at the end
    wall_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    notes: str = ""

    def figures(self) -> dict[str, float]:
        def ms(xs: list[float], q: float) -> float:
            return percentile(xs, q) * 1e3 if xs else float("nan")

        busy = sum(self.lookup_s) + sum(self.fetch_s) + sum(self.put_s)
        return {
            "hit ratio": self.fetched / self.blocks if self.blocks else float("nan"),
            "Lookup p50 ms": ms(self.lookup_s, 50),
            "Lookup p99 ms": ms(self.lookup_s, 99),
            "fetch p50 ms": ms(self.fetch_s, 50),
            "fetch p99 ms": ms(self.fetch_s, 99),
            "put p50 ms": ms(self.put_s, 50),
            "blocks/s": self.blocks / busy if busy else float("nan"),
        }


FIGURES = ("hit ratio", "Lookup p50 ms", "Lookup p99 ms", "fetch p50 ms", "fetch p99 ms", "put p50 ms", "blocks/s")
HIGHER_IS_BETTER = {"hit ratio", "blocks/s"}
TARGETS = ("Lookup p50 ms", "fetch p50 ms", "blocks/s", "hit ratio")  # the four


@dataclass(frozen=True)
class Setup:
    namespace: str
    trace_keys: list[list[bytes]]
    distinct: list[bytes]
    payload_bytes: int
    block_bytes: int  # encoded
    capacity_blocks: int


# -- kvcache --------------------------------------------------------------------------------------


def replay_kvcache(name: str, shm: bool, s: Setup, args: argparse.Namespace) -> Run:
    run = Run(name)
    sets = [
        f"ram.capacity_bytes={s.capacity_blocks * RamTier.entry_cost_of(s.block_bytes)}",
        f"ram.presence_block_bytes={s.block_bytes}",
    ]
    servers: list[ServerProcess] = []
    filler = os.urandom(s.payload_bytes)
    longest = max(len(k) for k in s.trace_keys)
    dst = [np.empty(s.payload_bytes, dtype=np.uint8) for _ in range(longest)]
    try:
        (port,) = start_kvcaches({"small-trace": sets}, servers, dict(os.environ)).values()
        with KVCacheClient(f"127.0.0.1:{port}", shm=shm, timeout_s=CALL_TIMEOUT_S) as client:
            warm = [bytes(16)]  # first calls map the arena and the index, open channels; then deleted
            client.put_many("warm", [(warm[0], encode_block(filler, key=warm[0], dtype="uint8", shape=(len(filler),)))])
            client.lookup("warm", warm)
            client.get_into("warm", warm, dst[:1])
            client.get_many("warm", warm)
            client.delete("warm", warm)
            run.load = (os.getloadavg()[0], 0.0)
            start = time.perf_counter()
            for keys in s.trace_keys:
                t0 = time.perf_counter()
                p = client.lookup(s.namespace, keys).prefix_length
                run.lookup_s.append(time.perf_counter() - t0)
                g = 0
                if p:
                    t1 = time.perf_counter()
                    if args.get == "get_into":
                        g = leading(client.get_into(s.namespace, keys[:p], dst[:p], prefix_only=True), bool)
                    else:
                        got = client.get_many(s.namespace, keys[:p], prefix_only=True)
                        g = leading(got, lambda b: b is not None)
                    run.fetch_s.append(time.perf_counter() - t1)
                if g < len(keys):
                    t2 = time.perf_counter()
                    rest = keys[g:]
                    items = list(zip(rest, encode_bytes_parts(rest, [filler] * len(rest)), strict=True))
                    run.put_failed += client.put_many(s.namespace, items).rejected
                    run.put_s.append(time.perf_counter() - t2)
                run.blocks += len(keys)
                run.fetched += g
                run.short += p - g
            run.wall_s = time.perf_counter() - start
            run.load = (run.load[0], os.getloadavg()[0])
            ram = next(t for t in client.stats().tiers if t.name == "ram")
            run.held = int(ram.blocks)
            c = client.presence.counters
            run.notes = (
                f"presence {client.presence.state}: Lookups local {c.local:,}, partial {c.partial:,}, rpc {c.rpc:,}, "
                f"blocks read in place {c.read_in_place:,} (read again {c.read_again:,}); "
                f"RAM evictions {int(ram.evictions):,}; corrupt {client.corrupt_blocks}"
            )
        if not servers[-1].alive():
            raise RuntimeError(f"the kvcache server exited during the run{servers[-1].stderr_tail()}")
    finally:
        for proc in servers:
            proc.stop()
    return run


# -- Mooncake -------------------------------------------------------------------------------------


class MooncakeDriver:
    """bench/peers/mooncake_small_driver.py in its own environment: one line per call, timed there."""

    def __init__(self, python: Path, s: Setup) -> None:
        segment = s.capacity_blocks * s.payload_bytes
        buffer = max(64 << 20, 2 * max(len(k) for k in s.trace_keys) * s.payload_bytes)
        argv = ["unshare", "-n", str(python), str(PEER_DIR / "mooncake_small_driver.py")]
        argv += [str(segment), str(s.payload_bytes), str(buffer)]
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed with the driver
        env = {**os.environ, "PYTHONPATH": ""}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ready":
            self._log.seek(0)
            log = self._log.read()[-1500:]
            self.close()
            raise RuntimeError(f"did not start: {line.strip()} {log}")

    def call(self, op: str, keys: Sequence[str]) -> tuple[int, float]:
        self.proc.stdin.write(f"{op} {' '.join(keys)}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        out, took = self.proc.stdout.readline().split()  # type: ignore[union-attr]
        return int(out), float(took)

    def count(self, keys: Sequence[str]) -> int:
        self.proc.stdin.write(f"count {' '.join(keys)}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return int(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(60)
        except Exception:  # a driver that will not stop is killed
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def replay_mooncake(python: Path, s: Setup) -> Run:
    run = Run(MOONCAKE)
    hexes = [[k.hex() for k in keys] for keys in s.trace_keys]
    codes: dict[int, int] = {}
    driver = MooncakeDriver(python, s)
    try:
        run.load = (os.getloadavg()[0], 0.0)
        start = time.perf_counter()
        for keys in hexes:
            p, took = driver.call("exists", keys)
            run.lookup_s.append(took)
            g = 0
            if p:
                g, took = driver.call("get", keys[:p])
                run.fetch_s.append(took)
            if g < len(keys):
                rc, took = driver.call("put", keys[g:])
                run.put_s.append(took)
                if rc != 0:
                    run.put_failed += 1
                    codes[rc] = codes.get(rc, 0) + 1
            run.blocks += len(keys)
            run.fetched += g
            run.short += p - g
        run.wall_s = time.perf_counter() - start
        run.load = (run.load[0], os.getloadavg()[0])
        run.held = driver.count([k.hex() for k in s.distinct])
        run.notes = f"put_batch calls not 0: {run.put_failed:,} (codes: {codes or '-'})"
    finally:
        driver.close()
    return run


# -- report ---------------------------------------------------------------------------------------


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def fmt(name: str, x: float) -> str:
    if x != x:  # nan
        return "-"
    if name == "hit ratio":
        return f"{x:.3f}"
    return f"{x:,.0f}" if name == "blocks/s" else f"{x:.3f}"


def table(runs: dict[str, dict[str, float]], extra: dict[str, list[str]] | None = None) -> str:
    extra = extra or {}
    extra_heads = ["held at end", "load 1m"] if extra else []
    rows = [[name, *(fmt(f, r[f]) for f in FIGURES), *extra.get(name, [])] for name, r in runs.items()]
    return render_table(["system", *FIGURES, *extra_heads], rows)


def ratios(medians: dict[str, dict[str, float]]) -> str:
    if MOONCAKE not in medians:
        return "  (no Mooncake row: no ratios)"
    mc = medians[MOONCAKE]
    rows, verdicts = [], []
    for name in (KV_SHM, KV_REMOTE):
        if name not in medians:
            continue
        r = medians[name]
        cells = [f"{r[f] / mc[f]:.2f}" if mc[f] and mc[f] == mc[f] and r[f] == r[f] else "-" for f in FIGURES]
        rows.append([f"{name} / Mooncake", *cells])
        met = [
            f"{f} {'met' if (r[f] >= mc[f] if f in HIGHER_IS_BETTER else r[f] <= mc[f]) else 'MISSED'}" for f in TARGETS
        ]
        verdicts.append(f"  targets, {name}: " + ", ".join(met))
    return render_table(["ratio", *FIGURES], rows) + "\n" + "\n".join(verdicts)


def median_runs(passes: list[dict[str, Run]]) -> dict[str, dict[str, float]]:
    names = [n for n in (KV_SHM, KV_REMOTE, MOONCAKE) if any(n in p for p in passes)]
    out = {}
    for n in names:
        figs = [p[n].figures() for p in passes if n in p]
        out[n] = {f: statistics.median(x[f] for x in figs) for f in FIGURES}
    return out


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--trace", default=str(TRACE), help="a Mooncake JSONL trace (default: the committed one)")
    p.add_argument("--requests", type=int, default=3000, help="the trace's first N requests (default 3000)")
    p.add_argument("--block-kib", type=int, default=16, help="payload of one block in KiB (default 16)")
    p.add_argument("--ram-share", type=float, default=0.10, help="capacity, share of the working set (default 0.1)")
    p.add_argument("--passes", type=int, default=2, help="passes over all systems, alternating order (default 2)")
    p.add_argument("--get", choices=("get_into", "get_many"), default="get_into", help="kvcache's fetch")
    p.add_argument("--no-mooncake", action="store_true")
    p.add_argument("--peers-dir", default=os.environ.get("KVCACHE_PEERS_DIR", "/tmp/peers"))
    p.add_argument("--json", metavar="PATH", help="also write every run's figures here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.block_kib < 1 or args.passes < 1 or not 0 < args.ram_share <= 1:
        p.error("--requests, --block-kib and --passes must be >= 1, --ram-share in (0, 1]")
    return args


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    trace = load_trace(args.trace, args.requests)
    payload = args.block_kib * KiB
    space = Namespace("bench/small-trace", "uint8", BLOCK_TOKENS, 1, 1, payload)
    trace_keys = [chain_keys(r.hash_ids, space.fingerprint, {}) for r in trace]
    distinct = list(dict.fromkeys(k for ks in trace_keys for k in ks))
    block_bytes = len(encode_block(bytes(payload), key=bytes(16), dtype="uint8", shape=(payload,)))
    capacity = round(args.ram_share * len(distinct))
    s = Setup(space.fingerprint.hex(), trace_keys, distinct, payload, block_bytes, capacity)
    total = sum(len(k) for k in trace_keys)
    print("kvcache small-call trace bench: Lookup, fetch of the present prefix, put of the rest; one client")
    print(f"  trace: {args.trace}: first {len(trace):,} requests, {total:,} blocks asked, {len(distinct):,} distinct")
    print(
        f"  blocks {args.block_kib} KiB payload ({block_bytes:,} B encoded for kvcache); capacity "
        f"{args.ram_share:.0%} of the working set = {capacity:,} blocks: kvcache ram.capacity_bytes "
        f"{capacity * RamTier.entry_cost_of(block_bytes):,} ({RamTier.entry_cost_of(block_bytes):,} B a block), "
        f"Mooncake global segment {capacity * payload:,} ({payload:,} B a block)"
    )
    print(f"  {os.cpu_count()} CPUs, load average {loadavg()}; kvcache fetch: {args.get}")
    systems: list[tuple[str, Callable[[], Run]]] = [
        (KV_SHM, lambda: replay_kvcache(KV_SHM, True, s, args)),
        (KV_REMOTE, lambda: replay_kvcache(KV_REMOTE, False, s, args)),
    ]
    python = Path(args.peers_dir) / "mc" / "bin" / "python"
    if args.no_mooncake:
        print("  skipped Mooncake: --no-mooncake")
    elif not python.exists():
        print(f"  skipped Mooncake: no virtual environment at {python.parent.parent} (install it as peers.md says)")
    elif capacity * payload < MOONCAKE_MIN_SEGMENT:
        print(f"  skipped Mooncake: its storage process does not start with a segment under {MOONCAKE_MIN_SEGMENT:,} B")
    else:
        systems.append((MOONCAKE, lambda: replay_mooncake(python, s)))
    passes: list[dict[str, Run]] = []
    for i in range(args.passes):
        order = systems if i % 2 == 0 else systems[::-1]
        print(f"\npass {i + 1}: " + ", then ".join(n for n, _ in order), flush=True)
        done: dict[str, Run] = {}
        for name, fn in order:
            try:
                r = fn()
            except (OSError, RuntimeError) as exc:
                if name != MOONCAKE:
                    raise
                print(f"  skipped Mooncake: {exc}")
                systems = [x for x in systems if x[0] != MOONCAKE]
                continue
            done[name] = r
            print(
                f"  {name}: {r.wall_s:.1f} s, hit ratio {r.fetched / r.blocks:.3f}, held {r.held:,} blocks, "
                f"load {r.load[0]:.2f}-{r.load[1]:.2f}; fetch short of Lookup {r.short:,}; {r.notes}",
                flush=True,
            )
        passes.append(done)
        extra = {n: [f"{r.held:,}", f"{r.load[0]:.2f}-{r.load[1]:.2f}"] for n, r in done.items()}
        print()
        print(table({n: done[n].figures() for n in (KV_SHM, KV_REMOTE, MOONCAKE) if n in done}, extra))
    medians = median_runs(passes)
    print(f"\nmedians over {args.passes} pass(es):")
    print(table(medians))
    print("\nkvcache / Mooncake (latencies: at most 1 is as fast or faster; hit ratio and blocks/s: at least 1):")
    print(ratios(medians))
    print(f"\nload average at the end {loadavg()}; total {time.monotonic() - t_start:.0f} s")
    if args.json:
        doc = {
            "requests": len(trace),
            "blocks_asked": total,
            "distinct": len(distinct),
            "capacity_blocks": capacity,
            "passes": [{n: r.figures() | {"held": r.held, "load": r.load} for n, r in p.items()} for p in passes],
            "medians": medians,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
