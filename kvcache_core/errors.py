"""The contract's exceptions: what bytes that break the block format or the wire encoding raise.

    KVCacheError
    ├── BlockFormatError (also ValueError)    bytes that are not a valid block
    │   ├── UnknownFormatVersion
    │   └── ChecksumMismatch                  (also: a block presented under another key)
    └── WireError (also ValueError)           bytes that are not a valid protobuf message

The SDK adds its RPC errors under the same base (kvcache_client.errors).
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error kvcache's packages raise."""


class BlockFormatError(KVCacheError, ValueError):
    """Bytes that do not parse as a block (docs/format.md)."""


class UnknownFormatVersion(BlockFormatError):
    """A block header with a format version this code does not know."""


class ChecksumMismatch(BlockFormatError):
    """A block whose bytes do not match its header's checksum, or that belongs to another key."""


class WireError(KVCacheError, ValueError):
    """Bytes that are not a valid encoding of the expected protobuf message."""
