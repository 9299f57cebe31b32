"""Re-exports kvcache_core.format (the contract now lives in kvcache_core; this import path keeps working)."""

from kvcache_core.format import (  # noqa: F401
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
