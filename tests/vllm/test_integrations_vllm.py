"""docs/integrations.md's vLLM command lines, parsed as vLLM's CLI parses --kv-transfer-config, then by
the plug-in's own config: the connector's and the secondary tier's."""

from __future__ import annotations

import importlib

import pytest
from pydantic import TypeAdapter
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import _expand_json_human_readable_numbers
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvcache_connectors.vllm import KVCacheConnector
from kvcache_connectors.vllm.config import KVCacheConnectorConfig
from kvcache_connectors.vllm_tier import KVCacheTier, KVCacheTierConfig
from tests.integrations_doc import commands

pytestmark = pytest.mark.timeout(60)


def transfer_configs() -> list[KVTransferConfig]:
    out = []
    for argv in commands("vllm"):
        assert argv[:2] == ["vllm", "serve"]
        raw = argv[argv.index("--kv-transfer-config") + 1]
        out.append(TypeAdapter(KVTransferConfig).validate_json(_expand_json_human_readable_numbers(raw)))
    return out


def test_both_vllm_command_lines_build_their_plug_ins() -> None:
    own, tier = transfer_configs()
    assert own.kv_connector == "KVCacheConnector"
    module = importlib.import_module(own.kv_connector_module_path)
    assert getattr(module, own.kv_connector) is KVCacheConnector
    config = KVCacheConnectorConfig.from_extra_config(own.kv_connector_extra_config, block_size=16)
    assert config.target == "kvcache.internal:51051"
    assert tier.kv_connector == "OffloadingConnector"
    extra = tier.kv_connector_extra_config
    assert extra["spec_name"] == "TieringOffloadingSpec"
    (entry,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is KVCacheTier
    options = {k: v for k, v in entry.items() if k not in ("type", "module_path")}
    assert KVCacheTierConfig.from_options(options).target == "kvcache.internal:51051"
