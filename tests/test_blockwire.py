"""The hand-written codec for PutRequest/GetResponse speaks exactly the generated code's wire format."""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_core.blockwire import (
    BlockPart,
    GetPart,
    ShmRange,
    decode_get_response,
    decode_put_request,
    encode_get_response,
    encode_put_request,
    split_block,
)
from kvcache_proto import kvcache_pb2 as pb
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(120)

namespaces = st.text(max_size=40)
blocks = st.lists(st.tuples(st.binary(max_size=20), st.binary(max_size=300)), max_size=6)
items = st.lists(
    st.tuples(st.integers(0, 2**32 - 1), st.booleans(), st.binary(max_size=300), st.integers(0, 3)), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(namespaces, blocks)
def test_put_request_matches_generated_code(namespace: str, blocks: list[tuple[bytes, bytes]]) -> None:
    ours = encode_put_request(namespace, blocks)
    generated = pb.PutRequest(namespace=namespace, blocks=[pb.Block(key=k, data=d) for k, d in blocks])
    assert ours == generated.SerializeToString()
    parsed = decode_put_request(generated.SerializeToString())
    assert (parsed.error, parsed.namespace, parsed.blocks) == ("", namespace, blocks)


@settings(max_examples=200, deadline=None)
@given(items)
def test_get_response_matches_generated_code(items: list[tuple[int, bool, bytes, int]]) -> None:
    ours = encode_get_response(items)
    generated = pb.GetResponse(items=[pb.GetItem(index=i, found=f, data=d, tier=t) for i, f, d, t in items])
    assert ours == generated.SerializeToString()
    decoded = decode_get_response(generated.SerializeToString())
    assert [(x.index, x.found, bytes(x.data), x.tier) for x in decoded] == items


shm_ranges = st.builds(ShmRange, st.text(max_size=40), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))


def _pb_range(r: ShmRange) -> pb.ShmRange:
    return pb.ShmRange(segment=r.segment, offset=r.offset, length=r.length)


@settings(max_examples=200, deadline=None)
@given(
    namespaces, st.lists(st.tuples(st.binary(max_size=20), st.one_of(st.binary(max_size=50), shm_ranges)), max_size=6)
)
def test_put_request_with_shm_ranges_matches_generated_code(namespace: str, blocks: list) -> None:
    ours = encode_put_request(namespace, blocks)
    generated = pb.PutRequest(
        namespace=namespace,
        blocks=[
            pb.Block(key=k, shm=_pb_range(d)) if isinstance(d, ShmRange) else pb.Block(key=k, data=d) for k, d in blocks
        ],
    )
    assert ours == generated.SerializeToString()
    parsed = decode_put_request(ours)
    assert (parsed.error, parsed.namespace, parsed.blocks) == ("", namespace, blocks)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**32 - 1), st.booleans(), st.one_of(st.binary(max_size=50), shm_ranges), st.integers(0, 3)
        ),
        max_size=6,
    )
)
def test_get_response_with_shm_ranges_matches_generated_code(items: list) -> None:
    ours = encode_get_response(items)
    generated = pb.GetResponse(
        items=[
            pb.GetItem(index=i, found=f, tier=t, shm=_pb_range(d))
            if isinstance(d, ShmRange)
            else pb.GetItem(index=i, found=f, data=d, tier=t)
            for i, f, d, t in items
        ]
    )
    assert ours == generated.SerializeToString()
    decoded = decode_get_response(ours)
    assert [(x.index, x.found, x.shm if x.shm is not None else bytes(x.data), x.tier) for x in decoded] == items


def test_block_with_data_and_shm_is_a_range_with_a_head() -> None:
    """Block.data beside Block.shm is the block's first bytes (a header sent inline), the range the rest."""
    message = pb.PutRequest(
        namespace="ns", blocks=[pb.Block(key=b"k" * 16, data=b"hdr", shm=pb.ShmRange(segment="s", offset=7, length=5))]
    ).SerializeToString()
    decoded = decode_put_request(message)
    assert not decoded.error
    assert decoded.blocks == [(b"k" * 16, ShmRange("s", 7, 5, b"hdr"))]
    assert decoded.blocks[0][1].block_length == 8
    # and the encoder writes it so
    assert encode_put_request("ns", [(b"k" * 16, ShmRange("s", 7, 5, b"hdr"))]) == message


def test_block_with_shm_and_more_or_total_length_is_malformed() -> None:
    for extra in ({"more": True}, {"total_length": 9}, {"data": b"x", "more": True}):
        message = pb.PutRequest(
            namespace="ns", blocks=[pb.Block(key=b"k" * 16, shm=pb.ShmRange(segment="s", length=1), **extra)]
        ).SerializeToString()
        assert "sets shm with more or total_length" in decode_put_request(message).error


def test_unknown_fields_are_skipped() -> None:
    # Field 9 (varint), field 10 (bytes), field 11 (fixed32), field 12 (fixed64) around a real block.
    extra = b"\x48\x05" + b"\x52\x03abc" + b"\x5d\x01\x02\x03\x04" + b"\x61" + bytes(8)
    message = extra + encode_put_request("ns", [(b"k" * 16, b"data")]) + extra
    parsed = decode_put_request(message)
    assert (parsed.error, parsed.namespace, parsed.blocks) == ("", "ns", [(b"k" * 16, b"data")])


@pytest.mark.parametrize(
    "junk",
    [b"\x0a\x05ab", b"\x12\xff\xff\xff\xff\x0f", b"\x80", b"\x0b", b"\x00\x01", b"\x0a\x02\xff\xfe", b"\x12\x01"],
)
def test_malformed_put_is_reported_not_raised(junk: bytes) -> None:
    assert decode_put_request(junk).error.startswith("malformed PutRequest")


def test_server_answers_malformed_put_with_invalid_argument(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        put = channel.stream_unary("/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            put(iter([b"\x12\xff\xff\xff\xff\x0f"]), timeout=5)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed PutRequest" in info.value.details()


def test_large_blocks_are_kept_as_views_and_charged_their_whole_message() -> None:
    from kvcache_core.blockwire import block_cost
    from kvcache_server.arena import align
    from kvcache_server.tiers.ram import ENTRY_OVERHEAD_BYTES, RamTier

    big, small = os.urandom(100_000), [os.urandom(1000) for _ in range(3)]
    message = encode_put_request("ns", [(b"k" * 16, big)])
    ((_key, data),) = decode_put_request(message).blocks
    # One large block: a view into the received message, no copy, charged the whole message.
    assert isinstance(data, memoryview) and data.obj is message and bytes(data) == big
    assert block_cost(data) == len(message)
    # The RAM tier copies it into an arena slot, so it charges the slot, never the message.
    assert RamTier.entry_cost(data) == align(len(big)) + ENTRY_OVERHEAD_BYTES
    # Packed small blocks are copied out, so one kept block never pins its neighbours.
    packed = decode_put_request(encode_put_request("ns", [(bytes([i]) * 16, b) for i, b in enumerate(small)]))
    assert [type(d) for _, d in packed.blocks] == [bytes] * 3 and [d for _, d in packed.blocks] == small


def test_block_parts_encode_exactly_like_the_joined_block(server: ServerThread) -> None:
    from kvcache_client import KVCacheClient
    from kvcache_core.format import encode_block, encode_block_parts

    payload = os.urandom(5000)
    key = b"p" * 16
    parts = encode_block_parts(payload, key=key, dtype="float16", shape=(50, 50))
    whole = encode_block(payload, key=key, dtype="float16", shape=(50, 50))
    assert b"".join(parts) == whole and parts[1] is payload  # the payload is not copied
    assert encode_put_request("ns", [(key, parts)]) == encode_put_request("ns", [(key, whole)])
    with KVCacheClient(server.target) as client:
        assert client.put_many("ns", [(key, parts)]).stored == 1
        assert bytes(client.get_many("ns", [key])[0]) == whole  # type: ignore[arg-type]


parts = st.builds(BlockPart, st.binary(max_size=50), st.booleans(), st.integers(0, 2**64 - 1))


@settings(max_examples=200, deadline=None)
@given(namespaces, st.lists(st.tuples(st.binary(max_size=20), st.one_of(st.binary(max_size=50), parts)), max_size=6))
def test_put_request_with_parts_matches_generated_code(namespace: str, blocks: list) -> None:
    ours = encode_put_request(namespace, blocks)
    generated = pb.PutRequest(
        namespace=namespace,
        blocks=[
            pb.Block(key=k, data=d.data, more=d.more, total_length=d.total_length)
            if isinstance(d, BlockPart)
            else pb.Block(key=k, data=d)
            for k, d in blocks
        ],
    )
    assert ours == generated.SerializeToString()
    decoded = decode_put_request(ours).blocks
    for (k, d), (dk, dd) in zip(blocks, decoded, strict=True):
        assert dk == k
        if isinstance(d, BlockPart) and (d.more or d.total_length):
            assert isinstance(dd, BlockPart) and (bytes(dd.data), dd.more, dd.total_length) == (
                d.data,
                d.more,
                d.total_length,
            )
        else:
            assert bytes(dd if not isinstance(dd, BlockPart) else dd.data) == (
                d.data if isinstance(d, BlockPart) else d
            )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=4), st.integers(1, 64))
def test_split_block_covers_the_block_in_parts_of_at_most_part_bytes(pieces: list[bytes], part_bytes: int) -> None:
    data = tuple(pieces)
    whole = b"".join(pieces)
    split = split_block(data, part_bytes)
    assert b"".join(b"".join(bytes(x) for x in p.data) for p in split) == whole
    assert all(sum(len(x) for x in p.data) <= part_bytes for p in split)
    if len(split) == 1:
        assert split[0] == BlockPart(split[0].data, False, 0)  # small blocks are not split
    else:
        assert split[0].total_length == len(whole) and all(p.total_length == 0 for p in split[1:])
        assert all(p.more for p in split[:-1]) and not split[-1].more


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=50), st.booleans(), st.integers(0, 3)), max_size=6)
)
def test_get_response_parts_match_generated_code(items: list) -> None:
    ours = encode_get_response([(i, True, GetPart(d, m), t) for i, d, m, t in items])
    generated = pb.GetResponse(items=[pb.GetItem(index=i, found=True, data=d, tier=t, more=m) for i, d, m, t in items])
    assert ours == generated.SerializeToString()
    assert [(x.index, bytes(x.data), x.more, x.tier) for x in decode_get_response(ours)] == items
