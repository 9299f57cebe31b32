"""Re-exports kvcache_core.format (the contract now lives in kvcache_core; this import path keeps working).

``__all__`` makes the re-export explicit, so strict type checkers (mypy ``--strict``, pyright) accept
``from kvcache_client.format import DType``; without it they treat these names as private imports.
"""

from kvcache_core.format import (
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    BlockHeader,
    BlockParts,
    Compression,
    DType,
    Layout,
    compute_checksum,
    decode_block,
    encode_block,
    encode_block_parts,
    parse_header,
    payload_view,
    verify_block,
)

__all__ = [
    "FIXED_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_NDIM",
    "BlockHeader",
    "BlockParts",
    "Compression",
    "DType",
    "Layout",
    "compute_checksum",
    "decode_block",
    "encode_block",
    "encode_block_parts",
    "parse_header",
    "payload_view",
    "verify_block",
]
