"""Large blocks put in parts (Block.more / Block.total_length): assembled, verified, and every misuse refused."""

from __future__ import annotations

import os

import grpc
import pytest

from kvcache_client import KVCacheClient
from kvcache_client.messages import DEFAULT_PART_BYTES, put_messages
from kvcache_core.blockwire import BlockPart, encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(60)

KEY = b"p" * 16


@pytest.fixture
def small_server(make_server) -> ServerThread:
    return make_server(limits={"max_block_bytes": 1 << 20}, shm={"enabled": False})


def send(server: ServerThread, messages: list[bytes]) -> tuple[grpc.StatusCode, str, pb.PutResponse | None]:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_unary("/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString)
        try:
            return grpc.StatusCode.OK, "", call(iter(messages), timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), None


def stored(server: ServerThread, key: bytes) -> bytes | None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        (response,) = list(stub.Get(pb.GetRequest(namespace="ns", keys=[key]), timeout=10))
        item = response.items[0]
        return item.data if item.found else None


def test_info_offers_parts_and_the_sdk_uses_them(make_server) -> None:
    server = make_server(shm={"enabled": False})
    block = raw_block(KEY, os.urandom(5 * DEFAULT_PART_BYTES + 12345))  # over PARTS_ABOVE_BYTES: 6 parts
    small = raw_block(b"s" * 16, b"small")
    with KVCacheClient(server.target, bulk=False) as client:  # the gRPC path (bulk: test_bulk.py)
        assert client.put_many("ns", [(KEY, block), (b"s" * 16, small)]).stored == 2
        assert client._transport.inner.part_bytes == DEFAULT_PART_BYTES
        assert bytes(client.get_many("ns", [KEY])[0]) == block
    # What the SDK sent: the large block as parts, one message each, then the small block.
    messages = list(put_messages("ns", [(KEY, block), (b"s" * 16, small)], part_bytes=DEFAULT_PART_BYTES))
    assert len(messages) == 7
    # Blocks up to PARTS_ABOVE_BYTES travel whole (parts gained nothing for them).
    assert (
        len(list(put_messages("ns", [(KEY, raw_block(KEY, os.urandom(2 << 20)))], part_bytes=DEFAULT_PART_BYTES))) == 1
    )
    assert all(len(m) < DEFAULT_PART_BYTES + 100 for m in messages)


def test_parts_across_and_within_messages_assemble_exactly(small_server: ServerThread) -> None:
    block = raw_block(KEY, os.urandom(50_000))
    other = raw_block(b"o" * 16, os.urandom(1000))
    a, b, c = block[:10_000], block[10_000:30_000], block[30_000:]
    messages = [
        encode_put_request("ns", [(b"o" * 16, other), (KEY, BlockPart(a, True, len(block)))]),
        encode_put_request("", [(b"", BlockPart(b, True)), (b"", c)]),  # two parts in one message
    ]
    code, details, response = send(small_server, messages)
    assert code is grpc.StatusCode.OK, details
    assert response is not None and response.stored == 2 and response.bytes_received == len(block) + len(other)
    assert stored(small_server, KEY) == block and stored(small_server, b"o" * 16) == other


def part_messages(block: bytes, total: int | None = None) -> list[bytes]:
    half = len(block) // 2
    return [
        encode_put_request("ns", [(KEY, BlockPart(block[:half], True, len(block) if total is None else total))]),
        encode_put_request("", [(b"", block[half:])]),
    ]


@pytest.mark.parametrize(
    ("messages", "code", "fragment"),
    [
        # A continuation part may not carry a key.
        (
            lambda b: [
                encode_put_request("ns", [(KEY, BlockPart(b[:100], True, len(b)))]),
                encode_put_request("", [(KEY, b[100:])]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "must not carry a key",
        ),
        # The stream ends while a block is incomplete.
        (
            lambda b: [encode_put_request("ns", [(KEY, BlockPart(b[:100], True, len(b)))])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended inside block 0",
        ),
        # total_length missing, or smaller than the first part.
        (
            lambda b: [encode_put_request("ns", [(KEY, BlockPart(b[:100], True, 0))])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "needs total_length",
        ),
        (lambda b: part_messages(b, total=10), grpc.StatusCode.INVALID_ARGUMENT, "needs total_length"),
        # Parts that add up to more, or less, than total_length.
        (lambda b: part_messages(b, total=len(b) - 1), grpc.StatusCode.INVALID_ARGUMENT, "exceed total_length"),
        (lambda b: part_messages(b, total=len(b) + 1), grpc.StatusCode.INVALID_ARGUMENT, "parts hold"),
        # total_length without more, and a continuation that sets total_length.
        (
            lambda b: [encode_put_request("ns", [(KEY, BlockPart(b, False, len(b)))])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "total_length is set but more is not",
        ),
        (
            lambda b: [
                encode_put_request("ns", [(KEY, BlockPart(b[:100], True, len(b)))]),
                encode_put_request("", [(b"", BlockPart(b[100:], False, 5))]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "continuation part sets total_length",
        ),
        # A block announced larger than max_block_bytes is refused before any buffer is allocated.
        (lambda b: part_messages(b, total=2 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_block_bytes"),
    ],
    ids=[
        "key-on-continuation",
        "stream-ends-inside",
        "no-total",
        "total-too-small",
        "parts-exceed-total",
        "parts-short-of-total",
        "total-without-more",
        "continuation-total",
        "over-max-block",
    ],
)
def test_misused_parts_are_refused_and_store_nothing(small_server: ServerThread, messages, code, fragment) -> None:
    block = raw_block(KEY, os.urandom(5000))
    got, details, _ = send(small_server, messages(block))
    assert got is code and fragment in details, details
    assert stored(small_server, KEY) is None


def test_a_corrupt_block_in_parts_is_data_loss(small_server: ServerThread) -> None:
    block = bytearray(raw_block(KEY, os.urandom(5000)))
    block[-1] ^= 0x01
    got, details, _ = send(small_server, part_messages(bytes(block)))
    assert got is grpc.StatusCode.DATA_LOSS and "block 0" in details
    assert stored(small_server, KEY) is None


# -- gets in parts ------------------------------------------------------------------------------------


def test_large_blocks_come_back_in_parts_only_to_clients_that_accept_them(make_server) -> None:
    server = make_server(shm={"enabled": False})
    block = raw_block(KEY, os.urandom(4 * DEFAULT_PART_BYTES + 777))  # just over the threshold: 5 parts
    small = raw_block(b"s" * 16, b"tiny")
    keys = [KEY, b"s" * 16, b"m" * 16]
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(KEY, block), (b"s" * 16, small)])
        got = client.get_many("ns", keys)
        assert bytes(got[0]) == block and bytes(got[1]) == small and got[2] is None
    with grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.KVCacheStub(channel)
        parted = [i for r in stub.Get(pb.GetRequest(namespace="ns", keys=keys, accept_parts=True)) for i in r.items]
        whole = [i for r in stub.Get(pb.GetRequest(namespace="ns", keys=keys)) for i in r.items]
    assert [(i.index, i.more) for i in parted] == [(0, True)] * 4 + [(0, False), (1, False), (2, False)]
    assert b"".join(i.data for i in parted[:5]) == block and all(len(i.data) <= DEFAULT_PART_BYTES for i in parted)
    assert [(i.index, i.more, i.data == d) for i, d in zip(whole, [block, small, b""], strict=True)] == [
        (0, False, True),
        (1, False, True),
        (2, False, True),
    ]


def test_collector_refuses_broken_part_sequences() -> None:
    from kvcache_client.errors import KVCacheError
    from kvcache_client.messages import GetCollector
    from kvcache_core.blockwire import GetItem

    interleaved = GetCollector(2)
    interleaved.add([GetItem(0, True, b"ab", 1, more=True)])
    with pytest.raises(KVCacheError, match="interrupted block 0"):
        interleaved.add([GetItem(1, True, b"cd", 1)])
    unfinished = GetCollector(1)
    unfinished.add([GetItem(0, True, b"ab", 1, more=True)])
    with pytest.raises(KVCacheError, match="ended inside block 0"):
        unfinished.resolve(None)
    joined = GetCollector(1)
    joined.add([GetItem(0, True, b"ab", 1, more=True)])
    joined.add([GetItem(0, True, b"cd", 1, more=False)])
    assert joined.resolve(None) == [(b"abcd", "ram")]
