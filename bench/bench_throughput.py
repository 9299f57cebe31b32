"""Throughput of the kvcache SDK against bare gRPC, protobuf-over-gRPC and redis-py baselines.

Run from the repository root with the project's virtualenv:

    python bench/bench_throughput.py              # full run (~2-3 minutes)
    python bench/bench_throughput.py --quick      # smoke run (< 30 s)
    python bench/bench_throughput.py --json out.json

Workloads (payload bytes per call; every block has its own random 16-byte key):
    16MiB x1     one 16 MiB block per call
    16MiB x8     eight 16 MiB blocks per call
    256KiB x64   sixty-four 256 KiB blocks per call
each as put and get.

Systems, every server in its own process, every client synchronous (like KVCacheClient):
    kvcache SDK   KVCacheClient.put_many / get_many against `python -m kvcache_server`, as a client on
                  the server's host gets it by default: block bytes through shared memory (docs/shm.md),
                  control on gRPC. Blocks from encode_block(payload, key=k, dtype="uint8", shape=(n,)); get
                  includes the SDK's checksum verification, put includes the server's.
    SDK gRPC      the same client with shm=False, as a client on another host: every byte on gRPC.
    gRPC raw      bench/echo_server.py, generic handlers with identity serializers: the raw block bytes
                  are the gRPC messages; no protobuf anywhere. Client-streaming Put, server-streaming Get.
                  Same message sizes as the SDK: 16 MiB blocks one per message; 256 KiB blocks packed
                  greedily into messages of at most 4 MiB exactly as the SDK packs them (which, with the
                  48-byte block header, is 15 blocks per message). The packed messages are built once,
                  outside the timed region, and Get does not split them: this is an upper bound.
    gRPC pb       the same server with google.protobuf.BytesValue messages (one bytes field):
                  protobuf serialisation and parsing on both sides, nothing else.
    redis-py      redis-server started here on a free port (no persistence); SET/GET for one block,
                  a non-transactional pipeline of SETs and one MGET for batches.
The 256 KiB workload is also measured one block per message on the echo server (second table), and the
16 MiB workloads as prebuilt 1 MiB messages ("gRPC raw 1MiB msgs", third table): the SDK over gRPC puts
blocks over 4 MiB in parts of 1 MiB (Block.more), and gets them so, which gRPC moves faster than one
16 MiB message.

This script is longer than the project's ~500-line module guideline on purpose: it is one self-contained
benchmark whose baselines must be read side by side with the measured system; splitting it would scatter
what one reader needs to judge the comparison.

Each measurement: --rounds interleaved rounds over the systems (rotating order; the machine is assumed
noisy), each round one warm-up call and then calls until its share of --min-time and --min-iters;
the reported throughput is payload bytes / median time of all timed calls (MB/s = 10^6 B/s, GB/s = 10^9 B/s).
The first get of every system and workload is checked to return exactly the bytes that were put.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import redis
from _common import (
    KiB,
    Measurement,
    MiB,
    ServerProcess,
    TimingPlan,
    exit_on_sigterm,
    free_port,
    measure,
    memcpy_gb_s,
    python_cmd,
    redis_versions,
)
from google.protobuf.wrappers_pb2 import BytesValue, UInt64Value

from kvcache_client import KVCacheClient
from kvcache_client.client import DEFAULT_MAX_MESSAGE_BYTES
from kvcache_client.messages import DEFAULT_MESSAGE_BYTES, DEFAULT_PART_BYTES, channel_options
from kvcache_core.format import encode_block
from kvcache_server.config import load_config

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "bench-throughput"
CALL_TIMEOUT_S = 120.0
SERVER_ARGS = ("--ram-capacity", "4GiB", "--max-block-bytes", "64MiB")

SDK, SDKG, RAW, PB, REDIS = "kvcache SDK", "SDK gRPC", "gRPC raw", "gRPC pb", "redis-py"
RAW1, PB1 = "gRPC raw 1/msg", "gRPC pb 1/msg"
RAWP = "gRPC raw 1MiB msgs"
MAIN_SYSTEMS = (SDK, SDKG, RAW, PB, REDIS)
ALL_SYSTEMS = (SDK, SDKG, RAW, PB, REDIS, RAW1, PB1, RAWP)
SHORT_NAMES = {
    "sdk": SDK,
    "sdkgrpc": SDKG,
    "raw": RAW,
    "pb": PB,
    "redis": REDIS,
    "raw1": RAW1,
    "pb1": PB1,
    "rawparts": RAWP,
}


# -- workloads ---------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    block_bytes: int
    count: int
    keys: list[bytes]
    blocks: list[bytes]  # encoded blocks (header + payload), what the SDK sends
    packed: list[bytes]  # the blocks packed into messages the way the SDK packs its Put messages
    single: list[bytes]  # one block per message
    parts: list[bytes]  # blocks over DEFAULT_PART_BYTES cut into messages of that size (SDK gRPC puts)

    @property
    def payload_bytes(self) -> int:
        return self.block_bytes * self.count

    @property
    def items(self) -> list[tuple[bytes, bytes]]:
        return list(zip(self.keys, self.blocks, strict=True))


def pack_like_sdk(blocks: Sequence[bytes], message_bytes: int = DEFAULT_MESSAGE_BYTES) -> list[bytes]:
    """Concatenates blocks into messages with the SDK's rule (messages.put_messages): start a new
    message when the next block would take this one past `message_bytes`."""
    messages: list[bytes] = []
    batch: list[bytes] = []
    size = 0
    for b in blocks:
        if batch and size + len(b) > message_bytes:
            messages.append(b"".join(batch))
            batch, size = [], 0
        batch.append(b)
        size += len(b)
    if batch:
        messages.append(b"".join(batch))
    return messages


def make_workloads(specs: Sequence[tuple[str, int, int]]) -> list[Workload]:
    """Random payloads, generated once; every block gets distinct bytes and a distinct key."""
    total = sum(size * count for _, size, count in specs)
    rnd = memoryview(os.urandom(total))
    out: list[Workload] = []
    offset = 0
    for name, size, count in specs:
        blocks = []
        keys = [os.urandom(16) for _ in range(count)]
        for key in keys:
            blocks.append(encode_block(rnd[offset : offset + size], key=key, dtype="uint8", shape=(size,)))
            offset += size
        parts = [b[i : i + DEFAULT_PART_BYTES] for b in blocks for i in range(0, len(b), DEFAULT_PART_BYTES)]
        out.append(Workload(name, size, count, keys, blocks, pack_like_sdk(blocks), list(blocks), parts))
    return out


# -- systems -----------------------------------------------------------------------------------


class System:
    """put(wl) and get(wl) -> list of byte strings comparable with expected(wl)."""

    name: str

    def applies(self, wl: Workload) -> bool:
        return True

    def put(self, wl: Workload) -> None:
        raise NotImplementedError

    def get(self, wl: Workload) -> list[bytes | None]:
        raise NotImplementedError

    def expected(self, wl: Workload) -> list[bytes]:
        return wl.blocks


class SdkSystem(System):
    def __init__(self, client: KVCacheClient, name: str) -> None:
        self.client = client
        self.name = name

    def put(self, wl: Workload) -> None:
        result = self.client.put_many(NAMESPACE, wl.items)
        if result.stored != wl.count:
            raise RuntimeError(f"kvcache stored {result.stored} of {wl.count} blocks ({result})")

    def get(self, wl: Workload) -> list[bytes | None]:
        return self.client.get_many(NAMESPACE, wl.keys)


class EchoSystem(System):
    """The bench/echo_server.py baselines: raw bytes or protobuf BytesValue, packed or one block per message."""

    def __init__(self, channel: grpc.Channel, name: str, *, protobuf: bool, mode: str) -> None:
        self.name = name
        self.mode = mode  # "packed", "single" (one block per message) or "parts" (1 MiB messages)
        service = "echo.Pb" if protobuf else "echo.Raw"
        self.protobuf = protobuf
        if protobuf:
            self._put = channel.stream_unary(
                f"/{service}/Put",
                request_serializer=BytesValue.SerializeToString,
                response_deserializer=UInt64Value.FromString,
            )
            self._get = channel.unary_stream(
                f"/{service}/Get",
                request_serializer=BytesValue.SerializeToString,
                response_deserializer=BytesValue.FromString,
            )
        else:
            # No serializers: requests and responses are bytes as they go on the wire.
            self._put = channel.stream_unary(f"/{service}/Put")
            self._get = channel.unary_stream(f"/{service}/Get")

    def applies(self, wl: Workload) -> bool:
        if self.mode == "single":  # with blocks >= the 4 MiB message target, packing is one per message
            return len(wl.packed) != len(wl.single)
        if self.mode == "parts":  # only blocks that the SDK puts in parts
            return wl.block_bytes > DEFAULT_PART_BYTES
        return True

    def _slot(self, wl: Workload) -> str:
        return f"{wl.name}/{self.mode}"

    def expected(self, wl: Workload) -> list[bytes]:
        return {"single": wl.single, "packed": wl.packed, "parts": wl.parts}[self.mode]

    def put(self, wl: Workload) -> None:
        messages = self.expected(wl)
        meta = (("slot", self._slot(wl)),)
        if self.protobuf:
            ack = self._put((BytesValue(value=m) for m in messages), metadata=meta, timeout=CALL_TIMEOUT_S).value
        else:
            ack = int.from_bytes(self._put(iter(messages), metadata=meta, timeout=CALL_TIMEOUT_S), "little")
        if ack != len(messages):
            raise RuntimeError(f"{self.name}: server acknowledged {ack} of {len(messages)} messages")

    def get(self, wl: Workload) -> list[bytes | None]:
        slot = self._slot(wl).encode()
        if self.protobuf:
            return [r.value for r in self._get(BytesValue(value=slot), timeout=CALL_TIMEOUT_S)]
        return list(self._get(slot, timeout=CALL_TIMEOUT_S))


class RedisSystem(System):
    name = REDIS

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def put(self, wl: Workload) -> None:
        if wl.count == 1:
            self.r.set(wl.keys[0], wl.blocks[0])
            return
        pipe = self.r.pipeline(transaction=False)
        for k, b in wl.items:
            pipe.set(k, b)
        pipe.execute()

    def get(self, wl: Workload) -> list[bytes | None]:
        if wl.count == 1:
            return [self.r.get(wl.keys[0])]
        return self.r.mget(wl.keys)


# -- servers -----------------------------------------------------------------------------------


def start_kvcache() -> tuple[ServerProcess, int]:
    proc = ServerProcess(
        "kvcache-server", python_cmd("-m", "kvcache_server", "--port", "0", *SERVER_ARGS), cwd=str(REPO)
    )
    port = proc.start(r"serving \S+ on [^\s:]+:(\d+)")  # a failed start stops the child itself
    assert port is not None
    return proc, port


def start_echo(max_message_bytes: int) -> tuple[ServerProcess, int]:
    argv = python_cmd(
        str(REPO / "bench" / "echo_server.py"), "--port", "0", "--max-message-bytes", str(max_message_bytes)
    )
    proc = ServerProcess("echo-server", argv, cwd=str(REPO))
    port = proc.start(r"serving on [^\s:]+:(\d+)")  # a failed start stops the child itself
    assert port is not None
    return proc, port


def start_redis(redis_server: str) -> tuple[ServerProcess, int, redis.Redis]:
    port = free_port()
    argv = [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = ServerProcess("redis-server", argv)
    try:
        proc.start(None)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=CALL_TIMEOUT_S)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not come up on port {port}{proc.stderr_tail()}") from None
                time.sleep(0.05)
    except BaseException:
        proc.stop()
        raise
    return proc, port, client


def wait_for_channel(channel: grpc.Channel, what: str, timeout_s: float = 15.0) -> None:
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise RuntimeError(f"cannot connect to {what}") from None


# -- report ------------------------------------------------------------------------------------


def fmt_rate(m: Measurement | None) -> str:
    return "-" if m is None else f"{m.mb_s:,.0f}"


def fmt_ratio(a: Measurement | None, b: Measurement | None) -> str:
    return "-" if a is None or b is None else f"{a.mb_s / b.mb_s:.2f}x"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    align = ["<"] + [">"] * (len(headers) - 1)
    line = lambda cells: "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths, strict=True))  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def build_tables(results: dict[tuple[str, str, str], Measurement], workloads: Sequence[Workload]) -> str:
    main_rows = []
    extra_rows = []
    for wl in workloads:
        for op in ("put", "get"):
            get = lambda s, wl=wl, op=op: results.get((s, wl.name, op))  # noqa: E731
            sdk = get(SDK)
            main_rows.append(
                [
                    f"{wl.name} {op}",
                    *(fmt_rate(get(s)) for s in MAIN_SYSTEMS),
                    fmt_ratio(sdk, get(RAW)),
                    fmt_ratio(get(SDKG), get(RAW)),
                    fmt_ratio(sdk, get(PB)),
                    fmt_ratio(sdk, get(REDIS)),
                ]
            )
            if get(RAW1) or get(PB1):
                extra_rows.append(
                    [
                        f"{wl.name} {op}",
                        fmt_rate(sdk),
                        fmt_rate(get(RAW)),
                        fmt_rate(get(RAW1)),
                        fmt_rate(get(PB)),
                        fmt_rate(get(PB1)),
                        fmt_ratio(sdk, get(RAW1)),
                        fmt_ratio(sdk, get(PB1)),
                    ]
                )
    headers = ["workload op (MB/s)", *MAIN_SYSTEMS, "SDK/raw", "SDK gRPC/raw", "SDK/pb", "SDK/redis"]
    text = render_table(headers, main_rows)
    if extra_rows:
        headers2 = [
            "workload op (MB/s)",
            SDK,
            "raw packed",
            "raw 1/msg",
            "pb packed",
            "pb 1/msg",
            "SDK/raw1",
            "SDK/pb1",
        ]
        text += "\n\nSmall blocks, packed (like the SDK: <= 4 MiB per message) vs one block per message:\n"
        text += render_table(headers2, extra_rows)
    part_rows = []
    for wl in workloads:
        for op in ("put", "get"):
            raw_parts = results.get((RAWP, wl.name, op))
            if raw_parts is None:
                continue
            sdkg, raw = results.get((SDKG, wl.name, op)), results.get((RAW, wl.name, op))
            part_rows.append(
                [f"{wl.name} {op}", fmt_rate(sdkg), fmt_rate(raw), fmt_rate(raw_parts), fmt_ratio(sdkg, raw_parts)]
            )
    if part_rows:
        text += "\n\nLarge blocks in 1 MiB messages (how SDK gRPC moves them, in parts) vs whole:\n"
        text += render_table(["workload op (MB/s)", SDKG, "raw whole", "raw 1MiB msgs", "SDK gRPC/raw 1MiB"], part_rows)
    return text


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kvcache SDK throughput vs bare gRPC, protobuf gRPC and redis-py (see module docstring).",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few iterations (< 30 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--min-time", type=float, help="seconds per measurement (default 1.5, quick 0.1)")
    p.add_argument("--min-iters", type=int, help="calls per measurement at least (default 5, quick 2)")
    p.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds over the systems; each gets 1/rounds of the time (default 3, quick 1)",
    )
    p.add_argument(
        "--systems",
        default=",".join(SHORT_NAMES),
        help="comma-separated subset of " + ",".join(SHORT_NAMES) + " (default: all)",
    )
    p.add_argument("--redis-server", default="redis-server", help="redis-server executable (default: redis-server)")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHORT_NAMES]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {','.join(SHORT_NAMES)}")
    args.systems = [SHORT_NAMES[n] for n in names]
    return args


def timing_plan(args: argparse.Namespace) -> TimingPlan:
    base = (
        TimingPlan(min_time_s=0.1, min_iters=2, max_iters=20, max_time_s=0.5)
        if args.quick
        else TimingPlan(min_time_s=1.5, min_iters=5, max_iters=500, max_time_s=6.0)
    )
    return TimingPlan(
        min_time_s=base.min_time_s if args.min_time is None else args.min_time,
        min_iters=base.min_iters if args.min_iters is None else args.min_iters,
        max_iters=base.max_iters,
        max_time_s=max(base.max_time_s, args.min_time or 0),
        warmup=base.warmup,
    )


def check_roundtrip(system: System, wl: Workload) -> None:
    got = system.get(wl)
    want = system.expected(wl)
    if len(got) != len(want) or any(g != w for g, w in zip(got, want, strict=False)):
        missing = sum(g is None for g in got)
        raise RuntimeError(
            f"{system.name} {wl.name}: get returned different bytes than were put "
            f"({len(got)} items for {len(want)}, {missing} missing)"
        )


def versions(redis_server: str) -> dict[str, str]:
    from google import protobuf

    rs, parser = redis_versions(redis_server)
    return {
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": protobuf.__version__,
        "redis-py": redis.__version__,
        "redis-py parser": parser,
        "redis-server": rs,
        "cpus": str(os.cpu_count()),
        "platform": platform.platform(),
    }


def run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    plan = timing_plan(args)
    info = versions(args.redis_server)
    print("kvcache throughput benchmark" + (" (--quick)" if args.quick else ""))
    print("  " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(
        f"  timing: {args.rounds} interleaved round(s) per measurement, each {plan.warmup} warm-up call then "
        f">= {plan.min_time_s / args.rounds:.2f}s and >= {plan.per_round(args.rounds).min_iters} calls; "
        "median over all timed calls reported"
    )

    memcpy = memcpy_gb_s(16 * MiB, min_time_s=0.2 if args.quick else 0.5)
    print(f"  memcpy baseline (bytearray slice copy, 16 MiB): {memcpy:.2f} GB/s")

    specs = [("16MiB x1", 16 * MiB, 1), ("16MiB x8", 16 * MiB, 8), ("256KiB x64", 256 * KiB, 64)]
    workloads = make_workloads(specs)
    for wl in workloads:
        print(
            f"  workload {wl.name}: {wl.count} x {wl.block_bytes} B payload (+{len(wl.blocks[0]) - wl.block_bytes} B "
            f"header), {len(wl.packed)} message(s) per call when packed like the SDK"
        )

    max_message_bytes = load_config(
        overrides={"ram": {"capacity_bytes": "4GiB"}, "limits": {"max_block_bytes": "64MiB"}}
    ).limits.max_message_bytes

    servers: list[ServerProcess] = []
    closers: list[Callable[[], object]] = []
    results: dict[tuple[str, str, str], Measurement] = {}
    try:
        systems: list[System] = []
        sdk_wanted = [s for s in (SDK, SDKG) if s in args.systems]
        if sdk_wanted:
            proc, port = start_kvcache()
            servers.append(proc)
            print(f"  started: {proc.first_line}")
            for name in sdk_wanted:
                client = KVCacheClient(f"127.0.0.1:{port}", timeout_s=CALL_TIMEOUT_S, shm=name == SDK, bulk=False)
                closers.append(client.close)
                stats = client.stats()  # connects, and checks the server answers
                systems.append(SdkSystem(client, name))
            print(f"  kvcache server {stats.version}, max block {stats.max_block_bytes} B")
        echo_wanted = [s for s in (RAW, PB, RAW1, PB1, RAWP) if s in args.systems]
        if echo_wanted:
            proc, port = start_echo(max_message_bytes)
            servers.append(proc)
            print(f"  started: {proc.first_line} (max message {max_message_bytes} B)")
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options(DEFAULT_MAX_MESSAGE_BYTES))
            closers.append(channel.close)
            wait_for_channel(channel, "echo server")
            for name in echo_wanted:
                systems.append(
                    EchoSystem(
                        channel,
                        name,
                        protobuf=name in (PB, PB1),
                        mode="single" if name in (RAW1, PB1) else "parts" if name == RAWP else "packed",
                    )
                )
        if REDIS in args.systems:
            proc, port, rclient = start_redis(args.redis_server)
            servers.append(proc)
            closers.append(rclient.close)
            print(f"  started: redis-server on 127.0.0.1:{port}")
            systems.append(RedisSystem(rclient))
        systems.sort(key=lambda s: ALL_SYSTEMS.index(s.name))

        print()
        print(f"{'system':<16} {'workload':<11} {'op':<4} {'MB/s':>9} {'GB/s':>7} {'iters':>6}  min..max MB/s")
        round_plan = plan.per_round(args.rounds)
        for wl in workloads:
            for op in ("put", "get"):
                active = [s for s in systems if s.applies(wl)]
                if op == "get":
                    for system in active:
                        check_roundtrip(system, wl)
                # Rounds interleave the systems (in rotating order) so that the machine's noise
                # spreads over all of them rather than hitting whichever ran at a bad moment.
                for r in range(args.rounds):
                    k = r % len(active)
                    for system in active[k:] + active[:k]:
                        fn = functools.partial(system.get if op == "get" else system.put, wl)
                        m = measure(system.name, wl.name, op, wl.payload_bytes, fn, round_plan)
                        key = (system.name, wl.name, op)
                        if key in results:
                            results[key].add(m)
                        else:
                            results[key] = m
                for system in active:
                    m = results[(system.name, wl.name, op)]
                    lo, hi = m.spread()
                    print(
                        f"{system.name:<16} {wl.name:<11} {op:<4} {m.mb_s:>9,.0f} {m.gb_s:>7.2f} {m.iters:>6}  "
                        f"{lo:,.0f}..{hi:,.0f}",
                        flush=True,
                    )
        for proc in servers:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the run{proc.stderr_tail()}")
        for system in systems:
            if isinstance(system, SdkSystem):
                link = system.client._transport.shm  # type: ignore[attr-defined]
                print(f"  {system.name}: shared-memory path {link.state}{f' ({link.reason})' if link.reason else ''}")
        if sdk_wanted:
            s = systems[0].client.stats()  # type: ignore[attr-defined]
            print(f"  server: {s.shm_bytes_received:,} B received and {s.shm_bytes_sent:,} B sent through shm")
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # cleanup must go on
                print(f"warning: close failed: {exc}", file=sys.stderr)
        for proc in reversed(servers):
            proc.stop()

    elapsed = time.monotonic() - t_start
    print()
    print(f"Throughput, payload MB/s (10^6 B/s), median per call; memcpy 16 MiB: {memcpy:.2f} GB/s")
    print(build_tables(results, workloads))
    print(f"\ntotal run time {elapsed:.1f} s")

    if args.json:
        doc = {
            "quick": args.quick,
            "timing": {**vars(plan), "rounds": args.rounds},
            "versions": info,
            "memcpy_gb_s": memcpy,
            "elapsed_s": elapsed,
            "workloads": [
                {
                    "name": wl.name,
                    "block_payload_bytes": wl.block_bytes,
                    "blocks_per_call": wl.count,
                    "block_bytes_with_header": len(wl.blocks[0]),
                    "messages_per_call_packed": len(wl.packed),
                }
                for wl in workloads
            ],
            "results": [m.to_json() for m in results.values()],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
