"""The bulk path's framing (docs/bulk.md): length-prefixed frames on a plain TCP (or TLS) stream.

Shared by the server (kvcache_server.bulk) and the SDK (kvcache_client.bulk). Every frame is a
16-byte header, then `length` payload bytes; all integers are little-endian:

    offset  size  field
    0       4     magic    b"KVB1"
    4       1     type     FrameType
    5       1     flags    0 (reserved; a receiver refuses anything else)
    6       2     reserved 0
    8       8     length   payload bytes that follow (u64)

Block bytes travel as the payload of DATA frames (puts) and GET_ITEM frames (gets), so a receiver
reads each block with recv_into straight into the buffer it reserved for it, and a sender passes
the frame header and the block's own memory to one sendmsg, without joining them.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

MAGIC = b"KVB1"
VERSION = 1
HEADER = struct.Struct("<4sBBHQ")
HEADER_BYTES = HEADER.size  # 16
KEY_BYTES = 16

_HELLO = struct.Struct("<HH")  # version, token length
_READY = struct.Struct("<QQI")  # max_frame_bytes, max_block_bytes, max_keys_per_request
_ERROR = struct.Struct("<I")  # gRPC status code, then the UTF-8 message
_NS = struct.Struct("<H")  # namespace length, then the namespace
_COUNT = struct.Struct("<I")
_PUT_ENTRY = struct.Struct("<16sQ")  # key, block length
_GET_FLAGS = struct.Struct("<B")
GET_ITEM = struct.Struct("<IB3x")  # index, tier, 3 reserved bytes; then the block
_PUT_DONE = struct.Struct("<IIQ")  # stored, rejected, bytes received
_GET_DONE = struct.Struct("<I")  # items sent

PREFIX_ONLY = 0x01
"""GET flag: stop at the first key that is not found."""


class FrameType(enum.IntEnum):
    HELLO = 0x01  # client -> server, first frame of a connection
    READY = 0x02  # server -> client, the answer to HELLO
    ERROR = 0x03  # server -> client, always the last frame before the server closes
    PUT = 0x10  # client -> server: namespace, then (key, length) per block
    DATA = 0x11  # client -> server: one block's bytes, one frame per PUT entry, in order
    PUT_DONE = 0x12  # server -> client: the PUT is committed
    GET = 0x20  # client -> server: namespace, flags, keys
    GET_ITEM = 0x21  # server -> client: one found block
    GET_DONE = 0x22  # server -> client: the GET is complete
    LEASE = 0x30  # client -> server, same host: namespace, flags, keys, lease ids to end first
    LEASED = 0x31  # server -> client: the arena, and each key's slot under a read lease
    RELEASE = 0x32  # client -> server: lease ids to end
    RELEASED = 0x33  # server -> client: how many of them were live
    LOOKUP = 0x40  # client -> server: namespace, the caller's time left, keys
    LOOKED_UP = 0x41  # server -> client: the stored prefix's length and each of its keys' tier
    PUT_MEM = 0x13  # client -> server, same host: namespace, a registered process, each block's head and range
    TOUCH = 0x50  # client -> server, same host: namespace, keys read out of the arena (counted as read)
    TOUCHED = 0x51  # server -> client: how many keys the TOUCH named


class FrameError(Exception):
    """Bytes on the stream that break the framing; the connection is unusable after it.

    Attributes:
        code_name: The gRPC status name the server answers with (INVALID_ARGUMENT, RESOURCE_EXHAUSTED).
    """

    def __init__(self, message: str, code_name: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code_name = code_name


def header(kind: FrameType, length: int) -> bytes:
    return HEADER.pack(MAGIC, kind, 0, 0, length)


def parse_header(raw: bytes | bytearray | memoryview, max_length: int) -> tuple[FrameType, int]:
    """A frame header's type and payload length.

    Raises:
        FrameError: bad magic, unknown type, non-zero reserved bits, or a length over `max_length`
            (RESOURCE_EXHAUSTED).
    """
    magic, kind, flags, reserved, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"not a bulk frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    try:
        frame_type = FrameType(kind)
    except ValueError:
        raise FrameError(f"unknown frame type 0x{kind:02x}") from None
    if flags or reserved:
        raise FrameError(f"{frame_type.name} frame: reserved header bits set")
    if length > max_length:
        raise FrameError(
            f"{frame_type.name} frame of {length} bytes exceeds the limit of {max_length}", "RESOURCE_EXHAUSTED"
        )
    return frame_type, length


# -- payloads ----------------------------------------------------------------------------------


def hello(token: str) -> bytes:
    raw = token.encode("utf-8")
    return _HELLO.pack(VERSION, len(raw)) + raw


def parse_hello(payload: bytes) -> tuple[int, str]:
    """(version, token). Raises FrameError when malformed."""
    if len(payload) < _HELLO.size:
        raise FrameError("HELLO frame too short")
    version, n = _HELLO.unpack_from(payload)
    if len(payload) != _HELLO.size + n:
        raise FrameError("HELLO frame's token length disagrees with the frame's length")
    try:
        return version, payload[_HELLO.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("HELLO token is not UTF-8") from None


@dataclass(frozen=True, slots=True)
class Ready:
    max_frame_bytes: int
    max_block_bytes: int
    max_keys_per_request: int


def ready(r: Ready) -> bytes:
    return _READY.pack(r.max_frame_bytes, r.max_block_bytes, r.max_keys_per_request)


def parse_ready(payload: bytes) -> Ready:
    if len(payload) != _READY.size:
        raise FrameError("READY frame has the wrong length")
    return Ready(*_READY.unpack(payload))


def error(code: int, message: str) -> bytes:
    return _ERROR.pack(code) + message.encode("utf-8")[:4096]


def parse_error(payload: bytes) -> tuple[int, str]:
    if len(payload) < _ERROR.size:
        raise FrameError("ERROR frame too short")
    (code,) = _ERROR.unpack_from(payload)
    return code, payload[_ERROR.size :].decode("utf-8", "replace")


def _namespace(namespace: str) -> bytes:
    raw = namespace.encode("utf-8")
    return _NS.pack(len(raw)) + raw


def _read_namespace(payload: bytes, what: str) -> tuple[str, int]:
    if len(payload) < _NS.size:
        raise FrameError(f"{what} frame too short")
    (n,) = _NS.unpack_from(payload)
    end = _NS.size + n
    if len(payload) < end:
        raise FrameError(f"{what} frame's namespace runs past its end")
    try:
        return payload[_NS.size : end].decode("utf-8"), end
    except UnicodeDecodeError:
        raise FrameError(f"{what} namespace is not UTF-8") from None


def put(namespace: str, entries: Sequence[tuple[bytes, int]]) -> bytes:
    parts = [_namespace(namespace), _COUNT.pack(len(entries))]
    parts += [_PUT_ENTRY.pack(key, n) for key, n in entries]
    return b"".join(parts)


def parse_put(payload: bytes) -> tuple[str, list[tuple[bytes, int]]]:
    """(namespace, [(key, length)]). Raises FrameError when the counts disagree with the frame's length."""
    namespace, at = _read_namespace(payload, "PUT")
    if len(payload) < at + _COUNT.size:
        raise FrameError("PUT frame too short")
    (count,) = _COUNT.unpack_from(payload, at)
    at += _COUNT.size
    if len(payload) != at + count * _PUT_ENTRY.size:
        raise FrameError(f"PUT frame announces {count} blocks but its length disagrees")
    return namespace, [_PUT_ENTRY.unpack_from(payload, at + i * _PUT_ENTRY.size) for i in range(count)]


_PUT_MEM_ENTRY = struct.Struct("<16sIQQQ")  # key, head length, address, range length, seal_before_ns
PUT_MEM_ENTRY_BYTES = _PUT_MEM_ENTRY.size
"""What each block adds to a PUT_MEM frame, besides its head."""
_NAME_LEN = struct.Struct("<B")
MAX_HEAD_BYTES = 64 << 10
"""The most bytes of a PUT_MEM block sent inline before its range (a header), as Block.data beside
Block.shm in a gRPC Put (kvcache_core.blockwire)."""


def put_mem(namespace: str, process: str, blocks: Sequence[tuple[bytes, int, int, int, bytes]]) -> bytes:
    """A PUT_MEM frame's payload: `process` the name the server gave the client's registration
    (docs/shm.md, "Puts out of the client's memory"), then per block (key, address, length,
    seal_before_ns, head): its head sent inline, then `length` bytes at `address` in the client's
    memory, which the server reads itself; seal_before_ns nonzero: the server computes the checksum."""
    name = process.encode("ascii")
    parts = [_namespace(namespace), _NAME_LEN.pack(len(name)), name, _COUNT.pack(len(blocks))]
    for key, address, length, seal_before_ns, head in blocks:
        parts += [_PUT_MEM_ENTRY.pack(key, len(head), address, length, seal_before_ns), head]
    return b"".join(parts)


def parse_put_mem(payload: bytes) -> tuple[str, str, list[tuple[bytes, int, int, int, bytes]]]:
    """(namespace, process, [(key, address, length, seal_before_ns, head)]). Raises FrameError when
    malformed (a head over MAX_HEAD_BYTES included)."""
    namespace, at = _read_namespace(payload, "PUT_MEM")
    if len(payload) < at + 1:
        raise FrameError("PUT_MEM frame too short")
    (n,) = _NAME_LEN.unpack_from(payload, at)
    at += 1
    try:
        process = payload[at : at + n].decode("ascii")
    except UnicodeDecodeError:
        raise FrameError("PUT_MEM process name is not ASCII") from None
    at += n
    if len(process) != n or len(payload) < at + _COUNT.size:
        raise FrameError("PUT_MEM frame too short")
    (count,) = _COUNT.unpack_from(payload, at)
    at += _COUNT.size
    blocks: list[tuple[bytes, int, int, int, bytes]] = []
    for i in range(count):
        if len(payload) < at + _PUT_MEM_ENTRY.size:
            raise FrameError(f"PUT_MEM frame announces {count} blocks but ends in block {i}")
        key, head_len, address, length, seal_before_ns = _PUT_MEM_ENTRY.unpack_from(payload, at)
        at += _PUT_MEM_ENTRY.size
        if head_len > MAX_HEAD_BYTES:
            raise FrameError(f"PUT_MEM block {i}: a head of {head_len} bytes; at most {MAX_HEAD_BYTES}")
        if len(payload) < at + head_len:
            raise FrameError(f"PUT_MEM frame announces {count} blocks but ends in block {i}")
        blocks.append((key, address, length, seal_before_ns, bytes(payload[at : at + head_len])))
        at += head_len
    if at != len(payload):
        raise FrameError(f"PUT_MEM frame announces {count} blocks but its length disagrees")
    return namespace, process, blocks


def get(namespace: str, keys: Sequence[bytes], prefix_only: bool) -> bytes:
    flags = PREFIX_ONLY if prefix_only else 0
    return b"".join([_namespace(namespace), _GET_FLAGS.pack(flags), _COUNT.pack(len(keys)), *keys])


def parse_get(payload: bytes) -> tuple[str, bool, list[bytes]]:
    """(namespace, prefix_only, keys). Raises FrameError when malformed."""
    namespace, at = _read_namespace(payload, "GET")
    if len(payload) < at + _GET_FLAGS.size + _COUNT.size:
        raise FrameError("GET frame too short")
    (flags,) = _GET_FLAGS.unpack_from(payload, at)
    if flags & ~PREFIX_ONLY:
        raise FrameError(f"GET flags 0x{flags:02x}: unknown bits")
    (count,) = _COUNT.unpack_from(payload, at + 1)
    at += _GET_FLAGS.size + _COUNT.size
    if len(payload) != at + count * KEY_BYTES:
        raise FrameError(f"GET frame announces {count} keys but its length disagrees")
    return (
        namespace,
        bool(flags & PREFIX_ONLY),
        [payload[at + i * KEY_BYTES : at + (i + 1) * KEY_BYTES] for i in range(count)],
    )


_ID = struct.Struct("<Q")
_LEASED = struct.Struct("<dH")  # expires_in_s, arena path length; then the path, a count, the slots
SLOT = struct.Struct("<QQQ")  # lease id, offset, length (all 0: a miss)
MAX_IDS = 65536
"""Lease ids one LEASE or RELEASE frame may name (as LeaseRelease over gRPC)."""


def _ids(ids: Sequence[int]) -> bytes:
    return _COUNT.pack(len(ids)) + struct.pack(f"<{len(ids)}Q", *ids)


def _read_ids(payload: bytes, at: int, what: str) -> list[int]:
    if len(payload) < at + _COUNT.size:
        raise FrameError(f"{what} frame too short")
    (count,) = _COUNT.unpack_from(payload, at)
    at += _COUNT.size
    if count > MAX_IDS:
        raise FrameError(f"{what} frame names {count} lease ids, more than {MAX_IDS}")
    if len(payload) != at + count * _ID.size:
        raise FrameError(f"{what} frame announces {count} lease ids but its length disagrees")
    return list(struct.unpack_from(f"<{count}Q", payload, at))


def lease(namespace: str, keys: Sequence[bytes], prefix_only: bool, releases: Sequence[int] = ()) -> bytes:
    """A LEASE payload: a GET's, then the ids of leases to end before these are granted."""
    return get(namespace, keys, prefix_only) + _ids(releases)


def parse_lease(payload: bytes) -> tuple[str, bool, list[bytes], list[int]]:
    """(namespace, prefix_only, keys, lease ids to end). Raises FrameError when malformed."""
    namespace, at = _read_namespace(payload, "LEASE")
    if len(payload) < at + _GET_FLAGS.size + _COUNT.size:
        raise FrameError("LEASE frame too short")
    (count,) = _COUNT.unpack_from(payload, at + 1)
    end = at + _GET_FLAGS.size + _COUNT.size + count * KEY_BYTES
    if len(payload) < end:
        raise FrameError(f"LEASE frame announces {count} keys but is shorter")
    _, prefix_only, keys = parse_get(payload[:end])
    return namespace, prefix_only, keys, _read_ids(payload, end, "LEASE")


def leased(expires_in_s: float, arena_path: str, slots: Sequence[tuple[int, int, int]]) -> bytes:
    raw = arena_path.encode("utf-8")
    flat = [x for slot in slots for x in slot]
    return _LEASED.pack(expires_in_s, len(raw)) + raw + _COUNT.pack(len(slots)) + struct.pack(f"<{len(flat)}Q", *flat)


def parse_leased(payload: bytes) -> tuple[float, str, list[tuple[int, int, int]]]:
    """(expires_in_s, arena path, (id, offset, length) per key). Raises FrameError when malformed."""
    if len(payload) < _LEASED.size:
        raise FrameError("LEASED frame too short")
    expires_in_s, n = _LEASED.unpack_from(payload)
    at = _LEASED.size + n
    if len(payload) < at + _COUNT.size:
        raise FrameError("LEASED frame too short")
    (count,) = _COUNT.unpack_from(payload, at)
    at += _COUNT.size
    if len(payload) != at + count * SLOT.size:
        raise FrameError(f"LEASED frame announces {count} slots but its length disagrees")
    try:
        path = payload[_LEASED.size : _LEASED.size + n].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError("LEASED arena path is not UTF-8") from None
    return expires_in_s, path, [SLOT.unpack_from(payload, at + i * SLOT.size) for i in range(count)]


def release(ids: Sequence[int]) -> bytes:
    return _ids(ids)


def parse_release(payload: bytes) -> list[int]:
    return _read_ids(payload, 0, "RELEASE")


def released(n: int) -> bytes:
    return _COUNT.pack(n)


def parse_released(payload: bytes) -> int:
    if len(payload) != _COUNT.size:
        raise FrameError("RELEASED frame has the wrong length")
    return _COUNT.unpack(payload)[0]


_TIER = struct.Struct("<B3xIIIII")  # tier kind, 3 reserved, stored, queued, dropped, failed, deleted


@dataclass(frozen=True, slots=True)
class PutDone:
    """A committed PUT: blocks stored, rejected, bytes received, and per tier (RAM first) what it took:
    (tier kind as kvcache.v1.Tier, stored, queued, dropped, failed, deleted)."""

    stored: int
    rejected: int
    received: int
    tiers: tuple[tuple[int, int, int, int, int, int], ...] = ()


def put_done(done: PutDone) -> bytes:
    head = _PUT_DONE.pack(done.stored, done.rejected, done.received) + bytes([len(done.tiers)])
    return head + b"".join(_TIER.pack(*t) for t in done.tiers)


def parse_put_done(payload: bytes) -> PutDone:
    if len(payload) < _PUT_DONE.size + 1 or len(payload) != _PUT_DONE.size + 1 + payload[_PUT_DONE.size] * _TIER.size:
        raise FrameError("PUT_DONE frame has the wrong length")
    stored, rejected, received = _PUT_DONE.unpack_from(payload)
    at = _PUT_DONE.size + 1
    tiers = tuple(_TIER.unpack_from(payload, at + i * _TIER.size) for i in range(payload[_PUT_DONE.size]))
    return PutDone(stored, rejected, received, tiers)


def get_done(sent: int) -> bytes:
    return _GET_DONE.pack(sent)


def parse_get_done(payload: bytes) -> int:
    if len(payload) != _GET_DONE.size:
        raise FrameError("GET_DONE frame has the wrong length")
    return _GET_DONE.unpack(payload)[0]


_LOOKUP = struct.Struct("<II")  # the caller's time left in ms (0: none given), key count; then the keys


def lookup(namespace: str, keys: Sequence[bytes], timeout_ms: int) -> bytes:
    """A LOOKUP payload; `timeout_ms` bounds how long the server waits for lower tiers (0: its own limits)."""
    return b"".join([_namespace(namespace), _LOOKUP.pack(min(max(timeout_ms, 0), 0xFFFFFFFF), len(keys)), *keys])


def parse_lookup(payload: bytes) -> tuple[str, int, list[bytes]]:
    """(namespace, timeout_ms, keys). Raises FrameError when malformed."""
    namespace, at = _read_namespace(payload, "LOOKUP")
    if len(payload) < at + _LOOKUP.size:
        raise FrameError("LOOKUP frame too short")
    timeout_ms, count = _LOOKUP.unpack_from(payload, at)
    at += _LOOKUP.size
    if len(payload) != at + count * KEY_BYTES:
        raise FrameError(f"LOOKUP frame announces {count} keys but its length disagrees")
    return namespace, timeout_ms, [payload[at + i * KEY_BYTES : at + (i + 1) * KEY_BYTES] for i in range(count)]


def looked_up(tiers: Sequence[int]) -> bytes:
    """A LOOKED_UP payload: the prefix's length, then one tier kind (kvcache.v1.Tier) byte per key of it."""
    return _COUNT.pack(len(tiers)) + bytes(tiers)


def parse_looked_up(payload: bytes) -> list[int]:
    if len(payload) < _COUNT.size:
        raise FrameError("LOOKED_UP frame too short")
    (n,) = _COUNT.unpack_from(payload)
    if len(payload) != _COUNT.size + n:
        raise FrameError(f"LOOKED_UP frame announces {n} tiers but its length disagrees")
    return list(payload[_COUNT.size :])


def touch(namespace: str, keys: Sequence[bytes]) -> bytes:
    """A TOUCH payload: the keys a same-host client read straight out of the arena (the server counts
    them as read: hits, most recently used). Only to a server whose presence index has FLAG_LOCATIONS."""
    return b"".join([_namespace(namespace), _COUNT.pack(len(keys)), *keys])


def parse_touch(payload: bytes) -> tuple[str, list[bytes]]:
    """(namespace, keys). Raises FrameError when malformed."""
    namespace, at = _read_namespace(payload, "TOUCH")
    if len(payload) < at + _COUNT.size:
        raise FrameError("TOUCH frame too short")
    (count,) = _COUNT.unpack_from(payload, at)
    at += _COUNT.size
    if len(payload) != at + count * KEY_BYTES:
        raise FrameError(f"TOUCH frame announces {count} keys but its length disagrees")
    return namespace, [payload[at + i * KEY_BYTES : at + (i + 1) * KEY_BYTES] for i in range(count)]


def touched(count: int) -> bytes:
    return _COUNT.pack(count)


def parse_touched(payload: bytes) -> int:
    if len(payload) != _COUNT.size:
        raise FrameError("TOUCHED frame has the wrong length")
    return _COUNT.unpack(payload)[0]


def control_limit(max_keys: int) -> int:
    """The largest PUT, GET or LEASE frame a request of `max_keys` keys needs (namespace up to 64
    KiB; a LEASE's lease ids to end, MAX_IDS at most)."""
    return _NS.size + 0xFFFF + _GET_FLAGS.size + _COUNT.size + max_keys * _PUT_ENTRY.size + _COUNT.size + MAX_IDS * 8


# -- socket I/O --------------------------------------------------------------------------------


class PeerClosed(ConnectionError):
    """The peer closed the stream before a frame was complete (or, with `clean`, between frames)."""

    def __init__(self, message: str, clean: bool = False) -> None:
        super().__init__(message)
        self.clean = clean


_IOV_MAX = 512


def as_bytes_view(data: object) -> memoryview:
    """A flat byte view of a buffer (numpy arrays and tensors' buffers included), without a copy."""
    view = data if isinstance(data, memoryview) else memoryview(data)  # type: ignore[arg-type]
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fills `view` from `sock` with recv_into (no intermediate copy).

    Raises:
        PeerClosed: the stream ended first (`clean` when it ended before the first byte).
        TimeoutError: the socket's timeout passed with no bytes.
    """
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise PeerClosed(f"connection closed after {got} of {n} bytes of {what}", clean=got == 0)
        got += r


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Sends every buffer in order: one sendmsg for many (no join), sendall on TLS sockets."""
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
    pending = [as_bytes_view(b) for b in buffers if len(b)]
    while pending:
        drop_sent(pending, sock.sendmsg(pending[:_IOV_MAX]))


def drop_sent(pending: list[memoryview], sent: int) -> None:
    """Removes the first `sent` bytes (at most all there are) from the buffers still to send: those
    sent whole, and the sent head of the next. Its ends found in C (a put of 16 small blocks is 50
    buffers: a pop(0) each cost the client more than its sendmsg's bookkeeping)."""
    if not sent:
        return
    ends = list(accumulate(map(len, pending)))
    whole = bisect_right(ends, sent)
    rest = sent - ends[whole - 1] if whole else sent
    del pending[:whole]
    if rest and pending:
        pending[0] = pending[0][rest:]
