"""End-to-end: a real server on a free port, exercised through both SDKs."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvcache_client import AsyncKVCacheClient, KVCacheClient, Layout, Namespace
from kvcache_core.format import decode_block
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = Namespace(model_id="test/llama", kv_dtype="bfloat16", chunk_tokens=16, num_layers=2, num_kv_heads=2, head_size=8)


def kv_chunk(seed: int, tokens: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, tokens, 8, generator=g).to(torch.bfloat16)


def test_sync_round_trip(server: ServerThread) -> None:
    tokens = list(range(1000, 1000 + 16 * 5 + 3))  # five full chunks and a partial tail
    with KVCacheClient(server.target, timeout_s=10) as client:
        keys = client.chunk_keys(tokens, NS)
        assert len(keys) == 6
        assert client.lookup(NS, keys).prefix_length == 0
        tensors = [kv_chunk(i, 16 if i < 5 else 3) for i in range(6)]
        result = client.put_tensors(NS, keys, tensors)
        assert (result.stored, result.rejected) == (6, 0)
        found = client.lookup(NS, keys)
        assert found.prefix_length == 6 and found.tiers == ("ram",) * 6
        got = client.get_tensors(NS, keys)
        for want, have in zip(tensors, got, strict=True):
            assert have is not None and have.dtype == torch.bfloat16 and torch.equal(want, have)
        # The prefix of a longer prompt sharing the first three chunks.
        other = client.chunk_keys(tokens[:48] + [7] * 40, NS)
        assert other[:3] == keys[:3]
        assert client.lookup(NS, other).prefix_length == 3
        assert client.delete(NS, keys[2:4]) == 2
        assert client.lookup(NS, keys).prefix_length == 2
        blocks = client.get_many(NS, keys)
        assert [b is not None for b in blocks] == [True, True, False, False, True, True]
        assert client.get_many(NS, keys, prefix_only=True) == blocks[:2] + [None] * 4
        stats = client.stats()
        ram = stats.tier("ram")
        assert ram.blocks == 4 and ram.puts == 6 and ram.used_bytes <= ram.capacity_bytes
        assert client.corrupt_blocks == 0


def test_async_round_trip(server: ServerThread) -> None:
    async def main() -> None:
        async with AsyncKVCacheClient(server.target, timeout_s=10) as client:
            keys = client.chunk_keys(list(range(64)), NS)
            assert (await client.lookup(NS, keys)).prefix_length == 0
            tensors = [kv_chunk(100 + i) for i in range(len(keys))]
            assert (await client.put_tensors(NS, keys, tensors)).stored == 4
            assert (await client.lookup(NS, keys)).prefix_length == 4
            got = await client.get_tensors(NS, keys)
            assert all(torch.equal(a, b) for a, b in zip(tensors, got, strict=True))  # type: ignore[arg-type]
            assert await client.delete(NS, keys) == 4
            assert await client.get_many(NS, keys) == [None] * 4
            assert (await client.stats()).tier("ram").blocks == 0

    asyncio.run(main())


def test_namespaces_are_disjoint(server: ServerThread) -> None:
    salted = Namespace(**{**NS.to_dict(), "cache_salt": "tenant-b"})
    with KVCacheClient(server.target) as client:
        tokens = list(range(32))
        keys = client.chunk_keys(tokens, NS)
        client.put_tensors(NS, keys, [kv_chunk(0), kv_chunk(1)])
        # Same tokens, other salt: other keys, and even the same keys under the other name miss.
        assert client.lookup(salted, client.chunk_keys(tokens, salted)).prefix_length == 0
        assert client.lookup(salted, keys).prefix_length == 0


def test_large_blocks_and_many_small_blocks_stream(server: ServerThread) -> None:
    big = os.urandom(16 << 20)
    small = [os.urandom(256 << 10) for _ in range(40)]  # 10 MiB: several Put and Get messages
    with KVCacheClient(server.target) as client:
        big_key, small_keys = os.urandom(16), [os.urandom(16) for _ in small]
        assert client.put_many("bench", [(big_key, raw_block(big_key, big))]).stored == 1
        assert (
            client.put_many("bench", list(zip(small_keys, map(raw_block, small_keys, small), strict=True))).stored == 40
        )
        (block,) = client.get_many("bench", [big_key])
        assert block is not None and bytes(decode_block(block, verify=False)[1]) == big
        for want, have in zip(small, client.get_many("bench", small_keys), strict=True):
            assert have is not None and bytes(decode_block(have, verify=False)[1]) == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_tensor_dtypes_over_the_wire(server: ServerThread, dtype: torch.dtype) -> None:
    t = torch.randn(3, 2, 4, 5, 7).to(dtype)
    with KVCacheClient(server.target) as client:
        key = os.urandom(16)
        client.put_tensors("dtypes", [key], [t], layout=Layout.CANONICAL)
        (got,) = client.get_tensors("dtypes", [key])
        assert got is not None and got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_health_and_reflection(server: ServerThread) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvcache.v1.KVCache"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvcache.v1.KVCache", "grpc.health.v1.Health"} <= names
