"""Retention hints through vLLM's real Scheduler: a request's kv_transfer_params (kvcache_retain_ttl_s, or a
cache_control object) or the connector's retain_ttl_s setting make its saves retained puts, checked in the
Stats of a real `python -m kvcache_server` process (docs/vllm.md, "Sessions that stay").

Prompts are 100 tokens: with chunk_tokens 32, four chunks (three full, a 4-token tail), each one block at
TP 1 (a block of all KV heads is stored under the chunk's own key).
"""

from __future__ import annotations

import logging
import math
import subprocess

import pytest

from kvcache_client import KVCacheClient, chunk_keys
from kvcache_connectors.vllm import KVCacheConnectorConfig, KVCacheConnectorMetadata
from tests.vllm.harness import Engine, expected_namespace, make_engine

pytestmark = pytest.mark.timeout(90)

PROMPT = list(range(10, 110))
OTHER = list(range(300, 400))
CHUNKS = 4

Server = tuple[subprocess.Popen[bytes], str]


def ram_retained(target: str) -> int:
    with KVCacheClient(target, timeout_s=5) as client:
        return client.stats().tier("ram").retained_blocks


def saved_ttls(engine: Engine) -> dict[str, set[float]]:
    """Request id -> the retain_ttl_s of every save the scheduler planned for it."""
    out: dict[str, set[float]] = {}
    for step in engine.steps:
        meta = step.output.kv_connector_metadata
        assert isinstance(meta, KVCacheConnectorMetadata)
        for save in meta.saves:
            out.setdefault(save.request_id, set()).add(save.retain_ttl_s)
    return out


def test_a_hinted_request_stores_its_chunks_retained_and_a_plain_one_does_not(
    model_dir: str, server_process: Server
) -> None:
    _, target = server_process
    engine = make_engine(model_dir, extra={"target": target})
    engine.add("plain", OTHER)
    engine.run()
    assert ram_retained(target) == 0  # stored, not retained
    engine.add("session", PROMPT, kv_transfer_params={"kvcache_retain_ttl_s": 600})
    engine.run()

    assert ram_retained(target) == CHUNKS  # the session's four blocks, and only those
    namespace = expected_namespace(model_dir)
    with KVCacheClient(target, timeout_s=5) as client:
        for tokens in (PROMPT, OTHER):
            assert client.lookup(namespace, chunk_keys(tokens, namespace)).prefix_length == CHUNKS
    assert saved_ttls(engine) == {"plain": {0.0}, "session": {600.0}}
    stats = engine.stats.data
    assert stats["save_chunks"] == 2 * CHUNKS and stats["save_retained_chunks"] == CHUNKS
    assert stats.get("retain_hints_ignored", 0) == 0


def test_cache_control_and_the_default_setting_retain_capped_at_the_maximum(
    model_dir: str, server_process: Server
) -> None:
    _, target = server_process
    extra = {"target": target, "retain_ttl_s": 60, "max_retain_ttl_s": 900}
    engine = make_engine(model_dir, extra=extra, max_num_batched_tokens=512)
    engine.add("default", PROMPT)  # no hint: the connector's retain_ttl_s
    engine.add("anthropic", OTHER, kv_transfer_params={"cache_control": {"type": "ephemeral", "ttl": "1h"}})
    engine.add("short", list(range(500, 600)), kv_transfer_params={"cache_control": {"type": "ephemeral"}})
    engine.add("long", list(range(600, 700)), kv_transfer_params={"kvcache_retain_ttl_s": 86400})
    engine.run()

    assert saved_ttls(engine) == {"default": {60.0}, "anthropic": {900.0}, "short": {300.0}, "long": {900.0}}
    assert ram_retained(target) == 4 * CHUNKS
    assert engine.stats.data["save_retained_chunks"] == 4 * CHUNKS


@pytest.mark.parametrize(
    "hint",
    [
        {"kvcache_retain_ttl_s": -5},
        {"kvcache_retain_ttl_s": 0},
        {"kvcache_retain_ttl_s": math.nan},
        {"kvcache_retain_ttl_s": "forever"},
        {"kvcache_retain_ttl_s": True},
        {"cache_control": {"type": "persistent"}},
        {"cache_control": "ephemeral"},
        {"cache_control": {"type": "ephemeral", "ttl": "1d"}},
    ],
    ids=["negative", "zero", "nan", "word", "bool", "type", "not-object", "unit"],
)
def test_a_bad_hint_is_ignored_counted_and_the_request_served(
    model_dir: str, server_process: Server, hint: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    _, target = server_process
    engine = make_engine(model_dir, extra={"target": target})
    engine.add("bad", PROMPT, kv_transfer_params=hint)
    with caplog.at_level(logging.WARNING, logger="kvcache_connectors.vllm.scheduler"):
        engine.run()

    assert engine.computed_positions("bad") == list(range(100))  # served whole
    assert engine.stats.data["retain_hints_ignored"] == 1
    assert engine.stats.data["save_chunks"] == CHUNKS  # stored as if it had asked for nothing
    assert engine.stats.data.get("save_retained_chunks", 0) == 0
    assert ram_retained(target) == 0
    assert any("retention hint ignored" in r.getMessage() and "bad" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(10)
def test_retention_settings_are_checked_at_start_up() -> None:
    parse = KVCacheConnectorConfig.from_extra_config
    assert parse({}, block_size=16).retain_ttl_s is None
    assert parse({"retain_ttl_s": 600}, block_size=16).retain_ttl_s == 600.0
    for bad, message in (
        ({"retain_ttl_s": 0}, "retain_ttl_s"),
        ({"retain_ttl_s": "1h"}, "retain_ttl_s"),
        ({"max_retain_ttl_s": -1}, "max_retain_ttl_s"),
        ({"retain_ttl_s": 7200}, "exceeds"),  # above the default max_retain_ttl_s of 3600
    ):
        with pytest.raises(ValueError, match=message):
            parse(bad, block_size=16)
