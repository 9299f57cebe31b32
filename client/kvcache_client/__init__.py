"""The kvcache SDK: chunk keys, the block format, and sync/asyncio clients.

Importing this package never imports torch; the tensor helpers load it on first use.
"""

from kvcache_client.aio import AsyncKVCacheClient
from kvcache_client.client import KVCacheClient, LookupResult, PutResult
from kvcache_client.connection import TLSConfig
from kvcache_client.errors import (
    BlockFormatError,
    ChecksumMismatch,
    DataCorrupted,
    DeadlineExceeded,
    InvalidRequest,
    KVCacheError,
    PermissionDenied,
    ResourceExhausted,
    RPCError,
    Unauthenticated,
    Unavailable,
    UnknownFormatVersion,
)
from kvcache_client.results import PrefetchResult
from kvcache_client.retry import RetryPolicy
from kvcache_core.format import DType, Layout, decode_block, encode_block, encode_block_parts
from kvcache_core.keys import Namespace, chunk_keys

__all__ = [
    "AsyncKVCacheClient",
    "BlockFormatError",
    "ChecksumMismatch",
    "DType",
    "DataCorrupted",
    "DeadlineExceeded",
    "InvalidRequest",
    "KVCacheClient",
    "KVCacheError",
    "Layout",
    "LookupResult",
    "Namespace",
    "PermissionDenied",
    "PrefetchResult",
    "PutResult",
    "RPCError",
    "ResourceExhausted",
    "RetryPolicy",
    "TLSConfig",
    "Unauthenticated",
    "Unavailable",
    "UnknownFormatVersion",
    "chunk_keys",
    "decode_block",
    "encode_block",
    "encode_block_parts",
]
