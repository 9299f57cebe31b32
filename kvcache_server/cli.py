"""`kvcache-server`: start the server. With no arguments: RAM only, on 127.0.0.1:51051."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from kvcache_server.allocator import malloc_thresholds, tune_malloc
from kvcache_server.app import STARTUP_LOGGER, serve
from kvcache_server.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ConfigError,
    ServerConfig,
    load_config,
    parse_assignment,
)
from kvcache_server.interceptor import RequestIdFilter


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: tracebacks go in `exc` (and `stack`), escaped."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry)


def rfc3339(created: float) -> str:
    """A UTC timestamp with milliseconds: 2026-12-01T11:20:03.123Z."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _log_uncaught() -> None:
    """Uncaught exceptions, in the main thread or any other, become log records instead of raw tracebacks."""
    crash = logging.getLogger("kvcache_server.crash")

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        crash.critical("uncaught exception", exc_info=(kind, exc, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            name = args.thread.name if args.thread else "?"
            crash.error(
                "uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
            )

    sys.excepthook = hook
    threading.excepthook = thread_hook


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


def setup_logging(config: ServerConfig) -> None:
    """The root handler on stderr, plain or JSON (server.log_json), and warnings routed through it."""
    handler = logging.StreamHandler()
    if config.server.log_json:
        handler.setFormatter(JsonFormatter())
        # The start-up line is a record too: on stderr with the rest, and on stdout, where supervisors wait for it.
        announce = logging.StreamHandler(sys.stdout)
        announce.setFormatter(JsonFormatter())
        announce.addFilter(RequestIdFilter())
        startup = logging.getLogger(STARTUP_LOGGER)
        startup.addHandler(announce)
        startup.setLevel(logging.INFO)  # announced whatever server.log_level says, as the plain line is
        _log_uncaught()
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=config.server.log_level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn() as WARNING records of logger py.warnings


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(path=args.config, env=os.environ, overrides=_overrides(args))
    except ConfigError as exc:
        message = f"kvcache-server: configuration error: {exc}"
        if args.log_json:  # logging is not set up yet; the line is still one JSON object
            message = json.dumps(
                {
                    "ts": rfc3339(time.time()),
                    "level": "error",
                    "logger": "kvcache_server",
                    "request_id": "-",
                    "msg": message,
                }
            )
        print(message, file=sys.stderr)
        return 2
    setup_logging(config)
    tune_malloc(*malloc_thresholds(config.server))  # before the first block is allocated
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        if config.server.log_json:
            logging.getLogger("kvcache_server").error("%s", exc)
        else:
            print(f"kvcache-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
