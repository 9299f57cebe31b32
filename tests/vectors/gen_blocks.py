"""Independent reference implementation of docs/format.md (version 2); writes tests/vectors/blocks.json.

Written from the specification alone: only `struct` and `xxhash.xxh3_64_intdigest`, and deliberately
no import of kvcache_core, so tests/test_format.py checks the implementation against a second one
(as tests/vectors/gen_keys.py does for the keys) and a client in another language can check itself
against the same vectors.

Run from anywhere:  python tests/vectors/gen_blocks.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from xxhash import xxh3_64_intdigest

OUT = Path(__file__).resolve().parent / "blocks.json"
ITEMSIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 1, 6: 1, 7: 8}  # docs/format.md, "dtype codes"


def block(key: bytes, dtype: int, layout: int, shape: tuple[int, ...], payload: bytes) -> bytes:
    """The uncompressed version-2 block of `payload` under `key`, byte by byte from the spec."""
    assert len(key) == 16
    raw_len = len(payload)
    n = 1
    for d in shape:
        n *= d
    assert n * ITEMSIZE[dtype] == raw_len
    descriptor = struct.pack("<BBB", dtype, layout, len(shape)) + struct.pack("<Q", raw_len)
    descriptor += b"".join(struct.pack("<Q", d) for d in shape)
    checksum = xxh3_64_intdigest(key + descriptor + payload, seed=0)
    header = b"KVCB" + struct.pack("<HH", 2, 40 + 8 * len(shape))
    header += struct.pack("<BBBB", dtype, layout, 0, len(shape)) + bytes(4)
    header += struct.pack("<QQQ", raw_len, raw_len, checksum)
    header += b"".join(struct.pack("<Q", d) for d in shape)
    return header + payload


CASES = [
    # (name, key, dtype, layout, shape, payload)
    ("docs worked example", bytes(range(16)), 2, 0, (2, 2), bytes.fromhex("003c00c000380042")),
    ("empty payload", b"\xff" * 16, 0, 0, (0,), b""),
    ("scalar shape", bytes(16), 4, 0, (), struct.pack("<f", 1.5)),
    ("canonical bf16", bytes(range(16, 32)), 3, 1, (1, 2, 1, 2, 2), bytes(range(16))),
    ("mla fp8", b"kvcache-mla-key!", 5, 2, (2, 3, 1), bytes([1, 2, 3, 4, 5, 6])),
    ("opaque bytes", b"0123456789abcdef", 0, 0, (11,), b"hello world"),
]


def main() -> None:
    vectors = []
    for name, key, dtype, layout, shape, payload in CASES:
        vectors.append(
            {
                "name": name,
                "key": key.hex(),
                "dtype": dtype,
                "layout": layout,
                "shape": list(shape),
                "payload": payload.hex(),
                "block": block(key, dtype, layout, shape, payload).hex(),
            }
        )
    OUT.write_text(json.dumps({"format_version": 2, "vectors": vectors}, indent=1) + "\n")
    print(f"wrote {len(vectors)} vectors to {OUT}")


if __name__ == "__main__":
    main()
