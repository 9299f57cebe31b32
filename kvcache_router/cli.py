"""`kvcache-router`: start the router. The first line on stdout says where it serves. For example:

kvcache-router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --kvcache 127.0.0.1:51051
kvcache-router --config router.toml --set workers.prefill_attempts=3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from aiohttp import web

from kvcache_client import AsyncKVCacheClient, TLSConfig
from kvcache_client.retry import NO_RETRY
from kvcache_router import __version__
from kvcache_router.app import Router
from kvcache_router.config import ConfigError, RouterConfig, assignments, load_config
from kvcache_router.logs import MalformedHttpFilter, RouterJsonFormatter
from kvcache_router.prefix import PrefixOracle


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvcache-router", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML file (default: $KVCACHE_ROUTER_CONFIG)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="any field (repeatable)")
    p.add_argument("--host", help="address to listen on (http.host)")
    p.add_argument("--port", type=int, help="port; 0 picks a free one (http.port)")
    p.add_argument("--prefill", action="append", metavar="URL", help="a prefill worker's base URL (repeatable)")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode worker's base URL (repeatable)")
    p.add_argument("--kvcache", metavar="HOST:PORT", help="the kvcache server to look prompts up in (kvcache.target)")
    p.add_argument("--log-level", help="debug, info, warning, error (http.log_level)")
    p.add_argument("--log-json", action="store_true", help="JSON log lines (http.log_json)")
    p.add_argument("--version", action="version", version=f"kvcache-router {__version__}")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out = assignments(args.set)
    flags = {
        ("http", "host"): args.host,
        ("http", "port"): args.port,
        ("http", "log_level"): args.log_level,
        ("http", "log_json"): True if args.log_json else None,
        ("workers", "prefill"): args.prefill,
        ("workers", "decode"): args.decode,
        ("kvcache", "target"): args.kvcache,
    }
    for (section, name), value in flags.items():
        if value is not None:
            out.setdefault(section, {})[name] = value
    return out


def build_router(config: RouterConfig, env: dict[str, str]) -> Router:
    """The router with its kvcache client (none without kvcache.target); nothing is connected yet."""
    kv = config.kvcache
    oracle = None
    if kv.target:
        tls: TLSConfig | bool = TLSConfig(ca_file=kv.tls_ca_file or None) if kv.tls else False
        # No retries: a Lookup that fails fast routes the request as uncached, which is always correct.
        client = AsyncKVCacheClient(
            kv.target, timeout_s=kv.lookup_timeout_s, retry=NO_RETRY, token=env.get(kv.token_env) or None, tls=tls
        )
        oracle = PrefixOracle(client, lookup_timeout_s=kv.lookup_timeout_s)
    namespace = None
    if oracle is not None and kv.namespace_source == "config":
        namespace = config.namespace.build()
        oracle.head_block = config.namespace.head_block()
    return Router(config, oracle, namespace)


def setup_logging(config: RouterConfig) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(
        RouterJsonFormatter()
        if config.http.log_json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=config.http.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(MalformedHttpFilter())


async def serve(config: RouterConfig, router: Router) -> None:
    """Serves until SIGTERM or SIGINT, then stops taking requests and closes the upstream connections."""
    runner = web.AppRunner(
        router.app(), access_log=None, handle_signals=False, shutdown_timeout=config.http.shutdown_grace_s
    )
    await runner.setup()
    site = web.TCPSite(runner, config.http.host, config.http.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    kv = config.kvcache.target or "off"
    w = config.workers
    print(
        f"kvcache-router {__version__} serving openai on {host}:{port} "
        f"(prefill: {len(w.prefill)}, decode: {len(w.decode)}, kvcache: {kv})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    try:
        config = load_config(path=args.config, env=env, overrides=overrides(args))
    except ConfigError as exc:
        print(f"kvcache-router: {exc}", file=sys.stderr)
        return 2
    setup_logging(config)
    asyncio.run(serve(config, build_router(config, env)))
    return 0
