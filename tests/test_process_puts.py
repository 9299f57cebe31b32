"""Same-host puts read straight out of the client's own memory (kvcache_client.procmem, kvcache_server.procmem).

A real server and real client processes: the client registers its process over the server's segment
socket, a put names each block by address, and the server copies it with process_vm_readv into the
arena slot it reserved and verifies it there. What a client can do to that path: name memory it does
not have, change its bytes mid-call, use another connection's or tenant's name, stall the server's
reads of its memory (a userfaultfd it never answers); each costs only its own calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvcache_client import AsyncKVCacheClient, KVCacheClient
from kvcache_client.errors import DataCorrupted
from kvcache_client.handoff import Handoff
from kvcache_core.blockwire import ShmRange, encode_put_request
from kvcache_core.format import encode_block_parts
from kvcache_proto import kvcache_pb2 as pb
from kvcache_proto import kvcache_pb2_grpc as pb_grpc
from kvcache_server.auth import token_digest
from kvcache_server.shm import SEGMENT_NAME
from tests.conftest import ServerThread, keyed, raw_block

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
NS = "ns"
NOBODY = 65534


@pytest.fixture
def place() -> Iterator[Path]:
    """A short directory for the server's shm directory and segment socket (Unix socket paths are short)."""
    d = Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(make_server, place: Path) -> ServerThread:  # type: ignore[no-untyped-def]
    return make_server(
        ram={"capacity_bytes": 256 << 20}, shm={"dir": str(place / "shm"), "socket_path": str(place / "seg.sock")}
    )


def stub(server: ServerThread) -> pb_grpc.KVCacheStub:
    return pb_grpc.KVCacheStub(grpc.insecure_channel(server.target))


def client_segments(directory: Path) -> list[str]:
    """Segment files clients made in the directory (not the server's arena or presence index)."""
    return sorted(p.name for p in directory.iterdir() if SEGMENT_NAME.fullmatch(p.name))


def test_a_same_host_put_is_read_out_of_the_clients_memory(server: ServerThread, place: Path) -> None:
    """Whole blocks and blocks in parts (header + payload view: the head travels inline), from the
    blocking and the asyncio SDK: stored byte-identical, and no segment was ever made for them."""
    whole = [keyed(os.urandom(1 << 20)) for _ in range(6)]
    payloads = [np.random.default_rng(i).integers(0, 256, 3 << 19, dtype=np.uint8) for i in range(4)]
    keys = [os.urandom(16) for _ in payloads]
    parts = [
        (k, encode_block_parts(memoryview(p), key=k, dtype="uint8", shape=(p.nbytes,)))
        for k, p in zip(keys, payloads, strict=True)
    ]
    total = sum(len(b) for _, b in whole) + sum(len(h) + len(p) for _, (h, p) in parts)
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, whole).stored == 6
        assert client.put_many(NS, parts).stored == 4
        link = client._transport.shm
        assert (link.process.state, link.state) == ("on", "on"), link.process.reason
        assert link.pool is not None and link.pool.idle_bytes == 0  # no segment made for a put
        got = client.get_many(NS, [k for k, _ in whole] + keys)
    assert [bytes(g) for g in got[:6]] == [b for _, b in whole]
    assert [bytes(g) for g in got[6:]] == [h + p.tobytes() for _, (h, p) in parts]
    del got
    s = stub(server).Stats(pb.StatsRequest(), timeout=10)
    assert (s.shm_bytes_received, s.put_checksum_failures) == (total, 0)

    async def from_asyncio() -> list[bytes]:
        async with AsyncKVCacheClient(server.target) as c:
            items = [keyed(os.urandom(700_000)) for _ in range(3)]
            assert (await c.put_many("async", items)).stored == 3
            assert c._transport.shm.process.state == "on"
            got = await c.get_many("async", [k for k, _ in items])
            return [bytes(g) for g in got] + [b for _, b in items]

    both = asyncio.run(from_asyncio())
    assert both[:3] == both[3:]
    assert client_segments(place / "shm") == []


def _registered(server: ServerThread, place: Path, token: str = "") -> tuple[Handoff, str]:
    info = stub(server).Info(pb.InfoRequest(), timeout=10)
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, token)
    name, _ = handoff.register_process()
    return handoff, name


def _put(server: ServerThread, key: bytes, ref: ShmRange, metadata: tuple = ()) -> grpc.RpcError | None:  # type: ignore[type-arg]
    put = grpc.insecure_channel(server.target).stream_unary(
        "/kvcache.v1.KVCache/Put", lambda b: b, pb.PutResponse.FromString
    )
    try:
        put(iter([encode_put_request(NS, [(key, ref)])]), timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc
    return None


def test_a_range_that_is_not_the_clients_block_fails_its_call_and_stores_nothing(
    server: ServerThread, place: Path
) -> None:
    """Memory the client does not have: INVALID_ARGUMENT; a block made for another key: DATA_LOSS;
    in both, no block stored and the reserved slot back in the arena."""
    handoff, name = _registered(server, place)
    try:
        k = os.urandom(16)
        unmapped = _put(server, k, ShmRange(name, 4096, 100_000))
        assert unmapped is not None and unmapped.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not readable memory" in unmapped.details()
        other = np.frombuffer(raw_block(os.urandom(16), os.urandom(100_000)), dtype=np.uint8)
        wrong = _put(server, k, ShmRange(name, other.ctypes.data, other.nbytes))
        assert wrong is not None and wrong.code() is grpc.StatusCode.DATA_LOSS and "checksum" in wrong.details()
        right = np.frombuffer(raw_block(k, os.urandom(100_000)), dtype=np.uint8)
        header, payload = right[:64].tobytes(), right[64:]
        assert _put(server, k, ShmRange(name, payload.ctypes.data, payload.nbytes, header)) is None  # head + range
    finally:
        handoff.close()
    ram = server.stack.ram
    assert ram.used_bytes == ram.entry_cost_of(right.nbytes)  # only the good block
    s = stub(server).Stats(pb.StatsRequest(), timeout=10)
    assert (s.put_checksum_failures, s.arena_reservations) == (1, 0)
    got = stub(server).Lookup(pb.LookupRequest(namespace=NS, keys=[k]), timeout=10)
    assert got.prefix_length == 1


def test_a_name_serves_only_its_connection_and_tenant(make_server, place: Path) -> None:  # type: ignore[no-untyped-def]
    """Another tenant naming a registered process is answered as for a name that does not exist; so
    is anyone once the registering connection closed."""
    tokens = {"a": "kvc_process_tenant_a_token", "b": "kvc_process_tenant_b_token"}
    text = "".join(
        f'[[tokens]]\nname = "{t}"\ntenant = "{t}"\nsha256 = "{token_digest(v).hex()}"\nrights = ["read", "write"]\n\n'
        for t, v in tokens.items()
    )
    (place / "tokens.toml").write_text(text)
    server = make_server(
        ram={"capacity_bytes": 64 << 20},
        shm={"dir": str(place / "shm"), "socket_path": str(place / "seg.sock")},
        auth={"enabled": True, "tokens_file": str(place / "tokens.toml")},
    )
    md = {t: (("authorization", f"Bearer {v}"),) for t, v in tokens.items()}
    info = stub(server).Info(pb.InfoRequest(), timeout=10, metadata=md["a"])
    handoff = Handoff(str(place / "seg.sock"), info.server_uid, tokens["a"])
    try:
        name, _ = handoff.register_process()
        k = os.urandom(16)
        block = np.frombuffer(raw_block(k, os.urandom(100_000)), dtype=np.uint8)
        ref = ShmRange(name, block.ctypes.data, block.nbytes)
        refused = _put(server, k, ref, md["b"])
        assert refused is not None and refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "not one this client handed over" in refused.details()
        assert _put(server, k, ref, md["a"]) is None
    finally:
        handoff.close()
    deadline = time.monotonic() + 10
    while (gone := _put(server, k, ref, md["a"])) is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the server's socket thread drops the name when it sees the close
    assert gone is not None and gone.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_bytes_changed_during_puts_never_store_a_wrong_block(server: ServerThread) -> None:
    """A thread flips one payload byte back and forth while the same block is put 60 times: each put
    stores the block or is refused (DATA_LOSS); what is stored is the block, byte for byte."""
    k = os.urandom(16)
    block = bytearray(raw_block(k, os.urandom(2 << 20)))
    original = bytes(block)
    view = np.frombuffer(block, dtype=np.uint8)
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            view[len(block) // 2] ^= 0xFF
            view[len(block) // 2] ^= 0xFF

    flipper = threading.Thread(target=flip, daemon=True)
    stored = refused = 0
    with KVCacheClient(server.target) as client:
        client.put_many(NS, [keyed(b"x" * 100_000)])  # Info, registration
        assert client._transport.shm.process.state == "on"
        flipper.start()
        try:
            for _ in range(60):
                try:
                    client.put_many(NS, [(k, memoryview(block))])
                    stored += 1
                except DataCorrupted:
                    refused += 1
        finally:
            stop.set()
            flipper.join(10)
        assert stored + refused == 60
        assert client._transport.shm.process.state == "on"  # a refused block is the put's fault, not the path's
        got = client.get_many(NS, [k])[0]
        assert got is None if stored == 0 else bytes(got) == original


STALLER = r"""
import ctypes, fcntl, json, mmap, os, struct, sys, time
import numpy as np
from kvcache_client import KVCacheClient
from kvcache_client.errors import KVCacheError
from kvcache_core.format import encode_block_parts

libc = ctypes.CDLL(None, use_errno=True)
uffd = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd (x86_64): a fault in this region waits for us, forever
assert uffd >= 0, ctypes.get_errno()
fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # UFFDIO_API
region = mmap.mmap(-1, 1 << 20)
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("QQQQ", address, 1 << 20, 1, 0)))  # UFFDIO_REGISTER, MISSING
key = b"s" * 16
header, _ = encode_block_parts(bytes(1 << 20), key=key, dtype="uint8", shape=(1 << 20,))  # the header of zeros
items = [(key, (header, memoryview(region)))]
out = {"deadlines": 0, "other": []}
warm = encode_block_parts(bytes(1 << 17), key=b"w" * 16, dtype="uint8", shape=(1 << 17,))
with KVCacheClient(sys.argv[1], timeout_s=30) as c:
    c.put_many("warm", [(b"w" * 16, warm)])  # Info, the bulk port, the registration: no deadline of 0.5 s
    out["process"] = c._transport.shm.process.state
    for _ in range(int(sys.argv[2])):
        try:
            c.put_many("stall", items, timeout_s=0.5)
        except KVCacheError as exc:
            if type(exc).__name__ == "DeadlineExceeded":
                out["deadlines"] += 1
            else:
                out["other"].append(f"{type(exc).__name__}: {exc}"[:300])
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # stays alive (its reads stalled) until the test has checked everyone else
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="userfaultfd syscall number")
def test_a_client_that_stalls_the_servers_reads_of_its_memory_stalls_only_itself(server: ServerThread) -> None:
    """A client whose block lies in memory a read of which waits forever (a userfaultfd it never
    answers: root may make one the kernel waits on; so may anyone where vm.unprivileged_userfaultfd
    is 1, or with a FUSE mount) puts it 12 times with deadlines of 0.5 s: each call ends at its
    deadline, and meanwhile other clients (puts out of their memory, puts through segments, gets)
    go on. On reads in the server's shared threads (6 here) the 12 stalled reads would hold them all."""
    if os.geteuid() != 0 and Path("/proc/sys/vm/unprivileged_userfaultfd").read_text().strip() != "1":
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: a userfaultfd the kernel waits on needs it")
        pytest.skip("a userfaultfd that stalls the kernel's reads needs root or vm.unprivileged_userfaultfd=1")
    env = {**os.environ, "PYTHONPATH": f"{REPO}/client:{REPO}:{REPO}/connectors"}
    staller = subprocess.Popen(
        [sys.executable, "-c", STALLER, server.target, "12"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert staller.stdout is not None
        line = staller.stdout.readline()
        assert line, "the stalling client failed"
        report = json.loads(line)
        assert report == {"process": "on", "deadlines": 12, "other": []}
        # Its reads are stuck in the server now. Everyone else goes on, in bounded time.
        items = [keyed(os.urandom(1 << 20)) for _ in range(8)]
        t0 = time.monotonic()
        with KVCacheClient(server.target, timeout_s=20) as client:
            assert client.put_many(NS, items).stored == 8
            assert client._transport.shm.process.state == "on"
            assert [bytes(g) for g in client.get_many(NS, [k for k, _ in items])] == [b for _, b in items]
        os.environ["KVCACHE_PROCESS_PUTS"] = "0"
        try:
            with KVCacheClient(server.target, timeout_s=20) as client:
                more = [keyed(os.urandom(1 << 20)) for _ in range(8)]
                assert client.put_many(NS, more).stored == 8
                assert client._transport.shm.process.state == "off"
        finally:
            del os.environ["KVCACHE_PROCESS_PUTS"]
        assert time.monotonic() - t0 < 20
    finally:
        if staller.stdin is not None:
            staller.stdin.close()
        try:
            staller.wait(30)
        except subprocess.TimeoutExpired:
            staller.kill()
            staller.wait(10)
    # The staller gone, its uffd closed: its reads fail, their calls end, their slots go back.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = stub(server).Stats(pb.StatsRequest(), timeout=10)
        if s.arena_reservations == 0 and s.inflight_bytes == 0:
            break
        time.sleep(0.1)
    assert (s.arena_reservations, s.inflight_bytes) == (0, 0)
    looked = stub(server).Lookup(pb.LookupRequest(namespace="stall", keys=[b"s" * 16]), timeout=10)
    assert looked.prefix_length == 0  # no stalled block stored


def test_a_server_that_may_not_read_the_client_refuses_the_registration_and_puts_go_as_before(place: Path) -> None:
    """A server running as another user (nobody) may not read a root client's memory: the
    registration is refused with the kernel's reason, and the client's puts go as they would
    without this path."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root with setpriv")
        pytest.skip("running the server as another user needs root and setpriv")
    os.chown(place, NOBODY, NOBODY)
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    argv = [*as_nobody, sys.executable, "-m", "kvcache_server", "--port", "0", "--ram-capacity", str(64 << 20)]
    argv += ["--set", f"shm.dir={place / 'shm'}", "--set", f"shm.socket_path={place / 'seg.sock'}"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": f"{REPO}/client:{REPO}:{REPO}/connectors"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"serving \S+ on [^\s:]+:(\d+)", line)
        assert found, f"the server did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        port = found.group(1)
        items = [keyed(os.urandom(1 << 20)) for _ in range(4)]
        with KVCacheClient(f"127.0.0.1:{port}", timeout_s=20) as client:
            assert client.put_many(NS, items).stored == 4
            link = client._transport.shm
            assert link.process.state == "off" and "may not read" in link.process.reason, link.process.reason
            # and the puts went as they would without this path (inline here: a root client's segment
            # files are not the server's user's), bytes identical
            assert [bytes(g) for g in client.get_many(NS, [k for k, _ in items])] == [b for _, b in items]
    finally:
        proc.terminate()
        proc.wait(30)


def test_one_registration_per_connection_and_heads_are_small(server: ServerThread, place: Path) -> None:
    """A second "P" on a connection answers the same name (no second set of threads); a block whose
    inline head is over 64 KiB is refused INVALID_ARGUMENT."""
    handoff, name = _registered(server, place)
    try:
        again, _ = handoff.register_process()
        assert again == name
        assert server.running.handoff is not None and server.running.handoff.registry.count() == 1
        k = os.urandom(16)
        payload = np.zeros(1000, dtype=np.uint8)
        big = _put(server, k, ShmRange(name, payload.ctypes.data, payload.nbytes, b"h" * (65 << 10)))
        assert big is not None and big.code() is grpc.StatusCode.INVALID_ARGUMENT and "head" in big.details()
    finally:
        handoff.close()


REGISTER_AND_HAND_OVER = r"""
import json, os, sys
from kvcache_client.handoff import Handoff
handoff = Handoff(sys.argv[1], int(sys.argv[2]), "")
name, _ = handoff.register_process()
if os.fork() == 0:  # the child keeps the connection (and so the name) open after its parent exits
    import time
    time.sleep(60)  # killed by the test before that
    os._exit(0)
print(json.dumps({"name": name, "pid": os.getpid()}), flush=True)
os._exit(0)
"""

VICTIM = r"""
import json, sys
import numpy as np
secret = np.frombuffer(b"SECRET-OF-ANOTHER-PROCESS-" * 20000, dtype=np.uint8)  # 540 KB
print(json.dumps({"address": int(secret.ctypes.data), "length": int(secret.nbytes)}), flush=True)
sys.stdin.readline()
"""


def test_a_registered_process_that_exited_is_never_read_through_its_pid(server: ServerThread, place: Path) -> None:
    """A client registers, hands its connection to a child and exits; a victim process is started
    with the same pid (root: /proc/sys/kernel/ns_last_pid). A Put naming the registration and the
    victim's memory is FAILED_PRECONDITION, and nothing of the victim's bytes comes back: on a check
    of the pidfd only after a block's last piece, the first 256 KiB were read and the header error
    quoted them ("bad magic b'SECRET-O'")."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root: reusing a pid on purpose needs it")
        pytest.skip("reusing a pid on purpose needs root (ns_last_pid)")
    env = {**os.environ, "PYTHONPATH": f"{REPO}/client:{REPO}:{REPO}/connectors"}
    info = stub(server).Info(pb.InfoRequest(), timeout=10)
    registrant = subprocess.Popen(
        [sys.executable, "-c", REGISTER_AND_HAND_OVER, str(place / "seg.sock"), str(info.server_uid)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert registrant.stdout is not None
    registered = json.loads(registrant.stdout.readline())
    registrant.wait(30)  # exited and reaped: its pid is free; its child holds the connection
    victim = None
    try:
        for _ in range(50):  # other processes and threads may take the pid first: try again
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(registered["pid"] - 1))
            candidate = subprocess.Popen(
                [sys.executable, "-c", VICTIM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            if candidate.pid == registered["pid"]:
                victim = candidate
                break
            candidate.kill()
            candidate.wait(10)
        assert victim is not None and victim.stdout is not None, "could not start a process with the freed pid"
        where = json.loads(victim.stdout.readline())
        refused = _put(server, os.urandom(16), ShmRange(registered["name"], where["address"], where["length"]))
        assert refused is not None and refused.code() is grpc.StatusCode.FAILED_PRECONDITION, refused
        assert "exited" in refused.details() and "SECRET" not in refused.details()
    finally:
        if victim is not None:
            victim.kill()
            victim.wait(10)
        subprocess.run(["pkill", "-f", "handoff.register_process"], check=False)  # the child holding the connection


def test_a_client_registers_again_when_its_connection_is_gone(server: ServerThread, place: Path) -> None:
    """The server forgot the name (its connection closed: a server restart closes them all): the next put
    registers again and still reads out of the client's memory, blocking and asyncio SDK alike (the
    asyncio one off its event loop)."""
    # Over 1 MiB: a smaller same-host put goes over the bulk port (kvcache_client.bulk, SAME_HOST_BULK_PUT_BYTES).
    items = [keyed(os.urandom(1_200_000)) for _ in range(2)]
    with KVCacheClient(server.target) as client:
        assert client.put_many(NS, items[:1]).stored == 1
        link = client._transport.shm
        first = link.process._name
        link._process_handoff.close()  # as when the server closes it
        assert link.process.stale()
        before = stub(server).Stats(pb.StatsRequest(), timeout=10).shm_bytes_received
        assert client.put_many(NS, items[1:]).stored == 1
        assert link.process.state == "on" and link.process._name != first and not link.process.stale()
        assert stub(server).Stats(pb.StatsRequest(), timeout=10).shm_bytes_received - before == len(items[1][1])
        assert link.pool is not None and link.pool.idle_bytes == 0  # no segment made

    async def from_asyncio() -> tuple[str, bool, int]:
        async with AsyncKVCacheClient(server.target) as c:
            more = [keyed(os.urandom(1_200_000)) for _ in range(2)]
            await c.put_many("async", more[:1])
            alink = c._transport.shm
            alink._process_handoff.close()
            loop_thread = threading.get_ident()
            seen: list[int] = []
            register = alink.process._register_now

            def recorded(handoff: Handoff) -> bool:
                seen.append(threading.get_ident())
                return register(handoff)

            alink.process._register_now = recorded  # type: ignore[method-assign]
            await c.put_many("async", more[1:])
            return alink.process.state, all(t != loop_thread for t in seen), len(seen)

    state, off_the_loop, registrations = asyncio.run(from_asyncio())
    assert (state, off_the_loop, registrations) == ("on", True, 1)


def test_with_no_room_for_slots_a_block_is_read_out_of_the_client_into_memory_and_verified(
    make_server, place: Path
) -> None:  # type: ignore[no-untyped-def]
    """RAM cannot reserve slots (a lease pins what it holds): the server reads the block (its header
    inline, its payload out of the client's memory) into memory of its own and verifies it there, as
    for a segment; RAM then refuses it for want of room, counted, nothing else failing."""
    server = make_server(
        ram={"capacity_bytes": 4 << 20}, shm={"dir": str(place / "shm"), "socket_path": str(place / "seg.sock")}
    )
    payload = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    k = os.urandom(16)
    header, view = encode_block_parts(memoryview(payload), key=k, dtype="uint8", shape=(payload.nbytes,))
    with KVCacheClient(server.target) as client:
        held = keyed(os.urandom(2 << 20))
        client.put_many(NS, [held])
        before = stub(server).Stats(pb.StatsRequest(), timeout=10)
        with client.leased(NS, [held[0]]):
            result = client.put_many(NS, [(k, (header, view))])
        assert client._transport.shm.process.state == "on"
    after = stub(server).Stats(pb.StatsRequest(), timeout=10)
    assert (result.stored, result.rejected) == (0, 1)
    assert after.put_checksum_failures == before.put_checksum_failures == 0
    assert after.shm_bytes_received - before.shm_bytes_received == len(header) + payload.nbytes
    assert after.arena_reservations == 0


def test_a_registration_dropped_during_a_put_ends_it_and_never_reads_on_the_shared_threads(
    server: ServerThread, place: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client drops its registration ("D", or its connection closes) just after the put opened its
    name: the put is FAILED_PRECONDITION and nothing is read (before: the reads went to the server's
    shared threads, where a stalling client could hold them, and the block was stored)."""
    handoff, name = _registered(server, place)
    service = server.running.service
    registry = server.running.handoff.registry
    assert service is not None and registry is not None
    opened = service._open_segment

    def open_then_dropped(segment: str, *, writable: bool) -> tuple[int, int]:
        got = opened(segment, writable=writable)
        if segment == name:
            assert registry.drop(name, registry._by_name[name].conn)
        return got

    monkeypatch.setattr(service, "_open_segment", open_then_dropped)
    try:
        k = os.urandom(16)
        block = np.frombuffer(raw_block(k, os.urandom(300_000)), dtype=np.uint8)
        refused = _put(server, k, ShmRange(name, block.ctypes.data, block.nbytes))
        assert refused is not None and refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "registration ended" in refused.details()
    finally:
        handoff.close()
    looked = stub(server).Lookup(pb.LookupRequest(namespace=NS, keys=[k]), timeout=10)
    assert looked.prefix_length == 0
    assert stub(server).Stats(pb.StatsRequest(), timeout=10).arena_reservations == 0


def test_a_blocks_reads_check_the_process_before_and_after_its_first_piece_and_after_its_last() -> None:
    """kvcache_server.shm._filler over a registered process: the pidfd's exit check runs before the
    block's first read and after its first piece (the header is parsed from it) and its last (before
    the checksum's verdict); pieces between are only hashed. An exit found wipes what the slot
    received. Here the memory read is this process's own and the pidfd a child's: the child exiting
    mid-block is the registered process exiting and its pid going to another process (the pid-reuse
    case, made on purpose)."""
    from kvcache_server.procmem import ProcessCopy
    from kvcache_server.shm import ShmError, _filler

    source = (np.arange(1 << 16) % 251 + 1).astype(np.uint8)  # no zero byte: a wipe shows
    ref = ShmRange(segment="p", offset=source.ctypes.data, length=len(source), head=b"HEAD")

    def child() -> tuple[subprocess.Popen[bytes], int]:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return proc, os.pidfd_open(proc.pid)

    def end(proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait(30)

    proc, pidfd = child()
    try:
        slot = memoryview(bytearray(b"\xaa" * (4 + len(source))))
        fill = _filler(7, pidfd, -os.getpid(), ref, slot)
        fill(0, 2)  # inside the head: nothing read from the process
        fill(2, 1024)  # the first piece from the process: checked before and after, alive
        assert bytes(slot[:1024]) == b"HEAD" + source[:1020].tobytes()
        end(proc)  # the registered process exits mid-block
        fill(1024, 2048)  # a middle piece: read, not checked (only hashed by the caller)
        with pytest.raises(ShmError) as last:
            fill(2048, len(slot))  # the last piece: checked, the exit found
        assert last.value.code is grpc.StatusCode.FAILED_PRECONDITION and "block 7" in last.value.message
        assert "exited" in last.value.message
        assert bytes(slot[:4]) == b"HEAD" and not any(slot[4:]), "what the slot received is wiped"

        # Already gone before the block's first read: nothing is read at all.
        slot = memoryview(bytearray(b"\xaa" * (4 + len(source))))
        with pytest.raises(ShmError, match="exited"):
            _filler(7, pidfd, -os.getpid(), ref, slot)(0, 4096)
        assert bytes(slot[:4]) == b"HEAD" and set(bytes(slot[4:])) == {0xAA}

        # Exited during the first read (scripted: alive before it, gone after): the first piece is
        # checked before the caller parses the header from it, and wiped.
        import kvcache_server.procmem as procmem

        answers = iter([False, True])
        real_exited = procmem.exited
        procmem.exited = lambda fd: next(answers)  # type: ignore[assignment]
        try:
            slot = memoryview(bytearray(b"\xaa" * (4 + len(source))))
            with pytest.raises(ShmError, match="exited"):
                _filler(7, pidfd, -os.getpid(), ref, slot)(0, 4096)
            assert bytes(slot[:4]) == b"HEAD" and not any(slot[4:4096]), "the first piece read is wiped"
            # A read that fails (EFAULT here: an unmapped address) after the process exited is the exit
            # (FAILED_PRECONDITION), never INVALID_ARGUMENT: its pid may be another process's by then.
            answers = iter([False, True])
            with pytest.raises(ShmError) as gone:
                ProcessCopy(os.getpid(), pidfd, "p", 4096, memoryview(bytearray(64))).read(0, 64)
            assert gone.value.code is grpc.StatusCode.FAILED_PRECONDITION and "exited" in gone.value.message
            answers = iter([False, False])
            with pytest.raises(ShmError) as bad:  # alive: the bad address is the client's error
                ProcessCopy(os.getpid(), pidfd, "p", 4096, memoryview(bytearray(64))).read(0, 64)
            assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            procmem.exited = real_exited

        # ProcessCopy itself: its reads stay inside the buffer, and the address range is checked.
        copy = ProcessCopy(os.getpid(), pidfd, "p", source.ctypes.data, slot[4:])
        with pytest.raises(ValueError):
            copy.read(0, len(source) + 1)
        with pytest.raises(ShmError, match="not valid"):
            ProcessCopy(os.getpid(), pidfd, "p", -1, slot)
    finally:
        if proc.poll() is None:
            end(proc)
        os.close(pidfd)
