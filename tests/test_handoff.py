"""Same-host clients of two other Unix users keep the shared-memory path (issue 22, invariant 3).

The server's shm directory is owner-only, so a client of another user could not create segments in
it and moved every byte over gRPC. Now it hands the server memfds over the segment socket
(kvcache_server/handoff.py). The test creates two Unix users, runs a real server (auth on, tenants a
and b), runs each tenant's client as its own user in its own process, and checks: both move their
bytes through shared memory (the server's shm byte counters, the clients' `shm.state`, no
fallback), every byte comes back; neither user can open the other's memory, the shm directory or
the arena; a handed segment named by the other tenant is refused; the socket refuses what it must
(a bad token, no HELLO, a descriptor that is not shared memory, more segments than its cap).

On the code before the change (the same test's client part): `shm.state` was "off" for both users
and the server's shm byte counters stayed at 0.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import token_digest
from kvcache_server.handoff import HandoffListener, HandoffRegistry
from tests.conftest import ServerThread

pytestmark = pytest.mark.timeout(240)

USERS = ("kvcache-test-a", "kvcache-test-b")
TOKENS = {"a": "kvc_handoff_tenant_a_token", "b": "kvc_handoff_tenant_b_token", "ops": "kvc_handoff_ops_token"}
REPO = Path(__file__).resolve().parents[1]


def _md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def _need_root() -> None:
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tests/test_handoff.py creates Unix users: CI runs it as root with useradd and setpriv")
        pytest.skip("creating Unix users needs root, useradd and setpriv")


def _uid(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "-M", "-s", "/usr/sbin/nologin", name], check=True)
        return pwd.getpwnam(name).pw_uid


@pytest.fixture(scope="module")
def users() -> dict[str, int]:
    _need_root()
    return {"a": _uid(USERS[0]), "b": _uid(USERS[1])}


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is 0700): the socket lives in it."""
    d = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _tokens(tmp: Path) -> Path:
    text = ""
    for name, rights in (("a", '["read", "write"]'), ("b", '["read", "write"]'), ("ops", '["admin"]')):
        text += f'[[tokens]]\nname = "{name}"\ntenant = "{name}"\nsha256 = "{token_digest(TOKENS[name]).hex()}"\n'
        text += f"rights = {rights}\n\n"
    path = tmp / "tokens.toml"
    path.write_text(text)
    return path


def _server(make_server, place: Path, **shm: object) -> ServerThread:  # type: ignore[no-untyped-def]
    (place / "shm").mkdir(mode=0o700)
    return make_server(
        ram={"capacity_bytes": 64 << 20},
        shm={"dir": str(place / "shm"), "socket_path": str(place / "seg.sock"), **shm},
        auth={"enabled": True, "tokens_file": str(_tokens(place))},
    )


CLIENT = r"""
import asyncio, json, os, sys
from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.format import encode_block
args = json.loads(sys.argv[1])


def blocks(tag):
    items = []
    for i in range(args["n"]):
        key = (tag + str(i)).encode().ljust(16, b"\0")
        payload = bytes([i % 251]) * args["size"]
        items.append((key, encode_block(payload, key=key, dtype="uint8", shape=(len(payload),))))
    return items


def report(c, items, got):
    out = {"uid": os.geteuid(), "pid": os.getpid()}
    out["identical"] = sum(1 for (k, v), g in zip(items, got) if g is not None and bytes(g) == v)
    link = c._transport.shm
    out["state"], out["reason"], out["fallbacks"] = link.state, link.reason, link.fallbacks
    idle = link.pool._idle if link.pool is not None else []
    out["segments"], out["fds"] = [s.name for s in idle], [s.fd for s in idle]
    for probe in args.get("probe", []):
        try:
            os.open(probe, os.O_RDONLY)
            out.setdefault("opened", []).append(probe)
        except OSError as exc:
            out.setdefault("refused", []).append([probe, exc.errno])
    print(json.dumps(out), flush=True)


async def run_async():
    async with AsyncKVCacheClient(args["target"], token=args["token"], timeout_s=20) as c:
        for round in range(args.get("rounds", 1)):
            items = blocks(f"{args['tag']}{round}-")
            await c.put_many(args["ns"], items)
            report(c, items, await c.get_many(args["ns"], [k for k, _ in items]))
            sys.stdin.readline()


if args.get("asyncio"):
    asyncio.run(run_async())
else:
    with KVCacheClient(args["target"], token=args["token"], timeout_s=20) as c:
        for round in range(args.get("rounds", 1)):
            items = blocks(f"{args['tag']}{round}-")
            c.put_many(args["ns"], items)
            report(c, items, c.get_many(args["ns"], [k for k, _ in items]))
            sys.stdin.readline()
"""


def _as(uid: int, args: dict) -> subprocess.Popen[str]:  # type: ignore[type-arg]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": f"{REPO}/client:{REPO}:{REPO}/connectors"}
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", CLIENT]
    return subprocess.Popen(
        [*cmd, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen[str], timeout_s: float = 90.0) -> dict:  # type: ignore[type-arg]
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout_s)
        raise AssertionError(f"client failed: {proc.stderr.read() if proc.stderr else ''}")
    return json.loads(line)


def _finish(proc: subprocess.Popen[str]) -> None:  # type: ignore[type-arg]
    if proc.stdin is not None:
        proc.stdin.close()
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""


def _stats(server: ServerThread) -> pb.StatsResponse:
    with grpc.insecure_channel(server.target) as ch:
        return pb_grpc.KVCacheStub(ch).Stats(pb.StatsRequest(), timeout=10, metadata=_md("ops"))


def test_two_users_keep_the_shared_memory_path_and_cannot_reach_each_other(users, place, make_server) -> None:
    server = _server(make_server, place)
    with grpc.insecure_channel(server.target) as ch:
        info = pb_grpc.KVCacheStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=_md("a"))
    assert info.shm_socket == str(place / "seg.sock") and info.server_uid == os.geteuid()
    arena = info.arena_path
    size, n = 256 << 10, 8  # above the 64 KiB under which puts stay inline
    base = {"target": server.target, "n": n, "size": size}
    a = _as(users["a"], base | {"token": TOKENS["a"], "ns": "m", "tag": "a", "rounds": 2})
    try:
        ra = _result(a)
        assert a.stdin is not None
        a.stdin.write("\n")
        a.stdin.flush()
        again = _result(a)
        # Pooled: the second round's calls used the segments the first handed over (before the fix
        # of the liveness probe, each call waited out a 2 s socket timeout and handed over new ones).
        assert again["segments"] == ra["segments"] and again["identical"] == n and again["fallbacks"] == 0
        probes = [f"/proc/{ra['pid']}/fd/{fd}" for fd in ra["fds"]] + [str(place / "shm")]
        probes += [arena] if arena else []
        b = _as(users["b"], base | {"token": TOKENS["b"], "ns": "m", "tag": "b", "probe": probes, "asyncio": True})
        rb = _result(b)
        _finish(b)
        # Tenant b names tenant a's handed segment in a Get of its own: refused as unknown.
        with grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.KVCacheStub(ch)
            request = pb.GetRequest(namespace="m", keys=[b"b0-0".ljust(16, b"\0")])
            request.shm.segment, request.shm.capacity = ra["segments"][0], 1 << 20
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Get(request, timeout=10, metadata=_md("b")))
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        _finish(a)
    for r, who in ((ra, "a"), (rb, "b")):
        assert r["uid"] == users[who]
        assert r["state"] == "on", r["reason"]  # before: "off" (the directory is not this user's)
        assert r["fallbacks"] == 0 and r["identical"] == n
    assert "opened" not in rb, rb["opened"]  # b opened none of a's memfds, nor the directory or arena
    assert len(rb["refused"]) == len(probes)
    stats = _stats(server)
    # Both users' puts came through their segments, and their gets went back through them (before: 0, 0).
    assert stats.shm_bytes_received >= 2 * n * size
    assert stats.shm_bytes_sent >= 2 * n * size


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(path))
    return s


def test_the_socket_refuses_bad_tokens_silence_and_foreign_descriptors(users, place, make_server) -> None:
    server = _server(make_server, place, max_segments_per_connection=2)
    sock_path = place / "seg.sock"
    listener = server.running.handoff
    assert listener is not None
    with _connect(sock_path) as s:  # a wrong token
        s.send(b"Hnot-a-token")
        assert s.recv(4096).startswith(b"E") and s.recv(4096) == b""
    with _connect(sock_path) as s:  # a descriptor before HELLO
        fd = os.memfd_create("x")
        socket.send_fds(s, [b"A"], [fd])
        os.close(fd)
        assert s.recv(4096).startswith(b"E") and s.recv(4096) == b""
    with _connect(sock_path) as s:
        s.send(b"H" + TOKENS["a"].encode())
        assert s.recv(4096) == b"K"
        with open(place / "plain", "w+b") as f:  # a file on disk: a read could stall; refused
            socket.send_fds(s, [b"A"], [f.fileno()])
            assert s.recv(4096).startswith(b"Esegment refused")
        fd = os.memfd_create("ro")
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        socket.send_fds(s, [b"A"], [ro])  # read-only: the server could not write a get into it
        assert s.recv(4096).startswith(b"Esegment refused")
        os.close(ro)
        names = []
        for _ in range(2):
            socket.send_fds(s, [b"A"], [fd])
            reply = s.recv(4096)
            assert reply.startswith(b"Kkvcache-fd-"), reply
            names.append(reply[1:].decode())
        socket.send_fds(s, [b"A"], [fd])  # past the cap of 2
        assert s.recv(4096).startswith(b"E")
        assert listener.registry.count() == 2
        s.send(b"D" + names[0].encode())
        deadline = time.monotonic() + 10
        while listener.registry.count() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.registry.count() == 1
        os.close(fd)
    deadline = time.monotonic() + 10  # its connection closed: its segments are gone with it
    while listener.registry.count() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.registry.count() == 0
    silent = _connect(sock_path)  # says nothing: closed after the HELLO deadline (5 s)
    started = time.monotonic()
    assert silent.recv(4096) == b""
    assert time.monotonic() - started < 9
    silent.close()
    assert listener.connections == 0
    assert listener.refused == 6


def test_a_restarted_socket_is_followed(users, place, make_server) -> None:
    """The server's segment socket went away and came back (a restart): the client sees its pooled
    segments' connection closed, drops them and hands new ones over a new connection; no call goes
    inline, none fails."""
    server = _server(make_server, place)
    size, n = 256 << 10, 4
    proc = _as(
        users["a"],
        {"target": server.target, "n": n, "size": size, "token": TOKENS["a"], "ns": "m", "tag": "r", "rounds": 3},
    )
    try:
        first = _result(proc)
        assert first["state"] == "on" and first["fallbacks"] == 0
        old = server.running.handoff
        assert old is not None
        old.stop()
        new = HandoffListener(old.path, HandoffRegistry(), old._authenticate)
        new.start()
        server.running.handoff = server.running.service.handoff = new
        received = _stats(server).shm_bytes_received
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        second = _result(proc)
        assert second["state"] == "on" and second["identical"] == n
        assert second["fallbacks"] == 0
        assert _stats(server).shm_bytes_received >= received + n * size  # its put came in place
        assert new.registry.count() >= 1 and set(second["segments"]).isdisjoint(first["segments"])
        proc.stdin.write("\n")
        proc.stdin.flush()
        third = _result(proc)
        assert third["state"] == "on" and third["identical"] == n and third["fallbacks"] == 0
    finally:
        _finish(proc)
        if server.running.handoff is not None:
            server.running.handoff.stop()
            server.running.handoff = None


def test_descriptors_held_are_capped_per_user(users, place, make_server) -> None:
    """What the socket holds in descriptors is capped (half of it per Unix user), so that one user
    cannot leave the server without descriptors for gRPC: with room for 8, one user's two
    connections take 4 descriptors in all, then every further segment is refused, and a connection of
    another user is still served."""
    server = _server(make_server, place, socket=False)  # its own listener, with a small budget
    path = place / "small.sock"
    listener = HandoffListener(str(path), HandoffRegistry(), None, max_descriptors=8)
    listener.start()
    try:
        socks, fd, served, refused = [], os.memfd_create("x"), 0, 0
        for _ in range(2):
            s = _connect(path)
            s.send(b"H")
            assert s.recv(4096) == b"K"
            socks.append(s)
        for _ in range(6):
            socket.send_fds(socks[0], [b"A"], [fd])
            if socks[0].recv(4096).startswith(b"K"):
                served += 1
            else:
                refused += 1
        assert (served, refused) == (2, 4)  # 2 connections + 2 segments = this uid's half of 8
        other = subprocess.run(
            [
                "setpriv",
                f"--reuid={users['a']}",
                f"--regid={users['a']}",
                "--clear-groups",
                sys.executable,
                "-c",
                "import os, socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.settimeout(10); "
                f"s.connect({str(path)!r}); s.send(b'H'); assert s.recv(9) == b'K'; "
                "socket.send_fds(s, [b'A'], [os.memfd_create('y')]); print(s.recv(99)[:12].decode())",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.stdout.strip() == "Kkvcache-fd-", other.stderr
        os.close(fd)
        for s in socks:
            s.close()
    finally:
        listener.stop()
    del server


def test_stopping_twice_closes_nothing_of_another_object(place) -> None:
    """RunningServer.stop may run twice (a test stops a server, its fixture again): the second stop of
    the socket must not close descriptor numbers that other objects hold by then (seen: the bulk
    listener's socket and the shm directory failed with EBADF at the next server's stop)."""
    listener = HandoffListener(str(place / "twice.sock"), HandoffRegistry(), None)
    listener.start()
    listener.stop()
    others = [os.pipe() for _ in range(4)]  # take the numbers the listener's pipe had
    try:
        listener.stop()
        for r, w in others:
            os.fstat(r), os.fstat(w)  # still open
    finally:
        for r, w in others:
            os.close(r), os.close(w)
    failed = HandoffListener("/nonexistent-dir/x.sock", HandoffRegistry(), None)
    with pytest.raises(OSError):
        failed.start()
    failed.stop()  # a listener that never started stops cleanly, once
    failed.stop()
