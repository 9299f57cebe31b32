"""The connector's parts on their own: configuration, namespace facts, request facts, breaker, stats, metadata."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from kvcache_connectors.vllm import (
    ChunkRef,
    KVCacheConnector,
    KVCacheConnectorConfig,
    KVCacheConnectorMetadata,
    KVCacheConnectorStats,
    RequestTransfer,
)
from kvcache_connectors.vllm.namespaces import KVFacts, kv_groups
from kvcache_connectors.vllm.scheduler import request_extra
from kvcache_connectors.vllm.stats import Counters
from kvcache_core.breaker import BreakerState, CircuitBreaker
from kvcache_core.keys import HEADS_LAYOUT_VERSION, MLA_LAYOUT, Namespace, head_block_key
from tests.vllm.harness import (
    BLOCK,
    HEAD,
    LAYER_NAMES,
    attention_spec,
    expected_namespace,
    make_kv_cache_config,
    make_vllm_config,
    make_worker,
)

pytestmark = pytest.mark.timeout(30)


# -- configuration -----------------------------------------------------------------------------


def test_defaults() -> None:
    config = KVCacheConnectorConfig.from_extra_config({}, block_size=16)
    assert config == KVCacheConnectorConfig(
        target="127.0.0.1:51051",
        lookup_timeout_s=0.5,
        transfer_timeout_s=30.0,
        breaker_cooldown_s=5.0,
        chunk_tokens=256,
        model_id=None,
        model_revision=None,
        namespace_extra=(),
        save_partial_chunks=True,
    )
    # The default chunk is the smallest multiple of the block size of at least 256 tokens.
    assert KVCacheConnectorConfig.from_extra_config({}, block_size=48).chunk_tokens == 288
    assert KVCacheConnectorConfig.from_extra_config({}, block_size=512).chunk_tokens == 512


def test_every_key_is_parsed() -> None:
    extra = {
        "target": "kvcache.internal:7000",
        "lookup_timeout_s": 0.25,
        "transfer_timeout_s": 10,
        "breaker_cooldown_s": 1.5,
        "chunk_tokens": 64,
        "model_id": "meta-llama/Llama-3.1-8B",
        "model_revision": "",
        "namespace_extra": {"deployment": "blue", "a": "b"},
        "save_partial_chunks": False,
        "token_env": "MY_KVCACHE_TOKEN",
        "token": "kvc_inline",
        "tls": True,
        "tls_ca_file": "/etc/kvcache/ca.crt",
        "tls_cert_file": "/etc/kvcache/client.crt",
        "tls_key_file": "/etc/kvcache/client.key",
        "shm": False,
        "save_queue_steps": 2,
        "staging_bytes": 1 << 20,
        "write_back": True,
        "handoff_timeout_s": 2.5,
        "kv_heads_per_block": 2,
        "retain_ttl_s": 600,
        "max_retain_ttl_s": 1800,
    }
    config = KVCacheConnectorConfig.from_extra_config(extra, block_size=16)
    assert (config.retain_ttl_s, config.max_retain_ttl_s) == (600, 1800)
    assert "kvc_inline" not in repr(config) and config.shm is False
    assert config.namespace_extra == (("a", "b"), ("deployment", "blue"))
    assert (config.transfer_timeout_s, config.chunk_tokens, config.model_revision) == (10.0, 64, "")
    assert dataclasses.asdict(config).keys() == extra.keys()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"taget": "x:1"}, r"unknown key\(s\) \['taget'\]"),
        ({"kv_heads_per_block": 0}, r"\['kv_heads_per_block'\] must be positive"),
        ({"chunk_tokens": 100}, r"\['chunk_tokens'\] = 100 must be a multiple of vLLM's block size 16"),
        ({"chunk_tokens": 0}, r"\['chunk_tokens'\] must be positive"),
        ({"chunk_tokens": 64.0}, r"\['chunk_tokens'\] must be an integer"),
        ({"lookup_timeout_s": 0}, r"\['lookup_timeout_s'\] must be a positive number of seconds"),
        ({"transfer_timeout_s": float("inf")}, r"\['transfer_timeout_s'\] must be a positive number"),
        ({"breaker_cooldown_s": True}, r"\['breaker_cooldown_s'\] must be a number, got bool"),
        ({"lookup_timeout_s": "1"}, r"\['lookup_timeout_s'\] must be a number, got str"),
        ({"target": ""}, r"\['target'\] must not be empty"),
        ({"target": 51051}, r"\['target'\] must be a string"),
        ({"model_id": ""}, r"\['model_id'\] must not be empty"),
        ({"save_partial_chunks": "no"}, r"\['save_partial_chunks'\] must be true or false"),
        ({"namespace_extra": ["a"]}, r"\['namespace_extra'\] must be an object of strings"),
        ({"namespace_extra": {"a": 1}}, r"\['namespace_extra'\] must map strings to strings"),
        ({"namespace_extra": {"vllm.lora": "x"}}, r"keys starting with 'vllm\.' are reserved"),
    ],
)
def test_bad_values_are_refused_naming_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConnectorConfig.from_extra_config(extra, block_size=16)


def test_the_connector_presents_its_token(make_server, tmp_path, monkeypatch) -> None:
    from kvcache_client import Unauthenticated
    from kvcache_connectors.vllm.connector import connect
    from kvcache_server.auth import token_digest

    tokens = tmp_path / "tokens.toml"
    digest = token_digest("kvc_vllm").hex()
    tokens.write_text(f'[[tokens]]\ntenant = "llm"\nsha256 = "{digest}"\nrights = ["read", "write"]\n')
    server = make_server(auth={"enabled": True, "tokens_file": str(tokens)})
    key = [bytes(16)]
    monkeypatch.delenv("KVCACHE_TOKEN", raising=False)
    with pytest.raises(Unauthenticated):
        connect(KVCacheConnectorConfig.from_extra_config({"target": server.target}, block_size=16)).lookup("n", key)
    inline = {"target": server.target, "token": "kvc_vllm"}
    assert connect(KVCacheConnectorConfig.from_extra_config(inline, block_size=16)).lookup("n", key).prefix_length == 0
    monkeypatch.setenv("VLLM_KV_TOKEN", "kvc_vllm")
    from_env = {"target": server.target, "token_env": "VLLM_KV_TOKEN"}
    assert (
        connect(KVCacheConnectorConfig.from_extra_config(from_env, block_size=16)).lookup("n", key).prefix_length == 0
    )


def test_vllm_refuses_to_start_with_a_bad_config(model_dir: str) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        make_worker(make_vllm_config(model_dir, extra={"chunk_tokens": 24}), make_kv_cache_config(8))


# -- namespace facts ---------------------------------------------------------------------------


def facts(model_dir: str, kv_cache_config: KVCacheConfig | None = None, **extra: Any) -> KVFacts:
    vllm_config = make_vllm_config(model_dir, extra=extra)
    config = KVCacheConnectorConfig.from_extra_config(
        vllm_config.kv_transfer_config.kv_connector_extra_config, block_size=BLOCK
    )
    return KVFacts.from_vllm(vllm_config, kv_cache_config or make_kv_cache_config(8), config)


def test_namespace_comes_from_vllm_configs_and_the_overrides(model_dir: str) -> None:
    (default,) = facts(model_dir).namespaces()
    assert default == expected_namespace(model_dir)

    named = facts(model_dir, model_id="org/tiny", model_revision="abc123", namespace_extra={"deployment": "blue"})
    (namespace,) = named.namespaces("salt", (("vllm.lora", "sql"),))
    assert namespace == Namespace(
        model_id="org/tiny",
        model_revision="abc123",
        kv_dtype="float16",
        chunk_tokens=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=HEAD,
        cache_salt="salt",
        layout_version=HEADS_LAYOUT_VERSION,
        extra={"deployment": "blue", "vllm.lora": "sql"},
    )


def test_fp8_cache_dtype_is_part_of_the_namespace(model_dir: str) -> None:
    vllm_config = make_vllm_config(model_dir)
    vllm_config.cache_config.cache_dtype = "fp8_e4m3"
    spec = dataclasses.replace(attention_spec(), dtype=torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    config = KVCacheConnectorConfig.from_extra_config({"chunk_tokens": 32}, block_size=BLOCK)
    (namespace,) = KVFacts.from_vllm(vllm_config, make_kv_cache_config(8, spec), config).namespaces()
    assert (namespace.kv_dtype, dict(namespace.extra)) == ("uint8", {"vllm.cache_dtype": "fp8_e4m3"})


def test_mla_caches_use_the_mla_layout_and_replicas_share_one_shard(model_dir: str) -> None:
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv_cache_config = make_kv_cache_config(8, spec)
    kv_cache_config.kv_tp_replicas = 4
    vllm_config = make_vllm_config(model_dir, tp_size=4)
    config = KVCacheConnectorConfig.from_extra_config({"chunk_tokens": 32}, block_size=BLOCK)
    mla = KVFacts.from_vllm(vllm_config, kv_cache_config, config)
    (namespace,) = mla.namespaces()
    assert (namespace.layout, namespace.tp_size, namespace.tp_rank, namespace.head_size) == (MLA_LAYOUT, 1, 0, 576)
    assert [mla.shard_of(r) for r in range(4)] == [0, 0, 0, 0]
    assert [mla.is_writer(r) for r in range(4)] == [True, False, False, False]
    assert mla.chunk_shape(7) == (2, 7, 576)


def test_tensor_parallel_ranks_share_one_head_sharded_namespace(model_dir: str) -> None:
    kv_cache_config = make_kv_cache_config(8, attention_spec(num_kv_heads=2))
    vllm_config = make_vllm_config(model_dir, tp_size=4)
    config = KVCacheConnectorConfig.from_extra_config({"chunk_tokens": 32, "kv_heads_per_block": 1}, block_size=BLOCK)
    sharded = KVFacts.from_vllm(vllm_config, kv_cache_config, config)  # 8 KV heads over 4 ranks, 2 each
    (namespace,) = sharded.namespaces()
    assert (namespace.tp_size, namespace.tp_rank, namespace.num_kv_heads) == (1, 0, 8)
    assert namespace.layout_version == HEADS_LAYOUT_VERSION
    assert [sharded.units(r, 1) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    key = b"k" * 16
    blocks = sharded.unit_keys((key,), 1)
    assert blocks == tuple(head_block_key(key, h, 1, 8) for h in range(8)) and len(set(blocks)) == 8
    assert sharded.chunk_shape(5, heads=1) == (2, 2, 1, 5, HEAD)
    # Without kv_heads_per_block a rank's heads are one block, and a TP=1 chunk is the chunk key itself.
    assert KVFacts.from_vllm(vllm_config, kv_cache_config, dataclasses.replace(config, kv_heads_per_block=None)).units(
        3, None
    ) == range(3, 4)
    assert head_block_key(key, 0, 8, 8) == key

    kv_cache_config = make_kv_cache_config(8, attention_spec(num_kv_heads=1))
    kv_cache_config.kv_tp_replicas = 2  # 2 KV heads over 4 ranks: ranks 0,1 hold head 0, ranks 2,3 head 1
    replicated = KVFacts.from_vllm(vllm_config, kv_cache_config, config)
    assert [replicated.shard_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [replicated.is_writer(r) for r in range(4)] == [True, False, True, False]
    assert replicated.namespaces()[0].num_kv_heads == 2

    with pytest.raises(ValueError, match=r"'kv_heads_per_block'\] = 3 must divide the 2 KV heads of one rank"):
        KVFacts.from_vllm(vllm_config, make_kv_cache_config(8), dataclasses.replace(config, kv_heads_per_block=3))


@pytest.mark.parametrize(
    ("kv_cache_config", "message"),
    [
        (
            KVCacheConfig(
                8,
                [],
                [
                    KVCacheGroupSpec([LAYER_NAMES[0]], attention_spec()),
                    KVCacheGroupSpec(
                        [LAYER_NAMES[1]], MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float16,))
                    ),
                ],
            ),
            r"KV-cache group 1 \(MambaSpec, layers \['model.layers.1.self_attn.attn'\]\): "
            "a recurrent-state \\(Mamba-style\\) group",
        ),
        (
            KVCacheConfig(
                8,
                [],
                [
                    KVCacheGroupSpec([LAYER_NAMES[0]], attention_spec()),
                    KVCacheGroupSpec(
                        [LAYER_NAMES[1]],
                        ChunkedLocalAttentionSpec(
                            block_size=BLOCK,
                            num_kv_heads=2,
                            head_size=HEAD,
                            dtype=torch.float16,
                            attention_chunk_size=64,
                        ),
                    ),
                ],
            ),
            "KV-cache group 1 \\(ChunkedLocalAttentionSpec",
        ),
        (
            KVCacheConfig(
                8,
                [],
                [
                    KVCacheGroupSpec(
                        list(LAYER_NAMES),
                        SlidingWindowMLASpec(
                            block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=64
                        ),
                    )
                ],
            ),
            "KV-cache group 0 \\(SlidingWindowMLASpec",
        ),
        (
            KVCacheConfig(
                8,
                [],
                [
                    KVCacheGroupSpec([LAYER_NAMES[0]], attention_spec()),
                    KVCacheGroupSpec(
                        [LAYER_NAMES[1]],
                        SlidingWindowSpec(
                            block_size=2 * BLOCK, num_kv_heads=2, head_size=HEAD, dtype=torch.float16, sliding_window=64
                        ),
                    ),
                ],
            ),
            r"one block size across KV-cache groups, got \[16, 32\]",
        ),
        (
            make_kv_cache_config(
                8, dataclasses.replace(attention_spec(), kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)
            ),
            "quantization mode FP8_PER_TOKEN_HEAD",
        ),
        (
            make_kv_cache_config(8, dataclasses.replace(attention_spec(), head_size_v=8)),
            "equal K and V head sizes",
        ),
    ],
    ids=[
        "mamba-group",
        "chunked-local-group",
        "sliding-window-mla",
        "mixed-block-sizes",
        "per-token-quant",
        "unequal-v-head",
    ],
)
def test_setups_the_connector_cannot_serve_are_refused(model_dir: str, kv_cache_config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_worker(make_vllm_config(model_dir), kv_cache_config)


# -- request facts -----------------------------------------------------------------------------


def request(**kwargs: Any) -> Request:
    return Request(request_id="r", sampling_params=SamplingParams(max_tokens=1), pooling_params=None, **kwargs)


def test_request_facts_separate_lora_adapters_and_multimodal_inputs() -> None:
    assert request_extra(request(prompt_token_ids=[1, 2, 3])) == ()
    lora = LoRARequest(lora_name="sql-adapter", lora_int_id=1, lora_path="/adapters/sql")
    assert request_extra(request(prompt_token_ids=[1, 2, 3], lora_request=lora)) == (
        ("vllm.lora", "sql-adapter@/adapters/sql"),  # the weights' path too: one name, two paths never share
    )
    images = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=name, mm_position=PlaceholderRange(offset, 4))
        for name, offset in (("img-a", 2), ("img-b", 9))
    ]
    assert request_extra(request(prompt_token_ids=list(range(20)), mm_features=images)) == (
        ("vllm.mm", "img-a@2;img-b@9"),
    )
    # Prompt embeddings: the KV is not a function of token ids, so nothing is looked up or saved.
    assert request_extra(request(prompt_token_ids=None, prompt_embeds=torch.zeros(3, 8))) is None


# -- breaker, stats, metadata ------------------------------------------------------------------


def test_breaker_opens_on_a_failure_and_probes_once_per_cooldown() -> None:
    now = [100.0]
    breaker = CircuitBreaker(failure_threshold=1, reset_s=2.0, max_reset_s=2.0, clock=lambda: now[0])
    assert breaker.allow()
    assert breaker.failure() is True  # opened: the caller logs once
    assert not breaker.allow()
    now[0] += 1.9
    assert not breaker.allow()
    now[0] += 0.2
    assert breaker.allow() and breaker.state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # one probe at a time
    assert breaker.failure() is False  # still down: no second log line
    now[0] += 2.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    with pytest.raises(ValueError):
        CircuitBreaker(0)


def test_counters_drain_to_plain_data_and_stats_aggregate_as_vllm_does() -> None:
    counters = Counters()
    assert counters.drain() is None
    counters.lookups, counters.lookup_tokens, counters.hit_tokens = 2, 200, 150
    assert counters.drain() == {"lookups": 2, "lookup_tokens": 200, "hit_tokens": 150}
    assert counters.drain() is None

    worker = KVCacheConnector.build_kv_connector_stats({"load_chunks": 3, "load_bytes": 4_000_000, "load_s": 0.002})
    other = KVCacheConnector.build_kv_connector_stats({"load_chunks": 1, "load_bytes": 1_000_000, "load_s": 0.003})
    scheduler = KVCacheConnector.build_kv_connector_stats({"lookups": 2, "lookup_tokens": 200, "hit_tokens": 150})
    total = worker.aggregate(other).aggregate(scheduler)
    assert isinstance(total, KVCacheConnectorStats)
    assert total.reduce() == {
        "load_chunks": 4,
        "load_bytes": 5_000_000,
        "load_s": 0.005,
        "lookups": 2,
        "lookup_tokens": 200,
        "hit_tokens": 150,
        "hit_rate": 0.75,
        "load_MBps": 1000.0,
    }
    assert not total.is_empty() and KVCacheConnector.build_kv_connector_stats().is_empty()
    total.reset()
    assert total.is_empty()


def test_metadata_survives_pickling_as_vllm_ships_it_to_workers() -> None:
    chunk = ChunkRef(index=1, keys=(b"k" * 16, b"K" * 16), num_tokens=32, start=40, end=64)
    meta = KVCacheConnectorMetadata(
        loads=(RequestTransfer("r1", ("ns0", "ns1"), (4, 5, 6, 7), (chunk,)),),
        saves=(RequestTransfer("r2", ("ns0", "ns1"), (1, 2), (dataclasses.replace(chunk, index=0, start=0, end=32),)),),
    )
    copy = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == meta
    assert (copy.loads[0].start, copy.loads[0].end) == (40, 64)


def test_a_sliding_window_group_needs_only_the_blocks_vllm_keeps_below_a_hit(model_dir: str) -> None:
    spec = SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=2,
        head_size=HEAD,
        dtype=torch.float16,
        sliding_window=40,
        extra_retained_tokens=3,
    )
    config = KVCacheConnectorConfig.from_extra_config({"chunk_tokens": 32}, block_size=BLOCK)
    (sliding,) = kv_groups(make_vllm_config(model_dir), make_kv_cache_config(8, spec), config)
    (namespace,) = sliding.namespaces()
    # A lone sliding-window group (Mistral under vLLM's hybrid allocator) still records its spec.
    assert dict(namespace.extra)["vllm.kv_group"] == "sliding_window:40" and namespace.num_layers == 2
    assert (sliding.sliding, sliding.retained_tokens) == (True, 40 - 1 + 3)
    # vLLM skips the tokens below hit - 42 (SlidingWindowManager.get_num_skipped_tokens) and frees the
    # blocks wholly among them: the first block needed starts at a block boundary at or below hit - 42.
    assert [sliding.needed_from(hit) for hit in (0, 42, 57, 58, 100)] == [0, 0, 0, 16, 48]
    (full,) = kv_groups(make_vllm_config(model_dir), make_kv_cache_config(8), config)
    assert not full.sliding and full.needed_from(1000) == 0
    assert "vllm.kv_group" not in dict(full.namespaces()[0].extra)  # one full group: the namespace it always had
