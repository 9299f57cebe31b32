"""End to end: the real `lmcache server` process with kvcache as its L2 (`--l2-adapter` of type
"plugin" naming KVCacheL2Adapter), driven by LMCache's own client (LMCacheSDKContext).

With `--l2-store-policy skip_l1` LMCache deletes each chunk from its L1 once kvcache has it, so a
retrieve must prefetch it back from kvcache: lookup-and-lock, load into LMCache's buffers, unlock.
kvcache's Stats prove where the bytes were: its RAM holds the chunks and its hits count the reads.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from lmcache.sdk.context import LMCacheSDKContext
from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
from lmcache.v1.gpu_connector.utils import LayoutHints
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
    EngineDrivenTransferContext,
    create_transfer_context,
)

from kvcache_client import KVCacheClient
from kvcache_server.launcher import LocalKVCacheServer
from tests.backends import sigstop
from tests.lmcache.harness import eventually

ROOT = Path(__file__).resolve().parents[2]
CHUNK_TOKENS = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
DTYPE = torch.bfloat16
CHUNK_BYTES = 2 * LAYERS * CHUNK_TOKENS * HEADS * HEAD_DIM * DTYPE.itemsize  # 16 KiB per chunk


class GeometryContext(LMCacheSDKContext):
    """LMCache's SDK client with the model's KV geometry given here (its register_caches reads it
    from a vLLM instance's registration, which these tests have none of)."""

    def register_geometry(self, *, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        self._world_size = 1
        self._num_kv_readers = 1
        self._kv_caches = {
            f"layer.{i}": torch.zeros((1, 2, num_kv_heads, block_size, head_dim), dtype=DTYPE)
            for i in range(num_layers)
        }
        ctx = create_transfer_context(self._kv_caches, instance_id=self.instance_id, req_client=self._req_client)
        self.blocks_in_chunk = self._chunk_size // block_size
        hints = LayoutHints(kv_layout="HND", num_kv_heads=num_kv_heads, tokens_per_block=block_size, head_dim=head_dim)
        ctx.register(
            self._kv_caches,
            self._model_name,
            self._world_size,
            self.blocks_in_chunk,
            self._mq_timeout,
            layout_hints=hints,
        )
        assert isinstance(ctx, EngineDrivenTransferContext), type(ctx)
        self._transfer_ctx = ContiguousTransferWrapper(ctx.engine_driven_context, self._chunk_size)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LMCacheServer:
    """`lmcache server` in a child process of this interpreter (the venv the install script filled)."""

    def __init__(self, log_path: Path, l2_adapter: dict[str, object], *, store_policy: str = "skip_l1") -> None:
        self.port, self.http_port, self.metrics_port = free_ports(3)
        self.log_path = log_path
        argv = [
            sys.executable,
            "-c",
            "import sys; from lmcache.cli.main import main; sys.exit(main())",
            "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--prometheus-port", str(self.metrics_port),
            "--chunk-size", str(CHUNK_TOKENS),
            "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
            "--l2-store-policy", store_policy,
            "--max-workers", "1",
            "--supported-transfer-mode", "auto",
            "--disable-grpc-metrics",
            "--l2-adapter", json.dumps(l2_adapter),
        ]  # fmt: skip
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"lmcache server exited:\n{self.log_tail()}"
            try:
                if requests.get(f"{self.http_url}/config", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"lmcache server not ready in {timeout_s} s:\n{self.log_tail()}"
            time.sleep(0.2)

    def status(self) -> dict:
        """LMCache's /status: its L1, controllers and each L2 adapter's report_status()."""
        return requests.get(f"{self.http_url}/status", timeout=5).json()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


@pytest.fixture
def kvcache() -> Iterator[LocalKVCacheServer]:
    with LocalKVCacheServer("--ram-capacity", "64MiB") as server:
        yield server


def kvcache_l2(kvcache: LocalKVCacheServer) -> dict[str, object]:
    """The `--l2-adapter` spec naming this adapter over `kvcache`."""
    return {
        "type": "plugin",
        "module_path": "kvcache_connectors.lmcache_l2",
        "class_name": "KVCacheL2Adapter",
        "adapter_params": {"target": kvcache.target, "timeout_s": 5.0, "lookup_timeout_s": 2.0},
    }


@pytest.fixture
def lmcache_with_kvcache(kvcache: LocalKVCacheServer, tmp_path: Path) -> Iterator[LMCacheServer]:
    server = LMCacheServer(tmp_path / "lmcache.log", kvcache_l2(kvcache))
    try:
        server.wait_ready(120)
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_lmcache_server_keeps_kvcache_below_its_l1(kvcache, lmcache_with_kvcache) -> None:
    """Four chunks stored through LMCache land in kvcache (and leave LMCache's L1: skip_l1); the
    retrieve of the same tokens returns the stored KV byte for byte, read back from kvcache (its RAM
    hits rise by four); tokens never stored retrieve nothing."""
    lmc = lmcache_with_kvcache
    ctx = GeometryContext(lmc.url, lmc.http_url, "org/tiny-e2e", timeout=30)
    try:
        ctx.register_geometry(num_layers=LAYERS, num_kv_heads=HEADS, block_size=CHUNK_TOKENS, head_dim=HEAD_DIM)
        tokens = list(range(1000, 1000 + 4 * CHUNK_TOKENS))
        kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(5)).to(DTYPE)
        with KVCacheClient(kvcache.target) as probe:
            before = probe.stats().tier("ram")
            assert ctx.store(kv, tokens)
            assert eventually(lambda: probe.stats().tier("ram").blocks == before.blocks + 4, 30), lmc.log_tail()
            stored = probe.stats().tier("ram")
            assert stored.used_bytes - before.used_bytes >= 4 * CHUNK_BYTES
            # skip_l1 deletes each chunk from L1 once the adapter's store completed
            assert eventually(lambda: lmc.status()["storage_manager"]["l1_manager"]["total_object_count"] == 0, 30)

            out = ctx.retrieve(tokens)
            assert out is not None, lmc.log_tail()
            assert out.shape == kv.shape and out.dtype == kv.dtype
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
            after = probe.stats()
            assert after.tier("ram").hits - stored.hits == 4  # the bytes came from kvcache
            adapter = lmc.status()["storage_manager"]["l2_adapters"][0]
            assert adapter["type"] == "kvcache" and adapter["is_healthy"] is True
            assert {
                k: adapter[k] for k in ("stored_chunks", "lookup_hits", "loaded_chunks", "unlocks")
            } == dict.fromkeys(("stored_chunks", "lookup_hits", "loaded_chunks", "unlocks"), 4)
            assert adapter["locked_keys"] == 0 and adapter["current_size_bytes"] == 4 * CHUNK_BYTES
            assert eventually(lambda: probe.stats().arena_leases == 0)  # unlock released the read leases

            assert ctx.retrieve(list(range(5000, 5000 + 2 * CHUNK_TOKENS))) is None
            missed = lmc.status()["storage_manager"]["l2_adapters"][0]
            assert (missed["lookup_hits"], missed["lookup_misses"], missed["lookup_failures"]) == (4, 2, 0)
    finally:
        ctx.close()


@pytest.mark.timeout(240)
def test_a_stopped_kvcache_is_a_miss_for_lmcache_and_its_server_keeps_serving(kvcache, lmcache_with_kvcache) -> None:
    """kvcache SIGSTOPped under a running `lmcache server`: a retrieve of chunks only kvcache holds
    comes back empty within the adapter's lookup deadline (2 s) plus LMCache's own overhead, LMCache
    answers its HTTP status meanwhile, and once kvcache resumes the same retrieve is served again."""
    lmc = lmcache_with_kvcache
    ctx = GeometryContext(lmc.url, lmc.http_url, "org/tiny-e2e", timeout=30)
    try:
        ctx.register_geometry(num_layers=LAYERS, num_kv_heads=HEADS, block_size=CHUNK_TOKENS, head_dim=HEAD_DIM)
        tokens = list(range(2000, 2000 + 2 * CHUNK_TOKENS))
        kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(6)).to(DTYPE)
        assert ctx.store(kv, tokens)
        assert eventually(lambda: lmc.status()["storage_manager"]["l1_manager"]["total_object_count"] == 0, 30)
        sigstop(kvcache.proc.pid)
        try:
            started = time.monotonic()
            assert ctx.retrieve(tokens) is None
            elapsed_s = time.monotonic() - started
            assert lmc.status()["is_healthy"] is True
            adapter = lmc.status()["storage_manager"]["l2_adapters"][0]
        finally:
            os.kill(kvcache.proc.pid, signal.SIGCONT)
        assert elapsed_s < 2.0 + 3.0, elapsed_s
        # The presence index answered the lookup (the stopped server still holds the blocks), the
        # leases behind it failed at the lookup's deadline, and the load read nothing.
        assert adapter["lookup_failures"] == 1 and adapter["loaded_chunks"] == 0 and adapter["locked_keys"] == 0
        assert adapter["breaker"] == "open"
        # the breaker's cooldown (5 s by default) passes, then the next lookup reaches kvcache again
        time.sleep(5.0)
        out = ctx.retrieve(tokens)
        assert out is not None and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    finally:
        ctx.close()


def l1_objects(lmc: LMCacheServer) -> int:
    return lmc.status()["storage_manager"]["l1_manager"]["total_object_count"]


@pytest.mark.timeout(300)
def test_a_new_lmcache_server_loads_what_a_stopped_one_stored_from_kvcache_alone(kvcache, tmp_path) -> None:
    """Issue #24's restart proof. A first `lmcache server` (store policy "default": its L1 keeps
    the chunks too) stores four chunks, which reach kvcache; it is stopped (SIGTERM, its process
    gone) and a second one starts with the same adapter spec and an empty L1. The retrieve of the
    same tokens through the second one returns the stored KV byte for byte, and it can only have
    come from kvcache: its L1 held nothing, kvcache's RAM hits rise by exactly four, its adapter
    locked, loaded and unlocked four chunks and holds no lock after, and the kvcache server holds no
    arena lease. Tokens never stored miss without a lock or a lease."""
    spec = kvcache_l2(kvcache)
    tokens = list(range(3000, 3000 + 4 * CHUNK_TOKENS))
    kv = torch.randn(2, LAYERS, len(tokens), HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(DTYPE)
    geometry = {"num_layers": LAYERS, "num_kv_heads": HEADS, "block_size": CHUNK_TOKENS, "head_dim": HEAD_DIM}
    with KVCacheClient(kvcache.target) as probe:
        before = probe.stats().tier("ram")

        first = LMCacheServer(tmp_path / "lmcache-1.log", spec, store_policy="default")
        try:
            first.wait_ready(120)
            ctx = GeometryContext(first.url, first.http_url, "org/tiny-restart", timeout=30)
            try:
                ctx.register_geometry(**geometry)
                assert ctx.store(kv, tokens)
                assert eventually(lambda: probe.stats().tier("ram").blocks == before.blocks + 4, 30), first.log_tail()
                # kvcache holds the blocks a moment before the adapter counts its store complete
                assert eventually(lambda: first.status()["storage_manager"]["l2_adapters"][0]["stored_chunks"] == 4)
                writer = first.status()["storage_manager"]["l2_adapters"][0]
                assert (writer["stored_chunks"], writer["store_failed_tasks"], writer["locked_keys"]) == (4, 0, 0)
                assert l1_objects(first) == 4  # "default" keeps them in L1 as well
            finally:
                ctx.close()
        finally:
            first.stop()
        assert first.proc.returncode is not None
        stored = probe.stats()
        assert stored.tier("ram").blocks == before.blocks + 4 and stored.arena_leases == 0

        second = LMCacheServer(tmp_path / "lmcache-2.log", spec, store_policy="default")
        try:
            second.wait_ready(120)
            assert l1_objects(second) == 0
            fresh = second.status()["storage_manager"]["l2_adapters"][0]
            assert (fresh["stored_chunks"], fresh["lookup_hits"], fresh["loaded_chunks"]) == (0, 0, 0)
            ctx = GeometryContext(second.url, second.http_url, "org/tiny-restart", timeout=30)
            try:
                ctx.register_geometry(**geometry)
                started = time.monotonic()
                out = ctx.retrieve(tokens)
                elapsed_s = time.monotonic() - started
                assert out is not None, second.log_tail()
                assert out.shape == kv.shape and out.dtype == kv.dtype
                assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
                assert elapsed_s < 30.0, elapsed_s
                after = probe.stats()
                assert after.tier("ram").hits - stored.tier("ram").hits == 4  # read from kvcache, once each
                assert after.tier("ram").misses == stored.tier("ram").misses
                # LMCache's prefetch controller may unlock just after the retrieve returns
                assert eventually(lambda: second.status()["storage_manager"]["l2_adapters"][0]["unlocks"] == 4)
                reader = second.status()["storage_manager"]["l2_adapters"][0]
                counts = ("lookup_hits", "loaded_chunks", "unlocks")
                assert {k: reader[k] for k in counts} == dict.fromkeys(counts, 4), reader
                assert (reader["lookup_misses"], reader["lookup_failures"], reader["load_missing_chunks"]) == (0, 0, 0)
                assert (reader["locked_keys"], reader["locked_bytes"], reader["releases_failed"]) == (0, 0, 0)
                assert eventually(lambda: probe.stats().arena_leases == 0), probe.stats().arena_leases
                assert probe.stats().arena_leases_expired == stored.arena_leases_expired  # released, not timed out

                assert ctx.retrieve(list(range(7000, 7000 + 2 * CHUNK_TOKENS))) is None
                missed = second.status()["storage_manager"]["l2_adapters"][0]
                assert (missed["lookup_hits"], missed["lookup_misses"], missed["unlocks"]) == (4, 2, 4)
                assert missed["locked_keys"] == 0 and probe.stats().arena_leases == 0
            finally:
                ctx.close()
        finally:
            second.stop()
