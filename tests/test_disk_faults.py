"""The disk tier when its disk dies or its directory is made unreadable mid-run, in real server processes
with a real redis-server behind it: misses and counts, never a crash, a wrong byte or a stall of the
other tiers (docs/tiers.md, "Disk tier", "Failures").

A dead disk is an ext4 file system on a loop device shut down with EXT4_IOC_SHUTDOWN (what ext4 does
itself on a fatal device error: from then on every read, write and open on it fails with EIO). The
unreadable directory is a `chmod 000` under a server that runs as an unprivileged user (as the
images do: root reads any file whatever its mode). Both need root; under CI=true they fail instead
of skipping without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache_client import KVCacheClient
from kvcache_server.tiers.base import TierError
from kvcache_server.tiers.disk import DiskTier
from tests.backends import IN_CI, KVServerProcess, RedisProcess, wait_for
from tests.test_disk_tier import NS, MiB, blocks, disk_stats, server

pytestmark = pytest.mark.timeout(180)

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # as a device that stops answering: nothing more reaches it
NOBODY = 65534


def _need_root(what: str, done: subprocess.CompletedProcess[bytes]) -> None:
    if done.returncode != 0:
        message = f"cannot {what} (needs root): {done.stderr.decode().strip()}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def ext4_on_a_loop_device(where: Path, size: str = "64M") -> Iterator[Path]:
    """A fresh ext4 file system in an image file, on a loop device of its own, mounted at where/mnt;
    unmounted (lazily, if busy) and the loop device detached afterwards, whatever the test did."""
    image, mnt = where / "disk.img", where / "mnt"
    mnt.mkdir(parents=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    _need_root("make an ext4 file system", made)
    attached = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True)
    _need_root("attach a loop device", attached)
    device = attached.stdout.decode().strip()
    try:
        _need_root("mount a loop device", subprocess.run(["mount", device, str(mnt)], capture_output=True))
        try:
            yield mnt
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def kill_the_disk(mnt: Path) -> None:
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="Input/output error"):  # the disk is gone for everyone
        (mnt / "probe").write_bytes(b"x")


def tier_counts(client: KVCacheClient) -> dict[str, tuple[int, int, int]]:
    """(hits, misses, errors) per tier."""
    return {t.name: (t.hits, t.misses, t.errors) for t in client.stats().tiers}


def test_a_disk_that_dies_mid_run_is_misses_and_redis_behind_it_serves_every_block(tmp_path: Path) -> None:
    redis = RedisProcess()
    try:
        with ext4_on_a_loop_device(tmp_path) as mnt:
            proc = server(
                mnt / "tier",
                "disk.capacity_bytes=32MiB",
                "disk.write_mode=through",
                "disk.write_threads=1",
                "redis.enabled=true",
                f"redis.url={redis.url}",
                "redis.write_mode=through",
            )
            try:
                with KVCacheClient(proc.target, timeout_s=10, shm=False, bulk=False) as client:
                    batch = blocks(200, 20_000)  # 4 MB: RAM (2 MiB) keeps the last ~100, disk and Redis all
                    for i in range(0, 200, 20):
                        result = client.put_many(NS, batch[i : i + 20])
                        assert result.tier("disk").stored == 20 and result.tier("redis").stored == 20
                    keys = [k for k, _ in batch]
                    assert [bytes(g) for g in client.get_many(NS, keys[:10])] == [b for _, b in batch[:10]]
                    assert disk_stats(client).hits >= 10  # the oldest came from the disk while it lived

                    kill_the_disk(mnt)
                    before = tier_counts(client)
                    t0 = time.monotonic()
                    got = [g for i in range(0, 200, 20) for g in client.get_many(NS, keys[i : i + 20])]
                    took = time.monotonic() - t0
                    after = tier_counts(client)
                    assert [bytes(g) for g in got] == [b for _, b in batch]  # every block, from RAM or Redis
                    assert client.corrupt_blocks == 0
                    served = {name: after[name][0] - before[name][0] for name in after}
                    assert served["disk"] == 0
                    assert served["ram"] + served["redis"] == 200 and served["redis"] > 0, served
                    disk = disk_stats(client)
                    assert after["disk"][2] > before["disk"][2], (before, after)  # the EIOs, counted
                    assert disk.breaker == "open", disk  # a dead disk is not called again per Get
                    print(f"dead disk: 200 blocks served in {took:.2f} s ({served}), disk errors {after['disk'][2]}")

                    # Puts go on: RAM and Redis store them, the disk's refusals are counted.
                    fresh = blocks(60, 20_000)
                    for i in range(0, 60, 20):
                        result = client.put_many(NS, fresh[i : i + 20])
                        assert result.stored == 20 and result.tier("redis").stored == 20
                        assert result.tier("disk").stored == 0
                    fresh_keys = [k for k, _ in fresh]
                    assert [bytes(g) for g in client.get_many(NS, fresh_keys)] == [b for _, b in fresh]
                    assert client.lookup(NS, keys[:5]).prefix_length == 5  # Redis answers; the disk is skipped
                    assert proc.proc.poll() is None
            finally:
                proc.stop()
    finally:
        redis.stop()


def test_a_dead_disk_fails_a_write_batch_even_when_it_holds_some_of_its_keys(tmp_path: Path) -> None:
    """A batch of writes that wrote nothing it attempted on a dead device is a TierError (the stack's
    breaker opens), also when some of its keys were held already (a repeated prefix): those count as
    stored and hid the failure."""
    with ext4_on_a_loop_device(tmp_path) as mnt:
        disk = DiskTier(str(mnt / "tier"), capacity_bytes=8 * MiB, region_bytes=MiB, io_threads=2, write_threads=1)

        async def go() -> None:
            held = blocks(4)
            assert all(await disk.put_many(NS, held))
            kill_the_disk(mnt)
            with pytest.raises(TierError, match="Input/output error"):
                await disk.put_many(NS, held[:1] + blocks(3))  # one held, three to write
            await disk.close()

        asyncio.run(go())


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that uid NOBODY can reach (pytest's tmp_path sits under a 0700 directory of root's)."""
    d = Path(tempfile.mkdtemp(prefix="kvcache-disk-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_a_directory_made_unreadable_mid_run(open_dir: Path) -> None:
    """The server (uid NOBODY) keeps its region files open: what it holds stays served, byte for byte.
    What needs the directory (a region file not made yet) is refused, counted, and the put still lands
    in RAM; once the directory is readable again, new region files are made and written."""
    tier_dir = open_dir / "tier"
    tier_dir.mkdir(mode=0o700)
    done = subprocess.run(["chown", f"{NOBODY}:{NOBODY}", str(tier_dir)], capture_output=True)
    _need_root("give the tier's directory to an unprivileged user", done)
    proc = KVServerProcess(
        "ram.capacity_bytes=2MiB",
        "ram.prefault=false",
        "shm.enabled=false",
        "bulk.enabled=false",
        "disk.enabled=true",
        f"disk.dir={tier_dir}",
        "disk.region_bytes=1MiB",
        "disk.capacity_bytes=32MiB",
        "disk.write_mode=through",
        "disk.write_threads=1",
        user=NOBODY,
    )
    try:
        with KVCacheClient(proc.target, timeout_s=10, shm=False, bulk=False) as client:
            held = blocks(150, 20_000)  # 3 MB: 3-4 region files of 1 MiB
            for i in range(0, 150, 10):
                assert client.put_many(NS, held[i : i + 10]).tier("disk").stored == 10
            made = sorted(p.name for p in tier_dir.glob("r*.kvd"))

            tier_dir.chmod(0o000)
            for f in tier_dir.glob("r*.kvd"):
                f.chmod(0o000)
            as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            assert subprocess.run([*as_nobody, "ls", str(tier_dir)], capture_output=True).returncode != 0
            errors = disk_stats(client).errors
            hits = disk_stats(client).hits
            # What the disk holds (RAM kept only the last ~100) is read through the files it has open.
            keys = [k for k, _ in held[:40]]
            assert [bytes(g) for g in client.get_many(NS, keys)] == [b for _, b in held[:40]]
            assert disk_stats(client).hits > hits
            # New blocks need region files the server cannot make: refused on disk, counted, kept in RAM.
            more = blocks(300, 20_000)  # 6 MB: more than the open regions' room
            refused = 0
            for i in range(0, 300, 10):
                result = client.put_many(NS, more[i : i + 10])
                assert result.stored == 10  # RAM took them
                refused += 10 - result.tier("disk").stored
            assert refused > 0 and disk_stats(client).errors > errors
            got = client.get_many(NS, [k for k, _ in more])
            assert all(g is None or bytes(g) == b for g, (_, b) in zip(got, more, strict=True))
            assert client.corrupt_blocks == 0 and proc.proc.poll() is None
            # Each refusal was the tier's own (EACCES, counted), not its breaker's: a refused file is
            # no dead device, so nothing was skipped and reads go on (the regions it could still reuse
            # took the new blocks, evicting the oldest, as a full disk's would).
            disk = disk_stats(client)
            assert (disk.breaker, disk.skipped) == ("closed", 0), disk
            on_disk = [k for k, _ in held[40:60]]  # RAM holds only the newest: these come from disk, or miss
            for key, got in zip(on_disk, client.get_many(NS, on_disk), strict=True):
                assert got is None or bytes(got) == dict(held)[key]

            # Readable again: new region files are made and blocks stored on disk again.
            tier_dir.chmod(0o700)
            for f in tier_dir.glob("r*.kvd"):
                f.chmod(0o600)
            # The next region file the tier needs is made again (one sealed by a refused write, when
            # it is next reused).
            wait_for(lambda: client.put_many(NS, blocks(10, 20_000)).tier("disk").stored == 10, 60, "disk writes")
            assert len(list(tier_dir.glob("r*.kvd"))) > len(made)
            print(f"unreadable directory: {refused} of 300 disk writes refused, errors {disk_stats(client).errors}")
    finally:
        proc.stop()
