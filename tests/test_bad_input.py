"""Every error a client can cause gets a precise status, loses nothing, and leaves nothing half-written."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import grpc
import pytest

from kvcache_client import DataCorrupted, InvalidRequest, KVCacheClient, ResourceExhausted
from kvcache_core.format import Compression, compute_checksum, encode_block
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 16


@pytest.fixture
def small_server(make_server) -> ServerThread:
    return make_server(limits={"max_block_bytes": 1 << 20, "max_keys_per_request": 100})


@pytest.fixture
def stub(small_server: ServerThread) -> Iterator[pb_grpc.KVCacheStub]:
    with grpc.insecure_channel(small_server.target) as channel:
        yield pb_grpc.KVCacheStub(channel)


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def put(stub: pb_grpc.KVCacheStub, *messages: pb.PutRequest) -> pb.PutResponse:
    return stub.Put(iter(messages), timeout=10)


def message(*blocks: tuple[bytes, bytes], namespace: str = "ns") -> pb.PutRequest:
    return pb.PutRequest(namespace=namespace, blocks=[pb.Block(key=k, data=d) for k, d in blocks])


def with_byte(block: bytes, offset: int, value: int) -> bytes:
    b = bytearray(block)
    b[offset] = value
    return bytes(b)


GOOD = raw_block(KEY, b"x" * 100)


@pytest.mark.parametrize(
    ("make_call", "code", "fragment"),
    [
        (lambda s: s.Lookup(pb.LookupRequest(keys=[KEY]), timeout=5), "INVALID_ARGUMENT", "namespace is required"),
        (lambda s: s.Lookup(pb.LookupRequest(namespace="a b", keys=[KEY]), timeout=5), "INVALID_ARGUMENT", "printable"),
        (
            lambda s: s.Lookup(pb.LookupRequest(namespace="n" * 129, keys=[KEY]), timeout=5),
            "INVALID_ARGUMENT",
            "1..128",
        ),
        (lambda s: s.Lookup(pb.LookupRequest(namespace="ns"), timeout=5), "INVALID_ARGUMENT", "keys must not be empty"),
        (
            lambda s: s.Lookup(pb.LookupRequest(namespace="ns", keys=[KEY, b"short"]), timeout=5),
            "INVALID_ARGUMENT",
            "keys[1] is 5 bytes",
        ),
        (
            lambda s: s.Lookup(pb.LookupRequest(namespace="ns", keys=[KEY] * 101), timeout=5),
            "INVALID_ARGUMENT",
            "max_keys_per_request=100",
        ),
        (
            lambda s: list(s.Get(pb.GetRequest(namespace="ns", keys=[b"x" * 17]), timeout=5)),
            "INVALID_ARGUMENT",
            "keys[0] is 17 bytes",
        ),
        (lambda s: list(s.Get(pb.GetRequest(keys=[KEY]), timeout=5)), "INVALID_ARGUMENT", "namespace is required"),
        (lambda s: s.Delete(pb.DeleteRequest(namespace="ns"), timeout=5), "INVALID_ARGUMENT", "keys must not be empty"),
        (lambda s: put(s), "INVALID_ARGUMENT", "no blocks"),
        (lambda s: put(s, pb.PutRequest(namespace="ns")), "INVALID_ARGUMENT", "no blocks"),
        (lambda s: put(s, message((KEY, GOOD), namespace="")), "INVALID_ARGUMENT", "namespace is required"),
        (lambda s: put(s, message((b"k", GOOD))), "INVALID_ARGUMENT", "key is 1 bytes"),
        (lambda s: put(s, message((KEY, raw_block(KEY, b"x" * (1 << 20))))), "RESOURCE_EXHAUSTED", "max_block_bytes"),
        (
            lambda s: put(s, message((KEY, b"not a block at all, just some bytes here"))),
            "INVALID_ARGUMENT",
            "malformed block: bad magic",
        ),
        (lambda s: put(s, message((KEY, GOOD[:20]))), "INVALID_ARGUMENT", "shorter than"),
        (lambda s: put(s, message((KEY, GOOD[:-1]))), "INVALID_ARGUMENT", "payload bytes"),
        (lambda s: put(s, message((KEY, GOOD + b"!"))), "INVALID_ARGUMENT", "payload bytes"),
        (lambda s: put(s, message((KEY, with_byte(GOOD, 4, 9)))), "INVALID_ARGUMENT", "unknown block format version 9"),
        (lambda s: put(s, message((KEY, with_byte(GOOD, 8, 200)))), "INVALID_ARGUMENT", "unknown code"),
        (lambda s: put(s, message((KEY, with_byte(GOOD, 13, 1)))), "INVALID_ARGUMENT", "reserved"),
        (lambda s: put(s, message((KEY, with_byte(GOOD, len(GOOD) - 1, ord("y"))))), "DATA_LOSS", "checksum mismatch"),
        (lambda s: put(s, message((KEY, with_byte(GOOD, 33, GOOD[33] ^ 1)))), "DATA_LOSS", "checksum mismatch"),
    ],
)
def test_bad_request_gets_precise_status(
    stub: pb_grpc.KVCacheStub,
    small_server: ServerThread,
    make_call,
    code: str,
    fragment: str,
) -> None:
    got_code, details = status_of(lambda: make_call(stub))
    assert got_code.name == code, details
    assert fragment in details
    # Nothing was stored, and the server still serves.
    assert sum(t.blocks for t in small_server.stack.stats()) == 0
    assert put(stub, message((KEY, GOOD))).stored == 1
    assert stub.Lookup(pb.LookupRequest(namespace="ns", keys=[KEY]), timeout=5).prefix_length == 1


def test_namespace_cannot_change_within_a_stream(stub: pb_grpc.KVCacheStub) -> None:
    other_key = os.urandom(16)
    code, details = status_of(lambda: put(stub, message((KEY, GOOD)), message((other_key, GOOD), namespace="other")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "namespace changed" in details
    # The first message was committed; the second was not, under either name.
    assert stub.Lookup(pb.LookupRequest(namespace="ns", keys=[KEY]), timeout=5).prefix_length == 1
    for ns in ("ns", "other"):
        assert stub.Lookup(pb.LookupRequest(namespace=ns, keys=[other_key]), timeout=5).prefix_length == 0


def test_compressed_block_refused(stub: pb_grpc.KVCacheStub) -> None:
    payload = b"z" * 64
    checksum = compute_checksum(KEY, 0, 0, (64,), payload)
    header = struct.pack("<4sHHBBBBIQQQQ", b"KVCB", 2, 48, 0, 0, Compression.LZ4, 1, 0, 10, 64, checksum, 64)
    code, details = status_of(lambda: put(stub, message((KEY, header + b"0123456789"))))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "compress" in details


def test_failing_message_is_not_half_written(stub: pb_grpc.KVCacheStub, small_server: ServerThread) -> None:
    good = [keyed(os.urandom(100)) for _ in range(3)]
    bad_key = os.urandom(16)
    corrupt = with_byte(raw_block(bad_key, b"a" * 100), 60, ord("b"))
    first = message(*good[:2])
    second = message(good[2], (bad_key, corrupt))
    code, details = status_of(lambda: put(stub, first, second))
    assert code is grpc.StatusCode.DATA_LOSS and details.startswith("block 3:")
    present = stub.Lookup(pb.LookupRequest(namespace="ns", keys=[k for k, _ in good]), timeout=5)
    # The first message was committed whole; nothing of the second is visible.
    assert present.prefix_length == 2
    assert stub.Lookup(pb.LookupRequest(namespace="ns", keys=[good[2][0]]), timeout=5).prefix_length == 0


def test_sdk_raises_typed_errors(small_server: ServerThread) -> None:
    with KVCacheClient(small_server.target, timeout_s=5) as client:
        with pytest.raises(InvalidRequest) as info:
            client.lookup("ns", [b"short"])
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ResourceExhausted):
            client.put_many("ns", [(KEY, raw_block(KEY, bytes(2 << 20)))])
        with pytest.raises(DataCorrupted):
            client.put_many("ns", [(KEY, with_byte(GOOD, len(GOOD) - 1, 0))])
        with pytest.raises(InvalidRequest):
            client.get_many("", [KEY])
        # Empty batches never reach the server.
        assert client.get_many("ns", []) == []
        assert client.lookup("ns", []).prefix_length == 0
        assert client.stats().failed_requests == 4


def test_block_too_big_for_grpc_limit_is_refused(stub: pb_grpc.KVCacheStub) -> None:
    huge = raw_block(KEY, bytes(4 << 20))  # beyond the server's gRPC message limit for a 1 MiB block cap
    code, _ = status_of(lambda: put(stub, message((KEY, huge))))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_encode_block_refuses_mismatched_shape() -> None:
    from kvcache_client import BlockFormatError

    with pytest.raises(BlockFormatError):
        encode_block(b"abc", key=KEY, dtype="float16", shape=(2,))
    with pytest.raises(BlockFormatError):
        encode_block(bytes(16), key=KEY, dtype="uint8", shape=(2, 8), layout=1)
