"""Capacity decides the hit ratio: Mooncake's conversation trace through RAM alone, RAM + disk, RAM + Redis.

Run from the repository root with the project's virtualenv:

    python bench/bench_capacity.py                       # the whole trace, 4 KiB blocks (~10 minutes here)
    python bench/bench_capacity.py --requests 2000       # its first 2,000 requests (smoke run, ~1 minute)
    python bench/bench_capacity.py --extra-disk 0.25 --extra-disk 0.25:1 --json out.json

Trace: Mooncake's FAST'25 conversation trace (kvcache-ai/Mooncake, FAST25-release/traces/
conversation_trace.jsonl: 12,031 requests sampled from one hour of online traffic, 512-token prefix
blocks), committed here as bench/traces/conversation_trace.jsonl.xz (origin and checksum in
docs/disk-benchmarks.md); --trace reads another file of the same format. Requests are replayed in
trace order, one at a time (closed loop, one client: the timestamps only set the order), each as an
engine's connector does it:

    keys      one chunk key per hash id, chained (kvcache_core.keys.chunk_key of the previous key):
              each key names one exact prefix, as bench_trace_replay.py builds them.
    Lookup    of all keys: p blocks found.
    Get       keys[:p], prefix_only: g leading blocks served (verified by the SDK): the hits.
    Put       keys[g:], what the engine computed.

Model shape (--head-size): fp16 KV of 1 layer and 1 KV head of head size 2, K and V: 8 bytes per token,
4 KiB per 512-token block, a stand-in small enough for the whole trace to run in minutes on 2 CPUs.
The hit ratio depends on capacities in blocks, not on block bytes, so every capacity below is a share
of the trace's working set (its distinct blocks) and is converted into each tier's bytes with that
tier's own per-block cost:

    RAM       align64(block) + ENTRY_OVERHEAD_BYTES (384) per block: ram.capacity_bytes (docs/tiers.md).
    disk      its record span (header + namespace + block, 8-aligned), rounded up to whole regions of
              --region-mib: disk.capacity_bytes.
    Redis     the sizing rule of docs/tiers.md "Sizing Redis and S3": maxmemory = its used_memory when
              empty + 1.26 x block bytes + 200 bytes per block; allkeys-lru.

Reported, for one run:
    ideal     from the trace alone: per request, the leading blocks that any earlier request had (an
              unbounded cache that stores every block it sees).
    LRU sim   the same with a block LRU of a capacity in blocks (pure Python, bench_trace_replay's
              ideal_hits): at RAM's capacity, and at the capacity of the configuration's largest tier.
              The lower tiers here hold a copy of every block put (write-through Redis, write-behind
              disk), so RAM's blocks are a subset of theirs and the configuration's capacity is the lower
              tier's; the sum of both capacities is shown beside it, an upper bound.
    achieved  through a real kvcache server (one per phase, started here) over gRPC: blocks served by
              the Gets / blocks requested; which tier the Lookups found them in; "short of LRU", blocks
              the LRU simulation at that capacity served and the server did not (summed per request),
              and "over LRU", the reverse; the server's counters: write-behind drops, demotions, disk
              evictions (whole regions), Redis evicted keys.

Phases (all on one file system, --dir, default a temporary directory):
    RAM 10%                   ram.capacity_bytes for 10% (--ram-share) of the working set.
    RAM 10% + disk 100%       and a disk tier for 100% of it (write-behind, the default; --disk-write-mode).
    RAM 10% + Redis 100%      and a redis-server started here (write-through, the default).
    RAM 10% + disk X%         with --extra-disk X[:REGION_MIB] (repeatable), a disk for X of the working set
                              (regions of REGION_MIB, default --region-mib): where eviction by region shows.

The machine's load average is printed beside each phase: the 2 CPUs are shared.

Exit status 0 unless a Get served a corrupt block or a phase failed; the issue's targets (with the disk
tier within 1 point of the ideal and 0.5 point of the LRU simulation) are printed, not enforced.

Longer than the project's ~500-line module guideline on purpose: one self-contained benchmark whose
simulations, sizing, replay and report are meant to be read together; nothing in it is imported elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
from _common import MiB, ServerProcess, exit_on_sigterm
from bench_tiers import find_binary, render_table, start_kvcaches, start_redis
from bench_trace_replay import BLOCK_TOKENS, chain_keys, leading, load_trace

from kvcache_client import KVCacheClient, KVCacheError
from kvcache_client.results import ServerStats
from kvcache_core.format import encode_block
from kvcache_core.keys import Namespace
from kvcache_server.arena import align
from kvcache_server.tiers import disk_layout
from kvcache_server.tiers.ram import ENTRY_OVERHEAD_BYTES

TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl.xz"
CALL_TIMEOUT_S = 30.0  # every Lookup, Get and Put: capacity is measured here, not deadlines
REDIS_VALUE_FACTOR = 1.26  # docs/tiers.md "Sizing Redis and S3": jemalloc's size classes
REDIS_KEY_BYTES = 200  # ... plus about 200 bytes a key
DRAIN_TIMEOUT_S = 120.0


# -- the simulations -----------------------------------------------------------------------------


def lru_prefixes(requests: Sequence[Sequence[bytes]], capacity_blocks: int | None) -> list[int]:
    """Per request, the leading blocks a block LRU of `capacity_blocks` (None: unbounded) holds, in trace order.

    The same model as bench_trace_replay.ideal_hits (whose sum it is): a request's leading cached
    blocks are hits, then all its blocks are stored or touched in order, and the least recently used
    beyond the capacity dropped."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    out = []
    for keys in requests:
        out.append(leading(keys, lru.__contains__))
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return out


@dataclass
class RegionModel:
    """A model of RAM over the disk tier, in blocks: what the server does, without bytes or timing.

        RAM: a block LRU of `ram_blocks`; a Get touches what it hits, a disk hit is promoted into RAM;
        RAM's evictions are demoted to the disk unless it holds them (a Get's RAM hits are served before its disk
    reads, whose promotions may evict them). Disk: `regions` regions of
        `per_region` records, one active region appended to (the stack's write-behind drains one batch
        at a time, so one writer thread works), sealed regions in LRU order, touched when read (not when
        RAM serves their blocks); a new region is an unused one, else the least recently used is evicted
        whole. Per request: the leading blocks in RAM or on disk are hits; the promotions' demotions are
        written, then the Put's blocks go into RAM and its demotions and then its blocks onto the disk.
    """

    ram_blocks: int
    regions: int
    per_region: int
    ram: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    where: dict[bytes, int] = field(default_factory=dict)  # key -> its region
    members: list[list[bytes]] = field(default_factory=list)  # per region, the keys written in its epoch
    unused: list[int] = field(default_factory=list)  # regions never written, popped from the end
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    active: int | None = None
    fill: int = 0
    writes: int = 0
    evicted: int = 0
    demoted: int = 0

    def __post_init__(self) -> None:
        self.members = [[] for _ in range(self.regions)]
        self.unused = list(range(self.regions - 1, -1, -1))

    def _write(self, key: bytes) -> None:
        if key in self.where:
            return
        if self.active is None or self.fill >= self.per_region:
            if self.active is not None:
                self.lru[self.active] = None
            if self.unused:
                self.active = self.unused.pop()
            else:
                self.active = self.lru.popitem(last=False)[0]
                for k in self.members[self.active]:
                    if self.where.get(k) == self.active:
                        del self.where[k]
                        self.evicted += 1
                self.members[self.active] = []
            self.fill = 0
        self.where[key] = self.active
        self.members[self.active].append(key)
        self.fill += 1
        self.writes += 1

    def _to_ram(self, key: bytes, demote: list[bytes]) -> None:
        self.ram[key] = None
        self.ram.move_to_end(key)
        while len(self.ram) > self.ram_blocks:
            demote.append(self.ram.popitem(last=False)[0])

    def _demote(self, keys: list[bytes]) -> None:
        for key in keys:
            if key not in self.where:
                self.demoted += 1
                self._write(key)

    def request(self, keys: Sequence[bytes]) -> int:
        hits = leading(keys, lambda k: k in self.ram or k in self.where)
        from_disk = []
        for key in keys[:hits]:  # the Get serves RAM's hits first (under leases), then reads the disk
            if key in self.ram:
                self.ram.move_to_end(key)
            else:
                from_disk.append(key)
        demote: list[bytes] = []
        for key in from_disk:
            region = self.where[key]
            if region in self.lru:
                self.lru.move_to_end(region)
            self._to_ram(key, demote)
        self._demote(demote)
        demote = []
        for key in keys[hits:]:
            self._to_ram(key, demote)
        self._demote(demote)
        for key in keys[hits:]:
            self._write(key)
        return hits


# -- sizes ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    """Per-block costs of each tier, and the working set in blocks."""

    payload_bytes: int
    block_bytes: int  # encoded
    distinct: int
    nslen: int

    def ram(self, share: float) -> tuple[int, int]:
        """(blocks, ram.capacity_bytes) for `share` of the working set."""
        blocks = round(share * self.distinct)
        return blocks, blocks * (align(self.block_bytes) + ENTRY_OVERHEAD_BYTES)

    def disk(self, share: float, region_bytes: int) -> tuple[int, int, int]:
        """(regions, records per region, disk.capacity_bytes): `share` of the working set, up to whole regions."""
        span = disk_layout.record_span(self.nslen, self.block_bytes)
        per_region = (region_bytes - disk_layout.REGION_HEADER_BYTES) // span
        regions = math.ceil(share * self.distinct / per_region)
        return regions, per_region, regions * region_bytes

    def redis(self, share: float, baseline_bytes: int) -> tuple[int, int]:
        """(blocks, maxmemory) by the sizing rule."""
        blocks = round(share * self.distinct)
        return blocks, baseline_bytes + math.ceil(blocks * (REDIS_VALUE_FACTOR * self.block_bytes + REDIS_KEY_BYTES))


# -- the replay ----------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    lower: str  # "", "disk", "redis"
    ram_blocks: int
    lower_blocks: int
    capacity_bytes: dict[str, int]
    lru: list[int]  # per request, the LRU simulation's hits at this configuration's capacity
    lru_hits: int = 0
    lru_sum_hits: int = 0  # at RAM's plus the lower tier's capacity (an upper bound)
    model: RegionModel | None = None  # disk phases: the model of RAM over regions, after the trace
    model_hits: int = 0
    requests: int = 0
    blocks: int = 0
    served: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    short_of_lru: int = 0
    over_lru: int = 0
    get_short: int = 0  # blocks a Lookup reported that its Get did not serve
    lookup_failed: int = 0
    put_failed: int = 0
    put_dropped: dict[str, int] = field(default_factory=dict)  # per tier: Put blocks a write-behind queue dropped
    corrupt: int = 0
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end
    server: dict[str, dict[str, int]] = field(default_factory=dict)
    redis_evicted: int = 0
    redis_keys: int = 0

    @property
    def ratio(self) -> float:
        return self.served / self.blocks if self.blocks else 0.0


def block_for(key: bytes, filler: bytes) -> bytes:
    payload = key + filler[len(key) :]
    return encode_block(payload, key=key, dtype="uint8", shape=(len(payload),))


COUNTERS = ("blocks", "hits", "misses", "puts", "evictions", "rejected", "errors", "checksum_failures")
COUNTERS += ("promotions", "demotions", "write_errors", "queue_dropped", "queue_depth", "skipped")


def counters(stats: ServerStats) -> dict[str, dict[str, int]]:
    return {t.name: {n: int(getattr(t, n)) for n in COUNTERS} for t in stats.tiers}


def drained(client: KVCacheClient) -> dict[str, dict[str, int]]:
    """The server's counters once its write-behind queues are empty."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        now = counters(client.stats(timeout_s=CALL_TIMEOUT_S))
        if all(t["queue_depth"] == 0 for t in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def replay(phase: Phase, target: str, namespace: str, trace_keys: Sequence[list[bytes]], payload_bytes: int) -> None:
    filler = os.urandom(payload_bytes)
    phase.load = (os.getloadavg()[0], 0.0)
    start = time.monotonic()
    with KVCacheClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        before = counters(client.stats())
        for i, keys in enumerate(trace_keys):
            try:
                found = client.lookup(namespace, keys)
                p, tiers = found.prefix_length, found.tiers
            except KVCacheError:
                phase.lookup_failed += 1
                p, tiers = 0, ()
            blocks = client.get_many(namespace, keys[:p], prefix_only=True) if p else []
            g = leading(blocks, lambda b: b is not None)
            if g < len(keys):
                items = [(key, block_for(key, filler)) for key in keys[g:]]
                try:
                    result = client.put_many(namespace, items)
                    for t in result.tiers:
                        if t.dropped:
                            phase.put_dropped[t.name] = phase.put_dropped.get(t.name, 0) + t.dropped
                    phase.put_failed += result.rejected
                except KVCacheError:
                    phase.put_failed += len(items)
            phase.requests += 1
            phase.blocks += len(keys)
            phase.served += g
            phase.get_short += p - g
            for t in tiers[:g]:
                phase.by_tier[t] = phase.by_tier.get(t, 0) + 1
            phase.short_of_lru += max(0, phase.lru[i] - g)
            phase.over_lru += max(0, g - phase.lru[i])
            if (i + 1) % 3000 == 0:
                print(
                    f"    {i + 1:,} requests, {time.monotonic() - start:.0f} s, hit ratio {phase.ratio:.2%}", flush=True
                )
        phase.seconds = time.monotonic() - start
        after = drained(client)
        phase.corrupt = client.corrupt_blocks
    phase.load = (phase.load[0], os.getloadavg()[0])
    gauges = ("blocks", "queue_depth")
    phase.server = {
        name: {k: v if k in gauges else v - before.get(name, {}).get(k, 0) for k, v in tier.items()}
        for name, tier in after.items()
    }


# -- report --------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{x:.2%}"


def report(phases: Sequence[Phase], ideal: int, total: int) -> str:
    headers = ["configuration", "ideal", "LRU sim", "LRU sim (sum)", "region model", "achieved", "vs ideal", "vs LRU"]
    headers += ["short / over LRU", "from RAM / lower", "load"]
    rows = []
    for p in phases:
        lower = sum(v for k, v in p.by_tier.items() if k != "ram")
        rows.append(
            [
                p.name,
                pct(ideal / total),
                pct(p.lru_hits / total),
                pct(p.lru_sum_hits / total) if p.lower else "-",
                pct(p.model_hits / total) if p.model is not None else "-",
                pct(p.ratio),
                f"{(p.served - ideal) / total * 100:+.2f} pt",
                f"{(p.served - p.lru_hits) / total * 100:+.2f} pt",
                f"{p.short_of_lru:,} / {p.over_lru:,}",
                f"{p.by_tier.get('ram', 0):,} / {lower:,}",
                f"{p.load[0]:.1f}-{p.load[1]:.1f}",
            ]
        )
    return render_table(headers, rows)


def tier_notes(p: Phase) -> str:
    ram = p.server.get("ram", {})
    parts = [f"RAM holds {ram.get('blocks', 0):,} blocks (sized {p.ram_blocks:,}), evicted {ram.get('evictions', 0):,}"]
    for name in ("disk", "redis"):
        t = p.server.get(name)
        if t is None:
            continue
        held = f"{t['blocks']:,}" if name == "disk" else f"{p.redis_keys:,} keys (redis-server's DBSIZE)"
        parts.append(
            f"{name} holds {held} (sized {p.lower_blocks:,}), puts {t['puts']:,}, "
            f"evicted {t['evictions']:,}, demotions {t['demotions']:,}, queue dropped {t['queue_dropped']:,}, "
            f"rejected {t['rejected']:,}, errors {t['errors']:,}, write errors {t['write_errors']:,}, "
            f"checksum failures {t['checksum_failures']:,}, promotions {t['promotions']:,}"
        )
    if p.model is not None:
        m = p.model
        parts.append(
            f"region model: disk writes {m.writes:,}, evicted {m.evicted:,}, demotions {m.demoted:,}, "
            f"holds {len(m.where):,}"
        )
    if p.lower == "redis":
        parts.append(f"redis-server evicted_keys {p.redis_evicted:,}")
    parts.append(
        f"Put blocks dropped by a queue {sum(p.put_dropped.values()):,}, Puts not stored {p.put_failed:,}, "
        f"Lookups failed {p.lookup_failed:,}, Gets short of their Lookup {p.get_short:,}, corrupt {p.corrupt:,}"
    )
    return f"  {p.name} ({p.requests:,} requests in {p.seconds:.0f} s):\n    " + ";\n    ".join(parts)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Mooncake's conversation trace through RAM, RAM + disk, RAM + Redis.")
    p.add_argument(
        "--trace", default=str(TRACE), help="a Mooncake JSONL trace, .xz or plain (default: the committed one)"
    )
    p.add_argument("--requests", type=int, help="replay only the first N requests (default: all)")
    p.add_argument("--head-size", type=int, default=2, help="the model shape's head size (fp16, 1 layer, 1 KV head)")
    p.add_argument("--ram-share", type=float, default=0.10, help="RAM's share of the working set (default 0.10)")
    p.add_argument("--region-mib", type=int, default=8, help="disk.region_bytes in MiB (default 8)")
    p.add_argument(
        "--extra-disk",
        action="append",
        default=[],
        metavar="SHARE[:REGION_MIB]",
        help="also RAM + a disk for SHARE of the working set (e.g. 0.25, or 0.25:1 with 1 MiB regions); repeatable",
    )
    p.add_argument("--no-redis", action="store_true", help="skip the Redis phase")
    p.add_argument(
        "--disk-write-mode",
        choices=("behind", "through"),
        default="behind",
        help="disk.write_mode (default behind, the tier's default; through: Puts wait for the disk)",
    )
    p.add_argument("--dir", help="where the disk tier's files go (default: a temporary directory)")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    if args.head_size < 1 or not 0 < args.ram_share < 1 or args.region_mib < 1:
        p.error("--head-size and --region-mib must be >= 1, --ram-share in (0, 1)")
    extra = []
    for spec in args.extra_disk:
        share, _, region = spec.partition(":")
        try:
            extra.append((float(share), int(region) if region else args.region_mib))
        except ValueError:
            p.error(f"--extra-disk {spec!r}: expected SHARE or SHARE:REGION_MIB")
        if not 0 < extra[-1][0] <= 4 or extra[-1][1] < 1:
            p.error(f"--extra-disk {spec!r}: SHARE must be in (0, 4] and REGION_MIB >= 1")
    args.extra_disk = extra
    return args


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    trace = load_trace(args.trace, args.requests)
    space = Namespace("bench/capacity", "float16", BLOCK_TOKENS, 1, 1, args.head_size)
    payload_bytes = 2 * BLOCK_TOKENS * args.head_size * 2  # K and V, fp16
    namespace = space.fingerprint.hex()
    trace_keys = [chain_keys(r.hash_ids, space.fingerprint, {}) for r in trace]
    total = sum(len(k) for k in trace_keys)
    distinct = len({k for ks in trace_keys for k in ks})
    block_bytes = len(block_for(bytes(16), bytes(payload_bytes)))
    sizes = Sizes(payload_bytes, block_bytes, distinct, len(namespace.encode()))
    ideal_per = lru_prefixes(trace_keys, None)
    ideal = sum(ideal_per)
    ram_blocks, ram_bytes = sizes.ram(args.ram_share)
    ram_lru = lru_prefixes(trace_keys, ram_blocks)
    ram_pct = f"{args.ram_share:.0%}"
    print("kvcache capacity bench: trace replay through Lookup, Get of the hit prefix, Put of the rest")
    print(f"  trace: {args.trace}: {len(trace):,} requests, {total:,} blocks requested, {distinct:,} distinct")
    print(
        f"  model shape: fp16, 1 layer, 1 KV head, head size {args.head_size}: {payload_bytes:,} B per "
        f"{BLOCK_TOKENS}-token block ({block_bytes:,} B encoded); working set {distinct * block_bytes / MiB:,.0f} MiB"
    )
    print(f"  {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; ideal (unbounded) {ideal / total:.2%}")
    base = Path(tempfile.mkdtemp(prefix="kvcache-capacity-", dir=args.dir))
    servers: list[ServerProcess] = []
    phases: list[Phase] = []
    rclient: redis.Redis | None = None
    status = 0
    try:
        region = args.region_mib
        plans = [(f"RAM {ram_pct}", "", 0.0, region), (f"RAM {ram_pct} + disk 100%", "disk", 1.0, region)]
        for s, r in args.extra_disk:
            plans.append(
                (f"RAM {ram_pct} + disk {s:.0%}" + (f" ({r} MiB regions)" if r != region else ""), "disk", s, r)
            )
        if not args.no_redis:
            plans.append((f"RAM {ram_pct} + Redis 100%", "redis", 1.0, region))
            redis_port, rclient = start_redis(find_binary(args.redis_server), servers)
            print(f"  started redis-server on 127.0.0.1:{redis_port}")
        for name, lower, share, region_mib in plans:
            sets = [f"ram.capacity_bytes={ram_bytes}"]
            capacity = {"ram": ram_bytes}
            lower_blocks = 0
            if lower == "disk":
                regions, per_region, disk_bytes = sizes.disk(share, region_mib * MiB)
                lower_blocks = regions * per_region
                directory = base / f"disk{len(phases)}"
                sets += ["disk.enabled=true", f"disk.dir={directory}", f"disk.capacity_bytes={disk_bytes}"]
                sets += [f"disk.region_bytes={region_mib * MiB}", f"disk.write_mode={args.disk_write_mode}"]
                capacity["disk"] = disk_bytes
            elif lower == "redis":
                assert rclient is not None
                rclient.flushall()
                rclient.config_set("maxmemory", 0)
                lower_blocks, maxmemory = sizes.redis(share, int(rclient.info("memory")["used_memory"]))
                rclient.config_set("maxmemory", maxmemory)
                rclient.config_set("maxmemory-policy", "allkeys-lru")
                rclient.config_resetstat()
                sets += ["redis.enabled=true", f"redis.url=redis://127.0.0.1:{redis_port}/0", "redis.timeout_s=5"]
                capacity["redis"] = maxmemory
            lru = lru_prefixes(trace_keys, lower_blocks) if lower else ram_lru
            phase = Phase(name, lower, ram_blocks, lower_blocks, capacity, lru, lru_hits=sum(lru))
            if lower:
                phase.lru_sum_hits = sum(lru_prefixes(trace_keys, ram_blocks + lower_blocks))
            if lower == "disk":
                phase.model = RegionModel(ram_blocks, regions, per_region)
                phase.model_hits = sum(phase.model.request(keys) for keys in trace_keys)
            print(
                f"  {name}: "
                + ", ".join(f"{t} {b:,} B" for t, b in capacity.items())
                + f" (RAM {ram_blocks:,} blocks"
                + (f", {lower} {lower_blocks:,})" if lower else ")"),
                flush=True,
            )
            (port,) = start_kvcaches({f"phase{len(phases)}": sets}, servers, dict(os.environ)).values()
            proc = servers[-1]
            replay(phase, f"127.0.0.1:{port}", namespace, trace_keys, payload_bytes)
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run{proc.stderr_tail()}")
            if lower == "redis":
                assert rclient is not None
                phase.redis_evicted = int(rclient.info("stats")["evicted_keys"])
                phase.redis_keys = int(rclient.dbsize())
            proc.stop()
            phases.append(phase)
            print(
                f"    hit ratio {phase.ratio:.2%} (LRU sim {phase.lru_hits / total:.2%}, ideal {ideal / total:.2%}) "
                f"in {phase.seconds:.0f} s, load {phase.load[0]:.1f}-{phase.load[1]:.1f}",
                flush=True,
            )
            if phase.corrupt:
                status = 1
    finally:
        if rclient is not None:
            rclient.close()
        for proc in reversed(servers):
            proc.stop()
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(report(phases, ideal, total))
    print(
        "\nLRU sim: a block LRU of the configuration's capacity (RAM's, or the lower tier's, which holds a copy of "
        "every block);\n(sum): of RAM's plus the lower tier's; vs: achieved minus it, in points of the blocks "
        "requested;\nshort / over LRU: blocks per request the LRU sim served and the server did not, and the reverse"
    )
    print()
    for p in phases:
        print(tier_notes(p))
    for p in phases:
        if p.lower == "disk":
            ok_ideal = abs(p.served - ideal) / total <= 0.01
            ok_lru = abs(p.served - p.lru_hits) / total <= 0.005
            print(
                f"  target, {p.name}: within 1 point of the ideal: {'met' if ok_ideal else 'MISSED'}; "
                f"within 0.5 point of the LRU sim: {'met' if ok_lru else 'MISSED'}"
            )
    print(f"total run time {time.monotonic() - t_start:.0f} s")
    if args.json:
        doc = {
            "trace": args.trace,
            "requests": len(trace),
            "blocks_requested": total,
            "blocks_distinct": distinct,
            "payload_bytes": payload_bytes,
            "block_bytes": block_bytes,
            "ideal_hits": ideal,
            "phases": [
                {k: v for k, v in vars(p).items() if k not in ("lru", "model")} | {"hit_ratio": p.ratio} for p in phases
            ],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
