"""Fixtures for the vLLM connector tests (the kvcache server fixtures come from tests/conftest.py).

These tests import the real vllm==0.33.0, installed CPU-only by scripts/install_vllm_cpu.sh.
Where vLLM is missing they are not collected (one line at the end of the report says so);
under CI (CI=1) a missing vLLM is an error instead, so the suite cannot pass without them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
VLLM_MISSING = importlib.util.find_spec("vllm") is None
if VLLM_MISSING:
    if IN_CI:
        raise ImportError("tests/vllm need vllm==0.33.0: run scripts/install_vllm_cpu.sh on this venv first")
    collect_ignore_glob = ["test_*.py"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if VLLM_MISSING:
        terminalreporter.write_line("tests/vllm: NOT RUN, vllm is not installed (see scripts/install_vllm_cpu.sh)")


@pytest.fixture(scope="session", autouse=True)
def _vllm_none_hash() -> None:
    """vLLM's prefix-cache hashing needs its NONE_HASH seeded once per process (EngineCore does this)."""
    if VLLM_MISSING:
        return
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama's config.json, all ModelConfig needs offline."""
    from tests.vllm.harness import write_model_dir

    return write_model_dir(Path(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def dead_target() -> str:
    """host:port where nothing listens (a port just released by the OS)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A `python -m kvcache_server` subprocess (one that can be SIGSTOPped) and its target."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcache_server", "--port", str(port), "--ram-capacity", "64MiB"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    target = f"127.0.0.1:{port}"
    try:
        from kvcache_client import KVCacheClient

        deadline = time.monotonic() + 30
        with KVCacheClient(target, timeout_s=1) as client:
            while True:
                assert process.poll() is None, (tmp_path / "server.log").read_text()
                try:
                    client.stats()
                    break
                except Exception:
                    assert time.monotonic() < deadline, "kvcache_server did not start"
                    time.sleep(0.1)
        yield process, target
    finally:
        if process.poll() is None:  # a test may have killed it
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()
