"""Replays a multi-turn trace through Lookup, Get and Put, Redis below a small RAM tier: hit ratio and lost hits.

(One file over 500 lines on purpose: a benchmark run as a script, whose trace, ideal and replay are read
together; nothing in it is imported elsewhere.)

Run from the repository root with the project's virtualenv:

    python bench/bench_trace_replay.py                            # full run (~25 s)
    python bench/bench_trace_replay.py --quick                    # smoke run (~10 s)
    python bench/bench_trace_replay.py --compare-fixed-timeout    # and first with the old fixed 0.15 s (x2)
    python bench/bench_trace_replay.py --compare-fixed-timeout --clients 16 --block-kib 128 --ram-mib 256
    python bench/bench_trace_replay.py --trace bench/traces/conversation_trace.jsonl.xz --requests 2000 --json out.json

The fourth line is the loaded case (~1 minute on 2 CPUs): 16 clients moving 128 KiB blocks keep
the server and Redis busy enough that a Redis Lookup sometimes takes more than 0.15 s.

What it answers: does a Lookup under vLLM's deadline (0.5 s, one attempt) report every block the
cache holds, so that the engine loads it instead of recomputing it, while Lookup's p99 stays bounded?

Trace: Mooncake's FAST'25 JSONL (`{"timestamp": ms, "input_length", "output_length", "hash_ids"}`,
hash_ids naming the 512-token blocks of the prompt, a block's id standing for its whole prefix) with
--trace (the conversation trace is committed as bench/traces/conversation_trace.jsonl.xz, origin in
docs/disk-benchmarks.md), else a synthetic one built here from a fixed seed: multi-turn sessions that share a few
system prompts (1 to 8 blocks), whose first turn brings 200-4,000 tokens (a fifth of them a document
of 8k-60k tokens) and each later turn the previous answer plus a new message, so that each turn's
prompt extends the previous turn's history (its full blocks; the partial last block changes); a
quarter of the requests are one-off prompts. Sessions start every 2 s on average, turns come about
60 s apart, and requests are replayed in timestamp order, so the turns of a hundred sessions
interleave and a session's history has usually left RAM (64 MiB) by its next turn, but not Redis.
Requests are replayed closed loop, as fast as --clients threads can (timestamps only set the order);
a request waits until no request in flight still has to store one of its blocks (a turn is sent after
the previous turn's answer), so several clients do not race a turn against its predecessor's Put.

Each request, as vLLM's connector does it (KVCacheClient(timeout_s=0.5, retry=RetryPolicy(max_attempts=1)),
one client per --clients thread):
    keys      one 16-byte chunk key per hash id, chained like the SDK's (kvcache_core.keys.chunk_key of the
              previous key and the id as two u32 "tokens", starting from the namespace's fingerprint):
              each key names one exact prefix.
    Lookup    of all keys, deadline 0.5 s: p blocks found (a failed Lookup counts as p = 0).
    Get       keys[:p], prefix_only (deadline 30 s): g leading blocks served, verified by the SDK.
    Put       the blocks keys[g:] (what the engine computed), --block-kib payload each, encoded with
              kvcache_core.format.encode_block bound to its key (deadline 30 s).

Reported, per phase (one kvcache server per phase, over a freshly flushed redis-server):
    hit ratio      blocks served by Gets / blocks requested.
    ideal          computed from the trace alone, in trace order: "unbounded" counts, per request, the
                   leading blocks whose keys any earlier request had (an infinite cache that stores every
                   block); "LRU RAM" is the same with a block LRU of the RAM tier's capacity in blocks
                   (what RAM alone could do); "LRU RAM+Redis" with RAM's plus Redis's capacity (--redis-mib;
                   unbounded Redis: equal to "unbounded").
    lost hits      client side: a Lookup lost hits when it answered p blocks although the blocks p, p+1,
                   ... up to e were stored before it was sent: e is the longest prefix of keys whose Put
                   had returned with Redis storing every block, and the bench checks with EXISTS, straight
                   to redis-server, which of keys[p:e] are still there (only evictions by --redis-mib make
                   that differ). Lost blocks = that run; "within deadline" are those of Lookups that
                   answered in under lookup_deadline_share x deadline (0.4 s of 0.5 s) on the client's
                   clock: the server stopped waiting for Redis while its caller still had time, the case
                   that must be 0. Server side: the sum of the lower tiers' `lookup_late_hits` (Stats),
                   keys a tier found after its Lookup had answered without them. The two differ only by
                   RAM-held keys after the first key RAM lacked, which a late Redis answer does not count.
                   A failed Lookup's blocks stored before it are counted apart ("failed (blocks)").
    stored again   blocks Put although an earlier Put had stored them: the lost blocks, sent again (the
                   engine recomputed them), and with --redis-mib blocks that Redis evicted.
    latency        client-side p50/p99 of Lookup (answered ones; failed ones are counted apart), of
                   Get (non-empty prefixes) and of Put.

With --compare-fixed-timeout the same replay runs first with `--set redis.lookup_timeout_s=0.15`: a
Lookup then waits at most 0.15 s for Redis whatever its deadline (the behaviour before Lookups waited
for what the caller's deadline leaves). The exit status is 1 when the deadline phase lost a hit that
the deadline allowed (or a Get served a corrupt block).

The machine is shared by the client threads, the kvcache server and redis-server: on a small machine
the figures include CPU contention, which is what makes a tier late.

Longer than the project's ~500-line module guideline on purpose: one self-contained benchmark whose
trace, ideals, replay and report are meant to be read together.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis
from _common import KiB, MiB, ServerProcess, exit_on_sigterm
from bench_tiers import find_binary, percentile, render_table, start_kvcaches, start_redis

from kvcache_client import KVCacheClient, KVCacheError, RetryPolicy
from kvcache_client.results import ServerStats
from kvcache_core.format import encode_block
from kvcache_core.keys import Namespace, chunk_key

BLOCK_TOKENS = 512  # Mooncake's hash_ids are 512-token blocks
DEADLINE_S = 0.5  # vLLM's Lookup budget
TRANSFER_TIMEOUT_S = 30.0  # vLLM's transfer_timeout_s, for Gets and Puts
LOOKUP_DEADLINE_SHARE = 0.8  # the server's limits.lookup_deadline_share (default)
OLD_FIXED_WAIT_S = 0.15  # what a Lookup waited for each lower tier before
REDIS_TIMEOUT_S = 5.0  # the Redis tier's per-call timeout (its default)
REDIS_ENTRY_OVERHEAD = 128  # approximate bytes Redis spends per key besides the value, for --redis-mib
SEED = 23


# -- the trace -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str, limit: int | None) -> list[Request]:
    """The first `limit` requests (all with None) of a Mooncake JSONL trace (.xz: compressed), in timestamp order."""
    out: list[Request] = []
    with lzma.open(path, "rt") if path.endswith(".xz") else open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(
                Request(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]), tuple(d["hash_ids"]))
            )
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)  # stable: ties keep the file's order
    return out


@dataclass
class _Session:
    full: list[int]  # ids of the history's full blocks
    tokens: int


def synthesize(n: int, seed: int = SEED) -> list[Request]:
    """A deterministic multi-turn conversation trace of `n` requests (see the module docstring)."""
    rng = random.Random(seed)
    ids = iter(range(1 << 62))
    systems = [[next(ids) for _ in range(k)] for k in (1, 2, 2, 4, 4, 8)]
    weights = [8, 4, 4, 2, 2, 1]
    # (time s, tokens added, output tokens, session or None for a one-off, its system prompt)
    events: list[tuple[float, int, int, _Session | None, list[int]]] = []
    t = 0.0
    while len(events) < n * 1.3:  # more than needed: the last sessions' later turns fall past the cut
        t += rng.expovariate(1 / 2.0)
        system = rng.choices(systems, weights)[0]
        if rng.random() < 0.25:
            events.append((t, rng.randint(200, 6000), rng.randint(50, 800), None, system))
            continue
        session = _Session(list(system), len(system) * BLOCK_TOKENS)
        added = rng.randint(8000, 60000) if rng.random() < 0.2 else rng.randint(200, 4000)
        ts = t
        for _ in range(rng.randint(2, 10)):
            out = rng.randint(50, 800)
            events.append((ts, added, out, session, system))
            ts += rng.expovariate(1 / 60.0) + out / 50  # think time + generation at 50 tokens/s
            added = out + rng.randint(20, 1500)  # the answer joins the history, then the next message
    events.sort(key=lambda e: e[0])
    out: list[Request] = []
    for ts, added, output, session, system in events[:n]:
        if session is None:  # one-off: the system prompt, then blocks of its own
            session = _Session(list(system), len(system) * BLOCK_TOKENS)
        session.tokens += added
        while len(session.full) < session.tokens // BLOCK_TOKENS:
            session.full.append(next(ids))
        tail = [next(ids)] if session.tokens % BLOCK_TOKENS else []  # a partial block: new with every turn
        out.append(Request(int(ts * 1000), session.tokens, output, (*session.full, *tail)))
    return out


def chain_keys(hash_ids: Iterable[int], fingerprint: bytes, memo: dict[tuple[bytes, int], bytes]) -> list[bytes]:
    """One chunk key per block, each the SDK's chunk_key of its parent and its hash id: one key, one prefix."""
    keys: list[bytes] = []
    parent = fingerprint
    for h in hash_ids:
        key = memo.get((parent, h))
        if key is None:
            key = memo[(parent, h)] = chunk_key(parent, [h & 0xFFFFFFFF, (h >> 32) & 0xFFFFFFFF])
        keys.append(key)
        parent = key
    return keys


# -- ideals --------------------------------------------------------------------------------------


T = TypeVar("T")


def leading(items: Sequence[T], present: Callable[[T], bool]) -> int:
    """How many leading items are present."""
    n = 0
    for item in items:
        if not present(item):
            break
        n += 1
    return n


def ideal_hits(requests: Sequence[Sequence[bytes]], capacity_blocks: int | None) -> int:
    """Blocks a prefix cache of `capacity_blocks` (None: unbounded) serves over the trace, in trace order.

    Each request's leading cached blocks are hits; then all its blocks are stored (or touched), in
    order, and the least recently used blocks beyond the capacity are dropped."""
    lru: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for keys in requests:
        hits += leading(keys, lru.__contains__)
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hits


# -- the replay ----------------------------------------------------------------------------------


@dataclass
class Phase:
    """One replay against one kvcache server: the client-side tallies and the server's counter deltas."""

    name: str
    requests: int = 0
    blocks: int = 0
    served: int = 0  # blocks the Gets returned (leading, verified)
    from_ram: int = 0  # of the Lookups' prefixes, per tier
    from_redis: int = 0
    failed: int = 0  # Lookups that raised (deadline exceeded)
    failed_lost: int = 0  # blocks stored before a failed Lookup was sent
    lost_lookups: int = 0
    lost_blocks: int = 0
    lost_within_deadline: int = 0  # of lost_blocks: Lookups that answered in < share x deadline
    get_short: int = 0  # blocks a Lookup reported that its Get did not serve
    stored_again: int = 0
    put_failed: int = 0  # Puts that raised or whose blocks did not all reach Redis
    corrupt: int = 0
    seconds: float = 0.0
    lookup_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    put_s: list[float] = field(default_factory=list)
    lost_lookup_s: list[float] = field(default_factory=list)
    server: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def late_hits(self) -> int:
        return sum(t.get("lookup_late_hits", 0) for name, t in self.server.items() if name != "ram")

    def to_json(self) -> dict[str, object]:
        d = {k: v for k, v in vars(self).items() if not k.endswith("_s")}
        d["hit_ratio"] = self.served / self.blocks if self.blocks else None
        d["late_hits"] = self.late_hits
        for op in ("lookup", "get", "put"):
            xs: list[float] = getattr(self, f"{op}_s")
            d[f"{op}_count"] = len(xs)
            for q in (50, 99):
                d[f"{op}_p{q}_s"] = percentile(xs, q) if xs else None
            d[f"{op}_max_s"] = max(xs, default=None)
        d["lost_lookup_s"] = self.lost_lookup_s
        return d


class Replay:
    """Hands the trace's requests to the client threads in order; keeps what is known to be stored.

    A request is handed out only once no request in flight still has to store one of its blocks
    (the next turn of a conversation comes after the previous turn's answer), so that with several
    clients a turn does not race its predecessor's Put; the requests after it wait too (trace order).
    """

    def __init__(self, phase: Phase, namespace: str, keys: Sequence[list[bytes]], block_bytes: int) -> None:
        self.phase = phase
        self.namespace = namespace
        self.keys = keys
        self.filler = os.urandom(block_bytes)
        self.stored: set[bytes] = set()  # keys whose Put returned with Redis storing every block
        self.pending: set[bytes] = set()  # keys not yet stored of the requests in flight
        self.cond = threading.Condition()
        self.next = 0
        self.errors: list[str] = []

    def take(self) -> tuple[list[bytes], int] | None:
        """The next request's keys and how many of them are stored now (before its Lookup is sent)."""
        with self.cond:
            while True:
                if self.next >= len(self.keys) or self.errors:
                    return None
                keys = self.keys[self.next]
                if self.pending.isdisjoint(keys):
                    break
                self.cond.wait(1.0)
            self.next += 1
            expected = leading(keys, self.stored.__contains__)
            self.pending.update(keys[expected:])
            return keys, expected

    def done(self, keys: list[bytes], expected: int) -> None:
        with self.cond:
            self.pending.difference_update(keys[expected:])
            self.cond.notify_all()

    def block(self, key: bytes) -> bytes:
        payload = key + self.filler[len(key) :]
        return encode_block(payload, key=key, dtype="uint8", shape=(len(payload),))

    def worker(self, target: str, rclient: redis.Redis) -> None:
        try:
            with KVCacheClient(target, timeout_s=DEADLINE_S, retry=RetryPolicy(max_attempts=1)) as client:
                while (taken := self.take()) is not None:
                    try:
                        self.one(client, rclient, *taken)
                    finally:
                        self.done(*taken)
                with self.cond:
                    self.phase.corrupt += client.corrupt_blocks
        except Exception as exc:  # reported by the main thread, which stops the run
            with self.cond:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.cond.notify_all()

    def one(self, client: KVCacheClient, rclient: redis.Redis, keys: list[bytes], expected: int) -> None:
        ns, ph = self.namespace, self.phase
        t0 = time.perf_counter()
        try:
            found = client.lookup(ns, keys)
            lookup_s: float | None = time.perf_counter() - t0
            p = found.prefix_length
        except KVCacheError:
            lookup_s, p, found = None, 0, None
        lost = 0
        if expected > p:  # blocks stored before the Lookup was sent, beyond what it answered: still there?
            with rclient.pipeline(transaction=False) as pipe:
                for key in keys[p:expected]:
                    pipe.exists(f"kvcache/{ns}/{key.hex()}")
                lost = leading([bool(c) for c in pipe.execute()], bool)
        t1 = time.perf_counter()
        blocks = client.get_many(ns, keys[:p], prefix_only=True, timeout_s=TRANSFER_TIMEOUT_S) if p else []
        get_s = time.perf_counter() - t1
        g = leading(blocks, lambda b: b is not None)
        items = [(key, self.block(key)) for key in keys[g:]]
        put_s, put_ok = 0.0, True
        if items:
            t2 = time.perf_counter()
            try:
                result = client.put_many(ns, items, timeout_s=TRANSFER_TIMEOUT_S)
                put_ok = result.rejected == 0 and result.tier("redis").stored == len(items)
            except KVCacheError:
                put_ok = False
            put_s = time.perf_counter() - t2
        with self.cond:
            ph.requests += 1
            ph.blocks += len(keys)
            ph.served += g
            ph.get_short += p - g
            ph.stored_again += sum(1 for key, _ in items if key in self.stored)
            if found is not None:
                ph.from_ram += sum(1 for t in found.tiers if t == "ram")
                ph.from_redis += sum(1 for t in found.tiers if t == "redis")
            if lookup_s is None:
                ph.failed += 1
                ph.failed_lost += lost
            else:
                ph.lookup_s.append(lookup_s)
                if lost:
                    ph.lost_lookups += 1
                    ph.lost_blocks += lost
                    ph.lost_lookup_s.append(lookup_s)
                    if lookup_s < LOOKUP_DEADLINE_SHARE * DEADLINE_S:
                        ph.lost_within_deadline += lost
            if p:
                ph.get_s.append(get_s)
            if items:
                ph.put_s.append(put_s)
                if put_ok:
                    self.stored.update(key for key, _ in items)
                else:
                    ph.put_failed += 1


def tier_counters(stats: ServerStats) -> dict[str, dict[str, int]]:
    names = ("hits", "misses", "errors", "evictions", "promotions", "demotions", "lookup_late_hits", "skipped")
    return {t.name: {n: int(getattr(t, n)) for n in names} for t in stats.tiers}


def settled_counters(client: KVCacheClient) -> dict[str, dict[str, int]]:
    """The counters once the Lookups' late tier calls have ended (each is bounded by the tier's timeout_s)."""
    last = tier_counters(client.stats())
    deadline = time.monotonic() + REDIS_TIMEOUT_S + 1
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tier_counters(client.stats())
        if now == last:
            break
        last = now
    return last


def replay(
    phase: Phase,
    target: str,
    rclient: redis.Redis,
    namespace: str,
    keys: Sequence[list[bytes]],
    args: argparse.Namespace,
) -> None:
    run = Replay(phase, namespace, keys, args.block_kib * KiB)
    with KVCacheClient(target, timeout_s=TRANSFER_TIMEOUT_S) as admin:
        before = tier_counters(admin.stats())
        threads = [
            threading.Thread(target=run.worker, args=(target, rclient), name=f"client-{i}") for i in range(args.clients)
        ]
        start = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        phase.seconds = time.monotonic() - start
        if run.errors:
            raise RuntimeError(f"{phase.name}: a client failed: {run.errors[0]}")
        after = settled_counters(admin)
    phase.server = {
        name: {k: v - before.get(name, {}).get(k, 0) for k, v in counters.items()} for name, counters in after.items()
    }


# -- report --------------------------------------------------------------------------------------


def ms(xs: Sequence[float], q: float) -> str:
    return f"{percentile(xs, q) * 1e3:,.1f}" if xs else "-"


def report(phases: Sequence[Phase], ideal_unbounded: int) -> str:
    hit_rows = []
    for p in phases:
        hit_rows.append(
            [
                p.name,
                f"{p.served:,}",
                f"{p.served / p.blocks:.1%}",
                f"{p.served / ideal_unbounded:.1%}" if ideal_unbounded else "-",
                f"{p.from_ram:,} / {p.from_redis:,}",
                f"{p.lost_lookups:,}",
                f"{p.lost_blocks:,}",
                f"{p.lost_within_deadline:,}",
                f"{p.late_hits:,}",
                f"{p.stored_again:,}",
                f"{p.failed:,} ({p.failed_lost:,})",
            ]
        )
    hit_headers = ["phase", "served", "hit ratio", "of ideal", "RAM / Redis", "lost Lookups", "lost blocks"]
    hit_headers += ["within deadline", "late hits", "stored again", "failed (blocks)"]
    lat_rows = []
    for p in phases:
        lat_rows.append(
            [
                p.name,
                f"{p.requests / p.seconds:,.1f}",
                ms(p.lookup_s, 50),
                ms(p.lookup_s, 99),
                f"{max(p.lookup_s, default=float('nan')) * 1e3:,.1f}",
                ms(p.get_s, 50),
                ms(p.get_s, 99),
                ms(p.put_s, 50),
                ms(p.put_s, 99),
                f"{p.seconds:.1f}",
            ]
        )
    lat_headers = ["phase", "req/s", "lookup p50 ms", "p99", "max", "get p50 ms", "p99", "put p50 ms", "p99", "seconds"]
    return render_table(hit_headers, hit_rows) + "\n\n" + render_table(lat_headers, lat_rows)


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Trace replay through Lookup, Get and Put: hit ratio, lost hits.")
    p.add_argument("--quick", action="store_true", help="smoke run: 400 requests, RAM 16 MiB (~10 s)")
    p.add_argument("--trace", metavar="PATH", help="a Mooncake JSONL trace (default: a synthetic one, fixed seed)")
    p.add_argument("--requests", type=int, help="requests replayed (default 1500, quick 400; a trace's first N)")
    p.add_argument("--seed", type=int, default=SEED, help=f"seed of the synthetic trace (default {SEED})")
    p.add_argument("--ram-mib", type=int, help="RAM tier capacity in MiB (default 64, quick 16)")
    p.add_argument("--redis-mib", type=int, default=0, help="Redis maxmemory in MiB, allkeys-lru (0: unbounded)")
    p.add_argument("--block-kib", type=int, default=32, help="payload of one block in KiB (default 32)")
    p.add_argument("--clients", type=int, default=1, help="client threads, one KVCacheClient each (default 1)")
    p.add_argument(
        "--compare-fixed-timeout",
        action="store_true",
        help=f"also replay with redis.lookup_timeout_s={OLD_FIXED_WAIT_S} (the old fixed wait), first",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    args = p.parse_args(argv)
    args.requests = args.requests or (400 if args.quick else 1500)
    args.ram_mib = args.ram_mib or (16 if args.quick else 64)
    if args.requests < 1 or args.ram_mib < 1 or args.block_kib < 1 or args.clients < 1 or args.redis_mib < 0:
        p.error("--requests, --ram-mib, --block-kib and --clients must be >= 1, --redis-mib >= 0")
    return args


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    if args.trace:
        trace, source = load_trace(args.trace, args.requests), f"{args.trace} (first {args.requests} requests)"
    else:
        trace, source = synthesize(args.requests, args.seed), f"synthetic multi-turn trace, seed {args.seed}"
    names = ["fixed 0.15 s", "deadline share"] if args.compare_fixed_timeout else ["deadline share"]
    memo: dict[tuple[bytes, int], bytes] = {}
    spaces = {
        name: Namespace("bench/trace-replay", "uint8", BLOCK_TOKENS, 1, 1, args.block_kib * KiB, cache_salt=name)
        for name in names
    }
    keys = {name: [chain_keys(r.hash_ids, ns.fingerprint, memo) for r in trace] for name, ns in spaces.items()}
    some = keys[names[0]]
    block_len = len(
        encode_block(bytes(args.block_kib * KiB), key=bytes(16), dtype="uint8", shape=(args.block_kib * KiB,))
    )
    ram_blocks = args.ram_mib * MiB // block_len
    redis_blocks = args.redis_mib * MiB // (block_len + REDIS_ENTRY_OVERHEAD) if args.redis_mib else None
    total = sum(len(k) for k in some)
    distinct = len({k for ks in some for k in ks})
    ideal = ideal_hits(some, None)
    lru_ram = ideal_hits(some, ram_blocks)
    lru_both = ideal_hits(some, ram_blocks + redis_blocks) if redis_blocks is not None else ideal
    print("kvcache trace replay" + (" (--quick)" if args.quick else ""))
    print(f"  trace: {source}: {len(trace):,} requests, {total:,} blocks requested, {distinct:,} distinct")
    distinct_mib = distinct * block_len / MiB
    print(
        f"  {os.cpu_count()} CPUs; blocks {args.block_kib} KiB ({block_len:,} B encoded, "
        f"{distinct_mib:,.0f} MiB distinct); RAM {args.ram_mib} MiB (~{ram_blocks:,} blocks); Redis "
        + (f"{args.redis_mib} MiB, allkeys-lru (~{redis_blocks:,} blocks)" if args.redis_mib else "unbounded")
        + f"; {args.clients} client(s); Lookup deadline {DEADLINE_S} s, one attempt"
    )
    print(
        f"  ideal hit ratio: unbounded {ideal / total:.1%}, LRU RAM {lru_ram / total:.1%}, "
        f"LRU RAM+Redis {lru_both / total:.1%}" + ("" if args.redis_mib else " (Redis unbounded)")
    )
    servers: list[ServerProcess] = []
    phases: list[Phase] = []
    rclient: redis.Redis | None = None
    try:
        redis_port, rclient = start_redis(find_binary(args.redis_server), servers)
        if args.redis_mib:
            rclient.config_set("maxmemory", args.redis_mib * MiB)
            rclient.config_set("maxmemory-policy", "allkeys-lru")
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        print(f"  started redis-server on 127.0.0.1:{redis_port}")
        for name in names:
            sets = [f"ram.capacity_bytes={args.ram_mib}MiB", "redis.enabled=true", f"redis.url={redis_url}"]
            sets.append(f"redis.timeout_s={REDIS_TIMEOUT_S}")
            if name.startswith("fixed"):
                sets.append(f"redis.lookup_timeout_s={OLD_FIXED_WAIT_S}")
            (port,) = start_kvcaches({name.replace(" ", "-"): sets}, servers, dict(os.environ)).values()
            proc = servers[-1]
            phase = Phase(name)
            replay(phase, f"127.0.0.1:{port}", rclient, spaces[name].name, keys[name], args)
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run{proc.stderr_tail()}")
            proc.stop()
            rclient.flushall()
            phases.append(phase)
            answered = ", ".join(f"{t * 1e3:.0f}" for t in phase.lost_lookup_s[:8])
            print(
                f"  {name}: {phase.requests:,} requests in {phase.seconds:.1f} s, hit ratio "
                f"{phase.served / phase.blocks:.1%}, lost blocks {phase.lost_blocks:,}, late hits {phase.late_hits:,}"
                + (f" (lost Lookups answered in {answered} ms)" if answered else ""),
                flush=True,
            )
    finally:
        if rclient is not None:
            rclient.close()
        for proc in reversed(servers):
            proc.stop()
    print()
    print(report(phases, ideal))
    print(
        "\nserved: blocks the Gets returned; of ideal: served / the unbounded ideal; RAM / Redis: the tiers of the "
        "Lookups' prefixes;\nlost blocks: stored before the Lookup was sent yet beyond its prefix (within deadline: "
        f"Lookups answered in < {LOOKUP_DEADLINE_SHARE * DEADLINE_S:.1f} s);\n"
        "late hits: the server's lookup_late_hits; stored again: Put although already stored; "
        "failed: Lookups that raised (blocks stored before them)"
    )
    status = 0
    for p in phases:
        redis_errors = p.server.get("redis", {}).get("errors", 0)
        evictions = p.server.get("ram", {}).get("evictions", 0)
        print(
            f"  {p.name}: Redis errors {redis_errors}, RAM evictions {evictions:,}, Gets short of their Lookup "
            f"{p.get_short}, Puts not all in Redis {p.put_failed}, corrupt blocks {p.corrupt}"
        )
        if p.name == "deadline share" and (p.lost_within_deadline or p.corrupt):
            status = 1
    if status:
        print("FAILED: the deadline-share phase lost hits its callers' deadline allowed, or served corrupt blocks")
    print(f"total run time {time.monotonic() - t_start:.1f} s")
    if args.json:
        doc = {
            "trace": source,
            "requests": len(trace),
            "blocks_requested": total,
            "blocks_distinct": distinct,
            "block_bytes": block_len,
            "ram_mib": args.ram_mib,
            "redis_mib": args.redis_mib,
            "clients": args.clients,
            "deadline_s": DEADLINE_S,
            "ideal": {"unbounded": ideal, "lru_ram": lru_ram, "lru_ram_redis": lru_both},
            "ideal_ratio": {"unbounded": ideal / total, "lru_ram": lru_ram / total, "lru_ram_redis": lru_both / total},
            "phases": [p.to_json() for p in phases],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
