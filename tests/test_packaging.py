"""Generated code is fresh; the server never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def test_generated_protobuf_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_server_and_sdk_import_without_torch() -> None:
    code = (
        "import sys, kvcache_server.app, kvcache_server.cli, kvcache_client, kvcache_core.keys;"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_server_does_not_import_the_sdk() -> None:
    """The contract (keys, block format, wire codec, breaker) is kvcache_core; the server needs no SDK."""
    code = (
        "import sys, kvcache_server.app, kvcache_server.cli, kvcache_server.service, kvcache_server.stack;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvcache_client'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_sdk_import_paths_still_work() -> None:
    """Code written against the SDK's old module paths gets the very same objects from kvcache_core."""
    import kvcache_client.blockwire
    import kvcache_client.breaker
    import kvcache_client.format
    import kvcache_client.keys
    import kvcache_core.blockwire
    import kvcache_core.breaker
    import kvcache_core.format
    import kvcache_core.keys
    from kvcache_client import BlockFormatError, ChecksumMismatch
    from kvcache_core import errors

    assert kvcache_client.format.verify_block is kvcache_core.format.verify_block
    assert kvcache_client.keys.Namespace is kvcache_core.keys.Namespace
    assert kvcache_client.blockwire.decode_get_response is kvcache_core.blockwire.decode_get_response
    assert kvcache_client.breaker.CircuitBreaker is kvcache_core.breaker.CircuitBreaker
    assert BlockFormatError is errors.BlockFormatError and ChecksumMismatch is errors.ChecksumMismatch
