"""docs/integrations.md's LMCache command line, parsed by `lmcache server`'s own argument parser and
config functions (lmcache.cli.commands.server), then by the adapter's own config."""

from __future__ import annotations

import argparse
import importlib

import pytest
from lmcache.cli.commands.server import ServerCommand
from lmcache.v1.distributed.config import parse_args_to_config

from kvcache_connectors.lmcache_l2 import KVCacheL2Adapter, KVCacheL2Config
from tests.integrations_doc import commands

pytestmark = pytest.mark.timeout(60)


def test_the_lmcache_command_line_builds_the_adapter() -> None:
    (argv,) = commands("lmcache")
    assert argv[:2] == ["lmcache", "server"]
    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    config = parse_args_to_config(parser.parse_args(argv[2:]))
    (adapter,) = config.l2_adapter_config.adapters
    module = importlib.import_module(adapter.module_path)
    assert getattr(module, adapter.class_name) is KVCacheL2Adapter
    assert KVCacheL2Config.from_params(adapter.adapter_params).target == "kvcache.internal:51051"
