"""The disk tier's on-disk layout: region files of append-only records, and the scan that rebuilds the index.

A region is one file, `r<id>.kvd`, of at most `region_bytes`. It is written front to back by one
writer thread at a time and never rewritten in place, except (a) its header, when the region is
evicted whole and reused, (b) the 4-byte magic of a record that is deleted, and (c) the 4-byte magic
that commits a run of appended records.

    region file
    0                64
    | region header  | record | record | record | ... | frontier: the rest is old or unwritten
                     ^ records start here, each 8-byte aligned

    region header (64 bytes, little-endian)
    0       4       8               16
    | KVDG  | crc32 | epoch (u64)   | region_bytes (u64) | zero ... |
      crc32 covers bytes 8..24

    record
    0       4       8               16          20      22      24               40           40+nslen
    | magic | crc32 | epoch (u64)   | len (u32) | nslen | 0     | key (16 bytes) | namespace  | pad | block |
      magic: KVDR (live) or KVDX (deleted); crc32 covers bytes 8..40+nslen, not the magic, so
      deleting is one aligned 4-byte write that cannot tear. The block follows the header at the
      next 8-byte boundary; the next record starts at the next 8-byte boundary after the block.

Why each rule holds what it must through a crash (SIGKILL, or power loss without fsync):

- Records are appended in runs (group commit, by the one thread that owns the region): one pwritev
  of the whole run with the first record's magic zeroed, then one aligned 4-byte pwrite of that
  magic. Until the second write lands the scan stops at the run's first record; once it has, the
  run's bytes are all in the page cache. So a valid header implies its block is there too.
  After a power loss the order is not guaranteed; the block's own key-bound checksum
  (docs/format.md), verified by the stack on every read, then turns a torn block into a miss.
- A region's records are appended by one thread, so everything before a valid header was
  written before it: the scan stops at the first record that is not valid (bad magic, crc,
  epoch, or length) and loses nothing acknowledged in front of it.
- Each reuse of a region gets a new epoch (a global counter), written in its header before any
  of its new records; records of an older epoch left behind the new frontier are rejected, so
  an evicted or deleted block never comes back from the tail of a reused region.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

REGION_MAGIC = b"KVDG"
RECORD_MAGIC = b"KVDR"
DELETED_MAGIC = b"KVDX"

REGION_HEADER = struct.Struct("<4sIQQ")  # magic, crc32, epoch, region_bytes
REGION_HEADER_BYTES = 64
RECORD = struct.Struct("<4sIQIHH16s")  # magic, crc32, epoch, length, nslen, reserved, key
ALIGN = 8
MAX_NAMESPACE_BYTES = 1024


def aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def header_len(nslen: int) -> int:
    """Bytes from a record's start to its block."""
    return aligned(RECORD.size + nslen)


def record_span(nslen: int, length: int) -> int:
    """Bytes a record takes in its region, padding included."""
    return header_len(nslen) + aligned(length)


def pack_region_header(epoch: int, region_bytes: int) -> bytes:
    body = struct.pack("<QQ", epoch, region_bytes)
    head = REGION_HEADER.pack(REGION_MAGIC, zlib.crc32(body), epoch, region_bytes)
    return head.ljust(REGION_HEADER_BYTES, b"\0")


def parse_region_header(data: bytes, region_bytes: int) -> int | None:
    """The region's epoch, or None when the header is not valid for regions of `region_bytes`."""
    if len(data) < REGION_HEADER.size:
        return None
    magic, crc, epoch, size = REGION_HEADER.unpack_from(data)
    if magic != REGION_MAGIC or crc != zlib.crc32(data[8 : REGION_HEADER.size]) or size != region_bytes:
        return None
    return epoch


def pack_record_header(epoch: int, namespace: bytes, key: bytes, length: int) -> bytes:
    """The header of a record (padded to where its block starts)."""
    body = RECORD.pack(RECORD_MAGIC, 0, epoch, length, len(namespace), 0, key)[8:] + namespace
    head = RECORD_MAGIC + struct.pack("<I", zlib.crc32(body)) + body
    return head.ljust(header_len(len(namespace)), b"\0")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    live: bool  # False: deleted (magic KVDX)
    epoch: int
    length: int
    key: bytes
    namespace: bytes

    @property
    def span(self) -> int:
        return record_span(len(self.namespace), self.length)


def parse_record_header(data: bytes | memoryview) -> RecordHeader | None:
    """The record header at the start of `data` (which must hold it all), or None when it is not one."""
    if len(data) < RECORD.size:
        return None
    magic, crc, epoch, length, nslen, _, key = RECORD.unpack_from(data)
    if magic not in (RECORD_MAGIC, DELETED_MAGIC) or nslen > MAX_NAMESPACE_BYTES or len(data) < RECORD.size + nslen:
        return None
    if crc != zlib.crc32(data[8 : RECORD.size + nslen]):
        return None
    return RecordHeader(
        magic == RECORD_MAGIC, epoch, length, bytes(key), bytes(data[RECORD.size : RECORD.size + nslen])
    )


ScannedRecord = tuple[int, bool, int, bytes, bytes, int]
"""(offset, live (False: deleted, magic KVDX), block length, key, namespace, span): plain tuples, as a
scan makes one per block (a million of them in seconds)."""


_SCAN_CHUNK = 4 << 20


def scan_region(path: str, region_bytes: int) -> tuple[int | None, list[ScannedRecord], int]:
    """Reads a region file's records: (its epoch or None when its header is not valid, the records
    of that epoch in order, deleted ones included, and the offset where the valid records end).

    Reads 4 MiB at a time and parses the headers in place: small records cost no syscall each,
    large ones are skipped by reading again past their blocks (which are not read: the stack
    verifies a block when it is served).
    """
    with open(path, "rb", buffering=0) as f:
        epoch = parse_region_header(f.read(REGION_HEADER_BYTES), region_bytes)
        if epoch is None:
            return None, [], REGION_HEADER_BYTES
        records: list[ScannedRecord] = []
        buf, base, eof = b"", 0, False  # buf holds the file from offset `base`
        offset = REGION_HEADER_BYTES
        fixed = RECORD.size
        while offset + fixed <= region_bytes:
            rel = offset - base
            if rel < 0 or (rel + fixed + MAX_NAMESPACE_BYTES > len(buf) and not eof) or rel + fixed > len(buf):
                f.seek(offset)
                buf = f.read(_SCAN_CHUNK)
                base, rel, eof = offset, 0, len(buf) < _SCAN_CHUNK
                if len(buf) < fixed:
                    break
            magic, crc, rec_epoch, length, nslen, _, key = RECORD.unpack_from(buf, rel)
            end = rel + fixed + nslen
            if magic not in (RECORD_MAGIC, DELETED_MAGIC) or nslen > MAX_NAMESPACE_BYTES or end > len(buf):
                break
            if rec_epoch != epoch or crc != zlib.crc32(memoryview(buf)[rel + 8 : end]):
                break
            span = ((fixed + nslen + 7) & ~7) + ((length + 7) & ~7)  # record_span, inline: once per block
            if offset + span > region_bytes:
                break
            records.append((offset, magic == RECORD_MAGIC, length, key, buf[rel + fixed : end], span))
            offset += span
    return epoch, records, offset
