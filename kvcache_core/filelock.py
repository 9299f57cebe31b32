"""A live server's mark on the files it shares (its block arena, its presence index): how a reader
on the same host tells a live server's file from a dead one's.

The server holds two locks on each such file for its lifetime, both released by the kernel when its
process ends (however it ends): an exclusive flock, and an exclusive open-file-description (OFD)
record lock over the whole file. A reader asks about the second with F_OFD_GETLK: one fcntl call
that answers either way, where testing the flock means a failed LOCK_SH|LOCK_NB, an exception in
Python each time the server lives (the presence index's check, on every lookup answered from it,
took 25 us of a 200 us lookup-and-lock right after a store; this one a few). A file without the
record lock (a server from before it, or a kernel without OFD locks) is checked by its flock, as
before. Linux keeps flock and record locks apart (on a local file system: tmpfs here), so neither
check sees the other's lock.
"""

from __future__ import annotations

import fcntl
import os
import struct

_FLOCK = struct.Struct("@hhqqi4x")
"""struct flock on Linux x86-64 and aarch64: l_type, l_whence, l_start, l_len, l_pid (32 bytes)."""

_WHOLE_FILE_WRITE = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_PROBE_READ = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
_OFD_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)


def hold_record_lock(fd: int) -> bool:
    """Takes the exclusive OFD record lock over the whole file open as `fd` (writable), held until
    every descriptor of that open file is closed; False where the platform has no OFD locks or the
    lock is taken (readers then rely on the flock alone)."""
    if _OFD_SETLK is None:
        return False
    try:
        fcntl.fcntl(fd, _OFD_SETLK, _WHOLE_FILE_WRITE)
    except OSError:
        return False
    return True


def record_lock_held(fd: int) -> bool:
    """Whether another open file holds a write record lock on the file open as `fd` (any mode): True
    means its server lives. False is no answer: no such lock (a dead server, or one that never took
    it) or no OFD locks here; check the flock then."""
    if _OFD_GETLK is None:
        return False
    try:
        answer = fcntl.fcntl(fd, _OFD_GETLK, _PROBE_READ)
    except (OSError, ValueError):  # ValueError: fd -1 (the index unmapped by another thread meanwhile)
        return False
    return bool(_FLOCK.unpack(answer)[0] == fcntl.F_WRLCK)
