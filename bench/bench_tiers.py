"""Per-tier hit latency of kvcache (RAM, Redis, S3) against redis-py and boto3 reading the same bytes.

Run from the repository root with the project's virtualenv:

    python bench/bench_tiers.py              # full run (~2 minutes)
    python bench/bench_tiers.py --quick      # smoke run (< 30 s)
    python bench/bench_tiers.py --json out.json

Backends, started here on free ports and stopped at the end:
    redis-server    no persistence (--save "" --appendonly no)
    moto_server     moto's S3 API over HTTP (AWS_ACCESS_KEY_ID/SECRET=testing), bucket "kvbench"

kvcache servers (`python -m kvcache_server`, one subprocess per scenario, all alive during the run):
    ram      RAM tier only (1 GiB): the batch is served from RAM.
    redis    tiny RAM (4 KiB: no block fits, so RAM rejects every block and never holds one),
             Redis and S3 both enabled, write-through, promote=false: the batch is served from Redis.
    s3       tiny RAM, S3 only (same bucket, so it reads the objects the redis server wrote),
             promote=false: the batch is served from S3.
Which tier served the reads is checked twice: Lookup's `tiers` before timing, and the servers' Stats
counters after timing (hits of the intended tier = 64 x calls, no hits or promotions elsewhere, no errors);
a failed check is reported after the tables and makes the exit status 1.
redis.timeout_s is set to --redis-timeout (10 s): it bounds each Redis command, and the server's default of
1 s was seen to expire on this 128 MiB MGET on a loaded 2-core machine, which turns the read into a Redis
miss served by S3 (and would mix S3 reads into the Redis numbers). S3 keeps its default (10 s).

Workload: one batch of 64 blocks of 2 MiB (encode_block(payload, key=k, dtype="uint8", shape=(n,)), random bytes).
    kvcache           KVCacheClient.get_many(ns, 64 keys): one Get RPC; the server reads the tier
                      (Redis: GETs pipelined 4 per round trip on a worker thread; S3: 64 GetObject in
                      its 16-thread pool), verifies every block's checksum, and hands them back: the
                      client runs on the server's host, so by default through shared memory
                      (docs/shm.md; --no-shm: over gRPC); the SDK verifies them again.
    redis-py          the same values in the same redis-server: (a) 64 sequential GETs (LMCache's Redis
                      path), (b) one MGET. Raw bytes, no checksum.
    boto3             the same objects in moto: 64 sequential GetObject, and the 64 through a
                      ThreadPoolExecutor of 16 threads. Raw bytes, no checksum.
Lookup: 128 keys whose blocks (16 KiB each) live only in Redis.
    kvcache           KVCacheClient.lookup(ns, 128 keys): one RPC; the server sends one pipeline of 128 EXISTS.
    redis-py          128 sequential EXISTS (one round trip each), and, for reference, one pipeline of 128 EXISTS.
    kvcache (RAM)     for reference: the same lookup answered from the RAM server.

Timing: --rounds interleaved rounds over the systems of a group (rotating order; the machine is shared
and noisy), each round one warm-up call then calls until its share of the time and iteration budget.
Reported: p50 and p99 (linear interpolation) of all timed calls, and throughput = payload / p50.
Ratios are speedups of kvcache: baseline time / kvcache time, so >= 1.00x means kvcache is at least as fast.

Longer than the project's ~500-line module guideline on purpose: one self-contained benchmark whose
scenarios, baselines and checks are meant to be read together.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import grpc
import redis
from _common import (
    GB,
    KiB,
    Measurement,
    MiB,
    ServerProcess,
    TimingPlan,
    exit_on_sigterm,
    free_port,
    measure,
    python_cmd,
    redis_versions,
)
from botocore.config import Config as BotoConfig

from kvcache_client import KVCacheClient
from kvcache_core.format import encode_block

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-tiers"
BUCKET = "kvbench"
KEY_PREFIX = "kvcache"  # the default redis.key_prefix and s3.prefix
CALL_TIMEOUT_S = 120.0
BLOCK_BYTES = 2 * MiB
BLOCKS = 64
LOOKUP_KEYS = 128
LOOKUP_BLOCK_BYTES = 16 * KiB
TINY_RAM = "4KiB"  # smaller than any block: RAM refuses every block, so reads must come from a lower tier
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

# Systems of the batch-get group and of the lookup group.
KV_RAM, KV_REDIS, KV_S3 = "kvcache RAM tier", "kvcache Redis tier", "kvcache S3 tier"
RP_GET, RP_MGET = "redis-py 64x GET", "redis-py 1x MGET"
B3_SEQ, B3_PAR = "boto3 64x GET seq", "boto3 64x GET 16 thr"
GET_SYSTEMS = (KV_RAM, KV_REDIS, RP_GET, RP_MGET, KV_S3, B3_SEQ, B3_PAR)
LK_REDIS, LK_RAM = "kvcache lookup (Redis)", "kvcache lookup (RAM)"
RP_EXISTS, RP_EXISTS_PIPE = "redis-py 128x EXISTS", "redis-py EXISTS pipeline"
LOOKUP_SYSTEMS = (LK_REDIS, RP_EXISTS, RP_EXISTS_PIPE, LK_RAM)
SERVED_BY = {KV_RAM: "ram", KV_REDIS: "redis", KV_S3: "s3", LK_REDIS: "redis", LK_RAM: "ram"}


# -- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50(m: Measurement) -> float:
    return statistics.median(m.times_s)


def p99(m: Measurement) -> float:
    return percentile(m.times_s, 99)


# -- backends ------------------------------------------------------------------------------------


def find_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None and (Path(sys.executable).parent / name).exists():
        path = str(Path(sys.executable).parent / name)
    if path is None:
        raise SystemExit(f"{name} not found (PATH or the virtualenv's bin)")
    return path


def wait_until(check: Callable[[], bool], proc: ServerProcess, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if not proc.alive():
            raise RuntimeError(f"{what} exited during start-up{proc.stderr_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout_s:.0f}s{proc.stderr_tail()}")
        time.sleep(0.05)


def start_redis(binary: str, servers: list[ServerProcess]) -> tuple[int, redis.Redis]:
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = ServerProcess("redis-server", argv)
    servers.append(proc)  # stopped by the caller's finally, whatever happens next
    proc.start(None)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=CALL_TIMEOUT_S)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_until(up, proc, "redis-server")
    return port, client


def start_moto(binary: str, servers: list[ServerProcess], env: dict[str, str]) -> str:
    port = free_port()
    proc = ServerProcess("moto_server", [binary, "-H", "127.0.0.1", "-p", str(port)], env=env)
    servers.append(proc)
    proc.start(None)
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=0.5).close()
        except OSError:
            return False
        return True

    wait_until(up, proc, "moto_server")
    return endpoint


def start_kvcaches(
    configs: dict[str, Sequence[str]], servers: list[ServerProcess], env: dict[str, str]
) -> dict[str, int]:
    """Starts one kvcache server per {name: [--set assignments]}, all at once; returns their ports."""
    procs = {}
    for name, sets in configs.items():
        argv = python_cmd("-m", "kvcache_server", "--port", "0", "--log-level", "warning")
        for s in sets:
            argv += ["--set", s]
        procs[name] = ServerProcess(f"kvcache-{name}", argv, env=env, cwd=str(REPO))
        servers.append(procs[name])  # stopped by the caller's finally, whatever happens next
    with ThreadPoolExecutor(len(procs)) as pool:
        futures = {name: pool.submit(p.start, r"serving \S+ on [^\s:]+:(\d+)") for name, p in procs.items()}
        ports = {name: f.result() for name, f in futures.items()}
    for name, proc in procs.items():
        print(f"  started {name}: {proc.first_line}")
    return {name: port for name, port in ports.items() if port is not None}


# -- the benchmark -------------------------------------------------------------------------------


@dataclass
class Data:
    keys: list[bytes]
    blocks: list[bytes]
    lookup_keys: list[bytes]
    lookup_blocks: list[bytes]

    @property
    def items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.keys, self.blocks, strict=True))

    @property
    def lookup_items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.lookup_keys, self.lookup_blocks, strict=True))


def make_data() -> Data:
    rnd = memoryview(os.urandom(BLOCKS * BLOCK_BYTES + LOOKUP_KEYS * LOOKUP_BLOCK_BYTES))
    keys = [os.urandom(16) for _ in range(BLOCKS)]
    blocks = [
        encode_block(rnd[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES], key=key, dtype="uint8", shape=(BLOCK_BYTES,))
        for i, key in enumerate(keys)
    ]
    base = BLOCKS * BLOCK_BYTES
    lookup_keys = [os.urandom(16) for _ in range(LOOKUP_KEYS)]
    small = [
        encode_block(
            rnd[base + i * LOOKUP_BLOCK_BYTES : base + (i + 1) * LOOKUP_BLOCK_BYTES],
            key=key,
            dtype="uint8",
            shape=(LOOKUP_BLOCK_BYTES,),
        )
        for i, key in enumerate(lookup_keys)
    ]
    return Data(keys, blocks, lookup_keys, small)


def backend_key(key: bytes) -> str:
    """Where the Redis and S3 tiers keep a block (RedisTier._key / S3Tier._object)."""
    return f"{KEY_PREFIX}/{NAMESPACE}/{key.hex()}"


@dataclass
class Counted:
    """A callable that counts its calls (to check the servers' hit counters afterwards)."""

    fn: Callable[[], object]
    calls: int = 0

    def __call__(self) -> object:
        self.calls += 1
        return self.fn()


@dataclass
class Group:
    title: str
    nbytes: int
    systems: dict[str, Counted] = field(default_factory=dict)
    results: dict[str, Measurement] = field(default_factory=dict)


def run_group(group: Group, plan: TimingPlan, rounds: int) -> None:
    names = list(group.systems)
    round_plan = plan.per_round(rounds)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            m = measure(name, group.title, "get", group.nbytes, group.systems[name], round_plan)
            if name in group.results:
                group.results[name].add(m)
            else:
                group.results[name] = m
    for name in names:
        m = group.results[name]
        print(f"  {name:<26} p50 {p50(m) * 1e3:9.2f} ms  p99 {p99(m) * 1e3:9.2f} ms  ({m.iters} calls)", flush=True)


def check_same(what: str, got: Sequence[object], want: Sequence[bytes]) -> None:
    if len(got) != len(want):
        raise RuntimeError(f"{what}: {len(got)} results for {len(want)} keys")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is None or bytes(g) != w:  # type: ignore[call-overload]
            raise RuntimeError(f"{what}: item {i} differs from what was put ({'missing' if g is None else 'bytes'})")


def check_lookup(client: KVCacheClient, keys: list[bytes], tier: str, what: str) -> None:
    res = client.lookup(NAMESPACE, keys)
    if res.prefix_length != len(keys) or set(res.tiers) != {tier}:
        raise RuntimeError(
            f"{what}: lookup says prefix {res.prefix_length}/{len(keys)} in tiers {sorted(set(res.tiers))}, "
            f"expected all in {tier}"
        )


def tier_counters(client: KVCacheClient) -> dict[str, dict[str, int]]:
    out = {}
    for t in client.stats().tiers:
        out[t.name] = {
            "hits": t.hits,
            "misses": t.misses,
            "blocks": t.blocks,
            "promotions": t.promotions,
            "errors": t.errors,
            "checksum_failures": t.checksum_failures,
        }
    return out


def check_served(
    what: str, before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], tier: str, expected_hits: int
) -> tuple[bool, str]:
    """Checks from the Stats counters that exactly `expected_hits` block reads were served by `tier`."""
    delta = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    problems = []
    if delta[tier]["hits"] != expected_hits:
        problems.append(f"{tier} hits +{delta[tier]['hits']}, expected +{expected_hits}")
    for name, d in delta.items():
        if name != tier and name != "ram" and d["hits"]:
            problems.append(f"{name} also served {d['hits']} blocks")
        if d["errors"] or d["checksum_failures"]:
            problems.append(f"{name}: {d['errors']} errors, {d['checksum_failures']} checksum failures")
    if tier != "ram":
        if delta["ram"]["hits"]:
            problems.append(f"ram served {delta['ram']['hits']} blocks")
        if after["ram"]["blocks"] or delta["ram"]["promotions"]:
            problems.append(f"ram holds {after['ram']['blocks']} blocks, {delta['ram']['promotions']} promotions")
    if problems:
        return False, f"FAILED {what}: reads not served as intended: " + "; ".join(problems)
    return True, f"{what}: {expected_hits} block reads, all from {tier} (Stats counters; no errors, no promotions)"


def versions(redis_server: str) -> dict[str, str]:
    import moto

    rs, parser = redis_versions(redis_server)

    return {
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "redis-py": f"{redis.__version__} ({parser} parser)",
        "boto3": boto3.__version__,
        "moto": moto.__version__,
        "redis-server": rs.split(" sha=")[0],
        "cpus": str(os.cpu_count()),
    }


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    align = ["<"] + [">"] * (len(headers) - 1)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True)).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def build_report(get_group: Group, lookup_group: Group) -> tuple[str, list[dict[str, object]]]:
    rows = []
    for name, m in get_group.results.items():
        rows.append(
            [
                name,
                SERVED_BY.get(name, "-"),
                fmt_ms(p50(m)),
                fmt_ms(p99(m)),
                f"{m.nbytes / p50(m) / GB:.2f}",
                str(m.iters),
            ]
        )
    text = f"Batch get: {BLOCKS} x {BLOCK_BYTES // MiB} MiB ({BLOCKS * BLOCK_BYTES // MiB} MiB payload) per call\n"
    text += render_table(["system", "served by", "p50 ms", "p99 ms", "GB/s @p50", "calls"], rows)

    rows = []
    for name, m in lookup_group.results.items():
        rows.append([name, SERVED_BY.get(name, "-"), fmt_ms(p50(m)), fmt_ms(p99(m)), str(m.iters)])
    text += f"\n\nLookup of {LOOKUP_KEYS} keys (presence only)\n"
    text += render_table(["system", "answered by", "p50 ms", "p99 ms", "calls"], rows)

    comparisons = [
        ("Redis tier get vs redis-py 64x GET", get_group, KV_REDIS, RP_GET, ">= 1.00x"),
        ("Redis tier get vs redis-py 1x MGET", get_group, KV_REDIS, RP_MGET, "-"),
        ("S3 tier get vs boto3 sequential", get_group, KV_S3, B3_SEQ, "-"),
        ("S3 tier get vs boto3 16 threads", get_group, KV_S3, B3_PAR, "-"),
        ("lookup 128 (Redis) vs 128x EXISTS", lookup_group, LK_REDIS, RP_EXISTS, "> 1.00x"),
        ("lookup 128 (Redis) vs EXISTS pipeline", lookup_group, LK_REDIS, RP_EXISTS_PIPE, "-"),
    ]
    rows = []
    doc = []
    for label, group, kv, base, target in comparisons:
        a, b = group.results.get(kv), group.results.get(base)
        if a is None or b is None:
            continue
        r50, r99 = p50(b) / p50(a), p99(b) / p99(a)
        verdict = "-"
        if target.startswith(">="):
            verdict = "met" if r50 >= 1.0 else "MISSED"
        elif target.startswith(">"):
            verdict = "met" if r50 > 1.0 else "MISSED"
        rows.append([label, f"{r50:.2f}x", f"{r99:.2f}x", target, verdict])
        doc.append({"comparison": label, "kvcache": kv, "baseline": base, "speedup_p50": r50, "speedup_p99": r99})
    text += "\n\nkvcache speedup (baseline time / kvcache time; > 1 = kvcache faster)\n"
    text += render_table(["comparison", "p50", "p99", "target", "verdict"], rows)
    return text, doc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kvcache per-tier hit latency vs redis-py and boto3 (see module docstring)."
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few iterations (< 30 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--rounds", type=int, help="interleaved rounds per group (default 3, quick 1)")
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable")
    p.add_argument("--moto-server", default="moto_server", help="moto_server executable")
    p.add_argument(
        "--no-shm",
        action="store_true",
        help="kvcache clients with shm=False: every byte over gRPC, as for a client on another host",
    )
    p.add_argument(
        "--redis-timeout",
        type=float,
        default=10.0,
        help="the kvcache servers' redis.timeout_s (server default 1.0; see module docstring) (default 10)",
    )
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def plans(quick: bool) -> tuple[TimingPlan, TimingPlan]:
    """(batch get plan, lookup plan), per system over all rounds."""
    if quick:
        return (
            # No warm-up call: the correctness check before timing has just warmed every system.
            TimingPlan(min_time_s=0.1, min_iters=2, max_iters=10, max_time_s=1.0, warmup=0),
            TimingPlan(min_time_s=0.2, min_iters=50, max_iters=300, max_time_s=0.5),
        )
    return (
        TimingPlan(min_time_s=3.0, min_iters=15, max_iters=300, max_time_s=9.0),
        TimingPlan(min_time_s=2.0, min_iters=300, max_iters=3000, max_time_s=5.0),
    )


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    get_plan, lookup_plan = plans(args.quick)
    redis_bin, moto_bin = find_binary(args.redis_server), find_binary(args.moto_server)
    info = versions(redis_bin)
    print("kvcache tier benchmark" + (" (--quick)" if args.quick else ""))
    print("  " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(
        f"  timing: {args.rounds} interleaved round(s); batch get >= {get_plan.min_iters} calls and "
        f">= {get_plan.min_time_s:.1f}s per system; lookup >= {lookup_plan.min_iters} calls and "
        f">= {lookup_plan.min_time_s:.1f}s"
    )
    data = make_data()
    env = {**os.environ, **S3_ENV}
    servers: list[ServerProcess] = []
    closers: list[Callable[[], object]] = []
    checks: list[str] = []
    failed = 0
    get_group = Group("batch get", BLOCKS * BLOCK_BYTES)
    lookup_group = Group("lookup", 0)
    try:
        redis_port, rclient = start_redis(redis_bin, servers)
        closers.append(rclient.close)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        print(f"  started redis-server on 127.0.0.1:{redis_port}")
        endpoint = start_moto(moto_bin, servers, env)
        print(f"  started moto_server on {endpoint}")

        s3_sets = [
            "s3.enabled=true",
            f"s3.bucket={BUCKET}",
            f"s3.endpoint_url={endpoint}",
            "s3.path_style=true",
            "s3.create_bucket=true",
            "s3.write_mode=through",
            "s3.promote=false",
        ]
        redis_sets = [
            "redis.enabled=true",
            f"redis.url={redis_url}",
            "redis.promote=false",
            f"redis.timeout_s={args.redis_timeout:g}",
        ]
        ports = start_kvcaches(
            {
                "ram": ["ram.capacity_bytes=1GiB"],
                "redis": [f"ram.capacity_bytes={TINY_RAM}", *redis_sets, *s3_sets],
                "s3": [f"ram.capacity_bytes={TINY_RAM}", *s3_sets],
            },
            servers,
            env,
        )
        clients = {}
        for name, port in ports.items():
            c = KVCacheClient(f"127.0.0.1:{port}", timeout_s=CALL_TIMEOUT_S, shm=not args.no_shm, bulk=False)
            closers.append(c.close)
            clients[name] = c

        # Load: the RAM server keeps its own copy; the redis server writes through to Redis and S3,
        # where the S3-only server (same bucket, prefix and namespace) finds the objects.
        t0 = time.perf_counter()
        for name in ("ram", "redis"):
            for items in (data.items, data.lookup_items):
                res = clients[name].put_many(NAMESPACE, items)
                if res.stored != len(items):
                    raise RuntimeError(f"{name} server stored {res.stored} of {len(items)} blocks ({res})")
        print(
            f"  loaded {BLOCKS} x 2 MiB + {LOOKUP_KEYS} x 16 KiB blocks in {time.perf_counter() - t0:.1f}s "
            f"(set-up done at {time.monotonic() - t_start:.1f}s)"
        )

        rkeys = [backend_key(k) for k in data.keys]
        rlookup = [backend_key(k) for k in data.lookup_keys]
        boto = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=BotoConfig(
                s3={"addressing_style": "path"},
                max_pool_connections=16,
                retries={"max_attempts": 1, "mode": "standard"},
                read_timeout=CALL_TIMEOUT_S,
            ),
        )
        closers.append(boto.close)
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench-boto3")
        closers.append(pool.shutdown)

        def s3_get(name: str) -> bytes:
            return boto.get_object(Bucket=BUCKET, Key=name)["Body"].read()

        def rp_exists_pipe() -> list[object]:
            pipe = rclient.pipeline(transaction=False)
            for k in rlookup:
                pipe.exists(k)
            return pipe.execute()

        def kv_get(client: KVCacheClient) -> Callable[[], list[object]]:
            return lambda: client.get_many(NAMESPACE, data.keys)

        get_fns: dict[str, Callable[[], list[object]]] = {
            KV_RAM: kv_get(clients["ram"]),
            KV_REDIS: kv_get(clients["redis"]),
            RP_GET: lambda: [rclient.get(k) for k in rkeys],
            RP_MGET: lambda: rclient.mget(rkeys),
            KV_S3: kv_get(clients["s3"]),
            B3_SEQ: lambda: [s3_get(k) for k in rkeys],
            B3_PAR: lambda: list(pool.map(s3_get, rkeys)),
        }
        # Where each system's reads must come from, checked before timing.
        check_lookup(clients["ram"], data.keys, "ram", "ram server")
        check_lookup(clients["redis"], data.keys, "redis", "redis server")
        check_lookup(clients["s3"], data.keys, "s3", "s3 server")
        check_lookup(clients["redis"], data.lookup_keys, "redis", "redis server (lookup keys)")
        check_lookup(clients["ram"], data.lookup_keys, "ram", "ram server (lookup keys)")
        checks.append("Lookup tiers before timing: ram server -> ram, redis server -> redis, s3 server -> s3")
        before = {name: tier_counters(c) for name, c in clients.items()}
        get_group.systems = {name: Counted(fn) for name, fn in get_fns.items()}
        for name, fn in get_group.systems.items():
            check_same(name, fn(), data.blocks)  # every system returns exactly the bytes that were put
        lookup_group.systems = {
            LK_REDIS: Counted(lambda: clients["redis"].lookup(NAMESPACE, data.lookup_keys)),
            RP_EXISTS: Counted(lambda: [rclient.exists(k) for k in rlookup]),
            RP_EXISTS_PIPE: Counted(rp_exists_pipe),
            LK_RAM: Counted(lambda: clients["ram"].lookup(NAMESPACE, data.lookup_keys)),
        }
        for name in (LK_REDIS, LK_RAM):
            if lookup_group.systems[name]().prefix_length != LOOKUP_KEYS:  # type: ignore[attr-defined]
                raise RuntimeError(f"{name}: lookup did not find all {LOOKUP_KEYS} keys")
        if sum(lookup_group.systems[RP_EXISTS]()) != LOOKUP_KEYS:  # type: ignore[arg-type]
            raise RuntimeError("redis-py: EXISTS did not find all lookup keys")

        print("\nbatch get (64 x 2 MiB):")
        run_group(get_group, get_plan, args.rounds)
        print(f"\nlookup ({LOOKUP_KEYS} keys):")
        run_group(lookup_group, lookup_plan, args.rounds)

        after = {name: tier_counters(c) for name, c in clients.items()}
        for server, system, tier in (("ram", KV_RAM, "ram"), ("redis", KV_REDIS, "redis"), ("s3", KV_S3, "s3")):
            hits = get_group.systems[system].calls * BLOCKS
            ok, message = check_served(f"{server} server", before[server], after[server], tier, hits)
            failed += not ok
            checks.append(message)
        for proc in servers:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run{proc.stderr_tail()}")
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # cleanup must go on
                print(f"warning: close failed: {exc}", file=sys.stderr)
        for proc in reversed(servers):
            proc.stop()

    elapsed = time.monotonic() - t_start
    text, ratios = build_report(get_group, lookup_group)
    print()
    print(text)
    print("\nchecks:")
    for c in checks:
        print(f"  {c}")
    print(
        "notes: kvcache verifies each block's XXH3 checksum on the server and again in the SDK; redis-py and boto3 "
        "return raw bytes unverified.\n       S3 is moto_server on this machine (a Python HTTP server), not AWS: "
        "S3 latencies say little about real S3.\n"
        "       With a few tens of batch calls per system, p99 is close to the slowest call; on a shared machine "
        "it mostly measures the noise."
    )
    path = "gRPC only (--no-shm)" if args.no_shm else "shared memory where the server offers it (same host)"
    print(f"       kvcache clients moved block bytes by {path}.")
    print(f"\ntotal run time {elapsed:.1f} s")

    if args.json:
        doc: dict[str, object] = {
            "quick": args.quick,
            "rounds": args.rounds,
            "plans": {"batch_get": vars(get_plan), "lookup": vars(lookup_plan)},
            "versions": info,
            "elapsed_s": elapsed,
            "workload": {
                "blocks": BLOCKS,
                "block_payload_bytes": BLOCK_BYTES,
                "block_bytes_with_header": len(data.blocks[0]),
                "lookup_keys": LOOKUP_KEYS,
            },
            "results": [
                {
                    **{k: v for k, v in m.to_json().items() if k != "system"},
                    "system": name,
                    "served_by": SERVED_BY.get(name),
                    "p50_s": p50(m),
                    "p99_s": p99(m),
                }
                for group in (get_group, lookup_group)
                for name, m in group.results.items()
            ],
            "speedups": ratios,
            "checks": checks,
            "checks_failed": failed,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    if failed:
        print(f"{failed} check(s) FAILED: some reads were not served by the intended tier", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
