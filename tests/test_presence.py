"""The presence index (docs/presence.md): same-host Lookups of blocks RAM holds, answered without an RPC,
against real servers (the in-process ServerThread, and server processes where one is killed).

Each test says what the code before the index did: every Lookup was a gRPC round trip, so a Lookup while
the server's event loop is busy waited for it (DeadlineExceeded with a short deadline), and the client had
no index, no counters and no switch.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcache_client import InvalidRequest, KVCacheClient, KVCacheError
from kvcache_client.presence import PresenceLink
from kvcache_core.filelock import record_lock_held
from kvcache_core.presence import BUCKET_SLOTS, W_BUCKETS, W_SEED, fingerprint, unpack_header
from kvcache_server.auth import token_digest
from kvcache_server.presence import PresenceTable
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TOKENS = {"a": "kvc_presence_tenant_a_token", "b": "kvc_presence_tenant_b_token"}


def _block(key: bytes, n: int = 1000) -> bytes:
    return raw_block(key, key[:4] * (n // 4))


def _keys(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def _busy_loop(server: ServerThread, seconds: float) -> None:
    """Keeps the server's event loop from answering any RPC for `seconds` (a Lookup RPC then waits)."""
    server.loop.call_soon_threadsafe(time.sleep, seconds)
    time.sleep(0.05)  # the sleep has started on the loop


def test_lookups_of_ram_blocks_need_no_rpc(make_server) -> None:
    """Before: a Lookup with the loop busy for 1.5 s hit its 0.5 s deadline."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    keys = _keys(10)
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.put_many("ns", [(k, _block(k)) for k in keys[:6]]).stored == 6
        assert client.presence is not None
        _busy_loop(server, 1.5)
        whole = client.lookup("ns", keys, timeout_s=0.5)
        one = client.lookup("ns", keys[:1], timeout_s=0.5)
        absent = client.lookup("ns", keys[7:8], timeout_s=0.5)  # no lower tier: a definite miss
        other_ns = client.lookup("other", keys[:1], timeout_s=0.5)  # an RPC would miss its deadline
        assert (whole.prefix_length, whole.tiers) == (6, ("ram",) * 6)
        assert (one.prefix_length, absent.prefix_length, other_ns.prefix_length) == (1, 0, 0)
        assert client.presence.state == "on"
        assert client.presence.counters.local == 4 and client.presence.counters.rpc == 0


@pytest.mark.parametrize(
    "namespace, keys",
    [("ns", [b"short"]), ("ns", [bytes(16), bytes(17)]), ("", [bytes(16)]), ("a:b", [bytes(16)]), ("a b", [bytes(16)])],
)
def test_bad_input_goes_to_the_server_for_its_error(make_server, namespace: str, keys: list[bytes]) -> None:
    """A Lookup the server would refuse is never answered from the index: the caller gets the
    server's INVALID_ARGUMENT, counted there. Before: a short key was a local miss (CI's
    test_bad_input and test_observability caught it)."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB}, limits={"max_keys_per_request": 64})
    with KVCacheClient(server.target, timeout_s=5) as client:
        assert client.lookup("ns", _keys(1)).prefix_length == 0  # the index is mapped
        assert client.presence is not None and client.presence.state == "on"
        with pytest.raises(InvalidRequest) as info:
            client.lookup(namespace, keys)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert client.stats().failed_requests == 1
        with pytest.raises(KVCacheError):  # past the server's max_keys_per_request: its refusal
            client.lookup("ns", _keys(65))


def test_index_agrees_with_the_rpc_through_puts_evictions_and_deletes(make_server) -> None:
    """Every local answer equals the RPC's (a client with presence_index=False) after each step of a
    random mix of puts (a 4 MiB tier of 256 KiB blocks: most puts evict), deletes and re-puts."""
    server: ServerThread = make_server(ram={"capacity_bytes": 4 * MiB})
    rng = random.Random(7)
    pool = _keys(40)
    with KVCacheClient(server.target) as local, KVCacheClient(server.target, presence_index=False) as rpc:
        for step in range(150):
            op = rng.random()
            chosen = rng.sample(pool, rng.randint(1, 4))
            if op < 0.6:
                local.put_many("ns", [(k, _block(k, 256 << 10)) for k in chosen])
            else:
                local.delete("ns", chosen)
            probe = rng.sample(pool, rng.choice([1, 3, 8, 20]))
            assert local.lookup("ns", probe) == rpc.lookup("ns", probe), step
        assert local.presence.counters.local == 150 and local.presence.counters.rpc == 0
        assert rpc.presence.state == "off" and rpc.presence.counters.local == 0
        assert server.stack.ram.stats().evictions > 0


def test_a_key_evicted_after_the_lookup_is_a_miss_never_wrong_bytes(make_server) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": 4 * MiB})
    first = _keys(1)
    with KVCacheClient(server.target) as client:
        client.put_many("ns", [(first[0], _block(first[0], 512 << 10))])
        assert client.lookup("ns", first).prefix_length == 1  # the index says: in RAM
        others = _keys(12)  # 6 MiB more: the first is evicted between the lookup and the get
        client.put_many("ns", [(k, _block(k, 512 << 10)) for k in others])
        assert client.get_many("ns", first) == [None]
        assert client.lookup("ns", first).prefix_length == 0
        # Re-put with other bytes under the same key: the get returns the new bytes, verified under the key.
        new = raw_block(first[0], b"new!" * 1000)
        client.put_many("ns", [(first[0], new)])
        assert client.lookup("ns", first).prefix_length == 1
        got = client.get_many("ns", first)[0]
        assert got is not None and bytes(got) == new
        assert client.presence.counters.local == 3


def test_lower_tiers_a_ram_miss_goes_to_the_rpc(make_server, tmp_path: Path) -> None:
    """With a disk tier below RAM, a key RAM evicted is still found (on disk) through the RPC, and a
    prefix held in RAM is answered from the index with one RPC for the rest."""
    server: ServerThread = make_server(
        ram={"capacity_bytes": 4 * MiB},
        disk={"enabled": True, "dir": str(tmp_path / "disk"), "capacity_bytes": 256 * MiB, "region_bytes": 8 * MiB,
              "write_mode": "through"},
    )  # fmt: skip
    keys = _keys(12)
    with KVCacheClient(server.target) as client:
        for k in keys:  # one by one, oldest first: the first ones are demoted to disk
            client.put_many("ns", [(k, _block(k, 512 << 10))])
        deadline = time.monotonic() + 10
        while server.stack.ram.stats().evictions == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        in_ram = server.stack.ram.contains_many_sync("ns", keys)
        assert not in_ram[0] and in_ram[-1]
        whole = client.lookup("ns", keys)  # keys[0] absent from RAM, on disk: an RPC answers
        assert whole.prefix_length == 12 and whole.tiers[0] == "disk"
        assert client.presence.counters.rpc == 1
        tail = [*keys[-2:], keys[0]]  # two in RAM (local), then one only on disk (RPC for the rest)
        got = client.lookup("ns", tail)
        assert got.prefix_length == 3 and got.tiers == ("ram", "ram", "disk")
        assert client.presence.counters.partial == 1
        assert client.lookup("ns", keys[-2:]).tiers == ("ram", "ram")
        assert client.presence.counters.local == 1


def _fill_bucket(seed: int, buckets: int, n: int) -> list[bytes]:
    """`n` keys whose fingerprints in namespace "ns" all fall into bucket 0."""
    out: list[bytes] = []
    while len(out) < n:
        key = os.urandom(16)
        if fingerprint(seed, b"ns", key) & (buckets - 1) == 0:
            out.append(key)
    return out


def test_an_overflowed_bucket_sends_the_lookup_to_the_rpc(make_server) -> None:
    """A full bucket (9 fingerprints for 8 slots) sets its overflow flag: a key the table lacks there
    is asked of the server (the spilled key is found); other buckets still answer locally. Deleting
    one key moves the spilled one in and clears the flag."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB, "presence_block_bytes": MiB})
    with KVCacheClient(server.target) as client:
        first = _keys(1)
        client.put_many("ns", [(k, _block(k)) for k in first])  # Info, the index mapped
        assert client.presence.state == "on"
        with open(client.presence.path, "rb") as f:
            header = unpack_header(f.read(64))
        buckets, seed = header[W_BUCKETS], header[W_SEED]
        assert buckets == 64
        # Gone before the crowd comes: one time in 64 it fell into bucket 0 too, which then held one
        # more than the test counts on (still overflowed after the delete below).
        assert client.delete("ns", first) == 1
        crowd = _fill_bucket(seed, buckets, BUCKET_SLOTS + 2)
        stored, absent = crowd[: BUCKET_SLOTS + 1], crowd[-1]
        client.put_many("ns", [(k, _block(k)) for k in stored])
        assert [client.lookup("ns", [k]).prefix_length for k in stored] == [1] * len(stored)
        assert client.lookup("ns", [absent]).prefix_length == 0
        assert client.presence.counters.rpc >= 2  # the spilled key and the absent one went to the server
        rpc_before = client.presence.counters.rpc
        elsewhere = next(k for k in iter(lambda: os.urandom(16), None) if fingerprint(seed, b"ns", k) & (buckets - 1))
        assert client.lookup("ns", [elsewhere]).prefix_length == 0
        assert client.presence.counters.rpc == rpc_before  # a definite miss in a bucket that never overflowed
        client.delete("ns", stored[:1])
        rpc_before = client.presence.counters.rpc
        assert [client.lookup("ns", [k]).prefix_length for k in stored[1:]] == [1] * BUCKET_SLOTS
        assert client.lookup("ns", [absent]).prefix_length == 0
        assert client.presence.counters.rpc == rpc_before  # all local again: the flag is clear


def _tokens(tmp: Path) -> str:
    text = "".join(
        f'[[tokens]]\nname = "{t}"\ntenant = "{t}"\nsha256 = "{token_digest(tok).hex()}"\nrights = ["read", "write"]\n'
        for t, tok in TOKENS.items()
    )
    path = tmp / "tokens.toml"
    path.write_text(text)
    return str(path)


def test_two_tenants_each_see_only_their_own_index(make_server, tmp_path: Path) -> None:
    """With the arena shared across tenants (trusting each other, same Unix user), each tenant's Info
    names its own index only, and identical namespace and key names of two tenants never meet."""
    server: ServerThread = make_server(
        shm={"dir": str(tmp_path / "shm"), "share_arena_across_tenants": True},
        auth={"enabled": True, "tokens_file": _tokens(tmp_path)},
    )
    ka, kb, both = _keys(3)
    a = KVCacheClient(server.target, token=TOKENS["a"])
    b = KVCacheClient(server.target, token=TOKENS["b"])
    with a, b:
        a.put_many("ns", [(ka, _block(ka)), (both, _block(both))])
        b.put_many("ns", [(kb, _block(kb)), (both, _block(both))])
        assert a.presence.state == b.presence.state == "on"
        assert a.presence.path != b.presence.path
        _busy_loop(server, 1.5)
        assert [a.lookup("ns", [k], timeout_s=0.5).prefix_length for k in (ka, kb, both)] == [1, 0, 1]
        assert [b.lookup("ns", [k], timeout_s=0.5).prefix_length for k in (ka, kb, both)] == [0, 1, 1]
        assert a.presence.counters.local == b.presence.counters.local == 3
        b.delete("ns", [both])  # b's delete leaves a's block (and a's index) alone
        assert a.lookup("ns", [both]).prefix_length == 1 and b.lookup("ns", [both]).prefix_length == 0
        for path, table_of in ((a.presence.path, "a"), (b.presence.path, "b")):
            with open(path, "rb") as f:
                header = unpack_header(f.read(64))
            other = kb if table_of == "a" else ka
            fp = fingerprint(header[W_SEED], b"ns", other)
            with open(path, "rb") as f:
                assert fp.to_bytes(8, "little") not in f.read()  # nothing of the other tenant in it


def test_tenants_without_a_shared_arena_get_no_index(make_server, tmp_path: Path) -> None:
    """Several tenants of one Unix user and share_arena_across_tenants off (the default): the arena is
    not shared, so no index is named either; every Lookup is an RPC and still right."""
    server: ServerThread = make_server(
        shm={"dir": str(tmp_path / "shm")}, auth={"enabled": True, "tokens_file": _tokens(tmp_path)}
    )
    (k,) = _keys(1)
    with KVCacheClient(server.target, token=TOKENS["a"]) as a:
        a.put_many("ns", [(k, _block(k))])
        assert a.lookup("ns", [k]).prefix_length == 1
        assert a.presence.state == "off" and a.presence.counters.rpc == 1
    assert not [n for n in os.listdir(tmp_path / "shm") if n.startswith("kvcache-presence-")]


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A fresh directory that every user may enter (tmp_path's parents are the test user's own)."""
    path = Path(tempfile.mkdtemp(prefix="kvcache-presence-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another Unix user needs root")
def test_another_unix_user_cannot_open_an_index(make_server, tmp_path: Path, open_dir: Path) -> None:
    """Tenants kept apart by the kernel run as their own Unix users: such a process opens neither the
    shm directory nor any tenant's index file (owner-only directory, 0400 files)."""
    shm = open_dir / "shm"  # the server makes it 0700; the directory above is open to everyone
    server: ServerThread = make_server(
        shm={"dir": str(shm), "share_arena_across_tenants": True},
        auth={"enabled": True, "tokens_file": _tokens(tmp_path)},
    )
    paths = []
    for tenant in ("a", "b"):
        with KVCacheClient(server.target, token=TOKENS[tenant]) as c:
            c.lookup("ns", _keys(1))
            paths.append(c.presence.path)
    assert all(p and os.stat(p).st_mode & 0o777 == 0o400 for p in paths)
    control = shm.parent / "control"  # a file nobody may read: the child's opens do reach this far
    control.write_text("x")
    control.chmod(0o444)
    assert _opens_as_nobody([str(control), *paths]) == ["opened", "denied", "denied"]


def _opens_as_nobody(paths: list[str]) -> list[str]:
    """Tries to open each path in a forked child running as uid/gid 65534 (it only opens and exits)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, no gRPC calls
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = []
            for p in paths:
                try:
                    os.close(os.open(p, os.O_RDONLY))
                    out.append("opened")
                except PermissionError:
                    out.append("denied")
            os.write(write_end, " ".join(out).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        got = os.read(read_end, 4096).decode().split()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    return got


# -- a killed and restarted server ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_process(port: int, shm: Path) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "kvcache_server", "--host", "127.0.0.1", "--port", str(port)]
    for setting in (f"shm.dir={shm}", "ram.capacity_bytes=32MiB", "ram.prefault=false"):
        args += ["--set", setting]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # type: ignore[union-attr]  # the line it prints once it serves
    return proc


@pytest.fixture
def killable(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(10)


def test_a_killed_servers_index_is_not_trusted_and_the_new_one_is_mapped(killable, tmp_path: Path) -> None:
    """SIGKILL leaves the old index's header intact; its lock is gone, so the client stops trusting it
    (a block the new server does not hold is not reported), then maps the restarted server's index."""
    port, shm = _free_port(), tmp_path / "shm"
    killable.append(_server_process(port, shm))
    keys = _keys(4)
    with KVCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
        client.put_many("ns", [(k, _block(k)) for k in keys])
        assert client.lookup("ns", keys).prefix_length == 4 and client.presence.counters.local == 1
        old_path = client.presence.path
        killable[0].send_signal(signal.SIGKILL)
        killable[0].wait(10)
        killable.append(_server_process(port, shm))
        assert client.lookup("ns", keys).prefix_length == 0  # the old index still lists them: not trusted
        assert client.presence.state == "stale" and client.presence.counters.rpc == 1
        time.sleep(1.1)  # the stale index is looked for again in Info at most once a second
        client.put_many("ns", [(k, _block(k)) for k in keys[:2]])
        assert client.lookup("ns", keys).prefix_length == 2
        assert client.presence.state == "on" and client.presence.path != old_path
        assert client.presence.counters.local == 2
        assert not os.path.exists(old_path)  # the new server removed the dead one's file


# -- how a reader tells a live server's index from a dead one's ----------------------------------------------


def test_liveness_is_read_from_the_record_lock_else_from_the_flock(tmp_path: Path) -> None:
    """A live server holds an OFD record lock and a flock on its index (kvcache_core.filelock): the
    reader checks the record lock (one fcntl call, no exception); where there is none (a server from
    before it) the flock decides, as it did alone before; with neither the index is not trusted. The
    reader's own descriptor is another open file, so in one process the checks see the table's locks
    exactly as a client's see a server's."""
    table = PresenceTable(str(tmp_path), 1024, instance_id=7, lower_tiers=False)
    try:
        key = os.urandom(16)
        table.add("ns", key)
        link = PresenceLink()
        link.configure(table.path, 7)
        assert link.state == "on" and link.prefix("ns", [key]) == (1, True)
        assert record_lock_held(link._fd)
        unlock = struct.pack("@hhqqi4x", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)
        fcntl.fcntl(table._fd, fcntl.F_OFD_SETLK, unlock)  # as a server without the record lock
        assert not record_lock_held(link._fd)
        assert link.prefix("ns", [key]) == (1, True)  # its flock says it lives
        fcntl.flock(table._fd, fcntl.LOCK_UN)  # neither lock: as a killed server's
        assert link.prefix("ns", [key]) is None
        assert link.state == "stale"
    finally:
        table.close()


def test_a_stopped_server_holds_its_record_locks_and_a_killed_one_none(killable, tmp_path: Path) -> None:
    """SIGSTOP keeps both files' record locks (the index is trusted and answers); SIGKILL drops them
    with the process, and the flock with them."""
    port, shm = _free_port(), tmp_path / "shm"
    killable.append(_server_process(port, shm))
    keys = _keys(2)
    with KVCacheClient(f"127.0.0.1:{port}", timeout_s=10) as client:
        client.put_many("ns", [(k, _block(k)) for k in keys])
        assert client.lookup("ns", keys).prefix_length == 2
        files = sorted(str(p) for p in shm.iterdir())
        assert any("kvcache-arena-" in f for f in files) and client.presence.path in files
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            assert all(record_lock_held(fd) for fd in fds)
            killable[0].send_signal(signal.SIGSTOP)
            try:
                assert all(record_lock_held(fd) for fd in fds)
                assert client.presence.prefix("ns", keys) == (2, True)
            finally:
                killable[0].send_signal(signal.SIGCONT)
            killable[0].send_signal(signal.SIGKILL)
            killable[0].wait(10)
            assert not any(record_lock_held(fd) for fd in fds)
            for fd in fds:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the flock went too: no BlockingIOError
            assert client.presence.prefix("ns", keys) is None and client.presence.state == "stale"
        finally:
            for fd in fds:
                os.close(fd)


def _read_only_maps_of_server_files() -> int:
    """This process's read-only shared mappings of a server's arena or presence index: a client's (the
    in-process server maps its own files read-write)."""
    with open("/proc/self/maps") as f:
        return sum(
            ("kvcache-arena-" in line or "kvcache-presence-" in line) and line.split()[1] == "r--s" for line in f
        )


def test_a_closed_client_unmaps_the_arena_and_the_index_at_once(make_server) -> None:
    """close() lets go of the server's arena and presence index while the client object is still
    referenced (an engine's connector object often lives on). Before, both stayed mapped until the
    client was collected: the vLLM tests' process held 256 MiB arenas of servers long stopped, 15 GB
    of /dev/shm at its peak."""
    server: ServerThread = make_server(ram={"capacity_bytes": 64 * MiB})
    keys = _keys(2)
    client = KVCacheClient(server.target)
    client.put_many("ns", [(k, _block(k)) for k in keys])
    got = client.get_many("ns", keys)
    assert client.lookup("ns", keys).prefix_length == 2 and client.presence.state == "on"
    assert _read_only_maps_of_server_files() == 2  # the arena and the tenant's index
    client.close()
    assert _read_only_maps_of_server_files() == 0
    assert client.presence.state == "off"
    assert [bytes(b) for b in got] == [_block(k) for k in keys]  # what it returned stays valid
