"""Block format v2: a block is valid only under the key it was made for, at every verification point.

Each test puts a *valid, undamaged* block under another key (or a version-1 block, whose checksum did not
cover the key) where a real deployment could meet one: sent by a buggy client, copied in Redis or S3 by
an operator, misdirected inside the server. Before v2 every one of these was served as the other key's KV.
"""

from __future__ import annotations

import os
import struct

import grpc
import pytest
import xxhash

from kvcache_client import KVCacheClient
from kvcache_core.format import DType, Layout, decode_block
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.backends import RedisProcess, S3Process
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

NS = "binding"
BUCKET = "kvcache-test"


def pair() -> tuple[bytes, bytes, bytes, bytes]:
    """Two keys and each one's own valid block (distinct payloads, same shape)."""
    x, y = os.urandom(16), os.urandom(16)
    return x, raw_block(x, b"X" * 5000), y, raw_block(y, b"Y" * 5000)


def v1_block(payload: bytes) -> bytes:
    """A block as version 1 wrote it: the same header, a checksum over descriptor || payload only."""
    n = len(payload)
    checksum = xxhash.xxh3_64_intdigest(struct.pack("<BBBQQ", DType.UINT8, Layout.RAW, 1, n, n) + payload)
    return struct.pack("<4sHHBBBBIQQQQ", b"KVCB", 1, 48, DType.UINT8, 0, 0, 1, 0, n, n, checksum, n) + payload


def redis_name(key: bytes) -> str:
    return f"kvcache/{NS}/{key.hex()}"


def test_a_put_of_another_keys_block_is_data_loss_and_stores_nothing(server: ServerThread) -> None:
    x, block_x, y, _ = pair()
    with grpc.insecure_channel(server.target) as channel:
        put = pb_grpc.KVCacheStub(channel).Put
        with pytest.raises(grpc.RpcError) as info:
            put(iter([pb.PutRequest(namespace=NS, blocks=[pb.Block(key=y, data=block_x)])]), timeout=10)
        assert info.value.code() is grpc.StatusCode.DATA_LOSS
        assert "belongs to another key" in (info.value.details() or "")
    with KVCacheClient(server.target) as client:
        assert client.lookup(NS, [y]).prefix_length == 0
        assert client.put_many(NS, [(x, block_x)]).stored == 1  # under its own key it is fine
        assert client.stats().put_checksum_failures == 1


def test_a_version_1_block_is_refused_on_put(server: ServerThread) -> None:
    key = os.urandom(16)
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVCacheStub(channel).Put(
            iter([pb.PutRequest(namespace=NS, blocks=[pb.Block(key=key, data=v1_block(b"old" * 100))])]),
            timeout=10,
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "version 1 is refused" in (info.value.details() or "")


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_block_copied_under_another_key_in_redis_is_a_miss_and_deleted(
    make_server, redis_server: RedisProcess, compression: str
) -> None:
    redis = {"enabled": True, "url": redis_server.url, "timeout_s": 2.0, "compression": compression}
    server: ServerThread = make_server(redis=redis)
    x, block_x, y, block_y = pair()
    r = redis_server.client()
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, [(x, block_x), (y, block_y)]).stored == 2
        server.stack.ram.delete_many_sync(NS, [x, y])  # only Redis holds them now
        r.set(redis_name(y), r.get(redis_name(x)))  # an operator's copy: X's intact block under Y
        for _ in range(20):  # each read: a miss, never X's bytes
            got_y, got_x = client.get_many(NS, [y, x])
            assert got_y is None
            assert got_x is not None and bytes(got_x) == block_x
            server.stack.ram.delete_many_sync(NS, [x])  # read X from Redis again next round
            r.set(redis_name(y), r.get(redis_name(x)))
        assert client.stats().tier("redis").checksum_failures == 20
        assert client.corrupt_blocks == 0  # the server never sent it
        client.get_many(NS, [y])
        assert r.exists(redis_name(y)) == 0  # the bad copy is deleted where it lay
        assert client.lookup(NS, [y]).prefix_length == 0


def test_a_block_copied_under_another_key_in_s3_is_a_miss_and_deleted(make_server, s3_server: S3Process) -> None:
    s3_cfg = {
        "enabled": True,
        "bucket": BUCKET,
        "endpoint_url": s3_server.endpoint,
        "path_style": True,
        "create_bucket": True,
        "write_mode": "through",
        "compression": "shuffle-lz4",
        "timeout_s": 5.0,
    }
    server: ServerThread = make_server(s3=s3_cfg)
    x, block_x, y, block_y = pair()
    s3 = s3_server.client()
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, [(x, block_x), (y, block_y)]).stored == 2
        server.stack.ram.delete_many_sync(NS, [x, y])
        body = s3.get_object(Bucket=BUCKET, Key=redis_name(x))["Body"].read()
        s3.put_object(Bucket=BUCKET, Key=redis_name(y), Body=body)
        got_y, got_x = client.get_many(NS, [y, x])
        assert got_y is None and got_x is not None and bytes(got_x) == block_x
        assert client.stats().tier("s3").checksum_failures == 1
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=BUCKET, Key=redis_name(y))


def test_a_version_1_block_in_redis_is_never_served(make_server, redis_server: RedisProcess) -> None:
    server: ServerThread = make_server(redis={"enabled": True, "url": redis_server.url, "timeout_s": 2.0})
    key = os.urandom(16)
    r = redis_server.client()
    r.set(redis_name(key), v1_block(b"written by an older server" * 10))
    with KVCacheClient(server.target) as client:
        assert client.lookup(NS, [key]).prefix_length == 1  # presence alone is not verification
        assert client.get_many(NS, [key]) == [None]
        assert client.stats().tier("redis").checksum_failures == 1
        assert r.exists(redis_name(key)) == 0
        assert client.lookup(NS, [key]).prefix_length == 0


def test_the_sdk_refuses_another_keys_block_from_the_server(server: ServerThread) -> None:
    """A misdirected block inside the server (a data-path race, a tier bug): the SDK's own check catches it."""
    x, block_x, y, block_y = pair()
    with KVCacheClient(server.target) as client, KVCacheClient(server.target, shm=False) as inline:
        assert client.put_many(NS, [(x, block_x), (y, block_y)]).stored == 2
        # Straight into the RAM tier, past the server's Put check: X's bytes under Y.
        assert server.stack.ram.put_many_sync(NS, [(y, block_x)]) == [True]
        for c in (client, inline):  # through shared memory and through gRPC
            got_x, got_y = c.get_many(NS, [x, y])
            assert got_x is not None and bytes(got_x) == block_x
            assert got_y is None
            assert c.corrupt_blocks == 1
        assert server.stack.ram.put_many_sync(NS, [(y, v1_block(b"v1" * 100))]) == [True]
        assert inline.get_many(NS, [y]) == [None] and inline.corrupt_blocks == 2


def test_get_tensors_refuses_another_keys_tensor(server: ServerThread) -> None:
    torch = pytest.importorskip("torch")
    x, y = os.urandom(16), os.urandom(16)
    a, b = torch.zeros(2, 2, 1, 4, 8), torch.ones(2, 2, 1, 4, 8)  # same shape, dtype and layout
    with KVCacheClient(server.target) as client:
        assert client.put_tensors(NS, [x, y], [a, b]).stored == 2
        (block_x,) = client.get_many(NS, [x])
        assert block_x is not None
        decode_block(block_x, x)  # valid under its own key
        assert server.stack.ram.put_many_sync(NS, [(y, bytes(block_x))]) == [True]
        got = client.get_tensors(NS, [x, y])
        assert got[0] is not None and torch.equal(got[0], a)
        assert got[1] is None and client.corrupt_blocks == 1
