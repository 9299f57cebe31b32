"""Sessions that stay, at the router: a client's retention hint passed to the workers, and a prefetch
after each turn (docs/router.md, "Sessions").

    a client's hint        body["kvcache"] = {"retain_ttl_s": 600}          the router's own spelling
                           body["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
                           a message's, or a content part's, cache_control  (Anthropic's spelling)
      -> validated (400 invalid_retention_hint otherwise), cut to kvcache.max_retain_ttl_s, and written
         into the kv_transfer_params of the prefill and the decode call as kvcache_retain_ttl_s, the key
         the vLLM connector reads (docs/vllm.md, "Sessions that stay")

    a turn answered whole  -> TurnPrefetcher.after_turn: one Prefetch of the prompt's blocks, in the
                              background, after the answer's last byte went out

The prefetch never delays an answer and never fails one: it starts once the answer is written; it
has a deadline (kvcache.prefetch_timeout_s), names at most kvcache.prefetch_max_keys blocks (the
prompt's first), and at most kvcache.max_concurrent_prefetches run at once (more are dropped). Every
outcome is counted in kvcache_router_prefetches_total.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from kvcache_client import KVCacheError
from kvcache_core.hints import RETAIN_PARAM, cache_control_ttl_s, parse_ttl_s
from kvcache_router.errors import RouterError
from kvcache_router.metrics import RouterMetrics
from kvcache_router.prefix import PrefixOracle

log = logging.getLogger(__name__)

HINT_FIELD = "kvcache"
"""The request body's object of the router's own session settings: {"retain_ttl_s": ...}."""

_HINT_KEYS = frozenset({"retain_ttl_s"})


def _invalid(message: str, param: str) -> RouterError:
    return RouterError(400, message, code="invalid_retention_hint", param=param)


def _cache_control_ttl(value: Any, param: str) -> float:
    try:
        return cache_control_ttl_s(value, what=param)
    except ValueError as exc:
        raise _invalid(str(exc), param) from None


def retention_hint(body: dict[str, Any], *, max_ttl_s: float) -> tuple[dict[str, Any], float | None]:
    """The retention a completion's body asks for, and the body without the router's own fields.

    `kvcache.retain_ttl_s` wins; else the longest TTL that a cache_control asks for, on the request or on
    any of its messages and their content parts (a conversation marked anywhere is kept as long as its
    longest mark). The TTL is cut to `max_ttl_s`. `kvcache` and a top-level `cache_control` are taken
    out of the body (the workers would log them as unknown fields); the messages are left as they are.

    Raises:
        RouterError: 400 invalid_retention_hint, naming the field at fault.
    """
    ttls: list[float] = []
    if HINT_FIELD in body:
        hint = body[HINT_FIELD]
        if not isinstance(hint, dict):
            raise _invalid(f'{HINT_FIELD} must be an object like {{"retain_ttl_s": 600}}', HINT_FIELD)
        unknown = sorted(set(hint) - _HINT_KEYS)
        if unknown:
            raise _invalid(f"{HINT_FIELD}: unknown field(s) {unknown}; known: {sorted(_HINT_KEYS)}", HINT_FIELD)
        if hint.get("retain_ttl_s") is not None:
            param = f"{HINT_FIELD}.retain_ttl_s"
            try:
                ttls.append(parse_ttl_s(hint["retain_ttl_s"], what=param))
            except ValueError as exc:
                raise _invalid(str(exc), param) from None
    if not ttls:
        if body.get("cache_control") is not None:
            ttls.append(_cache_control_ttl(body["cache_control"], "cache_control"))
        messages = body.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            if not isinstance(message, dict):
                continue
            if message.get("cache_control") is not None:
                ttls.append(_cache_control_ttl(message["cache_control"], f"messages[{i}].cache_control"))
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("cache_control") is not None:
                    param = f"messages[{i}].content[{j}].cache_control"
                    ttls.append(_cache_control_ttl(part["cache_control"], param))
    stripped = {k: v for k, v in body.items() if k not in (HINT_FIELD, "cache_control")}
    return stripped, (min(max(ttls), max_ttl_s) if ttls else None)


def with_retention(params: Any, ttl_s: float | None) -> Any:
    """kv_transfer_params with the retention hint added (params as they are when there is none)."""
    if ttl_s is None:
        return params
    return {**(params if isinstance(params, dict) else {}), RETAIN_PARAM: ttl_s}


class TurnPrefetcher:
    """Prefetches of finished turns' prompts, in background tasks of bounded number and duration.

    Args:
        oracle: Keys the prompt in the workers' namespace; its client makes the call.
        metrics: Where outcomes are counted.
        timeout_s: One prefetch's deadline.
        max_keys: Blocks one prefetch names at most (the prompt's first).
        max_in_flight: Prefetches running at once; one more is dropped.
    """

    def __init__(
        self,
        oracle: PrefixOracle,
        metrics: RouterMetrics,
        *,
        timeout_s: float,
        max_keys: int,
        max_in_flight: int,
    ) -> None:
        self._oracle = oracle
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._max_keys = max_keys
        self._max_in_flight = max_in_flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure_logged = False

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def after_turn(self, tokens: Sequence[int], cache_salt: str = "") -> None:
        """Starts the prefetch of a finished turn's prompt; returns at once."""
        if len(self._tasks) >= self._max_in_flight:
            self._metrics.prefetches.labels("dropped").inc()
            return
        task = asyncio.create_task(self._prefetch(tokens, cache_salt), name="kvcache-prefetch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancels the prefetches still running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _prefetch(self, tokens: Sequence[int], cache_salt: str) -> None:
        blocks = self._oracle.prefix_blocks(tokens, cache_salt=cache_salt)
        if blocks is None:  # no namespace known yet
            self._metrics.prefetches.labels("skipped").inc()
            return
        namespace, keys = blocks
        keys = keys[: self._max_keys]
        try:
            async with asyncio.timeout(self._timeout_s):
                result = await self._oracle.client.prefetch(namespace, keys, timeout_s=self._timeout_s)
        except (KVCacheError, TimeoutError, ValueError) as exc:
            self._metrics.prefetches.labels("failed").inc()
            # Once at warning level: a kvcache server that is down would fail every turn's.
            level = logging.DEBUG if self._failure_logged else logging.WARNING
            self._failure_logged = True
            log.log(level, "kvcache prefetch after a turn failed: %s", exc)
            return
        self._metrics.prefetches.labels("sent").inc()
        for answer in ("in_ram", "queued", "unknown", "dropped"):
            self._metrics.prefetch_keys.labels(answer).inc(getattr(result, answer))
