"""blockwire decodes every encoding exactly as the generated code does, and the generated code
parses what blockwire encodes (differential tests against kvcache_pb2, upb backend).

Each byte string is decoded by both sides: either both refuse it (DecodeError from protobuf,
WireError or PutMessage.error from blockwire, nothing else) or both accept it with the same values.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache_core import blockwire as bw
from kvcache_core.errors import WireError
from kvcache_proto import kvcache_pb2 as pb

MAX_FIELD = 2**29 - 1

# -- comparing both decoders ----------------------------------------------------------------------

ShmValues = tuple[str, int, int, int] | None
BlockValues = tuple[bytes, bytes, ShmValues, bool, int]  # key, data, shm, more, total_length
ItemValues = tuple[int, bool, bytes, int, ShmValues, bool]  # index, found, data, tier, shm, more


def _pb_shm(message: pb.Block | pb.GetItem) -> ShmValues:
    if not message.HasField("shm"):
        return None
    return (message.shm.segment, message.shm.offset, message.shm.length, message.shm.seal_before_ns)


def _bw_shm(shm: bw.ShmRange | None) -> ShmValues:
    return None if shm is None else (shm.segment, shm.offset, shm.length, shm.seal_before_ns)


def _pb_put(data: bytes) -> tuple[str, list[BlockValues]] | None:
    try:
        message = pb.PutRequest.FromString(data)
    except DecodeError:
        return None
    return message.namespace, [(b.key, b.data, _pb_shm(b), b.more, b.total_length) for b in message.blocks]


def _bw_block(key: bytes, data: object, message: bytes) -> BlockValues:
    """A decoded block's values; also checks it has the one shape its fields call for."""
    if isinstance(data, bw.MixedBlock):
        assert len(data.data) or data.more or data.total_length
        return key, bytes(data.data), _bw_shm(data.shm), data.more, data.total_length
    if isinstance(data, bw.ShmRange):
        return key, b"", _bw_shm(data), False, 0
    if isinstance(data, bw.BlockPart):
        assert data.more or data.total_length
        value, more, total_length = data.data, data.more, data.total_length
    else:
        value, more, total_length = data, False, 0
    assert isinstance(value, bytes | memoryview)
    # Zero copy: a block that is at least half its message is a view into it, smaller ones are bytes.
    if 2 * len(value) >= len(message):
        assert isinstance(value, memoryview) and value.obj is message
    else:
        assert type(value) is bytes
    return key, bytes(value), None, more, total_length


def _bw_put(data: bytes) -> tuple[str, list[BlockValues]] | None:
    parsed = bw.parse_put_request(data)
    if parsed.error:
        assert parsed.error.startswith("malformed PutRequest") and not parsed.namespace and not parsed.blocks
        return None
    return parsed.namespace, [_bw_block(k, d, data) for k, d in parsed.blocks]


def check_put(data: bytes) -> tuple[str, list[BlockValues]] | None:
    """Decodes `data` as a PutRequest both ways, asserts they agree, and returns the values (None: refused)."""
    expected = _pb_put(data)
    assert _bw_put(data) == expected
    # What the server calls: the same decoding, then the one validation rule protobuf does not know.
    checked = bw.decode_put_request(data)
    if expected is None:
        assert checked.error
    elif any(shm is not None and (more or total) for _, d, shm, more, total in expected[1]):
        assert "sets shm with more or total_length" in checked.error and not checked.blocks
    else:
        assert not checked.error and (checked.namespace, len(checked.blocks)) == (expected[0], len(expected[1]))
        for (_, d, shm, _, _), (_, got) in zip(expected[1], checked.blocks, strict=True):
            if shm is not None:  # data beside shm is the block's head
                assert isinstance(got, bw.ShmRange)
                assert (got.segment, got.offset, got.length, got.seal_before_ns, got.head) == (*shm, d)
    return expected


def _pb_get(data: bytes) -> list[ItemValues] | None:
    try:
        message = pb.GetResponse.FromString(data)
    except DecodeError:
        return None
    return [(x.index, x.found, x.data, x.tier, _pb_shm(x), x.more) for x in message.items]


def _bw_get(data: bytes) -> list[ItemValues] | None:
    try:
        items = bw.decode_get_response(data)
    except WireError:
        return None
    for item in items:  # zero copy: data are views into the message
        assert not len(item.data) or (isinstance(item.data, memoryview) and item.data.obj is data)
    return [(x.index, x.found, bytes(x.data), x.tier, _bw_shm(x.shm), x.more) for x in items]


def check_get(data: bytes) -> list[ItemValues] | None:
    """Decodes `data` as a GetResponse both ways, asserts they agree, and returns the values (None: refused)."""
    expected = _pb_get(data)
    assert _bw_get(data) == expected
    return expected


# -- building encodings by hand -------------------------------------------------------------------


def varint(value: int, size: int = 0) -> bytes:
    """`value` as a varint of at least `size` bytes (non-minimal: padded with continuation bits)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value or len(out) + 1 < size:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def ld(number: int, body: bytes) -> bytes:
    return tag(number, 2) + varint(len(body)) + body


@st.composite
def padded_varints(draw: st.DrawFn, values: st.SearchStrategy[int], max_size: int = 10) -> bytes:
    """Varints of `values`, minimal or padded up to `max_size` bytes."""
    value = draw(values)
    minimal = len(varint(value))
    return varint(value, draw(st.integers(minimal, max(minimal, max_size))))


# Varint values around every truncation protobuf applies (32, 63, 64 bits), and beyond 64 bits up
# to what 10 bytes hold (protobuf drops those bits).
edge_ints = st.sampled_from([0, 1, 2, 3, 127, 128, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1])
wide_ints = st.one_of(edge_ints, st.integers(0, 2**64 - 1), st.integers(0, 2**70 - 1), st.integers(2**64, 2**70 - 1))
varint_values = padded_varints(wide_ints)


@st.composite
def tags(draw: st.DrawFn, number: int, wire_type: int) -> bytes:
    """A tag, minimal or padded up to the 5 bytes protobuf accepts."""
    return draw(padded_varints(st.just(number << 3 | wire_type), 5))


@st.composite
def length_delimited(draw: st.DrawFn, number: int, body: bytes) -> bytes:
    return draw(tags(number, 2)) + draw(padded_varints(st.just(len(body)), 5)) + body


field_numbers = st.one_of(st.integers(1, 40), st.sampled_from([1000, 2**14, 2**21, 2**28, MAX_FIELD]))


@st.composite
def foreign_fields(draw: st.DrawFn, known: dict[int, int], in_group: bool = False, depth: int = 0) -> bytes:
    """A field the message does not read: an unknown number, or a known one with another wire type,
    with any wire type including groups (whose fields may use number 0)."""
    number = draw(st.one_of(st.just(0), field_numbers) if in_group else field_numbers)
    wire_types = [w for w in (0, 1, 2, 3, 5) if known.get(number) != w and (w != 3 or depth < 3)]
    wire_type = draw(st.sampled_from(wire_types))
    head = draw(tags(number, wire_type))
    if wire_type == 0:
        return head + draw(varint_values)
    if wire_type == 1:
        return head + draw(st.binary(min_size=8, max_size=8))
    if wire_type == 5:
        return head + draw(st.binary(min_size=4, max_size=4))
    if wire_type == 2:
        body = draw(st.binary(max_size=12))
        return head + draw(padded_varints(st.just(len(body)), 5)) + body
    inner = draw(st.lists(foreign_fields({}, in_group=True, depth=depth + 1), max_size=3))
    return head + b"".join(inner) + draw(tags(number, 4))


SHM_FIELDS = {1: 2, 2: 0, 3: 0, 5: 0}
BLOCK_FIELDS = {1: 2, 2: 2, 3: 2, 4: 0, 5: 0}
PUT_FIELDS = {1: 2, 2: 2}
ITEM_FIELDS = {1: 0, 2: 0, 3: 2, 4: 0, 5: 2, 6: 0}
GET_FIELDS = {1: 2}

texts = st.text(max_size=12)
u64 = st.one_of(edge_ints, st.integers(0, 2**64 - 1))


@st.composite
def messages(draw: st.DrawFn, chunks: st.SearchStrategy[bytes], known: dict[int, int]) -> bytes:
    """A message as its fields in any order, repeated or not, with foreign fields mixed in."""
    fields = draw(st.lists(st.one_of(chunks, chunks, foreign_fields(known)), max_size=6))
    return b"".join(fields)


@st.composite
def shm_chunks(draw: st.DrawFn) -> bytes:
    """Fields of a ShmRange: serialised by the generated code, or by hand (explicit zeros, wide varints)."""
    kind = draw(st.sampled_from(["pb", "segment", "offset", "length", "seal"]))
    if kind == "pb":
        msg = pb.ShmRange(segment=draw(texts), offset=draw(u64), length=draw(u64), seal_before_ns=draw(u64))
        return msg.SerializeToString()
    if kind == "segment":
        return draw(length_delimited(1, draw(texts).encode()))
    return draw(tags({"offset": 2, "length": 3, "seal": 5}[kind], 0)) + draw(varint_values)


shm_bodies = messages(shm_chunks(), SHM_FIELDS)


@st.composite
def block_chunks(draw: st.DrawFn) -> bytes:
    """Fields of a Block; `shm` may occur several times, each occurrence its own fields."""
    kind = draw(st.sampled_from(["pb", "key", "data", "shm", "pb_shm", "more", "total_length"]))
    if kind == "pb":
        msg = pb.Block(key=draw(st.binary(max_size=20)), data=draw(st.binary(max_size=300)))
        msg.more, msg.total_length = draw(st.booleans()), draw(u64)
        return msg.SerializeToString()
    if kind == "pb_shm":
        return pb.Block(shm=pb.ShmRange(segment=draw(texts), length=draw(u64))).SerializeToString()
    if kind == "key":
        return draw(length_delimited(1, draw(st.binary(max_size=20))))
    if kind == "data":
        return draw(length_delimited(2, draw(st.binary(max_size=300))))
    if kind == "shm":
        return draw(length_delimited(3, draw(shm_bodies)))
    return draw(tags(4 if kind == "more" else 5, 0)) + draw(varint_values)


@st.composite
def put_chunks(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["pb", "namespace", "block", "block"]))
    if kind == "pb":
        blocks = [pb.Block(key=k, data=d) for k, d in draw(st.lists(st.tuples(st.binary(max_size=20), st.binary())))]
        return pb.PutRequest(namespace=draw(texts), blocks=blocks).SerializeToString()
    if kind == "namespace":
        return draw(length_delimited(1, draw(texts).encode()))
    return draw(length_delimited(2, draw(messages(block_chunks(), BLOCK_FIELDS))))


@st.composite
def item_chunks(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["pb", "data", "shm", "index", "found", "tier", "more"]))
    if kind == "pb":
        msg = pb.GetItem(index=draw(st.integers(0, 2**32 - 1)), found=draw(st.booleans()), more=draw(st.booleans()))
        msg.data, msg.tier = draw(st.binary(max_size=300)), draw(st.integers(-(2**31), 2**31 - 1))
        if draw(st.booleans()):
            msg.shm.CopyFrom(pb.ShmRange(segment=draw(texts), offset=draw(u64)))
        return msg.SerializeToString()
    if kind == "data":
        return draw(length_delimited(3, draw(st.binary(max_size=300))))
    if kind == "shm":
        return draw(length_delimited(5, draw(shm_bodies)))
    number = {"index": 1, "found": 2, "tier": 4, "more": 6}[kind]
    return draw(tags(number, 0)) + draw(varint_values)


@st.composite
def get_chunks(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 3)) == 0:
        items = [
            pb.GetItem(index=i, found=True, data=d)
            for i, d in draw(st.lists(st.tuples(st.integers(0, 9), st.binary())))
        ]
        return pb.GetResponse(items=items).SerializeToString()
    return draw(length_delimited(1, draw(messages(item_chunks(), ITEM_FIELDS))))


put_messages = messages(put_chunks(), PUT_FIELDS)
get_messages = messages(get_chunks(), GET_FIELDS)


# -- generated -> blockwire -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@settings(max_examples=400, deadline=None)
@given(put_messages)
def test_put_requests_decode_like_generated_code(data: bytes) -> None:
    assert check_put(data) is not None  # every such encoding is valid protobuf


@pytest.mark.timeout(60)
@settings(max_examples=400, deadline=None)
@given(get_messages)
def test_get_responses_decode_like_generated_code(data: bytes) -> None:
    assert check_get(data) is not None


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None)
@given(
    texts,
    st.lists(
        st.tuples(st.binary(max_size=20), st.binary(max_size=200), st.booleans(), u64, st.none() | texts), max_size=4
    ),
    st.lists(foreign_fields(PUT_FIELDS), max_size=3),
)
def test_generated_put_requests_with_unknown_fields(namespace: str, blocks: list, junk: list[bytes]) -> None:
    message = pb.PutRequest(namespace=namespace)
    for key, data, more, total_length, segment in blocks:
        block = message.blocks.add(key=key, data=data, more=more, total_length=total_length)
        if segment is not None:
            block.shm.segment = segment
    wire = message.SerializeToString()
    for data in (wire, b"".join(junk) + wire, wire + b"".join(junk)):
        values = check_put(data)
        assert values is not None and values[0] == namespace and len(values[1]) == len(blocks)


# -- raw bytes -> both ----------------------------------------------------------------------------

# Bytes that matter to a protobuf parser: tags of the known fields with every wire type, group
# starts and ends, continuation bytes, short lengths.
tokens = st.sampled_from(
    [bytes([n << 3 | w]) for n in range(7) for w in range(8)]
    + [b"\x80", b"\xff", b"\x7f", b"\x01", b"\x02", b"\x05", b"\x4b", b"\x4c", b"\x80\x80\x80\x80\x10", b"\xff" * 10]
)
soups = st.lists(tokens, max_size=40).map(b"".join)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    """A valid message with a few bytes flipped, inserted, removed, duplicated or cut off."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["set", "insert", "delete", "truncate", "duplicate"]))
        if op == "set" and at < len(data):
            data[at] = draw(st.one_of(st.integers(0, 255), st.sampled_from([0x00, 0x80, 0xFF, 0x0B, 0x0C, 0x04])))
        elif op == "insert":
            data[at:at] = draw(st.one_of(st.binary(min_size=1, max_size=4), tokens))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        elif op == "truncate":
            del data[at:]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


@st.composite
def stretched_fields(draw: st.DrawFn) -> bytes:
    """A field whose tag, length or varint value is padded to around what protobuf accepts (5, 5
    and 10 bytes), over a valid body."""
    number, wire_type = draw(st.integers(1, 6)), draw(st.sampled_from([0, 2]))
    head = varint(number << 3 | wire_type, draw(st.integers(1, 7)))
    if wire_type == 0:
        return head + varint(draw(wide_ints), draw(st.integers(1, 12)))
    body = draw(
        st.one_of(st.binary(max_size=8), messages(block_chunks(), BLOCK_FIELDS), messages(item_chunks(), ITEM_FIELDS))
    )
    return head + varint(len(body), draw(st.integers(1, 7))) + body


@pytest.mark.timeout(60)
@settings(max_examples=1500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=60),
        soups,
        st.lists(stretched_fields(), min_size=1, max_size=3).map(b"".join),
        mutated(put_messages),
        mutated(get_messages),
    )
)
def test_any_bytes_decode_or_fail_like_generated_code(data: bytes) -> None:
    check_put(data)
    check_get(data)


def _nested_groups(depth: int) -> bytes:
    return b"\x4b" * depth + b"\x4c" * depth


# Cases worked out against the generated code; each runs both decoders (outcomes noted for the reader).
CRAFTED = {
    "empty": b"",  # accepted
    "known field, wrong wire type": b"\x10\x01" + b"\x08\x05" + b"\x0d" + bytes(4),  # accepted: unknown fields
    "blocks as a group": b"\x13\x0a\x01k\x14",  # accepted
    "field 0": b"\x00\x01",  # refused
    "field 0 in a group": b"\x4b\x00\x01\x03\x04\x4c",  # accepted
    "field 0 in a sub-message": ld(1, b"\x00\x01") + ld(2, b"\x00\x01"),  # refused
    "largest field number": tag(MAX_FIELD, 0) + b"\x00",  # accepted
    "field number above 2**29-1": b"\x80\x80\x80\x80\x10\x00",  # refused
    "tag of 6 bytes": b"\x8a\x80\x80\x80\x80\x00\x00",  # refused
    "wire type 6": b"\x0e",  # refused
    "wire type 7 in a group": b"\x4b\x0f\x4c",  # refused
    "end-group at the top": b"\x4c",  # refused
    "mismatched end-group": b"\x4b\x54",  # refused
    "unclosed group": b"\x4b\x08\x01",  # refused
    "group open at the end of a sub-message": ld(2, b"\x4b") + b"\x4c",  # refused
    "100 nested groups": _nested_groups(100),  # accepted
    "101 nested groups": _nested_groups(101),  # refused
    "99 nested groups in a sub-message": ld(2, _nested_groups(99)) + ld(1, _nested_groups(99)),  # accepted
    "100 nested groups in a sub-message": ld(2, _nested_groups(100)),  # refused
    "98 nested groups in a ShmRange": ld(2, ld(3, _nested_groups(98))) + ld(1, ld(5, _nested_groups(98))),
    "99 nested groups in a ShmRange": ld(2, ld(3, _nested_groups(99))),  # refused
    "deep groups in an unknown field": ld(9, _nested_groups(300)),  # accepted: not parsed
    "length of 5 bytes": b"\x0a\x83\x80\x80\x80\x00abc",  # accepted
    "length of 6 bytes": b"\x0a\x83\x80\x80\x80\x80\x00abc",  # refused
    "varint of 10 bytes, bits above 64": ld(2, b"\x28" + b"\xff" * 9 + b"\x7f")
    + ld(1, b"\x08" + b"\xff" * 9 + b"\x7f"),
    "varint of 11 bytes": b"\x48" + b"\x80" * 10 + b"\x00",  # refused
    "bool and uint32 above 32 bits": ld(2, b"\x20" + varint(2**32))
    + ld(1, b"\x10" + varint(2**32) + b"\x08" + varint(2**32 + 5)),
    "bool at 2**64 (10 bytes)": ld(2, b"\x20" + b"\x80" * 9 + b"\x02") + ld(1, b"\x30" + b"\x80" * 9 + b"\x02"),
    "tier out of range": ld(1, b"\x20" + varint(2**31)) + ld(1, b"\x20" + varint(2**64 - 1)) + ld(1, b"\x20\x07"),
    "shm twice, merged": ld(2, ld(3, ld(1, b"s") + b"\x10\x05") + ld(3, b"\x18\x07"))
    + ld(1, ld(5, b"\x10\x05") + ld(5, b"\x10\x00")),
    "data twice, last wins": ld(2, ld(2, b"a") + ld(2, b"b")) + ld(1, ld(3, b"a") + ld(3, b"")),
    "packed-looking scalar": ld(2, ld(4, b"\x01")) + ld(1, ld(4, b"\x01")),  # accepted: unknown fields
    "invalid UTF-8": ld(1, b"\xff"),  # refused as a PutRequest
    "surrogate in UTF-8": ld(2, ld(3, ld(1, b"\xed\xa0\x80"))) + ld(1, ld(5, ld(1, b"\xed\xa0\x80"))),  # refused
    "invalid UTF-8 then valid": ld(1, b"\xc0\x80") + ld(1, b"ok"),  # refused
    "invalid UTF-8 in an unknown field": ld(9, b"\xff"),  # accepted
    "truncated": b"\x12\x05\x0a\x03ab",  # refused
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data", list(CRAFTED.values()), ids=list(CRAFTED))
def test_crafted_encodings_decode_or_fail_like_generated_code(data: bytes) -> None:
    check_put(data)
    check_get(data)


@pytest.mark.timeout(30)
def test_crafted_encodings_cut_short_decode_or_fail_like_generated_code() -> None:
    for data in CRAFTED.values():
        for cut in range(len(data)):
            check_put(data[:cut])
            check_get(data[:cut])


# -- blockwire -> generated -----------------------------------------------------------------------

shm_ranges = st.builds(bw.ShmRange, texts, u64, u64, seal_before_ns=u64)
block_data = st.one_of(st.binary(max_size=200), st.lists(st.binary(max_size=50), max_size=3).map(tuple))
put_data = st.one_of(block_data, shm_ranges, st.builds(bw.BlockPart, block_data, st.booleans(), u64))


def _joined(data: object) -> bytes:
    return b"".join(data) if isinstance(data, tuple) else bytes(data)  # type: ignore[arg-type]


def _expected_block(key: bytes, data: object) -> BlockValues:
    if isinstance(data, bw.ShmRange):
        return key, b"", _bw_shm(data), False, 0
    if isinstance(data, bw.BlockPart):
        return key, _joined(data.data), None, data.more, data.total_length
    return key, _joined(data), None, False, 0


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.tuples(st.binary(max_size=20), put_data), max_size=5))
@example("", [(b"", b"")])
@example("ns", [(b"", bw.ShmRange("", 0, 0)), (b"k", bw.BlockPart((b"a", b"b"), True, 2)), (b"", (b"",))])
def test_encoded_put_requests_parse_with_generated_code(namespace: str, blocks: list) -> None:
    wire = bw.encode_put_request(namespace, blocks)
    expected = (namespace, [_expected_block(k, d) for k, d in blocks])
    assert _pb_put(wire) == expected
    assert pb.PutRequest.FromString(wire).SerializeToString() == wire
    assert check_put(wire) == expected


get_data = st.one_of(st.binary(max_size=200), shm_ranges, st.builds(bw.GetPart, st.binary(max_size=200), st.booleans()))
tiers = st.one_of(st.sampled_from([0, 1, 2, 3]), st.integers(0, 2**31 - 1))


def _expected_item(index: int, found: bool, data: object, tier: int) -> ItemValues:
    if isinstance(data, bw.ShmRange):
        return index, found, b"", tier, _bw_shm(data), False
    if isinstance(data, bw.GetPart):
        return index, found, bytes(data.data), tier, None, data.more
    return index, found, bytes(data), tier, None, False  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.booleans(), get_data, tiers), max_size=5))
@example([(0, False, b"", 0)])
@example([(0, True, bw.ShmRange("", 0, 0), 0), (2**32 - 1, True, bw.GetPart(b"", True), 3), (1, True, b"x", 1)])
def test_encoded_get_responses_parse_with_generated_code(items: list) -> None:
    wire = bw.encode_get_response(items)
    expected = [_expected_item(*item) for item in items]
    assert _pb_get(wire) == expected
    assert pb.GetResponse.FromString(wire).SerializeToString() == wire
    assert check_get(wire) == expected
