"""`kvcache`: the kvcache server from a shell, for people (tables) and scripts (--json, exit codes).

    kvcache stats                                  the server's counters, one column per tier
    kvcache lookup --model ID ... --tokens-file F  how much of a prompt is stored, and where
    kvcache put / get / delete                     one block by namespace and hex key
    kvcache bench                                  put and get throughput and latency
    kvcache health                                 grpc.health.v1 Check, for probes

Global options (--target, --timeout, --json, the TLS options) go before or after the command; the
API token comes from KVCACHE_TOKEN, as for the SDK. The exit codes
(EXIT_CODES below) are part of the interface: scripts and container health checks rely on them.
Expected failures print one line, `kvcache: <message>`, on stderr; never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_client._cli import inputs
from kvcache_client._cli.bench import BenchPlan, Progress, run_bench
from kvcache_client._cli.inputs import MISS, NOT_SERVING, OK, REJECTED, UNREACHABLE, USAGE, CliError
from kvcache_client._cli.options import (
    DEFAULT_TIMEOUT_S,
    TARGET_ENV,
    Parser,
    arg_type,
    global_options,
    key_value,
    tls_options,
)
from kvcache_client._cli.render import hit_ratio, human_bytes, lookup_text, stats_text, table
from kvcache_client.client import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TARGET, KVCacheClient
from kvcache_client.connection import TOKEN_ENV, TLSConfig, make_channel
from kvcache_client.errors import DeadlineExceeded, KVCacheError, RPCError, Unavailable, from_rpc_error
from kvcache_core.format import BlockFormatError, decode_block, encode_block, verify_block
from kvcache_core.keys import CANONICAL_LAYOUT, HEADS_LAYOUT_VERSION, LAYOUT_VERSION, MLA_LAYOUT, Namespace, chunk_keys

EXIT_CODES = f"""\
exit codes:
  {OK}  success
  {MISS}  not found: get missed (or the block failed verification), lookup --require-hit
     found no stored prefix, bench could not read back every block it put
  {USAGE}  usage error: bad arguments, or an input file that cannot be read or parsed
  {UNREACHABLE}  server unreachable: no connection, or no answer within --timeout
  {REJECTED}  the server refused or failed the request (invalid, corrupt, too large, no or
     wrong token, ...)
  {NOT_SERVING}  health: the server or --service is not serving

environment:
  {TARGET_ENV}  the server, when --target is not given
  {TOKEN_ENV}   API token sent with every call (servers with [auth]; health needs none)
"""


@dataclass(frozen=True, slots=True)
class Context:
    """The global options, resolved."""

    target: str
    timeout_s: float
    json_output: bool
    tls: TLSConfig | bool = False

    def client(self) -> KVCacheClient:
        return KVCacheClient(self.target, timeout_s=self.timeout_s, tls=self.tls)

    def emit(self, text: str, data: Any) -> None:
        """Prints `text` for people, or `data` as JSON with --json."""
        print(json.dumps(data, indent=2) if self.json_output else text)


# -- commands --------------------------------------------------------------------------------------


def cmd_stats(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.client() as client:
        stats = client.stats()
    data = {"target": ctx.target, **dataclasses.asdict(stats)}
    for tier in data["tiers"]:
        tier["hit_ratio"] = hit_ratio(stats.tier(tier["name"]))
    ctx.emit(stats_text(stats, ctx.target), data)
    return OK


def _namespace(args: argparse.Namespace) -> Namespace:
    required = {"--num-layers": args.num_layers, "--num-kv-heads": args.num_kv_heads, "--head-size": args.head_size}
    missing = [flag for flag, value in required.items() if value is None]
    if missing:
        raise CliError(f"lookup --model also needs {', '.join(missing)}")
    try:
        return Namespace(
            model_id=args.model,
            kv_dtype=args.kv_dtype,
            chunk_tokens=args.chunk_tokens,
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_size,
            tp_size=args.tp_size,
            tp_rank=args.tp_rank,
            model_revision=args.model_revision,
            cache_salt=args.cache_salt,
            layout=args.layout,
            layout_version=args.layout_version,
            extra=dict(args.extra),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None


def cmd_lookup(ctx: Context, args: argparse.Namespace) -> int:
    if (args.model is None) == (args.namespace is None):
        raise CliError("lookup needs either --model (with the namespace fields and --tokens-file) or --namespace")
    if args.namespace is not None:
        if args.keys_file is None or args.tokens_file is not None:
            raise CliError("lookup --namespace takes --keys-file (hex keys), not --tokens-file")
        keys = inputs.read_keys(args.keys_file)
        with ctx.client() as client:
            result = client.lookup(args.namespace, keys)
        data: dict[str, Any] = {"namespace": args.namespace, "chunks": len(keys), "prefix_chunks": result.prefix_length}
        text = lookup_text(args.namespace, len(keys), result.prefix_length, result.tiers)
    else:
        if args.tokens_file is None or args.keys_file is not None:
            raise CliError("lookup --model takes --tokens-file (token ids); --keys-file goes with --namespace")
        ns = _namespace(args)
        tokens = inputs.read_tokens(args.tokens_file)
        if args.full_chunks_only:
            tokens = tokens[: len(tokens) - len(tokens) % ns.chunk_tokens]
        keys = chunk_keys(tokens, ns)
        with ctx.client() as client:
            result = client.lookup(ns.name, keys)
        data = {
            "namespace": ns.name,
            "chunks": len(keys),
            "tokens": len(tokens),
            "chunk_tokens": ns.chunk_tokens,
            "prefix_chunks": result.prefix_length,
            "prefix_tokens": min(result.prefix_length * ns.chunk_tokens, len(tokens)),
        }
        text = lookup_text(
            ns.name, len(keys), result.prefix_length, result.tiers, num_tokens=len(tokens), chunk_tokens=ns.chunk_tokens
        )
    data.update(tiers=list(result.tiers), keys=[k.hex() for k in keys])
    ctx.emit(text, data)
    return MISS if args.require_hit and result.prefix_length == 0 else OK


def cmd_put(ctx: Context, args: argparse.Namespace) -> int:
    data = inputs.read_bytes(args.file)
    if args.raw:
        block = encode_block(data, key=args.key, dtype="uint8", shape=(len(data),))
    else:
        try:
            verify_block(data, args.key)
        except BlockFormatError as exc:
            raise CliError(
                f"{args.file} is not a valid block under key {args.key.hex()} ({exc}); --raw stores any bytes as one"
            ) from None
        block = data
    with ctx.client() as client:
        result = client.put_many(args.namespace, [(args.key, block)])
    if result.stored != 1:
        raise CliError(
            f"the server did not keep the block of {human_bytes(len(block))} (larger than its RAM tier?)", REJECTED
        )
    # One block: each tier did exactly one thing with it (stored, queued, dropped, failed, deleted).
    tiers = {t.name: next((f for f in _PUT_OUTCOMES if getattr(t, f)), "none") for t in result.tiers}
    where = f": {', '.join(f'{name} {did}' for name, did in tiers.items())}" if tiers else ""
    ctx.emit(
        f"stored {args.namespace}/{args.key.hex()} ({len(block):,} bytes){where}",
        {"namespace": args.namespace, "key": args.key.hex(), "stored": True, "bytes": len(block), "tiers": tiers},
    )
    return OK


_PUT_OUTCOMES = ("stored", "queued", "dropped", "failed", "deleted")


def cmd_get(ctx: Context, args: argparse.Namespace) -> int:
    to_stdout = args.output in (None, "-")
    if to_stdout and sys.stdout.isatty():
        raise CliError("refusing to write a block to a terminal; use -o FILE or redirect stdout")
    if to_stdout and ctx.json_output:
        raise CliError("get --json needs -o FILE: stdout carries the block")
    with ctx.client() as client:
        (block,) = client.get_many(args.namespace, [args.key])
        corrupt = client.corrupt_blocks
    where = f"{args.namespace}/{args.key.hex()}"
    if block is None:
        reason = "failed verification (treated as a miss)" if corrupt else "not found"
        raise CliError(f"{where}: {reason}", MISS)
    header, payload = decode_block(block, verify=False)  # the SDK verified it on receipt
    out = payload if args.payload else block
    if to_stdout:
        sys.stdout.buffer.write(out)
        sys.stdout.buffer.flush()
        return OK
    try:
        with open(args.output, "wb") as f:
            f.write(out)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror}") from None
    shape = "x".join(str(d) for d in header.shape) or "scalar"
    what = "payload" if args.payload else "block"
    ctx.emit(
        f"wrote {len(out):,} bytes ({what}: {header.dtype.name.lower()} [{shape}], "
        f"layout {header.layout.name.lower()}) to {args.output}",
        {
            "namespace": args.namespace,
            "key": args.key.hex(),
            "path": args.output,
            "bytes": len(out),
            "payload_only": args.payload,
            "dtype": header.dtype.name.lower(),
            "layout": header.layout.name.lower(),
            "shape": list(header.shape),
        },
    )
    return OK


def cmd_delete(ctx: Context, args: argparse.Namespace) -> int:
    with ctx.client() as client:
        deleted = client.delete(args.namespace, args.key)
    ctx.emit(
        f"deleted {deleted} of {len(args.key)} keys from {args.namespace}",
        {"namespace": args.namespace, "requested": len(args.key), "deleted": deleted},
    )
    return OK


def cmd_bench(ctx: Context, args: argparse.Namespace) -> int:
    if args.blocks < 1 or args.batch < 1 or args.block_bytes < 1 or not 0 <= args.seconds < math.inf:
        raise CliError("bench: --blocks, --batch and --block-bytes must be positive, --seconds finite and >= 0")
    plan = BenchPlan(args.block_bytes, args.blocks, min(args.batch, args.blocks), args.seconds)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    with ctx.client() as client:
        namespace, put, get = run_bench(client, plan, Progress(sys.stderr, show), keep=args.keep)
    header = ["", "calls", "blocks", "MB/s", "p50 ms", "p99 ms"]
    rows = [
        [name, f"{r.calls:,}", f"{r.blocks:,}", f"{r.mb_s:,.1f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}"]
        for name, r in (("put", put), ("get", get))
    ]
    title = f"bench {ctx.target}: {plan.blocks} blocks of {human_bytes(plan.block_bytes)}, {plan.batch} per call" + (
        f", namespace {namespace} kept" if args.keep else ""
    )
    ctx.emit(
        title + "\n" + table(header, rows),
        {
            "target": ctx.target,
            "namespace": namespace,
            "kept": args.keep,
            "block_bytes": plan.block_bytes,
            "blocks": plan.blocks,
            "batch": plan.batch,
            "seconds": plan.seconds,
            "put": put.to_dict(),
            "get": get.to_dict(),
        },
    )
    if get.missing:
        print(
            f"kvcache: bench: {get.missing} of {get.blocks} gets missed; the working set "
            f"({human_bytes(plan.blocks * plan.block_bytes)}) may not fit the server's RAM tier",
            file=sys.stderr,
        )
        return MISS
    return OK


def cmd_health(ctx: Context, args: argparse.Namespace) -> int:
    with make_channel(ctx.target, tls=ctx.tls, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=ctx.timeout_s)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise from_rpc_error(exc) from None
            status = "SERVICE_UNKNOWN"  # what Watch would say; Check answers NOT_FOUND
    ctx.emit(status, {"target": ctx.target, "service": args.service, "status": status})
    return OK if status == "SERVING" else NOT_SERVING


# -- argument parsing ------------------------------------------------------------------------------


NAMESPACE_HELP = "the server-side namespace name (a Namespace's fingerprint hex, or any name the writer used)"


def build_parser() -> argparse.ArgumentParser:
    globals_ = global_options()
    fmt = argparse.RawDescriptionHelpFormatter
    parser = Parser(
        prog="kvcache",
        description="Inspect and exercise a kvcache server.",
        epilog=EXIT_CODES,
        formatter_class=fmt,
        parents=[globals_],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def command(name: str, func: Callable[[Context, argparse.Namespace], int], help_: str) -> Parser:
        p = sub.add_parser(
            name, help=help_, description=help_, epilog=EXIT_CODES, formatter_class=fmt, parents=[globals_]
        )
        p.set_defaults(func=func)
        return p

    command("stats", cmd_stats, "the server's counters: a table per tier, or all of them with --json")

    p = command("lookup", cmd_lookup, "the stored prefix of a prompt (token ids) or of a list of keys")
    model = p.add_argument_group("a prompt: the namespace fields (docs/keys.md) and its token ids")
    model.add_argument("--model", metavar="ID", help="model_id of the namespace")
    model.add_argument("--kv-dtype", default="bfloat16", metavar="DTYPE", help="KV element type (default %(default)s)")
    model.add_argument(
        "--chunk-tokens", type=int, default=256, metavar="N", help="tokens per chunk (default %(default)s)"
    )
    model.add_argument("--num-layers", type=int, metavar="N", help="layers of the model (required with --model)")
    model.add_argument("--num-kv-heads", type=int, metavar="H", help="KV heads of this shard (required with --model)")
    model.add_argument("--head-size", type=int, metavar="D", help="elements per head (required with --model)")
    model.add_argument(
        "--tp-size", type=int, default=1, metavar="N", help="tensor-parallel world size (default %(default)s)"
    )
    model.add_argument(
        "--tp-rank", type=int, default=0, metavar="R", help="this shard's tensor-parallel rank (default %(default)s)"
    )
    model.add_argument(
        "--model-revision", default="", metavar="REV", help="checkpoint revision (default: none, unknown)"
    )
    model.add_argument(
        "--cache-salt", default="", metavar="SALT", help="per-tenant or per-request isolation string (default: none)"
    )
    model.add_argument(
        "--layout",
        choices=[CANONICAL_LAYOUT, MLA_LAYOUT],
        default=CANONICAL_LAYOUT,
        help="KV layout of the blocks (default %(default)s)",
    )
    model.add_argument(
        "--layout-version",
        type=int,
        default=LAYOUT_VERSION,
        metavar="V",
        help=f"layout version; {HEADS_LAYOUT_VERSION}: head-sharded, as the vLLM and transformers connectors store "
        "(default %(default)s)",
    )
    model.add_argument(
        "--extra",
        type=arg_type(key_value),
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="namespace extra field; repeat for more (default: none)",
    )
    model.add_argument(
        "--tokens-file",
        metavar="FILE",
        help="token ids: a JSON list or integers separated by whitespace or commas; - reads stdin",
    )
    model.add_argument("--full-chunks-only", action="store_true", help="do not key a final partial chunk")
    raw = p.add_argument_group("raw keys")
    raw.add_argument("--namespace", metavar="NAME", help="the server-side namespace name")
    raw.add_argument("--keys-file", metavar="FILE", help="hex keys, a JSON list or separated words; - reads stdin")
    p.add_argument("--require-hit", action="store_true", help=f"exit {MISS} when no prefix is stored")

    key = arg_type(inputs.parse_key)
    p = command("put", cmd_put, "store one block from a file")
    p.add_argument("--namespace", required=True, metavar="NAME", help=NAMESPACE_HELP)
    p.add_argument("--key", required=True, type=key, metavar="HEX", help="the chunk key, 32 hex digits")
    p.add_argument("--raw", action="store_true", help="store the file's bytes as an opaque uint8 block")
    p.add_argument("file", metavar="FILE", help="an encoded block (or any bytes with --raw); - reads stdin")

    p = command("get", cmd_get, f"fetch one block; exit {MISS} when it is not stored")
    p.add_argument("--namespace", required=True, metavar="NAME", help=NAMESPACE_HELP)
    p.add_argument("--key", required=True, type=key, metavar="HEX", help="the chunk key, 32 hex digits")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--payload", action="store_true", help="write the payload only, without the block header")

    p = command("delete", cmd_delete, "remove keys from every tier")
    p.add_argument("--namespace", required=True, metavar="NAME", help=NAMESPACE_HELP)
    p.add_argument("--key", required=True, type=key, nargs="+", metavar="HEX", help="chunk keys, 32 hex digits each")

    p = command("bench", cmd_bench, "put then get random blocks; MB/s and latency per call")
    p.add_argument(
        "--block-bytes",
        type=arg_type(inputs.parse_size),
        default=16 << 20,
        metavar="SIZE",
        help="payload per block (default 16MiB)",
    )
    p.add_argument("--blocks", type=int, default=32, metavar="N", help="distinct blocks (default 32)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="blocks per call (default 1)")
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="repeat each phase for at least this long (default: one pass)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--keep", action="store_true", help="leave the blocks on the server")

    p = command("health", cmd_health, f"grpc.health.v1 Check: exit {OK} only when SERVING")
    p.add_argument("--service", default="", metavar="NAME", help="a service name (default: the whole server)")
    return parser


# -- main ------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _fail(message: str) -> None:
    print(f"kvcache: {_one_line(message)}", file=sys.stderr)


def run(argv: Sequence[str] | None = None) -> int:
    """Parses `argv` and runs the command; raises CliError and the SDK's errors."""
    args = build_parser().parse_args(argv)
    ctx = Context(
        target=getattr(args, "target", None) or os.environ.get(TARGET_ENV) or DEFAULT_TARGET,
        timeout_s=getattr(args, "timeout", DEFAULT_TIMEOUT_S),
        json_output=getattr(args, "json", False),
        tls=tls_options(args),
    )
    try:
        return args.func(ctx, args)
    except Unavailable as exc:
        raise CliError(f"cannot reach the server at {ctx.target}: {exc.details}", UNREACHABLE) from None
    except DeadlineExceeded:
        raise CliError(f"no answer from the server at {ctx.target} within {ctx.timeout_s:g}s", UNREACHABLE) from None


def main(argv: Sequence[str] | None = None) -> int:
    """The `kvcache` command. Returns the exit code (see EXIT_CODES)."""
    try:
        return run(argv)
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else OK
    except CliError as exc:
        _fail(str(exc))
        return exc.code
    except RPCError as exc:
        hint = f" (set {TOKEN_ENV} to an API token)" if exc.code == grpc.StatusCode.UNAUTHENTICATED else ""
        _fail(f"the server refused the request: {exc.code.name}: {exc.details}{hint}")
        return REJECTED
    except KVCacheError as exc:
        _fail(f"unexpected answer from the server: {exc}")
        return REJECTED
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (`kvcache stats | head`); stop quietly, without a second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK


if __name__ == "__main__":
    sys.exit(main())
