"""KVCache.PutOne (docs/proto.md): a Put of one message as a unary call. Real servers on free ports,
raw gRPC calls beside the SDK's."""

from __future__ import annotations

import os
import re
from pathlib import Path

import grpc
import pytest

from kvcache_client import KVCacheClient, PermissionDenied
from kvcache_core.blockwire import encode_put_request
from kvcache_proto import kvcache_pb2 as pb
from kvcache_server.auth import METHOD_RIGHTS, Right
from kvcache_server.service import KVCacheService
from tests.conftest import keyed
from tests.test_bulk import RO, RW, auth_config

pytestmark = pytest.mark.timeout(60)

PROTO = Path(__file__).resolve().parent.parent / "proto" / "kvcache" / "v1" / "kvcache.proto"
NO_BULK = {"bulk": {"enabled": False}, "shm": {"enabled": False}}  # every put on gRPC


def raw_put_one(target: str, message: bytes, token: str = "") -> pb.PutResponse:
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/kvcache.v1.KVCache/PutOne", lambda b: b, pb.PutResponse.FromString)
        return call(message, timeout=10, metadata=md)


def calls_of(client: KVCacheClient) -> dict[str, int]:
    """Counts the Put and PutOne calls the client's gRPC transport makes."""
    transport = getattr(client._transport, "inner", client._transport)
    counts = {"Put": 0, "PutOne": 0}
    put, put_one = transport._put, transport._put_one

    def counted_put(*a, **k):  # type: ignore[no-untyped-def]
        counts["Put"] += 1
        return put(*a, **k)

    def counted_put_one(*a, **k):  # type: ignore[no-untyped-def]
        counts["PutOne"] += 1
        return put_one(*a, **k)

    transport._put, transport._put_one = counted_put, counted_put_one
    return counts


def test_every_rpc_of_the_service_needs_a_right_but_info() -> None:
    """A method missing from METHOD_RIGHTS is open to every authenticated token: a write RPC added
    without its entry would let read-only tokens write. Every rpc the proto declares has one."""
    declared = set(re.findall(r"^\s*rpc (\w+)\(", PROTO.read_text(), re.M))
    assert "PutOne" in declared and "Put" in declared
    assert declared - set(METHOD_RIGHTS) == {"Info"}
    assert METHOD_RIGHTS["PutOne"] is Right.WRITE


def test_put_one_stores_as_put_and_refuses_as_put(make_server) -> None:
    server = make_server(ram={"capacity_bytes": 64 << 20}, **NO_BULK)
    items = [keyed(os.urandom(n)) for n in (100, 16 << 10, 1 << 20)]
    answer = raw_put_one(server.target, encode_put_request("ns", items))
    assert (answer.stored, answer.rejected) == (3, 0)
    with KVCacheClient(server.target, shm=False) as client:
        got = client.get_many("ns", [k for k, _ in items])
    assert [bytes(g) for g in got] == [b for _, b in items]
    (k1, b1), (k2, b2) = keyed(os.urandom(4096)), keyed(os.urandom(4096))
    damaged = bytearray(b2)
    damaged[-1] ^= 1
    with pytest.raises(grpc.RpcError) as err:
        raw_put_one(server.target, encode_put_request("ns", [(k1, b1), (k2, bytes(damaged))]))
    assert err.value.code() is grpc.StatusCode.DATA_LOSS and "block 1" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        raw_put_one(server.target, b"\xff\xff\xff not a PutRequest")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert sum(server.call(server.stack.ram.contains_many("ns", [k1, k2]))) == 0  # the message is all or nothing


def test_put_one_needs_the_write_right(make_server, tmp_path: Path) -> None:
    server = make_server(ram={"capacity_bytes": 64 << 20}, **NO_BULK, **auth_config(tmp_path))
    key, block = keyed(os.urandom(4096))
    message = encode_put_request("ns", [(key, block)])
    with pytest.raises(grpc.RpcError) as err:
        raw_put_one(server.target, message, RO)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED and "write" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        raw_put_one(server.target, message)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert raw_put_one(server.target, message, RW).stored == 1
    with KVCacheClient(server.target, shm=False, token=RO) as client, pytest.raises(PermissionDenied):
        client.put_many("ns", [keyed(os.urandom(4096))])


def test_the_sdk_sends_one_message_as_put_one_and_more_as_put(make_server) -> None:
    server = make_server(ram={"capacity_bytes": 64 << 20}, **NO_BULK)
    small = [keyed(os.urandom(16 << 10)) for _ in range(8)]
    large = [keyed(os.urandom(3 << 20)) for _ in range(3)]  # 9 MiB: several messages of about 4 MiB
    with KVCacheClient(server.target, shm=False) as client:
        counts = calls_of(client)
        assert client.put_many("ns", small).stored == 8
        assert counts == {"Put": 0, "PutOne": 1}
        assert client.put_many("ns", large).stored == 3
        assert counts == {"Put": 1, "PutOne": 1}
        got = client.get_many("ns", [k for k, _ in small + large])
    assert [bytes(g) for g in got] == [b for _, b in small + large]


def test_a_server_without_put_one_gets_put_streams(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that predates PutOne answers UNIMPLEMENTED having stored nothing: the SDK sends the
    same message as a Put, and every later put as Put streams, without asking again."""

    async def unimplemented(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(KVCacheService, "PutOne", unimplemented)
    server = make_server(ram={"capacity_bytes": 64 << 20}, **NO_BULK)
    first, second = [keyed(os.urandom(4096)) for _ in range(2)], [keyed(os.urandom(4096)) for _ in range(2)]
    with KVCacheClient(server.target, shm=False) as client:
        counts = calls_of(client)
        assert client.put_many("ns", first).stored == 2
        assert counts == {"Put": 1, "PutOne": 1}
        assert client.put_many("ns", second).stored == 2
        assert counts == {"Put": 2, "PutOne": 1}
        got = client.get_many("ns", [k for k, _ in first + second])
    assert [bytes(g) for g in got] == [b for _, b in first + second]
