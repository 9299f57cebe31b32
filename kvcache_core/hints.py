"""Retention hints: how a request asks that its prefix stay in RAM, read alike by the router and the connectors.

A hint becomes a put's `retain_ttl_s` (docs/tiers.md, "Sessions that stay"). Two spellings:

    {"kvcache_retain_ttl_s": 600}                   in a request's kv_transfer_params (the connectors';
                                                    the router writes it there for its workers)
    {"type": "ephemeral", "ttl": "1h"}              a `cache_control` object as Anthropic's API spells
                                                    it; ttl: seconds, or "<n>s" / "<n>m" / "<n>h";
                                                    without a ttl, 5 minutes (Anthropic's default)

Every parser here raises ValueError with a message for the client; what to do with it (a 400 at the
router, a counted warning in an engine, which must never fail a request over a hint) is the caller's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

RETAIN_PARAM = "kvcache_retain_ttl_s"
"""The kv_transfer_params key of a retention hint, in seconds."""

CACHE_CONTROL_PARAM = "cache_control"
"""The kv_transfer_params (and request body) key of an Anthropic-style cache_control object."""

DEFAULT_CACHE_CONTROL_TTL_S = 300.0
"""An ephemeral cache_control without a ttl: Anthropic's default of five minutes."""

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl_s(value: Any, *, what: str = RETAIN_PARAM) -> float:
    """A TTL in seconds: a positive, finite number, or a string "<n>", "<n>s", "<n>m" or "<n>h".

    Raises:
        ValueError: anything else (a bool, zero, a negative, NaN, infinity, another unit).
    """
    if isinstance(value, str):
        m = _DURATION.fullmatch(value)
        if m is None:
            raise ValueError(f"{what} must be seconds or a duration like '300s', '5m' or '1h', got {value!r}")
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return seconds


def cache_control_ttl_s(value: Any, *, what: str = CACHE_CONTROL_PARAM) -> float:
    """The TTL an Anthropic-style cache_control object asks for: {"type": "ephemeral"[, "ttl": ...]}.

    Raises:
        ValueError: not an object, a type other than "ephemeral", or a bad ttl.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f'{what} must be an object like {{"type": "ephemeral", "ttl": "5m"}}')
    if value.get("type") != "ephemeral":
        raise ValueError(f'{what}.type must be "ephemeral", got {value.get("type")!r}')
    if value.get("ttl") is None:
        return DEFAULT_CACHE_CONTROL_TTL_S
    return parse_ttl_s(value["ttl"], what=f"{what}.ttl")


def transfer_params_ttl_s(params: Any) -> float | None:
    """The retention a request's kv_transfer_params ask for: RETAIN_PARAM, else a cache_control object;
    None when they ask for none.

    Raises:
        ValueError: a hint that is there and malformed.
    """
    if not isinstance(params, Mapping):
        return None
    if params.get(RETAIN_PARAM) is not None:
        return parse_ttl_s(params[RETAIN_PARAM])
    if params.get(CACHE_CONTROL_PARAM) is not None:
        return cache_control_ttl_s(params[CACHE_CONTROL_PARAM], what=f"kv_transfer_params.{CACHE_CONTROL_PARAM}")
    return None
