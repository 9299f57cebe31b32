"""Authentication, rights, tenant isolation in every tier, quotas, rate limits, TLS and mTLS."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcache_client import (
    KVCacheClient,
    Namespace,
    PermissionDenied,
    ResourceExhausted,
    TLSConfig,
    Unauthenticated,
    Unavailable,
)
from kvcache_core.format import decode_block
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import METHOD_RIGHTS, token_digest
from tests.backends import RedisProcess, S3Process, make_certs, wait_for
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(120)

TOKENS = {
    "a": "kvc_token_for_tenant_a_rw",
    "b": "kvc_token_for_tenant_b_rw",
    "a-reader": "kvc_token_for_tenant_a_read_only",
    "ops": "kvc_token_for_ops_admin",
    "slow": "kvc_token_for_rate_limited_tenant",
}


def tokens_file(tmp: Path, *, quota: str = "0", rate: float = 0.0) -> Path:
    entries = [
        ("a", "a", '["read", "write"]'),
        ("b", "b", '["read", "write"]'),
        ("a-reader", "a", '["read"]'),
        ("ops", "ops", '["admin"]'),
        ("slow", "slow", '["read", "write"]'),
    ]
    text = ""
    for name, tenant, rights in entries:
        text += f'[[tokens]]\nname = "{name}"\ntenant = "{tenant}"\nsha256 = "{token_digest(TOKENS[name]).hex()}"\n'
        text += f"rights = {rights}\n\n"
    text += f'[tenants.a]\nram_quota_bytes = "{quota}"\n[tenants.b]\nram_quota_bytes = "{quota}"\n'
    text += f"[tenants.slow]\nrequests_per_s = {rate or 5.0}\nburst = 5\n"
    path = tmp / "tokens.toml"
    path.write_text(text)
    return path


@pytest.fixture
def secured(make_server, tmp_path: Path) -> ServerThread:
    return make_server(auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))})


NS = Namespace(model_id="org/model", kv_dtype="float16", chunk_tokens=4, num_layers=1, num_kv_heads=1, head_size=4)


def stub_calls(stub: pb_grpc.KVCacheStub, metadata: tuple) -> dict[str, object]:
    key = os.urandom(16)
    put = pb.PutRequest(namespace="n", blocks=[pb.Block(key=key, data=raw_block(key, b"x"))])
    return {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(namespace="n", keys=[key]), metadata=metadata, timeout=5),
        "Get": lambda: list(stub.Get(pb.GetRequest(namespace="n", keys=[key]), metadata=metadata, timeout=5)),
        "Put": lambda: stub.Put(iter([put]), metadata=metadata, timeout=5),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(namespace="n", keys=[key]), metadata=metadata, timeout=5),
        "Stats": lambda: stub.Stats(pb.StatsRequest(), metadata=metadata, timeout=5),
        "Info": lambda: stub.Info(pb.InfoRequest(), metadata=metadata, timeout=5),
        "WatchEvents": lambda: next(iter(stub.WatchEvents(pb.WatchEventsRequest(), metadata=metadata, timeout=0.5))),
    }


def test_every_rpc_of_the_proto_has_a_right_but_info() -> None:
    """Authenticator.check lets any valid token call a method missing from METHOD_RIGHTS: a write RPC
    added to the proto without its entry would be open to read-only tokens. Every rpc the proto
    declares has one, Info alone (every token may ask it) excepted, and no entry names a method the
    proto does not have."""
    proto = Path(__file__).resolve().parent.parent / "proto" / "kvcache" / "v1" / "kvcache.proto"
    declared = set(re.findall(r"^\s*rpc (\w+)\(", proto.read_text(), re.M))
    assert {"Lookup", "Put", "Get", "Info"} <= declared
    assert declared - set(METHOD_RIGHTS) == {"Info"}
    assert set(METHOD_RIGHTS) <= declared


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((), dict.fromkeys(["Lookup", "Get", "Put", "Delete", "Stats", "Info", "WatchEvents"], "UNAUTHENTICATED")),
        ((("authorization", "Bearer wrong"),), dict.fromkeys(["Lookup", "Put", "Stats"], "UNAUTHENTICATED")),
        ((("authorization", "Basic " + TOKENS["a"]),), {"Lookup": "UNAUTHENTICATED"}),
        (
            (("authorization", "Bearer " + TOKENS["a-reader"]),),
            {
                "Lookup": "OK",
                "Get": "OK",
                "Put": "PERMISSION_DENIED",
                "Delete": "PERMISSION_DENIED",
                "Stats": "PERMISSION_DENIED",
                "Info": "OK",
                "WatchEvents": "DEADLINE_EXCEEDED",
            },
        ),
        (
            (("authorization", "Bearer " + TOKENS["a"]),),
            {"Lookup": "OK", "Get": "OK", "Put": "OK", "Delete": "OK", "Stats": "PERMISSION_DENIED"},
        ),
        (
            (("authorization", "Bearer " + TOKENS["ops"]),),
            {"Stats": "OK", "Info": "OK", "Lookup": "PERMISSION_DENIED", "Put": "PERMISSION_DENIED"},
        ),
    ],
    ids=["no-token", "bad-token", "wrong-scheme", "read-only", "read-write", "admin"],
)
def test_every_rpc_needs_a_valid_token_and_the_right(secured: ServerThread, metadata: tuple, expected: dict) -> None:
    with grpc.insecure_channel(secured.target) as channel:
        calls = stub_calls(pb_grpc.KVCacheStub(channel), metadata)
        got = {method: code_of(calls[method]).name for method in expected}
        assert got == expected
        # Health needs no token.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_sdk_takes_a_token_from_argument_or_environment(secured: ServerThread, monkeypatch) -> None:
    keys = KVCacheClient.chunk_keys(list(range(8)), NS)
    with KVCacheClient(secured.target) as anonymous, pytest.raises(Unauthenticated):
        anonymous.lookup(NS, keys)
    with KVCacheClient(secured.target, token=TOKENS["a-reader"]) as reader, pytest.raises(PermissionDenied):
        reader.put_many(NS, [(keys[0], raw_block(keys[0], b"x"))])
    monkeypatch.setenv("KVCACHE_TOKEN", TOKENS["a"])
    with KVCacheClient(secured.target) as client:
        assert client.put_many(NS, [(keys[0], raw_block(keys[0], b"x"))]).stored == 1
        assert client.lookup(NS, keys).prefix_length == 1


def test_in_place_calls_obey_tokens_and_tenants(make_server, tmp_path: Path) -> None:
    # Several tenants share one arena only when told (by default the server does not hand it out:
    # tests/test_arena_trust.py); here they are, so that tokens and tenants can be tried on it.
    secured = make_server(
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
        shm={"dir": str(tmp_path / "shm"), "share_arena_across_tenants": True},
    )
    key, block = keyed(os.urandom(1 << 20))  # large enough to go through a segment into an arena slot
    a = KVCacheClient(secured.target, token=TOKENS["a"])
    reader = KVCacheClient(secured.target, token=TOKENS["a-reader"])
    b = KVCacheClient(secured.target, token=TOKENS["b"])
    with a, reader, b:
        assert a.put_many("n", [(key, block)]).stored == 1
        with pytest.raises(PermissionDenied):
            reader.put_many("n", [(os.urandom(16), block)])  # Put needs the write right
        assert reader._transport.arena.state == "on"  # a refused right is not a reason to leave the path
        assert bytes(reader.get_many("n", [key])[0]) == block  # same tenant, read right
        assert b.get_many("n", [key]) == [None]  # another tenant: a miss, in place as inline
        assert (a._transport.arena.state, b._transport.arena.state) == ("on", "on")
    with KVCacheClient(secured.target, token=TOKENS["ops"]) as ops:
        stats = ops.stats()
    assert stats.inplace_bytes_received == stats.shm_bytes_received == len(block)  # only tenant a's put came in
    assert stats.inplace_bytes_leased == len(block)  # only the reader's hit went out
    assert stats.shm_bytes_sent == 0

    def call(token: str) -> tuple[pb_grpc.KVCacheStub, tuple[tuple[str, str], ...]]:
        return pb_grpc.KVCacheStub(grpc.insecure_channel(secured.target)), (("authorization", f"Bearer {token}"),)

    sa, ma = call(TOKENS["a"])
    sb, mb = call(TOKENS["b"])
    (lease,) = sa.LeaseGet(pb.LeaseGetRequest(namespace="n", keys=[key]), metadata=ma, timeout=5).leases
    assert lease.id and sb.LeaseRelease(pb.LeaseReleaseRequest(leases=[lease.id]), metadata=mb, timeout=5).released == 0
    assert sa.LeaseRelease(pb.LeaseReleaseRequest(leases=[lease.id]), metadata=ma, timeout=5).released == 1
    with pytest.raises(grpc.RpcError) as info:  # no tenant is handed a writable slot
        sa.ArenaReserve(pb.ArenaReserveRequest(namespace="n", lengths=[len(block)]), metadata=ma, timeout=5)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_rate_limit_answers_resource_exhausted(secured: ServerThread) -> None:
    with KVCacheClient(secured.target, token=TOKENS["slow"]) as client:
        keys = [os.urandom(16)]
        for _ in range(5):  # the burst
            client.lookup("n", keys)
        with pytest.raises(ResourceExhausted) as info:
            client.lookup("n", keys)
        assert "rate limit" in info.value.details
    with KVCacheClient(secured.target, token=TOKENS["a"]) as other:  # other tenants are not affected
        for _ in range(20):
            other.lookup("n", keys)


def test_info_has_a_rate_bucket_of_its_own(secured: ServerThread) -> None:
    """Info is not charged to a tenant's calls (the SDK asks it to map the presence index), but a
    flood of Info calls is bounded all the same, per tenant, at the tenant's rate."""
    channel = grpc.insecure_channel(secured.target)
    stub = pb_grpc.KVCacheStub(channel)
    md = (("authorization", f"Bearer {TOKENS['slow']}"),)
    codes = []
    for _ in range(20):
        try:
            stub.Info(pb.InfoRequest(), metadata=md, timeout=5)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    channel.close()
    assert codes[:5] == [grpc.StatusCode.OK] * 5  # the burst
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    with KVCacheClient(secured.target, token=TOKENS["slow"]) as client:  # the calls' own bucket is whole
        client.lookup("n", [os.urandom(16)])


def test_tenants_never_meet_in_any_tier(
    make_server, tmp_path: Path, redis_server: RedisProcess, s3_server: S3Process
) -> None:
    server: ServerThread = make_server(
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path))},
        redis={"enabled": True, "url": redis_server.url},
        s3={
            "enabled": True,
            "bucket": "kv-sec",
            "endpoint_url": s3_server.endpoint,
            "path_style": True,
            "create_bucket": True,
            "write_mode": "through",
        },
    )
    tokens = list(range(100, 112))  # same prompt, same salt, same namespace for both tenants
    a, b = KVCacheClient(server.target, token=TOKENS["a"]), KVCacheClient(server.target, token=TOKENS["b"])
    with a, b:
        keys = a.chunk_keys(tokens, NS)
        a.put_many(NS, [(k, raw_block(k, b"A-secret-" + bytes([i]))) for i, k in enumerate(keys)])
        # B cannot find, read or delete A's blocks: a miss, exactly as for keys nobody stored.
        assert b.lookup(NS, keys).prefix_length == 0
        assert b.get_many(NS, keys) == [None] * len(keys)
        assert b.delete(NS, keys) == 0
        # B writing the same keys does not overwrite A's blocks.
        b.put_many(NS, [(k, raw_block(k, b"B-other")) for k in keys])
        for block in a.get_many(NS, keys):
            assert block is not None and bytes(decode_block(block, verify=False)[1]).startswith(b"A-secret-")
        for block in b.get_many(NS, keys):
            assert block is not None and bytes(decode_block(block, verify=False)[1]) == b"B-other"
        # The same holds below RAM: drop RAM and read from Redis, then from S3.
        for tenant in ("a", "b"):
            server.stack.ram.delete_many_sync(f"{tenant}:{NS.name}", keys)
        redis_keys = {k.decode() for k in redis_server.client().keys("*")}
        assert redis_keys == {f"kvcache/{t}:{NS.name}/{k.hex()}" for t in "ab" for k in keys}
        listed = s3_server.client().list_objects_v2(Bucket="kv-sec")["Contents"]
        assert {o["Key"] for o in listed} == redis_keys
        redis_server.client().flushall()
        assert bytes(decode_block(a.get_many(NS, keys[:1])[0], keys[0])[1]).startswith(b"A-secret-")  # type: ignore[arg-type]
        assert bytes(decode_block(b.get_many(NS, keys[:1])[0], keys[0])[1]) == b"B-other"  # type: ignore[arg-type]
        # Lookups of the other tenant's keys answer exactly like lookups of keys nobody has.
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVCacheStub(channel)
            md = (("authorization", "Bearer " + TOKENS["b"]),)
            theirs = stub.Lookup(pb.LookupRequest(namespace="x", keys=keys), metadata=md, timeout=5)
            a.put_many("x", [(keys[0], raw_block(keys[0], b"only-a"))])
            nobody = stub.Lookup(pb.LookupRequest(namespace="x", keys=[os.urandom(16)]), metadata=md, timeout=5)
            after = stub.Lookup(pb.LookupRequest(namespace="x", keys=keys), metadata=md, timeout=5)
            assert theirs.SerializeToString() == nobody.SerializeToString() == after.SerializeToString() == b""


def test_events_only_show_the_callers_tenant(secured: ServerThread) -> None:
    with grpc.insecure_channel(secured.target) as channel:
        stream = pb_grpc.KVCacheStub(channel).WatchEvents(
            pb.WatchEventsRequest(), metadata=(("authorization", "Bearer " + TOKENS["b"]),)
        )
        wait_for(lambda: secured.stack.events.subscribers == 1, what="subscriber")
        with (
            KVCacheClient(secured.target, token=TOKENS["a"]) as a,
            KVCacheClient(secured.target, token=TOKENS["b"]) as b,
        ):
            a.put_many("shared", [keyed(b"a")])
            key = os.urandom(16)
            b.put_many("shared", [(key, raw_block(key, b"b"))])
        event = next(iter(stream))
        assert (event.namespace, list(event.keys)) == ("shared", [key])  # B's own event, tenant prefix hidden
        stream.cancel()


def test_a_tenants_flood_evicts_only_its_own_blocks(make_server, tmp_path: Path) -> None:
    quota = 1 << 20
    server: ServerThread = make_server(
        ram={"capacity_bytes": 2 * quota},
        auth={"enabled": True, "tokens_file": str(tokens_file(tmp_path, quota=str(quota)))},
    )
    with KVCacheClient(server.target, token=TOKENS["a"]) as a, KVCacheClient(server.target, token=TOKENS["b"]) as b:
        b_keys = [os.urandom(16) for _ in range(20)]
        b.put_many("n", [(k, raw_block(k, os.urandom(16 << 10))) for k in b_keys])  # 320 KiB: within B's share
        for _ in range(40):  # A floods 10 MiB
            a.put_many("n", [keyed(os.urandom(32 << 10)) for _ in range(8)])
        assert b.lookup("n", b_keys).prefix_length == 20  # B's hit rate untouched
        assert all(x is not None for x in b.get_many("n", b_keys))
    ram = server.stack.ram
    assert ram.tenant_used_bytes("a") <= quota and ram.used_bytes <= 2 * quota
    assert ram.stats().evictions > 0


def tls_server(make_server, certs: dict[str, Path], *, mtls: bool, **extra):
    tls = {"cert_file": str(certs["server.crt"]), "key_file": str(certs["server.key"])}
    if mtls:
        tls["client_ca_file"] = str(certs["ca.crt"])
    return make_server(tls=tls, **extra)


def test_tls_verifies_the_server(make_server, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server: ServerThread = tls_server(make_server, certs, mtls=False, metrics={"enabled": True, "port": 0})
    with KVCacheClient(server.target, tls=TLSConfig(ca_file=str(certs["ca.crt"])), timeout_s=5) as client:
        assert client.put_many("n", [keyed(b"over tls")]).stored == 1
    for bad in (TLSConfig(ca_file=str(certs["rogue-ca.crt"])), True, False):  # wrong CA, system roots, plaintext
        with KVCacheClient(server.target, tls=bad, timeout_s=3) as client, pytest.raises(Unavailable):
            client.stats()
    # The metrics port speaks TLS with the same certificate.
    context = ssl.create_default_context(cafile=str(certs["ca.crt"]))
    url = f"https://127.0.0.1:{server.running.metrics_port}/metrics"
    assert b"kvcache_tier_puts_total" in urllib.request.urlopen(url, context=context, timeout=5).read()


def test_mtls_requires_a_client_certificate_from_the_ca(make_server, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server: ServerThread = tls_server(make_server, certs, mtls=True)
    ca = str(certs["ca.crt"])
    good = TLSConfig(ca_file=ca, cert_file=str(certs["client.crt"]), key_file=str(certs["client.key"]))
    with KVCacheClient(server.target, tls=good, timeout_s=5) as client:
        assert client.stats().tier("ram").blocks == 0
    rogue = TLSConfig(ca_file=ca, cert_file=str(certs["rogue-client.crt"]), key_file=str(certs["rogue-client.key"]))
    for bad in (TLSConfig(ca_file=ca), rogue):
        with KVCacheClient(server.target, tls=bad, timeout_s=3) as client, pytest.raises(Unavailable):
            client.stats()


def test_unauthenticated_non_loopback_needs_explicit_force(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "kvcache_server", "--host", "0.0.0.0", "--port", "0"]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "without authentication" in refused.stderr
    proc = subprocess.Popen(
        [*base, "--set", "auth.allow_unauthenticated=true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert "no auth" in proc.stdout.readline()  # type: ignore[union-attr]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert "WITHOUT authentication" in err


def test_stream_and_metadata_bounds(make_server) -> None:
    server: ServerThread = make_server(limits={"max_put_stream_blocks": 10, "max_metadata_bytes": 1024})
    with KVCacheClient(server.target) as client:
        with pytest.raises(ResourceExhausted, match="max_put_stream_blocks=10"):
            client.put_many("n", [keyed(b"x") for _ in range(11)])
        assert client.put_many("n", [keyed(b"x") for _ in range(10)]).stored == 10
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(), metadata=(("x-big", "v" * 4096),), timeout=5)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
