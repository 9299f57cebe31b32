"""`kvcache-server`: start the server. With no arguments: RAM only, on 127.0.0.1:51051."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

from kvcache_server.allocator import tune_malloc
from kvcache_server.app import serve
from kvcache_server.config import DEFAULT_HOST, DEFAULT_PORT, ConfigError, load_config, parse_assignment
from kvcache_server.interceptor import RequestIdFilter


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache-server",
        description="kvcache server: content-addressed KV blocks over gRPC. "
        "Settings come from defaults < --config TOML < KVCACHE_<SECTION>_<FIELD> env vars < flags.",
    )
    p.add_argument("--config", help="TOML config file (also KVCACHE_CONFIG)")
    p.add_argument("--host", help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, help=f"port to bind, 0 for any free port (default {DEFAULT_PORT})")
    p.add_argument("--ram-capacity", metavar="SIZE", help="RAM tier byte cap, e.g. 4GiB (default 1GiB)")
    p.add_argument("--max-block-bytes", metavar="SIZE", help="largest accepted block (default 64MiB)")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="set any config field")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    named = {
        ("server", "host"): args.host,
        ("server", "port"): args.port,
        ("ram", "capacity_bytes"): args.ram_capacity,
        ("limits", "max_block_bytes"): args.max_block_bytes,
        ("server", "log_level"): args.log_level,
        ("server", "log_json"): True if args.log_json else None,
    }
    for text in args.set:
        section, name, value = parse_assignment(text)
        out.setdefault(section, {})[name] = value
    for (section, name), value in named.items():
        if value is not None:
            out.setdefault(section, {})[name] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(path=args.config, env=os.environ, overrides=_overrides(args))
    except ConfigError as exc:
        print(f"kvcache-server: configuration error: {exc}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    if config.server.log_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=config.server.log_level.upper(), handlers=[handler])
    tune_malloc(config.server.malloc_mmap_threshold_bytes)  # before the first block is allocated
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"kvcache-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
