"""Re-exports kvcache_core.keys (the contract now lives in kvcache_core; this import path keeps working)."""

from kvcache_core.keys import (  # noqa: F401
    CANONICAL_LAYOUT,
    KEY_BYTES,
    LAYOUT_VERSION,
    MLA_LAYOUT,
    Namespace,
    chunk_key,
    chunk_keys,
    validate_key,
)
