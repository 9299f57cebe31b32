"""kvcache-router's configuration: TOML, environment and flags, as strict as the server's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvcache_core.keys import HEADS_LAYOUT_VERSION, Namespace, chunk_keys, head_block_key
from kvcache_router.cli import overrides, parse_args
from kvcache_router.config import ConfigError, load_config
from kvcache_server.config import load_config as load_server_config

pytestmark = pytest.mark.timeout(30)

DECODE = {"workers": {"decode": "http://127.0.0.1:8200"}}


def test_defaults_need_a_decode_worker() -> None:
    with pytest.raises(ConfigError, match=r"workers.decode needs at least one URL"):
        load_config(env={})
    cfg = load_config(env={}, overrides=DECODE)
    assert cfg.workers.decode == ("http://127.0.0.1:8200",) and cfg.workers.prefill == ()
    assert (cfg.http.host, cfg.http.port, cfg.http.max_body_bytes) == ("127.0.0.1", 8000, 8 << 20)
    assert cfg.kvcache.target == ""
    h = cfg.http
    assert (h.body_timeout_s, h.max_concurrent_bodies, h.max_json_depth) == (10.0, 64, 64)
    assert h.max_json_containers == 100_000 and h.allow_client_kv_transfer_params is False


def test_the_intake_settings_from_the_environment() -> None:
    env = {
        "KVCACHE_ROUTER_HTTP_BODY_TIMEOUT_S": "2.5",
        "KVCACHE_ROUTER_HTTP_MAX_CONCURRENT_BODIES": "16",
        "KVCACHE_ROUTER_HTTP_MAX_JSON_DEPTH": "32",
        "KVCACHE_ROUTER_HTTP_ALLOW_CLIENT_KV_TRANSFER_PARAMS": "true",
    }
    h = load_config(env=env, overrides=DECODE).http
    assert (h.body_timeout_s, h.max_concurrent_bodies, h.max_json_depth) == (2.5, 16, 32)
    assert h.allow_client_kv_transfer_params is True


def test_toml_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        '[http]\nport = 9000\nmax_body_bytes = "1MiB"\n'
        '[workers]\nprefill = ["http://p1:8000", "http://p2:8000"]\ndecode = ["http://d:8000"]\n'
        '[kvcache]\ntarget = "kvcache:51051"\n'
    )
    env = {"KVCACHE_ROUTER_HTTP_PORT": "9100", "KVCACHE_ROUTER_WORKERS_DECODE": "http://d1:8000, http://d2:8000"}
    args = parse_args(["--port", "9200", "--prefill", "http://p3:8000", "--set", "workers.prefill_attempts=3"])
    cfg = load_config(path=path, env=env, overrides=overrides(args))
    assert cfg.http.port == 9200 and cfg.http.max_body_bytes == 1 << 20
    assert cfg.workers.prefill == ("http://p3:8000",) and cfg.workers.decode == ("http://d1:8000", "http://d2:8000")
    assert cfg.workers.prefill_attempts == 3 and cfg.kvcache.target == "kvcache:51051"
    assert load_config(env={"KVCACHE_ROUTER_CONFIG": str(path)}).http.port == 9000


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"htp": {"port": 1}}, r"unknown section \[htp\]"),
        ({"http": {"prot": 1}}, "unknown field http.prot"),
        ({"http": {"port": "eighty"}}, "http.port: 'eighty' is not a valid int"),
        ({"http": {"port": 70000}}, r"http.port must be in \[0, 65535\]"),
        ({"workers": {"decode": "d:8000"}}, "is not a base URL"),
        ({"workers": {"decode": "http://d:8000/v1"}}, "is not a base URL"),
        ({"workers": {"prefill_timeout_s": 0}}, "workers.prefill_timeout_s must be positive"),
        ({"http": {"body_timeout_s": 0}}, "http.body_timeout_s must be positive"),
        ({"http": {"max_concurrent_bodies": 0}}, "http.max_concurrent_bodies must be positive"),
        ({"http": {"max_json_containers": 0}}, "http.max_json_containers must be positive"),
        ({"http": {"max_json_depth": 0}}, r"http.max_json_depth must be in \[1, 512\], got 0"),
        ({"http": {"max_json_depth": 513}}, r"http.max_json_depth must be in \[1, 512\], got 513"),
        ({"http": {"allow_client_kv_transfer_params": "maybe"}}, "is not a boolean"),
        ({"kvcache": {"namespace_source": "guess"}}, "kvcache.namespace_source must be one of"),
        ({"kvcache": {"target": "k:1", "namespace_source": "config"}}, r"\[namespace\]: Namespace.model_id"),
    ],
)
def test_bad_settings_are_named(updates: dict, message: str) -> None:
    merged = {**DECODE, **updates}
    if "workers" in updates:
        merged["workers"] = {**DECODE["workers"], **updates["workers"]}
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=merged)


def test_unknown_router_variable_is_an_error_with_a_hint() -> None:
    with pytest.raises(ConfigError, match="did you mean KVCACHE_ROUTER_HTTP_PORT"):
        load_config(env={"KVCACHE_ROUTER_HTTP_PROT": "1"}, overrides=DECODE)


def test_server_and_router_variables_live_side_by_side() -> None:
    """One environment (a shell, a .env file) may hold both; each program checks only its own."""
    env = {"KVCACHE_ROUTER_HTTP_PORT": "9000", "KVCACHE_SERVER_PORT": "51052", "KVCACHE_TOKEN": "t"}
    assert load_server_config(env=env).server.port == 51052
    assert load_config(env=env, overrides=DECODE).http.port == 9000
    with pytest.raises(ConfigError, match="unknown variable KVCACHE_ROUTERX"):
        load_server_config(env={"KVCACHE_ROUTERX": "1"})


def test_namespace_from_config_is_the_connectors_namespace() -> None:
    fields = {
        "model_id": "/models/model",
        "kv_dtype": "bfloat16",
        "chunk_tokens": "256",
        "num_layers": "32",
        "num_kv_heads": "8",
        "head_size": "128",
        "extra": "deployment=blue",
    }
    cfg = load_config(
        env={}, overrides={**DECODE, "kvcache": {"target": "k:1", "namespace_source": "config"}, "namespace": fields}
    )
    want = Namespace(
        model_id="/models/model",
        kv_dtype="bfloat16",
        chunk_tokens=256,
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        layout_version=HEADS_LAYOUT_VERSION,
        extra={"deployment": "blue"},
    )
    assert cfg.namespace.build() == want and cfg.namespace.build().name == want.name
    assert cfg.namespace.head_block() is None  # TP1: one block per chunk, under the chunk's key


@pytest.mark.parametrize(("tp_size", "per_block"), [(1, 0), (2, 0), (4, 0), (2, 1), (1, 2)])
def test_lookup_keys_are_the_vllm_connectors_stored_keys(tp_size: int, per_block: int) -> None:
    """The router's [namespace] and looked-up keys equal what the real vLLM connector stores, at any TP size."""
    import torch

    from kvcache_connectors.vllm.namespaces import KVFacts

    heads = 8 // tp_size
    facts = KVFacts(
        model_id="/models/model",
        model_revision="",
        kv_dtype="bfloat16",
        torch_dtype=torch.bfloat16,
        mla=False,
        chunk_tokens=16,
        block_size=16,
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(4)),
        num_kv_heads=heads,
        head_size=64,
        tp_size=tp_size,
        tp_replicas=1,
        extra=(),
        heads_per_block=per_block or heads,
    )
    cfg = load_config(
        env={},
        overrides={
            **DECODE,
            "kvcache": {"target": "k:1", "namespace_source": "config"},
            "namespace": {
                "model_id": "/models/model",
                "kv_dtype": "bfloat16",
                "chunk_tokens": "16",
                "num_layers": "4",
                "num_kv_heads": str(heads),
                "head_size": "64",
                "tp_size": str(tp_size),
                "kv_heads_per_block": str(per_block),
            },
        },
    )
    (namespace,) = facts.namespaces()
    assert cfg.namespace.build() == namespace
    tokens = list(range(40))
    chunk = chunk_keys(tokens, namespace)
    stored = [facts.unit_keys((k,), per_block or None) for k in chunk]  # every rank's blocks of each chunk
    block = cfg.namespace.head_block()
    looked_up = chunk if block is None else [head_block_key(k, 0, block[0], block[1]) for k in chunk]
    assert [keys[0] for keys in stored] == looked_up


def test_kv_heads_per_block_must_divide_a_ranks_heads() -> None:
    cfg = {"model_id": "m", "kv_dtype": "bfloat16", "num_layers": "2", "num_kv_heads": "4", "head_size": "8"}
    with pytest.raises(ConfigError, match="kv_heads_per_block"):
        load_config(
            env={},
            overrides={
                **DECODE,
                "kvcache": {"target": "k:1", "namespace_source": "config"},
                "namespace": {**cfg, "kv_heads_per_block": "3"},
            },
        )


def test_cli_reports_a_bad_config_and_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache_router", "--decode", "nonsense"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "kvcache-router: workers: 'nonsense' is not a base URL" in proc.stderr


def test_router_imports_only_what_its_image_installs() -> None:
    """docker/router.Dockerfile installs the base dependencies and aiohttp: no torch, no tier clients."""
    code = (
        "import sys, kvcache_router.cli, kvcache_router.app;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'redis', 'boto3'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert result.stdout.strip() == "[]"
