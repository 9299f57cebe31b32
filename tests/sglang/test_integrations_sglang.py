"""docs/integrations.md's SGLang command line, parsed by SGLang's own ServerArgs argument parser and its
HiCache controller's extra-config parser, then by the backend's own config."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvcache_connectors.sglang_hicache import HiCacheBackendConfig, KVCacheHiCacheStorage
from tests.integrations_doc import commands

pytestmark = pytest.mark.timeout(60)


def test_the_sglang_command_line_builds_the_backend() -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.server_args import ServerArgs

    (argv,) = commands("python -m sglang.launch_server")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv[3:])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(args.hicache_storage_backend_extra_config)
    module = importlib.import_module(extra["module_path"])
    assert getattr(module, extra["class_name"]) is KVCacheHiCacheStorage
    config = HiCacheBackendConfig.from_extra_config(extra)
    assert config.interface_v1 and config.target == "kvcache.internal:51051"
