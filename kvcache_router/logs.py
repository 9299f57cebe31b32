"""The router's log records: kvcache-server's JSON line, plus the facts of a request as fields of their own.

With --log-json every record is one JSON object (kvcache-server's: ts, level, logger, request_id,
msg). A request's line also carries what the router did as fields (endpoint, status, route, tokens,
workers, timings: `RequestReport.fields`), so a log pipeline reads them without parsing `msg`, and
no text a client sends can pose as one: the request id is checked at the door (intake.request_id),
everything else in a field is the router's own or JSON-escaped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from kvcache_server.cli import JsonFormatter

FIELDS = "router_fields"  # the LogRecord attribute the fields travel in (logging's `extra`)


def request_extra(request_id: str, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`extra=` for a log call about one request: its id, and optionally more fields."""
    extra: dict[str, Any] = {"request_id": request_id}
    if fields:
        extra[FIELDS] = dict(fields)
    return extra


class RouterJsonFormatter(JsonFormatter):
    """kvcache-server's JSON records, with a record's router fields merged in (never over the record's own keys)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, FIELDS, None)
        if not fields:
            return line
        entry = json.loads(line)
        entry.update({k: v for k, v in fields.items() if k not in entry})
        return json.dumps(entry)


class MalformedHttpFilter(logging.Filter):
    """aiohttp's server logs a client's malformed HTTP (a bad chunk size, an oversized header) as an ERROR
    with a traceback, before any handler runs; it already answered 400. On the `aiohttp.server` logger
    this makes each such record one WARNING line without the traceback: a client's mistake, not the
    router's, and not a way to fill the log with tracebacks.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "malformed HTTP from a client, answered %s: %r", (exc.code, exc.message)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True
