"""docs/vllm-tier.md's command line, parsed as vLLM parses it, and docs/keys.md's engine-keyed example."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import xxhash
from pydantic import TypeAdapter
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import _expand_json_human_readable_numbers
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvcache_connectors.engine_keys import EngineNamespace
from kvcache_connectors.vllm_tier import KVCacheTier, KVCacheTierConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


def documented_kv_transfer_config() -> str:
    text = (DOCS / "vllm-tier.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("vllm serve ")]
    args = shlex.split(line)
    return args[args.index("--kv-transfer-config") + 1]


@pytest.mark.timeout(30)
def test_the_documented_command_line_builds_the_tier() -> None:
    """What vLLM's CLI does with --kv-transfer-config (arg_utils' parse_dataclass), then the tier factory's lookup."""
    config = TypeAdapter(KVTransferConfig).validate_json(
        _expand_json_human_readable_numbers(documented_kv_transfer_config())
    )
    assert config.kv_connector == "OffloadingConnector" and config.kv_role == "kv_both"
    extra = config.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (entry,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is KVCacheTier
    options = {k: v for k, v in entry.items() if k not in ("type", "module_path")}
    assert KVCacheTierConfig.from_options(options).target == "kvcache.internal:51051"


@pytest.mark.timeout(30)
def test_the_documented_option_table_names_every_option() -> None:
    text = (DOCS / "vllm-tier.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)`(?:, `([a-z_]+)`)? \|", text, flags=re.M))
    names = {n for pair in documented for n in pair if n}
    assert names == set(KVCacheTierConfig.__dataclass_fields__)


@pytest.mark.timeout(30)
def test_the_engine_keyed_example_of_keys_md() -> None:
    """The example's bytes rebuilt by hand (not through engine_keys), then compared with engine_keys."""

    def s(v: str) -> bytes:
        return len(v.encode()).to_bytes(4, "little") + v.encode()

    facts = {"model_name": "meta-llama/Llama-3.1-8B", "dtype": "bfloat16", "chunk_bytes": "2097152"}
    canonical = b"kvcache.ns.engine.v1\0" + s("vllm") + s("vllm.offload_key.v1") + (3).to_bytes(8, "little")
    canonical += b"".join(s(k) + s(facts[k]) for k in sorted(facts))
    fingerprint = xxhash.xxh3_128_digest(canonical)
    engine_key = bytes(range(32)) + (0).to_bytes(4, "big")
    key = xxhash.xxh3_128_digest(b"kvcache.engine-key.v1\0" + fingerprint + (36).to_bytes(4, "little") + engine_key)

    ns = EngineNamespace.of("vllm", "vllm.offload_key.v1", facts)
    assert ns.canonical_bytes() == canonical and len(canonical) == 148
    assert ns.name == fingerprint.hex() == "2f0e20bccca9c796c9dd43f59b90dacc"
    assert ns.key(engine_key) == key and key.hex() == "8b6f0522023e2ef03b551b8b6b718a75"
    text = (DOCS / "keys.md").read_text()
    assert "2f0e20bccca9c796c9dd43f59b90dacc" in text and "8b6f0522023e2ef03b551b8b6b718a75" in text
